"""Delivering alert notifications: Alertmanager, Alertmanager-style webhooks, Slack, PagerDuty.

Alertmanager gets every active alert re-sent each minute (`endsAt` = now + 4 × resend) and each
resolved one, with `endsAt` at its resolve time, for 15 minutes: Alertmanager deduplicates, and
an alert we stop sending expires by itself. The other notifiers get one notification per state
change (and reminders), taken in order from the SQLite outbox; a failed delivery stays at the
head of its notifier's queue and is retried with backoff, across restarts. A notification is
marked delivered right after the receiver's 2xx, so nothing is sent twice for one state change
as far as that 2xx tells.
"""

from __future__ import annotations

import json
import logging
import random
import threading
from collections.abc import Callable, Sequence
from typing import Any

import requests

from exporter import __version__
from exporter.alerts.engine import Alert, iso
from exporter.clock import Clock
from exporter.config import AlertmanagerNotifier, PagerDutyNotifier, SlackNotifier, WebhookNotifier
from exporter.state import AlertStore

log = logging.getLogger(__name__)

RESEND = 60.0
TIMEOUT = 10.0
BACKOFF_FIRST = 5.0
BACKOFF_MAX = 300.0
GIVE_UP_AFTER = 5
"""Attempts after which a notification the receiver refuses outright (4xx but 408/429) is dropped,
so one bad message cannot block its notifier's queue for ever."""
PAGERDUTY_SEVERITIES = ("critical", "error", "warning", "info")

OutboxNotifier = WebhookNotifier | SlackNotifier | PagerDutyNotifier


def webhook_payload(event: dict[str, Any], receiver: str, external_url: str, notification: str) -> dict[str, Any]:
    """Alertmanager's webhook format, version 4, for one alert, plus `notificationId`: the same on
    every delivery attempt of one notification, so a receiver can drop a repeat delivery."""
    labels = event["labels"]
    alert = {
        "status": event["status"],
        "labels": labels,
        "annotations": event["annotations"],
        "startsAt": iso(event["starts_at"]),
        "endsAt": iso(event["ends_at"]),
        "generatorURL": f"{external_url}/api/v1/alerts",
        "fingerprint": event["key"],
    }
    return {
        "version": "4",
        "groupKey": f'{{}}:{{alertname="{labels["alertname"]}"}}',
        "truncatedAlerts": 0,
        "status": event["status"],
        "receiver": receiver,
        "groupLabels": {"alertname": labels["alertname"]},
        "commonLabels": labels,
        "commonAnnotations": event["annotations"],
        "externalURL": external_url,
        "alerts": [alert],
        "notificationId": notification,
    }


def slack_payload(event: dict[str, Any], external_url: str) -> dict[str, Any]:
    status = event["status"].upper()
    name = event["labels"]["alertname"]
    summary = event["annotations"].get("summary", name)
    labels = ", ".join(f"{k}={v}" for k, v in sorted(event["labels"].items()) if k != "alertname")
    return {
        "text": f"[{status}] {name}: {summary}",
        "blocks": [
            {"type": "section", "text": {"type": "mrkdwn", "text": f"*[{status}] {name}*\n{summary}"}},
            {
                "type": "context",
                "elements": [{"type": "mrkdwn", "text": f"{labels or 'no labels'} · <{external_url}/|exporter>"}],
            },
        ],
    }


def pagerduty_payload(event: dict[str, Any], routing_key: str, external_url: str) -> dict[str, Any]:
    """PagerDuty Events API v2: trigger or resolve, one incident per `dedup_key`."""
    body: dict[str, Any] = {
        "routing_key": routing_key,
        "event_action": "trigger" if event["status"] == "firing" else "resolve",
        "dedup_key": event["dedup_key"],
    }
    if event["status"] == "firing":
        severity = event["labels"].get("severity", "warning")
        body["payload"] = {
            "summary": event["annotations"].get("summary", event["labels"]["alertname"])[:1024],
            "source": "inference-cost-exporter",
            "severity": severity if severity in PAGERDUTY_SEVERITIES else "warning",
            "timestamp": iso(event["starts_at"]),
            "component": event["labels"].get("endpoint_id", event["labels"].get("budget", "")),
            "group": event["labels"]["alertname"],
            "custom_details": {"labels": event["labels"], "annotations": event["annotations"]},
        }
        body["client"] = "inference-cost-exporter"
        body["client_url"] = external_url
    return body


