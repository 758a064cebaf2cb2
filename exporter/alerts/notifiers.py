"""Delivering alert notifications: Alertmanager, Alertmanager-style webhooks, Slack, PagerDuty, email.

Every notifier has its own worker thread, so a slow or dead receiver delays only its own queue:
never another receiver, the alert evaluation or a refresh. Each delivery has one deadline for
the whole exchange (`post.post_json`, `email.send`), and a redirect is a failure, never followed.

Alertmanager gets every active alert re-sent each minute (`endsAt` = now + 4 × resend) and each
resolved one, with `endsAt` at its resolve time, for 15 minutes: Alertmanager deduplicates, and
an alert we stop sending expires by itself. The other notifiers get one message per rule and
state change (the engine groups the alerts that changed together; a message shows a capped list
and says how many more), taken in order from the SQLite outbox; a failed delivery stays at the
head of its notifier's queue and is retried with backoff, across restarts. A notification is
marked delivered right after the receiver's 2xx, so nothing is sent twice for one state change
as far as that 2xx tells (for email: the SMTP server's answer to the message; every attempt at
one notification has the same Message-ID, as a webhook's has the same `notificationId`). A
notification the receiver refuses outright (an HTTP 3xx or 4xx, an SMTP 5xx) is dropped after
GIVE_UP_AFTER attempts; other failures are retried until they succeed.
"""

from __future__ import annotations

import http.client
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, NamedTuple

from exporter import __version__, digest, mrkdwn
from exporter.alerts import email
from exporter.alerts.engine import Alert
from exporter.alerts.post import DeadlineExceeded, post_json
from exporter.billing import network_cause
from exporter.clock import Clock, iso
from exporter.logs import get_logger
from exporter.schema import AlertmanagerNotifier, EmailNotifier, PagerDutyNotifier, SlackNotifier, WebhookNotifier
from exporter.state import AlertStore, GroupEvent, OutboxEntry, StateError

log = get_logger(__name__)

RESEND = 60.0
DEADLINE = 10.0
"""The longest one delivery may take, connection to last byte of the answer."""
POLL = 2.0
"""How often a worker looks at its queue when nothing wakes it (retries fall due)."""
BACKOFF_FIRST = 5.0
BACKOFF_MAX = 300.0
GIVE_UP_AFTER = 5
"""Attempts after which a notification the receiver refuses outright (a 3xx, a 4xx but 408/429, an
SMTP 5xx to its sender, recipients or data) is dropped, so one bad message cannot block its
notifier's queue for ever."""
PAGERDUTY_SEVERITIES = ("critical", "error", "warning", "info")
WEBHOOK_ALERTS = 100
SLACK_ALERTS = 10
PAGERDUTY_ALERTS = 20

USER_AGENT = f"inference-cost-exporter/{__version__}"

REMOVED = "its notifier was removed from the config"
OWED = "the email recipients still owed it refused it for a day"
OWED_FOR = 86400.0
"""How long a notification is retried to email recipients who refuse it for now (4xx) while the
others took it: a full mailbox is not held against the rest of the queue, nor retried for ever."""
SUPERSEDED = "its alerts changed state again before it could be delivered"
DISCARDED = ("notifier_removed", "superseded")
"""Why a queued notification is never delivered: its notifier left the config (`configure`), or
every alert in it changed state again meanwhile (`_current`)."""


class Attempt(NamedTuple):
    """One delivery attempt: `reason` None when done with (delivered, or nothing to tell this
    notifier), else why it failed (counted and logged already); `owed`, the email recipients a
    retry goes to when others took it already."""

    reason: str | None
    owed: tuple[str, ...] = ()


OutboxNotifier = WebhookNotifier | SlackNotifier | PagerDutyNotifier | EmailNotifier
AnyNotifier = AlertmanagerNotifier | OutboxNotifier


def _common(mappings: list[dict[str, str]]) -> dict[str, str]:
    """The pairs every mapping shares."""
    first, *rest = mappings
    return {k: v for k, v in first.items() if all(m.get(k) == v for m in rest)}


def _more(shown: int, total: int) -> str:
    return f"and {total - shown} more" if total > shown else ""


