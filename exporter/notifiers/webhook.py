"""The `webhook` kind: Alertmanager's webhook JSON (version 4) per alert group, digests as JSON."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from exporter.core.clock import iso
from exporter.core.fields import HttpUrl
from exporter.model.events import GroupEvent
from exporter.notifiers.kind import Attempt, Delivery, NotifierModel, OutboxKind, common, notification_id

if TYPE_CHECKING:
    from exporter.state import OutboxEntry


class WebhookNotifier(NotifierModel):
    type: Literal["webhook"]
    url: HttpUrl

    def plain_secrets(self) -> tuple[str, ...]:
        secret = webhook_secret(self.url)
        path = urlsplit(self.url).path if secret == self.url else ""
        # (the path: the token under any scheme or host; a password: basic auth's)
        return (secret, path if len(path) > 1 else "", *super().plain_secrets())


def webhook_secret(url: str) -> str:
    """The secret a plain webhook URL may carry ("" if none): its query (a token), or the whole
    URL when it is a hooks service's (Slack's, Zapier's: the path is the token)."""
    parts = urlsplit(url)
    if (parts.hostname or "").startswith("hooks."):
        return url
    return parts.query


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
        # As Alertmanager's: the group's status is firing while any of its alerts fires (each alert
        # says its own); a resolve of some of a rule's alerts is no resolve of its incident.
        "status": "firing" if event["status"] == "resolved" and event["still_firing"] else event["status"],
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
    payload = webhook_payload(event, notifier.name, via.external_url, notification_id(entry))
    return Attempt(via.post(notifier.name, notifier.url, payload))


def digest(notifier: WebhookNotifier, body: Mapping[str, Any], entry: OutboxEntry, via: Delivery) -> Attempt:
    """The digest as it is: it is JSON already."""
    return Attempt(via.post(notifier.name, notifier.url, body))


KIND = OutboxKind(model=WebhookNotifier, send=send, digest=digest)
