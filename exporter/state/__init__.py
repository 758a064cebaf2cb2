"""The state file: one SQLite file that outlives restarts, its lock, integrity checks and numbered
migrations, and the tables each owner keeps in it (usage cursors, history, settled days, probe
runs, alerts and the notification outboxes).
"""

from exporter.state.store import (
    LAYOUT,
    AlertStore,
    OutboxEntry,
    StateError,
    StateStore,
    UsageCursor,
    location_problem,
    peek,
)

__all__ = [
    "LAYOUT",
    "AlertStore",
    "OutboxEntry",
    "StateError",
    "StateStore",
    "UsageCursor",
    "location_problem",
    "peek",
]
