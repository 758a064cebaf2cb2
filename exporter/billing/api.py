"""The billing API as the sources use it: the `BillingAPI` protocol, and `Listings`, which pages
through its two listings (daily bills, per-request usage) over any way of answering one request.

`Listings` is shared by the HTTP client (`client.BillingClient`) and the tests' in-process fake,
so that both send the same queries and read, parse and check the same pages the same way.

A page is asked for in one step and read in another: the threads that fetch pages only make the
request and take its answer (`_answer`), and the reader of the pages parses and checks each one as
it comes (`_pages`). So a fetching thread goes straight on to its next request, and a page's
records are made by the thread that counts them.
"""

from __future__ import annotations

import abc
import datetime as dt
import math
from collections.abc import Callable, Generator, Iterator
from typing import Any, Protocol, TypeVar

from exporter.billing.errors import RecordError
from exporter.billing.records import (
    BillRecord,
    UsagePage,
    UsageRecord,
    decode_usage_page,
    parse_bill,
    parse_envelope,
    parse_usage,
)
from exporter.core.logs import get_logger
from exporter.core.words import counted

log = get_logger(__name__)

BILLS_PATH = "/api/v1/bills/details"
USAGES_PATH = "/api/v1/usages/details"
GROUP_PERIOD_DAILY = "GROUP_PERIOD_DAILY"
GROUP_TERM_INSTANCE = "GROUP_TERM_INSTANCE"
GROUP_TERM_ITEM = "GROUP_TERM_ITEM"
BILLS_PAGE_SIZE = 100
LISTING_READS = 3
"""Reads of a month's bills in several pages before one that held still is given up on."""
MAX_USAGE_PAGE_SIZE = 500
MAX_TOTAL = 10**10
"""A `total` beyond this is refused: it would mean reading more pages than any day holds."""
R = TypeVar("R")
Answer = tuple[int, bytes]
"""An answer to one request: its HTTP status and body."""
Ask = Callable[[int, int], Answer]
"""Asks for one page, (page_num, page_size), in a fetching thread."""
Read = Callable[[int, int, Answer], tuple[tuple[R, ...], int]]
"""Reads one page's answer, (page_num, page_size, answer): its records and `total`."""


def _list(data: dict[str, Any], what: str) -> list[Any]:
    records = data.get("list")
    if records is None:
        return []
    if not isinstance(records, list):
        raise RecordError(f"{what}: `data.list` is not a list")
    return records


def _total(total: object, what: str) -> int:
    """`data.total` as a count (the API may send it as a string of digits)."""
    if isinstance(total, str) and total.isascii() and total.isdigit():
        total = int(total)
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise RecordError(f"{what}: `data.total` is not a non-negative integer")
    if total > MAX_TOTAL:
        raise RecordError(f"{what}: `data.total` is out of range (over {MAX_TOTAL:,})")
    return total


def capped(page_num: int, count: int, page_size: int, total: int) -> bool:
    """A first page shorter than asked while `total` says more records exist: the service caps its pages at `count`."""
    return page_num == 1 and 0 < count < min(page_size, total)


class BillingAPI(Protocol):
    """What the sources use of the billing API. They take this, not `BillingClient`, so that their
    logic can be tested on an in-process fake (tests/fakes.py) instead of over HTTP."""

    base_url: str
    """Where the answers come from: data read from another account are read again."""
    project_id: str
    page_size: int
    """Usage records asked for a page: a poll works out from it which pages can hold new records."""
    concurrency: int
    """Requests it keeps in flight at most (callers that have many to make may make that many at once)."""

    def bills(self, period: str, group_term: str, instance_id: str = "") -> list[BillRecord]: ...

    def usage_pages(self, day: dt.date, first_page: int = 1, last_page: int | None = None) -> Iterator[UsagePage]: ...

    def usage_page(self, day: dt.date, page_num: int) -> UsagePage: ...

    def adopt_cap(self, size: int) -> None: ...

    def carry_over(self, before: BillingAPI) -> None:
        """Take on what the API told `before`, the client this one replaces at a reload, that must
        outlive it (a wait it was asked for)."""

    def close(self, cut: bool = True) -> None:
        """Release the connections, and end the reads under way (`ClientClosed`); `cut`: the
        requests on the wire too, at once (a stop), else they end within their timeout (a reload)."""


def _row(bill: BillRecord) -> tuple[object, ...]:
    """Which row of the list a bill is: its day and what it is the charge of."""
    return bill.day, bill.instance_id, bill.item, bill.product, bill.project_id


