"""High availability, run for real: two exporters on one config, each with its own state file,
send to a two-peer prometheus-alertmanager cluster gossiping on loopback. Its webhook receiver
gets each alert once, and still once after one exporter is killed."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import pytest
import requests
import yaml

from exporter.sim import ITEMS, Endpoint, Simulator, SimulatorServer
from tests.conftest import require_binary
from tests.helpers import Receiver, free_port, scrape, value, wait_for
from tests.test_cli import ready, write_config

PEER_TIMEOUT = "5s"
"""How long the second peer holds a notification back before it looks in the gossiped notification
log: the first peer's delivery and its gossip must land within it, on a loaded machine too."""
GRACE = 2.0
"""Once both peers have looked in the notification log for a group, time for a send one of them
decided on to reach the receiver (a local POST: milliseconds)."""
THRESHOLD = Decimal(100)
ENDPOINTS = tuple(Endpoint(f"ep-ha-{n}", "model-a", "proj-ha") for n in range(5))
EARLY, LATE = ENDPOINTS[:4], ENDPOINTS[4]
"""Over the threshold from the start; over it only after one exporter is killed."""
RULE = {
    "alert": "SpendHigh",
    "signal": "spend",
    "window": "today",
    "by": ["endpoint_id"],
    "op": ">",
    "threshold": str(THRESHOLD),
    "labels": {"severity": "page"},
    "annotations": {"summary": "{endpoint_id} spent {value} today"},
}

Labels = frozenset[tuple[str, str]]


@dataclass
class Running:
    """A process the test started (an Alertmanager peer or an exporter), and the file its output goes to."""

    url: str
    popen: subprocess.Popen[bytes]
    log: Path


def start(
    command: list[str], port: int, log: Path, cwd: Path | None = None, env: dict[str, str] | None = None
) -> Running:
    with log.open("wb") as out:
        popen = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env)
    return Running(f"http://127.0.0.1:{port}", popen, log)


def stop(processes: list[Running]) -> None:
    """SIGKILL: nothing here has state worth a clean stop, and a peer stopping cleanly waits 10 s
    for the other to acknowledge its leaving."""
    for each in processes:
        each.popen.kill()
        each.popen.wait()


def show(processes: list[Running]) -> None:
    """The end of each log: pytest shows it when the test failed."""
    for each in processes:
        lines = each.log.read_text(errors="replace").splitlines()
        print(f"--- {each.log.parent.name}/{each.log.name} (last 80 lines)", *lines[-80:], sep="\n")


def bill_today(sim: Simulator, endpoint_id: str, amount: Decimal) -> None:
    """Today's bill of one endpoint: `amount` on its first item, nothing on the others."""
    for n, item in enumerate(ITEMS):
        sim.revise_bill(sim.clock.today(), endpoint_id, item, amount if n == 0 else Decimal(0))


def labels(endpoint: Endpoint) -> Labels:
    return frozenset({"alertname": "SpendHigh", "endpoint_id": endpoint.endpoint_id, "severity": "page"}.items())


@pytest.fixture
def service() -> Iterator[tuple[Simulator, SimulatorServer]]:
    """The simulator on the real clock (the exporters are processes: they sign with the real time)."""
    sim = Simulator(endpoints=ENDPOINTS)
    for endpoint in EARLY:
        bill_today(sim, endpoint.endpoint_id, THRESHOLD * 3)
    bill_today(sim, LATE.endpoint_id, THRESHOLD / 20)
    server = sim.serve()
    yield sim, server
    server.stop()


@pytest.fixture
def cluster(tmp_path: Path, receiver: Receiver) -> Iterator[list[Running]]:
    """Two Alertmanager peers, each told of the other, that group by every label (one group, so one
    notification, per alert), notify a group 1 s after it forms and never again within the test:
    a second notification of a group would be a duplicate, not a reminder."""
    binary = require_binary("prometheus-alertmanager")
    config = tmp_path / "alertmanager.yml"
    route = {
        "receiver": "hook",
        "group_by": ["..."],
        "group_wait": "1s",
        "group_interval": "1h",
        "repeat_interval": "1h",
    }
    hook = {"url": f"{receiver.url}/hook", "send_resolved": True}
    config.write_text(yaml.safe_dump({"route": route, "receivers": [{"name": "hook", "webhook_configs": [hook]}]}))
    gossip = [free_port(), free_port()]
    peers: list[Running] = []
    try:
        for n, (own, other) in enumerate(zip(gossip, reversed(gossip), strict=True)):
            port, home = free_port(), tmp_path / f"alertmanager-{n}"
            home.mkdir()
            command = [
                binary,
                f"--config.file={config}",
                f"--storage.path={home / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                f"--cluster.listen-address=127.0.0.1:{own}",
                f"--cluster.advertise-address=127.0.0.1:{own}",
                f"--cluster.peer=127.0.0.1:{other}",
                f"--cluster.peer-timeout={PEER_TIMEOUT}",
                # Gossip each 100 ms rather than 200: the notification log spreads sooner, and a peer
                # settles (three unchanged looks at its members, 10 gossip intervals apart) in ~5 s.
                "--cluster.gossip-interval=100ms",
                "--log.level=debug",
            ]
            peers.append(start(command, port, home / "alertmanager.log"))
        wait_for(lambda: all(clustered(peer.url) for peer in peers), timeout=30, interval=0.5)
        positions = sorted(metric(peer, "alertmanager_peer_position") for peer in peers)
        assert positions == [0, 1], f"the peers do not see each other as two: positions {positions}"
        yield peers
    finally:
        stop(peers)
        show(peers)
        print("--- the receiver's record", json.dumps(receiver.bodies(), indent=1), sep="\n")


