"""The one SQLite file that survives a restart: usage sync cursors with their day's totals, alert
state, budget tiers fired and the notification outbox. (Bills and probes are rebuilt from the API.)

One connection, serialised by a lock, WAL journal; each save is one transaction, so a crash leaves
the previous complete state. One exporter per file: `<path>.lock` is held (flock) while it is open.
Every fault of the file (corrupt, read-only, full, deleted, replaced, in use) is a `StateError`
whose message names the file.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import json
import math
import os
import secrets
import sqlite3
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exporter.core.logs import get_logger
from exporter.model.events import GroupEvent, read_event
from exporter.model.snapshots import UsageRow

log = get_logger(__name__)

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
CREATE TABLE IF NOT EXISTS usage_totals ({USAGE_SUMS_COLUMNS});
CREATE TABLE IF NOT EXISTS usage_ids (
    day TEXT PRIMARY KEY,
    ids BLOB NOT NULL
);
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
CREATE TABLE IF NOT EXISTS digest_outbox ({OUTBOX_COLUMNS});
CREATE INDEX IF NOT EXISTS digest_outbox_pending ON digest_outbox (notifier, delivered, id);
CREATE TABLE IF NOT EXISTS digests (
    key TEXT PRIMARY KEY,
    made REAL NOT NULL
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
"""
"""Every table in the newest layout. Run at each opening: it makes what a file lacks (all of a new
file); a table an earlier layout made is brought up to date by MIGRATIONS."""


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
    head_ids: str = ""
    """The ids at the head of the list (its first page), as hex of their 64-bit digests: where
    a list that shows the newest first must show them again, shifted down by the new records."""
    newest_first: bool = False
    """The service was seen to list the day newest first."""
    page_size: int = 0
    """The page size the cursor's pages were read at (below the configured one when the
    service caps its pages); 0: not saved."""


class StateError(Exception):
    """The state file cannot be used; the message names the file and the fault in plain words."""

    def __init__(self, path: str, message: str, *, corrupt: bool = False, fault: str = "") -> None:
        super().__init__(message)
        self.path = path
        self.fault = fault or message
        """The fault alone, e.g. "is corrupt (database disk image is malformed)"."""
        self.corrupt = corrupt
        """True when the file holds something that is not a sound SQLite database
        (`StateStore(path, reset=True)` moves such a file aside)."""


def _fault(error: sqlite3.Error) -> tuple[str, bool]:
    """What an SQLite error means for the file, in words to follow "state file X", and whether it
    is corrupt."""
    name = getattr(error, "sqlite_errorname", "") or ""
    detail = str(error)
    if name == "SQLITE_NOTADB":
        return f"is not a SQLite database ({detail})", True
    if name.startswith("SQLITE_CORRUPT"):
        return f"is corrupt ({detail})", True
    if name.startswith("SQLITE_READONLY"):
        return f"is read-only ({detail})", False
    if name == "SQLITE_FULL":
        return f"cannot be written: the disk is full ({detail})", False
    if name.startswith("SQLITE_IOERR"):
        return f"cannot be read or written ({detail})", False
    if name.startswith("SQLITE_CANTOPEN"):
        return f"cannot be opened ({detail})", False
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
        return f"is locked by another connection ({detail})", False
    return f"failed ({detail})", False


