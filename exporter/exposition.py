"""/metrics rendering with a cache per collector.

Bills alone can be tens of thousands of series, and they change only when a refresh replaces
the snapshot. Each collector's block of text is rendered once per snapshot (and per format) and
reused by every scrape until its snapshot changes; the exporter's own health block, whose
figures move every refresh, is rendered on each scrape. A block that cannot be rendered is left
out (and logged once), so one bad value never takes the whole exposition down.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from exporter.logs import get_logger

log = get_logger(__name__)

OPENMETRICS_EOF = b"# EOF\n"
Encoder = Callable[[CollectorRegistry], bytes]


class Exposition:
    def __init__(self, collectors: Sequence[Collector]) -> None:
        self.collectors = tuple(collectors)
        self._registries = []
        for collector in self.collectors:
            registry = CollectorRegistry()
            registry.register(collector)
            self._registries.append(registry)
        self._cache: dict[tuple[int, str], tuple[object, bytes]] = {}
        self._lock = threading.Lock()
        self._broken: dict[int, str] = {}
        """Collectors whose last render failed, with the error (logged once per new error)."""

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The exposition in the format the `Accept` header asks for, and its content type."""
        encoder, content_type = choose_encoder(accept)
        blocks = [
            self._text(index, collector, registry, encoder, content_type, getattr(collector, "version", lambda: None)())
            for index, (collector, registry) in enumerate(zip(self.collectors, self._registries, strict=True))
        ]
        if content_type.startswith("application/openmetrics-text"):
            blocks.append(OPENMETRICS_EOF)
        return b"".join(blocks), content_type

    def _text(
        self, index: int, collector: Collector, registry: CollectorRegistry, encoder: Encoder, content_type: str,
        version: object,
    ) -> bytes:  # fmt: skip
        """A block's text: cached for its version, else rendered (and cached)."""
        with self._lock:
            cached = self._cache.get((index, content_type))
        if version is not None and cached is not None and cached[0] is version:
            return cached[1]
        try:
            block = encoder(registry).removesuffix(OPENMETRICS_EOF)
        except Exception as error:  # a value no exposition can hold: leave this block out, keep the rest
            self._failed(index, collector, error)
            block = b""
        else:
            self._broken.pop(index, None)
        if version is not None:
            with self._lock:
                self._cache[(index, content_type)] = (version, block)
        return block

    def _failed(self, index: int, collector: Collector, error: Exception) -> None:
        reason = f"{type(error).__name__}: {error}"[:300]
        if self._broken.get(index) != reason:
            log.error("metrics left out of /metrics", collector=type(collector).__name__, error=reason)
        self._broken[index] = reason
