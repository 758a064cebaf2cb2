"""One billing day's per-request usage → per (endpoint, model) totals, synced incrementally.

Records stream into running sums page by page, so memory does not grow with the day's volume.
The API documents no order for a day's records, and services list them oldest first (new
records at the end) or newest first (new records at the head, everything known shifted down by
their number). The sync finds out which from what the pages show, reads only the new records,
and verifies itself every poll:
- oldest first: it re-reads the page holding the last record it saw, checks that record (and
  the ids before it on that page) are where they were, and reads only what follows;
- newest first: it reads the head down to the first records it saw, which must sit, in the same
  order, exactly as many places down as `total` has grown;
and in both the aggregated count must equal the server's `total`. When the checks of the order
last seen fail and there are new records, the other order is tried (from newest first, that
takes a full read: no end of the list is saved to find again); anything else falls back to a
full read of the day, which itself tries the other order when its first attempt fails.

At the billing day's rollover the old day gets one last full pull (late records) and is kept
as the finalised previous day; today's counters start from zero. Cursor and totals live in the
state store, so a restart resumes without downloading the day again.

Today's estimated amount is a counter: each poll prices the tokens it counted with the prices of
that moment and adds them, so new prices (a reload, or a restart on an edited config) price
only what is counted from then on, and the counter never goes down with a price cut. What it
counted is kept in the state store beside the day's totals (`usage_amounts`), so a restart
resumes it where it stood. The finalised previous day is a gauge, priced whole with the prices
of the moment.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import math
import time
from array import array
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from types import MappingProxyType

from exporter.billing import BillingAPI, BillingError, RecordError, UsagePage, UsageRecord
from exporter.config.schema import PriceConfig
from exporter.core.clock import Clock
from exporter.core.logs import get_logger
from exporter.model.snapshots import UsageKey, UsageRow, UsageSnapshot, UsageTotals
from exporter.state import StateStore, UsageCursor

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
        return self.add_digest(_digest(request_id))

    def add_digest(self, digest: int) -> bool:
        """Remember a request id by its `_digest` (when the caller has it already)."""
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
            self.count(r, _digest(r.request_id))

    def count(self, r: UsageRecord, digest: int) -> None:
        """One record, its request id's `_digest` already made: counted unless its id was seen."""
        self.rows += 1
        if not self.seen.add_digest(digest):
            self.duplicates.add(r.request_id)
            return
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
    """`cost`, or None for a model without a configured price."""
    return None if price is None else cost(price, prompt, completion, cached)


def cost(price: PriceConfig, prompt: int, completion: int, cached: int) -> Decimal:
    """Tokens × a model's configured price; cached prompt tokens are part of the prompt tokens."""
    cached_price = (
        price.prompt_per_million if price.cached_prompt_per_million is None else price.cached_prompt_per_million
    )
    return (
        (prompt - cached) * price.prompt_per_million + cached * cached_price + completion * price.completion_per_million
    ) / MILLION


Tokens = tuple[int, int, int]
"""prompt, completion, cached: what an estimate is made of."""


@dataclass(frozen=True, slots=True)
class Counted:
    """What today's estimate counter of one key has counted: `amount` for the tokens `covered`,
    each priced by the prices in effect when it was counted."""

    amount: Decimal
    covered: Tokens


NOTHING_COUNTED = Counted(Decimal(0), (0, 0, 0))


def count(
    counted: Mapping[UsageKey, Counted], aggregate: Aggregate, prices: Mapping[str, PriceConfig]
) -> dict[UsageKey, Counted]:
    """`counted`, with the tokens `aggregate` holds beyond it priced by `prices` and added.

    A key whose model has no price is left as it was: its tokens are priced by the first price
    its model gets (a price added to the config covers the day so far; nothing went out at a
    lower figure meanwhile, since a key without a price has no counter). An amount that covers
    more tokens than the key holds (counted on a list read afresh that shows fewer) is not trusted:
    that key's tokens are priced afresh.
    """
    after = dict(counted)
    for key, (_, prompt, completion, cached) in aggregate.sums.items():
        price = prices.get(key.model)
        before = after.get(key, NOTHING_COUNTED)
        if not all(had <= has for had, has in zip(before.covered, (prompt, completion, cached), strict=True)):
            before = after[key] = NOTHING_COUNTED
        if price is None or before.covered == (prompt, completion, cached):
            continue
        p, c, k = before.covered
        amount = before.amount + cost(price, prompt - p, completion - c, cached - k)
        after[key] = Counted(amount, (prompt, completion, cached))
    return after