def _directory_writable(directory: Path) -> bool:
    """Whether a file can be created in `directory` (tried, since root ignores the permission bits)."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False


def location_problem(path: str | Path) -> str:
    """Why no state file could be kept at `path` ("" if one could), found without creating anything."""
    if str(path) == ":memory:":
        return ""
    target = Path(path)
    if target.is_dir():
        return f"{target} is a directory"
    existing = target.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"the directory {existing} is not writable"
    if target.exists() and not os.access(target, os.R_OK | os.W_OK):
        return f"{target} is not readable and writable"
    return ""


def move_aside(path: str | Path) -> str:
    """Rename a state file (and its -wal and -shm journal files, which belong to it) to
    `<path>.corrupt-YYYYmmddTHHMMSS`; returns the new name of the file."""
    path = str(path)
    target = f"{path}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}"
    n = 0
    while any(os.path.lexists(target + suffix) for suffix in ("", "-wal", "-shm")):
        n += 1
        target = f"{path}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}-{n}"
    for suffix in ("", "-wal", "-shm"):
        if os.path.lexists(path + suffix):
            os.rename(path + suffix, target + suffix)
    return target


def peek(path: str | Path, start: float, end: float) -> tuple[list[tuple[str, bool, float | None]], list[str]] | None:
    """Read only, beside the daemon that owns it: a state file's probe runs in [start, end) and its
    alert states (JSON bodies); None when there is no such file or it cannot be read."""
    if not Path(path).is_file():
        return None
    try:
        db = sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True)
        try:
            runs = _probe_runs(db, start, end)
            bodies = [body for _, body in _alert_states(db).values()]
        finally:
            db.close()
    except sqlite3.Error as error:
        log.warning("state file not read", path=str(path), error=str(error))
        return None
    return runs, bodies


def _probe_runs(db: sqlite3.Connection, start: float, end: float) -> list[tuple[str, bool, float | None]]:
    """(probe, success, time to first token) of the runs in [start, end)."""
    rows = db.execute(
        "SELECT probe, success, time_to_first_token FROM probe_runs WHERE at >= ? AND at < ? ORDER BY at", (start, end)
    ).fetchall()
    return [(probe, bool(success), ttft) for probe, success, ttft in rows]


def _alert_states(db: sqlite3.Connection) -> dict[str, tuple[str, str]]:
    """Each alert's key → (its rule, its state as JSON)."""
    return {key: (rule, body) for key, rule, body in db.execute("SELECT key, rule, body FROM alert_state")}


