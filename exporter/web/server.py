"""HTTP: the server (`ExporterServer`) and its handler, with optional TLS and basic auth.

A threaded server: a slow client never holds up a scrape, and a scrape only renders the
current snapshots (it never waits on the API). Slow clients cannot exhaust it either: connections
are capped, and a request's line and headers (TLS handshake included) have one overall deadline
(see connections). A request whose framing is ambiguous (two Content-Length, a space before a colon…) is refused
with a 400 (see parsing), and a bug in a handler is a 500: each one log line, never a traceback on stderr.
The certificate, key, password and response headers (from the config, or from a web configuration file in
exporter-toolkit's format) are swapped on a reload for the connections and requests that follow.
What each path answers is in routes.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import socket
import ssl
import sys
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from exporter.config.schema import ServerConfig
from exporter.core.logs import get_logger
from exporter.core.words import shortened
from exporter.metrics.exposition import GZIP_LEVEL
from exporter.web.connections import HEADER_DEADLINE, IDLE_DEADLINE, MAX_CONNECTIONS, Connections, Phase, connection_cap
from exporter.web.credentials import Credentials
from exporter.web.parsing import (
    MAX_HEADER_BYTES,
    MAX_URL,
    accepts_gzip,
    credentialed,
    header_problem,
    target_path,
    without_credentials,
)
from exporter.web.routes import OPEN_PATHS, respond
from exporter.web.views import View

log = get_logger(__name__)

REASON = 200
"""The longest reason a refusal gives, in its answer and its log line."""
ACCEPT_BACKOFF = 0.1
"""Pause after accept() fails for want of descriptors or memory: the pending connection keeps the listening socket
readable, so retrying at once would spin."""
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
PLAIN_TO_TLS = "Client sent an HTTP request to an HTTPS server."
"""The answer to a request in clear on the TLS listener (Go's words, which Prometheus users know)."""
_CLIENT_GONE = (ConnectionError, ssl.SSLError, TimeoutError)
"""What a connection raises when its client hangs up, stalls or fails TLS: no fault of the server's."""


class ExporterServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(
        self,
        address: tuple[str, int],
        view: View,
        config: ServerConfig,
        *,
        web_config: str | Path | None = None,
        max_connections: int = MAX_CONNECTIONS,
        header_deadline: float = HEADER_DEADLINE,
        idle_deadline: float = IDLE_DEADLINE,
    ) -> None:
        self.connections = Connections(connection_cap(max_connections), header_deadline, idle_deadline)
        self._stopping = threading.Event()
        self._accept_failing = False
        # First: a bad certificate or web configuration file leaves no socket bound.
        self.credentials = Credentials.load(config, web_config)
        self._dual_stack = not address[0] and socket.has_dualstack_ipv6()
        if self._dual_stack:  # every address (`:9877`), IPv6 and IPv4 alike, as Go's servers listen
            address = ("::", address[1])
        if ":" in address[0]:  # an IPv6 address (`[::1]:9877`)
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)
        self.view = view
        self._thread: threading.Thread | None = None

    def server_bind(self) -> None:
        if self._dual_stack:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()

    def use(self, credentials: Credentials) -> None:
        """Serve with these from now on: new connections get the new certificate, and every request from now on
        (on a kept-alive connection too) is checked against the new password; a kept-alive connection these would
        not have taken (in clear with TLS on, or without the client certificate now asked) is closed after the
        request it serves (see _still_serves)."""
        self.credentials = credentials

    @property
    def scheme(self) -> str:
        return "http" if self.credentials.tls is None else "https"

    @property
    def url(self) -> str:
        address, port = self.server_address[:2]
        host = str(address)
        host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host  # noqa: S104 - display only
        host = f"[{host}]" if ":" in host else host
        return f"{self.scheme}://{host}:{port}"

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A socket's trouble (a client that hangs up, or fails the TLS handshake) is the client's problem, not a
        server error. Anything else is one log line with its traceback as a field, not the stdlib's traceback
        printed to stderr (a handler's own errors are answered before this, see _Handler.handle)."""
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            log.debug("http client dropped", address=client_address[0], error=str(error))
            return
        log.exception("http connection crashed", address=client_address[0])

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, args=(0.1,), name="http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        self._stopping.clear()  # a server shut down may serve again
        super().serve_forever(poll_interval)

    def shutdown(self) -> None:
        self._stop_waiting()  # the accept loop may be waiting for a slot
        super().shutdown()

    def _stop_waiting(self) -> None:
        self._stopping.set()
        self.connections.wake()

    def get_request(self) -> tuple[Any, Any]:
        """Accept once there is a slot, registering the connection in its header phase (the TLS handshake counts).

        When accept() fails for want of descriptors, pause before the serve loop retries, and say so once.
        """
        self.connections.wait_for_slot(self._stopping)
        try:
            request, address = super().get_request()
        except OSError as error:
            if error.errno in _OUT_OF_RESOURCES:
                if not self._accept_failing:
                    log.warning("http accept failing, backing off", error=str(error), connections=self.open_connections)
                    self._accept_failing = True
                self._stopping.wait(ACCEPT_BACKOFF)
            raise
        if self._accept_failing:
            log.info("http accepting again", connections=self.open_connections)
            self._accept_failing = False
        # Headers and body go out in separate writes; with Nagle's algorithm a kept-alive connection
        # would hold the body until the client's delayed ACK (about 40 ms a response).
        with contextlib.suppress(OSError):
            request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tls = self.credentials.tls
        if tls is not None:
            # Each connection is wrapped with the context of the moment, so a reload's certificate serves the
            # next connection. The handshake happens in the request's own thread (see _Handler.setup), so a
            # client that connects and says nothing cannot hold up the accept loop.
            try:
                request = tls.wrap_socket(request, server_side=True, do_handshake_on_connect=False)
            except OSError:
                request.close()
                raise
        self.connections.add(request, str(address[0]))
        return request, address

    @property
    def max_connections(self) -> int:
        """Connections open at once, at most (see connection_cap)."""
        return self.connections.cap

    @property
    def open_connections(self) -> int:
        """Connections open now."""
        return len(self.connections)

    @property
    def evicted(self) -> int:
        """Connections cut to make room for a new one at the cap."""
        return self.connections.evicted

    @property
    def timed_out(self) -> int:
        """Connections cut at their header or idle deadline."""
        return self.connections.timed_out

    def shutdown_request(self, request: Any) -> None:
        """Free the slot, then close the connection (see Connections.remove)."""
        self.connections.remove(request)
        super().shutdown_request(request)


def _still_serves(made_with: ssl.SSLContext | None, now: ssl.SSLContext | None) -> bool:
    """Whether a connection made under the TLS context `made_with` (None: in clear) may go on under the one of
    now, after a reload: not in clear once TLS is on (nor under TLS once it is off), nor when the client
    certificates asked for changed (`client_auth_type`, the client CA). A renewed server certificate alone
    leaves it as it is: its session goes on as it began."""
    if made_with is now:
        return True
    if made_with is None or now is None:
        return False
    if now.verify_mode == ssl.CERT_NONE:
        return True
    return made_with.verify_mode == now.verify_mode and made_with.get_ca_certs() == now.get_ca_certs()


class _Handler(BaseHTTPRequestHandler):
    server: ExporterServer
    protocol_version = "HTTP/1.1"
    server_version = "inference-cost-exporter"
    timeout = 30  # a client that stalls mid-request is dropped, not waited on forever
    target = "/"
    """The path the request asks for, from its checked target (see parse_request)."""
    answered = False
    """Whether this request's response has begun: after that, a crash can only cut the connection."""
    taken = False
    """Whether this request was read under TLS settings that would take its connection (`parse_request`): it is
    answered then, whatever a reload does meanwhile (the connection closes after it: see _next_request)."""

    def version_string(self) -> str:
        """The `Server` header: the program's name, not the interpreter's version (a scanner's finding)."""
        return self.server_version

    plain_to_tls = False
    """Whether the connection to the TLS listener began with an HTTP request in clear (answered in `setup`)."""

    def setup(self) -> None:
        if isinstance(self.request, ssl.SSLSocket):
            self.request.settimeout(self.timeout)
            self.plain_to_tls = self._plain_to_tls()
            if not self.plain_to_tls:
                self.request.do_handshake()
        super().setup()

    def _plain_to_tls(self) -> bool:
        """Whether the client sent an HTTP request in clear to the TLS listener (its first byte a letter, where a
        TLS handshake begins with 0x16): it is answered a 400 that says so in clear, as Go's servers do, rather
        than a handshake failure the client reads as a dropped connection. (Peeked at under the TLS socket.)"""
        try:
            first = socket.socket.recv(self.request, 1, socket.MSG_PEEK)
        except OSError:  # (timed out, reset: the handshake says so)
            return False
        if not first.isalpha():
            return False
        log.info("http request refused", status=400, reason=PLAIN_TO_TLS, address=self.client_address[0])
        body = f"{PLAIN_TO_TLS}\n".encode()
        head = f"HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {len(body)}\r\n"
        with contextlib.suppress(OSError):
            socket.socket.sendall(self.request, f"{head}Connection: close\r\n\r\n".encode() + body)
        return True

    def handle(self) -> None:
        """The stdlib's keep-alive loop, with the connection idle between requests (see Connections.enter). A bug
        that escapes a request is a 500 and one log line (see _crashed), not the stdlib's traceback on stderr."""
        self.close_connection = True
        if self.plain_to_tls:  # (answered in setup)
            return
        try:
            self._handle_one()
            while not self.close_connection and self._next_request():
                self._handle_one()
        except _CLIENT_GONE:
            raise  # no fault of the server's: ExporterServer.handle_error says it at debug
        except Exception:
            self._crashed()

    def _handle_one(self) -> None:
        self.answered = self.taken = False
        self.handle_one_request()

    def _next_request(self) -> bool:
        """Wait, idle, for the next request's first byte; its header deadline starts there. A connection that the
        TLS settings of now would not have taken (see _still_serves) takes no more requests: its client connects
        again under them."""
        if not self._taken_now():
            return False
        if not self.server.connections.enter(self.request, Phase.IDLE):
            return False
        try:
            arrived = bool(self.rfile.peek(1))  # type: ignore[attr-defined]  # a BufferedReader
        except OSError:  # timed out, reset, or a TLS error
            return False
        if not self._taken_now():  # (a reload while it waited: unanswered)
            return False
        return arrived and self.server.connections.enter(self.request, Phase.HEADERS)

    def _taken_now(self) -> bool:
        """Whether the TLS settings of now would have taken this connection (see _still_serves): a reload since
        it was accepted may have turned TLS on or off, or asked for client certificates. What it sends is not
        answered then, whatever it is; its client connects again under them."""
        made_with = self.request.context if isinstance(self.request, ssl.SSLSocket) else None
        return _still_serves(made_with, self.server.credentials.tls)

    def handle_expect_100(self) -> bool:
        """The stdlib's `100 Continue`, unless the connection is not one the TLS settings of now would take."""
        if not self._taken_now():
            self.close_connection = True
            return False
        return super().handle_expect_100()

    def parse_request(self) -> bool:
        """Reads the headers; from then on the header deadline no longer applies. A connection cut meanwhile saw
        its headers end early: that truncated request gets no answer. One the stdlib takes but whose target or
        headers are malformed or ambiguous is refused with a 400 (see target_path and header_problem). A
        connection the TLS settings of now would not have taken (a reload since it was accepted: see
        _still_serves) gets no answer either, its first request too: its client connects again under them."""
        parsed = super().parse_request()
        if not self.server.connections.enter(self.request, Phase.BUSY):
            self.close_connection = True
            return False
        if not self._taken_now():
            self.close_connection = True
            return False
        self.taken = True
        if not parsed:
            return False
        path = target_path(self.command, self.path)
        problem = header_problem(self.headers) if path is not None else "a target that is neither a path nor a URL"
        if path is None and credentialed(self.path):
            problem = "a target holding a user name or password"
        if problem is None and self.request_version == "HTTP/1.1" and "Host" not in self.headers:
            problem = "no Host header (a version 1.1 request must have one)"  # (RFC 9112 §3.2, as Go answers it)
        if path is None or problem is not None:
            self._refuse(400, f"bad request: {problem}")
            return False
        self.target = path
        return True

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The stdlib's refusals (a bad request line, a line too long, too many headers, an unknown method) as this
        server's own: plain text, the connection closed, one log line."""
        if self.request_version == "HTTP/0.9":
            # A request line the stdlib could not read leaves HTTP/0.9, whose answers have no status line: the
            # client would see a page, not a refusal.
            self.request_version = self.protocol_version
        self._refuse(code, message or HTTPStatus(code).phrase)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("http request", line=without_credentials(format % args))

    def _accepts_gzip(self) -> bool:
        headers = getattr(self, "headers", None)  # none yet when the request line itself is refused
        return headers is not None and accepts_gzip(headers.get_all("Accept-Encoding", []))

    def _send(
        self,
        status: int,
        body: bytes,
        content_type: str,
        headers: dict[str, str] | None = None,
        gzipped: bool = False,
        *,
        logged: bool = True,
    ) -> None:
        """Send a response, gzipped (one member: curl and other libcurl clients stop after the
        first) when the client accepts it and it is worth it; `gzipped`: it is already. `logged`: with the access
        line at debug (a refusal or a crash has its own line instead)."""
        if not self._taken_now():  # (a reload since the connection was accepted)
            self.close_connection = True  # its last answer, saying so
            if not self.taken:  # (the stdlib's refusals, before the request was taken: none)
                return
        headers = dict(headers or {})
        if not gzipped and len(body) > 1024 and self._accepts_gzip():
            body, gzipped = gzip.compress(body, compresslevel=GZIP_LEVEL), True
        if gzipped:
            headers["Content-Encoding"] = "gzip"
        self.answered = True
        if logged:
            self.log_request(status)
        self.send_response_only(status)
        self.send_header("Server", self.version_string())
        self.send_header("Date", self.date_time_string())
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in self.server.credentials.headers:  # the web configuration file's, on every response
            self.send_header(name, value)
        for name, value in headers.items():
            self.send_header(name, value)
        # The client's `close` (among other options too: the stdlib reads it alone only), or HTTP/1.0:
        # the connection closes after this answer, which says so (RFC 9112 §9.6).
        asked = getattr(self, "headers", None)
        options = ",".join(asked.get_all("Connection", [])) if asked is not None else ""
        if "close" in {option.strip().lower() for option in options.split(",")}:
            self.close_connection = True
        if self.close_connection and "Connection" not in headers:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        self.do_GET()

    def _refuse(self, status: int, reason: str, **headers: str) -> None:
        """Answer `status` and close the connection: what else the client sent is never read, so it cannot be
        taken for a request of its own. One log line, at info: a client's mistake, or someone probing."""
        reason = shortened(without_credentials(reason), REASON)  # (the stdlib's echo the request line)
        log.info(
            "http request refused", status=status, reason=reason, address=self.client_address[0],
            request=without_credentials(self.requestline)[:200],
        )  # fmt: skip
        self.close_connection = True
        body = f"{reason}\n".encode()
        self._send(status, body, "text/plain; charset=utf-8", {"Connection": "close", **headers}, logged=False)

    def _crashed(self) -> None:
        """A bug: one log line, at error, with the traceback as a field; a 500 unless the response has begun (then
        only cutting the connection can tell the client). The connection closes either way: how much of the
        request was read is unknown."""
        log.exception(
            "http request crashed", address=self.client_address[0], request=without_credentials(self.requestline)[:200]
        )
        self.close_connection = True
        if not self.answered:
            with contextlib.suppress(OSError):  # the client may be gone already
                body = b"internal server error\n"
                self._send(500, body, "text/plain; charset=utf-8", {"Connection": "close"}, logged=False)

    def do_POST(self) -> None:
        self._refuse(405, "method not allowed", Allow="GET, HEAD")

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_POST  # noqa: N815 - the stdlib names handlers so

    def do_GET(self) -> None:
        if len(self.path) > MAX_URL:
            self._refuse(414, "URI too long")
            return
        if sum(len(name) + len(value) for name, value in self.headers.items()) > MAX_HEADER_BYTES:
            self._refuse(431, "request header fields too large")
            return
        has_body = bool(self.headers.get("Content-Length", "0").strip(" \t").lstrip("0"))  # (checked: digits)
        if has_body or "Transfer-Encoding" in self.headers:
            self._refuse(413, "this server takes no request body")
            return
        authorization = self.headers.get("Authorization", "")
        if self.target not in OPEN_PATHS and not self.server.credentials.authorised(authorization):
            self._send(401, b"unauthorised\n", "text/plain", {"WWW-Authenticate": 'Basic realm="exporter"'})
            return
        response = respond(self.server.view, self.target, self.headers)
        self._send(
            response.status, response.body, response.content_type, {"Vary": response.vary}, gzipped=response.gzipped
        )
