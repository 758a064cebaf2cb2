"""One JSON POST to a receiver, with one deadline for the whole exchange and no redirects.

`requests` bounds each socket read, not the request: a receiver that sends its headers and then
one byte every few seconds would hold a delivery for ever. Here a `Deadline` shuts the socket
down when it passes, whatever phase the exchange is in (connect, TLS handshake, headers, body);
each step also waits at most for the time left, the host name's lookup too (`core.lookup`: it
goes on in a thread of its own, which the deadline does not wait for). A POST is never followed
to a 3xx's `Location` (that would turn it into a GET with no body): the answer's status is the
caller's to judge. Credentials in the URL (`https://user:pass@host/…`), proxies from the
environment (`HTTPS_PROXY`, `HTTP_PROXY`, `NO_PROXY`, with their credentials) and requests' CA
bundle are honoured as `requests` would.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any
from urllib.parse import SplitResult, unquote, urlsplit

from requests.utils import DEFAULT_CA_BUNDLE_PATH, get_environ_proxies

from exporter.core import lookup
from exporter.core.deadline import Deadline
from exporter.core.fields import ascii_host
from exporter.core.net import retry_after

MAX_ANSWER = 64 * 1024
"""How much of a receiver's answer is read (and thrown away)."""


@dataclass(frozen=True)
class Answer:
    status: int
    location: str = ""
    retry_after: float | None = None
    """The seconds its `Retry-After` asks to wait (as seconds or as an HTTP date), if it says."""


class DeadlineExceeded(Exception):
    """No complete answer within the deadline."""


@cache
def _tls() -> ssl.SSLContext:
    cafile = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or DEFAULT_CA_BUNDLE_PATH
    return ssl.create_default_context(cafile=cafile)


def _basic(parts: SplitResult, header: str = "Authorization") -> dict[str, str]:
    """A basic-auth header for credentials written in a URL, if any."""
    if parts.username is None:
        return {}
    pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
    return {header: "Basic " + base64.b64encode(pair).decode()}


class _HTTPConnection(http.client.HTTPConnection):
    """Each socket it opens watched by the deadline from the moment it exists, so that every
    phase after the TCP connect can be cut: a proxy's CONNECT, the request, the answer."""

    def __init__(self, host: str, port: int, timer: Deadline, address: str | None = None, **options: Any) -> None:
        super().__init__(host, port, timeout=timer.remaining(), **options)
        self.timer = timer
        self.address = address
        """The IP address to connect to instead of the host's (see `peers`): its name is still the
        one the request and TLS give."""
        self._create_connection = self._watched  # what http.client opens its socket with

    def _watched(self, address: tuple[str, int], *options: Any) -> socket.socket:
        if self.address is not None:
            address = (self.address, address[1])
        return self.timer.watch(lookup.create_connection(address, *options, time_left=self.timer.remaining))


class _HTTPSConnection(_HTTPConnection, http.client.HTTPSConnection):
    """The TLS handshake done once the TLS socket is watched, so the deadline can shut it down
    mid-handshake (during `wrap_socket` the plain socket is already detached)."""

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)  # TCP, and the proxy's CONNECT tunnel if any
        hostname = self._tunnel_host or self.host  # type: ignore[attr-defined]
        tls = self._context.wrap_socket(  # type: ignore[attr-defined]
            self.sock, server_hostname=hostname, do_handshake_on_connect=False
        )
        self.sock = self.timer.watch(tls)
        self.sock.do_handshake()


def _port(parts: SplitResult, whose: str) -> int | None:
    """The port an address gives (None without one); InvalidURL, naming no address (it may hold a
    secret), for one out of range."""
    try:
        return parts.port
    except ValueError:
        raise http.client.InvalidURL(f"{whose} port is not a number from 1 to 65535") from None


def _reached(url: str) -> tuple[SplitResult, str, int, str, str | None]:
    """How `url` is reached: its parts, its host (as sent: IDNA's xn-- form) and port, the URL
    written with them (no credentials: what NO_PROXY names), and the environment's proxy for it, if
    any. InvalidURL for a host or a port that cannot be sent."""
    parts = urlsplit(url)
    host, port = ascii_host(parts.hostname or ""), _port(parts, "the URL's") or (443 if parts.scheme == "https" else 80)
    if host is None:
        raise http.client.InvalidURL("the URL's host name cannot be written in IDNA's xn-- form")
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    written = parts._replace(netloc=netloc).geturl()
    return parts, host, port, written, get_environ_proxies(written).get(parts.scheme)


