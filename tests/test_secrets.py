"""No secret in anything the process writes: logs, metrics, /api/v1/alerts, pages, `once`, `check`."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import yaml

from exporter.sim import Simulator, SimulatorServer
from tests.helpers import Receiver, wait_for
from tests.test_cli import ready, run, spawn

SECRETS = {
    "TEST_BILLING_SECRET": "S3cr3t-billing-9f8e7d6c",
    "TEST_INFERENCE_KEY": "sk-live-4b3a2918abcdef",
    "TEST_SCRAPE_PASSWORD": "scrape-pw-77aa88bb",
    "TEST_SLACK_TOKEN": "xoxb-slacktoken-5566",
    "TEST_PD_KEY": "pd-routing-key-3344",
}


@pytest.fixture
def live() -> Iterator[tuple[Simulator, SimulatorServer]]:
    sim = Simulator(secret_access_key=SECRETS["TEST_BILLING_SECRET"], api_key=SECRETS["TEST_INFERENCE_KEY"])
    sim.add_usage(500)
    server = sim.serve()
    yield sim, server
    server.stop()


def test_no_secret_reaches_any_output(
    tmp_path: Path, live: tuple[Simulator, SimulatorServer], receiver: Receiver
) -> None:
    sim, server = live
    receiver.refuse = 2  # failed deliveries get logged too
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "billing": {"url": server.url, "access_key_id": sim.access_key_id,
                            "secret_access_key": "${TEST_BILLING_SECRET}", "bills_interval": "1s",
                            "usage_interval": "1s"},
                "inference": {"url": server.url, "api_key": "${TEST_INFERENCE_KEY}"},
                "probes": [{"name": "p", "model": sim.endpoints[0].endpoint_id, "interval": "1s"},
                           {"name": "bad", "model": "ep-missing", "interval": "1s"}],
                "alerts": {
                    "rules": [{"alert": "AnySpend", "signal": "spend", "by": ["endpoint_id"], "threshold": 0}],
                    "notifiers": [
                        {"name": "chat", "type": "slack", "url": f"{receiver.url}/services/${{TEST_SLACK_TOKEN}}"},
                        {"name": "pd", "type": "pagerduty", "routing_key": "${TEST_PD_KEY}",
                         "url": f"{receiver.url}/pd"},
                    ],
                },
                "server": {"basic_auth": {"username": "prom", "password": "${TEST_SCRAPE_PASSWORD}"}},
                "state": {"path": str(tmp_path / "state.db")},
                "log": {"level": "debug"},
            }
        )
    )  # fmt: skip
    auth = ("prom", SECRETS["TEST_SCRAPE_PASSWORD"])
    process, url = spawn("run", "--config", str(config), env=SECRETS)
    written: list[str] = []
    try:
        wait_for(lambda: ready(url), timeout=30)
        wait_for(lambda: len(receiver.bodies()) >= 2, timeout=60)  # one message per notifier, after the refusals
        for path in ("/metrics", "/api/v1/alerts", "/", "/readyz", "/healthz"):
            written.append(requests.get(f"{url}{path}", auth=auth, timeout=5).text)
        written.append(requests.get(f"{url}/metrics", auth=("prom", "wrong"), timeout=5).text)
    finally:
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=15)
    written += [stdout, stderr]
    once = run("once", "--config", str(config), env=SECRETS)
    check = run("check", "--config", str(config), env=SECRETS)
    written += [once.stdout, once.stderr, check.stdout, check.stderr]

    assert 'msg="probe failed" probe=bad reason=http_404' in stderr
    assert "notification failed" in stderr
    assert "inference_probe_success" in once.stdout
    everything = "\n".join(written)
    for name, secret in SECRETS.items():
        assert secret not in everything, f"{name} leaked"
