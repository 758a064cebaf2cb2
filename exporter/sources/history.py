"""Past months of daily bills, kept in the state file: the base of the anomaly baseline, the
month-start forecast and backtests.

`billing.history_months` months before the current one are fetched at start-up (those the state
file does not hold from today already) and again once a day, since past months get revised too;
with them, once a day, each endpoint's charges by item (what names the items behind an
endpoint's anomaly), for those months and the current one. Per billing day, whatever the bills
interval: (history_months + 1) × (2 + endpoints) bills requests (more for months longer than a
page), as many at once as the client keeps in flight (`billing.concurrency`) once the account's
bills and usage have their first figures (one at a time before, so that history does not hold up
the first figures at start-up; later checks share the client's requests in flight with them). A
month the API refuses, or answers with no records, is logged and skipped: the copy
fetched before (if any) is kept, and a month never fetched is absent, never read as zero spend (a
zero-spend day from a failed fetch would fake a huge drop, or a baseline of nothing). A month
refused leaves the history `behind`, which fails its refresh (after the months it has are used).
The months are kept with the API and project they came from, and forgotten when either changes.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from functools import partial
from types import MappingProxyType
from typing import TypeVar

import msgspec

from exporter.billing import (
    GROUP_TERM_INSTANCE,
    GROUP_TERM_ITEM,
    AskedToWait,
    BillingAPI,
    BillingError,
    ClientClosed,
)
from exporter.core.clock import Clock, days_in_period, first_day, periods_before
from exporter.core.logs import get_logger
from exporter.model.snapshots import DailyAmount, HistorySnapshot, MonthHistory
from exporter.sources.bills import daily_amounts
from exporter.state import StateError, StateStore

log = get_logger(__name__)

RETRY_AFTER = 3600.0
"""Seconds before a month the API refused is asked for again."""
R = TypeVar("R")


def _rows(amounts: Iterable[DailyAmount]) -> list[list[str]]:
    """Daily amounts as JSON-ready rows (amounts as their exact decimal text)."""
    return [[a.day.isoformat(), a.key, a.product, a.project_id, str(a.payable), str(a.usage)] for a in amounts]


class _Row(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A row as `_rows` wrote it, read back: decoded into these, untracked by the garbage collector,
    rather than a list each (at 5,000 endpoints a start-up made 3M lists, whose full collections
    made reading the history 18 times as long as at 500 endpoints)."""

    day: dt.date
    key: str
    product: str
    project: str
    payable: Decimal
    usage: Decimal


_ROWS = msgspec.json.Decoder(list[_Row])
_SPLIT = msgspec.json.Decoder(dict[str, list[_Row]])


def _amounts(period: str, rows: Iterable[_Row]) -> tuple[DailyAmount, ...]:
    return tuple(DailyAmount(period, r.day, r.key, r.product, r.project, r.payable, r.usage) for r in rows)


def _all(calls: Sequence[Callable[[], R]], workers: int) -> list[R]:
    """Each call's result, in order, with at most `workers` of them running at once. The first
    failure (in order) raises, the calls not started yet are cancelled, and those running end
    first (each request has its timeout, and closing the client ends them at once)."""
    if workers <= 1 or len(calls) <= 1:
        return [call() for call in calls]
    pool = ThreadPoolExecutor(min(workers, len(calls)), thread_name_prefix="history")
    futures = [pool.submit(call) for call in calls]
    try:
        results = [future.result() for future in futures]
    except BaseException as error:
        # Those running end first, except when a command is stopped (Ctrl-C, SIGTERM: no Exception):
        # its close cuts them, which it could not do while this waited for them.
        pool.shutdown(wait=isinstance(error, Exception), cancel_futures=True)
        raise
    pool.shutdown()
    return results


def _attempts(calls: Sequence[Callable[[], R]], workers: int) -> list[R | BillingError]:
    """Each call's result, or the BillingError it raised, in order, with at most `workers` of them
    running at once; `ClientClosed` (a reload, the shutdown) raises at once."""

    def attempt(call: Callable[[], R]) -> R | BillingError:
        try:
            return call()
        except ClientClosed:
            raise
        except BillingError as error:
            return error

    return _all([partial(attempt, call) for call in calls], workers)


def fetch_month(client: BillingAPI, period: str, today: dt.date, workers: int = 1) -> MonthHistory | None:
    """One month's daily bills: by endpoint, by item, and each endpoint's charges by item; None if
    the API listed nothing for it. Raises BillingError when a request fails. `workers`: requests
    made at once (the client bounds those in flight anyway)."""
    instances, items = _all(
        [partial(client.bills, period, GROUP_TERM_INSTANCE), partial(client.bills, period, GROUP_TERM_ITEM)], workers
    )
    if not instances or not items:
        return None
    by_endpoint = daily_amounts(instances, "instance")
    by_item = daily_amounts(items, "item")
    endpoints = sorted({a.key for a in by_endpoint} - {""})
    charges = _all([partial(client.bills, period, GROUP_TERM_ITEM, instance_id=e) for e in endpoints], workers)
    split = {endpoint: daily_amounts(bills, "item") for endpoint, bills in zip(endpoints, charges, strict=True)}
    if own := [a for a in by_endpoint if a.key == ""]:
        split[""] = _unattributed(by_item, split.values(), own)
    return MonthHistory(period, by_endpoint, by_item, today, MappingProxyType(split))


