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
_under_way: dict[tuple[object, ...], Future[Any]] = {}
_ended: dict[tuple[object, ...], tuple[float, Future[Any]]] = {}
"""The lookups that have ended, each with when (on the monotonic clock), while KEPT."""


def _answered(key: tuple[object, ...], call: Callable[[], T], time_left: TimeLeft) -> T:
    """What `call` returns (or raises), waited for while `time_left()` is above 0, else
    `LookupTimeout`; run in a thread of its own, shared by the callers of the same `key` while it
    lasts (it goes on after a caller stops waiting, for the next to take)."""
    with _lock:
        ended = _ended.get(key)
        found = ended[1] if ended is not None and time.monotonic() - ended[0] <= KEPT else _under_way.get(key)
        if found is None:
            found = Future()
            try:
                threading.Thread(target=_run, args=(key, call, found), name="lookup", daemon=True).start()
            except RuntimeError as error:  # (no thread to be had: nothing is left under way)
                raise OSError(f"the lookup could not start ({error})") from None
            _under_way[key] = found
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


def _run(key: tuple[object, ...], call: Callable[[], object], future: Future[Any]) -> None:
    """Make the lookup; no longer under way before its waiters hear of it (a caller after a failure
    asks again), its answer kept while KEPT."""
    try:
        answer, error = call(), None
    except BaseException as failed:  # (a gaierror, a UnicodeError: the waiters' to raise)
        answer, error = None, failed
    with _lock:
        _under_way.pop(key, None)
        now = time.monotonic()
        for old in [k for k, (at, _) in _ended.items() if now - at > KEPT]:
            del _ended[old]
        if error is None:
            _ended[key] = (now, future)
    if error is None:
        future.set_result(answer)
    else:
        future.set_exception(error)


def getaddrinfo(host: str, port: int, time_left: TimeLeft, family: int = 0, kind: int = socket.SOCK_STREAM) -> Found:
    """`socket.getaddrinfo(host, port, family, kind)`, or `LookupTimeout` once `time_left()` is 0
    before it answers. An address needs no lookup, and is answered at once."""
    if _is_address(host):
        return socket.getaddrinfo(host, port, family, kind)
    return _answered(
        ("getaddrinfo", host, port, family, kind), partial(socket.getaddrinfo, host, port, family, kind), time_left
    )


_named: list[str] = []
"""This machine's fully qualified name, once a lookup of it has ended (`fqdn`)."""


def fqdn(time_left: TimeLeft) -> str:
    """`socket.getfqdn()`, this machine's fully qualified name (a reverse lookup), looked up once:
    a lookup that outlasts its callers' waits is kept for the next caller. `LookupTimeout` while
    none has ended."""
    if _named:
        return _named[0]
    return _answered(("getfqdn",), _kept_fqdn, time_left)


def _kept_fqdn() -> str:
    name = socket.getfqdn()
    _named.append(name)  # (in the lookup's thread: kept though nobody waits for it any more)
    return name


def create_connection(
    address: tuple[str, int],
    timeout: object,
    source_address: Any = None,
    *,
    time_left: TimeLeft,
) -> socket.socket:
    """`socket.create_connection`, its host name looked up within `time_left` (`getaddrinfo`);
    each address it has tried in turn, as that does (a `timeout` that is no number nor None is
    http.client's "the default": left as it is)."""
    host, port = address
    error: OSError | None = None
    for family, kind, proto, _, sockaddr in getaddrinfo(host, port, time_left):
        sock = socket.socket(family, kind, proto)
        try:
            if timeout is None or isinstance(timeout, int | float):
                sock.settimeout(timeout)
            if source_address:
                sock.bind(source_address)
            sock.connect(sockaddr)
            return sock
        except OSError as failed:
            sock.close()
            error = failed
    raise error if error is not None else OSError("the host name has no address")


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
