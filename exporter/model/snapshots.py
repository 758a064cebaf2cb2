"""Immutable snapshots shared between the refresh threads and the scrape thread.

A refresh builds a new snapshot and swaps it in whole; a scrape reads whatever is current.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from decimal import Decimal
from types import MappingProxyType
from typing import NamedTuple

import msgspec

from exporter.core.clock import periods_before
from exporter.model.forecast import DEFAULT_LEVEL, MonthForecast
from exporter.model.source_names import BILLING_SOURCES, PROBE_PREFIX, probe_source

BillKey = tuple[str, str, str]
"""An endpoint id or a billing item, the product and the project of a bill's rows."""
UsageRow = tuple[str, str, str, int, int, int, int]
"""endpoint, model, api_key, requests, prompt, completion, cached"""


class DailyAmount(msgspec.Struct, frozen=True, gc=False):
    """One day's bill for one key (an endpoint id or a billing item). Untracked by the garbage
    collector (`gc=False`: its fields are strings, a date and amounts, so it can hold no cycle):
    at 5,000 endpoints a month holds 135k of them, and every full collection would walk them all."""

    period: str
    day: dt.date
    key: str
    product: str
    project_id: str
    payable: Decimal
    usage: Decimal


def per_day(amounts: Iterable[DailyAmount]) -> dict[dt.date, Decimal]:
    """The payable amount per day, over any rows (one key's, a scope's, the account's by item)."""
    days: dict[dt.date, Decimal] = {}
    for a in amounts:
        days[a.day] = days.get(a.day, Decimal(0)) + a.payable
    return days


@dataclass(frozen=True)
class MonthBills:
    period: str
    by_endpoint: tuple[DailyAmount, ...]
    by_item: tuple[DailyAmount, ...]
    month_to_date: Decimal
    forecast: Decimal
    today_forecast: Decimal
    outlook: MonthForecast | None = None
    """The forecast in full (its expected days, its interval at `forecast.interval`); None for
    today's formula (no history at hand) and for a month that has ended."""

    @property
    def lower(self) -> Decimal | None:
        """The bounds of the forecast's interval; None when it has none."""
        return None if self.outlook is None else self.outlook.lower

    @property
    def upper(self) -> Decimal | None:
        return None if self.outlook is None else self.outlook.upper

    @property
    def interval(self) -> float:
        """The interval's nominal coverage the bills were forecast with (`forecast.interval`)."""
        return DEFAULT_LEVEL if self.outlook is None else self.outlook.level

    def spend_on(self, day: dt.date) -> Decimal:
        return sum((a.payable for a in self.by_item if a.day == day), Decimal(0))

    def totals(self, by_endpoint: bool, day: dt.date | None = None) -> Mapping[BillKey, Decimal]:
        """The payable amount per (endpoint id or item, product, project), over the month or on
        `day`: what every spend rule of one window sums its groups from. Made once per snapshot
        and window (a snapshot is never changed): ten rules at 5,000 endpoints read 5,000 sums
        each instead of 150,000 rows."""
        cache: dict[tuple[bool, dt.date | None], Mapping[BillKey, Decimal]] = self.__dict__.setdefault("_totals", {})
        found = cache.get((by_endpoint, day))
        if found is None:
            sums: dict[BillKey, Decimal] = {}
            for a in self.by_endpoint if by_endpoint else self.by_item:
                if day is None or a.day == day:
                    key = (a.key, a.product, a.project_id)
                    sums[key] = sums.get(key, Decimal(0)) + a.payable
            found = cache[by_endpoint, day] = MappingProxyType(sums)
        return found


@dataclass(frozen=True)
class BillsSnapshot:
    months: tuple[MonthBills, ...]
    """The current month first, then the previous one while it is in its grace days."""
    today: dt.date
    asked: float | None = None
    """When the bills were asked for (Unix seconds; None: not said): they are as they stood then, or later."""

    @property
    def current(self) -> MonthBills:
        return self.months[0]


@dataclass(frozen=True)
class MonthHistory:
    """A past month's daily bills, as fetched on `fetched` (a billing day)."""

    period: str
    by_endpoint: tuple[DailyAmount, ...]
    by_item: tuple[DailyAmount, ...]
    fetched: dt.date
    items_by_endpoint: Mapping[str, tuple[DailyAmount, ...]] = field(default_factory=lambda: MappingProxyType({}))
    """Each endpoint's charges by item (what names the items of an endpoint behind an anomaly)."""


