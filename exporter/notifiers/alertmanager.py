"""The `alertmanager` kind: every active alert re-sent each minute, never queued.

Each send carries every firing alert (`endsAt` = now + 4 × RESEND) and each resolved one the
engine still reports, with `endsAt` at its resolve time: Alertmanager deduplicates, and an alert
we stop sending expires by itself. It owns the state, so it takes no digest.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Annotated, Any, Literal

from exporter.core.clock import iso
from exporter.core.fields import HttpUrl
from exporter.core.typed import Field
from exporter.notifiers.kind import Delivery, NotifierModel, ResendKind

if TYPE_CHECKING:
    from exporter.alerts.alert import Alert


class AlertmanagerNotifier(NotifierModel):
    type: Literal["alertmanager"]
    urls: Annotated[tuple[HttpUrl, ...], Field(min_length=1)]
    every_address: bool = False
    """Send to each address a URL's host name resolves to (the peers of a cluster behind one
    name, a Kubernetes headless Service: Alertmanager's peers do not pass alerts on), not to the
    one a connection reaches; each address's delivery counted and logged apart."""


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
        starts, ends = alert.fired_at, alert.resolved_at if alert.state == "resolved" else now + 4 * RESEND
        # The clock stepped back between the two: Alertmanager refuses the whole POST for an end
        # before a start. A resolved alert starts as it ended (not active again till a time to
        # come), a firing one ends once it has started.
        if starts is not None and ends is not None and ends < starts:
            starts, ends = (ends, ends) if alert.state == "resolved" else (starts, starts)
        body.append(
            {
                "labels": alert.labels,
                "annotations": alert.annotations,
                "startsAt": iso(starts),
                "endsAt": iso(ends),
                "generatorURL": f"{external_url}/api/v1/alerts",
            }
        )
    return body


def send(notifier: AlertmanagerNotifier, alerts: Sequence[Alert], now: float, via: Delivery) -> None:
    """The alerts to each URL of the notifier, all at once (one that drops packets must not hold
    back the others); with `every_address`, to each address its host name resolves to, each URL
    resolved on its own. Nothing when there is none to send."""
    body = payload(alerts, now, via.external_url)
    if not body:
        return

    def to_url(n: int, url: str) -> None:
        found: list[str | None] = [None]
        if notifier.every_address:
            from exporter.core.post import peers  # (here: `check` and `rules` load this module, not the HTTP client)

            found = peers(
                url, within=via.deadline / 4
            )  # (then the POST's own deadline, which waits for the same lookup)
        named = f"urls[{n}]" if len(notifier.urls) > 1 or len(found) > 1 else ""
        api = f"{url}/api/v2/alerts"
        _at_once(
            partial(via.post, notifier.name, api, body, f"{named} at {address}" if address else named, address)
            for address in found
        )

    _at_once(partial(to_url, n, url) for n, url in enumerate(notifier.urls))


def _at_once(calls: Iterable[Callable[[], object]]) -> None:
    """Each call, on a thread of its own when there are several; returns once all have."""
    calls = list(calls)
    if len(calls) == 1:
        calls[0]()
        return
    threads = [threading.Thread(target=call, daemon=True) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


KIND = ResendKind(
    model=AlertmanagerNotifier, send=send, every=RESEND, no_digest="is an Alertmanager: it takes alerts, not a digest"
)
