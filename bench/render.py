"""/metrics render time at ~20k series, idle and while a usage sync is running.

python -m bench.render [--endpoints 700]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import requests
from prometheus_client import CollectorRegistry, generate_latest

from bench.common import SimSettings, add_usage, client_for, simulator
from exporter.bills import BillsSource
from exporter.clock import Clock
from exporter.config import validate
from exporter.daemon import build_exposition
from exporter.server import ExporterServer, View
from exporter.snapshots import Latest
from exporter.state import StateStore
from exporter.usage_sync import UsageSync

RUNS = 200


def render_times(render: object, runs: int = RUNS) -> list[float]:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        render()  # type: ignore[operator]
        times.append(time.perf_counter() - started)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoints", type=int, default=700)
    parser.add_argument("--sync-records", type=int, default=200_000)
    args = parser.parse_args(argv)
    clock = Clock()
    with simulator(SimSettings(records=20_000, endpoints=args.endpoints, latency=0.05)) as url:
        client = client_for(url, page_size=500, concurrency=4)
        latest = Latest()
        latest.bills = BillsSource(client, clock, 3).refresh()
        sync = UsageSync(client, clock, StateStore(":memory:"), per_api_key=False)
        latest.usage = sync.refresh()
        config = validate({"billing": {"url": url, "access_key_id": "x", "secret_access_key": "y"}}, {})
        exposition = build_exposition(config, latest, clock)
        text, _ = exposition.render()
        series = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
        registry = CollectorRegistry()
        for collector in exposition.collectors:
            registry.register(collector)
        uncached = render_times(lambda: generate_latest(registry), runs=5)

        view = View(latest, exposition.render, lambda: ["bills", "usage"])
        server = ExporterServer(("127.0.0.1", 0), view, config.server)
        server.start()
        session = requests.Session()

        def scrape() -> None:
            """As Prometheus scrapes: one kept-alive connection, gzip asked for."""
            session.get(f"{server.url}/metrics", timeout=30).raise_for_status()

        def fresh_scrape() -> None:
            with requests.Session() as fresh:
                fresh.get(f"{server.url}/metrics", timeout=30).raise_for_status()

        idle = render_times(lambda: exposition.render())
        idle_http = render_times(scrape, runs=30)
        fresh_http = render_times(fresh_scrape, runs=30)
        add_usage(url, args.sync_records)
        sync_thread = threading.Thread(
            target=lambda: UsageSync(client, clock, StateStore(":memory:"), per_api_key=False).refresh()
        )
        sync_thread.start()
        time.sleep(0.5)
        busy = render_times(lambda: exposition.render())
        busy_http = render_times(scrape, runs=30)
        still_running = sync_thread.is_alive()
        sync_thread.join()
        client.close()
        server.stop()

    idle_ms, busy_ms = statistics.median(idle) * 1000, statistics.median(busy) * 1000
    print(f"/metrics render: {series} series, {len(text) / 1e6:.1f} MB")
    print(f"  uncached render (every family built and formatted): {statistics.median(uncached) * 1000:.0f} ms")
    print(f"  median render time, idle: {idle_ms:.1f} ms  (target ≤ 100 ms)")
    print(f"  median render time while a sync runs: {busy_ms:.1f} ms (sync still running at the end: {still_running})")
    print(f"  ratio during sync ÷ idle: {busy_ms / idle_ms:.2f}  (target: unchanged, ≈ 1)")
    idle_http_ms, busy_http_ms = statistics.median(idle_http) * 1000, statistics.median(busy_http) * 1000
    print(f"  median HTTP scrape of /metrics, idle: {idle_http_ms:.1f} ms; while a sync runs: {busy_http_ms:.1f} ms")
    print(f"  ratio during sync ÷ idle (HTTP): {busy_http_ms / idle_http_ms:.2f}")
    fresh_ms = statistics.median(fresh_http) * 1000
    print(f"  gzip scrape on a kept-alive connection ÷ on a fresh one: {idle_http_ms / fresh_ms:.2f}  (target ≤ 1)")


if __name__ == "__main__":
    main()
