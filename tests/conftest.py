"""Shared fixtures: a frozen billing clock, the simulator on loopback, configs that point at it."""

from __future__ import annotations

import datetime as dt
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from exporter.billing import BillingClient, RetryPolicy
from exporter.config.load import validate
from exporter.config.schema import Config
from exporter.core.clock import Clock, FrozenClock
from exporter.sim import Simulator, SimulatorServer
from exporter.state import StateStore
from tests.fakes import FakeBilling

SHANGHAI = ZoneInfo("Asia/Shanghai")
SERVERS = frozenset({"server", "live", "receiver"})
"""Fixtures that start a server: a test using one (directly or through another) is an integration test."""
STARTS_ITS_OWN = frozenset(
    {"test_ha", "test_post", "test_prometheus_e2e", "test_alertmanager", "test_server", "test_server_limits",
     "test_soak"}
)  # fmt: skip
"""Modules whose tests all start servers, processes or binaries of their own (elsewhere, such a test
is marked `integration` itself)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The `integration` marker on every test that starts a server or a binary; the rest is the unit
    layer (`make test-fast`)."""
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""  # type: ignore[attr-defined]
        if module in STARTS_ITS_OWN or SERVERS & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
        if shares_a_module_fixture(item):  # pytest-xdist (--dist loadgroup): one worker sets it up, once
            item.add_marker(pytest.mark.xdist_group(module))
    # The tests with a timeout over the default (the longest) first: pytest-xdist hands them out before
    # the rest, so that none of them starts late and keeps the other workers waiting at the end.
    items.sort(key=lambda item: -timeout_of(item))


def shares_a_module_fixture(item: pytest.Item) -> bool:
    definitions = getattr(item, "_fixtureinfo", None)
    return definitions is not None and any(
        d.scope in ("module", "package", "class") for ds in definitions.name2fixturedefs.values() for d in ds
    )


def timeout_of(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    return float(marker.args[0]) if marker and marker.args else 0.0


PAGE = 100
"""The usage page size of `small_pages`: small, so that a few hundred records span many pages."""
DATA = Path(__file__).parent / "data"


@pytest.fixture
def frozen() -> FrozenClock:
    """10:00 on 2026-11-22 in Shanghai (02:00 UTC)."""
    return FrozenClock(dt.datetime(2026, 11, 22, 10, 0, tzinfo=SHANGHAI))


@pytest.fixture
def clock(frozen: FrozenClock) -> Clock:
    return Clock(SHANGHAI, frozen)


@pytest.fixture
def sim(clock: Clock) -> Simulator:
    return Simulator(clock=clock)


@pytest.fixture
def server(sim: Simulator) -> Iterator[SimulatorServer]:
    server = sim.serve()
    yield server
    server.stop()


def billing_section(sim: Simulator, server: SimulatorServer, **overrides: object) -> dict[str, object]:
    return {
        "url": server.url,
        "access_key_id": sim.access_key_id,
        "secret_access_key": sim.secret_access_key,
        "timeout": "5s",
    } | overrides


@pytest.fixture
def config(sim: Simulator, server: SimulatorServer) -> Config:
    return validate({"billing": billing_section(sim, server)}, {})


class Sleeps(list[float]):
    """Stands in for time.sleep in a RetryPolicy: records the pauses instead of waiting."""

    def __call__(self, seconds: float) -> None:
        self.append(seconds)


@pytest.fixture
def sleeps() -> Sleeps:
    return Sleeps()


@pytest.fixture
def small_pages(sim: Simulator, server: SimulatorServer, clock: Clock) -> Iterator[BillingClient]:
    """A client reading usage in pages of PAGE, three at a time, retrying without waiting."""
    config = validate({"billing": billing_section(sim, server, page_size=PAGE, concurrency=3)}, {})
    with BillingClient.from_config(config.billing, clock, retry=RetryPolicy(sleep=lambda s: None)) as client:
        yield client


@pytest.fixture
def fake_pages(sim: Simulator) -> FakeBilling:
    """`small_pages` in process: usage in pages of PAGE, read from `sim` without HTTP (the unit layer)."""
    return FakeBilling(sim, page_size=PAGE)


@pytest.fixture
def fake(sim: Simulator) -> FakeBilling:
    """The billing API on `sim` in process, at the configured page size (the unit layer's `client`)."""
    return FakeBilling(sim)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StateStore]:
    store = StateStore(tmp_path / "state.db")
    yield store
    store.close()


@pytest.fixture
def live() -> Iterator[tuple[Simulator, SimulatorServer]]:
    """A simulator on the real clock, for commands run as processes (they sign with the real time)."""
    sim = Simulator()
    server = sim.serve()
    yield sim, server
    server.stop()


@pytest.fixture
def client(config: Config, clock: Clock, sleeps: Sleeps) -> Iterator[BillingClient]:
    with BillingClient.from_config(config.billing, clock, retry=RetryPolicy(sleep=sleeps)) as client:
        yield client


def require_binary(name: str) -> str:
    """The path of a real binary; skipped when absent, unless CI is set (then it must be there)."""
    path = shutil.which(name)
    if path:
        return path
    if os.environ.get("CI"):
        pytest.fail(f"{name} is not installed; CI must install it (make system-deps)")
    pytest.skip(f"{name} is not installed (make test installs it as root; CI requires it)")


@pytest.fixture
def receiver() -> Iterator[object]:
    from tests.helpers import Receiver

    receiver = Receiver()
    yield receiver
    receiver.stop()


from tests.smtp import ca, ca_file, mailbox, start_smtp  # noqa: E402, F401 - fixtures for every test module
