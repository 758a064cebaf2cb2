"""Threshold comparisons and budget ratios; the signals themselves are in `signals.py`."""

from __future__ import annotations

import datetime as dt
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal

from exporter.config.schema import BudgetConfig, PriceConfig
from exporter.core.clock import Clock
from exporter.model.forecast import crossing
from exporter.model.signals import fresh, todays_bills
from exporter.model.snapshots import Latest
from exporter.sources.budgets import BudgetFigures, figures

COMPARE: dict[str, Callable[[Decimal, Decimal], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
}


@dataclass(frozen=True)
class BudgetMeasure:
    """A budget as a rule judges it: its period key, the share of the amount used (or forecast to be
    used), and when the spend crosses the amount at the forecast's pace, with the chance it does."""

    period: str
    ratio: Decimal
    crossing: dt.date | None
    """None when the pace does not cross the amount this period, or when that is not known."""
    chance: float | None


def summed_crossing(found: Sequence[BudgetFigures], amount: Decimal) -> dt.date | None:
    """When the summed spend crosses `amount` at the summed pace of the accounts' forecasts."""
    if len(found) == 1:
        return found[0].crossing(amount)
    if len(found[0].period) == 10:  # a day budget: today, when the accounts' spend or forecast reaches it
        reached = max(sum((f.spent for f in found), Decimal(0)), sum((f.projected for f in found), Decimal(0)))
        return dt.date.fromisoformat(found[0].period) if reached >= amount else None
    spent: dict[dt.date, Decimal] = {}
    for f in found:
        for day, amount_of_day in f.days:
            spent[day] = spent.get(day, Decimal(0)) + amount_of_day
    if sum(spent.values(), Decimal(0)) >= amount:
        return crossing(sorted(spent.items()), amount)  # the day the accounts' spend did
    aheads = [days for f in found if (days := f.ahead) is not None]
    if len(aheads) < len(found):
        return None
    ahead: dict[dt.date, Decimal] = {}
    for days in aheads:
        for day, amount_of_day in days.items():
            ahead[day] = ahead.get(day, Decimal(0)) + amount_of_day
    total = sum(spent.values(), Decimal(0))
    return crossing(sorted(ahead.items()), amount, total)


def budget_ratio(
    budget: BudgetConfig,
    spans: Sequence[tuple[Latest, Sequence[PriceConfig]]],
    clock: Clock,
    basis: str = "actual",
) -> BudgetMeasure | None:
    """The budget's period key (`2026-11` or `2026-11-22`) and the share of it used (`actual`) or
    forecast to be used at the period's end (`forecast`), summed over the accounts it spans (each
    with its prices), from fresh figures of today only (bills, or usage for a scope priced from
    usage; what the metrics show may be older); None when an account has none (a part unknown is
    never read as zero). The chance of crossing is known for one account's budget only."""
    period = ""
    found: list[BudgetFigures] = []
    for latest, prices in spans:
        if budget.on_usage:
            usage = latest.usage
            current = usage is not None and usage.day == clock.today() and fresh(latest, "usage")
        else:
            current = todays_bills(latest, clock)
        if not current:
            return None
        figures_now = figures(budget, latest, prices)
        if figures_now is None or (period and figures_now.period != period):
            return None
        period = figures_now.period
        found.append(figures_now)
    if not period:
        return None
    share = sum((f.projected if basis == "forecast" else f.spent for f in found), Decimal(0)) / budget.amount
    chance = found[0].chance(budget.amount) if len(found) == 1 else None
    return BudgetMeasure(period, share, summed_crossing(found, budget.amount), chance)
