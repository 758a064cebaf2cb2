"""`backfill`'s file, and what promtool needs to make blocks of it, as months and endpoints grow:
bill series an hour apart (read through `last_over_time(…[1h])`) against the same months as a
Prometheus scraping every 5 minutes stores them (the layout before, read without a window); and
the same hourly series as `--output-dir` writes them, a file for each of promtool's blocks, each
loaded by a promtool of its own.

python -m bench.backfill [--months 3 6] [--endpoints 3 30] [--no-promtool]

The months are the simulator's modelled bills (3 billing items, `SpendModel`), fetched in process
and written with `job` and `instance` labels, as docs/backfill.md's example. For each size: the file's
bytes and samples, and, when `promtool` is on the PATH, its `tsdb create-blocks-from openmetrics
--max-block-duration=486h` wall time and peak memory (for a directory: the sum of its files' times,
the largest of their peaks). Ratios: before ÷ now at the smallest size (the target is ≥ 10 for the
file), and each size's output against the smallest's beside the ratios of their series and
samples (linear: no more than those; a month's day series hold more samples the longer the month,
so bytes follow the samples). promtool reads one file once for its times and again for each
block it makes of it, so its time grows faster than the series; a file a block it reads twice,
whatever the range.
"""

from __future__ import annotations

import argparse
import datetime as dt
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from zoneinfo import ZoneInfo

from exporter.core.clock import Clock, FrozenClock, first_day, periods_between
from exporter.replay.backfill import CALENDAR_STEP, STEP, _Calendar, fetch, outputs, render, replacing_all
from exporter.sim import Endpoint, Simulator, SpendModel
from tests.fakes import FakeBilling

TARGET = 10.0
LABELS = (("job", "inference-cost-exporter"), ("instance", "inference-cost-exporter:9877"))
MEASURE = (
    "import resource, subprocess, sys\n"
    "subprocess.run(sys.argv[1:], check=True, capture_output=True)\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
)
"""promtool in a process of its own, whose children's peak resident set is promtool's alone."""


def _write(path: Path, months: int, endpoints: int, step: int, split: bool = False) -> tuple[list[Path], int, int]:
    """`months` months ending last month, for `endpoints` endpoints, to `path`, or as `--output-dir`
    cuts them into the directory `path`; (the files, series, samples)."""
    tz = ZoneInfo("Asia/Shanghai")
    today = dt.date(2026, 11, 20)
    clock = Clock(tz, FrozenClock(dt.datetime(2026, 11, 20, 12, tzinfo=tz)))
    sim = Simulator(clock=clock)
    sim.endpoints = tuple(Endpoint(f"ep-{n:04d}", f"model-{n % 7}", f"proj-{n % 3}") for n in range(endpoints))
    first = first_day(clock.period(today))
    for _ in range(months):
        first = first_day(clock.period(first - dt.timedelta(days=1)))
    sim.spend = SpendModel(start=first)
    last = clock.period(first_day(clock.period(today)) - dt.timedelta(days=1))
    periods = periods_between(clock.period(first), last)
    found, _ = fetch(FakeBilling(sim), periods)
    calendar = _Calendar(clock, 3)
    span = (calendar.at(first), calendar.at(first_day(clock.period(today))))
    paths, cuts = outputs(path, *span, directory=split)
    if split:
        path.mkdir()
    with replacing_all(paths) as (out, *more):
        cut = list(zip(cuts, more, strict=True))
        return paths, *render(out, found, calendar, span, history=False, target=LABELS, step=step, cuts=cut)


def _promtool(promtool: str, path: Path, blocks: Path) -> tuple[float, int]:
    """(seconds, peak kB) for promtool to make blocks of `path`."""
    command = [
        promtool,
        "tsdb",
        "create-blocks-from",
        "openmetrics",
        "--max-block-duration=486h",
        str(path),
        str(blocks),
    ]
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", MEASURE, *command], check=True, capture_output=True, text=True)
    return time.perf_counter() - started, int(done.stdout.split()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--months", type=int, nargs="+", default=[3, 6])
    parser.add_argument("--endpoints", type=int, nargs="+", default=[3, 30])
    parser.add_argument("--no-promtool", action="store_true")
    args = parser.parse_args(argv)
    promtool = None if args.no_promtool else shutil.which("promtool")
    sizes = [(m, args.endpoints[0]) for m in args.months] + [(args.months[-1], e) for e in args.endpoints[1:]]
    layouts = {"now (1 h)": (STEP, False), "a file a block": (STEP, True), "before (5 min)": (CALENDAR_STEP, False)}
    print(f"backfill: 3 billing items, labels {', '.join(k for k, _ in LABELS)}; promtool {promtool or 'absent'}")
    print(
        f"{'layout':<15} {'months':>6} {'endpoints':>9} {'series':>7} {'files':>5} {'MB':>9} {'samples':>11} "
        f"{'promtool s':>10} {'peak MB':>8}"
    )
    results: dict[tuple[str, int, int], tuple[int, float, int, int, int]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, (step, split) in layouts.items():
            for months, endpoints in sizes if not name.startswith("before") else sizes[:1]:
                paths, series, samples = _write(Path(scratch) / "backfill", months, endpoints, step, split)
                size, seconds, peak = sum(p.stat().st_size for p in paths), 0.0, 0
                if promtool:
                    for path in paths:
                        took, most = _promtool(promtool, path, Path(scratch) / "blocks")
                        seconds, peak = seconds + took, max(peak, most)
                shutil.rmtree(Path(scratch) / "blocks", ignore_errors=True)
                shutil.rmtree(Path(scratch) / "backfill") if split else paths[0].unlink()
                results[name, months, endpoints] = (size, seconds, peak, series, samples)
                shown = f"{seconds:>10.1f} {peak / 1024:>8.0f}" if promtool else f"{'—':>10} {'—':>8}"
                print(
                    f"{name:<15} {months:>6} {endpoints:>9} {series:>7,} {len(paths):>5} {size / 1e6:>9.1f}"
                    f" {samples:>11,} {shown}"
                )
    months, endpoints = sizes[0]
    now, before = results["now (1 h)", months, endpoints], results["before (5 min)", months, endpoints]
    verdict = "met" if before[0] / now[0] >= TARGET else "NOT met"
    print(f"before ÷ now at {months} month(s) × {endpoints} endpoints: bytes {before[0] / now[0]:.1f}", end="")
    if promtool:
        print(f", promtool time {before[1] / now[1]:.1f}, peak memory {before[2] / now[2]:.1f}", end="")
    print(f" (target ≥ {TARGET:.0f} for bytes: {verdict})")
    for name in ("now (1 h)", "a file a block"):
        smallest = results[name, months, endpoints]
        for m, e in sizes[1:]:
            size, seconds, peak, series, samples = results[name, m, e]
            timing = (
                f", promtool time {seconds / smallest[1]:.2f}, peak memory {peak / smallest[2]:.2f}" if promtool else ""
            )
            print(
                f"{name} at {m} month(s) × {e} endpoints ÷ the smallest: bytes {size / smallest[0]:.2f}{timing}"
                f" (series {series / smallest[3]:.2f}, samples {samples / smallest[4]:.2f}: linear is no more)"
            )


if __name__ == "__main__":
    main()
