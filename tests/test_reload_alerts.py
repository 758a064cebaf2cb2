"""What the receivers are told when a reload changes the rules or the routing while alerts are
pending, firing or resolved: every firing told is resolved to the notifiers that were told it,
and to no other; what was never told is never resolved; a receiver's last word on a label set is
the state it is in. On the simulator in process, read from the outbox (tests/daemon_fakes.py)."""

from __future__ import annotations

import datetime as dt
import logging
import re
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import closing
from decimal import Decimal
from pathlib import Path

import pytest
import yaml

from exporter.alerts import engine
from exporter.alerts.alert import rekey
from exporter.app.daemon import Daemon
from exporter.config.load import load
from exporter.config.rules import rule_key
from exporter.core.clock import Clock, FrozenClock, iso
from exporter.model.snapshots import Latest
from exporter.notifiers.alertmanager import payload
from exporter.sim import ITEMS, Endpoint, Simulator
from exporter.state import AlertStore, StateStore
from tests.daemon_fakes import NOWHERE, fake_billing_section, metrics, readiness, statuses, told, unit_daemon
from tests.helpers import Receiver, logged, value
from tests.smtp import FROM, PASSWORD, TO, USER, Mailbox, Start
from tests.test_reconcile import billed_week

RULE = {"alert": "EndpointSpend", "signal": "spend", "by": ["endpoint_id"], "threshold": "1"}
QUIET = {"threshold": "1e9"}
"""A threshold nothing reaches: the rule's alerts resolve."""
BUDGET_RULE = {"alert": "MonthlyBudget", "budget": "month", "tiers": [0.5]}


class Reloading:
    """A daemon on the simulator whose config file a test rewrites and reloads."""

    def __init__(self, sim: Simulator, clock: Clock, tmp_path: Path) -> None:
        self.sim, self.clock, self.path = sim, clock, tmp_path / "config.yaml"
        self.state = tmp_path / "state.db"
        self.daemon: Daemon | None = None

    def config(
        self, rules: list[dict], notifiers: tuple[str, ...] = ("hook",), billing: dict | None = None, **more: object
    ) -> None:
        document = {
            "billing": fake_billing_section(self.sim, history_months=0) | (billing or {}),
            "state": {"path": str(self.state)},
            "alerts": {"rules": rules, "notifiers": [hook(name) for name in notifiers]},
        } | more
        self.path.write_text(yaml.safe_dump(document))
        if self.daemon is None:
            self.daemon = unit_daemon(load(self.path), self.sim, self.clock, config_path=self.path)
        else:
            assert self.daemon.reload()

    def evaluate(self) -> None:
        assert self.daemon is not None
        self.daemon.refresh("bills")
        self.daemon.alert_cycle()

    def told(self, notifier: str) -> list[tuple[str, list[str]]]:
        assert self.daemon is not None
        return [
            (e["status"], sorted(a["labels"]["endpoint_id"] for a in e["alerts"])) for e in told(self.daemon, notifier)
        ]


def hook(name: str) -> dict:
    return {"name": name, "type": "webhook", "url": f"{NOWHERE}/{name}"}


@pytest.fixture
def world(sim: Simulator, clock: Clock, tmp_path: Path) -> Reloading:
    billed_week(sim)
    world = Reloading(sim, clock, tmp_path)
    yield world
    if world.daemon is not None:
        world.daemon.stop()


def endpoints(world: Reloading) -> list[str]:
    assert world.daemon is not None
    return sorted({a.labels["endpoint_id"] for a in world.daemon.sources.engine.current() if a.state == "firing"})


def test_a_rule_removed_while_its_alerts_are_pending_tells_nothing(world: Reloading) -> None:
    world.config([RULE | {"for": "10m"}])
    world.evaluate()
    assert told(world.daemon) == []  # pending
    world.config([])
    world.evaluate()
    assert world.told("hook") == []  # never told it fired: nothing to resolve
    assert world.daemon is not None
    assert world.daemon.sources.engine.current() == []


def test_a_rule_changed_in_what_it_watches_tells_the_old_alerts_resolved_before_the_new_ones_fire(
    world: Reloading,
) -> None:
    """Same labels, another rule (the month's spend instead of the day's): a receiver matching
    alerts by their labels ends on firing, the state they are in."""
    world.config([RULE])
    world.evaluate()
    firing = endpoints(world)
    world.config([RULE | {"window": "month"}])
    world.evaluate()
    assert endpoints(world) == firing
    assert [status for status, _ in world.told("hook")] == ["firing", "resolved", "firing"]
    # Alertmanager takes one label set as one alert: it is sent the one that fires, not beside it the
    # old rule's resolved one (whichever came last in a push would have won).
    assert world.daemon is not None
    now = world.clock.now().timestamp()
    pushed = payload(world.daemon.sources.engine.current(), now, "")
    assert sorted(a["labels"]["endpoint_id"] for a in pushed) == firing
    assert all(a["endsAt"] > iso(now) for a in pushed)


