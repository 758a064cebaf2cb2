"""backtest: the daemon's own rules replayed over months the simulator bills with a weekly rhythm,
noise, growth and known spikes; what fires must be what the simulator's figures say, day by day.

The replay reads the simulator in process (tests/fakes.py); the command runs as a process against
it over HTTP, and in process where it refuses a range before it builds a client."""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest
import yaml

from exporter.config.load import validate
from exporter.core.clock import Clock, first_day, period_at, period_index
from exporter.model.forecast import month_forecast
from exporter.replay.backfill import MAX_MONTHS
from exporter.replay.backtest import backtest, render
from exporter.sim import ITEMS, Simulator, SimulatorServer, SpendModel
from tests.conftest import SHANGHAI
from tests.daemon_fakes import fake_billing_section
from tests.fakes import FakeBilling

SPIKES = [(dt.date(2026, 9, 16), 1, 2.5), (dt.date(2026, 10, 8), 2, 2.0), (dt.date(2026, 10, 31), 0, 2.5)]
"""The last on the last day of the range: judged (and fired) on 1 November, still reported."""


@pytest.fixture
def history(sim: Simulator) -> Simulator:
    sim.spend = SpendModel(start=dt.date(2026, 6, 1))
    for day, endpoint, factor in SPIKES:
        sim.add_spike(day, sim.endpoints[endpoint].endpoint_id, factor)
    sim.add_spike(dt.date(2026, 8, 31), sim.endpoints[0].endpoint_id, 3.0)  # before the range: fires on its
    return sim  # first day, but it is about a day the backtest was not asked for


def spent(sim: Simulator, day: dt.date, endpoint: int | None = None) -> Decimal:
    endpoints = sim.endpoints if endpoint is None else [sim.endpoints[endpoint]]
    return sum((sim.charge(f"{day:%Y-%m}", day, e, item)[0] for e in endpoints for item in ITEMS), Decimal(0))


def days_of(first: dt.date, last: dt.date) -> list[dt.date]:
    return [first + dt.timedelta(days=n) for n in range((last - first).days + 1)]


