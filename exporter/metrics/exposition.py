"""/metrics rendering with a cache per collector, as text and gzipped.

Bills alone can be tens of thousands of series, and they change only when a refresh replaces
the snapshot. Each collector's block of text is rendered once per snapshot (and per format) and
reused by every scrape until its snapshot changes; the exporter's own health block, whose
figures move every refresh, is rendered on each scrape. A block that cannot be rendered is left
out (and logged once), so one bad value never takes the whole exposition down.

Gzipped, likewise: a block is compressed once per snapshot, on its own, and cached beside its
text; a scrape compresses only what it rendered afresh (the health block) and joins the pieces
into one gzip member (one: curl and other libcurl clients stop after a stream's first member).

A collector with `parts()` (the probes) changes a part at a time: each run of P probes replaces one
probe's snapshot, and rendering the block whole after each would cost P probes' series per run, P²
a round. Each part is rendered once per its version instead (a run renders its probe's series), and
the block is joined from the parts, family by family, and compressed at the first scrape that needs
it: once per scrape at most, however many runs came between. The alerts' collector is in parts too:
their series, rendered once per change of the alerts, and the small notification figures, which
change with each delivery (`metrics.alerts`).
"""

from __future__ import annotations

import re
import struct
import threading
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import chain
from typing import Any, Protocol, TypeVar, runtime_checkable

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from exporter.core.logs import get_logger

log = get_logger(__name__)

OPENMETRICS_EOF = b"# EOF\n"
OPENMETRICS_ACCEPT = "application/openmetrics-text; version=1.0.0"
GZIP_LEVEL = 5
"""Compression level of every gzipped response."""
Encoder = Callable[[Collector], bytes]

_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
"""RFC 1952: deflate, no flags, no modification time, no extra flags, unknown OS."""
_FINAL_BLOCK = b"\x03\x00"
"""An empty deflate block with BFINAL set (fixed codes, just the end-of-block code): what ends the pieces' stream."""


def deflate(text: bytes) -> bytes:
    """`text` compressed on its own as raw deflate, ended by a sync flush: whole bytes, no final block, and nothing
    referred to outside it. Such pieces in a row make up one deflate stream, which gzip_member closes."""
    compressor = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, -zlib.MAX_WBITS)
    return compressor.compress(text) + compressor.flush(zlib.Z_SYNC_FLUSH)


def gzip_member(texts: Sequence[bytes], pieces: Sequence[bytes]) -> bytes:
    """One gzip member holding `texts` in a row, from their pieces (`deflate` of each)."""
    crc = 0
    for text in texts:  # over each text where it lies: joining them first would copy megabytes per scrape
        crc = zlib.crc32(text, crc)
    size = sum(len(text) for text in texts) % 2**32
    return b"".join([_GZIP_HEADER, *pieces, _FINAL_BLOCK, struct.pack("<II", crc, size)])


_QVALUE = re.compile(r"0(\.[0-9]{0,3})?|1(\.0{0,3})?")
"""A weight as RFC 9110 §12.4.2 writes it."""


def weighted(header: str) -> list[tuple[str, float]]:
    """The elements of an `Accept` or `Accept-Encoding` header, each (its name in lower case, its
    weight): 1 without `q`, 0 for a `q` that is not a weight (`q=2`: what is not asked is never
    wrong)."""
    found = []
    for element in header.split(","):
        name, *parameters = (part.strip() for part in element.split(";"))
        if not name:
            continue
        weight = 1.0
        for parameter in parameters:
            key, _, value = parameter.partition("=")
            if key.strip().lower() == "q":
                value = value.strip()
                weight = float(value) if _QVALUE.fullmatch(value) else 0.0
        found.append((name.lower(), weight))
    return found


def negotiated(accept: str) -> str:
    """The `Accept` header as one of the two expositions served: OpenMetrics 1.0.0 when the client
    prefers OpenMetrics (its weight above 0 and at least the text format's: `text/plain`, `text/*`
    or `*/*`), else the text format 0.0.4. prometheus_client would write another for each
    variant asked (any `version=1.0.N`, `escaping=allow-utf-8`, as Prometheus 3 asks), each cached
    apart: every scrape of Prometheus 3 missed what `prepare` had rendered, and a client making up
    versions grew the caches without end; and it reads no weights. The names here need no
    escaping: each format says the same."""
    try:
        _, content_type = choose_encoder(accept)
    except (TypeError, ValueError):  # (a version it cannot compare, `version="1.0.0"`: the text format)
        return ""
    if not content_type.startswith("application/openmetrics-text"):
        return ""
    weights: dict[str, float] = {}
    for media, weight in weighted(accept):
        weights[media] = max(weights.get(media, 0.0), weight)
    text = max(weights.get("text/plain", 0.0), weights.get("text/*", 0.0), weights.get("*/*", 0.0))
    openmetrics = weights.get("application/openmetrics-text", 0.0)
    return OPENMETRICS_ACCEPT if openmetrics > 0 and openmetrics >= text else ""


