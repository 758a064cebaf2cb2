"""The month-end forecast backtested over a year of simulated history per seed: its mean absolute
percentage error by day of the month against today's formula and a naive one (month to date ÷ days
elapsed × days in the month), and how often the month's actual total fell inside its interval.

History: `SpendModel` from 1 January (±15% noise a line, weekly rhythm, `--growth` a month) for the
default endpoints × items, with `--spikes` spikes a month on average (×1.6–2.5 on a random day, on
an endpoint, an item or the whole account), drawn from the seed. Each month of the year is
backtested as the daemon would have forecast it with `billing.history_months` 3: January with no
history at all, February with one month, March with two.

Done when the interval holds the actual total within ±10 points of its level over the months and
seeds, and the model's error is no worse than today's formula's on any day of the month, and
better on average.

python -m bench.forecast [--seed 1] [--seeds 10] [--spikes 2] [--growth 0.03] [--level 0.8]
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import time
from collections.abc import Sequence
from decimal import Decimal

from exporter.core.clock import periods_between
from exporter.replay.forecast_backtest import Errors, Forecasted, by_day_of_month, errors, replay_forecasts
from exporter.sim import DEFAULT_ENDPOINTS, ITEMS, SpendModel, Spike

START = dt.date(2026, 1, 1)
FIRST, LAST = "2026-01", "2026-12"
HISTORY_MONTHS = 3
GRACE_DAYS = 3
ENDPOINTS = tuple(e.endpoint_id for e in DEFAULT_ENDPOINTS)
GROUPS = (*ENDPOINTS, *ITEMS, "")
BUCKETS = ((1, 7), (8, 14), (15, 21), (22, 31))
ROOM = 0.10
"""The coverage's target: within ± this of the level."""


def account_days(seed: int, spikes: float, growth: float = 0.03) -> dict[str, dict[dt.date, Decimal]]:
    """The account's daily totals by month over the year, with about `spikes` spikes a month."""
    model = SpendModel(START, seed=seed, growth=growth)
    rng = random.Random(seed)
    year = [START + dt.timedelta(days=n) for n in range(365)]
    model.spikes = [
        Spike(day, rng.choice(GROUPS), round(rng.uniform(1.6, 2.5), 2))
        for day in sorted(rng.sample(year, round(spikes * 12)))
    ]
    months: dict[str, dict[dt.date, Decimal]] = {}
    for day in year:
        total = sum((model.amount(day, e, i) for e in ENDPOINTS for i in ITEMS), Decimal(0))
        months.setdefault(f"{day:%Y-%m}", {})[day] = total
    return months


def run(seed: int, spikes: float, growth: float, level: float) -> list[Forecasted]:
    months = account_days(seed, spikes, growth)
    return replay_forecasts(months, FIRST, LAST, history_months=HISTORY_MONTHS, grace_days=GRACE_DAYS, level=level)


def _pct(value: float) -> str:
    return f"{value * 100:.2f}%"


def _three(e: Errors) -> str:
    return f"{_pct(e.model)} / {_pct(e.formula)} / {_pct(e.naive)}"


def _measured(rows: Sequence[Forecasted]) -> Errors:
    found = errors(rows)
    assert found is not None, "no forecast with days left"
    return found


def report_seed(seed: int, rows: Sequence[Forecasted]) -> None:
    parts = [
        f"{low}–{high} {_three(_measured([r for r in rows if low <= r.day.day <= high]))}" for low, high in BUCKETS
    ]
    overall = _measured(rows)
    print(f"  seed {seed:>2}: days {';  '.join(parts)};  all {_three(overall)};  inside {_pct(overall.inside)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--seeds", type=int, default=10, help="seeds seed … seed + N − 1")
    parser.add_argument("--spikes", type=float, default=2.0, help="spikes a month, on average")
    parser.add_argument("--growth", type=float, default=0.03, help="growth a month")
    parser.add_argument("--level", type=float, default=0.8, help="the interval's level")
    args = parser.parse_args(argv)
    seeds = range(args.seed, args.seed + max(1, args.seeds))
    months = len(periods_between(FIRST, LAST))
    print(
        f"forecast backtest, {FIRST} … {LAST} ({months} months, history from {START}, history_months "
        f"{HISTORY_MONTHS}), ~{args.spikes:g} spikes a month, growth {args.growth:.0%} a month; mean absolute "
        "error of the month's total, model / today's formula / naive, at the end of days …:"
    )
    every: list[Forecasted] = []
    by_seed: list[Errors] = []
    started = time.perf_counter()
    for seed in seeds:
        rows = run(seed, args.spikes, args.growth, args.level)
        every += rows
        by_seed.append(_measured(rows))
        report_seed(seed, rows)
    seconds = time.perf_counter() - started
    print(f"by day of the month, seeds {seeds[0]}…{seeds[-1]} together:")
    worse = []
    for number, e in by_day_of_month(every).items():
        if e.model > e.formula:
            worse.append(number)
        print(f"  day {number:>2} (n {e.count:>3}): {_three(e)}; inside {_pct(e.inside)}")
    overall = _measured(every)
    low, high = args.level - ROOM, args.level + ROOM
    print(
        f"all: {_three(overall)} over {overall.count} forecasts ({len(every)} made in {seconds:.1f} s); "
        f"inside the {args.level:.0%} interval {_pct(overall.inside)} (target {low:.0%}–{high:.0%}; by seed "
        f"{_pct(min(e.inside for e in by_seed))} … {_pct(max(e.inside for e in by_seed))})"
    )
    judged = [r for r in every if r.days_left > 0]
    below = sum(r.actual < r.model.lower for r in judged) / len(judged)
    above = sum(r.actual > r.model.upper for r in judged) / len(judged)
    early = _measured([r for r in judged if r.day.day <= 5]).inside
    print(f"  outside: below the lower bound {_pct(below)}, above the upper {_pct(above)}"
          f" (each {(1 - args.level) / 2:.0%} at best); inside on days 1–5 {_pct(early)}")  # fmt: skip
    behind = [seed for seed, e in zip(seeds, by_seed, strict=True) if e.model > e.formula]
    print(
        f"days of the month where the model errs more than today's formula: {worse or 'none'} (target none); "
        f"seeds where it does on average: {behind or 'none'}"
    )


if __name__ == "__main__":
    main()
