"""The alerts' block of /metrics is rendered once per change of the alerts, not at every scrape:
byte for byte what rendering the collector whole gives, in both formats, plain and gzipped, through
evaluations that change states, a reload that removes a rule and alerts resolving; and never stale,
even when an evaluation ends while a scrape renders. On the simulator in process
(tests/daemon_fakes.py), on a frozen clock."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from exporter.alerts.alert import Alert
from exporter.alerts.engine import Engine
from exporter.app.daemon import Daemon
from exporter.app.sources import source_key
from exporter.config.load import validate
from exporter.core.clock import Clock, FrozenClock
from exporter.metrics.alerts import AlertsCollector
from exporter.metrics.assembled import AssembledExposition
from exporter.metrics.exposition import OPENMETRICS_ACCEPT, Exposition
from exporter.sim import ITEMS, Simulator, SpendModel
from tests.daemon_fakes import NOWHERE, fake_billing_section, unit_daemon
from tests.helpers import named, parse
from tests.test_spend_anomaly import RULE as ANOMALY_RULE
from tests.test_spend_anomaly import YESTERDAY

TODAY = dt.date(2026, 11, 22)
VARIANTS = [(accept, gzipped) for accept in ("", OPENMETRICS_ACCEPT) for gzipped in (False, True)]
"""Both formats, plain and gzipped."""


class Whole(Collector):
    """A collector rendered whole at every scrape: how the alerts' block was rendered before it was
    kept between scrapes."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector

    def collect(self) -> Iterator[Metric]:
        yield from self.collector.collect()


@pytest.fixture
def walks(monkeypatch: pytest.MonkeyPatch) -> list[Engine]:
    """Each call of `Engine.current` (a walk over every alert held), by any engine."""
    calls: list[Engine] = []
    current = Engine.current

    def counted(engine: Engine, notifier: str | None = None) -> list[Alert]:
        calls.append(engine)
        return current(engine, notifier)

    monkeypatch.setattr(Engine, "current", counted)
    return calls


@pytest.fixture
def spiked(sim: Simulator) -> Simulator:
    """Months of history with a spike on the day judged (an anomaly fires and the judged days show)."""
    sim.spend = SpendModel(start=dt.date(2026, 7, 1))
    sim.add_spike(YESTERDAY, sim.endpoints[1].endpoint_id, 2.5)
    return sim


def spent_today(sim: Simulator) -> dict[str, Decimal]:
    return {
        e.endpoint_id: sum((sim.charge(f"{TODAY:%Y-%m}", TODAY, e, item)[0] for item in ITEMS), Decimal(0))
        for e in sim.endpoints
    }


def spend_rule(alert: str, threshold: Decimal, hold: str) -> dict[str, object]:
    return {"alert": alert, "signal": "spend", "window": "today", "by": ["endpoint_id"], "op": ">",
            "threshold": str(threshold), "for": hold, "labels": {"severity": "warning"}}  # fmt: skip


def started(sim: Simulator, clock: Clock, tmp_path: Path, rules: list[dict[str, object]], several: bool) -> Daemon:
    """A unit-layer daemon with these rules, its config in a file (for reloads)."""
    billing = fake_billing_section(sim)
    document: dict[str, object] = {
        "state": {"path": str(tmp_path / "state.db")},
        "alerts": {"rules": rules, "notifiers": [{"name": "hook", "type": "webhook", "url": f"{NOWHERE}/hook"}]},
    }
    if several:
        document["accounts"] = [{"name": "a", "billing": billing}, {"name": "b", "billing": billing}]
    else:
        document["billing"] = billing
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(document))
    return unit_daemon(validate(document, {}), sim, clock, config_path=path)


def reconfigured(daemon: Daemon, change: Callable[[dict[str, Any]], None]) -> None:
    """The daemon's config file changed by `change`, and reloaded."""
    assert daemon.config_path is not None
    path = Path(daemon.config_path)
    document = yaml.safe_load(path.read_text())
    change(document)
    path.write_text(yaml.safe_dump(document))
    assert daemon.reload()


def refreshed(daemon: Daemon, *sources: str) -> None:
    """These sources of every account refreshed, then the rules evaluated."""
    for source in sources:
        for account in daemon.sources.accounts:
            assert daemon.refresh(source_key(account, source))
    daemon.alert_cycle()


def states(text: str) -> dict[str, set[str]]:
    """Each alert name in `inference_alerts`, with the states its alerts are in."""
    found: dict[str, set[str]] = {}
    for labels in named(parse(text), "inference_alerts"):
        found.setdefault(dict(labels)["alertname"], set()).add(dict(labels)["alertstate"])
    return found


