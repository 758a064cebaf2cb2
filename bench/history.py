"""History at start-up: every month's daily bills (by endpoint, by item, and each endpoint's by
item) fetched over HTTP from the simulator (in a process of its own, `--latency` per answer),
against the wire limit: the requests made ÷ the requests in flight × the latency.

python -m bench.history [--endpoints 50] [--months 4] [--latency 0.05] [--concurrency 4]

Twice: as the daemon fetches once the account's bills and usage have their first figures (as many
requests at once as the client keeps in flight), then one listing at a time (as before them).
"""

from __future__ import annotations

import argparse
import time

from bench.common import SimSettings, client_for, simulator
from exporter.core.clock import Clock
from exporter.sources.history import HistorySource
from exporter.state import StateStore

TARGET = 1.3


def fetch(url: str, months: int, concurrency: int, wide: bool) -> tuple[float, int]:
    """(seconds, requests) of one cold fetch of the history."""
    calls: list[str] = []
    client = client_for(url, concurrency=concurrency)
    client._on_response = lambda api, code: calls.append(code)
    try:
        source = HistorySource(client, Clock(), StateStore(":memory:"), months, wide=lambda: wide)
        started = time.perf_counter()
        history = source.refresh()
        elapsed = time.perf_counter() - started
    finally:
        client.close()
    assert len(history.months) == months, list(history.months)
    assert set(calls) == {"200"}, set(calls)
    return elapsed, len(calls)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoints", type=int, default=50)
    parser.add_argument("--months", type=int, default=4)
    parser.add_argument("--latency", type=float, default=0.05)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args(argv)
    settings = SimSettings(endpoints=args.endpoints, latency=args.latency, spend_start="2025-01-01")
    with simulator(settings) as url:
        wide, requests = fetch(url, args.months, args.concurrency, wide=True)
        narrow, _ = fetch(url, args.months, args.concurrency, wide=False)
    limit = requests / args.concurrency * args.latency
    print(f"history: {args.months} months and the current one at {args.endpoints} endpoints, {requests} requests, "
          f"{args.latency * 1000:g} ms an answer, {args.concurrency} in flight; wire limit {limit:.2f} s")  # fmt: skip
    print(f"  one listing at a time: {narrow:.2f} s ({narrow / limit:.2f} × the wire limit)")
    print(f"  as many at once as in flight: {wide:.2f} s; ratio ÷ wire limit {wide / limit:.2f}  (target ≤ {TARGET:g})")


if __name__ == "__main__":
    main()
