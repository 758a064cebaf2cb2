"""A faithful stand-in for the whole service, on loopback: signed billing API and chat completions.

Used by `demo`, `simulate`, the tests and the benchmarks; the daemon never imports it.
It is strict where the specification allows: it verifies every signature (digest, label,
parameter order, lifetime, clock window, nonce reuse, key), rejects camelCase query names,
a future `date` and `page_size` over 500. Data are deterministic functions of a seed, so a test
can ask the simulator for its own totals. Latency, time to first token and faults are injectable.

Bills are deterministic random amounts, unless the simulator has a price table (`prices`): then
every day that has usage records is billed from those records at those prices, as the provider
would, so the exporter's estimate from usage and the bills agree.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
import random
import re
import socket
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlsplit

from exporter.clock import Clock, days_in_period
from exporter.signing import content_digest, sign, signature_base

if TYPE_CHECKING:
    from exporter.schema import PriceConfig

PRODUCT = "PRODUCT_INFERENCE_ENDPOINT"
ITEMS = ("ITEM_PROMPT_TOKEN", "ITEM_COMPLETION_TOKEN", "ITEM_CACHED_PROMPT_TOKEN")
PROMPT_ITEM, COMPLETION_ITEM, CACHED_PROMPT_ITEM = ITEMS
TENANT = "tenant-0001"
SIGNATURE_WINDOW = 300
BILLS_QUERY = {
    "period",
    "group_period",
    "start_time",
    "end_time",
    "page_num",
    "page_size",
    "project_id",
    "group_term",
    "product",
    "instance_id",
    "bill_id",
    "order_id",
}
USAGES_QUERY = {"date", "page_num", "page_size", "project_id", "model"}
MAX_PAGE_SIZE = 500


@dataclass(frozen=True)
class Endpoint:
    endpoint_id: str
    model: str
    project_id: str


DEFAULT_ENDPOINTS = (
    Endpoint("ep-20261101-alpha", "model-a", "proj-main"),
    Endpoint("ep-20261101-beta", "model-b", "proj-main"),
    Endpoint("ep-20261102-gamma", "model-a", "proj-lab"),
)
API_KEYS = ("sk-7f3a********", "sk-19cc********")
MILLION = Decimal(1_000_000)


@dataclass(frozen=True)
class SimPrice:
    """What the simulator bills per million tokens of one model, per billing item."""

    prompt: Decimal
    """Uncached prompt tokens (ITEM_PROMPT_TOKEN)."""
    cached_prompt: Decimal
    """Prompt tokens served from cache (ITEM_CACHED_PROMPT_TOKEN)."""
    completion: Decimal
    """Completion tokens (ITEM_COMPLETION_TOKEN)."""

    def per_item(self) -> dict[str, Decimal]:
        return {
            PROMPT_ITEM: self.prompt,
            CACHED_PROMPT_ITEM: self.cached_prompt,
            COMPLETION_ITEM: self.completion,
        }


def prices_from_config(prices: Iterable[PriceConfig]) -> dict[str, SimPrice]:
    """The exporter configuration's `prices` as the simulator's table, so one table (the config's)
    both bills and estimates. A missing cached price is the prompt price, as in the exporter's estimate."""
    return {
        p.model: SimPrice(
            prompt=p.prompt_per_million,
            cached_prompt=p.prompt_per_million if p.cached_prompt_per_million is None else p.cached_prompt_per_million,
            completion=p.completion_per_million,
        )
        for p in prices
    }


@dataclass
class Fault:
    """One injected fault, applied to the next `times` requests whose path starts with `path`.

    kind: status (HTTP `status`, envelope body), code (HTTP 200, non-zero `code`), reset (the
    connection reset in the middle of the body), malformed
    (a body that is not JSON), drop (connection closed with no answer), delay (`seconds`, then
    the normal answer), bad_amount (one bill's payableAmount not a number), total_mismatch
    (`total` one higher than the records), bad_value (the first record's `field` set to `value`,
    any JSON value), plain_answer (tools ignored) / bad_tool_args (arguments
    not JSON) / stream_error / truncate / no_usage / stall (chat
    streams only).
    """

    kind: str
    path: str = "/"
    times: int = 1
    status: int = 500
    retry_after: int | None = None
    seconds: float = 0.0
    field: str = ""
    value: Any = None


@dataclass
class UsageDay:
    count: int = 0
    order: list[int] | None = None
    newest_first: bool = False
    """List the newest record first (new records arrive at the head), as consoles often do."""
    removals: int = 0
    """How often records were taken out of the listing: the one change that can shrink the set of
    distinct records (reordering and repeating cannot; new records only add to it), so the only one
    after which billed token sums must be counted again from scratch."""

    def indices(self) -> list[int] | range:
        if self.order is not None:
            return self.order
        return range(self.count - 1, -1, -1) if self.newest_first else range(self.count)


class SimulatorError(Exception):
    def __init__(self, http_status: int, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.http_status = http_status
        self.code = code
        self.reason = reason
        self.message = message


class _RawList(list[str]):
    """A list whose items are already JSON text; `_encode` splices them in as they are."""


_SPLICE = "\u0000raw-list\u0000"


def _encode(payload: dict[str, Any]) -> bytes:
    data = payload.get("data")
    if not isinstance(data, dict) or not isinstance(raw := data.get("list"), _RawList):
        return json.dumps(payload).encode()
    text = json.dumps(payload | {"data": data | {"list": _SPLICE}})
    return text.replace(json.dumps(_SPLICE), "[" + ", ".join(raw) + "]", 1).encode()


def _json(item: str | dict[str, Any]) -> str:
    return item if isinstance(item, str) else json.dumps(item)


def _mix(x: int) -> int:
    """A cheap, well-spread 64-bit hash of an integer (splitmix64's finaliser)."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def _unit(*parts: object) -> int:
    digest = hashlib.sha256("|".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big")


def _record_tokens(h: int) -> tuple[int, int, int]:
    """Prompt, completion and cached prompt tokens of the record whose hash is `h`: one definition
    for the usage records served and the bills computed from them."""
    prompt = 50 + h % 2000
    return prompt, 1 + (h >> 8) % 800, (h >> 16) % (prompt + 1)


@dataclass
class _DayTokens:
    """Billed token counts of one day's records, per (endpoint id, item); extended as records arrive."""

    basis: tuple[Any, ...]
    """What the counts were computed under (seed, endpoints, removals): any change means counting again."""
    counted: int
    """Records 0..counted-1 (those still listed) are in `tokens`."""
    tokens: dict[tuple[str, str], int]


@dataclass
class Simulator:
    """The service's state. `serve()` puts it on a loopback port."""

    clock: Clock = field(default_factory=Clock)
    access_key_id: str = "AKSIMULATOR0001"
    secret_access_key: str = "sim-secret-key-0001"  # noqa: S105 - the stand-in's own, public demo credentials
    api_key: str = "sim-inference-key-0001"
    label: str = "svc"
    seed: int = 1
    endpoints: tuple[Endpoint, ...] = DEFAULT_ENDPOINTS
    latency: float = 0.0
    """Billing: the whole response time (the simulator's own work counts toward it).
    Chat: added before the answer starts, so `time_to_first_token` comes on top of it."""
    time_to_first_token: float = 0.0
    chunk_delay: float = 0.0
    failure_rate: float = 0.0
    """The share of billing requests answered with a random 500, 502, 503 or 429."""
    before_usage_page: Callable[[int], None] | None = None
    """Called with the page number before a usage page is served (tests change the list mid-read)."""
    prices: Mapping[str, SimPrice] | None = None
    """Per model name. When set, a day with usage records is billed from them at these prices
    (see `charge`); change it with `set_prices`, which also drops bills computed at the old ones."""

    def __post_init__(self) -> None:
        self._check_prices(self.prices)
        self._lock = threading.Lock()
        # Held while counting a day's tokens, so that concurrent bills requests count new records once.
        self._tokens_lock = threading.Lock()
        self._day_tokens: dict[dt.date, _DayTokens] = {}
        # Changes whenever priced bills may have changed; part of the bill rows' cache key.
        self._bills_version = 0
        # Usage records read to compute bills: each once however often bills are asked for (all
        # of a day again only after a removal, or a change of seed or endpoints).
        self.records_billed = 0
        self._usage: dict[dt.date, UsageDay] = {}
        self._nonces: dict[str, float] = {}
        self._nonce_expiry: deque[tuple[float, str]] = deque()
        self._faults: list[Fault] = []
        self._bill_overrides: dict[tuple[str, dt.date, str, str], Decimal] = {}
        self._bill_cache: dict[tuple[Any, ...], list[dict[str, str]]] = {}
        self._day_prefixes: dict[dt.date, tuple[str, dt.datetime]] = {}
        self._fragments: dict[Endpoint, str] = {}
        self.requests_served: dict[str, int] = {}
        self.in_flight = 0
        self.max_in_flight = 0
        self._random = random.Random(self.seed)

    # -- control --------------------------------------------------------------------------

    def add_usage(self, count: int, day: dt.date | None = None) -> None:
        with self._lock:
            if self.prices is not None:
                self._bills_version += 1
            usage = self._usage.setdefault(day or self.clock.today(), UsageDay())
            first = usage.count
            usage.count += count
            if usage.order is not None and usage.newest_first:
                usage.order[:0] = range(usage.count - 1, first - 1, -1)
            elif usage.order is not None:
                usage.order.extend(range(first, usage.count))

    def list_newest_first(self, day: dt.date | None = None) -> None:
        """From now on list the day's records newest first: new records arrive at the head."""
        with self._lock:
            self._usage.setdefault(day or self.clock.today(), UsageDay()).newest_first = True

    def repeat_usage(self, position: int, at: int, day: dt.date | None = None) -> None:
        """List the record at `position` a second time, at `at` (`total` counts it twice), as an
        API may that repeats a request across pages."""
        with self._lock:
            usage = self._usage.setdefault(day or self.clock.today(), UsageDay())
            order = list(usage.indices())
            order.insert(at, order[position])
            usage.order = order

    def reorder_usage(self, day: dt.date | None = None) -> None:
        """Serve the day's records in a different order (as the API is free to)."""
        with self._lock:
            usage = self._usage.setdefault(day or self.clock.today(), UsageDay())
            usage.order = list(reversed(usage.indices()))

    def remove_usage(self, positions: list[int], day: dt.date | None = None) -> None:
        with self._lock:
            usage = self._usage.setdefault(day or self.clock.today(), UsageDay())
            order = list(usage.indices())
            for position in sorted(positions, reverse=True):
                del order[position]
            usage.order = order
            usage.removals += 1
            if self.prices is not None:
                self._bills_version += 1

    def set_prices(self, prices: Mapping[str, SimPrice] | None) -> None:
        """Bill days with usage records at `prices` from now on (None: random amounts again)."""
        self._check_prices(prices)
        with self._lock:
            self.prices = prices
            self._bills_version += 1
            self._bill_cache.clear()

    def _check_prices(self, prices: Mapping[str, SimPrice] | None) -> None:
        """Refuse a table that leaves a model unpriced, rather than bill it at some made-up amount."""
        missing = sorted({e.model for e in self.endpoints} - set(prices)) if prices is not None else []
        if missing:
            raise ValueError(f"no simulator price for model(s) {', '.join(missing)}")

    def revise_bill(self, day: dt.date, endpoint_id: str, item: str, amount: Decimal) -> None:
        with self._lock:
            self._bill_overrides[(self.clock.period(day), day, endpoint_id, item)] = amount
            self._bill_cache.clear()

    def inject(self, fault: Fault) -> None:
        with self._lock:
            self._faults.append(fault)

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def _random_failure(self) -> Fault | None:
        if self.failure_rate and self._random.random() < self.failure_rate:
            return Fault("status", status=self._random.choice((500, 502, 503, 429)), retry_after=None)
        return None

    def _take_fault(self, path: str) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if path.startswith(fault.path) and fault.times > 0:
                    fault.times -= 1
                    if fault.times == 0:
                        self._faults.remove(fault)
                    return fault
        return None

    # -- data -----------------------------------------------------------------------------

    def _billed_days(self, period: str) -> list[dt.date]:
        year, month = (int(p) for p in period.split("-"))
        today = self.clock.today()
        days = [dt.date(year, month, d) for d in range(1, days_in_period(period) + 1)]
        return [d for d in days if d <= today]

    def charge(self, period: str, day: dt.date, endpoint: Endpoint, item: str) -> tuple[Decimal, Decimal]:
        """The payable amount and usage of one endpoint, item and day: a revised amount if there is
        one; with `prices` and records that day, the records' tokens of that item × its price;
        else deterministic random amounts (so that past days of the month have bills too)."""
        override = self._bill_overrides.get((period, day, endpoint.endpoint_id, item))
        prices = self.prices
        counted = self._count_tokens(day) if prices is not None else None
        if prices is not None and counted is not None:
            tokens = counted.get((endpoint.endpoint_id, item), 0)
            amount = tokens * prices[endpoint.model].per_item()[item] / MILLION
            return (amount if override is None else override), Decimal(tokens)
        tokens_drawn = Decimal(_unit(self.seed, "tokens", day, endpoint.endpoint_id, item) % 5_000_000)
        if override is not None:
            return override, tokens_drawn
        amount = Decimal(_unit(self.seed, "amount", day, endpoint.endpoint_id, item) % 9_000_000_000).scaleb(-8)
        return amount, tokens_drawn

    def _count_tokens(self, day: dt.date) -> dict[tuple[str, str], int] | None:
        """The day's billed tokens per (endpoint id, item), None when the day has no records.

        Every distinct record listed counts once (a record listed twice is one request). The
        counts are kept per day and extended by the records added since the last call, so serving
        bills reads each record once, not once per request."""
        with self._tokens_lock:
            with self._lock:
                usage = self._usage.get(day)
                if usage is None or usage.count == 0:
                    return None
                basis = (self.seed, self.endpoints, usage.removals)
                known = self._day_tokens.get(day)
                count = usage.count
                if known is None or known.basis != basis:
                    known = _DayTokens(basis, 0, {})
                    indices: Iterable[int] = set(usage.order) if usage.order is not None else range(count)
                else:
                    indices = range(known.counted, count)  # new records are appended: add_usage
            tokens = self._add_tokens(known.tokens, day, indices)
            self._day_tokens[day] = _DayTokens(basis, count, tokens)
            return tokens

    def _add_tokens(
        self, counted: dict[tuple[str, str], int], day: dt.date, indices: Iterable[int]
    ) -> dict[tuple[str, str], int]:
        """`counted` plus the tokens of records `indices`, as a new dict: one handed out is never changed."""
        tokens = dict(counted)
        endpoints = self.endpoints
        base = self._record_base(day)
        read = 0
        for index in indices:
            h = _mix(base + index)
            prompt, completion, cached = _record_tokens(h)
            endpoint_id = endpoints[h % len(endpoints)].endpoint_id
            for item, value in (
                (PROMPT_ITEM, prompt - cached),
                (CACHED_PROMPT_ITEM, cached),
                (COMPLETION_ITEM, completion),
            ):
                tokens[endpoint_id, item] = tokens.get((endpoint_id, item), 0) + value
            read += 1
        self.records_billed += read
        return tokens

    def bill_rows(self, period: str, group_term: str, project_id: str = "") -> list[dict[str, str]]:
        """A month's rows for one grouping; cached, since every page of a request needs them."""
        key = (period, group_term, project_id, self.clock.today(), self.endpoints, self._bills_version)
        with self._lock:
            rows = self._bill_cache.get(key)
        if rows is None:
            rows = self._bill_rows(period, group_term, project_id)
            with self._lock:
                self._bill_cache = {key: rows} | dict(list(self._bill_cache.items())[:7])
        return rows

    def _bill_rows(self, period: str, group_term: str, project_id: str) -> list[dict[str, str]]:
        rows = []
        for day in self._billed_days(period):
            start = self.clock.day_start(day).astimezone(dt.UTC)
            common = {
                "tenantId": TENANT,
                "period": period,
                "product": PRODUCT,
                "startTime": start.strftime("%Y-%m-%dT%H:%M:%SZ"),
                "endTime": (start + dt.timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%SZ"),
            }
            endpoints = [e for e in self.endpoints if not project_id or e.project_id == project_id]
            charges = {(e, item): self.charge(period, day, e, item) for e in endpoints for item in ITEMS}
            if group_term == "GROUP_TERM_INSTANCE":
                for e in endpoints:
                    amount = sum((charges[e, item][0] for item in ITEMS), Decimal(0))
                    usage = sum((charges[e, item][1] for item in ITEMS), Decimal(0))
                    rows.append(
                        common
                        | {
                            "projectId": e.project_id,
                            "instanceId": e.endpoint_id,
                            "item": "",
                            "payableAmount": str(amount),
                            "usageValue": str(usage),
                        }
                    )
            else:
                for item in ITEMS:
                    amount = sum((charges[e, item][0] for e in endpoints), Decimal(0))
                    usage = sum((charges[e, item][1] for e in endpoints), Decimal(0))
                    rows.append(
                        common
                        | {
                            "projectId": project_id,
                            "instanceId": "",
                            "item": item,
                            "payableAmount": str(amount),
                            "usageValue": str(usage),
                        }
                    )
        return rows

    def bill_totals(self, period: str) -> dict[str, Decimal]:
        """The simulator's own sums: per endpoint id, per item, and `total`."""
        sums: dict[str, Decimal] = {"total": Decimal(0)}
        for day in self._billed_days(period):
            for e in self.endpoints:
                for item in ITEMS:
                    amount = self.charge(period, day, e, item)[0]
                    sums[e.endpoint_id] = sums.get(e.endpoint_id, Decimal(0)) + amount
                    sums[item] = sums.get(item, Decimal(0)) + amount
                    sums["total"] += amount
        return sums

    def usage_record_json(self, day: dt.date, index: int) -> str:
        """Record `index` of `day` as JSON text: written directly, since serving pages of them is
        the simulator's hottest path (`usage_record` parses this same text, so both agree)."""
        h = _mix(self._record_base(day) + index)
        endpoint = self.endpoints[h % len(self.endpoints)]
        fragment = self._fragments.get(endpoint)
        if fragment is None:
            fragment = self._fragments[endpoint] = json.dumps(
                {"model": endpoint.model, "endpoint": endpoint.endpoint_id}
            )[1:-1]
        day_prefix = self._day_prefixes.get(day)
        if day_prefix is None:
            start = self.clock.day_start(day).astimezone(dt.UTC).replace(tzinfo=None)
            day_prefix = self._day_prefixes[day] = (f"req-{day:%Y%m%d}-", start)
        prompt, completion, cached = _record_tokens(h)
        instant = day_prefix[1] + dt.timedelta(seconds=(index * 37) % 86400)
        return (
            f'{{"requestId": "{day_prefix[0]}{index:09d}", "requestTime": "{instant.isoformat()}Z", '
            f'"tenantId": "{TENANT}", {fragment}, "apikey": "{API_KEYS[(h >> 20) % len(API_KEYS)]}", '
            f'"promptTokens": {prompt}, "completionTokens": {completion}, '
            f'"promptCachedTokens": {cached}}}'
        )

    def _record_base(self, day: dt.date) -> int:
        """Record `index` of `day` is a function of `_mix(_record_base(day) + index)`."""
        return self.seed * 1_000_003 + day.toordinal() * 100_000_007

    def usage_record(self, day: dt.date, index: int) -> dict[str, Any]:
        record: dict[str, Any] = json.loads(self.usage_record_json(day, index))
        return record

    def usage_records(self, day: dt.date) -> Iterator[dict[str, Any]]:
        with self._lock:
            indices = list(self._usage.get(day, UsageDay()).indices())
        return (self.usage_record(day, i) for i in indices)

    def usage_totals(
        self, day: dt.date | None = None, *, distinct: bool = False
    ) -> dict[tuple[str, str], dict[str, int]]:
        """The simulator's own sums for a day, per (endpoint, model): of every record it lists, or
        with `distinct`, of every request (one it lists twice counted once)."""
        totals: dict[tuple[str, str], dict[str, int]] = {}
        seen: set[str] = set()
        for r in self.usage_records(day or self.clock.today()):
            if distinct and r["requestId"] in seen:
                continue
            seen.add(r["requestId"])
            t = totals.setdefault(
                (r["endpoint"], r["model"]), dict.fromkeys(("requests", "prompt", "completion", "cached"), 0)
            )
            t["requests"] += 1
            t["prompt"] += r["promptTokens"]
            t["completion"] += r["completionTokens"]
            t["cached"] += r["promptCachedTokens"]
        return totals

    # -- billing API ----------------------------------------------------------------------

    def verify_signature(self, method: str, raw_query: str, path: str, headers: Any, body: bytes) -> None:
        def reject(reason: str, message: str) -> SimulatorError:
            return SimulatorError(401, 100401, reason, message)

        digest = headers.get("Content-Digest")
        signature_input = headers.get("Signature-Input")
        signature = headers.get("Signature")
        if not (digest and signature_input and signature):
            raise reject("SignatureMissing", "Content-Digest, Signature-Input and Signature are required")
        if not hmac.compare_digest(digest, content_digest(body)):
            raise reject("DigestMismatch", "Content-Digest does not match the body")
        label, _, params = signature_input.partition("=")
        if label != self.label or not signature.startswith(f"{self.label}=:") or not signature.endswith(":"):
            raise reject("SignatureLabel", f"signature label must be {self.label!r}")
        match = re.fullmatch(
            r'\("@method" "@query" "@path" "content-digest"\);created=(\d+)(?:;expires=(\d+))?'
            r';nonce="([A-Za-z0-9_-]{43})";keyid="((?:[^"\\]|\\.)*)";alg="hmac-sha256"',
            params,
        )
        if not match:
            raise reject("SignatureInput", "Signature-Input parameters are malformed or out of order")
        created, expires = int(match[1]), int(match[2]) if match[2] else None
        nonce, key_id = match[3], re.sub(r"\\(.)", r"\1", match[4])
        now = self.clock.now().timestamp()
        if abs(now - created) > SIGNATURE_WINDOW:
            raise reject("SignatureExpired", "created is outside the accepted clock window")
        if expires is not None and (expires <= created or now > expires):
            raise reject("SignatureExpired", "signature has expired")
        if key_id != self.access_key_id:
            raise reject("AccessKeyInvalid", "unknown access key")
        base = signature_base(method=method, query=raw_query, path=path, digest=digest, params=params)
        expected = f"{self.label}=:{sign(self.secret_access_key, base)}:"
        if not hmac.compare_digest(signature, expected):
            raise reject("SignatureMismatch", "signature does not match")
        with self._lock:
            while self._nonce_expiry and self._nonce_expiry[0][0] < now:
                self._nonces.pop(self._nonce_expiry.popleft()[1], None)
            if nonce in self._nonces:
                raise reject("NonceReused", "nonce has been used before")
            self._nonces[nonce] = now
            self._nonce_expiry.append((now + 2 * SIGNATURE_WINDOW, nonce))

    @staticmethod
    def _query(raw_query: str, allowed: set[str]) -> dict[str, str]:
        params: dict[str, str] = {}
        for name, value in parse_qsl(raw_query, keep_blank_values=True, strict_parsing=bool(raw_query)):
            if name != name.lower():
                raise SimulatorError(400, 100400, "InvalidParameter", f"parameter {name!r} must be snake_case")
            if name not in allowed:
                raise SimulatorError(400, 100400, "InvalidParameter", f"unknown parameter {name!r}")
            params[name] = value
        return params

    @staticmethod
    def _paging(params: dict[str, str], default_size: int) -> tuple[int, int]:
        try:
            page_num = int(params.get("page_num", "1"))
            page_size = int(params.get("page_size", str(default_size)))
        except ValueError:
            raise SimulatorError(400, 100400, "InvalidParameter", "page_num and page_size must be integers") from None
        if page_num < 1 or not 1 <= page_size <= MAX_PAGE_SIZE:
            raise SimulatorError(400, 100400, "InvalidParameter", f"page_num ≥ 1 and page_size 1..{MAX_PAGE_SIZE}")
        return page_num, page_size

    def bills_response(self, raw_query: str) -> dict[str, Any]:
        params = self._query(raw_query, BILLS_QUERY)
        period = params.get("period", "")
        if not re.fullmatch(r"\d{4}-(0[1-9]|1[0-2])", period):
            raise SimulatorError(400, 100400, "InvalidParameter", "period must be YYYY-MM")
        if params.get("group_period") != "GROUP_PERIOD_DAILY":
            raise SimulatorError(400, 100400, "InvalidParameter", "group_period must be GROUP_PERIOD_DAILY")
        group_term = params.get("group_term", "GROUP_TERM_ITEM")
        if group_term not in ("GROUP_TERM_ITEM", "GROUP_TERM_INSTANCE"):
            raise SimulatorError(400, 100400, "InvalidParameter", "unknown group_term")
        page_num, page_size = self._paging(params, 20)
        rows = self.bill_rows(period, group_term, params.get("project_id", ""))
        if params.get("instance_id"):
            rows = [r for r in rows if r["instanceId"] == params["instance_id"]]
        start = (page_num - 1) * page_size
        return {"list": rows[start : start + page_size], "total": len(rows)}

    def usages_response(self, raw_query: str) -> dict[str, Any]:
        params = self._query(raw_query, USAGES_QUERY)
        try:
            day = dt.date.fromisoformat(params.get("date", ""))
        except ValueError:
            raise SimulatorError(400, 100400, "InvalidParameter", "date must be YYYY-MM-DD") from None
        if day > self.clock.today():
            raise SimulatorError(400, 100400, "InvalidParameter", "date must not be in the future")
        page_num, page_size = self._paging(params, 100)
        if self.before_usage_page is not None:
            self.before_usage_page(page_num)
        start = (page_num - 1) * page_size
        project, model = params.get("project_id"), params.get("model")
        with self._lock:
            indices = self._usage.get(day, UsageDay()).indices()
            indices = indices[start : start + page_size] if not (project or model) else list(indices)
            total = len(self._usage.get(day, UsageDay()).indices())
        if not (project or model):
            page = _RawList(self.usage_record_json(day, i) for i in indices)
            return {"list": page, "total": str(total), "date": day.isoformat()}
        ids = {e.endpoint_id for e in self.endpoints if not project or e.project_id == project}
        records = (self.usage_record(day, i) for i in indices)
        matching = [r for r in records if r["endpoint"] in ids and (not model or r["model"] == model)]
        return {"list": matching[start : start + page_size], "total": str(len(matching)), "date": day.isoformat()}

    # -- chat API -------------------------------------------------------------------------

    def chat_answer(self, request: dict[str, Any]) -> tuple[list[str], list[str], list[dict[str, Any]], int]:
        """Reasoning pieces, content pieces, tool calls and prompt tokens for one request."""
        messages = request.get("messages") or []
        prompt_text = " ".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
        prompt_tokens = 1 + len(prompt_text) // 4
        thinking = bool((request.get("chat_template_kwargs") or {}).get("thinking"))
        reasoning = ["The ", "caller ", "wants ", "a ", "short ", "answer."] if thinking else []
        tools = request.get("tools") or []
        if tools:
            function = tools[0].get("function", {})
            properties = (function.get("parameters") or {}).get("properties") or {}
            arguments = {
                name: 1 if (spec or {}).get("type") == "integer" else "probe" for name, spec in properties.items()
            }
            call = {
                "id": "call_sim_0001",
                "type": "function",
                "function": {"name": function.get("name", ""), "arguments": json.dumps(arguments)},
            }
            return reasoning, [], [call], prompt_tokens
        if (request.get("response_format") or {}).get("type") == "json_object":
            system = " ".join(str(m.get("content", "")) for m in messages if m.get("role") == "system")
            keys = re.findall(r'"(\w+)"', system) or ["result"]
            answer = json.dumps(dict.fromkeys(keys, "ok"))
            return reasoning, [answer[i : i + 4] for i in range(0, len(answer), 4)], [], prompt_tokens
        return reasoning, ["po", "ng"], [], prompt_tokens

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> SimulatorServer:
        server = SimulatorServer((host, port), _Handler, self)
        server.start()
        return server


class SimulatorServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], sim: Simulator) -> None:
        super().__init__(address, handler)
        self.sim = sim
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up (a probe's deadline, a killed process) is normal here, not an error."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, args=(0.05,), name="simulator", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        if self._thread:
            self._thread.join(timeout=5)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: SimulatorServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    @property
    def sim(self) -> Simulator:
        return self.server.sim

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, payload: bytes, content_type: str = "application/json", **headers: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(payload)

    def _envelope(self, status: int, code: int, reason: str, message: str, data: Any = None) -> None:
        body = {"code": code, "reason": reason, "message": message}
        if data is not None:
            body["data"] = data
        self._send(status, _encode(body))

    def date_time_string(self, timestamp: float | None = None) -> str:
        return super().date_time_string(self.sim.clock.now().timestamp() if timestamp is None else timestamp)

    def _transport_fault(self, fault: Fault | None, error_body: Callable[[int], bytes]) -> bool:
        """Apply a fault both APIs share (delay, drop, HTTP status); True when it ended the request."""
        if fault is None:
            return False
        if fault.kind == "delay":
            time.sleep(fault.seconds)
        elif fault.kind == "drop":
            self._drop()
            return True
        elif fault.kind == "status":
            extra = {"Retry-After": str(fault.retry_after)} if fault.retry_after is not None else {}
            self._send(fault.status, error_body(fault.status), **extra)
            return True
        elif fault.kind == "reset":
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "4096")
            self.end_headers()
            self.wfile.write(b'{"code": 0, "data": {"list": [{"requestId": "')
            self.wfile.flush()
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self._drop()  # with SO_LINGER 0 the close is a reset, mid-body
            return True
        return False

    def _drop(self) -> None:
        self.close_connection = True
        self.connection.close()

    def do_GET(self) -> None:
        sim = self.sim
        with sim._lock:
            sim.in_flight += 1
            sim.max_in_flight = max(sim.max_in_flight, sim.in_flight)
        try:
            self._billing()
        finally:
            with sim._lock:
                sim.in_flight -= 1

    def _billing(self) -> None:
        """`latency` is the whole response time: the simulator's own work counts toward it."""
        received = time.monotonic()
        url = urlsplit(self.path)
        body = self._body()
        with self.sim._lock:
            self.sim.requests_served[url.path] = self.sim.requests_served.get(url.path, 0) + 1
        handlers = {
            "/api/v1/bills/details": self.sim.bills_response,
            "/api/v1/usages/details": self.sim.usages_response,
        }
        if url.path not in handlers:
            self._envelope(404, 100404, "NotFound", "no such API")
            return
        fault = self.sim._take_fault(url.path) or self.sim._random_failure()

        def envelope(status: int) -> bytes:
            return _encode({"code": 100500, "reason": "Fault", "message": HTTPStatus(status).phrase})

        if self._transport_fault(fault, envelope):
            return
        if fault and fault.kind == "malformed":
            self._send(200, b'{"code": 0, "data": {"list": [')
            return
        if fault and fault.kind == "code":
            self._envelope(200, 100503, "ServiceBusy", "service is busy, try later")
            return
        try:
            self.sim.verify_signature("GET", url.query, url.path, self.headers, body)
            data = handlers[url.path](url.query)
        except SimulatorError as error:
            self._envelope(error.http_status, error.code, error.reason, error.message)
            return
        if fault and fault.kind == "bad_amount" and data["list"]:
            first = data["list"][0]
            if isinstance(first, str):  # a usage record, as JSON text
                data["list"] = _RawList([json.dumps(json.loads(first) | {"promptTokens": "12,5"}), *data["list"][1:]])
            else:
                data["list"][0] = first | {"payableAmount": "12,5"}
        if fault and fault.kind == "bad_value" and data["list"]:
            first = data["list"][0]
            record = json.loads(first) if isinstance(first, str) else first
            data["list"] = _RawList([json.dumps(record | {fault.field: fault.value}), *map(_json, data["list"][1:])])
        if fault and fault.kind == "total_mismatch":
            data["total"] = type(data["total"])(int(data["total"]) + 1)
        payload = _encode({"code": 0, "reason": "OK", "message": "success", "data": data})
        remaining = self.sim.latency - (time.monotonic() - received)
        if remaining > 0:
            time.sleep(remaining)
        self._send(200, payload)

    def do_POST(self) -> None:
        url = urlsplit(self.path)
        body = self._body()
        if url.path == "/v1/chat/completions":
            self._chat(body)
        elif url.path.startswith("/_sim/"):
            self._control(url.path, body)
        else:
            self._send(404, b'{"error": {"message": "not found"}}')

    def _control(self, path: str, body: bytes) -> None:
        """Out-of-process control: /_sim/usage {"count": N}, /_sim/fault {Fault fields}, /_sim/clear,
        /_sim/stats (requests served per path)."""
        try:
            request = json.loads(body or b"{}")
            if path == "/_sim/stats":
                with self.sim._lock:
                    self._send(200, json.dumps(self.sim.requests_served).encode())
                return
            if path == "/_sim/usage":
                day = request.get("date")
                self.sim.add_usage(int(request["count"]), dt.date.fromisoformat(day) if day else None)
            elif path == "/_sim/fault":
                self.sim.inject(Fault(**request))
            elif path == "/_sim/clear":
                self.sim.clear_faults()
            else:
                raise KeyError(path)
        except (KeyError, TypeError, ValueError) as error:
            self._send(400, json.dumps({"error": str(error)}).encode())
            return
        self._send(200, b"{}")

    def _chat_error(self, status: int, kind: str, message: str) -> None:
        self._send(status, json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode())

    def _chat(self, body: bytes) -> None:
        sim = self.sim
        fault = sim._take_fault("/v1/chat/completions")
        if sim.latency:
            time.sleep(sim.latency)
        if self._transport_fault(
            fault, lambda status: json.dumps({"error": {"message": HTTPStatus(status).phrase}}).encode()
        ):
            return
        if self.headers.get("Authorization") != f"Bearer {sim.api_key}":
            self._chat_error(401, "authentication_error", "invalid API key")
            return
        try:
            request = json.loads(body)
            model = request["model"]
        except (ValueError, KeyError, TypeError):
            self._chat_error(400, "invalid_request_error", "body must be JSON with model and messages")
            return
        if model not in {e.endpoint_id for e in sim.endpoints}:
            self._chat_error(404, "not_found_error", "endpoint not found")
            return
        if fault and fault.kind == "malformed":
            self._send(200, b'{"id": "chatcmpl-sim", "choices": [')
            return
        if fault and fault.kind == "plain_answer":
            request = {k: v for k, v in request.items() if k != "tools"}
        reasoning, content, tool_calls, prompt_tokens = sim.chat_answer(request)
        if fault and fault.kind == "bad_tool_args":
            tool_calls = [call | {"function": call["function"] | {"arguments": '{"service": '}} for call in tool_calls]
        max_tokens = request.get("max_tokens")
        finish = "tool_calls" if tool_calls else "stop"
        if isinstance(max_tokens, int) and len(reasoning) + len(content) > max_tokens:
            content = content[: max(0, max_tokens - len(reasoning))]
            finish = "length"
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(reasoning) + len(content) + (8 if tool_calls else 0),
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        head = {"id": "chatcmpl-sim", "created": int(sim.clock.now().timestamp()), "model": model}
        if not request.get("stream"):
            time.sleep(sim.time_to_first_token + sim.chunk_delay * max(0, len(content) - 1))
            message: dict[str, Any] = {"role": "assistant", "content": "".join(content) if not tool_calls else None}
            if reasoning:
                message["reasoning_content"] = "".join(reasoning)
            if tool_calls:
                message["tool_calls"] = tool_calls
            answer = head | {
                "object": "chat.completion",
                "usage": usage,
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            }
            self._send(200, json.dumps(answer).encode())
            return
        include_usage = bool((request.get("stream_options") or {}).get("include_usage"))
        self._stream(head, reasoning, content, tool_calls, finish, usage if include_usage else None, fault)

    def _stream(
        self,
        head: dict[str, Any],
        reasoning: list[str],
        content: list[str],
        tool_calls: list[dict[str, Any]],
        finish: str,
        usage: dict[str, Any] | None,
        fault: Fault | None,
    ) -> None:
        sim = self.sim
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def event(data: str) -> None:
            payload = f"data: {data}\n\n".encode()
            self.wfile.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
            self.wfile.flush()

        def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> None:
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
            event(json.dumps(head | {"object": "chat.completion.chunk", "choices": [choice]}))

        try:
            chunk({"role": "assistant", "content": ""})
            time.sleep(sim.time_to_first_token)
            deltas: list[dict[str, Any]] = [{"reasoning_content": piece} for piece in reasoning]
            deltas += [{"content": piece} for piece in content]
            for call in tool_calls:
                arguments = call["function"]["arguments"]
                deltas.append(
                    {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": call["id"],
                                "type": "function",
                                "function": {"name": call["function"]["name"], "arguments": ""},
                            }
                        ]
                    }
                )
                deltas += [
                    {"tool_calls": [{"index": 0, "function": {"arguments": arguments[i : i + 8]}}]}
                    for i in range(0, len(arguments), 8)
                ]
            for n, delta in enumerate(deltas):
                if n:
                    time.sleep(sim.chunk_delay)
                if fault and fault.kind == "stall" and n == len(deltas) // 2:
                    time.sleep(fault.seconds)
                if fault and fault.kind == "stream_error" and n == len(deltas) // 2:
                    event(json.dumps({"error": {"message": "internal error while generating", "type": "server_error"}}))
                    break
                if fault and fault.kind == "truncate" and n == len(deltas) // 2:
                    break
                chunk(delta)
            else:
                chunk({}, finish)
                if usage is not None and not (fault and fault.kind == "no_usage"):
                    event(json.dumps(head | {"object": "chat.completion.chunk", "choices": [], "usage": usage}))
                event("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
