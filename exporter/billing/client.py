"""The billing API over HTTP: `BillingClient`, the `Listings` answered by signed requests, with
retries (`RetryPolicy`) and pages fetched by a few threads (`Workers`).

Pages are fetched with a bounded number of requests in flight and handed out as they arrive. Every
attempt is signed anew (a retried request must not reuse its nonce). The paging itself, and the
parsing and checks of what comes back, are the same for every `Listings` (see `api`, `records`).
"""

from __future__ import annotations

import datetime as dt
import email.utils
import random
import threading
import time
from collections.abc import Callable, Generator
from concurrent.futures import Future
from dataclasses import dataclass
from queue import SimpleQueue
from typing import Any, TypeVar
from urllib.parse import urlsplit

import requests

from exporter.billing.api import MAX_USAGE_PAGE_SIZE, BillingAPI, Listings
from exporter.billing.errors import AskedToWait, BillingUnavailable, ClientClosed, SignatureRejected
from exporter.billing.records import parse_envelope
from exporter.billing.signing import BillingSigner
from exporter.billing.workers import Workers
from exporter.config.schema import BillingConfig
from exporter.core.clock import Clock
from exporter.core.deadline import Deadline
from exporter.core.logs import get_logger
from exporter.core.net import network_cause, retry_after, timed_out
from exporter.core.watched import Cuts, WatchedAdapter, watching
from exporter.core.words import counted

log = get_logger(__name__)

MAX_RETRY_AFTER = 120.0
"""The longest `Retry-After` a request waits out; one asking longer ends the refresh, and the
listing's requests are not sent again until that time has passed (at most MAX_HOLD from now)."""
MAX_HOLD = 3600.0
"""The longest a `Retry-After` holds a listing back: a date years ahead (a misconfigured gateway)
must not stop the exporter for good."""
MAX_CLOCK_SKEW = 60.0
LOOKAHEAD = 4
R = TypeVar("R")


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


class _Cut(requests.RequestException):
    """A request whose exchange's deadline fired (its time passed, or the client was closed)."""


class _Retryable(Exception):
    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.retry_after = retry_after


