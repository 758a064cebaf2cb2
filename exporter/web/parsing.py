"""What a request may be: its target and headers read strictly (what a proxy in front may read another way is
refused, not guessed at), the limits on their size, and whether the client takes gzip."""

from __future__ import annotations

import re
from collections.abc import Sequence
from email.message import Message
from urllib.parse import urlsplit

from exporter.metrics.exposition import weighted

MAX_URL = 8192
"""The longest target a request may have: longer is refused with a 414."""
MAX_HEADER_BYTES = 16384
"""The most its header names and values may hold together: more is refused with a 431."""
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
"""A header name (RFC 9110 §5.6.2)."""
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
"""What a header value must not hold (RFC 9110 §5.5): NUL, CR, LF (a folded line) and every other control but tab."""
_DIGITS = re.compile(r"[0-9]+")
_ONCE = ("Content-Length", "Host")
"""Headers a request may hold once: two are two readings of one request (RFC 9112 §3.2, §6.3)."""


def target_path(command: str, target: str) -> str | None:
    """The path a request asks for: its target's in origin form (`/metrics?x`) or absolute form
    (`http://host/metrics`, which RFC 9112 §3.2.2 has a server accept), or `*` for `OPTIONS *`. None for any other
    target, for one that cannot be parsed (`http://[x/`), and for one with a user name or password, which RFC 9110
    §4.2.4 has a recipient take as an error (`credentialed`)."""
    if target == "*" and command == "OPTIONS":
        return target
    try:
        parts = urlsplit(target)
    except ValueError:
        return None
    if credentialed(target):
        return None
    if target.startswith("/"):
        return parts.path
    if parts.scheme.lower() in ("http", "https") and parts.netloc:
        return parts.path or "/"
    return None


_USERINFO = re.compile(r"(?<=//)[^/?#]*@")
"""A URL's `user:password@`, written after `//` and before the host (a space in it too, as a lax proxy forwards it)."""


def credentialed(target: str) -> bool:
    """Whether a target holds a user name or password: an absolute form's, or one written after
    `//` where a path begins (which a URL parser reads as an authority)."""
    try:
        return "@" in urlsplit(target).netloc
    except ValueError:
        return False


def without_credentials(line: str) -> str:
    """`line` (a request line, as a log line quotes it) with any URL's `user:password@` masked."""
    return _USERINFO.sub("***@", line)


def header_problem(headers: Message) -> str | None:
    """Why a request's headers are refused, or None if they are not.

    What a proxy in front may read another way is refused, not guessed at (RFC 9112 §5.1, §5.2, §6.3): a line that
    is not `name: value` (the stdlib's parser takes it and every line after it for a body, so `Content-Length : 5`
    would go unseen), a folded line, a control character, two Content-Length (or Host), a Content-Length that is not
    one number, and Transfer-Encoding beside Content-Length.
    """
    if headers.defects or headers.get_payload():
        return "a header line that is not NAME: VALUE"
    for name, value in headers.items():
        if not _TOKEN.fullmatch(name):
            return "a header name that is not a token"
        if _CONTROL.search(value):
            return f"a folded line or a control character in {name}"  # (a token: nothing to escape)
    for name in _ONCE:
        if len(headers.get_all(name, [])) > 1:
            return f"more than one {name}"
    length = headers.get("Content-Length")
    if length is not None and not _DIGITS.fullmatch(length.strip(" \t")):
        return "a Content-Length that is not a number"
    if length is not None and "Transfer-Encoding" in headers:
        return "both Transfer-Encoding and Content-Length"
    return None


def accepts_gzip(fields: Sequence[str]) -> bool:
    """Whether a client that sent these Accept-Encoding fields takes gzip, and prefers it at least as much as the
    body as it is (RFC 9110 §12.5.3).

    `gzip;q=0`, or `*;q=0` with no `gzip` of its own, says gzip is not acceptable; `gzip;q=0.5, identity` prefers the
    plain body. Codings and parameters are case-insensitive, `x-gzip` is gzip (§8.4.1.3), and a weight that is not
    one (`q=2`) counts as 0: the plain body is never wrong.
    """
    weights: dict[str, float] = {}
    for coding, weight in weighted(",".join(fields)):
        weights["gzip" if coding == "x-gzip" else coding] = weight
    gzip_weight = weights.get("gzip", weights.get("*", 0.0))
    # Not named, the plain body is acceptable but the least preferred: a client that names gzip gets it.
    identity_weight = weights.get("identity", weights.get("*", 0.0))
    return gzip_weight > 0 and gzip_weight >= identity_weight
