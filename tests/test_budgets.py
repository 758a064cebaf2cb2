"""Scoped budgets: the daemon on the simulator in process (tests/daemon_fakes.py), and once end to end
against it over HTTP; truth from the simulator's own sums."""

from __future__ import annotations

import datetime as dt
import json
import logging
from decimal import Decimal
from pathlib import Path

import pytest
import yaml

from exporter.alerts.promrules import rule_file
from exporter.app.daemon import Daemon
from exporter.config.load import load, validate
from exporter.core.clock import Clock, FrozenClock
from exporter.model.forecast import month_forecast
from exporter.sim import ITEMS, Simulator, SimulatorServer
from exporter.sim.model import API_KEYS, MILLION
from tests.conftest import billing_section
from tests.daemon_fakes import NOWHERE, fake_billing_section, metrics, page, told, unit_daemon
from tests.helpers import logged, scrape, value

PRICES = [
    {"model": "model-a", "prompt_per_million": "4", "cached_prompt_per_million": "1", "completion_per_million": "16"},
    {"model": "model-b", "prompt_per_million": "2", "completion_per_million": "8"},
]
PRICE = {p["model"]: p for p in PRICES}


def priced(sim: Simulator, day: dt.date, *, model: str | None = None, api_key: str | None = None) -> Decimal:
    """The simulator's records of `day` in the scope, priced by hand."""
    total = Decimal(0)
    for r in sim.usage_records(day):
        if (model is not None and r["model"] != model) or (api_key is not None and r["apikey"] != api_key):
            continue
        price = PRICE[r["model"]]
        cached_price = Decimal(price.get("cached_prompt_per_million", price["prompt_per_million"]))
        total += (
            (r["promptTokens"] - r["promptCachedTokens"]) * Decimal(price["prompt_per_million"])
            + r["promptCachedTokens"] * cached_price
            + r["completionTokens"] * Decimal(price["completion_per_million"])
        ) / MILLION
    return total


def billed(sim: Simulator, day: dt.date, *, endpoint_id: str | None = None, item: str | None = None) -> Decimal:
    return sum(
        (
            sim.charge(f"{day:%Y-%m}", day, e, i)[0]
            for e in sim.endpoints
            for i in ITEMS
            if endpoint_id in (None, e.endpoint_id) and item in (None, i)
        ),
        Decimal(0),
    )


def by_hand_forecast(days: list[Decimal], today: dt.date, month_days: int) -> Decimal:
    """Complete days + max(today, trailing average) + trailing average × the days after today."""
    *complete, so_far = days
    window = complete[-7:]
    average = sum(window, Decimal(0)) / len(window)
    return sum(complete, Decimal(0)) + max(so_far, average) + average * (month_days - today.day)


def start(sim: Simulator, server: SimulatorServer, clock: Clock, tmp_path: Path, **extra: object) -> Daemon:
    billing = billing_section(sim, server) | extra.pop("billing", {})  # type: ignore[operator]
    document = {"billing": billing, "state": {"path": str(tmp_path / "state.db")}} | extra
    daemon = Daemon(validate(document, {}), clock=clock, listen="127.0.0.1:0")
    daemon.start(schedule=False)
    return daemon


def unit(sim: Simulator, clock: Clock, tmp_path: Path, **extra: object) -> Daemon:
    """`start` in the unit layer: on `sim` in process, no server, nothing delivered (see daemon_fakes)."""
    billing = fake_billing_section(sim) | extra.pop("billing", {})  # type: ignore[operator]
    document = {"billing": billing, "state": {"path": str(tmp_path / "state.db")}} | extra
    return unit_daemon(validate(document, {}), sim, clock)


def to_hook(rule: dict) -> dict:
    """An `alerts` section: `rule`, told to a webhook (its notifications read from the outbox)."""
    return {"rules": [rule], "notifiers": [{"name": "hook", "type": "webhook", "url": f"{NOWHERE}/hook"}]}


