"""The month's daily bills → a bills snapshot with month-to-date and a month-end forecast.

Bills get revised, so every refresh re-fetches the whole month and replaces the snapshot.
During the first `grace_days` of a month the previous month is fetched too, so its last
days settle.

Forecast (current month): `model.forecast.month_forecast` on the month's days and every day held
before it (the history's months, and last month's while fetched in its grace days): the complete
days, each day left at the account's level × its weekday's factor, with the interval
(`forecast.interval`) learnt from the history (`docs/forecast.md`); today's forecast is today so far
plus what the model expects it still adds. With fewer than three weeks of days known, it is
today's formula (`model.forecast.forecast`): the complete days' sum + max(today so far, average) +
average × days after today (today so far below zero, a credit: so far + average), where average
is that of the trailing 7 complete days (fewer at the start of a month when the previous month is
neither fetched nor held). A past month's forecast and bounds are its total.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable, Mapping
from decimal import Decimal

from exporter.billing import GROUP_TERM_INSTANCE, GROUP_TERM_ITEM, BillingAPI, BillRecord
from exporter.core.clock import Clock, previous_period
from exporter.model.forecast import DEFAULT_LEVEL, forecast, held_days, month_forecast
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
    history: Mapping[dt.date, Decimal] | None = None,
    level: float = DEFAULT_LEVEL,
) -> MonthBills:
    """A month's bills as of `today`, with its month to date (from the item lines, which cover
    every charge) and forecast. `history`: the account's days before the month, each month held
    whole (`filled`): the forecast is the model's, with its `level` interval; without it, today's
    formula (`previous`: last month's days, when held) and no interval."""
    days = per_day(by_item)
    month_to_date = sum((a.payable for a in by_item), Decimal(0))
    if history is None:
        month_end, today_end = forecast(period, today, days, previous)
        return MonthBills(period, by_endpoint, by_item, month_to_date, month_end, today_end)
    outlook = month_forecast(period, today, days, history, level)
    so_far = days.get(today, Decimal(0)) if period == f"{today:%Y-%m}" else Decimal(0)
    today_end = so_far + outlook.daily.get(today, Decimal(0))
    return MonthBills(period, by_endpoint, by_item, month_to_date, outlook.point, today_end, outlook)


class BillsSource:
    def __init__(
        self,
        client: BillingAPI,
        clock: Clock,
        grace_days: int,
        history: Callable[[], HistorySnapshot | None] = lambda: None,
        interval: float = DEFAULT_LEVEL,
    ) -> None:
        self.client = client
        self.clock = clock
        self.grace_days = grace_days
        self.history = history
        """The past months held: what the forecast learns the account's rhythm and error from."""
        self.interval = interval
        """The forecast interval's nominal coverage (`forecast.interval`)."""

    def periods(self, today: dt.date) -> list[str]:
        current = self.clock.period(today)
        return [current, previous_period(current)] if today.day <= self.grace_days else [current]

    def refresh(self) -> BillsSnapshot:
        asked = self.clock.now().timestamp()
        today = self.clock.today()
        fetched = [
            (period, self.client.bills(period, GROUP_TERM_INSTANCE), self.client.bills(period, GROUP_TERM_ITEM))
            for period in self.periods(today)
        ]
        by_items = [daily_amounts(items, "item") for _, _, items in fetched]
        # The days before this month: the history's months, and last month as fetched in the grace days.
        history = self.history()
        held = {p: per_day(m.by_item) for p, m in history.months.items()} if history is not None else {}
        if len(by_items) > 1 and by_items[1]:  # (a month that lists nothing is unknown, not a month of zeros)
            held[fetched[1][0]] = per_day(by_items[1])
        before = held_days(held)
        months = [
            month_bills(
                period,
                today,
                daily_amounts(instances, "instance"),
                by_items[index],
                None,
                before if index == 0 else {},
                self.interval,
            )
            for index, (period, instances, _) in enumerate(fetched)
        ]
        return BillsSnapshot(months=tuple(months), today=today, asked=asked)
