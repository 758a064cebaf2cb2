"""The stand-in service's state, and how tests change it (usage, faults, prices, revised bills)."""

from __future__ import annotations

import datetime as dt
import random
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from exporter.core.clock import Clock
from exporter.sim.billing_api import BillingService
from exporter.sim.chat_api import ChatAPI
from exporter.sim.history import SpendModel, Spike
from exporter.sim.model import (
    DEFAULT_ENDPOINTS,
    Endpoint,
    Fault,
    SimPrice,
    UsageDay,
    _DayTokens,
)
from exporter.sim.server import SimulatorServer


@dataclass
class Simulator(BillingService, ChatAPI):
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
    before_bills_page: Callable[[int], None] | None = None
    """Called with the page number before a bills page is served (the same, for the bills)."""
    newest_first: bool = False
    """List every day's usage records newest first (new records at the head), as consoles often
    do; `list_newest_first` turns it on for one day."""
    stream_framing: str = "chunked"
    """How a streamed chat answer is framed: "chunked" (Transfer-Encoding: chunked) or "close" (no
    length and no chunks: the body ends when the connection closes, as some servers and proxies send it)."""
    usage_page_cap: int | None = None
    """The most usage records a page holds whatever `page_size` asks (a service that caps pages
    silently); None: as many as asked."""
    total_as_number: bool = False
    """Write a usage page's `total` as a JSON number instead of the documented string."""
    spend: SpendModel | None = None
    """Bill days without usage records of their own from this model (months of history with a
    weekly rhythm, noise, growth and spikes); None: deterministic random amounts."""
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
        self._distortions: list[tuple[dt.date, Decimal, str, str]] = []
        self._bill_cache: dict[tuple[Any, ...], list[dict[str, str]]] = {}
        self._day_prefixes: dict[dt.date, tuple[str, str, str, int, int]] = {}
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
            usage = self._usage_day(day)
            first = usage.count
            usage.count += count
            if usage.order is not None and usage.newest_first:
                usage.order[:0] = range(usage.count - 1, first - 1, -1)
            elif usage.order is not None:
                usage.order.extend(range(first, usage.count))

    def _usage_day(self, day: dt.date | None) -> UsageDay:
        """The listing of `day` (today by default), started in the simulator's order if new."""
        return self._usage.setdefault(day or self.clock.today(), UsageDay(newest_first=self.newest_first))

    def list_newest_first(self, day: dt.date | None = None) -> None:
        """From now on list the day's records newest first: new records arrive at the head."""
        with self._lock:
            self._usage_day(day).newest_first = True

    def insert_usage(self, count: int, at: int, day: dt.date | None = None) -> None:
        """New records listed at position `at` instead of where the order puts them (a late record
        landing mid-list)."""
        with self._lock:
            if self.prices is not None:
                self._bills_version += 1
            usage = self._usage_day(day)
            order = list(usage.indices())
            first = usage.count
            usage.count += count
            order[at:at] = range(first, usage.count)
            usage.order = order

    def repeat_usage(self, position: int, at: int, day: dt.date | None = None) -> None:
        """List the record at `position` a second time, at `at` (`total` counts it twice), as an
        API may that repeats a request across pages."""
        with self._lock:
            usage = self._usage_day(day)
            order = list(usage.indices())
            order.insert(at, order[position])
            usage.order = order

    def reorder_usage(self, day: dt.date | None = None) -> None:
        """Serve the day's records in a different order (as the API is free to)."""
        with self._lock:
            usage = self._usage_day(day)
            usage.order = list(reversed(usage.indices()))

    def remove_usage(self, positions: list[int], day: dt.date | None = None) -> None:
        with self._lock:
            usage = self._usage_day(day)
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

    def add_spike(self, day: dt.date, group: str, factor: float) -> None:
        """`factor` × the usual spend on `day` for `group` (an endpoint id, an item, or "" for all)."""
        if self.spend is None:
            raise ValueError("spikes need a spend model (Simulator.spend)")
        with self._lock:
            self.spend.spikes.append(Spike(day, group, factor))
            self._bills_version += 1
            self._bill_cache.clear()

    def distort_bill(self, day: dt.date, factor: Decimal, *, endpoint_id: str = "", item: str = "") -> None:
        """Bill `factor` × the tokens the records count (and their price) on `day`, for one
        endpoint and/or item (all when not given): a bill that disagrees with the usage it lists.
        Only bills computed from records at `prices` are affected."""
        with self._lock:
            self._distortions.append((day, factor, endpoint_id, item))
            self._bills_version += 1
            self._bill_cache.clear()

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

    def _take_fault(self, path: str, kinds: frozenset[str] | None = None) -> Fault | None:
        """The next fault injected for `path` (of `kinds`, when given), counted as served."""
        with self._lock:
            for fault in self._faults:
                if path.startswith(fault.path) and fault.times > 0 and (kinds is None or fault.kind in kinds):
                    fault.times -= 1
                    if fault.times == 0:
                        self._faults.remove(fault)
                    return fault
        return None

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> SimulatorServer:
        server = SimulatorServer((host, port), self)
        server.start()
        return server