def alerted(text: str, alertname: str) -> set[str]:
    """The endpoints with an alert of `alertname` in `inference_alerts`."""
    return {dict(labels)["endpoint_id"] for labels in named(parse(text), "inference_alerts")
            if dict(labels)["alertname"] == alertname}  # fmt: skip


def alerts_collector(daemon: Daemon) -> AlertsCollector:
    exposition = daemon.sources.exposition
    if isinstance(exposition, Exposition):
        collectors = list(exposition.collectors)
    else:
        collectors = [collector for kind in exposition.kinds for _, collector in kind]
    (found,) = [collector for collector in collectors if isinstance(collector, AlertsCollector)]
    return found


class Scrapes:
    """Scrapes of the daemon's alerts collector alone, as its exposition has it (one account's
    `Exposition`, several accounts' `AssembledExposition`; the rest of /metrics moves between two
    scrapes on its own), each checked against the collector rendered whole."""

    def __init__(self, daemon: Daemon, walks: list[Engine]) -> None:
        self.daemon, self.walks = daemon, walks
        self._built: tuple[AlertsCollector, Exposition | AssembledExposition] | None = None

    def exposition(self, collector: Collector) -> Exposition | AssembledExposition:
        if isinstance(self.daemon.sources.exposition, Exposition):
            return Exposition([collector])
        return AssembledExposition([[("", collector)]])

    def __call__(self) -> str:
        """The block in each format, twice, each time what the collector rendered whole gives; the
        second scrape does not walk the alerts. Returns the plain text."""
        collector = alerts_collector(self.daemon)
        if self._built is None or self._built[0] is not collector:  # a reload built another
            self._built = (collector, self.exposition(collector))
        exposition = self._built[1]
        for accept, gzipped in VARIANTS:
            served = exposition.render(accept, gzipped)[0]
            self.walks.clear()
            assert exposition.render(accept, gzipped)[0] == served
            assert self.walks == []
            assert served == self.exposition(Whole(collector)).render(accept, gzipped)[0]
        return exposition.render()[0].decode()


@pytest.mark.parametrize("several", [False, True], ids=["one account", "several accounts"])
def test_the_kept_block_is_byte_for_byte_a_fresh_one_through_evaluations_a_reload_and_resolves(
    spiked: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path, walks: list[Engine], several: bool
) -> None:
    low = min(spent_today(spiked).values()) / 2  # every endpoint is over it
    rules = [spend_rule("Held", low, "10m"), spend_rule("Quick", low, "0s"), ANOMALY_RULE]
    daemon = started(spiked, clock, tmp_path, rules, several)
    try:
        scrape = Scrapes(daemon, walks)
        assert states(scrape()) == {}
        refreshed(daemon, "history", "bills")
        text = scrape()
        assert states(text) == {"Held": {"pending"}, "Quick": {"firing"}, "SpendAnomaly": {"firing"}}
        assert named(parse(text), "inference_spend_anomaly_impact_amount")

        spiked.revise_bill(YESTERDAY, spiked.endpoints[1].endpoint_id, ITEMS[0], Decimal(500))
        refreshed(daemon, "history", "bills")  # the same alerts, a larger impact judged
        impact = [line for line in scrape().splitlines() if line.startswith("inference_spend_anomaly_impact")]
        assert impact != [line for line in text.splitlines() if line.startswith("inference_spend_anomaly_impact")]

        frozen.advance(dt.timedelta(minutes=10))
        daemon.alert_cycle()  # Held's alerts fire
        assert states(scrape()) == {"Held": {"firing"}, "Quick": {"firing"}, "SpendAnomaly": {"firing"}}

        reconfigured(daemon, lambda document: document["alerts"]["rules"].pop(1))  # Quick is removed
        assert "Quick" in states(scrape())  # still held until the new engine evaluates
        daemon.alert_cycle()
        assert states(scrape()) == {"Held": {"firing"}, "SpendAnomaly": {"firing"}}

        calm = spiked.endpoints[0].endpoint_id
        for item in ITEMS:
            spiked.revise_bill(TODAY, calm, item, Decimal("0.0001"))
        held = alerted(scrape(), "Held")
        refreshed(daemon, "bills")  # its Held alert resolves
        assert calm in held
        assert alerted(scrape(), "Held") == held - {calm}
    finally:
        daemon.stop(grace=5)


