"""The state file itself: one SQLite file that survives a restart, opened by one exporter at a
time (`LockFile`), checked and migrated as it opens, and kept at its path while the exporter runs.

One connection, serialised by a lock, WAL journal; each save is one transaction, so a crash leaves
the previous complete state. Every fault of the file (corrupt, read-only, full, deleted, replaced,
in use) is a `StateError` whose message names the file. The tables' owners read and write through
`StateFile`'s `reading` and `transaction` (see `StateStore` and `AlertStore`); what a scrape reads
goes through `peeking`, a read-only connection beside that one, which a write in progress does not hold up.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from exporter.core.logs import get_logger
from exporter.state.errors import StateError, fault_of
from exporter.state.location import directory_writable
from exporter.state.lock import LockFile
from exporter.state.migrations import FIRST_TABLE, LAYOUT, MIGRATIONS, SCHEMA, complete, number_outboxes

log = get_logger(__name__)


def _identity_of(path: str) -> tuple[int, int] | None:
    """The (device, inode) of the file at `path`; None if there is none (OSError for other faults)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def connect_existing(path: str | Path, mode: str) -> sqlite3.Connection:
    """A connection to the file at `path` that never creates one (sqlite3.Error if there is none):
    read-only (`mode` "ro") or read-write ("rw")."""
    uri = f"{Path(path).resolve().as_uri()}?mode={mode}"
    return sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)


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


WRITER_RETRIES_WITHIN = 3600.0
"""How long a failed save is told once other writers' saves succeed: longer than the usage, the
alerts and the probes wait before they try again (a full disk stays told), though a history month,
saved once a day, is then told for an hour only."""


