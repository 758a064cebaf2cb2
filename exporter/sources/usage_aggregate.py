"""A day's usage as running sums: `Aggregate` adds records into totals per (endpoint, model, API
key), counting each request id once, which `SeenIds` remembers in 8 bytes an id.

Every record a read returns passes through `Aggregate.add`, a page at a time (a list shown newest
first, through `Aggregate.count`): it is the hot loop of a day's read.
"""

from __future__ import annotations

import hashlib
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Sequence

from exporter.billing import UsageRecord
from exporter.model.snapshots import UsageKey, UsageRow


def id_digest(request_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "big")


class SeenIds:
    """The request ids of one day, as 64-bit digests in sorted arrays (8 bytes an id, so a day of
    a million requests costs 8 MB): one array per leading 12 bits, so an insert moves little.
    A bucket is made when its first id arrives: an empty or small day costs next to nothing.

    A poll works on a `fork`: it sees the ids of the set it was forked from (its base, left as it
    is) and keeps those it adds apart (`added`), so that a poll costs what it finds, not the day's
    size, and a poll that fails leaves the base untouched. `settle` folds them into the base once
    the poll is kept.
    """

    def __init__(self, buckets: dict[int, array[int]] | None = None, base: SeenIds | None = None) -> None:
        self._buckets = buckets if buckets is not None else {}
        self.base = base
        self.count: int = sum(map(len, self._buckets.values())) + (base.count if base is not None else 0)

    def __contains__(self, digest: int) -> bool:
        bucket = self._buckets.get(digest >> 52)
        if bucket is not None:
            at = bisect_left(bucket, digest)
            if at < len(bucket) and bucket[at] == digest:
                return True
        return self.base is not None and digest in self.base

    def add(self, request_id: str) -> bool:
        """Remember `request_id`; False if it was seen before."""
        return self.add_digest(id_digest(request_id))

    def add_digest(self, digest: int) -> bool:
        """Remember a request id by its `id_digest` (when the caller has it already)."""
        return not self.add_digests((digest,))

    def add_digests(self, digests: Sequence[int]) -> list[int]:
        """Remember every digest of `digests`; the positions of those seen before (almost always
        none). A page's digests at a time: this runs for every record of the day."""
        base = self.base if self.base is not None and self.base.count else None  # (a full read's fork: empty)
        buckets = self._buckets
        repeated: list[int] = []
        for at_digest, digest in enumerate(digests):
            if base is not None and digest in base:
                repeated.append(at_digest)
                continue
            bucket = buckets.get(digest >> 52)
            if bucket is None:
                bucket = buckets[digest >> 52] = array("Q")
            at = bisect_left(bucket, digest)
            if at < len(bucket) and bucket[at] == digest:
                repeated.append(at_digest)
                continue
            bucket.insert(at, digest)
        self.count += len(digests) - len(repeated)
        return repeated

    def fork(self) -> SeenIds:
        """A set that starts with these ids and adds its own apart (see the class)."""
        return SeenIds(base=self)

    def added(self) -> list[memoryview]:
        """The digests a fork added to its base, in order (every digest, for a set that is no fork)."""
        return [memoryview(self._buckets[key]) for key in sorted(self._buckets) if self._buckets[key]]

    def settle(self) -> None:
        """Fold a fork's own ids into its base and take the base's arrays as its own: the base, left
        behind, must not be used again (it holds this set's ids now)."""
        base = self.base
        if base is None:
            return
        base.settle()
        if not base.count:  # (a full read's fork: its ids are all there are)
            self.base = None
            return
        for bucket in self._buckets.values():
            base.add_digests(bucket)
        self._buckets, self.base, self.count = base._buckets, None, base.count

    def chunks(self) -> list[memoryview]:
        """Every digest, in order, as views (for writing out without a copy of the whole)."""
        buckets = self._merged()
        return [memoryview(buckets[key]) for key in sorted(buckets) if buckets[key]]

    def _merged(self) -> dict[int, array[int]]:
        if self.base is None:
            return self._buckets
        merged = dict(self.base._merged())
        for key, bucket in self._buckets.items():  # (a fork's ids are never its base's)
            before = merged.get(key)
            merged[key] = bucket if before is None else array("Q", sorted((*before, *bucket)))
        return merged

    def extend(self, data: bytes) -> None:
        """Add the digests of `data` (as `added` wrote them; some may be known already)."""
        digests = array("Q")
        digests.frombytes(data)
        self.add_digests(digests)

    @classmethod
    def from_bytes(cls, data: bytes) -> SeenIds:
        """The ids `chunks()` wrote (data not a whole number of digests is refused: ValueError)."""
        digests = array("Q")
        digests.frombytes(data)
        buckets: dict[int, array[int]] = {}
        for digest in digests:
            bucket = buckets.get(digest >> 52)
            if bucket is None:
                bucket = buckets[digest >> 52] = array("Q")
            bucket.append(digest)
        return cls(buckets)