def test_budgets_on_an_endpoint_and_on_an_item_measure_only_their_share_of_the_bills(
    sim: Simulator, server: SimulatorServer, clock: Clock, tmp_path: Path
) -> None:
    """End to end: the bills over HTTP, the figures scraped."""
    today = clock.today()
    endpoint = sim.endpoints[1].endpoint_id
    budgets = [
        {"name": "account", "amount": "10000"},
        {"name": "team", "amount": "2000", "where": {"endpoint_id": endpoint}},
        {"name": "completion-today", "amount": "50", "period": "day", "where": {"item": ITEMS[-1]}},
        {"name": "main-project", "amount": "3000", "where": {"project_id": "proj-main"}},
    ]
    daemon = start(sim, server, clock, tmp_path, budgets=budgets)
    try:
        assert daemon.refresh("bills")
        series = scrape(daemon.server.url)
        days = [today.replace(day=d) for d in range(1, today.day + 1)]

        team = [billed(sim, d, endpoint_id=endpoint) for d in days]
        assert value(series, "inference_budget_used_ratio", budget="team") == pytest.approx(
            float(sum(team) / 2000), rel=1e-12
        )
        team_forecast = month_forecast(f"{today:%Y-%m}", today, dict(zip(days, team, strict=True))).point
        assert value(series, "inference_budget_forecast_ratio", budget="team") == pytest.approx(
            float(team_forecast / 2000), rel=1e-12
        )  # the endpoint's own days, through the bills' model (no history held here)
        completion = [billed(sim, d, item=ITEMS[-1]) for d in days]
        assert value(series, "inference_budget_used_ratio", budget="completion-today") == pytest.approx(
            float(completion[-1] / 50), rel=1e-12
        )
        main = sum(
            billed(sim, d, endpoint_id=e.endpoint_id)
            for d in days
            for e in sim.endpoints
            if e.project_id == "proj-main"
        )
        assert value(series, "inference_budget_used_ratio", budget="main-project") == pytest.approx(
            float(main / 3000), rel=1e-12
        )
        account = sum(billed(sim, d) for d in days)
        assert value(series, "inference_budget_used_ratio", budget="account") == pytest.approx(
            float(account / 10000), rel=1e-12
        )
        assert 0 < sum(team) < account  # a share, not the whole
    finally:
        daemon.stop()


