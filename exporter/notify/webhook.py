"""The `webhook` kind: Alertmanager's webhook JSON (version 4) per alert group, digests as JSON."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from exporter.clock import iso
from exporter.notify.kind import Attempt, Delivery, OutboxKind, common
from exporter.schema import WebhookNotifier
from exporter.state import GroupEvent, OutboxEntry

WEBHOOK_ALERTS = 100


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
        "commonLabels": common([a["labels"] for a in shown]),
        "commonAnnotations": common([a["annotations"] for a in shown]),
        "externalURL": external_url,
        "alerts": alerts,
        "notificationId": notification,
    }


def send(notifier: WebhookNotifier, entry: OutboxEntry, via: Delivery) -> Attempt:
    event = entry.event
    payload = webhook_payload(event, notifier.name, via.external_url, f"{event['dedup_key']}-{entry.id}")
    return Attempt(via.post(notifier.name, notifier.url, payload))


def digest(notifier: WebhookNotifier, body: Mapping[str, Any], entry: OutboxEntry, via: Delivery) -> Attempt:
    """The digest as it is: it is JSON already."""
    return Attempt(via.post(notifier.name, notifier.url, body))


KIND = OutboxKind(send=send, digest=digest)