class Aggregate:
    """Running sums per key, [requests, prompt, completion, cached], over distinct request ids.

    `rows` counts every record read, duplicates included: it is the position in the day's list
    (what `total` counts). `duplicates` holds the ids read twice.
    """

    def __init__(
        self,
        per_api_key: bool,
        sums: dict[UsageKey, list[int]] | None = None,
        seen: SeenIds | None = None,
        rows: int = 0,
    ) -> None:
        self.per_api_key = per_api_key
        self.sums: dict[UsageKey, list[int]] = sums or {}
        self.records = sum(s[0] for s in self.sums.values())
        self.seen = seen or SeenIds()
        self.rows = rows
        self.duplicates: set[str] = set()

    def fork(self) -> Aggregate:
        """A copy to go on counting in, its ids a fork of these (`SeenIds.fork`): this one stays as
        it is while the copy counts, and is left behind once the copy `settle`s."""
        return Aggregate(self.per_api_key, {k: list(v) for k, v in self.sums.items()}, self.seen.fork(), self.rows)

    def add(self, records: Sequence[UsageRecord]) -> None:
        """`count` each record, a page at a time: the ids digested in one comprehension and
        remembered in one call, then the sums with the names looked up once and a key made only
        for a new (endpoint, model, key), as this runs for every record of the day (it was half
        the client's CPU in a full read)."""
        blake2b, from_bytes = hashlib.blake2b, int.from_bytes
        repeated = self.seen.add_digests(
            [from_bytes(blake2b(r.request_id.encode(), digest_size=8).digest(), "big") for r in records]
        )
        self.rows += len(records)
        if repeated:
            self.duplicates.update(records[at].request_id for at in repeated)
            dropped = set(repeated)
            records = [r for at, r in enumerate(records) if at not in dropped]
        sums, per_api_key = self.sums, self.per_api_key
        for r in records:
            key = (r.endpoint, r.model, (r.apikey or "") if per_api_key else "")
            found = sums.get(key)  # type: ignore[call-overload]  # (a tuple finds its UsageKey: equal, same hash)
            if found is None:
                found = sums[UsageKey(*key)] = [0, 0, 0, 0]
            found[0] += 1
            found[1] += r.prompt_tokens
            found[2] += r.completion_tokens
            found[3] += r.cached_prompt_tokens
        self.records += len(records)

    def count(self, r: UsageRecord, digest: int) -> None:
        """One record, its request id's `id_digest` already made: counted unless its id was seen."""
        self.rows += 1
        if not self.seen.add_digest(digest):
            self.duplicates.add(r.request_id)
            return
        key = UsageKey(r.endpoint, r.model, (r.apikey or "") if self.per_api_key else "")
        sums = self.sums.get(key)
        if sums is None:
            sums = self.sums[key] = [0, 0, 0, 0]
        sums[0] += 1
        sums[1] += r.prompt_tokens
        sums[2] += r.completion_tokens
        sums[3] += r.cached_prompt_tokens
        self.records += 1

    def table(self) -> list[UsageRow]:
        return [(k.endpoint_id, k.model, k.api_key, *v) for k, v in self.sums.items()]  # type: ignore[misc]

    @classmethod
    def from_rows(cls, per_api_key: bool, rows: Iterable[UsageRow], seen: SeenIds, position: int) -> Aggregate:
        sums = {UsageKey(e, m, a): [r, p, c, k] for e, m, a, r, p, c, k in rows}
        return cls(per_api_key, sums, seen, position)
