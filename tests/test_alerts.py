"""Alerts: what the daemon's rules decide on the simulator's figures, on a frozen clock, read from its
outbox with the simulator in process (tests/daemon_fakes.py); delivery end to end, against the
simulator and a webhook receiver on loopback."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import re
import sqlite3
from decimal import Decimal
from pathlib import Path
from unittest.mock import Mock

import pytest
import requests
import yaml

from exporter.app.daemon import Daemon
from exporter.config.load import validate
from exporter.core.clock import Clock, FrozenClock
from exporter.sim import ITEMS, Fault, Simulator, SimulatorServer
from exporter.state import StateError
from tests.conftest import billing_section
from tests.daemon_fakes import NOWHERE, alerts_api, fake_billing_section, metrics, statuses, told, unit_daemon
from tests.helpers import Receiver, logged, named, scrape

TODAY = dt.date(2026, 11, 22)


def today_by_endpoint(sim: Simulator, day: dt.date = TODAY) -> dict[str, Decimal]:
    return {
        e.endpoint_id: sum((sim.charge(f"{day:%Y-%m}", day, e, item)[0] for item in ITEMS), Decimal(0))
        for e in sim.endpoints
    }


def make_daemon(
    sim: Simulator, server: SimulatorServer, clock: Clock, tmp_path: Path, alerts: dict, **extra: object
) -> Daemon:
    document = {
        "billing": billing_section(sim, server),
        "state": {"path": str(tmp_path / "state.db")},
        "alerts": alerts,
    } | extra
    daemon = Daemon(validate(document, {}), clock=clock, listen="127.0.0.1:0")
    daemon.start(schedule=False)
    return daemon


def unit(sim: Simulator, clock: Clock, tmp_path: Path, alerts: dict, **extra: object) -> Daemon:
    """`make_daemon` in the unit layer: on `sim` in process, no server, nothing delivered."""
    document = {
        "billing": fake_billing_section(sim),
        "state": {"path": str(tmp_path / "state.db")},
        "alerts": alerts,
    } | extra
    return unit_daemon(validate(document, {}), sim, clock)


@pytest.fixture
def spend_rule(sim: Simulator) -> dict:
    amounts = today_by_endpoint(sim)
    top = max(amounts, key=lambda e: amounts[e])
    threshold = (sorted(amounts.values())[-2] + amounts[top]) / 2  # only the top endpoint is over it
    return {
        "alert": "EndpointDailySpendHigh",
        "signal": "spend",
        "window": "today",
        "by": ["endpoint_id"],
        "op": ">",
        "threshold": str(threshold),
        "for": "10m",
        "labels": {"severity": "warning"},
        "annotations": {"summary": "{endpoint_id} spent {value} today (over {threshold})"},
    }


def settle(daemon: Daemon) -> None:
    """Evaluate now and deliver what is due, here: refreshes only wake the alert worker, and the
    notifiers deliver on their own threads, so a test that counts messages settles first."""
    daemon.alert_cycle()
    daemon.deliver()


def refreshed(daemon: Daemon, source: str = "bills") -> bool:
    ok = daemon.refresh(source)
    settle(daemon)
    return ok


def evaluated(daemon: Daemon, source: str = "bills") -> bool:
    """`refreshed` in the unit layer: refresh and evaluate; what is to be told waits in the outbox."""
    ok = daemon.refresh(source)
    daemon.alert_cycle()
    return ok


def to_hook(receiver: Receiver | None, *rules: dict) -> dict:
    """An `alerts` section: these rules, notifying the webhook `hook` at `receiver` (without one: at
    an address nothing asks, in the unit layer, which reads the notifications from the outbox)."""
    url = receiver.url if receiver is not None else f"{NOWHERE}/hook"
    return {"rules": list(rules), "notifiers": [{"name": "hook", "type": "webhook", "url": url}]}


def received(receiver: Receiver) -> list[str]:
    """The statuses of the notifications a receiver got."""
    return [body["status"] for body in receiver.bodies()]


def test_spend_rule_pends_fires_repeats_and_resolves_once_each(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path, spend_rule: dict
) -> None:
    alerts = to_hook(None, spend_rule) | {"repeat_interval": "1h"}
    daemon = unit(sim, clock, tmp_path, alerts)
    try:
        amounts = today_by_endpoint(sim)
        top = max(amounts, key=lambda e: amounts[e])
        assert evaluated(daemon)
        series = metrics(daemon)
        pending = named(series, "inference_alerts")
        assert [dict(labels)["alertstate"] for labels in pending] == ["pending"]
        assert dict(next(iter(pending)))["endpoint_id"] == top
        assert statuses(daemon) == []

        frozen.advance(dt.timedelta(minutes=9))
        daemon.alert_cycle()
        assert statuses(daemon) == []
        frozen.advance(dt.timedelta(minutes=1))
        daemon.alert_cycle()
        assert statuses(daemon) == ["firing"]
        alert = told(daemon)[0]["alerts"][0]
        assert alert["labels"] == {"alertname": "EndpointDailySpendHigh", "severity": "warning", "endpoint_id": top}
        assert alert["annotations"]["summary"].startswith(f"{top} spent {amounts[top].quantize(Decimal('0.01'))} today")
        assert alert["ends_at"] is None  # (the webhook's zero endsAt: test_webhook_slack_and_pagerduty_payloads)

        for _ in range(3):
            daemon.alert_cycle()
            evaluated(daemon)
        assert statuses(daemon) == ["firing"]
        frozen.advance(dt.timedelta(hours=1))
        daemon.alert_cycle()
        assert statuses(daemon) == ["firing", "firing"]

        sim.revise_bill(TODAY, top, ITEMS[0], Decimal(1000))  # still over: the alert reads the new figure
        evaluated(daemon)
        raised = today_by_endpoint(sim)[top].quantize(Decimal("0.01"))
        assert raised != amounts[top].quantize(Decimal("0.01"))
        (shown,) = alerts_api(daemon)["data"]["alerts"]
        assert shown["annotations"]["summary"].startswith(f"{top} spent {raised} today")
        assert statuses(daemon) == ["firing", "firing"]

        for item in ITEMS:
            sim.revise_bill(TODAY, top, item, Decimal("0.01"))
        evaluated(daemon)
        daemon.alert_cycle()
        assert statuses(daemon) == ["firing", "firing", "resolved"]
        assert told(daemon)[-1]["alerts"][0]["ends_at"] is not None
        assert named(metrics(daemon), "inference_alerts") == {}
        api = alerts_api(daemon)
        assert [a["state"] for a in api["data"]["alerts"]] == ["resolved"]
    finally:
        daemon.stop()


def test_tier_ladder_notifies_three_times_across_a_month(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    rule = {"alert": "MonthlyBudget", "budget": "monthly", "tiers": [0.5, 0.8, 1.0], "labels": {"severity": "critical"}}
    alerts = to_hook(None, rule)
    daemon = unit(sim, clock, tmp_path, alerts, budgets=[{"name": "monthly", "amount": "20000"}])
    endpoint = sim.endpoints[0].endpoint_id
    try:
        evaluated(daemon)
        assert statuses(daemon) == []  # about 41% used
        tiers = []
        for day, extra in ((3, "2000"), (4, "6000"), (5, "4000")):
            sim.revise_bill(dt.date(2026, 11, day), endpoint, ITEMS[0], Decimal(extra))
            frozen.advance(dt.timedelta(hours=1))
            evaluated(daemon)
            evaluated(daemon)  # the next refresh sends nothing new
            tiers.append([event["alerts"][0]["labels"]["tier"] for event in told(daemon)])
        assert tiers == [["0.5"], ["0.5", "0.8"], ["0.5", "0.8", "1"]]
        assert statuses(daemon) == ["firing"] * 3
        firing = named(metrics(daemon), "inference_alerts")
        assert [dict(labels)["tier"] for labels in firing] == ["1"]  # the lower tiers are inhibited

        frozen.set(dt.datetime(2026, 12, 1, 9, 0, tzinfo=clock.tz))  # a new month starts clean
        evaluated(daemon)
        assert statuses(daemon) == ["firing"] * 3 + ["resolved"]
        assert told(daemon)[-1]["alerts"][0]["labels"]["tier"] == "1"
    finally:
        daemon.stop()


def test_a_receiver_down_for_three_attempts_gets_everything_once(
    sim: Simulator, server: SimulatorServer, clock: Clock, frozen: FrozenClock, tmp_path: Path,
    receiver: Receiver, spend_rule: dict,
) -> None:  # fmt: skip
    spend_rule["for"] = "0s"
    alerts = to_hook(receiver, spend_rule)
    receiver.refuse = 3
    daemon = make_daemon(sim, server, clock, tmp_path, alerts)
    try:
        refreshed(daemon)  # fires, and the first delivery attempt is refused
        assert receiver.attempts == 1
        for attempt in (2, 3):
            daemon.deliver()
            assert receiver.attempts == attempt - 1  # not before its backoff
            frozen.advance(dt.timedelta(minutes=5))
            daemon.deliver()
            assert receiver.attempts == attempt
        series = scrape(daemon.server.url)
        assert named(series, "inference_alert_notifications_failed_total") == {frozenset({("notifier", "hook")}): 3}
        assert named(series, "inference_alert_notifications_pending") == {frozenset({("notifier", "hook")}): 1}
    finally:
        daemon.stop()

    restarted = make_daemon(sim, server, clock, tmp_path, alerts)  # the outbox survives a restart
    try:
        frozen.advance(dt.timedelta(minutes=5))
        restarted.deliver()
        settle(restarted)
        assert received(receiver) == ["firing"]
        assert receiver.attempts == 4
    finally:
        restarted.stop()


def test_a_failing_source_never_reads_as_zero_spend(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path, spend_rule: dict
) -> None:
    spend_rule["for"] = "0s"
    alerts = to_hook(None, spend_rule)
    daemon = unit(sim, clock, tmp_path, alerts)
    try:
        evaluated(daemon)
        assert statuses(daemon) == ["firing"]
        sim.inject(Fault("total_mismatch", times=100))  # every listing's `total` one more than it holds: refused
        frozen.advance(dt.timedelta(minutes=5))
        assert not evaluated(daemon)
        daemon.alert_cycle()
        assert statuses(daemon) == ["firing"]  # kept, not resolved by missing data
    finally:
        daemon.stop()


def test_data_age_signal_fires_on_stale_data(sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path) -> None:
    rule = {"alert": "BillsStale", "signal": "data_age", "where": {"source": "bills"}, "op": ">", "threshold": 1800}
    alerts = to_hook(None, rule)
    daemon = unit(sim, clock, tmp_path, alerts)
    try:
        evaluated(daemon)
        sim.inject(Fault("total_mismatch", times=1000))
        frozen.advance(dt.timedelta(minutes=31))
        assert not evaluated(daemon)
        daemon.alert_cycle()
        assert statuses(daemon) == ["firing"]
        assert told(daemon)[0]["alerts"][0]["labels"] == {"alertname": "BillsStale"}
    finally:
        daemon.stop()


def test_webhook_slack_and_pagerduty_payloads(
    sim: Simulator, server: SimulatorServer, clock: Clock, frozen: FrozenClock, tmp_path: Path,
    receiver: Receiver, spend_rule: dict,
) -> None:  # fmt: skip
    spend_rule["for"] = "0s"
    alerts = {
        "rules": [spend_rule],
        "notifiers": [
            {"name": "hook", "type": "webhook", "url": f"{receiver.url}/hook"},
            {"name": "chat", "type": "slack", "url": f"{receiver.url}/slack/T000/B000/secret-token"},
            {"name": "pager", "type": "pagerduty", "routing_key": "R0UTINGKEY", "url": f"{receiver.url}/pd"},
        ],
    }
    daemon = make_daemon(sim, server, clock, tmp_path, alerts)
    amounts = today_by_endpoint(sim)
    top = max(amounts.items(), key=lambda kv: kv[1])[0]
    try:
        refreshed(daemon)
        for item in ITEMS:
            sim.revise_bill(TODAY, top, item, Decimal("0.01"))
        refreshed(daemon)
        api = requests.get(f"{daemon.server.url}/api/v1/alerts", timeout=5).json()
        assert [a["state"] for a in api["data"]["alerts"]] == ["resolved"]
    finally:
        daemon.stop()
    hook = receiver.bodies("/hook")
    assert [body["status"] for body in hook] == ["firing", "resolved"]
    assert hook[0]["version"] == "4"
    (alert,) = hook[0]["alerts"]
    assert alert["labels"] == {"alertname": "EndpointDailySpendHigh", "severity": "warning", "endpoint_id": top}
    assert alert["annotations"]["summary"].startswith(f"{top} spent {amounts[top].quantize(Decimal('0.01'))} today")
    assert alert["endsAt"] == "0001-01-01T00:00:00Z"
    assert hook[1]["alerts"][0]["endsAt"] != "0001-01-01T00:00:00Z"
    slack = receiver.bodies("/slack/T000/B000/secret-token")
    assert [m["text"].split("]")[0] for m in slack] == ["[FIRING", "[RESOLVED"]
    assert slack[0]["text"].startswith(f"[FIRING] EndpointDailySpendHigh: {top} spent")
    assert slack[0]["blocks"][0]["type"] == "section"
    pager = receiver.bodies("/pd")
    # Slack takes no id: the notification's, the same on each attempt, ends the context (a repeat shows).
    ids = [m["blocks"][1]["elements"][0]["text"].rpartition(" · notification ")[2] for m in slack]
    assert [i.rpartition("-")[0] for i in ids] == [pager[0]["dedup_key"]] * 2
    assert len(set(ids)) == 2
    assert [(p["event_action"], p["routing_key"]) for p in pager] == [
        ("trigger", "R0UTINGKEY"),
        ("resolve", "R0UTINGKEY"),
    ]
    assert pager[0]["dedup_key"] == pager[1]["dedup_key"]
    assert pager[0]["payload"]["severity"] == "warning"
    assert pager[0]["payload"]["source"] == "inference-cost-exporter"
    assert pager[0]["payload"]["custom_details"]["alerts"][0]["labels"]["endpoint_id"] == top


def test_a_restart_keeps_the_pending_for_timer(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path, spend_rule: dict
) -> None:
    alerts = to_hook(None, spend_rule)
    first = unit(sim, clock, tmp_path, alerts)
    evaluated(first)  # pending from now; `for` is 10 minutes
    first.stop()
    frozen.advance(dt.timedelta(minutes=10))
    second = unit(sim, clock, tmp_path, alerts)
    try:
        evaluated(second)  # a fresh timer would still be pending here
        assert statuses(second) == ["firing"]
    finally:
        second.stop()


def test_counts_show_without_decimals_and_amounts_with_two(sim: Simulator, clock: Clock, tmp_path: Path) -> None:
    sim.add_usage(40)
    rules = [
        {"alert": "Tokens", "signal": "tokens", "threshold": 10, "annotations": {"summary": "{value} > {threshold}"}},
        {"alert": "Spend", "signal": "spend", "threshold": 10, "annotations": {"summary": "{value} > {threshold}"}},
    ]
    daemon = unit(sim, clock, tmp_path, to_hook(None, *rules))
    try:
        assert daemon.refresh("usage")
        assert evaluated(daemon)
    finally:
        daemon.stop()
    summaries = {e["alerts"][0]["labels"]["alertname"]: e["alerts"][0]["annotations"]["summary"] for e in told(daemon)}
    tokens = sum(t["prompt"] + t["completion"] for t in sim.usage_totals().values())
    assert summaries["Tokens"] == f"{tokens} > 10"
    assert re.fullmatch(r"\d+\.\d\d > 10\.00", summaries["Spend"])


def test_alerts_and_notifications_saved_before_grouping_keep_their_incident_keys(
    sim: Simulator, server: SimulatorServer, clock: Clock, tmp_path: Path, receiver: Receiver
) -> None:
    import json
    import sqlite3

    rule = {"alert": "Spend", "signal": "spend", "by": ["endpoint_id"], "threshold": 0}
    alerts = {"rules": [rule], "notifiers": [{"name": "pager", "type": "pagerduty", "routing_key": "rk",
                                              "url": f"{receiver.url}/pd"}]}  # fmt: skip
    first = make_daemon(sim, server, clock, tmp_path, alerts)
    first.dispatcher.close()  # no delivery: what the previous version left behind is set up below
    assert first.refresh("bills")
    first.alert_cycle()
    first.stop()
    with sqlite3.connect(tmp_path / "state.db") as db:  # as the previous version wrote them
        bodies = {key: json.loads(body) for key, body in db.execute("SELECT key, body FROM alert_state")}
        for key, body in bodies.items():
            del body["grouped"]
            db.execute("UPDATE alert_state SET body = ? WHERE key = ?", (json.dumps(body), key))
        db.execute("DELETE FROM outbox")
        key, body = next(iter(bodies.items()))
        old_event = {"key": key, "dedup_key": key, "status": "firing", "labels": body["labels"],
                     "annotations": body["annotations"], "starts_at": body["fired_at"], "ends_at": None,
                     "value": body["value"]}  # fmt: skip
        db.execute(
            "INSERT INTO outbox (notifier, event, created, next_attempt) VALUES ('pager', ?, 0, 0)",
            (json.dumps(old_event),),
        )
    second = make_daemon(sim, server, clock, tmp_path, alerts)
    try:
        second.deliver()
        (trigger,) = receiver.bodies("/pd")
        assert (trigger["event_action"], trigger["dedup_key"]) == ("trigger", key)
        for endpoint in sim.endpoints:
            for item in ITEMS:
                sim.revise_bill(TODAY, endpoint.endpoint_id, item, Decimal(0))
        assert refreshed(second)
    finally:
        second.stop()
    resolves = [b for b in receiver.bodies("/pd") if b["event_action"] == "resolve"]
    assert sorted(b["dedup_key"] for b in resolves) == sorted(bodies)  # each closes the incident it opened


def test_rule_ids_are_those_earlier_versions_saved() -> None:
    """Budget tiers already fired and alert states are stored under these ids: a rule must keep its id."""
    import hashlib
    import json

    from exporter.alerts.alert import rule_id
    from exporter.config.load import validate

    def saved_by_earlier_versions(identity: list[object]) -> str:
        return hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]

    billing = {"url": "http://x", "access_key_id": "a", "secret_access_key": "s"}
    rules = [
        {"alert": "Spend", "signal": "spend", "by": ["endpoint_id"], "where": {"product": "p"}, "threshold": 1},
        {"alert": "Monthly", "budget": "m", "tiers": [0.5, 1]},
    ]
    config = validate({"billing": billing, "budgets": [{"name": "m", "amount": 1}], "alerts": {"rules": rules}}, {})
    threshold, budget = config.alerts.rules
    assert rule_id(threshold) == saved_by_earlier_versions(
        ["Spend", "spend", "today", ["endpoint_id"], [["product", "p"]], None]
    )
    assert rule_id(budget) == saved_by_earlier_versions(["Monthly", None, "today", [], [], "m"])


def test_an_alert_is_kept_as_the_object_earlier_versions_wrote_and_read_back_the_same() -> None:
    """The state file's body of an alert: its fields as a JSON object in their order, the object
    earlier versions wrote (with `json.dumps`'s spaces, which they and this version read), and back;
    a label no UTF-8 can carry (a lone surrogate, which YAML's "\\ud800" makes) is escaped."""
    import json

    from exporter.alerts.alert import Alert

    alerts = [
        Alert("k1", "r1", {"alertname": "A", "endpoint_id": "ep-1"}, {"summary": "s"}, "pending", 1.0, "3", 1.0),
        Alert("k2", "r2", {"alertname": "B"}, {}, "resolved", 1764201600.123456, "0.5", 2.0, fired_at=1.5,
              resolved_at=9.0, inhibited=True, period="2026-11", grouped=True, incident_key="i"),
    ]  # fmt: skip
    written_before = [
        '{"key": "k1", "rule": "r1", "labels": {"alertname": "A", "endpoint_id": "ep-1"}, "annotations": '
        '{"summary": "s"}, "state": "pending", "active_since": 1.0, "value": "3", "last_true": 1.0, "fired_at": '
        'null, "resolved_at": null, "inhibited": false, "period": "", "grouped": false, "incident_key": ""}',
        '{"key": "k2", "rule": "r2", "labels": {"alertname": "B"}, "annotations": {}, "state": "resolved", '
        '"active_since": 1764201600.123456, "value": "0.5", "last_true": 2.0, "fired_at": 1.5, "resolved_at": 9.0, '
        '"inhibited": true, "period": "2026-11", "grouped": true, "incident_key": "i"}',
    ]
    for alert, body in zip(alerts, written_before, strict=True):
        assert list(json.loads(alert.body()).items()) == list(json.loads(body).items())
        assert Alert(**json.loads(body)) == alert
        assert Alert(**json.loads(alert.body())) == alert
    assert alerts[0].true_at(5.0) == Alert(**(json.loads(alerts[0].body()) | {"last_true": 5.0}))
    labels = {"alertname": "D", "endpoint_id": "推理-东"}
    chinese = Alert("k4", "r4", labels, {"summary": "超出"}, "firing", 1.0, "1", 1.0)
    assert Alert(**json.loads(chinese.body())) == chinese
    odd = Alert("k3", "r3", {"alertname": "C", "team": "ops-\ud800"}, {}, "firing", 1.0, "1", 1.0)
    assert odd.body().isascii()
    assert Alert(**json.loads(odd.body())) == odd


def test_alerts_and_daily_bills_are_not_walked_by_the_garbage_collector() -> None:
    """Every evaluation makes each alert still true anew and a month at 5,000 endpoints holds 135k
    daily amounts: tracked, they sent the collector over every object held at each evaluation
    (`bench.evaluation`). Neither can be part of a cycle (strings, numbers, dicts of strings)."""
    import datetime as dt
    import gc
    from decimal import Decimal

    from exporter.alerts.alert import Alert
    from exporter.model.snapshots import DailyAmount

    alert = Alert("k1", "r1", {"alertname": "A"}, {"summary": "s"}, "firing", 1.0, "3", 1.0)
    amount = DailyAmount("2026-11", dt.date(2026, 11, 27), "ep-1", "inference", "", Decimal("1.5"), Decimal(10))
    assert not gc.is_tracked(alert)
    assert not gc.is_tracked(alert.true_at(2.0))
    assert not gc.is_tracked(amount)


def saved_last_true(daemon: Daemon) -> list[float]:
    """Each saved alert's `last_true`, as another process would read it from the state file."""
    with contextlib.closing(sqlite3.connect(daemon.config.state.path)) as db:
        return [json.loads(body)["last_true"] for (body,) in db.execute("SELECT body FROM alert_state")]


def test_an_alert_still_true_is_saved_again_as_its_hold_needs_and_at_a_reload_and_a_stop(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path, spend_rule: dict
) -> None:
    rule = spend_rule | {"for": "0s", "keep_firing_for": "10m"}  # saved again each minute (a tenth of it)
    path = tmp_path / "config.yaml"
    document = {
        "billing": fake_billing_section(sim),
        "state": {"path": str(tmp_path / "state.db")},
        "alerts": to_hook(None, rule),
    }
    path.write_text(yaml.safe_dump(document))
    daemon = unit_daemon(validate(document, {}), sim, clock, config_path=path)
    try:
        evaluated(daemon)
        fired = clock.now().timestamp()
        assert statuses(daemon) == ["firing"]
        assert saved_last_true(daemon) == [fired]
        for seconds in range(20, 120, 20):  # true at every evaluation, nothing else changed
            frozen.set(dt.datetime.fromtimestamp(fired + seconds, clock.tz))
            daemon.alert_cycle()
            (saved,) = saved_last_true(daemon)
            (alert,) = daemon.sources.engine.current()
            assert alert.last_true == fired + seconds
            assert 0 <= alert.last_true - saved < 60  # never a tenth of `keep_firing_for` behind
        assert saved == fired + 60  # written once in those five evaluations, not five times

        frozen.set(dt.datetime.fromtimestamp(fired + 110, clock.tz))
        daemon.alert_cycle()
        assert saved_last_true(daemon) == [fired + 60]
        assert daemon.reload()  # the new engine reads the alerts from the state file: saved first
        (alert,) = daemon.sources.engine.current()
        assert alert.last_true == fired + 110
        assert saved_last_true(daemon) == [fired + 110]

        frozen.set(dt.datetime.fromtimestamp(fired + 130, clock.tz))
        daemon.alert_cycle()
        assert saved_last_true(daemon) == [fired + 110]
        assert statuses(daemon) == ["firing"]  # told once
    finally:
        daemon.stop()
    assert saved_last_true(daemon) == [fired + 130]  # saved at the stop


def test_a_hold_outlives_a_crash_at_most_a_tenth_early(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path, spend_rule: dict
) -> None:
    rule = spend_rule | {"for": "0s", "keep_firing_for": "10m"}
    first = unit(sim, clock, tmp_path, to_hook(None, rule))
    evaluated(first)
    start = clock.now().timestamp()
    for seconds in (30, 90, 110):
        frozen.set(dt.datetime.fromtimestamp(start + seconds, clock.tz))
        first.alert_cycle()
    # A crash: `first` never stops; the next process reads what was committed to the state file
    # (copied: `first` still holds its lock). Its rule is over no endpoint now, so the alert holds
    # for `keep_firing_for` from when it was last true.
    after = tmp_path / "after"
    after.mkdir()
    with (
        contextlib.closing(sqlite3.connect(tmp_path / "state.db")) as held,
        contextlib.closing(sqlite3.connect(after / "state.db")) as copy,
    ):
        held.backup(copy)
    quiet = rule | {"threshold": "1000000"}
    second = unit(sim, clock, after, to_hook(None, quiet))
    try:
        evaluated(second)
        (alert,) = second.sources.engine.current()
        last_true = alert.last_true
        assert start + 110 - 60 < last_true <= start + 110  # what the file held: at most a tenth behind
        ends = last_true + 600
        frozen.set(dt.datetime.fromtimestamp(ends - 1, clock.tz))
        second.alert_cycle()
        assert [a.state for a in second.sources.engine.current()] == ["firing"]
        frozen.set(dt.datetime.fromtimestamp(ends, clock.tz))
        second.alert_cycle()
        assert [a.state for a in second.sources.engine.current()] == ["resolved"]
        assert ends >= start + 110 + 600 - 60
    finally:
        second.stop()
        first.stop()


def test_after_a_failed_write_and_a_failed_read_back_the_next_evaluation_saves_what_it_holds(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path, spend_rule: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon = unit(sim, clock, tmp_path, to_hook(None, spend_rule | {"for": "1h"}))
    try:
        assert daemon.refresh("bills")
        engine = daemon.sources.engine

        def refused(*args: object) -> None:
            raise StateError(daemon.state.path, f"state file {daemon.state.path} failed (disk I/O error)")

        monkeypatch.setattr(engine.db, "save_state", refused)  # the write fails (the alert is in memory)…
        monkeypatch.setattr(engine.db, "load_states", refused)  # …and so does reading back what was committed
        with pytest.raises(StateError):
            engine.evaluate()
        monkeypatch.undo()
        assert [a.state for a in engine.current()] == ["pending"]  # held in memory only
        assert saved_last_true(daemon) == []

        frozen.advance(dt.timedelta(minutes=1))
        daemon.alert_cycle()  # reads the state file first: the pending alert is new again, and saved
        (alert,) = engine.current()
        assert alert.state == "pending"
        assert alert.active_since == clock.now().timestamp()
        assert saved_last_true(daemon) == [alert.last_true]
    finally:
        daemon.stop()


def test_spend_rules_grouping_the_bills_alike_share_their_groups_and_no_one_elses() -> None:
    """A month's bills summed by a rule's groups are kept with the snapshot, for each way of
    grouping them (`by`, `where`, endpoint or item, the day): a rule reads what another made only
    when it groups alike, and what it is given is its own to change. (Within a snapshot the day is
    always the snapshot's: the next day's evaluation waits for the next day's bills.)"""
    from exporter.core.clock import FrozenClock
    from exporter.model import signals
    from exporter.model.snapshots import BillsSnapshot, DailyAmount, Latest, MonthBills

    zone = Clock().tz
    clock = Clock(zone, FrozenClock(dt.datetime(2026, 11, 27, 12, tzinfo=zone)))
    today, yesterday = clock.today(), clock.today() - dt.timedelta(days=1)

    def amount(day: dt.date, endpoint: str, product: str, payable: str) -> DailyAmount:
        return DailyAmount("2026-11", day, endpoint, product, "", Decimal(payable), Decimal(0))

    rows = (amount(yesterday, "ep-a", "inference", "5"), amount(today, "ep-a", "inference", "2"),
            amount(today, "ep-b", "inference", "3"), amount(today, "ep-b", "fine-tune", "7"))  # fmt: skip
    latest = Latest(bills=BillsSnapshot((MonthBills("2026-11", rows, (), Decimal(17), Decimal(0), Decimal(0)),), today))
    latest.record("bills", success=True, at=clock.now().timestamp(), duration=0.1)

    def spend(**rule: object) -> dict[signals.Labels, Decimal] | None:
        document = {
            "billing": {"url": "https://billing.invalid", "access_key_id": "AK", "secret_access_key": "S"},
            "alerts": {"rules": [{"alert": "Spend", "signal": "spend", "threshold": "1", **rule}]},
        }
        found = signals.evaluate(validate(document, {}).alerts.rules[0], latest, clock, ["bills"])
        assert found is not None
        return found

    by_endpoint = {(("endpoint_id", "ep-a"),): Decimal(7), (("endpoint_id", "ep-b"),): Decimal(10)}
    first = spend(window="month", by=["endpoint_id"])
    assert first == by_endpoint
    first.clear()  # (its own: the next rule still reads the groups)
    assert spend(window="month", by=["endpoint_id"], threshold="9") == by_endpoint
    assert spend(window="today", by=["endpoint_id"]) == {
        (("endpoint_id", "ep-a"),): Decimal(2),
        (("endpoint_id", "ep-b"),): Decimal(10),
    }
    assert spend(window="month", by=["endpoint_id"], where={"product": "inference"}) == {
        (("endpoint_id", "ep-a"),): Decimal(7),
        (("endpoint_id", "ep-b"),): Decimal(3),
    }
    assert spend(window="month", by=["endpoint_id", "product"]) == {
        (("endpoint_id", "ep-a"), ("product", "inference")): Decimal(7),
        (("endpoint_id", "ep-b"), ("product", "fine-tune")): Decimal(7),
        (("endpoint_id", "ep-b"), ("product", "inference")): Decimal(3),
    }
    assert spend(window="month", where={"endpoint_id": "ep-b"}) == {(): Decimal(10)}
    assert spend(window="month", where={"endpoint_id": "ep-a"}) == {(): Decimal(7)}
    assert spend(window="month", where={"endpoint_id": ["ep-a", "ep-b"]}) == {(): Decimal(17)}

    revised = (*rows, amount(today, "ep-a", "inference", "4"))  # the next bills refresh: a new snapshot
    latest.bills = BillsSnapshot((MonthBills("2026-11", revised, (), Decimal(21), Decimal(0), Decimal(0)),), today)
    assert spend(window="month", by=["endpoint_id"]) == {
        (("endpoint_id", "ep-a"),): Decimal(11),
        (("endpoint_id", "ep-b"),): Decimal(10),
    }


def test_usage_rules_grouping_alike_share_their_groups_and_no_other_signals_or_snapshots() -> None:
    """Today's usage summed by a rule's groups is kept with the usage snapshot, for each signal and
    way of grouping: a `requests` rule never reads a `tokens` rule's groups, nor the last poll's."""
    from exporter.core.clock import FrozenClock
    from exporter.model import signals
    from exporter.model.snapshots import Latest, UsageKey, UsageSnapshot, UsageTotals

    zone = Clock().tz
    clock = Clock(zone, FrozenClock(dt.datetime(2026, 11, 27, 12, tzinfo=zone)))
    totals = {
        UsageKey("ep-a", "m-1"): UsageTotals(requests=2, prompt_tokens=10, completion_tokens=5),
        UsageKey("ep-a", "m-2"): UsageTotals(requests=1, prompt_tokens=7, completion_tokens=0),
        UsageKey("ep-b", "m-1"): UsageTotals(requests=4, prompt_tokens=1, completion_tokens=1),
    }
    latest = Latest(usage=UsageSnapshot(clock.today(), totals, 7, 0.0))
    latest.record("usage", success=True, at=clock.now().timestamp(), duration=0.1)

    def evaluate(signal: str, **rule: object) -> dict[signals.Labels, Decimal]:
        document = {
            "billing": {"url": "https://billing.invalid", "access_key_id": "AK", "secret_access_key": "S"},
            "alerts": {"rules": [{"alert": "Use", "signal": signal, "threshold": "1", **rule}]},
        }
        found = signals.evaluate(validate(document, {}).alerts.rules[0], latest, clock, ["usage"])
        assert found is not None
        return found

    a, b = (("endpoint_id", "ep-a"),), (("endpoint_id", "ep-b"),)
    requests = evaluate("requests", by=["endpoint_id"])
    assert requests == {a: Decimal(3), b: Decimal(4)}
    requests.clear()  # (its own)
    assert evaluate("tokens", by=["endpoint_id"]) == {a: Decimal(22), b: Decimal(2)}
    assert evaluate("requests", by=["endpoint_id"]) == {a: Decimal(3), b: Decimal(4)}
    assert evaluate("requests", by=["endpoint_id"], where={"model": "m-1"}) == {a: Decimal(2), b: Decimal(4)}
    assert evaluate("requests", by=["model", "endpoint_id"]) == {
        (("endpoint_id", "ep-a"), ("model", "m-1")): Decimal(2),
        (("endpoint_id", "ep-a"), ("model", "m-2")): Decimal(1),
        (("endpoint_id", "ep-b"), ("model", "m-1")): Decimal(4),
    }
    more = totals | {UsageKey("ep-b", "m-2"): UsageTotals(requests=5)}  # the next poll: a new snapshot
    latest.usage = UsageSnapshot(clock.today(), more, 12, 0.0)
    assert evaluate("requests", by=["endpoint_id"]) == {a: Decimal(3), b: Decimal(9)}


@pytest.mark.parametrize("damage", ["not json {", '{"key": "k"}', '{"state": 3}'])
def test_a_saved_alert_that_cannot_be_read_is_judged_afresh_and_the_others_kept(
    sim: Simulator, server: SimulatorServer, clock: Clock, tmp_path: Path, damage: str,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """One damaged row of the state file stopped the daemon from starting, with a traceback (and
    --reset-state could not help: the file is sound to SQLite)."""
    import sqlite3

    rule = {"alert": "Spend", "signal": "spend", "by": ["endpoint_id"], "threshold": 0}
    alerts = {"rules": [rule], "notifiers": [{"name": "hook", "type": "webhook", "url": f"{NOWHERE}/hook"}]}
    first = make_daemon(sim, server, clock, tmp_path, alerts)
    first.dispatcher.close()
    assert first.refresh("bills")
    first.alert_cycle()
    first.stop()
    with sqlite3.connect(tmp_path / "state.db") as db:
        keys = sorted(key for (key,) in db.execute("SELECT key FROM alert_state"))
        db.execute("UPDATE alert_state SET body = ? WHERE key = ?", (damage, keys[0]))
    second = make_daemon(sim, server, clock, tmp_path, alerts)
    try:
        kept = {a.key for a in second.sources.engine.current()}
        assert kept == set(keys[1:])
        assert second.refresh("bills")
        engine = second.sources.engine
        with pytest.MonkeyPatch.context() as refusing:  # evaluations the state file refuses: rolled back, read again
            refusing.setattr(engine.db, "save_state", Mock(side_effect=StateError("state.db", "disk I/O error")))
            for _ in range(3):
                with pytest.raises(StateError):
                    engine.evaluate()
        assert len(logged(caplog.records, "saved alerts cannot be read: judged afresh", alerts=1)) == 1
        second.alert_cycle()
        assert {a.key for a in second.sources.engine.current() if a.state == "firing"} == set(keys)
    finally:
        second.stop()


@pytest.mark.parametrize("damage", ["not json {", '{"key": "k"}'])
def test_a_saved_alert_that_cannot_be_read_of_a_rule_whose_id_moves_is_left_behind(
    sim: Simulator, clock: Clock, tmp_path: Path, damage: str
) -> None:
    """Saved by a version that keyed the rule by its `by` as written: the others move to the rule's
    id, the damaged one stays (judged afresh) and the daemon starts."""
    import sqlite3

    from exporter.config.rules import rule_key

    rule = {"alert": "Spend", "signal": "spend", "by": ["product", "endpoint_id"], "threshold": 0}
    document = {
        "billing": fake_billing_section(sim),
        "state": {"path": str(tmp_path / "state.db")},
        "alerts": {"rules": [rule], "notifiers": [{"name": "hook", "type": "webhook", "url": f"{NOWHERE}/h"}]},
    }
    config = validate(document, {})
    first = unit_daemon(config, sim, clock)
    assert first.refresh("bills")
    first.alert_cycle()
    first.stop()
    parsed = config.alerts.rules[0]
    written = rule_key(parsed, as_written=True)
    assert written != rule_key(parsed)
    with sqlite3.connect(tmp_path / "state.db") as db:  # as a version keying rules as written saved them
        keys = sorted(key for (key,) in db.execute("SELECT key FROM alert_state"))
        db.execute("UPDATE alert_state SET rule = ?", (written,))
        # Its key one no rule makes now (as the version before keyed it), and it was told.
        db.execute("UPDATE alert_state SET body = ?, key = 'old' WHERE key = ?", (damage, keys[0]))
        db.execute("UPDATE alert_sent SET key = 'old' WHERE key = ?", (keys[0],))
    second = unit_daemon(config, sim, clock)
    try:
        assert len(second.sources.engine.current()) == len(keys) - 1
        assert second.refresh("bills")
        second.alert_cycle()
        assert len([a for a in second.sources.engine.current() if a.state == "firing"]) == len(keys)
    finally:
        second.stop()
    with sqlite3.connect(tmp_path / "state.db") as db:  # the damaged row went at the evaluation: not read again
        assert db.execute("SELECT COUNT(*) FROM alert_state WHERE key = 'old'").fetchone() == (0,)
        assert db.execute("SELECT COUNT(*) FROM alert_sent WHERE key = 'old'").fetchone() == (0,)
        assert db.execute("SELECT COUNT(*) FROM alert_state").fetchone() == (len(keys),)


def test_a_resolve_of_some_of_an_incident_s_alerts_is_no_resolve_of_the_webhook_s_group() -> None:
    """As Alertmanager's webhook: the group is firing while any of its alerts fires."""
    from exporter.notifiers.webhook import webhook_payload

    alert = {"key": "k1", "status": "resolved", "labels": {"alertname": "A", "endpoint_id": "ep-1"},
             "annotations": {}, "starts_at": 0.0, "ends_at": 60.0, "value": "1"}  # fmt: skip
    event = {"status": "resolved", "alertname": "A", "dedup_key": "d", "alerts": [alert], "total": 1}
    partly = webhook_payload({**event, "still_firing": 1}, "hook", "", "d-1")  # type: ignore[typeddict-item]
    assert (partly["status"], partly["alerts"][0]["status"]) == ("firing", "resolved")
    whole = webhook_payload({**event, "still_firing": 0}, "hook", "", "d-2")  # type: ignore[typeddict-item]
    assert (whole["status"], whole["alerts"][0]["status"]) == ("resolved", "resolved")


def test_a_pagerduty_trigger_stays_under_the_events_api_s_size_limit() -> None:
    """PagerDuty refuses an event over 512 KB, and a refused trigger is dropped after 5 tries: long
    values from the API (each non-ASCII character six bytes in JSON) are cut, and alerts left out
    past the limit, `total` still counting them."""
    import json

    from exporter.notifiers.pagerduty import DETAIL_CHARS, pagerduty_payload

    long = "計費" * 10_000
    labels = {f"l{i}": long for i in range(20)}
    alerts = [
        {"key": f"k{n}", "status": "firing", "labels": {"alertname": "A", "endpoint_id": f"ep-{n}", **labels},
         "annotations": {"summary": long}, "starts_at": 0.0, "ends_at": None, "value": "1"}
        for n in range(100)
    ]  # fmt: skip
    event = {
        "status": "firing",
        "alertname": "A",
        "dedup_key": "d",
        "alerts": alerts,
        "total": 5000,
        "still_firing": 5000,
    }
    body = pagerduty_payload(event, "rk", "")  # type: ignore[arg-type]
    assert body is not None
    assert len(json.dumps(body)) <= 512 * 1024
    details = body["payload"]["custom_details"]
    assert details["total"] == 5000
    assert details["alerts"][0]["labels"]["endpoint_id"] == "ep-0"
    assert len(details["alerts"][0]["annotations"]["summary"]) == DETAIL_CHARS
    assert details["alerts"][0]["annotations"]["summary"].endswith("…")
    # One alert too long alone (100 such values, a 300,000-character endpoint id): shown without it.
    huge = {**alerts[0], "labels": {"alertname": "A", "endpoint_id": "é" * 300_000},
            "annotations": {f"a{i}": long for i in range(100)}}  # fmt: skip
    body = pagerduty_payload({**event, "alerts": [huge], "total": 1}, "rk", "")  # type: ignore[arg-type]
    assert body is not None
    assert len(json.dumps(body)) <= 512 * 1024
    assert body["payload"]["custom_details"] == {"alerts": [], "total": 1}
    assert len(body["payload"]["component"]) == DETAIL_CHARS
