"""A deadline over the sockets of one exchange: when it passes, they are shut down.

A socket's timeout bounds each read, not an exchange: a peer that sends a byte every few seconds
would hold a thread for ever. A `Deadline` watches the sockets of one exchange (a POST, an SMTP
session, a connection to the HTTP server) and, when its time passes, shuts them down, which wakes a
thread blocked on them in recv, send or a TLS handshake, where close alone would not. One thread
(`Alarms`) keeps every deadline's time in a heap, so arming and re-arming one is cheap: no thread
per deadline.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from exporter.core.logs import get_logger

log = get_logger(__name__)

Socket = TypeVar("Socket", bound=socket.socket)


class Alarms:
    """When each armed deadline passes: their times in a heap, and a thread that fires each deadline as its time
    comes. `threaded=False` leaves the firing to whoever calls `fire_due` (a test, with a clock of its own)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, *, threaded: bool = True) -> None:
        self.clock = clock
        self._threaded = threaded
        self._heap: list[tuple[float, int, Deadline, int]] = []
        """(when, order of arrival, deadline, the deadline's arming): an arming that is no longer the deadline's
        own is left in place, and skipped when its time comes."""
        self._order = itertools.count()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def set(self, deadline: Deadline, when: float, arming: int) -> None:
        """Fire `deadline` at `when` (on the clock) unless it has been armed again since `arming`."""
        with self._changed:
            order = next(self._order)
            heapq.heappush(self._heap, (when, order, deadline, arming))
            if self._threaded and self._thread is None:  # started on first use: importing starts no thread
                self._thread = threading.Thread(target=self._run, name="deadlines", daemon=True)
                self._thread.start()
            if self._heap[0][1] == order:  # the thread may be waiting for a later time
                self._changed.notify()

    def fire_due(self) -> None:
        """Fire each deadline whose time has come."""
        with self._changed:
            now = self.clock()
            due = []
            while self._heap and self._heap[0][0] <= now:
                due.append(heapq.heappop(self._heap))
        for _, _, deadline, arming in due:  # out of the lock: a deadline's own lock is taken before it (see arm)
            try:
                deadline._fire(expired=True, arming=arming)
            except Exception:  # a bug in an on_fire: the other deadlines still fire
                log.exception("deadline on_fire crashed")

    def _run(self) -> None:
        while True:
            self.fire_due()
            with self._changed:
                if self._heap:  # (a time already past returns at once; one too far off would raise)
                    self._changed.wait(min(self._heap[0][0] - self.clock(), threading.TIMEOUT_MAX))
                else:
                    self._changed.wait()


ALARMS = Alarms()


class Deadline:
    """A deadline over the sockets of one exchange; thread-safe.

    Armed for `seconds` from now (or not armed, with None), it fires when that time passes, unless it is armed
    again meanwhile or stopped. Firing shuts down every watched socket (the plain socket's shutdown, on a TLS socket
    too, which wakes a thread blocked on it) and any socket watched after. `on_fire(expired)` runs once, as it
    fires and before any socket is shut down (a peer sees the hang-up only after it), with no lock of the deadline's
    held: on the alarms' thread when its time passed (expired), in the caller of `fire` otherwise.
    """

    def __init__(
        self,
        seconds: float | None = None,
        *,
        on_fire: Callable[[bool], None] | None = None,
        alarms: Alarms = ALARMS,
    ) -> None:
        self._alarms = alarms
        self._on_fire = on_fire
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._when: float | None = None
        self._arming = 0
        self._fired = False
        self._shut = False
        self._stopped = False
        if seconds is not None:
            self.arm(seconds)

    @property
    def fired(self) -> bool:
        """Whether it has fired (its time passed, or `fire` was called): the exchange was cut."""
        return self._fired

    @property
    def passed(self) -> bool:
        """Whether its time has come: fired, or due and not yet fired by the alarms' thread (an exchange that
        timed out on its own at the time left ended because of the deadline too)."""
        return self.remaining() == 0.0

    def remaining(self) -> float:
        """Seconds until it passes: 0 once it has fired, infinity while it is not armed."""
        with self._lock:
            if self._fired:
                return 0.0
            if self._when is None:
                return math.inf
            return max(0.0, self._when - self._alarms.clock())

    def arm(self, seconds: float | None) -> bool:
        """Pass `seconds` from now, instead of when it was to (None: never, until armed again). False, changing
        nothing, once it has fired or been stopped."""
        with self._lock:
            if self._fired or self._stopped:
                return False
            self._arming += 1
            self._when = None if seconds is None else self._alarms.clock() + seconds
            if self._when is not None:
                self._alarms.set(self, self._when, self._arming)
            return True

    def watch(self, sock: Socket) -> Socket:
        """Shut `sock` down when the deadline fires, at once if it has; `sock` itself, to use in an expression."""
        with self._lock:
            self._sockets.append(sock)
            if self._shut:
                _shut_down(sock)
        return sock

    def unwatch(self, sock: socket.socket) -> None:
        """No longer shut `sock` down when the deadline fires (a connection going back to a pool,
        for another request to use)."""
        with self._lock:
            if sock in self._sockets:
                self._sockets.remove(sock)

    def fire(self) -> bool:
        """Fire now, as if its time had passed; False if it had fired or been stopped already."""
        return self._fire(expired=False)

    def stop(self) -> None:
        """Never fire, nor shut a socket down, after this returns: call it before closing a watched socket, whose
        number may be another file's once it is closed."""
        with self._lock:
            self._stopped = True

    def close(self) -> None:
        """Stop, then close every watched socket."""
        with self._lock:
            self._stopped = True
            sockets = list(self._sockets)
        for sock in sockets:
            sock.close()

    def _fire(self, *, expired: bool, arming: int | None = None) -> bool:
        """Fire, unless it has fired or been stopped, or (for the alarm set at `arming`) been armed again since."""
        with self._lock:
            if self._fired or self._stopped or (arming is not None and arming != self._arming):
                return False
            self._fired = True  # from here, arm says the exchange is cut
        try:
            if self._on_fire is not None:
                self._on_fire(expired)
        finally:
            with self._lock:
                if not self._stopped:
                    self._shut = True
                    for sock in self._sockets:
                        _shut_down(sock)
        return True


def _shut_down(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # closed already, or the peer has gone
        # The plain socket's shutdown, on a TLS socket too: SSLSocket's own would also drop the SSL object that
        # the exchange's thread is using.
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
