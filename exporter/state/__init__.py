"""The state file: one SQLite file that outlives restarts, its lock, integrity checks and numbered
migrations, and the tables each owner keeps in it (usage cursors and sums, settled days, bill
history, probe runs, alerts and the notification outboxes).

Modules, each importing only those before it: `errors` (StateError), `lock` (`<path>.lock`),
`migrations` (SCHEMA, MIGRATIONS, LAYOUT), `file` (opening, integrity, transactions), one module
per owner's tables (`usage`, `settled`, `history`, `probes`, `alerts`), and `store` (StateStore,
which composes the owners' tables but the alerts', and `peek`).
"""

from exporter.state.alerts import AlertStore, OutboxEntry
from exporter.state.errors import StateError
from exporter.state.file import location_problem
from exporter.state.migrations import LAYOUT
from exporter.state.store import StateStore, peek
from exporter.state.usage import UsageCursor

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
