"""Nothing lost, repeated or falsified when the config changes under running state: rules reordered
or inserted, notifiers removed and added again, a state file started afresh, a file saved by the
version that told rules apart by their position. What is queued, on the simulator in process
(tests/daemon_fakes.py); what is delivered, against the simulator and receivers on loopback."""

from __future__ import annotations

import datetime as dt
import json
import logging
import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from exporter.alerts.alert import Alert, alert_key, legacy_moves, legacy_rule_ids, rekey
from exporter.app.daemon import Daemon
from exporter.config.load import ConfigError, load, validate
from exporter.config.rules import rule_ids
from exporter.core.clock import Clock, FrozenClock
from exporter.core.mrkdwn import TEXT
from exporter.delivery.dispatcher import BACKOFF_MAX
from exporter.model.events import GroupEvent
from exporter.notifiers.kind import common
from exporter.notifiers.slack import slack_payload
from exporter.sim import Simulator, SimulatorServer
from exporter.state import AlertStore, StateStore
from tests.conftest import DATA, billing_section
from tests.daemon_fakes import NOWHERE, fake_billing_section, unit_daemon
from tests.daemon_fakes import told as told_in_process
from tests.helpers import Receiver, logged, named, scrape

WARNING = {
    "alert": "EndpointSpend",
    "signal": "spend",
    "by": ["endpoint_id"],
    "threshold": "1",
    "labels": {"severity": "warning"},
}
CRITICAL = WARNING | {"threshold": "2", "labels": {"severity": "critical"}}
BUDGET = {"alert": "MonthlyBudget", "budget": "month", "tiers": [0.1, 0.2], "labels": {"severity": "page"}}
RULES = [WARNING, CRITICAL, BUDGET]
"""The rules `tests/data/state-layout0.db` was written with (by the version before layout 1)."""


def ids(rules: list[dict]) -> list[str]:
    billing = {"url": "http://x", "access_key_id": "a", "secret_access_key": "s"}
    document = {"billing": billing, "budgets": [{"name": "month", "amount": "1"}], "alerts": {"rules": rules}}
    return rule_ids(validate(document, {}).alerts.rules)


def legacy_ids(rules: list[dict]) -> list[str]:
    billing = {"url": "http://x", "access_key_id": "a", "secret_access_key": "s"}
    document = {"billing": billing, "budgets": [{"name": "month", "amount": "1"}], "alerts": {"rules": rules}}
    return legacy_rule_ids(validate(document, {}).alerts.rules)


# -- rule identity, without a server --


def test_a_rules_id_survives_reordering_and_inserting_rules() -> None:
    warning, critical, budget = ids(RULES)
    assert len({warning, critical, budget}) == 3
    other = {"alert": "Other", "signal": "spend", "threshold": "5"}
    inserted = WARNING | {"threshold": "1.5", "labels": {"severity": "info"}}  # a third tier of the same alert
    assert ids([CRITICAL, BUDGET, WARNING]) == [critical, budget, warning]
    assert ids([other, CRITICAL, inserted, WARNING, BUDGET])[1:] == [critical, ids([inserted])[0], warning, budget]
    # What the old ids did: the second rule of a kind took the other's id when the two swapped.
    assert legacy_ids([WARNING, CRITICAL])[0] == legacy_ids([CRITICAL, WARNING])[0]