class Listings(abc.ABC):
    """The two listings over any way of answering one request: query parameters, paging (caps,
    records added meanwhile), parsing and checks. `BillingClient` answers over HTTP; the tests'
    fake answers from the simulator in process, and so reads, parses and checks the same way."""

    concurrency = 1
    """Requests in flight at most (one, unless the way of answering says more)."""

    def __init__(self, *, tz: dt.tzinfo, project_id: str, page_size: int) -> None:
        if not 1 <= page_size <= MAX_USAGE_PAGE_SIZE:
            raise ValueError(f"page_size must be 1..{MAX_USAGE_PAGE_SIZE}")
        self.tz = tz
        self.project_id = project_id
        self.page_size = page_size
        self._caps_said: set[tuple[str, int]] = set()

    base_url: str

    @abc.abstractmethod
    def _answer(self, api: str, path: str, params: dict[str, str | int]) -> tuple[int, bytes]:
        """One request's final answer, its HTTP status and body (what cannot be answered raises:
        retries run out, the signature refused)."""

    def _request(self, path: str) -> str:
        """How errors name a request to `path`."""
        return f"GET {self.base_url}{path}"

    @abc.abstractmethod
    def _one(self, fetch: Callable[[int], R], page_num: int) -> R:
        """`fetch(page_num)`."""

    @abc.abstractmethod
    def _many(self, fetch: Callable[[int], R], pages: range) -> Generator[tuple[int, R], None, None]:
        """(page_num, `fetch(page_num)`) for every page of `pages`, in the order they come."""

    def _pages(
        self,
        ask: Ask,
        read: Read[R],
        first_page: int,
        page_size: int,
        last_page: int | None = None,
        on_cap: Callable[[int], None] = lambda size: None,
    ) -> Iterator[tuple[int, tuple[R, ...], int]]:
        """Yield (page_num, records, total) for every page, each asked for with `ask` (in the
        threads that fetch pages) and read with `read` (here, as it comes).

        `first_page` comes first and tells `total`; the pages it implies (up to `last_page`, if
        given) come from `_many`, in the order they arrive. Without `last_page`, pages then
        continue one at a time from the last one while it is full and the latest `total` says more
        records exist (records added meanwhile). A first page shorter than asked while `total` says
        more records exist means the service caps its pages: the read goes on at that size, and
        `on_cap` is told.
        """

        def sized(page_num: int) -> Answer:
            return ask(page_num, page_size)

        records, total = self._read_one(ask, read, first_page, page_size)
        yield first_page, records, total
        if capped(first_page, len(records), page_size, total):
            page_size = len(records)
            on_cap(page_size)
        elif len(records) < page_size:
            return
        last = max(first_page, math.ceil(total / page_size))
        if last_page is not None:
            last = min(last, last_page)
        tail = (first_page, len(records))
        following = self._many(sized, range(first_page + 1, last + 1))
        try:
            for page_num, answer in following:
                records, page_total = read(page_num, page_size, answer)
                total = max(total, page_total)
                tail = max(tail, (page_num, len(records)))
                yield page_num, records, page_total
        finally:  # a reader that stops early: the pages still pending are cancelled now
            following.close()
        page_num, size = tail
        while last_page is None and size >= page_size and page_num * page_size < total:
            page_num += 1
            records, total = self._read_one(ask, read, page_num, page_size)
            size = len(records)
            yield page_num, records, total

    def bills(self, period: str, group_term: str, instance_id: str = "") -> list[BillRecord]:
        """Every daily bill record of a month for one grouping (of one endpoint's charges only,
        with `instance_id`), all pages."""
        what = f"bills {period} {group_term}" + (f" {instance_id}" if instance_id else "")
        params: dict[str, str | int] = {"period": period, "group_period": GROUP_PERIOD_DAILY, "group_term": group_term}
        if self.project_id:
            params["project_id"] = self.project_id
        if instance_id:
            params["instance_id"] = instance_id

        def ask(page_num: int, page_size: int) -> Answer:
            return self._answer("bills", BILLS_PATH, params | {"page_num": page_num, "page_size": page_size})

        def read(page_num: int, page_size: int, answer: Answer) -> tuple[tuple[BillRecord, ...], int]:
            data = parse_envelope(*answer, self._request(BILLS_PATH))
            offset = (page_num - 1) * page_size
            records = _list(data, what)
            bills = tuple(parse_bill(raw, f"{what}: record {offset + i}", self.tz) for i, raw in enumerate(records))
            return bills, _total(data.get("total"), what)

        for _ in range(LISTING_READS):
            bills: list[BillRecord] = []
            first: tuple[BillRecord, ...] = ()
            totals = set()
            pages = self._pages(ask, read, 1, BILLS_PAGE_SIZE, on_cap=lambda size: self._capped("bills", size))
            for page_num, records, page_total in pages:
                first = records if page_num == 1 else first
                totals.add(page_total)
                bills.extend(records)
            # Read in several pages, the list must have held still: rows that came or went meanwhile
            # (a new day's or a new endpoint's at its head) move the others from page to page, and a
            # row read twice with another missed still adds up to `total`. Page 1 again tells (its
            # rows, not their amounts: an amount revised meanwhile moves no row).
            if len(totals) == 1 and (
                len(bills) <= len(first)
                or list(map(_row, self._read_one(ask, read, 1, len(first))[0])) == list(map(_row, first))
            ):
                (total,) = totals
                if len(bills) != total:
                    raise RecordError(f"{what}: pages held {counted(len(bills), 'record')}, `total` says {total}")
                return bills
            log.info("the bills changed while they were read; reading them again", listing=what)
        raise RecordError(f"{what}: the list changed while it was read, {LISTING_READS} times running")

    def _read_one(self, ask: Ask, read: Read[R], page_num: int, page_size: int) -> tuple[tuple[R, ...], int]:
        """One page, asked for with `ask` (by `_one`) and read here with `read`: (records, total)."""
        return read(page_num, page_size, self._one(lambda n: ask(n, page_size), page_num))

    def _usage_listing(self, day: dt.date) -> tuple[Ask, Read[UsageRecord]]:
        """How a page of the day's usage is asked for, and how its answer is read."""
        what = f"usage {day.isoformat()}"
        params: dict[str, str | int] = {"date": day.isoformat()}
        if self.project_id:
            params["project_id"] = self.project_id

        def ask(page_num: int, page_size: int) -> Answer:
            return self._answer("usages", USAGES_PATH, params | {"page_num": page_num, "page_size": page_size})

        def read(page_num: int, page_size: int, answer: Answer) -> tuple[tuple[UsageRecord, ...], int]:
            status, body = answer
            fast = decode_usage_page(body) if status == 200 else None
            if fast is not None:
                usage, total, echoed = fast
            else:  # an error, or something to name: field by field
                data = parse_envelope(status, body, self._request(USAGES_PATH))
                total, echoed = data.get("total"), data.get("date")
            if echoed is not None and echoed != day.isoformat():
                raise RecordError(f"{what}: response is for date {str(echoed)[:20]!r}")
            if fast is None:
                offset = (page_num - 1) * page_size
                records = _list(data, what)
                usage = tuple(parse_usage(raw, f"{what}: record {offset + i}") for i, raw in enumerate(records))
            return usage, _total(total, what)

        return ask, read

    def adopt_cap(self, size: int) -> None:
        """The service lists at most `size` usage records a page (seen now, or saved when it was
        seen): ask for that many from now on."""
        if size < self.page_size:
            self._capped("usage", size)
            self.page_size = size

    def _capped(self, listing: str, size: int) -> None:
        """Say once per listing and size that the service caps its pages."""
        if (listing, size) not in self._caps_said:
            self._caps_said.add((listing, size))
            log.warning("the service lists fewer records a page than asked; reading pages of that size",
                        listing=listing, page_size=size)  # fmt: skip

    def usage_pages(self, day: dt.date, first_page: int = 1, last_page: int | None = None) -> Iterator[UsagePage]:
        """The pages of one day's usage records, from `first_page` to the end or to `last_page`
        (the first one first, the others as they arrive)."""
        ask, read = self._usage_listing(day)
        pages = self._pages(ask, read, first_page, self.page_size, last_page, self.adopt_cap)
        for page_num, records, total in pages:
            yield UsagePage(page_num=page_num, records=records, total=total)

    def usage_page(self, day: dt.date, page_num: int) -> UsagePage:
        """One page of a day's usage records (page 1 also tells whether the service caps pages)."""
        (ask, read), page_size = self._usage_listing(day), self.page_size
        records, total = self._read_one(ask, read, page_num, page_size)
        if capped(page_num, len(records), page_size, total):
            self.adopt_cap(len(records))
        return UsagePage(page_num=page_num, records=records, total=total)