@pytest.mark.parametrize("slow", [None, "1d", "2d"])
def test_backtest_fires_what_the_figures_say_on_the_day_they_say_it(
    history: Simulator, fake: FakeBilling, clock: Clock, slow: str | None
) -> None:
    """(`slow`: beside them, a rule that never fires, whose `for` is a day or more: it changes
    nothing of when the others fire.)"""
    threshold = Decimal(160)
    budget = spent(history, dt.date(2026, 9, 1)) * 30  # a month's budget somewhere inside September's spend
    team = history.endpoints[1].endpoint_id
    team_budget = spent(history, dt.date(2026, 9, 1), 1) * 25  # an endpoint's, crossed late in each month
    config = validate(
        {
            "billing": fake_billing_section(history),
            "budgets": [{"name": "monthly", "amount": str(budget)},
                        {"name": "team", "amount": str(team_budget), "where": {"endpoint_id": team}},
                        {"name": "model-a", "amount": "5", "where": {"model": "model-a"}}],
            "prices": [{"model": "model-a", "prompt_per_million": 1, "completion_per_million": 2}],
            "alerts": {
                "rules": [
                    {"alert": "DailyHigh", "signal": "spend", "by": ["endpoint_id"], "threshold": str(threshold),
                     "for": "10m"},
                    {"alert": "Budget", "budget": "monthly", "tiers": [0.5, 1.0]},
                    {"alert": "Anomaly", "signal": "spend_anomaly", "by": ["endpoint_id"], "min_amount": "20",
                     "min_percent": 30},
                    {"alert": "Requests", "signal": "requests", "threshold": 1},
                    {"alert": "TeamBudget", "budget": "team", "tiers": [1.0]},
                    {"alert": "ModelBudget", "budget": "model-a", "tiers": [1.0]},
                    *([{"alert": "Slow", "signal": "spend", "window": "month", "threshold": "1e12", "for": slow}]
                      if slow else []),
                ]
            },
        },
        {},
    )  # fmt: skip
    fired, notes = backtest(config, "2026-09", "2026-10", clock, fake)
    assert notes == [
        "alerts.rules[3] (Requests): skipped: `requests` is not in the bills",
        "alerts.rules[5] (ModelBudget): skipped: budget 'model-a' is priced from usage",
    ]
    by_rule: dict[str, list[tuple[dt.date, dict[str, str]]]] = {}
    for f in fired:
        by_rule.setdefault(f.alert.labels["alertname"], []).append((f.day, f.alert.labels))

    # DailyHigh: an endpoint's day over the threshold fires on that day: each day's spend starts
    # from nothing, so the alert resolves at midnight and fires anew, as the daemon's would
    expected_high = []
    for index, endpoint in enumerate(history.endpoints):
        over = [d for d in days_of(dt.date(2026, 9, 1), dt.date(2026, 10, 31)) if spent(history, d, index) > threshold]
        expected_high += [(d, endpoint.endpoint_id) for d in over]
    got_high = [(d, labels["endpoint_id"]) for d, labels in by_rule.get("DailyHigh", [])]
    assert sorted(got_high) == sorted(expected_high)
    assert len(got_high) > 5  # weekdays of the busiest endpoint, and the spikes

    # Budget: each tier once per month, on the day month to date crosses it
    expected_tiers = []
    for month in (9, 10):
        total, crossed = Decimal(0), set()
        for d in days_of(dt.date(2026, month, 1), dt.date(2026, month + 1, 1) - dt.timedelta(days=1)):
            total += spent(history, d)
            reached = [t for t in (0.5, 1.0) if total / budget >= Decimal(str(t)) and t not in crossed]
            if reached:
                expected_tiers.append((d, f"{max(reached):g}"))
                crossed |= {t for t in (0.5, 1.0) if total / budget >= Decimal(str(t))}
    assert [(d, labels["tier"]) for d, labels in by_rule["Budget"]] == expected_tiers

    # TeamBudget: the scoped budget crosses on the day its endpoint's month to date does, alone
    expected_team = []
    for month in (9, 10):
        total = Decimal(0)
        for d in days_of(dt.date(2026, month, 1), dt.date(2026, month + 1, 1) - dt.timedelta(days=1)):
            total += spent(history, d, 1)
            if total >= team_budget:
                expected_team.append((d, team))
                break
    assert expected_team  # crossed at least once: the test means something
    assert [(d, labels["tier"]) for d, labels in by_rule["TeamBudget"]] == [(d, "1") for d, _ in expected_team]

    # Anomaly: each spike, judged the day after it, about the day it happened, in its endpoint alone
    assert [(d, labels["day"], labels["endpoint_id"]) for d, labels in by_rule["Anomaly"]] == [
        (day + dt.timedelta(days=1), day.isoformat(), history.endpoints[endpoint].endpoint_id)
        for day, endpoint, _ in SPIKES
    ]

    lines = [json.loads(line) for line in render(fired, "json").splitlines()]
    assert len(lines) == len(fired)
    assert set(lines[0]) == {"day", "alertname", "labels", "value", "annotations"}
    assert render(fired, "text").count("\n") == len(fired)


def _last_two_months() -> tuple[dt.date, str, str]:
    """Today on the real clock (what the command runs on), and the two months before this one."""
    from exporter.core.clock import previous_period

    today = Clock().today()
    last = previous_period(f"{today:%Y-%m}")
    return today, previous_period(last), last