def test_only_a_change_to_what_a_rule_watches_or_its_labels_moves_its_id() -> None:
    (warning,) = ids([WARNING])
    assert ids([WARNING | {"threshold": "7", "for": "5m", "annotations": {"summary": "x"}}]) == [warning]
    assert ids([WARNING | {"by": []}]) != [warning]
    assert ids([WARNING | {"labels": {"severity": "page"}}]) != [warning]
    # The order of `by` (and of a `where` list) says nothing of what is watched; a rule written in
    # their sorted order keeps the id versions before gave it. A label named twice is refused: the
    # rule would be another beside the one that names it once, making the same alerts.
    bare = {k: v for k, v in WARNING.items() if k != "labels"}
    lists = bare | {"by": ["endpoint_id", "project_id"], "where": {"endpoint_id": ["ep-a", "ep-b"]}}
    (sorted_id,) = ids([lists])
    assert ids([lists | {"by": ["project_id", "endpoint_id"], "where": {"endpoint_id": ["ep-b", "ep-a"]}}]) == [
        sorted_id
    ]
    assert legacy_ids([lists]) == [sorted_id]
    assert ids([lists | {"where": {"endpoint_id": ["ep-a", "ep-c"]}}]) != [sorted_id]
    with pytest.raises(ConfigError, match="`by` names a label twice"):
        ids([lists | {"by": ["project_id", "endpoint_id", "project_id"]}])
    # A rule without labels keeps the id every earlier version gave it.
    assert ids([bare]) == legacy_ids([bare])


def test_rules_that_would_make_the_same_alerts_are_refused_naming_both() -> None:
    low, high = WARNING, WARNING | {"threshold": "9"}  # only the threshold differs: their alerts would too
    with pytest.raises(ConfigError) as refused:
        ids([BUDGET, low, high])
    assert refused.value.details == [
        "alerts.rules[2] (alert EndpointSpend): makes the same alerts as alerts.rules[1] (the same alert name, "
        "what it watches and labels); give one of them other `labels`, a severity"
    ]


def test_legacy_ids_are_moved_by_the_saved_alerts_that_can_be_read() -> None:
    """A row that cannot be read (or whose labels are no object) tells nothing, and stops nothing:
    the others tell which rule is theirs."""
    bare = {k: v for k, v in CRITICAL.items() if k != "labels"}
    before = legacy_ids([bare, CRITICAL])
    billing = {"url": "http://x", "access_key_id": "a", "secret_access_key": "s"}
    rules = validate({"billing": billing, "alerts": {"rules": [CRITICAL, bare]}}, {}).alerts.rules
    labels = {"alertname": "EndpointSpend", "endpoint_id": "ep-1", "severity": "critical"}
    readable = [(before[1], json.dumps({"labels": labels}))]
    damaged = [(before[1], text) for text in ("not json {", '{"labels": null}', '{"labels": []}', "[]")]
    assert legacy_moves(rules, [*damaged, *readable]) == legacy_moves(rules, readable)


def test_saved_alerts_go_to_the_rule_whose_labels_are_theirs_in_any_order_now() -> None:
    """A rule without labels matches any alert of its name; a labelled rule's alerts still go to it."""
    bare = {k: v for k, v in CRITICAL.items() if k != "labels"}
    before = legacy_ids([bare, CRITICAL])  # as the previous version numbered them
    saved = [
        (before[0], json.dumps({"labels": {"alertname": "EndpointSpend", "endpoint_id": "ep-1"}})),
        (
            before[1],
            json.dumps({"labels": {"alertname": "EndpointSpend", "endpoint_id": "ep-1", "severity": "critical"}}),
        ),
    ]
    billing = {"url": "http://x", "access_key_id": "a", "secret_access_key": "s"}
    document = {"billing": billing, "alerts": {"rules": [CRITICAL, bare]}}  # reordered at the upgrade
    rules = validate(document, {}).alerts.rules
    critical, plain = rule_ids(rules)
    assert legacy_moves(rules, saved) == {before[1]: critical} | ({before[0]: plain} if before[0] != plain else {})


# -- Slack, without a server --


HOSTILE = "<!channel> <https://evil.example/login|Billing console: re-enter your key> & *bold*"


def event(summary: str, count: int = 1, **labels: str) -> GroupEvent:
    alerts = [
        {
            "key": f"k{n}",
            "dedup_key": "d",
            "status": "firing",
            "labels": {"alertname": "EndpointSpend", **labels},
            "annotations": {"summary": summary},
            "starts_at": 0.0,
            "ends_at": None,
            "value": "1",
        }
        for n in range(count)
    ]
    return {"status": "firing", "alertname": "EndpointSpend", "dedup_key": "d", "alerts": alerts,  # type: ignore[typeddict-item]
            "total": count, "still_firing": count}  # fmt: skip


