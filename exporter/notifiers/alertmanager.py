"""The `alertmanager` kind: every active alert re-sent each minute, never queued.

Each send carries every firing alert (`endsAt` = now + 4 × RESEND) and each resolved one the
engine still reports, with `endsAt` at its resolve time: Alertmanager deduplicates, and an alert
we stop sending expires by itself. It owns the state, so it takes no digest.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field

from exporter.core.clock import iso
from exporter.core.fields import HttpUrl
from exporter.notifiers.kind import Delivery, NotifierModel, ResendKind

if TYPE_CHECKING:
    from exporter.alerts.alert import Alert


class AlertmanagerNotifier(NotifierModel):
    type: Literal["alertmanager"]
    urls: Annotated[tuple[HttpUrl, ...], Field(min_length=1)]


RESEND = 60.0


def payload(alerts: Sequence[Alert], now: float, external_url: str) -> list[dict[str, Any]]:
    """Alertmanager's `POST /api/v2/alerts` body: the alerts that are not pending, and of those
    with the same labels (a rule changed by a reload in what it watches, its old alert resolved
    and its new one firing) the one that fires: Alertmanager takes one label set as one alert."""
    body = []
    live = {tuple(sorted(a.labels.items())) for a in alerts if a.state == "firing"}
    for alert in alerts:
        if alert.state == "pending":
            continue
        if alert.state == "resolved" and tuple(sorted(alert.labels.items())) in live:
            continue
        ends = alert.resolved_at if alert.state == "resolved" else now + 4 * RESEND
        body.append(
            {
                "labels": alert.labels,
                "annotations": alert.annotations,
                "startsAt": iso(alert.fired_at),
                "endsAt": iso(ends),
                "generatorURL": f"{external_url}/api/v1/alerts",
            }
        )
    return body


def send(notifier: AlertmanagerNotifier, alerts: Sequence[Alert], now: float, via: Delivery) -> None:
    """The alerts to each URL of the notifier (nothing when there is none to send)."""
    body = payload(alerts, now, via.external_url)
    if not body:
        return
    if len(notifier.urls) == 1:
        via.post(notifier.name, f"{notifier.urls[0]}/api/v2/alerts", body)
        return
    # Every peer at once: one that drops packets must not hold back the others.
    posts = [
        threading.Thread(target=via.post, args=(notifier.name, f"{url}/api/v2/alerts", body, f"urls[{n}]"), daemon=True)
        for n, url in enumerate(notifier.urls)
    ]
    for post in posts:
        post.start()
    for post in posts:
        post.join()


KIND = ResendKind(
    model=AlertmanagerNotifier, send=send, every=RESEND, no_digest="is an Alertmanager: it takes alerts, not a digest"
)