def test_backtest_forecast_prints_each_days_forecast_against_the_months_total(
    live: tuple[Simulator, SimulatorServer], tmp_path: Path
) -> None:
    from tests.test_cli import run, write_config

    sim, server = live
    today, first, last = _last_two_months()
    sim.spend = SpendModel(start=today - dt.timedelta(days=200))
    config = write_config(tmp_path, sim, server, history_months=3)
    env = {"TEST_BILLING_SECRET": sim.secret_access_key}
    result = run("backtest", "--config", str(config), "--from", first, "--to", last, "--forecast", "--format", "json",
                 env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert {tuple(sorted(line)) for line in lines} == {("actual", "day", "forecast", "lower", "period", "upper")}
    assert {line["period"] for line in lines} == {first, last}
    for line in lines:  # each month's actual is the simulator's total; each day's interval holds its point
        assert Decimal(line["actual"]) == sim.bill_totals(line["period"])["total"]
        assert Decimal(line["lower"]) <= Decimal(line["forecast"]) <= Decimal(line["upper"])
    text = run("backtest", "--config", str(config), "--from", first, "--to", last, "--forecast", env=env)
    assert text.returncode == 0, text.stderr
    assert text.stdout.splitlines()[0].split() == ["day", "n", "forecast", "formula", "naive", "inside"]


def test_the_backtest_command_prints_json_lines_and_refuses_months_that_make_no_sense(
    live: tuple[Simulator, SimulatorServer], tmp_path: Path
) -> None:
    from tests.test_cli import run, write_config

    sim, server = live
    _, first, last = _last_two_months()
    spike = dt.date(int(first[:4]), int(first[5:]), 16)
    sim.spend = SpendModel(start=spike - dt.timedelta(days=120))
    sim.add_spike(spike, sim.endpoints[0].endpoint_id, 3.0)
    config = write_config(tmp_path, sim, server)
    document = yaml.safe_load(config.read_text())
    document["alerts"] = {
        "rules": [
            {
                "alert": "Anomaly",
                "signal": "spend_anomaly",
                "by": ["endpoint_id"],
                "min_amount": "20",
                "min_percent": 30,
            },
            {"alert": "Tokens", "signal": "tokens", "threshold": 1},
        ]
    }
    config.write_text(yaml.safe_dump(document))
    env = {"TEST_BILLING_SECRET": sim.secret_access_key}
    result = run("backtest", "--config", str(config), "--from", first, "--to", last, "--format", "json", env=env)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(line["day"], line["labels"]["day"], line["labels"]["endpoint_id"]) for line in lines] == [
        ((spike + dt.timedelta(days=1)).isoformat(), spike.isoformat(), sim.endpoints[0].endpoint_id)
    ]
    assert "alerts.rules[1] (Tokens): skipped: `tokens` is not in the bills" in result.stderr
    assert sim.secret_access_key not in result.stdout + result.stderr

    for args, message in [
        (["--from", "2026-13"], "'2026-13' is not a month (YYYY-MM)"),
        (["--from", "0001-01"], "0001-01 is before 1970"),
        (["--from", last, "--to", first], f"--from {last} is after --to {first}"),
        (["--from", "2999-01", "--to", "2999-02"], "--from 2999-01 has not begun yet"),
        (["--from", "2999-01"], "--from 2999-01 has not begun yet"),  # (not "after --to", which was not given)
        (["--from", first, "--to", "2999-02"], "--to 2999-02 has not begun yet"),  # (not stopped at today, unsaid)
    ]:
        refused = run("backtest", "--config", str(config), *args, env=env)
        assert refused.returncode == 2
        assert message in refused.stderr
        assert refused.stdout == ""


@pytest.mark.parametrize("level", ["info", "debug"])
def test_the_backtest_command_prints_its_results_alone_on_stdout_and_the_replay_s_logs_only_at_debug(
    live: tuple[Simulator, SimulatorServer], tmp_path: Path, level: str
) -> None:
    """A threshold every day crosses fires anew each day: hundreds of results, which once came among
    the engine's line for each alert firing and resolving in the replay (three times as many)."""
    from exporter.core.clock import previous_period
    from tests.test_cli import run, write_config

    sim, server = live
    clock = Clock()  # the command runs on the real clock
    last = previous_period(clock.period())
    first = previous_period(last)
    sim.spend = SpendModel(start=first_day(first) - dt.timedelta(days=120))
    config = write_config(tmp_path, sim, server, log_level=level)
    document = yaml.safe_load(config.read_text())
    document["alerts"] = {"rules": [{"alert": "DailyHigh", "signal": "spend", "by": ["endpoint_id"], "threshold": 0}]}
    config.write_text(yaml.safe_dump(document))
    env = {"TEST_BILLING_SECRET": sim.secret_access_key}
    result = run("backtest", "--config", str(config), "--from", first, "--to", last, env=env)
    assert result.returncode == 0, result.stderr

    fired, notes = backtest(validate(document, env), first, last, clock)
    assert notes == []
    assert len(fired) > 100
    assert result.stdout == render(fired, "text")  # the results, and nothing else
    if level == "info":
        assert result.stderr == ""
    else:  # asked for: the replay's own account of each alert, and the requests
        assert result.stderr.count('msg="alert firing"') == len(fired)
        assert "component=urllib3.connectionpool" in result.stderr


