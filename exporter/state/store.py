"""`StateStore`: the state file with the tables of the usage sync, the reconciliation, the bill
history, the probe and which file is each account's, one class per owner's tables in a module of
its own (the alerts' and the outboxes' are `AlertStore`'s, on the same store); and `peek` and
`peek_account_files`, which read a state file beside the daemon that has it open."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import TypeVar

from exporter.core.logs import get_logger
from exporter.state.accounts import AccountFile, AccountTables, read_account_files
from exporter.state.alerts import read_alert_states
from exporter.state.file import connect_existing
from exporter.state.history import HistoryTable
from exporter.state.migrations import complete_read_only
from exporter.state.probes import ProbeTable, read_probe_runs
from exporter.state.settled import SettledTables
from exporter.state.usage import UsageTables

log = get_logger(__name__)
T = TypeVar("T")


class StateStore(UsageTables, SettledTables, HistoryTable, ProbeTable, AccountTables):
    """The state file (see `StateFile`: one exporter at a time, checked, migrated and kept at its
    path) with every owner's tables but the alerts'. Opened once by the exporter and handed to
    each owner; `AlertStore(store)` reads and writes the alerts' tables through it."""


def _beside(path: str | Path, read: Callable[[sqlite3.Connection], T]) -> T | None:
    """`read` on a state file opened read only, beside the daemon that owns it; None when there is
    no such file or it cannot be read (said in the log)."""
    if not Path(path).is_file():
        return None

    def opened(mode: str) -> T:
        with closing(connect_existing(path, mode)) as db:
            complete_read_only(db)
            return read(db)

    try:
        try:
            return opened("ro")
        except sqlite3.OperationalError as error:
            refused = "readonly" in str(error) or "unable to open" in str(error)
            if not refused or Path(f"{Path(path).resolve()}-wal").exists():
                raise
            # Read only by its owner's leave, its daemon stopped (no write-ahead log: a directory the
            # reader cannot write, where SQLite cannot make the files a WAL reader shares with a
            # writer): read as the file no one writes now. (With a log, what it holds would be missed.)
            return opened("ro&immutable=1")
    except sqlite3.Error as error:
        log.warning("state file not read", path=str(path), error=str(error))
        return None


def peek_account_files(path: str | Path) -> list[AccountFile]:
    """Which file each account's state is in, read beside the daemon (none when the file cannot be
    read, or an earlier version wrote it last: the accounts' files are then their names)."""

    def read(db: sqlite3.Connection) -> list[AccountFile]:
        if not db.execute("SELECT 1 FROM sqlite_master WHERE name = 'account_files'").fetchone():
            return []
        return read_account_files(db)

    return _beside(path, read) or []


def peek(
    path: str | Path, start: float, end: float
) -> tuple[list[tuple[str, bool, float | None]], list[tuple[str, str]]] | None:
    """Read only, beside the daemon that owns it: a state file's probe runs in [start, end) and its
    alert states (key, JSON body); None when there is no such file or it cannot be read."""
    return _beside(
        path, lambda db: (read_probe_runs(db, start, end), [(k, b) for k, (_, b) in read_alert_states(db).items()])
    )