def texts(payload: dict) -> list[str]:
    return [payload["text"], payload["blocks"][0]["text"]["text"], payload["blocks"][1]["elements"][0]["text"]]


@pytest.mark.parametrize("count", [1, 3])
def test_every_name_in_a_slack_alert_is_escaped(count: int) -> None:
    payload = slack_payload(event(f"{HOSTILE} spent 120.00", count, endpoint_id=HOSTILE), "http://exporter:9877")
    for text in texts(payload):
        assert "<!channel>" not in text
        assert "<https://evil" not in text
        assert "&lt;!channel&gt;" in text or (count > 1 and text == payload["text"])
    assert payload["blocks"][1]["elements"][0]["text"].endswith(" · <http://exporter:9877/|exporter>")


def test_slack_texts_stay_within_slacks_limits_and_never_end_inside_an_escape() -> None:
    huge = "<&>" * 5000
    payload = slack_payload(event(huge, 1, endpoint_id=huge), "http://exporter:9877")
    for text in texts(payload):
        assert len(text) <= TEXT
        assert not text.rstrip("…").endswith(("&", "&a", "&am", "&amp", "&l", "&lt", "&g", "&gt"))
    assert payload["blocks"][1]["elements"][0]["text"].endswith("|exporter>")  # our own link is never cut


# -- ids across state files --


def test_a_fresh_state_file_numbers_its_notifications_apart_from_another(tmp_path: Path) -> None:
    first_ids = []
    for name in ("old.db", "new.db"):
        store = StateStore(tmp_path / name)
        alerts = AlertStore(store)
        with store.transaction() as db:
            alerts.enqueue(db, "hook", event("x"), 1.0)
        alerts.enqueue_digest("daily:2026-11-22", ["hook"], {"day": "2026-11-22"}, 1.0)
        first_ids.append((alerts.head("hook").id,))  # type: ignore[union-attr]
        with sqlite3.connect(tmp_path / name) as db:
            first_ids[-1] += (db.execute("SELECT id FROM digest_outbox").fetchone()[0],)
        store.close()
    (alert_a, digest_a), (alert_b, digest_b) = first_ids
    assert alert_a != alert_b
    assert digest_a != digest_b


# -- the daemon --


@pytest.fixture
def hook() -> Iterator[Receiver]:
    receiver = Receiver()
    yield receiver
    receiver.stop()


class Deployment:
    """A daemon on a config file that a test rewrites and reloads: against the simulator over HTTP,
    delivering to receivers; without `server`, on the simulator in process, delivering nothing."""

    def __init__(self, sim: Simulator, server: SimulatorServer | None, clock: Clock, tmp_path: Path) -> None:
        self.sim, self.server, self.clock = sim, server, clock
        self.path = tmp_path / "config.yaml"
        self.state = tmp_path / "state.db"
        self.daemon: Daemon | None = None

    def write(self, rules: list[dict], notifiers: list[dict], state: Path | None = None, **alerts: object) -> None:
        if self.server is None:
            billing = fake_billing_section(self.sim, history_months=0)
        else:
            billing = billing_section(self.sim, self.server, history_months=0)
        self.path.write_text(
            yaml.safe_dump(
                {
                    "billing": billing,
                    "budgets": [{"name": "month", "amount": "1"}],
                    "alerts": {"rules": rules, "notifiers": notifiers} | alerts,
                    "state": {"path": str(state or self.state)},
                }
            )
        )

    def start(self) -> Daemon:
        if self.server is None:
            self.daemon = unit_daemon(load(self.path), self.sim, self.clock, config_path=self.path)
            return self.daemon
        self.daemon = Daemon(load(self.path), config_path=self.path, clock=self.clock, listen="127.0.0.1:0")
        self.daemon.start(schedule=False)
        return self.daemon

    def evaluate(self) -> None:
        assert self.daemon is not None
        self.daemon.refresh("bills")
        self.daemon.alert_cycle()
        if self.server is not None:
            self.daemon.deliver()

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()
            self.daemon = None


