"""Logging: logfmt or JSON lines on stderr, the same fields in both, every known secret masked.

The exporter never logs a secret itself; the mask is for what libraries log (a webhook URL
carrying a token in urllib3's debug lines, say) and for tracebacks.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
import sys
from collections.abc import Iterable, Mapping
from typing import Any

from exporter.core.lognames import FORMATS, LEVELS, MASK

_RECORD_KEYWORDS = frozenset({"exc_info", "stack_info", "stacklevel", "extra"})
_NEEDS_QUOTES = re.compile(r'[\s"=\\\x00-\x1f\x7f\u2028\u2029]|^$')
_OWN_KEYS = ("ts", "level", "component", "msg", "exc")


class Logger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """`log.info("refresh failed", source="usage", error=...)`: keyword arguments are the line's
    fields, kept apart from the message, so both formats can show them as fields."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        fields = {key: kwargs.pop(key) for key in [k for k in kwargs if k not in _RECORD_KEYWORDS]}
        kwargs["extra"] = {**kwargs.get("extra", {}), "fields": fields}
        return msg, kwargs


def get_logger(name: str) -> Logger:
    return Logger(logging.getLogger(name), {})


def _time(record: logging.LogRecord) -> str:
    """RFC 3339 in UTC with milliseconds: 2026-11-22T10:26:00.555Z."""
    return dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds")[:-6] + "Z"


def _fields(record: logging.LogRecord) -> dict[str, object]:
    entry: dict[str, object] = {
        "ts": _time(record),
        "level": record.levelname.lower(),
        "component": record.name,
        "msg": record.getMessage(),
    }
    for key, value in getattr(record, "fields", {}).items():
        entry[key if key not in _OWN_KEYS else f"field_{key}"] = value
    return entry


def _quoted(text: str) -> str:
    """A double-quoted string with JSON's escapes: every control character escaped, one line."""
    return json.dumps(text, ensure_ascii=False)


def logfmt_value(value: object) -> str:
    if isinstance(value, Mapping):  # labels: endpoint_id=ep-1,severity=page
        value = ",".join(f"{k}={v}" for k, v in value.items())
    text = value if isinstance(value, str) else "null" if value is None else str(value)
    return _quoted(text) if _NEEDS_QUOTES.search(text) else text


class LogfmtFormatter(logging.Formatter):
    """`ts=2026-11-22T10:26:00.555Z level=info component=exporter.app.daemon msg="refresh failed" source=usage`"""

    def format(self, record: logging.LogRecord) -> str:
        entry = _fields(record)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return " ".join(f"{key}={logfmt_value(value)}" for key, value in entry.items())


class JsonFormatter(logging.Formatter):
    """One JSON object a line, with the fields as keys."""

    def format(self, record: logging.LogRecord) -> str:
        entry = _fields(record)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


class MaskingFormatter(logging.Formatter):
    """Formats with another formatter, then masks every secret in the result."""

    def __init__(self, inner: logging.Formatter, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self.inner = inner
        self.secrets: set[str] = set()
        self.add(secrets)

    def add(self, secrets: Iterable[str]) -> None:
        """Mask these too (a reload may bring new secrets; old ones stay masked), as written, without
        the spaces or line breaks at their ends (a message may quote them escaped), and as both
        formats escape them (a secret holding `"` or `\\` is written escaped)."""
        self.secrets |= {form for s in secrets for form in (s, s.strip()) if len(form) >= 4}
        forms = {form for s in self.secrets for form in (s, _quoted(s)[1:-1], json.dumps(s)[1:-1])}
        self._ordered = sorted(forms, key=len, reverse=True)

    def format(self, record: logging.LogRecord) -> str:
        text = self.inner.format(record)
        for secret in self._ordered:
            text = text.replace(secret, MASK)
        return text


def setup_logging(level: str = "info", fmt: str = "text", secrets: Iterable[str] = ()) -> None:
    """Log to stderr at `level` in `fmt`, either as LEVELS and FORMATS spell them (ValueError for another)."""
    if level not in LEVELS or fmt not in FORMATS:
        raise ValueError(f"log level {level!r} or format {fmt!r} is not one of {list(LEVELS)}, {list(FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    inner = JsonFormatter() if FORMATS[fmt] == "json" else LogfmtFormatter()
    handler.setFormatter(MaskingFormatter(inner, secrets))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(LEVELS[level].upper())
    logging.getLogger("apscheduler").setLevel(max(logging.WARNING, root.level))


def mask_more(secrets: Iterable[str]) -> None:
    """Add secrets to the mask of every handler set up here."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler.formatter, MaskingFormatter):
            handler.formatter.add(secrets)
