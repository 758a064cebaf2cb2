"""`backtest --forecast`: the month-end forecast as it stood at the end of each day of past months,
against the month's actual total.

For each day of each month in range that has ended, the forecast is made as the daemon would have
made it just after that day ended: that day and the days before it complete (their final
amounts), the next day not billed yet, and the days before the month as the daemon would have held
them (the months of history, when `billing.history_months` is on; otherwise last month only in its
grace days). Three forecasts are set against the actual total: the model's, with its interval
(`model.forecast.month_forecast`, what the forecast gauges show), today's formula
(`model.forecast.forecast`: the complete days and the trailing week's average for each day left)
and a naive one (the month to date ÷ days elapsed × days in the month).

The errors leave out each month's last day: nothing is left to forecast, all three are exact.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from decimal import Decimal

from exporter.billing import GROUP_TERM_ITEM, BillingAPI, BillingClient
from exporter.config.schema import Config
from exporter.core.clock import Clock, days_in_period, first_day, periods_before, periods_between, previous_period
from exporter.core.logs import get_logger
from exporter.model.forecast import DEFAULT_LEVEL, MonthForecast, filled, forecast, held_days, month_forecast
from exporter.model.snapshots import per_day
from exporter.sources.bills import daily_amounts

log = get_logger(__name__)

CENT = Decimal("0.01")
Days = Mapping[dt.date, Decimal]


@dataclass(frozen=True)
class Forecasted:
    """The forecasts of a month's total at the end of `day`, and the total."""

    day: dt.date
    period: str
    actual: Decimal
    model: MonthForecast
    formula: Decimal
    """Today's formula."""
    naive: Decimal
    """The month to date ÷ days elapsed × days in the month."""

    @property
    def days_left(self) -> int:
        return days_in_period(self.period) - self.day.day

    @property
    def inside(self) -> bool:
        return self.model.lower <= self.actual <= self.model.upper

    def document(self) -> dict[str, str]:
        return {
            "day": self.day.isoformat(),
            "period": self.period,
            "forecast": _money(self.model.point),
            "lower": _money(self.model.lower),
            "upper": _money(self.model.upper),
            "actual": f"{self.actual:f}",
        }


@dataclass(frozen=True)
class Errors:
    """Mean absolute percentage errors (fractions) of a set of forecasts, and their interval's coverage."""

    count: int
    model: float
    formula: float
    naive: float
    inside: float
    """The share of actual totals inside the model's interval."""


def _money(amount: Decimal) -> str:
    return f"{amount.quantize(CENT):f}"


def _error(forecast_: Decimal, actual: Decimal) -> float:
    return float(abs(forecast_ - actual) / abs(actual)) if actual else 0.0  # (a month of net credits too)


def errors(rows: Iterable[Forecasted]) -> Errors | None:
    """The errors of `rows` with days left (None if none has)."""
    counted = [r for r in rows if r.days_left > 0]
    if not counted:
        return None
    n = len(counted)
    return Errors(
        n,
        sum(_error(r.model.point, r.actual) for r in counted) / n,
        sum(_error(r.formula, r.actual) for r in counted) / n,
        sum(_error(r.naive, r.actual) for r in counted) / n,
        sum(r.inside for r in counted) / n,
    )


def by_day_of_month(rows: Sequence[Forecasted]) -> dict[int, Errors]:
    """The errors of each day of the month (over the months), the days with nothing left aside."""
    table = {}
    for number in range(1, 32):
        found = errors(r for r in rows if r.day.day == number)
        if found is not None:
            table[number] = found
    return table


