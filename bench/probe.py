"""Probe timing accuracy: measured time to first token minus the simulator's injected one, for each
stream framing (chunked, and a body that ends when the connection closes) and gap between tokens.

python -m bench.probe [--runs 50] [--ttft 0.2] [--gaps 5,50,200]
"""

from __future__ import annotations

import argparse
import statistics

from exporter.config.load import validate
from exporter.sim import Simulator
from exporter.sources.probe import ProbeRunner

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


if __name__ == "__main__":
    main()
