"""Run every benchmark: `make bench` or `python -m bench`."""

from bench import (
    accounts,
    anomaly,
    backtest,
    chart,
    evaluation,
    faults,
    history,
    probe,
    reconcile,
    render,
    scaling,
    startup,
    state_writes,
    sync,
)

if __name__ == "__main__":
    sync.main([])
    render.main([])
    chart.main([])
    probe.main([])
    faults.main([])
    anomaly.main([])
    backtest.main([])
    reconcile.main([])
    history.main([])
    scaling.main([])
    evaluation.main([])
    state_writes.main([])
    startup.main([])
    accounts.main([])