@pytest.fixture
def deployment(sim: Simulator, server: SimulatorServer, clock: Clock, tmp_path: Path) -> Iterator[Deployment]:
    deployment = Deployment(sim, server, clock, tmp_path)
    yield deployment
    deployment.stop()


@pytest.fixture
def in_process(sim: Simulator, clock: Clock, tmp_path: Path) -> Iterator[Deployment]:
    """A `Deployment` on the simulator in process: what the daemon queues is read from its outbox."""
    deployment = Deployment(sim, None, clock, tmp_path)
    yield deployment
    deployment.stop()


def webhook(receiver: Receiver | None, name: str = "hook", path: str = "") -> dict:
    """A webhook notifier posting to `receiver`; without one, to an address nothing asks (the unit layer)."""
    return {"name": name, "type": "webhook", "url": (receiver.url if receiver else NOWHERE) + path}


def alerts_told(receiver: Receiver) -> list[dict]:
    """The alert notifications a receiver got (not digests)."""
    return [body for body in receiver.bodies() if "alerts" in body]


def told(receiver: Receiver) -> list[tuple[str, str, int]]:
    return [(b["status"], b["commonLabels"].get("severity", ""), len(b["alerts"])) for b in alerts_told(receiver)]


def queued(daemon: Daemon) -> list[tuple[str, str, int]]:
    """`told` of what the daemon queued (the unit layer): status, the common severity, how many alerts."""
    return [
        (e["status"], common([a["labels"] for a in e["alerts"]]).get("severity", ""), len(e["alerts"]))
        for e in told_in_process(daemon)
    ]


def test_reordering_and_inserting_tiers_sends_nothing(in_process: Deployment) -> None:
    in_process.write(RULES, [webhook(None)])
    daemon = in_process.start()
    in_process.evaluate()
    first = queued(daemon)
    assert sorted(first) == [("firing", "critical", 3), ("firing", "page", 1), ("firing", "warning", 3)]
    firing = {a.key for a in daemon.sources.engine.current() if a.state == "firing"}
    between = WARNING | {"threshold": "1.5", "labels": {"severity": "info"}}
    for rules in ([BUDGET, CRITICAL, WARNING], [CRITICAL, between, BUDGET, WARNING]):
        in_process.write(rules, [webhook(None)])
        assert daemon.reload()
        in_process.evaluate()
        still = {a.key for a in daemon.sources.engine.current() if a.state == "firing"}
        assert firing <= still  # the same alerts, never resolved and fired again
    assert queued(daemon)[len(first) :] == [("firing", "info", 3)]  # only the rule that was inserted


