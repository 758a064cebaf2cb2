"""Probe timing accuracy: measured time to first token minus the simulator's injected one.

python -m bench.probe [--runs 50] [--ttft 0.2]
"""

from __future__ import annotations

import argparse
import statistics

from bench.common import SimSettings, simulator
from exporter.config import validate
from exporter.probe import ProbeRunner
from exporter.sim import DEFAULT_ENDPOINTS, Simulator


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--ttft", type=float, default=0.2)
    args = parser.parse_args(argv)
    with simulator(SimSettings(ttft=args.ttft, chunk_delay=0.01)) as url:
        config = validate(
            {
                "billing": {"url": url, "access_key_id": "x", "secret_access_key": "y"},
                "inference": {"url": url, "api_key": Simulator.api_key},
                "probes": [{"name": "bench", "model": DEFAULT_ENDPOINTS[0].endpoint_id}],
            },
            {},
        )
        assert config.inference is not None
        runner = ProbeRunner(config.probes[0], config.inference)
        errors = []
        for _ in range(args.runs):
            run = runner.run().last
            assert run.success, run.reason
            assert run.time_to_first_token is not None
            errors.append(run.time_to_first_token - args.ttft)
        runner.close()
    median = statistics.median(errors) * 1000
    print(f"probe time to first token vs injected {args.ttft * 1000:.0f} ms over {args.runs} runs:")
    spread = f"max {max(errors) * 1000:.2f} ms, min {min(errors) * 1000:.2f} ms"
    print(f"  median error: {median:.2f} ms  (target ≤ 5 ms); {spread}")


if __name__ == "__main__":
    main()
