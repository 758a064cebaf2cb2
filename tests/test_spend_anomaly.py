"""spend_anomaly rules: the daemon on the simulator's months of history (a weekly rhythm, noise,
growth) with a spike injected, a frozen clock in Shanghai; on the simulator in process, what is to be
told read from the outbox (tests/daemon_fakes.py), and once end to end with a webhook receiver."""

from __future__ import annotations

import datetime as dt
import logging
from decimal import Decimal
from pathlib import Path

import pytest

from exporter.alerts import anomalies
from exporter.alerts.engine import Engine
from exporter.app.daemon import Daemon
from exporter.config.load import validate
from exporter.config.rules import AnomalyRule
from exporter.core.clock import Clock, FrozenClock
from exporter.digest.build import build as digest
from exporter.model.snapshots import BillsSnapshot, DailyAmount, HistorySnapshot, Latest, MonthBills, MonthHistory
from exporter.notifiers.digest import text as digest_text
from exporter.sim import ITEMS, Simulator, SimulatorServer, SpendModel
from exporter.state import StateStore
from exporter.state.alerts import AlertStore
from tests.conftest import SHANGHAI
from tests.daemon_fakes import metrics, statuses, told
from tests.helpers import Receiver, logged, named
from tests.test_alerts import evaluated, make_daemon, refreshed, to_hook, unit

YESTERDAY = dt.date(2026, 11, 21)  # the clock stands on 22 November: the 21st is the day judged

RULE = {
    "alert": "SpendAnomaly",
    "signal": "spend_anomaly",
    "by": ["endpoint_id"],
    "min_amount": "20",
    "min_percent": 30,
    "labels": {"severity": "warning"},
    "annotations": {"summary": "{endpoint_id} spent {actual} on {day}, {impact_percent}% over {expected}"},
}


@pytest.fixture
def spiked(sim: Simulator) -> Simulator:
    sim.spend = SpendModel(start=dt.date(2026, 7, 1))
    sim.add_spike(YESTERDAY, sim.endpoints[1].endpoint_id, 2.5)
    return sim


def spent(sim: Simulator, day: dt.date, endpoint_index: int) -> Decimal:
    endpoint = sim.endpoints[endpoint_index]
    return sum((sim.charge(f"{day:%Y-%m}", day, endpoint, item)[0] for item in ITEMS), Decimal(0))


def refresh_all(daemon: Daemon) -> None:
    """History, then bills, each refresh evaluated (the unit layer: nothing delivered)."""
    for source in ("history", "bills"):
        assert evaluated(daemon, source)


