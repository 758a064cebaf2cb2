"""Small helpers the tests share: scraping, waiting on a condition with a deadline."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import requests
from prometheus_client.parser import text_string_to_metric_families

T = TypeVar("T")
Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(exposition: str) -> Series:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
    }


def scrape(url: str, **kwargs: object) -> Series:
    response = requests.get(f"{url}/metrics", timeout=10, **kwargs)  # type: ignore[arg-type]
    response.raise_for_status()
    return parse(response.text)


def value(series: Series, name: str, **labels: str) -> float | None:
    return series.get((name, frozenset(labels.items())))


def named(series: Series, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {labels: v for (n, labels), v in series.items() if n == name}


def logged(records: list[logging.LogRecord], message: str, **fields: object) -> list[logging.LogRecord]:
    """The records whose message starts with `message` and whose fields include `fields`."""
    return [
        r
        for r in records
        if r.getMessage().startswith(message) and all(getattr(r, "fields", {}).get(k) == v for k, v in fields.items())
    ]


def wait_for(condition: Callable[[], T], timeout: float = 20.0, interval: float = 0.05) -> T:
    """Poll `condition` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


class Receiver:
    """A webhook receiver on loopback: records every POST, and can refuse the next few."""

    def __init__(self) -> None:
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        receiver = self
        self.received: list[dict] = []
        self.attempts = 0
        self.refuse = 0
        self.redirect_to = ""
        """When set, every POST is answered 302 with this `Location`."""
        self.gets = 0
        self.on_post: Callable[[], object] | None = None
        """Called as each POST arrives, before it is answered."""
        self.answers: list[tuple[int, dict[str, str]]] = []
        """Answers (a status, its headers) given to the next POSTs, in turn, before any other."""
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                with receiver._lock:
                    receiver.gets += 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if receiver.on_post is not None:
                    receiver.on_post()
                with receiver._lock:
                    scripted = receiver.answers.pop(0) if receiver.answers else None
                    receiver.attempts += scripted is not None
                if scripted is not None:
                    status, headers = scripted
                    self.send_response(status)
                    for name, value in {**headers, "Content-Length": "0"}.items():
                        self.send_header(name, value)
                    self.end_headers()
                    return
                if receiver.redirect_to:
                    with receiver._lock:
                        receiver.attempts += 1
                    self.send_response(302)
                    self.send_header("Location", receiver.redirect_to)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                with receiver._lock:
                    receiver.attempts += 1
                    refused = receiver.refuse > 0
                    if refused:
                        receiver.refuse -= 1
                    else:
                        receiver.received.append(
                            {"path": self.path, "body": json.loads(body), "headers": dict(self.headers)}
                        )
                self.send_response(503 if refused else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    def bodies(self, path: str | None = None) -> list[dict]:
        with self._lock:
            return [r["body"] for r in self.received if path is None or r["path"] == path]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port free now, for a process the test starts to listen on. Not one the system
    hands out for port 0: between this check and the process's own bind, any server started by
    another test (a simulator, a receiver) could take that one, and the test would talk to it.
    A port below the system's ephemeral range, at random, none twice in a run."""
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            first_ephemeral = int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 32768
    draw = random.SystemRandom()
    while True:
        port = draw.randrange(10000, first_ephemeral)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port


def serve_binary(command: list[str], port: int, timeout: float = 60.0) -> Iterator[str]:
    """Run a Prometheus-family binary listening on 127.0.0.1:`port` until its /-/ready answers;
    yields its URL and stops it afterwards (use with `yield from` in a fixture)."""
    import subprocess

    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return requests.get(f"{url}/-/ready", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False

    try:
        wait_for(ready, timeout=timeout)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=15)


class LoopbackServer:
    """A TCP server on 127.0.0.1 that hands each connection to `serve` on a thread of its own, and
    counts them; `stop` closes the listener, and `stopping` is set for the conversations to end."""

    def __init__(self, backlog: int = 16) -> None:
        self.connections = 0
        self.stopping = threading.Event()
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(backlog)
        self.port: int = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self.serve, args=(connection,), daemon=True).start()

    def serve(self, connection: socket.socket) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self.stopping.set()
        self._listener.close()


class DripReceiver(LoopbackServer):
    """A receiver that reads a request, sends its status line and headers, then one byte of body
    every `interval` seconds for as long as the client stays (a slow proxy, a stuck service)."""

    def __init__(self, interval: float = 1.0) -> None:
        super().__init__()
        self.interval = interval
        self.url = f"http://127.0.0.1:{self.port}/hook"

    def serve(self, connection: socket.socket) -> None:
        with connection:
            try:
                connection.recv(65536)
                connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n")
                while not self.stopping.wait(self.interval):
                    connection.sendall(b".")
            except OSError:
                return
