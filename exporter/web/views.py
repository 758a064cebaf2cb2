"""What the server shows (`View`, read afresh on each request) and its JSON views: readiness, the alerts and the
bill's disagreements with the usage."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from exporter.alerts.alert import Alert
from exporter.config.schema import BudgetConfig, PriceConfig
from exporter.core.clock import iso
from exporter.digest.build import disagreeing, gap_entry
from exporter.model.snapshots import Latest, SourceHealth, TokenGap


@dataclass(frozen=True)
class AccountView:
    """One account of several, as the landing page shows it."""

    name: str
    latest: Latest
    budgets: Sequence[BudgetConfig]
    prices: Sequence[PriceConfig]


@dataclass(frozen=True)
class View:
    """What the server shows; callables, so a config reload is seen at once."""

    latest: Latest
    render: Callable[[str], tuple[bytes, str]]
    """The exposition for an `Accept` header, and its content type."""
    sources: Callable[[], Sequence[str]]
    render_gzipped: Callable[[str], tuple[bytes, str]] | None = None
    """The same as one gzip member, for a client that accepts gzip, when the exposition compresses it cheaper than
    the server would (Exposition does: from pieces cached per snapshot)."""
    alerts: Callable[[], Sequence[Alert]] = list
    budgets: Callable[[], Sequence[BudgetConfig]] = tuple
    prices: Callable[[], Sequence[PriceConfig]] = tuple
    """What budgets scoped on usage are priced with."""
    today: Callable[[], dt.date | None] = lambda: None
    """The billing zone's day: a budget's figures of a day or month that has ended are not shown as current."""
    now: Callable[[], float] = time.time
    """The billing clock's time, which the sources' timestamps are in."""
    health: Callable[[], Mapping[str, SourceHealth]] | None = None
    """Each of `sources` with its health (with several accounts, `prod/bills`); `latest`'s when None."""

    accounts: Callable[[], Sequence[AccountView] | None] | None = None
    """With several accounts, each one's snapshots, budgets and prices (None: one account, `latest`);
    asked on each request, since a reload may turn one account into several or back."""
    shared_budgets: Callable[[], Sequence[BudgetConfig]] = tuple
    """With several accounts, the budgets that span them."""
    awaited: Callable[[], Sequence[str]] | None = None
    """The sources readiness waits for (every one of `sources` when None)."""
    served: threading.Event = field(default_factory=threading.Event)
    """Set once ready: from then on, with several accounts, an account a reload adds (or renames)
    is not waited for to be tried (`ready`)."""

    def sources_health(self) -> Mapping[str, SourceHealth]:
        return self.latest.health if self.health is None else self.health()


def awaited(view: View) -> list[str]:
    """The sources readiness waits for (`View.awaited`), as they are now: not matched against
    `sources`, which a reload between the two reads may have changed (none would match, and
    readiness would wait for nothing)."""
    return list(view.sources() if view.awaited is None else view.awaited())


def ready(view: View) -> tuple[bool, dict[str, str]]:
    """Whether there is something to serve: each source readiness waits for (`awaited`) has
    refreshed successfully at least once; with several accounts, those of one account at least,
    and the others' have each been tried once (so that an account whose API refuses its key, or a
    reload added with a typo, does not keep the others' figures out of service, yet a pod starting
    is not in service before each account has been read or found failing). And every source's
    state (those it does not wait for too)."""
    health = view.sources_health()
    states = {}
    for source in view.sources():
        entry = health.get(source)
        if entry is None:
            states[source] = "not refreshed yet"
        elif entry.last_success is None:
            states[source] = "never succeeded"
        else:
            states[source] = "ok" if entry.success else "failing (serving last good data)"
    accounts: dict[str, list[str]] = {}
    for source in awaited(view):  # (`prod/bills`: account names hold no `/`)
        accounts.setdefault(source.rpartition("/")[0], []).append(source)
    serving = [
        all(source in health and health[source].last_success is not None for source in sources)
        for sources in accounts.values()
    ]
    tried = all(source in health for sources in accounts.values() for source in sources)
    # With several accounts, each is tried before the first time in service (a pod starting); not an
    # account a reload adds later: its API hanging would take the others' figures out of service.
    is_ready = all(serving) if len(accounts) < 2 else any(serving) and (tried or view.served.is_set())
    if is_ready:
        view.served.set()
    return is_ready, states


def alerts_document(view: View) -> dict[str, object]:
    """/api/v1/alerts, shaped like Prometheus' own: pending, firing and recently resolved alerts."""
    alerts = [
        {
            "labels": alert.labels,
            "annotations": alert.annotations,
            "state": alert.state,
            "activeAt": iso(alert.active_since),
            "firedAt": iso(alert.fired_at) if alert.fired_at else None,
            "resolvedAt": iso(alert.resolved_at) if alert.resolved_at else None,
            "value": alert.value,
        }
        for alert in view.alerts()
    ]
    return {"status": "success", "data": {"alerts": alerts}}


def reconciliation_document(view: View) -> dict[str, object]:
    """/api/v1/reconciliation: every figure of the settled days whose bill disagrees with the usage counted (the
    landing page shows the largest few), as the digest gives them, with `what` the page's column; with several
    accounts, each with its `account`."""
    several = view.accounts() if view.accounts is not None else None
    results = [(None, view.latest)] if several is None else [(a.name, a.latest) for a in several]
    disagreements = [
        ({} if account is None else {"account": account})
        | gap_entry(gap)
        | {"what": "tokens" if isinstance(gap, TokenGap) else "amount"}
        for account, latest in results
        for gap in disagreeing(latest.reconciliation)
    ]
    return {"status": "success", "data": {"disagreements": disagreements}}
