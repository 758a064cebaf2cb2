"""The month's daily bills → a bills snapshot with month-to-date and a month-end forecast.

Bills get revised, so every refresh re-fetches the whole month and replaces the snapshot.
During the first `grace_days` of a month the previous month is fetched too, so its last
days settle.

Forecast (current month) = the complete days' sum + max(today so far, average) + average ×
days after today, where average is that of the trailing 7 complete days (fewer at the start
of a month when the previous month is neither fetched nor held in the history; with no complete
day at all, today so far stands for the average). Today's forecast is max(today so far, average). A past month's
forecast is its total.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable
from decimal import Decimal

from exporter.billing import GROUP_TERM_INSTANCE, GROUP_TERM_ITEM, BillingAPI, BillRecord
from exporter.core.clock import Clock, previous_period
from exporter.model.forecast import forecast
from exporter.model.snapshots import BillsSnapshot, DailyAmount, HistorySnapshot, MonthBills, per_day


def daily_amounts(records: Iterable[BillRecord], key: str) -> tuple[DailyAmount, ...]:
    """Sum records that share (day, key, product, project): one series per label set."""
    sums: dict[tuple[str, dt.date, str, str, str], tuple[Decimal, Decimal]] = {}
    for r in records:
        label = r.instance_id if key == "instance" else r.item
        k = (r.period, r.day, label, r.product, r.project_id)
        payable, usage = sums.get(k, (Decimal(0), Decimal(0)))
        sums[k] = (payable + r.payable_amount, usage + r.usage_value)
    return tuple(
        DailyAmount(period, day, label, product, project, payable, usage)
        for (period, day, label, product, project), (payable, usage) in sorted(sums.items())
    )


def month_bills(
    period: str,
    today: dt.date,
    by_endpoint: tuple[DailyAmount, ...],
    by_item: tuple[DailyAmount, ...],
    previous: dict[dt.date, Decimal] | None,
) -> MonthBills:
    """A month's bills as of `today`, with its month to date (from the item lines, which cover
    every charge) and forecast; `previous`: last month's days, when held."""
    month_end, today_end = forecast(period, today, per_day(by_item), previous)
    month_to_date = sum((a.payable for a in by_item), Decimal(0))
    return MonthBills(period, by_endpoint, by_item, month_to_date, month_end, today_end)


class BillsSource:
    def __init__(
        self,
        client: BillingAPI,
        clock: Clock,
        grace_days: int,
        history: Callable[[], HistorySnapshot | None] = lambda: None,
    ) -> None:
        self.client = client
        self.clock = clock
        self.grace_days = grace_days
        self.history = history
        """The past months held, for the days before this month in the forecast's trailing window."""

    def periods(self, today: dt.date) -> list[str]:
        current = self.clock.period(today)
        return [current, previous_period(current)] if today.day <= self.grace_days else [current]

    def refresh(self) -> BillsSnapshot:
        today = self.clock.today()
        fetched = [
            (period, self.client.bills(period, GROUP_TERM_INSTANCE), self.client.bills(period, GROUP_TERM_ITEM))
            for period in self.periods(today)
        ]
        by_items = [daily_amounts(items, "item") for _, _, items in fetched]
        # Last month's days for this month's trailing week: fetched in the grace days, else held.
        history = self.history()
        before: dict[dt.date, Decimal] | None
        if len(by_items) > 1:
            before = per_day(by_items[1])
        else:
            before = history.item_days(previous_period(fetched[0][0])) if history is not None else None
        months = [
            month_bills(
                period, today, daily_amounts(instances, "instance"), by_items[index], before if index == 0 else None
            )
            for index, (period, instances, _) in enumerate(fetched)
        ]
        return BillsSnapshot(months=tuple(months), today=today)
