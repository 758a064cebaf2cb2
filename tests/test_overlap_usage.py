"""Usage sync when the list changes while it is being read: appends in both orders, repeated ids.

Each case checks the figures against the simulator afterwards: every request counted exactly
once, none missed, whatever the timing of the change. The sync's logic runs on the in-process fake
(tests/fakes.py), which hands a parallel read's pages over last first (the interleaving furthest
from the wire's); over HTTP, one case of each change made while pages are read in parallel, and
what only the real client does (closing it ends a read).
"""

from __future__ import annotations

import datetime as dt
import math
import threading
import time
from array import array
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
from requests.auth import AuthBase

from exporter.billing import BillingAPI, BillingClient, ClientClosed, RecordError, UsageRecord
from exporter.core.clock import Clock
from exporter.sim import Simulator
from exporter.sources.usage import SeenIds, UsageSync
from exporter.sources.usage_aggregate import Aggregate, id_digest
from exporter.state import StateStore
from tests.conftest import PAGE
from tests.fakes import FakeBilling
from tests.test_usage_sync import PageCounter, as_truth


def append_when_served(sim: Simulator, page: int, count: int) -> None:
    """Add `count` records once, just before `page` is served (a parallel read is under way)."""
    fired = []

    def hook(page_num: int) -> None:
        if page_num == page and not fired:
            fired.append(page_num)
            sim.add_usage(count)

    sim.before_usage_page = hook


def records_arriving(
    sim: Simulator, api: BillingAPI, clock: Clock, store: StateStore, newest_first: bool, during: str, page: int
) -> None:
    if newest_first:
        sim.list_newest_first()
    sim.add_usage(850)
    sync = UsageSync(api, clock, store, per_api_key=False)
    if during == "incremental":
        sync.refresh()
        sim.add_usage(600)  # the next poll reads pages 9 to 15 in parallel (oldest first)
        page = page if newest_first else {2: 10, 5: 12, 9: 15}[page]
    listed = sim.usage_totals()
    append_when_served(sim, page, 37)
    snapshot = sync.refresh()
    # The poll counts the list as it was before the records arrived (newest first, they arrive
    # above a page already read: the next poll's) or after: never a part of them, never one twice.
    after = sim.usage_totals()
    assert as_truth(snapshot) in (listed, after)
    assert snapshot.records == sum(t["requests"] for t in as_truth(snapshot).values())
    sim.before_usage_page = None
    again = sync.refresh()  # and the next poll agrees
    assert as_truth(again) == sim.usage_totals()


@pytest.mark.parametrize("newest_first", [False, True], ids=["oldest-first", "newest-first"])
@pytest.mark.parametrize("during", ["first", "incremental"])
@pytest.mark.parametrize("page", [2, 5, 9])
def test_records_arriving_during_a_parallel_read_are_counted_once(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore, newest_first: bool, during: str,
    page: int,
) -> None:  # fmt: skip
    records_arriving(sim, fake_pages, clock, store, newest_first, during, page)


def test_records_arriving_during_a_parallel_read_over_http_are_counted_once(
    sim: Simulator, small_pages: BillingClient, clock: Clock, store: StateStore
) -> None:
    records_arriving(sim, small_pages, clock, store, newest_first=False, during="incremental", page=5)


def test_a_request_the_api_lists_twice_is_counted_once(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore
) -> None:
    sim.add_usage(730)
    sim.repeat_usage(position=120, at=455)  # the same request on page 2 and on page 5; `total` counts both
    sync = UsageSync(fake_pages, clock, store, per_api_key=False)
    snapshot = sync.refresh()
    assert snapshot.records == 730
    assert as_truth(snapshot) == sim.usage_totals(distinct=True)
    assert as_truth(snapshot) != sim.usage_totals()  # the naive sum would count it twice
    sim.add_usage(40)
    counter = PageCounter(sim)
    polled = sync.refresh()
    assert as_truth(polled) == sim.usage_totals(distinct=True)
    assert counter.pages <= math.ceil(40 / PAGE) + 2
    assert polled.resyncs == 0


def test_a_new_record_repeating_a_counted_id_is_counted_once(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore
) -> None:
    sim.add_usage(300)
    sync = UsageSync(fake_pages, clock, store, per_api_key=False)
    sync.refresh()
    sim.add_usage(10)
    sim.repeat_usage(position=5, at=305)  # an old request listed again among the new ones
    snapshot = sync.refresh()
    assert snapshot.records == 310
    assert as_truth(snapshot) == sim.usage_totals(distinct=True)


