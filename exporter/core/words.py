"""Words people read: counts (`1 probe`, `2 probes`, never `1 probes`), text on one line, names of nothing."""

from __future__ import annotations

import re

NO_ENDPOINT = "(no endpoint)"
"""How a message names the charges the bills tie to no endpoint (an empty `instanceId`, such as a
fee of the account's): the label stays empty, which Prometheus and Alertmanager read as absent."""

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]+")


def counted(count: int, noun: str, plural: str = "") -> str:
    """`count` and `noun` agreeing with it (`plural`, when adding an `s` does not make it)."""
    return f"{count:,} {noun if count == 1 else plural or noun + 's'}"


def line(text: str) -> str:
    """One line of text: control characters (line breaks too) become a space."""
    return _CONTROL.sub(" ", text).strip()


def shortened(text: str, limit: int) -> str:
    """`text` if it has at most `limit` characters, else its start and "…" in `limit`."""
    return text if len(text) <= limit else text[: limit - 1] + "…"
