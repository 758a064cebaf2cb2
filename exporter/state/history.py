"""The bill history's table (`exporter.sources.history`): each past month's daily bills by endpoint
and by item, and each endpoint's by item, as JSON, with the day they were fetched (a start-up on
that day fetches them no more)."""

from __future__ import annotations

import sqlite3

from exporter.state.file import StateFile


class HistoryTable(StateFile):
    """`bill_history`: one row per month; and in `meta`, what they were fetched from (`history_source`)."""

    def history_source(self) -> str | None:
        """What the months held were fetched from (None: not said, as an earlier version kept them)."""
        with self.reading() as db:
            return _source(db)

    def forget_history(self, source: str, *, keep: bool = False) -> None:
        """Drop every month held (unless `keep`): they were fetched from another source; the months
        held from now on are `source`'s."""
        with self.transaction("history") as db:
            if not keep:
                db.execute("DELETE FROM bill_history")
            db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('history_source', ?)", (source,))

    def load_history(self) -> list[tuple[str, str, str, str, str]]:
        """Every month held: (period, its daily bills by endpoint, by item, and each endpoint's by
        item, as JSON; the day fetched)."""
        with self.reading() as db:
            rows: list[tuple[str, str, str, str, str]] = db.execute(
                "SELECT period, by_endpoint, by_item, items_by_endpoint, fetched FROM bill_history ORDER BY period"
            ).fetchall()
        return rows

    def save_history(
        self, period: str, by_endpoint: str, by_item: str, items_by_endpoint: str, fetched: str, *, keep_from: str,
        source: str,
    ) -> bool:  # fmt: skip
        """Replace one month's bills, fetched from `source`; forget the months before `keep_from`.
        False, and nothing written, when the months held are another source's now (a fetch from
        the address before a reload, ending after it)."""
        with self.transaction("history") as db:
            if _source(db) not in (None, source):
                return False
            db.execute(
                "INSERT OR REPLACE INTO bill_history (period, by_endpoint, by_item, items_by_endpoint, fetched)"
                " VALUES (?, ?, ?, ?, ?)",
                (period, by_endpoint, by_item, items_by_endpoint, fetched),
            )
            db.execute("DELETE FROM bill_history WHERE period < ?", (keep_from,))
        return True


def _source(db: sqlite3.Connection) -> str | None:
    row = db.execute("SELECT value FROM meta WHERE key = 'history_source'").fetchone()
    return None if row is None else str(row[0])
