"""/metrics for several accounts, assembled from pieces each account renders on its own.

One family's series of every account must come under one HELP and TYPE. Rendering the families
of all accounts together after each refresh would cost every account's series at every
account's refresh: with N accounts, N times the work of one, N times as often. Instead each
account's collector is rendered alone (its samples labelled with its `account`), once per
snapshot and format, and split into its families; a scrape joins, family by family, the header
of the first account that has it and each account's samples, from what is cached. A refresh of
one account renders that account's figures only; a scrape joins bytes.

Gzipped likewise: each piece is deflated once (`exposition.deflate`) and the pieces make one gzip
member (`exposition.gzip_member`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from exporter.config.schema import ACCOUNT
from exporter.metrics.exposition import (
    OPENMETRICS_ACCEPT,
    OPENMETRICS_EOF,
    Encoder,
    Failed,
    Failures,
    Families,
    Parted,
    deflate,
    families,
    gzip_member,
    joined,
    prepared,
    rendered_parts,
)

NOTHING = object()
"""The version of a collector that has no snapshot yet (it shows nothing until it has one)."""


@dataclass
class _Piece:
    text: bytes
    deflated: bytes | None = None
    """`text` deflated, from the first gzipped scrape or `prepare` that needed it."""

    def piece(self) -> bytes:
        if self.deflated is None:
            self.deflated = deflate(self.text)  # (two threads at once compress it twice: the same bytes)
        return self.deflated


@dataclass
class _Families:
    """One account's collector rendered in one format: each family's header and samples, in order."""

    version: object
    headers: dict[str, _Piece] = field(default_factory=dict)
    samples: dict[str, _Piece] = field(default_factory=dict)
    prepared: bool = False
    """Every piece deflated (by `prepare`): nothing left to do for it until its version changes."""


class _Labelled(Collector):
    """One account's collector, each sample labelled with the account (first among its labels)."""

    def __init__(self, account: str, collector: Collector) -> None:
        self.account = account
        self.collector = collector

    def collect(self) -> Iterator[Metric]:
        for family in self.collector.collect():
            if self.account:
                family.samples = [s._replace(labels={ACCOUNT: self.account, **s.labels}) for s in family.samples]
            yield family


def _pieces_of(found: Families, version: object) -> _Families:
    """Rendered families as pieces to deflate one at a time, for `version`."""
    return _Families(
        version,
        {name: _Piece(header) for name, (header, _) in found.items()},
        {name: _Piece(samples) for name, (_, samples) in found.items()},
    )


