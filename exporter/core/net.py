"""Why a network exchange failed, in words a log reader acts on (DNS, refused, TLS, timeout, reset);
how long an answer asks to wait (`Retry-After`)."""

from __future__ import annotations

import datetime as dt
import socket
import ssl
import sys
from collections.abc import Iterator
from email.utils import parsedate_to_datetime


def _causes(error: BaseException) -> Iterator[BaseException]:
    """The error and what lies under it (requests wraps urllib3, which wraps the socket's error)."""
    seen: set[int] = set()
    stack = [error]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        under = (current.__cause__, current.__context__, getattr(current, "reason", None), *current.args)
        stack += [e for e in under if isinstance(e, BaseException)]


TIMED_OUT = "timed out"


def _named_cause(error: BaseException) -> tuple[str, BaseException] | None:
    """The first cause (in this order of kinds) that has words, with them; None when none has."""
    causes = list(_causes(error))
    kinds: list[tuple[type[BaseException], str]] = [
        (socket.gaierror, "the host name does not resolve (DNS)"),
        (ssl.SSLCertVerificationError, "TLS certificate verification failed"),
        (ssl.SSLError, "TLS failed"),
        (ConnectionRefusedError, "connection refused"),
        (ConnectionResetError, "connection reset"),
        (TimeoutError, TIMED_OUT),
    ]
    # requests' own timeout, where requests is in use (a process that never loaded it has none of
    # its errors: `check` and the email notifier do not load it for this).
    requests = sys.modules.get("requests")
    if requests is not None:
        kinds.append((requests.Timeout, TIMED_OUT))
    for kind, words in kinds:
        match = next((c for c in causes if isinstance(c, kind)), None)
        if match is not None:
            return words, match
    return None


def network_cause(error: BaseException) -> str:
    """Why a connection failed, in words: DNS, refused, TLS verification, timeout, reset."""
    named = _named_cause(error)
    if named is None:
        return type(error).__name__
    words, match = named
    detail = getattr(match, "verify_message", "") or ""
    return f"{words} ({detail})" if detail else words


def timed_out(error: BaseException) -> bool:
    """Whether the cause `network_cause` names is a timeout: a connection or an answer that did not
    come in time, or a body that stopped coming (which requests reports as a connection error)."""
    named = _named_cause(error)
    return named is not None and named[0] == TIMED_OUT


def retry_after(value: str | None, now: float) -> float | None:
    """A `Retry-After` header's wait in seconds from `now` (never below 0); None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # (not `²`, which isdigit() takes)
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # (an HTTP date is GMT)
        when = when.replace(tzinfo=dt.UTC)
    return max(0.0, when.timestamp() - now)
