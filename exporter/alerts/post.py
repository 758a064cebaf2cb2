"""One JSON POST to a receiver, with one deadline for the whole exchange and no redirects.

`requests` bounds each socket read, not the request: a receiver that sends its headers and then
one byte every few seconds would hold a delivery for ever. Here a timer shuts the socket down
when the deadline passes, whatever phase the exchange is in (connect, TLS, headers, body).
A POST is never followed to a 3xx's `Location` (that would turn it into a GET with no body):
the answer's status is the caller's to judge. Proxies from the environment (`HTTPS_PROXY`,
`HTTP_PROXY`, `NO_PROXY`) and requests' CA bundle are honoured as `requests` would.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import ssl
import threading
from dataclasses import dataclass
from functools import cache
from urllib.parse import urlsplit

from requests import certs
from requests.utils import get_environ_proxies

MAX_ANSWER = 64 * 1024
"""How much of a receiver's answer is read (and thrown away)."""


@dataclass(frozen=True)
class Answer:
    status: int
    location: str = ""


class DeadlineExceeded(Exception):
    """No complete answer within the deadline."""


@cache
def _tls() -> ssl.SSLContext:
    cafile = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or certs.where()
    return ssl.create_default_context(cafile=cafile)


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    """A connection for `url` (through the environment's proxy, if any) and the request target."""
    parts = urlsplit(url)
    https = parts.scheme == "https"
    host, port = parts.hostname or "", parts.port or (443 if https else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    proxy = get_environ_proxies(url).get(parts.scheme)
    if proxy:
        via = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        proxy_host, proxy_port = via.hostname or "", via.port or 80
        if https:
            connection = http.client.HTTPSConnection(proxy_host, proxy_port, timeout=timeout, context=_tls())
            connection.set_tunnel(host, port)
            return connection, target
        return http.client.HTTPConnection(proxy_host, proxy_port, timeout=timeout), url
    if https:
        return http.client.HTTPSConnection(host, port, timeout=timeout, context=_tls()), target
    return http.client.HTTPConnection(host, port, timeout=timeout), target


def _cut(connection: http.client.HTTPConnection, fired: threading.Event) -> None:
    fired.set()
    sock = connection.sock
    if sock is not None:
        with contextlib.suppress(OSError):  # already closed
            sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv; close alone would not


def post_json(url: str, body: object, *, deadline: float, headers: dict[str, str]) -> Answer:
    """POST `body` as JSON; the receiver's status (and `Location`), or `DeadlineExceeded`, or an
    `OSError`/`http.client.HTTPException` for a connection that failed."""
    data = json.dumps(body).encode()
    connection, target = _connection(url, deadline)
    fired = threading.Event()
    timer = threading.Timer(deadline, _cut, args=(connection, fired))
    timer.daemon = True
    timer.start()
    try:
        connection.request("POST", target, body=data, headers={"Content-Type": "application/json", **headers})
        response = connection.getresponse()
        body = response.read(MAX_ANSWER)
        if response.length and len(body) < MAX_ANSWER:  # the connection ended before the answer did
            raise http.client.IncompleteRead(body, response.length)
        if fired.is_set():
            raise DeadlineExceeded(f"no complete answer within {deadline:g}s")
        return Answer(response.status, response.getheader("Location") or "")
    except (OSError, http.client.HTTPException):
        if fired.is_set():
            raise DeadlineExceeded(f"no complete answer within {deadline:g}s") from None
        raise
    finally:
        timer.cancel()
        connection.close()
