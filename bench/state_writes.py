"""Bytes the usage sync writes to its state file per poll, as the day grows: each poll appends the
request ids it found, so what it writes follows what it found, not the day's size.

python -m bench.state_writes [--days 10000 1000000] [--found 1000] [--polls 20]

The day is read in full from the simulator in process (no HTTP: nothing but the state file is
written), then `--polls` polls each find `--found` new records. Bytes written: the process's
`wchar` (/proc/self/io: every write, the WAL's frames and checkpoints included) over the polls,
÷ polls. The reference is the ids a poll found, 8 bytes each; the cursor, the day's totals and
SQLite's pages come on top, the same at any day size.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

from exporter.core.clock import Clock
from exporter.sim import Simulator
from exporter.sources.usage import UsageSync
from exporter.state import StateStore
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--days", type=int, nargs="+", default=[10_000, 1_000_000], help="records in the day")
    parser.add_argument("--found", type=int, default=1000, help="new records each poll finds")
    parser.add_argument("--polls", type=int, default=20)
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


if __name__ == "__main__":
    main()
