"""Bytes the usage sync writes to its state file per poll, as the day grows: each poll appends the
request ids it found, so what it writes follows what it found, not the day's size.

python -m bench.state_writes [--days 10000 1000000] [--found 1000] [--polls 20]

The day is read in full from the simulator in process (no HTTP: nothing but the state file is
written), then `--polls` polls each find `--found` new records. Bytes written: the process's
`wchar` (/proc/self/io: every write, the WAL's frames and checkpoints included) over the polls,
÷ polls. The reference is the ids a poll found, 8 bytes each; the cursor, the day's totals and
SQLite's pages come on top, the same at any day size.

Then what a save costs the scrapes meanwhile: a day of `--scrape-ids` request ids saved whole (as a
full read saves it) `--saves` times while a thread reads the notifications waiting (what every
scrape reads from the state file) in a loop, once beside the writer (`StateFile.peeking`, as now)
and once through the writer's own connection (as before): the longest wait of each.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import tempfile
import threading
import time
from array import array
from collections.abc import Callable
from pathlib import Path

from exporter.core.clock import Clock
from exporter.sim import Simulator
from exporter.sources.usage import UsageSync
from exporter.state import AlertStore, StateStore, UsageCursor
from exporter.state.alerts import read_pending
from tests.fakes import FakeBilling

PAGE_SIZE = 500


def _written() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


def measure(records: int, found: int, polls: int) -> tuple[float, float, int]:
    """(bytes written per poll, CPU seconds per poll, the state file's size at the end)."""
    sim = Simulator(clock=Clock())
    sim.add_usage(records)
    with tempfile.TemporaryDirectory() as workdir:
        path = Path(workdir) / "state.db"
        store = StateStore(path)
        try:
            sync = UsageSync(FakeBilling(sim, page_size=PAGE_SIZE), Clock(), store, per_api_key=False)
            assert sync.refresh().records == records
            before, cpu = _written(), time.process_time()
            for n in range(polls):
                sim.add_usage(found)
                assert sync.refresh().records == records + found * (n + 1)
            written, cpu = _written() - before, time.process_time() - cpu
        finally:
            store.close()
        return written / polls, cpu / polls, path.stat().st_size


def _waits(read: Callable[[], object], save: Callable[[], None], saves: int) -> tuple[list[float], float]:
    """The waits of `read`, run in a loop on a thread of its own while `save` runs `saves` times
    (sorted); and the longest save."""
    taken: list[float] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            read()
            taken.append(time.perf_counter() - started)
            time.sleep(0.002)

    thread = threading.Thread(target=reader)
    thread.start()
    longest_save = 0.0
    try:
        for _ in range(saves):
            started = time.perf_counter()
            save()
            longest_save = max(longest_save, time.perf_counter() - started)
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join()
    return sorted(taken), longest_save


def scrape_waits(ids: int, saves: int) -> None:
    """The waits of the outbox count, read each way while a day of `ids` request ids is saved."""
    digests = array("Q", range(0, ids * 7919, 7919))
    today = dt.date.today()
    cursor = UsageCursor(today, "settings", ids, "id", "fingerprint")
    with tempfile.TemporaryDirectory() as workdir:
        store = StateStore(Path(workdir) / "state.db")
        try:

            def save() -> None:
                store.save_usage(cursor, [], time.time(), today, ids=[memoryview(digests)])

            def through_the_writer() -> None:
                with store.reading() as db:
                    read_pending(db)

            beside, saved = _waits(AlertStore(store).pending_count, save, saves)
            through, saved_too = _waits(through_the_writer, save, saves)
        finally:
            store.close()
    print(f"the outbox count every scrape reads, while a day of {ids:,} request ids is saved whole {saves} times "
          f"(the longest save {max(saved, saved_too) * 1000:.0f} ms):")  # fmt: skip
    for way, taken in (("beside the writer (now)", beside), ("through the writer's connection (before)", through)):
        print(f"  read {way}: longest wait {taken[-1] * 1000:.1f} ms, median {taken[len(taken) // 2] * 1000:.2f} ms")
    print(f"  longest wait beside ÷ through the writer's connection: {beside[-1] / through[-1]:.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--days", type=int, nargs="+", default=[10_000, 1_000_000], help="records in the day")
    parser.add_argument("--found", type=int, default=1000, help="new records each poll finds")
    parser.add_argument("--polls", type=int, default=20)
    parser.add_argument("--scrape-ids", type=int, default=10_000_000, help="request ids of the day saved whole")
    parser.add_argument("--saves", type=int, default=3)
    args = parser.parse_args(argv)
    logging.disable(logging.INFO)
    reference = args.found * 8
    print(f"state file writes per poll finding {args.found} records ({reference:,} bytes of new ids), "
          f"mean of {args.polls} polls")  # fmt: skip
    results = {}
    for records in args.days:
        per_poll, cpu, size = measure(records, args.found, args.polls)
        results[records] = per_poll
        print(f"  a day of {records:>9,} records: {per_poll:>10,.0f} bytes a poll ({per_poll / reference:.1f} × the "
              f"new ids), {cpu * 1000:.1f} ms CPU a poll; state file {size / 1e6:.1f} MB")  # fmt: skip
    small, large = min(args.days), max(args.days)
    print(f"  bytes a poll at {large:,} ÷ at {small:,} records: {results[large] / results[small]:.2f}  (target ≤ 1.5; "
          f"a whole rewrite: {large / small:g})")  # fmt: skip
    scrape_waits(args.scrape_ids, args.saves)


if __name__ == "__main__":
    main()
