"""One billing day's per-request usage → per (endpoint, model) totals, synced incrementally.

Records stream into running sums page by page, so memory does not grow with the day's volume.
Records come in no documented order, so an incremental poll verifies itself: it re-reads the
page holding the last record it saw, checks that record (and the ids before it on that page)
are where they were, reads only what follows, and checks that the aggregated count equals the
server's `total`. Any mismatch falls back to a full resync of the day.

At the billing day's rollover the old day gets one last full pull (late records) and is kept
as the finalised previous day; today's counters start from zero. Cursor and totals live in the
state store, so a restart resumes without downloading the day again.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import math
import time
from array import array
from bisect import bisect_left
from collections.abc import Callable, Iterable
from decimal import Decimal
from types import MappingProxyType

from exporter.billing import BillingClient, BillingError, RecordError, UsagePage, UsageRecord
from exporter.clock import Clock
from exporter.logs import get_logger
from exporter.schema import PriceConfig
from exporter.snapshots import UsageKey, UsageSnapshot, UsageTotals
from exporter.state import StateStore, UsageCursor, UsageRow

log = get_logger(__name__)

MILLION = Decimal(1_000_000)
PROGRESS_EVERY = 5.0
"""Seconds between progress lines while one read of a day goes on."""
FULL_READS = 3
"""Reads of a whole day in a row that may disagree with `total` (or with each other) before the refresh fails."""
FINALISE_ATTEMPTS = 10
"""Refreshes that may fail on yesterday's last pull before today's counting goes ahead without it."""


ID_BUCKETS = 4096


def _digest(request_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "big")


class SeenIds:
    """The request ids of one day, as 64-bit digests in sorted arrays (8 bytes an id, so a day of
    a million requests costs 8 MB): one array per leading 12 bits, so an insert moves little."""

    def __init__(self, buckets: list[array[int]] | None = None) -> None:
        self._buckets = buckets or [array("Q") for _ in range(ID_BUCKETS)]
        self.count = sum(map(len, self._buckets))

    def add(self, request_id: str) -> bool:
        """Remember `request_id`; False if it was seen before."""
        digest = _digest(request_id)
        bucket = self._buckets[digest >> 52]
        at = bisect_left(bucket, digest)
        if at < len(bucket) and bucket[at] == digest:
            return False
        bucket.insert(at, digest)
        self.count += 1
        return True

    def copy(self) -> SeenIds:
        return SeenIds([array("Q", bucket) for bucket in self._buckets])

    def chunks(self) -> list[memoryview]:
        """The digests, in order, as views (for writing out without a copy of the whole)."""
        return [memoryview(bucket) for bucket in self._buckets if bucket]

    @classmethod
    def from_bytes(cls, data: bytes) -> SeenIds:
        """The ids `chunks()` wrote (data not a whole number of digests is refused: ValueError)."""
        digests = array("Q")
        digests.frombytes(data)
        buckets = [array("Q") for _ in range(ID_BUCKETS)]
        for digest in digests:
            buckets[digest >> 52].append(digest)
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

    def copy(self) -> Aggregate:
        return Aggregate(self.per_api_key, {k: list(v) for k, v in self.sums.items()}, self.seen.copy(), self.rows)

    def add(self, records: Iterable[UsageRecord]) -> None:
        for r in records:
            self.rows += 1
            if not self.seen.add(r.request_id):
                self.duplicates.add(r.request_id)
                continue
            key = UsageKey(r.endpoint, r.model, r.apikey if self.per_api_key else "")
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


def estimate(price: PriceConfig | None, prompt: int, completion: int, cached: int) -> Decimal | None:
    """Tokens × configured prices; cached prompt tokens are part of the prompt tokens."""
    if price is None:
        return None
    cached_price = (
        price.prompt_per_million if price.cached_prompt_per_million is None else price.cached_prompt_per_million
    )
    return (
        (prompt - cached) * price.prompt_per_million + cached * cached_price + completion * price.completion_per_million
    ) / MILLION


def fingerprint(ids: Iterable[str]) -> str:
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()


class ResyncNeeded(Exception):
    """The incremental view no longer matches the server's; the day must be read again."""


