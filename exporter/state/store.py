"""`StateStore`: the state file with the tables of the usage sync, the reconciliation, the bill
history, the probe and the accounts' names, one class per owner's tables in a module of its own (the alerts' and the
outboxes' are `AlertStore`'s, on the same store); and `peek`, which reads a state file beside the
daemon that has it open."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from exporter.core.logs import get_logger
from exporter.state.accounts import AccountFile, AccountTables, read_account_files
from exporter.state.alerts import read_alert_states
from exporter.state.file import connect_existing
from exporter.state.history import HistoryTable
from exporter.state.probes import ProbeTable, read_probe_runs
from exporter.state.settled import SettledTables
from exporter.state.usage import UsageTables

log = get_logger(__name__)


class StateStore(UsageTables, SettledTables, HistoryTable, ProbeTable, AccountTables):
    """The state file (see `StateFile`: one exporter at a time, checked, migrated and kept at its
    path) with every owner's tables but the alerts'. Opened once by the exporter and handed to
    each owner; `AlertStore(store)` reads and writes the alerts' tables through it."""


def peek_account_files(path: str | Path) -> list[AccountFile]:
    """Read only, beside the daemon that owns it: which file each account's state is in (none when
    there is no such file, or it cannot be read)."""
    if not Path(path).is_file():
        return []
    try:
        db = connect_existing(path, "ro")
        try:
            if not db.execute("SELECT 1 FROM sqlite_master WHERE name = 'account_files'").fetchone():
                return []  # (a file an earlier version wrote last: the accounts' files are their names)
            return read_account_files(db)
        finally:
            db.close()
    except sqlite3.Error as error:
        log.warning("state file not read", path=str(path), error=str(error))
        return []


def peek(path: str | Path, start: float, end: float) -> tuple[list[tuple[str, bool, float | None]], list[str]] | None:
    """Read only, beside the daemon that owns it: a state file's probe runs in [start, end) and its
    alert states (JSON bodies); None when there is no such file or it cannot be read."""
    if not Path(path).is_file():
        return None
    try:
        db = connect_existing(path, "ro")
        try:
            runs = read_probe_runs(db, start, end)
            bodies = [body for _, body in read_alert_states(db).values()]
        finally:
            db.close()
    except sqlite3.Error as error:
        log.warning("state file not read", path=str(path), error=str(error))
        return None
    return runs, bodies