def test_reordering_a_rule_s_by_or_where_list_tells_nothing_and_an_upgrade_keeps_alerts_saved_in_their_order(
    world: Reloading, caplog: pytest.LogCaptureFixture
) -> None:
    """Their order says nothing of what the rule watches: its firing alerts stay as they are, told
    once. A state file of a version whose ids followed the order as written has its alerts moved
    to the rule's id now at start-up, not resolved and fired again."""
    caplog.set_level(logging.INFO, logger="exporter")
    chosen = sorted(e.endpoint_id for e in world.sim.endpoints)
    rule = RULE | {"by": ["project_id", "endpoint_id"], "where": {"endpoint_id": chosen}}
    world.config([rule])
    world.evaluate()
    firing = endpoints(world)
    assert firing
    assert world.told("hook") == [("firing", firing)]
    assert world.daemon is not None
    (written,) = world.daemon.config.alerts.rules
    world.config([rule | {"by": ["endpoint_id", "project_id"], "where": {"endpoint_id": chosen[::-1]}}])
    world.evaluate()
    assert (endpoints(world), world.told("hook")) == (firing, [("firing", firing)])
    assert world.daemon is not None
    world.daemon.stop()
    world.daemon = None
    store = StateStore(world.state)  # as a version before saved them: under the rule's id as written
    AlertStore(store).adopt_rule_ids({rule_key(written): rule_key(written, as_written=True)}, rekey)
    store.close()
    world.config([rule])
    (moved,) = logged(caplog.records, "saved alerts moved to their rules' new ids")
    assert moved.fields["alerts"] == len(firing)  # type: ignore[attr-defined]
    world.evaluate()
    assert (endpoints(world), world.told("hook")) == (firing, [("firing", firing)])


def test_a_notifier_added_by_the_reload_that_resolves_the_alerts_is_told_nothing(world: Reloading) -> None:
    world.config([RULE])
    world.evaluate()
    world.config([RULE | QUIET], notifiers=("hook", "new"))
    world.evaluate()
    assert [status for status, _ in world.told("hook")] == ["firing", "resolved"]
    assert world.told("new") == []  # it never heard them fire


