"""Threshold comparisons and budget ratios; the signals themselves are in `signals.py`."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from decimal import Decimal

from exporter.config.schema import BudgetConfig, PriceConfig
from exporter.core.clock import Clock
from exporter.model.signals import fresh, todays_bills
from exporter.model.snapshots import Latest
from exporter.sources.budgets import figures

COMPARE: dict[str, Callable[[Decimal, Decimal], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
}


def budget_ratio(
    budget: BudgetConfig, spans: Sequence[tuple[Latest, Sequence[PriceConfig]]], clock: Clock
) -> tuple[str, Decimal] | None:
    """The budget's period key (`2026-11` or `2026-11-22`) and the share of it used, summed over
    the accounts it spans (each with its prices), from fresh figures of today only (bills, or usage
    for a scope priced from usage; what the metrics show may be older); None when an account has
    none (a part unknown is never read as zero)."""
    period, spent = "", Decimal(0)
    for latest, prices in spans:
        if budget.on_usage:
            usage = latest.usage
            current = usage is not None and usage.day == clock.today() and fresh(latest, "usage")
        else:
            current = todays_bills(latest, clock)
        if not current:
            return None
        found = figures(budget, latest, prices)
        if found is None or (period and found.period != period):
            return None
        period, spent = found.period, spent + found.spent
    if not period:
        return None
    return period, spent / budget.amount
