"""HTTP client for the billing API's two endpoints: daily bills and per-request usage.

Pages are fetched with a bounded number of requests in flight and handed out as they arrive. Every
attempt is signed anew (a retried request must not reuse its nonce). Amounts parse to Decimal and a
malformed record raises `RecordError` naming the field, never a silent zero.
"""

from __future__ import annotations

import abc
import datetime as dt
import email.utils
import json
import math
import random
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, NamedTuple, Protocol, TypeVar, cast
from urllib.parse import urlsplit

import requests
from requests.adapters import HTTPAdapter

from exporter.billing.signing import BillingSigner
from exporter.config.schema import BillingConfig
from exporter.core.clock import Clock
from exporter.core.decimals import parse_decimal
from exporter.core.logs import get_logger
from exporter.core.net import network_cause

log = get_logger(__name__)

BILLS_PATH = "/api/v1/bills/details"
USAGES_PATH = "/api/v1/usages/details"
GROUP_PERIOD_DAILY = "GROUP_PERIOD_DAILY"
GROUP_TERM_INSTANCE = "GROUP_TERM_INSTANCE"
GROUP_TERM_ITEM = "GROUP_TERM_ITEM"
BILLS_PAGE_SIZE = 100
MAX_USAGE_PAGE_SIZE = 500
MAX_RETRY_AFTER = 120.0
MAX_CLOCK_SKEW = 60.0
LOOKAHEAD = 4
MAX_COUNT = 10**12
"""Tokens of one request beyond this are refused: a day's sums must fit SQLite's 64-bit integers."""
MAX_TOTAL = 10**10
"""A `total` beyond this is refused: it would mean reading more pages than any day holds."""
R = TypeVar("R")


class BillingError(Exception):
    """Anything that stops a billing call from giving a trustworthy answer."""


class BillingAPIError(BillingError):
    """The API answered with a non-zero `code` (or an HTTP error status)."""

    def __init__(self, summary: str, *, status: int, code: int | None, message: str) -> None:
        super().__init__(summary)
        self.status = status
        self.code = code
        self.message = message


class SignatureRejected(BillingAPIError):
    """The API refused our credentials or signature (wrong key, skewed clock, ...)."""


class BillingUnavailable(BillingError):
    """No usable answer after every retry: timeouts, connection errors, 429 or 5xx."""


class ClientClosed(BillingUnavailable):
    """The client was closed (a config reload replaced it) while a call was under way."""


class RecordError(BillingError):
    """A response or record that does not have the documented shape."""


class BillRecord(NamedTuple):
    period: str
    day: dt.date
    instance_id: str
    item: str
    product: str
    project_id: str
    payable_amount: Decimal
    usage_value: Decimal


class UsageRecord(NamedTuple):
    request_id: str
    request_time: dt.datetime
    model: str
    endpoint: str
    apikey: str
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True)
class UsagePage:
    page_num: int
    records: tuple[UsageRecord, ...]
    total: int


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 4
    backoff: float = 0.5
    max_backoff: float = 20.0
    sleep: Callable[[float], object] | None = None
    """How to wait before a retry; by default the client waits so that closing it cuts the wait short."""

    def delay(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, MAX_RETRY_AFTER)
        ceiling = min(self.max_backoff, self.backoff * 2 ** (attempt - 1))
        return random.uniform(ceiling / 2, ceiling)


class _Retryable(Exception):
    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.retry_after = retry_after


# --- network failures in words ---------------------------------------------------------


# --- record parsing -----------------------------------------------------------------------


def _field(record: dict[str, Any], name: str, where: str) -> Any:
    if name not in record:
        raise RecordError(f"{where}: missing field {name!r}")
    return record[name]


def _text(record: dict[str, Any], name: str, where: str, *, optional: bool = False) -> str:
    if optional and record.get(name) is None:
        return ""
    value = _field(record, name, where)
    if not isinstance(value, str):
        raise RecordError(f"{where}: field {name!r} is not a string")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: valid JSON, but no text a label or SQLite can hold
            raise RecordError(f"{where}: field {name!r} is not valid Unicode text") from None
    return value


