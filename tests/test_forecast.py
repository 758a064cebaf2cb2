"""The month-end forecast with its interval (`model.forecast.month_forecast`) on the simulator's
seasonal history, and `backtest --forecast` (`replay.forecast_backtest`): behaviour, not numbers."""

from __future__ import annotations

import datetime as dt
import json
import random
import statistics
from decimal import Decimal
from itertools import accumulate

import pytest

from bench.forecast import account_days
from exporter.config.load import validate
from exporter.core.clock import Clock, FrozenClock, days_in_period, periods_between
from exporter.model.forecast import DEFAULT_LEVEL, Draws, MonthForecast, filled, forecast, month_forecast
from exporter.model.snapshots import MonthBills, per_day
from exporter.replay.forecast_backtest import by_day_of_month, errors, forecast_backtest, render, replay_forecasts
from exporter.sim import ITEMS, Simulator, SpendModel
from exporter.sources.bills import BillsSource, month_bills
from exporter.sources.history import HistorySource
from exporter.state import StateStore
from tests.conftest import SHANGHAI
from tests.daemon_fakes import fake_billing_section
from tests.fakes import FakeBilling

YEAR = account_days(seed=1, spikes=2.0)
"""The account's days of 2026 by month: weekly rhythm, noise, growth, about two spikes a month."""
MONTH = "2026-06"
FIRST = dt.date(2026, 6, 1)
KEYS = {"day", "period", "forecast", "lower", "upper", "actual"}


def held(*periods: str) -> dict[dt.date, Decimal]:
    """The months' days, each held whole, as the daemon passes them."""
    return {d: a for p in periods for d, a in filled(p, YEAR[p]).items()}


def before(today: dt.date) -> dict[dt.date, Decimal]:
    """June's days before `today`."""
    return {d: a for d, a in YEAR[MONTH].items() if d < today}


def june(today: dt.date, changed: dict[dt.date, Decimal] | None = None) -> MonthForecast:
    """June forecast on `today` with three months held: its days before today complete (some of
    them `changed`), nothing billed today yet."""
    return month_forecast(MONTH, today, before(today) | (changed or {}), held("2026-03", "2026-04", "2026-05"))


def test_the_interval_holds_the_point_and_narrows_as_the_month_runs_out() -> None:
    widths = []
    for day in (2, 6, 10, 14, 18, 22, 26, 29):
        f = june(FIRST.replace(day=day))
        assert f.month_to_date <= f.lower < f.point < f.upper
        assert f.level == DEFAULT_LEVEL
        assert f.point == f.month_to_date + sum(f.daily.values(), Decimal(0))
        widths.append(f.upper - f.lower)
    assert widths == sorted(widths, reverse=True)
    assert len(set(widths)) == len(widths)


def test_a_month_that_has_ended_is_its_total_with_no_room() -> None:
    total = sum(YEAR[MONTH].values(), Decimal(0))
    f = month_forecast(MONTH, dt.date(2026, 7, 1), YEAR[MONTH], held("2026-05"))
    assert f.point == f.lower == f.upper == total
    assert f.daily == {}
    assert f.chance_over(total - 1) == 1.0
    assert f.chance_over(total) == 0.0


def test_with_no_history_the_point_is_todays_formula_and_the_interval_says_it_is_unsure() -> None:
    today = FIRST.replace(day=6)
    days = {d: a for d, a in YEAR[MONTH].items() if d <= today}  # today's bills so far among them
    alone = month_forecast(MONTH, today, days)
    assert alone.point == forecast(MONTH, today, days, None)[0]
    assert (alone.point - alone.month_to_date).quantize(Decimal("0.01")) == sum(alone.daily.values(), Decimal(0))
    informed = month_forecast(MONTH, today, days, held("2026-03", "2026-04", "2026-05"))
    assert alone.point != informed.point

    def relative_width(f: MonthForecast) -> Decimal:
        return (f.upper - f.lower) / (f.point - f.month_to_date)

    assert relative_width(alone) > 3 * relative_width(informed)
    assert relative_width(alone) > Decimal("0.5")  # unsure: the days left could be half as much again or more