def webhook_payload(event: GroupEvent, receiver: str, external_url: str, notification: str) -> dict[str, Any]:
    """Alertmanager's webhook format, version 4, for one group (at most WEBHOOK_ALERTS alerts, the
    rest counted in `truncatedAlerts`, as Alertmanager's `max_alerts` does), plus `notificationId`:
    the same on every delivery attempt of one notification, so a receiver can drop a repeat."""
    shown = event["alerts"][:WEBHOOK_ALERTS]
    alerts = [
        {
            "status": alert["status"],
            "labels": alert["labels"],
            "annotations": alert["annotations"],
            "startsAt": iso(alert["starts_at"]),
            "endsAt": iso(alert["ends_at"]),
            "generatorURL": f"{external_url}/api/v1/alerts",
            "fingerprint": alert["key"],
        }
        for alert in shown
    ]
    return {
        "version": "4",
        "groupKey": f'{{}}:{{alertname="{event["alertname"]}"}}',
        "truncatedAlerts": event["total"] - len(alerts),
        "status": event["status"],
        "receiver": receiver,
        "groupLabels": {"alertname": event["alertname"]},
        "commonLabels": _common([a["labels"] for a in shown]),
        "commonAnnotations": _common([a["annotations"] for a in shown]),
        "externalURL": external_url,
        "alerts": alerts,
        "notificationId": notification,
    }


def slack_payload(event: GroupEvent, external_url: str) -> dict[str, Any]:
    """Slack's text and blocks for one group: every name in them escaped (`mrkdwn`), since labels
    and summaries carry names from the API, and each text capped at Slack's limit."""
    status = event["status"].upper()
    name = mrkdwn.escape(event["alertname"])
    alerts, total = event["alerts"], event["total"]
    if total == 1:
        summary = mrkdwn.escape(alerts[0]["annotations"].get("summary", event["alertname"]))
        pairs = sorted(alerts[0]["labels"].items())
        text, detail = f"[{status}] {name}: {summary}", f"*[{status}] {name}*\n{summary}"
    else:
        lines = [f"• {mrkdwn.escape(a['annotations'].get('summary', a['key']))}" for a in alerts[:SLACK_ALERTS]]
        more = _more(len(lines), total)
        pairs = sorted(_common([a["labels"] for a in alerts]).items())
        text = f"[{status}] {name}: {total} alerts"
        detail = f"*[{status}] {name}: {total} alerts*\n" + "\n".join(lines) + (f"\n…{more}" if more else "")
    labels = ", ".join(f"{mrkdwn.escape(k)}={mrkdwn.escape(v)}" for k, v in pairs if k != "alertname")
    link = f" · <{external_url}/|exporter>"
    return {
        "text": mrkdwn.cap(text),
        "blocks": [
            {"type": "section", "text": {"type": "mrkdwn", "text": mrkdwn.cap(detail)}},
            {
                "type": "context",
                "elements": [
                    {"type": "mrkdwn", "text": mrkdwn.cap(labels or "no labels", mrkdwn.TEXT - len(link)) + link}
                ],
            },
        ],
    }


def pagerduty_payload(event: GroupEvent, routing_key: str, external_url: str) -> dict[str, Any] | None:
    """PagerDuty Events API v2: one incident per group `dedup_key` (a rule; a budget and its period,
    so its tiers escalate one incident). Triggered when the group's alerts fire, resolved only when
    none of them is firing any more; None when there is nothing to tell PagerDuty."""
    resolved = event["status"] != "firing"
    if resolved and event["still_firing"]:
        return None
    body: dict[str, Any] = {
        "routing_key": routing_key,
        "event_action": "resolve" if resolved else "trigger",
        "dedup_key": event["dedup_key"],
    }
    if resolved:
        return body
    alerts, total = event["alerts"], event["total"]
    first = alerts[0]
    summary = first["annotations"].get("summary", event["alertname"])
    if total > 1:
        summary = f"{event['alertname']}: {total} alerts firing: {summary}, {_more(1, total)}"
    severity = first["labels"].get("severity", "warning")
    body["payload"] = {
        "summary": summary[:1024],
        "source": "inference-cost-exporter",
        "severity": severity if severity in PAGERDUTY_SEVERITIES else "warning",
        "timestamp": iso(first["starts_at"]),
        "component": first["labels"].get("endpoint_id", first["labels"].get("budget", "")),
        "group": event["alertname"],
        "custom_details": {
            "alerts": [{"labels": a["labels"], "annotations": a["annotations"]} for a in alerts[:PAGERDUTY_ALERTS]],
            "total": total,
        },
    }
    body["client"] = "inference-cost-exporter"
    body["client_url"] = external_url
    return body


