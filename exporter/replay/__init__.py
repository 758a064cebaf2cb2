"""Commands over the account's past, run without the daemon: `backtest` (the rules replayed over
past months) and `backfill` (past bills as Prometheus blocks).
"""
