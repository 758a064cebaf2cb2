"""`SeenIds` as its buckets are cut finer: every id stays found, forks and their bases cut apart
still agree, and what it writes and reads stays the sorted digests.

The buckets are cut by one more bit when they hold `BUCKET_IDS` ids on average; these tests lower
it to 2, so some thousands of ids cross several cuts.
"""

from __future__ import annotations

import random
from array import array

import pytest

from exporter.sources import usage_aggregate
from exporter.sources.usage_aggregate import FIRST_BITS, SeenIds

EDGES = [0, 1, (1 << 64) - 1, (1 << 63) - 1, 1 << 63]
"""Digests at the ends of the range and either side of its middle."""


@pytest.fixture(autouse=True)
def small_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(usage_aggregate, "BUCKET_IDS", 2)


def digests(count: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(count)]


def add_pages(seen: SeenIds, new: list[int], page: int = 500) -> None:
    for at in range(0, len(new), page):
        assert seen.add_digests(new[at : at + page]) == []


def written(views: list[memoryview]) -> list[int]:
    return list(array("Q", b"".join(views)))


def bits(seen: SeenIds) -> int:
    return len(seen._buckets).bit_length() - 1


def test_every_id_stays_found_as_the_buckets_are_cut_finer() -> None:
    ids = [*EDGES, *digests(40_000)]
    seen = SeenIds()
    cuts = set()
    for at in range(0, len(ids), 500):
        assert seen.add_digests(ids[at : at + 500]) == []
        cuts.add(bits(seen))
        assert all(d in seen for d in ids[: at + 500 : 97])
    assert cuts == {FIRST_BITS, 13, 14, 15}  # cut past 8,192, 16,384 and 32,768 ids
    assert seen.count == len(ids)
    assert all(d in seen for d in ids)
    assert not any(d in seen for d in digests(1_000, seed=2))
    assert written(seen.chunks()) == sorted(ids)
    assert written(seen.added()) == sorted(ids)


def test_repeats_are_named_by_position_before_and_after_a_cut() -> None:
    seen = SeenIds()
    first = digests(8_192)  # 2 << 12: one more and the buckets are cut
    add_pages(seen, first)
    assert bits(seen) == FIRST_BITS
    new = digests(3, seed=2)
    assert seen.add_digests([first[5], new[0], new[0], first[-1], new[1]]) == [0, 2, 3]
    assert bits(seen) == FIRST_BITS + 1
    assert seen.add_digests([new[1], new[2], first[0], new[0], new[2]]) == [0, 2, 3, 4]
    assert seen.count == 8_195
    assert not seen.add_digest(first[4_000])
    assert written(seen.chunks()) == sorted([*first, *new])


@pytest.mark.parametrize(
    ("days", "finds", "cut"),
    [(30_000, 300, (FIRST_BITS, 14)), (1_000, 20_000, (14, FIRST_BITS))],
    ids=["a poll's few ids against a large day: coarser than its base", "more than its base: cut finer"],
)
def test_a_fork_cut_apart_from_its_base(days: int, finds: int, cut: tuple[int, int]) -> None:
    """A fork is cut by its own ids, coarser or finer than its base; the two still agree."""
    day, found = digests(days), digests(finds, seed=2)
    base = SeenIds()
    add_pages(base, day)
    fork = base.fork()
    add_pages(fork, found)
    assert (bits(fork), bits(base)) == cut
    assert fork.add_digests([day[7], found[7], day[-1]]) == [0, 1, 2]
    assert fork.count == days + finds
    assert written(fork.added()) == sorted(found)
    assert written(fork.chunks()) == sorted([*day, *found])
    assert not any(d in base for d in found)  # the base is left as it was
    assert written(base.chunks()) == sorted(day)
    fork.settle()
    assert fork.base is None
    assert fork.count == days + finds
    assert bits(fork) == 14  # the base's, cut finer as the fork's ids went in where it had fewer
    assert all(d in fork for d in [*day, *found])
    assert written(fork.chunks()) == sorted([*day, *found])


