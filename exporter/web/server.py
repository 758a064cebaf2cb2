"""HTTP: landing page, /metrics, /healthz, /readyz; optional TLS and basic auth.

A threaded server: a slow client never holds up a scrape, and a scrape only renders the
current snapshots (it never waits on the API). Slow clients cannot exhaust it either: connections
are capped, and a request's line and headers (TLS handshake included) have one overall deadline.
A request whose framing is ambiguous (two Content-Length, a space before a colon…) is refused
with a 400, and a bug in a handler is a 500: each one log line, never a traceback on stderr.
The certificate, key and password are swapped on a reload for the connections and requests that follow.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import enum
import errno
import gzip
import hmac
import html
import json
import re
import resource
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from email.message import Message
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NoReturn
from urllib.parse import urlsplit

from exporter import __version__
from exporter.alerts.engine import Alert
from exporter.config.schema import BudgetConfig, PriceConfig, ServerConfig
from exporter.core.clock import iso
from exporter.core.logs import get_logger
from exporter.metrics.exposition import GZIP_LEVEL
from exporter.model.snapshots import Latest, Reconciliation
from exporter.sources.budgets import budget_status, scope_matched
from exporter.sources.reconcile import disagrees
from exporter.web.chart import month_chart

log = get_logger(__name__)

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
"""Liveness and readiness stay reachable without credentials, for orchestrators' probes."""


@dataclass(frozen=True)
class View:
    """What the server shows; callables, so a config reload is seen at once."""

    latest: Latest
    render: Callable[[str], tuple[bytes, str]]
    """The exposition for an `Accept` header, and its content type."""
    sources: Callable[[], Sequence[str]]
    render_gzipped: Callable[[str], tuple[bytes, str]] | None = None
    """The same as one gzip member, for a client that accepts gzip, when the exposition compresses it cheaper than
    the server would (Exposition does: from pieces cached per snapshot)."""
    alerts: Callable[[], Sequence[Alert]] = list
    budgets: Callable[[], Sequence[BudgetConfig]] = tuple
    prices: Callable[[], Sequence[PriceConfig]] = tuple
    """What budgets scoped on usage are priced with."""
    today: Callable[[], dt.date | None] = lambda: None
    """The billing zone's day: a budget's figures of a day or month that has ended are not shown as current."""
    now: Callable[[], float] = time.time
    """The billing clock's time, which the sources' timestamps are in."""


HEADER_DEADLINE = 10.0
"""Seconds a connection gets for its TLS handshake, request line and headers, however steadily it sends; for a later
request on a kept-alive connection, counted from that request's first byte."""
IDLE_DEADLINE = 20.0
"""Seconds a kept-alive connection may wait for its next request: over a 15 s scrape interval, so Prometheus keeps
its connection, and under the per-read timeout."""
MAX_CONNECTIONS = 200
"""Connections open at once; lowered to a quarter of the open-file limit when that is smaller (connection_cap)."""
REASON = 200
"""The longest reason a refusal gives, in its answer and its log line."""
REAP_INTERVAL = 0.25
"""How often the deadlines are checked, so how late past its deadline a connection may be cut."""
ACCEPT_BACKOFF = 0.1
"""Pause after accept() fails for want of descriptors or memory: the pending connection keeps the listening socket
readable, so retrying at once would spin."""
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_CLIENT_GONE = (ConnectionError, ssl.SSLError, TimeoutError)
"""What a connection raises when its client hangs up, stalls or fails TLS: no fault of the server's."""