def _refused(reason: str) -> bool:
    """A 4xx other than 408 and 429: the receiver will not take this message, however often it comes."""
    return reason.startswith("HTTP 4") and reason not in ("HTTP 408", "HTTP 429")


class Dispatcher:
    def __init__(
        self,
        notifiers: Sequence[AlertmanagerNotifier | OutboxNotifier],
        store: AlertStore,
        clock: Clock,
        alerts: Callable[[], list[Alert]],
        external_url: str,
        previous: Dispatcher | None = None,
    ) -> None:
        self.alertmanagers = [n for n in notifiers if isinstance(n, AlertmanagerNotifier)]
        self.outbox_notifiers = [n for n in notifiers if not isinstance(n, AlertmanagerNotifier)]
        self.store = store
        self.clock = clock
        self.alerts = alerts
        self.external_url = external_url
        # Counters go on across a reload for the notifiers it keeps.
        self.sent: dict[str, int] = {n.name: previous.sent.get(n.name, 0) if previous else 0 for n in notifiers}
        self.failed: dict[str, int] = {n.name: previous.failed.get(n.name, 0) if previous else 0 for n in notifiers}
        self._session = requests.Session()
        self._session.headers["User-Agent"] = f"inference-cost-exporter/{__version__}"
        self._lock = threading.Lock()
        self._counts = threading.Lock()
        self._failing: set[str] = set()

    def close(self) -> None:
        self._session.close()

    def _post(self, notifier: str, url: str, body: object) -> str | None:
        """POST JSON; None on a 2xx, else a short reason (never the URL: it may hold a secret)."""
        try:
            response = self._session.post(url, json=body, timeout=TIMEOUT)
        except requests.RequestException as error:
            reason = f"connection failed ({type(error).__name__})"
        else:
            if 200 <= response.status_code < 300:
                with self._counts:
                    self.sent[notifier] += 1
                if notifier in self._failing:
                    self._failing.discard(notifier)
                    log.info("notifier recovered notifier=%s", notifier)
                return None
            reason = f"HTTP {response.status_code}"
        with self._counts:
            self.failed[notifier] += 1
        if notifier not in self._failing:
            self._failing.add(notifier)
            log.error("notification failed notifier=%s reason=%r (will retry)", notifier, reason)
        return reason

    def _format(self, notifier: OutboxNotifier, event: dict[str, Any], entry: int) -> tuple[str, object]:
        if isinstance(notifier, WebhookNotifier):
            notification = f"{event['key']}-{entry}"
            return notifier.url, webhook_payload(event, notifier.name, self.external_url, notification)
        if isinstance(notifier, SlackNotifier):
            return notifier.url.get_secret_value(), slack_payload(event, self.external_url)
        routing_key = notifier.routing_key.get_secret_value()
        return notifier.url, pagerduty_payload(event, routing_key, self.external_url)

    def deliver(self) -> int:
        """Send what is due from the outbox, in order per notifier; returns how many were delivered."""
        delivered = 0
        with self._lock:
            for notifier in self.outbox_notifiers:
                while (entry := self.store.head(notifier.name)) is not None:
                    now = self.clock.now().timestamp()
                    if entry.next_attempt > now:
                        break
                    url, body = self._format(notifier, json.loads(entry.event), entry.id)
                    reason = self._post(notifier.name, url, body)
                    if reason is not None and _refused(reason) and entry.attempts + 1 >= GIVE_UP_AFTER:
                        log.error("notification dropped notifier=%s reason=%r after %d attempts", notifier.name,
                                  reason, entry.attempts + 1)  # fmt: skip
                        self.store.delivered(entry.id, now, dropped=reason)
                        continue
                    if reason is not None:
                        pause = min(BACKOFF_MAX, BACKOFF_FIRST * 2**entry.attempts) * random.uniform(0.8, 1.2)
                        self.store.failed(entry.id, now + pause, reason)
                        break
                    self.store.delivered(entry.id, now)
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

    def resend_alertmanager(self) -> None:
        """Every active and recently resolved alert to every Alertmanager (they deduplicate)."""
        payload = self.alertmanager_payload()
        if not payload:
            return
        for notifier in self.alertmanagers:
            for url in notifier.urls:
                self._post(notifier.name, f"{url}/api/v2/alerts", payload)

    def pending(self) -> dict[str, int]:
        return self.store.pending_count()
