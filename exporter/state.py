"""The one SQLite file that survives a restart: usage sync cursors with their day's totals.

(Everything else is rebuilt from the API.) One connection, serialised by a lock, WAL journal;
each save is one transaction, so a crash leaves the previous complete state.
"""

from __future__ import annotations

import datetime as dt
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS usage_cursor (
    day TEXT PRIMARY KEY,
    settings TEXT NOT NULL,
    records INTEGER NOT NULL,
    boundary_id TEXT NOT NULL,
    page_fingerprint TEXT NOT NULL,
    finalised INTEGER NOT NULL DEFAULT 0,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS usage_totals (
    day TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    model TEXT NOT NULL,
    api_key TEXT NOT NULL,
    requests INTEGER NOT NULL,
    prompt INTEGER NOT NULL,
    completion INTEGER NOT NULL,
    cached INTEGER NOT NULL,
    PRIMARY KEY (day, endpoint, model, api_key)
);
"""


@dataclass(frozen=True)
class UsageCursor:
    """Where the last sync of a day stopped: `records` aggregated, the last one's id, and a
    fingerprint of the ids on its page up to it (to tell that nothing before it moved)."""

    day: dt.date
    settings: str
    records: int
    boundary_id: str
    page_fingerprint: str
    finalised: bool = False


UsageRow = tuple[str, str, str, int, int, int, int]
"""endpoint, model, api_key, requests, prompt, completion, cached"""


class StateStore:
    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._lock = threading.RLock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def load_usage(self, day: dt.date) -> tuple[UsageCursor, list[UsageRow]] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT settings, records, boundary_id, page_fingerprint, finalised FROM usage_cursor WHERE day = ?",
                (day.isoformat(),),
            ).fetchone()
            if row is None:
                return None
            totals = self._db.execute(
                "SELECT endpoint, model, api_key, requests, prompt, completion, cached FROM usage_totals WHERE day = ?",
                (day.isoformat(),),
            ).fetchall()
        return UsageCursor(day, row[0], row[1], row[2], row[3], bool(row[4])), totals

    def save_usage(self, cursor: UsageCursor, totals: list[UsageRow], updated: float, keep_from: dt.date) -> None:
        """Replace a day's cursor and totals in one transaction; forget days before `keep_from`."""
        day = cursor.day.isoformat()
        with self.transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO usage_cursor VALUES (?, ?, ?, ?, ?, ?, ?)",
                (day, cursor.settings, cursor.records, cursor.boundary_id, cursor.page_fingerprint,
                 int(cursor.finalised), updated),
            )  # fmt: skip
            db.execute("DELETE FROM usage_totals WHERE day = ?", (day,))
            db.executemany("INSERT INTO usage_totals VALUES (?, ?, ?, ?, ?, ?, ?, ?)", [(day, *t) for t in totals])
            db.execute("DELETE FROM usage_cursor WHERE day < ?", (keep_from.isoformat(),))
            db.execute("DELETE FROM usage_totals WHERE day < ?", (keep_from.isoformat(),))
