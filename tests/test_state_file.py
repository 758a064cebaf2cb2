"""The state file's faults: a second exporter on it, corrupt or truncated, read-only, full, deleted or
replaced while running. Real files in tmp_path; the `run` command as a real process."""

from __future__ import annotations

import datetime as dt
import errno
import logging
import os
import shutil
import signal
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import pytest

from exporter.sim import Simulator, SimulatorServer
from exporter.state import LAYOUT, AlertStore, StateError, StateStore, UsageCursor
from exporter.state import file as state_file
from exporter.state.accounts import AccountFile
from exporter.state.store import peek_account_files
from tests.conftest import DATA
from tests.helpers import free_port, logged, wait_for
from tests.test_cli import ready, run, spawn, write_config

DAY = dt.date(2026, 11, 22)
KEEP_FROM = dt.date(2026, 11, 1)


def usage_rows(n: int, tag: str = "") -> list[tuple[str, str, str, int, int, int, int]]:
    return [(f"ep-{i}{tag}", "model-a", "sk-1", i, 2 * i, 3 * i, i) for i in range(n)]


def save_day(store: StateStore, day: dt.date, rows: int = 3, tag: str = "") -> None:
    store.save_usage(UsageCursor(day, "settings", rows, f"id-{rows}", "fp"), usage_rows(rows, tag), 1.0, KEEP_FROM)


def add_alert(store: StateStore, key: str) -> None:
    with store.transaction() as db:
        AlertStore.save_state(db, key, "rule", f'{{"key": "{key}"}}')
        AlertStore.mark_sent(db, key, "hook", 1.0)
        AlertStore.enqueue(db, "hook", f"firing {key}", 1.0)


def write_real_state(path: Path) -> None:
    """A state file as the daemon leaves it: usage rows, alerts, the outbox; closed cleanly."""
    store = StateStore(path)
    save_day(store, DAY, rows=400)
    save_day(store, DAY + dt.timedelta(days=1), rows=400)
    for n in range(40):
        add_alert(store, f"alert-{n}")
    store.close()
    assert not os.path.exists(f"{path}-wal")  # all of it is in the file itself


def contents(store: StateStore) -> tuple[object, ...]:
    alerts = AlertStore(store)
    return (
        store.load_usage(DAY),
        store.load_usage(DAY + dt.timedelta(days=1)),
        alerts.load_states(),
        alerts.load_sent(),
        alerts.pending_count(),
    )


