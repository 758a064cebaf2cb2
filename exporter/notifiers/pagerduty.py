"""The `pagerduty` kind: Events API v2, one incident per alert group; no digest (not an incident)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal

from exporter.core.clock import iso
from exporter.core.fields import HttpUrl
from exporter.core.typed import SecretStr
from exporter.core.words import shortened
from exporter.model.events import GroupEvent
from exporter.notifiers.kind import Attempt, Delivery, NotifierModel, OutboxKind, more

if TYPE_CHECKING:
    from exporter.state import OutboxEntry


class PagerDutyNotifier(NotifierModel):
    type: Literal["pagerduty"]
    routing_key: SecretStr
    url: HttpUrl = "https://events.pagerduty.com/v2/enqueue"


PAGERDUTY_SEVERITIES = ("critical", "error", "warning", "info")
PAGERDUTY_ALERTS = 20
DETAIL_CHARS = 1024
"""The longest label or annotation value `custom_details` shows (cut, with "…")."""
MAX_EVENT_BYTES = 500_000
"""Under PagerDuty's 512 KB a whole event: alerts past it are left out of `custom_details`, which
still says how many there are (`total`). A trigger over the limit is refused, retried and dropped."""


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
    summary = first["annotations"].get("summary", "").strip() or event["alertname"]  # (PagerDuty requires one)
    if total > 1:
        summary = f"{event['alertname']}: {total} alerts firing: {summary}, {more(1, total)}"
    severity = first["labels"].get("severity", "warning").lower()
    body["payload"] = {
        "summary": summary[:1024],
        "source": "inference-cost-exporter",
        "severity": severity if severity in PAGERDUTY_SEVERITIES else "warning",
        "timestamp": iso(first["starts_at"]),
        "component": shortened(first["labels"].get("endpoint_id", first["labels"].get("budget", "")), DETAIL_CHARS),
        "group": event["alertname"],
        "custom_details": {
            "alerts": [
                {"labels": _cut(a["labels"]), "annotations": _cut(a["annotations"])} for a in alerts[:PAGERDUTY_ALERTS]
            ],
            "total": total,
        },
    }
    body["client"] = "inference-cost-exporter"
    body["client_url"] = external_url
    shown = body["payload"]["custom_details"]["alerts"]
    while shown and len(json.dumps(body)) > MAX_EVENT_BYTES:  # (none at last: one alert alone may be too much)
        shown.pop()
    return body


def _cut(values: dict[str, str]) -> dict[str, str]:
    return {k: shortened(v, DETAIL_CHARS) for k, v in values.items()}


def send(notifier: PagerDutyNotifier, entry: OutboxEntry, via: Delivery) -> Attempt:
    body = pagerduty_payload(entry.event, notifier.routing_key.get_secret_value(), via.external_url)
    return Attempt(None if body is None else via.post(notifier.name, notifier.url, body))


KIND = OutboxKind(
    model=PagerDutyNotifier, send=send, digest=None, no_digest="is PagerDuty: a digest is not an incident"
)
