"""Slow clients cannot exhaust the HTTP server: header and idle deadlines, the connection cap, accept back-off."""

from __future__ import annotations

import http.client
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests

from exporter.config.load import validate
from exporter.model.snapshots import Latest
from exporter.web import ExporterServer, View
from tests.helpers import wait_for
from tests.test_server import BILLING, dribble

Render = Callable[[str], tuple[bytes, str]]
Serve = Callable[..., ExporterServer]


def exposition(accept: str) -> tuple[bytes, str]:
    return b"# HELP up\nup 1\n", "text/plain; version=0.0.4; charset=utf-8"


@pytest.fixture
def serve() -> Iterator[Serve]:
    """Start a plain-HTTP server with a stand-in exposition and the given limits; stopped afterwards."""
    servers: list[ExporterServer] = []

    def start(render: Render = exposition, **limits: Any) -> ExporterServer:
        config = validate({"billing": BILLING}, {})
        server = ExporterServer(("127.0.0.1", 0), View(Latest(), render, list), config.server, **limits)
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def test_a_client_dribbling_its_headers_is_cut_at_the_header_deadline(serve: Serve) -> None:
    renders = []
    server = serve(lambda accept: renders.append(accept) or exposition(accept), header_deadline=1.0)
    with socket.create_connection(server.server_address[:2], timeout=10) as client:
        took, answer = dribble(client, 0.3)  # each read is well within the 30 s per-read timeout
    assert answer == b""  # no response: the request was never complete
    assert 0.9 <= took < 6
    assert renders == []  # its truncated headers were not taken for a request
    assert server.timed_out == 1
    assert requests.get(f"{server.url}/metrics", timeout=5).status_code == 200


class SlowClients:
    """Keeps `count` connections dribbling header lines, reconnecting whenever the server cuts one (as an attacker
    would); counts the cuts, any answers (there should be none), and the most connections open at once."""

    def __init__(self, server: ExporterServer, count: int, interval: float) -> None:
        self.server, self.interval = server, interval
        self.clients = [self._connect() for _ in range(count)]
        self.cut = self.answered = self.most_open = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _connect(self) -> socket.socket:
        client = socket.create_connection(self.server.server_address[:2], timeout=10)
        client.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        return client

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.most_open = max(self.most_open, self.server.open_connections)
            readable, _, _ = select.select(self.clients, [], [], 0)
            for i, client in enumerate(self.clients):
                try:
                    if client in readable:
                        self.answered += bool(client.recv(65536))
                        raise ConnectionResetError  # it was cut: the server has hung up
                    client.sendall(b"X-Slow: v\r\n")
                except ConnectionError:
                    client.close()
                    self.cut += 1
                    self.clients[i] = self._connect()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        for client in self.clients:
            client.close()


def test_at_the_cap_slow_clients_are_evicted_so_probes_and_scrapes_are_served(serve: Serve) -> None:
    server = serve(max_connections=8, header_deadline=60.0)  # eviction, not the deadline, makes room here
    attack = SlowClients(server, count=14, interval=0.3)
    try:
        wait_for(lambda: attack.cut >= 6, timeout=20)  # the cap is full and churning
        took = []
        for _ in range(5):
            for path in ("/healthz", "/metrics"):
                started = time.monotonic()
                assert requests.get(f"{server.url}{path}", timeout=10).status_code == 200
                took.append(time.monotonic() - started)
            time.sleep(0.2)
    finally:
        attack.stop()
    print(f"slowest probe/scrape under attack: {max(took):.3f}s, evicted {server.evicted}")
    assert max(took) < 5
    assert attack.most_open <= 8
    assert 6 <= attack.cut <= server.evicted
    assert attack.answered == 0
    assert server.timed_out == 0