def replay_forecasts(
    months: Mapping[str, Days],
    first: str,
    last: str,
    *,
    history_months: int,
    grace_days: int,
    level: float = DEFAULT_LEVEL,
) -> list[Forecasted]:
    """The forecasts at the end of each day of `first` … `last` (those in `months`, which must be
    complete), with the days the daemon would have held. `months`: each month's days (a day absent
    billed nothing; a month absent is unknown)."""
    rows = []
    for period in periods_between(first, last):
        if period not in months:
            continue
        month = filled(period, months[period])
        actual = sum(month.values(), Decimal(0))
        held = periods_before(period, history_months) if history_months else []
        history = held_days({p: months[p] for p in held if p in months})
        previous_month = previous_period(period)
        previous = filled(previous_month, months[previous_month]) if previous_month in months else None
        for number in range(1, days_in_period(period) + 1):
            day = first_day(period).replace(day=number)
            today = day + dt.timedelta(days=1)
            so_far = {d: a for d, a in month.items() if d <= day}
            in_grace = today.day <= grace_days and today.month == day.month
            before = previous if history_months or in_grace else None
            past = {**history, **(before or {})}
            model = month_forecast(period, today, so_far, past, level)
            formula, _ = forecast(period, today, so_far, before)
            spent = sum(so_far.values(), Decimal(0))
            naive = spent / number * days_in_period(period)
            rows.append(Forecasted(day, period, actual, model, formula, naive))
    return rows


def _percent(value: float) -> str:
    return f"{value * 100:.1f}%"


def render(rows: Sequence[Forecasted], form: str) -> str:
    """JSON lines (one a day), or a table by day of month with a summary."""
    if form == "json":
        return "".join(json.dumps(r.document()) + "\n" for r in rows)
    table = by_day_of_month(rows)
    lines = [
        f"{'day':>3}  {'n':>3}  {'forecast':>8}  {'formula':>8}  {'naive':>8}  {'inside':>7}",
    ]
    for number, e in table.items():
        lines.append(
            f"{number:>3}  {e.count:>3}  {_percent(e.model):>8}  {_percent(e.formula):>8}  {_percent(e.naive):>8}"
            f"  {_percent(e.inside):>7}"
        )
    overall = errors(rows)
    if overall is None:
        lines.append("nothing to measure: no month in range has ended with its bills listed (the notes say why)")
    else:
        level = rows[0].model.level
        periods = sorted({r.period for r in rows})
        lines.append(
            f"{len(periods)} months ({periods[0]} … {periods[-1]}), {overall.count} forecasts with days left: "
            f"mean absolute error {_percent(overall.model)} (today's formula {_percent(overall.formula)}, "
            f"naive {_percent(overall.naive)}); actual inside the {level:.0%} interval {_percent(overall.inside)}"
        )
    return "".join(line + "\n" for line in lines)


def fetch_days(client: BillingAPI, periods: Sequence[str]) -> dict[str, dict[dt.date, Decimal]]:
    """Each month's account days (by item, which covers every charge); a month the API lists
    nothing for is left out (and said)."""
    months = {}
    for period in periods:
        records = client.bills(period, GROUP_TERM_ITEM)
        if not records:
            log.warning("backtest: the API listed no bills for this month", period=period)
            continue
        months[period] = per_day(daily_amounts(records, "item"))
    return months


def forecast_backtest(
    config: Config, first: str, last: str, clock: Clock, client: BillingAPI | None = None
) -> tuple[list[Forecasted], list[str]]:
    """Fetch `first` … `last` and the history months before them from `client` (unless given, the
    HTTP client on `config.billing`, closed after) and replay the forecasts at `forecast.interval`;
    with notes on the months left out. Only months that have ended are replayed. Raises
    BillingError when the API refuses or cannot be reached."""
    current = clock.period()
    ended = [p for p in periods_between(first, last) if p < current]
    notes = [f"{p}: not over yet, no actual total to measure against" for p in periods_between(first, last)
             if p >= current]  # fmt: skip
    if not ended:
        return [], notes
    periods = [*periods_before(ended[0], config.billing.history_months or 1), *ended]
    opened: AbstractContextManager[BillingAPI] = (
        BillingClient.from_config(config.billing, clock) if client is None else nullcontext(client)
    )
    with opened as api:
        months = fetch_days(api, periods)
    notes += [f"{p}: no bills" for p in ended if p not in months]
    rows = replay_forecasts(
        months,
        ended[0],
        ended[-1],
        history_months=config.billing.history_months,
        grace_days=config.billing.previous_month_grace_days,
        level=config.forecast.interval,
    )
    return rows, notes
