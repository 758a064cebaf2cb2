"""The demo: the simulator with a scenario worth looking at (a spend anomaly, a reconciliation gap,
usage that keeps growing, a chat API that fails now and then), and the demo config pointed at it.

The simulator is imported only when a demo starts: the daemon's own commands never load it.
"""

from __future__ import annotations

import datetime as dt
import random
import tempfile
import threading
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING

from exporter.config.load import load
from exporter.config.schema import Config

if TYPE_CHECKING:
    from exporter.sim import Simulator, SimulatorServer, SpendModel

DEMO_CONFIG = Path(__file__).parent.parent / "demo.yaml"


def demo_traffic(sim: Simulator, stop: threading.Event) -> None:
    """Keep today's usage growing, so the counters move while you watch; now and then a chat
    request fails, so the probe failure panels have something to show."""
    from exporter.sim import Fault

    rng = random.Random(7)
    tick = 0
    while not stop.wait(2.0):
        tick += 1
        sim.add_usage(rng.randint(5, 60))
        if tick % 8 == 0:
            sim.inject(Fault("status", "/v1/chat/completions", status=rng.choice((429, 502, 503))))


def demo_reconciled_days(today: dt.date) -> list[dt.date]:
    """Three settled days the demo has usage records for (its bills computed from them); on the
    middle one the bill charges 5% more completion tokens than the records count."""
    return [today - dt.timedelta(days=back) for back in (3, 4, 5)]


def demo_history(today: dt.date) -> SpendModel:
    """Four months of past bills with a weekly rhythm, and yesterday one endpoint spending three
    times its usual: what the demo's SpendAnomaly rule fires on."""
    from exporter.sim import DEFAULT_ENDPOINTS, SpendModel, Spike

    yesterday = today - dt.timedelta(days=1)
    return SpendModel(
        start=today - dt.timedelta(days=120), spikes=[Spike(yesterday, DEFAULT_ENDPOINTS[1].endpoint_id, 3.0)]
    )


SIMULATED_DAYS = 35
"""The past days `simulate` serves usage records for: this month's and, in its first days, the
last month's grace days, which the exporter reconciles."""


def simulated(sim: Simulator, records: int) -> Simulator:
    """`sim` as `simulate` serves it: `records` usage records today, a quarter as many on each of
    the past SIMULATED_DAYS, and the days with records billed from them at the demo's prices, as an
    account's are: its settled days reconcile, where bills of days with no records at all made every
    item disagree with its usage at the first reconciliation (the example config's alert fired)."""
    from exporter.sim import prices_from_config

    placeholders = dict.fromkeys(("SIM_ACCESS_KEY_ID", "SIM_SECRET_ACCESS_KEY", "SIM_API_KEY"), "placeholder")
    demo = load(DEMO_CONFIG, placeholders | {"SIM_URL": "http://127.0.0.1:1", "STATE_DIR": "."})
    sim.set_prices(prices_from_config(demo.prices))
    today = sim.clock.today()
    sim.add_usage(records)
    for back in range(1, SIMULATED_DAYS + 1):
        sim.add_usage(max(records // 4, 1), today - dt.timedelta(days=back))
    return sim


def demo_scenario() -> tuple[Simulator, SimulatorServer, tempfile.TemporaryDirectory[str], Config]:
    """The simulator with the demo's data, serving on 127.0.0.1; a state directory removed when the
    demo ends; the demo config pointed at both."""
    from exporter.sim import Simulator, prices_from_config

    sim = Simulator(time_to_first_token=0.05, chunk_delay=0.01)
    sim.spend = demo_history(sim.clock.today())
    sim.add_usage(20_000)
    settled = demo_reconciled_days(sim.clock.today())
    for day in settled:  # settled days with usage records, billed from them ...
        sim.add_usage(2_000, day)
    sim.distort_bill(settled[1], Decimal("1.05"), item="ITEM_COMPLETION_TOKEN")  # ... one of them off
    sim_server = sim.serve("127.0.0.1", 0)
    workdir = tempfile.TemporaryDirectory(prefix="inference-cost-exporter-demo-")
    config = load(
        DEMO_CONFIG,
        {
            "SIM_URL": sim_server.url,
            "SIM_ACCESS_KEY_ID": sim.access_key_id,
            "SIM_SECRET_ACCESS_KEY": sim.secret_access_key,
            "SIM_API_KEY": sim.api_key,
            "STATE_DIR": workdir.name,
        },
    )
    sim.set_prices(prices_from_config(config.prices))  # it bills the demo's usage at the demo config's prices
    return sim, sim_server, workdir, config
