"""The cost of a backtest: six months of bills fetched from the simulator over HTTP and replayed
day by day through the alert engine (spend thresholds, a budget with tiers, spend_anomaly by
endpoint, by item and for the account).

python -m bench.backtest [--months 6]
"""

from __future__ import annotations

import argparse
import datetime as dt
import time

from exporter.config.load import validate
from exporter.core.clock import Clock, FrozenClock, periods_between
from exporter.replay.backtest import backtest
from exporter.sim import Simulator, SpendModel

TODAY = dt.datetime(2026, 11, 22, 12, 0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--months", type=int, default=6)
    args = parser.parse_args(argv)
    clock = Clock(now_fn=FrozenClock(TODAY.replace(tzinfo=Clock().tz)))
    sim = Simulator(clock=clock, spend=SpendModel(start=dt.date(2026, 1, 1)))
    server = sim.serve()
    periods = periods_between("2026-01", "2026-10")[-args.months :]
    rules = [
        {"alert": f"Anomaly{n}", "signal": "spend_anomaly", "by": by, "min_amount": "20", "min_percent": 30}
        for n, by in enumerate(([], ["endpoint_id"], ["item"]))
    ] + [
        {"alert": "DailyHigh", "signal": "spend", "by": ["endpoint_id"], "threshold": "160", "for": "10m"},
        {"alert": "Budget", "budget": "monthly", "tiers": [0.5, 0.8, 1.0]},
    ]
    config = validate(
        {
            "billing": {
                "url": server.url,
                "access_key_id": sim.access_key_id,
                "secret_access_key": sim.secret_access_key,
            },
            "budgets": [{"name": "monthly", "amount": "9000"}],
            "alerts": {"rules": rules},
        },
        {},
    )
    try:
        started = time.perf_counter()
        fired, _ = backtest(config, periods[0], periods[-1], clock)
        elapsed = time.perf_counter() - started
    finally:
        server.stop()
    span = f"{periods[0]} … {periods[-1]}, {len(rules)} rules, 3 months of history before"
    print(f"backtest of {len(periods)} months ({span}):")
    print(f"  {elapsed:.2f} s, {len(fired)} alerts would have fired  (target < 5 s)")


if __name__ == "__main__":
    main()