class StateStore:
    """The state file, opened by one exporter at a time.

    An exclusive lock on `<path>.lock` (holding the owner's pid) keeps a second exporter, or a
    second store in this process, off the file. At start-up the file is checked (`quick_check`)
    and written once, so a corrupt or read-only file is refused then rather than at the first
    evaluation. Every write transaction first checks that the file at the path is still the one
    opened: a deleted file is recreated from the open connection, a replaced one is refused.

    Every SQLite error comes out as a `StateError` naming the file and the fault.
    """

    def __init__(self, path: str | Path, *, reset: bool = False) -> None:
        """Open (or create) the state file. With `reset`, a corrupt file is moved aside (see
        `move_aside`) and a fresh one started; without, it is refused with a `StateError`."""
        self.path = str(path)
        self._lock = threading.RLock()
        self._lock_fd: int | None = None
        self._identity: tuple[int, int] | None = None
        self._wal = False
        self._closed = False
        self.write_error = ""
        """How the last write transaction failed ("" if it was committed)."""
        self.layout = LAYOUT
        """The file's layout as found when it was opened (see MIGRATIONS)."""
        self.moved_aside: str | None = None
        """Where a corrupt file was moved by `reset`, if it was."""
        if self.path == ":memory:":
            self._db = self._connect(self.path)
            return
        directory = Path(self.path).parent
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise StateError(
                self.path,
                f"state file {self.path}: cannot create its directory {directory} ({error.strerror or error})",
            ) from None
        self._lock_fd = self._take_lock()
        try:
            try:
                self._db = self._open()
            except StateError as error:
                if not (reset and error.corrupt):
                    raise
                self.moved_aside = self._move_aside()
                log.warning("state file moved aside; started a fresh one",
                            path=self.path, fault=error.fault, moved_to=self.moved_aside)  # fmt: skip
                self._db = self._open()
        except BaseException:
            self._release_lock()
            raise

    # -- opening --

    def _connect(self, path: str) -> sqlite3.Connection:
        """A connection in WAL mode with the tables; raises sqlite3.Error."""
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        try:
            (mode,) = db.execute("PRAGMA journal_mode=WAL").fetchone()
            self._wal = mode == "wal"
            db.execute("PRAGMA synchronous=NORMAL")
            if path != ":memory:":
                (verdict,) = db.execute("PRAGMA quick_check(1)").fetchone()
                if verdict != "ok":
                    corrupt = sqlite3.DatabaseError(f"quick_check: {verdict[:200]}")
                    corrupt.sqlite_errorname = "SQLITE_CORRUPT"
                    raise corrupt
            (version,) = db.execute("PRAGMA user_version").fetchone()
            if version > LAYOUT:
                raise StateError(
                    self.path,
                    f"state file {self.path} was written by a newer version (layout {version}; this one knows "
                    f"layouts up to {LAYOUT}): run that version, or start afresh with another state.path",
                )
            db.executescript(SCHEMA)
            # Written once now, always: a read-only file opens (read-only) without complaint.
            db.execute("BEGIN IMMEDIATE")
            try:
                for step in MIGRATIONS[version:]:
                    step(db)
                db.execute(f"PRAGMA user_version = {LAYOUT}")
                self.layout = version
                _number_outboxes(db)
                db.execute("COMMIT")
            finally:
                if db.in_transaction:
                    db.execute("ROLLBACK")
        except BaseException:
            db.close()
            raise
        return db

    def _open(self) -> sqlite3.Connection:
        try:
            db = self._connect(self.path)
        except sqlite3.Error as error:
            name = getattr(error, "sqlite_errorname", "") or ""
            directory = Path(self.path).parent
            if name.startswith("SQLITE_CANTOPEN") and not _directory_writable(directory):
                raise StateError(
                    self.path,
                    f"state file {self.path} cannot be opened: its directory {directory} is read-only ({error})",
                ) from None
            raise self._error(error) from error
        self._identity = self._stat_identity()
        return db

    def _stat_identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        except OSError as error:
            raise StateError(self.path, f"state file {self.path} cannot be examined ({error.strerror})") from None
        return st.st_dev, st.st_ino

    def _move_aside(self) -> str:
        try:
            return move_aside(self.path)
        except OSError as error:
            raise StateError(
                self.path, f"state file {self.path} is corrupt and cannot be moved aside ({error.strerror or error})"
            ) from None

    def _error(self, error: sqlite3.Error) -> StateError:
        fault, corrupt = _fault(error)
        remedy = "; move it aside or start with --reset-state" if corrupt else ""
        return StateError(self.path, f"state file {self.path} {fault}{remedy}", corrupt=corrupt, fault=fault)

    # -- the lock --

    @property
    def lock_path(self) -> str:
        return f"{self.path}.lock"

    def _take_lock(self) -> int:
        """Open and lock `<path>.lock`, write our pid into it; refuse if another holds it."""
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise StateError(
                    self.path,
                    f"state file {self.path}: cannot create its lock file {self.lock_path}: the directory is "
                    f"read-only or not writable ({error.strerror})",
                ) from None
            raise StateError(
                self.path, f"state file {self.path}: cannot open its lock file {self.lock_path} ({error.strerror})"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            try:
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            finally:
                os.close(fd)
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StateError(
                    self.path, f"state file {self.path}: cannot lock {self.lock_path} ({error.strerror})"
                ) from None
            pid = holder if holder.isdigit() else "unknown"
            raise StateError(
                self.path,
                f"state file {self.path} is in use by another exporter (pid {pid}); "
                "each exporter needs its own state.path",
            ) from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass  # the lock holds without the pid; only the message to a second exporter is poorer
        return fd

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing releases the flock
            self._lock_fd = None

    def _check_lock(self) -> None:
        """Take the lock again if `<path>.lock` was deleted or replaced while running."""
        if self._lock_fd is None:
            return
        mine = os.fstat(self._lock_fd)
        try:
            there = os.stat(self.lock_path)
        except FileNotFoundError:
            there = None
        if there is not None and (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino):
            return
        fd = self._take_lock()  # refused if another exporter took the new lock file meanwhile
        os.close(self._lock_fd)
        self._lock_fd = fd
        log.warning("state lock file was deleted while running; locked it again", path=self.lock_path)

    # -- the file under the connection --

    def _check_file(self) -> None:
        """Before a write: the path must still hold the file opened. Recreate a deleted one from the
        open connection; refuse to write over a replaced one."""
        if self._identity is None:
            return
        try:
            identity = self._stat_identity()
            if identity is not None and identity != self._identity:
                raise StateError(
                    self.path,
                    f"state file {self.path} was replaced while running (another file is now at that path); "
                    "not writing over it: restart the exporter to use it, or remove it to have this one recreated",
                )
            if identity is None:
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)  # the whole directory may be gone
            self._check_lock()
            if identity is None:
                self._recreate(f"state file {self.path} was deleted while running")
            elif self._wal and not os.path.exists(self.path + "-wal"):
                self._recreate(f"the -wal journal of state file {self.path} was deleted while running")
        except OSError as error:
            raise StateError(self.path, f"state file {self.path}: {error.strerror or error}") from None

    def _recreate(self, event: str) -> None:
        """Write the open connection's database to a new file at the path and switch to it."""
        staging = f"{self.path}.recreating"
        for suffix in ("", "-journal", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(staging + suffix)
        try:
            copy = sqlite3.connect(staging, isolation_level=None)
            try:
                self._db.backup(copy)
            finally:
                copy.close()
        except sqlite3.Error as error:
            with contextlib.suppress(FileNotFoundError):
                os.remove(staging)
            fault, _ = _fault(error)
            raise StateError(self.path, f"{event}, and it cannot be recreated ({fault})") from None
        # The old connection must be gone before the new file is opened: its -wal and -shm, if still
        # there, belong to the deleted file and would be taken for the new one's.
        self._db.close()
        try:
            for suffix in ("-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.path + suffix)
            if self._stat_identity() == self._identity:  # our own file, its -wal gone: replace it
                os.replace(staging, self.path)
            else:
                _install(staging, self.path)
        except (OSError, StateError) as error:
            # Keep working on the copy: the next write tries again to put it at the path.
            self._db = sqlite3.connect(staging, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            raise StateError(
                self.path,
                f"{event}, and it cannot be recreated ({getattr(error, 'strerror', None) or error})",
            ) from None
        self._identity = self._stat_identity()
        try:
            self._db = self._connect(self.path)
        except sqlite3.Error as error:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            raise self._error(error) from error
        log.warning("state file recreated from the open copy", path=self.path, event=event)

    # -- the public API --

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._check_file()  # a file deleted since the last write is written back before closing
            except StateError as error:
                log.error("closing the state file failed", path=self.path, error=str(error))
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
            self._release_lock()

    @contextmanager
    def _reading(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                yield self._db
            except sqlite3.Error as error:
                raise self._error(error) from error

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; a failure rolls it back and raises StateError (the next may succeed).
        `write_error` says how the last one ended ("" when it was committed)."""
        with self._lock:
            try:
                with self._write() as db:
                    yield db
            except StateError as error:
                self.write_error = str(error)
                raise
            self.write_error = ""

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._check_file()
            try:
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as error:
                raise self._error(error) from error
            try:
                yield self._db
            except sqlite3.Error as error:
                self._rollback()
                raise self._error(error) from error
            except BaseException:
                self._rollback()
                raise
            try:
                self._db.execute("COMMIT")
            except sqlite3.Error as error:
                self._rollback()
                raise self._error(error) from error

    def _rollback(self) -> None:
        if self._db.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")

    def load_usage(self, day: dt.date) -> tuple[UsageCursor, list[UsageRow]] | None:
        with self._reading() as db:
            row = db.execute(
                "SELECT settings, records, boundary_id, page_fingerprint, finalised, head_ids, newest_first, page_size"
                " FROM usage_cursor LEFT JOIN usage_head USING (day) WHERE day = ?",
                (day.isoformat(),),
            ).fetchone()
            if row is None:
                return None
            totals = db.execute(
                "SELECT endpoint, model, api_key, requests, prompt, completion, cached FROM usage_totals WHERE day = ?",
                (day.isoformat(),),
            ).fetchall()
        return UsageCursor(
            day, row[0], row[1], row[2], row[3], bool(row[4]), row[5] or "", bool(row[6]), row[7] or 0
        ), totals

    def load_settled_usage(self, first: dt.date, account: str) -> dict[dt.date, list[UsageRow]]:
        """The settled days read from `first` on from `account`, each with its per-key sums (none
        for a day without usage)."""
        with self._reading() as db:
            days = [
                row[0]
                for row in db.execute(
                    "SELECT day FROM settled_days WHERE day >= ? AND account = ?", (first.isoformat(), account)
                )
            ]
            rows = db.execute(
                "SELECT day, endpoint, model, api_key, requests, prompt, completion, cached FROM settled_usage"
                " WHERE day >= ?",
                (first.isoformat(),),
            ).fetchall()
        held: dict[dt.date, list[UsageRow]] = {dt.date.fromisoformat(day): [] for day in days}
        for day, *row in rows:
            if (when := dt.date.fromisoformat(day)) in held:
                held[when].append(tuple(row))
        return held

    def save_settled_usage(self, day: dt.date, rows: Sequence[UsageRow], account: str, *, keep_from: dt.date) -> None:
        """One settled day's per-key sums; forget the days before `keep_from`."""
        with self.transaction() as db:
            db.execute("DELETE FROM settled_usage WHERE day = ? OR day < ?", (day.isoformat(), keep_from.isoformat()))
            db.executemany(
                "INSERT INTO settled_usage VALUES (?, ?, ?, ?, ?, ?, ?, ?)", [(day.isoformat(), *row) for row in rows]
            )
            db.execute("DELETE FROM settled_days WHERE day < ?", (keep_from.isoformat(),))
            db.execute("INSERT OR REPLACE INTO settled_days VALUES (?, ?, ?)", (day.isoformat(), time.time(), account))

    def load_history(self) -> list[tuple[str, str, str, str, str]]:
        """Every month held: (period, its daily bills by endpoint, by item, and each endpoint's by
        item, as JSON; the day fetched)."""
        with self._reading() as db:
            rows: list[tuple[str, str, str, str, str]] = db.execute(
                "SELECT period, by_endpoint, by_item, items_by_endpoint, fetched FROM bill_history ORDER BY period"
            ).fetchall()
        return rows

    def save_history(
        self, period: str, by_endpoint: str, by_item: str, items_by_endpoint: str, fetched: str, *, keep_from: str
    ) -> None:
        """Replace one month's bills; forget the months before `keep_from`."""
        with self.transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO bill_history (period, by_endpoint, by_item, items_by_endpoint, fetched)"
                " VALUES (?, ?, ?, ?, ?)",
                (period, by_endpoint, by_item, items_by_endpoint, fetched),
            )
            db.execute("DELETE FROM bill_history WHERE period < ?", (keep_from,))

    def record_probe_run(self, probe: str, at: float, success: bool, ttft: float | None, *, keep_from: float) -> None:
        """One probe run (for the digest's success ratios and percentiles); forget runs before `keep_from`."""
        with self.transaction() as db:
            db.execute("INSERT INTO probe_runs VALUES (?, ?, ?, ?)", (probe, at, int(success), ttft))
            db.execute("DELETE FROM probe_runs WHERE at < ?", (keep_from,))

    def probe_runs(self, start: float, end: float) -> list[tuple[str, bool, float | None]]:
        """(probe, success, time to first token) of the runs in [start, end)."""
        with self._reading() as db:
            return _probe_runs(db, start, end)

    def load_usage_amounts(self, day: dt.date) -> list[tuple[str, str, str, str, int, int, int]]:
        """What today's estimate counters counted (`usage_sync.Counted`), per (endpoint, model, api
        key): the amount as exact decimal text and the prompt, completion and cached tokens it covers."""
        with self._reading() as db:
            return db.execute(
                "SELECT endpoint, model, api_key, amount, prompt, completion, cached FROM usage_amounts WHERE day = ?",
                (day.isoformat(),),
            ).fetchall()

    def load_usage_ids(self, day: dt.date) -> bytes:
        """The digests of the request ids counted on `day` (see `usage_sync.SeenIds`); empty if none."""
        with self._reading() as db:
            row = db.execute("SELECT ids FROM usage_ids WHERE day = ?", (day.isoformat(),)).fetchone()
        return bytes(row[0]) if row else b""

    def save_usage(
        self,
        cursor: UsageCursor,
        totals: list[UsageRow],
        updated: float,
        keep_from: dt.date,
        *,
        ids: Sequence[memoryview] = (),
        amounts: Sequence[tuple[str, str, str, str, int, int, int]] | None = None,
    ) -> None:
        """Replace a day's cursor, totals and request ids seen (in chunks, written into the blob one
        after the other: no copy of the whole) in one transaction; forget days before `keep_from`.
        `amounts` (as `load_usage_amounts` reads them) replace the counted amounts in the same
        transaction, so they never cover other totals than those saved with them."""
        day = cursor.day.isoformat()
        with self.transaction() as db:
            if amounts is not None:
                db.execute("DELETE FROM usage_amounts")  # only today's are ever read
                db.executemany(
                    "INSERT INTO usage_amounts VALUES (?, ?, ?, ?, ?, ?, ?, ?)", [(day, *a) for a in amounts]
                )
            db.execute(
                "INSERT OR REPLACE INTO usage_ids (day, ids) VALUES (?, zeroblob(?))", (day, sum(c.nbytes for c in ids))
            )
            (rowid,) = db.execute("SELECT rowid FROM usage_ids WHERE day = ?", (day,)).fetchone()
            with db.blobopen("usage_ids", "ids", rowid) as blob:
                for chunk in ids:
                    blob.write(chunk)
            db.execute("DELETE FROM usage_ids WHERE day < ?", (keep_from.isoformat(),))
            db.execute(
                "INSERT OR REPLACE INTO usage_cursor VALUES (?, ?, ?, ?, ?, ?, ?)",
                (day, cursor.settings, cursor.records, cursor.boundary_id, cursor.page_fingerprint,
                 int(cursor.finalised), updated),
            )  # fmt: skip
            # In a table of its own: a file this version wrote stays one the previous version can write.
            db.execute(
                "INSERT OR REPLACE INTO usage_head VALUES (?, ?, ?, ?)",
                (day, cursor.head_ids, int(cursor.newest_first), cursor.page_size),
            )
            db.execute("DELETE FROM usage_head WHERE day < ?", (keep_from.isoformat(),))
            db.execute("DELETE FROM usage_totals WHERE day = ?", (day,))
            db.executemany("INSERT INTO usage_totals VALUES (?, ?, ?, ?, ?, ?, ?, ?)", [(day, *t) for t in totals])
            db.execute("DELETE FROM usage_cursor WHERE day < ?", (keep_from.isoformat(),))
            db.execute("DELETE FROM usage_totals WHERE day < ?", (keep_from.isoformat(),))


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


def _number_outboxes(db: sqlite3.Connection) -> None:
    """A new (empty, never used) outbox numbers its rows from a random point (FIRST_ID_RANGE)."""
    for table in OUTBOXES:
        numbered = db.execute("SELECT 1 FROM sqlite_sequence WHERE name = ?", (table,)).fetchone()
        if numbered is None and db.execute(f"SELECT 1 FROM {table} LIMIT 1").fetchone() is None:  # noqa: S608
            db.execute(
                "INSERT INTO sqlite_sequence (name, seq) VALUES (?, ?)", (table, secrets.randbelow(FIRST_ID_RANGE))
            )


def _install(staging: str, path: str) -> None:
    """Put `staging` at `path`, unless a file appeared there meanwhile."""
    try:
        os.link(staging, path)
    except FileExistsError:
        raise OSError(errno.EEXIST, "another file appeared at the path meanwhile") from None
    except OSError:
        os.replace(staging, path)  # no hard links on this file system
        return
    os.remove(staging)


@dataclass(frozen=True)
class OutboxEntry:
    id: int
    notifier: str
    event: GroupEvent
    attempts: int
    next_attempt: float
    digest: dict[str, Any] | None = None
    """A digest (`exporter.digest.build`) instead of an alert group: `event` is then empty."""
    recipients: tuple[str, ...] = ()
    """The email recipients still owed it when others took it already; () while nobody has."""
    created: float = 0.0

    @property
    def table(self) -> str:
        return "outbox" if self.digest is None else "digest_outbox"


NO_EVENT: GroupEvent = {"status": "", "alertname": "", "dedup_key": "", "alerts": [], "total": 0, "still_firing": 0}


class AlertStore:
    """Alert state, what was last sent to whom, budget tiers fired, and the delivery outbox.

    `StateStore.transaction()` groups a whole evaluation: state changes and the notifications
    they cause are committed together or not at all.
    """

    def __init__(self, store: StateStore) -> None:
        self.store = store

    def load_states(self) -> dict[str, tuple[str, str]]:
        with self.store._reading() as db:
            return _alert_states(db)

    def load_sent(self) -> dict[tuple[str, str], float]:
        with self.store._reading() as db:
            rows = db.execute("SELECT key, notifier, sent FROM alert_sent").fetchall()
        return {(key, notifier): sent for key, notifier, sent in rows}

    def tiers_fired(self, rule: str, period: str) -> set[float]:
        with self.store._reading() as db:
            rows = db.execute("SELECT tier FROM budget_tiers WHERE rule = ? AND period = ?", (rule, period)).fetchall()
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
    def enqueue(db: sqlite3.Connection, notifier: str, event: GroupEvent, now: float) -> None:
        db.execute(
            "INSERT INTO outbox (notifier, event, created, next_attempt) VALUES (?, ?, ?, ?)",
            (notifier, json.dumps(event), now, now),
        )

    def digest_made(self, key: str) -> bool:
        with self.store._reading() as db:
            return db.execute("SELECT 1 FROM digests WHERE key = ?", (key,)).fetchone() is not None

    def enqueue_digest(self, key: str, notifiers: Sequence[str], body: Mapping[str, object], now: float) -> bool:
        """Queue the digest `key` (`daily:2026-11-23`) for each notifier, once: False when it was
        queued before (a restart, a second look at the same time). The body gets `id`: the key, so a
        receiver can tell digests apart and drop a repeat."""
        with self.store.transaction() as db:
            if db.execute("INSERT OR IGNORE INTO digests VALUES (?, ?)", (key, now)).rowcount == 0:
                return False
            text = json.dumps({**body, "id": key})
            db.executemany(
                "INSERT INTO digest_outbox (notifier, event, created, next_attempt) VALUES (?, ?, ?, ?)",
                [(name, text, now, now) for name in notifiers],
            )
            db.execute("DELETE FROM digests WHERE made < ?", (now - 60 * 86400,))
        return True

    def head(self, notifier: str, now: float = math.inf) -> OutboxEntry | None:
        """The oldest undelivered notification for a notifier: delivery is in order, one at a time;
        alerts first, then digests (kept apart, so a version without digests never reads one). One
        that only some email recipients are still owed is out of that order: it is the head only
        once its retry is due (at `now`), so one full mailbox never holds back the rest."""
        with self.store._reading() as db:
            for table in OUTBOXES:
                row = db.execute(
                    f"SELECT id, notifier, event, attempts, next_attempt, recipients, created FROM {table}"  # noqa: S608 - one of two names
                    " WHERE notifier = ? AND delivered IS NULL AND (recipients = '' OR next_attempt <= ?)"
                    " ORDER BY id LIMIT 1",
                    (notifier, now),
                ).fetchone()
                if row is not None:
                    break
        if row is None:
            return None
        entry_id, name, text, attempts, next_attempt, recipients, created = row
        owed = tuple(json.loads(recipients)) if recipients else ()
        if table == "digest_outbox":
            return OutboxEntry(entry_id, name, NO_EVENT, attempts, next_attempt, json.loads(text), owed, created)
        return OutboxEntry(entry_id, name, read_event(text), attempts, next_attempt, None, owed, created)

    def delivered(self, entry_id: int, now: float, dropped: str = "", *, table: str = "outbox") -> None:
        """Done with: delivered, or `dropped` (the reason) when the receiver will never take it."""
        assert table in OUTBOXES
        with self.store.transaction() as db:
            db.execute(
                f"UPDATE {table} SET delivered = ?, attempts = attempts + 1, last_error = ? WHERE id = ?",  # noqa: S608
                (now, dropped, entry_id),
            )
            db.execute(f"DELETE FROM {table} WHERE delivered IS NOT NULL AND delivered < ?", (now - 7 * 86400,))  # noqa: S608

    def failed(
        self, entry_id: int, next_attempt: float, error: str, *, table: str = "outbox", recipients: Sequence[str] = ()
    ) -> None:
        """A failed attempt; `recipients`: the email recipients still owed it, when others took it."""
        assert table in OUTBOXES
        with self.store.transaction() as db:
            db.execute(
                f"UPDATE {table} SET attempts = attempts + 1, next_attempt = ?, last_error = ?,"  # noqa: S608
                " recipients = COALESCE(NULLIF(?, ''), recipients) WHERE id = ?",
                (next_attempt, error[:500], json.dumps(list(recipients)) if recipients else "", entry_id),
            )

    def discard(self, keep: Iterable[str], now: float, reason: str) -> dict[str, int]:
        """Mark done, with `reason`, what waits for any notifier but those in `keep` (a notifier a
        reload removed, or that is no longer one with a queue), and forget what was sent to them (one
        added again under the same name is then told what fires, as a new one is); how many were
        waiting, per notifier."""
        kept = sorted(set(keep))
        marks = ",".join("?" * len(kept))
        dropped: dict[str, int] = {}
        with self.store.transaction() as db:
            for table in OUTBOXES:
                where = f"delivered IS NULL AND notifier NOT IN ({marks})"
                rows = db.execute(f"SELECT notifier, COUNT(*) FROM {table} WHERE {where} GROUP BY notifier", kept)  # noqa: S608
                for name, count in rows.fetchall():
                    dropped[name] = dropped.get(name, 0) + count
                db.execute(f"UPDATE {table} SET delivered = ?, last_error = ? WHERE {where}", (now, reason, *kept))  # noqa: S608
            db.execute(f"DELETE FROM alert_sent WHERE notifier NOT IN ({marks})", kept)  # noqa: S608
        return dropped

    def alert_states(self, keys: Iterable[str]) -> dict[str, str]:
        """The current state of each of these alerts that is kept (one resolved long ago is not)."""
        wanted = list(dict.fromkeys(keys))
        found: dict[str, str] = {}
        with self.store._reading() as db:
            for start in range(0, len(wanted), 500):
                chunk = wanted[start : start + 500]
                marks = ",".join("?" * len(chunk))
                query = f"SELECT key, json_extract(body, '$.state') FROM alert_state WHERE key IN ({marks})"  # noqa: S608
                rows = db.execute(query, chunk).fetchall()
                found.update(rows)
        return found

    @property
    def legacy_rule_ids(self) -> bool:
        """The file's alerts were saved with rule ids that depend on the rules' order (layout 0), and
        have not been moved yet."""
        with self.store._reading() as db:
            return db.execute("SELECT 1 FROM meta WHERE key = 'rule_ids'").fetchone() is not None

    def adopt_rule_ids(self, moves: Mapping[str, str], rekey: Callable[[dict[str, Any], str], dict[str, Any]]) -> int:
        """Rewrite the alert tables from old rule ids to new ones, once per file: each saved alert of a
        moved rule becomes `rekey(body, new id)` (its new key, the incident it opened kept), its
        alert_sent rows and queued notifications follow its key, and budget tiers fired follow their
        rule. Then the file no longer says its ids are by position. Returns how many alerts moved."""
        with self.store.transaction() as db:
            # Read everything, then write: an old id may be another rule's new one.
            renamed: dict[str, str] = {}
            alerts = []
            for old_key, rule, text in db.execute("SELECT key, rule, body FROM alert_state").fetchall():
                if rule in moves:
                    body = rekey(json.loads(text), moves[rule])
                    renamed[old_key] = body["key"]
                    alerts.append((body["key"], moves[rule], json.dumps(body)))
            sent = db.execute("SELECT key, notifier, sent FROM alert_sent").fetchall()
            tiers = db.execute("SELECT rule, period, tier FROM budget_tiers").fetchall()
            db.executemany("DELETE FROM alert_state WHERE key = ?", [(key,) for key in renamed])
            db.executemany("INSERT OR REPLACE INTO alert_state VALUES (?, ?, ?)", alerts)
            db.execute("DELETE FROM alert_sent")
            db.executemany(
                "INSERT OR REPLACE INTO alert_sent VALUES (?, ?, ?)",
                [(renamed.get(key, key), notifier, at) for key, notifier, at in sent],
            )
            db.execute("DELETE FROM budget_tiers")
            db.executemany(
                "INSERT OR IGNORE INTO budget_tiers VALUES (?, ?, ?)",
                [(moves.get(rule, rule), period, tier) for rule, period, tier in tiers],
            )
            if renamed:
                for entry_id, text in db.execute("SELECT id, event FROM outbox WHERE delivered IS NULL").fetchall():
                    event = read_event(text)
                    for alert in event["alerts"]:
                        alert["key"] = renamed.get(alert["key"], alert["key"])
                    db.execute("UPDATE outbox SET event = ? WHERE id = ?", (json.dumps(event), entry_id))
            db.execute("DELETE FROM meta WHERE key = 'rule_ids'")
        return len(renamed)

    def pending_count(self) -> dict[str, int]:
        with self.store._reading() as db:
            rows = db.execute(
                "SELECT notifier, COUNT(*) FROM (SELECT notifier FROM outbox WHERE delivered IS NULL"
                " UNION ALL SELECT notifier FROM digest_outbox WHERE delivered IS NULL) GROUP BY notifier"
            ).fetchall()
        return dict(rows)