@pytest.mark.integration
def test_alerts_saved_by_the_previous_layout_keep_their_ids_and_incidents(
    deployment: Deployment, hook: Receiver, frozen: FrozenClock, caplog: pytest.LogCaptureFixture
) -> None:
    """tests/data/state-layout0.db: written by the last release of layout 0 with RULES (tiers
    told apart by position), every alert firing and told to `hook`, three notifications and a
    digest still queued for `late` (its receiver refused them); besides, that release's usage,
    history, settled days and a probe run (`tests/test_state_file.py` checks those are kept)."""
    caplog.set_level(logging.INFO, logger="exporter")
    shutil.copy(DATA / "state-layout0.db", deployment.state)
    with sqlite3.connect(deployment.state) as db:
        queued = {row[0] for row in db.execute("SELECT id FROM outbox WHERE delivered IS NULL")}
    late = Receiver()
    try:
        deployment.write([CRITICAL, WARNING, BUDGET], [webhook(hook), webhook(late, "late")])  # reordered, too
        daemon = deployment.start()
        (moved,) = logged(caplog.records, "saved alerts moved to their rules' new ids")
        assert moved.fields["alerts"] == 7  # type: ignore[attr-defined]
        frozen.advance(dt.timedelta(seconds=BACKOFF_MAX * 1.2 + 1))  # `late` is due again
        deployment.evaluate()
        assert told(hook) == []  # no re-page after the upgrade
        assert sorted(told(late)) == [("firing", "critical", 3), ("firing", "page", 1), ("firing", "warning", 3)]
        assert {int(b["notificationId"].rsplit("-", 1)[1]) for b in alerts_told(late)} == queued
        assert [b["id"] for b in late.bodies() if "alerts" not in b] == ["daily:2026-11-21"]  # its digest too
        alerts = daemon.sources.engine.current()
        assert [a.state for a in alerts] == ["firing"] * 7
        with sqlite3.connect(deployment.state) as db:
            (layout,) = db.execute("PRAGMA user_version").fetchone()
        assert layout == 1
        # Their incidents stay those opened before the upgrade: each resolve closes the one it opened.
        opened = {b["commonLabels"]["severity"]: b["notificationId"].rsplit("-", 1)[0] for b in alerts_told(late)}
        deployment.write([], [webhook(hook), webhook(late, "late")])  # the rules go; their alerts resolve
        assert daemon.reload()
        deployment.evaluate()
        closed = {
            b["commonLabels"]["severity"]: b["notificationId"].rsplit("-", 1)[0]
            for b in alerts_told(late)
            if b["status"] == "resolved"
        }
        assert closed == opened
    finally:
        late.stop()


def test_alerts_moved_to_their_rule_s_new_id_move_in_a_queued_notification_past_its_first_hundred() -> None:
    """A queued firing of 102 alerts keeps the first 100 in full and the rest by key (`beyond`):
    moved to the new id, every one of them is still the alert the notification tells."""
    old, new = "0123456789abcdef", "fedcba9876543210"
    store = AlertStore(StateStore(":memory:"))
    alerts = [
        Alert(alert_key(labels, old), old, labels, {}, "firing", 100.0, "1", 100.0, fired_at=100.0)
        for labels in ({"alertname": "A", "endpoint_id": f"ep-{n}"} for n in range(102))
    ]
    event: GroupEvent = {
        "status": "firing", "alertname": "A", "dedup_key": "d", "total": 102, "still_firing": 102,
        "alerts": [{"key": a.key, "dedup_key": "d", "status": "firing", "labels": a.labels, "annotations": {},
                    "starts_at": 100.0, "ends_at": None, "value": "1"} for a in alerts[:100]],  # type: ignore[typeddict-item]
        "beyond": [(a.key, 100.0) for a in alerts[100:]],
    }  # fmt: skip
    with store.store.transaction() as db:
        for alert in alerts:
            AlertStore.save_state(db, alert.key, alert.rule, alert.body())
        AlertStore.enqueue(db, "hook", event, 100.0)
    assert store.adopt_rule_ids({old: new}, rekey) == 102
    head = store.head("hook")
    assert head is not None
    told = [a["key"] for a in head.event["alerts"]] + [key for key, _ in head.event.get("beyond", [])]
    assert set(store.alert_states(told)) == set(told)
    assert {rule for _, _, rule in store.alert_states(told).values()} == {new}


