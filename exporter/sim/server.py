"""The stand-in service on loopback: one HTTP server for the billing API, the chat API and the
test control API (`/_sim/...`)."""

from __future__ import annotations

import datetime as dt
import json
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from exporter.sim.chat_api import ChatRequests
from exporter.sim.model import (
    Fault,
    SimulatorError,
    _encode,
    corrupt,
)

if TYPE_CHECKING:
    from exporter.sim.service import Simulator


class SimulatorServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], sim: Simulator) -> None:
        if ":" in address[0]:  # an IPv6 address (`[::1]:8080`)
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)
        self.sim = sim
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = str(host)
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up (a probe's deadline, a killed process) is normal here, not an error."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, args=(0.05,), name="simulator", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        if self._thread:
            self._thread.join(timeout=5)


class _Handler(ChatRequests):
    protocol_version = "HTTP/1.1"
    server: SimulatorServer
    # An answer goes out as its headers, then its body: with Nagle's algorithm the body waited for
    # the client's delayed ACK of the headers (40 ms) on every request of a kept-alive connection
    # after the first, as no real service makes one wait.
    disable_nagle_algorithm = True
    received = 0.0
    """When the request line arrived (`time.monotonic`): `latency` counts from here."""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    def parse_request(self) -> bool:
        self.received = time.monotonic()
        return super().parse_request()

    @property
    def sim(self) -> Simulator:
        return self.server.sim

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, payload: bytes, content_type: str = "application/json", **headers: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(payload)

    def _envelope(self, status: int, code: int, reason: str, message: str, data: Any = None) -> None:
        body = {"code": code, "reason": reason, "message": message}
        if data is not None:
            body["data"] = data
        self._send(status, _encode(body))

    def date_time_string(self, timestamp: float | None = None) -> str:
        return super().date_time_string(self.sim.clock.now().timestamp() if timestamp is None else timestamp)

    def _transport_fault(self, fault: Fault | None, error_body: Callable[[int], bytes]) -> bool:
        """Apply a fault both APIs share (delay, drop, HTTP status, a body cut or stopped); True when
        it ended the request."""
        if fault is None:
            return False
        if fault.kind == "delay":
            time.sleep(fault.seconds)
        elif fault.kind == "drop":
            self._drop()
            return True
        elif fault.kind == "status":
            if fault.gate is not None:
                fault.gate.wait(60)
            time.sleep(fault.seconds)
            extra = {"Retry-After": str(fault.retry_after)} if fault.retry_after is not None else {}
            self._send(fault.status, error_body(fault.status), **extra)
            return True
        elif fault.kind == "reset":
            self._start_body()
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self._drop()  # with SO_LINGER 0 the close is a reset, mid-body
            return True
        elif fault.kind == "slow_body":
            self._start_body()
            time.sleep(fault.seconds)  # (the rest of the body never comes)
            self._drop()
            return True
        return False

    def _start_body(self) -> None:
        """A successful answer's headers and the start of its body, sent: the fault then cuts it."""
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "4096")
        self.end_headers()
        self.wfile.write(b'{"code": 0, "data": {"list": [{"requestId": "')
        self.wfile.flush()

    def _drop(self) -> None:
        self.close_connection = True
        self.connection.close()

    def do_GET(self) -> None:  # noqa: N802 - the stdlib names handlers so
        sim = self.sim
        with sim._lock:
            sim.in_flight += 1
            sim.max_in_flight = max(sim.max_in_flight, sim.in_flight)
        try:
            self._billing()
        finally:
            with sim._lock:
                sim.in_flight -= 1

    def _billing(self) -> None:
        """`latency` is the whole response time from the request line's arrival: the simulator's own
        work (reading the headers, checking the signature, making the page) counts toward it."""
        url = urlsplit(self.path)
        body = self._body()
        with self.sim._lock:
            self.sim.requests_served[url.path] = self.sim.requests_served.get(url.path, 0) + 1
        handlers = {
            "/api/v1/bills/details": self.sim.bills_response,
            "/api/v1/usages/details": self.sim.usages_response,
        }
        if url.path not in handlers:
            self._envelope(404, 100404, "NotFound", "no such API")
            return
        fault = self.sim._take_fault(url.path) or self.sim._random_failure()

        def envelope(status: int) -> bytes:
            return _encode({"code": 100500, "reason": "Fault", "message": HTTPStatus(status).phrase})

        if self._transport_fault(fault, envelope):
            return
        if fault and fault.kind == "malformed":
            self._send(200, b'{"code": 0, "data": {"list": [')
            return
        if fault and fault.kind == "code":
            self._envelope(200, 100503, "ServiceBusy", "service is busy, try later")
            return
        try:
            self.sim.verify_signature("GET", url.query, url.path, self.headers, body)
            data = handlers[url.path](url.query)
        except SimulatorError as error:
            self._envelope(error.http_status, error.code, error.reason, error.message)
            return
        if fault is not None:
            data = corrupt(data, fault)
        payload = _encode({"code": 0, "reason": "OK", "message": "success", "data": data})
        remaining = self.sim.latency - (time.monotonic() - self.received)
        if remaining > 0:
            time.sleep(remaining)
        self._send(200, payload)

    def do_POST(self) -> None:  # noqa: N802 - the stdlib names handlers so
        url = urlsplit(self.path)
        body = self._body()
        if url.path == "/v1/chat/completions":
            self._chat(body)
        elif url.path.startswith("/_sim/"):
            self._control(url.path, body)
        else:
            self._send(404, b'{"error": {"message": "not found"}}')

    def _control(self, path: str, body: bytes) -> None:
        """Out-of-process control: /_sim/usage {"count": N}, /_sim/fault {Fault fields}, /_sim/clear,
        /_sim/stats (requests served per path)."""
        try:
            request = json.loads(body or b"{}")
            if path == "/_sim/stats":
                with self.sim._lock:
                    self._send(200, json.dumps(self.sim.requests_served).encode())
                return
            if path == "/_sim/usage":
                day = request.get("date")
                self.sim.add_usage(int(request["count"]), dt.date.fromisoformat(day) if day else None)
            elif path == "/_sim/fault":
                if "gate" in request:  # (an event in process only)
                    raise TypeError("gate: not over HTTP")
                self.sim.inject(Fault(**request))
            elif path == "/_sim/clear":
                self.sim.clear_faults()
            else:
                raise KeyError(path)
        except (KeyError, TypeError, ValueError) as error:
            self._send(400, json.dumps({"error": str(error)}).encode())
            return
        self._send(200, b"{}")