@dataclass(frozen=True)
class _Block:
    """A collector's block for one snapshot version and format; `piece`: its text deflated, from the first gzipped
    scrape that needed it."""

    version: object
    text: bytes
    piece: bytes | None = None


@runtime_checkable
class Parted(Protocol):
    """A collector whose series change a part at a time (a probe's; the alerts' or the notification figures)."""

    def parts(self) -> Iterable[tuple[object, Collector]]:
        """Its parts in order, each with its version (the same object, the same text) and a collector of the part
        alone: their families joined family by family make the collector's."""
        ...


Families = dict[str, tuple[bytes, bytes]]
"""Rendered text by family, in order: each family's header (its `#` lines) and its samples."""


def families(text: bytes) -> Families:
    """`text` as prometheus_client writes it, by family: each starts at its `# HELP` line, its header
    runs over the `#` lines that follow, and its samples up to the next family's `# HELP`. Lines
    end at `\n` alone: a label value may hold `\r`, written as it is."""
    found: dict[str, tuple[list[bytes], list[bytes]]] = {}
    header: list[bytes] = []
    samples: list[bytes] = []
    for line in (line + b"\n" for line in text.split(b"\n")[:-1]):
        if line.startswith(b"# HELP "):
            header, samples = [line], []
            found[line.split(b" ", 3)[2].decode()] = (header, samples)
        elif line.startswith(b"#") and not samples:
            header.append(line)
        else:
            samples.append(line)
    return {name: (b"".join(header), b"".join(samples)) for name, (header, samples) in found.items()}


def joined(parts: Sequence[Families]) -> Families:
    """The parts' families in the order they first come, each under its first header and with every
    part's samples (a family's samples in one group, its HELP and TYPE once, as the format needs)."""
    return {
        name: (
            next(part[name][0] for part in parts if name in part),
            b"".join([part[name][1] for part in parts if name in part]),
        )
        for name in dict.fromkeys(chain.from_iterable(parts))
    }


def rendered_parts(
    cached: Mapping[int, tuple[object, Families]],
    found: Iterable[tuple[object, Collector]],
    render: Callable[[Collector], bytes],
) -> tuple[list[tuple[object, Families]], Exception | None]:
    """A collector's parts (`found`: what its `parts()` gave) in order, each with its version: taken
    from `cached` (by the id of its version, which each holds, so no other object has that id
    meanwhile) or else rendered; one that cannot be rendered is left out (the last such error
    returned), the rest kept. The caller keeps what comes back as its cache, in place of `cached`."""
    parts: list[tuple[object, Families]] = []
    failure: Exception | None = None
    for version, part in found:
        known = cached.get(id(version))
        if known is None or known[0] is not version:
            try:
                known = (version, families(render(part).removesuffix(OPENMETRICS_EOF)))
            except Exception as error:  # a value no exposition can hold: this part is left out
                failure = error
                continue
        parts.append(known)
    return parts, failure


T = TypeVar("T")


class Failed:
    """What `Failures.asked` gives when what it asked failed."""


FAILED = Failed()


class Failures:
    """What collectors failed at, each keyed by the collector and what failed (its render in a
    format, its `version()`, its `parts()`): logged once while the error stays the same (a render's
    once per format, as where a bad value sits in the text differs in each), forgotten once it
    succeeds. What failed is left out of that scrape; the rest of /metrics is served."""

    def __init__(self) -> None:
        self._last: dict[tuple[object, ...], str] = {}

    def asked(self, key: tuple[object, ...], collector: object, ask: Callable[[], T], **fields: Any) -> T | Failed:
        """`ask()`, or FAILED (logged as `failed`) if it raised."""
        try:
            found = ask()
        except Exception as error:  # a value no exposition can hold; a version or parts not to be had
            self.failed(key, collector, error, **fields)
            return FAILED
        self.succeeded(key)
        return found

    def failed(self, key: tuple[object, ...], collector: object, error: Exception, **fields: Any) -> None:
        reason = f"{type(error).__name__}: {error}"[:300]
        if self._last.get(key) != reason:
            log.error("metrics left out of /metrics", collector=type(collector).__name__, error=reason,
                      during=str(key[-1]), **fields)  # fmt: skip
        self._last[key] = reason

    def succeeded(self, key: tuple[object, ...]) -> None:
        self._last.pop(key, None)


def prepared(collector: Collector, only: Collector | None) -> bool:
    """Whether `prepare` renders `collector`: `only`, or without it every one a refresh changes (not
    one whose `refreshed` is False: the alerts', whose version reads the state file); each with a
    version (the others are rendered by every scrape anyway)."""
    chosen = collector is only if only is not None else getattr(collector, "refreshed", True)
    return chosen and getattr(collector, "version", None) is not None


