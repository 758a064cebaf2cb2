"""Delivering alert notifications for every configured notifier, whatever its kind.

Every notifier has its own worker thread, so a slow or dead receiver delays only its own queue:
never another receiver, the alert evaluation or a refresh. Each delivery has one deadline for
the whole exchange (`post.post_json`, `smtp.send`), and a redirect is a failure, never followed.

The dispatcher never looks at a notifier's kind: it asks the registry (`registry.kind`). A kind
that is resent (Alertmanager) gets every active alert from its worker each `every` seconds, and
at once when alert states change. The others get one message per rule and state change (the
engine groups the alerts that changed together; a message shows a capped list and says how many
more), taken in order from the SQLite outbox; a failed delivery stays at the head of its
notifier's queue and is retried with backoff, across restarts. A notification is marked
delivered right after the receiver's 2xx, so nothing is sent twice for one state change as far
as that 2xx tells (for email: the SMTP server's answer to the message; every attempt at one
notification has the same Message-ID, as a webhook's has the same `notificationId`). A
notification the receiver refuses outright (an HTTP 3xx or 4xx, an SMTP 5xx) is dropped after
GIVE_UP_AFTER refusals in a row; other failures are retried until they succeed, no sooner than a
429's or a 503's `Retry-After` asks.
"""

from __future__ import annotations

import contextlib
import http.client
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, TypeVar
from urllib.parse import urlsplit

from exporter import __version__
from exporter.alerts.alert import Alert
from exporter.config.schema import NotifierConfig
from exporter.core.clock import Clock
from exporter.core.logs import get_logger
from exporter.core.net import network_cause
from exporter.core.post import DeadlineExceeded, post_json
from exporter.model.events import GroupEvent
from exporter.notifiers.kind import Attempt, OutboxKind
from exporter.notifiers.registry import kind, outbox
from exporter.state import AlertStore, OutboxEntry, StateError
from exporter.state.alerts import NO_DIGESTS, REMOVED, UnreadableEntry

log = get_logger(__name__)

DEADLINE = 10.0
"""The longest one delivery may take, connection to last byte of the answer."""
POLL = 2.0
"""How often a worker looks at its queue when nothing wakes it (retries fall due)."""
BACKOFF_FIRST = 5.0
BACKOFF_MAX = 300.0
GIVE_UP_AFTER = 5
"""Refusals in a row after which a notification the receiver refuses outright (a 3xx, a 4xx but
408/429, an SMTP 5xx to its sender, recipients or data) is dropped, so one bad message cannot
block its notifier's queue for ever. (Counted in memory: the tries a receiver that was down
failed do not count, nor those before a restart.)"""
JUDGED_WAIT = 120.0
"""Seconds after the start the kinds that are resent wait at most for the alerts to be judged on
fresh figures (`judged`), then send what the state file holds: Alertmanager's copies of what the
process sent before it stopped end 4 minutes after that send."""
WAIT_ASKED_MAX = 3600.0
"""The longest a receiver's `Retry-After` (on a 429 or a 503) holds its queue back."""

USER_AGENT = f"inference-cost-exporter/{__version__}"
T = TypeVar("T")

OWED = "the email recipients still owed it refused it for a day"
OWED_FOR = 86400.0
"""How long a notification is retried to email recipients who refuse it for now (4xx) while the
others took it: a full mailbox is not held against the rest of the queue, nor retried for ever."""
SUPERSEDED = "its alerts changed state again before it could be delivered"
UNREADABLE = "it could not be read from the state file"
DISCARDED = ("notifier_removed", "superseded", "refused", "unreadable")
"""Why a queued notification is never delivered: its notifier left the config (`configure`; for a
digest, `digest.notifiers`), every alert in it changed state again meanwhile (`_current`), its
receiver refused it outright `GIVE_UP_AFTER` times in a row (or the email recipients still owed it
refused it for `OWED_FOR`), or its row in the state file cannot be read (`UnreadableEntry`)."""


