"""Host name lookups that end with the exchange's deadline.

`socket.getaddrinfo` cannot be interrupted: a resolver that does not answer holds its caller for
as long as its own timeouts and retries say (often tens of seconds), and one that hangs for ever.
No deadline over the exchange's sockets can cut it, for there is no socket yet. So a lookup runs in
a thread of its own while its caller waits no longer than its time left (`TimeLeft`: a deadline's
`remaining`, which is 0 once a client's close fires it). A lookup of the same name and port
already under way is waited for, not started again: a resolver that hangs holds one thread per
name and port, however many exchanges try it meanwhile. Its answer (not a failure) is kept for
`KEPT` seconds after it ends, for the next exchanges: a resolver slower than every deadline would
otherwise fail each of them, each starting the lookup again.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from functools import partial
from typing import Any, TypeVar, cast

from exporter.core.deadline import Deadline

TimeLeft = Callable[[], float]
"""Seconds the caller may still wait: 0 when it may no longer, infinity when nothing bounds it."""

Found = list[tuple[Any, ...]]
"""`getaddrinfo`'s answer: (family, type, proto, canonname, sockaddr) each."""

T = TypeVar("T")

WAKE = 0.05
"""How often a wait looks at its time left again (a deadline fired by a client's close is seen)."""
KEPT = 30.0
"""How long a lookup's answer is taken again once it has ended (a failure is not: a retry asks the
resolver again, as a transient fault may be over)."""


class LookupTimeout(TimeoutError):
    """The lookup did not end within the time left (the host is not named: the caller says what
    it was connecting to)."""


_lock = threading.Lock()
_lookups: dict[tuple[object, ...], tuple[Future[Any], float]] = {}
"""Each lookup under way, or ended with an answer: its future, and until when (on the monotonic
clock) it is taken again: infinity while it is under way."""


def _answered(key: tuple[object, ...], call: Callable[[], T], time_left: TimeLeft, kept: float = KEPT) -> T:
    """What `call` returns (or raises), waited for while `time_left()` is above 0, else
    `LookupTimeout`; run in a thread of its own, shared by the callers of the same `key` while it
    lasts (it goes on after a caller stops waiting, for the next to take), its answer taken again
    for `kept` seconds after it ends."""
    with _lock:
        entry = _lookups.get(key)
        if entry is not None and time.monotonic() <= entry[1]:  # (under way, or kept)
            found = entry[0]
        else:
            found = Future()
            try:
                threading.Thread(target=_run, args=(key, call, found, kept), name="lookup", daemon=True).start()
            except RuntimeError as error:  # (no thread to be had: nothing is left under way)
                raise OSError(f"the lookup could not start ({error})") from None
            _lookups[key] = (found, math.inf)
    while True:
        if found.done():
            return cast(T, _taken(found))
        left = time_left()
        if left <= 0:
            raise LookupTimeout("the lookup did not end in time")
        wait([found], timeout=min(left, WAKE))


def _taken(found: Future[Any]) -> Any:
    """An ended lookup's answer, or its failure raised afresh: every caller waiting for it raises
    it, and each raise would add to the one exception's traceback (and to the frames it holds)."""
    error = found.exception()
    if error is None:
        return found.result()
    try:
        fresh = type(error)(*error.args)
    except Exception:  # (an exception that cannot be made from its args: raised without its traceback)
        fresh = error.with_traceback(None)
    raise fresh from None


def _run(key: tuple[object, ...], call: Callable[[], object], future: Future[Any], kept: float) -> None:
    """Make the lookup; no longer under way before its waiters hear of it (a caller after a failure
    asks again), its answer kept while `kept`."""
    try:
        answer, error = call(), None
    except BaseException as failed:  # (a gaierror, a UnicodeError: the waiters' to raise)
        answer, error = None, failed
    with _lock:
        now = time.monotonic()
        for old in [k for k, (_, until) in _lookups.items() if now > until]:
            del _lookups[old]
        if error is None:
            _lookups[key] = (future, now + kept)
        else:
            _lookups.pop(key, None)
    if error is None:
        future.set_result(answer)
    else:
        future.set_exception(error)


def under_way() -> list[tuple[object, ...]]:
    """The lookups under way now."""
    with _lock:
        return [key for key, (found, _) in _lookups.items() if not found.done()]


def getaddrinfo(host: str, port: int, time_left: TimeLeft, family: int = 0, kind: int = socket.SOCK_STREAM) -> Found:
    """`socket.getaddrinfo(host, port, family, kind)`, or `LookupTimeout` once `time_left()` is 0
    before it answers. An address needs no lookup, and is answered at once."""
    if _is_address(host):
        return socket.getaddrinfo(host, port, family, kind)
    return _answered(
        ("getaddrinfo", host, port, family, kind), partial(socket.getaddrinfo, host, port, family, kind), time_left
    )


def fqdn(time_left: TimeLeft) -> str:
    """`socket.getfqdn()`, this machine's fully qualified name (a reverse lookup), looked up once
    and kept for good (a lookup that outlasts its callers' waits too). `LookupTimeout` while none
    has ended."""
    return _answered(("getfqdn",), socket.getfqdn, time_left, kept=math.inf)


def create_connection(
    address: tuple[str, int], timeout: Any, source_address: Any = None, *, time_left: TimeLeft
) -> socket.socket:
    """`socket.create_connection`, to each address of the host in turn, its name looked up within
    `time_left` (`addresses`)."""
    host, port = address
    error: OSError = OSError("the host name has no address")
    for found in addresses(host, port, time_left):
        try:
            return socket.create_connection((found, port), timeout, source_address)
        except OSError as failed:
            error = failed
    raise error


def addresses(host: str, port: int, time_left: TimeLeft, family: int = 0) -> list[str]:
    """The addresses `host` has (`getaddrinfo` within `time_left`), each once, in its order."""
    return list(dict.fromkeys(str(info[4][0]) for info in getaddrinfo(host, port, time_left, family)))


def within(*limits: float | None, deadlines: Sequence[Deadline] = ()) -> TimeLeft:
    """The time left under each of `deadlines` and of `limits` seconds from now (None: no
    limit), whichever is least."""
    ends = [time.monotonic() + limit for limit in limits if limit is not None]

    def time_left() -> float:
        now = time.monotonic()
        return min([math.inf, *(end - now for end in ends), *(d.remaining() for d in deadlines)])

    return time_left


def _is_address(host: str) -> bool:
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host.partition("%")[0])
            return True
        except (OSError, ValueError):
            continue
    return False