@dataclass(frozen=True)
class HistorySnapshot:
    months: Mapping[str, MonthHistory] = field(default_factory=lambda: MappingProxyType({}))
    """By period, oldest first; a month that could never be fetched is absent (never zeros)."""
    current: MonthHistory | None = None
    """The current month as fetched once today, for its endpoints' charges by item."""
    as_of: dt.date | None = None
    """The billing day of the refresh that made it."""

    def item_days(self, period: str) -> dict[dt.date, Decimal] | None:
        """The account's payable amount per day of `period`, or None when it is not held."""
        month = self.months.get(period)
        return None if month is None else per_day(month.by_item)

    def keeping(self, months: int) -> HistorySnapshot:
        """Itself with only the past months a config of `billing.history_months: months` keeps (a
        reload may have made them fewer: those it no longer keeps are not judged on)."""
        if self.as_of is None:
            return self
        kept = set(periods_before(f"{self.as_of:%Y-%m}", months))
        if kept >= self.months.keys():
            return self
        return replace(self, months=MappingProxyType({p: m for p, m in self.months.items() if p in kept}))


@dataclass(frozen=True)
class TokenGap:
    """One settled day's billed tokens of one item against the tokens the usage records count."""

    day: dt.date
    item: str
    billed: Decimal
    counted: int
    ratio: Decimal | None
    """(billed − counted) ÷ counted; None when nothing was counted but something billed."""


@dataclass(frozen=True)
class AmountGap:
    """One settled day's payable amount of one endpoint against its tokens × prices."""

    day: dt.date
    endpoint_id: str
    billed: Decimal
    estimated: Decimal
    ratio: Decimal | None


@dataclass(frozen=True)
class Reconciliation:
    tokens: tuple[TokenGap, ...] = ()
    amounts: tuple[AmountGap, ...] = ()

    @property
    def last_day(self) -> dt.date | None:
        """The last settled day with figures."""
        days = [g.day for g in self.tokens] + [g.day for g in self.amounts]
        return max(days) if days else None


class UsageKey(NamedTuple):
    """What a day's usage is summed by. A named tuple, not a dataclass: one is made, hashed and
    compared for every record a read counts, and a tuple's are done in C."""

    endpoint_id: str
    model: str
    api_key: str = ""


@dataclass(frozen=True, slots=True)
class UsageTotals:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    estimated_payable: Decimal | None = None


@dataclass(frozen=True)
class UsageSnapshot:
    day: dt.date
    totals: Mapping[UsageKey, UsageTotals]
    records: int
    created: float
    """When these counters started: the day's start, or a later reset when records vanished upstream."""
    resyncs: int = 0
    previous_day: UsageSnapshot | None = None
    """The day before, finalised by its last full pull at the rollover."""
    per_api_key: bool | None = None
    """Whether `totals` are per API key (None: not said)."""


@dataclass(frozen=True)
class ProbeRun:
    """One probe request: its outcome, its checks and its timings (seconds)."""

    success: bool
    reason: str | None
    checks: Mapping[str, bool]
    duration: float
    time_to_headers: float | None = None
    time_to_first_token: float | None = None
    time_to_first_reasoning_token: float | None = None
    time_to_first_answer_token: float | None = None
    max_chunk_gap: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    output_tokens_per_second: float | None = None


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts, Prometheus style."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float = 0.0

    def observe(self, value: float) -> Histogram:
        counts = tuple(c + (value <= bound) for c, bound in zip(self.counts, self.bounds, strict=True))
        return Histogram(self.bounds, counts, self.total + value)

    @property
    def count(self) -> int:
        return self.counts[-1]


@dataclass(frozen=True)
class ProbeSnapshot:
    """A probe's last run and its running totals since start-up."""

    probe: str
    endpoint_id: str
    scenario: str
    last: ProbeRun
    runs: int
    failures: Mapping[str, int]
    tokens: Mapping[str, int]
    time_to_first_token: Histogram
    e2e_latency: Histogram


@dataclass(frozen=True)
class SourceHealth:
    source: str
    success: bool
    last_success: float | None
    duration: float
    error: str = ""


