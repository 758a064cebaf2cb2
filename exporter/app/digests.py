"""When the digest is due: its scheduled day, how long it waits for the day's figures, and its
queueing (once per day or week and account, across restarts), each account's with its own alerts."""

from __future__ import annotations

import datetime as dt
import functools
import heapq
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from operator import itemgetter

from exporter.alerts.alert import Alert
from exporter.app.account import Account
from exporter.app.sources import Sources
from exporter.config.schema import ACCOUNT, Config, DigestConfig
from exporter.core.clock import Clock
from exporter.core.logs import get_logger
from exporter.delivery.dispatcher import Dispatcher
from exporter.digest.build import span
from exporter.model.signals import todays_bills, todays_history
from exporter.model.snapshots import Latest
from exporter.state import StateError

log = get_logger(__name__)

DIGEST_WAIT = 3600.0
"""Seconds a due digest waits for the day's bills (and history), from its time or from the start if
later, before it goes with what there is."""


def digest_due(config: DigestConfig, now: dt.datetime, clock: Clock) -> dt.date | None:
    """The day whose digest is due at `now`: the last scheduled time passed, if it is at most half
    a period ago (a digest missed for longer is skipped: the next one is nearer)."""
    hour, minute = config.time
    today = clock.today()
    period = 7 if config.schedule == "weekly" else 1
    for back in range(period + 1):
        day = today - dt.timedelta(days=back)
        if config.schedule == "weekly" and day.weekday() != 0:
            continue
        scheduled = clock.at(day, hour, minute)
        if scheduled <= now:  # (instants: UTC and the zone's compare as such)
            return day if now.astimezone(dt.UTC) - scheduled <= dt.timedelta(days=period / 2) else None
    return None


def digest_ready(latest: Latest, clock: Clock, config: Config) -> bool:
    """Today's bills are in, and today's history when there is one: the day summarised is complete."""
    if not todays_bills(latest, clock):
        return False
    return config.billing.history_months == 0 or todays_history(latest, clock)


def _ids(sources: Sources, account: Account, last: tuple[str, str] | None) -> tuple[str, ...]:
    """The billing account ids whose digests are `account`'s: its own, and the one it had before
    its access key was rotated, if the last digest under its name (`last`:
    `AlertStore.digest_last_owner`) was of an id no longer configured with the same project.
    (Another billing account of the same project whose name it was is taken for that one: nothing
    here tells them apart.)"""
    if last is None or last[0] == account.account_id or last[0] in sources.account_ids:
        return (account.account_id,)
    before, project = last
    return (account.account_id, before) if project == account.client.project_id else (account.account_id,)


def _alone(sources: Sources, account: Account) -> bool:
    """No other account configured is of the same billing account and project as `account`."""
    return account.account_id not in sources.alike


class FiringByAccount:
    """The firing alerts each account's digest tells, read once for a round of digests and grouped
    by account in one pass: each account's digest then reads its own alerts, not every one held
    (400 accounts' digests, each sorting and walking all 2,000 alerts held, took 0.9 s)."""

    def __init__(self, current: Callable[[], Sequence[Alert]], several: bool) -> None:
        """`current`: the alerts held, in the order a digest lists them; read at the first `of`, so
        a round whose digests were all made before reads nothing. `several`: the config lists
        accounts (without, an `account` label is one a rule's `labels` set: the one digest has it)."""
        self._current = current
        self._several = several

    @functools.cached_property
    def _groups(self) -> tuple[dict[str, list[tuple[int, Alert]]], list[tuple[int, Alert]]]:
        """Each account's firing alerts, and those of rules not split by account (no `account`
        label: each account's digest keeps those that count it, `Sources.digest`), each with its
        place in the order held."""
        own: dict[str, list[tuple[int, Alert]]] = {}
        shared: list[tuple[int, Alert]] = []
        for place, alert in enumerate(self._current()):
            if alert.state == "firing":
                name = alert.labels.get(ACCOUNT) if self._several else None
                (shared if name is None else own.setdefault(name, [])).append((place, alert))
        return own, shared

    def of(self, account: str) -> list[Alert]:
        """The firing alerts of `account` and of rules not split by account, in the order held."""
        own, shared = self._groups
        return [alert for _, alert in heapq.merge(own.get(account, []), shared, key=itemgetter(0))]