def _decimal(record: dict[str, Any], name: str, where: str) -> Decimal:
    try:
        return parse_decimal(_field(record, name, where))
    except ValueError as error:
        raise RecordError(f"{where}: field {name!r} is {error}") from None


def _count(record: dict[str, Any], name: str, where: str) -> int:
    value = _field(record, name, where)
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RecordError(f"{where}: field {name!r} is not a non-negative integer")
    if value > MAX_COUNT:
        raise RecordError(f"{where}: field {name!r} is out of range (over {MAX_COUNT:,})")
    return value


def _instant(record: dict[str, Any], name: str, where: str) -> dt.datetime:
    value = _text(record, name, where)
    try:
        instant = dt.datetime.fromisoformat(value)
    except ValueError:
        raise RecordError(f"{where}: field {name!r} is not an RFC 3339 time: {value[:40]!r}") from None
    if instant.tzinfo is None:
        raise RecordError(f"{where}: field {name!r} has no UTC offset")
    return instant


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RecordError(f"{where}: not a JSON object")
    return value


def parse_bill(raw: Any, where: str, tz: dt.tzinfo) -> BillRecord:
    record = _object(raw, where)
    return BillRecord(
        period=_text(record, "period", where),
        day=_instant(record, "startTime", where).astimezone(tz).date(),
        instance_id=_text(record, "instanceId", where, optional=True),
        item=_text(record, "item", where, optional=True),
        product=_text(record, "product", where, optional=True),
        project_id=_text(record, "projectId", where, optional=True),
        payable_amount=_decimal(record, "payableAmount", where),
        usage_value=_decimal(record, "usageValue", where),
    )


def parse_usage(raw: Any, where: str) -> UsageRecord:
    """One usage record. The common, well-formed case takes a fast path; anything else goes
    through the field-by-field checks, which name the field that is wrong."""
    try:
        request_id, model, endpoint = raw["requestId"], raw["model"], raw["endpoint"]
        apikey = raw.get("apikey") or ""
        prompt, completion, cached = raw["promptTokens"], raw["completionTokens"], raw["promptCachedTokens"]
        request_time = dt.datetime.fromisoformat(raw["requestTime"])
    except (KeyError, TypeError, ValueError, AttributeError):
        pass
    else:
        if (
            type(request_id) is str
            and type(model) is str
            and type(endpoint) is str
            and type(apikey) is str
            and request_id.isascii()
            and model.isascii()
            and endpoint.isascii()
            and apikey.isascii()
            and type(prompt) is int
            and type(completion) is int
            and type(cached) is int
            and 0 <= prompt <= MAX_COUNT
            and 0 <= completion <= MAX_COUNT
            and 0 <= cached <= MAX_COUNT
            and request_time.tzinfo is not None
        ):
            return UsageRecord(request_id, request_time, model, endpoint, apikey, prompt, completion, cached)
    return _parse_usage_checked(raw, where)


def _parse_usage_checked(raw: Any, where: str) -> UsageRecord:
    record = _object(raw, where)
    return UsageRecord(
        request_id=_text(record, "requestId", where),
        request_time=_instant(record, "requestTime", where),
        model=_text(record, "model", where),
        endpoint=_text(record, "endpoint", where),
        apikey=_text(record, "apikey", where, optional=True),
        prompt_tokens=_count(record, "promptTokens", where),
        completion_tokens=_count(record, "completionTokens", where),
        cached_prompt_tokens=_count(record, "promptCachedTokens", where),
    )


