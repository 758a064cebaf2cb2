"""requests' connections whose sockets a `Deadline` watches while a request is made (`watching`).

A socket's timeout bounds each read, not an exchange: a server that drips its headers or its body a
byte at a time would hold a request for as long as it likes, and a client's `close` could not end a
request already on the wire. A session whose adapter is a `WatchedAdapter` hands each connection's
socket to the deadlines the thread named with `watching`, so that one firing (its time passed, or
fired by the client's close) shuts the socket down and the request ends at once.
"""

from __future__ import annotations

import math
import socket
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import urllib3
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.exceptions import ConnectTimeoutError, LocationParseError, NameResolutionError, NewConnectionError
from urllib3.util.connection import allowed_gai_family

from exporter.core import lookup
from exporter.core.deadline import Deadline

_WATCHING = threading.local()
"""`answer`: the deadlines over the request this thread makes (see `watching`), which watch its
connection's socket from the moment its answer is awaited; `connecting`: those that watch a new
connection's socket from the moment it is made, through a copy of it (`copies`)."""


class Exchange:
    """How far the request made under `watching` got."""

    sent = False
    """Whether it was sent: its connection made (a proxy's CONNECT and the TLS handshake too) and the
    request written, its answer awaited. A deadline that fired before is one of connecting."""


@contextmanager
def watching(
    answer: Sequence[Deadline], connecting: Sequence[Deadline] = (), copies: list[socket.socket] | None = None
) -> Iterator[Exchange]:
    """While a request is made in this thread through a `WatchedAdapter`: each of `answer` watches
    its connection's socket (a kept-alive connection's too) from the moment the request is sent, and
    each of `connecting` a new connection's from the moment it is made, through a copy (`dup`: the
    same connection under a descriptor of its own) put in `copies`, since the TLS handshake or a
    proxy's CONNECT wraps the socket made in another. The caller closes the copies once those
    deadlines are stopped (`Deadline.stop`: a closed descriptor's number may be another file's)."""
    exchange = Exchange()
    _WATCHING.answer, _WATCHING.connecting = tuple(answer), tuple(connecting)
    _WATCHING.copies = copies if copies is not None else []
    _WATCHING.exchange = exchange
    try:
        yield exchange
    finally:
        _WATCHING.answer = _WATCHING.connecting = ()
        _WATCHING.copies = _WATCHING.exchange = None