def fingerprint(ids: Iterable[str]) -> str:
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()


def head_ids(digests: Iterable[int]) -> str:
    """Request ids at the head of a day's list, kept to be found again: their `_digest`s, as hex."""
    return array("Q", digests).tobytes().hex()


def _digests(head: str) -> array[int]:
    digests = array("Q")
    digests.frombytes(bytes.fromhex(head))
    return digests


def _shifted_by(first: UsagePage, again: UsagePage) -> int | None:
    """How far the records of `first` moved down in `again` (the same page read later), when
    that is by exactly the number of records added meanwhile (a list showing the newest first);
    else None."""
    shift = again.total - first.total
    ids = [r.request_id for r in first.records]
    later = [r.request_id for r in again.records]
    if shift <= 0 or shift >= len(later) or later[shift:] != ids[: len(later) - shift]:
        return None
    return shift


class _Frame:
    """A newest-first list's records placed where the first page read saw them.

    A page read once `shift` more records had arrived at the head holds records that were
    `shift` places further up when the first page was read; placing each by that position, pages
    read out of order overlap (each slot is taken once, and an overlap must show the same id) or
    leave holes (read again). Slots hold id digests: 8 bytes a record, for the read's duration.
    """

    def __init__(self, total: int, size: int, page_size: int, new: int, aggregate: Aggregate) -> None:
        self.total = total
        """`total` as the first page said it: the frame everything is placed in."""
        self.latest = total
        self.page_size = page_size
        self.new = new
        """Slots below this are records to count; the rest were counted before (only checked)."""
        self.aggregate = aggregate
        self.slots = array("Q", [0]) * size
        self.filled = bytearray(size)
        self.pages = 0

    def place(self, page: UsagePage) -> None:
        self.pages += 1
        self.latest = max(self.latest, page.total)
        shift = page.total - self.total
        if shift < 0:
            raise ResyncNeeded("records were removed while the pages were read")
        start = (page.page_num - 1) * self.page_size - shift
        size = len(self.slots)
        for i, record in enumerate(page.records):
            at = start + i
            if at < 0:
                continue  # arrived after the first page was read: the next poll counts it
            if at >= size:
                break
            digest = _digest(record.request_id)
            if self.filled[at]:
                if self.slots[at] != digest:
                    raise ResyncNeeded("records moved other than by new ones arriving at the head")
                continue
            self.slots[at], self.filled[at] = digest, 1
            if at < self.new:
                self.aggregate.count(record, digest)

    def hole(self) -> int:
        """The first slot no page has filled yet; -1 when none is left."""
        return self.filled.find(0)

    def page_of(self, slot: int) -> int:
        """The page that holds `slot` now, as far as the latest `total` tells."""
        return (slot + self.latest - self.total) // self.page_size + 1


class ResyncNeeded(Exception):
    """The incremental view no longer matches the server's; the day must be read again."""


