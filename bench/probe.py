"""Probe timing accuracy: measured time to first token minus the simulator's injected one, for each
stream framing (chunked, and a body that ends when the connection closes) and gap between tokens.
Then a stream line arriving a few bytes at a time: the CPU time to read 1 MB of it ÷ 256 kB (each
piece looked through once: linear, 4).

python -m bench.probe [--runs 50] [--ttft 0.2] [--gaps 5,50,200]
"""

from __future__ import annotations

import argparse
import statistics
import time

from exporter.config.load import validate
from exporter.sim import Simulator
from exporter.sources.probe import ProbeRunner
from exporter.sources.probe_answer import sse_events

FRAMINGS = ("chunked", "close")
TARGET_MS = 5.0


def first_token_errors(framing: str, ttft: float, gap: float, runs: int) -> list[float]:
    """Measured minus injected time to first token, in seconds, one per run.

    The simulator runs in this process (it has no setting for the framing across processes); it
    sleeps between events, so it takes the GIL only to write one.
    """
    sim = Simulator(time_to_first_token=ttft, chunk_delay=gap, stream_framing=framing)
    server = sim.serve()
    try:
        config = validate(
            {
                "billing": {"url": server.url, "access_key_id": "x", "secret_access_key": "y"},
                "inference": {"url": server.url, "api_key": sim.api_key},
                "probes": [{"name": "bench", "model": sim.endpoints[0].endpoint_id}],
            },
            {},
        )
        assert config.inference is not None
        runner = ProbeRunner(config.probes[0], config.inference)
        errors = []
        try:
            for _ in range(runs):
                run = runner.run().last
                assert run.success, run.reason
                assert run.time_to_first_token is not None
                errors.append(run.time_to_first_token - ttft)
        finally:
            runner.close()
        return errors
    finally:
        server.stop()


def long_line(size: int, piece: int = 20) -> float:
    """CPU seconds to read one `data:` line of `size` bytes sent `piece` bytes at a time, the best of 3."""
    line = b"data: " + b"x" * (size - 8) + b"\n\n"
    pieces = [line[at : at + piece] for at in range(0, len(line), piece)]
    times = []
    for _ in range(3):
        started = time.process_time()
        (event,) = sse_events(pieces)
        times.append(time.process_time() - started)
        assert len(event) == size - 8
    return min(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--ttft", type=float, default=0.2)
    parser.add_argument("--gaps", default="5,50,200", help="milliseconds between tokens, comma-separated")
    args = parser.parse_args(argv)
    gaps = [float(gap) / 1000 for gap in args.gaps.split(",")]
    print(f"probe time to first token vs injected {args.ttft * 1000:.0f} ms, {args.runs} runs per row:")
    for framing in FRAMINGS:
        medians = []
        for gap in gaps:
            errors = [error * 1000 for error in first_token_errors(framing, args.ttft, gap, args.runs)]
            medians.append(statistics.median(errors))
            print(f"  {framing:<7} {gap * 1000:>4.0f} ms between tokens: median error {medians[-1]:7.2f} ms; "
                  f"max {max(errors):.2f} ms, min {min(errors):.2f} ms")  # fmt: skip
        verdict = "met" if max(medians) <= TARGET_MS else "MISSED"
        print(f"  {framing:<7} worst median error: {max(medians):.2f} ms  (target ≤ {TARGET_MS:.0f} ms: {verdict})")
    small, large = long_line(256 * 1024), long_line(1024 * 1024)
    print(f"a stream line in 20-byte pieces: 1 MB in {large * 1000:.0f} ms, 256 kB in {small * 1000:.0f} ms;"
          f" ratio {large / small:.1f}  (linear: 4)")  # fmt: skip


if __name__ == "__main__":
    main()
