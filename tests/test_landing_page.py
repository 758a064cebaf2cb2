"""The landing page in a real browser (headless Chromium): sources, budgets, probes, firing alerts."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from exporter.clock import Clock
from exporter.config import validate
from exporter.daemon import Daemon
from exporter.sim import Simulator, SimulatorServer
from tests.conftest import billing_section, require_binary

SCREENSHOT_DIR = Path(os.environ.get("SCREENSHOT_DIR", Path(__file__).parent.parent / "test-output"))


def chromium(*args: str, profile: Path) -> subprocess.CompletedProcess[str]:
    binary = require_binary("chromium")
    flags = [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}",
    ]  # fmt: skip
    return subprocess.run([binary, *flags, *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def daemon(sim: Simulator, server: SimulatorServer, clock: Clock, tmp_path: Path) -> Daemon:
    document = {
        "billing": billing_section(sim, server),
        "inference": {"url": server.url, "api_key": sim.api_key},
        "probes": [{"name": "chat-stream", "model": sim.endpoints[0].endpoint_id}],
        "budgets": [{"name": "monthly", "amount": "9000"}],
        "alerts": {
            "rules": [
                {"alert": "MonthlyBudget", "budget": "monthly", "tiers": [0.5, 0.9], "labels": {"severity": "critical"}}
            ]
        },
        "state": {"path": str(tmp_path / "state.db")},
    }
    daemon = Daemon(validate(document, {}), clock=clock, listen="127.0.0.1:0")
    daemon.start(schedule=False)
    for source in ("bills", "usage", "probe:chat-stream"):
        assert daemon.refresh(source)
    yield daemon
    daemon.stop()


def test_landing_page_renders_in_chromium(daemon: Daemon, tmp_path: Path) -> None:
    url = f"{daemon.server.url}/"
    dom = chromium("--dump-dom", url, profile=tmp_path / "profile-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    page = dom.stdout
    expected = (
        "<h2>Sources</h2>",
        '<td>bills</td><td class="ok">ok</td><td>0s ago</td>',
        "<td>monthly</td>",
        "<td>chat-stream</td>",
        '<td class="bad">MonthlyBudget</td>',
        "budget=monthly, severity=critical, tier=0.9",
    )
    for text in expected:
        assert text in page, text
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    shot = SCREENSHOT_DIR / "landing-page.png"
    result = chromium(f"--screenshot={shot}", "--window-size=1200,1100", url, profile=tmp_path / "profile-shot")
    assert result.returncode == 0, result.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"landing page screenshot: {shot}")
