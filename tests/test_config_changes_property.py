"""The alert pipeline under random sequences of config changes (hypothesis' stateful testing).

One daemon (not started: the test thread is the only one that evaluates and delivers, so what a
receiver sees can be checked against the alert state of the moment it arrives) on a simulator,
its config rewritten and reloaded at random: rules added, removed, reordered, re-thresholded;
notifiers added, removed and renamed; budgets and prices changed; bills revised; receivers
failing and recovering; the daemon restarted on its state file. After every step:

- each notification arriving tells its alerts' state at that moment;
- no receiver gets one state change twice;
- every alert firing now has reached each notifier of the config whose receiver is up;
- nothing waits in the outbox for a notifier the config no longer has (the README: dropped).

`make test` runs a bounded number of examples; `PROPERTY_EXAMPLES` asks for more (the soak).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import tempfile
from decimal import Decimal
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
import yaml
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from exporter.app.daemon import Daemon
from exporter.config.load import load
from exporter.core.clock import Clock, FrozenClock
from exporter.delivery.dispatcher import BACKOFF_MAX
from exporter.sim import ITEMS, Simulator
from tests.conftest import billing_section
from tests.helpers import Receiver

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]  # examples of a few seconds each, many

SHANGHAI = ZoneInfo("Asia/Shanghai")
EXAMPLES = int(os.environ.get("PROPERTY_EXAMPLES", "15"))
NAMES = ("a", "b", "c", "d")
DOWN = st.frozensets(st.sampled_from(NAMES))
"""The receivers refusing everything during a step."""
DUE = dt.timedelta(seconds=BACKOFF_MAX * 1.2 + 1)
"""Past the longest backoff: every failed notification is due again at the next delivery."""

RULES = {
    "warning": {"alert": "EndpointSpend", "signal": "spend", "by": ["endpoint_id"], "labels": {"severity": "warning"}},
    "critical": {
        "alert": "EndpointSpend",
        "signal": "spend",
        "by": ["endpoint_id"],
        "labels": {"severity": "critical"},
    },
    "account": {"alert": "AccountSpend", "signal": "spend"},
    "month": {"alert": "MonthlyBudget", "budget": "month", "tiers": [0.5, 1, 2]},
    "model": {"alert": "ModelBudget", "budget": "model-a", "tiers": [0.5, 1], "labels": {"severity": "page"}},
}
LEVELS = ("everything", "some", "nothing")


class Pipeline(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.directory = tempfile.TemporaryDirectory()
        self.tmp = Path(self.directory.name)
        self.frozen = FrozenClock(dt.datetime(2026, 11, 22, 10, 0, tzinfo=SHANGHAI))
        self.clock = Clock(SHANGHAI, self.frozen)
        self.sim = Simulator(clock=self.clock)
        self.sim.add_usage(300)
        self.server = self.sim.serve()
        self.receivers: dict[str, Receiver] = {}
        """One receiver per notifier name; `generation` tells a name added again apart."""
        self.generation: dict[str, int] = {}
        self.mismatches: list[str] = []
        self.checked: dict[str, int] = {}
        """Per receiver, how many of its notifications were checked."""
        self.daemon: Daemon | None = None
        self.path = self.tmp / "config.yaml"
        spend = sorted(
            sum((self.sim.charge("2026-11", self.clock.today(), e, item)[0] for item in ITEMS), Decimal(0))
            for e in self.sim.endpoints
        )
        self.thresholds = {"everything": "0", "some": str(spend[len(spend) // 2]), "nothing": "1000000000"}
        self.rules: list[tuple[str, str]] = []
        self.notifiers: list[str] = []
        self.amounts = {"month": "100", "model-a": "1"}
        self.price = "4"

    # -- the world --

    def _write(self) -> None:
        rules = []
        for name, level in self.rules:
            rule = dict(RULES[name])
            if "signal" in rule:
                rule["threshold"] = self.thresholds[level]
            rules.append(rule)
        notifiers = [
            {"name": name, "type": "webhook", "url": f"{self.receivers[name].url}/{name}/{self.generation[name]}"}
            for name in self.notifiers
        ]
        document = {
            "billing": billing_section(self.sim, self.server, history_months=0),
            "prices": [
                {"model": m, "prompt_per_million": self.price, "completion_per_million": "16"}
                for m in sorted({e.model for e in self.sim.endpoints})
            ],
            "budgets": [
                {"name": "month", "amount": self.amounts["month"]},
                {"name": "model-a", "amount": self.amounts["model-a"], "period": "day", "where": {"model": "model-a"}},
            ],
            "alerts": {"rules": rules, "notifiers": notifiers, "repeat_interval": "1000h"},
            "state": {"path": str(self.tmp / "state.db")},
        }
        self.path.write_text(yaml.safe_dump(document))

    def _receiver(self, name: str) -> Receiver:
        if name not in self.receivers:
            self.receivers[name] = Receiver()
            self.generation[name] = 0
        return self.receivers[name]

    def _deliver(self) -> None:
        """Deliver what is due, then check each notification that arrived against the alert state:
        nothing evaluates in between (the test thread alone does), so it is the state they met."""
        assert self.daemon is not None
        self.daemon.deliver()
        states = {a.key: a.state for a in self.daemon.sources.engine.current()}
        for name, receiver in self.receivers.items():
            told: dict[tuple[str, str], set[str]] = {}
            for record in receiver.received[self.checked.get(name, 0) :]:
                for alert in record["body"]["alerts"]:
                    now = "firing" if states.get(alert["fingerprint"]) == "firing" else "resolved"
                    if alert["status"] != now:
                        self.mismatches.append(f"{record['path']}: {alert['status']} for an alert {now} now")
                    labels = json.dumps(sorted(alert["labels"].items()))
                    told.setdefault((record["path"], labels), set()).add(alert["status"])
            # An alert (as receivers know it: by its labels) resolved and fired again at once has not
            # changed: its rule was taken for another (the rules' order once did that).
            self.mismatches += [
                f"{path}: {labels} resolved and fired at once" for (path, labels), s in told.items() if len(s) > 1
            ]
            self.checked[name] = len(receiver.received)

    def _start(self) -> None:
        self.daemon = Daemon(load(self.path), config_path=self.path, clock=self.clock, listen="127.0.0.1:0")

    def _stop(self) -> None:
        if self.daemon is not None:
            self.daemon.sources.close()
            self.daemon.state.close()
            self.daemon.server.server_close()
            self.daemon = None

    @initialize(names=st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True))
    def begin(self, names: list[str]) -> None:
        for name in names:
            self._receiver(name)
        self.notifiers = names
        self.rules = [("warning", "everything"), ("critical", "some"), ("month", "some")]
        self._write()
        self._start()

    def teardown(self) -> None:
        self._stop()
        self.server.stop()
        for receiver in self.receivers.values():
            receiver.stop()
        self.directory.cleanup()

    # -- steps --

    @rule(
        down=DOWN,
        chosen=st.lists(
            st.tuples(st.sampled_from(sorted(RULES)), st.sampled_from(LEVELS)), max_size=5, unique_by=lambda r: r[0]
        ),
    )
    def change_rules(self, down: frozenset[str], chosen: list[tuple[str, str]]) -> None:
        """Rules added, removed, reordered, re-thresholded: one reload."""
        self.rules = chosen
        self._reload(down)

    @rule(down=DOWN, permutation=st.randoms(use_true_random=False))
    def reorder_rules(self, down: frozenset[str], permutation: random.Random) -> None:
        permutation.shuffle(self.rules)
        self._reload(down)

    @rule(down=DOWN, name=st.sampled_from(NAMES))
    def add_or_remove_notifier(self, down: frozenset[str], name: str) -> None:
        if name in self.notifiers:
            self.notifiers = [n for n in self.notifiers if n != name]
        else:
            self._receiver(name)
            self.generation[name] += 1  # a notifier added again is a new one (its queue was dropped)
            self.notifiers = [*self.notifiers, name]
        self._reload(down)

    @precondition(lambda self: bool(self.notifiers))
    @rule(down=DOWN, data=st.data())
    def rename_notifier(self, down: frozenset[str], data: st.DataObject) -> None:
        old = data.draw(st.sampled_from(self.notifiers))
        new = data.draw(st.sampled_from([n for n in NAMES if n not in self.notifiers] or [old]))
        if new == old:
            return
        self._receiver(new)
        self.generation[new] += 1
        self.notifiers = [new if n == old else n for n in self.notifiers]
        self._reload(down)

    @rule(down=DOWN, budget=st.sampled_from(["month", "model-a"]), amount=st.sampled_from(["0.01", "1", "100", "1e5"]))
    def change_budget(self, down: frozenset[str], budget: str, amount: str) -> None:
        self.amounts[budget] = amount
        self._reload(down)

    @rule(down=DOWN, price=st.sampled_from(["0.4", "4", "400"]))
    def change_prices(self, down: frozenset[str], price: str) -> None:
        self.price = price
        self._reload(down)

    @rule(down=DOWN, data=st.data(), factor=st.sampled_from(["0", "0.5", "3"]))
    def revise_bill(self, down: frozenset[str], data: st.DataObject, factor: str) -> None:
        endpoint = data.draw(st.sampled_from(self.sim.endpoints))
        item = data.draw(st.sampled_from(ITEMS))
        amount = self.sim.charge("2026-11", self.clock.today(), endpoint, item)[0]
        self.sim.revise_bill(self.clock.today(), endpoint.endpoint_id, item, amount * Decimal(factor))
        self.evaluate(down)

    @rule(down=DOWN)
    def restart(self, down: frozenset[str]) -> None:
        self._stop()
        self._start()
        self.evaluate(down)

    @rule(down=DOWN)
    def evaluate(self, down: frozenset[str]) -> None:
        """Time passes (retries fall due), receivers fail or recover, the sources refresh, the
        rules are evaluated and every notifier delivers what is due."""
        assert self.daemon is not None
        for name in NAMES:
            self._receiver(name).refuse = 10**9 if name in down else 0
        self.frozen.advance(DUE)
        self.daemon.refresh("bills")
        self.daemon.refresh("usage")
        self.daemon.alert_cycle()
        self._deliver()
        self._every_firing_alert_reached_every_notifier_that_is_up()

    def _reload(self, down: frozenset[str]) -> None:
        """The config file rewritten and reloaded, then evaluated (as the daemon does after a reload)."""
        assert self.daemon is not None
        self._write()
        assert self.daemon.reload()
        self.evaluate(down)

    # -- what must hold --

    @invariant()
    def every_notification_told_the_state_of_its_moment(self) -> None:
        assert self.mismatches == []

    @invariant()
    def no_receiver_gets_one_state_change_twice(self) -> None:
        for receiver in self.receivers.values():
            told: dict[tuple[str, str], tuple[str, str]] = {}
            for record in receiver.received:
                for alert in record["body"]["alerts"]:
                    change = (alert["status"], alert["startsAt"])
                    key = (record["path"], alert["fingerprint"])
                    assert told.get(key) != change, f"{key} told {change} twice"
                    told[key] = change

    @invariant()
    def nothing_waits_for_a_notifier_that_is_gone(self) -> None:
        if self.daemon is not None:
            assert set(self.daemon.dispatcher.pending()) <= set(self.notifiers)

    def _every_firing_alert_reached_every_notifier_that_is_up(self) -> None:
        """Once everything due was delivered: an alert that fires now was last told as firing, since
        it started, to each notifier whose receiver is up (and nothing waits for those)."""
        assert self.daemon is not None
        firing = [a for a in self.daemon.sources.engine.current() if a.state == "firing"]
        for name in self.notifiers:
            receiver = self.receivers[name]
            if receiver.refuse:
                continue
            assert not self.daemon.dispatcher.pending().get(name), f"{name} is up, but notifications wait for it"
            path = f"/{name}/{self.generation[name]}"
            last: dict[str, tuple[str, float | str]] = {}
            for record in receiver.received:
                if record["path"] == path:
                    for alert in record["body"]["alerts"]:
                        last[alert["fingerprint"]] = (alert["status"], alert["startsAt"])
            for alert in firing:
                status, _ = last.get(alert.key, ("never", ""))
                assert status == "firing", f"{alert.labels} fires but {path} was last told {status}"


Pipeline.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_the_alert_pipeline_under_random_config_changes = Pipeline.TestCase