class StateFile:
    """The state file, opened by one exporter at a time.

    An exclusive lock on `<path>.lock` (holding the owner's pid) keeps a second exporter, or a
    second store in this process, off the file. At start-up the file is checked (`quick_check`)
    and written once, so a corrupt or read-only file is refused then rather than at the first
    evaluation. Every write transaction first checks that the file at the path is still the one
    opened: a deleted file is recreated from the open connection, a replaced one is refused.

    Every SQLite error comes out as a `StateError` naming the file and the fault. The owners'
    tables are subclasses of it, composed into `StateStore`; `AlertStore` works through one.
    """

    def __init__(self, path: str | Path, *, reset: bool = False) -> None:
        """Open (or create) the state file. With `reset`, a corrupt file is moved aside (see
        `move_aside`) and a fresh one started; without, it is refused with a `StateError`."""
        self.path = str(path)
        self._lock = threading.RLock()
        self._lock_file: LockFile | None = None
        self._identity: tuple[int, int] | None = None
        self._wal = False
        self._wal_identity: tuple[int, int] | None = None
        """The -wal journal's, as the connection opened it: one at the path since is not its own."""
        self._closed = False
        self._reader: sqlite3.Connection | None = None
        self._reader_lock = threading.Lock()
        self._beside = False
        """The connection is on the file at the path, in WAL mode: a reader may open it beside (`peeking`)."""
        self._write_errors: dict[str, tuple[str, float]] = {}
        """Per writer (`transaction`'s), how its last write failed and when (monotonic), while it
        has not written since."""
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
        self._lock_file = LockFile(self.path)
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
            self._lock_file.abandon()
            raise

    # -- opening --

    def _connect(self, path: str, *, create: bool = True) -> sqlite3.Connection:
        """A connection in WAL mode with the tables; raises sqlite3.Error (also, not `create`, when
        there is no file at `path`)."""
        if create or path == ":memory:":
            db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        else:
            db = connect_existing(path, "rw")
        try:
            # The layout first: a newer version's file is refused before anything here changes it
            # (switching it to WAL, for one).
            (version,) = db.execute("PRAGMA user_version").fetchone()
            if path != ":memory:":
                self._refuse_another_programs(db)
            if version > LAYOUT:
                raise StateError(
                    self.path,
                    f"state file {self.path} was written by a newer version (layout {version}; this one knows "
                    f"layouts up to {LAYOUT}): run that version, or start afresh with another state.path",
                )
            (mode,) = db.execute("PRAGMA journal_mode=WAL").fetchone()
            self._wal = mode == "wal"
            db.execute("PRAGMA synchronous=NORMAL")
            if path != ":memory:":
                (verdict,) = db.execute("PRAGMA quick_check(1)").fetchone()
                if verdict != "ok":
                    corrupt = sqlite3.DatabaseError(f"quick_check: {verdict[:200]}")
                    corrupt.sqlite_errorname = "SQLITE_CORRUPT"
                    raise corrupt
            db.executescript(SCHEMA)
            # Written once now, always: a read-only file opens (read-only) without complaint.
            db.execute("BEGIN IMMEDIATE")
            try:
                for step in MIGRATIONS[version:]:
                    step(db)
                complete(db)
                db.execute(f"PRAGMA user_version = {LAYOUT}")
                self.layout = version
                number_outboxes(db)
                db.execute("COMMIT")
            finally:
                if db.in_transaction:
                    db.execute("ROLLBACK")
        except BaseException:
            db.close()
            raise
        return db

    def _refuse_another_programs(self, db: sqlite3.Connection) -> None:
        """StateError for a database of another program's at `state.path` (a path mistyped: another
        service's file), whatever its `user_version`, before anything here changes it: a file is
        this exporter's when it is new (no table) or holds the table every version made first (a
        later version adds tables, at the same layout too: a file it wrote is not refused)."""
        tables = sorted(
            row[0]
            for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite%'")
        )
        if tables and FIRST_TABLE not in tables:
            shown = ", ".join(tables[:5]) + (", …" if len(tables) > 5 else "")
            raise StateError(
                self.path,
                f"state file {self.path} is not this exporter's (its tables: {shown}); check state.path, which"
                " must name a file of its own",
            )

    def _open(self) -> sqlite3.Connection:
        try:
            db = self._connect(self.path)
        except sqlite3.Error as error:
            name = getattr(error, "sqlite_errorname", "") or ""
            directory = Path(self.path).parent
            if name.startswith("SQLITE_CANTOPEN") and not directory_writable(directory):
                raise StateError(
                    self.path,
                    f"state file {self.path} cannot be opened: its directory {directory} is read-only ({error})",
                ) from None
            raise self._error(error) from error
        self._identity = self._stat_identity()
        self._opened_beside()
        return db

    def _stat_identity(self) -> tuple[int, int] | None:
        try:
            return _identity_of(self.path)
        except OSError as error:
            raise StateError(self.path, f"state file {self.path} cannot be examined ({error.strerror})") from None

    def _opened_beside(self) -> None:
        """The connection is now on the file at the path: note its -wal journal, and let a reader
        open beside it (in WAL mode)."""
        try:
            self._wal_identity = _identity_of(self.path + "-wal") if self._wal else None
        except OSError:
            self._wal_identity = None
        self._beside = self._wal_identity is not None

    def _move_aside(self) -> str:
        try:
            return move_aside(self.path)
        except OSError as error:
            raise StateError(
                self.path, f"state file {self.path} is corrupt and cannot be moved aside ({error.strerror or error})"
            ) from None

    def _error(self, error: sqlite3.Error) -> StateError:
        fault, corrupt = fault_of(error)
        remedy = "; move it aside or start with --reset-state" if corrupt else ""
        return StateError(self.path, f"state file {self.path} {fault}{remedy}", corrupt=corrupt, fault=fault)

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
            if self._lock_file is not None:
                self._lock_file.check()
            if identity is None:
                self._recreate(f"state file {self.path} was deleted while running")
            elif self._wal and (moved := self._wal_moved()):
                self._recreate(f"the -wal journal of state file {self.path} was {moved} while running")
        except OSError as error:
            raise StateError(self.path, f"state file {self.path}: {error.strerror or error}") from None

    def _wal_moved(self) -> str:
        """How the -wal journal at the path is not the connection's own: "deleted", "replaced"
        (another file in its place, such as one a connection made after it was deleted), or ""."""
        wal = _identity_of(self.path + "-wal")
        if wal is None:
            return "deleted"
        return "replaced" if self._wal_identity is not None and wal != self._wal_identity else ""

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
            fault, _ = fault_of(error)
            raise StateError(self.path, f"{event}, and it cannot be recreated ({fault})") from None
        # The old connections must be gone before the new file is opened: its -wal and -shm, if still
        # there, belong to the deleted file and would be taken for the new one's.
        self._leave_beside()
        self._db.close()
        copied: tuple[int, int] | None = None
        try:
            copied = _identity_of(staging)
            for suffix in ("-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.path + suffix)
            # The copy keeps its own name too until a connection is on it at the path: should the
            # path lose it again meanwhile, the copy is still there to work on.
            _install(staging, self.path, over=self._stat_identity() == self._identity)  # (over: our own file)
            db = self._connect(self.path, create=False)  # (never a new, empty file)
            if _identity_of(self.path) != copied:
                db.close()
                raise OSError(errno.ENOENT, "the file put at the path was gone again at once")
        except (OSError, StateError, sqlite3.Error) as error:
            cause = error.args[0] if isinstance(error, sqlite3.Error) else getattr(error, "strerror", None) or error
            self._work_on_copy(staging, copied)
            raise StateError(self.path, f"{event}, and it cannot be recreated ({cause})") from None
        self._identity, self._db = copied, db
        with contextlib.suppress(FileNotFoundError):
            os.remove(staging)
        self._opened_beside()
        log.warning("state file recreated from the open copy", path=self.path, event=event)

    def _work_on_copy(self, staging: str, copied: tuple[int, int] | None) -> None:
        """After a recreation that failed once the old connection was closed: go on with the copy,
        at the path if it is there (the next write then looks at its journal), else under its own
        name (the next write tries again to put it at the path). StateError if neither holds it."""
        for name in (self.path, staging):
            try:
                if copied is None or _identity_of(name) != copied:
                    continue
                db = connect_existing(name, "rw")
            except (OSError, sqlite3.Error):
                continue
            try:
                (mode,) = db.execute("PRAGMA journal_mode=WAL").fetchone()
            except sqlite3.Error:
                db.close()
                continue
            self._db, self._identity = db, copied
            if name == self.path:
                self._wal = mode == "wal"
                self._opened_beside()
                with contextlib.suppress(OSError):
                    os.remove(staging)  # (its second name, or nothing)
            return
        raise StateError(self.path, f"state file {self.path}: its copy was lost while it was being recreated")

    # -- reading and writing --

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._check_file()  # a file deleted since the last write is written back before closing
            except StateError as error:
                log.error("closing the state file failed", path=self.path, error=str(error))
            self._leave_beside()
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
            if self._lock_file is not None:
                self._lock_file.release()

    @contextmanager
    def reading(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                yield self._db
            except sqlite3.Error as error:
                raise self._error(error) from error

    @contextmanager
    def peeking(self) -> Iterator[sqlite3.Connection]:
        """A read of what was last committed that no write transaction holds up: through a read-only
        connection of its own beside the one that writes (in WAL mode a reader neither waits for
        the writer nor holds it up), for what a scrape reads while a large save or a slow disk
        keeps the writer busy. Where no such reader can be opened (an in-memory file, a file not in
        WAL mode, one deleted or replaced since the last write, or a copy the exporter works on
        because it could not put it back at the path), it reads as `reading` does; one opened
        before reads the file the writer has open until a recreation closes it."""
        with self._reader_lock:
            reader = self._open_reader() if self._beside else None
            if reader is not None:
                try:
                    yield reader
                except sqlite3.Error as error:
                    self._close_reader()
                    raise self._error(error) from error
                return
        with self.reading() as db:
            yield db

    def _open_reader(self) -> sqlite3.Connection | None:
        """The reader of `peeking`, opened the first time (holding `_reader_lock`); None where the
        path does not hold the file and the -wal journal that the writing connection has open."""
        if self._reader is not None:
            return self._reader
        wal = self.path + "-wal"
        try:
            if _identity_of(wal) != self._wal_identity:
                return None
            reader = connect_existing(self.path, "ro")
        except (OSError, sqlite3.Error):
            return None
        try:
            # The first read opens the -wal: one deleted since the look above is made anew, empty,
            # and the reader is not used (the writer's next write finds it is not its own).
            reader.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
            same = _identity_of(self.path) == self._identity and _identity_of(wal) == self._wal_identity
        except (OSError, sqlite3.Error):
            same = False
        if not same:
            with contextlib.suppress(sqlite3.Error):
                reader.close()
            return None
        self._reader = reader
        return reader

    def _close_reader(self) -> None:
        """(Holding `_reader_lock`.)"""
        if self._reader is not None:
            with contextlib.suppress(sqlite3.Error):
                self._reader.close()
            self._reader = None

    def _leave_beside(self) -> None:
        """No reader beside the writing connection from now on (until `_beside` is set again)."""
        with self._reader_lock:
            self._beside = False
            self._close_reader()

    @property
    def write_error(self) -> str:
        """How a write failed, while the writer it failed for has not written since ("" when none)."""
        return next((error for error, _ in self._write_errors.values()), "")

    @contextmanager
    def transaction(self, writer: str = "") -> Iterator[sqlite3.Connection]:
        """One write transaction; a failure rolls it back and raises StateError (the next may succeed).
        `writer`: what it saves (the usage, the alerts…), for `write_error`: a failure is told until
        that writer commits a change, not cleared by one that changed nothing (an evaluation with
        nothing new: a full disk takes it), nor by another writer's change while it may still be
        tried again (WRITER_RETRIES_WITHIN; a failure of no writer named, a reload's, at once):
        a writer a reload took out, or that has nothing more to save today, is not waited for."""
        with self._lock:
            changes = self._db.total_changes
            try:
                with self._write() as db:
                    yield db
            except StateError as error:
                self._write_errors[writer] = (str(error), time.monotonic())
                raise
            if self._db.total_changes != changes:
                self._write_errors.pop(writer, None)
                since = time.monotonic() - WRITER_RETRIES_WITHIN
                self._write_errors = {w: (e, at) for w, (e, at) in self._write_errors.items() if w and at > since}

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


def _install(staging: str, path: str, *, over: bool) -> None:
    """Put `staging` at `path` as a second name of it (a hard link), unless a file appeared there
    meanwhile; `over`: in place of the file there, whichever it is. Where the file system has no
    hard links, it is moved, over whatever is there (then the name `staging` is gone)."""
    linked = f"{staging}-link"
    with contextlib.suppress(FileNotFoundError):
        os.remove(linked)
    try:
        os.link(staging, linked if over else path)
    except FileExistsError:
        raise OSError(errno.EEXIST, "another file appeared at the path meanwhile") from None
    except OSError as error:
        if error.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EMLINK):
            raise
        os.replace(staging, path)  # no hard links on this file system
        return
    if over:
        os.replace(linked, path)