def parse_envelope(status: int, body: bytes, what: str) -> dict[str, Any]:
    """The `data` object of a successful envelope; raises for every other answer."""
    try:
        envelope = json.loads(body, parse_float=Decimal)
    except (ValueError, UnicodeDecodeError):
        if status >= 400:
            raise BillingAPIError(f"{what}: HTTP {status}", status=status, code=None, message="") from None
        raise RecordError(f"{what}: response is not JSON") from None
    if not isinstance(envelope, dict) or "code" not in envelope:
        raise RecordError(f"{what}: response has no envelope (`code` missing)")
    code = envelope["code"]
    if isinstance(code, bool) or not isinstance(code, int):
        raise RecordError(f"{what}: envelope `code` is not an integer")
    message = str(envelope.get("message") or envelope.get("reason") or "")[:300]
    if status in (401, 403):
        raise SignatureRejected(
            f"{what}: signature rejected (HTTP {status}, code {code}): {message}",
            status=status,
            code=code,
            message=message,
        )
    if code != 0 or status >= 400:
        raise BillingAPIError(
            f"{what}: API error (HTTP {status}, code {code}): {message}",
            status=status,
            code=code,
            message=message,
        )
    return _object(envelope.get("data"), f"{what}: envelope `data`")


def _list(data: dict[str, Any], what: str) -> list[Any]:
    records = data.get("list")
    if records is None:
        return []
    if not isinstance(records, list):
        raise RecordError(f"{what}: `data.list` is not a list")
    return records


def _total(data: dict[str, Any], what: str) -> int:
    total = data.get("total")
    if isinstance(total, str) and total.isascii() and total.isdigit():
        total = int(total)
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise RecordError(f"{what}: `data.total` is not a non-negative integer")
    if total > MAX_TOTAL:
        raise RecordError(f"{what}: `data.total` is out of range (over {MAX_TOTAL:,})")
    return total


def _retry_after(response: requests.Response) -> float | None:
    value = response.headers.get("Retry-After")
    if not value:
        return None
    if value.strip().isdigit():
        return float(value.strip())
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, (when - dt.datetime.now(dt.UTC)).total_seconds())


# --- the client ---------------------------------------------------------------------------


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

    def bills(self, period: str, group_term: str, instance_id: str = "") -> list[BillRecord]: ...

    def usage_pages(self, day: dt.date, first_page: int = 1, last_page: int | None = None) -> Iterator[UsagePage]: ...

    def usage_page(self, day: dt.date, page_num: int) -> UsagePage: ...

    def adopt_cap(self, size: int) -> None: ...

    def close(self) -> None: ...