@pytest.mark.integration
def test_a_removed_notifiers_queue_is_dropped_and_never_delivered_when_it_comes_back(
    deployment: Deployment, frozen: FrozenClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="exporter")
    down = Receiver()
    down.refuse = 10**6
    try:
        deployment.write([WARNING], [webhook(down)])
        daemon = deployment.start()
        deployment.evaluate()
        assert daemon.dispatcher.pending() == {"hook": 1}
        deployment.write([WARNING | {"threshold": "1000000"}], [])  # removed; its alerts resolve meanwhile
        assert daemon.reload()
        deployment.evaluate()
        assert daemon.dispatcher.pending() == {}
        (dropped,) = logged(caplog.records, "queued notifications dropped: their notifier is no longer configured")
        assert dropped.fields == {"notifier": "hook", "notifications": 1}  # type: ignore[attr-defined]
        series = scrape(daemon.server.url)
        assert (
            named(series, "inference_alert_notifications_discarded_total")[frozenset({("reason", "notifier_removed")})]
            == 1
        )
        frozen.advance(dt.timedelta(days=20))
        down.refuse = 0
        deployment.write([WARNING | {"threshold": "1000000"}], [webhook(down)])  # back, under the same name
        assert daemon.reload()
        deployment.evaluate()
        assert down.bodies() == []
    finally:
        down.stop()


def test_a_restart_without_a_notifier_drops_its_queue_and_its_digests(
    in_process: Deployment, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="exporter")
    in_process.write([WARNING], [webhook(None), webhook(None, "other")])
    in_process.start()
    in_process.evaluate()  # queued for both, delivered to neither
    in_process.stop()
    store = StateStore(in_process.state)
    AlertStore(store).enqueue_digest("daily:2026-11-21", ["hook", "other"], {"day": "2026-11-21"}, 1.0)
    store.close()
    in_process.write([WARNING], [webhook(None, "other")])
    daemon = in_process.start()
    assert daemon.dispatcher.pending() == {"other": 2}  # its alert and its digest; none for `hook`
    assert daemon.dispatcher.discarded["notifier_removed"] == 2
    assert logged(caplog.records, "queued notifications dropped: their notifier is no longer configured",
                  notifier="hook")  # fmt: skip


@pytest.fixture
def down() -> Iterator[Receiver]:
    """A webhook receiver that refuses everything until the test says otherwise (`refuse = 0`)."""
    receiver = Receiver()
    receiver.refuse = 10**6
    yield receiver
    receiver.stop()


def fired_at(deployment: Deployment, down: Receiver, **alerts: object) -> Daemon:
    """The daemon started with WARNING notifying `down`, evaluated once: the alert fires, and its
    receiver refuses the firing."""
    deployment.write([WARNING], [webhook(down)], **alerts)
    daemon = deployment.start()
    deployment.evaluate()
    return daemon


@pytest.mark.integration
def test_a_state_change_overtaken_while_it_waited_is_never_delivered(
    deployment: Deployment, down: Receiver, frozen: FrozenClock
) -> None:
    daemon = fired_at(deployment, down)  # fires; the receiver refuses
    deployment.write([WARNING | {"threshold": "1000000"}], [webhook(down)])
    assert daemon.reload()
    deployment.evaluate()  # resolves; queued behind the firing
    assert daemon.dispatcher.pending() == {"hook": 2}
    down.refuse = 0
    frozen.advance(dt.timedelta(seconds=BACKOFF_MAX * 1.2 + 1))
    daemon.deliver()
    assert [b["status"] for b in down.bodies()] == ["resolved"]  # the firing it overtook is not news
    assert daemon.dispatcher.discarded["superseded"] == 1
    assert daemon.dispatcher.pending() == {}


