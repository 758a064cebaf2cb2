"""Threshold comparisons and budget ratios; the signals themselves are in `signals.py`."""

from __future__ import annotations

import operator
from collections.abc import Callable
from decimal import Decimal

from exporter.alerts.signals import fresh
from exporter.bills import budget_status
from exporter.clock import Clock
from exporter.schema import BudgetConfig
from exporter.snapshots import Latest

COMPARE: dict[str, Callable[[Decimal, Decimal], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
}


def budget_ratio(budget: BudgetConfig, latest: Latest, clock: Clock) -> tuple[str, Decimal] | None:
    """The budget's period key (`2026-11` or `2026-11-22`) and the share of it used, from fresh bills
    of today only (what the metrics show may be older); None when there are none."""
    bills = latest.bills
    today = clock.today()
    if bills is None or not fresh(latest, "bills") or bills.today != today:
        return None
    ((_, ratios),) = budget_status(latest, [budget])
    assert ratios is not None
    return (bills.current.period if budget.period == "month" else today.isoformat()), ratios[0]
