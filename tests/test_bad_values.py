"""Values the API may send that no store or exposition can hold: refused by name, never fatal.

A bad value fails the refresh of its source with a `RecordError` naming the record and the field;
the daemon keeps serving the last good figures on /metrics (and says the source is failing); the
next good answer is taken as usual. `once` exits 2 with one line.

Each value is served in process to the source that reads it (the simulator's ledger through
tests/fakes.py: the unit layer); over HTTP, the daemon facing one bad value of each source,
`once` as a process, and promtool reading a raw CR.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests

from exporter.app.daemon import Daemon
from exporter.billing import BillingError, RetryPolicy
from exporter.config.load import ConfigError, validate
from exporter.core.clock import Clock
from exporter.sim import Fault, Simulator, SimulatorServer
from exporter.sources.bills import BillsSource
from exporter.sources.usage import UsageSync
from exporter.state import StateStore
from tests.conftest import billing_section, require_binary
from tests.fakes import FakeBilling
from tests.helpers import named, scrape, value
from tests.test_cli import run, write_config

BILLS = "/api/v1/bills/details"
USAGES = "/api/v1/usages/details"
BAD = [
    ("bills", "instanceId", "ep\ud800x", "field 'instanceId' is not valid Unicode text"),
    ("usage", "endpoint", "ep\ud800x", "field 'endpoint' is not valid Unicode text"),
    ("usage", "promptTokens", 2**70, "field 'promptTokens' is out of range"),
    ("bills", "payableAmount", "1e30", "field 'payableAmount' is out of range"),
    ("bills", "payableAmount", "9e999999", "field 'payableAmount' is out of range"),
    ("bills", "payableAmount", "1e999999999", "field 'payableAmount' is out of range"),  # (past Decimal's own)
    ("bills", "payableAmount", "1e400", "field 'payableAmount' is out of range"),
    ("bills", "payableAmount", "1_000.5", "field 'payableAmount' is not a decimal: '1_000.5'"),
    ("bills", "payableAmount", "١٢٣", "field 'payableAmount' is not a decimal"),
    ("bills", "usageValue", "Infinity", "field 'usageValue' is not a decimal"),
]
OVER_HTTP = [BAD[2], BAD[4]]
"""One of each source for the daemon: how it keeps serving does not depend on the value."""


@pytest.mark.parametrize(("source", "field", "bad", "message"), BAD, ids=[f"{s}-{f}-{b!r}" for s, f, b, _ in BAD])
def test_a_bad_value_fails_its_source_by_name_and_the_next_good_answer_is_taken(
    sim: Simulator,
    fake_pages: FakeBilling,
    clock: Clock,
    store: StateStore,
    source: str,
    field: str,
    bad: object,
    message: str,
) -> None:
    sim.add_usage(300)
    refreshers: dict[str, Callable[[], object]] = {
        "bills": BillsSource(fake_pages, clock, 3).refresh,
        "usage": UsageSync(fake_pages, clock, store, per_api_key=False).refresh,
    }
    refresh = refreshers[source]
    before = refresh()
    sim.inject(Fault("bad_value", BILLS if source == "bills" else USAGES, field=field, value=bad))
    with pytest.raises(BillingError) as refused:  # what the daemon records as the source's error
        refresh()
    assert message in str(refused.value)
    assert re.search(r"record \d+: field", str(refused.value))
    assert refresh() == before  # the next good answer is taken: the same figures, nothing counted twice


@pytest.mark.parametrize("amount", ["1_000", "١٢٣", "NaN", "1e400", "Infinity"])
def test_config_amounts_are_decimal_text_too(amount: str) -> None:
    billing = {"url": "http://127.0.0.1:1", "access_key_id": "AK", "secret_access_key": "s"}
    with pytest.raises(ConfigError, match=r"budgets\[0\]\.amount \(budget 'b'\): (not a number|out of range)"):
        validate({"billing": billing, "budgets": [{"name": "b", "amount": amount}]}, {})


# --- over HTTP --------------------------------------------------------------------------------


@pytest.fixture
def daemon(sim: Simulator, server: SimulatorServer, clock: Clock, tmp_path: Path) -> Iterator[Daemon]:
    sim.add_usage(300)
    document = {
        "billing": billing_section(sim, server, page_size=100),
        "state": {"path": str(tmp_path / "state.db")},
        "alerts": {"rules": [{"alert": "Spend", "signal": "spend", "window": "month", "threshold": "1"}]},
    }
    daemon = Daemon(validate(document, {}), clock=clock, listen="127.0.0.1:0", retry=RetryPolicy(attempts=1))
    daemon.start(schedule=False)
    yield daemon
    daemon.stop()


@pytest.mark.parametrize(
    ("source", "field", "bad", "message"), OVER_HTTP, ids=[f"{s}-{f}-{b!r}" for s, f, b, _ in OVER_HTTP]
)
def test_the_daemon_serves_the_last_good_figures_while_a_value_is_bad(
    daemon: Daemon, sim: Simulator, source: str, field: str, bad: object, message: str
) -> None:
    assert daemon.refresh("bills")
    assert daemon.refresh("usage")
    daemon.alert_cycle()
    before = scrape(daemon.server.url)
    sim.inject(Fault("bad_value", BILLS if source == "bills" else USAGES, field=field, value=bad))
    assert not daemon.refresh(source)
    health = daemon.latest.health[source]
    assert message in health.error
    assert re.search(r"record \d+: field", health.error)
    daemon.alert_cycle()  # evaluation goes on with the last good bills
    response = requests.get(f"{daemon.server.url}/metrics", timeout=5)
    assert response.status_code == 200
    during = scrape(daemon.server.url)
    assert value(during, "inference_exporter_refresh_success", source=source) == 0
    for name in ("inference_bill_item_daily_payable_amount", "inference_usage_requests_total"):
        assert named(during, name) == named(before, name)
    assert daemon.refresh(source)  # the next good answer is taken
    assert value(scrape(daemon.server.url), "inference_exporter_refresh_success", source=source) == 1


@pytest.mark.integration  # starts its own server
def test_once_exits_2_with_one_line_naming_the_field(tmp_path: Path) -> None:
    sim = Simulator()
    server = sim.serve()
    try:
        sim.inject(Fault("bad_value", BILLS, field="payableAmount", value="9e999999"))
        result = run("once", "--config", str(write_config(tmp_path, sim, server)),
                     env={"TEST_BILLING_SECRET": sim.secret_access_key})  # fmt: skip
    finally:
        server.stop()
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "field 'payableAmount' is out of range" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_carriage_return_in_a_label_passes_promtool(daemon: Daemon, sim: Simulator) -> None:
    """The text format has no escape for CR (promtool refuses `\\r`); a raw CR is valid in a label."""
    promtool = require_binary("promtool")
    sim.inject(Fault("bad_value", BILLS, field="instanceId", value="ep\rone", times=2))
    assert daemon.refresh("bills")
    exposition = requests.get(f"{daemon.server.url}/metrics", timeout=5).content
    assert b'endpoint_id="ep\rone"' in exposition
    checked = subprocess.run([promtool, "check", "metrics"], input=exposition, capture_output=True, timeout=60)
    assert checked.returncode == 0, checked.stderr
