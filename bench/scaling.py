"""Work that must grow linearly with endpoints and days: each measured at N and at 2N endpoints, and
at D and D/2 days, in one run; the ratio of the times is 2 for linear work (4 for quadratic).

python -m bench.scaling [--endpoints 1000] [--days 30] [--repeat 5]

- reconciliation: every settled day of the month's bills against its counted usage (run after
  every bills refresh), `days` days × N endpoints, 2 models, 3 items; and the function calls it
  makes at each size (`calls_made`), which a busy machine or the caches do not move.
"""

from __future__ import annotations

import argparse
import datetime as dt
from collections.abc import Callable
from decimal import Decimal

from bench.common import calls_made, median_seconds
from exporter.config.schema import DEFAULT_RECONCILED_ITEMS, PriceConfig
from exporter.model.snapshots import BillsSnapshot, DailyAmount, MonthBills, UsageRow
from exporter.sources.reconcile import reconcile

MODELS = ("model-a", "model-b")
PRICES = tuple(
    PriceConfig(model=m, prompt_per_million=Decimal("0.8"), completion_per_million=Decimal("2")) for m in MODELS
)


def _reconcile_inputs(endpoints: int, days: int) -> Callable[[], object]:
    month = [dt.date(2026, 10, 1) + dt.timedelta(days=d) for d in range(days)]
    names = [f"ep-{n:05d}" for n in range(endpoints)]
    settled: dict[dt.date, list[UsageRow]] = {
        day: [(e, m, "", 100, 50_000 + n, 20_000 + n, 1_000) for n, e in enumerate(names) for m in MODELS]
        for day in month
    }
    by_endpoint = tuple(
        DailyAmount("2026-10", day, e, "inference", "proj", Decimal("0.1234"), Decimal(0))
        for day in month
        for e in names
    )
    by_item = tuple(
        DailyAmount("2026-10", day, item, "inference", "proj", Decimal("1.5"), Decimal(70_000 * endpoints))
        for day in month
        for item in DEFAULT_RECONCILED_ITEMS
    )
    bills = BillsSnapshot((MonthBills("2026-10", by_endpoint, by_item, Decimal(0), Decimal(0), Decimal(0)),), month[-1])
    items = dict(DEFAULT_RECONCILED_ITEMS)
    return lambda: reconcile(bills, settled, items, PRICES)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoints", type=int, default=1000)
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    n = args.endpoints
    print(f"scaling: each at {n:,} and {2 * n:,} endpoints × {args.days} days, median of {args.repeat}")
    small = median_seconds(_reconcile_inputs(n, args.days), args.repeat)
    large = median_seconds(_reconcile_inputs(2 * n, args.days), args.repeat)
    print(f"  reconciliation: {small * 1000:.0f} ms → {large * 1000:.0f} ms; ratio {large / small:.2f}  "
          f"(linear 2, quadratic 4; target ≤ 2.5)")  # fmt: skip
    half, days = args.days // 2, args.days
    fewer = median_seconds(_reconcile_inputs(n, half), args.repeat)
    print(f"  reconciliation at {n:,} endpoints, {half} days → {days}: {fewer * 1000:.0f} ms → {small * 1000:.0f} ms;"
          f" ratio {small / fewer:.2f}  (linear {days / half:g}; target ≤ 2.5)")  # fmt: skip
    calls = {size: calls_made(_reconcile_inputs(*size)) for size in ((n, half), (n, days), (2 * n, days))}
    print(f"  the calls it makes: {', '.join(f'{c:,}' for c in calls.values())} (at {n:,} × {half}, {n:,} × {days},"
          f" {2 * n:,} × {days}); ratios {calls[n, days] / calls[n, half]:.2f} for the days,"
          f" {calls[2 * n, days] / calls[n, days]:.2f} for the endpoints (linear {days / half:g} and 2: a count,"
          f" which a busy machine, the caches or the garbage collector do not move)")  # fmt: skip


if __name__ == "__main__":
    main()
