"""The month-end forecast of the bills: the complete days, today at no less than the trailing
week's daily average, and that average for each day left."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

from exporter.core.clock import days_in_period

TRAILING_DAYS = 7


def forecast(
    period: str, today: dt.date, days: dict[dt.date, Decimal], previous: dict[dt.date, Decimal] | None
) -> tuple[Decimal, Decimal]:
    """Projected month-end and today's totals (see the module's docstring).

    `previous` is last month's days, when fetched.
    """
    month_to_date = sum(days.values(), Decimal(0))
    if period != f"{today:%Y-%m}":
        return month_to_date, Decimal(0)
    first_known = today.replace(day=1)
    if previous is not None:
        first_known = (first_known - dt.timedelta(days=1)).replace(day=1)
    known = {**(previous or {}), **days}
    window = [today - dt.timedelta(days=n) for n in range(1, TRAILING_DAYS + 1)]
    window = [d for d in window if d >= first_known]
    so_far = days.get(today, Decimal(0))
    average = sum((known.get(d, Decimal(0)) for d in window), Decimal(0)) / len(window) if window else so_far
    complete = month_to_date - so_far
    return complete + max(so_far, average) + average * (days_in_period(period) - today.day), max(so_far, average)
