"""`core.watched`: a request's deadlines watch its connection while it is the request's, never once
the connection has gone back to the pool for another request."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
import requests

from exporter.core.deadline import Deadline
from exporter.core.watched import WatchedAdapter, watching


class _Slow(BaseHTTPRequestHandler):
    """Keeps connections alive; a request for /slow is answered once `answer` is set."""

    protocol_version = "HTTP/1.1"
    arrived = threading.Event()
    answer = threading.Event()
    ports: ClassVar[set[int]] = set()
    """The client ports of the connections served."""

    def do_GET(self) -> None:
        _Slow.ports.add(self.client_address[1])
        if self.path == "/slow":
            _Slow.arrived.set()
            _Slow.answer.wait(10)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    _Slow.arrived, _Slow.answer, _Slow.ports = threading.Event(), threading.Event(), set()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        _Slow.answer.set()
        httpd.shutdown()
        httpd.server_close()


def test_a_deadline_that_fires_after_its_request_spares_the_next_request_on_the_same_connection(server: str) -> None:
    """Request A ends (its connection back in the pool); B takes that connection and waits for its
    answer; A's deadline then fires (late: its thread was held up before it could stop it). B's
    answer still comes, on the same connection."""
    session = requests.Session()
    session.mount("http://", WatchedAdapter())
    first = Deadline()
    copies: list = []
    with watching((first,), (first,), copies):
        assert session.get(f"{server}/", timeout=10).status_code == 200
    answered: list[requests.Response | BaseException] = []

    def second() -> None:
        try:
            answered.append(session.get(f"{server}/slow", timeout=10))
        except requests.RequestException as error:
            answered.append(error)

    waiting = threading.Thread(target=second)
    waiting.start()
    try:
        assert _Slow.arrived.wait(10)
        first.fire()
        _Slow.answer.set()
        waiting.join(10)
    finally:
        first.stop()
        for copy in copies:
            copy.close()
        session.close()
    (response,) = answered
    assert isinstance(response, requests.Response), response
    assert response.text == "ok"
    assert len(_Slow.ports) == 1  # (the same connection: the one A's deadline watched)
