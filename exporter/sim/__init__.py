"""A faithful stand-in for the whole service, on loopback: signed billing API and chat completions.

Used by `demo`, `simulate`, the tests and the benchmarks; the daemon's own code paths (`run`,
`once`, `check`, `rules`) never import it (a test proves it). It is strict where the
specification allows: it verifies every signature (digest, label, parameter order, lifetime,
clock window, nonce reuse, key), rejects camelCase query names, a future `date` and `page_size`
over 500. Data are deterministic functions of a seed, so a test can ask the simulator for its
own totals. Latency, time to first token and faults are injectable.
"""

from exporter.sim.history import SpendModel, Spike
from exporter.sim.model import (
    API_KEYS,
    DEFAULT_ENDPOINTS,
    ITEMS,
    Endpoint,
    Fault,
    SimPrice,
    prices_from_config,
)
from exporter.sim.server import SimulatorServer
from exporter.sim.service import Simulator

__all__ = [
    "API_KEYS",
    "DEFAULT_ENDPOINTS",
    "ITEMS",
    "Endpoint",
    "Fault",
    "SimPrice",
    "Simulator",
    "SimulatorServer",
    "SpendModel",
    "Spike",
    "prices_from_config",
]
