"""The reconciliation's tables (`exporter.sources.reconcile`): the settled days it read, from which
account, with their usage sums per (endpoint, model, api key): each settled day's usage is read
from the service once, not at every start."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Sequence

from exporter.model.snapshots import UsageRow
from exporter.state.file import StateFile


class SettledTables(StateFile):
    """`settled_days` and `settled_usage`."""

    def load_settled_usage(self, first: dt.date, account: str) -> dict[dt.date, list[UsageRow]]:
        """The settled days read from `first` on from `account`, each with its per-key sums (none
        for a day without usage)."""
        with self.reading() as db:
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
