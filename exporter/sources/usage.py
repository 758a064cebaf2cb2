"""One billing day's per-request usage → per (endpoint, model) totals, synced incrementally.

`UsageSync` keeps the days: it resumes them from the state store, finalises the old one at the
rollover, saves every poll's cursor and totals, counts today's estimates and makes the snapshots.
Reading a day's list (its order, paging, checks) is `usage_read`'s job, the running sums it reads
into are `usage_aggregate`'s, and prices are `usage_cost`'s; `estimate` and `SeenIds` are
imported from here by their callers too.

At the billing day's rollover the old day gets one last full pull (late records) and is kept
as the finalised previous day; today's counters start from zero. Cursor and totals live in the
state store, so a restart resumes without downloading the day again.

Today's estimated amount is a counter: each poll prices the tokens it counted with the prices of
that moment and adds them, so new prices (a reload, or a restart on an edited config) price
only what is counted from then on, and the counter never goes down with a price cut. What it
counted is kept in the state store beside the day's totals (`usage_amounts`), so a restart
resumes it where it stood. The finalised previous day is a gauge, priced whole with the prices
of the moment.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable, Iterable, Mapping, Sequence
from decimal import Decimal
from types import MappingProxyType
from typing import Any

from exporter.billing import AskedToWait, BillingAPI, BillingError, ClientClosed
from exporter.config.schema import PriceConfig
from exporter.core.clock import Clock
from exporter.core.logs import get_logger
from exporter.model.snapshots import UsageKey, UsageSnapshot, UsageTotals
from exporter.sources.usage_aggregate import Aggregate, SeenIds
from exporter.sources.usage_cost import NOTHING_COUNTED, Counted, cost, count, estimate
from exporter.sources.usage_read import ResyncNeeded, UsageReader, counted_part
from exporter.state import StateStore, UsageCursor

__all__ = ["SeenIds", "UsageSync", "estimate"]

log = get_logger(__name__)


NOTHING = (0, 0, 0, 0)
"""A key's sums (requests, prompt, completion, cached tokens) where nothing was counted."""


def _by_model(sums: Iterable[tuple[UsageKey, Sequence[int]]]) -> dict[tuple[str, str], list[int]]:
    """A day's sums by (endpoint, model), whatever the API keys."""
    found: dict[tuple[str, str], list[int]] = {}
    for key, values in sums:
        held = found.setdefault((key.endpoint_id, key.model), [0, 0, 0, 0])
        for at, value in enumerate(values):
            held[at] += value
    return found


def _settings(written: str) -> dict[str, str]:
    """A cursor's `settings` (`UsageReader.settings`: `name=value;…`) by name; `project_id`, the last
    of how the sums were counted, whole (it may hold a `;`)."""
    head, _, project = counted_part(written).partition(";project_id=")
    return dict(part.partition("=")[::2] for part in head.split(";") if part) | {"project_id": project}


def _went_down(before: Mapping[Any, Sequence[int]], now: Mapping[Any, Sequence[int]], *, kept: bool = False) -> bool:
    """Whether a sum of `before` is lower in `now` (a key not in `now` holds nothing; with `kept`,
    only the keys still in `now` are looked at)."""
    return any(
        new < old
        for key, sums in before.items()
        if not kept or key in now
        for new, old in zip(now.get(key, NOTHING), sums, strict=True)
    )


FINALISE_ATTEMPTS = 10
"""Refreshes that may fail on yesterday's last pull before today's counting goes ahead without it
(those that asked the API: not one held by its Retry-After, nor one a reload or a stop ended)."""