@pytest.mark.parametrize("several", [False, True], ids=["one account", "several accounts"])
def test_a_scrape_with_unchanged_alerts_does_not_walk_them(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path, walks: list[Engine], several: bool
) -> None:
    low = min(spent_today(sim).values()) / 2
    daemon = started(sim, clock, tmp_path, [spend_rule("Quick", low, "0s")], several)
    try:
        refreshed(daemon, "bills")
        exposition = daemon.sources.exposition
        for accept, gzipped in VARIANTS:
            exposition.render(accept, gzipped)
        frozen.advance(dt.timedelta(minutes=1))
        top = max(spent_today(sim).items(), key=lambda pair: pair[1])[0]
        sim.revise_bill(TODAY, top, ITEMS[0], Decimal(1000))  # a new reading of an alert still firing
        walks.clear()
        refreshed(daemon, "bills")
        daemon.alert_cycle()
        assert walks == []  # nothing new to render after the evaluations either
        daemon.deliver()  # the webhook is nowhere: a failed attempt
        walks.clear()
        for accept, gzipped in VARIANTS:
            exposition.render(accept, gzipped)
        assert walks == []
        assert 'inference_alert_notifications_failed_total{notifier="hook"} 1.0' in exposition.render()[0].decode()
    finally:
        daemon.stop(grace=5)


@pytest.mark.parametrize("several", [False, True], ids=["one account", "several accounts"])
def test_an_evaluation_that_changes_an_alerts_state_shows_at_the_next_scrape_rendered_by_the_worker(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path, walks: list[Engine], several: bool
) -> None:
    """The alert worker renders the alerts' series after an evaluation that changed them, in both
    formats: the scrape after it finds them rendered (at 50,000 alerts it does not wait half a
    second for them)."""
    amounts = sorted(spent_today(sim).values())
    between = (amounts[-2] + amounts[-1]) / 2  # the top endpoint alone is over it
    rules = [spend_rule("Top", between, "10m"), spend_rule("Quick", amounts[0] / 2, "0s")]
    daemon = started(sim, clock, tmp_path, rules, several)
    try:
        scrape = Scrapes(daemon, walks)
        for evaluation, top in ((lambda: refreshed(daemon, "bills"), "pending"), (daemon.alert_cycle, "firing")):
            evaluation()  # Top's alert pending; ten minutes later, firing
            shown = {"Top": {top}, "Quick": {"firing"}}
            walks.clear()
            for accept in ("", OPENMETRICS_ACCEPT):
                assert states(daemon.sources.exposition.render(accept)[0].decode()) == shown
            assert walks == []
            assert states(scrape()) == shown
            frozen.advance(dt.timedelta(minutes=10))
    finally:
        daemon.stop(grace=5)