def test_with_a_few_weeks_of_days_the_model_takes_over_and_widens_for_what_it_lacks() -> None:
    """Three weeks of June and nothing before it: a weekday rhythm to learn, few errors to learn from."""
    today = FIRST.replace(day=23)
    short = month_forecast(MONTH, today, before(today), {})
    assert short.point != forecast(MONTH, today, before(today), None)[0]  # the weekdays left, not the week's average
    longer = june(today)
    assert (short.upper - short.lower) > (longer.upper - longer.lower)


def test_after_a_pause_of_most_of_the_recent_days_the_forecast_is_unsure_not_certain_of_nothing() -> None:
    """Three months of spend, then the last 12 days of May billed nothing (a shutdown), and June
    spending again: the recent days' median is 0, which said "nothing more, for sure" (no room, no
    chance of going over) while June billed again."""
    history = held("2026-02", "2026-03", "2026-04", "2026-05")
    for day in range(20, 32):
        history[dt.date(2026, 5, day)] = Decimal(0)
    for day in (2, 6, 10):
        today = FIRST.replace(day=day)
        f = month_forecast(MONTH, today, before(today), history)
        assert f.month_to_date < f.lower < f.point < f.upper, day
        assert f.chance_over(f.point) > 0.1


def test_on_the_first_day_after_a_pause_the_pause_may_go_on_or_end_and_the_forecast_says_both() -> None:
    """The last 12 days of May billed nothing, and June has billed nothing yet: the trailing week's
    pace is 0, and the forecast was "nothing more, for sure" (a zero-wide interval, no chance of
    any budget above the month to date) just as spending may resume."""
    history = held("2026-02", "2026-03", "2026-04", "2026-05")
    for day in range(20, 32):
        history[dt.date(2026, 5, day)] = Decimal(0)
    f = month_forecast(MONTH, FIRST, {}, history)
    assert f.month_to_date == f.point == f.lower < f.upper  # (the pause may go on: nothing more is within)
    tail = (1 - DEFAULT_LEVEL) / 2
    assert f.chance_over(f.upper) == pytest.approx(tail, abs=0.01)
    assert f.chance_over((f.lower + f.upper) / 2) > tail


def _sparse_year(seed: int) -> dict[str, dict[dt.date, Decimal]]:
    """An account that bills 1000 on about 40% of its days, whichever weekday they fall on."""
    rng, months, day = random.Random(seed), {}, dt.date(2026, 1, 1)
    while day.year == 2026:
        months.setdefault(f"{day:%Y-%m}", {})[day] = Decimal(1000) if rng.random() < 0.4 else Decimal(0)
        day += dt.timedelta(days=1)
    return months


@pytest.mark.timeout(300)
def test_an_account_that_spends_on_few_days_gets_intervals_that_hold_its_total_as_often_as_they_say() -> None:
    """Most of each weekday's days billed nothing: the weekday factors (medians) were 0 for most
    weekdays, the days left forecast at nothing, and the interval zero-wide and missed."""
    rows = [
        r
        for seed in (1, 2, 3)
        for r in replay_forecasts(_sparse_year(seed), "2026-04", "2026-12", history_months=3, grace_days=3)
        if r.days_left > 0
    ]
    assert all(r.model.lower < r.model.upper for r in rows)
    inside = sum(r.inside for r in rows) / len(rows)
    assert abs(inside - DEFAULT_LEVEL) <= 0.10, inside