def connection_cap(wanted: int) -> int:
    """`wanted`, but at most a quarter of the open-file limit: each connection holds a descriptor, and the rest of
    the process (the listening socket, the billing API's connections, the state database) needs its own."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft // 4))


class Phase(enum.Enum):
    """Where a connection is; the server may cut it only while it waits on its client (HEADERS, IDLE)."""

    HEADERS = "waiting for the TLS handshake, request line and headers"
    BUSY = "producing the response"
    IDLE = "kept alive, waiting for the next request"
    CLOSING = "cut by the server; its own thread is about to close it"


_WAITING = frozenset({Phase.HEADERS, Phase.IDLE})


@dataclass(slots=True)
class _Connection:
    """An open connection as the accept loop and the reaper see it."""

    address: str
    phase: Phase
    since: float
    """When it entered its phase (monotonic): the longest waiting is evicted first."""
    deadline: float


class TlsError(OSError):
    """The certificate or its key cannot be loaded. An OSError, as the ssl module's own errors are: at start-up
    it is reported as the server failing to come up."""


_TLS_REASONS = {"KEY_VALUES_MISMATCH": "the key is not the certificate's"}
"""OpenSSL's reasons, in words."""


def _no_passphrase() -> NoReturn:
    """Answers OpenSSL when a key is encrypted: its own default asks on the terminal, and the start-up or the reload
    would wait for an answer there."""
    raise TlsError("the key is encrypted; an unencrypted key is needed")


