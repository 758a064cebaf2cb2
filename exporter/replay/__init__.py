"""Commands over the account's past, run without the daemon: `backtest` (the rules replayed over
past months) and `backfill` (past bills as Prometheus blocks).
"""

MAX_MONTHS = 24
"""The most months `backfill` and `backtest` take at once (`backfill.check_range`). Each month costs
a few bills requests (and a backfill some 30 MB of file per endpoint and item), so a slip such as
`--from 2000-01` would make well over a thousand: such a range is refused before the first."""