class UsageSync:
    def __init__(
        self,
        client: BillingAPI,
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
        self._counted: dict[UsageKey, Counted] = {}
        """What today's estimate counters counted, key by key (see `count`)."""
        self._saved: dict[UsageKey, Counted] = {}
        """`_counted` as the state store holds it."""
        self._published: UsageSnapshot | None = None
        """The last snapshot returned (a poll that finds nothing new returns it again)."""
        self._published_prices: object = None
        """The price table `_published` was priced with: a poll with nothing new still reprices
        after a reload whose new prices arrived while a refresh was running."""
        self._previous: tuple[dt.date, Aggregate, float] | None = None
        """The day before, finalised: its day, sums and start (priced anew in every snapshot)."""
        self._finalise_failures = 0
        self._total_seen = 0
        """`total` as the last page read this poll said it."""
        self._learnt = False
        """The pages of the read under way showed the order."""
        self.newest_first = False
        """How the service lists a day's records, as last seen (oldest first until it shows otherwise)."""

    # -- snapshots --

    def _snapshot(
        self,
        day: dt.date,
        aggregate: Aggregate,
        created: float,
        prices: Mapping[str, PriceConfig],
        counted: Mapping[UsageKey, Counted] | None = None,
    ) -> UsageSnapshot:
        """Today's figures, given what its counters `counted`, with the finalised day before; or,
        without, that day before, every token priced with `prices` (its figures are gauges)."""
        totals = {}
        for key, (r, p, c, k) in aggregate.sums.items():
            price = prices.get(key.model)
            if price is None:
                amount = None
            elif counted is None:
                amount = cost(price, p, c, k)
            else:
                amount = counted.get(key, NOTHING_COUNTED).amount
            totals[key] = UsageTotals(r, p, c, k, amount)
        previous = self._previous if counted is not None else None
        return UsageSnapshot(
            day=day,
            totals=MappingProxyType(totals),
            records=aggregate.records,
            created=created,
            resyncs=self.resyncs,
            previous_day=self._snapshot(*previous, prices) if previous else None,
        )

    def reprice(self, prices: Iterable[PriceConfig]) -> UsageSnapshot | None:
        """Take new prices; the figures with them (None before the first sync). No API call.

        Today's estimates are counters: they keep what they counted, and the new prices price the
        tokens counted from now on (and those of a model that had no price). The finalised day
        before is priced anew whole. What this counted is saved by the next poll.
        """
        self.prices = {p.model: p for p in prices}
        if self._day is None or self._cursor is None:
            return None
        self._counted = count(self._counted, self._aggregate, self.prices)
        self._published = self._snapshot(self._day, self._aggregate, self._created, self.prices, self._counted)
        self._published_prices = self.prices
        return self._published

    # -- paging --

    def _read(
        self,
        day: dt.date,
        aggregate: Aggregate,
        first_page: int = 1,
        skip: int = 0,
        verify: Callable[[UsagePage], None] | None = None,
    ) -> tuple[UsagePage, bool, str | None]:
        """Add every record from `first_page` on (the first `skip` of it excepted) to `aggregate`,
        for a list that shows the oldest first.

        Returns the highest page that held records (the first page if none did), where the next
        poll picks up; whether more than one page was read (then in parallel); and the head's
        fingerprint when page 1 was read. Pages arrive in any order after the first; after a
        parallel read the first page is read again, and if its records moved (records arrived at
        the head of the list meanwhile, so the other pages were read shifted) the read is not to
        be trusted, and when they moved by exactly the records added, the list shows the newest first.
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
            again = self.client.usage_page(day, start.page_num)
            if [r.request_id for r in again.records][: len(ids)] != ids:
                if start.page_num == 1 and _shifted_by(start, again) is not None:
                    self._learn(day, newest_first=True)
                raise ResyncNeeded("records moved while the pages were read")
        head = None
        if start.page_num == 1:
            head = head_ids(_digest(r.request_id) for r in start.records[: aggregate.rows])
        return boundary, pages > 1, head

    def _read_newest(self, day: dt.date, aggregate: Aggregate, known: int = 0, head: str = "") -> tuple[int, str]:
        """Add to `aggregate` the records at the head of a list that shows the newest first, down
        to the `known` ones counted before (all of them when none were), whose first ids, `head`,
        must show right below the new ones: as many of them as the pages read anyway hold, and
        at least the first.

        The pages needed are read in parallel and placed in the frame of the first one (see
        `_Frame`); holes left by pages read out of order while records arrived are read again,
        and then the first page once more, which must fit what was placed. Returns the number of
        records the list had when its first page was read (now counted) and the ids at its head.
        """
        first = self.client.usage_page(day, 1)  # page 1 tells whether the service caps its pages
        self._total_seen = first.total
        new = first.total - known
        if new < 0:
            raise ResyncNeeded(f"`total` fell from {known} to {first.total}")
        page_size = self.client.page_size
        old_head = _digests(head)
        if known and not old_head:
            raise ResyncNeeded("no head saved to find again")
        # the old head's ids to check: those on the pages that the new records take anyway
        checked = min(len(old_head), max(1, math.ceil((new + 1) / page_size) * page_size - new)) if known else 0
        frame = _Frame(first.total, new + checked, page_size, new, aggregate)
        said = time.monotonic()
        try:
            frame.place(first)
            last_page = math.ceil(len(frame.slots) / page_size)
            if last_page > 1:
                for page in self.client.usage_pages(day, 2, last_page):
                    frame.place(page)
                    if time.monotonic() - said >= PROGRESS_EVERY:
                        said = time.monotonic()
                        log.info("reading usage", day=day, pages=frame.pages, of=last_page)
            refills = max(4, last_page // 2)
            while (hole := frame.hole()) >= 0 and refills:
                refills -= 1
                frame.place(self.client.usage_page(day, frame.page_of(hole)))
            if frame.hole() >= 0:
                raise ResyncNeeded(f"records kept moving: {frame.filled.count(0)} of {len(frame.slots)} unread")
            if frame.latest != frame.total:  # records arrived meanwhile: the head must fit what was placed
                frame.place(self.client.usage_page(day, 1))
            if frame.slots[new:] != old_head[:checked]:
                raise ResyncNeeded("the records counted before are not where `total` says")
        except ResyncNeeded:
            again = self.client.usage_page(day, 1)
            if again.total > first.total and [r.request_id for r in again.records] == [
                r.request_id for r in first.records
            ]:
                self._learn(day, newest_first=False)
            raise
        # the new head: the new records, then as much of the old head as a page holds
        top = frame.slots[: min(page_size, new)]
        top.extend(old_head[: page_size - len(top)])
        return first.total, head_ids(top)

    def _learn(self, day: dt.date, *, newest_first: bool) -> None:
        self._learnt = True
        if newest_first != self.newest_first:
            log.info("usage records are listed " + ("newest first" if newest_first else "oldest first"), day=day)
        self.newest_first = newest_first

    def _full(self, day: dt.date) -> tuple[Aggregate, UsageCursor]:
        """Every record of the day, each request counted once; and the cursor after it.

        Records that arrive while pages are read in parallel can make the count miss `total`, or
        shift records between pages so that one is read twice and another not at all: the day is
        read again then. Request ids that repeat in a read spanning several pages may be such a
        shift, or the API listing a request twice: the day is read again, and repeats that the
        next read shows again (it may show new ones too, on a live day) are the API's, each
        request counted once.

        The first read assumes the order last seen. A read that fails without showing the order
        (on a busy day records may arrive faster than the first page can show them shifting) is
        followed by one in the other order.
        """
        repeated: set[str] | None = None
        problem = ""
        newest_first = self.newest_first
        for _ in range(FULL_READS):
            aggregate = Aggregate(self.per_api_key)
            self._learnt = False
            try:
                if newest_first:
                    _, head = self._read_newest(day, aggregate)
                    parallel = aggregate.rows > self.client.page_size
                else:
                    boundary, parallel, read_head = self._read(day, aggregate)
                    head = read_head or ""
            except ResyncNeeded as mismatch:
                problem = str(mismatch)
                newest_first = self.newest_first if self._learnt else not newest_first
                continue
            if not parallel or not aggregate.duplicates or (repeated is not None and repeated <= aggregate.duplicates):
                if aggregate.duplicates:
                    log.warning("request ids listed more than once; each is counted once",
                                day=day, repeated=len(aggregate.duplicates))  # fmt: skip
                if newest_first != self.newest_first:
                    self._learn(day, newest_first=newest_first)
                if newest_first:
                    return aggregate, self._newest_cursor(day, aggregate, head)
                return aggregate, self._cursor_after(day, aggregate, boundary, head)
            repeated = aggregate.duplicates
            problem = f"{len(repeated)} request ids read twice"
        raise RecordError(f"usage {day}: {problem} in {FULL_READS} reads in a row")

    def read_day(self, day: dt.date) -> Aggregate:
        """One whole day's usage, read afresh (each request counted once); nothing is saved."""
        return self._full(day)[0]

    def _incremental(self, cursor: UsageCursor) -> tuple[Aggregate, UsageCursor]:
        """The records added since `cursor`, read in the order the list was last seen in; if its
        checks fail and there are new records, in the other (the service may list either way)."""
        problem: ResyncNeeded | None = None
        self._total_seen = cursor.records
        for newest_first in (cursor.newest_first, not cursor.newest_first):
            if problem is not None and self._total_seen <= cursor.records:
                break  # nothing new, and the list changed: no order explains that
            if not (cursor.head_ids if newest_first else cursor.page_fingerprint):
                continue  # nothing saved to check that order against
            try:
                result = self._incremental_newest(cursor) if newest_first else self._incremental_oldest(cursor)
            except ResyncNeeded as mismatch:
                problem = problem or mismatch
                continue
            self._learn(cursor.day, newest_first=newest_first)
            return result
        if cursor.newest_first and not cursor.page_fingerprint:
            # Newest first explained nothing, and there is no end of the list saved to try the other
            # order with: the full read starts oldest first, which leaves a cursor fit for both.
            self.newest_first = False
        raise problem or ResyncNeeded("nothing saved to check the list against")

    def _incremental_newest(self, cursor: UsageCursor) -> tuple[Aggregate, UsageCursor]:
        aggregate = self._aggregate.copy()
        rows, head = self._read_newest(cursor.day, aggregate, cursor.records, cursor.head_ids)
        if aggregate.duplicates and rows - cursor.records >= self.client.page_size:  # pages read at once
            raise ResyncNeeded(f"{len(aggregate.duplicates)} new records repeat request ids already counted")
        return aggregate, self._newest_cursor(cursor.day, aggregate, head)

    def _incremental_oldest(self, cursor: UsageCursor) -> tuple[Aggregate, UsageCursor]:
        position = cursor.records - 1
        offset = position % self.client.page_size

        def verify(page: UsagePage) -> None:
            self._total_seen = page.total
            ids = [r.request_id for r in page.records[: offset + 1]]
            if len(ids) <= offset or ids[offset] != cursor.boundary_id or fingerprint(ids) != cursor.page_fingerprint:
                raise ResyncNeeded("the last record seen is no longer where it was")

        aggregate = self._aggregate.copy()
        first_page = position // self.client.page_size + 1
        boundary, parallel, head = self._read(cursor.day, aggregate, first_page, offset + 1, verify)
        if aggregate.duplicates and parallel:  # a shift between pages read at once, or the API's repeat
            raise ResyncNeeded(f"{len(aggregate.duplicates)} new records repeat request ids already counted")
        return aggregate, self._cursor_after(cursor.day, aggregate, boundary, head or cursor.head_ids)

    def _cursor_after(self, day: dt.date, aggregate: Aggregate, boundary: UsagePage, head: str) -> UsageCursor:
        """Where a list that shows the oldest first was left: its last record counted."""
        ids = [r.request_id for r in boundary.records]
        return UsageCursor(
            day=day,
            settings=self.settings,
            records=aggregate.rows,
            boundary_id=ids[-1] if ids else "",
            page_fingerprint=fingerprint(ids),
            head_ids=head,
            page_size=self.client.page_size,
        )

    def _newest_cursor(self, day: dt.date, aggregate: Aggregate, head: str) -> UsageCursor:
        """Where a list that shows the newest first was left: its head (its last record moves
        with every new one, so there is no page of it to find again)."""
        return UsageCursor(
            day,
            self.settings,
            aggregate.rows,
            "",
            "",
            head_ids=head,
            newest_first=True,
            page_size=self.client.page_size,
        )

    def _save(self, cursor: UsageCursor, aggregate: Aggregate, counted: dict[UsageKey, Counted] | None = None) -> None:
        """The day's cursor and totals, and with them (in one transaction) what its counters
        `counted` when that changed."""
        keep_from = self.clock.today() - dt.timedelta(days=1)
        amounts = None
        if counted is not None and counted != self._saved:
            amounts = [(k.endpoint_id, k.model, k.api_key, str(c.amount), *c.covered) for k, c in counted.items()]
        self.state.save_usage(
            cursor, aggregate.table(), self.clock.now().timestamp(), keep_from, ids=aggregate.seen.chunks(),
            amounts=amounts,
        )  # fmt: skip
        if counted is not None:
            self._saved = counted

    def _load_counted(self, day: dt.date) -> dict[UsageKey, Counted]:
        return {
            UsageKey(e, m, a): Counted(Decimal(amount), (p, c, k))
            for e, m, a, amount, p, c, k in self.state.load_usage_amounts(day)
        }

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
            self.newest_first = saved[0].newest_first
            self._created = self.clock.day_start(day).timestamp()
            if day < today and self._cursor.finalised:
                self._previous = (day, self._aggregate, self._created)
            if day == today:
                self._counted = self._saved = self._load_counted(day)
        if self._day == today:
            log.info("resuming usage sync", day=today, records=self._aggregate.records)
            saved_size = self._cursor.page_size if self._cursor is not None else 0
            if 0 < saved_size < self.client.page_size:  # the service caps its pages
                self.client.adopt_cap(saved_size)

    def _finalise(self, day: dt.date) -> None:
        """The old day's last full pull, for records that arrived late."""
        aggregate, cursor = self._full(day)
        self._save(dataclasses.replace(cursor, finalised=True), aggregate)
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
            # Nothing at a rollover; after a restart that reads the day afresh (its settings
            # changed), what its counters counted, so that they go on from there.
            self._counted = self._saved = self._load_counted(today)
            self._created = self.clock.day_start(today).timestamp()

        try:
            if self._cursor is None or self._cursor.records == 0:
                raise ResyncNeeded("no cursor")
            aggregate, cursor = self._incremental(self._cursor)
        except ResyncNeeded as reason:
            if self._cursor is not None and self._cursor.records:
                self.resyncs += 1
                log.warning("usage resync", day=today, reason=str(reason))
            aggregate, cursor = self._full(today)
        before = self._counted
        if any(
            new < old
            for key, sums in self._aggregate.sums.items()
            for new, old in zip(aggregate.sums.get(key, (0, 0, 0, 0)), sums, strict=True)
        ):
            # Records were removed upstream: the counters reset here, and `created` says when; the
            # estimates start again from the day's tokens at today's prices.
            self._created = self.clock.now().timestamp()
            before = {}
        prices = self.prices  # once: a reload may set new ones while this runs
        counted = count(before, aggregate, prices)
        published = self._published
        if (
            published is not None
            and published.day == today
            and published.resyncs == self.resyncs
            and cursor == self._cursor
            and aggregate.rows == self._aggregate.rows
            and aggregate.sums == self._aggregate.sums
            and self._published_prices is prices
            and counted == self._saved
        ):
            return published  # nothing new: nothing rewritten, and the same snapshot renders from cache
        self._save(cursor, aggregate, counted)  # first: if the state file refuses it, nothing here has moved
        self._cursor, self._aggregate, self._counted = cursor, aggregate, counted
        self._published = self._snapshot(today, aggregate, self._created, prices, counted)
        self._published_prices = prices
        return self._published
