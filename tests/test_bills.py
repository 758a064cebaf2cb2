"""Bills snapshots: month to date, forecast, revisions, the previous month's grace days (on the
simulator's ledger in process: tests/fakes.py)."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

from exporter.billing import BillingAPI
from exporter.core.clock import Clock, FrozenClock
from exporter.model.forecast import forecast
from exporter.sim import ITEMS, Simulator
from exporter.sources.bills import BillsSource
from tests.conftest import SHANGHAI
from tests.fakes import FakeBilling


def source(client: BillingAPI, clock: Clock, grace: int = 3) -> BillsSource:
    return BillsSource(client, clock, grace)


def test_month_to_date_equals_the_simulators_total(sim: Simulator, fake: FakeBilling, clock: Clock) -> None:
    snapshot = source(fake, clock).refresh()
    assert [m.period for m in snapshot.months] == ["2026-11"]
    month = snapshot.current
    assert month.month_to_date == sim.bill_totals("2026-11")["total"]
    assert sum(a.payable for a in month.by_endpoint) == month.month_to_date
    assert {a.day for a in month.by_item} == {dt.date(2026, 11, d) for d in range(1, 23)}


def test_revised_bills_replace_the_snapshot(sim: Simulator, fake: FakeBilling, clock: Clock) -> None:
    before = source(fake, clock).refresh().current.month_to_date
    endpoint = sim.endpoints[0]
    day = dt.date(2026, 11, 3)
    old = sim.charge("2026-11", day, endpoint, ITEMS[0])[0]
    sim.revise_bill(day, endpoint.endpoint_id, ITEMS[0], old + Decimal("0.01"))
    after = source(fake, clock).refresh().current
    assert after.month_to_date == before + Decimal("0.01")
    assert after.month_to_date == sim.bill_totals("2026-11")["total"]


def test_month_rollover_keeps_the_previous_month_during_the_grace_days(
    sim: Simulator, fake: FakeBilling, clock: Clock, frozen: FrozenClock
) -> None:
    frozen.set(dt.datetime(2026, 11, 30, 16, 0, 30, tzinfo=dt.UTC))  # 00:00:30 on 1 December in Shanghai
    bills = source(fake, clock, grace=3)
    snapshot = bills.refresh()
    assert [m.period for m in snapshot.months] == ["2026-12", "2026-11"]
    november = snapshot.months[1]
    assert november.month_to_date == sim.bill_totals("2026-11")["total"]
    assert november.forecast == november.month_to_date  # a closed month's forecast is its total
    assert {a.day for a in november.by_item} == {dt.date(2026, 11, d) for d in range(1, 31)}

    frozen.set(dt.datetime(2026, 12, 3, 12, 0, tzinfo=SHANGHAI))
    assert [m.period for m in bills.refresh().months] == ["2026-12", "2026-11"]
    frozen.set(dt.datetime(2026, 12, 4, 0, 0, 1, tzinfo=SHANGHAI))
    assert [m.period for m in bills.refresh().months] == ["2026-12"]


def test_january_looks_back_to_december(fake: FakeBilling, clock: Clock, frozen: FrozenClock) -> None:
    frozen.set(dt.datetime(2027, 1, 2, 9, 0, tzinfo=SHANGHAI))
    assert [m.period for m in source(fake, clock).refresh().months] == ["2027-01", "2026-12"]


def test_forecast_uses_the_trailing_seven_complete_days() -> None:
    today = dt.date(2026, 11, 22)
    days = {dt.date(2026, 11, d): Decimal(10) for d in range(1, 22)}
    days[dt.date(2026, 11, 21)] = Decimal(24)  # the trailing 7 days: 6 × 10 + 24 = 84, average 12
    days[today] = Decimal(3)
    month_end, today_end = forecast("2026-11", today, days, None)
    complete = Decimal(20 * 10 + 24)
    assert today_end == Decimal(12)
    assert month_end == complete + 12 + 12 * 8  # today at the average, then 8 more days


def test_forecast_takes_today_when_it_already_beats_the_average() -> None:
    today = dt.date(2026, 11, 10)
    days = {dt.date(2026, 11, d): Decimal(10) for d in range(1, 10)} | {today: Decimal(50)}
    month_end, today_end = forecast("2026-11", today, days, None)
    assert today_end == 50
    assert month_end == 90 + 50 + 10 * 20


def test_forecast_early_in_the_month_borrows_last_months_days() -> None:
    today = dt.date(2026, 12, 2)
    days = {dt.date(2026, 12, 1): Decimal(20), today: Decimal(1)}
    previous = {dt.date(2026, 11, d): Decimal(6) for d in range(1, 31)}
    month_end, _ = forecast("2026-12", today, days, previous)
    average = (Decimal(20) + 6 * 6) / 7
    assert month_end == 20 + average + average * 29
    alone, _ = forecast("2026-12", today, days, None)
    assert alone == 20 + 20 + 20 * 29  # only 1 December is known


def test_forecast_on_the_first_day_without_history_is_today_so_far() -> None:
    today = dt.date(2026, 12, 1)
    assert forecast("2026-12", today, {today: Decimal(4)}, None) == (Decimal(4) * 31, Decimal(4))
