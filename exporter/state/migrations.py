"""The state file's layout: SCHEMA, every table of the newest layout, and MIGRATIONS, the numbered
steps (`PRAGMA user_version`) that bring a file an earlier version wrote up to LAYOUT, one function
per step; both run when the file is opened (`StateFile`). Also where an outbox starts numbering."""

from __future__ import annotations

import secrets
import sqlite3
from collections.abc import Callable

USAGE_SUMS_COLUMNS = """
    day TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    model TEXT NOT NULL,
    api_key TEXT NOT NULL,
    requests INTEGER NOT NULL,
    prompt INTEGER NOT NULL,
    completion INTEGER NOT NULL,
    cached INTEGER NOT NULL,
    PRIMARY KEY (day, endpoint, model, api_key)
"""
"""A day's usage sums per (endpoint, model, api key): today's and yesterday's (`usage_totals`), and
the settled days read in full (`settled_usage`)."""

OUTBOX_COLUMNS = """
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    notifier TEXT NOT NULL,
    event TEXT NOT NULL,
    created REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt REAL NOT NULL,
    delivered REAL,
    last_error TEXT NOT NULL DEFAULT '',
    recipients TEXT NOT NULL DEFAULT ''
"""
"""An outbox's rows: the alerts' (`outbox`) and the digests' (`digest_outbox`, apart, so a version
without digests never reads one). `recipients` (JSON) lists the email recipients still owed the
message after others took it ('' while nobody has)."""

OUTBOXES = ("outbox", "digest_outbox")