def _refused(reason: str) -> bool:
    """A 3xx, or a 4xx other than 408 and 429; an SMTP server's 5xx to the message (`email.send`
    words only those so): the receiver will not take this message, however often it comes."""
    if reason.startswith("SMTP 5"):
        return True
    return reason.startswith(("HTTP 3", "HTTP 4")) and reason not in ("HTTP 408", "HTTP 429")


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
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._work()
            except StateError as error:
                log.error("notification delivery paused", error=str(error))
            except Exception:  # a bug must not stop delivery for good; it is logged with its traceback
                log.exception("notification delivery crashed")


def _fields(notifier: str, target: str) -> dict[str, Any]:
    """Log fields naming a notifier, and which of its URLs when it has several."""
    return {"notifier": notifier, "target": target} if target else {"notifier": notifier}


class Dispatcher:
    """Delivers for every configured notifier; one for the daemon's life, reconfigured on reload
    (a notifier keeps its queue, its worker and its counters while its name stays)."""

    def __init__(
        self,
        notifiers: Sequence[AnyNotifier],
        store: AlertStore,
        clock: Clock,
        alerts: Callable[[], list[Alert]],
        external_url: str,
    ) -> None:
        self.store = store
        self.clock = clock
        self.alerts = alerts
        self.deadline = DEADLINE
        self.sent: dict[str, int] = {}
        self.failed: dict[str, int] = {}
        self.discarded: dict[str, int] = dict.fromkeys(DISCARDED, 0)
        """Notifications never delivered, and why (a DISCARDED reason)."""
        self._notifiers: dict[str, AnyNotifier] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._workers: dict[str, _Worker] = {}
        self._kinds: dict[str, type] = {}
        self._retired: list[_Worker] = []
        self._unsaved: dict[str, Callable[[], None]] = {}
        """Per notifier, the outcome of its last delivery that the state file refused to record:
        written first when delivery resumes, so nothing is sent again meanwhile."""
        self._counts = threading.Lock()
        self._failing: set[tuple[str, str]] = set()
        """(notifier, target) pairs whose last delivery failed: each failure and recovery is logged once."""
        self._running = False
        self._closed = False
        self.configure(notifiers, external_url)

    # -- configuration and workers --

    def configure(self, notifiers: Sequence[AnyNotifier], external_url: str) -> None:
        """Deliver for these notifiers from now on. What waits in the outbox for a notifier that is
        no longer one of them (removed, or now an Alertmanager) is dropped, logged and counted: it
        was decided for a config that is gone, and a notifier added again later under its name
        starts with an empty queue rather than with state changes that are long out of date."""
        self.external_url = external_url
        self._notifiers = {n.name: n for n in notifiers}
        with self._counts:
            self.sent = {name: self.sent.get(name, 0) for name in self._notifiers}
            self.failed = {name: self.failed.get(name, 0) for name in self._notifiers}
        for name in self._notifiers:
            self._locks.setdefault(name, threading.Lock())
        self._drop_orphans()
        if self._running:
            self._start_workers()

    def _drop_orphans(self) -> None:
        """Drop the queues of notifiers no longer configured (a state file that refuses is left as
        it is: nothing is delivered from those queues meanwhile, and the next reload tries again)."""
        try:
            dropped = self.store.discard([n.name for n in self.outbox_notifiers], self.clock.now().timestamp(), REMOVED)
        except StateError as error:
            log.error("could not drop the queues of removed notifiers", error=str(error))
            return
        for name, count in sorted(dropped.items()):
            log.warning("queued notifications dropped: their notifier is no longer configured",
                        notifier=name, notifications=count)  # fmt: skip
            with self._counts:
                self.discarded["notifier_removed"] += count

    @property
    def alertmanagers(self) -> list[AlertmanagerNotifier]:
        return [n for n in self._notifiers.values() if isinstance(n, AlertmanagerNotifier)]

    @property
    def outbox_notifiers(self) -> list[OutboxNotifier]:
        return [n for n in self._notifiers.values() if not isinstance(n, AlertmanagerNotifier)]

    def start(self) -> None:
        """Deliver in the background from now on (until `close`)."""
        self._running = True
        self._start_workers()

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
                if isinstance(notifier, AlertmanagerNotifier):
                    self._workers[name] = _Worker(name, partial(self._alertmanager, name), RESEND)
                else:
                    self._workers[name] = _Worker(name, partial(self._drain, name), POLL)
                self._workers[name].poke()

    def poke(self) -> None:
        """New notifications are queued: the outbox workers look now."""
        for name, worker in list(self._workers.items()):
            if not isinstance(self._notifiers.get(name), AlertmanagerNotifier):
                worker.poke()

    def resend_alertmanager(self) -> None:
        """Alert states changed: the Alertmanager workers send everything now, not at their next minute."""
        for name, worker in list(self._workers.items()):
            if isinstance(self._notifiers.get(name), AlertmanagerNotifier):
                worker.poke()

    def close(self) -> None:
        """Stop the workers: each ends after the delivery it is in (bounded by DEADLINE)."""
        self._running = False
        self._closed = True
        for worker in self._workers.values():
            worker.stop()

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` for the workers (those a reload retired too) to end; True if all did."""
        deadline = time.monotonic() + timeout
        workers = [*self._workers.values(), *self._retired]
        for worker in workers:
            worker.join(deadline - time.monotonic())
        return not any(worker.alive for worker in workers)

    # -- sending --

    def _post(self, notifier: str, url: str, body: object, target: str = "") -> str | None:
        """POST JSON; None on a 2xx, else a short reason (never the URL: it may hold a secret).
        `target` tells apart the URLs of a notifier that has several, in the log."""
        try:
            answer = post_json(url, body, deadline=self.deadline, headers={"User-Agent": USER_AGENT})
        except DeadlineExceeded as error:
            reason = str(error)
        except (OSError, http.client.HTTPException) as error:
            reason = f"connection failed: {network_cause(error)}"
        else:
            if 200 <= answer.status < 300:
                return self._outcome(notifier, None, target)
            reason = f"HTTP {answer.status}"
            if 300 <= answer.status < 400:
                reason += f" (redirect to {answer.location or 'nowhere'}; a notification is never followed)"
        return self._outcome(notifier, reason, target)

    def _outcome(self, notifier: str, reason: str | None, target: str = "") -> str | None:
        """Count one delivery's outcome (None: it went through) and log a notifier's (or one of
        its targets') first failure and its recovery, once each; returns `reason`."""
        if reason is None:
            with self._counts:
                self.sent[notifier] = self.sent.get(notifier, 0) + 1
                recovered = (notifier, target) in self._failing
                self._failing.discard((notifier, target))
            if recovered:
                log.info("notifier recovered", **_fields(notifier, target))
            return None
        with self._counts:
            self.failed[notifier] = self.failed.get(notifier, 0) + 1
            first = (notifier, target) not in self._failing
            self._failing.add((notifier, target))
        if first:
            log.error("notification failed (will retry)", reason=reason, **_fields(notifier, target))
        return reason

    def _send(self, notifier: OutboxNotifier, entry: OutboxEntry) -> Attempt:
        """Deliver one outbox notification to one notifier, however that notifier takes it."""
        if entry.digest is not None:
            return self._send_digest(notifier, entry)
        event = entry.event
        if isinstance(notifier, EmailNotifier):
            return self._email(notifier, email.alert_message(event, self.external_url), event["dedup_key"], entry)
        message = self._format(notifier, event, entry.id)
        return Attempt(None if message is None else self._post(notifier.name, *message))

    def _email(self, notifier: EmailNotifier, message: tuple[str, str, str], key: str, entry: OutboxEntry) -> Attempt:
        """(subject, text, HTML) by SMTP, with a Message-ID the same on every attempt of this entry,
        to the recipients still owed it. Recipients the server refuses while it takes the message
        for others: a permanent refusal (5xx) is logged naming the recipient, counted, and never
        tried again; a temporary one (4xx) is retried to that recipient only."""
        subject, text, html = message
        message_id = email.message_id(key, entry.id)
        name = notifier.name
        recipients = [r for r in entry.recipients if r in notifier.to] if entry.recipients else list(notifier.to)
        if not recipients:
            return Attempt(None)  # those it was still owed to have left `to` since
        sent = email.send(
            notifier, subject, text, html, message_id=message_id, deadline=self.deadline, recipients=recipients
        )
        if sent.reason is not None:
            return Attempt(self._outcome(name, sent.reason))
        self._outcome(name, None)
        owed = []
        for address, code in sorted(sent.refused.items()):
            with self._counts:
                self.failed[name] = self.failed.get(name, 0) + 1
                first = (name, address) not in self._failing
                self._failing.add((name, address))
            if 500 <= code < 600:
                if first:
                    log.error("email recipient refused a notification for good; it is not sent to them again",
                              notifier=name, recipient=address, reason=f"SMTP {code}")  # fmt: skip
                continue
            owed.append(address)
            if first:
                log.warning("email recipient refused the notification for now; retried to them only",
                            notifier=name, recipient=address, reason=f"SMTP {code}")  # fmt: skip
        for address in set(recipients) - set(sent.refused):
            with self._counts:
                recovered = (name, address) in self._failing
                self._failing.discard((name, address))
            if recovered:
                log.info("email recipient took a notification again", notifier=name, recipient=address)
        if owed:
            return Attempt(f"SMTP {min(sent.refused[a] for a in owed)} (recipients refused: {len(owed)})", tuple(owed))
        return Attempt(None)

    def _send_digest(self, notifier: OutboxNotifier, entry: OutboxEntry) -> Attempt:
        """A digest: the webhook gets it as JSON as it is, Slack as blocks, email as text and HTML;
        PagerDuty none (the config refuses it: a digest is not an incident)."""
        body = entry.digest
        assert body is not None
        if isinstance(notifier, EmailNotifier):
            message = digest.subject(body), digest.text(body), digest.html(body)
            return self._email(notifier, message, f"digest-{body.get('id') or body['day']}", entry)
        if isinstance(notifier, WebhookNotifier):
            return Attempt(self._post(notifier.name, notifier.url, body))
        if isinstance(notifier, SlackNotifier):
            return Attempt(self._post(notifier.name, notifier.url.get_secret_value(), digest.slack(body)))
        return Attempt(None)

    def _current(self, entry: OutboxEntry) -> OutboxEntry | None:
        """The notification with only the alerts whose state it tells is still theirs: a `firing`
        for alerts that fire now, a `resolved` for alerts that do not (None when that leaves none).
        A state change that was overtaken while it waited (a receiver down, a queue held back) is
        never delivered as if it were news; the change that overtook it is queued behind it."""
        event = entry.event
        alerts = event["alerts"]
        states = self.store.alert_states(alert["key"] for alert in alerts)
        firing = event["status"] == "firing"
        kept = [alert for alert in alerts if (states.get(alert["key"]) == "firing") == firing]
        if len(kept) == len(alerts):
            return entry
        if not kept and event["total"] > len(alerts):
            return entry  # it counts alerts it does not show, whose state is unknown here: told as it was
        if not kept:
            return None
        return replace(entry, event={**event, "alerts": kept, "total": event["total"] - (len(alerts) - len(kept))})

    def _format(
        self, notifier: WebhookNotifier | SlackNotifier | PagerDutyNotifier, event: GroupEvent, entry: int
    ) -> tuple[str, object] | None:
        """The URL and JSON body of an HTTP notification; None when there is nothing to send."""
        if isinstance(notifier, WebhookNotifier):
            notification = f"{event['dedup_key']}-{entry}"
            return notifier.url, webhook_payload(event, notifier.name, self.external_url, notification)
        if isinstance(notifier, SlackNotifier):
            return notifier.url.get_secret_value(), slack_payload(event, self.external_url)
        body = pagerduty_payload(event, notifier.routing_key.get_secret_value(), self.external_url)
        return None if body is None else (notifier.url, body)

    def deliver(self) -> int:
        """Send what is due now for every outbox notifier, here and now (a worker busy with the
        same notifier is waited for); returns how many notifications were done with (delivered,
        or nothing to tell that notifier)."""
        return sum(self._drain(notifier.name) for notifier in self.outbox_notifiers)

    def _record(self, name: str, write: Callable[[], None]) -> None:
        """Write a delivery's outcome; if the state file refuses, keep it to write first next time."""
        try:
            write()
        except StateError:
            self._unsaved[name] = write
            raise
        self._unsaved.pop(name, None)

    def _drain(self, name: str) -> int:
        """Send a notifier's due notifications in order; stop at the first failure (but for a retry to
        the email recipients still owed one: that holds nothing back). While the state file refuses
        to record an outcome, nothing more is sent (it would be sent again)."""
        delivered = 0
        with self._locks[name]:
            if name in self._unsaved:
                self._record(name, self._unsaved[name])
            while not self._closed and isinstance(notifier := self._notifiers.get(name), OutboxNotifier):
                now = self.clock.now().timestamp()
                head = self.store.head(name, now)
                if head is None or head.next_attempt > now:
                    break
                if head.recipients and now - head.created > OWED_FOR:
                    log.error("email recipients refused a notification for a day; it is dropped for them",
                              notifier=name, recipients=", ".join(head.recipients))  # fmt: skip
                    self._record(name, partial(self.store.delivered, head.id, now, dropped=OWED, table=head.table))
                    continue
                entry = head if head.digest is not None else self._current(head)
                if entry is None:
                    self._record(name, partial(self.store.delivered, head.id, now, dropped=SUPERSEDED))
                    with self._counts:
                        self.discarded["superseded"] += 1
                    log.info("queued notification dropped: its alerts changed state again since",
                             notifier=name, alertname=head.event["alertname"], status=head.event["status"])  # fmt: skip
                    continue
                reason, owed = self._send(notifier, entry)
                now = self.clock.now().timestamp()
                if reason is not None and _refused(reason) and entry.attempts + 1 >= GIVE_UP_AFTER:
                    log.error("notification dropped", notifier=name, reason=reason, attempts=entry.attempts + 1)
                    self._record(name, partial(self.store.delivered, entry.id, now, dropped=reason, table=entry.table))
                    continue
                if reason is not None and (owed or entry.recipients):
                    # Owed to some recipients only (others took it): retried apart, holding nothing back.
                    pause = min(BACKOFF_MAX, BACKOFF_FIRST * 2**entry.attempts) * random.uniform(0.8, 1.2)
                    failed = partial(self.store.failed, entry.id, now + pause, reason, recipients=owed)
                    self._record(name, partial(failed, table=entry.table))
                    continue
                if reason is not None:
                    pause = min(BACKOFF_MAX, BACKOFF_FIRST * 2**entry.attempts) * random.uniform(0.8, 1.2)
                    failed = partial(
                        self.store.failed, entry.id, now + pause, reason, table=entry.table, recipients=owed
                    )
                    self._record(name, failed)
                    break
                self._record(name, partial(self.store.delivered, entry.id, now, table=entry.table))
                delivered += 1
        return delivered

    def alertmanager_payload(self) -> list[dict[str, Any]]:
        now = self.clock.now().timestamp()
        payload = []
        for alert in self.alerts():
            if alert.state == "pending":
                continue
            ends = alert.resolved_at if alert.state == "resolved" else now + 4 * RESEND
            payload.append(
                {
                    "labels": alert.labels,
                    "annotations": alert.annotations,
                    "startsAt": iso(alert.fired_at),
                    "endsAt": iso(ends),
                    "generatorURL": f"{self.external_url}/api/v1/alerts",
                }
            )
        return payload

    def _alertmanager(self, name: str) -> None:
        """Every active and recently resolved alert to each URL of one Alertmanager notifier."""
        notifier = self._notifiers.get(name)
        if not isinstance(notifier, AlertmanagerNotifier):
            return
        payload = self.alertmanager_payload()
        if not payload:
            return
        with self._locks[name]:
            if len(notifier.urls) == 1:
                self._post(name, f"{notifier.urls[0]}/api/v2/alerts", payload)
                return
            # Every peer at once: one that drops packets must not hold back the others.
            posts = [
                threading.Thread(
                    target=self._post, args=(name, f"{url}/api/v2/alerts", payload, f"urls[{n}]"), daemon=True
                )
                for n, url in enumerate(notifier.urls)
            ]
            for post in posts:
                post.start()
            for post in posts:
                post.join()

    def send_alertmanager(self) -> None:
        """Send to every Alertmanager here and now (tests and `once`)."""
        for notifier in self.alertmanagers:
            self._alertmanager(notifier.name)

    def pending(self) -> dict[str, int]:
        return self.store.pending_count()
