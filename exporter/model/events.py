"""An alert group's state change as the outbox holds it and every notifier kind reads it."""

from __future__ import annotations

import json
from typing import NotRequired, TypedDict, cast


class AlertEvent(TypedDict):
    """One alert's state change, as the notifiers format it."""

    key: str
    dedup_key: str
    status: str
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: float
    ends_at: float | None
    value: str


class GroupEvent(TypedDict):
    """What the outbox holds: one rule's alerts that changed to one state together (a message)."""

    status: str
    alertname: str
    dedup_key: str
    alerts: list[AlertEvent]
    """The first GROUP_DETAIL of them."""
    total: int
    still_firing: int
    """Alerts of the same incident still firing after the change (a resolve waits for 0)."""
    beyond: NotRequired[list[tuple[str, float | None]]]
    """The alerts past the first GROUP_DETAIL, by key and the start of their episode only: what a
    delivery checks they still tell (absent in rows written before it, and in groups no larger)."""


def read_event(text: str) -> GroupEvent:
    """An outbox row's event. Rows written before alerts were grouped hold one alert each; they read
    as a group of one."""
    event = json.loads(text)
    if "alerts" in event:
        return cast(GroupEvent, event)
    return {
        "status": event["status"],
        "alertname": event["labels"]["alertname"],
        "dedup_key": event["dedup_key"],
        "alerts": [cast(AlertEvent, event)],
        "total": 1,
        "still_firing": int(event["status"] == "firing"),
    }