FIRST_ID_RANGE = 2**48
"""A new outbox numbers its rows from a random point below this: notification ids and Message-IDs
(which carry the row's number) then never repeat those of another state file (one lost, or reset)."""

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS usage_cursor (
    day TEXT PRIMARY KEY,
    settings TEXT NOT NULL,
    records INTEGER NOT NULL,
    boundary_id TEXT NOT NULL,
    page_fingerprint TEXT NOT NULL,
    finalised INTEGER NOT NULL DEFAULT 0,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS bill_history (
    period TEXT PRIMARY KEY,
    by_endpoint TEXT NOT NULL,
    by_item TEXT NOT NULL,
    fetched TEXT NOT NULL,
    items_by_endpoint TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS settled_days (
    day TEXT PRIMARY KEY,
    read REAL NOT NULL,
    account TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS settled_usage ({USAGE_SUMS_COLUMNS});
CREATE TABLE IF NOT EXISTS usage_head (
    day TEXT PRIMARY KEY,
    head_ids TEXT NOT NULL,
    newest_first INTEGER NOT NULL,
    page_size INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS usage_created (
    day TEXT PRIMARY KEY,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS usage_totals ({USAGE_SUMS_COLUMNS});
CREATE TABLE IF NOT EXISTS usage_ids (
    day TEXT PRIMARY KEY,
    ids BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS usage_ids_added (
    day TEXT NOT NULL,
    ids BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS usage_ids_added_day ON usage_ids_added (day);
CREATE TABLE IF NOT EXISTS usage_amounts (
    day TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    model TEXT NOT NULL,
    api_key TEXT NOT NULL,
    amount TEXT NOT NULL,
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
CREATE TABLE IF NOT EXISTS outbox ({OUTBOX_COLUMNS});
CREATE INDEX IF NOT EXISTS outbox_pending ON outbox (notifier, delivered, id);
CREATE INDEX IF NOT EXISTS outbox_delivered ON outbox (delivered);
CREATE TABLE IF NOT EXISTS digest_outbox ({OUTBOX_COLUMNS});
CREATE INDEX IF NOT EXISTS digest_outbox_pending ON digest_outbox (notifier, delivered, id);
CREATE INDEX IF NOT EXISTS digest_outbox_delivered ON digest_outbox (delivered);
CREATE TABLE IF NOT EXISTS digests (
    key TEXT PRIMARY KEY,
    made REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS digest_outbox_digest ON digest_outbox (json_extract(event, '$.id'));
CREATE TABLE IF NOT EXISTS digest_spans (
    account_id TEXT NOT NULL,
    name TEXT NOT NULL,
    first_day TEXT NOT NULL,
    last_day TEXT NOT NULL,
    project_id TEXT NOT NULL,
    marked INTEGER NOT NULL,
    PRIMARY KEY (account_id, name, last_day, first_day)
);
CREATE INDEX IF NOT EXISTS digest_spans_name ON digest_spans (name, first_day, last_day);
CREATE TABLE IF NOT EXISTS digest_told_by (
    account_id TEXT NOT NULL,
    day TEXT NOT NULL,
    PRIMARY KEY (account_id, day)
);
CREATE TABLE IF NOT EXISTS digest_told (
    account TEXT NOT NULL,
    day TEXT NOT NULL,
    PRIMARY KEY (account, day)
);
CREATE TABLE IF NOT EXISTS probe_runs (
    probe TEXT NOT NULL,
    at REAL NOT NULL,
    success INTEGER NOT NULL,
    time_to_first_token REAL
);
CREATE INDEX IF NOT EXISTS probe_runs_at ON probe_runs (at);
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS account_files (
    file TEXT PRIMARY KEY,
    account_id TEXT NOT NULL,
    name TEXT NOT NULL,
    used INTEGER NOT NULL
);
"""
"""Every table in the newest layout. Run at each opening: it makes what a file lacks (all of a new
file); a table an earlier layout made is brought up to date by MIGRATIONS. An index is made here
for a file of any layout (older versions keep it up to date without knowing it): an outbox's
`_delivered` one lets each delivery forget rows older than a week without reading the table."""


FIRST_TABLE = "usage_cursor"
"""The table every version's SCHEMA made first: a database with tables but not this one is another
program's, never taken for a state file (a file whose making stopped part way has it)."""


def _to_layout_1(db: sqlite3.Connection) -> None:
    """Layout 1. Outboxes get `recipients` (the email recipients still owed a message). Alerts
    saved until now belong to rules told apart by their place in the config: the file says so
    (`meta.rule_ids`), and the alert engine moves them to their rules' ids the first time it has
    the config (`AlertStore.adopt_rule_ids`). `usage_amounts` comes with SCHEMA."""
    for table in OUTBOXES:
        columns = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
        if "recipients" not in columns:
            db.execute(f"ALTER TABLE {table} ADD COLUMN recipients TEXT NOT NULL DEFAULT ''")
    if db.execute("SELECT 1 FROM alert_state LIMIT 1").fetchone() is not None:
        db.execute("INSERT OR REPLACE INTO meta VALUES ('rule_ids', 'by position')")


MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (_to_layout_1,)
"""The steps from each layout (`PRAGMA user_version`) to the next: a file of layout N gets
MIGRATIONS[N:], in the transaction that opens it, after SCHEMA has made the tables it lacked (so
a step changes only tables an earlier layout made). Layout 0 is every version before layout 1.
Each released layout is kept in tests/data as a file that the tests open and check."""

LAYOUT = len(MIGRATIONS)
"""The layout this version writes."""

COLUMNS_ADDED = (
    ("usage_created", "updated", "REAL NOT NULL", "-1"),  # (matches no cursor: `created` not trusted)
    ("digest_spans", "project_id", "TEXT NOT NULL", "''"),
    ("digest_spans", "marked", "INTEGER NOT NULL", "1"),  # (every span was a digest queued then)
    ("account_files", "used", "INTEGER NOT NULL", "0"),
)
"""Columns that came to a table of layout 1 after the table did: builds between releases made the
table without them, in files that say layout 1 all the same (so no step of MIGRATIONS runs on
them). Each is (table, column, type, the value an older row means): added where a file lacks them,
at each opening (`complete`), or read so on a file opened read only (`complete_read_only`)."""


def _lacking(db: sqlite3.Connection) -> dict[str, tuple[list[str], list[tuple[str, str, str]]]]:
    """Per table the file has that lacks some of COLUMNS_ADDED: its columns, and those it lacks."""
    lacking: dict[str, tuple[list[str], list[tuple[str, str, str]]]] = {}
    for table, column, kind, default in COLUMNS_ADDED:
        present = [row[1] for row in db.execute(f"PRAGMA main.table_info({table})")]
        if present and column not in present:
            lacking.setdefault(table, (present, []))[1].append((column, kind, default))
    return lacking


def complete(db: sqlite3.Connection) -> None:
    """Add each of COLUMNS_ADDED that its table lacks."""
    for table, (_, missing) in _lacking(db).items():
        for column, kind, default in missing:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind} DEFAULT {default}")


def complete_read_only(db: sqlite3.Connection) -> None:
    """On a file opened read only, where no column can be added: each table that lacks some of
    COLUMNS_ADDED is read through a temporary view of its name (found before the file's table)
    that has them, with the value an older row means."""
    for table, (present, missing) in _lacking(db).items():
        columns = ", ".join([*present, *(f"{default} AS {column}" for column, _, default in missing)])
        db.execute(f"CREATE TEMP VIEW {table} AS SELECT {columns} FROM main.{table}")  # noqa: S608 (names of ours)


def number_outboxes(db: sqlite3.Connection) -> None:
    """A new (empty, never used) outbox numbers its rows from a random point (FIRST_ID_RANGE)."""
    for table in OUTBOXES:
        numbered = db.execute("SELECT 1 FROM sqlite_sequence WHERE name = ?", (table,)).fetchone()
        if numbered is None and db.execute(f"SELECT 1 FROM {table} LIMIT 1").fetchone() is None:  # noqa: S608
            db.execute(
                "INSERT INTO sqlite_sequence (name, seq) VALUES (?, ?)", (table, secrets.randbelow(FIRST_ID_RANGE))
            )
