"""The landing page's render time with its month chart, at 50 endpoints billed every day of a month so far (the
30th of a 31-day month: 30 stacked bars, one forecast bar), four monthly budgets and a daily one.

python -m bench.chart [--endpoints 50] [--runs 200]
"""

from __future__ import annotations

import argparse
import datetime as dt
import time
from decimal import Decimal
from zoneinfo import ZoneInfo

import requests

from bench.render import render_times
from exporter.billing import BillingClient
from exporter.config.load import validate
from exporter.config.schema import BudgetConfig
from exporter.core.clock import Clock, FrozenClock
from exporter.model.snapshots import Latest
from exporter.sim import Endpoint, Simulator
from exporter.sources.bills import BillsSource
from exporter.web import ExporterServer, View, landing_page
from exporter.web.chart import month_chart

TARGET_MS = 20.0
ZONE = ZoneInfo("Asia/Shanghai")
TODAY = dt.datetime(2026, 12, 30, 10, 0, tzinfo=ZONE)


def _ms(times: list[float], quantile: float = 0.5) -> float:
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))] * 1000


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoints", type=int, default=50)
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args(argv)
    clock = Clock(ZONE, FrozenClock(TODAY))
    # In this process: the simulator checks signatures against its own clock, which must be the frozen one.
    sim = Simulator(clock=clock)
    sim.endpoints = tuple(Endpoint(f"ep-{n:04d}", f"model-{n % 7}", f"proj-{n % 3}") for n in range(args.endpoints))
    server = sim.serve()
    try:
        billing = {"url": server.url, "access_key_id": sim.access_key_id, "secret_access_key": sim.secret_access_key}
        config = validate({"billing": billing}, {})
        with BillingClient.from_config(config.billing, clock) as client:
            latest = Latest(bills=BillsSource(client, clock, 3).refresh())
    finally:
        server.stop()
    assert latest.bills is not None
    month, today = latest.bills.current, latest.bills.today
    budgets = [BudgetConfig(name=f"budget-{n}", amount=Decimal(10_000 * n)) for n in range(1, 5)]
    budgets.append(BudgetConfig(name="daily", amount=Decimal(500), period="day"))
    monthly = [(b.name, b.amount) for b in budgets if b.period == "month"]
    sources = ["bills", "usage", "history"]
    view = View(latest, lambda accept: (b"", "text/plain"), lambda: sources, budgets=lambda: budgets)

    page = landing_page(view)
    chart = month_chart(month, today, monthly)
    assert chart in page
    days = len({a.day for a in month.by_endpoint})
    whole = render_times(lambda: landing_page(view), runs=args.runs)
    whole_cpu = render_times(lambda: landing_page(view), runs=args.runs, timer=time.thread_time)
    alone = render_times(lambda: month_chart(month, today, monthly), runs=args.runs)

    http = ExporterServer(("127.0.0.1", 0), view, config.server)
    http.start()
    try:
        with requests.Session() as session:

            def get() -> None:
                session.get(f"{http.url}/", timeout=30).raise_for_status()

            over_http = render_times(get, runs=min(args.runs, 100))
    finally:
        http.stop()

    print(
        f"landing page with the month chart: {args.endpoints} endpoints × {days} days "
        f"({len(month.by_endpoint)} bill rows), {len(monthly)} monthly budgets"
    )
    print(f"  page {len(page.encode()) / 1e3:.0f} kB, of which the chart {len(chart.encode()) / 1e3:.0f} kB")
    print(
        f"  landing_page(): median {_ms(whole):.2f} ms, p95 {_ms(whole, 0.95):.2f} ms, max {max(whole) * 1000:.2f} ms"
        f" (target < {TARGET_MS:.0f} ms: median ÷ target {_ms(whole) / TARGET_MS:.2f});"
        f" median CPU {_ms(whole_cpu):.2f} ms"
    )
    print(f"  month_chart() alone: median {_ms(alone):.2f} ms, p95 {_ms(alone, 0.95):.2f} ms")
    print(f"  GET / over HTTP (kept alive, gzip): median {_ms(over_http):.2f} ms, p95 {_ms(over_http, 0.95):.2f} ms")


if __name__ == "__main__":
    main()
