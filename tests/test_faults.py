"""The fault matrix: every fault the simulator can inject, against every source.

Whatever the API or the network does, the daemon keeps serving the last good figures with the
source's success gauge at 0, counters never go down, the error is logged once per change of
state (not once per retry), and the first refresh after the fault clears is right again.

The faults that change what a listing says, and the chat API's answers to the probe, run on the
daemon with the simulator in process (tests/daemon_fakes.py, tests/fakes.py); those of the wire
(the billing API's statuses, which its client retries, timeouts, resets, bodies that are not JSON)
against the simulator over HTTP.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest

from exporter.app import account
from exporter.app.daemon import Daemon
from exporter.billing import RetryPolicy
from exporter.config.load import validate
from exporter.core.clock import Clock, FrozenClock
from exporter.sim import Fault, Simulator, SimulatorServer
from exporter.sim.chat_api import WIRE_FAULTS
from tests.conftest import SHANGHAI, billing_section
from tests.daemon_fakes import NOWHERE, fake_billing_section, metrics, unit_daemon
from tests.fakes import chat_runner
from tests.helpers import Series, logged, named, scrape, value

FAST = RetryPolicy(attempts=3, backoff=0.001, sleep=lambda s: None)
BILLING_PATHS = {"bills": "/api/v1/bills/details", "usage": "/api/v1/usages/details"}
CHAT = "/v1/chat/completions"
PROBE = "probe:chat"

FAULTS = {
    "http_500": Fault("status", status=500),
    "http_502": Fault("status", status=502),
    "http_503": Fault("status", status=503),
    "http_429_retry_after": Fault("status", status=429, retry_after=1),
    "timeout": Fault("delay", seconds=0.8),
    "reset_mid_body": Fault("reset"),
    "malformed_json": Fault("malformed"),
    "nonzero_code": Fault("code"),
    "total_mismatch": Fault("total_mismatch"),
    "non_numeric_amount": Fault("bad_amount"),
}
PROBE_FAULTS = (
    "http_500",
    "http_502",
    "http_503",
    "http_429_retry_after",
    "timeout",
    "reset_mid_body",
    "malformed_json",
)
CONTENT = ("total_mismatch", "non_numeric_amount")
"""The faults that change what a listing says (the in-process fake applies them as the server does)."""
CHAT_WIRE = tuple(fault for fault in PROBE_FAULTS if FAULTS[fault].kind in WIRE_FAULTS)
"""The probe's faults that need a connection; the chat API gives the others in process."""
CASES = [(fault, source) for fault in FAULTS if fault not in CONTENT for source in ("bills", "usage")] + [
    (fault, PROBE) for fault in CHAT_WIRE
]
UNIT_CASES = [(fault, source) for fault in CONTENT for source in ("bills", "usage")] + [
    (fault, PROBE) for fault in PROBE_FAULTS if fault not in CHAT_WIRE
]


def document(sim: Simulator, billing: dict[str, object], inference: str, tmp_path: Path) -> dict[str, object]:
    return {
        "billing": billing,
        "inference": {"url": inference, "api_key": sim.api_key},
        "probes": [{"name": "chat", "model": sim.endpoints[0].endpoint_id, "timeout": "400ms"}],
        "state": {"path": str(tmp_path / "state.db")},
    }


@pytest.fixture
def daemon(sim: Simulator, server: SimulatorServer, clock: Clock, tmp_path: Path) -> Iterator[Daemon]:
    sim.add_usage(1234)
    billing = billing_section(sim, server, timeout="400ms", page_size=200)
    daemon = Daemon(validate(document(sim, billing, server.url, tmp_path), {}), clock=clock, listen="127.0.0.1:0",
                    retry=FAST)  # fmt: skip
    daemon.start(schedule=False)
    yield daemon
    daemon.stop(grace=5)


@pytest.fixture
def unit(sim: Simulator, clock: Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Daemon]:
    """`daemon` in the unit layer: its billing API and its probe's chat answered by `sim` in process, no server."""
    monkeypatch.setattr(account, "ProbeRunner", partial(chat_runner, sim))
    sim.add_usage(1234)
    billing = fake_billing_section(sim, timeout="400ms", page_size=200)
    daemon = unit_daemon(validate(document(sim, billing, NOWHERE, tmp_path), {}), sim, clock)
    yield daemon
    daemon.stop(grace=5)


