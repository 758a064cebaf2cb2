"""Budgets on the forecast (`basis: forecast`): a tier fires on the day the month's forecast first
reaches it, once per period, saying the day the pace crosses the amount; over the simulator's
seasonal history, day by day, as the daemon refreshes and evaluates."""

from __future__ import annotations

import datetime as dt
import shutil
import sqlite3
from decimal import Decimal
from pathlib import Path

from exporter.app.daemon import Daemon
from exporter.config.load import validate
from exporter.core.clock import Clock, FrozenClock, days_in_period
from exporter.model.forecast import filled, month_forecast
from exporter.sim import ITEMS, Simulator, SpendModel
from tests.conftest import SHANGHAI
from tests.daemon_fakes import fake_billing_section, metrics, statuses, told, unit_daemon
from tests.helpers import named

MONTH = "2026-10"


def account_days(sim: Simulator, first: dt.date, last: dt.date) -> dict[dt.date, Decimal]:
    """The simulator's payable amount of each day from `first` to `last`, the whole account."""
    days, day = {}, first
    while day <= last:
        days[day] = sum(
            (sim.charge(f"{day:%Y-%m}", day, e, item)[0] for e in sim.endpoints for item in ITEMS), Decimal(0)
        )
        day += dt.timedelta(days=1)
    return days