def _backoff(attempts: int) -> float:
    """The wait before the next try of a notification tried `attempts` times: doubling from
    BACKOFF_FIRST up to BACKOFF_MAX, jittered. (The exponent is capped: a receiver down for days
    leaves thousands of tries behind a row, and 2 ** 1024 is no float.)"""
    return min(BACKOFF_MAX, BACKOFF_FIRST * float(2 ** min(attempts, 16))) * random.uniform(0.8, 1.2)


def _where(location: str | None) -> str:
    """Where a redirect points, as a reason may name it: its scheme and host, never its path or
    query (a webhook's token moves with it, to https or another host)."""
    if not location:
        return "nowhere"
    parts = urlsplit(location)
    if not parts.netloc:
        return "another path on the same host"
    host = parts.netloc.rpartition("@")[2]
    return f"{parts.scheme}://{host}" if parts.scheme else host


def _refused(reason: str) -> bool:
    """A 3xx, or a 4xx other than 408 and 429; an SMTP server's 5xx to the message (`smtp.send`
    words only those so): the receiver will not take this message, however often it comes."""
    if reason.startswith("SMTP 5"):
        return True
    return reason.startswith(("HTTP 3", "HTTP 4")) and reason not in ("HTTP 408", "HTTP 429")


@dataclass
class _TakenUp:
    """A queued notification a worker has taken up (its table and id), and why a reload would have
    dropped it meanwhile (REMOVED, NO_DIGESTS), had the worker not had it: an alert's is dropped as
    its send fails though a later reload added its notifier back (whose queue starts empty); a
    digest's notifier that takes digests again keeps it to retry."""

    row: tuple[str, int]
    spared: str | None = None


class _Worker:
    """A notifier's own thread: wakes when poked or every `interval`, then runs `work`."""

    def __init__(self, name: str, work: Callable[[], object], interval: float) -> None:
        self.interval = interval
        self._work = work
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"notify-{name}", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def join(self, timeout: float) -> None:
        self._thread.join(max(0.0, timeout))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        paused = ""  # (the state file's error delivery is paused by: said once, and again when it changes)
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._work()
            except StateError as error:
                if str(error) != paused:
                    log.error("notification delivery paused", error=str(error))
                paused = str(error)
                continue
            except Exception:  # a bug must not stop delivery for good; it is logged with its traceback
                log.exception("notification delivery crashed")
                continue
            if paused:
                log.info("notification delivery resumed")
                paused = ""


def _fields(notifier: str, target: str) -> dict[str, Any]:
    """Log fields naming a notifier, and which of its URLs when it has several."""
    return {"notifier": notifier, "target": target} if target else {"notifier": notifier}