def test_at_the_cap_busy_connections_are_not_evicted_the_new_one_waits(serve: Serve) -> None:
    rendering, release = threading.Semaphore(0), threading.Event()

    def slow_render(accept: str) -> tuple[bytes, str]:
        rendering.release()
        release.wait(30)
        return exposition(accept)

    server = serve(slow_render, max_connections=2)
    with ThreadPoolExecutor(2) as pool:
        scrapes = [pool.submit(requests.get, f"{server.url}/metrics", timeout=30) for _ in range(2)]
        for _ in scrapes:
            assert rendering.acquire(timeout=10)
        with pytest.raises(requests.exceptions.ReadTimeout):  # connected (the backlog), but not yet accepted
            requests.get(f"{server.url}/healthz", timeout=(5, 1))
        assert (server.open_connections, server.evicted) == (2, 0)
        release.set()
        assert [scrape.result().status_code for scrape in scrapes] == [200, 200]
    # Answered, the scrapes' kept-alive connections are idle: evictable, so the probe gets in.
    assert requests.get(f"{server.url}/healthz", timeout=5).status_code == 200


def test_an_idle_keep_alive_connection_is_closed_at_the_idle_deadline(serve: Serve) -> None:
    server = serve(idle_deadline=1.0)
    connection = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
    try:
        connection.request("GET", "/healthz")
        response = connection.getresponse()
        response.read()
        assert not response.will_close
        idle_since = time.monotonic()
        assert connection.sock.recv(1) == b""  # the server hangs up
        assert 0.9 <= time.monotonic() - idle_since < 6
    finally:
        connection.close()
    wait_for(lambda: server.timed_out == 1, timeout=5)


def test_a_steady_keep_alive_client_keeps_its_connection(serve: Serve) -> None:
    server = serve(idle_deadline=1.0, header_deadline=1.0)
    connection = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
    local_ports = set()
    started = time.monotonic()
    try:
        while time.monotonic() - started < 2.5:  # longer than either deadline, over one connection
            connection.request("GET", "/metrics")
            response = connection.getresponse()
            assert response.status == 200
            response.read()
            local_ports.add(connection.sock.getsockname()[1])
            time.sleep(0.3)
    finally:
        connection.close()
    assert len(local_ports) == 1
    assert server.timed_out == server.evicted == 0


OUT_OF_FILES = """
import logging, os, resource, sys
from exporter.config.load import validate
from exporter.web import ExporterServer, View
from exporter.model.snapshots import Latest

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
config = validate({"billing": {"url": "http://127.0.0.1:1", "access_key_id": "AK", "secret_access_key": "s"}}, {})
server = ExporterServer(("127.0.0.1", 0), View(Latest(), lambda accept: (b"", "text/plain"), list), config.server,
                        header_deadline=60.0)
server.start()
hogs = []
try:
    while True:
        hogs.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
for fd in hogs[:4]:
    os.close(fd)  # room for four connections, and no more
print(server.server_address[1], server.max_connections, flush=True)
sys.stdin.read()
"""


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_out_of_descriptors_the_accept_loop_backs_off_instead_of_spinning(tmp_path: Path) -> None:
    stderr = tmp_path / "stderr.log"
    with stderr.open("w") as errors:
        server = subprocess.Popen(
            [sys.executable, "-c", OUT_OF_FILES],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True,
            cwd=Path(__file__).parent.parent,
        )  # fmt: skip
    clients: list[socket.socket] = []
    try:
        assert server.stdout is not None
        port, cap = map(int, server.stdout.readline().split())
        assert cap == 32  # a quarter of the open-file limit, under MAX_CONNECTIONS
        clients = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(12)]
        wait_for(lambda: "http accept failing" in stderr.read_text(), timeout=20)
        before = cpu_seconds(server.pid)
        time.sleep(2)
        spent = cpu_seconds(server.pid) - before
        print(f"server CPU while out of descriptors: {spent:.2f}s over 2s")
        assert spent < 0.5
        for client in clients:
            client.close()

        def healthy() -> bool:
            try:
                return requests.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
            except requests.RequestException:
                return False

        wait_for(healthy, timeout=20)
        log = stderr.read_text()
        # Once an episode, not per attempt: each "failing" followed by its "accepting again" (a busy
        # machine may see two episodes, the server's side of the closed connections not closed yet).
        said = [line for line in log.splitlines() if "http accept failing" in line or "http accepting again" in line]
        assert said
        assert all(("failing" in line) == (n % 2 == 0) for n, line in enumerate(said)), said
        assert "http accepting again" in said[-1]
    finally:
        for client in clients:
            client.close()
        server.communicate(timeout=10)