def test_the_ids_seen_survive_a_restart(sim: Simulator, fake_pages: FakeBilling, clock: Clock, tmp_path: Path) -> None:
    sim.add_usage(420)
    store = StateStore(tmp_path / "state.db")
    UsageSync(fake_pages, clock, store, per_api_key=False).refresh()
    store.close()
    sim.add_usage(10)
    sim.repeat_usage(position=3, at=425)  # a request counted before the restart, listed again after it
    reopened = StateStore(tmp_path / "state.db")
    try:
        counter = PageCounter(sim)
        snapshot = UsageSync(fake_pages, clock, reopened, per_api_key=False).refresh()
    finally:
        reopened.close()
    assert snapshot.records == 430
    assert as_truth(snapshot) == sim.usage_totals(distinct=True)  # the ids counted before it were kept
    assert counter.pages == 1  # and the poll went on where it stopped


def keeps_moving(sim: Simulator, api: BillingAPI, clock: Clock, store: StateStore, newest_first: bool, at: int) -> None:
    if newest_first:
        sim.list_newest_first()
    sim.add_usage(600)
    sim.before_usage_page = lambda page_num: sim.insert_usage(3, at=at) if page_num == 4 else None  # every read
    failure = ""
    try:
        snapshot = UsageSync(api, clock, store, per_api_key=False).refresh()
    except RecordError as error:
        failure = str(error)
    if failure:
        assert "in 3 reads in a row" in failure
    else:  # a read that saw the list after an insert, consistently
        assert as_truth(snapshot) == sim.usage_totals()


@pytest.mark.parametrize("newest_first", [False, True], ids=["oldest-first", "newest-first"])
@pytest.mark.parametrize("at", [350, 50])
def test_a_list_that_keeps_moving_mid_list_is_counted_right_or_not_at_all(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore, newest_first: bool, at: int
) -> None:
    keeps_moving(sim, fake_pages, clock, store, newest_first, at)


def test_a_list_that_keeps_moving_mid_list_over_http_is_counted_right_or_not_at_all(
    sim: Simulator, small_pages: BillingClient, clock: Clock, store: StateStore
) -> None:
    keeps_moving(sim, small_pages, clock, store, newest_first=False, at=350)


def test_a_newest_first_list_gaining_records_on_every_read_is_counted_as_its_first_page_showed_it(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore
) -> None:
    """Records arriving at the head while pages are read in parallel shift every page read
    after them: each page is placed where the first page saw its records, and the records that
    arrived are left to the next poll."""
    sim.list_newest_first()
    sim.add_usage(600)
    sync = UsageSync(fake_pages, clock, store, per_api_key=False)
    sync.refresh()
    sim.add_usage(700)
    sync.refresh()  # learns the order from the head
    assert sync.newest_first
    for _ in range(3):
        sim.add_usage(450)
        listed = sim.usage_totals()
        sim.before_usage_page = lambda page_num: sim.add_usage(3) if page_num in (3, 4) else None
        snapshot = sync.refresh()
        sim.before_usage_page = None
        assert as_truth(snapshot) == listed
        assert snapshot.resyncs == 0
    assert as_truth(sync.refresh()) == sim.usage_totals()


def test_seen_ids_remember_exactly_what_was_added() -> None:
    seen = SeenIds()
    ids = [f"req-{n:09d}" for n in range(20_000)]
    assert all(seen.add(i) for i in ids)
    assert not any(seen.add(i) for i in ids[::7])
    assert seen.count == 20_000
    restored = SeenIds.from_bytes(b"".join(seen.chunks()))
    assert restored.count == 20_000
    assert not restored.add(ids[12_345])
    assert restored.add("req-new")
    fork = restored.fork()
    assert not fork.add(ids[7])  # it sees its base's ids
    assert fork.add("req-only-in-the-fork")
    assert fork.count == restored.count + 1
    assert b"".join(fork.added()) == id_bytes("req-only-in-the-fork")
    assert b"".join(fork.chunks()) == b"".join(sorted_ids([*ids, "req-new", "req-only-in-the-fork"]))
    assert restored.add("req-only-in-the-fork")  # the base is left as it was


