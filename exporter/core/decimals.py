"""Decimal text as the billing API writes it, and the range a bill can hold."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

MAX_AMOUNT = Decimal(10) ** 15
"""Amounts beyond ± this are no bill: refused, so that sums, forecasts and the exposition stay exact."""
DECIMAL_TEXT = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII)
"""ASCII digits, one point, an optional exponent: no `_`, no other scripts' digits, no `NaN` or
`Infinity` (Python's Decimal accepts them all; the API's decimal text has none of them)."""


class WrittenFloat(float):
    """A number read from a config file as a float, with the text it was written as (`written`): an
    amount written unquoted, `0.12345678901234567891`, is read to the last digit, not as the float
    nearest it."""

    written: str = ""


def parse_decimal(value: Any) -> Decimal:
    """A finite decimal within ±MAX_AMOUNT, from text (or a number); ValueError says why not."""
    if isinstance(value, bool) or not isinstance(value, str | int | float | Decimal):
        raise ValueError("not a decimal")
    text = value.strip() if isinstance(value, str) else str(value)
    if isinstance(value, WrittenFloat) and DECIMAL_TEXT.fullmatch(written := value.written.replace("_", "")):
        text = written
    if not DECIMAL_TEXT.fullmatch(text):
        raise ValueError(f"not a decimal: {text[:40]!r}")
    try:
        amount = Decimal(text)
    except InvalidOperation:  # pragma: no cover - the pattern admits only what Decimal reads
        raise ValueError(f"not a decimal: {text[:40]!r}") from None
    if amount.copy_abs() > MAX_AMOUNT:  # (not abs(): 1e999999999, past the context's exponents, would overflow)
        raise ValueError(f"out of range (beyond ±{MAX_AMOUNT:.0E}): {text[:40]!r}")
    return amount
