"""A day's request ids (`SeenIds`) as the day grows: the CPU time to add N and 10N random ids a page
at a time, to restore them as a restart does (the appended chunks of each poll, or the whole as
written), and the memory an id costs. Each should grow linearly: 10N takes 10 × N's time. Then a page's ids
made 64 bits: `id_digest` (XXH3) against the BLAKE2b digest it replaced.

The yardstick is a set of the same ids added a page at a time: a set's insert costs the same at any
size, so what it shows above 10 is the memory's own (the cache holds less of a larger day).

python -m bench.seen_ids [--ids 1000000] [--runs 3]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import random
import statistics
import time
import tracemalloc
from array import array
from collections.abc import Callable
from functools import partial

from exporter.sources.usage_aggregate import SeenIds, id_digest

PAGE_SIZE = 500
POLL_IDS = 1000
"""Ids each poll appended (usage_ids_added) in the restart from chunks."""


def add(digests: list[int]) -> SeenIds:
    seen = SeenIds()
    for at in range(0, len(digests), PAGE_SIZE):
        seen.add_digests(digests[at : at + PAGE_SIZE])
    return seen


def restore_chunks(chunks: list[bytes]) -> SeenIds:
    seen = SeenIds.from_bytes(chunks[0])
    for chunk in chunks[1:]:
        seen.extend(chunk)
    return seen


def blake2b_digest(request_id: str) -> int:
    """A request id's digest as versions before XXH3 made it."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "big")


def digest_page(digest: Callable[[str], int], pages: list[list[str]]) -> None:
    for page in pages:
        [digest(request_id) for request_id in page]


def add_to_set(digests: list[int]) -> set[int]:
    seen: set[int] = set()
    for at in range(0, len(digests), PAGE_SIZE):
        seen.update(digests[at : at + PAGE_SIZE])
    return seen


def timed(work: Callable[[], object], runs: int) -> float:
    """The median of `runs` CPU times (the machine's other work left out), a collection before each
    (so none is charged another's garbage)."""
    times = []
    for _ in range(runs):
        gc.collect()
        started = time.process_time()
        work()
        times.append(time.process_time() - started)
    return statistics.median(times)


def bytes_an_id(build: Callable[[], SeenIds], ids: int) -> float:
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        seen = build()
        size = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert seen.count == ids
    return size / ids


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ids", type=int, default=1_000_000, help="N: ids in the smaller day (the larger: 10N)")
    parser.add_argument("--runs", type=int, default=3, help="timings of each, the median printed")
    args = parser.parse_args(argv)
    rng = random.Random(1)
    sizes = (args.ids, 10 * args.ids)
    times: dict[str, dict[int, float]] = {"add": {}, "restore from chunks": {}, "restore whole": {}, "a set": {}}
    print(f"SeenIds: CPU seconds, median of {args.runs} runs; ids added {PAGE_SIZE} a page, restored from chunks "
          f"of {POLL_IDS} (or the whole)")  # fmt: skip
    for ids in sizes:
        digests = [rng.getrandbits(64) for _ in range(ids)]
        chunks = [array("Q", digests[at : at + POLL_IDS]).tobytes() for at in range(0, ids, POLL_IDS)]
        chunks[0] = array("Q", sorted(digests[:POLL_IDS])).tobytes()  # (the first, saved whole, is sorted)
        whole = b"".join(add(digests).chunks())
        times["add"][ids] = timed(partial(add, digests), args.runs)
        times["restore from chunks"][ids] = timed(partial(restore_chunks, chunks), args.runs)
        times["restore whole"][ids] = timed(partial(SeenIds.from_bytes, whole), args.runs)
        times["a set"][ids] = timed(partial(add_to_set, digests), args.runs)
        added = bytes_an_id(partial(add, digests), ids)
        restored = bytes_an_id(partial(SeenIds.from_bytes, whole), ids)
        print(f"  {ids:>11,} ids: " + ", ".join(f"{name} {t[ids]:.2f}" for name, t in times.items())
              + f"; {added:.1f} bytes an id added, {restored:.1f} restored")  # fmt: skip
        del digests, chunks, whole
    small, large = sizes
    for name, t in times.items():
        yardstick = "  (the yardstick)" if name == "a set" else ""
        print(f"  {name:>19}: {large:,} ÷ {small:,} ids: {t[large] / t[small]:5.1f}  (linear: 10){yardstick}")
    pages = [[f"req-{rng.getrandbits(64):016x}-{n:06d}" for n in range(PAGE_SIZE)] for _ in range(1000)]
    xxh3, blake2b = (timed(partial(digest_page, d, pages), args.runs) / len(pages) for d in (id_digest, blake2b_digest))
    print(f"a page's {PAGE_SIZE} request ids digested, CPU a page: id_digest (XXH3) {xxh3 * 1000:.3f} ms,"
          f" BLAKE2b {blake2b * 1000:.3f} ms; ratio {xxh3 / blake2b:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