@dataclass(frozen=True)
class Credentials:
    """What the server serves new connections and requests with; replaced whole on a reload, so a request sees
    one certificate and one password, never half of a change."""

    tls: ssl.SSLContext | None
    auth: tuple[bytes, bytes] | None = field(default=None, repr=False)
    """The basic-auth user and password, UTF-8; out of the repr, so that no log line or traceback can show them."""

    @classmethod
    def load(cls, config: ServerConfig) -> Credentials:
        """Read the certificate and key files now: a renewed certificate often keeps its paths, so they are read
        again on each reload, not only when the config names other files."""
        tls = None
        if config.tls is not None:
            tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            tls.minimum_version = ssl.TLSVersion.TLSv1_2
            try:
                tls.load_cert_chain(config.tls.cert_file, config.tls.key_file, password=_no_passphrase)
            except OSError as error:  # unreadable, not PEM, encrypted, or a key that is not the certificate's
                if isinstance(error, ssl.SSLError):  # its "[SSL] PEM lib (_ssl.c:3905)" only says a file is not PEM
                    detail = _TLS_REASONS.get(error.reason, error.reason) or "a file is not in PEM format"
                else:
                    detail = error.strerror or str(error)
                raise TlsError(
                    f"server.tls: cannot load the certificate {config.tls.cert_file!r} with the key "
                    f"{config.tls.key_file!r}: {detail}"
                ) from None
        auth = None
        if config.basic_auth is not None:
            auth = (config.basic_auth.username.encode(), config.basic_auth.password.get_secret_value().encode())
        return cls(tls, auth)


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
        max_connections: int = MAX_CONNECTIONS,
        header_deadline: float = HEADER_DEADLINE,
        idle_deadline: float = IDLE_DEADLINE,
    ) -> None:
        self.max_connections = connection_cap(max_connections)
        self.header_deadline = header_deadline
        self.idle_deadline = idle_deadline
        self.evicted = 0
        """Connections cut to make room for a new one at the cap."""
        self.timed_out = 0
        """Connections cut at their header or idle deadline."""
        self._connections: dict[socket.socket, _Connection] = {}
        self._slots = threading.Condition()
        """Guards _connections and the counters; notified whenever a slot may have come free."""
        self._stopping = threading.Event()
        self._accept_failing = False
        self.credentials = Credentials.load(config)  # first: a bad certificate leaves no socket bound
        super().__init__(address, _Handler)
        self.view = view
        self._thread: threading.Thread | None = None

    def use(self, credentials: Credentials) -> None:
        """Serve with these from now on: new connections get the new certificate, and every request from now on
        (on a kept-alive connection too) is checked against the new password; connections in flight keep their
        TLS session."""
        self.credentials = credentials

    @property
    def scheme(self) -> str:
        return "http" if self.credentials.tls is None else "https"

    @property
    def url(self) -> str:
        address, port = self.server_address[:2]
        host = str(address)
        host = "127.0.0.1" if host in ("", "0.0.0.0") else host  # noqa: S104 - display only
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
        """Serve, with the reaper thread holding the deadlines meanwhile."""
        self._stopping.clear()
        reaper = threading.Thread(target=self._reap_forever, name="http-reaper", daemon=True)
        reaper.start()
        try:
            super().serve_forever(poll_interval)
        finally:
            self._stop_waiting()
            reaper.join()

    def shutdown(self) -> None:
        self._stop_waiting()  # the accept loop may be waiting for a slot
        super().shutdown()

    def _stop_waiting(self) -> None:
        with self._slots:
            self._stopping.set()
            self._slots.notify_all()

    def get_request(self) -> tuple[Any, Any]:
        """Accept once there is a slot, registering the connection in its header phase (the TLS handshake counts).

        When accept() fails for want of descriptors, pause before the serve loop retries, and say so once.
        """
        self._wait_for_slot()
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
        now = time.monotonic()
        with self._slots:
            self._connections[request] = _Connection(str(address[0]), Phase.HEADERS, now, now + self.header_deadline)
        return request, address

    def _wait_for_slot(self) -> None:
        """At the cap, evict the connection that has waited longest on its client, so a prompt client (a scrape, a
        probe) is always served; while every connection is busy responding, wait rather than go over the cap."""
        with self._slots:
            while len(self._connections) >= self.max_connections and not self._stopping.is_set():
                if not any(c.phase is Phase.CLOSING for c in self._connections.values()):
                    waiting = [(s, c) for s, c in self._connections.items() if c.phase in _WAITING]
                    if waiting:
                        self.evicted += 1  # counted first: the client may see the hang-up before the next line
                        self._cut(*min(waiting, key=lambda item: item[1].since), reason="evicted")
                self._slots.wait(REAP_INTERVAL)
            if self._stopping.is_set():
                raise OSError("server shutting down")

    @property
    def open_connections(self) -> int:
        """Connections open now."""
        with self._slots:
            return len(self._connections)

    def enter(self, request: socket.socket, phase: Phase) -> bool:
        """Move a connection to `phase`, starting that phase's deadline; False if the server has cut it."""
        now = time.monotonic()
        deadline = {Phase.HEADERS: self.header_deadline, Phase.IDLE: self.idle_deadline}.get(phase, float("inf"))
        with self._slots:
            connection = self._connections.get(request)
            if connection is None or connection.phase is Phase.CLOSING:
                return False
            connection.phase, connection.since, connection.deadline = phase, now, now + deadline
            self._slots.notify_all()  # an idle connection can now be evicted
            return True

    def _reap_forever(self) -> None:
        while not self._stopping.wait(REAP_INTERVAL):
            now = time.monotonic()
            with self._slots:
                for request, connection in self._connections.items():
                    if connection.phase in _WAITING and connection.deadline <= now:
                        self.timed_out += 1  # counted first: the client may see the hang-up before the next line
                        self._cut(request, connection, reason="deadline")

    def _cut(self, request: socket.socket, connection: _Connection, reason: str) -> None:
        """Shut the connection down, which wakes its thread from recv(); that thread closes it. Closing it here
        instead could free its descriptor for reuse while the thread still reads from it."""
        log.debug("http connection cut", reason=reason, phase=connection.phase.name, address=connection.address)
        connection.phase = Phase.CLOSING
        with contextlib.suppress(OSError):  # the client may have gone already
            # The plain socket's shutdown: SSLSocket's also drops the SSL object the request's thread is using.
            socket.socket.shutdown(request, socket.SHUT_RDWR)

    def shutdown_request(self, request: Any) -> None:
        """Free the slot; deregistered before it is closed, so _cut never meets a descriptor reused elsewhere."""
        with self._slots:
            self._connections.pop(request, None)
            self._slots.notify_all()
        super().shutdown_request(request)


def ready(view: View) -> tuple[bool, dict[str, str]]:
    """Each configured source has refreshed successfully at least once."""
    health = view.latest.health
    states = {}
    for source in view.sources():
        entry = health.get(source)
        if entry is None:
            states[source] = "not refreshed yet"
        elif entry.last_success is None:
            states[source] = "never succeeded"
        else:
            states[source] = "ok" if entry.success else "failing (serving last good data)"
    is_ready = all(source in health and health[source].last_success is not None for source in states)
    return is_ready, states


