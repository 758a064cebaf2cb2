"""Benchmarks: each prints ratios measured in one run (never absolute targets in tests)."""
