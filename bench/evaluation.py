"""Alert evaluation with everything firing, at N, 10 × N and 20 × N endpoints: the daemon on a billing
API of the benchmark's own (each endpoint billed every day of the month so far, answered in
process), `--rules` spend rules by endpoint whose threshold every endpoint is over, evaluated
once to fire them all, then timed over `--repeat` evaluations (the steady state of an incident,
every `alerts.evaluation_interval`). Then a scrape of /metrics after them, the alerts unchanged
(OpenMetrics, gzipped, as Prometheus asks), timed over `--repeat` scrapes, beside rendering the
alerts' block afresh (and compressing it), which each scrape did before the block was kept.

python -m bench.evaluation [--endpoints 500] [--rules 10] [--repeat 5] [--rounds 3]

The sizes are measured in turn, `--rounds` times, and each ratio is the median of the rounds' (on
a shared machine a slower spell falls on every size). 10 × N ÷ N is over 10 where N's alerts and
bills fit the processor's caches and 10 × N's do not; 20 × N ÷ 10 × N, both out of them, shows
how the work grows, and so do the function calls an evaluation makes at each size (`calls_made`,
counted in the first round).
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import statistics
import tempfile
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import NamedTuple

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from bench.common import calls_made, median_seconds
from exporter.app.daemon import Daemon
from exporter.billing import BillRecord, UsagePage
from exporter.config.load import validate
from exporter.core.clock import Clock, FrozenClock
from exporter.metrics.alerts import AlertsCollector
from exporter.metrics.exposition import OPENMETRICS_ACCEPT, Exposition, deflate

TARGET = 0.5
"""Seconds for an evaluation at 5,000 endpoints and 10 rules, everything firing."""


class Billed:
    """The billing API as the daemon uses it, answering from a ledger made up here: `endpoints`
    each billed 1.00 for each of three items every day of the month so far; no usage."""

    base_url = "in-process://bench"
    project_id = ""
    page_size = 500
    concurrency = 1

    def __init__(self, endpoints: int, clock: Clock) -> None:
        self.names = [f"ep-{n:05d}" for n in range(endpoints)]
        self.clock = clock

    def bills(self, period: str, group_term: str, instance_id: str = "") -> list[BillRecord]:
        today = self.clock.today()
        days = [today.replace(day=d) for d in range(1, today.day + 1)] if period == f"{today:%Y-%m}" else []
        names = [instance_id] if instance_id else self.names
        items = ("ITEM_PROMPT_TOKEN", "ITEM_COMPLETION_TOKEN", "ITEM_CACHED_PROMPT_TOKEN")
        if group_term == "GROUP_TERM_INSTANCE":
            return [
                BillRecord(period, d, e, "", "inference", "proj", Decimal(3), Decimal(3000))
                for d in days
                for e in names
            ]
        if instance_id:
            return [
                BillRecord(period, d, instance_id, i, "inference", "proj", Decimal(1), Decimal(1000))
                for d in days
                for i in items
            ]
        n = Decimal(len(names))
        return [BillRecord(period, d, "", i, "inference", "proj", n, n * 1000) for d in days for i in items]

    def usage_pages(self, day: dt.date, first_page: int = 1, last_page: int | None = None) -> Iterator[UsagePage]:
        yield UsagePage(first_page, (), 0)

    def usage_page(self, day: dt.date, page_num: int) -> UsagePage:
        return UsagePage(page_num, (), 0)

    def adopt_cap(self, size: int) -> None:
        pass

    def carry_over(self, before: object) -> None:
        pass

    def close(self, cut: bool = True) -> None:
        pass


class Measured(NamedTuple):
    """Median seconds of each, and the alerts firing."""

    evaluation: float
    firing: int
    scrape: float
    """A scrape of /metrics with the alerts unchanged since the last."""
    rebuild: float
    """The alerts' block rendered afresh and compressed."""
    calls: int | None = None
    """The function calls an evaluation makes (counted when asked)."""


def measure(
    endpoints: int, rules: int, repeat: int, keep_firing_for: str = "0s", count: bool = False, day: int | None = None
) -> Measured:
    """With `keep_firing_for` as short as 1s, every alert still true is due to be saved again at
    each evaluation (`engine.TRUE_LAG`): the evaluation that writes them all, which a longer one
    has once in a tenth of it. `day`: the evaluations at noon on that day of November 2026 (the
    month billed up to it), not today."""
    clock = Clock()
    if day is not None:
        clock = Clock(clock.tz, FrozenClock(dt.datetime(2026, 11, day, 12, tzinfo=clock.tz)))
    with tempfile.TemporaryDirectory() as workdir:
        document = {
            "billing": {"url": "https://billing.invalid", "access_key_id": "AK", "secret_access_key": "secret",
                        "history_months": 0},
            "alerts": {"rules": [
                {"alert": f"Spend{n}", "signal": "spend", "window": "month", "by": ["endpoint_id"], "threshold": "0.5",
                 "keep_firing_for": keep_firing_for}
                for n in range(rules)
            ]},
            "state": {"path": str(Path(workdir) / "state.db")},
        }  # fmt: skip
        daemon = Daemon(validate(document, {}), clock=clock, billing=lambda c: Billed(endpoints, clock), serve=False)
        try:
            assert daemon.refresh("bills")
            assert daemon.refresh("usage")
            daemon.alert_cycle()  # everything fires
            firing = sum(a.state == "firing" for a in daemon.sources.engine.current())
            evaluation = median_seconds(daemon.alert_cycle, repeat)
            calls = calls_made(daemon.alert_cycle) if count else None
            exposition = daemon.sources.exposition
            assert isinstance(exposition, Exposition)
            exposition.render(OPENMETRICS_ACCEPT, gzipped=True)  # the first scrape since the alerts fired
            scrape = median_seconds(lambda: exposition.render(OPENMETRICS_ACCEPT, gzipped=True), repeat)
            registry = CollectorRegistry()
            registry.register(next(c for c in exposition.collectors if isinstance(c, AlertsCollector)))
            render = choose_encoder(OPENMETRICS_ACCEPT)[0]
            rebuild = median_seconds(lambda: deflate(render(registry)), repeat)
        finally:
            daemon.stop()
    return Measured(evaluation, firing, scrape, rebuild, calls)