def figures(series: Series) -> dict[str, object]:
    """The figures a fault must not disturb."""
    return {
        name: named(series, name)
        for name in (
            "inference_bill_month_to_date_payable_amount",
            "inference_bill_endpoint_daily_payable_amount",
            "inference_usage_requests_total",
            "inference_usage_prompt_tokens_total",
        )
    }


def refresh_all(daemon: Daemon) -> None:
    for source in ("bills", "usage", PROBE):
        assert daemon.refresh(source), source


@pytest.mark.parametrize(("fault_name", "source"), CASES, ids=[f"{f}-{s}" for f, s in CASES])
def test_fault(daemon: Daemon, sim: Simulator, fault_name: str, source: str, caplog: pytest.LogCaptureFixture) -> None:
    url = daemon.server.url
    check_fault(daemon, sim, fault_name, source, caplog, lambda: scrape(url))


@pytest.mark.parametrize(("fault_name", "source"), UNIT_CASES, ids=[f"{f}-{s}" for f, s in UNIT_CASES])
def test_fault_in_process(
    unit: Daemon, sim: Simulator, fault_name: str, source: str, caplog: pytest.LogCaptureFixture
) -> None:
    check_fault(unit, sim, fault_name, source, caplog, lambda: metrics(unit))


def check_fault(
    daemon: Daemon, sim: Simulator, fault_name: str, source: str, caplog: pytest.LogCaptureFixture,
    exposition: Callable[[], Series],
) -> None:  # fmt: skip
    refresh_all(daemon)
    before = exposition()
    fault = FAULTS[fault_name]
    path = CHAT if source == PROBE else BILLING_PATHS[source]
    sim.inject(Fault(fault.kind, path, times=10_000, status=fault.status, retry_after=fault.retry_after,
                     seconds=fault.seconds))  # fmt: skip
    caplog.set_level(logging.DEBUG)
    sim.add_usage(50)  # new records the failing source cannot see yet

    for _ in range(3):
        refreshed = daemon.refresh(source)
        assert refreshed == (source == PROBE)  # a probe run that finds the endpoint failing is still a run
    during = exposition()
    assert figures(during) == figures(before)  # the last good figures, unchanged
    if source == PROBE:
        assert value(during, "inference_probe_success", probe="chat", endpoint_id=sim.endpoints[0].endpoint_id,
                     scenario="chat") == 0  # fmt: skip
        errors = [r for r in logged(caplog.records, "probe failed") if r.levelno >= logging.WARNING]
    else:
        assert value(during, "inference_exporter_refresh_success", source=source) == 0
        stamp = "inference_exporter_last_refresh_success_timestamp_seconds"
        assert value(during, stamp, source=source) == value(before, stamp, source=source)
        errors = [
            r for r in caplog.records if r.levelno >= logging.ERROR and getattr(r, "fields", {}).get("source") == source
        ]
    assert len(errors) == 1, [r.getMessage() for r in errors]

    sim.clear_faults()
    assert daemon.refresh(source)
    after = exposition()
    if source == PROBE:
        assert value(after, "inference_probe_success", probe="chat", endpoint_id=sim.endpoints[0].endpoint_id,
                     scenario="chat") == 1  # fmt: skip
        return
    assert value(after, "inference_exporter_refresh_success", source=source) == 1
    for labels, count in named(before, "inference_usage_requests_total").items():
        assert named(after, "inference_usage_requests_total")[labels] >= count  # never down within a day
    if source == "bills":
        assert value(after, "inference_bill_month_to_date_payable_amount", period="2026-11") == float(
            sim.bill_totals("2026-11")["total"]
        )
    else:
        truth = sim.usage_totals()
        got = {
            (dict(k)["endpoint_id"], dict(k)["model"]): v
            for k, v in named(after, "inference_usage_requests_total").items()
        }
        assert got == {key: sums["requests"] for key, sums in truth.items()}


def test_clock_skew_is_corrected_and_exposed(sim: Simulator, server: SimulatorServer, tmp_path: Path) -> None:
    skewed = Clock(SHANGHAI, lambda: sim.clock.now() + dt.timedelta(minutes=-9))
    document = {"billing": billing_section(sim, server), "state": {"path": str(tmp_path / "state.db")}}
    daemon = Daemon(validate(document, {}), clock=skewed, listen="127.0.0.1:0", retry=FAST)
    daemon.start(schedule=False)
    try:
        assert daemon.refresh("bills")
        assert daemon.refresh("usage")
        series = scrape(daemon.server.url)
        assert value(series, "inference_exporter_clock_skew_seconds") == 540
        assert value(series, "inference_exporter_api_requests_total", api="bills", code="401") == 1
    finally:
        daemon.stop()


