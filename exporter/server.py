"""HTTP: landing page, /metrics, /healthz, /readyz; optional TLS and basic auth.

A threaded server: a slow client never holds up a scrape, and a scrape only renders the
current snapshots (it never waits on the API).
"""

from __future__ import annotations

import base64
import gzip
import hmac
import html
import json
import logging
import ssl
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from exporter import __version__
from exporter.alerts.engine import Alert, iso
from exporter.collectors import budget_status
from exporter.config import BudgetConfig, ServerConfig
from exporter.snapshots import Latest

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
"""Liveness and readiness stay reachable without credentials, for orchestrators' probes."""


@dataclass(frozen=True)
class View:
    """What the server shows; callables, so a config reload is seen at once."""

    latest: Latest
    render: Callable[[str], tuple[bytes, str]]
    """The exposition for an `Accept` header, and its content type."""
    sources: Callable[[], Sequence[str]]
    alerts: Callable[[], Sequence[Alert]] = list
    budgets: Callable[[], Sequence[BudgetConfig]] = tuple
    now: Callable[[], float] = time.time
    """The billing clock's time, which the sources' timestamps are in."""


class ExporterServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], view: View, config: ServerConfig) -> None:
        super().__init__(address, _Handler)
        self.view = view
        self.auth: tuple[str, str] | None = None
        if config.basic_auth is not None:
            self.auth = (config.basic_auth.username, config.basic_auth.password.get_secret_value())
        self.scheme = "http"
        if config.tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(config.tls.cert_file, config.tls.key_file)
            # The handshake happens in the request's own thread (see _Handler.setup), so a client
            # that connects and says nothing cannot hold up the accept loop.
            self.socket = context.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)
            self.scheme = "https"
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = "127.0.0.1" if host in ("", "0.0.0.0") else host  # noqa: S104 - display only
        host = f"[{host}]" if ":" in str(host) else host
        return f"{self.scheme}://{host}:{port}"

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up or fails the TLS handshake is its own problem, not a server error."""
        error = sys.exc_info()[1]
        if isinstance(error, ConnectionError | ssl.SSLError | TimeoutError):
            log.debug("http client dropped address=%s error=%r", client_address[0], str(error))
            return
        super().handle_error(request, client_address)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, args=(0.1,), name="http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


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
        f"<tr><td>{html.escape(b.name)}</td><td>{html.escape(b.period)}</td><td>{b.amount:f}</td>"
        + (
            f"<td class={_level(r[0])}>{r[0]:.1%}</td><td class={_level(r[1])}>{r[1]:.1%}</td>"
            if r
            else "<td class=wait>—</td><td class=wait>—</td>"
        )
        + "</tr>"
        for b, r in budget_status(view.latest, view.budgets())
    )
    budgets = (
        "<table><tr><th>budget</th><th>period</th><th>amount</th><th>used</th><th>forecast</th></tr>"
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
</body></html>
"""


MAX_URL = 8192
MAX_HEADER_BYTES = 16384


class _Handler(BaseHTTPRequestHandler):
    server: ExporterServer
    protocol_version = "HTTP/1.1"
    timeout = 30  # a client that stalls mid-request is dropped, not waited on forever

    def setup(self) -> None:
        if isinstance(self.request, ssl.SSLSocket):
            self.request.settimeout(self.timeout)
            self.request.do_handshake()
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("http %s", format % args)

    def _send(self, status: int, body: bytes, content_type: str, **headers: str) -> None:
        if "gzip" in self.headers.get("Accept-Encoding", "") and len(body) > 1024:
            body = gzip.compress(body, compresslevel=5)
            headers["Content-Encoding"] = "gzip"
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _authorised(self) -> bool:
        if self.server.auth is None:
            return True
        scheme, _, encoded = self.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            username, _, password = base64.b64decode(encoded, validate=True).decode("utf-8").partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        expected_user, expected_password = self.server.auth
        user_ok = hmac.compare_digest(username.encode(), expected_user.encode())
        return hmac.compare_digest(password.encode(), expected_password.encode()) and user_ok

    def do_HEAD(self) -> None:
        self.do_GET()

    def _refuse(self, status: int, reason: str, **headers: str) -> None:
        self.close_connection = True
        self._send(status, f"{reason}\n".encode(), "text/plain", Connection="close", **headers)

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
        if self.headers.get("Content-Length", "0") != "0" or "Transfer-Encoding" in self.headers:
            self._refuse(413, "this server takes no request body")
            return
        path = urlsplit(self.path).path
        view = self.server.view
        if path not in OPEN_PATHS and not self._authorised():
            self._send(401, b"unauthorised\n", "text/plain", **{"WWW-Authenticate": 'Basic realm="exporter"'})
            return
        if path == "/metrics":
            body, content_type = view.render(self.headers.get("Accept", ""))
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
