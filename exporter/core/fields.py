"""The config's building blocks every section uses: strict frozen models, durations, amounts,
names and URLs, each with the message a user reads when a value does not fit."""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Annotated, Any
from urllib.parse import urlsplit

from exporter.core.decimals import parse_decimal
from exporter.core.typed import AfterValidator, BeforeValidator, Field, Model, SecretStr

DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")

DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
LONGEST = 10 * 366 * 86400.0
"""The longest duration the config takes: the scheduler and the calendar work in dates."""


def parse_duration(value: Any) -> float:
    """`30s`, `5m`, `1h30m`, `500ms` or a number of seconds → seconds."""
    if isinstance(value, bool):
        raise ValueError("not a duration")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and value and DURATION.sub("", value) == "":
        seconds = sum(float(n) * DURATION_UNITS[unit] for n, unit in DURATION.findall(value))
    else:
        raise ValueError("not a duration (use e.g. 30s, 5m, 1h)")
    if seconds != seconds or seconds in (math.inf, -math.inf):
        raise ValueError("not a duration (use e.g. 30s, 5m, 1h)")
    if seconds < 0:
        raise ValueError("must not be negative")
    if seconds > LONGEST:
        raise ValueError("longer than 10 years")
    return seconds


def parse_amount(value: Any) -> Decimal:
    """An amount or price: decimal text or a number, as the billing API would write it."""
    try:
        return parse_decimal(value)
    except ValueError as error:
        raise ValueError("not a number" if str(error).startswith("not a decimal") else str(error)) from None


def _positive(seconds: float) -> float:
    if seconds <= 0:
        raise ValueError("must be greater than zero")
    return seconds


def _non_negative(amount: Decimal) -> Decimal:
    if amount < 0:
        raise ValueError("must not be negative")
    return amount


Duration = Annotated[float, BeforeValidator(parse_duration)]

Interval = Annotated[float, BeforeValidator(parse_duration), AfterValidator(_positive)]

Amount = Annotated[Decimal, BeforeValidator(parse_amount), AfterValidator(_non_negative)]

Name = Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")]

Text = Annotated[str, Field(min_length=1)]


class Strict(Model):
    """A section of the config: frozen, refusing keys it does not know, never quoting its input."""


def _http_url(url: str) -> str:
    """An http:// or https:// URL with a host, and a port from 1 to 65535 if it has one (the URL is
    never in the message: it may hold a secret)."""
    # (HTTP sends none of these: a request would fail at every try, its error quoting the URL)
    if not url.isprintable() or any(c.isspace() for c in url):
        raise ValueError("holds a space or a control character: percent-encode it (a space is %20)")
    parts = urlsplit(url)
    if not re.match(r"^https?://[^/\s]+", url) or not parts.hostname:
        raise ValueError("must be an http:// or https:// URL")
    if not all(part.isascii() for part in (parts.path, parts.query, parts.fragment, parts.netloc.rpartition("@")[0])):
        raise ValueError("holds a character beyond ASCII outside its host name: percent-encode it")
    if not parts.hostname.isascii() and ascii_host(parts.hostname) is None:  # (sent in its xn-- form)
        raise ValueError("its host name cannot be written in IDNA's xn-- form") from None
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:
        raise ValueError("its port must be a number from 1 to 65535")
    return url.rstrip("/")


HttpUrl = Annotated[str, AfterValidator(_http_url)]


def ascii_host(host: str) -> str | None:
    """A host name as it goes on the wire: beyond ASCII, its `xn--` form as requests writes it
    (IDNA 2008 with UTS 46: `faß` stays itself, never `fass`, another domain); None when it has none."""
    if host.isascii():
        return host
    import idna  # (here: only a host beyond ASCII needs its tables)

    try:
        return idna.encode(host, uts46=True).decode("ascii")
    except idna.IDNAError:
        return None


def url_password(url: str) -> str:
    """The password a URL carries for basic auth (`https://user:PASSWORD@host/`), "" if none."""
    try:
        return urlsplit(url).password or ""
    except ValueError:  # (not a URL this can read: the config says so)
        return ""


def _secret_http_url(url: SecretStr) -> SecretStr:
    _http_url(url.get_secret_value())
    return url


SecretHttpUrl = Annotated[SecretStr, AfterValidator(_secret_http_url)]
"""An `HttpUrl` that is a secret as a whole (a Slack webhook's: its path is the token), kept as written."""


def _scope_value(value: Any) -> str | tuple[str, ...]:
    """One label value, or a list of distinct ones (a list of one is that value)."""
    if isinstance(value, str):
        if not value:
            raise ValueError("must not be empty")
        return value
    if not isinstance(value, list | tuple):
        raise ValueError("not a label value (a string) or a list of them")
    if not value:
        raise ValueError("an empty list matches nothing")
    for item in value:
        if not isinstance(item, str) or not item:
            raise ValueError(f"{item!r} in the list is not a label value (a non-empty string)")
    if len(set(value)) != len(value):
        raise ValueError("lists a value twice")
    return value[0] if len(value) == 1 else tuple(sorted(value))  # (in any order: the same scope)


ScopeValue = Annotated[str | tuple[str, ...], BeforeValidator(_scope_value)]
"""A `where` value: one label value, or a list of them (`endpoint_id: [ep-a, ep-b]`, any of them)."""


def in_scope(wanted: str | tuple[str, ...] | None, value: str) -> bool:
    """`value` is what a `where` entry (one value, a list, or None for no entry) lets through."""
    return wanted is None or value == wanted or (isinstance(wanted, tuple) and value in wanted)


def scope_values(wanted: str | tuple[str, ...]) -> tuple[str, ...]:
    return wanted if isinstance(wanted, tuple) else (wanted,)