def _connection(
    url: str, timer: Deadline, address: str | None = None
) -> tuple[http.client.HTTPConnection, str, dict[str, str]]:
    """A connection for `url` (through the environment's proxy, if any) whose sockets `timer`
    watches, the request target, and the headers the URL itself asks for (credentials); `address`:
    the IP address to reach its host at (never through a proxy: `peers` gives none then)."""
    parts, host, port, written, proxy = _reached(url)
    https = parts.scheme == "https"
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    headers = _basic(parts)
    if not proxy:
        if https:
            return _HTTPSConnection(host, port, timer, address, context=_tls()), target, headers
        return _HTTPConnection(host, port, timer, address), target, headers
    try:
        via = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    except ValueError:  # (the environment's: the config's URLs are checked)
        raise http.client.InvalidURL("the URL or its proxy's address cannot be read") from None
    proxy_auth = _basic(via, "Proxy-Authorization")
    proxy_host, proxy_port = via.hostname or "", _port(via, "the proxy's") or 80
    if https:
        connection = _HTTPSConnection(proxy_host, proxy_port, timer, context=_tls())
        connection.set_tunnel(host, port, headers=proxy_auth)
        return connection, target, headers
    return _HTTPConnection(proxy_host, proxy_port, timer), written, headers | proxy_auth  # (credentials: a header)


def peers(
    url: str, resolve: Callable[..., list[Any]] | None = None, *, within: float | None = None
) -> list[str | None]:
    """The IP addresses `url`'s host name resolves to, each once (IPv4's, when it has some), to POST
    to each (the peers of a cluster behind one name: a Kubernetes headless Service); [None], to POST
    to the URL as it is, when its host is an address, is reached through a proxy, resolves to one
    address, or does not resolve (the POST then fails, saying so), nor within `within` seconds
    (`core.lookup`; `resolve`, a `getaddrinfo` of a test's, has no time limit)."""
    try:
        _, host, port, _, proxy = _reached(url)
    except http.client.InvalidURL:
        return [None]
    if proxy or not host or ":" in host or host.replace(".", "").isdigit():
        return [None]
    try:
        if resolve is None:
            found = lookup.getaddrinfo(host, port, lookup.within(within))
        else:
            found = resolve(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return [None]
    v4 = [str(info[4][0]) for info in found if info[0] == socket.AF_INET]
    addresses: list[str | None] = list(dict.fromkeys(v4 or [str(info[4][0]) for info in found]))
    return addresses if len(addresses) > 1 else [None]


def post_json(
    url: str, body: object, *, deadline: float, headers: dict[str, str], address: str | None = None
) -> Answer:
    """POST `body` as JSON (to the host at `address`, one of its `peers`, when given); the
    receiver's status (and `Location`) once its whole answer is in, or `DeadlineExceeded`, or an
    `OSError`/`http.client.HTTPException` for a connection that failed."""
    data = json.dumps(body).encode()
    timer = Deadline(deadline)
    try:
        connection, target, url_headers = _connection(url, timer, address)
    except http.client.InvalidURL:
        timer.close()
        raise
    try:
        connection.connect()
        if timer.passed:  # the deadline passed while connecting, before there was a socket to cut
            raise DeadlineExceeded(f"no complete answer within {deadline:g}s")
        connection.sock.settimeout(max(0.001, timer.remaining()))
        connection.request(
            "POST", target, body=data, headers={"Content-Type": "application/json", **url_headers, **headers}
        )
        response = connection.getresponse()
        answer = response.read(MAX_ANSWER)
        if response.length and len(answer) < MAX_ANSWER:  # the connection ended before the answer did
            raise http.client.IncompleteRead(answer, response.length)
        if response.length is None and not response.chunked and timer.fired:
            # An answer whose end is the connection's: cut by the deadline, it only looks whole.
            raise DeadlineExceeded(f"no complete answer within {deadline:g}s")
        asked = retry_after(response.getheader("Retry-After"), time.time()) if response.status in (429, 503) else None
        return Answer(response.status, response.getheader("Location") or "", asked)
    except (OSError, http.client.HTTPException):
        if timer.passed:  # cut, or a socket timeout (set to the time left) that came before the cut
            raise DeadlineExceeded(f"no complete answer within {deadline:g}s") from None
        raise
    finally:
        timer.close()  # no cut after this, then the sockets closed (in that order: see Deadline.stop)
        connection.close()