def _unattributed(
    by_item: Iterable[DailyAmount], endpoints: Iterable[Iterable[DailyAmount]], own: Iterable[DailyAmount]
) -> tuple[DailyAmount, ...]:
    """The charges by item of what the bills tie to no endpoint (no `instanceId`; `own`: its bills
    by endpoint): the API has no listing of them alone (asked for an empty `instance_id`, it lists
    the whole account), so they are the account's charges by item less every endpoint's, day and
    item by day and item (the listings may label a line's product or project otherwise), under the
    product the account's lines of that item give it (when several, that of the day's lines of no
    endpoint) and the project of those lines (each when they name one: none when several)."""
    left: dict[tuple[str, dt.date, str], tuple[Decimal, Decimal]] = {}
    products: dict[tuple[str, dt.date, str], set[str]] = {}
    for a in by_item:
        products.setdefault((a.period, a.day, a.key), set()).add(a.product)
    for sign, amounts in ((1, by_item), *((-1, a) for a in endpoints)):
        for a in amounts:
            payable, usage = left.get((a.period, a.day, a.key), (Decimal(0), Decimal(0)))
            left[a.period, a.day, a.key] = (payable + sign * a.payable, usage + sign * a.usage)
    projects: dict[tuple[str, dt.date], set[str]] = {}
    own_products: dict[tuple[str, dt.date], set[str]] = {}
    for a in own:
        projects.setdefault((a.period, a.day), set()).add(a.project_id)
        own_products.setdefault((a.period, a.day), set()).add(a.product)

    def product(period: str, day: dt.date, item: str) -> str:
        return sole(products[period, day, item]) or sole(own_products.get((period, day), set()))

    return tuple(
        DailyAmount(period, day, item, product(period, day, item), sole(projects.get((period, day), set())), *v)
        for (period, day, item), v in sorted(left.items())
        if any(v) and (period, day, item) in products
    )


def sole(values: set[str]) -> str:
    """The one value of `values`; empty when there are none or several (a label no line agrees on)."""
    return next(iter(values)) if len(values) == 1 else ""


def _whole_months(held: Mapping[str, MonthHistory], periods: Iterable[str]) -> dict[str, MonthHistory]:
    """Those of `periods` held and fetched after they ended: a month saved before (the process
    stopped mid-month, and its fetch since failed) would read its days after that as nothing spent."""
    return {
        p: month
        for p in periods
        if (month := held.get(p)) is not None and month.fetched >= first_day(p) + dt.timedelta(days=days_in_period(p))
    }


