"""Work that grew faster than what it is given, each at a size and ten times it: the ratio of the
two times, median of `--rounds` rounds taken in turn (linear: 10); and the ratio of the function
calls the work makes at each (`calls_made`: a count, so a time ratio over 10 beside a count ratio
of 10 is the processor's caches, not more calls; the state file's queries count once each, and
there the time tells).

python -m bench.growth [--rounds 3] [--notifications 1000] [--endpoints 500] [--accounts 100] [--digests 40]
                       [--history 200]

- draining the outbox: N notifications waiting, each delivered in turn (the state file's work of
  a delivery: the next one found, marked delivered, rows a week old forgotten; no HTTP);
- budgets scoped on one endpoint each, a tenth of the endpoints with one and a rule each: an
  alert evaluation, and the budgets' metrics rendered;
- a spend rule by account and endpoint (everything firing) and a spend anomaly rule, over A
  accounts of 5 endpoints: an alert evaluation;
- digests over A accounts of 5 endpoints, the spend rule by account and endpoint firing: a round
  of digests, each account's made and queued;
- the months of history held in the state file read back at start-up, 4 months and the current
  one of E endpoints.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import calls_made, median_seconds
from bench.evaluation import Billed
from exporter.app.daemon import Daemon
from exporter.billing import BillRecord
from exporter.config.load import validate
from exporter.core.clock import Clock, FrozenClock, days_in_period, first_day
from exporter.metrics.collectors import BudgetCollector
from exporter.metrics.exposition import Exposition
from exporter.model.events import GroupEvent
from exporter.sources.history import HistorySource
from exporter.state import AlertStore, StateStore

Gauge = Callable[[Callable[[], object]], float]
"""What a case's work is measured with: seconds, or the calls it makes."""


def gauge(count: bool, repeat: int = 3) -> Gauge:
    """The calls the work makes (`count`), else the median seconds of `repeat` runs of it. Work
    that runs more than once is counted on its second run: what runs once only, the first time
    (formatting kept for later runs), is not in the median either."""
    if not count:
        return lambda work: median_seconds(work, repeat)

    def counted(work: Callable[[], object]) -> float:
        if repeat > 1:
            work()
        return float(calls_made(work))

    return counted


BILLING = {"url": "https://billing.invalid", "access_key_id": "AK", "secret_access_key": "secret", "history_months": 0}


def drain(waiting: int, count: bool = False) -> float:
    """Seconds (or calls) to deliver `waiting` notifications of one notifier, one after another."""
    event: GroupEvent = {
        "status": "firing", "alertname": "Spend", "dedup_key": "k", "alerts": [], "total": 1, "still_firing": 1,
    }  # fmt: skip
    now = time.time()
    with tempfile.TemporaryDirectory() as workdir:
        store = StateStore(Path(workdir) / "state.db")
        alerts = AlertStore(store)
        with store.transaction() as db:
            for _ in range(waiting):
                AlertStore.enqueue(db, "hook", event, now)

        def deliver() -> None:
            while (head := alerts.head("hook")) is not None:
                alerts.delivered(head.id, now)

        measured = gauge(count, 1)(deliver)
        store.close()
    return measured


def daemon_of(document: dict[str, Any], endpoints: int, workdir: str, clock: Clock | None = None) -> Daemon:
    clock = clock or Clock()
    config = validate(document | {"state": {"path": str(Path(workdir) / "state.db")}}, {})
    daemon = Daemon(config, clock=clock, billing=lambda c: Billed(endpoints, clock), serve=False)
    for account in config.accounts or [None]:
        name = f"{account.name}/" if account is not None else ""  # (an account's sources: `<account>/bills`)
        assert daemon.refresh(f"{name}bills")
        assert daemon.refresh(f"{name}usage")
    daemon.alert_cycle()  # (what fires, fires)
    return daemon


def budgets(endpoints: int, count: bool = False) -> tuple[float, float]:
    """(an evaluation, the budgets' render), with a budget on every tenth endpoint and a rule on each."""
    named = [
        {"name": f"ep-{n:05d}", "amount": "100", "where": {"endpoint_id": f"ep-{n:05d}"}}
        for n in range(0, endpoints, 10)
    ]
    rules = [{"alert": f"Budget{n}", "budget": budget["name"], "tiers": [0.5, 0.9]} for n, budget in enumerate(named)]
    with tempfile.TemporaryDirectory() as workdir:
        daemon = daemon_of({"billing": BILLING, "budgets": named, "alerts": {"rules": rules}}, endpoints, workdir)
        try:
            exposition = daemon.sources.exposition
            assert isinstance(exposition, Exposition)  # (one account)
            collector = next(c for c in exposition.collectors if isinstance(c, BudgetCollector))
            measure = gauge(count)
            return measure(daemon.alert_cycle), measure(lambda: list(collector.collect()))
        finally:
            daemon.stop()


SPEND_BY_ACCOUNT = {
    "alert": "Spend", "signal": "spend", "window": "month", "by": ["account", "endpoint_id"], "threshold": "0.5",
}  # fmt: skip
"""Every endpoint is over it (`Billed`): an alert each, firing."""


