"""Alert evaluation with everything firing, at N, 10 × N and 20 × N endpoints: the daemon on a billing
API of the benchmark's own (each endpoint billed every day of the month so far, answered in
process), `--rules` spend rules by endpoint whose threshold every endpoint is over, evaluated
once to fire them all, then timed over `--repeat` evaluations (the steady state of an incident,
every `alerts.evaluation_interval`).

python -m bench.evaluation [--endpoints 500] [--rules 10] [--repeat 5] [--rounds 3]

The sizes are measured in turn, `--rounds` times, and each ratio is the median of the rounds' (on
a shared machine a slower spell falls on every size). 10 × N ÷ N is over 10 where N's alerts and
bills fit the processor's caches and 10 × N's do not; 20 × N ÷ 10 × N, both out of them, shows
how the work grows.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import statistics
import tempfile
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

from exporter.app.daemon import Daemon
from exporter.billing import BillRecord, UsagePage
from exporter.config.load import validate
from exporter.core.clock import Clock

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

    def close(self) -> None:
        pass


def measure(endpoints: int, rules: int, repeat: int, keep_firing_for: str = "0s") -> tuple[float, int]:
    """(median seconds of an evaluation, alerts firing). With `keep_firing_for` as short as 1s,
    every alert still true is due to be saved again at each evaluation (`engine.TRUE_LAG`): the
    evaluation that writes them all, which a longer one has once in a tenth of it."""
    clock = Clock()
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
            times = []
            for _ in range(repeat):
                started = time.perf_counter()
                daemon.alert_cycle()
                times.append(time.perf_counter() - started)
        finally:
            daemon.stop()
    return statistics.median(times), firing


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
    small, large, larger = sizes
    listed = ", ".join(f"{n:,}" for n in sizes)
    print(f"alert evaluation, {args.rules} rules by endpoint, everything firing; the month billed up to today, day "
          f"{today.day} (the work grows with the day of the month); {args.rounds} rounds of {listed} endpoints in "
          f"turn, each the median of {args.repeat} evaluations")  # fmt: skip
    results: dict[int, list[float]] = {n: [] for n in sizes}
    firing: dict[int, int] = {}
    for _ in range(args.rounds):  # (in turn, so that a slower spell of a shared machine falls on every size)
        for endpoints in sizes:
            seconds, firing[endpoints] = measure(endpoints, args.rules, args.repeat)
            results[endpoints].append(seconds)
    for endpoints in sizes:
        runs = ", ".join(f"{s * 1000:.0f}" for s in results[endpoints])
        print(f"  {endpoints:,} endpoints ({firing[endpoints]:,} alerts firing): "
              f"{statistics.median(results[endpoints]) * 1000:.0f} ms an evaluation (rounds: {runs})")  # fmt: skip
    writing, _ = measure(large, args.rules, args.repeat, keep_firing_for="1s")
    print(
        f"  {large:,} endpoints, every alert saved again (keep_firing_for: 1s): {writing * 1000:.0f} ms an evaluation"
    )
    for before, after, linear in ((small, large, 10), (large, larger, 2)):
        ratios = [b / a for a, b in zip(results[before], results[after], strict=True)]
        print(f"  ratio at {after:,} ÷ at {before:,}, median of the rounds': {statistics.median(ratios):.1f} "
              f"(rounds: {', '.join(f'{r:.1f}' for r in ratios)}; linear: {linear})")  # fmt: skip
    at_large = statistics.median(results[large])
    print(f"  at {large:,}: {at_large:.2f} s  (target < {TARGET:g} s at 5,000 endpoints and 10 rules)")


if __name__ == "__main__":
    main()