class AssembledExposition:
    """The exposition of `kinds`: each a list of (account, collector) whose families are joined,
    a part named "" unlabelled (what spans the accounts: the organisation's budgets). A collector
    with a `version` is rendered once per version (None: nothing yet, the same until it has one);
    one without, on each scrape (the exporter's health)."""

    def __init__(self, kinds: Sequence[Sequence[tuple[str, Collector]]]) -> None:
        self.kinds = tuple(tuple(parts) for parts in kinds)
        self._registries: dict[tuple[int, int], CollectorRegistry] = {}
        for k, parts in enumerate(self.kinds):
            for i, (account, collector) in enumerate(parts):
                registry = CollectorRegistry()
                registry.register(_Labelled(account, collector))
                self._registries[(k, i)] = registry
        self._cache: dict[tuple[int, int, str], _Families] = {}
        self._parts: dict[tuple[int, int, str], dict[int, tuple[object, Families]]] = {}
        """Per collector with parts (an account's probes) and format, its parts as last rendered
        (`exposition.rendered_parts`); only ever replaced."""
        self._joined: dict[tuple[int, str], tuple[tuple[_Families, ...], list[_Piece]]] = {}
        """Per kind and format, its families' pieces in order, and the parts they were joined from."""
        self._lock = threading.Lock()
        self._failures = Failures()  # (keyed by the collector's kind and place, and what failed)

    def _version(self, collector: Collector) -> object:
        version = getattr(collector, "version", None)
        if version is None:
            return None
        found = version()
        return NOTHING if found is None else found

    def _families(self, k: int, i: int, encoder: Encoder, content_type: str) -> _Families:
        account, collector = self.kinds[k][i]
        ask = partial(self._version, collector)
        version = self._failures.asked((k, i, "version()"), collector, ask, account=account)
        if isinstance(version, Failed):
            return _Families(None)  # (not kept: the next scrape asks again)
        with self._lock:
            cached = self._cache.get((k, i, content_type))
        if version is not None and cached is not None and cached.version is version:
            return cached
        if isinstance(collector, Parted):
            if (listed := self._parts_of(k, i, collector)) is None:
                return _Families(None)
            found = joined(self._rendered_parts(k, i, listed, encoder, content_type))
        else:
            text = self._failures.asked(
                (k, i, content_type), collector,
                lambda: encoder(self._registries[(k, i)]).removesuffix(OPENMETRICS_EOF), account=account,
            )  # fmt: skip
            if isinstance(text, Failed):
                return _Families(None)
            found = families(text)
        rendered = _pieces_of(found, version)
        if version is not None:
            with self._lock:
                self._cache[(k, i, content_type)] = rendered
        return rendered

    def _parts_of(self, k: int, i: int, collector: Parted) -> list[tuple[object, Collector]] | None:
        """A collector's `parts()`; None if they cannot be had (`Failures`)."""
        account = self.kinds[k][i][0]
        found = self._failures.asked((k, i, "parts()"), collector, lambda: list(collector.parts()), account=account)
        return None if isinstance(found, Failed) else found

    def _rendered_parts(
        self, k: int, i: int, found: list[tuple[object, Collector]], encoder: Encoder, content_type: str
    ) -> list[Families]:
        """An account's collector's parts (`found`: what its `parts()` gave), each labelled and
        rendered once per its version (a probe's run renders that probe's series, not every one of
        the account's)."""
        account = self.kinds[k][i][0]
        with self._lock:
            cached = self._parts.get((k, i, content_type), {})
        parts, failure = rendered_parts(cached, found, lambda part: encoder(_Labelled(account, part)))
        with self._lock:
            self._parts[(k, i, content_type)] = {id(version): (version, part) for version, part in parts}
        if failure is not None:
            self._failures.failed((k, i, content_type), self.kinds[k][i][1], failure, account=account)
        else:
            self._failures.succeeded((k, i, content_type))
        return [part for _, part in parts]

    def _pieces(self, encoder: Encoder, content_type: str) -> list[_Piece]:
        pieces: list[_Piece] = []
        for k, parts in enumerate(self.kinds):
            rendered = tuple(self._families(k, i, encoder, content_type) for i in range(len(parts)))
            before = self._joined.get((k, content_type))
            if before is not None and all(a is b for a, b in zip(before[0], rendered, strict=True)):
                pieces += before[1]  # no account's part of this kind changed: joined as last time
                continue
            kind: list[_Piece] = []
            order = dict.fromkeys(name for families in rendered for name in families.headers)
            for name in order:
                kind.append(next(f.headers[name] for f in rendered if name in f.headers))
                kind += [f.samples[name] for f in rendered if name in f.samples and f.samples[name].text]
            if all(f.version is not None for f in rendered):
                self._joined[(k, content_type)] = (rendered, kind)
            pieces += kind
        return pieces

    def render(self, accept: str = "", gzipped: bool = False) -> tuple[bytes, str]:
        """As `Exposition.render`: the exposition for an `Accept` header (one gzip member if
        `gzipped`), and its content type."""
        encoder, content_type = choose_encoder(accept)
        pieces = self._pieces(encoder, content_type)
        if content_type.startswith("application/openmetrics-text"):
            pieces.append(_Piece(OPENMETRICS_EOF))
        texts = [piece.text for piece in pieces]
        if not gzipped:
            return b"".join(texts), content_type
        return gzip_member(texts, [piece.piece() for piece in pieces]), content_type

    def prepare(self, account: str | None = None, only: Collector | None = None) -> None:
        """Render and deflate what changed since (after a refresh), in both formats, so that scrapes
        find it cached; a refresh of one account renders that account's only. With `account`, only
        its collectors and those spanning the accounts are looked at (the others' snapshots did not
        change): a refresh costs the same with 50 accounts as with one. `only`: that collector
        alone (the alerts', after an evaluation); without it, not those whose `refreshed` is False."""
        chosen = [
            (k, i, collector)
            for k, parts in enumerate(self.kinds)
            for i, (name, collector) in enumerate(parts)
            if prepared(collector, only) and (account is None or name in (account, ""))
        ]
        found = {  # once for both formats
            (k, i): self._parts_of(k, i, collector) for k, i, collector in chosen if isinstance(collector, Parted)
        }
        for accept in ("", OPENMETRICS_ACCEPT):
            encoder, content_type = choose_encoder(accept)
            for k, i, collector in chosen:
                if isinstance(collector, Parted):  # its new parts: joined and deflated by the next scrape, once
                    if (listed := found[(k, i)]) is not None:
                        self._rendered_parts(k, i, listed, encoder, content_type)
                    continue
                families = self._families(k, i, encoder, content_type)
                if families.version is None or families.prepared:
                    continue
                for piece in (*families.headers.values(), *families.samples.values()):
                    if piece.text:
                        piece.piece()
                families.prepared = True
