"""The routes: the response each path gets, and the paths open without credentials."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from email.message import Message

from exporter.metrics.exposition import negotiated
from exporter.web.page import landing_page
from exporter.web.parsing import accepts_gzip
from exporter.web.views import View, alerts_document, awaited, ready, reconciliation_document

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
"""Liveness and readiness stay reachable without credentials, for orchestrators' probes."""


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    content_type: str
    gzipped: bool = False
    """The body is one gzip member already."""
    vary: str = "Accept-Encoding"
    """The request headers the body depends on (a cache in front keeps one body for each): gzip or not."""


def _metrics(view: View, headers: Message) -> Response:
    accept = negotiated(headers.get("Accept", ""))
    vary = "Accept, Accept-Encoding"  # (OpenMetrics or the text format, too)
    if view.render_gzipped is not None and accepts_gzip(headers.get_all("Accept-Encoding", [])):
        return Response(200, *view.render_gzipped(accept), gzipped=True, vary=vary)
    return Response(200, *view.render(accept), vary=vary)


def _health(view: View, headers: Message) -> Response:
    return Response(200, b"ok\n", "text/plain; charset=utf-8")


def _ready(view: View, headers: Message) -> Response:
    is_ready, states = ready(view)
    body = json.dumps({"ready": is_ready, "sources": states, "waits_for": awaited(view)}).encode()
    return Response(200 if is_ready else 503, body, "application/json")


def _alerts(view: View, headers: Message) -> Response:
    return Response(200, json.dumps(alerts_document(view)).encode(), "application/json")


def _reconciliation(view: View, headers: Message) -> Response:
    return Response(200, json.dumps(reconciliation_document(view)).encode(), "application/json")


def _landing_page(view: View, headers: Message) -> Response:
    return Response(200, landing_page(view).encode(), "text/html; charset=utf-8")


ROUTES: dict[str, Callable[[View, Message], Response]] = {
    "/metrics": _metrics,
    "/healthz": _health,
    "/readyz": _ready,
    "/api/v1/alerts": _alerts,
    "/api/v1/reconciliation": _reconciliation,
    "/": _landing_page,
}
"""Each path's response, from the view and the request's headers."""
_NOT_FOUND = Response(404, b"not found\n", "text/plain")


def respond(view: View, path: str, headers: Message) -> Response:
    """The response to a GET of `path` (credentials checked already)."""
    route = ROUTES.get(path)
    return _NOT_FOUND if route is None else route(view, headers)
