"""Reading one day's usage list into an `Aggregate`: the whole day, or only what was added since
a `UsageCursor`; `UsageReader` does it, and `UsageSync` builds on it.

Records stream into running sums page by page, so memory does not grow with the day's volume.
The API documents no order for a day's records, and services list them oldest first (new
records at the end) or newest first (new records at the head, everything known shifted down by
their number). The reader finds out which from what the pages show, reads only the new records,
and verifies itself every poll:
- oldest first: it re-reads the page holding the last record it saw, checks that record (and
  the ids before it on that page) are where they were, and reads only what follows;
- newest first: it reads the head down to the first records it saw, which must sit, in the same
  order, exactly as many places down as `total` has grown;
and in both the aggregated count must equal the server's `total`. When the checks of the order
last seen fail and there are new records, the other order is tried (from newest first, that
takes a full read: no end of the list is saved to find again); anything else falls back to a
full read of the day, which itself tries the other order when its first attempt fails.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import math
import time
from array import array
from collections.abc import Callable, Iterable

from exporter.billing import BillingAPI, RecordError, UsagePage
from exporter.core.logs import get_logger
from exporter.core.words import counted
from exporter.sources.usage_aggregate import ID_DIGEST, Aggregate, id_digest
from exporter.state import UsageCursor

log = get_logger(__name__)

PROGRESS_EVERY = 5.0
"""Seconds between progress lines while one read of a day goes on."""
FULL_READS = 3
"""Reads of a whole day in a row that may disagree with `total` (or with each other) before the refresh fails."""


def counted_part(settings: str) -> str:
    """Of a cursor's `settings`, how the sums were counted (`UsageReader.counted_as`), without how
    the ids were digested."""
    return settings.rpartition(";ids=")[0] if ";ids=" in settings else settings  # (a project_id may hold one)


def fingerprint(ids: Iterable[str]) -> str:
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()


def head_ids(digests: Iterable[int]) -> str:
    """Request ids at the head of a day's list, kept to be found again: their `id_digest`s, as hex."""
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
            digest = id_digest(record.request_id)
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


class UsageReader:
    """Reads a day's usage list from `client`, in the order the service lists it (learnt from
    what its pages show): whole (`read_day`), or from where a cursor left it."""

    def __init__(self, client: BillingAPI, *, per_api_key: bool) -> None:
        self.client = client
        self.per_api_key = per_api_key
        self.counted_as = f"page_size={client.page_size};per_api_key={per_api_key};project_id={client.project_id}"
        """How the day's sums are counted: a day counted otherwise is counted again."""
        self.settings = f"{self.counted_as};ids={ID_DIGEST}"
        """What a saved cursor must have been read under to go on from: the sums counted the same
        way, and its request ids digested the same way."""
        self._total_seen = 0
        """`total` as the last page read this poll said it."""
        self._learnt = False
        """The pages of the read under way showed the order."""
        self.newest_first = False
        """How the service lists a day's records, as last seen (oldest first until it shows otherwise)."""

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
            raise ResyncNeeded(f"read {counted(aggregate.rows, 'record')}, `total` says {total}")
        if pages > 1:
            ids = [r.request_id for r in start.records]
            again = self.client.usage_page(day, start.page_num)
            if [r.request_id for r in again.records][: len(ids)] != ids:
                if start.page_num == 1 and _shifted_by(start, again) is not None:
                    self._learn(day, newest_first=True)
                raise ResyncNeeded("records moved while the pages were read")
        head = None
        if start.page_num == 1:
            head = head_ids(id_digest(r.request_id) for r in start.records[: aggregate.rows])
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

    def _incremental(self, cursor: UsageCursor, before: Aggregate) -> tuple[Aggregate, UsageCursor]:
        """`before` (the day as read up to `cursor`) with the records added since, read in the order
        the list was last seen in; if its checks fail and there are new records, in the other (the
        service may list either way)."""
        problem: ResyncNeeded | None = None
        self._total_seen = cursor.records
        for newest_first in (cursor.newest_first, not cursor.newest_first):
            if problem is not None and self._total_seen <= cursor.records:
                break  # nothing new, and the list changed: no order explains that
            if not (cursor.head_ids if newest_first else cursor.page_fingerprint):
                continue  # nothing saved to check that order against
            try:
                read = self._incremental_newest if newest_first else self._incremental_oldest
                result = read(cursor, before)
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

    def _incremental_newest(self, cursor: UsageCursor, before: Aggregate) -> tuple[Aggregate, UsageCursor]:
        aggregate = before.fork()
        rows, head = self._read_newest(cursor.day, aggregate, cursor.records, cursor.head_ids)
        if aggregate.duplicates and rows - cursor.records >= self.client.page_size:  # pages read at once
            raise ResyncNeeded(f"{len(aggregate.duplicates)} new records repeat request ids already counted")
        return aggregate, self._newest_cursor(cursor.day, aggregate, head)

    def _incremental_oldest(self, cursor: UsageCursor, before: Aggregate) -> tuple[Aggregate, UsageCursor]:
        position = cursor.records - 1
        offset = position % self.client.page_size

        def verify(page: UsagePage) -> None:
            self._total_seen = page.total
            ids = [r.request_id for r in page.records[: offset + 1]]
            if len(ids) <= offset or ids[offset] != cursor.boundary_id or fingerprint(ids) != cursor.page_fingerprint:
                raise ResyncNeeded("the last record seen is no longer where it was")

        aggregate = before.fork()
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
