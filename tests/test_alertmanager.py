"""The real prometheus-alertmanager on loopback receives our alerts, then their resolution."""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest
import requests

from exporter.core.clock import Clock
from exporter.sim import ITEMS, Simulator, SimulatorServer
from tests.conftest import SHANGHAI, require_binary
from tests.helpers import free_port, serve_binary, wait_for
from tests.test_alerts import make_daemon, today_by_endpoint


@pytest.fixture
def clock() -> Clock:
    """Real time: Alertmanager judges `endsAt` by its own clock."""
    return Clock(SHANGHAI)


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[str]:
    binary = require_binary("prometheus-alertmanager")
    config = tmp_path / "alertmanager.yml"
    config.write_text("route:\n  receiver: blackhole\nreceivers:\n  - name: blackhole\n")
    port = free_port()
    yield from serve_binary(
        [binary, f"--config.file={config}", f"--storage.path={tmp_path / 'am-data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
        port,
    )  # fmt: skip


def am_alerts(url: str) -> list[dict]:
    return [
        a for a in requests.get(f"{url}/api/v2/alerts", timeout=5).json() if a["labels"]["alertname"] == "SpendHigh"
    ]


def test_alertmanager_shows_our_alert_then_its_resolution(
    sim: Simulator, server: SimulatorServer, clock: Clock, tmp_path: Path, alertmanager: str
) -> None:
    amounts = today_by_endpoint(sim, clock.today())  # real time: today is whatever day the test runs on
    top = max(amounts, key=lambda e: amounts[e])
    threshold = (sorted(amounts.values())[-2] + amounts[top]) / 2
    rule = {"alert": "SpendHigh", "signal": "spend", "by": ["endpoint_id"], "threshold": str(threshold),
            "labels": {"severity": "page"}, "annotations": {"summary": "{endpoint_id} at {value}"}}  # fmt: skip
    alerts = {"rules": [rule], "notifiers": [{"name": "am", "type": "alertmanager", "urls": [alertmanager]}]}
    daemon = make_daemon(sim, server, clock, tmp_path, alerts)
    try:
        assert daemon.refresh("bills")
        daemon.alert_cycle()
        shown = wait_for(lambda: am_alerts(alertmanager))
        assert len(shown) == 1
        assert shown[0]["labels"] == {"alertname": "SpendHigh", "severity": "page", "endpoint_id": top}
        assert shown[0]["status"]["state"] == "active"
        assert shown[0]["annotations"]["summary"] == f"{top} at {amounts[top].quantize(Decimal('0.01'))}"
        assert shown[0]["generatorURL"] == f"{daemon.server.url}/api/v1/alerts"
        wait_for(lambda: daemon.dispatcher.sent["am"])  # counted once its answer is read
        assert daemon.dispatcher.sent["am"] == 1

        for item in ITEMS:
            sim.revise_bill(clock.today(), top, item, Decimal("0.01"))
        assert daemon.refresh("bills")
        daemon.alert_cycle()
        wait_for(lambda: not am_alerts(alertmanager))  # resolved: endsAt is now, so it is no longer active
    finally:
        daemon.stop()
