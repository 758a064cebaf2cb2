"""Threshold comparisons and budget ratios; the signals themselves are in `signals.py`."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from decimal import Decimal

from exporter.alerts.signals import fresh
from exporter.budgets import figures
from exporter.clock import Clock
from exporter.schema import BudgetConfig, PriceConfig
from exporter.snapshots import Latest

COMPARE: dict[str, Callable[[Decimal, Decimal], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
}


def budget_ratio(
    budget: BudgetConfig, latest: Latest, clock: Clock, prices: Sequence[PriceConfig] = ()
) -> tuple[str, Decimal] | None:
    """The budget's period key (`2026-11` or `2026-11-22`) and the share of it used, from fresh
    figures of today only (bills, or usage for a scope priced from usage; what the metrics show
    may be older); None when there are none."""
    today = clock.today()
    source = "usage" if budget.on_usage else "bills"
    if budget.on_usage:
        day = latest.usage.day if latest.usage is not None else None
    else:
        day = latest.bills.today if latest.bills is not None else None
    if day != today or not fresh(latest, source):
        return None
    found = figures(budget, latest, prices)
    if found is None:
        return None
    return found.period, found.spent / budget.amount
