"""The estimate counter under a price change: the daemon reloads (on the simulator in process,
tests/daemon_fakes.py) and restarts on its state file (end to end, against the simulator over HTTP),
and the counter keeps what it counted at the prices of the time."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml

from exporter.app.daemon import Daemon
from exporter.config.load import load
from exporter.core.clock import Clock, FrozenClock
from exporter.sim import Simulator, SimulatorServer
from exporter.sim.model import MILLION, Fault
from tests.conftest import billing_section
from tests.daemon_fakes import fake_billing_section, metrics, unit_daemon
from tests.helpers import Series, named, scrape

COUNTER = "inference_usage_estimated_payable_amount_total"
CREATED = "inference_usage_estimated_payable_amount_created"
Key = tuple[str, str]


def prices(prompt: str, completion: str) -> list[dict[str, str]]:
    return [
        {"model": m, "prompt_per_million": prompt, "completion_per_million": completion} for m in ("model-a", "model-b")
    ]


DEAR, CHEAP, CHEAPER = prices("4", "16"), prices("0.4", "1.6"), prices("0.1", "0.2")


def write(path: Path, sim: Simulator, server: SimulatorServer | None, table: list[dict[str, str]]) -> None:
    """Without `server`: for a daemon on the simulator in process."""
    billing = billing_section(sim, server, history_months=0) if server else fake_billing_section(sim, history_months=0)
    path.write_text(
        yaml.safe_dump(
            {
                "billing": billing,
                "prices": table,
                "state": {"path": str(path.parent / "state.db")},
            }
        )
    )


def start(path: Path, clock: Clock) -> Daemon:
    daemon = Daemon(load(path), config_path=path, clock=clock, listen="127.0.0.1:0")
    daemon.start(schedule=False)
    return daemon


def priced(records: Iterable[dict[str, Any]], table: list[dict[str, str]]) -> dict[Key, Decimal]:
    """The records' tokens × `table`, by hand, per (endpoint, model)."""
    price = {p["model"]: p for p in table}
    amounts: dict[Key, Decimal] = {}
    for r in records:
        p = price[r["model"]]
        amount = (
            r["promptTokens"] * Decimal(p["prompt_per_million"])
            + r["completionTokens"] * Decimal(p["completion_per_million"])
        ) / MILLION
        key = (r["endpoint"], r["model"])
        amounts[key] = amounts.get(key, Decimal(0)) + amount
    return amounts


def added(*parts: dict[Key, Decimal]) -> dict[Key, Decimal]:
    total: dict[Key, Decimal] = {}
    for part in parts:
        for key, amount in part.items():
            total[key] = total.get(key, Decimal(0)) + amount
    return total


def by_key(series: Series, name: str) -> dict[Key, float]:
    return {(dict(labels)["endpoint_id"], dict(labels)["model"]): v for labels, v in named(series, name).items()}


def assert_counted(series: Series, expected: dict[Key, Decimal]) -> None:
    got = by_key(series, COUNTER)
    assert got.keys() == expected.keys()
    for key, amount in expected.items():
        assert got[key] == pytest.approx(float(amount), rel=1e-12), key