def test_a_budget_on_an_endpoint_fires_its_tiers_from_that_endpoint_alone(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    today = clock.today()
    team, other = sim.endpoints[0].endpoint_id, sim.endpoints[1].endpoint_id
    spent = sum(billed(sim, today.replace(day=d), endpoint_id=team) for d in range(1, today.day + 1))
    budgets = [{"name": "team", "amount": str(spent / Decimal("0.7")), "where": {"endpoint_id": team}}]
    rule = {"alert": "TeamBudget", "budget": "team", "tiers": [0.5, 0.8, 1.0]}
    daemon = unit(sim, clock, tmp_path, budgets=budgets, alerts=to_hook(rule))
    try:
        daemon.refresh("bills")
        daemon.alert_cycle()
        assert [e["alerts"][0]["labels"]["tier"] for e in told(daemon)] == ["0.5"]

        sim.revise_bill(today, other, ITEMS[0], Decimal("100000"))  # another endpoint's spend: not the team's
        frozen.advance(dt.timedelta(minutes=5))
        daemon.refresh("bills")
        daemon.alert_cycle()
        assert [e["alerts"][0]["labels"]["tier"] for e in told(daemon)] == ["0.5"]

        sim.revise_bill(
            today, team, ITEMS[0], sim.charge(f"{today:%Y-%m}", today, sim.endpoints[0], ITEMS[0])[0] + spent
        )
        frozen.advance(dt.timedelta(minutes=5))
        daemon.refresh("bills")
        daemon.alert_cycle()
        assert [e["alerts"][0]["labels"]["tier"] for e in told(daemon)] == ["0.5", "1"]
        assert told(daemon)[-1]["alerts"][0]["labels"]["budget"] == "team"
    finally:
        daemon.stop()


@pytest.mark.parametrize("basis", ["actual", "forecast"])
def test_a_budget_alert_tells_its_amount_in_the_account_s_currency(
    sim: Simulator, clock: Clock, tmp_path: Path, basis: str
) -> None:
    today = clock.today()
    spent = sum(billed(sim, today.replace(day=d)) for d in range(1, today.day + 1))
    budgets = [{"name": "month", "amount": str(spent * 2)}]
    rule = {"alert": "MonthBudget", "budget": "month", "tiers": [0.1], "basis": basis}
    daemon = unit(sim, clock, tmp_path, billing={"currency": "CNY"}, budgets=budgets, alerts=to_hook(rule))
    try:
        daemon.refresh("bills")
        daemon.alert_cycle()
        (summary,) = [e["alerts"][0]["annotations"]["summary"] for e in told(daemon)]
        assert f"of {spent * 2:.2f} CNY: tier 0.1 crossed" in summary
    finally:
        daemon.stop()


def test_budgets_on_a_model_and_on_an_api_key_price_the_usage(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    frozen.set(dt.datetime(2026, 11, 4, 15, 0, tzinfo=clock.tz))
    today = clock.today()
    days = [today.replace(day=d) for d in range(1, today.day + 1)]
    for n, day in enumerate(days):
        sim.add_usage(100 if day == today else 300 + 50 * n, day)  # today so far below the usual day
    key = API_KEYS[1]
    budgets = [
        {"name": "model-a-today", "amount": "5", "period": "day", "where": {"model": "model-a"}},
        {"name": "batch-key", "amount": "20", "where": {"api_key": key}},
    ]
    daemon = unit(
        sim, clock, tmp_path, budgets=budgets, prices=PRICES,
        billing={"per_api_key": True}, reconciliation={"days_per_refresh": 1},
    )  # fmt: skip
    try:
        # Each refresh syncs today and reads one past day (the 3rd, 2nd, then the 1st: all settled by 15:00).
        so_far = priced(sim, today, model="model-a")
        for read in range(1, 4):
            assert value(metrics(daemon), "inference_budget_used_ratio", budget="batch-key") is None
            assert daemon.refresh("usage")
            series = metrics(daemon)
            assert value(series, "inference_budget_used_ratio", budget="model-a-today") == pytest.approx(
                float(so_far / 5), rel=1e-12
            )
            # Today's forecast: max(so far, the average of the past days read so far), never of zeros.
            past = [priced(sim, today - dt.timedelta(days=n), model="model-a") for n in range(1, read + 1)]
            assert so_far < min(past)  # so the forecast is the average's
            assert value(series, "inference_budget_forecast_ratio", budget="model-a-today") == pytest.approx(
                float(max(so_far, sum(past) / len(past)) / 5), rel=1e-12
            )
            assert value(series, "inference_budget_amount", budget="batch-key") == 20
        # The month waited until every past day was read: never a ratio of only some days.
        month = [priced(sim, d, api_key=key) for d in days]
        assert value(series, "inference_budget_used_ratio", budget="batch-key") == pytest.approx(
            float(sum(month) / 20), rel=1e-12
        )
        assert value(series, "inference_budget_forecast_ratio", budget="batch-key") == pytest.approx(
            float(by_hand_forecast(month, today, 30) / 20), rel=1e-12
        )

        sim.add_usage(500)  # more today: the usage budgets move with the usage, not the bills
        frozen.advance(dt.timedelta(minutes=5))
        assert daemon.refresh("usage")
        series = metrics(daemon)
        assert value(series, "inference_budget_used_ratio", budget="model-a-today") == pytest.approx(
            float(priced(sim, today, model="model-a") / 5), rel=1e-12
        )
        month = [priced(sim, d, api_key=key) for d in days]
        assert value(series, "inference_budget_used_ratio", budget="batch-key") == pytest.approx(
            float(sum(month) / 20), rel=1e-12
        )
    finally:
        daemon.stop()


def test_a_usage_month_budget_is_crossed_at_the_pace_of_its_forecast(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    """Spent under the amount, forecast over it: the day its spend crosses the amount at the pace
    of its forecast (today's rest, then the trailing average a day), as a bill budget says it."""
    frozen.set(dt.datetime(2026, 11, 4, 15, 0, tzinfo=clock.tz))
    today = clock.today()
    days = [today.replace(day=d) for d in range(1, today.day + 1)]
    for n, day in enumerate(days):
        sim.add_usage(100 if day == today else 300 + 50 * n, day)
    month = [priced(sim, d, model="model-a") for d in days]
    *complete, so_far = month
    pace = sum(complete, Decimal(0)) / len(complete)
    at_eleven = sum(month, Decimal(0)) + (max(so_far, pace) - so_far) + pace * 11  # (11 days after today)
    budget = {"name": "model-a", "amount": str(at_eleven - pace / 2), "where": {"model": "model-a"}}
    daemon = unit(sim, clock, tmp_path, prices=PRICES, reconciliation={"days_per_refresh": 3}, budgets=[budget])
    try:
        assert daemon.refresh("usage")
        series = metrics(daemon)
        assert value(series, "inference_budget_used_ratio", budget="model-a") < 1
        assert value(series, "inference_budget_forecast_ratio", budget="model-a") > 1
        crossed = value(series, "inference_budget_crossing_timestamp_seconds", budget="model-a")
        assert crossed == clock.day_start(today + dt.timedelta(days=11)).timestamp()
        assert value(series, "inference_budget_crossing_probability", budget="model-a") is None  # (no error known)
    finally:
        daemon.stop()


def test_a_usage_budget_fires_and_a_model_without_a_price_leaves_it_without_figures(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    sim.add_usage(400)
    key = API_KEYS[0]
    spent = priced(sim, clock.today(), api_key=key)
    budgets = [{"name": "key-today", "amount": str(spent / Decimal("0.9")), "period": "day", "where": {"api_key": key}}]
    rule = {"alert": "KeyBudget", "budget": "key-today", "tiers": [0.8, 1.0]}
    daemon = unit(
        sim, clock, tmp_path, budgets=budgets, prices=PRICES, alerts=to_hook(rule), billing={"per_api_key": True}
    )
    try:
        daemon.refresh("usage")
        daemon.alert_cycle()
        assert [e["alerts"][0]["labels"] for e in told(daemon)] == [
            {"alertname": "KeyBudget", "budget": "key-today", "tier": "0.8"}
        ]
    finally:
        daemon.stop()

    only_a = [PRICE["model-a"]]  # the key also calls model-b, which now has no price
    daemon = unit(sim, clock, tmp_path, budgets=budgets, prices=only_a, billing={"per_api_key": True})
    try:
        daemon.refresh("usage")
        series = metrics(daemon)
        assert value(series, "inference_budget_used_ratio", budget="key-today") is None
    finally:
        daemon.stop()


def test_scoped_budgets_export_as_prometheus_rules_on_their_own_ratio(sim: Simulator) -> None:
    config = validate(
        {
            "billing": fake_billing_section(sim),
            "budgets": [{"name": "team", "amount": "2000", "where": {"endpoint_id": "ep-1"}}],
            "alerts": {"rules": [{"alert": "TeamBudget", "budget": "team", "tiers": [0.5, 1.0]}]},
        },
        {},
    )
    text, skipped = rule_file(config.alerts, config.budgets)
    assert skipped == []
    ratio = 'max without (instance) (max by (job, instance, account) (inference_budget_used_ratio{budget="team"}))'
    exprs = [rule["expr"] for rule in yaml.safe_load(text)["groups"][0]["rules"]]
    assert exprs == [f"{ratio} >= 0.5 < 1", f"{ratio} >= 1"]


def test_after_midnight_the_figures_of_the_day_and_month_that_ended_are_not_shown_as_current(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    frozen.set(dt.datetime(2026, 11, 30, 23, 0, tzinfo=clock.tz))
    budgets = [{"name": "month", "amount": "10000"}, {"name": "day", "amount": "500", "period": "day"}]
    daemon = unit(sim, clock, tmp_path, budgets=budgets)
    try:
        assert daemon.refresh("bills")
        before = metrics(daemon)
        assert value(before, "inference_budget_used_ratio", budget="day") is not None
        assert value(before, "inference_budget_used_ratio", budget="month") is not None

        frozen.set(dt.datetime(2026, 12, 1, 0, 0, 5, tzinfo=clock.tz))  # the new day's bills not fetched yet
        after = metrics(daemon)
        for name in ("day", "month"):
            assert value(after, "inference_budget_used_ratio", budget=name) is None  # unknown, not November's
            assert value(after, "inference_budget_forecast_ratio", budget=name) is None
            assert value(after, "inference_budget_amount", budget=name) is not None
        assert "<td>day</td><td>account</td><td>day</td><td>500</td><td class=wait>—</td>" in page(daemon)

        assert daemon.refresh("bills")
        fresh = metrics(daemon)
        december_first = dt.date(2026, 12, 1)
        assert value(fresh, "inference_budget_used_ratio", budget="day") == pytest.approx(
            float(billed(sim, december_first) / 500), rel=1e-12
        )
    finally:
        daemon.stop()


MATCHED = "inference_budget_scope_matched"
UNMATCHED = "budget scope matches nothing"


def test_a_scope_that_matches_nothing_reads_0_on_its_gauge_and_is_warned_about_once(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    endpoint = sim.endpoints[1].endpoint_id
    budgets = [
        {"name": "account", "amount": "10000"},
        {"name": "team", "amount": "2000", "where": {"endpoint_id": endpoint}},
        {"name": "team-typo", "amount": "2000", "where": {"endpoint_id": endpoint.replace("-", "_")}},
        {"name": "item-typo", "amount": "50", "period": "day", "where": {"item": "ITEM_COMPLETION_TOKENS"}},
        {"name": "key", "amount": "20", "where": {"api_key": API_KEYS[0]}},
        {"name": "key-typo", "amount": "20", "where": {"api_key": "sk-7f3b********"}},
    ]
    sim.add_usage(300)
    caplog.set_level(logging.WARNING, logger="exporter.sources.budgets")
    daemon = unit(sim, clock, tmp_path, budgets=budgets, prices=PRICES, billing={"per_api_key": True})
    try:
        series = metrics(daemon)
        assert value(series, MATCHED, budget="account") == 1  # no `where`: it always matches
        for name in ("team", "team-typo", "item-typo", "key", "key-typo"):
            assert value(series, MATCHED, budget=name) is None  # not judged before its source refreshed
        assert logged(caplog.records, UNMATCHED) == []

        assert daemon.refresh("bills")
        series = metrics(daemon)
        assert value(series, MATCHED, budget="team") == 1
        assert value(series, MATCHED, budget="team-typo") == 0
        assert value(series, MATCHED, budget="item-typo") == 0
        assert value(series, MATCHED, budget="key-typo") is None  # on usage, which has not refreshed
        assert value(series, "inference_budget_used_ratio", budget="team-typo") == 0  # what would go unnoticed
        warned = [
            (r.fields["budget"], r.fields["scope"], r.fields["source"]) for r in logged(caplog.records, UNMATCHED)
        ]  # type: ignore[attr-defined]
        assert sorted(warned) == [
            ("item-typo", "item=ITEM_COMPLETION_TOKENS", "bills"),
            ("team-typo", f"endpoint_id={endpoint.replace('-', '_')}", "bills"),
        ]
        rows = page(daemon).split("<tr>")
        marked = {row.split("</td>")[0].removeprefix("<td>") for row in rows if "matches nothing" in row}
        assert marked == {"team-typo", "item-typo"}  # the landing page says it too

        assert daemon.refresh("usage")
        series = metrics(daemon)
        assert value(series, MATCHED, budget="key") == 1
        assert value(series, MATCHED, budget="key-typo") == 0
        assert len(logged(caplog.records, UNMATCHED, budget="key-typo", scope="api_key=sk-7f3b********")) == 1

        for _ in range(2):  # refreshes that find the scopes still matching nothing say nothing new
            frozen.advance(dt.timedelta(minutes=5))
            assert daemon.refresh("bills")
            assert daemon.refresh("usage")
            metrics(daemon)
        assert len(logged(caplog.records, UNMATCHED)) == 3
    finally:
        daemon.stop()


def test_a_reload_that_corrects_a_scope_brings_its_gauge_to_1_and_a_new_miss_is_warned_about_again(
    sim: Simulator, clock: Clock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    endpoint = sim.endpoints[0].endpoint_id
    path = tmp_path / "config.yaml"

    def write(scope: str, amount: str = "2000") -> None:
        budget = {"name": "team", "amount": amount, "where": {"endpoint_id": scope}}
        document = {
            "billing": fake_billing_section(sim),
            "budgets": [budget],
            "state": {"path": str(tmp_path / "s.db")},
        }
        path.write_text(yaml.safe_dump(document))

    caplog.set_level(logging.WARNING, logger="exporter.sources.budgets")
    write("ep-typo")
    daemon = unit_daemon(load(path), sim, clock, config_path=path)
    try:
        assert daemon.refresh("bills")
        assert value(metrics(daemon), MATCHED, budget="team") == 0
        assert len(logged(caplog.records, UNMATCHED, budget="team", scope="endpoint_id=ep-typo")) == 1

        write(endpoint)
        assert daemon.reload()
        assert value(metrics(daemon), MATCHED, budget="team") == 1
        assert len(logged(caplog.records, UNMATCHED)) == 1

        write("ep-typo")  # it matched something, and now nothing again: that is news
        assert daemon.reload()
        assert value(metrics(daemon), MATCHED, budget="team") == 0
        assert len(logged(caplog.records, UNMATCHED, budget="team", scope="endpoint_id=ep-typo")) == 2

        write("ep-typo", amount="3000")  # a reload that keeps the miss is not
        assert daemon.reload()
        assert value(metrics(daemon), MATCHED, budget="team") == 0
        assert len(logged(caplog.records, UNMATCHED)) == 2
    finally:
        daemon.stop()


def judged_again(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path, budgets: list[dict], rule: dict
) -> Daemon:
    """The daemon started again on the state file, its bills read and its alerts judged twice, five
    minutes apart (the caller stops it)."""
    daemon = unit(sim, clock, tmp_path, budgets=budgets, alerts=to_hook(rule))
    for _ in range(2):
        frozen.advance(dt.timedelta(minutes=5))
        daemon.refresh("bills")
        daemon.alert_cycle()
    return daemon


def test_a_tier_whose_saved_alert_cannot_be_read_fires_again_while_crossed(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    """Its row gone, the tier it held is not taken as told for the rest of the period (it never
    showed again, nor resolved): it fires again, in the same incident."""
    import sqlite3

    today = clock.today()
    spent = sum(billed(sim, today.replace(day=d)) for d in range(1, today.day + 1))
    budgets = [{"name": "month", "amount": str(spent * 2)}]
    rule = {"alert": "MonthBudget", "budget": "month", "tiers": [0.3]}
    first = unit(sim, clock, tmp_path, budgets=budgets, alerts=to_hook(rule))
    first.refresh("bills")
    first.alert_cycle()
    (fired,) = told(first)
    first.stop()
    with sqlite3.connect(tmp_path / "state.db") as db:
        db.execute("UPDATE alert_state SET body = 'not json {'")
    second = judged_again(sim, clock, frozen, tmp_path, budgets, rule)
    try:
        again = [a for a in second.sources.engine.current() if a.state == "firing"]
        assert [a.labels["tier"] for a in again] == ["0.3"]
        assert told(second)[-1]["dedup_key"] == fired["dedup_key"]
    finally:
        second.stop()


def test_a_damaged_row_beside_a_tier_that_fires_makes_nothing_fire_again(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    """Tiers 0.3 and 0.5 crossed: 0.5 fires, 0.3 was resolved under it. 0.3's row damaged, the
    readable 0.5 still holds the period: neither is told again."""
    import sqlite3

    today = clock.today()
    spent = sum(billed(sim, today.replace(day=d)) for d in range(1, today.day + 1))
    budgets = [{"name": "month", "amount": str(spent / Decimal("0.4"))}]
    rule = {"alert": "MonthBudget", "budget": "month", "tiers": [0.3, 0.5]}
    first = unit(sim, clock, tmp_path, budgets=budgets, alerts=to_hook(rule))
    first.refresh("bills")
    first.alert_cycle()  # 0.4: tier 0.3
    endpoint = sim.endpoints[0]
    sim.revise_bill(
        today, endpoint.endpoint_id, ITEMS[0], sim.charge(f"{today:%Y-%m}", today, endpoint, ITEMS[0])[0] + spent / 2
    )
    frozen.advance(dt.timedelta(minutes=5))
    first.refresh("bills")
    first.alert_cycle()  # 0.6: tier 0.5, 0.3 resolved under it
    before = [(e["status"], e["alerts"][0]["labels"]["tier"]) for e in told(first)]
    first.stop()
    assert ("firing", "0.5") in before
    with sqlite3.connect(tmp_path / "state.db") as db:
        bodies = {key: json.loads(body) for key, body in db.execute("SELECT key, body FROM alert_state")}
        (lower,) = [key for key, body in bodies.items() if body["labels"]["tier"] == "0.3"]
        db.execute("UPDATE alert_state SET body = 'not json {' WHERE key = ?", (lower,))
    second = judged_again(sim, clock, frozen, tmp_path, budgets, rule)
    try:
        after = [(e["status"], e["alerts"][0]["labels"]["tier"]) for e in told(second)]
        assert after == before
        assert [a.labels["tier"] for a in second.sources.engine.current() if a.state == "firing"] == ["0.5"]
    finally:
        second.stop()


def test_a_spend_rule_reads_what_the_metrics_and_budgets_of_its_scope_read(
    sim: Simulator, clock: Clock, tmp_path: Path
) -> None:
    """The account's `month_forecast` is the forecast `inference_bill_month_forecast_payable_amount`
    shows (and the rule `rules` writes reads), not another projection; a project is read from the
    lines by endpoint, as its budget reads it (the lines by item carry no project)."""
    from exporter.model.signals import evaluate

    rules = [
        {"alert": "Forecast", "signal": "spend", "window": "month_forecast", "threshold": 1},
        {"alert": "Lab", "signal": "spend", "window": "month", "where": {"project_id": "proj-lab"}, "threshold": 1},
        {"alert": "Projects", "signal": "spend", "window": "today", "by": ["project_id"], "threshold": 1},
    ]
    doc = {
        "billing": fake_billing_section(sim, history_months=3),
        "alerts": {"rules": rules},
        "budgets": [{"name": "lab", "amount": "1000", "where": {"project_id": "proj-lab"}}],
        "state": {"path": str(tmp_path / "state.db")},
    }
    daemon = unit_daemon(validate(doc, {}), sim, clock)
    try:
        assert daemon.refresh("history")
        assert daemon.refresh("bills")
        series = metrics(daemon)
        latest, sources = daemon.latest, ["bills", "usage", "history"]
        forecast, lab, projects = (evaluate(rule, latest, clock, sources) for rule in daemon.config.alerts.rules)
    finally:
        daemon.stop()
    assert forecast == {(): latest.bills.current.forecast}  # type: ignore[union-attr]
    assert float(forecast[()]) == value(series, "inference_bill_month_forecast_payable_amount", period="2026-11")  # type: ignore[index]
    truth = sim.bill_totals("2026-11")
    spent = sum(truth[e.endpoint_id] for e in sim.endpoints if e.project_id == "proj-lab")
    assert lab == {(): spent}
    assert float(spent / 1000) == value(series, "inference_budget_used_ratio", budget="lab")
    today = clock.today()
    by_project: dict[str, Decimal] = {}
    for e in sim.endpoints:
        for item in ITEMS:
            by_project[e.project_id] = (
                by_project.get(e.project_id, Decimal(0)) + sim.charge("2026-11", today, e, item)[0]
            )
    assert projects == {(("project_id", p),): amount for p, amount in by_project.items()}