def test_a_fork_settles_into_its_base() -> None:
    base = SeenIds()
    for n in range(5_000):
        base.add(f"req-{n}")
    fork = base.fork()
    new = [f"new-{n}" for n in range(300)]
    assert all(fork.add(i) for i in new)
    fork.settle()
    assert fork.base is None
    assert fork.count == 5_300
    assert not any(fork.add(i) for i in new)
    assert b"".join(fork.chunks()) == b"".join(sorted_ids([*(f"req-{n}" for n in range(5_000)), *new]))
    again = SeenIds()
    again.extend(b"".join(fork.chunks()[:3]))
    again.extend(b"".join(fork.chunks()))  # some of them twice: each counted once
    assert again.count == 5_300


def test_a_page_of_ids_is_remembered_at_once_and_its_repeats_named_by_position() -> None:
    """Repeats within the page, of the fork's own ids and of its base's, each found where it is;
    the first of two equal ids in a page is the one remembered."""
    base = SeenIds()
    base.add("old-1")
    fork = base.fork()
    fork.add("mine-1")
    page = ["a", "old-1", "b", "a", "mine-1", "c", "b"]
    assert fork.add_digests([id_digest(i) for i in page]) == [1, 3, 4, 6]
    assert fork.count == base.count + 4  # mine-1, a, b, c
    assert b"".join(fork.added()) == b"".join(sorted_ids(["mine-1", "a", "b", "c"]))
    assert fork.add_digests([]) == []


def test_a_full_reads_fork_of_an_empty_set_settles_into_its_own_ids() -> None:
    empty = SeenIds()
    fork = empty.fork()
    ids = [f"req-{n}" for n in range(2_000)]
    assert fork.add_digests([id_digest(i) for i in ids]) == []
    fork.settle()
    assert fork.base is None
    assert fork.count == 2_000
    assert b"".join(fork.chunks()) == b"".join(sorted_ids(ids))
    assert not fork.add(ids[1_234])
    assert fork.add("req-new")


def test_aggregate_counts_a_repeat_once_and_names_it() -> None:
    """`rows` is every record read, `records` every distinct request; sums leave the repeat out."""
    at = dt.datetime(2026, 11, 22, 2, tzinfo=dt.UTC)

    def record(request_id: str, prompt: int, apikey: str | None = "sk-a****") -> UsageRecord:
        return UsageRecord(request_id, at, "model-a", "ep-1", prompt, 1, 0, apikey)

    aggregate = Aggregate(per_api_key=True)
    aggregate.add([record("r1", 10), record("r2", 20, None), record("r1", 1000)])
    aggregate.add((record("r2", 2000, None), record("r3", 30)))
    assert (aggregate.rows, aggregate.records, aggregate.duplicates) == (5, 3, {"r1", "r2"})
    assert sorted(aggregate.table()) == [
        ("ep-1", "model-a", "", 1, 20, 1, 0),
        ("ep-1", "model-a", "sk-a****", 2, 40, 2, 0),
    ]


def id_bytes(request_id: str) -> bytes:
    return array("Q", [id_digest(request_id)]).tobytes()


def sorted_ids(request_ids: Iterable[str]) -> list[bytes]:
    return [array("Q", sorted(id_digest(i) for i in request_ids)).tobytes()]


def head_change(sim: Simulator, api: BillingAPI, clock: Clock, store: StateStore, page: int) -> None:
    """Newest first: one record goes and a new one arrives at the head while later pages are read.
    `total` is unchanged, nothing repeats, nothing else moves: only reading the first page again
    shows that the list changed (the new record would be missed, the gone one counted)."""
    sim.list_newest_first()
    sim.add_usage(950)
    fired = []

    def replace_head_once(page_num: int) -> None:
        if page_num == page and not fired:
            fired.append(page_num)
            sim.remove_usage([0])
            sim.add_usage(1)

    sim.before_usage_page = replace_head_once
    snapshot = UsageSync(api, clock, store, per_api_key=False).refresh()
    assert fired
    assert snapshot.records == 950
    assert as_truth(snapshot) == sim.usage_totals()


@pytest.mark.parametrize("page", [3, 7])
def test_a_change_at_the_head_during_a_parallel_read_is_caught(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore, page: int
) -> None:
    head_change(sim, fake_pages, clock, store, page)


def test_a_change_at_the_head_during_a_parallel_read_over_http_is_caught(
    sim: Simulator, small_pages: BillingClient, clock: Clock, store: StateStore
) -> None:
    head_change(sim, small_pages, clock, store, page=3)


