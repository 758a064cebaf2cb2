"""Command start-up: `--version`, `check` and `rules` on the example config, each against a bare
interpreter (`python -c pass`), medians of `--runs` runs taken in turn in one run.

python -m bench.startup [--runs 15]

Bytecode is kept in a cache of the benchmark's own (as an installed package has it) and every
command runs once before the timed runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "config.example.yaml"
TARGET = 3.0


def _commands() -> dict[str, list[str]]:
    exporter = [sys.executable, "-m", "exporter.cli"]
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        "--version": [*exporter, "--version"],
        "check": [*exporter, "check", "--config", str(EXAMPLE)],
        "rules": [*exporter, "rules", "--config", str(EXAMPLE)],
    }


def _example_env(env: dict[str, str]) -> dict[str, str]:
    """The example config's ${VARIABLES}, set to placeholders so that it validates."""
    from exporter.config.load import REFERENCE  # (the benchmark's own process: not timed)

    names = {name for _, name in REFERENCE.findall(EXAMPLE.read_text()) if name}
    return env | {name: env.get(name, "placeholder-" + name.lower()) for name in names}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args(argv)
    commands = _commands()
    with tempfile.TemporaryDirectory() as cache:
        env = _example_env(dict(os.environ, PYTHONPYCACHEPREFIX=cache))
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        for command in commands.values():  # compile once, as an install does
            subprocess.run(command, env=env, cwd=ROOT, check=True, capture_output=True)
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.runs):
            for name, command in commands.items():
                started = time.perf_counter()
                subprocess.run(command, env=env, cwd=ROOT, check=True, capture_output=True)
                times[name].append(time.perf_counter() - started)
    bare = statistics.median(times["python -c pass"])
    print(f"command start-up, median of {args.runs} runs (wall time, bytecode cached)")
    print(f"  python -c pass: {bare * 1000:.0f} ms")
    for name in list(commands)[1:]:
        median = statistics.median(times[name])
        print(f"  {name}: {median * 1000:.0f} ms; ÷ bare interpreter {median / bare:.1f}  (target ≤ {TARGET:g})")


if __name__ == "__main__":
    main()
