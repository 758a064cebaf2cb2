"""The reconciliation's tables (`exporter.sources.reconcile`): the settled days it read, from which
account, with their usage sums per (endpoint, model, api key): each settled day's usage is read
from the service once, not at every start."""

from __future__ import annotations

import datetime as dt
import re
import time
from collections.abc import Sequence

from exporter.model.snapshots import UsageRow
from exporter.state.file import StateFile

_PAGE_SIZE = re.compile(r";page_size=\d+(?=;per_api_key=)")


def _as_read(account: str) -> str:
    """A settled day's account as `SettledUsage.account` says it: versions before named the page
    size the day was read in too, which changes nothing a whole day's sums hold."""
    return _PAGE_SIZE.sub("", account, count=1)


class SettledTables(StateFile):
    """`settled_days` and `settled_usage`."""

    def load_settled_usage(self, first: dt.date, account: str) -> dict[dt.date, list[UsageRow]]:
        """The settled days read from `first` on from `account`, each with its per-key sums (none
        for a day without usage)."""
        with self.reading() as db:
            saved = db.execute("SELECT day, account FROM settled_days WHERE day >= ?", (first.isoformat(),))
            days = [day for day, read_from in saved if _as_read(read_from) == account]
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
        with self.transaction("settled") as db:
            db.execute("DELETE FROM settled_usage WHERE day = ? OR day < ?", (day.isoformat(), keep_from.isoformat()))
            db.executemany(
                "INSERT INTO settled_usage VALUES (?, ?, ?, ?, ?, ?, ?, ?)", [(day.isoformat(), *row) for row in rows]
            )
            db.execute("DELETE FROM settled_days WHERE day < ?", (keep_from.isoformat(),))
            db.execute("INSERT OR REPLACE INTO settled_days VALUES (?, ?, ?)", (day.isoformat(), time.time(), account))
