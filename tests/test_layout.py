"""The daemon's own code never imports the simulator: it ships for `demo` and `simulate` only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


@pytest.mark.integration  # runs a process
def test_run_once_check_and_rules_never_import_the_simulator() -> None:
    script = """
import importlib, pathlib, sys
for path in sorted(pathlib.Path("exporter").rglob("*.py")):
    name = ".".join(path.with_suffix("").parts).removesuffix(".__init__")
    if not name.startswith("exporter.sim"):
        importlib.import_module(name)
from exporter.cli import main
for command in ("check", "rules"):
    try:
        main([command, "--config", "config.example.yaml"])
    except SystemExit:
        pass
loaded = sorted(name for name in sys.modules if name.startswith("exporter.sim"))
print(loaded)
"""
    env = {"BILLING_ACCESS_KEY_ID": "a", "BILLING_SECRET_ACCESS_KEY": "s", "INFERENCE_API_KEY": "k",
           "SLACK_WEBHOOK_URL": "https://hooks.example/x", "PAGERDUTY_ROUTING_KEY": "r"}  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
