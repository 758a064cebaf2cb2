"""The real prometheus-alertmanager on loopback receives our alerts, then their resolution."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from exporter.alerts.alert import Alert
from exporter.config.load import validate
from exporter.core import post
from exporter.core.clock import Clock, iso
from exporter.delivery import dispatcher as dispatcher_module
from exporter.delivery.dispatcher import Dispatcher
from exporter.notifiers.alertmanager import AlertmanagerNotifier, payload, send
from exporter.sim import ITEMS, Simulator, SimulatorServer
from exporter.state import AlertStore, StateStore
from tests.conftest import SHANGHAI, require_binary
from tests.helpers import Receiver, free_port, serve_binary, wait_for
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
        assert daemon.refresh("usage")
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


def test_a_restart_sends_alertmanager_nothing_before_it_has_judged_the_alerts_again(
    sim: Simulator, server: SimulatorServer, clock: Clock, tmp_path: Path
) -> None:
    """Stopped with an alert firing, which resolves while it is down (another replica may already
    have told Alertmanager so): restarted, it does not send the firing the state file holds, which
    would make the alert active again; its first word is the evaluation's, the alert resolved."""
    receiver = Receiver()  # (standing in for Alertmanager: every POST recorded)
    amounts = today_by_endpoint(sim, clock.today())
    top = max(amounts, key=lambda e: amounts[e])
    threshold = (sorted(amounts.values())[-2] + amounts[top]) / 2
    rule = {"alert": "SpendHigh", "signal": "spend", "by": ["endpoint_id"], "threshold": str(threshold)}
    alerts = {"rules": [rule], "notifiers": [{"name": "am", "type": "alertmanager", "urls": [receiver.url]}]}

    def states() -> list[str] | None:
        """What the last POST said of each alert; None before any."""
        bodies = receiver.bodies("/api/v2/alerts")
        return ["resolved" if a["endsAt"] <= iso(time.time()) else "firing" for a in bodies[-1]] if bodies else None

    try:
        first = make_daemon(sim, server, clock, tmp_path, alerts)
        try:
            assert first.refresh("bills")
            assert first.refresh("usage")
            first.alert_cycle()
            wait_for(lambda: states() == ["firing"])
        finally:
            first.stop()
        for item in ITEMS:  # (resolved while it is down)
            sim.revise_bill(clock.today(), top, item, Decimal("0.01"))
        receiver.received.clear()
        second = make_daemon(sim, server, clock, tmp_path, alerts)  # (its workers started)
        try:
            assert second.refresh("usage")  # (usage first: spend is not judged on it)
            second.alert_cycle()
            time.sleep(1)
            assert receiver.received == []  # (not the firing the state file holds)
            assert second.refresh("bills")
            second.alert_cycle()
            wait_for(lambda: states() == ["resolved"])
        finally:
            second.stop()
    finally:
        receiver.stop()


