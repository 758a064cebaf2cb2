"""Why a network exchange failed, in words a log reader acts on (DNS, refused, TLS, timeout, reset)."""

from __future__ import annotations

import socket
import ssl
import sys
from collections.abc import Iterator


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


def network_cause(error: BaseException) -> str:
    """Why a connection failed, in words: DNS, refused, TLS verification, timeout, reset."""
    causes = list(_causes(error))
    kinds: list[tuple[type[BaseException], str]] = [
        (socket.gaierror, "the host name does not resolve (DNS)"),
        (ssl.SSLCertVerificationError, "TLS certificate verification failed"),
        (ssl.SSLError, "TLS failed"),
        (ConnectionRefusedError, "connection refused"),
        (ConnectionResetError, "connection reset"),
        (TimeoutError, "timed out"),
    ]
    # requests' own timeout, where requests is in use (a process that never loaded it has none of
    # its errors: `check` and the email notifier do not load it for this).
    requests = sys.modules.get("requests")
    if requests is not None:
        kinds.append((requests.Timeout, "timed out"))
    for kind, words in kinds:
        match = next((c for c in causes if isinstance(c, kind)), None)
        if match is not None:
            detail = getattr(match, "verify_message", "") or ""
            return f"{words} ({detail})" if detail else words
    return type(error).__name__


def timed_out(error: BaseException) -> bool:
    """Whether the cause `network_cause` names is a timeout: a connection or an answer that did not
    come in time, or a body that stopped coming (which requests reports as a connection error)."""
    return network_cause(error).startswith("timed out")
