"""One billing day's per-request usage → per (endpoint, model) totals.

Records stream into running sums page by page, so memory does not grow with the day's volume.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from decimal import Decimal
from types import MappingProxyType

from exporter.billing import BillingClient, RecordError, UsageRecord
from exporter.clock import Clock
from exporter.config import PriceConfig
from exporter.snapshots import UsageKey, UsageSnapshot, UsageTotals

MILLION = Decimal(1_000_000)


class Aggregate:
    """Running sums per key: [requests, prompt, completion, cached]."""

    def __init__(self, per_api_key: bool) -> None:
        self.per_api_key = per_api_key
        self.sums: dict[UsageKey, list[int]] = {}
        self.records = 0

    def add(self, records: Iterable[UsageRecord]) -> None:
        for r in records:
            key = UsageKey(r.endpoint, r.model, r.apikey if self.per_api_key else "")
            sums = self.sums.get(key)
            if sums is None:
                sums = self.sums[key] = [0, 0, 0, 0]
            sums[0] += 1
            sums[1] += r.prompt_tokens
            sums[2] += r.completion_tokens
            sums[3] += r.cached_prompt_tokens
            self.records += 1


def estimate(price: PriceConfig | None, prompt: int, completion: int, cached: int) -> Decimal | None:
    """Tokens × configured prices; cached prompt tokens are part of the prompt tokens."""
    if price is None:
        return None
    cached_price = (
        price.prompt_per_million if price.cached_prompt_per_million is None else price.cached_prompt_per_million
    )
    return (
        (prompt - cached) * price.prompt_per_million + cached * cached_price + completion * price.completion_per_million
    ) / MILLION


def snapshot(day: dt.date, aggregate: Aggregate, prices: Mapping[str, PriceConfig]) -> UsageSnapshot:
    totals = {
        key: UsageTotals(
            requests=r,
            prompt_tokens=p,
            completion_tokens=c,
            cached_prompt_tokens=k,
            estimated_payable=estimate(prices.get(key.model), p, c, k),
        )
        for key, (r, p, c, k) in aggregate.sums.items()
    }
    return UsageSnapshot(day=day, totals=MappingProxyType(totals), records=aggregate.records)


def pull_day(client: BillingClient, day: dt.date, per_api_key: bool) -> Aggregate:
    """Every record of `day`, aggregated; the count must match the server's `total`."""
    aggregate = Aggregate(per_api_key)
    total = 0
    for page in client.usage_pages(day):
        aggregate.add(page.records)
        total = page.total
    if aggregate.records != total:
        raise RecordError(f"usage {day}: pages held {aggregate.records} records, `total` says {total}")
    return aggregate


class UsageSource:
    def __init__(
        self, client: BillingClient, clock: Clock, *, per_api_key: bool, prices: Iterable[PriceConfig] = ()
    ) -> None:
        self.client = client
        self.clock = clock
        self.per_api_key = per_api_key
        self.prices = {p.model: p for p in prices}

    def refresh(self) -> UsageSnapshot:
        day = self.clock.today()
        return snapshot(day, pull_day(self.client, day, self.per_api_key), self.prices)