def test_a_name_that_resolves_to_several_peers_has_the_alerts_posted_to_each(
    sim: Simulator, server: SimulatorServer, clock: Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`urls: [http://am.test:PORT]`, a name that resolves to two peers (a Kubernetes headless
    Service): Alertmanager's peers do not pass alerts to each other, so each gets them, under the
    name it was asked by."""
    port = free_port()
    got: dict[str, list[tuple[str, list]]] = {"127.0.0.1": [], "127.0.0.2": []}

    class Peer(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            got[self.server.server_address[0]].append((self.headers["Host"], body))  # type: ignore[index]
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    servers = [ThreadingHTTPServer((address, port), Peer) for address in got]
    for peer in servers:
        threading.Thread(target=peer.serve_forever, daemon=True).start()

    def resolve(host: str, at: int, type: int = 0) -> list[tuple]:  # noqa: A002 (getaddrinfo's name)
        assert host == "am.test"
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, at)) for address in got]

    peers = post.peers
    monkeypatch.setattr(post, "peers", lambda url, within: peers(url, resolve))
    amounts = today_by_endpoint(sim, clock.today())
    rule = {"alert": "SpendHigh", "signal": "spend", "by": ["endpoint_id"], "threshold": str(min(amounts.values()))}
    alerts = {
        "rules": [rule],
        "notifiers": [
            {"name": "am", "type": "alertmanager", "urls": [f"http://am.test:{port}"], "every_address": True}
        ],
    }
    daemon = make_daemon(sim, server, clock, tmp_path, alerts)
    try:
        assert daemon.refresh("bills")
        assert daemon.refresh("usage")
        daemon.alert_cycle()
        wait_for(lambda: all(got.values()))
        for posted in got.values():
            host, body = posted[0]
            assert host == f"am.test:{port}"
            assert {a["labels"]["alertname"] for a in body} == {"SpendHigh"}
        wait_for(lambda: daemon.dispatcher.sent["am"] == 2)  # (one delivery to each peer)
    finally:
        daemon.stop()
        for peer in servers:
            peer.shutdown()
            peer.server_close()


def test_an_alert_resolved_before_it_fired_by_the_clock_ends_as_it_starts() -> None:
    """The host's clock stepped back between firing and resolving: Alertmanager refuses a POST
    holding an `endsAt` before its `startsAt` (every alert in it): a resolved alert starts as it ended."""
    resolved = Alert(
        "k", "r", {"alertname": "A"}, {}, "resolved", 900.0, "1", 900.0, fired_at=1000.0, resolved_at=950.0
    )
    firing = Alert("j", "r", {"alertname": "B"}, {}, "firing", 900.0, "1", 900.0, fired_at=1000.0)
    body = payload([resolved, firing], 1200.0, "http://exporter:9877")
    assert [(a["startsAt"], a["endsAt"]) for a in body] == [(iso(950.0), iso(950.0)), (iso(1000.0), iso(1440.0))]
    # (resolved: ended in the past, never active again until the start the clock had written)


def test_alerts_never_judged_on_fresh_figures_are_sent_as_held_after_a_while(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Restarted while the API (or the state file) fails, so the alerts are never judged on fresh
    figures: what the state file holds is sent once JUDGED_WAIT has passed, before Alertmanager's
    copies from before the restart end (4 minutes after their last send)."""
    receiver = Receiver()
    monkeypatch.setattr(dispatcher_module, "JUDGED_WAIT", 0.5)
    config = validate(
        {"billing": {"url": "http://127.0.0.1:9", "access_key_id": "a", "secret_access_key": "s"},
         "alerts": {"notifiers": [{"name": "am", "type": "alertmanager", "urls": [receiver.url]}]}},
        {},
    )  # fmt: skip
    held = Alert("k", "r", {"alertname": "A"}, {}, "firing", 900.0, "1", 900.0, 1000.0)
    dispatcher = Dispatcher(
        config.alerts.notifiers, AlertStore(StateStore(":memory:")), clock, lambda name: [held], "http://x",
        judged_first=True,
    )  # fmt: skip
    try:
        dispatcher.start()  # (its worker's turn comes every minute: it is woken when JUDGED_WAIT has passed)
        dispatcher.resend_now()
        assert receiver.received == []  # (not judged yet)
        body = wait_for(lambda: receiver.bodies("/api/v2/alerts"), timeout=10)[0]
        assert [a["labels"] for a in body] == [{"alertname": "A"}]
    finally:
        dispatcher.close()
        receiver.stop()


class Posts:
    """The dispatcher, as `send` sees it: each POST recorded (its URL, log target and address)."""

    external_url = "http://exporter:9877"
    deadline = 10.0

    def __init__(self) -> None:
        self.made: list[tuple[str, str, str | None]] = []

    def post(self, notifier: str, url: str, body: object, target: str = "", address: str | None = None) -> None:
        self.made.append((url, target, address))


def test_only_every_address_sends_to_each_address_and_each_url_is_resolved_on_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without `every_address` no name is resolved here (a name balancing over addresses is one
    Alertmanager); with it, a URL whose name takes long to resolve holds back no other URL's POST."""
    firing = Alert("j", "r", {"alertname": "B"}, {}, "firing", 900.0, "1", 900.0, 1000.0)
    slow = threading.Event()

    def resolving(url: str, within: float) -> list[str | None]:
        if "slow" in url:
            slow.wait(10)
        return ["10.0.0.1", "10.0.0.2"] if "peers" in url else [None]

    monkeypatch.setattr(post, "peers", resolving)
    urls = ["http://slow.test:9093", "http://peers.test:9093"]

    def notifier(every_address: bool) -> AlertmanagerNotifier:
        return AlertmanagerNotifier(name="am", type="alertmanager", urls=urls, every_address=every_address)

    plain = Posts()
    send(notifier(False), [firing], 1000.0, plain)  # type: ignore[arg-type]
    assert sorted(plain.made) == sorted((f"{u}/api/v2/alerts", f"urls[{n}]", None) for n, u in enumerate(urls))
    each = Posts()
    sending = threading.Thread(target=send, args=(notifier(True), [firing], 1000.0, each))
    sending.start()
    try:
        wait_for(lambda: len(each.made) == 2, timeout=5)  # (the peers' POSTs, while slow.test resolves)
        assert sorted(each.made) == [
            (f"{urls[1]}/api/v2/alerts", f"urls[1] at 10.0.0.{n}", f"10.0.0.{n}") for n in (1, 2)
        ]
    finally:
        slow.set()
        sending.join(10)
    assert (f"{urls[0]}/api/v2/alerts", "urls[0]", None) in each.made
