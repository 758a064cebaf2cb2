"""Run every benchmark: `make bench` or `python -m bench`."""

from bench import (
    accounts,
    anomaly,
    backfill,
    backtest,
    chart,
    evaluation,
    faults,
    forecast,
    growth,
    history,
    landing,
    probe,
    probes,
    reconcile,
    render,
    scaling,
    seen_ids,
    startup,
    state_writes,
    sync,
)

if __name__ == "__main__":
    sync.main([])
    render.main([])
    chart.main([])
    probe.main([])
    probes.main([])
    faults.main([])
    anomaly.main([])
    forecast.main([])
    backtest.main([])
    backfill.main([])
    reconcile.main([])
    history.main([])
    scaling.main([])
    seen_ids.main([])
    evaluation.main([])
    growth.main([])
    landing.main([])
    state_writes.main([])
    startup.main([])
    accounts.main([])
