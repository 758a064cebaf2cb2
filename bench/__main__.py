"""Run every benchmark: `make bench` or `python -m bench`."""

from bench import accounts, anomaly, backtest, chart, faults, probe, reconcile, render, sync

if __name__ == "__main__":
    sync.main([])
    render.main([])
    chart.main([])
    probe.main([])
    faults.main([])
    anomaly.main([])
    backtest.main([])
    reconcile.main([])
    accounts.main([])
