"""The one SQLite file that survives a restart: usage sync cursors with their day's totals, alert
state, budget tiers fired and the notification outbox. (Bills and probes are rebuilt from the API.)

One connection, serialised by a lock, WAL journal; each save is one transaction, so a crash leaves
the previous complete state.
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
CREATE TABLE IF NOT EXISTS alert_state (
    key TEXT PRIMARY KEY,
    rule TEXT NOT NULL,
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS alert_sent (
    key TEXT NOT NULL,
    notifier TEXT NOT NULL,
    sent REAL NOT NULL,
    PRIMARY KEY (key, notifier)
);
CREATE TABLE IF NOT EXISTS budget_tiers (
    rule TEXT NOT NULL,
    period TEXT NOT NULL,
    tier REAL NOT NULL,
    PRIMARY KEY (rule, period, tier)
);
CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    notifier TEXT NOT NULL,
    event TEXT NOT NULL,
    created REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt REAL NOT NULL,
    delivered REAL,
    last_error TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS outbox_pending ON outbox (notifier, delivered, id);
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


@dataclass(frozen=True)
class OutboxEntry:
    id: int
    notifier: str
    event: str
    attempts: int
    next_attempt: float


class AlertStore:
    """Alert state, what was last sent to whom, budget tiers fired, and the delivery outbox.

    `StateStore.transaction()` groups a whole evaluation: state changes and the notifications
    they cause are committed together or not at all.
    """

    def __init__(self, store: StateStore) -> None:
        self.store = store

    def load_states(self) -> dict[str, tuple[str, str]]:
        with self.store._lock:
            rows = self.store._db.execute("SELECT key, rule, body FROM alert_state").fetchall()
        return {key: (rule, body) for key, rule, body in rows}

    def load_sent(self) -> dict[tuple[str, str], float]:
        with self.store._lock:
            rows = self.store._db.execute("SELECT key, notifier, sent FROM alert_sent").fetchall()
        return {(key, notifier): sent for key, notifier, sent in rows}

    def tiers_fired(self, rule: str, period: str) -> set[float]:
        with self.store._lock:
            rows = self.store._db.execute(
                "SELECT tier FROM budget_tiers WHERE rule = ? AND period = ?", (rule, period)
            ).fetchall()
        return {tier for (tier,) in rows}

    @staticmethod
    def save_state(db: sqlite3.Connection, key: str, rule: str, body: str) -> None:
        db.execute("INSERT OR REPLACE INTO alert_state VALUES (?, ?, ?)", (key, rule, body))

    @staticmethod
    def delete_state(db: sqlite3.Connection, key: str) -> None:
        db.execute("DELETE FROM alert_state WHERE key = ?", (key,))
        db.execute("DELETE FROM alert_sent WHERE key = ?", (key,))

    @staticmethod
    def mark_sent(db: sqlite3.Connection, key: str, notifier: str, sent: float) -> None:
        db.execute("INSERT OR REPLACE INTO alert_sent VALUES (?, ?, ?)", (key, notifier, sent))

    @staticmethod
    def mark_tiers(db: sqlite3.Connection, rule: str, period: str, tiers: list[float]) -> None:
        db.executemany("INSERT OR IGNORE INTO budget_tiers VALUES (?, ?, ?)", [(rule, period, t) for t in tiers])

    @staticmethod
    def enqueue(db: sqlite3.Connection, notifier: str, event: str, now: float) -> None:
        db.execute(
            "INSERT INTO outbox (notifier, event, created, next_attempt) VALUES (?, ?, ?, ?)",
            (notifier, event, now, now),
        )

    def head(self, notifier: str) -> OutboxEntry | None:
        """The oldest undelivered notification for a notifier: delivery is in order, one at a time."""
        with self.store._lock:
            row = self.store._db.execute(
                "SELECT id, notifier, event, attempts, next_attempt FROM outbox"
                " WHERE notifier = ? AND delivered IS NULL ORDER BY id LIMIT 1",
                (notifier,),
            ).fetchone()
        return OutboxEntry(*row) if row else None

    def delivered(self, entry_id: int, now: float, dropped: str = "") -> None:
        """Done with: delivered, or `dropped` (the reason) when the receiver will never take it."""
        with self.store.transaction() as db:
            db.execute(
                "UPDATE outbox SET delivered = ?, attempts = attempts + 1, last_error = ? WHERE id = ?",
                (now, dropped, entry_id),
            )
            db.execute("DELETE FROM outbox WHERE delivered IS NOT NULL AND delivered < ?", (now - 7 * 86400,))

    def failed(self, entry_id: int, next_attempt: float, error: str) -> None:
        with self.store.transaction() as db:
            db.execute(
                "UPDATE outbox SET attempts = attempts + 1, next_attempt = ?, last_error = ? WHERE id = ?",
                (next_attempt, error[:500], entry_id),
            )

    def pending_count(self) -> dict[str, int]:
        with self.store._lock:
            rows = self.store._db.execute(
                "SELECT notifier, COUNT(*) FROM outbox WHERE delivered IS NULL GROUP BY notifier"
            ).fetchall()
        return dict(rows)