@dataclass
class Latest:
    """The current snapshot of each source, plus per-source health and API call counts."""

    bills: BillsSnapshot | None = None
    usage: UsageSnapshot | None = None
    history: HistorySnapshot | None = None
    reconciliation: Reconciliation | None = None
    settled: Mapping[dt.date, list[UsageRow]] = field(default_factory=lambda: MappingProxyType({}))
    """Past days' usage sums, each read in full once it settled (`reconcile.SettledUsage`)."""
    probes: Mapping[str, ProbeSnapshot] = field(default_factory=lambda: MappingProxyType({}))
    _health: Mapping[str, SourceHealth] = field(default_factory=lambda: MappingProxyType({}))
    _api_calls: dict[tuple[str, str], int] = field(default_factory=dict)
    api_calls_counted: int = 0
    """API calls counted so far (what tells an account's health series changed since a render)."""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    started: float = field(default_factory=time.time)
    """When these snapshots began to be kept (the daemon gives its billing clock's time): what a
    source never refreshed has been waited for since (`waiting_since`)."""
    clock_skew: float | None = None
    config_reload_success: bool = True
    config_reload_timestamp: float = field(default_factory=time.time)
    _missed_scopes: dict[str, str] = field(default_factory=dict)
    """Budgets whose scope matched nothing when last judged, with that scope (`budgets.judge_scopes`)."""
    _sources: frozenset[str] | None = None
    """The sources the config has (`configure`); None: any (until a config says)."""
    _history_months: int | None = None
    """The past months the config keeps (`keep_history`); None: any (until a config says)."""
    _added: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    """When each source without a refresh yet came: a reload added it (the history turned on, a
    probe), or forgot its figures (`forget_figures`). Its age counts from then (`waiting_since`),
    not from the process's start: it cannot be older than the config that asked for it."""
    whose: tuple[str, str] | None = None
    """The billing account whose figures these are (`Account.account_id`: its access key id and
    project), and the API and project its history is fetched from (`Account.activate`): a reload
    back to one account after a config of several builds it afresh on the process's snapshots,
    which hold those of the one account before."""

    @property
    def health(self) -> Mapping[str, SourceHealth]:
        return self._health

    def configure(self, sources: Iterable[str], now: float) -> None:
        """The sources the config has from now on: what others left behind is dropped (a probe
        taken out of the config, the history turned off), and what a refresh of theirs still in
        flight publishes is not taken (it would come back, and its age grow for ever). `now`: the
        billing clock's time, from which a source added waits (`waiting_since`)."""
        with self._lock:
            kept = frozenset(sources)
            before, self._sources = self._sources, kept
            self._health = MappingProxyType({k: v for k, v in self._health.items() if k in kept})
            added = {k: t for k, t in self._added.items() if k in kept}
            if before is not None:  # (at the first config, from the start: `started`)
                added |= {k: now for k in kept - before if k not in self._health}
            self._added = MappingProxyType(added)
            self.probes = MappingProxyType({k: v for k, v in self.probes.items() if probe_source(k) in kept})
            if "history" not in kept:
                self.history = None  # (nothing stale is judged on)

    def forget_figures(self, now: float) -> None:
        """The account's billing figures come from another project, or another account, from now
        on (a reload):
        what was shown so far is none of its own, so it is neither shown, nor judged on, nor
        counted fresh (readiness waits for its bills and usage again) until its sources refresh."""
        with self._lock:
            self.bills = self.usage = self.history = self.reconciliation = None
            self.settled = MappingProxyType({})
            self._awaited(BILLING_SOURCES, now)

    def forget_history(self, now: float) -> None:
        """The history's months come from another API from now on (a reload, or a start, with
        another `billing.url` of the same project): none is learnt from, nor counted fresh, until
        they are fetched from it, waited for from `now`. (The bills and usage stay shown as the
        last good ones: the same account's, through another address it may be, a proxy's.)"""
        with self._lock:
            self.history = None
            self._awaited(("history",), now)

    def waiting_since(self, source: str) -> float:
        """Since when `source`, never refreshed successfully, has been waited for: the process's
        start, or when a reload added it or forgot its figures (`_added`)."""
        return max(self.started, self._added.get(source, self.started))

    def forget_probes(self, now: float, names: Iterable[str] | None = None) -> None:
        """The runs held of the probes `names` (all, with None) are of runners no longer running
        (the account built afresh, or a reload changed what they measure: another endpoint, another
        address): none is shown, nor counted fresh, until its probe runs again, and each is waited
        for from `now` (`waiting_since`)."""
        with self._lock:
            gone = set(self.probes) if names is None else set(names)
            sources = {probe_source(name) for name in gone} | (
                {k for k in self._health if k.startswith(PROBE_PREFIX)} if names is None else set()
            )
            self.probes = MappingProxyType({k: v for k, v in self.probes.items() if k not in gone})
            self._awaited(sources, now)

    def _awaited(self, sources: Iterable[str], now: float) -> None:
        """`sources` have no health from now on, and are waited for from `now` (`waiting_since`);
        under the lock."""
        sources = set(sources)
        self._health = MappingProxyType({k: v for k, v in self._health.items() if k not in sources})
        self._added = MappingProxyType(dict(self._added) | dict.fromkeys(sources, now))

    def _has(self, source: str) -> bool:
        return self._sources is None or source in self._sources

    def record(
        self, source: str, *, success: bool, at: float, duration: float, error: str = "",
        replaced: Callable[[], bool] = lambda: False,
    ) -> None:  # fmt: skip
        """A refresh of `source` ended at `at` (the billing clock's time) after `duration` seconds
        (not taken for a source the config no longer has, nor when `replaced()`: it read another
        project's, which a reload has since put aside)."""
        with self._lock:
            if not self._has(source) or replaced():
                return
            previous = self._health.get(source)
            last_success = at if success else (previous.last_success if previous else None)
            entry = SourceHealth(source, success, last_success, duration, "" if success else error)
            self._health = MappingProxyType({**self._health, source: entry})

    def publish_probe(self, snapshot: ProbeSnapshot, replaced: Callable[[], bool] = lambda: False) -> bool:
        """Show a probe's run unless `replaced()`, checked under the lock (False then: a reload
        changed or took out the probe that ran)."""
        with self._lock:
            if replaced():
                return False
            if self._has(probe_source(snapshot.probe)):
                self.probes = MappingProxyType({**self.probes, snapshot.probe: snapshot})
            return True

    def publish(self, replaced: Callable[[], bool], **figures: object) -> bool:
        """Set these figures (`bills`, `usage`, `history`, `settled`, `reconciliation`) unless
        `replaced()`, checked under the lock `forget_figures` takes (False then: a refresh that a
        reload to another project overtook publishes nothing after it). The history is not taken
        once the config has none (what a refresh in flight publishes would come back), and only
        with the months it keeps (`keep_history`)."""
        with self._lock:
            if replaced():
                return False
            for name, value in figures.items():
                if name == "history" and isinstance(value, HistorySnapshot) and self._history_months is not None:
                    value = value.keeping(self._history_months)
                if name != "history" or self._has("history"):
                    setattr(self, name, value)
            return True

    def keep_history(self, months: int) -> None:
        """The config keeps `months` past months from now on: those it no longer keeps (a reload may
        have made them fewer) go now, and a refresh still in flight publishes none of them."""
        with self._lock:
            self._history_months = months
            if self.history is not None:
                self.history = self.history.keeping(months)

    def observe_clock_skew(self, skew: float) -> None:
        self.clock_skew = skew

    def reloaded(self, *, success: bool) -> None:
        self.config_reload_success = success
        if success:
            self.config_reload_timestamp = time.time()

    def note_scope(self, budget: str, scope: str, matched: bool) -> bool:
        """Note whether `budget`'s `scope` matched anything; True when its matching nothing is news:
        not noted yet for this scope since the budget last matched. Kept here, for the daemon's
        lifetime, since a reload builds the budgets' collector anew."""
        with self._lock:
            if matched:
                self._missed_scopes.pop(budget, None)
                return False
            news = self._missed_scopes.get(budget) != scope
            self._missed_scopes[budget] = scope
            return news

    def count_api_call(self, api: str, code: str) -> None:
        with self._lock:
            self._api_calls[(api, code)] = self._api_calls.get((api, code), 0) + 1
            self.api_calls_counted += 1

    def api_calls(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._api_calls)