def test_an_api_clock_behind_ours_is_no_refusal_at_midnight(
    sim: Simulator, server: SimulatorServer, frozen: FrozenClock, tmp_path: Path
) -> None:
    """The API's clock 30 s behind the exporter's: the rollover just after the exporter's midnight
    reads the API's day still (its `Date` says which), never asks for a day it refuses as in the
    future, and the first refresh after the API's midnight shows the day before in full."""
    ahead = Clock(SHANGHAI, lambda: frozen() + dt.timedelta(seconds=30))
    document = {"billing": billing_section(sim, server), "state": {"path": str(tmp_path / "state.db")}}
    daemon = Daemon(validate(document, {}), clock=ahead, listen="127.0.0.1:0", retry=FAST)
    daemon.start(schedule=False)
    before = dt.date(2026, 11, 22)
    try:
        frozen.set(dt.datetime(2026, 11, 22, 23, 50, tzinfo=SHANGHAI))
        sim.add_usage(300, before)
        assert daemon.refresh("usage")
        frozen.set(dt.datetime(2026, 11, 22, 23, 59, 35, tzinfo=SHANGHAI))  # the exporter's 00:00:05
        sim.add_usage(20, before)
        assert daemon.refresh("usage")
        frozen.set(dt.datetime(2026, 11, 23, 0, 1, tzinfo=SHANGHAI))
        sim.add_usage(7, before + dt.timedelta(days=1))
        assert daemon.refresh("usage")
        series = scrape(daemon.server.url)
        assert value(series, "inference_exporter_clock_skew_seconds") == -30
        assert value(series, "inference_exporter_refresh_success", source="usage") == 1
        assert not {
            k: v for k, v in named(series, "inference_exporter_api_requests_total").items() if dict(k)["code"] == "400"
        }
        today = named(series, "inference_usage_requests_total")
        assert sum(today.values()) == 7
        previous = named(series, "inference_usage_previous_day_requests")
        assert sum(previous.values()) == 320 == sum(sums["requests"] for sums in sim.usage_totals(before).values())
    finally:
        daemon.stop()


def test_a_start_just_after_midnight_with_the_api_s_clock_behind_never_counts_yesterday_as_today(
    sim: Simulator, server: SimulatorServer, frozen: FrozenClock, tmp_path: Path
) -> None:
    """Started at the exporter's 00:00:10, the API's clock 30 s behind and not yet known to be: the
    new day is begun by our clock and refused until the API's midnight; once the skew is known, the
    day is not taken back to the one before (whose records would then be counted as today's)."""
    ahead = Clock(SHANGHAI, lambda: frozen() + dt.timedelta(seconds=30))
    before, after = dt.date(2026, 11, 22), dt.date(2026, 11, 23)
    sim.add_usage(300, before)
    frozen.set(dt.datetime(2026, 11, 22, 23, 59, 40, tzinfo=SHANGHAI))
    document = {"billing": billing_section(sim, server), "state": {"path": str(tmp_path / "state.db")}}
    daemon = Daemon(validate(document, {}), clock=ahead, listen="127.0.0.1:0", retry=FAST)
    daemon.start(schedule=False)
    try:
        assert not daemon.refresh("usage")  # (the 23rd, in the API's future)
        frozen.set(dt.datetime(2026, 11, 22, 23, 59, 50, tzinfo=SHANGHAI))
        assert not daemon.refresh("usage")  # (still: the skew now known takes the day no further back)
        for moment, count in (
            (dt.datetime(2026, 11, 23, 0, 1, tzinfo=SHANGHAI), 7),
            (dt.datetime(2026, 11, 23, 9, 0, tzinfo=SHANGHAI), 5),
        ):
            frozen.set(moment)
            sim.add_usage(count, after)
            assert daemon.refresh("usage")
            series = scrape(daemon.server.url)
            today = sum(sums["requests"] for sums in sim.usage_totals(after).values())
            assert sum(named(series, "inference_usage_requests_total").values()) == today
            previous = named(series, "inference_usage_previous_day_requests")
            assert sum(previous.values()) in (0, 300)  # (not read in full before the start: not shown)
    finally:
        daemon.stop()