@pytest.mark.parametrize("weekdays", [(0, 1, 2, 3, 4), (0, 2, 4)], ids=["Monday to Friday", "Mon, Wed, Fri"])
def test_one_weekend_batch_job_does_not_make_every_weekend_expected_to_spend(weekdays: tuple[int, ...]) -> None:
    """An account that bills on fixed weekdays, and on one Saturday of 13 a batch job: a spike,
    one of a dozen Saturdays, which leaves the weekend at nothing (a weekday's mean stands for its
    median of 0 only when a quarter of its days billed: an account that spends on few days,
    whichever they are)."""
    history: dict[dt.date, Decimal] = {}
    day = dt.date(2026, 8, 1)
    while day < dt.date(2026, 11, 1):
        history[day] = Decimal(100) if day.weekday() in weekdays else Decimal(0)
        day += dt.timedelta(days=1)
    history[dt.date(2026, 9, 12)] = Decimal(1000)  # (a Saturday)
    today = dt.date(2026, 11, 4)
    november = {
        d: Decimal(100) if d.weekday() in weekdays else Decimal(0) for d in (dt.date(2026, 11, n) for n in (1, 2, 3))
    }
    f = month_forecast("2026-11", today, november, history)
    assert all(amount == 0 for d, amount in f.daily.items() if d.weekday() not in weekdays)
    assert all(amount > 0 for d, amount in f.daily.items() if d.weekday() in weekdays and d > today)


def test_a_weekday_account_on_the_months_last_weekend_is_expected_to_bill_nothing_more_for_sure() -> None:
    """Its model expects nothing more (the weekend's factors are 0): the days left were taken as
    draws of the last three weeks, weekdays among them, and a budget just above the month to date
    had a chance of 0.45 on a weekend like the 17 before it that billed nothing."""
    history = {d: Decimal(100) if d.weekday() < 5 else Decimal(0)
               for d in (dt.date(2026, 2, 1) + dt.timedelta(days=n) for n in range(118))}  # fmt: skip
    for today in (dt.date(2026, 5, 30), dt.date(2026, 5, 31)):  # (a Saturday, a Sunday)
        days = {d: a for d, a in history.items() if d.month == 5 and d < today}
        f = month_forecast("2026-05", today, days, {d: a for d, a in history.items() if d.month < 5})
        assert f.lower == f.point == f.upper == f.month_to_date
        assert f.chance_over(f.month_to_date + 50) == 0.0


def test_with_a_level_of_0_the_days_left_are_draws_of_all_the_recent_days_not_of_their_weekdays() -> None:
    """An account that bills on Mondays, two of the last three of them nothing: the level is 0 and
    the point is today's formula, which knows no weekdays. The days left (Tuesday to Sunday) are
    then draws of all the last 21 days, as the formula's pace is, not of the last 13 weeks' days of
    their own weekdays, which never billed."""
    history = {d: Decimal(700) if d.weekday() == 0 else Decimal(0)
               for d in (dt.date(2026, 2, 1) + dt.timedelta(days=n) for n in range(114))}  # fmt: skip
    history[dt.date(2026, 5, 18)] = history[dt.date(2026, 5, 25)] = Decimal(0)
    today = dt.date(2026, 5, 26)  # (a Tuesday: six days left, no Monday among them)
    f = month_forecast("2026-05", today, {d: a for d, a in history.items() if d.month == 5},
                       {d: a for d, a in history.items() if d.month < 5})  # fmt: skip
    assert f.draws is not None
    assert f.draws.mean == pytest.approx(700 / 21 * 6)


WEEK_OF_DAYS = [Decimal(v) for v in (80, 120, 100, 90, 110, 100, 100)]
"""Seven recent days, 100 a day on average."""


def test_the_draws_take_off_what_today_billed_of_its_own_draw_and_no_more() -> None:
    """Today is one of the days left, and one draw: what it billed so far is part of that draw."""
    assert Draws.of(WEEK_OF_DAYS, 5, Decimal(0)).mean == pytest.approx(500)
    assert Draws.of(WEEK_OF_DAYS, 5, Decimal(50)).mean == pytest.approx(450)  # (half of today's draw to come)
    assert Draws.of(WEEK_OF_DAYS, 5, Decimal(250)).mean == pytest.approx(400)  # (more than a day's: none of it)
    assert Draws.of(WEEK_OF_DAYS, 5, Decimal(-30)).mean == pytest.approx(500)  # (a credit today: all of it)


