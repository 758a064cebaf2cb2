"""Usage sync: full-day time vs the ideal parallel time and the client's CPU a page vs a client
that only fetches and decodes the same signed pages, pages of an incremental poll in either
record order, memory.

python -m bench.sync [--records 200000] [--latency 0.05 0.02] [--runs 5] [--digest blake2b]

`--digest blake2b` counts with the request-id digest versions before XXH3 used, to see the
difference it makes (the full reads only; ids so digested are never saved).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from unittest.mock import patch

import msgspec
import requests

from bench.common import SimSettings, add_usage, client_for, peak_rss_mb, simulator
from exporter.billing import BillingClient, UsageRecord
from exporter.billing.api import USAGES_PATH
from exporter.core.clock import Clock
from exporter.sources import usage_aggregate
from exporter.sources.usage import UsageSync
from exporter.sources.usage_aggregate import Aggregate
from exporter.state import StateStore

PAGE_SIZE = 500
CONCURRENCY = 4


def fetch_only(url: str, client: BillingClient, pages: int) -> tuple[float, float]:
    """The reference: the same signed requests for the day's pages, `CONCURRENCY` in flight (one
    kept-alive session per thread, the environment read once and each body read in one piece as the
    client does), each body decoded as JSON and nothing else done with it.
    (seconds, CPU seconds)."""
    day = Clock().today().isoformat()
    local = threading.local()

    def fetch(page_num: int) -> int:
        if not hasattr(local, "session"):  # (as lean as the client's: the environment read once)
            local.session = requests.Session()
            local.session.auth = client._session.auth
            local.session.proxies, local.session.verify = client._session.proxies, client._session.verify
            local.session.trust_env = False
        params = {"date": day, "page_num": page_num, "page_size": PAGE_SIZE}
        response = local.session.get(url + USAGES_PATH, params=params, timeout=60, stream=True)
        body = b"".join(response.iter_content(None))  # (in one piece, as the client reads it)
        return len(msgspec.json.decode(body)["data"]["list"])

    started, cpu = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        assert sum(pool.map(fetch, range(1, pages + 1))) > 0
    return time.perf_counter() - started, time.process_time() - cpu


def full_day(records: int, latency: float, runs: int) -> None:
    """The full read and the fetch-only reference taken in turn `runs` times: medians of each."""
    pages = math.ceil(records / PAGE_SIZE)
    ideal = pages / CONCURRENCY * latency
    reads: list[tuple[float, float, float]] = []
    references: list[tuple[float, float]] = []
    with simulator(SimSettings(records=records, latency=latency)) as url, _counting() as counting:
        for _ in range(runs):
            client = client_for(url, page_size=PAGE_SIZE, concurrency=CONCURRENCY)
            reference, reference_cpu = fetch_only(url, client, pages)
            references.append((reference, reference_cpu / pages))
            calls: list[str] = []
            client._on_response = lambda api, code, calls=calls: calls.append(api)  # type: ignore[misc]
            sync = UsageSync(client, Clock(), StateStore(":memory:"), per_api_key=False)
            counting[0] = 0.0
            started, cpu = time.perf_counter(), time.process_time()
            snapshot = sync.refresh()
            elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
            assert snapshot.records == records, snapshot.records
            reads.append((elapsed, cpu / len(calls), counting[0] / len(calls)))
            client.close()
    elapsed, per_page, counting_per_page = (statistics.median(x) for x in zip(*reads, strict=True))
    reference, reference_per_page = (statistics.median(x) for x in zip(*references, strict=True))
    print(f"full-day sync at {latency * 1000:g} ms an answer: {records} records, {pages} pages, {elapsed:.2f}s;"
          f" ideal {ideal:.2f}s; fetch-only {reference:.2f}s (medians of {runs} runs, in turn)")  # fmt: skip
    print(f"  ratio full-day sync ÷ ideal parallel time: {elapsed / ideal:.2f}  (target ≤ 1.15); "
          f"fetch-only ÷ ideal: {reference / ideal:.2f}")  # fmt: skip
    paired = sorted(read[1] / reference[1] for read, reference in zip(reads, references, strict=True))
    print(f"  the client's CPU a page: {per_page * 1000:.1f} ms, fetch-only {reference_per_page * 1000:.1f} ms;"
          f" ratio, median of each run's to the fetch-only run beside it: {statistics.median(paired):.2f}"
          f" (from {paired[0]:.2f} to {paired[-1]:.2f})  (target ≤ 1.5)")  # fmt: skip
    rest = statistics.median(
        (read[1] - read[2]) / reference[1] for read, reference in zip(reads, references, strict=True)
    )
    print(f"  of the client's CPU a page, counting the records (`Aggregate.add`: ids digested and remembered,"
          f" sums) {counting_per_page * 1000:.1f} ms; the rest ÷ fetch-only: {rest:.2f}")  # fmt: skip


@contextmanager
def _counting() -> Iterator[list[float]]:
    """`Aggregate.add` made to add up the CPU time of the thread it runs in: [seconds]."""
    spent = [0.0]
    add = Aggregate.add

    def timed(self: Aggregate, records: Sequence[UsageRecord]) -> None:
        started = time.thread_time()
        add(self, records)
        spent[0] += time.thread_time() - started

    with patch.object(Aggregate, "add", timed):
        yield spent


def _blake2b(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def incremental_polls(records: int, latency: float, newest_first: bool, polls: int = 5, new: int = 1000) -> None:
    """Pages per incremental poll after `new` records, under one order, beside the naive full re-read."""
    order = "newest first" if newest_first else "oldest first"
    calls: list[str] = []
    with simulator(SimSettings(records=records, latency=latency, newest_first=newest_first)) as url:
        client = client_for(url, page_size=PAGE_SIZE, concurrency=CONCURRENCY)
        client._on_response = lambda api, code: calls.append(api)
        sync = UsageSync(client, Clock(), StateStore(":memory:"), per_api_key=False)
        expected = records
        sync.refresh()
        pages = []
        for _ in range(polls + 1):  # the first poll also finds out the order
            add_usage(url, new)
            expected += new
            calls.clear()
            snapshot = sync.refresh()
            assert snapshot.records == expected, (snapshot.records, expected)
            pages.append(len(calls))
        assert sync.newest_first == newest_first
        started = time.perf_counter()
        aggregate, _ = sync._full(Clock().today())  # a full read of the day in the order now known
        elapsed = time.perf_counter() - started
        assert aggregate.rows >= expected, (aggregate.rows, expected)
        client.close()
    ideal = math.ceil(expected / PAGE_SIZE) / CONCURRENCY * latency
    target = math.ceil(new / PAGE_SIZE) + 2
    naive = math.ceil(expected / PAGE_SIZE)
    print(f"records listed {order}: pages per poll after {new:,} new records on a {records:,}-record day")
    print(f"  first poll (finds out the order): {pages[0]}; then {', '.join(map(str, pages[1:]))}"
          f"  (target ≤ {target}; a naive full re-read: {naive})")  # fmt: skip
    print(f"  a full read of the day in that order ÷ ideal parallel time: {elapsed / ideal:.2f}")


def _child(records: int) -> None:
    """Run in a fresh process: one full sync, then report peak RSS."""
    with simulator(SimSettings(records=records)) as url:
        client = client_for(url, page_size=PAGE_SIZE, concurrency=CONCURRENCY)
        baseline = peak_rss_mb()
        snapshot = UsageSync(client, Clock(), StateStore(":memory:"), per_api_key=False).refresh()
        assert snapshot.records == records
        print(json.dumps({"records": records, "baseline_mb": baseline, "peak_mb": peak_rss_mb()}))


def memory(small: int, large: int) -> None:
    results = {}
    for records in (small, large):
        out = subprocess.run(
            [sys.executable, "-m", "bench.sync", "--child", str(records)], capture_output=True, text=True, check=True
        )
        results[records] = json.loads(out.stdout.strip().splitlines()[-1])
    growth = results[large]["peak_mb"] - results[small]["peak_mb"]
    print(
        f"peak RSS: {results[small]['peak_mb']:.1f} MB at {small} records, "
        f"{results[large]['peak_mb']:.1f} MB at {large} records"
    )
    print(f"  peak RSS at {large} minus at {small}: {growth:.1f} MB  (target ≤ 30 MB)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--latency", type=float, nargs="+", default=[0.05, 0.02], help="the full read at each")
    parser.add_argument("--runs", type=int, default=5, help="full reads (and fetch-only ones) at each latency")
    parser.add_argument("--memory", type=int, nargs=2, default=[100_000, 1_000_000], metavar=("SMALL", "LARGE"))
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--digest", choices=["xxh3", "blake2b"], default="xxh3", help="the request ids' digest")
    args = parser.parse_args(argv)
    if args.digest == "blake2b":
        patch.object(usage_aggregate, "xxh3_64_intdigest", _blake2b).start()  # (what `Aggregate.add` calls)
        for latency in args.latency:
            full_day(args.records, latency, args.runs)
        return
    if args.child:
        _child(args.child)
        return
    for latency in args.latency:
        full_day(args.records, latency, args.runs)
    for newest_first in (False, True):
        incremental_polls(args.records, args.latency[0], newest_first)
    memory(*args.memory)


if __name__ == "__main__":
    main()