class UsageSync(UsageReader):
    """A day's usage read (see `UsageReader`) and kept: resumed, saved, finalised, priced."""

    def __init__(
        self,
        client: BillingAPI,
        clock: Clock,
        state: StateStore,
        *,
        per_api_key: bool,
        prices: Iterable[PriceConfig] = (),
        skew: Callable[[], float | None] = lambda: None,
    ) -> None:
        super().__init__(client, per_api_key=per_api_key)
        self.clock = clock
        self.skew = skew
        """The API's clock minus ours, in seconds, as last seen (None: not seen yet)."""
        self.state = state
        self.prices: dict[str, PriceConfig] = {}
        self.set_prices(prices)
        self.resyncs = 0
        self._day: dt.date | None = None
        self._aggregate = Aggregate(per_api_key)
        self._cursor: UsageCursor | None = None
        self._created = 0.0
        self._counted: dict[UsageKey, Counted] = {}
        """What today's estimate counters counted, key by key (see `count`)."""
        self._saved: dict[UsageKey, Counted] = {}
        """`_counted` as the state store holds it."""
        self._published: UsageSnapshot | None = None
        """The last snapshot returned (a poll that finds nothing new returns it again)."""
        self._published_prices: object = None
        """The price table `_published` was priced with: a poll with nothing new still reprices
        after a reload whose new prices arrived while a refresh was running."""
        self._previous: tuple[dt.date, Aggregate, float] | None = None
        """The day before, finalised: its day, sums and start (priced anew in every snapshot)."""
        self._finalise_failures = 0
        self._saved_sums: dict[UsageKey, Sequence[int]] | None = None
        """For a day read afresh, its sums as saved, until a poll is kept (`_removed`)."""
        self._saved_by_model = False
        """They were saved with another `per_api_key`: compared by (endpoint, model) (`_by_model`)."""
        self._saved_elsewhere = False
        """They were saved for another `billing.project_id`: only the keys both have are compared."""

    # -- snapshots --

    def _snapshot(
        self,
        day: dt.date,
        aggregate: Aggregate,
        created: float,
        prices: Mapping[str, PriceConfig],
        counted: Mapping[UsageKey, Counted] | None = None,
    ) -> UsageSnapshot:
        """Today's figures, given what its counters `counted`, with the finalised day before; or,
        without, that day before, every token priced with `prices` (its figures are gauges)."""
        totals = {}
        for key, (r, p, c, k) in aggregate.sums.items():
            price = prices.get(key.model)
            if counted is not None and (price is not None or key in counted):
                # A counter: what it counted (a model whose price a reload took away keeps it, and
                # its tokens from then on are priced by the price it gets next: `count`).
                amount: Decimal | None = counted.get(key, NOTHING_COUNTED).amount
            elif price is None:
                amount = None
            else:
                amount = cost(price, p, c, k)
            totals[key] = UsageTotals(r, p, c, k, amount)
        previous = self._previous if counted is not None else None
        return UsageSnapshot(
            day=day,
            totals=MappingProxyType(totals),
            records=aggregate.records,
            created=created,
            resyncs=self.resyncs,
            previous_day=self._snapshot(*previous, prices) if previous else None,
            per_api_key=self.per_api_key,
        )

    def priced_before(self) -> bool:
        """Whether the figures last given were priced with another table than its prices now (new
        prices came while a refresh ran)."""
        return self._published is not None and self._published_prices is not self.prices

    def set_prices(self, prices: Iterable[PriceConfig]) -> None:
        """Price with `prices` from now on: the next refresh, or `reprice`, takes them."""
        self.prices = {p.model: p for p in prices}

    def reprice(self) -> UsageSnapshot | None:
        """The figures priced anew with the prices set last (None before the first sync). No API
        call.

        Today's estimates are counters: they keep what they counted, and the new prices price the
        tokens counted from now on (and those of a model that had no price). The finalised day
        before is priced anew whole. What this counted is saved by the next poll.
        """
        table = self.prices  # once: a reload may set new ones while this runs (it then runs again)
        if self._day is None or self._cursor is None:
            return None
        self._counted = count(self._counted, self._aggregate, table)
        self._published = self._snapshot(self._day, self._aggregate, self._created, table, self._counted)
        self._published_prices = table
        return self._published

    # -- the state store --

    def _save(
        self,
        cursor: UsageCursor,
        aggregate: Aggregate,
        counted: dict[UsageKey, Counted] | None = None,
        created: float | None = None,
    ) -> None:
        """The day's cursor and totals, and with them (in one transaction) what its counters
        `counted` when that changed, and since when (`created`; unless given, `_created`)."""
        keep_from = self.clock.today() - dt.timedelta(days=1)
        cursor = dataclasses.replace(cursor, created=self._created if created is None else created)
        amounts = None
        if counted is not None and counted != self._saved:
            amounts = [(k.endpoint_id, k.model, k.api_key, str(c.amount), *c.covered) for k, c in counted.items()]
        seen = aggregate.seen
        # A poll on the day as saved (a fork of its ids) appends the ids it found; anything else writes them whole.
        added = self._aggregate is not None and seen.base is self._aggregate.seen and self._day == cursor.day
        self.state.save_usage(
            cursor, aggregate.table(), self.clock.now().timestamp(), keep_from,
            ids=seen.added() if added else seen.chunks(), amounts=amounts, ids_added=added,
        )  # fmt: skip
        seen.settle()
        if counted is not None:
            self._saved = counted

    def _load_counted(self, day: dt.date) -> dict[UsageKey, Counted]:
        return {
            UsageKey(e, m, a): Counted(Decimal(amount), (p, c, k))
            for e, m, a, amount, p, c, k in self.state.load_usage_amounts(day)
        }

    # -- the refresh --

    def _restore(self, today: dt.date) -> None:
        for day in (today - dt.timedelta(days=1), today):
            saved = self.state.load_usage(day)
            if saved is None:
                continue
            if day == today:
                same = saved[0].settings == self.settings
            else:  # only ever read whole again (`_finalise`): its ids are never compared, only its sums kept
                same = counted_part(saved[0].settings) == self.counted_as
            if not same:
                if day < today:
                    # Read under other settings (a page size, per_api_key, a project): what it
                    # counted cannot go on under these. The day before is read whole again under
                    # these (its late records too: `refresh` finalises it), not dropped.
                    self._begin(day)
                continue
            whole, added = self.state.load_usage_ids(day)
            try:
                seen = SeenIds.from_bytes(whole)
                for chunk in added:
                    seen.extend(chunk)
            except ValueError:
                seen = SeenIds()
            aggregate = Aggregate.from_rows(self.per_api_key, saved[1], seen, saved[0].records)
            if day == today and seen.count != aggregate.records:
                # Saved without its request ids (an older version) or with them damaged: without
                # them a repeat could be counted twice, so the day is read afresh.
                log.info("usage sync starts the day afresh: its request ids were not saved", day=day)
                continue
            self._begin(day, saved[0], aggregate)
            if day == today and saved[0].created:  # (the counters reset since the day began: when)
                self._created = saved[0].created
            self.newest_first = saved[0].newest_first
            if day < today and saved[0].finalised:
                self._previous = (day, self._aggregate, self._created)
            if day == today:
                self._counted = self._saved = self._load_counted(day)
        if self._day == today:
            log.info("resuming usage sync", day=today, records=self._aggregate.records)
            saved_size = self._cursor.page_size if self._cursor is not None else 0
            if 0 < saved_size < self.client.page_size:  # the service caps its pages
                self.client.adopt_cap(saved_size)

    def _removed(self, aggregate: Aggregate) -> bool:
        """Whether records were removed upstream: a sum of the day went down since the last poll
        (since the sums saved, for a day read afresh: by endpoint and model when `per_api_key`
        changed how they are kept)."""
        saved, elsewhere = self._saved_sums, self._saved_elsewhere
        if saved is None:
            return _went_down(self._aggregate.sums, aggregate.sums)
        # A series counted before and shown again: what its counter counted tells whether it went
        # down, which the sums saved may not (kept by model, or for another project's endpoints).
        covered = {key: counted.covered for key, counted in self._counted.items()}
        if _went_down(covered, {key: sums[1:] for key, sums in aggregate.sums.items()}, kept=True):
            return True
        if not self._saved_by_model:
            return _went_down(saved, aggregate.sums, kept=elsewhere)
        return _went_down(_by_model(saved.items()), _by_model(aggregate.sums.items()), kept=elsewhere) or (
            # The series of no API key is the same with per_api_key or without (an empty label is none).
            _went_down({key: sums for key, sums in saved.items() if not key.api_key}, aggregate.sums, kept=True)
        )

    def _begin(self, day: dt.date, cursor: UsageCursor | None = None, aggregate: Aggregate | None = None) -> None:
        """Count `day` on from `cursor` into `aggregate` (without them: from its start, nothing counted yet)."""
        self._day, self._cursor = day, cursor
        self._aggregate = aggregate if aggregate is not None else Aggregate(self.per_api_key)
        self._created = self.clock.day_start(day).timestamp()

    def _finalise(self, day: dt.date) -> None:
        """The old day's last full pull, for records that arrived late."""
        aggregate, cursor = self._full(day)
        self._save(dataclasses.replace(cursor, finalised=True), aggregate)
        self._previous = (day, aggregate, self.clock.day_start(day).timestamp())
        log.info("finalised usage day", day=day, records=aggregate.records)

    def _today(self) -> dt.date:
        """The day to read: today, by the API's clock when it is behind ours, since the API refuses
        a day it has not begun as in the future (just after our midnight, the day before is its
        today still: read as such, then finalised at the first poll after its midnight)."""
        now = self.clock.now()
        behind = min(self.skew() or 0.0, 0.0)
        return dt.datetime.fromtimestamp(now.timestamp() + behind, now.tzinfo).date() if behind else now.date()

    def refresh(self) -> UsageSnapshot:
        today = self._today()
        if self._day is not None and today < self._day:
            # Never back to a day before the one begun (begun by our clock before the API's was
            # known to be behind, or a skew seen larger since): that day is read on, refused as in
            # the future until the API's midnight, never counted with the day before's records.
            today = self._day
        if self._day is None:
            self._restore(today)
        if self._day is not None and self._day < today:
            if not (self._cursor and self._cursor.finalised):
                try:
                    self._finalise(self._day)
                except (AskedToWait, ClientClosed):  # (never asked: the API's hold, a reload or a stop)
                    raise
                except BillingError:
                    self._finalise_failures += 1
                    if self._finalise_failures < FINALISE_ATTEMPTS:
                        raise
                    log.error("usage day could not be finalised; moving on to today",
                              day=self._day, tries=self._finalise_failures)  # fmt: skip
            self._day, self._finalise_failures = None, 0
            if self._previous is not None and self._previous[0] != today - dt.timedelta(days=1):
                # Not the day before today: the day before it, whose last pull was given up (the
                # one before that is still held), or a day a process that stood still over a
                # whole day finalised. Yesterday's figures are shown by no gauge rather than those.
                self._previous = None
        if self._day is None:
            self._begin(today)
            # Nothing at a rollover; after a restart that reads the day afresh (its settings
            # changed), what its counters counted, so that they go on from there, since when, and
            # the sums they were saved with (until a poll is kept: see `_removed`).
            self._counted = self._saved = self._load_counted(today)
            saved = self.state.load_usage(today)
            self._saved_sums = None  # (at a rollover: nothing saved of the new day)
            if saved is not None:
                said = _settings(saved[0].settings)
                self._created = saved[0].created or self._created
                self._saved_sums = {UsageKey(e, m, a): (r, p, c, k) for e, m, a, r, p, c, k in saved[1]}
                self._saved_by_model = said.get("per_api_key") != str(self.per_api_key)
                # (another project's: an endpoint is one project's, so a key both have is the same
                # records, and its counter goes on; what only the other has is no removal)
                self._saved_elsewhere = said["project_id"] != self.client.project_id

        try:
            if self._cursor is None or self._cursor.records == 0:
                raise ResyncNeeded("no cursor")
            aggregate, cursor = self._incremental(self._cursor, self._aggregate)
        except ResyncNeeded as reason:
            if self._cursor is not None and self._cursor.records:
                self.resyncs += 1
                log.warning("usage resync", day=today, reason=str(reason))
            aggregate, cursor = self._full(today)
        before = self._counted
        created = self._created
        if self._removed(aggregate):
            # Records were removed upstream: the counters reset here, and `created` says when; the
            # estimates start again from the day's tokens at today's prices.
            created = self.clock.now().timestamp()
            before = {}
        prices = self.prices  # once: a reload may set new ones while this runs
        counted = count(before, aggregate, prices)
        published = self._published
        if (
            published is not None
            and published.day == today
            and published.resyncs == self.resyncs
            and cursor == self._cursor
            and aggregate.rows == self._aggregate.rows
            and aggregate.sums == self._aggregate.sums
            and self._published_prices is prices
            and counted == self._saved
        ):
            return published  # nothing new: nothing rewritten, and the same snapshot renders from cache
        self._save(cursor, aggregate, counted, created)  # first: if the state file refuses it, nothing here has moved
        self._cursor, self._aggregate, self._counted, self._created = cursor, aggregate, counted, created
        self._saved_sums = None
        self._published = self._snapshot(today, aggregate, self._created, prices, counted)
        self._published_prices = prices
        return self._published
