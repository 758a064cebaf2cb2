"""/metrics render time at ~20k series, idle and while a usage sync is running; a gzip scrape's cost,
with the body compressed whole per scrape (before) and joined from pieces cached per snapshot (now).

python -m bench.render [--endpoints 700]
"""

from __future__ import annotations

import argparse
import gzip
import statistics
import threading
import time
from collections.abc import Callable

import requests
from prometheus_client import CollectorRegistry, generate_latest

from bench.common import SimSettings, add_usage, client_for, simulator
from exporter.app.account import build_exposition
from exporter.config.load import validate
from exporter.core.clock import Clock
from exporter.metrics.exposition import GZIP_LEVEL
from exporter.model.snapshots import Latest
from exporter.sources.bills import BillsSource
from exporter.sources.usage import UsageSync
from exporter.state import StateStore
from exporter.web import ExporterServer, View

RUNS = 200


def render_times(
    render: Callable[[], object], runs: int = RUNS, timer: Callable[[], float] = time.perf_counter
) -> list[float]:
    times = []
    for _ in range(runs):
        started = timer()
        render()
        times.append(timer() - started)
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

        def whole() -> bytes:
            """A gzip scrape's body as it was made before: the text rendered, then compressed whole."""
            return gzip.compress(exposition.render()[0], compresslevel=GZIP_LEVEL)

        def from_pieces() -> bytes:
            return exposition.render(gzipped=True)[0]

        sizes = len(whole()), len(from_pieces())  # the pieces are compressed (and cached) here
        gzip_cpu = (
            render_times(whole, runs=30, timer=time.thread_time),
            render_times(from_pieces, timer=time.thread_time),
        )

        def sources() -> list[str]:
            return ["bills", "usage"]

        server = ExporterServer(
            ("127.0.0.1", 0),
            View(latest, exposition.render, sources, render_gzipped=lambda accept: exposition.render(accept, True)),
            config.server,
        )
        before = ExporterServer(("127.0.0.1", 0), View(latest, exposition.render, sources), config.server)
        server.start()
        before.start()
        session = requests.Session()

        def scrape(url: str = server.url) -> None:
            """As Prometheus scrapes: one kept-alive connection, gzip asked for."""
            session.get(f"{url}/metrics", timeout=30).raise_for_status()

        def fresh_scrape() -> None:
            with requests.Session() as fresh:
                fresh.get(f"{server.url}/metrics", timeout=30).raise_for_status()

        idle = render_times(lambda: exposition.render())
        idle_http = render_times(scrape, runs=30)
        fresh_http = render_times(fresh_scrape, runs=30)
        before_http = render_times(lambda: scrape(before.url), runs=30)
        before.stop()
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
    whole_ms, pieces_ms = (statistics.median(times) * 1000 for times in gzip_cpu)
    print(f"  gzip body, compressed whole per scrape (before): {whole_ms:.1f} ms CPU, {sizes[0] / 1e3:.0f} kB")
    print(f"  gzip body, from pieces cached per snapshot (now): {pieces_ms:.1f} ms CPU, {sizes[1] / 1e3:.0f} kB")
    before_ms = statistics.median(before_http) * 1000
    print(f"  median gzip HTTP scrape, kept alive: {before_ms:.1f} ms before, {idle_http_ms:.1f} ms now")


if __name__ == "__main__":
    main()
