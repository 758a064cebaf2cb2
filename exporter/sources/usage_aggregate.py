"""A day's usage as running sums: `Aggregate` adds records into totals per (endpoint, model, API
key), counting each request id once, which `SeenIds` remembers in 8 bytes an id.

Every record a read returns passes through `Aggregate.add`, a page at a time (a list shown newest
first, through `Aggregate.count`): it is the hot loop of a day's read.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Iterable, Sequence

from xxhash import xxh3_64_intdigest

from exporter.billing import UsageRecord
from exporter.model.snapshots import UsageKey, UsageRow

ID_DIGEST = "xxh3_64"
"""How a request id is made 64 bits (`id_digest`): XXH3, a sixth of a BLAKE2b's cost with the
id's encoding and the call (`bench.seen_ids`: 0.041 against 0.276 ms a page of 500 ids), which was over a third of
counting a page. It is saved with the ids (in the reader's `settings`): ids an earlier
version saved as BLAKE2b digests are never compared with these, the day is read afresh instead."""


def id_digest(request_id: str) -> int:
    return xxh3_64_intdigest(request_id.encode())


Buckets = list["array[int] | None"]
"""Sorted digests by their leading bits (a list of 1 << bits: the digest's bucket is at `digest >>
(64 - bits)`), None where no digest has come."""

FIRST_BITS = 12
"""A new set's buckets: by the leading 12 bits (4,096, 32 KB of empty slots)."""
BUCKET_IDS = 256
"""The ids a bucket holds on average before the set's buckets are cut by one more bit: an insert
moves at most a few KB at any day size, and a bucket's own cost (its array and slot, some 140
bytes) is a tenth or less of its ids' 1-2 KB."""
_PIECE = 4096


def _bits(count: int) -> int:
    """The leading bits that cut a set of `count` ids into buckets."""
    bits = FIRST_BITS
    while count > BUCKET_IDS << bits:
        bits += 1
    return bits


def _bits_of(buckets: Buckets) -> int:
    return len(buckets).bit_length() - 1


def _split(buckets: Iterable[array[int] | None], bits: int) -> Buckets:
    """Sorted arrays cut by `bits` leading bits, no fewer than theirs: each bucket is a slice of
    one of them, so the ids are copied once, in C. Arrays found out of order (a damaged saved
    list) are refused, ValueError: cut as they are, whole runs of ids would go to buckets where
    they are never looked for, and the count would not show it."""
    shift = 64 - bits
    split: Buckets = [None] * (1 << bits)
    before = -1
    for bucket in filter(None, buckets):
        at = 0
        while at < len(bucket):
            key = bucket[at] >> shift
            upto = bisect_left(bucket, (key + 1) << shift, at)
            if key <= before or bucket[upto - 1] >> shift != key:
                raise ValueError("digests out of order")
            split[key] = bucket[at:upto]
            at, before = upto, key
    return split


class SeenIds:
    """The request ids of one day, as 64-bit digests in sorted arrays (8 bytes an id, so a day of
    a million requests costs 8 MB): one array for each value of the digests' leading bits, so an
    insert moves little. There are 12 bits to start with, and one more each time the buckets hold
    `BUCKET_IDS` on average, so an insert moves as little in a day of ten million ids as in one of
    a million.
    A bucket is made when its first id arrives: an empty or small day costs next to nothing.

    A poll works on a `fork`: it sees the ids of the set it was forked from (its base, left as it
    is) and keeps those it adds apart (`added`), so that a poll costs what it finds, not the day's
    size, and a poll that fails leaves the base untouched. `settle` folds them into the base once
    the poll is kept. A fork's bits follow its own ids, not its base's.
    """

    def __init__(self, buckets: Buckets | None = None, base: SeenIds | None = None) -> None:
        self._buckets: Buckets = buckets if buckets is not None else [None] * (1 << FIRST_BITS)
        self._shift = 64 - _bits_of(self._buckets)
        self.base = base
        self.count: int = sum(len(b) for b in self._buckets if b) + (base.count if base is not None else 0)

    def __contains__(self, digest: int) -> bool:
        bucket = self._buckets[digest >> self._shift]
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
        none). A page's digests at a time: this runs for every record of the day (the buckets are
        cut finer, once they have grown, after a call)."""
        base = self.base if self.base is not None and self.base.count else None  # (a full read's fork: empty)
        buckets, shift = self._buckets, self._shift
        repeated: list[int] = []
        for at_digest, digest in enumerate(digests):
            if base is not None and digest in base:
                repeated.append(at_digest)
                continue
            bucket = buckets[digest >> shift]
            if bucket is None:
                bucket = buckets[digest >> shift] = array("Q")
            at = bisect_left(bucket, digest)
            if at < len(bucket) and bucket[at] == digest:
                repeated.append(at_digest)
                continue
            bucket.insert(at, digest)
        self.count += len(digests) - len(repeated)
        own = self.count - (base.count if base is not None else 0)
        if own > BUCKET_IDS * len(buckets):
            bits = _bits(own)
            self._buckets, self._shift = _split(buckets, bits), 64 - bits
        return repeated

    def fork(self) -> SeenIds:
        """A set that starts with these ids and adds its own apart (see the class)."""
        return SeenIds(base=self)

    def added(self) -> list[memoryview]:
        """The digests a fork added to its base, in order (every digest, for a set that is no fork)."""
        return [memoryview(bucket) for bucket in self._buckets if bucket]

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
        for bucket in self._buckets:
            if bucket:
                base.add_digests(bucket)
        self._buckets, self._shift, self.base, self.count = base._buckets, base._shift, None, base.count

    def chunks(self) -> list[memoryview]:
        """Every digest, in order, as views (for writing out without a copy of the whole)."""
        return [memoryview(bucket) for bucket in self._merged() if bucket]

    def _merged(self) -> Buckets:
        if self.base is None:
            return self._buckets
        merged, own = self.base._merged(), self._buckets
        # The one with fewer buckets is cut as fine as the other (it has fewer ids: bits grow with them).
        if len(own) < len(merged):
            own = _split(own, _bits_of(merged))
        elif len(own) > len(merged):
            merged = _split(merged, _bits_of(own))
        merged = list(merged)
        for key, bucket in enumerate(own):  # (a fork's ids are never its base's)
            if bucket:
                before = merged[key]
                merged[key] = bucket if before is None else array("Q", sorted((*before, *bucket)))
        return merged

    def extend(self, data: bytes) -> None:
        """Add the digests of `data` (as `added` wrote them; some may be known already), a piece at
        a time so that the buckets are cut finer as they grow."""
        digests = array("Q")
        digests.frombytes(data)
        for at in range(0, len(digests), _PIECE):
            self.add_digests(digests[at : at + _PIECE])

    @classmethod
    def from_bytes(cls, data: bytes) -> SeenIds:
        """The ids `chunks()` wrote (data not a whole number of digests, or out of order, is refused:
        ValueError): as they are sorted, each bucket is a slice of them."""
        digests = array("Q")
        digests.frombytes(data)
        return cls(_split((digests,), _bits(len(digests))))


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
        digest = xxh3_64_intdigest
        repeated = self.seen.add_digests([digest(r.request_id.encode()) for r in records])
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