def alerts_document(view: View) -> dict[str, object]:
    """/api/v1/alerts, shaped like Prometheus' own: pending, firing and recently resolved alerts."""
    alerts = [
        {
            "labels": alert.labels,
            "annotations": alert.annotations,
            "state": alert.state,
            "activeAt": iso(alert.active_since),
            "firedAt": iso(alert.fired_at) if alert.fired_at else None,
            "resolvedAt": iso(alert.resolved_at) if alert.resolved_at else None,
            "value": alert.value,
        }
        for alert in view.alerts()
    ]
    return {"status": "success", "data": {"alerts": alerts}}


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _level(ratio: Decimal) -> str:
    return "bad" if ratio >= 1 else "wait" if ratio >= Decimal("0.8") else "ok"


def _gap(ratio: Decimal | None) -> str:
    return "billed, none counted" if ratio is None else f"{ratio:+.2%}"


def _disagreements(result: Reconciliation | None) -> str:
    """The settled days whose bill disagrees with the usage counted (tokens per item, amounts per endpoint)."""
    if result is None or result.last_day is None:
        return "<p>No settled day has been reconciled yet.</p>"
    rows = [
        f"<tr><td>{g.day}</td><td>{html.escape(g.item)}</td><td>tokens</td><td>{g.billed:f}</td>"
        f"<td>{g.counted}</td><td class=bad>{_gap(g.ratio)}</td></tr>"
        for g in result.tokens
        if disagrees(g.ratio)
    ] + [
        f"<tr><td>{a.day}</td><td>{html.escape(a.endpoint_id)}</td><td>amount</td><td>{a.billed:f}</td>"
        f"<td>{a.estimated.quantize(Decimal('0.01'))}</td><td class=bad>{_gap(a.ratio)}</td></tr>"
        for a in result.amounts
        if disagrees(a.ratio)
    ]
    days = len({g.day for g in result.tokens} | {a.day for a in result.amounts})
    if not rows:
        return f"<p class=ok>The {days} settled days reconciled agree with the usage counted (within 0.1%).</p>"
    return (
        f"<p>{len(rows)} figures of {days} settled days disagree with the usage counted:</p>"
        "<table><tr><th>day</th><th>item or endpoint</th><th>what</th><th>billed</th><th>counted or estimated</th>"
        "<th>gap</th></tr>" + "".join(rows) + "</table>"
    )


def _scope(budget: BudgetConfig) -> str:
    what = ", ".join(f"{k}={v}" for k, v in sorted(budget.where.items())) or "account"
    return f"{what} (usage × prices)" if budget.on_usage else what