def accounts(accounts: int, count: bool = False) -> float:
    """An evaluation over `accounts` accounts of 5 endpoints, a spend rule by account and endpoint firing."""
    document = {
        "accounts": [{"name": f"a{n:04d}", "billing": BILLING} for n in range(accounts)],
        "alerts": {"rules": [
            SPEND_BY_ACCOUNT,
            {"alert": "Anomaly", "signal": "spend_anomaly", "by": ["endpoint_id"], "min_amount": "0",
             "min_percent": "1"},
        ]},
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as workdir:
        daemon = daemon_of(document, 5, workdir)
        try:
            return gauge(count)(daemon.alert_cycle)
        finally:
            daemon.stop()


def digests(accounts: int, count: bool = False) -> float:
    """Seconds (or calls) to make and queue the digests of `accounts` accounts of 5 endpoints (each its own
    billing account: each digest's days are looked up among those its account's digests told), a
    spend rule by account and endpoint firing: the daemon is made an hour before the digests'
    time, then its clock is moved to it (each daemon makes its digests once)."""
    zone = Clock().tz
    frozen = FrozenClock(dt.datetime.combine(dt.datetime.now(zone).date(), dt.time(10), zone))
    document = {
        "accounts": [
            {"name": f"a{n:04d}", "billing": BILLING | {"access_key_id": f"AK{n:04d}"}} for n in range(accounts)
        ],
        "alerts": {"rules": [SPEND_BY_ACCOUNT], "notifiers": [{"name": "finance", "type": "webhook",
                                                            "url": "https://hook.invalid"}]},
        "digest": {"notifiers": ["finance"], "at": "11:00"},
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as workdir:
        daemon = daemon_of(document, 5, workdir, Clock(zone, frozen))
        try:
            frozen.advance(dt.timedelta(hours=1))
            measured = gauge(count, 1)(daemon.digest_cycle)
            assert daemon.dispatcher.pending() == {"finance": accounts}, "a digest per account, and nothing else"
            return measured
        finally:
            daemon.stop()


class BilledBefore(Billed):
    """`Billed`, with every day of the months before this one billed too."""

    def bills(self, period: str, group_term: str, instance_id: str = "") -> list[BillRecord]:
        if period == f"{self.clock.today():%Y-%m}":
            return super().bills(period, group_term, instance_id)
        last = dt.datetime.combine(first_day(period).replace(day=days_in_period(period)), dt.time(12), dt.UTC)
        return Billed(len(self.names), Clock(now_fn=FrozenClock(last))).bills(period, group_term, instance_id)


def history(endpoints: int, count: bool = False, months: int = 4) -> float:
    """Seconds (or calls) to read back `months` months and the current one of `endpoints` endpoints."""
    clock = Clock()
    with tempfile.TemporaryDirectory() as workdir:
        store = StateStore(Path(workdir) / "state.db")
        HistorySource(BilledBefore(endpoints, clock), clock, store, months).refresh()
        again = HistorySource(BilledBefore(endpoints, clock), clock, store, months)
        measured = gauge(count, 1)(again._stored)
        held = len(again._stored())
        store.close()
    assert held == months + 1, (held, months)  # (the ledger bills every month: each is held, and the current one)
    return measured


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--notifications", type=int, default=1_000)
    parser.add_argument("--endpoints", type=int, default=500, help="for the budgets")
    parser.add_argument("--history", type=int, default=200, help="endpoints, for the history")
    parser.add_argument("--accounts", type=int, default=100)
    parser.add_argument("--digests", type=int, default=40, help="accounts, for the digests")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    cases: list[tuple[str, int, Callable[[int, bool], tuple[float, ...]]]] = [
        ("draining the outbox, notifications", args.notifications, lambda n, count: (drain(n, count),)),
        ("budgets on an endpoint each (evaluation; render), endpoints", args.endpoints, budgets),
        ("spend and anomaly rules over accounts (evaluation), accounts", args.accounts,
         lambda n, count: (accounts(n, count),)),
        ("digests over accounts (a round of digests), accounts", args.digests, lambda n, count: (digests(n, count),)),
        ("history read back at start-up, endpoints", args.history, lambda n, count: (history(n, count),)),
    ]  # fmt: skip
    print(f"growth: each at N and 10 × N, {args.rounds} rounds in turn; ratio 10 × N ÷ N, median of the rounds'")
    for what, size, measure in cases:
        results: dict[int, list[tuple[float, ...]]] = {size: [], 10 * size: []}
        for _ in range(args.rounds):
            for n in results:
                results[n].append(measure(n, False))
        parts = len(results[size][0])
        times = "; ".join(
            " and ".join(f"{statistics.median(r[i] for r in results[n]) * 1000:.0f} ms" for i in range(parts))
            for n in results
        )
        ratios = "; ".join(
            f"{statistics.median(b[i] / a[i] for a, b in zip(results[size], results[10 * size], strict=True)):.1f}"
            for i in range(parts)
        )
        print(f"  {what} {size:,} → {10 * size:,}: {times}; ratio {ratios}  (linear: 10)")
        calls = [measure(n, True) for n in results]
        print(f"    the calls it makes: {'; '.join(' and '.join(f'{c:,.0f}' for c in made) for made in calls)};"
              f" ratio {'; '.join(f'{b / a:.1f}' for a, b in zip(*calls, strict=True))}  (linear: 10)")  # fmt: skip


if __name__ == "__main__":
    main()
