"""A simulator in its own process (so its CPU does not share our GIL), a client for it, and timing."""

from __future__ import annotations

import datetime as dt
import gc
import multiprocessing
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import requests

from exporter.billing import BillingClient
from exporter.config.load import validate
from exporter.core.clock import Clock
from exporter.sim import Endpoint, Simulator, SpendModel


@dataclass(frozen=True)
class SimSettings:
    records: int = 0
    latency: float = 0.0
    endpoints: int = 0
    ttft: float = 0.0
    chunk_delay: float = 0.0
    failure_rate: float = 0.0
    newest_first: bool = False
    stream_framing: str = "chunked"
    spend_start: str = ""
    """Bills from this day (YYYY-MM-DD) on, modelled (`SpendModel`); none before today without it."""


def _serve(settings: SimSettings, urls: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    sim = Simulator(
        latency=settings.latency,
        time_to_first_token=settings.ttft,
        chunk_delay=settings.chunk_delay,
        failure_rate=settings.failure_rate,
        newest_first=settings.newest_first,
        stream_framing=settings.stream_framing,
    )
    if settings.endpoints:
        sim.endpoints = tuple(
            Endpoint(f"ep-{n:04d}", f"model-{n % 7}", f"proj-{n % 3}") for n in range(settings.endpoints)
        )
    if settings.spend_start:
        sim.spend = SpendModel(start=dt.date.fromisoformat(settings.spend_start))
    sim.add_usage(settings.records)
    server = sim.serve()
    urls.put(server.url)
    while True:
        time.sleep(3600)


@contextmanager
def simulator(settings: SimSettings) -> Iterator[str]:
    context = multiprocessing.get_context("spawn")
    urls: multiprocessing.Queue = context.Queue()  # type: ignore[type-arg]
    process = context.Process(target=_serve, args=(settings, urls), daemon=True)
    process.start()
    try:
        yield urls.get(timeout=60)
    finally:
        process.terminate()
        process.join(10)


def client_for(url: str, **billing: object) -> BillingClient:
    config = validate(
        {
            "billing": {
                "url": url,
                "access_key_id": Simulator.access_key_id,
                "secret_access_key": Simulator.secret_access_key,
                "timeout": "60s",
            }
            | billing
        },
        {},
    )
    return BillingClient.from_config(config.billing, Clock())


def add_usage(url: str, count: int) -> None:
    requests.post(f"{url}/_sim/usage", json={"count": count}, timeout=60).raise_for_status()


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def median_seconds(work: Callable[[], object], repeat: int = 3) -> float:
    """The median wall time of `repeat` runs of `work`."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def calls_made(work: Callable[[], object]) -> int:
    """The function calls, the interpreter's and C's, that `work` makes in this thread: how the
    work grows, whatever the processor's caches hold and however busy the machine is (a count,
    the same from run to run, where a time ratio over linear may be the caches'). What one C
    call does inside (a database query, a sort) counts once: there the time ratio tells."""
    made = 0

    def profile(frame: object, event: str, arg: object) -> None:
        nonlocal made
        if event == "call" or event == "c_call":
            made += 1

    sys.setprofile(profile)
    try:
        work()
    finally:
        sys.setprofile(None)
    return made


T = TypeVar("T")


def fastest(work: Callable[[], T], repeat: int) -> tuple[float, T]:
    """The fastest wall time of `repeat` runs of `work`, each after a collection (so none is charged
    another's garbage), and what the last run gave."""
    times = []
    for _ in range(repeat):
        gc.collect()
        started = time.perf_counter()
        made = work()
        times.append(time.perf_counter() - started)
    return min(times), made