def _retry_after(response: requests.Response) -> float | None:
    return retry_after(response.headers.get("Retry-After"), time.time())


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
        self._signer = auth if isinstance(auth, BillingSigner) else None
        """The signer whose clock a refusal corrects (None: requests signed otherwise, never corrected)."""
        # The environment's proxy (`HTTP(S)_PROXY`, `ALL_PROXY`, `NO_PROXY`) and CA bundle
        # (`REQUESTS_CA_BUNDLE`, `CURL_CA_BUNDLE`) for the API's address, read once per client:
        # requests would read them again for every page (0.1 ms of scanning the environment each,
        # as much as the rest of a request's preparation). The API's address is the only one asked.
        found = self._session.merge_environment_settings(self.base_url, {}, None, None, None)
        self._session.proxies, self._session.verify = found["proxies"], found["verify"]
        self._session.trust_env = False
        adapter = WatchedAdapter(pool_connections=1, pool_maxsize=2 * self.concurrency + 1)
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)
        # As many workers as requests in flight: one waiting out a retry's backoff lends its place
        # (`_pause`), so the other pages keep flowing meanwhile.
        self._pool = Workers(self.concurrency, "billing-page")
        self._slots = threading.BoundedSemaphore(self.concurrency)
        self.clock_skew: float | None = None
        """The server's clock minus ours, from its last `Date` header."""
        self._date_read = ("", 0.0)
        """The last `Date` header read, and the time it says."""
        self._closed = threading.Event()
        self._not_before: dict[str, float] = {}
        """Per listing (`bills`, `usages`), when the API said it may be asked again (monotonic
        seconds): a wait of up to MAX_RETRY_AFTER is waited out, a longer one refused (`AskedToWait`)."""
        self._cuts = Cuts()
        """A deadline over each request on the wire (`_exchange`), which a `close` that cuts fires."""
        self._arrivals: set[SimpleQueue[Future[Any] | None]] = set()
        """The queues pages arrive in, one per read under way (`_many`): a close puts None in each,
        so that a read waiting on pages wakes at once (cancelled pages would wake it too, but not
        one that is running)."""

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

    def close(self, cut: bool = True) -> None:
        """Stop: pending pages are cancelled, waits before retries end now, and a refresh waiting on
        pages fails at once with `ClientClosed`; nothing here blocks. Requests on the wire are cut
        (`cut`), or left to end within their timeout: a reload leaves them, so that an answer asking
        to wait (`Retry-After`) still holds the client it made (`carry_over`)."""
        self._closed.set()
        if cut:
            self._cuts.cut()
        for arrivals in list(self._arrivals):
            arrivals.put(None)
        self._pool.shutdown()
        self._session.close()

    def __enter__(self) -> BillingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def carry_over(self, before: BillingAPI) -> None:
        """A wait the API asked `before` for (a long `Retry-After`) holds this client too, when both
        ask the same API: they share their holds from then on, so that one told in answer to a
        request `before` sent (closed meanwhile, or a read the reload let finish) holds this client
        as well. A reload that changed, say, the page size must not ask again an API that asked to
        be left alone for an hour."""
        if isinstance(before, BillingClient) and before.base_url == self.base_url:
            self._not_before = before._not_before

    # -- one call, with retries --

    def _answer(self, api: str, path: str, params: dict[str, str | int]) -> tuple[int, bytes]:
        what = self._request(path)
        attempt = corrected = 0
        held = self._not_before.get(api, 0.0) - time.monotonic()
        if held > MAX_RETRY_AFTER:
            raise AskedToWait(f"{what}: the API asked not to be asked again for {held:.0f}s more (Retry-After)")
        if held > 0:  # (a short wait asked in answer to another request, or to the client a reload replaced)
            self._pause(held)
            if self._closed.is_set():
                raise ClientClosed(f"{what}: the client was closed (config reload)")
        while True:
            offset = self._clock_offset()
            try:
                return self._attempt(api, path, params, what)
            except SignatureRejected:
                # Refused while our signing clock was far from the server's: signed again with its
                # time, once (the refusal corrected it, or another request did while this one was out).
                if corrected or self._clock_offset() == offset:
                    raise
                corrected = 1
            except _Retryable as failure:
                attempt += 1
                if failure.retry_after:  # (kept, and shared with the client a reload makes: `carry_over`)
                    until = time.monotonic() + min(failure.retry_after, MAX_HOLD)
                    self._not_before[api] = max(self._not_before.get(api, 0.0), until)
                wait = failure.retry_after if (failure.retry_after or 0) > MAX_RETRY_AFTER else None
                if wait is not None:  # (held by a client closed meanwhile too: the one a reload made shares it)
                    held = min(wait, MAX_HOLD)  # (`_not_before` holds it: above)
                    log.warning(
                        "the billing API asked to wait; not asking it again before then",
                        api=api, retry_after_seconds=round(wait), held_seconds=round(held),
                    )  # fmt: skip
                if self._closed.is_set():
                    raise ClientClosed(f"{what}: the client was closed (config reload)") from None
                if wait is not None:
                    raise AskedToWait(
                        f"{what}: {failure}, and asked to wait {wait:.0f}s (Retry-After):"
                        f" not asked again for {held:.0f}s"
                    ) from None
                if attempt >= self.retry.attempts:
                    raise BillingUnavailable(
                        f"{what}: {failure} (gave up after {counted(attempt, 'attempt')})"
                    ) from None
                pause = self.retry.delay(attempt, failure.retry_after)
                log.debug("retrying", api=api, attempt=attempt, reason=str(failure), after_seconds=round(pause, 2))
                self._pause(pause)

    def _pause(self, seconds: float) -> None:
        """Wait, cut short by `close` (or the tests' sleep), a page worker's place lent meanwhile."""
        with self._pool.lending():
            (self._closed.wait if self.retry.sleep is None else self.retry.sleep)(seconds)

    def _attempt(self, api: str, path: str, params: dict[str, str | int], what: str) -> tuple[int, bytes]:
        """One request. It is signed before it waits for a slot, so that a slot (a request in
        flight) is held only while the request is on the wire, and signed again once it has one if
        a signature made now would say another `created` (a second went by, or the clock was
        corrected meanwhile); the body is read in one piece."""
        try:
            created = self._created()
            request = self._prepare(path, params)
            with self._slots:
                if self._closed.is_set():
                    raise ClientClosed(f"{what}: the client was closed (config reload)")
                if self._created() != created:
                    request = self._prepare(path, params)
                response, body = self._exchange(request)
                # The server's clock, and on a refusal the correction, before the slot goes to a
                # request waiting for it: that one then goes out signed with the correction.
                self._observe_clock(response.headers.get("Date"))
                if response.status_code in (401, 403):
                    self._correct_clock()
        except requests.RequestException as error:
            if isinstance(error, _Cut) and self._closed.is_set():
                raise ClientClosed(f"{what}: the client was closed (config reload)") from None
            # (a body that stopped coming is a connection error to requests, a timeout all the same)
            if isinstance(error, requests.Timeout | _Cut) or timed_out(error):
                self._on_response(api, "timeout")
                raise _Retryable("timed out") from None
            self._on_response(api, "error")
            raise _Retryable(f"connection to {self._host} failed: {network_cause(error)}") from None
        self._on_response(api, str(response.status_code))
        if response.status_code == 429:
            raise _Retryable("HTTP 429 (rate limited)", _retry_after(response))
        if response.status_code >= 500:
            raise _Retryable(f"HTTP {response.status_code}", _retry_after(response))
        if response.status_code in (401, 403):
            parse_envelope(response.status_code, body, what)  # raises SignatureRejected (the clock may be off)
        return response.status_code, body

    def _exchange(self, request: requests.PreparedRequest) -> tuple[requests.Response, bytes]:
        """Send `request` and read its answer whole, all within `timeout` (a socket's timeout bounds
        each read, and a server dripping its answer a byte at a time would hold the page for ever):
        a `Deadline` over the exchange shuts its socket down when that passes, or when `close` fires
        it (`_Cut`)."""
        exchange = Deadline(self.timeout)
        with self._cuts.over(exchange) as copies:
            try:
                with watching((exchange,), (exchange,), copies):
                    response = self._session.send(request, timeout=self.timeout, stream=True)
                body = b"".join(response.iter_content(None))
            except requests.RequestException:
                if exchange.fired:
                    raise _Cut() from None
                raise
            if exchange.fired:  # (an answer whose end is the connection's: cut, it only looks whole)
                response.close()
                raise _Cut()
            return response, body

    def _prepare(self, path: str, params: dict[str, str | int]) -> requests.PreparedRequest:
        return self._session.prepare_request(requests.Request("GET", self.base_url + path, params=params))

    def _created(self) -> int:
        """The `created` a request signed now would carry (0 when no signer of ours signs it)."""
        return self._signer.created() if self._signer else 0

    # -- the server's clock --

    def _observe_clock(self, date_header: str | None) -> None:
        """Skew = the server's `Date` minus our signing clock (1 s resolution)."""
        if not date_header:
            return
        header, server = self._date_read  # (one read: page threads replace it)
        if date_header != header:  # (pages come several a second: one parse a second)
            try:
                server = email.utils.parsedate_to_datetime(date_header).timestamp()
            except (TypeError, ValueError):
                return
            self._date_read = (date_header, server)
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
        return self._signer.local_time() if self._signer else time.time()

    def _clock_offset(self) -> float:
        return self._signer.clock_offset if self._signer else 0.0

    def _correct_clock(self) -> None:
        """After a refusal: if the time we sign with is far from the server's, adopt the server's
        (and drop an old correction once our own clock is right again)."""
        signer, skew = self._signer, self.clock_skew
        if signer is None or skew is None or abs(skew - signer.clock_offset) <= MAX_CLOCK_SKEW:
            return
        signer.clock_offset = skew if abs(skew) > MAX_CLOCK_SKEW else 0.0
        log.warning(
            "signature refused while our clock is off: now signing with the server's time", skew_seconds=round(skew)
        )

    # -- paging --

    def _submit(self, fetch: Callable[[int], R], page_num: int) -> Future[R]:
        try:
            return self._pool.submit(fetch, page_num)
        except RuntimeError as error:
            if self._closed.is_set():  # (the workers are shut down)
                raise ClientClosed("the client was closed (config reload)") from None
            raise BillingUnavailable(f"no thread could be started to fetch pages ({error})") from None

    def _one(self, fetch: Callable[[int], R], page_num: int) -> R:
        """One page, fetched in the pool so that closing the client ends the wait at once."""
        pages = self._many(fetch, range(page_num, page_num + 1))
        try:
            return next(pages)[1]
        finally:
            pages.close()

    def _many(self, fetch: Callable[[int], R], pages: range) -> Generator[tuple[int, R], None, None]:
        """The pages `pages` as they arrive, at most LOOKAHEAD × `concurrency` submitted at a time
        (so memory stays bounded; a page waiting out a retry holds nothing else up). Each page puts
        itself in the read's queue when done, so a wait for the next costs the same however many
        are pending."""
        numbers = iter(pages)
        pending: dict[Future[R], int] = {}
        arrivals: SimpleQueue[Future[Any] | None] = SimpleQueue()
        self._arrivals.add(arrivals)
        try:
            while True:
                if self._closed.is_set():  # (closed before this read's queue was there to tell)
                    raise ClientClosed("the client was closed during the refresh (config reload)")
                while len(pending) < LOOKAHEAD * self.concurrency and (page_num := next(numbers, None)) is not None:
                    future = self._submit(fetch, page_num)
                    pending[future] = page_num
                    future.add_done_callback(arrivals.put)
                if not pending:
                    return
                done = arrivals.get()
                if done is None or done.cancelled():
                    raise ClientClosed("the client was closed during the refresh (config reload)")
                yield pending.pop(done), done.result()
        finally:
            self._arrivals.discard(arrivals)
            for future in pending:
                future.cancel()