class Listings(abc.ABC):
    """The two listings over any way of answering one request: query parameters, paging (caps,
    records added meanwhile), parsing and checks. `BillingClient` answers over HTTP; the tests'
    fake answers from the simulator in process, and so reads, parses and checks the same way."""

    def __init__(self, *, tz: dt.tzinfo, project_id: str, page_size: int) -> None:
        if not 1 <= page_size <= MAX_USAGE_PAGE_SIZE:
            raise ValueError(f"page_size must be 1..{MAX_USAGE_PAGE_SIZE}")
        self.tz = tz
        self.project_id = project_id
        self.page_size = page_size
        self._caps_said: set[tuple[str, int]] = set()

    @abc.abstractmethod
    def _get(self, api: str, path: str, params: dict[str, str | int]) -> dict[str, Any]:
        """The `data` of one successful answer (see `parse_envelope`)."""

    @abc.abstractmethod
    def _one(self, fetch: Callable[[int], R], page_num: int) -> R:
        """`fetch(page_num)`."""

    @abc.abstractmethod
    def _many(self, fetch: Callable[[int], R], pages: range) -> Generator[tuple[int, R], None, None]:
        """(page_num, `fetch(page_num)`) for every page of `pages`, in the order they come."""

    def _pages(
        self,
        fetch: Callable[[int, int], tuple[tuple[R, ...], int]],
        first_page: int,
        page_size: int,
        last_page: int | None = None,
        on_cap: Callable[[int], None] = lambda size: None,
    ) -> Iterator[tuple[int, tuple[R, ...], int]]:
        """Yield (page_num, records, total) for every page.

        `first_page` comes first and tells `total`; the pages it implies (up to `last_page`, if
        given) come from `_many`, in the order they arrive. Without `last_page`, pages then
        continue one at a time from the last one while it is full and the latest `total` says more
        records exist (records added meanwhile). A first page shorter than asked while `total` says
        more records exist means the service caps its pages: the read goes on at that size, and
        `on_cap` is told.
        """

        def sized(page_num: int) -> tuple[tuple[R, ...], int]:
            return fetch(page_num, page_size)

        records, total = self._one(sized, first_page)
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
            for page_num, (records, page_total) in following:
                total = max(total, page_total)
                tail = max(tail, (page_num, len(records)))
                yield page_num, records, page_total
        finally:  # a reader that stops early: the pages still pending are cancelled now
            following.close()
        page_num, size = tail
        while last_page is None and size >= page_size and page_num * page_size < total:
            page_num += 1
            records, total = self._one(sized, page_num)
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

        def fetch(page_num: int, page_size: int) -> tuple[tuple[BillRecord, ...], int]:
            data = self._get("bills", BILLS_PATH, params | {"page_num": page_num, "page_size": page_size})
            offset = (page_num - 1) * page_size
            records = _list(data, what)
            bills = tuple(parse_bill(raw, f"{what}: record {offset + i}", self.tz) for i, raw in enumerate(records))
            return bills, _total(data, what)

        bills: list[BillRecord] = []
        total = 0
        pages = self._pages(fetch, 1, BILLS_PAGE_SIZE, on_cap=lambda size: self._capped("bills", size))
        for _, records, page_total in pages:
            total = max(total, page_total)
            bills.extend(records)
        if len(bills) != total:
            raise RecordError(f"{what}: pages held {len(bills)} records, `total` says {total}")
        return bills

    def _usage_fetch(self, day: dt.date) -> Callable[[int, int], tuple[tuple[UsageRecord, ...], int]]:
        what = f"usage {day.isoformat()}"
        params: dict[str, str | int] = {"date": day.isoformat()}
        if self.project_id:
            params["project_id"] = self.project_id

        def fetch(page_num: int, page_size: int) -> tuple[tuple[UsageRecord, ...], int]:
            data = self._get("usages", USAGES_PATH, params | {"page_num": page_num, "page_size": page_size})
            echoed = data.get("date")
            if echoed is not None and echoed != day.isoformat():
                raise RecordError(f"{what}: response is for date {str(echoed)[:20]!r}")
            offset = (page_num - 1) * page_size
            records = _list(data, what)
            usage = tuple(parse_usage(raw, f"{what}: record {offset + i}") for i, raw in enumerate(records))
            return usage, _total(data, what)

        return fetch

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
        pages = self._pages(self._usage_fetch(day), first_page, self.page_size, last_page, self.adopt_cap)
        for page_num, records, total in pages:
            yield UsagePage(page_num=page_num, records=records, total=total)

    def usage_page(self, day: dt.date, page_num: int) -> UsagePage:
        """One page of a day's usage records (page 1 also tells whether the service caps pages)."""
        fetch, page_size = self._usage_fetch(day), self.page_size
        records, total = self._one(lambda n: fetch(n, page_size), page_num)
        if capped(page_num, len(records), page_size, total):
            self.adopt_cap(len(records))
        return UsagePage(page_num=page_num, records=records, total=total)


