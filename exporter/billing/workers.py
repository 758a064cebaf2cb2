"""The threads a client fetches its pages in: `Workers`."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager, suppress
from queue import Empty, SimpleQueue
from typing import Any, TypeVar

R = TypeVar("R")

_Work = tuple[Future[Any], Callable[[int], Any], int]


class Workers:
    """`size` threads taking work in turn (started as work comes), as an executor's would; a worker
    waiting out a retry's backoff lends its place (`lending`) to another thread meanwhile, so that
    the other pages keep flowing, and leaves once its own page is done if the places are taken.

    So there are no more threads taking work than requests that may be in flight: a thread that took
    a page only to wait for a request slot cost 0.2 ms of CPU a page in handing the interpreter lock
    around (`bench.sync`), and an executor of more threads than slots, which kept pages flowing
    through a backoff, had that many."""

    def __init__(self, size: int, name: str) -> None:
        self._size = max(1, size)
        self._name = name
        self._work: SimpleQueue[_Work | None] = SimpleQueue()
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._taking = 0
        """Threads that take work: those running, less those lending their place."""
        self._started = 0
        self._shut = False

    def submit(self, fn: Callable[[int], R], arg: int) -> Future[R]:
        """`fn(arg)` in a worker; RuntimeError once shut down (as an executor's)."""
        future: Future[R] = Future()
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot submit work once shut down")
            self._work.put((future, fn, arg))
            try:
                self._fill()
            except RuntimeError:  # (no thread could be started: the system's limit)
                if self._taking == 0:  # none would ever take it
                    future.cancel()
                    raise
        return future

    @contextmanager
    def lending(self) -> Iterator[None]:
        """While in it, this thread's place (if it is a worker) goes to another thread."""
        with self._lock:
            lent = threading.current_thread() in self._threads
            if lent:
                self._taking -= 1
                with suppress(RuntimeError):  # (no thread could be started: the others go on meanwhile)
                    self._fill()
        try:
            yield
        finally:
            if lent:
                with self._lock:
                    self._taking += 1  # (one too many now, until a worker leaves: `_run`)

    def shutdown(self, wait: bool = False) -> None:
        """No more work: what waits is cancelled, and each worker leaves once its page is done (all
        have left when this returns, with `wait`)."""
        with self._lock:
            self._shut = True
            threads = list(self._threads)
        while True:
            try:
                work = self._work.get_nowait()
            except Empty:
                break
            if work is not None:
                work[0].cancel()
        for _ in threads:
            self._work.put(None)
        if wait:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()

    def _fill(self) -> None:
        """A thread more while places are free and work waits, and fewer than twice `size` threads
        live: pages that all wait out one `Retry-After` lend their places in turn (the lock held).
        A thread that cannot be started (RuntimeError: the system's limit) takes no place."""
        if (
            self._taking < self._size
            and not self._shut
            and not self._work.empty()
            and len(self._threads) < 2 * self._size
        ):
            self._started += 1
            thread = threading.Thread(target=self._run, name=f"{self._name}_{self._started}", daemon=True)
            thread.start()  # (it waits for the lock held here before it takes anything)
            self._taking += 1
            self._threads.add(thread)

    def _run(self) -> None:
        me = threading.current_thread()
        try:
            while True:
                with self._lock:
                    if self._taking > self._size:  # (a lent place taken back while another holds it)
                        self._taking -= 1
                        return
                work = self._work.get()
                if work is None:
                    with self._lock:
                        self._taking -= 1
                    return
                _do(*work)
                del work  # (its result is the reader's, not this thread's to hold while it waits)
        finally:
            with self._lock:
                self._threads.discard(me)


def _do(future: Future[Any], fn: Callable[[int], Any], arg: int) -> None:
    if not future.set_running_or_notify_cancel():  # (cancelled while it waited)
        return
    try:
        result = fn(arg)
    except BaseException as error:
        future.set_exception(error)
    else:
        future.set_result(result)
