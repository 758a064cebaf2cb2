"""The simulator's records and bills: usage records made from a seed, bills from them (at its
prices) or from the seed, and its own totals for tests to compare with."""

from __future__ import annotations

import datetime as dt
import json
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from decimal import Decimal
from typing import Any

from exporter.core.clock import Clock, days_in_period
from exporter.sim.history import SpendModel
from exporter.sim.model import (
    API_KEYS,
    CACHED_PROMPT_ITEM,
    COMPLETION_ITEM,
    ITEMS,
    MILLION,
    PRODUCT,
    PROMPT_ITEM,
    TENANT,
    Endpoint,
    SimPrice,
    UsageDay,
    _DayTokens,
    _mix,
    _record_tokens,
    _unit,
)

_MINUTES = tuple(f"{h:02d}:{m:02d}:" for h in range(24) for m in range(60))
_SECONDS = tuple(f"{s:02d}Z" for s in range(60))
"""A record's time of day is looked up in these ("HH:MM:" by minute, "SSZ"), not formatted."""


class Ledger:
    """What the simulator bills and lists (a part of `Simulator`)."""

    # The simulator's state (set up by `Simulator`).
    clock: Clock
    seed: int
    endpoints: tuple[Endpoint, ...]
    prices: Mapping[str, SimPrice] | None
    access_key_id: str
    secret_access_key: str
    label: str
    _lock: threading.Lock
    _usage: dict[dt.date, UsageDay]
    _day_prefixes: dict[dt.date, tuple[str, str, str, int, int]]
    """A day's request id prefix, its first and next UTC dates, and the UTC second its start is."""
    _fragments: dict[Endpoint, str]
    _nonces: dict[str, float]
    _nonce_expiry: deque[tuple[float, str]]
    _tokens_lock: threading.Lock
    _day_tokens: dict[dt.date, _DayTokens]
    _bills_version: int
    _bill_overrides: dict[tuple[str, dt.date, str, str], Decimal]
    _distortions: list[tuple[dt.date, Decimal, str, str]]
    _bill_cache: dict[tuple[Any, ...], list[dict[str, str]]]
    records_billed: int
    before_usage_page: Callable[[int], None] | None
    before_bills_page: Callable[[int], None] | None
    usage_page_cap: int | None
    spend: SpendModel | None
    total_as_number: bool

    # -- data -----------------------------------------------------------------------------

    def _billed_days(self, period: str) -> list[dt.date]:
        year, month = (int(p) for p in period.split("-"))
        today = self.clock.today()
        days = [dt.date(year, month, d) for d in range(1, days_in_period(period) + 1)]
        opened = self.spend.start if self.spend is not None else dt.date.min  # no bills before the account opened
        return [d for d in days if opened <= d <= today]

    def charge(self, period: str, day: dt.date, endpoint: Endpoint, item: str) -> tuple[Decimal, Decimal]:
        """The payable amount and usage of one endpoint, item and day: a revised amount if there is
        one; with `prices` and records that day, the records' tokens of that item × its price;
        else the spend model's amount (`spend`: weekly rhythm, noise, growth, spikes) when one is
        set, or deterministic random amounts (so that past days have bills too)."""
        override = self._bill_overrides.get((period, day, endpoint.endpoint_id, item))
        prices = self.prices
        counted = self._count_tokens(day) if prices is not None else None
        if prices is not None and counted is not None:
            tokens = Decimal(counted.get((endpoint.endpoint_id, item), 0))
            for when, factor, endpoint_id, which in self._distortions:
                if when == day and endpoint_id in ("", endpoint.endpoint_id) and which in ("", item):
                    tokens *= factor
            amount = tokens * prices[endpoint.model].per_item()[item] / MILLION
            return (amount if override is None else override), tokens
        tokens_drawn = Decimal(_unit(self.seed, "tokens", day, endpoint.endpoint_id, item) % 5_000_000)
        if override is not None:
            return override, tokens_drawn
        if self.spend is not None:
            return self.spend.amount(day, endpoint.endpoint_id, item), tokens_drawn
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

    def bill_rows(
        self, period: str, group_term: str, project_id: str = "", instance_id: str = ""
    ) -> list[dict[str, str]]:
        """A month's rows for one grouping, of one endpoint's charges with `instance_id`; cached,
        since every page of a request needs them."""
        key = (period, group_term, project_id, instance_id, self.clock.today(), self.endpoints, self._bills_version)
        with self._lock:
            rows = self._bill_cache.get(key)
        if rows is None:
            rows = self._bill_rows(period, group_term, project_id, instance_id)
            with self._lock:
                self._bill_cache = {key: rows} | dict(list(self._bill_cache.items())[:7])
        return rows

    def _bill_rows(self, period: str, group_term: str, project_id: str, instance_id: str) -> list[dict[str, str]]:
        rows = []
        for day in self._billed_days(period):
            start = self.clock.day_start(day).astimezone(dt.UTC)
            common = {
                "tenantId": TENANT,
                "period": period,
                "product": PRODUCT,
                "startTime": start.strftime("%Y-%m-%dT%H:%M:%SZ"),
                "endTime": (start + dt.timedelta(seconds=self._day_seconds(day))).strftime("%Y-%m-%dT%H:%M:%SZ"),
            }
            endpoints = [
                e
                for e in self.endpoints
                if (not project_id or e.project_id == project_id) and (not instance_id or e.endpoint_id == instance_id)
            ]
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
            start = self.clock.day_start(day).astimezone(dt.UTC)
            first = start.date()
            following = first + dt.timedelta(days=1) if first < dt.date.max else first
            dates = (f"{first.isoformat()}T", f"{following.isoformat()}T")
            day_prefix = self._day_prefixes[day] = (
                f"req-{day:%Y%m%d}-",
                *dates,
                start.hour * 3600 + start.minute * 60 + start.second,
                self._day_seconds(day),
            )
        ids, first_date, next_date, start_second, length = day_prefix
        prompt, completion, cached = _record_tokens(h)
        # Within the natural day (23 or 25 hours when the clocks change), after the UTC midnight it starts on.
        second = start_second + (index * 37) % length
        date = next_date if second >= 86400 else first_date
        return (
            f'{{"requestId": "{ids}{index:09d}", '
            f'"requestTime": "{date}{_MINUTES[second % 86400 // 60]}{_SECONDS[second % 60]}", '
            f'"tenantId": "{TENANT}", {fragment}, "apikey": "{API_KEYS[(h >> 20) % len(API_KEYS)]}", '
            f'"promptTokens": {prompt}, "completionTokens": {completion}, '
            f'"promptCachedTokens": {cached}}}'
        )

    def _day_seconds(self, day: dt.date) -> int:
        """How long the natural day `day` is, in seconds."""
        if day >= dt.date.max:
            return 86400
        return int(self.clock.day_start(day + dt.timedelta(days=1)).timestamp() - self.clock.day_start(day).timestamp())

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
        self, day: dt.date | None = None, *, distinct: bool = False, oldest: int | None = None
    ) -> dict[tuple[str, str], dict[str, int]]:
        """The simulator's own sums for a day, per (endpoint, model): of every record it lists, or
        with `distinct`, of every request (one it lists twice counted once); with `oldest`, of the
        day's first `oldest` records as they were made, wherever they are listed."""
        totals: dict[tuple[str, str], dict[str, int]] = {}
        seen: set[str] = set()
        day = day or self.clock.today()
        records = self.usage_records(day) if oldest is None else (self.usage_record(day, i) for i in range(oldest))
        for r in records:
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
