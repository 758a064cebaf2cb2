"""The names sources refresh under, shared by the snapshots, the alert signals and the config's
checks (which load without the snapshots' classes)."""

PROBE_PREFIX = "probe:"
BILLING_SOURCES = ("bills", "usage", "history")
"""The sources that read the billing API (the probes ask the inference API)."""


def probe_source(name: str) -> str:
    """The source name a probe refreshes as (`probe:NAME`): health, scheduling and alert rules use it."""
    return PROBE_PREFIX + name