@pytest.mark.integration
def test_a_firing_whose_alerts_resolved_and_fired_again_while_it_waited_is_never_delivered(
    deployment: Deployment, down: Receiver, frozen: FrozenClock
) -> None:
    """Fired, resolved, fired again while the receiver refused: the first firing tells of an
    episode that is over (its resolve is not news either); only the second is delivered."""
    daemon = fired_at(deployment, down)  # fires; the receiver refuses
    for _ in range(6):  # and goes on refusing: the retries are BACKOFF_MAX (±20%) apart now
        frozen.advance(dt.timedelta(minutes=6))
        deployment.evaluate()
    for threshold in ("1000000", WARNING["threshold"]):  # within one of them, resolves and fires again
        frozen.advance(dt.timedelta(seconds=60))
        deployment.write([WARNING | {"threshold": threshold}], [webhook(down)])
        assert daemon.reload()
        deployment.evaluate()
    fired_again = deployment.clock.now()
    assert daemon.dispatcher.pending() == {"hook": 3}
    down.refuse = 0
    frozen.advance(dt.timedelta(seconds=BACKOFF_MAX * 1.2 + 1))
    daemon.deliver()
    (delivered,) = down.bodies()
    assert delivered["status"] == "firing"
    starts = {dt.datetime.fromisoformat(a["startsAt"].replace("Z", "+00:00")) for a in delivered["alerts"]}
    assert starts == {fired_again}  # the episode of now, not the one that resolved
    assert daemon.dispatcher.pending() == {}


@pytest.mark.integration
def test_a_firing_queued_for_a_notifier_a_reload_routed_the_rule_away_from_goes_to_the_new_one_only(
    deployment: Deployment, frozen: FrozenClock, down: Receiver, hook: Receiver
) -> None:
    old, new = down, hook
    notifiers = [webhook(old, "old"), webhook(new, "new")]
    deployment.write([WARNING | {"notifiers": ["old"]}], notifiers)
    daemon = deployment.start()
    deployment.evaluate()  # fires; "old" refuses
    assert daemon.dispatcher.pending() == {"old": 1}
    deployment.write([WARNING | {"notifiers": ["new"]}], notifiers)
    assert daemon.reload()
    deployment.evaluate()  # "new" is told it fires
    old.refuse = 0
    frozen.advance(dt.timedelta(seconds=BACKOFF_MAX * 1.2 + 1))
    daemon.deliver()
    assert [b["status"] for b in alerts_told(new)] == ["firing"]
    assert alerts_told(old) == []  # not its rule's to tell any more
    assert daemon.dispatcher.pending() == {}


@pytest.mark.integration
def test_reminders_do_not_pile_up_behind_a_receiver_that_is_down(
    deployment: Deployment, down: Receiver, frozen: FrozenClock
) -> None:
    """A reminder every `repeat_interval` is for a receiver that took the firing and heard nothing
    since: none is queued while what waits for it has failed, so a receiver back after hours gets
    the firing once, not once for each hour it was down (one that merely waits its turn holds
    back no reminder: tests/test_alerts.py)."""
    daemon = fired_at(deployment, down, repeat_interval="1h")  # fires; the receiver refuses
    for _ in range(4):
        frozen.advance(dt.timedelta(hours=1))
        deployment.evaluate()
    assert daemon.dispatcher.pending() == {"hook": 1}
    down.refuse = 0
    frozen.advance(dt.timedelta(seconds=BACKOFF_MAX * 1.2 + 1))
    daemon.deliver()
    assert [b["status"] for b in down.bodies()] == ["firing"]
    deployment.evaluate()  # the receiver has it now: reminded again after `repeat_interval`, as before
    frozen.advance(dt.timedelta(hours=1))
    deployment.evaluate()
    assert [b["status"] for b in down.bodies()] == ["firing", "firing"]


@pytest.mark.integration
def test_notification_ids_never_repeat_after_a_fresh_state_file(deployment: Deployment, hook: Receiver) -> None:
    for state in ("old.db", "new.db"):  # the same config; the second run on a fresh state file
        deployment.write([WARNING], [webhook(hook)], deployment.state.with_name(state))
        daemon = deployment.start()
        deployment.evaluate()
        deployment.write([WARNING | {"threshold": "1000000"}], [webhook(hook)], deployment.state.with_name(state))
        assert daemon.reload()
        deployment.evaluate()
        deployment.stop()
    sent = [(b["notificationId"], b["status"]) for b in hook.bodies()]
    assert [status for _, status in sent] == ["firing", "resolved"] * 2
    assert len({notification for notification, _ in sent}) == 4
