"""The API cost of reconciliation, and its effect on today's sync.

A settled day is read once in full: its pages are counted. Today's figures come first in a
usage refresh (the settled reads follow it), so the time from a refresh's start to today's
snapshot is measured with and without a settled day read in the same refresh.

python -m bench.reconcile [--records 200000] [--polls 5]
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import time

from bench.common import client_for
from exporter.core.clock import Clock
from exporter.sim import Simulator
from exporter.sources.reconcile import SettledUsage
from exporter.sources.usage import UsageSync
from exporter.state import StateStore

PAGE_SIZE = 500


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--polls", type=int, default=5)
    args = parser.parse_args(argv)
    clock = Clock()
    today = clock.today()
    sim = Simulator(latency=0.02)
    sim.add_usage(args.records, today - dt.timedelta(days=1))
    sim.add_usage(20_000)
    server = sim.serve()
    calls: list[str] = []
    try:
        client = client_for(server.url, page_size=PAGE_SIZE, concurrency=4)
        client._on_response = lambda api, code: calls.append(api)
        store = StateStore(":memory:")
        sync = UsageSync(client, clock, store, per_api_key=False)
        sync.refresh()
        alone, together = [], []
        for n in range(args.polls * 2):
            sim.add_usage(1000)
            started = time.perf_counter()
            sync.refresh()  # today's figures are published here
            (together if n % 2 else alone).append(time.perf_counter() - started)
            if n % 2:
                calls.clear()
                # A reconciler that holds no settled day (it keeps what it read in memory): it reads the day again.
                settled = SettledUsage(client, clock, StateStore(":memory:"), settle=0.0, days_per_refresh=1,
                                       per_api_key=False)  # fmt: skip
                settled.refresh(today - dt.timedelta(days=1))
                pages = len(calls)
        client.close()
    finally:
        server.stop()
    ratio = statistics.median(together) / statistics.median(alone)
    print(f"reconciliation: a settled day of {args.records:,} records read in full: {pages} pages (once per day)")
    print(f"  today's sync with a settled day read in the same refresh ÷ without: {ratio:.2f}  (target ≤ 1.1)")


if __name__ == "__main__":
    main()