def ends_when_closed(client: BillingClient, read: Callable[[], Iterable[object]], release: threading.Event) -> None:
    """`read` runs in a thread until it waits on pages, and the client closes then: the read must
    end at once with `ClientClosed`, not when its pages would have come back (at `release`)."""
    outcome: list[object] = []

    def reading() -> None:
        try:
            outcome.extend(read())
        except ClientClosed as closed:
            outcome.append(closed)

    reader = threading.Thread(target=reading, daemon=True)
    reader.start()
    time.sleep(0.3)  # (waiting on its pages by now; a read not there yet is refused at once all the same)
    started = time.monotonic()
    client.close()
    reader.join(5)
    release.set()
    assert not reader.is_alive(), "the read still waits on pages after the close"
    assert time.monotonic() - started < 2
    assert isinstance(outcome[-1], ClientClosed)


def test_closing_the_client_ends_a_wait_on_queued_pages_at_once(clock: Clock) -> None:
    """Every page submitted, two running and three queued when the client closes: the close
    cancels the queued ones and must end the wait on the running ones too."""
    release = threading.Event()

    def ask(page_num: int, page_size: int) -> tuple[int, bytes]:
        if page_num > 1:
            release.wait(10)  # pages 2 and 3 hold both workers; 4 to 6 stay queued
        return 200, b""

    def read(page_num: int, page_size: int, answer: tuple[int, bytes]) -> tuple[tuple[int, ...], int]:
        return (page_num,) * 2, 12

    client = BillingClient("http://127.0.0.1:9", AuthBase(), tz=clock.tz, page_size=2, concurrency=1)
    ends_when_closed(client, lambda: client._pages(ask, read, 1, 2), release)


def test_a_repeat_within_one_page_costs_no_full_read(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore
) -> None:
    sim.add_usage(250)
    sync = UsageSync(fake_pages, clock, store, per_api_key=False)
    sync.refresh()
    sim.add_usage(6)
    sim.repeat_usage(position=3, at=255)  # on page 3, where the poll starts: nothing can have shifted
    counter = PageCounter(sim)
    snapshot = sync.refresh()
    assert counter.pages == 1
    assert snapshot.resyncs == 0
    assert snapshot.records == 256
    assert as_truth(snapshot) == sim.usage_totals(distinct=True)


def test_an_api_that_keeps_listing_new_repeats_is_still_read(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore
) -> None:
    """Each read of the day finds the repeats of the read before, and a new one (a live day)."""
    sim.add_usage(900)
    sim.repeat_usage(position=10, at=450)
    added = []

    def one_more_repeat(page_num: int) -> None:
        if page_num == 1:  # as a read starts (and as it re-reads its first page)
            added.append(page_num)
            sim.repeat_usage(position=20 + len(added), at=800)

    sim.before_usage_page = one_more_repeat
    snapshot = UsageSync(fake_pages, clock, store, per_api_key=False).refresh()
    assert len(added) >= 2
    sim.before_usage_page = None
    assert as_truth(snapshot) == sim.usage_totals(distinct=True)


@pytest.mark.parametrize("ids", [b"", b"\x01\x02\x03"], ids=["saved-without-ids", "damaged-ids"])
def test_a_day_saved_without_its_ids_is_read_afresh(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, tmp_path: Path, ids: bytes
) -> None:
    sim.add_usage(420)
    store = StateStore(tmp_path / "state.db")
    UsageSync(fake_pages, clock, store, per_api_key=False).refresh()
    with store.transaction() as db:  # as an older version left it, or a damaged blob
        db.execute("UPDATE usage_ids SET ids = ?", (ids,))
    store.close()
    sim.repeat_usage(position=3, at=420)  # a request counted before, listed again
    reopened = StateStore(tmp_path / "state.db")
    try:
        snapshot = UsageSync(fake_pages, clock, reopened, per_api_key=False).refresh()
    finally:
        reopened.close()
    assert snapshot.records == 420
    assert as_truth(snapshot) == sim.usage_totals(distinct=True)


def test_a_newest_first_day_busier_than_a_page_per_read_is_read_from_the_first_refresh(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore
) -> None:
    """More than a page of records arrives during every read: the first page read again cannot
    show the list shifting (it shifted by more than a page), so the read in the order assumed
    fails, and the next read is in the other order."""
    sim.newest_first = True
    sim.add_usage(1234)
    sim.before_usage_page = lambda page_num: sim.add_usage(120) if page_num == 5 else None
    sync = UsageSync(fake_pages, clock, store, per_api_key=False)
    snapshot = sync.refresh()
    assert sync.newest_first
    # The list as one read's first page showed it: the records before some arrival, each once.
    assert (snapshot.records - 1234) % 120 == 0
    assert as_truth(snapshot) == sim.usage_totals(oldest=snapshot.records)
    sim.before_usage_page = None
    assert as_truth(sync.refresh()) == sim.usage_totals()