class Dispatcher:
    """Delivers for every configured notifier; one for the daemon's life, reconfigured on reload
    (a notifier keeps its queue, its worker and its counters while its name stays). It is the
    `kind.Delivery` its kinds send through."""

    def __init__(
        self,
        notifiers: Sequence[NotifierConfig],
        store: AlertStore,
        clock: Clock,
        alerts: Callable[[str], Sequence[Alert]],
        external_url: str,
        routed: Callable[[str], Sequence[str]] | None = None,
        digests_to: Callable[[], Collection[str] | None] | None = None,
        judged_first: bool = False,
    ) -> None:
        """`alerts`: the current alerts routed to the notifier named (what a kind that is resent sends).
        `routed`: the notifiers a rule's state changes go to now (a queued firing of a rule a reload
        routed elsewhere is not delivered); without it, a queued firing goes where it was queued.
        `digests_to`: the notifiers digests go to now (a queued digest of one a reload took out of
        `digest.notifiers` is not delivered); without it, or when it says None (a config without
        `digest` names none), a queued digest goes where it was queued. `judged_first`: the kinds
        that are resent send nothing until `judged` (the first evaluation on fresh figures since the
        start), or JUDGED_WAIT: the alerts the state file held may have resolved meanwhile, and
        another replica may have said so."""
        self.store = store
        self.clock = clock
        self.alerts = alerts
        self.routed = routed
        self.digests_to = digests_to
        self.deadline = DEADLINE
        self.retrying = True
        """Whether a failed notification is tried again (as it is but for `digest --send`, which tries once):
        what a failure's log line says."""
        self.sent: dict[str, int] = {}
        self.failed: dict[str, int] = {}
        self.discarded: dict[str, int] = dict.fromkeys(DISCARDED, 0)
        """Notifications never delivered, and why (a DISCARDED reason)."""
        self._refusals: dict[tuple[str, int], int] = {}
        """Per queued notification (its table and id), the refusals in a row it met (`GIVE_UP_AFTER`)."""
        self._asked: dict[str, float] = {}
        """Per notifier, the wait its receiver asked for in its last answer (`Retry-After`)."""
        self._notifiers: dict[str, NotifierConfig] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._workers: dict[str, _Worker] = {}
        self._kinds: dict[str, type] = {}
        self._retired: list[_Worker] = []
        self._unsaved: dict[str, tuple[Callable[[], Any], Callable[[Any], object] | None]] = {}
        """Per notifier, the outcome of its last delivery that the state file refused to record, and
        what is done once it is written (`_record`): written first when delivery resumes, so nothing
        is sent again meanwhile."""
        self._on_the_wire: dict[str, _TakenUp] = {}
        """Per notifier, the queued notification its worker has taken up, until its outcome is
        written: a reload that removes the notifier, or takes digests from it, meanwhile leaves it
        to that outcome (delivered, it was not dropped; its send failed, it is dropped then:
        `_spared_as_sent`)."""
        self._counts = threading.Lock()
        self._failing: set[tuple[str, str]] = set()
        """(notifier, target) pairs whose last delivery failed: each failure and recovery is logged once."""
        self._judged = threading.Event()
        """Whether the alerts have been judged on fresh figures since the start (`judged_first`), or
        JUDGED_WAIT has passed: till then, nothing is resent."""
        self._judged_wait: threading.Timer | None = None
        if not judged_first:
            self._judged.set()
        self._running = False
        self._closed = False
        self.configure(notifiers, external_url)

    # -- configuration and workers --

    def configure(self, notifiers: Sequence[NotifierConfig], external_url: str) -> None:
        """Deliver for these notifiers from now on. What waits in the outbox for a notifier that is
        no longer one of them (removed, or now of a kind that is resent) is dropped, logged and
        counted: it was decided for a config that is gone, and a notifier added again later under
        its name starts with an empty queue rather than with state changes that are long out of date."""
        self.external_url = external_url
        self._notifiers = {n.name: n for n in notifiers}
        with self._counts:
            self.sent = {name: self.sent.get(name, 0) for name in self._notifiers}
            self.failed = {name: self.failed.get(name, 0) for name in self._notifiers}
            # (a notifier added again starts afresh: its first failure is told, no recovery from before)
            self._failing = {pair for pair in self._failing if pair[0] in self._notifiers}
        for name in self._notifiers:
            self._locks.setdefault(name, threading.Lock())
        self._drop_orphans()
        if self._running:
            self._start_workers()

    def _drop_orphans(self) -> None:
        """Drop the queues of notifiers no longer configured, and the digests queued for those that
        take none now (`digests_to`), handing those on to the notifiers that do (`AlertStore.discard`).
        A state file that refuses is left as it is: nothing is delivered from a removed notifier's
        queue meanwhile, a digest its notifier takes no more is dropped when it comes to be sent,
        and the next reload tries again."""
        kept, now, wanted = [n.name for n in self.outbox_notifiers], self.clock.now().timestamp(), self._digests_now()
        with self._counts:
            sending = [taken.row for taken in self._on_the_wire.values()]
            for name, taken in self._on_the_wire.items():  # (left to their worker, which drops each if it failed)
                if name not in kept:
                    taken.spared = REMOVED
                elif taken.row[0] == "digest_outbox":  # (a digest its notifier takes again is its to retry)
                    taken.spared = NO_DIGESTS if wanted is not None and name not in wanted else None
        try:
            dropped, given = self.store.discard(kept, now, REMOVED, wanted or (), sending=sending)
        except StateError as error:
            log.error("could not drop the queues of removed notifiers", error=str(error))
            return
        for name, count in sorted(dropped.items()):
            log.warning("queued notifications dropped: their notifier is no longer configured",
                        notifier=name, notifications=count)  # fmt: skip
        more: dict[str, int] = {}
        also: dict[str, int] = {}
        if wanted is not None:
            # Theirs go now, not once what waits before them is delivered: a receiver that is down
            # would hold them past when they can be handed on.
            try:
                more, also = self.store.discard(wanted, now, NO_DIGESTS, wanted, digests=True, sending=sending)
            except StateError as error:
                log.error("could not drop the digests of notifiers that take none now", error=str(error))
        for name, count in sorted(more.items()):
            log.info("queued digests dropped: their notifier takes no digests any more", notifier=name, digests=count)
        for name, count in sorted((Counter(given) + Counter(also)).items()):
            log.info("queued digests dropped by the config handed on", notifier=name, digests=count)
        with self._counts:
            self.discarded["notifier_removed"] += sum(dropped.values()) + sum(more.values())

    @property
    def outbox_notifiers(self) -> list[NotifierConfig]:
        """The notifiers whose notifications wait in the outbox."""
        return [n for n in self._notifiers.values() if outbox(n) is not None]

    def start(self) -> None:
        """Deliver in the background from now on (until `close`)."""
        self._running = True
        self._start_workers()
        if not self._judged.is_set():  # (what is held goes when JUDGED_WAIT has passed, not at a worker's next turn)
            self._judged_wait = threading.Timer(JUDGED_WAIT, self.judged)  # (what is held goes, judged or not)
            self._judged_wait.daemon = True
            self._judged_wait.start()

    def _start_workers(self) -> None:
        self._retired = [worker for worker in self._retired if worker.alive]
        for name in list(self._workers):
            if type(self._notifiers.get(name)) is not self._kinds[name]:  # removed, or now another type
                worker = self._workers.pop(name)
                worker.stop()
                self._retired.append(worker)
                self._unsaved.pop(name, None)  # its queue is not delivered as it was any more
        for name, notifier in self._notifiers.items():
            self._kinds[name] = type(notifier)
            if name not in self._workers:
                found = kind(notifier)
                if isinstance(found, OutboxKind):
                    self._workers[name] = _Worker(name, partial(self._drain, name), POLL)
                else:
                    self._workers[name] = _Worker(name, partial(self._resend, name), found.every)
                self._workers[name].poke()

    def poke(self) -> None:
        """New notifications are queued: the outbox workers look now."""
        for name, worker in list(self._workers.items()):
            if (notifier := self._notifiers.get(name)) is None or outbox(notifier) is not None:
                worker.poke()

    @property
    def awaiting_judgement(self) -> bool:
        """Whether the kinds that are resent still wait for the first judgement (`judged`)."""
        return not self._judged.is_set()

    def judged(self) -> None:
        """The alerts have been evaluated on the figures readiness waits for (`web.views.ready`:
        with one account, its bills and usage refreshed): the kinds that are resent may send them,
        and the first time they do at once."""
        if not self._judged.is_set():
            self._judged.set()
            self.resend()

    def resend(self) -> None:
        """Alert states changed: the workers of the kinds that are resent send everything now, not
        at their next turn."""
        for name, worker in list(self._workers.items()):
            if (notifier := self._notifiers.get(name)) is not None and outbox(notifier) is None:
                worker.poke()

    def close(self) -> None:
        """Stop the workers: each ends after the delivery it is in (bounded by DEADLINE)."""
        self._running = False
        self._closed = True
        if self._judged_wait is not None:
            self._judged_wait.cancel()
        for worker in self._workers.values():
            worker.stop()

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` for the workers (those a reload retired too) to end; True if all did."""
        deadline = time.monotonic() + timeout
        workers = [*self._workers.values(), *self._retired]
        for worker in workers:
            worker.join(deadline - time.monotonic())
        return not any(worker.alive for worker in workers)

    # -- what the kinds send through (`kind.Delivery`) --

    def post(self, notifier: str, url: str, body: object, target: str = "", address: str | None = None) -> str | None:
        """POST JSON; None on a 2xx, else a short reason (never the URL: it may hold a secret).
        `target` tells apart the URLs of a notifier that has several, in the log; `address`: the
        IP address of the URL's host to POST to (`core.post.peers`)."""
        try:
            headers = {"User-Agent": USER_AGENT}
            answer = post_json(url, body, deadline=self.deadline, headers=headers, address=address)
        except DeadlineExceeded as error:
            reason = str(error)
        except http.client.InvalidURL as error:  # (a proxy's, from the environment: the config's are checked)
            reason = f"the URL cannot be used: {error}"
        except (OSError, http.client.HTTPException) as error:
            reason = f"connection failed: {network_cause(error)}"
        else:
            if 200 <= answer.status < 300:
                return self.outcome(notifier, None, target)
            reason = f"HTTP {answer.status}"
            if answer.retry_after is not None:  # (read on a 429 or a 503 only: `post_json`)
                self._asked[notifier] = max(self._asked.get(notifier, 0.0), min(answer.retry_after, WAIT_ASKED_MAX))
            if 300 <= answer.status < 400:
                reason += f" (redirect to {_where(answer.location)}; a notification is never followed)"
        return self.outcome(notifier, reason, target)

    def outcome(self, notifier: str, reason: str | None, target: str = "") -> str | None:
        """Count one delivery's outcome (None: it went through) and log a notifier's (or one of
        its targets') first failure and its recovery, once each; returns `reason`."""
        if reason is None:
            with self._counts:
                if notifier in self.sent:  # (not one a reload removed while its delivery was on the wire)
                    self.sent[notifier] += 1
            if self.recovered_at(notifier, target):
                log.info("notifier recovered", **_fields(notifier, target))
            return None
        if self.failed_at(notifier, target):
            said = "notification failed (will retry)" if self.retrying else "notification failed"
            log.error(said, reason=reason, **_fields(notifier, target))
        return reason

    def counts(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """Notifications sent and failed attempts per notifier configured, and those discarded per
        reason: copies read together, none changing while they are read."""
        with self._counts:
            return dict(self.sent), dict(self.failed), dict(self.discarded)

    def failed_at(self, notifier: str, target: str) -> bool:
        """Count a failure; whether it is the first since the notifier (or this target of it) last
        went through, to be logged. One that a reload removed while its delivery was on the wire
        is neither counted nor told: it is not retried."""
        with self._counts:
            if notifier not in self.failed:
                return False
            self.failed[notifier] += 1
            first = (notifier, target) not in self._failing
            self._failing.add((notifier, target))
        return first

    def recovered_at(self, notifier: str, target: str) -> bool:
        with self._counts:
            recovered = (notifier, target) in self._failing
            self._failing.discard((notifier, target))
        return recovered

    # -- the outbox --

    def _send(self, notifier: NotifierConfig, sender: OutboxKind[Any], entry: OutboxEntry) -> Attempt:
        """Deliver one outbox notification to one notifier, however its kind takes it (a digest to
        a kind that takes none, which the config refuses, is done with unsent)."""
        if entry.digest is None:
            return sender.send(notifier, entry, self)
        if sender.digest is None:
            return Attempt(None)
        return sender.digest(notifier, entry.digest, entry, self)

    def _current(self, entry: OutboxEntry) -> OutboxEntry | None:
        """The notification with only the alerts whose state it tells is still theirs: a `firing`
        for alerts that fire now, in the same episode, a `resolved` for alerts that do not (None
        when that leaves none, or when a reload routed a firing's rule away from this notifier).
        A state change that was overtaken while it waited (a receiver down, a queue held back) is
        never delivered as if it were news; the change that overtook it is queued behind it."""
        event = entry.event
        alerts, beyond = event["alerts"], event.get("beyond", [])
        states = self.store.alert_states([*(alert["key"] for alert in alerts), *(key for key, _ in beyond)])
        firing = event["status"] == "firing"
        # Whether its rule goes elsewhere now (a reload routed it away: a group is one rule's alerts).
        rules = {found[2] for alert in alerts if (found := states.get(alert["key"])) is not None}
        routed_away = (
            self.routed is not None and bool(rules) and not any(entry.notifier in self.routed(r) for r in rules)
        )
        if firing and routed_away:
            # Not this notifier's to tell. The first firing of an episode dropped so was never told:
            # its mark goes, so that routed back (by a reload or a restart), the notifier is queued
            # the firing anew. (A reminder's does not: the notifier was told the firing it reminds of.)
            first = [a["key"] for a in alerts if a["starts_at"] == entry.created]
            first += [key for key, since in beyond if since == entry.created]
            if first and not entry.recipients:  # (email recipients took it already: told)
                with contextlib.suppress(StateError):  # (kept: the notifier routed back waits for a reminder)
                    self.store.forget_sent(entry.notifier, first, entry.created)
            return None

        def told_still(key: str, starts_at: float | None) -> bool:
            state, since, _ = states.get(key, ("", None, ""))
            if not firing:
                # Overtaken by a new firing: dropped, unless a reload routed the rule away from this
                # notifier since (that firing is not its to hear: the resolve is its last word).
                return state != "firing" or routed_away
            # (the same episode: one that resolved and fired again since is told by the change queued behind)
            return state == "firing" and (since is None or since == starts_at)

        kept = [alert for alert in alerts if told_still(alert["key"], alert["starts_at"])]
        kept_beyond = [(key, since) for key, since in beyond if told_still(key, since)]
        if len(kept) == len(alerts) and len(kept_beyond) == len(beyond):
            return entry
        if not kept and (kept_beyond or event["total"] > len(alerts) + len(beyond)):
            # Those it does not show still tell it (or, in a row written before `beyond`, their state
            # is unknown here): told as it was.
            return entry
        if not kept:
            return None
        told: GroupEvent = {**event, "alerts": kept}
        told["total"] = event["total"] - (len(alerts) - len(kept)) - (len(beyond) - len(kept_beyond))
        if beyond:
            told["beyond"] = kept_beyond
        return replace(entry, event=told)

    def deliver(self) -> int:
        """Send what is due now for every outbox notifier, here and now (a worker busy with the
        same notifier is waited for); returns how many notifications were done with (delivered,
        or nothing to tell that notifier)."""
        return sum(self._drain(notifier.name) for notifier in self.outbox_notifiers)

    def _record(self, name: str, write: Callable[[], T], then: Callable[[T], object] | None = None) -> T:
        """Write a delivery's outcome, then do `then` with what the write returned (count a drop, say
        it); if the state file refuses, keep both to do first next time: a drop is counted once it is
        written, never before, and never not at all."""
        try:
            written = write()
        except StateError:
            self._unsaved[name] = (write, then)
            raise
        self._unsaved.pop(name, None)
        with self._counts:  # (written: a reload from now on takes the row as it stands)
            self._on_the_wire.pop(name, None)
        if then is not None:
            then(written)
        return written

    def _digests_now(self) -> list[str] | None:
        """The notifiers digests go to now; None when `digests_to` says None (or there is none: a
        queued digest goes where it was queued). All of them have a queue (`check` refuses the
        others); a reload may name one this dispatcher is configured with only in a moment (the
        config is swapped first), whose queue then waits for it."""
        wanted = self.digests_to() if self.digests_to is not None else None
        return None if wanted is None else list(wanted)

    def _takes_no_digests(self, name: str) -> bool:
        """Whether the config of now routes digests elsewhere than to notifier `name`."""
        wanted = self._digests_now()
        return wanted is not None and name not in wanted

    def _drop_waiting(self, table: str, entry_id: int, now: float, reason: str) -> list[str] | None:
        """Drop a queued row its notifier takes no more, if it still waits (None when it does not);
        a digest so dropped goes to those that take digests now (as they are when this is written:
        again after the state file refused it, maybe after a reload). Those it went to."""
        return self.store.drop_waiting(table, entry_id, now, reason, self._digests_now() or ())

    def _drain(self, name: str) -> int:
        """Send a notifier's due notifications in order; stop at the first failure (but for a retry to
        the email recipients still owed one: that holds nothing back). While the state file refuses
        to record an outcome, nothing more is sent (it would be sent again)."""
        with self._locks[name]:
            if name in self._unsaved:
                self._record(name, *self._unsaved[name])
            try:
                return self._drained(name)
            finally:
                with self._counts:  # (no outcome written: an error, or none to write; the row stands)
                    self._on_the_wire.pop(name, None)

    def _spared_as_sent(self, name: str, row: tuple[str, int], now: float) -> bool:
        """Whether a reload left the row its worker sent, and failed, to that outcome: then it is
        dropped instead (its notifier was removed, or takes digests no more: a digest goes to those
        that do now)."""
        with self._counts:
            taken = self._on_the_wire.get(name)
            reason = taken.spared if taken is not None and taken.row == row else None
        if reason is None:
            return False
        told = "queued notification dropped: the config changed as it was sent"
        self._record(
            name, partial(self._drop_waiting, *row, now, reason), partial(self._dropped_as_removed, name, told)
        )
        return True

    def _dropped_as_removed(self, name: str, message: str, given: list[str] | None) -> None:
        """Count, log and hand on a notification dropped as its notifier takes it no more (`given`:
        those a digest went to; None: it waited no more, dropped already, by a reload)."""
        if given is None:
            return
        with self._counts:
            self.discarded["notifier_removed"] += 1
        log.info(message, notifier=name, handed_on_to=",".join(given) or "none")
        if given:
            self.poke()

    def _drained(self, name: str) -> int:
        """`_drain`'s loop, its notifier's lock held."""
        delivered = 0
        while (
            not self._closed
            and (notifier := self._notifiers.get(name)) is not None
            and (sender := outbox(notifier)) is not None
        ):
            now = self.clock.now().timestamp()
            try:
                head = self.store.head(name, now)
            except UnreadableEntry as unreadable:
                log.error("queued notification dropped: it cannot be read", notifier=name,
                          state_file=str(self.store.store.path), error=str(unreadable))  # fmt: skip
                self._discard(name, unreadable.id, unreadable.table, now, UNREADABLE, "unreadable")
                continue
            if head is None or head.next_attempt > now:
                break
            # (A reload swaps the notifiers before it looks here: it sees this head, or this sees it.)
            with self._counts:
                if (current := self._notifiers.get(name)) is None or outbox(current) is None:
                    break  # (removed: what waits is the reload's to drop)
                self._on_the_wire[name] = _TakenUp((head.table, head.id))
            if head.recipients and now - head.created > OWED_FOR:
                log.error("email recipients refused a notification for a day; it is dropped for them",
                          notifier=name, recipients=", ".join(head.recipients))  # fmt: skip
                self._discard(name, head.id, head.table, now, OWED, "refused")
                continue
            if head.digest is not None and self._takes_no_digests(name):
                told = "queued digest dropped: its notifier takes no digests any more"
                drop = partial(self._drop_waiting, "digest_outbox", head.id, now, NO_DIGESTS)
                self._record(name, drop, partial(self._dropped_as_removed, name, told))
                continue
            self._asked.pop(name, None)
            try:
                entry = head if head.digest is not None else self._current(head)
                if entry is not None:
                    reason, owed = self._send(notifier, sender, entry)
            except (KeyError, TypeError):
                if head.digest is None:  # (an alert group's fields are checked as it is read: a fault here is ours)
                    raise
                # A digest read whole that lacks what its kind reads (`head` checks only that it is one).
                log.exception("queued notification dropped: it cannot be read", notifier=name,
                              state_file=str(self.store.store.path), id=head.id)  # fmt: skip
                self._discard(name, head.id, head.table, now, UNREADABLE, "unreadable")
                continue
            if entry is None:
                log.info("queued notification dropped: its alerts changed state again since",
                         notifier=name, alertname=head.event["alertname"], status=head.event["status"])  # fmt: skip
                self._discard(name, head.id, head.table, now, SUPERSEDED, "superseded")
                continue
            now = self.clock.now().timestamp()
            which = (entry.table, entry.id)
            earlier = self._refusals.pop(which, 0)  # (any other outcome ends the row of refusals)
            refusals = earlier + 1 if reason is not None and _refused(reason) else 0
            if reason is not None and refusals >= GIVE_UP_AFTER:
                log.error("notification dropped", notifier=name, reason=reason, attempts=entry.attempts + 1)
                self._discard(name, entry.id, entry.table, now, reason, "refused")
                continue
            if refusals:
                self._refusals[which] = refusals
            # (a refusal's backoff counts the refusals: one after a long outage is not 5 minutes a try)
            retry = now + max(_backoff(refusals - 1 if refusals else entry.attempts), self._asked.pop(name, 0.0))
            if reason is not None and self._spared_as_sent(name, which, now):
                continue  # (dropped: it holds nothing back)
            if reason is not None and (owed or entry.recipients):
                # Owed to some recipients only (others took it): retried apart, holding nothing back.
                self._record(name, partial(self.store.failed, entry.id, retry, reason, recipients=owed,
                                           table=entry.table))  # fmt: skip
                continue
            if reason is not None:
                failed = partial(self.store.failed, entry.id, retry, reason, table=entry.table, recipients=owed)
                self._record(name, failed)
                break
            self._record(name, partial(self.store.delivered, entry.id, now, table=entry.table))
            delivered += 1
        return delivered

    def _discard(self, name: str, entry_id: int, table: str, now: float, dropped: str, why: str) -> None:
        """Drop a queued notification, saying `dropped` in the state file, counted under `why` (a
        DISCARDED reason): the queue goes on behind it, and its refusals in a row are forgotten."""
        self._refusals.pop((table, entry_id), None)
        self._record(name, partial(self.store.drop_waiting, table, entry_id, now, dropped, ()),
                     partial(self._count_discarded, why))  # fmt: skip

    def _count_discarded(self, why: str, given: list[str] | None) -> None:
        """Count a drop `_discard` wrote; none when the row waited no more (a reload dropped it while
        the state file refused this drop, and counted it)."""
        if given is None:
            return
        with self._counts:
            self.discarded[why] += 1

    # -- the kinds that are resent --

    def _resend(self, name: str) -> None:
        """Every active and recently resolved alert to one notifier of a kind that is resent."""
        notifier = self._notifiers.get(name)
        if notifier is None or isinstance(sender := kind(notifier), OutboxKind) or not self._judged.is_set():
            return
        alerts, now = self.alerts(name), self.clock.now().timestamp()
        with self._locks[name]:
            sender.send(notifier, alerts, now, self)

    def resend_now(self) -> None:
        """Send to every notifier of a kind that is resent, here and now (tests)."""
        for notifier in list(self._notifiers.values()):
            if outbox(notifier) is None:
                self._resend(notifier.name)

    def pending(self) -> dict[str, int]:
        return self.store.pending_count()
