"""inference-cost-exporter: bills, token usage, budgets and endpoint probes as Prometheus metrics."""

__version__ = "0.1.0"