class BillingClient(Listings):
    """The listings over HTTP: signed requests, retries, and pages fetched in parallel with at most
    `concurrency` requests in flight; closing the client ends every wait with `ClientClosed`."""

    def __init__(
        self,
        base_url: str,
        auth: requests.auth.AuthBase,
        *,
        tz: dt.tzinfo,
        project_id: str = "",
        page_size: int = MAX_USAGE_PAGE_SIZE,
        concurrency: int = 4,
        timeout: float = 30.0,
        retry: RetryPolicy | None = None,
        on_response: Callable[[str, str], None] | None = None,
        on_skew: Callable[[float], None] | None = None,
    ) -> None:
        super().__init__(tz=tz, project_id=project_id, page_size=page_size)
        self.base_url = base_url.rstrip("/")
        self._host = urlsplit(self.base_url).netloc
        self.concurrency = max(1, concurrency)
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self._on_response = on_response or (lambda api, code: None)
        self._on_skew = on_skew or (lambda skew: None)
        self._session = requests.Session()
        self._session.auth = auth
        adapter = HTTPAdapter(pool_connections=1, pool_maxsize=2 * self.concurrency + 1)
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)
        # More workers than requests in flight: a page waiting out its retry backoff holds a worker,
        # not one of the `concurrency` request slots, so the other pages keep flowing meanwhile.
        self._pool = ThreadPoolExecutor(2 * self.concurrency, thread_name_prefix="billing-page")
        self._slots = threading.BoundedSemaphore(self.concurrency)
        self.clock_skew: float | None = None
        """The server's clock minus ours, from its last `Date` header."""
        self._closed = threading.Event()
        self._closing: Future[None] = Future()
        """Done when the client closes: waits on pages watch it too, so a close wakes them at once."""

    @classmethod
    def from_config(
        cls,
        config: BillingConfig,
        clock: Clock,
        on_response: Callable[[str, str], None] | None = None,
        retry: RetryPolicy | None = None,
        on_skew: Callable[[float], None] | None = None,
    ) -> BillingClient:
        """A client signing with `clock`'s time (so a test's frozen clock signs as the simulator expects)."""
        signer = BillingSigner(
            config.access_key_id,
            config.secret_access_key.get_secret_value(),
            label=config.signature_label,
            lifetime=int(config.signature_lifetime),
            time_fn=lambda: clock.now().timestamp(),
        )
        return cls(
            config.url,
            signer,
            tz=config.zone,
            project_id=config.project_id,
            page_size=config.page_size,
            concurrency=config.concurrency,
            timeout=config.timeout,
            retry=retry,
            on_response=on_response,
            on_skew=on_skew,
        )

    def close(self) -> None:
        """Stop: pending pages are cancelled, waits before retries end now, and a refresh waiting on
        pages fails at once with `ClientClosed`; nothing here blocks."""
        self._closed.set()
        if self._closing.set_running_or_notify_cancel():
            self._closing.set_result(None)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._session.close()

    def __enter__(self) -> BillingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one call, with retries --

    def _get(self, api: str, path: str, params: dict[str, str | int]) -> dict[str, Any]:
        what = f"GET {self.base_url}{path}"
        attempt = corrected = 0
        while True:
            try:
                return self._attempt(api, path, params, what)
            except SignatureRejected:
                # Refused while our signing clock is far from the server's: sign with its time, once.
                if corrected or not self._correct_clock():
                    raise
                corrected = 1
            except _Retryable as failure:
                attempt += 1
                if self._closed.is_set():
                    raise ClientClosed(f"{what}: the client was closed (config reload)") from None
                if attempt >= self.retry.attempts:
                    raise BillingUnavailable(f"{what}: {failure} (gave up after {attempt} attempts)") from None
                pause = self.retry.delay(attempt, failure.retry_after)
                log.debug("retrying", api=api, attempt=attempt, reason=str(failure), after_seconds=round(pause, 2))
                (self._closed.wait if self.retry.sleep is None else self.retry.sleep)(pause)

    def _attempt(self, api: str, path: str, params: dict[str, str | int], what: str) -> dict[str, Any]:
        try:
            with self._slots:
                response = self._session.get(self.base_url + path, params=params, timeout=self.timeout)
                body = response.content
        except requests.Timeout:
            self._on_response(api, "timeout")
            raise _Retryable("timed out") from None
        except requests.RequestException as error:
            self._on_response(api, "error")
            raise _Retryable(f"connection to {self._host} failed: {network_cause(error)}") from None
        self._on_response(api, str(response.status_code))
        self._observe_clock(response.headers.get("Date"))
        if response.status_code == 429:
            raise _Retryable("HTTP 429 (rate limited)", _retry_after(response))
        if response.status_code >= 500:
            raise _Retryable(f"HTTP {response.status_code}", _retry_after(response))
        return parse_envelope(response.status_code, body, what)

    # -- the server's clock --

    def _observe_clock(self, date_header: str | None) -> None:
        """Skew = the server's `Date` minus our signing clock (1 s resolution)."""
        if not date_header:
            return
        try:
            server = email.utils.parsedate_to_datetime(date_header).timestamp()
        except (TypeError, ValueError):
            return
        skew = server - self._local_time()
        previous, self.clock_skew = self.clock_skew, skew
        self._on_skew(skew)
        far, was_far = abs(skew) > MAX_CLOCK_SKEW, previous is not None and abs(previous) > MAX_CLOCK_SKEW
        if far and not was_far:
            log.warning(
                "clock skew: the billing API's clock is far from ours; fix this host's time (NTP)",
                skew_seconds=round(skew),
            )
        elif was_far and not far:
            log.info("clock skew back within limits", skew_seconds=round(skew), limit_seconds=MAX_CLOCK_SKEW)

    def _local_time(self) -> float:
        signer = self._session.auth
        return signer.local_time() if isinstance(signer, BillingSigner) else time.time()

    def _correct_clock(self) -> bool:
        """After a refusal: if the time we sign with is far from the server's, adopt the server's
        (and drop an old correction once our own clock is right again)."""
        signer = self._session.auth
        skew = self.clock_skew
        if not isinstance(signer, BillingSigner) or skew is None or abs(skew - signer.clock_offset) <= MAX_CLOCK_SKEW:
            return False
        signer.clock_offset = skew if abs(skew) > MAX_CLOCK_SKEW else 0.0
        log.warning(
            "signature refused while our clock is off: now signing with the server's time", skew_seconds=round(skew)
        )
        return True

    # -- paging --

    def _submit(self, fetch: Callable[[int], R], page_num: int) -> Future[R]:
        try:
            return self._pool.submit(fetch, page_num)
        except RuntimeError:  # the pool is shut down: the client was closed
            raise ClientClosed("the client was closed (config reload)") from None

    def _wait(self, pending: Iterable[Future[R]]) -> set[Future[R]]:
        """The futures among `pending` that are done, once one is; `ClientClosed` if the client
        closes first (cancelled futures never wake a `wait`, so the close itself must)."""
        watched: list[Future[Any]] = [*pending, self._closing]
        done, _ = wait(watched, return_when=FIRST_COMPLETED)
        if self._closing in done:
            raise ClientClosed("the client was closed during the refresh (config reload)")
        return cast("set[Future[R]]", done)

    def _one(self, fetch: Callable[[int], R], page_num: int) -> R:
        """One page, fetched in the pool so that closing the client ends the wait at once."""
        future = self._submit(fetch, page_num)
        try:
            self._wait([future])
        finally:
            future.cancel()
        return future.result()

    def _many(self, fetch: Callable[[int], R], pages: range) -> Generator[tuple[int, R], None, None]:
        """The pages `pages` as they arrive, at most LOOKAHEAD × `concurrency` submitted at a time
        (so memory stays bounded; a page waiting out a retry holds nothing else up)."""
        numbers = iter(pages)
        pending: dict[Future[R], int] = {}
        try:
            while True:
                while len(pending) < LOOKAHEAD * self.concurrency and (page_num := next(numbers, None)) is not None:
                    pending[self._submit(fetch, page_num)] = page_num
                if not pending:
                    return
                for future in self._wait(pending):
                    yield pending.pop(future), future.result()
        finally:
            for future in pending:
                future.cancel()
