"""The threads a billing client fetches its pages in."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from exporter.billing.workers import Workers
from tests.helpers import wait_for


def _named(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def test_work_waits_for_a_free_worker_and_a_shutdown_cancels_what_waits() -> None:
    workers = Workers(1, "w-cancel")
    release = threading.Event()
    first = workers.submit(lambda n: release.wait(10) and n, 1)
    second = workers.submit(lambda n: n, 2)
    wait_for(first.running)
    assert not second.running()
    assert len(_named("w-cancel")) == 1
    workers.shutdown()
    release.set()
    assert first.result(10) == 1
    assert second.cancelled()
    with pytest.raises(RuntimeError):
        workers.submit(lambda n: n, 3)
    wait_for(lambda: not _named("w-cancel"))


def test_a_lent_place_is_taken_by_another_thread_and_given_back() -> None:
    """The worker lending its place waits until the work behind it has been done by another; then
    one thread leaves, so that as many take work as before."""
    workers = Workers(1, "w-lend")
    done = threading.Event()

    def lender(n: int) -> bool:
        with workers.lending():
            return done.wait(10)

    lent = workers.submit(lender, 1)
    behind = workers.submit(lambda n: done.set() or n, 2)
    assert lent.result(10) is True
    assert behind.result(10) == 2
    wait_for(lambda: len(_named("w-lend")) == 1)
    assert workers.submit(lambda n: n + 1, 3).result(10) == 4
    workers.shutdown(wait=True)
    assert not _named("w-lend")


def test_lending_outside_a_worker_changes_nothing() -> None:
    workers = Workers(1, "w-outside")
    with workers.lending():
        assert workers.submit(lambda n: n, 1).result(10) == 1
    assert len(_named("w-outside")) == 1
    workers.shutdown(wait=True)


def test_an_exception_is_the_future_s_and_the_worker_goes_on() -> None:
    workers = Workers(1, "w-raise")
    failed = workers.submit(lambda n: 1 // (n - n), 1)
    with pytest.raises(ZeroDivisionError):
        failed.result(10)
    assert workers.submit(lambda n: n, 2).result(10) == 2
    workers.shutdown(wait=True)


class _FailingOnce(threading.Thread):
    """A thread whose first start fails, as at the system's limit of threads."""

    failed = False

    def start(self) -> None:
        if not _FailingOnce.failed:
            _FailingOnce.failed = True
            raise RuntimeError("can't start new thread")
        super().start()


def test_a_thread_that_could_not_be_started_takes_no_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """The work it was for fails at once (no thread would ever take it); the next work starts one."""
    from exporter.billing import workers as workers_module

    monkeypatch.setattr(workers_module, "threading", SimpleNamespace(**vars(threading) | {"Thread": _FailingOnce}))
    workers = Workers(1, "w-limit")
    with pytest.raises(RuntimeError):
        workers.submit(lambda n: n, 1)
    assert workers.submit(lambda n: n, 2).result(10) == 2
    workers.shutdown(wait=True)


def test_pages_that_all_lend_their_places_start_no_more_than_twice_the_threads() -> None:
    """Every page waits out the same hold (a Retry-After of its listing): a thread each would gain
    nothing."""
    workers = Workers(2, "w-cap")
    release = threading.Event()
    most = [0]

    def holding(n: int) -> int:
        with workers.lending():
            most[0] = max(most[0], len(_named("w-cap")))
            release.wait(10)
        return n

    futures = [workers.submit(holding, n) for n in range(12)]
    wait_for(lambda: len(_named("w-cap")) == 4)
    release.set()
    assert [f.result(10) for f in futures] == list(range(12))
    assert most[0] == 4
    workers.shutdown(wait=True)