class Exposition:
    def __init__(self, collectors: Sequence[Collector]) -> None:
        self.collectors = tuple(collectors)
        self._registries = []
        for collector in self.collectors:
            registry = CollectorRegistry()
            registry.register(collector)
            self._registries.append(registry)
        self._parted = {index: c for index, c in enumerate(self.collectors) if isinstance(c, Parted)}
        self._cache: dict[tuple[int, str], _Block] = {}
        self._parts: dict[tuple[int, str], dict[int, tuple[object, Families]]] = {}
        """Per collector with parts and format, its parts as last rendered (`rendered_parts`); only ever replaced."""
        self._lock = threading.Lock()
        self._failures = Failures()  # (keyed by the collector's index and what failed)

    def render(self, accept: str = "", gzipped: bool = False) -> tuple[bytes, str]:
        """The exposition in the format the `Accept` header asks for (as one gzip member if `gzipped`), and its
        content type."""
        encoder, content_type = choose_encoder(accept)
        blocks = [self._block(index, encoder, content_type) for index in range(len(self.collectors))]
        if content_type.startswith("application/openmetrics-text"):
            blocks.append(_Block(None, OPENMETRICS_EOF))
        texts = [block.text for block in blocks]
        if not gzipped:
            return b"".join(texts), content_type
        pieces = [self._piece((index, content_type), block) for index, block in enumerate(blocks)]
        return gzip_member(texts, pieces), content_type

    def prepare(self, account: str | None = None, only: Collector | None = None) -> None:
        """Render and compress new snapshots' blocks now (after a refresh), in both formats, so
        that scrapes, plain or Prometheus' OpenMetrics, find them cached. Only the cached pieces:
        no body is joined or checksummed, and blocks rendered per scrape (health) wait for it. A
        collector with parts has its new parts rendered; its block is joined and compressed by a scrape.
        (`account`: as `AssembledExposition.prepare`'s; here every collector is the one account's.)
        `only`: that collector alone (the alerts', after an evaluation); without it, every one a
        refresh changes (not those whose `refreshed` is False)."""
        chosen = [index for index, collector in enumerate(self.collectors) if prepared(collector, only)]
        found = {index: self._parts_of(index) for index in chosen if index in self._parted}  # once for both formats
        for accept in ("", OPENMETRICS_ACCEPT):
            encoder, content_type = choose_encoder(accept)
            for index in chosen:
                if index in self._parted:
                    if (parts := found[index]) is not None:
                        self._rendered_parts(index, parts, encoder, content_type)
                    continue
                block = self._block(index, encoder, content_type)
                if block.version is not None:
                    self._piece((index, content_type), block)

    def _block(self, index: int, encoder: Encoder, content_type: str) -> _Block:
        """A collector's block: cached for its snapshot's version, else rendered (and cached). One
        whose version or parts cannot be had is left out of this scrape and asked again by the next."""
        collector = self.collectors[index]
        version = self._failures.asked((index, "version()"), collector, getattr(collector, "version", lambda: None))
        if isinstance(version, Failed):
            return _Block(None, b"")
        with self._lock:
            cached = self._cache.get((index, content_type))
        if version is not None and cached is not None and cached.version is version:
            return cached
        if index in self._parted:
            if (found := self._parts_of(index)) is None:
                return _Block(None, b"")
            parts = self._rendered_parts(index, found, encoder, content_type)
            block = _Block(version, b"".join(header + samples for header, samples in joined(parts).values()))
        else:
            block = _Block(version, self._text(index, encoder, content_type))
        if version is not None:
            with self._lock:
                self._cache[(index, content_type)] = block
        return block

    def _piece(self, key: tuple[int, str], block: _Block) -> bytes:
        """A block's text deflated: cached beside the text while that is current, else compressed (and cached)."""
        if block.piece is not None:
            return block.piece
        piece = deflate(block.text)
        if block.version is not None:
            with self._lock:
                if self._cache.get(key) is block:  # not replaced meanwhile by a newer snapshot's block
                    self._cache[key] = replace(block, piece=piece)
        return piece

    def _parts_of(self, index: int) -> list[tuple[object, Collector]] | None:
        """A collector's `parts()`; None if they cannot be had (`Failures`)."""
        parted = self._parted[index]
        found = self._failures.asked((index, "parts()"), parted, lambda: list(parted.parts()))
        return None if isinstance(found, Failed) else found

    def _rendered_parts(
        self, index: int, found: Iterable[tuple[object, Collector]], encoder: Encoder, content_type: str
    ) -> list[Families]:
        """A collector's parts (`found`: what its `parts()` gave), each rendered once per its version."""
        with self._lock:
            cached = self._parts.get((index, content_type), {})
        parts, failure = rendered_parts(cached, found, encoder)
        with self._lock:
            self._parts[(index, content_type)] = {id(version): (version, part) for version, part in parts}
        if failure is not None:
            self._failures.failed((index, content_type), self.collectors[index], failure)
        else:
            self._failures.succeeded((index, content_type))
        return [part for _, part in parts]

    def _text(self, index: int, encoder: Encoder, content_type: str) -> bytes:
        text = self._failures.asked(
            (index, content_type), self.collectors[index],
            lambda: encoder(self._registries[index]).removesuffix(OPENMETRICS_EOF),
        )  # fmt: skip
        return b"" if isinstance(text, Failed) else text