class UsageSync:
    def __init__(
        self,
        client: BillingClient,
        clock: Clock,
        state: StateStore,
        *,
        per_api_key: bool,
        prices: Iterable[PriceConfig] = (),
    ) -> None:
        self.client = client
        self.clock = clock
        self.state = state
        self.per_api_key = per_api_key
        self.prices = {p.model: p for p in prices}
        self.settings = f"page_size={client.page_size};per_api_key={per_api_key};project_id={client.project_id}"
        self.resyncs = 0
        self._day: dt.date | None = None
        self._aggregate = Aggregate(per_api_key)
        self._cursor: UsageCursor | None = None
        self._created = 0.0
        self._published: UsageSnapshot | None = None
        """The last snapshot returned (a poll that finds nothing new returns it again)."""
        self._previous: tuple[dt.date, Aggregate, float] | None = None
        """The day before, finalised: its day, sums and start (priced anew in every snapshot)."""
        self._finalise_failures = 0

    # -- snapshots --

    def _snapshot(
        self, day: dt.date, aggregate: Aggregate, created: float, *, with_previous: bool = True
    ) -> UsageSnapshot:
        totals = {
            key: UsageTotals(r, p, c, k, estimate(self.prices.get(key.model), p, c, k))
            for key, (r, p, c, k) in aggregate.sums.items()
        }
        previous = self._previous if with_previous else None
        return UsageSnapshot(
            day=day,
            totals=MappingProxyType(totals),
            records=aggregate.records,
            created=created,
            resyncs=self.resyncs,
            previous_day=self._snapshot(*previous, with_previous=False) if previous else None,
        )

    def reprice(self, prices: Iterable[PriceConfig]) -> UsageSnapshot | None:
        """Take new prices; the figures priced with them (None before the first sync). No API call."""
        self.prices = {p.model: p for p in prices}
        if self._day is None or self._cursor is None:
            return None
        self._published = self._snapshot(self._day, self._aggregate, self._created)
        return self._published

    # -- paging --

    def _read(
        self,
        day: dt.date,
        aggregate: Aggregate,
        first_page: int = 1,
        skip: int = 0,
        verify: Callable[[UsagePage], None] | None = None,
    ) -> tuple[UsagePage, bool]:
        """Add every record from `first_page` on (the first `skip` of it excepted) to `aggregate`.

        Returns the highest page that held records (the first page if none did), where the next
        poll picks up, and whether more than one page was read (then in parallel). Pages arrive in
        any order after the first; after a parallel read the first page is read again, and if its
        records moved (records arrived at the head of the list meanwhile, so the other pages were
        read shifted) the read is not to be trusted.
        """
        boundary: UsagePage | None = None
        start: UsagePage | None = None
        pages = total = 0
        said = time.monotonic()
        for page in self.client.usage_pages(day, first_page):
            pages += 1
            if time.monotonic() - said >= PROGRESS_EVERY:  # a first sync of a busy day takes a while
                said = time.monotonic()
                of = max(pages, math.ceil(max(total, page.total) / self.client.page_size) - first_page + 1)
                log.info("reading usage", day=day, pages=pages, of=of)
            if start is None:
                if verify is not None:
                    verify(page)
                aggregate.add(page.records[skip:])
                start = boundary = page
            else:
                aggregate.add(page.records)
                if page.records and page.page_num > boundary.page_num:  # type: ignore[union-attr]
                    boundary = page
            total = max(total, page.total)
        assert start is not None  # usage_pages yields at least one page
        assert boundary is not None
        if aggregate.rows != total:
            raise ResyncNeeded(f"read {aggregate.rows} records, `total` says {total}")
        if pages > 1:
            ids = [r.request_id for r in start.records]
            again = [r.request_id for r in self.client.usage_page(day, start.page_num).records]
            if again[: len(ids)] != ids:
                raise ResyncNeeded("records moved while the pages were read")
        return boundary, pages > 1

    def _full(self, day: dt.date) -> tuple[Aggregate, UsagePage]:
        """Every record of the day, each request counted once.

        Records that arrive while pages are read in parallel can make the count miss `total`, or
        shift records between pages so that one is read twice and another not at all: the day is
        read again then. Request ids that repeat in a read spanning several pages may be such a
        shift, or the API listing a request twice: the day is read again, and repeats that the
        next read shows again (it may show new ones too, on a live day) are the API's, each
        request counted once.
        """
        repeated: set[str] | None = None
        problem = ""
        for _ in range(FULL_READS):
            aggregate = Aggregate(self.per_api_key)
            try:
                boundary, parallel = self._read(day, aggregate)
            except ResyncNeeded as mismatch:
                problem = str(mismatch)
                continue
            if not parallel or not aggregate.duplicates or (repeated is not None and repeated <= aggregate.duplicates):
                if aggregate.duplicates:
                    log.warning("request ids listed more than once; each is counted once",
                                day=day, repeated=len(aggregate.duplicates))  # fmt: skip
                return aggregate, boundary
            repeated = aggregate.duplicates
            problem = f"{len(repeated)} request ids read twice"
        raise RecordError(f"usage {day}: {problem} in {FULL_READS} reads in a row")

    def _incremental(self, cursor: UsageCursor) -> tuple[Aggregate, UsagePage]:
        position = cursor.records - 1
        offset = position % self.client.page_size

        def verify(page: UsagePage) -> None:
            ids = [r.request_id for r in page.records[: offset + 1]]
            if len(ids) <= offset or ids[offset] != cursor.boundary_id or fingerprint(ids) != cursor.page_fingerprint:
                raise ResyncNeeded("the last record seen is no longer where it was")

        aggregate = self._aggregate.copy()
        first_page = position // self.client.page_size + 1
        boundary, parallel = self._read(cursor.day, aggregate, first_page, offset + 1, verify)
        if aggregate.duplicates and parallel:  # a shift between pages read at once, or the API's repeat
            raise ResyncNeeded(f"{len(aggregate.duplicates)} new records repeat request ids already counted")
        return aggregate, boundary

    def _cursor_after(
        self, day: dt.date, aggregate: Aggregate, boundary: UsagePage, finalised: bool = False
    ) -> UsageCursor:
        ids = [r.request_id for r in boundary.records]
        return UsageCursor(
            day=day,
            settings=self.settings,
            records=aggregate.rows,
            boundary_id=ids[-1] if ids else "",
            page_fingerprint=fingerprint(ids),
            finalised=finalised,
        )

    def _save(self, cursor: UsageCursor, aggregate: Aggregate) -> None:
        keep_from = self.clock.today() - dt.timedelta(days=1)
        self.state.save_usage(
            cursor, aggregate.table(), self.clock.now().timestamp(), keep_from, ids=aggregate.seen.chunks()
        )

    # -- the refresh --

    def _restore(self, today: dt.date) -> None:
        for day in (today - dt.timedelta(days=1), today):
            saved = self.state.load_usage(day)
            if saved is None or saved[0].settings != self.settings:
                continue
            try:
                seen = SeenIds.from_bytes(self.state.load_usage_ids(day))
            except ValueError:
                seen = SeenIds()
            aggregate = Aggregate.from_rows(self.per_api_key, saved[1], seen, saved[0].records)
            if day == today and seen.count != aggregate.records:
                # Saved without its request ids (an older version) or with them damaged: without
                # them a repeat could be counted twice, so the day is read afresh.
                log.info("usage sync starts the day afresh: its request ids were not saved", day=day)
                continue
            self._day, self._cursor, self._aggregate = day, saved[0], aggregate
            self._created = self.clock.day_start(day).timestamp()
            if day < today and self._cursor.finalised:
                self._previous = (day, self._aggregate, self._created)
        if self._day == today:
            log.info("resuming usage sync", day=today, records=self._aggregate.records)

    def _finalise(self, day: dt.date) -> None:
        """The old day's last full pull, for records that arrived late."""
        aggregate, boundary = self._full(day)
        self._save(self._cursor_after(day, aggregate, boundary, finalised=True), aggregate)
        self._previous = (day, aggregate, self.clock.day_start(day).timestamp())
        log.info("finalised usage day", day=day, records=aggregate.records)

    def refresh(self) -> UsageSnapshot:
        today = self.clock.today()
        if self._day is None:
            self._restore(today)
        if self._day is not None and self._day < today:
            if not (self._cursor and self._cursor.finalised):
                try:
                    self._finalise(self._day)
                except BillingError:
                    self._finalise_failures += 1
                    if self._finalise_failures < FINALISE_ATTEMPTS:
                        raise
                    log.error("usage day could not be finalised; moving on to today",
                              day=self._day, tries=self._finalise_failures)  # fmt: skip
            self._day, self._finalise_failures = None, 0
        if self._day is None:
            self._day, self._cursor, self._aggregate = today, None, Aggregate(self.per_api_key)
            self._created = self.clock.day_start(today).timestamp()

        try:
            if self._cursor is None or self._cursor.records == 0:
                raise ResyncNeeded("no cursor")
            aggregate, boundary = self._incremental(self._cursor)
        except ResyncNeeded as reason:
            if self._cursor is not None and self._cursor.records:
                self.resyncs += 1
                log.warning("usage resync", day=today, reason=str(reason))
            aggregate, boundary = self._full(today)
        if any(
            new < old
            for key, sums in self._aggregate.sums.items()
            for new, old in zip(aggregate.sums.get(key, (0, 0, 0, 0)), sums, strict=True)
        ):
            # Records were removed upstream: the counters reset here, and `created` says when.
            self._created = self.clock.now().timestamp()
        cursor = self._cursor_after(today, aggregate, boundary)
        published = self._published
        if (
            published is not None
            and published.day == today
            and published.resyncs == self.resyncs
            and cursor == self._cursor
            and aggregate.rows == self._aggregate.rows
            and aggregate.sums == self._aggregate.sums
        ):
            return published  # nothing new: nothing rewritten, and the same snapshot renders from cache
        self._save(cursor, aggregate)  # first: if the state file refuses it, nothing here has moved
        self._cursor, self._aggregate = cursor, aggregate
        self._published = self._snapshot(today, aggregate, self._created)
        return self._published