def test_the_draws_spread_is_the_sum_of_the_days_about_a_mean_the_recent_days_only_estimate() -> None:
    """Five draws of days whose variance is v: 5 v for their sum, and 5² v ÷ n more for a mean that
    n recent days estimate, so fewer recent days give a wider spread about the same mean."""
    few, many = Draws.of(WEEK_OF_DAYS, 5, Decimal(0)), Draws.of(WEEK_OF_DAYS * 10, 5, Decimal(0))
    assert few.mean == pytest.approx(many.mean)
    for draws, values in ((few, WEEK_OF_DAYS), (many, WEEK_OF_DAYS * 10)):
        v = statistics.variance(float(a) for a in values)
        assert draws.spread**2 == pytest.approx(5 * v + 25 * v / len(values))
    assert few.spread > many.spread


def test_the_draws_go_no_lower_than_the_recent_days_largest_credit_on_every_day_left() -> None:
    assert Draws.of(WEEK_OF_DAYS, 5, Decimal(0)).floor == 0
    credited = Draws.of([*WEEK_OF_DAYS, Decimal(-700)], 5, Decimal(0))
    assert credited.floor == -3500
    assert credited.chance_over(Decimal(-3501)) == 1.0
    assert 0.5 < credited.chance_over(Decimal(-3500)) < 1.0  # (the normal's own tail, above its floor)


def test_days_that_never_vary_make_draws_that_are_sure() -> None:
    steady = Draws.of([Decimal(100)] * 21, 5, Decimal(0))
    assert steady.spread == 0
    assert steady.chance_over(Decimal(499)) == 1.0
    assert steady.chance_over(Decimal(500)) == 0.0


def test_credits_to_come_have_the_chances_the_interval_says() -> None:
    """A refund in the trailing week: the days left take money off, the interval lies below the
    month to date, and the chance of going over its bounds was 1 (every amount below the month to
    date was "sure" to be exceeded)."""
    days = {dt.date(2026, 5, n): Decimal(100) for n in range(1, 9)} | {dt.date(2026, 5, 9): Decimal(-1500)}
    f = month_forecast("2026-05", dt.date(2026, 5, 10), days, {})
    assert f.lower < f.point < f.upper < f.month_to_date
    assert f.chance_over(f.lower) == pytest.approx((1 + DEFAULT_LEVEL) / 2, abs=1e-9)
    assert f.chance_over(f.point) == pytest.approx(0.5, abs=1e-9)
    assert f.chance_over(f.upper) == pytest.approx((1 - DEFAULT_LEVEL) / 2, abs=1e-9)


def test_falling_back_with_credits_expected_the_point_and_lower_bound_may_go_below_the_month_to_date() -> None:
    """A refund in the trailing week: today's formula expects the days left to take money off,
    and the mixture's point and lower bound stood at the month to date (a chance of 1 below it)."""
    months = _sparse_year(3)
    history = {d: a for p in ("2026-08", "2026-09", "2026-10") for d, a in months[p].items()}
    november = {dt.date(2026, 11, n): Decimal(0) for n in range(1, 9)}
    november[dt.date(2026, 11, 6)] = Decimal(-5000)
    f = month_forecast("2026-11", dt.date(2026, 11, 9), november, history)
    assert f.draws is not None
    assert f.lower <= f.point < f.month_to_date < f.upper
    assert f.chance_over(f.upper) == pytest.approx((1 - DEFAULT_LEVEL) / 2, abs=1e-6)
    # Both views expect the days left to take money off (the draws from the recent days' refund,
    # the formula by its own reckoning): the point is nearer the formula's than the month to date.
    assert f.point - f.month_to_date < f.expected / 2  # (`expected`: what the formula's days left add)