class DigestQueue:
    """Queues the digest of each account when its time has come (see `Daemon.digest_cycle`)."""

    def __init__(
        self,
        clock: Clock,
        busy: Callable[[], AbstractContextManager[None]],
        alerts_lock: threading.Lock,
        stopping: threading.Event,
    ) -> None:
        """`busy`: counts the work in flight (the daemon's stop waits for it); `alerts_lock`: held
        while the notifiers are configured (a reload), so a removed one's queue is not filled again."""
        self.clock = clock
        self._busy = busy
        self._alerts_lock = alerts_lock
        self._stopping = stopping
        self._error = ""
        self._made: set[str] = set()
        """The keys of the digests due now (of `_made_on`) that were made, or skipped as told: none
        is looked up again until the day or the config changes."""
        self._made_on: dt.date | None = None
        self._made_for: Sources | None = None
        self._appeared: dict[str, dt.datetime] = {}
        """When each account was first looked at for a digest (at the start, or when a reload added
        it): its wait for the day's bills counts from then."""
        self._due: tuple[str, dt.date, dt.datetime] | None = None
        """The schedule and send day last found due, and when first: found near the end of the time
        it may be sent late in, it stays due while the digests wait for the day's bills."""

    def _told(
        self, dispatcher: Dispatcher, sources: Sources, account: Account, ids: tuple[str, ...],
        days: tuple[dt.date, dt.date],
    ) -> bool:  # fmt: skip
        """Whether every day from `days[0]` to `days[1]` was told by a digest of `account`'s billing
        account (`ids`: `_ids`; `AlertStore.digest_spans`), under any name (another schedule's, or
        one it had before a reload: moved under `accounts:`, renamed). Never when another account
        configured is of the same billing account: its digests mark nothing (either could be the
        other). Digests of days from today on were made while the clock ran ahead: they tell
        nothing."""
        if not _alone(sources, account):
            return False
        first, last = days
        told: set[dt.date] = set()
        today = self.clock.today()
        for account_id in ids:
            for start, end in dispatcher.store.digest_spans(account_id, first, last):
                if end < today:
                    told.update(start + dt.timedelta(days=n) for n in range((end - start).days + 1))
        return all(first + dt.timedelta(days=n) in told for n in range((last - first).days + 1))

    def _key(
        self, dispatcher: Dispatcher, account: Account, ids: tuple[str, ...], key: str, name: str,
        days: tuple[dt.date, dt.date],
    ) -> str | None:  # fmt: skip
        """The key of `account`'s digest (`key`: `daily:2026-11-23`, then `:name`), or None once it
        was made. One made under it of another billing account (the name was that one's before a
        reload) is not its own: its own has a key of its own, the name's and its account's. (One
        whose billing account is not known, made by a version before, is taken for its own.)"""
        if not dispatcher.store.digest_made(key):
            return key
        owners = dispatcher.store.digest_owners(name, days)
        if not owners or owners & set(ids):
            self._made.add(key)
            return None
        own = f"{key}:{account.account_id[:12]}"
        if dispatcher.store.digest_made(own):
            self._made.add(key)  # (its own made: not looked up again until the day or the config changes)
            return None
        return own

    def _told_before(
        self, dispatcher: Dispatcher, sources: Sources, account: Account, ids: tuple[str, ...], name: str,
        marked: bool,
    ) -> set[dt.date] | None:  # fmt: skip
        """The settled days whose reconciliation `account`'s digests told (`AlertStore.digest_told`;
        None before the first that told any): those of each of its billing account ids (`ids`:
        `_ids`), under any name; by `name` when another account configured is of the same billing
        account (the two keep theirs apart), or when none were kept by billing account (by a
        version before, which kept them by name only, and marked no digest: not `marked`, no digest
        under `name` kept its billing account)."""
        if not _alone(sources, account):
            return dispatcher.store.digest_told(name)
        kept = [told for account_id in ids if (told := dispatcher.store.digest_told(name, account_id)) is not None]
        if kept:  # (a key rotated back: the days told meanwhile are the other id's)
            return set().union(*kept)
        return None if marked else dispatcher.store.digest_told(name)

    def queue(self, sources: Sources, dispatcher: Dispatcher, url: str) -> bool:
        """True if a digest was queued now."""
        config = sources.config.digest
        if config is None or self._stopping.is_set():  # (stopping: the state file is about to close)
            return False
        now = self.clock.now()
        sent_on = digest_due(config, now, self.clock)
        if sent_on is None and self._due is not None:
            schedule, day, since = self._due
            if schedule == config.schedule and now - since < dt.timedelta(seconds=2 * DIGEST_WAIT):
                sent_on = day  # (its wait began in time: it goes when the bills come, or with what there is)
        if sent_on is None:
            return False
        if self._due is None or self._due[:2] != (config.schedule, sent_on):
            self._due = (config.schedule, sent_on, now)
        queued = False
        if (self._made_on, self._made_for) != (sent_on, sources):  # (a reload may give a name to another account)
            self._made, self._made_on, self._made_for = set(), sent_on, sources
        firing = FiringByAccount(sources.engine.current, sources.config.several)
        self._appeared = {name: at for name, at in self._appeared.items() if name in sources.accounts}
        for name in list(sources.accounts):  # with several accounts, one digest each
            queued = self._account(sources, dispatcher, url, config, name, sent_on, now, firing) or queued
        return queued

    def _account(
        self,
        sources: Sources,
        dispatcher: Dispatcher,
        url: str,
        config: DigestConfig,
        name: str,
        sent_on: dt.date,
        now: dt.datetime,
        firing: FiringByAccount,
    ) -> bool:
        with self._busy():
            try:
                account = sources.accounts.get(name)
                if account is None:
                    return False  # a reload removed it meanwhile
                due = f"{config.schedule}:{sent_on.isoformat()}" + (f":{name}" if name else "")
                if due in self._made:
                    return False
                last = dispatcher.store.digest_last_owner(name)
                days, ids = span(config.schedule, sent_on), _ids(sources, account, last)
                key = self._key(dispatcher, account, ids, due, name, days)
                if key is None:
                    return False
                scheduled = self.clock.at(sent_on, *config.time)
                if self._told(dispatcher, sources, account, ids, days):
                    # Every day of it was told already by this billing account's digests: under
                    # another schedule (a reload's change: a weekly one after the daily ones that
                    # told its days), or under a name it had before a reload (moved under
                    # `accounts:`, renamed).
                    self._made.add(due)
                    return False
                appeared = self._appeared.setdefault(name, now.astimezone(dt.UTC))
                waited_from = max(scheduled, appeared)
                waiting = now.astimezone(dt.UTC) < waited_from + dt.timedelta(seconds=DIGEST_WAIT)
                if not digest_ready(account.latest, self.clock, account.config) and waiting:
                    return False
                told_before = self._told_before(dispatcher, sources, account, ids, name, last is not None)
                settled, told = sources.digest_settled(sent_on, config.schedule, name, told_before)
                body = sources.digest(
                    sent_on, config.schedule, url, alerts=firing.of(name), account=name, settled=settled
                )
                # For the notifiers configured now: a reload meanwhile may have removed one (and
                # dropped its queue), which a digest queued after it must not fill again, or sent
                # digests elsewhere (and handed on what waited): the next round makes it anew.
                with self._alerts_lock:
                    current = {n.name for n in dispatcher.outbox_notifiers}
                    names = [n for n in config.notifiers if n in current]
                    wanted = dispatcher.digests_to() if dispatcher.digests_to is not None else config.notifiers
                    if not names or list(wanted or ()) != list(config.notifiers):
                        return False
                    queued = dispatcher.store.enqueue_digest(
                        key, names, body, now.timestamp(), told=(name, told | (told_before or set())),
                        account_id=account.account_id, project_id=account.client.project_id,
                        span=days, marked=_alone(sources, account),
                    )  # fmt: skip
            except StateError as error:
                if self._error != str(error):
                    log.error("digest not queued: the state file refused it (tried again each evaluation)",
                              error=str(error))  # fmt: skip
                self._error = str(error)
                return False
        if self._error:
            log.info("digest queueing recovered")
            self._error = ""
        if queued:
            where = {"account": name} if name else {}
            log.info("digest queued", day=body["day"], schedule=config.schedule, notifiers=",".join(config.notifiers),
                     **where)  # type: ignore[arg-type]  # fmt: skip
            dispatcher.poke()
        return queued