def landing_page(view: View) -> str:
    now = view.now()
    rows = []
    health = view.latest.health
    for source in view.sources():
        entry = health.get(source)
        if entry is None:
            rows.append(f"<tr><td>{html.escape(source)}</td><td class=wait>pending</td><td>—</td><td></td></tr>")
            continue
        state, css = ("ok", "ok") if entry.success else ("failing", "bad")
        age = _age(now - entry.last_success) + " ago" if entry.last_success else "never"
        rows.append(
            f"<tr><td>{html.escape(source)}</td><td class={css}>{state}</td><td>{age}</td>"
            f"<td>{html.escape(entry.error)}</td></tr>"
        )
    firing = [a for a in view.alerts() if a.state == "firing"]
    alert_rows = "".join(
        f"<tr><td class=bad>{html.escape(a.labels['alertname'])}</td>"
        f"<td>{html.escape(', '.join(f'{k}={v}' for k, v in sorted(a.labels.items()) if k != 'alertname'))}</td>"
        f"<td>{html.escape(a.annotations.get('summary', ''))}</td><td>{_age(now - (a.fired_at or now))}</td></tr>"
        for a in firing
    )
    alerts = (
        "<table><tr><th>alert</th><th>labels</th><th>summary</th><th>firing for</th></tr>" + alert_rows + "</table>"
        if firing
        else "<p>No alert is firing.</p>"
    )
    budget_rows = "".join(
        f"<tr><td>{html.escape(b.name)}</td><td>{html.escape(_scope(b))}"
        + ("<br><span class=bad>matches nothing</span>" if scope_matched(b, view.latest) is False else "")
        + f"</td><td>{html.escape(b.period)}</td><td>{b.amount:f}</td>"
        + (
            f"<td class={_level(r[0])}>{r[0]:.1%}</td><td class={_level(r[1])}>{r[1]:.1%}</td>"
            if r
            else "<td class=wait>—</td><td class=wait>—</td>"
        )
        + "</tr>"
        for b, r in budget_status(view.latest, view.budgets(), view.prices(), view.today())
    )
    budgets = (
        "<table><tr><th>budget</th><th>scope</th><th>period</th><th>amount</th><th>used</th><th>forecast</th></tr>"
        + budget_rows
        + "</table>"
        if budget_rows
        else "<p>No budget is configured.</p>"
    )
    probe_rows = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{html.escape(p.endpoint_id)}</td><td>{html.escape(p.scenario)}</td>"
        f"<td class={'ok' if p.last.success else 'bad'}>{'ok' if p.last.success else html.escape(p.last.reason or '')}"
        f"</td><td>{p.last.duration * 1000:.0f} ms</td>"
        f"<td>{'' if p.last.time_to_first_token is None else f'{p.last.time_to_first_token * 1000:.0f} ms'}</td></tr>"
        for name, p in sorted(view.latest.probes.items())
    )
    probes = (
        "<table><tr><th>probe</th><th>endpoint</th><th>scenario</th><th>last run</th><th>duration</th>"
        "<th>first token</th></tr>" + probe_rows + "</table>"
        if probe_rows
        else "<p>No probe has run.</p>"
    )
    reconciliation = _disagreements(view.latest.reconciliation)
    bills = view.latest.bills
    # The account's monthly budgets: a scoped one against the whole account's bars would mislead.
    monthly = [(b.name, b.amount) for b in view.budgets() if b.period == "month" and not b.where]
    chart = month_chart(bills.current, bills.today, monthly) if bills is not None else "<p>No bills yet.</p>"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>inference-cost-exporter</title>