def test_a_fork_of_a_fork_across_cuts() -> None:
    day, first, second = digests(20_000), digests(9_000, seed=2), digests(100, seed=3)
    base = SeenIds()
    add_pages(base, day)
    fork = base.fork()
    add_pages(fork, first)
    again = fork.fork()
    add_pages(again, second)
    assert [bits(s) for s in (base, fork, again)] == [14, 13, FIRST_BITS]
    assert again.add_digests([day[1], first[1], second[1]]) == [0, 1, 2]
    assert written(again.chunks()) == sorted([*day, *first, *second])
    again.settle()
    assert written(again.chunks()) == sorted([*day, *first, *second])
    assert again.count == 29_100


def test_a_full_reads_fork_is_cut_as_it_grows_and_settles_into_its_own_ids() -> None:
    ids = digests(20_000)
    fork = SeenIds().fork()
    add_pages(fork, ids)
    assert bits(fork) == 14
    fork.settle()
    assert fork.base is None
    assert fork.count == 20_000
    assert written(fork.chunks()) == sorted(ids)
    assert fork.add_digests(ids[:3]) == [0, 1, 2]


def test_what_is_written_is_read_back_whole_or_in_appended_chunks() -> None:
    day, polls = [*EDGES, *digests(20_000)], [digests(700, seed=s) for s in range(2, 12)]
    seen = SeenIds()
    add_pages(seen, day)
    whole = b"".join(seen.chunks())
    assert whole == array("Q", sorted(day)).tobytes()  # the layout every version writes and reads
    appended = []
    for found in polls:
        fork = seen.fork()
        add_pages(fork, found)
        appended.append(b"".join(fork.added()))
        fork.settle()
        seen = fork
    restored = SeenIds.from_bytes(whole)
    assert bits(restored) == bits(SeenIds.from_bytes(whole[: 8 * 8_192])) + 2  # cut for its size at once
    for chunk in appended:
        restored.extend(chunk)
    everything = sorted({*day, *(d for found in polls for d in found)})
    assert restored.count == seen.count == len(everything)
    assert written(restored.chunks()) == written(seen.chunks()) == everything
    assert all(d in restored for d in everything)
    restored.extend(appended[0] + b"".join(seen.chunks()))  # all of them known already
    assert restored.count == len(everything)


def test_one_large_appended_chunk_is_cut_as_it_goes_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """(A full read appends all its ids in one chunk when the day had none.)"""
    ids = digests(30_000)
    seen = SeenIds.from_bytes(b"")
    cuts = []
    add_digests = SeenIds.add_digests

    def add_counting_cuts(self: SeenIds, new: list[int]) -> list[int]:
        cuts.append(bits(self))
        return add_digests(self, new)

    monkeypatch.setattr(SeenIds, "add_digests", add_counting_cuts)
    seen.extend(array("Q", ids).tobytes())
    assert cuts[0] == FIRST_BITS
    assert cuts[-1] == 14
    assert bits(seen) == 14
    assert seen.count == 30_000
    assert written(seen.chunks()) == sorted(ids)


def test_data_that_is_no_whole_number_of_digests_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of item size"):
        SeenIds.from_bytes(b"\x00" * 12)
    assert SeenIds.from_bytes(b"").count == 0


def test_a_whole_out_of_order_is_refused() -> None:
    """A damaged list, here its first and last ids swapped, is refused (the day is then read
    afresh) rather than cut into buckets by the order it is in: all of it went to the last id's
    bucket, where almost none of its ids is looked for, and the count, intact, did not show it."""
    ids = sorted(digests(100_000))
    ids[0], ids[-1] = ids[-1], ids[0]
    with pytest.raises(ValueError, match="out of order"):
        SeenIds.from_bytes(array("Q", ids).tobytes())