def test_a_spike_fires_once_is_updated_by_a_revision_and_resolves_when_the_next_day_is_judged(
    spiked: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    daemon = unit(spiked, clock, tmp_path, to_hook(None, RULE))
    try:
        refresh_all(daemon)
        assert statuses(daemon) == ["firing"]
        (alert,) = told(daemon)[0]["alerts"]
        target = spiked.endpoints[1].endpoint_id
        assert alert["labels"] == {"alertname": "SpendAnomaly", "severity": "warning", "endpoint_id": target,
                                   "day": "2026-11-21"}  # fmt: skip
        actual = spent(spiked, YESTERDAY, 1)
        assert alert["annotations"]["summary"].startswith(
            f"{target} spent {actual.quantize(Decimal('0.01'))} on 2026-11-21"
        )
        series = metrics(daemon)
        impacts = {
            dict(labels)["endpoint_id"]: v
            for labels, v in named(series, "inference_spend_anomaly_impact_amount").items()
        }
        expected = {
            dict(labels)["endpoint_id"]: v
            for labels, v in named(series, "inference_spend_expected_daily_amount").items()
        }
        assert set(impacts) == {e.endpoint_id for e in spiked.endpoints}
        for endpoint_id, impact in impacts.items():
            index = [e.endpoint_id for e in spiked.endpoints].index(endpoint_id)
            assert abs(
                Decimal(str(impact)) + Decimal(str(expected[endpoint_id])) - spent(spiked, YESTERDAY, index)
            ) < Decimal("0.01")
        assert impacts[target] == max(impacts.values())

        # The bill of the 21st is revised upwards: the same anomaly, updated, not notified again.
        spiked.revise_bill(YESTERDAY, target, ITEMS[0], Decimal(500))
        refresh_all(daemon)
        assert statuses(daemon) == ["firing"]
        assert named(metrics(daemon), "inference_alerts")

        # The 22nd ends and is usual: the anomaly of the 21st resolves, once.
        frozen.set(dt.datetime(2026, 11, 23, 0, 5, tzinfo=SHANGHAI))
        refresh_all(daemon)
        daemon.alert_cycle()
        assert statuses(daemon) == ["firing", "resolved"]
    finally:
        daemon.stop(grace=5)


def test_the_account_rule_names_the_endpoint_that_carries_the_impact(
    spiked: Simulator, server: SimulatorServer, clock: Clock, tmp_path: Path, receiver: Receiver
) -> None:
    """End to end: the months of bills over HTTP, the alert delivered to a webhook receiver."""
    rule = {k: v for k, v in RULE.items() if k not in ("by", "annotations")} | {
        "alert": "AccountAnomaly",
        "annotations": {"summary": "{contributors}"},
    }
    daemon = make_daemon(spiked, server, clock, tmp_path, to_hook(receiver, rule))
    try:
        for source in ("history", "bills"):
            assert refreshed(daemon, source)
        (alert,) = receiver.bodies()[0]["alerts"]
        assert "endpoint_id" not in alert["labels"]
        first = alert["annotations"]["summary"].split(",")[0]
        assert first.startswith(f"{spiked.endpoints[1].endpoint_id} ")
    finally:
        daemon.stop(grace=5)


def test_a_group_with_under_two_weeks_of_history_is_not_judged_and_says_so_once(
    sim: Simulator, clock: Clock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sim.spend = SpendModel(start=dt.date(2026, 11, 12))  # the account opened ten days ago
    sim.add_spike(YESTERDAY, "", 4.0)
    caplog.set_level(logging.INFO)
    daemon = unit(sim, clock, tmp_path, to_hook(None, RULE))
    try:
        refresh_all(daemon)
        refresh_all(daemon)
        assert statuses(daemon) == []
        said = logged(caplog.records, "spend anomaly not judged: too little history for this group")
        assert len(said) == len(sim.endpoints)
    finally:
        daemon.stop(grace=5)


def test_an_endpoint_anomaly_names_the_item_that_carries_it(sim: Simulator, clock: Clock, tmp_path: Path) -> None:
    sim.spend = SpendModel(start=dt.date(2026, 7, 1))
    target = sim.endpoints[2].endpoint_id
    sim.revise_bill(YESTERDAY, target, ITEMS[2], Decimal(400))  # one item of one endpoint, far over its usual
    rule = RULE | {"annotations": {"summary": "{contributors}"}}
    daemon = unit(sim, clock, tmp_path, to_hook(None, rule))
    try:
        refresh_all(daemon)
        (alert,) = told(daemon)[0]["alerts"]
        assert alert["labels"]["endpoint_id"] == target
        assert alert["annotations"]["summary"].startswith(f"{ITEMS[2]} ")
    finally:
        daemon.stop(grace=5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"by": ["model"]}, "alerts.rules[0].by[0] (alert SpendAnomaly): must be one of 'endpoint_id' or 'item'"),
        ({"by": ["endpoint_id", "item"]}, "alerts.rules[0].by (alert SpendAnomaly): Tuple should have at most 1 item"),
        ({"threshold": "5"}, "alerts.rules[0].threshold (alert SpendAnomaly): does not apply to a spend_anomaly rule"),
        ({"min_amount": None}, "alerts.rules[0].min_amount (alert SpendAnomaly): "),
        ({"min_percent": -1}, "alerts.rules[0].min_percent (alert SpendAnomaly): "),
        ({"sensitivity": 0}, "alerts.rules[0].sensitivity (alert SpendAnomaly): "),
        ({"annotations": {"summary": "{nope}"}}, "annotation 'summary' names unknown field {nope}"),
    ],
)
def test_a_bad_anomaly_rule_is_a_config_error_at_its_place(change: dict, message: str) -> None:
    from exporter.config.load import ConfigError, validate

    rule = {k: v for k, v in (RULE | change).items() if v is not None}
    document = {
        "billing": {"url": "https://x", "access_key_id": "a", "secret_access_key": "b"},
        "alerts": {"rules": [rule]},
    }
    with pytest.raises(ConfigError) as raised:
        validate(document, {})
    assert any(message in problem for problem in raised.value.details), raised.value.details