def clustered(url: str) -> bool:
    """The peer sees both members and has settled (it holds notifications back until then)."""
    try:
        status = requests.get(f"{url}/api/v2/status", timeout=2).json()["cluster"]
    except requests.RequestException:
        return False
    return status["status"] == "ready" and len(status["peers"]) == 2


@pytest.fixture
def replicas(
    tmp_path: Path, service: tuple[Simulator, SimulatorServer], cluster: list[Running]
) -> Iterator[list[Running]]:
    """Two exporters on one config file, each run in its own directory: the config's relative
    state path is then a file of its own, as each replica has a volume of its own. Both send to
    both peers, as Prometheus replicas do."""
    sim, server = service
    config = write_config(tmp_path, sim, server, state=Path("exporter.db"), bills_interval="2s")
    document = yaml.safe_load(config.read_text())
    notifier = {"name": "am", "type": "alertmanager", "urls": [peer.url for peer in cluster]}
    document["alerts"] = {"rules": [RULE], "notifiers": [notifier]}
    config.write_text(yaml.safe_dump(document))
    env = {**os.environ, "TEST_BILLING_SECRET": sim.secret_access_key}
    exporters: list[Running] = []
    try:
        for name in ("replica-a", "replica-b"):
            (tmp_path / name).mkdir()
            port = free_port()
            command = [sys.executable, "-m", "exporter.cli", "run", "--config", str(config)]
            command += ["--listen", f"127.0.0.1:{port}"]
            exporters.append(start(command, port, tmp_path / name / "exporter.log", cwd=tmp_path / name, env=env))
        wait_for(lambda: all(ready(exporter.url) for exporter in exporters), timeout=30)
        yield exporters
    finally:
        stop(exporters)
        show(exporters)


def delivered(receiver: Receiver) -> Counter[tuple[str, Labels]]:
    """How often each alert reached the receiver, by its state in the notification."""
    return Counter(
        (alert["status"], frozenset(alert["labels"].items())) for body in receiver.bodies() for alert in body["alerts"]
    )


def arrived(receiver: Receiver, endpoints: tuple[Endpoint, ...]) -> bool:
    return {labels(e) for e in endpoints} <= {alert for _, alert in delivered(receiver)}


def decided(peers: list[Running], groups: int) -> None:
    """Wait until each peer has looked in its notification log for `groups` groups (the first peer
    at once, the second after the peer timeout), then long enough for any send that followed."""
    wait_for(lambda: all(metric(peer, "alertmanager_nflog_queries_total") >= groups for peer in peers), timeout=30)
    time.sleep(GRACE)


def metric(process: Running, name: str, **labels: str) -> float:
    """One sample of the process's /metrics; 0 when it has none."""
    return value(scrape(process.url), name, **labels) or 0.0


def active(peer: Running) -> dict[Labels, dt.datetime]:
    """The peer's active alerts and when each ends unless it is sent again."""
    alerts = requests.get(f"{peer.url}/api/v2/alerts", timeout=5).json()
    return {
        frozenset(a["labels"].items()): dt.datetime.fromisoformat(a["endsAt"])
        for a in alerts
        if a["status"]["state"] == "active"
    }


def test_each_alert_reaches_the_receiver_once_even_when_a_replica_is_killed(
    service: tuple[Simulator, SimulatorServer], cluster: list[Running], replicas: list[Running], receiver: Receiver
) -> None:
    sim, _ = service
    wait_for(lambda: arrived(receiver, EARLY), timeout=30)
    # Both replicas were in play: each sent its alerts to both peers.
    wait_for(lambda: all(metric(r, "inference_alert_notifications_total", notifier="am") >= 2 for r in replicas))
    decided(cluster, groups=len(EARLY))
    assert delivered(receiver) == Counter({("firing", labels(e)): 1 for e in EARLY})

    ends = [active(peer) for peer in cluster]
    killed = replicas[0]
    killed.popen.kill()  # SIGKILL: no goodbye of any kind
    killed.popen.wait()
    bill_today(sim, LATE.endpoint_id, THRESHOLD * 3)
    wait_for(lambda: arrived(receiver, (LATE,)), timeout=30)
    decided(cluster, groups=len(ENDPOINTS))
    assert delivered(receiver) == Counter({("firing", labels(e)): 1 for e in ENDPOINTS})
    attempts = sum(metric(peer, "alertmanager_notifications_total", integration="webhook") for peer in cluster)
    assert attempts == len(ENDPOINTS)  # one peer sent each group; the other held it back

    # The kill resolved nothing: the survivor sent the earlier alerts again with the new one, so
    # each peer holds them active with a later end than the dead replica's last send gave them.
    for peer, before in zip(cluster, ends, strict=True):
        after = active(peer)
        assert set(after) == {labels(e) for e in ENDPOINTS}
        assert all(after[alert] > ends_at for alert, ends_at in before.items())