def test_falling_back_on_two_views_the_bounds_and_the_point_are_their_mixtures() -> None:
    """An account that bills on 40% of its days: the chance of going over the lower bound, the
    point and the upper bound are those the interval's level and the median say (the two views'
    chances were combined by their larger one: a budget at the lower bound read as nearly sure
    to be crossed)."""
    months = _sparse_year(1)
    history = {d: a for p in ("2026-08", "2026-09", "2026-10") for d, a in months[p].items()}
    mixed = 0
    for day in range(2, 29):
        today = dt.date(2026, 11, day)
        f = month_forecast("2026-11", today, {d: a for d, a in months["2026-11"].items() if d < today}, history)
        if f.draws is None:  # (the recent days' level above 0: the model's forecast)
            continue
        mixed += 1
        assert f.month_to_date <= f.lower < f.point < f.upper, day
        assert f.chance_over(f.lower) == pytest.approx((1 + DEFAULT_LEVEL) / 2, abs=1e-6)
        assert f.chance_over(f.point) == pytest.approx(0.5, abs=1e-6)
        assert f.chance_over(f.upper) == pytest.approx((1 - DEFAULT_LEVEL) / 2, abs=1e-6)
        assert sum(f.daily.values()) == pytest.approx(f.point - f.month_to_date)  # (the days left share the point)
    assert mixed >= 5


def test_the_previous_month_alone_at_the_start_of_a_month_in_its_grace_days() -> None:
    """History off, last month fetched in its grace days: the model learns from it."""
    today = FIRST.replace(day=2)
    days = {FIRST: YEAR[MONTH][FIRST]}
    f = month_forecast(MONTH, today, days, held("2026-05"))
    assert f.lower < f.point < f.upper
    assert f.point != forecast(MONTH, today, days, YEAR["2026-05"])[0]


@pytest.mark.parametrize("history", ["none", "three months"])
def test_a_credit_posted_today_is_taken_off_the_month_at_once_not_the_day_after(history: str) -> None:
    today = FIRST.replace(day=10)
    held_before = held("2026-03", "2026-04", "2026-05") if history == "three months" else None
    usage, credit = Decimal(40), Decimal(-1000)

    def point(days: dict[dt.date, Decimal]) -> Decimal:
        return month_forecast(MONTH, today, days, held_before).point

    plain = point(before(today) | {today: usage})
    credited = point(before(today) | {today: usage + credit})
    # (today's 40 of usage is hidden in the net: at most that much of today is counted again)
    assert plain + credit <= credited <= plain + credit + usage
    if history == "none":
        assert forecast(MONTH, today, before(today) | {today: usage + credit}, None)[0] == credited


def test_a_spike_in_the_recent_days_moves_the_point_less_than_the_trailing_average_moves() -> None:
    today = FIRST.replace(day=16)
    spiked = FIRST.replace(day=14)
    usual = YEAR[MONTH][spiked]
    model = june(today).point, june(today, {spiked: usual * 4}).point
    formula = (
        forecast(MONTH, today, before(today), YEAR["2026-05"])[0],
        forecast(MONTH, today, before(today) | {spiked: usual * 4}, YEAR["2026-05"])[0],
    )
    extra = usual * 3  # what the spike billed, in the month to date of both
    assert model[1] - model[0] < formula[1] - formula[0]
    # Beyond the spike itself: a seventh of it on each of the 15 days left for the trailing average;
    # for the model, one value of the level's 21 (and one error of many).
    assert formula[1] - formula[0] - extra == pytest.approx(extra / 7 * 15)
    assert model[1] - model[0] - extra < (formula[1] - formula[0] - extra) / 4