@contextmanager
def read_only(path: Path) -> Iterator[None]:
    """Make a file or directory read-only, even for root (who ignores the permission bits): then with
    the immutable attribute."""
    if os.geteuid() != 0:
        mode = path.stat().st_mode
        path.chmod(0o555 if path.is_dir() else 0o444)
        try:
            yield
        finally:
            path.chmod(mode)
        return
    chattr = shutil.which("chattr")
    if chattr is None:
        pytest.skip("running as root, which ignores file permissions, and chattr is not installed")
    made = subprocess.run([chattr, "+i", str(path)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"running as root, and this file system has no immutable attribute: {made.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run([chattr, "-i", str(path)], check=True)


# -- one exporter per file --


def test_a_second_store_on_the_same_file_is_refused_until_the_first_closes(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    first = StateStore(path)
    assert Path(f"{path}.lock").read_text().strip() == str(os.getpid())
    with pytest.raises(StateError) as refused:
        StateStore(path)
    assert str(refused.value) == (
        f"state file {path} is in use by another exporter (pid {os.getpid()}); each exporter needs its own state.path"
    )
    save_day(first, DAY)  # the refusal did not disturb the holder
    first.close()
    second = StateStore(path)
    assert second.load_usage(DAY) is not None
    second.close()


def test_a_second_store_on_the_file_through_a_symlink_is_refused_too(tmp_path: Path) -> None:
    path, link = tmp_path / "state.db", tmp_path / "link.db"
    link.symlink_to(path)
    first = StateStore(path)
    with pytest.raises(StateError, match="in use by another exporter"):
        StateStore(link)
    first.close()


def test_a_deleted_lock_file_is_locked_again_at_the_next_write(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = StateStore(path)
    os.remove(f"{path}.lock")
    save_day(store, DAY)
    assert Path(f"{path}.lock").read_text().strip() == str(os.getpid())
    with pytest.raises(StateError, match="in use by another exporter"):
        StateStore(path)

    os.remove(f"{path}.lock")
    intruder = StateStore(path)  # in the gap before the next write: it gets the new lock file
    with pytest.raises(StateError, match=f"state file {path} is in use by another exporter"):
        save_day(store, DAY)
    store.close()
    intruder.close()


def test_a_memory_store_takes_no_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    one, two = StateStore(":memory:"), StateStore(":memory:")
    save_day(one, DAY)
    assert two.load_usage(DAY) is None
    one.close()
    two.close()
    assert list(tmp_path.iterdir()) == []


# -- start-up --


def corrupt_file(path: Path, kind: str) -> bytes:
    if kind == "random":
        path.write_bytes(os.urandom(64 * 1024))
    else:
        write_real_state(path)
        os.truncate(path, path.stat().st_size // 2)
    return path.read_bytes()


@pytest.mark.parametrize("kind", ["random", "truncated"])
def test_a_corrupt_file_is_refused_naming_it(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "state.db"
    original = corrupt_file(path, kind)
    with pytest.raises(StateError) as refused:
        StateStore(path)
    message = str(refused.value)
    assert message.startswith(f"state file {path} ")
    fault = "is not a SQLite database (file is not a database)" if kind == "random" else "is corrupt ("
    assert fault in message
    assert message.endswith("; move it aside or start with --reset-state")
    assert refused.value.corrupt
    assert path.read_bytes() == original
    StateStore(tmp_path / "other.db").close()  # the refused store let go of nothing it should keep
    with pytest.raises(StateError, match=r"corrupt|not a SQLite"):
        StateStore(path)  # and released its lock: the same refusal, not "in use"


def test_reset_moves_a_corrupt_file_aside_and_starts_afresh(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "state.db"
    original = corrupt_file(path, "truncated")
    with caplog.at_level(logging.WARNING, logger="exporter.state"):
        store = StateStore(path, reset=True)
    assert store.moved_aside is not None
    [aside] = tmp_path.glob("state.db.corrupt-*[0-9]")
    assert str(aside) == store.moved_aside
    assert aside.read_bytes() == original
    assert store.load_usage(DAY) is None
    save_day(store, DAY)
    store.close()
    [warning] = caplog.records
    assert warning.getMessage() == "state file moved aside; started a fresh one"
    assert (warning.fields["path"], warning.fields["moved_to"]) == (str(path), str(aside))  # type: ignore[attr-defined]

    kept = StateStore(path, reset=True)  # a sound file is not moved aside
    assert kept.moved_aside is None
    assert kept.load_usage(DAY) is not None
    kept.close()


@pytest.mark.integration  # as root, the chattr binary (root ignores the permission bits)
@pytest.mark.parametrize("what", ["file", "directory", "directory without a lock file"])
def test_a_read_only_file_or_directory_is_refused_at_start(tmp_path: Path, what: str) -> None:
    directory = tmp_path / "state"
    directory.mkdir()
    path = directory / "state.db"
    write_real_state(path)
    if what == "directory without a lock file":
        os.remove(f"{path}.lock")
    with read_only(path if what == "file" else directory), pytest.raises(StateError) as refused:
        StateStore(path)
    assert str(path) in str(refused.value)
    assert "read-only" in str(refused.value)
    store = StateStore(path)  # writable again: it opens, with everything in it
    assert store.load_usage(DAY) is not None
    store.close()


def test_a_state_directory_that_cannot_be_created_is_named(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    path = tmp_path / "file" / "state.db"
    with pytest.raises(StateError) as refused:
        StateStore(path)
    assert str(refused.value).startswith(f"state file {path}: cannot create its directory {tmp_path / 'file'} (")


# -- running --


def test_a_write_failure_names_the_file_rolls_back_and_the_next_write_succeeds(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = StateStore(path)
    save_day(store, DAY, rows=3)
    before = contents(store)

    store._db.execute("PRAGMA query_only = ON")  # what a file gone read-only under us does
    with pytest.raises(StateError) as refused:
        save_day(store, DAY, rows=5)
    assert str(refused.value) == f"state file {path} is read-only (attempt to write a readonly database)"
    store._db.execute("PRAGMA query_only = OFF")
    save_day(store, DAY, rows=4)
    assert store.load_usage(DAY)[0].records == 4  # type: ignore[index]
    before = contents(store)

    (pages,) = store._db.execute("PRAGMA page_count").fetchone()
    store._db.execute(f"PRAGMA max_page_count = {pages}")  # what a full disk does, part-way through
    with pytest.raises(StateError) as full:
        save_day(store, DAY, rows=20_000)
    assert str(full.value) == f"state file {path} cannot be written: the disk is full (database or disk is full)"
    with pytest.raises(StateError, match="disk is full"):
        add_alert(store, "too-much" * 100_000)
    assert contents(store) == before  # rolled back: nothing half-written
    assert not store._db.in_transaction
    store._db.execute("PRAGMA max_page_count = 1073741823")
    save_day(store, DAY, rows=20_000)
    add_alert(store, "after")
    store.close()
    reopened = StateStore(path)
    assert reopened.load_usage(DAY)[0].records == 20_000  # type: ignore[index]
    assert "after" in AlertStore(reopened).load_states()
    reopened.close()


def test_a_failed_save_is_told_until_its_writer_saves_again_whatever_else_is_written(tmp_path: Path) -> None:
    """`write_error` (the `state_write_success` gauge): a usage save refused by a full disk is not
    forgotten at the next alert evaluation, which may write nothing, or a little a full disk
    still takes; it is once the usage is saved."""
    store = StateStore(tmp_path / "state.db")
    save_day(store, DAY, rows=3)
    (pages,) = store._db.execute("PRAGMA page_count").fetchone()
    store._db.execute(f"PRAGMA max_page_count = {pages + 1}")  # a full disk: room for a little only
    with pytest.raises(StateError, match="disk is full"):
        save_day(store, DAY, rows=20_000)
    with store.transaction("alerts"):
        pass  # (an evaluation with nothing new)
    with store.transaction("alerts") as db:
        AlertStore.save_state(db, "small", "rule", "{}")  # (one that writes a little)
    assert "disk is full" in store.write_error
    store._db.execute("PRAGMA max_page_count = 1073741823")
    save_day(store, DAY, rows=20_000)  # (`save_usage`: the usage writer)
    assert store.write_error == ""
    store.close()


def test_a_writer_that_saves_no_more_is_not_waited_for_past_its_retries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe's save failed, then a reload took the probe out: once it would have been tried again
    (WRITER_RETRIES_WITHIN), the other writers' saves say the file is written."""
    store = StateStore(tmp_path / "state.db")
    store._db.execute("PRAGMA query_only = ON")
    with pytest.raises(StateError):
        store.record_probe_run("gone", 1.0, True, 0.1, keep_from=0.0)
    store._db.execute("PRAGMA query_only = OFF")
    save_day(store, DAY, rows=3)
    assert "read-only" in store.write_error  # (it may still be tried again)
    later = time.monotonic() + state_file.WRITER_RETRIES_WITHIN + 1
    monkeypatch.setattr(state_file.time, "monotonic", lambda: later)
    save_day(store, DAY, rows=4)
    assert store.write_error == ""
    store.close()


def test_reads_raise_state_errors_not_sqlite_errors(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = StateStore(path)
    for table in ("usage_cursor", "alert_state", "alert_sent", "budget_tiers", "outbox"):
        store._db.execute(f"DROP TABLE {table}")
    alerts = AlertStore(store)
    for read in (
        lambda: store.load_usage(DAY),
        alerts.load_states,
        alerts.load_sent,
        lambda: alerts.tiers_fired("rule", "2026-11"),
        lambda: alerts.head("hook"),
        alerts.pending_count,
        lambda: alerts.delivered(1, 1.0),
    ):
        with pytest.raises(StateError, match=f"^state file {path} failed \\(no such table: "):
            read()
    store.close()


def rows_in_file(path: Path) -> tuple[int, int, int, int]:
    """What another process would find in the file now (a crash of ours would leave just that)."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        counts = tuple(
            db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]  # noqa: S608 (our own table names)
            for table in ("usage_cursor", "usage_totals", "alert_state", "outbox")
        )
    finally:
        db.close()
    return counts  # type: ignore[return-value]


@pytest.mark.parametrize(
    "deleted", ["the file alone", "file, -wal and -shm", "the -wal journal alone", "the whole directory"]
)
def test_a_file_deleted_while_running_is_recreated_with_every_row(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, deleted: str
) -> None:
    directory = tmp_path / "state"
    path = directory / "state.db"
    store = StateStore(path)
    save_day(store, DAY, rows=5)
    add_alert(store, "before")
    if deleted == "the whole directory":
        shutil.rmtree(directory)
    else:
        suffixes = {"the file alone": [""], "the -wal journal alone": ["-wal"]}.get(deleted, ["", "-wal", "-shm"])
        for suffix in suffixes:  # "the file alone" leaves the -wal and -shm the open connection still uses
            os.remove(f"{path}{suffix}")
    with caplog.at_level(logging.WARNING, logger="exporter.state"):
        save_day(store, DAY + dt.timedelta(days=1), rows=7)
    add_alert(store, "after")
    assert path.exists()
    assert rows_in_file(path) == (2, 12, 2, 2)  # before and after the deletion, in the file itself
    [warning] = logged(caplog.records, "state file recreated from the open copy", path=str(path))
    assert "was deleted while running" in warning.fields["event"]  # type: ignore[attr-defined]
    if deleted == "the whole directory":  # the lock file went too: taken again
        assert logged(caplog.records, "state lock file was deleted while running", path=f"{path}.lock")
    with pytest.raises(StateError, match="in use"):
        StateStore(path)  # still locked
    store.close()

    reopened = StateStore(path)
    usage, next_day, states, sent, pending = contents(reopened)
    assert usage[1] == usage_rows(5)  # type: ignore[index]
    assert next_day[1] == usage_rows(7)  # type: ignore[index]
    assert set(states) == {"before", "after"}
    assert set(sent) == {("before", "hook"), ("after", "hook")}
    assert pending == {"hook": 2}
    reopened.close()
    assert not list(directory.glob("*.recreating*"))


@pytest.mark.parametrize("deleted", ["the file alone", "the -wal journal alone"])
def test_a_file_deleted_again_as_it_is_recreated_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, deleted: str
) -> None:
    """Deleted again between being put back at the path and being opened there: that write is
    refused, and the next one puts the copy back, every row in it (no new, empty file is opened)."""
    path = tmp_path / "state.db"
    store = StateStore(path)
    save_day(store, DAY, rows=5)
    add_alert(store, "before")
    os.remove(f"{path}{'' if deleted == 'the file alone' else '-wal'}")
    install = state_file._install

    def and_gone_again(staging: str, target: str, *, over: bool) -> None:
        install(staging, target, over=over)
        os.remove(target)

    monkeypatch.setattr(state_file, "_install", and_gone_again)
    with pytest.raises(StateError, match="while running, and it cannot be recreated"):
        add_alert(store, "refused")
    monkeypatch.undo()
    assert AlertStore(store).pending_count() == {"hook": 1}
    add_alert(store, "after")
    assert rows_in_file(path) == (1, 5, 2, 2)
    store.close()
    reopened = StateStore(path)
    assert set(AlertStore(reopened).load_states()) == {"before", "after"}
    assert reopened.load_usage(DAY)[1] == usage_rows(5)  # type: ignore[index]
    reopened.close()
    assert not list(tmp_path.glob("*.recreating*"))


@pytest.mark.parametrize("links", [True, False], ids=["hard links", "no hard links"])
@pytest.mark.parametrize("opening", ["succeeds", "fails once"])
def test_a_recreated_file_that_cannot_be_opened_at_once_is_worked_on_at_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, opening: str, links: bool
) -> None:
    """The copy is put at the path (a second name of it, or moved there on a file system without
    hard links). Should opening it there fail (a full disk, say), the exporter works on it there
    all the same: the next writes neither lose it, nor refuse it as another file, nor recreate it again."""
    path = tmp_path / "state.db"
    store = StateStore(path)
    save_day(store, DAY, rows=5)
    add_alert(store, "before")
    os.remove(path)

    def no_links(*args: object) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    if not links:
        monkeypatch.setattr(os, "link", no_links)
    if opening == "fails once":
        connect = StateStore._connect

        def fails_once(self: StateStore, at: str, *, create: bool = True) -> sqlite3.Connection:
            monkeypatch.setattr(StateStore, "_connect", connect)
            raise sqlite3.OperationalError("disk I/O error")

        monkeypatch.setattr(StateStore, "_connect", fails_once)
        with pytest.raises(StateError, match="was deleted while running, and it cannot be recreated"):
            add_alert(store, "refused")
    caplog.set_level(logging.WARNING, logger="exporter.state")
    for n in range(3):
        add_alert(store, f"after-{n}")
    recreated = logged(caplog.records, "state file recreated from the open copy")
    assert len(recreated) == (1 if opening == "succeeds" else 0)
    assert rows_in_file(path) == (1, 5, 4, 4)
    assert counted_during_a_write(store) == {"hook": 4}  # read beside the writer
    store.close()
    assert not list(tmp_path.glob("*.recreating*"))


def test_a_file_deleted_after_the_last_write_is_written_back_on_close(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = StateStore(path)
    save_day(store, DAY, rows=5)
    add_alert(store, "firing")
    for suffix in ("", "-wal", "-shm"):
        os.remove(f"{path}{suffix}")
    store.close()
    reopened = StateStore(path)
    assert reopened.load_usage(DAY) is not None
    assert set(AlertStore(reopened).load_states()) == {"firing"}  # not re-sent as new after the restart
    reopened.close()


def test_a_file_replaced_while_running_is_not_written_over(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = StateStore(path)
    save_day(store, DAY)
    other = tmp_path / "other.db"
    write_real_state(other)
    os.replace(other, path)
    original = path.read_bytes()
    with pytest.raises(StateError) as refused:
        save_day(store, DAY, rows=9)
    assert str(refused.value).startswith(f"state file {path} was replaced while running")
    assert path.read_bytes() == original
    os.remove(path)  # removing the stranger lets this store put its own file back
    save_day(store, DAY, rows=9)
    store.close()
    reopened = StateStore(path)
    assert reopened.load_usage(DAY)[0].records == 9  # type: ignore[index]
    reopened.close()


# -- what a scrape reads, beside the writer --


def one_waiting(path: Path, key: str, *, counted: bool) -> tuple[StateStore, AlertStore]:
    """A store at `path` with one alert and its notification waiting; `counted`: counted once
    already (as a scrape does), so its reader beside the writer is open."""
    store = StateStore(path)
    alerts = AlertStore(store)
    add_alert(store, key)
    if counted:
        assert alerts.pending_count() == {"hook": 1}
    return store, alerts


def counted_during_a_write(store: StateStore) -> dict[str, int]:
    """`pending_count` (what every scrape reads), asked while another thread holds a write
    transaction that queues one more notification; fails if the count waits for that transaction."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with store.transaction() as db:
            AlertStore.enqueue(db, "hook", "firing uncommitted", 2.0)  # type: ignore[arg-type]
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(30)
        counted: dict[str, int] = {}
        reading = threading.Thread(target=lambda: counted.update(AlertStore(store).pending_count()), daemon=True)
        reading.start()
        reading.join(10)
        assert not reading.is_alive(), "the count waited for the write transaction"
    finally:
        release.set()
        holder.join(30)
    return counted


def test_the_outbox_is_counted_beside_a_write_in_progress_as_last_committed(tmp_path: Path) -> None:
    """Answered while a write transaction is open (a large save, a slow disk), not after it, and
    counting only what was committed; the reader leaves nothing behind at a clean close."""
    path = tmp_path / "state.db"
    store = StateStore(path)
    add_alert(store, "committed")
    assert counted_during_a_write(store) == {"hook": 1}
    assert AlertStore(store).pending_count() == {"hook": 2}
    store.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.db", "state.db.lock"]  # no -wal, no -shm


@pytest.mark.parametrize("opened", [True, False], ids=["reader open before", "no reader yet"])
@pytest.mark.parametrize("deleted", ["the file alone", "file, -wal and -shm", "the -wal journal alone"])
def test_the_outbox_counted_beside_follows_a_deleted_file_and_its_recreation(
    tmp_path: Path, deleted: str, opened: bool
) -> None:
    path = tmp_path / "state.db"
    store, alerts = one_waiting(path, "before", counted=opened)
    suffixes = {"the file alone": [""], "the -wal journal alone": ["-wal"]}.get(deleted, ["", "-wal", "-shm"])
    for suffix in suffixes:
        os.remove(f"{path}{suffix}")
    assert alerts.pending_count() == {"hook": 1}  # deleted, not yet recreated: what the writer holds
    add_alert(store, "after")  # recreates the file
    assert alerts.pending_count() == {"hook": 2}  # read from the new file, not from the deleted one
    assert counted_during_a_write(store) == {"hook": 2}  # and beside the writer again
    assert alerts.pending_count() == {"hook": 3}
    store.close()


@pytest.mark.parametrize("when", ["reader open before", "no reader yet", "as the reader opens"])
def test_a_wal_journal_replaced_by_an_empty_one_is_neither_read_nor_written_to(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """What a reader opened just after the -wal journal was deleted leaves (it makes an empty one):
    counted from the writer's own, and the file recreated at the next write, with every row."""
    path = tmp_path / "state.db"
    store, alerts = one_waiting(path, "before", counted=when == "reader open before")
    if when == "as the reader opens":  # deleted between the reader's look at the -wal and its first read
        connect = sqlite3.connect

        def deleted_first(*args: Any, **kwargs: Any) -> sqlite3.Connection:
            os.remove(f"{path}-wal")
            return connect(*args, **kwargs)

        monkeypatch.setattr(sqlite3, "connect", deleted_first)
        assert alerts.pending_count() == {"hook": 1}
        monkeypatch.undo()
        assert os.path.exists(f"{path}-wal")  # made anew, empty, by the reader
    else:
        os.remove(f"{path}-wal")
        Path(f"{path}-wal").touch()
    assert alerts.pending_count() == {"hook": 1}
    with caplog.at_level(logging.WARNING, logger="exporter.state"):
        add_alert(store, "after")
    [warning] = logged(caplog.records, "state file recreated from the open copy", path=str(path))
    event = warning.fields["event"]  # type: ignore[attr-defined]
    assert event == f"the -wal journal of state file {path} was replaced while running"
    assert alerts.pending_count() == {"hook": 2}
    assert counted_during_a_write(store) == {"hook": 2}
    store.close()
    reopened = StateStore(path)
    assert set(AlertStore(reopened).load_states()) == {"before", "after"}
    assert AlertStore(reopened).pending_count() == {"hook": 3}  # (the one `counted_during_a_write` queued too)
    reopened.close()


@pytest.mark.parametrize("opened", [True, False], ids=["reader open before", "no reader yet"])
def test_the_outbox_counted_beside_is_never_that_of_a_file_put_in_its_place(tmp_path: Path, opened: bool) -> None:
    path = tmp_path / "state.db"
    store, alerts = one_waiting(path, "ours", counted=opened)
    store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # as a checkpoint leaves it: all of it in the file
    other = tmp_path / "other.db"
    write_real_state(other)  # 40 notifications waiting for "hook"
    os.replace(other, path)
    assert alerts.pending_count() == {"hook": 1}
    store.close()


# -- the run command --


def run_config(tmp_path: Path, live: tuple[Simulator, SimulatorServer], state: Path) -> tuple[Path, dict[str, str]]:
    sim, server = live
    config = write_config(tmp_path, sim, server, state=state)
    return config, {"TEST_BILLING_SECRET": sim.secret_access_key}


@pytest.mark.integration  # the daemon as a process, then the command again, against a simulator on loopback
def test_run_twice_on_one_state_file_refuses_the_second(
    tmp_path: Path, live: tuple[Simulator, SimulatorServer]
) -> None:
    state = tmp_path / "state.db"
    config, env = run_config(tmp_path, live, state)
    first, url = spawn("run", "--config", str(config), env=env)
    try:
        wait_for(lambda: ready(url), timeout=30)
        second = run("run", "--config", str(config), "--listen", f"127.0.0.1:{free_port()}", env=env)
        assert second.returncode == 1
        assert second.stderr.splitlines() == [
            f"inference-cost-exporter: state file {state} is in use by another exporter (pid {first.pid}); "
            "each exporter needs its own state.path"
        ]
        assert ready(url)
        assert first.poll() is None
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=15) == 0
    finally:
        first.kill()
        first.communicate()


@pytest.mark.integration  # the command as a process, then the daemon, against a simulator on loopback
@pytest.mark.parametrize("kind", ["random", "truncated"])
def test_run_refuses_a_corrupt_state_file_and_moves_it_aside_when_told(
    tmp_path: Path, live: tuple[Simulator, SimulatorServer], kind: str
) -> None:
    state = tmp_path / "state.db"
    original = corrupt_file(state, kind)
    config, env = run_config(tmp_path, live, state)
    refused = run("run", "--config", str(config), "--listen", f"127.0.0.1:{free_port()}", env=env)
    assert refused.returncode == 1
    [line] = refused.stderr.splitlines()
    assert line.startswith(f"inference-cost-exporter: state file {state} ")
    assert line.endswith("; move it aside or start with --reset-state")
    assert state.read_bytes() == original

    process, url = spawn("run", "--config", str(config), "--reset-state", env=env)
    try:
        wait_for(lambda: ready(url), timeout=30)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
    finally:
        process.kill()
        _, stderr = process.communicate()
    [aside] = tmp_path.glob("state.db.corrupt-*[0-9]")
    assert aside.read_bytes() == original
    assert any(str(state) in line and str(aside) in line for line in stderr.splitlines()), stderr
    assert "Traceback" not in stderr
    reopened = StateStore(state)  # the fresh file the daemon used, closed cleanly
    reopened.close()


@pytest.mark.integration  # the command as a process, against a simulator on loopback
def test_run_names_a_state_directory_it_cannot_create(tmp_path: Path, live: tuple[Simulator, SimulatorServer]) -> None:
    (tmp_path / "file").write_text("")
    state = tmp_path / "file" / "state.db"
    config, env = run_config(tmp_path, live, state)
    result = run("run", "--config", str(config), "--listen", f"127.0.0.1:{free_port()}", env=env)
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert line.startswith(f"inference-cost-exporter: state file {state}: cannot create its directory ")
    assert "cannot listen" not in line


def test_a_file_this_version_wrote_can_still_be_written_by_the_version_before(tmp_path: Path) -> None:
    """What this version adds to a day's cursor (the list's order, its head, a capped page size,
    when its counters started) lives in tables of their own: the previous version's seven-value
    insert still fits. A cursor it wrote since is not taken with the `created` saved before (its
    counters may have reset since): the day's start stands."""
    store = StateStore(tmp_path / "state.db")
    day = dt.date(2026, 11, 22)
    cursor = UsageCursor(day, "s", 3, "", "", head_ids="00" * 8, newest_first=True, page_size=40, created=1000.0)
    store.save_usage(cursor, [], 1.0, day)
    assert store.load_usage(day) == (cursor, [])
    store.close()
    with sqlite3.connect(tmp_path / "state.db") as db:
        db.execute(
            "INSERT OR REPLACE INTO usage_cursor VALUES (?, ?, ?, ?, ?, ?, ?)", ("2026-11-22", "s", 4, "", "", 0, 2.0)
        )
    reopened = StateStore(tmp_path / "state.db")
    try:
        loaded = reopened.load_usage(day)
        assert loaded is not None
        assert (loaded[0].records, loaded[0].created) == (4, 0.0)
    finally:
        reopened.close()


# -- layouts --


def table_rows(path: Path) -> dict[str, list[tuple[object, ...]]]:
    with sqlite3.connect(path) as db:
        names = [n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {name: sorted(db.execute(f"SELECT * FROM {name}").fetchall(), key=repr) for name in names}  # noqa: S608


@pytest.mark.parametrize("layout", [0])
def test_a_file_of_every_earlier_layout_opens_migrated_with_nothing_lost(tmp_path: Path, layout: int) -> None:
    """tests/data/state-layout<N>.db: written by the last release of each layout (its daemon's
    usage, history, settled days, probe runs, alerts, tiers and both outboxes with work waiting)."""
    path = tmp_path / "state.db"
    shutil.copy(DATA / f"state-layout{layout}.db", path)
    before = table_rows(path)
    store = StateStore(path)
    try:
        assert store.layout == layout
        alerts = AlertStore(store)
        head = alerts.head("late")
        assert head is not None
        assert head.recipients == ()  # the column a later layout added reads as nobody owed yet
        cursor_day = dt.date.fromisoformat(str(before["usage_cursor"][0][0]))
        loaded = store.load_usage(cursor_day)
        assert loaded is not None
        assert len(loaded[1]) == len(before["usage_totals"])
        assert len(store.load_history()) == len(before["bill_history"])
    finally:
        store.close()
    after = table_rows(path)
    for table, rows in before.items():
        if table == "sqlite_sequence":
            assert after[table] == rows  # the outbox numbering goes on where it was
            continue
        width = len(rows[0]) if rows else 0  # columns a later layout added come after the old ones
        assert sorted((row[:width] for row in after[table]), key=repr) == rows, table
    with sqlite3.connect(path) as db:
        (written,) = db.execute("PRAGMA user_version").fetchone()
    assert written == LAYOUT


def columns(path: Path) -> dict[str, list[str]]:
    with closing(sqlite3.connect(path)) as db:
        names = [n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {name: [row[1] for row in db.execute(f"PRAGMA table_info({name})")] for name in names}


def test_a_file_whose_tables_lack_columns_that_came_after_them_in_the_same_layout_gets_them(tmp_path: Path) -> None:
    """Builds between two releases made tables that later gained columns, all in files of layout 1
    (no migration step runs on them): the usage refreshes failed for good on `usage_created.updated`,
    and the accounts' files on `account_files.used`. Each gets its columns, its rows kept."""
    fresh, path = tmp_path / "fresh.db", tmp_path / "state.db"
    StateStore(fresh).close()
    StateStore(path).close()
    with closing(sqlite3.connect(path)) as db:
        db.executescript("""
            DROP TABLE usage_created; CREATE TABLE usage_created (day TEXT PRIMARY KEY, created REAL NOT NULL);
            INSERT INTO usage_created VALUES ('2026-11-22', 1000.0);
            DROP TABLE digest_spans; CREATE TABLE digest_spans (account_id TEXT NOT NULL, name TEXT NOT NULL,
                first_day TEXT NOT NULL, last_day TEXT NOT NULL, PRIMARY KEY (account_id, name, last_day, first_day));
            INSERT INTO digest_spans VALUES ('ak', '', '2026-11-20', '2026-11-21');
            DROP TABLE account_files; CREATE TABLE account_files (file TEXT PRIMARY KEY, account_id TEXT NOT NULL,
                name TEXT NOT NULL);
            INSERT INTO account_files VALUES ('prod.db', 'ak', 'prod');
        """)  # fmt: skip
    # Read beside a stopped daemon first (`digest`): opened read only, nothing can be added to it.
    assert peek_account_files(path) == [AccountFile("prod.db", "ak", "prod", 0)]
    store = StateStore(path)
    try:
        alerts = AlertStore(store)
        assert alerts.digest_spans("ak", dt.date(2026, 11, 1), dt.date(2026, 11, 30)) == [
            (dt.date(2026, 11, 20), dt.date(2026, 11, 21))
        ]
        day = dt.date(2026, 11, 22)
        cursor = UsageCursor(day=day, settings="s", records=1, boundary_id="", page_fingerprint="", created=5.0)
        store.save_usage(cursor, [("ep", "m", "", 1, 2, 3, 0)], 7.0, day)
        loaded = store.load_usage(day)
        assert loaded is not None
        assert loaded[0].created == 5.0
    finally:
        store.close()
    assert columns(path) == columns(fresh)


def test_a_file_written_by_a_newer_version_is_refused_naming_both_layouts(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    StateStore(path).close()
    with sqlite3.connect(path) as db:  # (a version that keeps its file in another journal mode)
        db.execute("PRAGMA journal_mode=DELETE")
        db.execute(f"PRAGMA user_version = {LAYOUT + 1}")
    written = path.read_bytes()
    with pytest.raises(StateError) as refused:
        StateStore(path, reset=True)
    assert f"written by a newer version (layout {LAYOUT + 1}; this one knows layouts up to {LAYOUT})" in str(
        refused.value
    )
    assert path.read_bytes() == written  # left as it was: not switched to WAL, nor anything else


@pytest.mark.parametrize("reset", [False, True])
@pytest.mark.parametrize("user_version", [0, LAYOUT, LAYOUT + 5])
@pytest.mark.parametrize("tables", [["users"], ["orders", "outbox"]])
def test_another_program_s_database_at_state_path_is_refused_and_left_as_it_was(
    tmp_path: Path, reset: bool, user_version: int, tables: list[str]
) -> None:
    """A state.path that names another service's SQLite file, whatever layout its `user_version`
    reads as (many programs set it), and one with a table of a name this exporter uses too (an
    outbox): refused, naming its tables, never migrated, switched to WAL, nor moved aside by
    --reset-state."""
    path = tmp_path / "grafana.db"
    with closing(sqlite3.connect(path)) as db:
        for table in tables:
            db.execute(f"CREATE TABLE {table} (id INTEGER, name TEXT)")
            db.execute(f"INSERT INTO {table} VALUES (1, 'admin')")  # noqa: S608 - the test's own names
        db.execute(f"PRAGMA user_version = {user_version}")
        db.commit()
    written = path.read_bytes()
    with pytest.raises(StateError) as refused:
        StateStore(path, reset=reset)
    assert f"state file {path} is not this exporter's (its tables: {', '.join(tables)})" in str(refused.value)
    assert path.read_bytes() == written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grafana.db"]  # (no -wal, lock file, nor moved aside)
    empty = tmp_path / "empty.db"
    sqlite3.connect(empty).close()  # (an empty database is a new state file)
    StateStore(empty).close()
    later = tmp_path / "later.db"  # (a later version's, at the same layout with a table of its own: gone back to)
    StateStore(later).close()
    with closing(sqlite3.connect(later)) as db:
        db.execute("CREATE TABLE kept_by_a_later_version (id INTEGER)")
        db.commit()
    StateStore(later).close()


def test_where_no_state_file_could_be_kept_is_found_even_as_root_and_leaves_nothing(tmp_path: Path) -> None:
    """/proc refuses a directory whatever the permission bits say (root passes them all); a path whose
    directories are missing but could be made is fine, and nothing is left behind by finding out."""
    from exporter.state.location import location_problem

    assert location_problem("/proc/nope/state.db") == "the directory /proc is not writable"
    assert location_problem(tmp_path / "a" / "b" / "state.db") == ""
    assert location_problem(tmp_path / "state.db") == ""
    assert list(tmp_path.iterdir()) == []
    assert location_problem(tmp_path) == f"{tmp_path} is a directory"
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")  # a link to nothing: no directory can be made there
    assert location_problem(tmp_path / "dangling" / "state.db") == f"{tmp_path / 'dangling'} is not a directory"
    os.mkfifo(tmp_path / "fifo")
    for special in (tmp_path / "fifo", Path("/dev/null")):
        assert location_problem(special) == f"{special} is not a regular file (a device, a FIFO or a socket)"


@pytest.mark.parametrize("kind", ["random", "truncated"])
def test_reset_state_moves_aside_a_corrupt_file_of_an_account_too(tmp_path: Path, kind: str) -> None:
    """With `accounts`, each keeps a file of its own beside the process's: the one the error names,
    which --reset-state must move aside as it says, or the daemon never starts."""
    from exporter.cli.commands import _reset_state
    from exporter.config.load import validate

    billing = {"url": "https://openapi.example.com", "access_key_id": "AK1", "secret_access_key": "s"}
    config = validate(
        {
            "accounts": [
                {"name": "prod", "billing": billing},
                {"name": "staging", "billing": billing | {"access_key_id": "AK2"}},
            ],
            "state": {"path": str(tmp_path / "state.db")},
        },
        {},
    )
    StateStore(tmp_path / "state.db").close()
    original = corrupt_file(tmp_path / "state.prod.db", kind)
    with pytest.raises(StateError):
        StateStore(tmp_path / "state.prod.db")
    _reset_state(config)
    [aside] = tmp_path.glob("state.prod.db.corrupt-*[0-9]")
    assert aside.read_bytes() == original
    StateStore(tmp_path / "state.prod.db").close()  # a fresh file now


def test_a_run_of_what_a_probe_measured_before_it_moved_is_not_kept(tmp_path: Path) -> None:
    """A run that ends as a reload moves its probe (the reload's note taken first): it is of the
    endpoint before, and is not kept under the probe's name."""
    store = StateStore(tmp_path / "state.db")
    try:
        assert store.measuring({"x": "alpha"}) == []
        assert store.record_probe_run("x", 10.0, True, 0.1, keep_from=0.0, measured="alpha")
        assert store.measuring({"x": "beta"}) == ["x"]
        assert not store.record_probe_run("x", 20.0, True, 0.1, keep_from=0.0, measured="alpha")
        assert store.record_probe_run("x", 30.0, False, None, keep_from=0.0, measured="beta")
        assert store.probe_runs(0.0, 100.0) == [("x", False, None)]
    finally:
        store.close()


def test_a_lock_file_taken_away_while_it_is_locked_is_locked_again_at_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another exporter that made the lock file, and failed, takes it away between this one's open
    and its lock: this one locks the file at the path (made anew), never the one taken away, so a
    third is refused rather than sharing the state file."""
    from exporter.state import lock as lock_module

    path = str(tmp_path / "state.db")
    Path(f"{path}.lock").write_text("")
    flock, taken = lock_module.fcntl.flock, []

    def taken_away_first(fd: int, operation: int) -> None:
        if not taken:
            taken.append(True)
            os.unlink(f"{path}.lock")
        flock(fd, operation)

    monkeypatch.setattr(lock_module.fcntl, "flock", taken_away_first)
    held = lock_module.LockFile(path)
    monkeypatch.setattr(lock_module.fcntl, "flock", flock)
    try:
        with pytest.raises(StateError, match="in use by another exporter"):
            lock_module.LockFile(path)
    finally:
        held.release()


def test_a_lock_file_that_is_never_the_one_locked_is_one_error_not_a_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(A file system that gives the lock file another number every time it is looked at, or one
    replaced again and again:) a few tries, then one StateError naming it, and no descriptor left."""
    from exporter.state import lock as lock_module

    monkeypatch.setattr(lock_module.LockFile, "_still_there", lambda self, fd: False)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(StateError, match=r"its lock file .*state\.db\.lock keeps being replaced"):
        lock_module.LockFile(str(tmp_path / "state.db"))
    assert len(os.listdir("/proc/self/fd")) == before
