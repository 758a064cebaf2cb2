"""Reconciliation: the tokens (and amounts) the bill charges against those the usage records count.

For each settled day (`reconciliation.settle` after it ended) of the months the bills source
holds, its usage is read once in full and kept as per-day sums per (endpoint, model[, api key])
in the state file, never raw records (`SettledUsage`, a few days per usage refresh, after today's
sync). Then, per day:

- tokens: each billing item's `usageValue` against the count it bills (`reconciliation.items`:
  prompt, prompt_uncached, cached_prompt or completion), summed over the day's records;
  gap = (billed − counted) ÷ counted;
- amounts: each endpoint's payable amount against its tokens × `prices`, where prices cover every
  model the endpoint served that day; gap = (billed − estimated) ÷ estimated.

A day whose usage could not be read has no figures (it is read again later), never a gap of −100%.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterable, Mapping
from decimal import Decimal
from types import MappingProxyType

from exporter.billing import BillingAPI, BillingError, ClientClosed
from exporter.config.schema import DEFAULT_RECONCILED_ITEMS, PriceConfig
from exporter.core.clock import Clock
from exporter.core.logs import get_logger
from exporter.model.snapshots import AmountGap, BillsSnapshot, Reconciliation, TokenGap, UsageRow
from exporter.sources.usage import UsageSync, estimate
from exporter.state import StateStore

log = get_logger(__name__)

RETRY_AFTER = 900.0
"""Seconds before a settled day whose read failed is tried again."""

DEFAULT_ITEMS = DEFAULT_RECONCILED_ITEMS
AGREES = Decimal("0.001")
"""A gap this small or smaller is agreement (rounding on the bill)."""


def settled_at(clock: Clock, day: dt.date, settle: dt.timedelta) -> dt.datetime:
    """When `day` has settled: `settle` after its end (an instant, in UTC)."""
    return clock.day_start(day + dt.timedelta(days=1)).astimezone(dt.UTC) + settle


def disagrees(ratio: Decimal | None) -> bool:
    """A gap ratio beyond rounding, or a bill for what nothing counted (None)."""
    return ratio is None or abs(ratio) > AGREES


def count(rows: Iterable[UsageRow], which: str) -> int:
    """A day's tokens of one kind, over its per-key sums."""
    total = 0
    for _, _, _, _, prompt, completion, cached in rows:
        total += {
            "prompt": prompt,
            "prompt_uncached": prompt - cached,
            "cached_prompt": cached,
            "completion": completion,
        }[which]
    return total


def ratio(billed: Decimal, counted: Decimal) -> Decimal | None:
    """(billed − counted) ÷ counted; None when nothing was counted (then 0 billed is no gap, and
    anything billed is a gap no ratio can say)."""
    if counted == 0:
        return Decimal(0) if billed == 0 else None
    return (billed - counted) / counted


def reconcile(
    bills: BillsSnapshot,
    settled: Mapping[dt.date, list[UsageRow]],
    items: Mapping[str, str],
    prices: Iterable[PriceConfig],
) -> Reconciliation:
    """Every settled day of the months the bills hold, billed against counted. A line the bill
    leaves out bills nothing: a day's mapped item, or an endpoint with usage, missing from it is
    a gap of −100%, not a day without figures. A charge of no endpoint (an empty `instanceId`)
    has no amount gap, unless usage records of no endpoint were counted that day."""
    priced = {p.model: p for p in prices}
    periods = {month.period for month in bills.months}
    days = sorted(day for day in settled if f"{day:%Y-%m}" in periods)
    billed_tokens: dict[tuple[dt.date, str], Decimal] = {(day, item): Decimal(0) for day in days for item in items}
    billed_amounts: dict[tuple[dt.date, str], Decimal] = {
        (day, row[0]): Decimal(0) for day in days for row in settled[day]
    }
    for month in bills.months:
        for a in month.by_item:
            if (a.day, a.key) in billed_tokens:
                billed_tokens[a.day, a.key] += a.usage
        for a in month.by_endpoint:
            if not a.key and (a.day, a.key) not in billed_amounts:
                continue  # a charge of no endpoint (a fee of the account's): no usage to set against it
            if a.day in settled and f"{a.day:%Y-%m}" in periods:
                billed_amounts[a.day, a.key] = billed_amounts.get((a.day, a.key), Decimal(0)) + a.payable
    tokens = tuple(
        TokenGap(day, item, billed, counted, ratio(billed, Decimal(counted)))
        for (day, item), billed in sorted(billed_tokens.items())
        for counted in [count(settled[day], items[item])]
    )
    by_endpoint: dict[tuple[dt.date, str], list[UsageRow]] = {}
    for day in days:  # each day's rows once (not once per endpoint: quadratic in endpoints)
        for row in settled[day]:
            by_endpoint.setdefault((day, row[0]), []).append(row)
    amounts = []
    for (day, endpoint), billed in sorted(billed_amounts.items()):
        rows = by_endpoint.get((day, endpoint), [])
        if any(row[1] not in priced for row in rows):
            continue  # a model without a price: nothing to estimate with
        estimated = sum(
            (estimate(priced[model], prompt, completion, cached) or Decimal(0)
             for _, model, _, _, prompt, completion, cached in rows),
            Decimal(0),
        )  # fmt: skip
        amounts.append(AmountGap(day, endpoint, billed, estimated, ratio(billed, estimated)))
    return Reconciliation(tokens, tuple(amounts))