def test_an_evaluation_ending_while_a_scrape_renders_shows_at_the_next_scrape(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    amounts = sorted(spent_today(sim).values())
    between = (amounts[-2] + amounts[-1]) / 2
    daemon = started(sim, clock, tmp_path, [spend_rule("Top", between, "10m")], several=False)
    try:
        exposition = daemon.sources.exposition

        def shown() -> dict[str, set[str]]:
            return states(exposition.render()[0].decode())

        assert shown() == {}
        assert daemon.refresh("bills")
        daemon.sources.engine.evaluate()  # pending (the engine's alone: the worker would render the block)
        frozen.advance(dt.timedelta(minutes=10))
        current, walks = Engine.current, []

        def evaluated_meanwhile(engine: Engine, notifier: str | None = None) -> list[Alert]:
            """The alerts, then an evaluation that fires the pending one before the scrape renders them."""
            walks.append(engine)
            alerts = current(engine, notifier)
            if len(walks) == 1:
                engine.evaluate()
            return alerts

        monkeypatch.setattr(Engine, "current", evaluated_meanwhile)
        assert shown() == {"Top": {"pending"}}  # rendered from what it read before the evaluation
        assert shown() == {"Top": {"firing"}}
        assert len(walks) == 2
        assert shown() == {"Top": {"firing"}}
        assert len(walks) == 2  # kept from then on
    finally:
        daemon.stop(grace=5)


def test_an_accounts_refresh_does_not_wait_for_an_evaluation_holding_the_main_state_file(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    """With several accounts, a refresh writes its own account's file and renders its own series:
    the alerts' (whose notification figures read the main state file) are the alert worker's to
    render, so a long evaluation, which holds that file, holds up no account's refresh."""
    daemon = started(sim, clock, tmp_path, [spend_rule("Quick", Decimal("0.01"), "0s")], several=True)
    held, done, released = threading.Event(), threading.Event(), threading.Event()

    def evaluation() -> None:
        with daemon.state.transaction():
            held.set()
            done.wait(10)
        released.set()

    holder = threading.Thread(target=evaluation)
    try:
        refreshed(daemon, "bills")
        frozen.advance(dt.timedelta(minutes=1))
        holder.start()
        assert held.wait(30)
        assert daemon.refresh(source_key("a", "bills"))
        assert not released.is_set()  # (the refresh returned while the file was still held)
    finally:
        done.set()
        holder.join()
        daemon.stop(grace=5)


@pytest.mark.parametrize("several", [False, True], ids=["one account", "several accounts"])
def test_a_delivery_ending_for_a_notifier_a_reload_removed_breaks_no_scrape(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path, several: bool
) -> None:
    """Its outcome is counted nowhere (its series went with the reload), and /metrics, the alert
    worker and the refreshes go on as before."""
    daemon = started(sim, clock, tmp_path, [spend_rule("Quick", Decimal("0.01"), "0s")], several)
    try:
        refreshed(daemon, "bills")
        daemon.dispatcher.outcome("gone", None)  # as a worker whose notifier was removed meanwhile
        daemon.dispatcher.outcome("gone", "HTTP 500")
        refreshed(daemon, "bills")
        for accept in ("", OPENMETRICS_ACCEPT):
            text = daemon.sources.exposition.render(accept)[0].decode()
            assert states(text) == {"Quick": {"firing"}}
            assert 'notifier="hook"' in text
            assert 'notifier="gone"' not in text
    finally:
        daemon.stop(grace=5)


@pytest.mark.parametrize("several", [False, True], ids=["one account", "several accounts"])
def test_a_reload_renders_the_new_expositions_blocks_not_the_next_scrape(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, several: bool
) -> None:
    """The blocks a reload's exposition serves are rendered by the reload; the alerts' by the
    evaluation after it."""
    from exporter.metrics.collectors import BillsCollector

    daemon = started(sim, clock, tmp_path, [spend_rule("Quick", Decimal("0.01"), "0s")], several)
    try:
        refreshed(daemon, "bills")
        daemon.sources.exposition.render()
        reconfigured(daemon, lambda document: document["alerts"]["rules"].append(spend_rule("More", Decimal(1), "0s")))
        daemon.alert_cycle()
        rendered = []
        collect = BillsCollector.collect
        monkeypatch.setattr(BillsCollector, "collect", lambda self: rendered.append(self) or collect(self))
        both = {"Quick": {"firing"}, "More": {"firing"}}
        for accept in ("", OPENMETRICS_ACCEPT):
            assert states(daemon.sources.exposition.render(accept)[0].decode()) == both
        assert rendered == []
    finally:
        daemon.stop(grace=5)


def test_a_reload_whose_rendering_crashes_is_done_all_the_same(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rendering after a reload is a cache: its crash is logged, and the reload completes (its
    rules in force, the old sources closed), as the next scrape renders what is needed."""
    daemon = started(sim, clock, tmp_path, [spend_rule("Quick", Decimal("0.01"), "0s")], several=False)
    try:
        refreshed(daemon, "bills")

        def crash(*args: object, **kwargs: object) -> None:
            raise RuntimeError("a bug")

        monkeypatch.setattr(Exposition, "prepare", crash)
        reconfigured(daemon, lambda document: document["alerts"]["rules"].append(spend_rule("More", Decimal(1), "0s")))
        daemon.alert_cycle()
        assert states(daemon.sources.exposition.render()[0].decode()) == {"Quick": {"firing"}, "More": {"firing"}}
    finally:
        daemon.stop(grace=5)


def test_a_scrape_reads_the_outbox_once(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The notification figures (the outbox's pending count, a query of the state file) are read
    once a scrape, even when they changed since the last and their part is rendered again."""
    from exporter.delivery.dispatcher import Dispatcher

    daemon = started(sim, clock, tmp_path, [spend_rule("Quick", Decimal("0.01"), "0s")], several=False)
    try:
        refreshed(daemon, "bills")  # an alert fires: a notification waits
        reads = []
        pending = Dispatcher.pending
        monkeypatch.setattr(Dispatcher, "pending", lambda self: reads.append(self) or pending(self))
        text = daemon.sources.exposition.render()[0].decode()
        assert 'inference_alert_notifications_pending{notifier="hook"} 1.0' in text
        assert len(reads) == 1
    finally:
        daemon.stop(grace=5)
