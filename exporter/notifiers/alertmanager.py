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
        if alert.fired_at is not None and ends is not None:  # (the clock stepped back between the two:
            ends = max(ends, alert.fired_at)  # Alertmanager refuses the whole POST for an end before a start)
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
    """The alerts to each URL of the notifier, and to each peer behind a URL whose host name
    resolves to several (a Kubernetes headless Service): Alertmanager's peers do not pass alerts on
    to each other. Nothing when there is none to send."""
    from exporter.core.post import peers  # (here: `check` and `rules` load this module, not the HTTP client)

    body = payload(alerts, now, via.external_url)
    if not body:
        return
    targets = [
        (f"{url}/api/v2/alerts", f"urls[{n}]" if len(found) == 1 else f"urls[{n}] at {address}", address)
        for n, url in enumerate(notifier.urls)
        for found in [peers(url)]
        for address in found
    ]
    if len(targets) == 1:
        (url, _, address), target = targets[0], "" if len(notifier.urls) == 1 else "urls[0]"
        via.post(notifier.name, url, body, target, address)
        return
    # Every peer at once: one that drops packets must not hold back the others.
    posts = [
        threading.Thread(target=via.post, args=(notifier.name, url, body, target, address), daemon=True)
        for url, target, address in targets
    ]
    for post in posts:
        post.start()
    for post in posts:
        post.join()


KIND = ResendKind(
    model=AlertmanagerNotifier, send=send, every=RESEND, no_digest="is an Alertmanager: it takes alerts, not a digest"
)
