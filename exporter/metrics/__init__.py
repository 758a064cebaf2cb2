"""The Prometheus side: collectors over the snapshots, the alerts' series, and the prepared
exposition a scrape is served from.
"""