@pytest.fixture
def root_logging() -> Iterator[None]:
    """The root logger as it was before a command run in process set up its own."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize("first", ["one-over", "2000-01"])
def test_a_backtest_over_more_months_than_backfill_takes_is_refused_before_any_request(
    sim: Simulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    root_logging: None, first: str,
) -> None:  # fmt: skip
    """`--from 2000-01` once made 1,640 bills requests: the range has backfill's cap, and is refused
    with one line and exit 2 before the API hears of it. In process, the API at an address where
    nothing answers: a request would end the command otherwise (exit 3, naming the failure)."""
    from tests.test_cli import invoke

    current = Clock(SHANGHAI).period()  # the command runs on the real clock, in the config's billing zone
    if first == "one-over":
        first = period_at(period_index(current) - MAX_MONTHS)
    count = period_index(current) - period_index(first) + 1
    config = tmp_path / "config.yaml"
    billing = fake_billing_section(sim, secret_access_key="${TEST_BILLING_SECRET}")
    config.write_text(yaml.safe_dump({"billing": billing}))
    result = invoke(monkeypatch, capsys, "backtest", "--config", str(config), "--from", first,
                    env={"TEST_BILLING_SECRET": sim.secret_access_key})  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"inference-cost-exporter: backtest: {count} months from {first} to {current}: at most {MAX_MONTHS} at once"
    ]
    assert result.stdout == ""


def test_a_budget_on_the_forecast_is_judged_on_the_forecast_the_daemon_makes(
    history: Simulator, fake: FakeBilling, clock: Clock
) -> None:
    """The month's forecast a `basis: forecast` tier is judged on is the daemon's: the model learnt
    from the months it holds before (`history_months`), with its interval, as each day began and
    ended; its tier fires on the first day that forecast reaches the amount."""
    held = {d: spent(history, d) for d in days_of(dt.date(2026, 7, 1), dt.date(2026, 9, 30))}

    def forecasts(level: float) -> list[tuple[dt.date, Decimal]]:
        """The daemon's forecast of October on each day, as the day began and as it ended."""
        october = days_of(dt.date(2026, 10, 1), dt.date(2026, 10, 31))
        return [
            (
                day,
                month_forecast("2026-10", day, {d: spent(history, d) for d in october if d <= upto}, held, level).point,
            )
            for day in october
            for upto in (day - dt.timedelta(days=1), day)
        ]

    document = {
        "billing": fake_billing_section(history) | {"history_months": 3},
        "budgets": [{"name": "monthly", "amount": "1"}],
        "alerts": {"rules": [{"alert": "Forecast", "budget": "monthly", "tiers": [1.0], "basis": "forecast"}]},
    }
    level = validate(document, {}).forecast.interval
    amount = dict(forecasts(level))[dt.date(2026, 10, 12)].quantize(Decimal("0.01"))  # reached mid-month, or before
    document["budgets"] = [{"name": "monthly", "amount": str(amount)}]
    fired, _ = backtest(validate(document, {}), "2026-10", "2026-10", clock, fake)
    first = min(day for day, point in forecasts(level) if point >= amount)
    assert [f.day for f in fired if f.alert.labels["alertname"] == "Forecast"] == [first]