class Delivering:
    """A daemon on the simulator whose one rule a test routes to notifiers `a` and `b` by reloads,
    each with a webhook receiver on loopback (which the test may make refuse)."""

    def __init__(self, clock: Clock, frozen: FrozenClock, tmp_path: Path) -> None:
        self.sim, self.clock, self.frozen, self.tmp_path = Simulator(clock=clock), clock, frozen, tmp_path
        billed_week(self.sim)
        self.receivers = {name: Receiver() for name in ("a", "b")}
        self.path = tmp_path / "config.yaml"
        self.daemon: Daemon | None = None

    def step(self, rule: dict, *, deliver: bool = True, minutes: int = 2) -> None:
        """The rule as given (a reload after the first), an evaluation on fresh bills, what is due
        delivered (unless not `deliver`), and `minutes` later."""
        self.reload(rule)
        assert self.daemon is not None
        self.daemon.refresh("bills")
        self.daemon.alert_cycle()
        if deliver:
            self.daemon.deliver()
        self.frozen.advance(dt.timedelta(minutes=minutes))

    def reload(self, rule: dict) -> None:
        """The rule as given: the daemon started with it, or reloaded."""
        notifiers = [{"name": n, "type": "webhook", "url": r.url} for n, r in self.receivers.items()]
        document = {
            "billing": fake_billing_section(self.sim, history_months=0),
            "state": {"path": str(self.tmp_path / "state.db")},
            "alerts": {"rules": [rule], "notifiers": notifiers, "repeat_interval": "30m"},
        }
        self.path.write_text(yaml.safe_dump(document))
        if self.daemon is None:
            self.daemon = unit_daemon(load(self.path), self.sim, self.clock, config_path=self.path)
        else:
            assert self.daemon.reload()

    def later(self, minutes: int = 10) -> None:
        """`minutes` later, what is due delivered."""
        assert self.daemon is not None
        self.frozen.advance(dt.timedelta(minutes=minutes))
        self.daemon.alert_cycle()
        self.daemon.deliver()

    def statuses(self) -> dict[str, list[str]]:
        return {name: [r["body"]["status"] for r in receiver.received] for name, receiver in self.receivers.items()}

    def close(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()
        for receiver in self.receivers.values():
            receiver.stop()


@pytest.fixture
def delivering(clock: Clock, frozen: FrozenClock, tmp_path: Path) -> Iterator[Delivering]:
    made = Delivering(clock, frozen, tmp_path)
    yield made
    made.close()


def test_a_notifier_the_rule_was_routed_away_from_is_never_left_on_firing(delivering: Delivering) -> None:
    """a is told the alert fired, then is down while it resolves; a reload routes the rule to b
    and the alert fires again, which overtakes a's waiting resolve; a is back: the resolve is
    delivered all the same (that firing is not a's to hear), and nothing more of it."""
    delivering.step(RULE | {"notifiers": ["a"]})
    delivering.receivers["a"].refuse = 10**6
    delivering.step(RULE | QUIET | {"notifiers": ["a"]})  # resolved: a's resolve waits
    delivering.step(RULE | {"notifiers": ["b"]})  # fires again, told to b
    delivering.receivers["a"].refuse = 0
    delivering.later()  # a's resolve, overtaken, goes all the same
    delivering.step(RULE | QUIET | {"notifiers": ["b"]})
    delivering.later()
    assert delivering.statuses() == {"a": ["firing", "resolved"], "b": ["firing", "resolved"]}


def test_a_budget_rule_removed_and_added_back_fires_its_tier_again(world: Reloading) -> None:
    """Its removal told the receivers the tier resolved: added back in the same month, the tier,
    still crossed, fires again."""
    budget = BUDGET_RULE
    budgets = [{"name": "month", "amount": "1"}]
    world.config([budget], budgets=budgets)
    world.evaluate()
    world.config([], budgets=budgets)
    world.evaluate()
    world.config([budget], budgets=budgets)
    world.evaluate()
    assert world.daemon is not None
    assert statuses(world.daemon, "hook") == ["firing", "resolved", "firing"]
    assert [a.state for a in world.daemon.sources.engine.current() if a.labels["alertname"] == "MonthlyBudget"] == [
        "firing"
    ]


def test_a_budget_made_daily_and_monthly_again_fires_its_month_tier_again(world: Reloading) -> None:
    """Month to day told the month's tier resolved; back to month in the same month, the tier,
    still crossed, fires again (it had stayed marked as fired: nothing fired till the month's end)."""

    def budgets(period: str) -> list[dict]:
        return [{"name": "month", "amount": "1", "period": period}]

    for period in ("month", "day", "month"):
        world.config([BUDGET_RULE], budgets=budgets(period))
        world.evaluate()
    assert world.daemon is not None
    assert statuses(world.daemon, "hook") == ["firing", "resolved", "firing", "resolved", "firing"]
    firing = [a for a in world.daemon.sources.engine.current() if a.state == "firing"]
    assert [a.period for a in firing] == [f"{world.daemon.clock.today():%Y-%m}"]


def test_an_email_owed_to_one_full_mailbox_holds_back_no_reminder(world: Reloading, frozen: FrozenClock) -> None:
    """A notification some recipients took, owed to one that refused it: the notifier's receiver
    is not down, and the reminders go on at `repeat_interval`."""
    world.config([RULE])
    world.evaluate()
    assert world.daemon is not None
    with closing(sqlite3.connect(world.state)) as db, db:  # as a delivery leaves one a full mailbox refused
        db.execute("UPDATE outbox SET attempts = 1, recipients = '[\"full@example.com\"]' WHERE notifier = 'hook'")
    frozen.advance(dt.timedelta(hours=4, minutes=1))
    world.evaluate()
    assert [status for status, _ in world.told("hook")] == ["firing", "firing"]


def test_a_reload_to_another_project_judges_nothing_on_the_project_before(world: Reloading) -> None:
    """Moved from proj-lab to proj-main, a rule added in the same reload: the evaluation that
    follows at once, before proj-main's bills are read, tells nothing of proj-lab's endpoint, and
    readiness waits for proj-main's bills and usage."""
    world.config([], billing={"project_id": "proj-lab"})
    world.evaluate()
    assert world.daemon is not None
    world.daemon.refresh("usage")
    world.config([RULE], billing={"project_id": "proj-main"})
    world.daemon.alert_cycle()  # (what the alert loop does at once after a reload)
    assert world.told("hook") == []
    latest = world.daemon.sources.one.latest
    assert (latest.bills, latest.usage) == (None, None)
    assert not {"bills", "usage"} & set(latest.health)
    assert not readiness(world.daemon)[0]
    world.evaluate()
    assert world.told("hook") == [("firing", ["ep-20261101-alpha", "ep-20261101-beta"])]


@pytest.mark.parametrize("change", [{"project_id": "proj-main"}, {"history_months": 1}])
def test_a_source_a_reload_adds_or_forgets_is_no_older_than_the_reload(
    world: Reloading, frozen: FrozenClock, change: dict
) -> None:
    """Two hours after the start, a reload to another project (its bills and usage forgotten) or one
    that turns the history on: until those sources refresh, `data_age` counts from the reload, not
    from the start. Nothing is told stale at once; what does not refresh within the threshold is."""
    stale = {"alert": "DataStale", "signal": "data_age", "by": ["source"], "threshold": 3600}
    world.config([stale], billing={"project_id": "proj-lab"})
    assert world.daemon is not None
    latest = world.daemon.sources.one.latest
    latest.started = world.clock.now().timestamp() - 7200  # (as if started two hours ago)
    for source in ("bills", "usage"):
        assert world.daemon.refresh(source)
    world.daemon.alert_cycle()
    world.config([stale], billing={"project_id": "proj-lab"} | change)
    world.daemon.alert_cycle()  # (what the alert loop does at once after a reload)
    assert told(world.daemon, "hook") == []
    frozen.advance(dt.timedelta(seconds=3601))  # (nothing refreshed since)
    world.daemon.alert_cycle()
    waited = {"history"} if "history_months" in change else {"bills", "usage"}
    firing = {a.labels["source"] for a in world.daemon.sources.engine.current() if a.state == "firing"}
    assert waited <= firing


def budget_alerts(world: Reloading) -> list[tuple[str, str]]:
    assert world.daemon is not None
    engine = world.daemon.sources.engine
    return [(a.state, a.annotations["summary"]) for a in engine.current() if a.labels["alertname"] == "MonthlyBudget"]


def test_a_budget_amount_raised_above_the_spend_resolves_its_tier_which_fires_again_when_crossed_again(
    world: Reloading,
) -> None:
    world.config([BUDGET_RULE], budgets=[{"name": "month", "amount": "1"}])
    world.evaluate()
    world.config([BUDGET_RULE], budgets=[{"name": "month", "amount": "1e12"}])
    world.evaluate()
    assert [state for state, _ in budget_alerts(world)] == ["resolved"]
    world.config([BUDGET_RULE], budgets=[{"name": "month", "amount": "1"}])
    world.evaluate()
    assert world.daemon is not None
    assert statuses(world.daemon, "hook") == ["firing", "resolved", "firing"]


def test_a_firing_budget_tier_tells_the_amount_of_now(world: Reloading) -> None:
    """A reload doubles the amount, the tier still crossed: what the alert says (and its reminders)
    is measured against the new amount."""
    world.config([BUDGET_RULE], budgets=[{"name": "month", "amount": "10"}])
    world.evaluate()
    ((state, before),) = budget_alerts(world)
    assert "of 10.00" in before
    world.config([BUDGET_RULE], budgets=[{"name": "month", "amount": "20"}])
    world.evaluate()
    ((state, after),) = budget_alerts(world)
    assert state == "firing"
    assert "of 20.00" in after
    assert world.daemon is not None
    assert statuses(world.daemon, "hook") == ["firing"]  # told once


def firing_tiers(world: Reloading) -> list[tuple[str, str]]:
    """The budget alerts firing: the share their summary tells, and their tier."""
    found = [re.search(r"is at (\d+%) of [\d.]+: tier ([\d.]+) crossed", s) for state, s in budget_alerts(world)
             if state == "firing"]  # fmt: skip
    return [(m[1], m[2]) if m else ("?", "?") for m in found]


def test_a_tier_a_reload_takes_out_is_told_resolved_and_the_highest_tier_left_crossed_fires(world: Reloading) -> None:
    """Tiers 0.5 and 0.8, spend at 90%: 0.8 fires (0.5 inhibited). A reload takes 0.8 out and
    raises the amount (85%): 0.8 is told resolved and 0.5 fires, at the figures of now; putting 0.8
    back fires it again (crossed)."""
    rule = BUDGET_RULE | {"tiers": [0.5, 0.8]}
    world.config([rule], budgets=[{"name": "month", "amount": "1"}])
    assert world.daemon is not None
    world.daemon.refresh("bills")
    bills = world.daemon.sources.one.latest.bills
    assert bills is not None
    spent = bills.current.month_to_date
    world.config([rule], budgets=[{"name": "month", "amount": str(spent / Decimal("0.9"))}])
    world.evaluate()
    assert firing_tiers(world) == [("90%", "0.8")]
    amount = spent / Decimal("0.85")
    world.config([rule | {"tiers": [0.5]}], budgets=[{"name": "month", "amount": str(amount)}])
    world.evaluate()
    assert firing_tiers(world) == [("85%", "0.5")]  # (at the amount of now)
    assert statuses(world.daemon, "hook") == ["firing", "resolved", "firing"]
    world.config([rule], budgets=[{"name": "month", "amount": str(amount)}])
    world.evaluate()
    assert firing_tiers(world) == [("85%", "0.8")]
    assert statuses(world.daemon, "hook") == ["firing", "resolved", "firing", "firing"]  # (0.5 inhibited)


def test_a_firing_of_more_alerts_than_it_shows_that_all_resolved_while_it_waited_is_not_delivered(
    clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    """150 alerts fire together (a message shows 100 and counts the rest) while the receiver is
    down; all of them resolve before it is back: it is told they resolved, not that they fire."""
    sim = Simulator(clock=clock, endpoints=tuple(Endpoint(f"ep-{n:03d}", "model-a", "proj-main") for n in range(150)))
    receiver = Receiver()
    path = tmp_path / "config.yaml"
    rule = RULE | {"threshold": "0"}

    def config(rule: dict) -> dict:
        return {
            "billing": fake_billing_section(sim, history_months=0),
            "state": {"path": str(tmp_path / "state.db")},
            "alerts": {"rules": [rule], "notifiers": [{"name": "hook", "type": "webhook", "url": receiver.url}]},
        }

    path.write_text(yaml.safe_dump(config(rule)))
    daemon = unit_daemon(load(path), sim, clock, config_path=path)
    try:
        receiver.refuse = 10**6
        daemon.refresh("bills")
        daemon.alert_cycle()
        daemon.deliver()
        path.write_text(yaml.safe_dump(config(rule | QUIET)))
        assert daemon.reload()
        daemon.refresh("bills")
        daemon.alert_cycle()
        receiver.refuse = 0
        frozen.advance(dt.timedelta(minutes=10))
        daemon.deliver()
    finally:
        daemon.stop()
        receiver.stop()
    bodies = [r["body"] for r in receiver.received]
    assert [(b["status"], len(b["alerts"]) + b["truncatedAlerts"]) for b in bodies] == [("resolved", 150)]


def test_a_firing_rule_routed_to_a_notifier_that_is_down_queues_it_the_firing(
    clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    """`down` has a notification waiting that it refused; a reload routes a firing rule to it too:
    it is queued the firing (delivered when it is back), never counted as told without it."""
    sim = Simulator(clock=clock)
    billed_week(sim)
    receivers = {name: Receiver() for name in ("down", "ok")}
    big = {"alert": "Big", "signal": "spend", "threshold": "1", "notifiers": ["down"]}
    path = tmp_path / "config.yaml"

    def config(routed: list[str]) -> None:
        notifiers = [{"name": n, "type": "webhook", "url": r.url} for n, r in receivers.items()]
        rules = [big, RULE | {"notifiers": routed}]
        document = {
            "billing": fake_billing_section(sim, history_months=0),
            "state": {"path": str(tmp_path / "state.db")},
            "alerts": {"rules": rules, "notifiers": notifiers},
        }
        path.write_text(yaml.safe_dump(document))

    config(["ok"])
    daemon = unit_daemon(load(path), sim, clock, config_path=path)
    try:
        receivers["down"].refuse = 10**6
        daemon.refresh("bills")
        daemon.alert_cycle()
        daemon.deliver()  # Big's firing, refused by down
        config(["ok", "down"])
        assert daemon.reload()
        daemon.alert_cycle()
        assert [(e["status"], e["alertname"]) for e in told(daemon, "down")] == [
            ("firing", "Big"),
            ("firing", "EndpointSpend"),
        ]
        receivers["down"].refuse = 0  # back
        frozen.advance(dt.timedelta(minutes=10))
        daemon.deliver()
        delivered = [(r["body"]["status"], r["body"]["groupLabels"]["alertname"]) for r in receivers["down"].received]
        assert delivered == [("firing", "Big"), ("firing", "EndpointSpend")]
    finally:
        daemon.stop()
        for receiver in receivers.values():
            receiver.stop()


def test_a_refresh_in_flight_across_a_reload_to_another_project_publishes_nothing(world: Reloading) -> None:
    """Its answers read when the reload to proj-lab comes, the refresh of proj-main's bills ends
    after it: what it read is not shown, not judged, not counted fresh; it runs again for proj-lab."""
    world.config([RULE], billing={"project_id": "proj-main"})
    daemon = world.daemon
    assert daemon is not None
    old = daemon.sources.accounts[""]
    fetched, go = threading.Event(), threading.Event()
    read = old.bills.refresh

    def slow() -> object:
        answer = read()  # every answer read...
        fetched.set()
        go.wait(10)  # ...and the figures still being made when the reload comes
        return answer

    old.bills.refresh = slow  # type: ignore[method-assign]
    refreshing = threading.Thread(target=daemon.refresh, args=("bills",))
    refreshing.start()
    try:
        assert fetched.wait(10)
        world.config([RULE], billing={"project_id": "proj-lab"})
    finally:
        go.set()
        refreshing.join(10)
    assert not refreshing.is_alive()  # (the reload did not wait for it)
    latest = daemon.sources.one.latest
    assert latest.bills is None
    assert "bills" not in latest.health
    daemon.alert_cycle()
    assert world.told("hook") == []


def spent(world: Reloading) -> Decimal:
    """The month's spend as the budget measures it (the budget `month` of amount 1 held now)."""
    assert world.daemon is not None
    used = value(metrics(world.daemon), "inference_budget_used_ratio", budget="month")
    assert used is not None
    return Decimal(repr(used))


def test_a_tier_whose_label_rounds_up_fires_once(world: Reloading) -> None:
    """Tier 0.6666667 is labelled 0.666667; the spend sits between the two: it fires once and
    stays firing, evaluation after evaluation."""
    world.config([], budgets=[{"name": "month", "amount": "1"}])
    world.evaluate()
    amount = spent(world) / Decimal("0.66666680")
    world.config([BUDGET_RULE | {"tiers": [0.6666667]}], budgets=[{"name": "month", "amount": f"{amount:.12f}"}])
    for _ in range(4):
        world.evaluate()
    assert world.daemon is not None
    assert statuses(world.daemon, "hook") == ["firing"]


def test_falling_back_under_the_top_tier_fires_the_tier_still_crossed(world: Reloading) -> None:
    """Tiers 0.5 and 0.8, the spend at 0.9, then 0.75 (a raised amount), then 0.9 again: the 0.8
    tier fires and resolves, the 0.5 tier (crossed all along, never told on its own) fires then,
    and 0.8, crossed anew, fires again (0.5 superseded without a notice of its own)."""
    world.config([], budgets=[{"name": "month", "amount": "1"}])
    world.evaluate()
    total = spent(world)
    rule = BUDGET_RULE | {"tiers": [0.5, 0.8]}
    for ratio in ("0.9", "0.75", "0.9"):
        world.config([rule], budgets=[{"name": "month", "amount": f"{total / Decimal(ratio):.12f}"}])
        world.evaluate()
    assert world.daemon is not None
    told_tiers = [(e["status"], e["alerts"][0]["labels"]["tier"]) for e in told(world.daemon, "hook")]
    assert told_tiers == [("firing", "0.8"), ("resolved", "0.8"), ("firing", "0.5"), ("firing", "0.8")]


def test_a_removed_rules_resolved_alerts_are_kept_a_quarter_of_an_hour(world: Reloading, frozen: FrozenClock) -> None:
    """Alertmanager keeps being sent their end, as for any resolved alert (one push missed loses it not)."""
    world.config([RULE])
    world.evaluate()
    world.config([])
    for _ in range(2):
        world.evaluate()
        frozen.advance(dt.timedelta(minutes=5))
    assert world.daemon is not None
    now = world.clock.now().timestamp()
    pushed = payload(world.daemon.sources.engine.current(), now, "")
    assert len(pushed) == 3
    assert all(a["endsAt"] < iso(now) for a in pushed)
    frozen.advance(dt.timedelta(minutes=10))
    world.evaluate()
    assert world.daemon.sources.engine.current() == []


def test_a_notifier_routed_away_hears_the_end_of_the_firing_it_was_told_once(
    world: Reloading, frozen: FrozenClock
) -> None:
    """Told to x, resolved; routed to y, the alert fires and resolves again, twice: x hears nothing
    of those."""
    world.config([RULE | {"notifiers": ["x"]}], notifiers=("x", "y"))
    world.evaluate()
    world.config([RULE | QUIET | {"notifiers": ["x"]}], notifiers=("x", "y"))
    world.evaluate()
    for _ in range(2):
        frozen.advance(dt.timedelta(minutes=2))
        world.config([RULE | {"notifiers": ["y"]}], notifiers=("x", "y"))
        world.evaluate()
        frozen.advance(dt.timedelta(minutes=2))
        world.config([RULE | QUIET | {"notifiers": ["y"]}], notifiers=("x", "y"))
        world.evaluate()
    assert [status for status, _ in world.told("x")] == ["firing", "resolved"]
    assert [status for status, _ in world.told("y")] == ["firing", "resolved", "firing", "resolved"]


@pytest.mark.parametrize("reloads", [1, 2, "a restart", "a restart, groups showing one alert"])
def test_a_notifier_routed_away_and_back_while_the_alert_fires_is_told_it_fires(
    delivering: Delivering, reloads: int | str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """a is down while the alert resolves and fires again; the rule is routed to b; a is back (it
    hears the resolve, the firing queued for it is dropped: routed away); routed back to a (by a
    reload, or by one and another before an evaluation): a is queued the firing, not left on
    `resolved` until a reminder hours later."""
    if reloads == "a restart, groups showing one alert":
        monkeypatch.setattr(engine, "GROUP_DETAIL", 1)  # (the other two kept by key: `beyond`)
    delivering.step(RULE | {"notifiers": ["a"]})
    delivering.receivers["a"].refuse = 10**6
    delivering.step(RULE | QUIET | {"notifiers": ["a"]})  # its resolve waits for a
    delivering.step(RULE | {"notifiers": ["a"]}, deliver=False)  # the firing queued behind it
    delivering.step(RULE | {"notifiers": ["b"]})  # routed away
    delivering.receivers["a"].refuse = 0
    delivering.later()  # a hears the resolve; the firing, routed away, is dropped
    if reloads == 2:
        delivering.reload(RULE | {"notifiers": ["a", "b"]})
    if str(reloads).startswith("a restart"):
        assert delivering.daemon is not None
        delivering.daemon.stop()
        delivering.daemon = None
    delivering.step(RULE | {"notifiers": ["a", "b"]} | ({"threshold": "1.5"} if reloads == 2 else {}))
    delivering.later()
    assert delivering.statuses()["a"] == ["firing", "resolved", "firing"]
    last = delivering.receivers["a"].received[-1]["body"]
    assert len(last["alerts"]) + last["truncatedAlerts"] == 3  # every alert of the firing


def test_a_firing_dropped_as_routed_away_is_not_resolved_to_its_notifier_when_the_bills_resolve_it(
    delivering: Delivering,
) -> None:
    """a's firing waits (its receiver down); a reload routes the rule to b, which is told; a is
    back and the firing, routed away, is dropped: a was never told. The alert then resolves on
    revised bills, no reload between (the engine that queues the resolve is the one that saw the
    firing queued for a): only b hears it."""
    delivering.receivers["a"].refuse = 10**6
    delivering.step(RULE | {"notifiers": ["a"]})
    delivering.step(RULE | {"notifiers": ["b"]})  # routed away: b is told
    delivering.receivers["a"].refuse = 0
    delivering.later()  # a's firing, routed away, is dropped
    assert delivering.daemon is not None
    firing = {a.labels["endpoint_id"] for a in delivering.daemon.sources.engine.current() if a.state == "firing"}
    assert firing
    for endpoint in firing:
        for item in ITEMS:
            delivering.sim.revise_bill(delivering.clock.today(), endpoint, item, Decimal(0))
    delivering.daemon.refresh("bills")
    delivering.later()
    assert delivering.statuses() == {"a": [], "b": ["firing", "resolved"]}


def test_a_reminder_dropped_as_routed_away_leaves_the_notifier_told_of_the_firing(delivering: Delivering) -> None:
    """a was told the alert fires; its receiver down, a reminder waits for it; the rule is routed
    to b, and the reminder dropped when a is back; after a restart the alert resolves: a, told it
    fired, is told it resolved."""
    delivering.step(RULE | {"notifiers": ["a"]})
    delivering.receivers["a"].refuse = 10**6
    delivering.later(minutes=31)  # a reminder, refused
    delivering.step(RULE | {"notifiers": ["b"]})  # routed away
    delivering.receivers["a"].refuse = 0
    delivering.later()  # the reminder, routed away, is dropped
    assert delivering.daemon is not None
    delivering.daemon.stop()
    delivering.daemon = None  # a restart
    delivering.step(RULE | QUIET | {"notifiers": ["b"]})
    delivering.later()
    assert delivering.statuses() == {"a": ["firing", "resolved"], "b": ["firing", "resolved"]}


def test_a_notifier_routed_to_a_rule_as_it_fires_is_told_once(world: Reloading) -> None:
    """One reload routes the rule to `new` too and lowers its threshold: the firing that follows
    is told to `new` once, one alert each."""
    world.config([RULE | QUIET])
    world.evaluate()
    world.config([RULE], notifiers=("hook", "new"))
    world.evaluate()
    assert world.daemon is not None
    for notifier in ("hook", "new"):
        (event,) = told(world.daemon, notifier)
        assert (event["status"], event["total"], len(event["alerts"])) == ("firing", 3, 3)


def test_an_email_taken_by_one_recipient_and_dropped_as_routed_away_still_gets_its_resolve(
    clock: Clock, frozen: FrozenClock, tmp_path: Path, start_smtp: Start, mailbox: Mailbox, ca_file: str
) -> None:
    """oncall takes the firing, ops refuses it (450, retried); a reload routes the rule away and
    the retry is dropped: oncall was told, and after a restart the alert's resolve reaches it."""
    smtp = start_smtp()
    mailbox.refuse = {"ops@example.com": "450 4.2.1 mailbox busy"}
    sim = Simulator(clock=clock)
    billed_week(sim)
    path = tmp_path / "config.yaml"
    mail = {"name": "mail", "type": "email", "smtp": f"127.0.0.1:{smtp.port}", "from": FROM, "to": TO,
            "username": USER, "password": PASSWORD, "ca_file": ca_file}  # fmt: skip

    def config(rule: dict) -> None:
        notifiers = [mail, {"name": "b", "type": "webhook", "url": f"{NOWHERE}/b"}]
        document = {
            "billing": fake_billing_section(sim, history_months=0),
            "state": {"path": str(tmp_path / "state.db")},
            "alerts": {"rules": [rule], "notifiers": notifiers},
        }
        path.write_text(yaml.safe_dump(document))

    def step(daemon: Daemon) -> None:
        daemon.refresh("bills")
        daemon.alert_cycle()
        daemon.deliver()

    config(RULE | {"notifiers": ["mail"]})
    daemon = unit_daemon(load(path), sim, clock, config_path=path)
    try:
        step(daemon)
        config(RULE | {"notifiers": ["b"]})
        assert daemon.reload()
        step(daemon)
        frozen.advance(dt.timedelta(minutes=30))
        daemon.deliver()  # the retry to ops: dropped, routed away
    finally:
        daemon.stop()
    config(RULE | QUIET | {"notifiers": ["b"]})
    daemon = unit_daemon(load(path), sim, clock, config_path=path)  # a restart
    try:
        step(daemon)
        frozen.advance(dt.timedelta(minutes=10))
        daemon.deliver()
    finally:
        daemon.stop()
    subjects = [(m.message["Subject"].split(":")[0], m.rcpt_tos) for m in mailbox.messages]
    assert subjects == [
        ("[FIRING] EndpointSpend", ["oncall@example.com"]),
        ("[RESOLVED] EndpointSpend", ["oncall@example.com"]),
    ]


def test_a_later_firing_still_queued_when_an_earlier_one_is_dropped_gets_its_resolve(delivering: Delivering) -> None:
    """a down throughout: the alert fires, resolves and fires again, all queued for a; routed to b,
    the first firing is dropped (a's drain stops at the resolve it refuses); restarted routed back to
    a with the alert under its threshold, a is delivered the second firing, then its resolve."""
    delivering.receivers["a"].refuse = 10**6
    delivering.step(RULE | {"notifiers": ["a"]})
    delivering.step(RULE | QUIET | {"notifiers": ["a"]}, deliver=False)
    delivering.step(RULE | {"notifiers": ["a"]}, deliver=False)  # a second firing, queued behind
    delivering.step(RULE | {"notifiers": ["b"]}, minutes=10)  # routed away: the first firing dropped
    assert delivering.daemon is not None
    delivering.daemon.stop()
    delivering.daemon = None
    delivering.receivers["a"].refuse = 0
    delivering.reload(RULE | QUIET | {"notifiers": ["a", "b"]})  # restarted, routed back
    delivering.later(minutes=30)  # a: the resolve (overtaken, dropped), then the second firing
    delivering.step(RULE | QUIET | {"notifiers": ["a", "b"]}, minutes=30)  # the alert resolves
    delivering.later()
    assert delivering.statuses()["a"] == ["firing", "resolved"]


def test_a_probe_whose_runs_are_forgotten_is_waited_for_from_then() -> None:
    """Back to one account from several, the probe's runner new: its runs held are forgotten, and
    `data_age` counts from then, not from the process's start."""
    latest = Latest(started=1000.0)
    latest.record("probe:chat", success=True, at=5000.0, duration=1.0)
    latest.forget_probes(now=9000.0)
    assert "probe:chat" not in latest.health
    assert latest.waiting_since("probe:chat") == 9000.0
    assert latest.waiting_since("bills") == 1000.0  # (never forgotten: from the start)
