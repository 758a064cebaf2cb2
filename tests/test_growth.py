"""Work that must grow with what it is given, not faster: counted, not timed (a shared machine's
timings move more than the difference), at a size and ten times it. SQLite's work is counted in
virtual-machine steps (its progress handler), Python's in the functions it calls (`sys.setprofile`)."""

from __future__ import annotations

import json
import sqlite3
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from exporter.model.events import GroupEvent
from exporter.state import AlertStore, StateStore
from exporter.state.migrations import OUTBOXES

WEEK = 7 * 86400


def sqlite_steps(store: StateStore, action: Callable[[], object]) -> int:
    """SQLite's virtual-machine steps (in hundreds) while `action` runs on `store`."""
    with store.reading() as db:
        connection: sqlite3.Connection = db
    steps = 0

    def step() -> int:
        nonlocal steps
        steps += 1
        return 0

    connection.set_progress_handler(step, 100)
    try:
        action()
    finally:
        connection.set_progress_handler(None, 0)
    return steps


def python_calls(action: Callable[[], object]) -> int:
    """The Python and built-in functions called while `action` runs."""
    calls = 0

    def profile(frame: object, event: str, arg: object) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(profile)
    try:
        action()
    finally:
        sys.setprofile(None)
    return calls


# -- the outbox --

EVENT: GroupEvent = {
    "status": "firing", "alertname": "Spend", "dedup_key": "k", "alerts": [], "total": 1, "still_firing": 1,
}  # fmt: skip


def delivery_steps(path: Path, table: str, kept: int) -> int:
    """Steps of one delivery from an outbox `kept` delivered rows long (kept for a week, so none goes)."""
    store = StateStore(path)
    now = 10 * WEEK
    event = json.dumps(EVENT)
    with store.transaction() as db:
        db.executemany(
            f"INSERT INTO {table} (notifier, event, created, next_attempt, delivered) VALUES (?, ?, ?, ?, ?)",  # noqa: S608
            [("hook", event, now - n, now - n, now - n) for n in range(kept)],
        )
        pending = f"INSERT INTO {table} (notifier, event, created, next_attempt) VALUES ('hook', ?, ?, ?)"  # noqa: S608
        db.execute(pending, (event, now, now))
        (waiting,) = db.execute(f"SELECT id FROM {table} WHERE delivered IS NULL").fetchone()  # noqa: S608
    alerts = AlertStore(store)
    steps = sqlite_steps(store, lambda: alerts.delivered(waiting, now, table=table))
    with store.reading() as db:
        assert db.execute(f"SELECT COUNT(*) FROM {table} WHERE delivered IS NOT NULL").fetchone() == (kept + 1,)  # noqa: S608
    store.close()
    return steps


@pytest.mark.parametrize("table", OUTBOXES)
def test_a_delivery_costs_the_same_however_many_deliveries_are_kept(tmp_path: Path, table: str) -> None:
    """Each delivery forgets what was delivered over a week ago: through an index, not by reading
    every row (with 20,000 rows kept, draining 10,000 notifications took 84 times 1,000's)."""
    small = delivery_steps(tmp_path / "small.db", table, 2_000)
    large = delivery_steps(tmp_path / "large.db", table, 20_000)
    assert large < 2 * small + 2, (small, large)