class SettledUsage:
    """Past days' usage, each read once in full after it settles, kept as per-day sums."""

    def __init__(
        self,
        client: BillingAPI,
        clock: Clock,
        state: StateStore,
        *,
        settle: float,
        days_per_refresh: int,
        per_api_key: bool,
    ) -> None:
        self.clock = clock
        self.state = state
        self.settle = dt.timedelta(seconds=settle)
        self.days_per_refresh = days_per_refresh
        self.reader = UsageSync(client, clock, state, per_api_key=per_api_key)
        self.account = f"{client.base_url};per_api_key={per_api_key};project_id={client.project_id}"
        """What the days held were read from, and how counted: days read from another account or
        project, or counted otherwise, are read again. Not the page size they were read in: a whole
        day's sums are the same in any (the client's may be a cap the service showed since)."""
        self._retry_at: dict[dt.date, float] = {}
        """Days whose read failed, and when (monotonic) to try again: the others go first meanwhile."""
        self._held: Mapping[dt.date, list[UsageRow]] | None = None
        """The days held from `_first` on: read from the state file once, then kept here."""
        self._first = dt.date.max

    def carry_over(self, before: SettledUsage) -> None:
        """Take on the days whose read failed from `before`, the one a reload replaces, when it read
        the same account: they wait their turn as they would have."""
        if before.account == self.account:
            self._retry_at = before._retry_at

    def settled_days(self, first: dt.date) -> list[dt.date]:
        """The days from `first` that have settled by now, oldest first."""
        now = self.clock.now()
        days = []
        day = first
        while settled_at(self.clock, day, self.settle) <= now:
            days.append(day)
            day += dt.timedelta(days=1)
        return days

    def refresh(self, first: dt.date) -> Mapping[dt.date, list[UsageRow]]:
        """Read up to `days_per_refresh` settled days from `first` on that are not held yet (the
        most recent first: the one an alert would judge), and return every held one from `first`:
        the same mapping as last time when nothing changed, else a new one. A day whose read fails
        stays unread (and is tried again next time); the others go on."""
        if self._held is None or first < self._first:
            self._held = MappingProxyType(self.state.load_settled_usage(first, self.account))
        elif first > self._first:
            self._held = MappingProxyType({day: rows for day, rows in self._held.items() if day >= first})
        self._first = first
        held = dict(self._held)
        now = time.monotonic()
        due = [day for day in self.settled_days(first) if day not in held and self._retry_at.get(day, 0.0) <= now][
            ::-1
        ][: self.days_per_refresh]
        for day in due:
            try:
                aggregate = self.reader.read_day(day)
            except ClientClosed:
                raise
            except BillingError as error:  # a failed day is read again later; the others go first meanwhile
                self._retry_at[day] = time.monotonic() + RETRY_AFTER
                log.warning("settled usage not read; tried again later", day=day, error=str(error)[:200])
                continue
            rows = aggregate.table()
            self.state.save_settled_usage(day, rows, self.account, keep_from=first)
            held[day] = rows
            self._held = MappingProxyType(dict(held))  # kept as soon as saved: a later day's failure loses nothing
            log.info("settled usage read", day=day, records=aggregate.records)
        return self._held