class Cuts:
    """The deadlines over a client's exchanges in flight, which `cut` fires (the client closed): each
    is held while its exchange lasts (`over`), and one that comes after the cut fires at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[Deadline] = set()
        self.cutting = False
        """Whether `cut` has been called."""

    def cut(self) -> None:
        """Fire every deadline held, and any held from now on."""
        with self._lock:
            self.cutting = True
            live = list(self._live)
        for deadline in live:
            deadline.fire()

    @contextmanager
    def over(self, deadline: Deadline) -> Iterator[list[socket.socket]]:
        """Hold `deadline` over an exchange; the list of copies to give `watching`, closed at the end,
        after the deadline is stopped (a closed descriptor's number may be another file's)."""
        copies: list[socket.socket] = []
        with self._lock:
            self._live.add(deadline)
            cutting = self.cutting
        try:
            if cutting:  # (cut since the exchange last looked)
                deadline.fire()
            yield copies
        finally:
            deadline.stop()
            with self._lock:
                self._live.discard(deadline)
            for copy in copies:
                copy.close()


def plain_socket(sock: Any) -> socket.socket | None:
    """What a deadline shuts down of a connection's `sock`: itself, or, for TLS inside TLS (an
    HTTPS endpoint through an HTTPS proxy), the socket under urllib3's `SSLTransport`, which is no
    socket of its own."""
    while sock is not None and not isinstance(sock, socket.socket):
        sock = getattr(sock, "socket", None)
    return sock


class _Watched:
    """A connection whose socket the thread's deadlines watch (`watching`), and that keeps hold of
    it (`kept`): http.client lets go of it when a response will close the connection (a stream
    delimited by the connection's end), and a caller may set each read's timeout on it."""

    kept: Any = None
    watched: list[tuple[Deadline, socket.socket]] | None = None
    """The deadlines watching this connection's socket (or a copy of it), and what each watches:
    `unwatched` when it goes back to the pool."""

    def _watch(self, deadline: Deadline, sock: socket.socket) -> None:
        deadline.watch(sock)
        if self.watched is None:
            self.watched = []
        self.watched.append((deadline, sock))

    def unwatched(self) -> None:
        """No deadline of the request that used it shuts it down now: another request may take it."""
        for deadline, sock in self.watched or ():
            deadline.unwatch(sock)
        self.watched = None

    def _new_conn(self) -> Any:
        connecting: tuple[Deadline, ...] = getattr(_WATCHING, "connecting", ())
        sock = self._connected(connecting)
        if connecting:
            copy = sock.dup()
            _WATCHING.copies.append(copy)
            for deadline in connecting:
                self._watch(deadline, copy)
        return sock

    def _connected(self, connecting: tuple[Deadline, ...]) -> Any:
        """urllib3's new connection, to each address of the host in turn, its name looked up within
        the connect timeout and the time `connecting` leave (`core.lookup`): urllib3's own lookup
        has no time limit, and no deadline can cut it, there being no socket yet."""
        conn: Any = self  # (an urllib3 connection: this class is mixed into one)
        name: str = conn._dns_host
        limit = conn.timeout if isinstance(conn.timeout, int | float) else None
        time_left = lookup.within(limit, deadlines=connecting)
        try:
            found = lookup.addresses(name.strip("[]"), conn.port, time_left, allowed_gai_family())
        except lookup.LookupTimeout:
            message = f"Connection to {conn.host} timed out. (its name's lookup did not end in time)"
            raise ConnectTimeoutError(conn, message) from None
        except socket.gaierror as error:
            raise NameResolutionError(conn.host, conn, error) from error
        except UnicodeError:  # (a label empty or too long: urllib3's words for it)
            raise LocationParseError(f"'{name}', label empty or too long") from None
        failed: Exception = NewConnectionError(conn, "Failed to establish a new connection: the name has no address")
        timeout = conn.timeout
        for address in found:
            left = time_left()  # (the lookup took its share: connecting has what is left)
            conn._dns_host, conn.timeout = address, timeout if left == math.inf else max(left, 0.001)
            try:
                return super()._new_conn()  # type: ignore[misc]
            except (ConnectTimeoutError, NewConnectionError) as error:
                failed = error
            finally:
                conn._dns_host, conn.timeout = name, timeout
        raise failed

    def connect(self) -> None:
        super().connect()  # type: ignore[misc]
        self.kept = self.sock  # type: ignore[attr-defined]

    def getresponse(self, *args: Any, **kwargs: Any) -> Any:
        answer: tuple[Deadline, ...] = getattr(_WATCHING, "answer", ())
        exchange = getattr(_WATCHING, "exchange", None)
        if exchange is not None and not any(deadline.passed for deadline in answer):  # (else sent too late)
            exchange.sent = True
        if answer and (sock := plain_socket(self.sock)) is not None:  # type: ignore[attr-defined]
            for deadline in answer:
                self._watch(deadline, sock)
        return super().getresponse(*args, **kwargs)  # type: ignore[misc]


class _Connection(_Watched, HTTPConnection):
    pass


class _TLSConnection(_Watched, HTTPSConnection):
    pass


class _Unwatching:
    """A pool whose connections, put back, are no longer watched by the deadlines of the request
    that used them: one firing late (its request's body just read) would cut the next request."""

    def _put_conn(self, conn: Any) -> None:
        if isinstance(conn, _Watched):
            conn.unwatched()
        super()._put_conn(conn)  # type: ignore[misc]


class _Pool(_Unwatching, urllib3.HTTPConnectionPool):
    ConnectionCls = _Connection


class _TLSPool(_Unwatching, urllib3.HTTPSConnectionPool):
    ConnectionCls = _TLSConnection


_POOLS = {"http": _Pool, "https": _TLSPool}


class WatchedAdapter(HTTPAdapter):
    """requests' adapter, its connections `_Watched` (through an HTTP proxy too; a SOCKS proxy's are
    not, and no deadline cuts them: each read has only its timeout)."""

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = _POOLS

    def proxy_manager_for(self, proxy: str, **kwargs: Any) -> Any:
        manager = super().proxy_manager_for(proxy, **kwargs)
        if not proxy.lower().startswith("socks"):
            manager.pool_classes_by_scheme = _POOLS
        return manager