<style>
body {{ font: 15px/1.5 system-ui, sans-serif; margin: 2rem auto; max-width: 60rem; padding: 0 1rem; color: #1d2330; }}
table {{ border-collapse: collapse; width: 100%; margin-bottom: 2rem; }}
td, th {{ text-align: left; padding: .35rem .6rem; border-bottom: 1px solid #dde2ea; }}
.ok {{ color: #1a7f37; font-weight: 600; }} .bad {{ color: #c62828; font-weight: 600; }} .wait {{ color: #8a6d00; }}
</style></head><body>
<h1>inference-cost-exporter <small>{html.escape(__version__)}</small></h1>
<p><a href="/metrics">Metrics</a> · <a href="/healthz">Health</a> · <a href="/readyz">Readiness</a>
 · <a href="/api/v1/alerts">Alerts (JSON)</a></p>
<h2>This month</h2>
{chart}
<h2>Sources</h2>
<table><tr><th>source</th><th>last refresh</th><th>last success</th><th>error</th></tr>
{"".join(rows)}
</table>
<h2>Budgets</h2>
{budgets}
<h2>Probes</h2>
{probes}
<h2>Firing alerts</h2>
{alerts}
<h2>Bill against usage</h2>
{reconciliation}
</body></html>
"""


MAX_URL = 8192
MAX_HEADER_BYTES = 16384
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
"""A header name (RFC 9110 §5.6.2)."""
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
"""What a header value must not hold (RFC 9110 §5.5): NUL, CR, LF (a folded line) and every other control but tab."""
_DIGITS = re.compile(r"[0-9]+")
_QVALUE = re.compile(r"0(\.[0-9]{0,3})?|1(\.0{0,3})?")
"""A weight (RFC 9110 §12.4.2)."""
_ONCE = ("Content-Length", "Host")
"""Headers a request may hold once: two are two readings of one request (RFC 9112 §3.2, §6.3)."""


def target_path(command: str, target: str) -> str | None:
    """The path a request asks for: its target's in origin form (`/metrics?x`) or absolute form
    (`http://host/metrics`, which RFC 9112 §3.2.2 has a server accept), or `*` for `OPTIONS *`. None for any other
    target, and for one that cannot be parsed (`http://[x/`)."""
    if target == "*" and command == "OPTIONS":
        return target
    try:
        parts = urlsplit(target)
    except ValueError:
        return None
    if target.startswith("/"):
        return parts.path
    if parts.scheme.lower() in ("http", "https") and parts.netloc:
        return parts.path or "/"
    return None


def header_problem(headers: Message) -> str | None:
    """Why a request's headers are refused, or None if they are not.

    What a proxy in front may read another way is refused, not guessed at (RFC 9112 §5.1, §5.2, §6.3): a line that
    is not `name: value` (the stdlib's parser takes it and every line after it for a body, so `Content-Length : 5`
    would go unseen), a folded line, a control character, two Content-Length (or Host), a Content-Length that is not
    one number, and Transfer-Encoding beside Content-Length.
    """
    if headers.defects or headers.get_payload():
        return "a header line that is not NAME: VALUE"
    for name, value in headers.items():
        if not _TOKEN.fullmatch(name):
            return "a header name that is not a token"
        if _CONTROL.search(value):
            return f"a folded line or a control character in {name}"  # (a token: nothing to escape)
    for name in _ONCE:
        if len(headers.get_all(name, [])) > 1:
            return f"more than one {name}"
    length = headers.get("Content-Length")
    if length is not None and not _DIGITS.fullmatch(length.strip(" \t")):
        return "a Content-Length that is not a number"
    if length is not None and "Transfer-Encoding" in headers:
        return "both Transfer-Encoding and Content-Length"
    return None


def accepts_gzip(fields: Sequence[str]) -> bool:
    """Whether a client that sent these Accept-Encoding fields takes gzip, and prefers it at least as much as the
    body as it is (RFC 9110 §12.5.3).

    `gzip;q=0`, or `*;q=0` with no `gzip` of its own, says gzip is not acceptable; `gzip;q=0.5, identity` prefers the
    plain body. Codings and parameters are case-insensitive, `x-gzip` is gzip (§8.4.1.3), and a weight that is not
    one (`q=2`) counts as 0: the plain body is never wrong.
    """
    weights: dict[str, float] = {}
    for element in ",".join(fields).split(","):
        coding, *parameters = (part.strip() for part in element.split(";"))
        if not coding:
            continue
        weight = 1.0
        for parameter in parameters:
            name, _, value = parameter.partition("=")
            if name.strip().lower() == "q":
                value = value.strip()
                weight = float(value) if _QVALUE.fullmatch(value) else 0.0
        coding = coding.lower()
        weights["gzip" if coding == "x-gzip" else coding] = weight
    gzip_weight = weights.get("gzip", weights.get("*", 0.0))
    # Not named, the plain body is acceptable but the least preferred: a client that names gzip gets it.
    identity_weight = weights.get("identity", weights.get("*", 0.0))
    return gzip_weight > 0 and gzip_weight >= identity_weight


class _Handler(BaseHTTPRequestHandler):
    server: ExporterServer
    protocol_version = "HTTP/1.1"
    timeout = 30  # a client that stalls mid-request is dropped, not waited on forever
    target = "/"
    """The path the request asks for, from its checked target (see parse_request)."""
    answered = False
    """Whether this request's response has begun: after that, a crash can only cut the connection."""

    def setup(self) -> None:
        if isinstance(self.request, ssl.SSLSocket):
            self.request.settimeout(self.timeout)
            self.request.do_handshake()
        super().setup()

    def handle(self) -> None:
        """The stdlib's keep-alive loop, with the connection idle between requests (see ExporterServer.enter). A bug
        that escapes a request is a 500 and one log line (see _crashed), not the stdlib's traceback on stderr."""
        self.close_connection = True
        try:
            self._handle_one()
            while not self.close_connection and self._next_request():
                self._handle_one()
        except _CLIENT_GONE:
            raise  # no fault of the server's: ExporterServer.handle_error says it at debug
        except Exception:
            self._crashed()

    def _handle_one(self) -> None:
        self.answered = False
        self.handle_one_request()

    def _next_request(self) -> bool:
        """Wait, idle, for the next request's first byte; its header deadline starts there."""
        if not self.server.enter(self.request, Phase.IDLE):
            return False
        try:
            arrived = bool(self.rfile.peek(1))  # type: ignore[attr-defined]  # a BufferedReader
        except OSError:  # timed out, reset, or a TLS error
            return False
        return arrived and self.server.enter(self.request, Phase.HEADERS)

    def parse_request(self) -> bool:
        """Reads the headers; from then on the header deadline no longer applies. A connection cut meanwhile saw
        its headers end early: that truncated request gets no answer. One the stdlib takes but whose target or
        headers are malformed or ambiguous is refused with a 400 (see target_path and header_problem)."""
        parsed = super().parse_request()
        if not self.server.enter(self.request, Phase.BUSY):
            self.close_connection = True
            return False
        if not parsed:
            return False
        path = target_path(self.command, self.path)
        problem = "a target that is neither a path nor a URL" if path is None else header_problem(self.headers)
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
        log.debug("http request", line=format % args)

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
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _authorised(self) -> bool:
        auth = self.server.credentials.auth  # once: a reload may swap it meanwhile
        if auth is None:
            return True
        scheme, _, encoded = self.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            username, _, password = base64.b64decode(encoded, validate=True).decode("utf-8").partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        expected_user, expected_password = auth
        user_ok = hmac.compare_digest(username.encode(), expected_user)
        return hmac.compare_digest(password.encode(), expected_password) and user_ok

    def do_HEAD(self) -> None:
        self.do_GET()

    def _refuse(self, status: int, reason: str, **headers: str) -> None:
        """Answer `status` and close the connection: what else the client sent is never read, so it cannot be
        taken for a request of its own. One log line, at info: a client's mistake, or someone probing."""
        reason = reason if len(reason) <= REASON else reason[: REASON - 1] + "…"  # the stdlib's echo the request line
        log.info(
            "http request refused", status=status, reason=reason, address=self.client_address[0],
            request=self.requestline[:200],
        )  # fmt: skip
        self.close_connection = True
        body = f"{reason}\n".encode()
        self._send(status, body, "text/plain; charset=utf-8", {"Connection": "close", **headers}, logged=False)

    def _crashed(self) -> None:
        """A bug: one log line, at error, with the traceback as a field; a 500 unless the response has begun (then
        only cutting the connection can tell the client). The connection closes either way: how much of the
        request was read is unknown."""
        log.exception("http request crashed", address=self.client_address[0], request=self.requestline[:200])
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
        path = self.target
        view = self.server.view
        if path not in OPEN_PATHS and not self._authorised():
            self._send(401, b"unauthorised\n", "text/plain", {"WWW-Authenticate": 'Basic realm="exporter"'})
            return
        if path == "/metrics":
            accept = self.headers.get("Accept", "")
            if view.render_gzipped is not None and self._accepts_gzip():
                body, content_type = view.render_gzipped(accept)
                self._send(200, body, content_type, gzipped=True)
            else:
                body, content_type = view.render(accept)
                self._send(200, body, content_type)
        elif path == "/healthz":
            self._send(200, b"ok\n", "text/plain; charset=utf-8")
        elif path == "/readyz":
            is_ready, states = ready(view)
            body = json.dumps({"ready": is_ready, "sources": states}).encode()
            self._send(200 if is_ready else 503, body, "application/json")
        elif path == "/api/v1/alerts":
            self._send(200, json.dumps(alerts_document(view)).encode(), "application/json")
        elif path == "/":
            self._send(200, landing_page(view).encode(), "text/html; charset=utf-8")
        else:
            self._send(404, b"not found\n", "text/plain")
