"""The state file: one SQLite file that outlives restarts, its lock, integrity checks and numbered
migrations, and the tables each owner keeps in it (usage cursors and sums, settled days, bill
history, probe runs, alerts and the notification outboxes).

Modules, each importing only those before it: `errors` (StateError), `lock` (`<path>.lock`),
`migrations` (SCHEMA, MIGRATIONS, LAYOUT), `file` (opening, integrity, transactions), one module
per owner's tables (`usage`, `settled`, `history`, `probes`, `alerts`), and `store` (StateStore,
which composes the owners' tables but the alerts', and `peek`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from exporter.state.alerts import AlertStore, OutboxEntry
    from exporter.state.errors import StateError
    from exporter.state.location import location_problem
    from exporter.state.migrations import LAYOUT
    from exporter.state.store import StateStore, peek, peek_account_files
    from exporter.state.usage import UsageCursor

_MODULES = {
    "AlertStore": "alerts",
    "OutboxEntry": "alerts",
    "StateError": "errors",
    "location_problem": "location",
    "LAYOUT": "migrations",
    "StateStore": "store",
    "peek": "store",
    "peek_account_files": "store",
    "UsageCursor": "usage",
}


def __getattr__(name: str) -> Any:
    """Each name is imported from its module when first asked for, so that importing one module of the
    package (`check` reads `location.location_problem`) does not load every owner's tables."""
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
    globals()[name] = value
    return value


__all__ = [
    "LAYOUT",
    "AlertStore",
    "OutboxEntry",
    "StateError",
    "StateStore",
    "UsageCursor",
    "location_problem",
    "peek",
    "peek_account_files",
]