def test_the_crossing_day_is_the_first_day_the_expected_spend_reaches_the_amount() -> None:
    f = june(FIRST.replace(day=11))
    spent = f.month_to_date
    days = sorted(f.daily)
    reached = list(accumulate((f.daily[d] for d in days), initial=spent))[1:]
    assert days[0] == f.today
    for index in (0, 5, len(days) - 1):
        assert f.crossing_day(reached[index], spent) == days[index]
    assert f.crossing_day(reached[5] + Decimal("0.01"), spent) == days[6]
    assert f.crossing_day(reached[-1] + Decimal("0.01"), spent) is None  # not this month
    assert f.crossing_day(spent, spent) == f.today  # already there
    assert f.crossing_day(spent - 1, spent) == f.today
    # Another scope's spend at the same pace: its own month to date, the same expected days.
    assert f.crossing_day(reached[3] - spent, Decimal(0)) == days[3]


def test_the_chance_of_going_over_falls_with_the_amount_and_is_even_at_the_point() -> None:
    f = june(FIRST.replace(day=9))
    low, high = f.month_to_date * Decimal("0.9"), f.upper * Decimal("1.2")
    amounts = [low + (high - low) * n / 200 for n in range(201)]
    chances = [f.chance_over(a) for a in amounts]
    assert chances == sorted(chances, reverse=True)
    assert chances[0] == 1.0  # less than already billed
    assert chances[-1] < 0.01
    assert f.chance_over(f.point) == pytest.approx(0.5, abs=1e-6)
    # the interval's bounds are the error model's own quantiles
    assert f.chance_over(f.lower) == pytest.approx((1 + f.level) / 2, abs=1e-6)
    assert f.chance_over(f.upper) == pytest.approx((1 - f.level) / 2, abs=1e-6)


def test_the_level_sets_how_wide_the_interval_is() -> None:
    today = FIRST.replace(day=9)
    history = held("2026-03", "2026-04", "2026-05")
    narrow, wide = (month_forecast(MONTH, today, before(today), history, level) for level in (0.5, 0.95))
    assert narrow.point == wide.point
    assert wide.lower < narrow.lower < narrow.point < narrow.upper < wide.upper


def bounds(month: MonthBills) -> tuple[Decimal, Decimal]:
    assert month.lower is not None
    assert month.upper is not None
    return month.lower, month.upper


def test_in_its_grace_days_a_previous_month_that_lists_nothing_is_not_learnt_from_as_zeros(
    sim: Simulator, fake: FakeBilling, clock: Clock, frozen: FrozenClock
) -> None:
    """An account's first month: October lists no bills (it did not exist), and is unknown, not a
    month of 31 zero days that would forecast November's days left at next to nothing."""
    sim.spend = SpendModel(start=dt.date(2026, 11, 1))
    frozen.set(dt.datetime(2026, 11, 3, 12, 0, tzinfo=SHANGHAI))  # in October's grace days
    november = BillsSource(fake, clock, 3).refresh().current
    days = per_day(november.by_item)
    alone = month_forecast("2026-11", clock.today(), days, {})
    assert (november.forecast, november.lower, november.upper) == (alone.point, alone.lower, alone.upper)