class HistorySource:
    def __init__(
        self, client: BillingAPI, clock: Clock, state: StateStore, months: int, *, wide: Callable[[], bool] = bool
    ) -> None:
        """`wide()`: whether a month may now be fetched with as many requests at once as the client
        keeps in flight; until then (at start-up, till bills and usage have their first figures),
        one at a time, so that history never holds up those."""
        self.client = client
        self.clock = clock
        self.state = state
        self.months = months
        self.wide = wide
        self._empty: dict[str, dt.date] = {}
        """Months the API listed nothing for, and the day it said so (not asked again that day)."""
        self._retry_at: dict[str, float] = {}
        """Months the API refused, and when (monotonic) to try again."""
        self._held: dict[str, MonthHistory] | None = None
        """The months held: read from the state file once, then kept here (also those it refused to keep)."""
        self._reading = threading.Lock()
        """Held while the state file's months are read (once: by a refresh, or `held`)."""
        self._unreadable = False
        """Whether `held` found the state file's months unreadable (it does not read them again)."""
        self.behind: list[str] = []
        """After a refresh, the months due today whose last fetch failed (held back an hour, or older
        than today's): the history is incomplete, however the other months went."""

    @property
    def source(self) -> str:
        """What the months are fetched from: the API and the project (the months held are of one)."""
        return f"{self.client.base_url};{self.client.project_id}"

    def _stored(self) -> dict[str, MonthHistory]:
        """The months the state file holds, fetched from this client's API and project: those of
        another (a reload or a restart that changed `billing.url` or `billing.project_id`) are
        forgotten, to be fetched again, never learnt from."""
        source = self.source
        stored = self.state.history_source()
        if stored != source:  # (none said: an earlier version's months, taken as this config's)
            try:
                self.state.forget_history(source, keep=stored is None)
            except StateError as error:  # (not held from it all the same: fetched again, kept here)
                log.warning("history of another source not forgotten in the state file", error=str(error)[:200])
            if stored is not None:
                return {}
        held = {}
        for period, by_endpoint, by_item, items_by_endpoint, fetched in self.state.load_history():
            split = {endpoint: _amounts(period, rows) for endpoint, rows in _SPLIT.decode(items_by_endpoint).items()}
            held[period] = MonthHistory(
                period,
                _amounts(period, _ROWS.decode(by_endpoint)),
                _amounts(period, _ROWS.decode(by_item)),
                dt.date.fromisoformat(fetched),
                MappingProxyType(split),
            )
        return held

    def _loaded(self) -> dict[str, MonthHistory]:
        """The months the state file holds, read from it once (StateError or ValueError when it
        cannot be read), then kept here."""
        with self._reading:
            if self._held is None:
                self._held = self._stored()
            return self._held

    def held(self) -> HistorySnapshot | None:
        """The past months as the state file holds them, for what reads the history before its
        first refresh in this process (the bills' forecast at start-up); None when it holds none
        (or cannot be read: the history's refresh says why). A month saved before it ended is not
        held (`_whole_months`)."""
        if self._held is None and self._unreadable:
            return None
        try:
            held = self._loaded()
        except (StateError, ValueError) as error:  # (a bills refresh does not fail for it)
            self._unreadable = True  # (said once; the history's refresh tries again, and says why)
            log.warning("history held in the state file not read", error=str(error)[:200])
            return None
        periods = periods_before(self.clock.period(), self.months)
        months = _whole_months(held, periods)
        return HistorySnapshot(MappingProxyType(months)) if months else None

    def refresh(self) -> HistorySnapshot:
        """Fetch the months not fetched today yet, and the current month once a day. A month
        refused on its own is skipped (and tried again an hour later), one listing nothing is not
        asked for again that day; one not asked because the API asked to wait (`AskedToWait`, a
        Retry-After met while fetching) is asked again at the next check. When every month tried
        fails, the refresh fails (with what the state file holds kept)."""
        today = self.clock.today()
        current = self.clock.period(today)
        periods = periods_before(current, self.months)
        held = self._loaded()
        due = [
            period
            for period in [*periods, current]
            if (period not in held or held[period].fetched != today)
            and self._empty.get(period) != today
            and self._retry_at.get(period, 0.0) <= time.monotonic()
        ]
        workers = self.client.concurrency if self.wide() else 1
        outcomes = _attempts([partial(fetch_month, self.client, period, today, workers) for period in due], workers)
        failures = [outcome for outcome in outcomes if isinstance(outcome, BillingError)]
        # Several months failing together is an outage, and a month the API asked to wait for was
        # not its own failure (a Retry-After met mid-fetch fails the months after it, unasked): each
        # is asked for again at the next check. A month failing on its own (refused, not answered as
        # documented, or failing every retry) is held back an hour, the only one due too.
        outage = len(due) > 1 and len(failures) == len(due)
        for period, month in zip(due, outcomes, strict=True):
            kept = "the copy fetched before" if period in held else "nothing"
            if isinstance(month, BillingError):
                if not outage and not isinstance(month, AskedToWait):
                    self._retry_at[period] = time.monotonic() + RETRY_AFTER
                log.warning("history month skipped", period=period, error=str(month)[:200], kept=kept)
                continue
            if month is None:
                self._empty[period] = today
                if period != current:
                    log.warning("history month skipped: the API listed no bills for it", period=period, kept=kept)
                continue
            self._save(month, today, keep_from=(periods or [current])[0])
            held[period] = month
        if due and len(failures) == len(due):
            raise failures[0]
        failed = {period for period, month in zip(due, outcomes, strict=True) if isinstance(month, BillingError)}
        self.behind = [
            period
            for period in [*periods, current]
            if (period in failed or self._retry_at.get(period, 0.0) > time.monotonic())
            and (period not in held or held[period].fetched != today)
        ]
        return HistorySnapshot(
            MappingProxyType(_whole_months(held, periods)),
            held.get(current),
            as_of=today,
        )

    def _save(self, month: MonthHistory, today: dt.date, keep_from: str) -> None:
        """Into the state file; if it refuses the write, the month is kept here (and used) anyway."""
        split = json.dumps({e: _rows(rows) for e, rows in month.items_by_endpoint.items()})
        try:
            if not self.state.save_history(
                month.period, json.dumps(_rows(month.by_endpoint)), json.dumps(_rows(month.by_item)), split,
                today.isoformat(), keep_from=keep_from, source=self.source,
            ):  # fmt: skip
                log.info("history month of an address no longer configured not saved", period=month.period)
        except StateError as error:
            log.warning("history month not saved; kept in memory", period=month.period, error=str(error)[:200])
