"""Incremental usage sync on the simulator's ledger, with a frozen clock in the billing zone.

The sync's logic runs on the in-process fake (tests/fakes.py: the unit layer); over HTTP only what
the client does on the wire with it (pages read in parallel, a cap the client notices and says),
and that the fake answers as the wire does."""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import math
import sqlite3
from array import array
from collections.abc import Iterator
from contextlib import closing
from dataclasses import replace
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from exporter.billing import (
    GROUP_TERM_INSTANCE,
    GROUP_TERM_ITEM,
    USAGES_PATH,
    AskedToWait,
    BillingAPI,
    BillingAPIError,
    BillingClient,
    BillingError,
    ClientClosed,
    RecordError,
    UsagePage,
)
from exporter.config.schema import PriceConfig
from exporter.core.clock import Clock, FrozenClock
from exporter.model.snapshots import UsageSnapshot, UsageTotals
from exporter.sim import Fault, Simulator
from exporter.sources.usage import FINALISE_ATTEMPTS, UsageSync
from exporter.sources.usage_aggregate import id_digest
from exporter.state import StateError, StateStore
from tests.conftest import PAGE, SHANGHAI
from tests.fakes import FakeBilling

USAGES = "/api/v1/usages/details"


@pytest.fixture(autouse=True, params=["oldest-first", "newest-first"])
def newest_first(request: pytest.FixtureRequest, sim: Simulator) -> bool:
    """Every scenario under each order a service may list a day's records in."""
    sim.newest_first = request.param == "newest-first"
    return sim.newest_first


def make_sync(client: BillingAPI, clock: Clock, store: StateStore) -> UsageSync:
    return UsageSync(client, clock, store, per_api_key=False)


def as_truth(snapshot: UsageSnapshot) -> dict[tuple[str, str], dict[str, int]]:
    return {
        (k.endpoint_id, k.model): {
            "requests": t.requests,
            "prompt": t.prompt_tokens,
            "completion": t.completion_tokens,
            "cached": t.cached_prompt_tokens,
        }
        for k, t in snapshot.totals.items()
    }


def refresh_restarted(sim: Simulator, client: BillingAPI, clock: Clock, path: Path) -> tuple[UsageSnapshot, int]:
    """A new sync on the state file at `path` (a restart) refreshes once: its snapshot, and the pages it read."""
    reopened = StateStore(path)
    try:
        counter = PageCounter(sim)
        snapshot = make_sync(client, clock, reopened).refresh()
    finally:
        reopened.close()
    return snapshot, counter.pages


class PageCounter:
    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self.mark()

    def mark(self) -> None:
        self.start = self.sim.requests_served.get(USAGES, 0)

    @property
    def pages(self) -> int:
        return self.sim.requests_served.get(USAGES, 0) - self.start


def test_first_sync_reads_the_whole_day(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore
) -> None:
    sim.add_usage(1234)
    counter = PageCounter(sim)
    snapshot = make_sync(fake_pages, clock, store).refresh()
    assert as_truth(snapshot) == sim.usage_totals()
    assert snapshot.records == 1234
    assert counter.pages == math.ceil(1234 / PAGE) + 1  # and the first page again: nothing moved meanwhile


@pytest.mark.parametrize(("existing", "new"), [(1234, 1), (1234, 66), (1200, 1000), (1234, 1000), (1299, 250), (1, 0)])
def test_a_poll_reads_only_pages_that_can_hold_new_records(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore, existing: int, new: int
) -> None:
    sim.add_usage(existing)
    sync = make_sync(fake_pages, clock, store)
    sync.refresh()
    sim.add_usage(new)
    counter = PageCounter(sim)
    snapshot = sync.refresh()
    assert counter.pages <= math.ceil(new / PAGE) + 2  # the boundary page, and again after a parallel read
    assert as_truth(snapshot) == sim.usage_totals()
    assert snapshot.resyncs == 0


def test_reordered_records_trigger_a_full_resync_with_correct_totals(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore
) -> None:
    sim.add_usage(950)
    sync = make_sync(fake_pages, clock, store)
    first = sync.refresh()
    sim.reorder_usage()
    sim.add_usage(30)
    snapshot = sync.refresh()
    assert snapshot.resyncs == 1
    assert as_truth(snapshot) == sim.usage_totals()
    assert snapshot.created == first.created  # nothing went down: no reset


def test_removed_records_trigger_a_resync_and_a_documented_reset(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore, frozen: FrozenClock
) -> None:
    sim.add_usage(950)
    sync = make_sync(fake_pages, clock, store)
    first = sync.refresh()
    sim.remove_usage([10, 500])
    frozen.advance(dt.timedelta(minutes=5))
    snapshot = sync.refresh()
    assert snapshot.resyncs == 1
    assert snapshot.records == 948
    assert as_truth(snapshot) == sim.usage_totals()
    assert snapshot.created == frozen().timestamp() > first.created