def print_ratios(what: str, sizes: tuple[int, int, int], seconds: dict[int, list[float]]) -> None:
    """10 × N ÷ N and 20 × N ÷ 10 × N, each the median of the rounds' ratios."""
    small, large, larger = sizes
    for before, after, linear in ((small, large, 10), (large, larger, 2)):
        ratios = [b / a for a, b in zip(seconds[before], seconds[after], strict=True)]
        print(f"  {what}ratio at {after:,} ÷ at {before:,}, median of the rounds': {statistics.median(ratios):.1f} "
              f"(rounds: {', '.join(f'{r:.1f}' for r in ratios)}; linear: {linear})")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoints", type=int, default=500)
    parser.add_argument("--rules", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    today = Clock().today()
    sizes = (args.endpoints, 10 * args.endpoints, 20 * args.endpoints)
    large = sizes[1]
    listed = ", ".join(f"{n:,}" for n in sizes)
    print(f"alert evaluation, {args.rules} rules by endpoint, everything firing; the month billed up to today, day "
          f"{today.day} (how the work grows with the day: 28 November ÷ 14, below); {args.rounds} rounds of "
          f"{listed} endpoints in turn, each the median of {args.repeat} evaluations")  # fmt: skip
    rounds: dict[int, list[Measured]] = {n: [] for n in sizes}
    for round_num in range(args.rounds):  # (in turn, so that a slower spell of a shared machine falls on every size)
        for endpoints in sizes:
            rounds[endpoints].append(measure(endpoints, args.rules, args.repeat, count=round_num == 0))
    results = {n: [m.evaluation for m in measured] for n, measured in rounds.items()}
    for endpoints in sizes:
        runs = ", ".join(f"{s * 1000:.0f}" for s in results[endpoints])
        print(f"  {endpoints:,} endpoints ({rounds[endpoints][-1].firing:,} alerts firing): "
              f"{statistics.median(results[endpoints]) * 1000:.0f} ms an evaluation (rounds: {runs})")  # fmt: skip
    writing = measure(large, args.rules, args.repeat, keep_firing_for="1s").evaluation
    print(
        f"  {large:,} endpoints, every alert saved again (keep_firing_for: 1s): {writing * 1000:.0f} ms an evaluation"
    )
    print_ratios("", sizes, results)
    calls = [rounds[n][0].calls or 0 for n in sizes]
    print(f"  the calls an evaluation makes: {', '.join(f'{c:,}' for c in calls)}; ratios {calls[1] / calls[0]:.1f} "
          f"and {calls[2] / calls[1]:.1f} (linear: 10 and 2)")  # fmt: skip
    scrapes = {n: [m.scrape for m in measured] for n, measured in rounds.items()}
    for endpoints in sizes:
        shares = [m.scrape / m.rebuild for m in rounds[endpoints]]
        print(f"  {endpoints:,} endpoints, a scrape with unchanged alerts: "
              f"{statistics.median(scrapes[endpoints]) * 1000:.1f} ms, {statistics.median(shares):.3f} × rendering "
              f"the alerts' block afresh ({statistics.median(m.rebuild for m in rounds[endpoints]) * 1000:.0f} ms; "
              f"rounds: {', '.join(f'{r:.3f}' for r in shares)})")  # fmt: skip
    print_ratios("a scrape with unchanged alerts, ", sizes, scrapes)
    days = {day: measure(large, args.rules, args.repeat, day=day).evaluation for day in (14, 28)}
    print(f"  {large:,} endpoints, on 28 November ÷ on 14 (the month billed up to each day):"
          f" {days[14] * 1000:.0f} ms → {days[28] * 1000:.0f} ms, ratio {days[28] / days[14]:.2f}"
          f" (linear: at most 2)")  # fmt: skip
    at_large = statistics.median(results[large])
    print(f"  at {large:,}: {at_large:.2f} s  (target < {TARGET:g} s at 5,000 endpoints and 10 rules)")


if __name__ == "__main__":
    main()
