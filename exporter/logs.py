"""Logging: key=value text or JSON lines on stderr, with every known secret masked.

The exporter never logs a secret itself; the mask is for what libraries log (a webhook URL
carrying a token in urllib3's debug lines, say) and for tracebacks.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterable

MASK = "***"
TEXT_FORMAT = "ts=%(asctime)s level=%(levelname)s component=%(name)s msg=%(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S%z"),
            "level": record.levelname.lower(),
            "component": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class MaskingFormatter(logging.Formatter):
    """Formats with another formatter, then masks every secret in the result."""

    def __init__(self, inner: logging.Formatter, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self.inner = inner
        self.secrets: set[str] = set()
        self.add(secrets)

    def add(self, secrets: Iterable[str]) -> None:
        """Mask these too (a reload may bring new secrets; old ones stay masked)."""
        self.secrets |= {s for s in secrets if len(s) >= 4}
        self._ordered = sorted(self.secrets, key=len, reverse=True)

    def format(self, record: logging.LogRecord) -> str:
        text = self.inner.format(record)
        for secret in self._ordered:
            text = text.replace(secret, MASK)
        return text


def setup_logging(level: str = "info", fmt: str = "text", secrets: Iterable[str] = ()) -> None:
    handler = logging.StreamHandler(sys.stderr)
    inner = JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT)
    handler.setFormatter(MaskingFormatter(inner, secrets))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("apscheduler").setLevel(max(logging.WARNING, root.level))


def mask_more(secrets: Iterable[str]) -> None:
    """Add secrets to the mask of every handler set up here."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler.formatter, MaskingFormatter):
            handler.formatter.add(secrets)