def test_an_order_learnt_from_a_late_record_at_the_head_is_unlearnt_at_the_cost_of_one_full_read(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, store: StateStore
) -> None:
    """Oldest first, a late record landing at the head looks like one new record of a list shown
    newest first. The next records at the end show otherwise: one full read, and polls are
    incremental again."""
    sim.add_usage(1234)
    sync = UsageSync(fake_pages, clock, store, per_api_key=False)
    sync.refresh()
    sim.add_usage(20)
    sync.refresh()
    sim.insert_usage(1, at=0)
    assert as_truth(sync.refresh()) == sim.usage_totals()
    resyncs = []
    for _ in range(4):
        sim.add_usage(20)
        counter = PageCounter(sim)
        snapshot = sync.refresh()
        assert as_truth(snapshot) == sim.usage_totals()
        resyncs.append(snapshot.resyncs)
    assert resyncs[-1] <= 1
    assert not sync.newest_first
    assert counter.pages <= 2


def _ids_written(path: Path) -> tuple[int, list[int]]:
    """The bytes of the day's ids written whole, and of each poll's appended since."""
    import sqlite3

    db = sqlite3.connect(path)
    try:
        whole = db.execute("SELECT coalesce(sum(length(ids)), 0) FROM usage_ids").fetchone()[0]
        added = [n for (n,) in db.execute("SELECT length(ids) FROM usage_ids_added ORDER BY rowid")]
    finally:
        db.close()
    return whole, added


def test_a_poll_writes_the_ids_it_found_and_a_restart_reads_them_back(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, tmp_path: Path
) -> None:
    """The day's ids are written whole by a full read; each poll after it appends only the ids it
    found (8 bytes each), so what a poll writes grows with what it found, not with the day."""
    path = tmp_path / "state.db"
    sim.add_usage(3000)
    store = StateStore(path)
    sync = UsageSync(fake_pages, clock, store, per_api_key=False)
    sync.refresh()
    assert _ids_written(path) == (3000 * 8, [])
    for found in (7, 130, 1):
        sim.add_usage(found)
        sync.refresh()
    sync.refresh()  # nothing new: nothing written
    assert _ids_written(path) == (3000 * 8, [7 * 8, 130 * 8, 1 * 8])
    store.close()

    sim.repeat_usage(position=3050, at=3138)  # a request of an appended poll, listed again
    sim.add_usage(4)
    reopened = StateStore(path)
    try:
        again = UsageSync(fake_pages, clock, reopened, per_api_key=False)
        snapshot = again.refresh()
    finally:
        reopened.close()
    assert snapshot.resyncs == 0  # resumed from the ids as saved, not read afresh
    assert snapshot.records == 3142
    assert as_truth(snapshot) == sim.usage_totals(distinct=True)
    assert _ids_written(path) == (3000 * 8, [7 * 8, 130 * 8, 1 * 8, 4 * 8])


def test_a_full_read_writes_the_ids_whole_and_drops_what_polls_appended(
    sim: Simulator, fake_pages: FakeBilling, clock: Clock, tmp_path: Path
) -> None:
    path = tmp_path / "state.db"
    sim.add_usage(900)
    store = StateStore(path)
    try:
        sync = UsageSync(fake_pages, clock, store, per_api_key=False)
        sync.refresh()
        sim.add_usage(20)
        sync.refresh()
        assert _ids_written(path) == (900 * 8, [20 * 8])
        sim.reorder_usage()  # nothing is where it was: the day is read again
        sim.add_usage(5)
        snapshot = sync.refresh()
        assert snapshot.resyncs == 1
        assert _ids_written(path) == (925 * 8, [])
        assert as_truth(snapshot) == sim.usage_totals(distinct=True)
    finally:
        store.close()


def test_closing_the_client_ends_a_wait_on_a_single_running_page_at_once(clock: Clock) -> None:
    """The first page (read alone, `_one`) is running when the client closes: the wait ends then,
    not when the page would have come back."""
    release = threading.Event()

    def fetch(page_num: int) -> int:
        release.wait(10)
        return page_num

    client = BillingClient("http://127.0.0.1:9", AuthBase(), tz=clock.tz, page_size=2, concurrency=1)
    ends_when_closed(client, lambda: [client._one(fetch, 1)], release)
