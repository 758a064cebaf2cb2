"""One module per refreshed source: usage (the per-request sync), bills, history, reconciliation,
budgets, the latency probe. Each turns what the API answers into a snapshot.
"""
