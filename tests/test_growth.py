"""Work that must grow with what it is given, not faster: counted, not timed (a shared machine's
timings move more than the difference), at a size and ten times it. SQLite's work is counted in
virtual-machine steps (its progress handler), Python's in the functions it calls (`sys.setprofile`)."""

from __future__ import annotations

import datetime as dt
import gc
import json
import sqlite3
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path

import pytest

from bench.common import calls_made
from exporter.config.load import validate
from exporter.config.schema import BudgetConfig
from exporter.model.events import GroupEvent
from exporter.model.snapshots import BillsSnapshot, DailyAmount, Latest, MonthBills
from exporter.sources import history
from exporter.sources.budgets import current_figures
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
    every row (draining 10,000 notifications took 84 times as long as 1,000, each delivery reading
    every row delivered before it)."""
    small = delivery_steps(tmp_path / "small.db", table, 2_000)
    large = delivery_steps(tmp_path / "large.db", table, 20_000)
    assert large < 2 * small + 2, (small, large)


# -- budgets --

TODAY = dt.date(2026, 11, 20)


def month_of_bills(endpoints: int) -> Latest:
    """The month to date of `endpoints` endpoints, by endpoint and by item: ep-<n> spends n plus
    the day of the month each day, in project proj-<n mod 3>."""
    period = f"{TODAY:%Y-%m}"
    days = [TODAY.replace(day=n) for n in range(1, TODAY.day + 1)]
    by_endpoint = tuple(
        DailyAmount(period, day, f"ep-{n}", "inference", f"proj-{n % 3}", Decimal(n + day.day), Decimal(1))
        for day in days
        for n in range(endpoints)
    )
    by_item = tuple(
        DailyAmount(period, day, "ITEM_PROMPT_TOKEN", "inference", "", payable, Decimal(1))
        for day in days
        for payable in [sum((a.payable for a in by_endpoint if a.day == day), Decimal(0))]
    )
    spent = sum((a.payable for a in by_item), Decimal(0))
    latest = Latest()
    latest.bills = BillsSnapshot((MonthBills(period, by_endpoint, by_item, spent, spent, Decimal(0)),), TODAY)
    return latest


def budgets_of(endpoints: int) -> list[BudgetConfig]:
    """A budget for every tenth endpoint, and one on a list of endpoints within a project."""
    alone = [{"name": f"ep-{n}", "amount": "100", "where": {"endpoint_id": f"ep-{n}"}} for n in range(0, endpoints, 10)]
    pair = {"name": "pair", "amount": "100", "where": {"endpoint_id": ["ep-1", "ep-2"], "project_id": "proj-1"}}
    document = {
        "billing": {"url": "https://billing.invalid", "access_key_id": "AK", "secret_access_key": "s"},
        "budgets": [*alone, pair],
    }
    return list(validate(document, {}).all_budgets)


def test_budgets_scoped_on_endpoints_read_their_own_lines_of_the_bills() -> None:
    """Each scoped budget sums its endpoints' lines alone: a budget for each of E endpoints,
    each reading every line of the month, grew with E² (1 s an evaluation at 2,000 endpoints)."""
    spent = {
        budget.name: None if found is None else found.spent
        for budget, found in current_figures(month_of_bills(40), budgets_of(40))
    }
    days = range(1, TODAY.day + 1)
    assert spent["ep-10"] == sum(Decimal(10 + d) for d in days)
    assert spent["pair"] == sum(Decimal(1 + d) for d in days)  # (ep-2 is in proj-2)
    calls = {}
    for endpoints in (40, 400):
        latest, budgets = month_of_bills(endpoints), budgets_of(endpoints)
        calls[endpoints] = calls_made(lambda: current_figures(latest, budgets))  # noqa: B023 (called at once)
    assert calls[400] < 15 * calls[40], calls


# -- history read back at start-up --


def test_history_read_back_is_exact_and_left_to_no_collection() -> None:
    """The months held are read back from the state file as they were written, amounts to the last
    digit, through rows the garbage collector does not track: at 5,000 endpoints a start-up made a
    list for each of 3M rows, and the collections they set off made it 18 times 500 endpoints' time."""
    amounts = ("1.50", "0", "1E+2", "-0.001", "123456789012345678901234.5678", "0E-8")
    held = tuple(
        DailyAmount("2026-10", dt.date(2026, 10, n + 1), f"ep-{n}", "inference", "proj", Decimal(a), Decimal(n))
        for n, a in enumerate(amounts)
    )
    rows = history._ROWS.decode(json.dumps(history._rows(held)))
    assert not any(gc.is_tracked(row) for row in rows)
    back = history._amounts("2026-10", rows)
    assert back == held
    assert [str(a.payable) for a in back] == list(amounts)
