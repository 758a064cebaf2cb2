"""The daemon's own code never imports the simulator: it ships for `demo` and `simulate` only."""

from __future__ import annotations

import json
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


CONFIG_ONLY = (
    *("requests", "apscheduler", "exporter.app", "exporter.web"),
    # what the daemon's work needs and a config does not: mail, snapshots, alerts, the state's tables
    *("smtplib", "ssl", "msgspec", "exporter.model.snapshots", "exporter.alerts.alert", "exporter.state.store"),
    # what would take the start-up past three times a bare interpreter's (`bench.startup`): a validation
    # library, logging, dataclasses (with `inspect`), the email package, the database, `tempfile` (the
    # state file's location is tried by hand)
    *("pydantic", "logging", "dataclasses", "inspect", "email", "sqlite3", "exporter.state.file", "tempfile"),
)


@pytest.mark.integration  # runs a process
@pytest.mark.parametrize(
    ("command", "absent"),
    [
        (["--version"], (*CONFIG_ONLY, "yaml", "prometheus_client", "exporter.config", "zoneinfo")),
        (["check", "--config", "config.example.yaml"], CONFIG_ONLY),
        (["rules", "--config", "config.example.yaml"], CONFIG_ONLY),
    ],
    ids=["version", "check", "rules"],
)
def test_quick_commands_import_only_what_they_use(command: list[str], absent: tuple[str, ...]) -> None:
    """`--version` loads no command; `check` and `rules` no HTTP client, scheduler, server, mail
    client, snapshot, logging or database (`bench.startup` measures what that saves)."""
    script = f"""
import json, sys
from exporter.cli import main
try:
    main({command!r})
except SystemExit:
    pass
top = {{".".join(name.split(".")[: 2 if name.startswith("exporter.") else 1]) for name in sys.modules}}
print(json.dumps(sorted(top | set(sys.modules))))
"""
    env = {"BILLING_ACCESS_KEY_ID": "a", "BILLING_SECRET_ACCESS_KEY": "s", "INFERENCE_API_KEY": "k"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60
    )
    loaded = set(json.loads(result.stdout.strip().splitlines()[-1]))
    assert not loaded & set(absent), sorted(loaded & set(absent))
    assert "exporter.cli" in loaded