def test_the_bills_source_forecasts_from_the_days_it_holds_with_its_interval(
    sim: Simulator, fake: FakeBilling, clock: Clock, frozen: FrozenClock
) -> None:
    sim.spend = SpendModel(start=dt.date(2026, 6, 1))
    frozen.set(dt.datetime(2026, 11, 2, 12, 0, tzinfo=SHANGHAI))  # in October's grace days
    history = HistorySource(fake, clock, StateStore(":memory:"), months=3).refresh()
    november, october = BillsSource(fake, clock, 3, history=lambda: history).refresh().months
    today = clock.today()
    days = per_day(november.by_item)
    held = {d: a for p, m in history.months.items() for d, a in filled(p, per_day(m.by_item)).items()}
    held |= filled("2026-10", per_day(october.by_item))  # fresher than the history's copy
    outlook = month_forecast("2026-11", today, days, held)
    assert (november.forecast, november.lower, november.upper) == (outlook.point, outlook.lower, outlook.upper)
    lower, upper = bounds(november)
    assert november.month_to_date < lower < november.forecast < upper
    assert november.today_forecast == days[today] + outlook.daily[today]
    assert october.forecast == october.lower == october.upper == october.month_to_date  # over: no room

    narrower = BillsSource(fake, clock, 3, history=lambda: history, interval=0.5).refresh().current
    assert narrower.forecast == november.forecast
    assert lower < bounds(narrower)[0] < bounds(narrower)[1] < upper

    # Without the history: the model on what the bills hold (October in its grace days).
    alone = BillsSource(fake, clock, 3).refresh().current
    assert alone.forecast == month_forecast("2026-11", today, days, filled("2026-10", per_day(october.by_item))).point
    # Others who make a month's bills with today's formula alone have no interval.
    formula = month_bills("2026-11", today, november.by_endpoint, november.by_item, None)
    assert (formula.forecast, formula.lower, formula.upper) == (forecast("2026-11", today, days, None)[0], None, None)


def test_the_backtest_says_each_days_forecast_in_designs_json_lines() -> None:
    rows = replay_forecasts(YEAR, "2026-05", "2026-06", history_months=3, grace_days=3)
    assert [r.day for r in rows] == [dt.date(2026, 5, 1) + dt.timedelta(days=n) for n in range(31 + 30)]
    lines = [json.loads(line) for line in render(rows, "json").splitlines()]
    assert len(lines) == len(rows)
    assert all(set(line) == KEYS for line in lines)
    assert (lines[0]["day"], lines[0]["period"]) == ("2026-05-01", "2026-05")
    assert lines[-1]["forecast"] == lines[-1]["lower"] == lines[-1]["upper"] == lines[-1]["actual"]  # over
    assert {Decimal(line["actual"]) for line in lines[:31]} == {sum(YEAR["2026-05"].values(), Decimal(0))}
    text = render(rows, "text")
    assert len(by_day_of_month(rows)) == 30  # the last day of each month has nothing left to forecast
    assert text.count("\n") == 1 + 30 + 1  # header, a row a day of the month, the summary
    assert "inside the 80% interval" in text


def test_the_backtest_fetches_the_months_and_the_history_before_them(sim: Simulator, clock: Clock) -> None:
    sim.spend = SpendModel(start=dt.date(2026, 5, 1))
    config = validate({"billing": fake_billing_section(sim, history_months=2)}, {})
    rows, notes = forecast_backtest(config, "2026-04", "2026-11", clock, FakeBilling(sim))
    assert {r.period for r in rows} == {"2026-05", "2026-06", "2026-07", "2026-08", "2026-09", "2026-10"}
    assert notes == ["2026-11: not over yet, no actual total to measure against", "2026-04: no bills"]
    october = [r for r in rows if r.period == "2026-10"]
    assert [r.day.day for r in october] == list(range(1, 32))
    days = [dt.date(2026, 10, n) for n in range(1, 32)]
    total = sum((sim.spend.amount(d, e.endpoint_id, item) for d in days for e in sim.endpoints for item in ITEMS),
                Decimal(0))  # fmt: skip
    assert {r.actual for r in october} == {total}


@pytest.mark.timeout(300)  # a year of forecasts for each of three seeds: the slowest here, handed out first
def test_over_the_simulators_history_the_interval_holds_the_total_as_often_as_it_says() -> None:
    rows = [
        r
        for seed in (1, 2, 3)
        for r in replay_forecasts(account_days(seed, spikes=2.0), "2026-04", "2026-12", history_months=3, grace_days=3)
    ]
    measured = errors(rows)
    assert measured is not None
    assert measured.count == sum(days_in_period(p) - 1 for p in periods_between("2026-04", "2026-12")) * 3
    assert abs(measured.inside - DEFAULT_LEVEL) <= 0.10
    assert measured.model < measured.formula < measured.naive