def test_two_rules_on_the_same_groups_with_other_floors_each_keep_their_own_alert(
    spiked: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    """A warning and a critical rule with one alert name: neither resolves the other's alert."""
    critical = RULE | {"min_amount": "100", "labels": {"severity": "critical"}}
    daemon = unit(spiked, clock, tmp_path, to_hook(None, RULE, critical))
    try:
        refresh_all(daemon)
        for _ in range(4):
            frozen.advance(dt.timedelta(minutes=1))
            daemon.alert_cycle()
        assert statuses(daemon) == ["firing", "firing"]
        severities = sorted(a["labels"]["severity"] for event in told(daemon) for a in event["alerts"])
        assert severities == ["critical", "warning"]
    finally:
        daemon.stop(grace=5)


def test_a_restart_mid_day_waits_for_the_history_rather_than_resolve_and_fire_again(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    frozen.set(dt.datetime(2026, 11, 10, 12, 0, tzinfo=SHANGHAI))  # this month alone: nine days, too few
    sim.spend = SpendModel(start=dt.date(2026, 7, 1))
    sim.add_spike(dt.date(2026, 11, 9), sim.endpoints[1].endpoint_id, 2.5)
    daemon = unit(sim, clock, tmp_path, to_hook(None, RULE))
    try:
        refresh_all(daemon)
    finally:
        daemon.stop(grace=5)
    assert statuses(daemon) == ["firing"]
    again = unit(sim, clock, tmp_path, to_hook(None, RULE))  # same state file
    try:
        assert evaluated(again, "bills")  # bills first: this month alone is under two weeks of history
        assert evaluated(again, "history")
        again.alert_cycle()
        assert statuses(again) == ["firing"]  # neither resolved in between nor fired a second time
        assert named(metrics(again), "inference_alerts")
    finally:
        again.stop(grace=5)


@pytest.mark.parametrize("by", [(), ("endpoint_id",), ("item",)])
def test_judging_several_days_at_once_is_judging_each_in_turn(by: tuple[str, ...]) -> None:
    """A weekly digest judges seven days in one call (each group's history indexed once): the
    findings, their order and their contributors are those of seven calls of one day."""
    start = dt.date(2026, 9, 1)
    rows = []
    for n in range(80):
        day = start + dt.timedelta(days=n)
        for e, endpoint in enumerate(("ep-a", "ep-b", "ep-c")):
            for i, item in enumerate(ITEMS):
                usual = Decimal(10 + 3 * e + i) * (Decimal("0.6") if day.weekday() >= 5 else 1)
                spike = Decimal(5) if (n % 17 == e and n > 30) else Decimal(1)
                rows.append((day, endpoint, item, (usual * spike + Decimal(n % 5) / 7).quantize(Decimal("0.01"))))

    def amounts(key: int) -> tuple[DailyAmount, ...]:
        sums: dict[tuple[dt.date, str], Decimal] = {}
        for row in rows:
            sums[row[0], row[key]] = sums.get((row[0], row[key]), Decimal(0)) + row[3]
        return tuple(DailyAmount(f"{d:%Y-%m}", d, k, "p", "", v, Decimal(0)) for (d, k), v in sums.items())

    split = {
        endpoint: tuple(DailyAmount(f"{d:%Y-%m}", d, i, "p", "", v, Decimal(0)) for d, e, i, v in rows if e == endpoint)
        for endpoint in ("ep-a", "ep-b", "ep-c")
    }
    bills = anomalies.Bills(amounts(1), amounts(2), split)
    rule = AnomalyRule(alert="A", signal="spend_anomaly", by=by, min_amount=Decimal(1), min_percent=Decimal(10))
    days = [start + dt.timedelta(days=n) for n in range(60, 80)]
    one_by_one = [finding for day in days for finding in anomalies.judge_groups(rule, bills, day)]
    assert any(f.judgement.anomalous for f in one_by_one)
    assert anomalies.judge_groups(rule, bills, *days) == one_by_one
    assert anomalies.judge_groups(rule, bills, *days, days[0]) == one_by_one  # (a day given twice: judged once)


def test_a_bill_written_finer_than_decimal_sums_keep_is_judged_and_holds_back_no_rule(
    sim: Simulator, clock: Clock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Yesterday's bill of an endpoint written with 27 decimals (valid decimal text): its expected
    amount is written to 1e-12, not to 27 decimals beyond Decimal's 28 digits; and a budget rule
    beside it fires."""
    sim.spend = SpendModel(start=dt.date(2026, 7, 1))
    target = sim.endpoints[1].endpoint_id
    sim.revise_bill(YESTERDAY, target, ITEMS[0], Decimal("9.123456789012345678901234567"))
    budget = {"alert": "Budget", "budget": "m", "tiers": [0.01]}
    daemon = unit(sim, clock, tmp_path, to_hook(None, RULE, budget), budgets=[{"name": "m", "amount": "10"}])
    try:
        refresh_all(daemon)
        assert statuses(daemon) == ["firing"]  # the budget, at far over 1% of 10
        judged = [f.judgement for _, _, findings, _ in daemon.sources.engine.judged.values() for f in findings]
        (finest,) = [j for j in judged if int(j.actual.as_tuple().exponent) < -12]  # (the endpoint's day)
        assert finest.expected.as_tuple().exponent == -12
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    finally:
        daemon.stop()


def test_a_rule_whose_figures_cannot_be_computed_holds_back_no_other_and_is_logged_once(
    spiked: Simulator, clock: Clock, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> None:
        raise ArithmeticError("a figure this code cannot compute")

    monkeypatch.setattr(Engine, "_judge", broken)  # (a fault of this code: one rule's figures)
    budget = {"alert": "Budget", "budget": "m", "tiers": [0.01]}
    daemon = unit(spiked, clock, tmp_path, to_hook(None, RULE, budget), budgets=[{"name": "m", "amount": "10"}])
    try:
        refresh_all(daemon)
        daemon.alert_cycle()
        assert statuses(daemon) == ["firing"]  # the budget's alert, the anomaly rule's none
        assert len(logged(caplog.records, "a rule's figures could not be computed; its alerts keep their state")) == 1
    finally:
        daemon.stop()


def test_charges_of_no_endpoint_are_named_so_in_the_summary_the_contributors_and_the_digest(tmp_path: Path) -> None:
    """A fee the bills tie to no endpoint (an empty `instanceId`) that jumps: its group's label stays
    empty (absent for Prometheus and Alertmanager), and the messages say "(no endpoint)"."""
    start, judged = dt.date(2026, 9, 1), dt.date(2026, 10, 30)
    months: dict[str, list[DailyAmount]] = {}
    for n in range((judged - start).days + 1):
        day = start + dt.timedelta(days=n)
        fee = Decimal(400 if day == judged else 5)
        months.setdefault(f"{day:%Y-%m}", []).extend([
            DailyAmount(f"{day:%Y-%m}", day, "ep-a", "PRODUCT_INFERENCE_ENDPOINT", "p", Decimal(100), Decimal(0)),
            DailyAmount(f"{day:%Y-%m}", day, "", "PRODUCT_INFERENCE_ENDPOINT", "p", fee, Decimal(0)),
        ])  # fmt: skip
    today = judged + dt.timedelta(days=1)
    latest = Latest()
    september, october = (tuple(months[p]) for p in ("2026-09", "2026-10"))
    latest.history = HistorySnapshot({"2026-09": MonthHistory("2026-09", september, september, today)}, as_of=today)
    zero = Decimal(0)
    latest.bills = BillsSnapshot((MonthBills("2026-10", october, october, zero, zero, zero),), today)
    frozen = FrozenClock(dt.datetime(2026, 10, 31, 8, tzinfo=SHANGHAI))
    clock = Clock(SHANGHAI, frozen)
    latest.record("bills", success=True, at=frozen().timestamp(), duration=1.0)
    by_endpoint = {k: v for k, v in RULE.items() if k != "annotations"} | {"alert": "ByEndpoint"}
    account = by_endpoint | {"alert": "Account", "by": [], "annotations": {"summary": "{contributors}"}}
    document = {"billing": {"url": "http://127.0.0.1:1", "access_key_id": "ak", "secret_access_key": "sk"}}
    config = validate(document | {"alerts": to_hook(None, by_endpoint, account)}, {})
    engine = Engine(config.alerts, config.budgets, AlertStore(StateStore(":memory:")), clock, latest,
                    lambda: ["bills", "history"], ["hook"])  # fmt: skip
    engine.evaluate()
    summaries = {
        a.labels["alertname"]: (a.labels.get("endpoint_id"), a.annotations["summary"]) for a in engine.current()
    }
    assert summaries["Account"] == (None, "(no endpoint) 100%")
    assert summaries["ByEndpoint"][0] == ""
    assert summaries["ByEndpoint"][1].startswith("ByEndpoint: endpoint_id=(no endpoint) spent 400.00 on 2026-10-30")
    rule = AnomalyRule(alert="A", signal="spend_anomaly", by=(), min_amount=Decimal(20), min_percent=Decimal(30))
    told = digest_text(digest(latest, schedule="daily", sent_on=today, anomalies=[rule]))
    assert "(no endpoint) 100%" in told
    assert "(no endpoint): 400.00" in told  # (the top endpoints)
