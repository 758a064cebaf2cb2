"""Refresh time when 5% of the API's answers fail (500/502/503/429) ÷ when none do.

python -m bench.faults [--records 100000] [--latency 0.05] [--failure-rate 0.05]
"""

from __future__ import annotations

import argparse
import time

from bench.common import SimSettings, client_for, simulator
from exporter.core.clock import Clock
from exporter.sources.usage import UsageSync
from exporter.state import StateStore


def timed_sync(records: int, latency: float, failure_rate: float) -> tuple[float, int]:
    calls: list[str] = []
    with simulator(SimSettings(records=records, latency=latency, failure_rate=failure_rate)) as url:
        client = client_for(url, page_size=500, concurrency=4)
        client._on_response = lambda api, code: calls.append(code)
        sync = UsageSync(client, Clock(), StateStore(":memory:"), per_api_key=False)
        started = time.perf_counter()
        snapshot = sync.refresh()
        elapsed = time.perf_counter() - started
        client.close()
    assert snapshot.records == records, snapshot.records
    return elapsed, sum(code != "200" for code in calls)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--latency", type=float, default=0.05)
    parser.add_argument("--failure-rate", type=float, default=0.05)
    args = parser.parse_args(argv)
    clean, _ = timed_sync(args.records, args.latency, 0.0)
    faulty, failures = timed_sync(args.records, args.latency, args.failure_rate)
    print(f"full-day sync of {args.records} records: {clean:.2f}s clean, {faulty:.2f}s with "
          f"{args.failure_rate:.0%} failing ({failures} failed answers, each retried with backoff)")  # fmt: skip
    print(f"  ratio refresh time with failures ÷ without: {faulty / clean:.2f}  (target ≤ 1.5)")


if __name__ == "__main__":
    main()
