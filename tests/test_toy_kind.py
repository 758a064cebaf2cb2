"""Adding a notifier kind is one new module and one registry entry: a toy kind is added that way to a
copy of the package, and the daemon there validates it, hides its secret and delivers through it."""

from __future__ import annotations

import filecmp
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent

TOY = '''"""The `toy` kind: one line of JSON per alert group, with a bearer token."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from exporter.core.typed import SecretStr

from exporter.core.fields import HttpUrl
from exporter.notifiers.kind import Attempt, Delivery, NotifierModel, OutboxKind

if TYPE_CHECKING:
    from exporter.state import OutboxEntry


class ToyNotifier(NotifierModel):
    type: Literal["toy"]
    url: HttpUrl
    token: SecretStr


def send(notifier: ToyNotifier, entry: OutboxEntry, via: Delivery) -> Attempt:
    event = entry.event
    body = {"toy": event["alertname"], "status": event["status"], "alerts": event["total"]}
    return Attempt(via.post(notifier.name, notifier.url, body))


def digest(notifier: ToyNotifier, body: Mapping[str, Any], entry: OutboxEntry, via: Delivery) -> Attempt:
    return Attempt(via.post(notifier.name, notifier.url, {"toy": "digest", "day": body["day"]}))


KIND = OutboxKind(model=ToyNotifier, send=send, digest=digest)
'''

SCRIPT = """
import datetime as dt, json, sys
from zoneinfo import ZoneInfo
from exporter.app.daemon import Daemon
from exporter.config.load import validate
from exporter.core.clock import Clock, FrozenClock
from exporter.sim import Simulator
from tests.helpers import Receiver, named, scrape

clock = Clock(ZoneInfo("Asia/Shanghai"), FrozenClock(dt.datetime(2026, 11, 22, 10, tzinfo=ZoneInfo("Asia/Shanghai"))))
sim = Simulator(clock=clock)
server = sim.serve()
receiver = Receiver()
document = {
    "billing": {"url": server.url, "access_key_id": sim.access_key_id, "secret_access_key": sim.secret_access_key},
    "state": {"path": sys.argv[1]},
    "alerts": {
        "rules": [{"alert": "AnySpend", "signal": "spend", "window": "today", "op": ">", "threshold": "0"}],
        "notifiers": [{"name": "toy", "type": "toy", "url": receiver.url, "token": "toy-token-0451"}],
    },
}
config = validate(document, {})
daemon = Daemon(config, clock=clock, listen="127.0.0.1:0")
daemon.start(schedule=False)
try:
    daemon.refresh("bills")
    daemon.alert_cycle()
    daemon.deliver()
    sent = named(scrape(daemon.server.url), "inference_alert_notifications_total")
    print(json.dumps({
        "secret_masked": "toy-token-0451" in config.secret_values(),
        "received": receiver.bodies(),
        "sent": {dict(labels)["notifier"]: value for labels, value in sent.items()},
    }))
finally:
    daemon.stop()
    receiver.stop()
    server.stop()
"""


def differing(left: Path, right: Path) -> list[str]:
    """The files added, removed or changed between two trees (relative paths)."""
    found: list[str] = []

    def walk(compared: filecmp.dircmp[str], prefix: str) -> None:
        found.extend(prefix + name for name in compared.left_only + compared.right_only + compared.diff_files)
        for name, sub in compared.subdirs.items():
            walk(sub, f"{prefix}{name}/")

    walk(filecmp.dircmp(left, right, ignore=["__pycache__"]), "")
    return sorted(found)


@pytest.mark.integration  # runs a process
def test_a_toy_kind_is_one_module_and_one_registry_entry(tmp_path: Path) -> None:
    copy = tmp_path / "src" / "exporter"
    shutil.copytree(ROOT / "exporter", copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "notifiers" / "toy.py").write_text(TOY)
    registry = copy / "notifiers" / "registry.py"
    text = registry.read_text()
    entry = '    "email": email.KIND,\n'
    assert entry in text
    registry.write_text(
        text.replace(entry, entry + '    "toy": toy.KIND,\n').replace(
            "from exporter.notifiers import alertmanager,", "from exporter.notifiers import toy, alertmanager,"
        )
    )
    assert differing(ROOT / "exporter", copy) == ["notifiers/registry.py", "notifiers/toy.py"]

    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "state.db")],
        capture_output=True, text=True, timeout=90, cwd=tmp_path,
        env={"PYTHONPATH": f"{tmp_path / 'src'}:{ROOT}", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["secret_masked"]
    assert [body["toy"] for body in outcome["received"]] == ["AnySpend"]
    assert outcome["received"][0]["status"] == "firing"
    assert outcome["sent"] == {"toy": 1.0}
