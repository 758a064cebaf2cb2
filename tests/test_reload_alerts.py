"""What the receivers are told when a reload changes the rules or the routing while alerts are
pending, firing or resolved: every firing told is resolved to the notifiers that were told it,
and to no other; what was never told is never resolved; a receiver's last word on a label set is
the state it is in. On the simulator in process, read from the outbox (tests/daemon_fakes.py)."""

from __future__ import annotations

import datetime as dt
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest
import yaml

from exporter.app.daemon import Daemon
from exporter.config.load import load
from exporter.core.clock import Clock, FrozenClock
from exporter.sim import Endpoint, Simulator
from tests.daemon_fakes import NOWHERE, fake_billing_section, readiness, told, unit_daemon
from tests.helpers import Receiver
from tests.test_reconcile import billed_week

RULE = {"alert": "EndpointSpend", "signal": "spend", "by": ["endpoint_id"], "threshold": "1"}
QUIET = {"threshold": "1e9"}
"""A threshold nothing reaches: the rule's alerts resolve."""


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


def test_a_notifier_added_by_the_reload_that_resolves_the_alerts_is_told_nothing(world: Reloading) -> None:
    world.config([RULE])
    world.evaluate()
    world.config([RULE | QUIET], notifiers=("hook", "new"))
    world.evaluate()
    assert [status for status, _ in world.told("hook")] == ["firing", "resolved"]
    assert world.told("new") == []  # it never heard them fire


def test_a_resolve_goes_to_the_notifiers_told_of_that_firing_not_to_those_of_one_before(
    world: Reloading, frozen: FrozenClock
) -> None:
    """Told to x, resolved; routed to y by a reload and firing again within the quarter of an
    hour a resolved alert is kept; resolved: x hears nothing of the second firing."""
    world.config([RULE | {"notifiers": ["x"]}], notifiers=("x", "y"))
    world.evaluate()
    world.config([RULE | QUIET | {"notifiers": ["x"]}], notifiers=("x", "y"))
    world.evaluate()
    frozen.advance(dt.timedelta(minutes=5))
    world.config([RULE | {"notifiers": ["y"]}], notifiers=("x", "y"))
    world.evaluate()
    frozen.advance(dt.timedelta(minutes=30))
    world.config([RULE | QUIET | {"notifiers": ["y"]}], notifiers=("x", "y"))
    world.evaluate()
    assert [status for status, _ in world.told("x")] == ["firing", "resolved"]
    assert [status for status, _ in world.told("y")] == ["firing", "resolved"]


def test_a_budget_rule_removed_and_added_back_fires_its_tier_again(world: Reloading) -> None:
    """Its removal told the receivers the tier resolved: added back in the same month, the tier,
    still crossed, fires again."""
    budget = {"alert": "MonthlyBudget", "budget": "month", "tiers": [0.5]}
    budgets = [{"name": "month", "amount": "1"}]
    world.config([budget], budgets=budgets)
    world.evaluate()
    world.config([], budgets=budgets)
    world.evaluate()
    world.config([budget], budgets=budgets)
    world.evaluate()
    assert world.daemon is not None
    assert [e["status"] for e in told(world.daemon, "hook")] == ["firing", "resolved", "firing"]
    assert [a.state for a in world.daemon.sources.engine.current() if a.labels["alertname"] == "MonthlyBudget"] == [
        "firing"
    ]


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


BUDGET_RULE = {"alert": "MonthlyBudget", "budget": "month", "tiers": [0.5]}


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
    assert [e["status"] for e in told(world.daemon, "hook")] == ["firing", "resolved", "firing"]


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
    assert [e["status"] for e in told(world.daemon, "hook")] == ["firing"]  # told once


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
