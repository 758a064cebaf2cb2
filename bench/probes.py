"""Synthetic probes at P and at 10 × P: a round, in which each probe runs once and, as the daemon does after
each run, its snapshot is published and the exposition prepared; then a gzipped OpenMetrics scrape, as
Prometheus makes it, after one more run. Each from snapshots made here (no probe request is sent), `--repeat`
times, and the fastest taken: what else runs on the machine only ever adds to a time.

A round must take time in proportion to the probes (time ratio ≈ 10): a run renders its own probe's series,
not every probe's (which made a round cost P², a ratio of about 100). A scrape joins every probe's series and
compresses them, so it too grows in proportion, and once per scrape, however many runs came between.

python -m bench.probes [--probes 20] [--rounds 3] [--repeat 5]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import logging
import time

from bench.common import fastest
from exporter.app.account import build_exposition
from exporter.config.load import validate
from exporter.core.clock import Clock
from exporter.metrics.exposition import OPENMETRICS_ACCEPT
from exporter.model.snapshots import Histogram, Latest, ProbeRun, ProbeSnapshot

BOUNDS = (0.1, 0.25, 0.5, 1.0, 2.0, 2.5, 5.0, 10.0, float("inf"))
"""The time to first token's buckets (`sources.probe`)."""


def _snapshot(name: str, runs: int) -> ProbeSnapshot:
    """A streamed run with every timing and check, after `runs` runs: each run's figures differ."""
    last = ProbeRun(True, None, {"status": True, "json": True}, 0.4 + runs / 1000, 0.1, 0.2, None, 0.2, 0.05, 10, 20,
                    30.0 + runs)  # fmt: skip
    histogram = Histogram(BOUNDS, tuple(runs + n for n in range(len(BOUNDS))), 0.3 * runs)
    return ProbeSnapshot(name, f"ep-{name}", "chat", last, runs, {"timeout": 1}, {"prompt": 10 * runs}, histogram,
                         histogram)  # fmt: skip


def measure(probes: int, rounds: int, repeat: int) -> tuple[float, float, int]:
    """(seconds a round takes, seconds a gzipped scrape after a run takes, the scrape's bytes)."""
    config = validate({"billing": {"url": "https://billing.invalid", "access_key_id": "a", "secret_access_key": "s"}},
                      {})  # fmt: skip
    latest = Latest()
    exposition = build_exposition(config, latest, Clock())
    names = [f"probe-{n:04d}" for n in range(probes)]
    for name in names:
        latest.publish_probe(_snapshot(name, 0))
    exposition.prepare()
    runs = itertools.count(1)

    def some_rounds() -> None:
        for _ in range(rounds):
            run = next(runs)
            for name in names:
                latest.publish_probe(_snapshot(name, run))
                exposition.prepare()

    def scrape_after_a_run() -> float:
        latest.publish_probe(_snapshot(names[0], next(runs)))
        exposition.prepare()
        gc.collect()
        started = time.perf_counter()
        exposition.render(OPENMETRICS_ACCEPT, gzipped=True)
        return time.perf_counter() - started

    round_time = fastest(some_rounds, repeat)[0] / rounds
    scrape = min(scrape_after_a_run() for _ in range(repeat))
    return round_time, scrape, len(exposition.render(OPENMETRICS_ACCEPT, gzipped=True)[0])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--probes", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    small, large = args.probes, 10 * args.probes
    print(f"probe rounds (each probe runs once: publish + prepare), {args.rounds} rounds a time; a gzipped "
          f"OpenMetrics scrape after a run; fastest of {args.repeat}")  # fmt: skip
    results = {}
    for probes in (small, large):
        results[probes] = round_time, scrape, size = measure(probes, args.rounds, args.repeat)
        print(f"  {probes:,} probes: a round {round_time * 1000:.0f} ms, a scrape {scrape * 1000:.1f} ms "
              f"({size:,} bytes)")  # fmt: skip
    (round_small, scrape_small, _), (round_large, scrape_large, _) = results[small], results[large]
    print(f"  {large:,} ÷ {small:,}: round {round_large / round_small:.1f} (linear: 10), "
          f"scrape {scrape_large / scrape_small:.1f} (linear: 10)")  # fmt: skip


if __name__ == "__main__":
    main()