def test_a_forecast_budget_fires_on_the_day_the_pace_first_reaches_it_and_once(tmp_path: Path) -> None:
    frozen = FrozenClock(dt.datetime(2026, 10, 1, 23, 0, tzinfo=SHANGHAI))
    clock = Clock(SHANGHAI, frozen)
    sim = Simulator(clock=clock)
    sim.spend = SpendModel(start=dt.date(2026, 6, 1))
    first = dt.date(2026, 10, 1)
    history = account_days(sim, dt.date(2026, 7, 1), first - dt.timedelta(days=1))
    month = account_days(sim, first, dt.date(2026, 10, days_in_period(MONTH)))
    # What the forecast says at each day's end (its bills through that day, three months before),
    # and an amount it first reaches mid-month: the day the alert must fire.
    points = {
        day: month_forecast(MONTH, day, {d: a for d, a in month.items() if d <= day}, filled("2026-09", history)).point
        for day in month
    }
    amount = sorted(points.values())[len(points) // 2].quantize(Decimal("0.01"))
    expected = min(day for day, point in points.items() if point >= amount)
    assert first < expected < max(month)  # (the amount is reached mid-month, not on the first day)

    document = {
        "billing": fake_billing_section(sim, history_months=3),
        "budgets": [{"name": "monthly", "amount": str(amount)}],
        "alerts": {
            "rules": [
                {"alert": "MonthlyForecast", "budget": "monthly", "tiers": [1.0], "basis": "forecast",
                 "annotations": {"description": "crossed on {crossing_day} at this pace ({chance})"}},
            ],
            "notifiers": [{"name": "hook", "type": "webhook", "url": "http://127.0.0.1:9/hook"}],
        },
        "state": {"path": str(tmp_path / "state.db")},
    }  # fmt: skip
    daemon = unit_daemon(validate(document, {}), sim, clock)
    fired_on = []
    try:
        for day in sorted(month):
            frozen.set(dt.datetime.combine(day, dt.time(23, 0), SHANGHAI))
            for source in ("history", "bills"):
                assert daemon.refresh(source), source
            daemon.alert_cycle()
            now = clock.now().timestamp()
            held = daemon.sources.engine.current()
            fired_on += [day for a in held if a.state == "firing" and a.fired_at == now]
            # Firing from that day while the forecast stays over; resolved for good once it falls back.
            over = expected <= day and all(points[d] >= amount for d in points if expected <= d <= day)
            assert [a.state for a in held if a.state == "firing"] == (["firing"] if over else []), day
        assert fired_on == [expected]  # on that day, and never again this month
        assert statuses(daemon)[0] == "firing"
        event = told(daemon)[0]
        (alert,) = event["alerts"]
        assert alert["labels"]["basis"] == "forecast"
        crossing = month_forecast(
            MONTH, expected, {d: a for d, a in month.items() if d <= expected}, filled("2026-09", history)
        ).crossing_day(amount, sum((a for d, a in month.items() if d <= expected), Decimal(0)))
        assert crossing is not None
        assert alert["annotations"]["description"].startswith(f"crossed on {crossing.isoformat()} at this pace (")
    finally:
        daemon.stop()


def test_a_restart_forecasts_with_the_months_the_state_file_holds_before_the_history_refreshes(
    tmp_path: Path,
) -> None:
    """Mid-month, the bills refreshed before the history after a restart (the history waits for
    bills and usage): the forecast, its interval and a forecast budget's ratio are those the process
    showed before it stopped, not ones made without the trailing months, until the next bills refresh."""
    frozen = FrozenClock(dt.datetime(2026, 11, 22, 10, 0, tzinfo=SHANGHAI))
    clock = Clock(SHANGHAI, frozen)
    sim = Simulator(clock=clock)
    document = {
        "billing": fake_billing_section(sim, history_months=3),
        "budgets": [{"name": "daily", "amount": "1000", "period": "day"}],
        "state": {"path": str(tmp_path / "state.db")},
    }
    names = (
        "inference_bill_month_forecast_payable_amount",
        "inference_bill_month_forecast_lower_payable_amount",
        "inference_bill_month_forecast_upper_payable_amount",
        "inference_budget_forecast_ratio",
    )

    def figures(daemon: Daemon) -> dict[str, dict[object, float]]:
        series = metrics(daemon)
        return {name: named(series, name) for name in names}

    daemon = unit_daemon(validate(document, {}), sim, clock)
    for source in ("history", "bills", "usage"):
        assert daemon.refresh(source)
    before = figures(daemon)
    assert all(before.values())
    daemon.stop(grace=1)
    frozen.advance(dt.timedelta(minutes=30))
    restarted = unit_daemon(validate(document, {}), sim, clock)
    try:
        for source in ("bills", "usage"):  # (the history not yet)
            assert restarted.refresh(source)
        assert restarted.latest.history is None
        assert figures(restarted) == before
    finally:
        restarted.stop(grace=1)


def test_a_restart_a_month_later_forecasts_without_a_month_saved_before_it_ended(tmp_path: Path) -> None:
    """Stopped on 12 October, restarted on 6 November (after the grace days): the state file holds
    October as fetched on the 12th. Until the history refreshes, the forecast is the one made with
    the months held that had ended, as if October were not held (its last 19 days are not read as
    nothing spent, which made the forecast the month so far, its interval none)."""
    frozen = FrozenClock(dt.datetime(2026, 10, 12, 10, 0, tzinfo=SHANGHAI))
    clock = Clock(SHANGHAI, frozen)
    sim = Simulator(clock=clock)

    def document(state: Path) -> dict:
        return {"billing": fake_billing_section(sim, history_months=3), "state": {"path": str(state)}}

    def forecast(daemon: Daemon) -> tuple[float, float, float]:
        series = metrics(daemon)
        names = ("", "_lower", "_upper")
        return tuple(  # type: ignore[return-value]
            named(series, f"inference_bill_month_forecast{n}_payable_amount")[frozenset({("period", "2026-11")})]
            for n in names
        )

    first = unit_daemon(validate(document(tmp_path / "state.db"), {}), sim, clock)
    for source in ("history", "bills", "usage"):
        assert first.refresh(source)
    first.stop(grace=1)
    shutil.copy(tmp_path / "state.db", tmp_path / "ended.db")
    with sqlite3.connect(tmp_path / "ended.db") as db:  # (the same months held, without October)
        assert db.execute("DELETE FROM bill_history WHERE period = '2026-10'").rowcount == 1
    db.close()
    frozen.set(dt.datetime(2026, 11, 6, 10, 0, tzinfo=SHANGHAI))
    restarted = unit_daemon(validate(document(tmp_path / "state.db"), {}), sim, clock)
    ended = unit_daemon(validate(document(tmp_path / "ended.db"), {}), sim, clock)
    try:
        for daemon in (restarted, ended):
            assert daemon.refresh("bills")
        point, lower, upper = forecast(restarted)
        assert (point, lower, upper) == forecast(ended)
        assert lower < point < upper
    finally:
        restarted.stop(grace=1)
        ended.stop(grace=1)


def test_history_the_state_file_cannot_give_back_does_not_fail_the_bills(tmp_path: Path) -> None:
    """A month's row the state file holds unreadable: after a restart, the bills refresh (and are
    forecast without the months held); the history's own refresh says what is wrong."""
    frozen = FrozenClock(dt.datetime(2026, 11, 22, 10, 0, tzinfo=SHANGHAI))
    clock = Clock(SHANGHAI, frozen)
    sim = Simulator(clock=clock)
    document = {"billing": fake_billing_section(sim, history_months=3), "state": {"path": str(tmp_path / "s.db")}}
    first = unit_daemon(validate(document, {}), sim, clock)
    for source in ("history", "bills", "usage"):
        assert first.refresh(source)
    first.stop(grace=1)
    with sqlite3.connect(tmp_path / "s.db") as db:
        db.execute("UPDATE bill_history SET by_item = '[[' WHERE period = '2026-09'")
    db.close()
    restarted = unit_daemon(validate(document, {}), sim, clock)
    try:
        assert restarted.refresh("bills")
        assert restarted.latest.bills is not None
    finally:
        restarted.stop(grace=1)