@pytest.mark.parametrize("page_size", [PAGE, PAGE // 2], ids=["resumed", "read afresh under another page size"])
def test_a_reset_is_told_across_restarts_and_records_removed_while_down_are_one(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path, page_size: int
) -> None:
    """The counters' `created` after a reset survives a restart; records removed while the exporter
    was down are a reset too, when the day resumes and when it is read afresh (its counters would
    have gone down with `created` still the day's start)."""
    path = tmp_path / "state.db"
    sim.add_usage(950)
    with closing(StateStore(path)) as store:
        sync = make_sync(FakeBilling(sim, page_size=PAGE), clock, store)
        sync.refresh()
        sim.remove_usage([10, 500])
        frozen.advance(dt.timedelta(minutes=5))
        reset = sync.refresh().created
    assert reset == frozen().timestamp()
    frozen.advance(dt.timedelta(minutes=5))
    restarted, _ = refresh_restarted(sim, FakeBilling(sim, page_size=PAGE), clock, path)
    assert restarted.created == reset
    sim.remove_usage([3])  # while down
    frozen.advance(dt.timedelta(minutes=5))
    again, _ = refresh_restarted(sim, FakeBilling(sim, page_size=page_size), clock, path)
    assert again.created == frozen().timestamp()
    assert again.records == 947
    assert as_truth(again) == sim.usage_totals()


def test_a_removal_while_down_is_a_reset_though_the_first_poll_on_a_day_read_afresh_fails(
    sim: Simulator, clock: Clock, frozen: FrozenClock, store: StateStore
) -> None:
    """Read afresh after a restart (another page size), records removed while down, and the first
    poll refused: the next poll, which counts the day, tells the reset all the same."""
    sim.add_usage(950)
    make_sync(FakeBilling(sim, page_size=PAGE), clock, store).refresh()
    sim.remove_usage([3, 400])
    frozen.advance(dt.timedelta(minutes=5))
    refusing = FakeBilling(sim, page_size=PAGE // 2)
    sync = make_sync(refusing, clock, store)
    sim.inject(Fault("status", path=USAGES, status=403, times=1))
    with pytest.raises(BillingError):
        sync.refresh()
    frozen.advance(dt.timedelta(minutes=1))
    snapshot = sync.refresh()
    assert snapshot.records == 948
    assert snapshot.created == frozen().timestamp()


def test_a_day_read_afresh_whose_polls_fail_until_midnight_leaves_the_next_day_its_start(
    sim: Simulator, clock: Clock, frozen: FrozenClock, store: StateStore
) -> None:
    """Read afresh after a restart, its polls failing until after midnight: the new day's counters
    start at its start, not compared with the day before's sums as if records had gone."""
    sim.add_usage(950)
    make_sync(FakeBilling(sim, page_size=PAGE), clock, store).refresh()
    frozen.set(dt.datetime(2026, 11, 22, 23, 58, tzinfo=frozen().tzinfo))
    sync = make_sync(FakeBilling(sim, page_size=PAGE // 2), clock, store)
    sim.inject(Fault("status", path=USAGES, status=403, times=1))
    with pytest.raises(BillingError):
        sync.refresh()
    frozen.set(dt.datetime(2026, 11, 23, 0, 5, tzinfo=frozen().tzinfo))
    sim.add_usage(20, clock.today())
    snapshot = sync.refresh()
    assert (snapshot.day, snapshot.records) == (clock.today(), 20)
    assert snapshot.created == clock.day_start(clock.today()).timestamp()


def hidden_removal(sim: Simulator, day: dt.date) -> tuple[int, int]:
    """A listing position, and a number of records the day's next ones bring, such that the removed
    record's endpoint and model, not its API key, are among them, with as many tokens of each kind
    at least: the sums by endpoint and model go no lower, that key's do."""
    listed = list(sim.usage_records(day))  # (all made so far: the next is number len(listed))
    fields = ("promptTokens", "completionTokens", "promptCachedTokens")
    for count in range(1, 20):
        added = [sim.usage_record(day, index) for index in range(len(listed), len(listed) + count)]
        models: dict[tuple[str, str], list[int]] = {}
        for a in added:
            sums = models.setdefault((a["endpoint"], a["model"]), [0, 0, 0])
            for at, name in enumerate(fields):
                sums[at] += a[name]
        keys = {(a["endpoint"], a["model"], a["apikey"]) for a in added}
        for at, r in enumerate(listed):
            by_model = models.get((r["endpoint"], r["model"]), [-1] * 3)
            if (
                all(s >= r[n] for s, n in zip(by_model, fields, strict=True))
                and (r["endpoint"], r["model"], r["apikey"]) not in keys
            ):
                return at, count
    raise AssertionError("no removal the sums by endpoint and model hide")


def test_a_key_s_removal_hidden_by_others_of_its_endpoint_and_model_is_a_reset_on_a_day_read_afresh(
    sim: Simulator, clock: Clock, frozen: FrozenClock, store: StateStore
) -> None:
    """Per API key, the day read afresh (another page size): one key's record removed while down,
    records of other keys of its endpoint and model added. That key's counters went down: a reset,
    as when the day resumes (the sums by endpoint and model, which went up, would hide it)."""
    sim.add_usage(300)
    first = UsageSync(FakeBilling(sim, page_size=PAGE), clock, store, per_api_key=True).refresh()
    position, count = hidden_removal(sim, clock.today())
    sim.remove_usage([position])
    sim.add_usage(count)
    frozen.advance(dt.timedelta(minutes=5))
    again = UsageSync(FakeBilling(sim, page_size=PAGE // 2), clock, store, per_api_key=True).refresh()
    assert again.records == 299 + count
    assert again.created == frozen().timestamp() > first.created


def test_a_key_s_removal_while_not_counted_per_key_is_a_reset_when_it_is_again(
    sim: Simulator, clock: Clock, frozen: FrozenClock, store: StateStore
) -> None:
    """Per API key, then not (a restart), when one key's record is removed and the sums by endpoint
    and model hide it; then per key again: that key's series is back lower, with an estimate that
    went down (its counter's tokens are more than it holds): a reset."""
    prices = [PriceConfig(model=m, prompt_per_million=Decimal(4), completion_per_million=Decimal(16))
              for m in ("model-a", "model-b")]  # fmt: skip

    def sync(per_api_key: bool) -> UsageSnapshot:
        return UsageSync(
            FakeBilling(sim, page_size=PAGE), clock, store, per_api_key=per_api_key, prices=prices
        ).refresh()

    sim.add_usage(300)
    first = sync(True)
    frozen.advance(dt.timedelta(minutes=5))
    assert sync(False).created == first.created
    position, count = hidden_removal(sim, clock.today())
    sim.remove_usage([position])
    sim.add_usage(count)
    frozen.advance(dt.timedelta(minutes=5))
    assert sync(False).created == first.created  # (its sums by endpoint and model went up)
    frozen.advance(dt.timedelta(minutes=5))
    assert sync(True).created == frozen().timestamp()


def test_a_reset_the_state_file_refuses_to_keep_moves_nothing(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, frozen: FrozenClock, store: StateStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A poll that finds records removed, whose save is refused, leaves `created` as it was: new prices
    meanwhile publish the figures as they stood with it; the poll that is kept tells the reset."""
    sim.add_usage(400)
    sync = make_sync(fake_pages, clock, store)
    first = sync.refresh()
    sim.remove_usage([3, 200])
    frozen.advance(dt.timedelta(minutes=5))
    save = store.save_usage

    def refused(*args: object, **kwargs: object) -> None:
        raise StateError("state.db", "disk full")

    monkeypatch.setattr(store, "save_usage", refused)
    with pytest.raises(StateError):
        sync.refresh()
    sync.set_prices([])
    repriced = sync.reprice()
    assert repriced is not None
    assert (repriced.records, repriced.created) == (first.records, first.created)
    monkeypatch.setattr(store, "save_usage", save)
    frozen.advance(dt.timedelta(minutes=5))
    kept = sync.refresh()
    assert (kept.records, kept.created) == (398, frozen().timestamp())


def test_another_project_s_day_goes_on_for_the_endpoints_both_count(
    sim: Simulator, clock: Clock, frozen: FrozenClock, store: StateStore
) -> None:
    """`billing.project_id` set (and a price cut) on a day counted for the whole tenant: an endpoint is
    one project's, so the project's series are the same records and their counters go on (no reset,
    no estimate lower); the other endpoints' absence is no removal. Back to the whole tenant after
    one of the project's records was removed: a reset."""

    def priced(per_million: int) -> list[PriceConfig]:
        price = Decimal(per_million)
        return [
            PriceConfig(model=m, prompt_per_million=price, completion_per_million=price) for m in ("model-a", "model-b")
        ]

    def sync(project: str, per_million: int) -> UsageSnapshot:
        client = FakeBilling(sim, page_size=PAGE, project_id=project)
        return UsageSync(client, clock, store, per_api_key=False, prices=priced(per_million)).refresh()

    sim.add_usage(300)
    whole = sync("", 8)
    frozen.advance(dt.timedelta(minutes=5))
    lab = sync("proj-lab", 1)
    assert lab.totals
    assert lab.created == whole.created
    for key, totals in lab.totals.items():
        assert totals.estimated_payable == whole.totals[key].estimated_payable  # (no new records: as counted)
    labs = {e.endpoint_id for e in sim.endpoints if e.project_id == "proj-lab"}
    sim.remove_usage([next(at for at, r in enumerate(sim.usage_records(clock.today())) if r["endpoint"] in labs)])
    frozen.advance(dt.timedelta(minutes=5))
    assert sync("", 1).created == frozen().timestamp()


def test_a_project_id_with_a_semicolon_is_its_own_when_the_day_is_read_afresh(
    sim: Simulator, clock: Clock, frozen: FrozenClock, store: StateStore
) -> None:
    """A `project_id` holding `;` (nothing forbids it): the day read afresh under another page size
    is the project's own, and a record removed meanwhile is a reset."""
    sim.endpoints = tuple(replace(e, project_id="proj;lab") if e.project_id == "proj-lab" else e for e in sim.endpoints)
    sim.add_usage(300)
    first = UsageSync(
        FakeBilling(sim, page_size=PAGE, project_id="proj;lab"), clock, store, per_api_key=False
    ).refresh()
    assert first.records
    labs = {e.endpoint_id for e in sim.endpoints if e.project_id == "proj;lab"}
    sim.remove_usage([next(at for at, r in enumerate(sim.usage_records(clock.today())) if r["endpoint"] in labs)])
    frozen.advance(dt.timedelta(minutes=5))
    client = FakeBilling(sim, page_size=PAGE // 2, project_id="proj;lab")
    assert UsageSync(client, clock, store, per_api_key=False).refresh().created == frozen().timestamp()


def test_a_removal_while_another_project_was_counted_is_a_reset_when_the_tenant_is_again(
    sim: Simulator, clock: Clock, frozen: FrozenClock, store: StateStore
) -> None:
    """Counted for the whole tenant, then for one project (the others' series not shown), when a
    record of another project is removed; then for the whole tenant again: that series is back
    lower than its counter counted, a reset (the project's day saved no sums of it)."""
    price = Decimal(4)
    prices = [
        PriceConfig(model=m, prompt_per_million=price, completion_per_million=price) for m in ("model-a", "model-b")
    ]

    def sync(project: str) -> UsageSnapshot:
        client = FakeBilling(sim, page_size=PAGE, project_id=project)
        return UsageSync(client, clock, store, per_api_key=False, prices=prices).refresh()

    sim.add_usage(300)
    whole = sync("")
    frozen.advance(dt.timedelta(minutes=5))
    assert sync("proj-lab").created == whole.created
    labs = {e.endpoint_id for e in sim.endpoints if e.project_id == "proj-lab"}
    sim.remove_usage([next(at for at, r in enumerate(sim.usage_records(clock.today())) if r["endpoint"] not in labs)])
    frozen.advance(dt.timedelta(minutes=5))
    assert sync("").created == frozen().timestamp()


def test_a_project_id_holding_the_ids_mark_is_read_whole(
    sim: Simulator, clock: Clock, frozen: FrozenClock, store: StateStore
) -> None:
    """A `project_id` holding `;ids=` (the settings' mark of how ids are digested): read back whole,
    the day read afresh is the project's own, and its series gone whole meanwhile is a reset."""
    sim.endpoints = tuple(
        replace(e, project_id="lab;ids=1") if e.project_id == "proj-lab" else e for e in sim.endpoints
    )
    sim.add_usage(300)
    lab = FakeBilling(sim, page_size=PAGE, project_id="lab;ids=1")
    assert UsageSync(lab, clock, store, per_api_key=False).refresh().records
    labs = {e.endpoint_id for e in sim.endpoints if e.project_id == "lab;ids=1"}
    listed = list(sim.usage_records(clock.today()))
    sim.remove_usage([at for at, r in enumerate(listed) if r["endpoint"] in labs])
    frozen.advance(dt.timedelta(minutes=5))
    client = FakeBilling(sim, page_size=PAGE // 2, project_id="lab;ids=1")
    again = UsageSync(client, clock, store, per_api_key=False).refresh()
    assert (again.records, again.created) == (0, frozen().timestamp())


def test_the_series_of_no_api_key_is_the_same_with_per_api_key_or_without(
    sim: Simulator, clock: Clock, frozen: FrozenClock, store: StateStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Half the records carry no API key. Counted per key from then on, the series of no key (an
    empty label is none: the same series as without per_api_key) holds those records only: it went
    down, a reset. Counted without keys again, it holds them all: up, no reset."""
    from exporter.sim import ledger

    monkeypatch.setattr(ledger, "API_KEYS", ("", "sk-19cc********"))
    sim.add_usage(300)
    first = UsageSync(FakeBilling(sim, page_size=PAGE), clock, store, per_api_key=False).refresh()
    frozen.advance(dt.timedelta(minutes=5))
    keyed = UsageSync(FakeBilling(sim, page_size=PAGE), clock, store, per_api_key=True).refresh()
    assert any(not key.api_key for key in keyed.totals)
    assert keyed.created == frozen().timestamp() > first.created
    frozen.advance(dt.timedelta(minutes=5))
    assert (
        UsageSync(FakeBilling(sim, page_size=PAGE), clock, store, per_api_key=False).refresh().created == keyed.created
    )


def test_counting_per_api_key_or_not_is_no_reset_when_nothing_was_removed(
    sim: Simulator, clock: Clock, frozen: FrozenClock, store: StateStore
) -> None:
    """The day read afresh with `per_api_key` toggled, records added meanwhile: its sums by endpoint
    and model went up only, so `created` stays the day's start (the keys alone differ)."""
    sim.add_usage(950)
    first = UsageSync(FakeBilling(sim, page_size=PAGE), clock, store, per_api_key=False).refresh()
    for per_api_key in (True, False):
        sim.add_usage(10)
        frozen.advance(dt.timedelta(minutes=5))
        toggled = UsageSync(FakeBilling(sim, page_size=PAGE), clock, store, per_api_key=per_api_key).refresh()
        assert toggled.records == first.records + (20 if not per_api_key else 10)
        assert toggled.created == first.created == clock.day_start(clock.today()).timestamp()


def test_removing_the_boundary_page_tail_is_caught(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore
) -> None:
    sim.add_usage(950)
    sync = make_sync(fake_pages, clock, store)
    sync.refresh()
    sim.remove_usage([949])
    sim.add_usage(1)  # same total as before, different last record
    snapshot = sync.refresh()
    assert snapshot.resyncs == 1
    assert as_truth(snapshot) == sim.usage_totals()


def test_day_rollover_at_shanghai_midnight_finalises_yesterday_and_resets(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore, frozen: FrozenClock
) -> None:
    frozen.set(dt.datetime(2026, 11, 22, 15, 55, tzinfo=dt.UTC))  # 23:55 in Shanghai
    sim.add_usage(400)
    sync = make_sync(fake_pages, clock, store)
    assert sync.refresh().records == 400
    sim.add_usage(25)  # late records of the 22nd, seen only by the final pull
    frozen.set(dt.datetime(2026, 11, 22, 16, 0, 5, tzinfo=dt.UTC))  # 00:00:05 on the 23rd in Shanghai
    yesterday, today = dt.date(2026, 11, 22), dt.date(2026, 11, 23)
    assert clock.today() == today
    sim.add_usage(7, today)
    snapshot = sync.refresh()
    assert snapshot.day == today
    assert snapshot.records == 7
    assert as_truth(snapshot) == sim.usage_totals(today)
    assert snapshot.created == dt.datetime(2026, 11, 22, 16, 0, tzinfo=dt.UTC).timestamp()
    assert snapshot.previous_day is not None
    assert snapshot.previous_day.day == yesterday
    assert snapshot.previous_day.records == 425
    assert as_truth(snapshot.previous_day) == sim.usage_totals(yesterday)


def test_a_day_whose_last_pull_never_succeeds_leaves_no_previous_day_rather_than_the_one_before(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore, frozen: FrozenClock
) -> None:
    frozen.set(dt.datetime(2026, 11, 21, 14, 0, tzinfo=dt.UTC))  # 22:00 on the 21st in Shanghai
    sim.add_usage(40, dt.date(2026, 11, 21))
    sync = make_sync(fake_pages, clock, store)
    sync.refresh()
    frozen.set(dt.datetime(2026, 11, 21, 16, 1, tzinfo=dt.UTC))  # just after midnight: the 21st finalised
    sim.add_usage(30, dt.date(2026, 11, 22))
    before = sync.refresh().previous_day
    assert before is not None
    assert (before.day, before.records) == (dt.date(2026, 11, 21), 40)
    frozen.set(dt.datetime(2026, 11, 22, 16, 1, tzinfo=dt.UTC))  # the 23rd: the 22nd's last pull is refused
    sim.add_usage(11, dt.date(2026, 11, 23))
    sim.inject(Fault(kind="status", status=403, path="/api/v1/usages", times=FINALISE_ATTEMPTS))
    for _ in range(FINALISE_ATTEMPTS - 1):
        with pytest.raises(BillingError):
            sync.refresh()
    snapshot = sync.refresh()  # (gives the 22nd up, and counts the 23rd)
    assert (snapshot.day, snapshot.records) == (dt.date(2026, 11, 23), 11)
    assert snapshot.previous_day is None  # never the 21st's figures, as if they were the day before


class Holding:
    """`FakeBilling` whose usage listing raises `held` (the API's Retry-After, or the client closed
    by a reload) until `held` is None again, without asking the API."""

    def __init__(self, client: FakeBilling) -> None:
        self.client = client
        self.held: BillingError | None = None

    def __getattr__(self, name: str) -> object:
        return getattr(self.client, name)

    def usage_pages(self, day: dt.date, first_page: int = 1, last_page: int | None = None) -> Iterator[UsagePage]:
        if self.held is not None:
            raise self.held
        return self.client.usage_pages(day, first_page, last_page)

    def usage_page(self, day: dt.date, page_num: int) -> UsagePage:
        if self.held is not None:
            raise self.held
        return self.client.usage_page(day, page_num)


@pytest.mark.parametrize("held", [AskedToWait("held by Retry-After"), ClientClosed("reload")])
def test_refreshes_that_never_asked_the_api_do_not_give_yesterday_s_last_pull_up(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore, frozen: FrozenClock, held: BillingError
) -> None:
    """An hour's Retry-After over midnight (or reloads meanwhile) holds every refresh without a
    request: none counts towards the attempts yesterday's last pull has, and once the hold ends the
    day before is finalised and shown, not given up."""
    frozen.set(dt.datetime(2026, 11, 21, 14, 0, tzinfo=dt.UTC))  # 22:00 on the 21st in Shanghai
    sim.add_usage(40, dt.date(2026, 11, 21))
    client = Holding(fake_pages)
    sync = make_sync(client, clock, store)  # type: ignore[arg-type]
    sync.refresh()
    sim.add_usage(5, dt.date(2026, 11, 21))
    sim.add_usage(30, dt.date(2026, 11, 22))
    frozen.set(dt.datetime(2026, 11, 21, 16, 0, 5, tzinfo=dt.UTC))  # just after midnight
    client.held = held
    for _ in range(FINALISE_ATTEMPTS + 2):
        with pytest.raises(type(held)):
            sync.refresh()
        frozen.set(frozen() + dt.timedelta(minutes=5))
    client.held = None
    snapshot = sync.refresh()
    assert snapshot.previous_day is not None
    assert (snapshot.previous_day.day, snapshot.previous_day.records) == (dt.date(2026, 11, 21), 45)
    assert (snapshot.day, snapshot.records) == (dt.date(2026, 11, 22), 30)


def test_an_api_whose_clock_is_behind_is_read_by_its_own_day_at_midnight(
    frozen: FrozenClock, clock: Clock, store: StateStore
) -> None:
    """The API's clock 10 s behind ours: just after our midnight it refuses our new day as in the
    future, so its day is read until its own midnight; the first poll after that finalises the day
    before and counts the new one, with no refusal on the way."""
    sim = Simulator(clock=Clock(clock.tz, lambda: frozen() - dt.timedelta(seconds=10)))
    seen: list[float] = []
    client = FakeBilling(sim, page_size=PAGE, on_skew=seen.append, clock=clock)
    sync = UsageSync(client, clock, store, per_api_key=False, skew=lambda: seen[-1] if seen else None)
    before, after = dt.date(2026, 11, 22), dt.date(2026, 11, 23)
    frozen.set(dt.datetime(2026, 11, 22, 23, 50, tzinfo=SHANGHAI))
    sim.add_usage(300, before)
    assert sync.refresh().records == 300
    frozen.set(dt.datetime(2026, 11, 23, 0, 0, 5, tzinfo=SHANGHAI))  # (the API's 23:59:55)
    sim.add_usage(20, before)
    snapshot = sync.refresh()
    assert (snapshot.day, snapshot.records) == (before, 320)
    frozen.set(dt.datetime(2026, 11, 23, 0, 5, tzinfo=SHANGHAI))
    sim.add_usage(7, after)
    snapshot = sync.refresh()
    assert (snapshot.day, snapshot.records) == (after, 7)
    assert snapshot.previous_day is not None
    assert (snapshot.previous_day.day, snapshot.previous_day.records) == (before, 320)
    assert as_truth(snapshot.previous_day) == sim.usage_totals(before)


def test_a_process_that_stood_still_over_a_day_shows_no_day_before_yesterday_as_the_previous_day(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore, frozen: FrozenClock
) -> None:
    """Polled last on the 21st, next on the 23rd (a machine suspended, a process stopped by a
    debugger): the 21st is finalised, but it is not the day before."""
    frozen.set(dt.datetime(2026, 11, 21, 14, 0, tzinfo=dt.UTC))
    sim.add_usage(40, dt.date(2026, 11, 21))
    sync = make_sync(fake_pages, clock, store)
    sync.refresh()
    sim.add_usage(5, dt.date(2026, 11, 21))
    frozen.set(dt.datetime(2026, 11, 22, 16, 1, tzinfo=dt.UTC))  # the 23rd in Shanghai
    sim.add_usage(11, dt.date(2026, 11, 23))
    snapshot = sync.refresh()
    assert (snapshot.day, snapshot.records) == (dt.date(2026, 11, 23), 11)
    assert snapshot.previous_day is None


def test_a_restart_resumes_from_sqlite_without_a_full_pull(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, tmp_path: Path
) -> None:
    sim.add_usage(2345)
    store = StateStore(tmp_path / "state.db")
    make_sync(fake_pages, clock, store).refresh()
    store.close()

    sim.add_usage(150)
    snapshot, pages = refresh_restarted(sim, fake_pages, clock, tmp_path / "state.db")
    assert pages <= math.ceil(150 / PAGE) + 2
    assert snapshot.records == 2495
    assert as_truth(snapshot) == sim.usage_totals()


def _as_an_earlier_version_saved_it(path: Path, sim: Simulator, day: dt.date) -> None:
    """Make the day's saved state what a version that digested request ids with BLAKE2b (and did
    not say so in the cursor) wrote: the same ids, digested that way."""
    blake2b = {
        id_digest(r["requestId"]): int.from_bytes(hashlib.blake2b(r["requestId"].encode(), digest_size=8).digest())
        for r in sim.usage_records(day)
    }
    with closing(sqlite3.connect(path)) as db, db:
        (settings, ids, head) = db.execute(
            "SELECT settings, ids, head_ids FROM usage_cursor JOIN usage_ids USING (day) JOIN usage_head USING (day)"
        ).fetchone()
        assert settings.endswith(";ids=xxh3_64")
        saved, at_head = array("Q"), array("Q")
        saved.frombytes(ids)
        at_head.frombytes(bytes.fromhex(head))
        db.execute("UPDATE usage_cursor SET settings = ?", (settings.removesuffix(";ids=xxh3_64"),))
        db.execute("UPDATE usage_ids SET ids = ?", (array("Q", sorted(blake2b[d] for d in saved)).tobytes(),))
        db.execute("UPDATE usage_head SET head_ids = ?", (array("Q", (blake2b[d] for d in at_head)).tobytes().hex(),))


def test_request_ids_saved_digested_otherwise_are_never_compared_with_these(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, tmp_path: Path, newest_first: bool
) -> None:
    """After an upgrade from a version that digested the request ids otherwise, the day is read
    afresh: a request counted before the restart that the API lists again after it is counted once."""
    sim.add_usage(600)
    store = StateStore(tmp_path / "state.db")
    make_sync(fake_pages, clock, store).refresh()
    store.close()
    _as_an_earlier_version_saved_it(tmp_path / "state.db", sim, clock.today())

    sim.add_usage(40)
    sim.repeat_usage(position=40 + 3 if newest_first else 3, at=0 if newest_first else 640)
    snapshot, pages = refresh_restarted(sim, fake_pages, clock, tmp_path / "state.db")
    assert as_truth(snapshot) == sim.usage_totals(distinct=True)
    assert snapshot.records == 640
    assert pages >= math.ceil(641 / PAGE)  # the whole day


def test_after_an_upgrade_that_digests_request_ids_otherwise_the_finalised_day_before_is_kept(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    """Its sums stand (it is only ever read whole again): today's is read afresh, the day before is
    not read, nor is today's refresh held up by it."""
    sim.add_usage(300)
    store = StateStore(tmp_path / "state.db")
    make_sync(fake_pages, clock, store).refresh()
    frozen.advance(dt.timedelta(days=1))
    sim.add_usage(20)
    make_sync(fake_pages, clock, store).refresh()  # the day before finalised
    store.close()
    with closing(sqlite3.connect(tmp_path / "state.db")) as db, db:  # as an earlier version wrote the cursors
        db.execute("UPDATE usage_cursor SET settings = replace(settings, ';ids=xxh3_64', '')")
    sim.add_usage(5)
    snapshot, pages = refresh_restarted(sim, fake_pages, clock, tmp_path / "state.db")
    assert snapshot.records == 25
    assert snapshot.previous_day is not None
    assert snapshot.previous_day.records == 300
    assert pages <= math.ceil(25 / PAGE) + 1  # today's, afresh


def test_a_restart_after_midnight_finalises_the_day_it_missed(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore, frozen: FrozenClock
) -> None:
    sim.add_usage(300)
    make_sync(fake_pages, clock, store).refresh()
    sim.add_usage(12)
    frozen.advance(dt.timedelta(days=1))
    snapshot = make_sync(fake_pages, clock, store).refresh()  # a new process the next day
    assert snapshot.day == dt.date(2026, 11, 23)
    assert snapshot.records == 0
    assert snapshot.previous_day is not None
    assert snapshot.previous_day.records == 312
    again = make_sync(fake_pages, clock, store).refresh()  # and once more: yesterday is not pulled again
    assert again.previous_day is not None
    assert again.previous_day.records == 312


def test_changed_settings_start_the_day_afresh(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore
) -> None:
    sim.add_usage(500)
    make_sync(fake_pages, clock, store).refresh()
    counter = PageCounter(sim)
    snapshot = make_sync(FakeBilling(sim, page_size=250), clock, store).refresh()
    assert counter.pages == 3  # two pages, and the first again
    assert snapshot.records == 500


@pytest.mark.parametrize("change", ["page size", "per api key"])
@pytest.mark.parametrize("when", ["a restart after midnight", "a reload after the day was finalised"])
def test_changed_settings_read_the_day_before_again_under_them(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore, frozen: FrozenClock,
    change: str, when: str,
) -> None:  # fmt: skip
    """The day before, read under other settings, is read whole again under the new ones: its
    late records counted, its figures kept (not dropped, nor left unfinalised)."""
    sim.add_usage(300)
    make_sync(fake_pages, clock, store).refresh()
    day = clock.today()
    sim.add_usage(12)  # late: after the day's last poll
    frozen.advance(dt.timedelta(days=1))
    if when == "a reload after the day was finalised":
        finalised = make_sync(fake_pages, clock, store).refresh().previous_day
        assert finalised is not None
        assert finalised.records == 312
    sim.add_usage(7)
    if change == "page size":
        changed = UsageSync(FakeBilling(sim, page_size=250), clock, store, per_api_key=False)
    else:
        changed = UsageSync(fake_pages, clock, store, per_api_key=True)
    snapshot = changed.refresh()
    assert snapshot.previous_day is not None
    assert (snapshot.previous_day.day, snapshot.previous_day.records) == (day, 312)
    assert snapshot.records == 7
    if change == "page size":
        again = make_sync(FakeBilling(sim, page_size=250), clock, store)
    else:
        again = UsageSync(fake_pages, clock, store, per_api_key=True)
    # And once more under the same new settings: the day before is not read again.
    counter = PageCounter(sim)
    assert again.refresh().previous_day.records == 312  # type: ignore[union-attr]
    assert counter.pages <= 2  # (today's: the day before was restored)


def test_per_api_key_splits_the_totals(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore
) -> None:
    sim.add_usage(200)
    snapshot = UsageSync(fake_pages, clock, store, per_api_key=True).refresh()
    keys = {k.api_key for k in snapshot.totals}
    assert keys == {"sk-7f3a********", "sk-19cc********"}
    assert sum(t.requests for t in snapshot.totals.values()) == 200


def test_a_long_read_says_it_is_progressing(
    sim: Simulator, small_pages: BillingClient, clock: Clock, store: StateStore,
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from exporter.sources import usage_read

    monkeypatch.setattr(usage_read, "PROGRESS_EVERY", 0.2)
    sim.latency = 0.05  # 20 pages, 3 at a time: about 0.4 s
    sim.add_usage(2000)
    caplog.set_level(logging.INFO, logger="exporter.sources.usage_read")
    make_sync(small_pages, clock, store).refresh()
    progress = [r.fields for r in caplog.records if r.getMessage() == "reading usage"]  # type: ignore[attr-defined]
    assert progress
    assert all(p["of"] == 20 and 0 < p["pages"] <= 20 for p in progress)
    assert [p["pages"] for p in progress] == sorted(p["pages"] for p in progress)


CHEAP = [PriceConfig(model=m, prompt_per_million=1, completion_per_million=2) for m in ("model-a", "model-b")]
DEAR = [PriceConfig(model=m, prompt_per_million=1000, completion_per_million=2000) for m in ("model-a", "model-b")]
"""Prices that make a difference a test can see: DEAR is 1,000 times CHEAP."""


def by_hand(prompt_price: int, completion_price: int, totals: UsageTotals) -> Decimal:
    """Tokens × a price without a cached prompt price (cached tokens cost what prompt tokens do)."""
    return Decimal(totals.prompt_tokens * prompt_price + totals.completion_tokens * completion_price) / 1_000_000


def tokens_since(now: UsageTotals, then: UsageTotals | None) -> UsageTotals:
    then = then or UsageTotals()
    return UsageTotals(
        prompt_tokens=now.prompt_tokens - then.prompt_tokens,
        completion_tokens=now.completion_tokens - then.completion_tokens,
    )


def test_prices_set_while_the_figures_are_priced_anew_are_not_taken_for_those_they_were_priced_with(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore, frozen: FrozenClock
) -> None:
    """A reload sets new prices while the figures are being priced with the ones before (in another
    thread): the figures say so, and the next refresh, with nothing new to read, prices them anew.
    Yesterday's figures, priced whole, show it."""
    sim.add_usage(150)
    sync = UsageSync(fake_pages, clock, store, per_api_key=False, prices=CHEAP)
    sync.refresh()
    frozen.advance(dt.timedelta(days=1))
    sim.add_usage(80, clock.today())
    sync.refresh()
    snapshot = sync._snapshot

    def reload_lands(*args: Any, **kwargs: Any) -> UsageSnapshot:
        sync.set_prices(DEAR)
        return snapshot(*args, **kwargs)

    sync._snapshot = reload_lands  # type: ignore[method-assign]
    sync.reprice()
    sync._snapshot = snapshot  # type: ignore[method-assign]
    assert sync.priced_before()
    later = sync.refresh()
    assert later.previous_day is not None
    for key, totals in later.previous_day.totals.items():
        assert totals.estimated_payable == by_hand(1000, 2000, totals), key


def test_new_prices_price_what_is_counted_from_then_on_and_the_next_day_counts_from_zero(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore, frozen: FrozenClock
) -> None:
    a_only = [PriceConfig(model="model-a", prompt_per_million=1, completion_per_million=2)]
    sim.add_usage(150)
    sync = UsageSync(fake_pages, clock, store, per_api_key=False, prices=a_only)
    first = sync.refresh()
    assert {k.model for k in first.totals} == {"model-a", "model-b"}
    sync.set_prices(DEAR)
    again = sync.reprice()
    assert again is not None
    assert again.created == first.created
    for key, totals in first.totals.items():
        if key.model == "model-a":  # what the counter counted stays counted: it never goes down
            assert again.totals[key].estimated_payable == totals.estimated_payable == by_hand(1, 2, totals)
        else:  # a model without a price had no counter: its first price covers the day so far
            assert totals.estimated_payable is None
            assert again.totals[key].estimated_payable == by_hand(1000, 2000, totals)

    sim.add_usage(60)
    later = sync.refresh()
    for key, totals in later.totals.items():
        counted = again.totals[key].estimated_payable if key in again.totals else 0
        assert totals.estimated_payable == counted + by_hand(1000, 2000, tokens_since(totals, again.totals.get(key)))
    assert later.created == first.created

    frozen.advance(dt.timedelta(days=1))  # past midnight: the new day's counters start from zero
    sim.add_usage(80, clock.today())
    today = sync.refresh()
    assert today.created == clock.day_start(clock.today()).timestamp()
    assert today.records == 80
    for totals in today.totals.values():
        assert totals.estimated_payable == by_hand(1000, 2000, totals)
    assert today.previous_day is not None  # a gauge: the whole day at the prices of now
    for totals in today.previous_day.totals.values():
        assert totals.estimated_payable == by_hand(1000, 2000, totals)
    sync.set_prices(a_only)
    repriced = sync.reprice()
    assert repriced is not None
    assert repriced.previous_day is not None
    for key, totals in today.previous_day.totals.items():
        expected = by_hand(1, 2, totals) if key.model == "model-a" else None
        assert repriced.previous_day.totals[key].estimated_payable == expected
    assert {k: t.estimated_payable for k, t in repriced.totals.items() if k.model == "model-a"} == {
        k: t.estimated_payable for k, t in today.totals.items() if k.model == "model-a"
    }


def test_prices_taken_while_a_poll_ran_price_what_it_counts_and_reprice_the_day_before(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore, frozen: FrozenClock
) -> None:
    sim.add_usage(150)
    sync = UsageSync(fake_pages, clock, store, per_api_key=False, prices=CHEAP)
    sync.refresh()
    frozen.advance(dt.timedelta(days=1))
    sim.add_usage(80, clock.today())
    first = sync.refresh()
    assert first.previous_day is not None
    # What a reload does when a usage refresh holds the lock: the prices only (see Daemon._reprice).
    sync.set_prices(p.model_copy(update={"prompt_per_million": 1000, "completion_per_million": 2000}) for p in CHEAP)
    later = sync.refresh()  # nothing new upstream: the day before is priced anew all the same
    assert later.previous_day is not None
    for key, totals in first.previous_day.totals.items():
        assert later.previous_day.totals[key].estimated_payable == by_hand(1000, 2000, totals)
    assert {k: t.estimated_payable for k, t in later.totals.items()} == {
        k: t.estimated_payable for k, t in first.totals.items()
    }
    assert sync.refresh() is later  # and then nothing new is nothing new again
    sim.add_usage(40, clock.today())
    more = sync.refresh()
    for key, totals in more.totals.items():
        counted = first.totals[key].estimated_payable if key in first.totals else 0
        assert totals.estimated_payable == counted + by_hand(1000, 2000, tokens_since(totals, first.totals.get(key)))


def test_records_removed_after_a_price_change_restart_the_counter_at_the_prices_of_now(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore, frozen: FrozenClock
) -> None:
    sim.add_usage(400)
    sync = UsageSync(fake_pages, clock, store, per_api_key=False, prices=CHEAP)
    first = sync.refresh()
    sync.set_prices(DEAR)
    sync.reprice()
    sim.remove_usage([3, 250])
    frozen.advance(dt.timedelta(minutes=5))
    after = sync.refresh()
    assert after.created == frozen().timestamp() > first.created  # a reset, and `_created` says when
    for totals in after.totals.values():
        assert totals.estimated_payable == by_hand(1000, 2000, totals)


def test_a_day_read_afresh_for_new_settings_keeps_what_its_counters_counted(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore
) -> None:
    sim.add_usage(500)
    first = UsageSync(fake_pages, clock, store, per_api_key=False, prices=CHEAP).refresh()
    client = FakeBilling(sim, page_size=250)  # a reload or restart with another page size…
    again = UsageSync(client, clock, store, per_api_key=False, prices=DEAR).refresh()  # …and new prices
    assert again.created == first.created
    assert {k: t.estimated_payable for k, t in again.totals.items()} == {
        k: t.estimated_payable for k, t in first.totals.items()
    }


def test_a_poll_that_finds_nothing_new_rewrites_nothing(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore, frozen: FrozenClock
) -> None:
    import sqlite3

    sim.add_usage(1234)
    sync = make_sync(fake_pages, clock, store)
    first = sync.refresh()

    def saved_at() -> float:
        with sqlite3.connect(store.path) as db:
            return db.execute("SELECT updated FROM usage_cursor").fetchone()[0]

    written = saved_at()
    frozen.advance(dt.timedelta(minutes=5))
    again = sync.refresh()
    assert again is first  # the same snapshot: its text and gzip come from the cache
    assert saved_at() == written  # and the state file was not written
    sim.add_usage(3)
    frozen.advance(dt.timedelta(minutes=5))
    moved = sync.refresh()
    assert moved is not first
    assert moved.records == 1237
    assert saved_at() > written


@pytest.mark.parametrize("new", [1, 99, 100, 250, 1000])
def test_once_the_order_is_known_a_poll_reads_the_new_records_and_little_else(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore, newest_first: bool, new: int
) -> None:
    sim.add_usage(1234)
    sync = make_sync(fake_pages, clock, store)
    sync.refresh()
    sim.add_usage(7)
    sync.refresh()  # new records show where the list puts them
    assert sync.newest_first == newest_first
    for _ in range(3):
        sim.add_usage(new)
        counter = PageCounter(sim)
        snapshot = sync.refresh()
        assert as_truth(snapshot) == sim.usage_totals()
        assert snapshot.resyncs == 0
        # newest first: the pages the new records take and the first known one; oldest first:
        # the page the last known one is on, those after it, and that page again after a parallel read
        assert counter.pages <= (math.ceil((new + 1) / PAGE) if newest_first else math.ceil(new / PAGE) + 2)


def test_the_order_learnt_survives_a_restart(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, tmp_path: Path, newest_first: bool
) -> None:
    sim.add_usage(640)
    store = StateStore(tmp_path / "state.db")
    sync = make_sync(fake_pages, clock, store)
    sync.refresh()
    sim.add_usage(15)
    sync.refresh()
    store.close()
    sim.add_usage(230)
    snapshot, pages = refresh_restarted(sim, fake_pages, clock, tmp_path / "state.db")
    assert as_truth(snapshot) == sim.usage_totals()
    assert snapshot.resyncs == 0
    assert pages == (3 if newest_first else math.ceil((655 % PAGE + 230) / PAGE) + 1)


@pytest.mark.parametrize("at", [0, 1, 333, 1100])
def test_a_late_record_landing_mid_list_costs_one_full_read(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore, at: int
) -> None:
    sim.add_usage(1234)
    sync = make_sync(fake_pages, clock, store)
    sync.refresh()
    sim.add_usage(40)
    sync.refresh()
    sim.add_usage(25)
    sim.insert_usage(1, at=at)
    snapshot = sync.refresh()
    assert as_truth(snapshot) == sim.usage_totals()
    assert snapshot.resyncs <= 1
    sim.add_usage(60)
    counter = PageCounter(sim)
    after = sync.refresh()  # and the next poll is incremental again
    assert as_truth(after) == sim.usage_totals()
    assert after.resyncs == snapshot.resyncs
    assert counter.pages <= math.ceil(60 / PAGE) + 2


@pytest.mark.parametrize("total_as_number", [False, True], ids=["total-as-string", "total-as-number"])
def test_a_service_that_caps_its_pages_loses_nothing(
    sim: Simulator, small_pages: BillingClient, clock: Clock, store: StateStore, total_as_number: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    sim.usage_page_cap = 40  # below the 100 asked for, and it does not say so
    sim.total_as_number = total_as_number
    sim.add_usage(1234)
    sync = make_sync(small_pages, clock, store)
    caplog.set_level(logging.WARNING, logger="exporter.billing")
    snapshot = sync.refresh()
    assert snapshot.records == 1234
    assert as_truth(snapshot) == sim.usage_totals()
    assert small_pages.page_size == 40
    assert any("fewer records a page than asked" in r.getMessage() for r in caplog.records)
    for new in (1, 39, 40, 130):
        sim.add_usage(new)
        counter = PageCounter(sim)
        polled = sync.refresh()
        assert as_truth(polled) == sim.usage_totals()
        assert counter.pages <= math.ceil(new / 40) + 3


def test_a_bad_record_after_the_service_capped_its_pages_is_named_by_its_place_in_the_day(
    sim: Simulator, clock: Clock
) -> None:
    """The pages after the first are asked for, and read, at the size the service caps them at:
    the bad record first on page 3 of 100 is the day's record 200."""

    class BadThird(FakeBilling):
        def _answer(self, api: str, path: str, params: dict[str, str | int]) -> tuple[int, bytes]:
            if params.get("page_num") == 3:
                self.sim.inject(Fault("bad_value", USAGES_PATH, field="promptTokens", value="x"))
            return super()._answer(api, path, params)

    sim.usage_page_cap = 100
    sim.add_usage(1000)
    with pytest.raises(RecordError, match=r": record 200: field 'promptTokens'"):
        list(BadThird(sim, page_size=500).usage_pages(clock.today()))


def test_a_capped_page_size_survives_a_restart(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, tmp_path: Path
) -> None:
    sim.usage_page_cap = 40
    sim.add_usage(1234)
    store = StateStore(tmp_path / "state.db")
    make_sync(fake_pages, clock, store).refresh()
    store.close()
    sim.add_usage(30)
    client = FakeBilling(sim, page_size=PAGE)  # a new process asks for PAGE again
    snapshot, pages = refresh_restarted(sim, client, clock, tmp_path / "state.db")
    assert as_truth(snapshot) == sim.usage_totals()
    assert snapshot.resyncs == 0
    assert pages <= 3


def test_the_fake_answers_as_the_wire_does(
    sim: Simulator, small_pages: BillingClient, fake_pages: FakeBilling, clock: Clock
) -> None:
    """The unit layer's fake stays honest: the same records, totals, caps and errors as over HTTP."""
    sim.add_usage(345)
    sim.add_usage(12, dt.date(2026, 11, 20))
    for period, group_term in (("2026-11", GROUP_TERM_ITEM), ("2026-10", GROUP_TERM_INSTANCE)):
        assert fake_pages.bills(period, group_term) == small_pages.bills(period, group_term)
    for day in (clock.today(), dt.date(2026, 11, 20), dt.date(2026, 11, 19)):
        wire = sorted(small_pages.usage_pages(day), key=lambda p: p.page_num)
        assert sorted(fake_pages.usage_pages(day), key=lambda p: p.page_num) == wire
        assert fake_pages.usage_page(day, 2) == small_pages.usage_page(day, 2)
    sim.usage_page_cap = 40
    assert fake_pages.usage_page(clock.today(), 1) == small_pages.usage_page(clock.today(), 1)
    assert fake_pages.page_size == small_pages.page_size == 40
    for api in (small_pages, fake_pages):
        with pytest.raises(BillingAPIError, match="must not be in the future") as refused:
            list(api.usage_pages(clock.today() + dt.timedelta(days=1)))
        assert refused.value.status == 400


@pytest.mark.parametrize("per_api_key", [True, False])
def test_a_reload_that_toggles_per_api_key_never_shows_two_series_under_one_label_set(
    sim: Simulator, clock: Clock, tmp_path: Path, per_api_key: bool
) -> None:
    """Until the next usage refresh counts the other way, the snapshot held is shown summed over its
    keys (per key → not), or not at all (not → per key: no key is known), never cut to the new labels."""
    import yaml

    from exporter.config.load import validate
    from tests.daemon_fakes import fake_billing_section, metrics, unit_daemon

    document = {
        "billing": fake_billing_section(sim, per_api_key=per_api_key),
        "state": {"path": str(tmp_path / "s.db")},
    }
    (path := tmp_path / "config.yaml").write_text(yaml.safe_dump(document))
    sim.add_usage(300)
    daemon = unit_daemon(validate(document, {}), sim, clock, config_path=path)
    try:
        assert daemon.refresh("usage")
        document["billing"]["per_api_key"] = not per_api_key
        path.write_text(yaml.safe_dump(document))
        assert daemon.reload()
        text = daemon.sources.exposition.render()[0].decode()
        shown = [line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("inference_usage_requests_total")]
        assert len({labels for labels, _ in shown}) == len(shown)  # no label set twice
        assert all("api_key" not in labels for labels, _ in shown)
        assert sum(float(value) for _, value in shown) == (300 if per_api_key else 0)  # summed, or not known yet
        assert daemon.refresh("usage")
        requests = {labels: v for labels, v in metrics(daemon).items() if labels[0] == "inference_usage_requests_total"}
        assert sum(requests.values()) == 300
    finally:
        daemon.stop()