def test_a_history_without_spread_still_gives_an_interval_while_it_is_short() -> None:
    """A month of exactly the same spend every day has no error to learn from: the interval then
    comes from the prior's share, never a zero-wide certainty."""
    september = {dt.date(2026, 9, 1) + dt.timedelta(days=n): Decimal(100) for n in range(30)}
    days = {dt.date(2026, 10, 1) + dt.timedelta(days=n): Decimal(100) for n in range(10)}
    outlook = month_forecast("2026-10", dt.date(2026, 10, 10), days, september)
    assert outlook.lower < outlook.point < outlook.upper
    assert 0.0 < outlook.chance_over(outlook.upper) < 0.5 < outlook.chance_over(outlook.lower) < 1.0


def test_the_forecast_sorts_its_known_days_as_often_whatever_their_number(monkeypatch: pytest.MonkeyPatch) -> None:
    """The weekday shape is refitted for every week of the days backtested for the interval, each
    time from the days before it in order, not by sorting all the known days again: a longer
    history is no more sorts of days."""
    from exporter.model import forecast as module

    sorts_of_days = [0]

    def counting(values, **kwargs):  # type: ignore[no-untyped-def]
        values = list(values)
        sorts_of_days[0] += bool(values) and isinstance(values[0], dt.date)
        return sorted(values, **kwargs)

    monkeypatch.setattr(module, "sorted", counting, raising=False)
    counts = []
    for months in (3, 9):
        history = held(*(f"2026-{m:02}" for m in range(12 - months, 12)))
        december = {d: a for d, a in YEAR["2026-12"].items() if d.day < 10}
        sorts_of_days[0] = 0
        module._errors_of.cache_clear()  # (learnt anew, not kept from another test)
        found = month_forecast("2026-12", dt.date(2026, 12, 10), december, history)
        assert found.lower < found.point < found.upper  # (the model's forecast, not the fallback's)
        counts.append(sorts_of_days[0])
    assert counts[0] == counts[1] > 0, counts


def test_the_errors_learnt_are_kept_for_a_forecast_that_knows_the_same_days_only() -> None:
    """A forecast that knows the same days (a day's bills refreshes, a backtest's evaluations of a
    day) takes the errors learnt before; one that knows a day otherwise (a bill revised) learns them
    anew."""
    from exporter.model import forecast as module

    today, revised_day = FIRST.replace(day=20), FIRST.replace(day=10)
    module._errors_of.cache_clear()
    first = june(today)
    assert june(today) == first
    assert module._errors_of.cache_info().hits == 1
    tripled = {revised_day: YEAR[MONTH][revised_day] * 3}
    revised = june(today, tripled)
    assert (revised.lower, revised.upper) != (first.lower, first.upper)
    module._errors_of.cache_clear()
    assert june(today, tripled) == revised  # (as learnt afresh)


def test_the_interval_holds_the_errors_where_the_smoothed_bias_misses_their_median() -> None:
    """Errors growing with the days ahead, as steady growth makes them: the bias curve (which
    flattens) misses their median far ahead, and the interval, spread from that curve, still holds
    the errors as often as its level says."""
    from statistics import NormalDist

    from exporter.model.forecast import _fitted

    noise = [(i - 20) / 2000 for i in range(41)]  # ±1%, evenly
    samples = {k: [0.003 * k + e for e in noise] for k in range(1, 32)}
    errors = _fitted(samples, DEFAULT_LEVEL)
    z = NormalDist().inv_cdf((1 + DEFAULT_LEVEL) / 2)
    held = {}
    for k, found in samples.items():
        centre, below, above = errors.at(k)
        held[k] = sum(centre - z * below <= e <= centre + z * above for e in found) / len(found)
    assert sum(held.values()) / len(held) >= DEFAULT_LEVEL  # (spread from each day's own median: 0.42)
    assert min(held.values()) >= 0.4  # (before: none held at 1 day ahead, nor past 24)