def test_a_price_cut_by_reload_keeps_what_the_counter_counted_and_prices_only_later_records_anew(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    path = tmp_path / "config.yaml"
    sim.add_usage(600)
    write(path, sim, None, DEAR)
    daemon = unit_daemon(load(path), sim, clock, config_path=path)
    try:
        assert daemon.refresh("usage")
        before = metrics(daemon)
        counted_dear = list(sim.usage_records(clock.today()))
        assert_counted(before, priced(counted_dear, DEAR))

        write(path, sim, None, CHEAP)
        assert daemon.reload()
        after = metrics(daemon)
        assert by_key(after, COUNTER) == by_key(before, COUNTER)  # nothing counted again, nothing went down
        assert by_key(after, CREATED) == by_key(before, CREATED)

        sim.add_usage(300)
        frozen.advance(dt.timedelta(minutes=5))
        assert daemon.refresh("usage")
        later = metrics(daemon)
        ids = {r["requestId"] for r in counted_dear}
        counted_cheap = [r for r in sim.usage_records(clock.today()) if r["requestId"] not in ids]
        assert len(counted_cheap) == 300
        assert_counted(later, added(priced(counted_dear, DEAR), priced(counted_cheap, CHEAP)))
        assert by_key(later, CREATED) == by_key(before, CREATED)
    finally:
        daemon.stop()


def test_a_restart_resumes_the_counter_where_it_stood_whatever_the_prices_are_now(
    sim: Simulator, server: SimulatorServer, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    """End to end: usage over HTTP, the counter scraped."""
    path = tmp_path / "config.yaml"
    sim.add_usage(500)
    write(path, sim, server, DEAR)
    daemon = start(path, clock)
    try:
        assert daemon.refresh("usage")
        first = list(sim.usage_records(clock.today()))
        write(path, sim, server, CHEAP)
        assert daemon.reload()
        sim.add_usage(200)
        frozen.advance(dt.timedelta(minutes=5))
        assert daemon.refresh("usage")
        stood = scrape(daemon.server.url)
    finally:
        daemon.stop()
    ids = {r["requestId"] for r in first}
    second = [r for r in sim.usage_records(clock.today()) if r["requestId"] not in ids]
    assert_counted(stood, added(priced(first, DEAR), priced(second, CHEAP)))

    write(path, sim, server, CHEAPER)  # and the config changed again while it was down
    frozen.advance(dt.timedelta(minutes=5))
    daemon = start(path, clock)
    try:
        assert daemon.refresh("usage")
        resumed = scrape(daemon.server.url)
        assert by_key(resumed, COUNTER) == by_key(stood, COUNTER)
        assert by_key(resumed, CREATED) == by_key(stood, CREATED)

        sim.add_usage(100)
        frozen.advance(dt.timedelta(minutes=5))
        assert daemon.refresh("usage")
        ids |= {r["requestId"] for r in second}
        third = [r for r in sim.usage_records(clock.today()) if r["requestId"] not in ids]
        assert_counted(
            scrape(daemon.server.url), added(priced(first, DEAR), priced(second, CHEAP), priced(third, CHEAPER))
        )
    finally:
        daemon.stop()


def test_a_price_taken_out_keeps_its_models_counter_as_it_stood_and_the_estimate_alerts_firing(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    """A reload takes model-b's price out: its counter disappeared, and an `estimated_spend` rule
    read the account's estimate without it (its alerts resolved; the price put back, they fired
    again). It stands as it was; model-b's later records are priced by the price it gets next."""
    path = tmp_path / "config.yaml"
    rules = [{"alert": "EstimateHigh", "signal": "estimated_spend", "by": ["endpoint_id"], "threshold": "0.000001"}]

    def config(table: list[dict[str, str]]) -> None:
        document = {"billing": fake_billing_section(sim, history_months=0), "prices": table,
                    "state": {"path": str(tmp_path / "state.db")}, "alerts": {"rules": rules}}  # fmt: skip
        path.write_text(yaml.safe_dump(document))

    def firing() -> set[str]:
        return {a.key for a in daemon.sources.engine.current() if a.state == "firing"}

    sim.add_usage(600)
    config(DEAR)
    daemon = unit_daemon(load(path), sim, clock, config_path=path)
    try:
        assert daemon.refresh("usage")
        daemon.alert_cycle()
        fired, counted = firing(), by_key(metrics(daemon), COUNTER)
        assert any(model == "model-b" for _, model in counted)
        config([p for p in DEAR if p["model"] == "model-a"])
        assert daemon.reload()
        sim.add_usage(300)
        frozen.advance(dt.timedelta(minutes=5))
        assert daemon.refresh("usage")
        daemon.alert_cycle()
        now = by_key(metrics(daemon), COUNTER)
        assert {k: v for k, v in now.items() if k[1] == "model-b"} == {
            k: v for k, v in counted.items() if k[1] == "model-b"
        }
        assert firing() == fired
        config(DEAR)  # put back: model-b's records since are priced by it
        assert daemon.reload()
        assert_counted(metrics(daemon), priced(sim.usage_records(clock.today()), DEAR))
    finally:
        daemon.stop()


def test_new_prices_that_came_while_a_usage_refresh_ran_price_the_estimates_though_the_next_failed(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    """A reload that re-prices while a usage refresh holds its lock leaves the pricing to a
    refresh; that one failing (the API down), the estimates kept the old prices until the API
    answered again."""
    path = tmp_path / "config.yaml"
    sim.add_usage(600)
    write(path, sim, None, [p for p in DEAR if p["model"] == "model-a"])
    daemon = unit_daemon(load(path), sim, clock, config_path=path)
    try:
        assert daemon.refresh("usage")
        assert {model for _, model in by_key(metrics(daemon), COUNTER)} == {"model-a"}
        lock = daemon._locks["usage"]
        with lock:  # (a usage refresh in flight)
            write(path, sim, None, DEAR)
            assert daemon.reload()
        sim.inject(Fault(kind="status", path="/api/v1/usages", status=400, times=50))
        frozen.advance(dt.timedelta(minutes=5))
        assert not daemon.refresh("usage")
        assert_counted(metrics(daemon), priced(sim.usage_records(clock.today()), DEAR))
    finally:
        daemon.stop()
