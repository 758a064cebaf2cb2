"""The server's open connections: capped, each under the deadline of its phase, the longest waiting on its client
evicted at the cap to make room for a new one.

A connection waiting on its client (for its TLS handshake, request line and headers, or kept alive for its next
request) has a deadline (exporter.core.deadline), which shuts its socket down when it passes; one producing a
response has none. Shutting a connection down wakes its thread from recv(), and that thread closes it.
"""

from __future__ import annotations

import enum
import resource
import socket
import threading
import time
from dataclasses import dataclass

from exporter.core.deadline import Deadline
from exporter.core.logs import get_logger

log = get_logger(__name__)

HEADER_DEADLINE = 10.0
"""Seconds a connection gets for its TLS handshake, request line and headers, however steadily it sends; for a later
request on a kept-alive connection, counted from that request's first byte."""
IDLE_DEADLINE = 20.0
"""Seconds a kept-alive connection may wait for its next request: over a 15 s scrape interval, so Prometheus keeps
its connection, and under the per-read timeout."""
MAX_CONNECTIONS = 200
"""Connections open at once; lowered to a quarter of the open-file limit when that is smaller (connection_cap)."""
SLOT_RECHECK = 0.25
"""How often the accept loop, waiting at the cap for a slot, looks again; it is woken when one may have come free."""


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


_WAITING = frozenset({Phase.HEADERS, Phase.IDLE})


@dataclass(slots=True)
class _Connection:
    """An open connection as the accept loop and its deadline see it."""

    address: str
    phase: Phase
    since: float
    """When it entered its phase (monotonic): the longest waiting is evicted first."""
    deadline: Deadline
    """Fired (its time passed, or evicted): cut by the server, its own thread is about to close it."""


class Connections:
    """The open connections, each registered from its accept to its close; thread-safe."""

    def __init__(self, cap: int, header_deadline: float, idle_deadline: float) -> None:
        self.cap = cap
        self._deadlines = {Phase.HEADERS: header_deadline, Phase.IDLE: idle_deadline}
        self.evicted = 0
        """Connections cut to make room for a new one at the cap."""
        self.timed_out = 0
        """Connections cut at their header or idle deadline."""
        self._open: dict[socket.socket, _Connection] = {}
        self._slots = threading.Condition()
        """Guards _open and the counters; notified whenever a slot may have come free. Its lock is re-entrant: an
        eviction holds it while its deadline fires, and _fired takes it again."""

    def __len__(self) -> int:
        with self._slots:
            return len(self._open)

    def wait_for_slot(self, stopping: threading.Event) -> None:
        """At the cap, evict the connection that has waited longest on its client, so a prompt client (a scrape, a
        probe) is always served; while every connection is busy responding, wait rather than go over the cap.
        OSError once `stopping` is set (see wake)."""
        with self._slots:
            while len(self._open) >= self.cap and not stopping.is_set():
                if not any(c.deadline.fired for c in self._open.values()):  # else one is closing: its slot will do
                    waiting = [c for c in self._open.values() if c.phase in _WAITING]
                    if waiting:
                        min(waiting, key=lambda c: c.since).deadline.fire()
                self._slots.wait(SLOT_RECHECK)
            if stopping.is_set():
                raise OSError("server shutting down")

    def wake(self) -> None:
        """Wake wait_for_slot, to see that it should stop waiting."""
        with self._slots:
            self._slots.notify_all()

    def add(self, sock: socket.socket, address: str) -> None:
        """Register a connection just accepted, in its header phase (a TLS handshake counts)."""
        deadline = Deadline(on_fire=lambda expired: self._fired(connection, expired))
        connection = _Connection(address, Phase.HEADERS, time.monotonic(), deadline)
        deadline.watch(sock)
        with self._slots:
            self._open[sock] = connection
            deadline.arm(self._deadlines[Phase.HEADERS])

    def enter(self, sock: socket.socket, phase: Phase) -> bool:
        """Move a connection to `phase`, starting that phase's deadline; False if the server has cut it."""
        with self._slots:
            connection = self._open.get(sock)
            if connection is None or not connection.deadline.arm(self._deadlines.get(phase)):
                return False
            connection.phase, connection.since = phase, time.monotonic()
            self._slots.notify_all()  # an idle connection can now be evicted
            return True

    def remove(self, sock: socket.socket) -> None:
        """Free the slot, before the connection is closed: its deadline is stopped first, so that it never shuts
        down a descriptor reused elsewhere."""
        with self._slots:
            connection = self._open.pop(sock, None)
            if connection is not None:
                connection.deadline.stop()
            self._slots.notify_all()

    def _fired(self, connection: _Connection, expired: bool) -> None:
        """Count a cut before its socket is shut down: the client may see the hang-up before the next line runs."""
        with self._slots:
            if expired:
                self.timed_out += 1
            else:
                self.evicted += 1
            reason = "deadline" if expired else "evicted"
            log.debug("http connection cut", reason=reason, phase=connection.phase.name, address=connection.address)
