"""The usage sync's tables (`exporter.sources.usage`): each day's cursor (where the last sync
stopped), its sums per (endpoint, model, api key), the digests of the request ids it counted, and
what today's estimate counters counted; all of a day saved in one transaction."""

from __future__ import annotations

import datetime as dt
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass

from exporter.model.snapshots import UsageRow
from exporter.state.file import StateFile


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
    created: float = 0.0
    """When the day's counters started (the `_created` of their series): its start, unless records
    removed upstream reset them since; 0: not saved."""


def _write_blob(db: sqlite3.Connection, table: str, rowid: int, chunks: Sequence[memoryview]) -> None:
    with db.blobopen(table, "ids", rowid) as blob:
        for chunk in chunks:
            blob.write(chunk)


class UsageTables(StateFile):
    """`usage_cursor`, `usage_head`, `usage_created`, `usage_totals`, `usage_ids`, `usage_ids_added` and
    `usage_amounts`."""

    def load_usage(self, day: dt.date) -> tuple[UsageCursor, list[UsageRow]] | None:
        with self.reading() as db:
            row = db.execute(
                # (`created` as saved with this cursor: one a version without it wrote since is not)
                "SELECT settings, records, boundary_id, page_fingerprint, finalised, head_ids, newest_first, page_size,"
                " usage_created.created FROM usage_cursor LEFT JOIN usage_head USING (day) LEFT JOIN usage_created"
                " ON usage_created.day = usage_cursor.day AND usage_created.updated = usage_cursor.updated"
                " WHERE usage_cursor.day = ?",
                (day.isoformat(),),
            ).fetchone()
            if row is None:
                return None
            totals = db.execute(
                "SELECT endpoint, model, api_key, requests, prompt, completion, cached FROM usage_totals WHERE day = ?",
                (day.isoformat(),),
            ).fetchall()
        return UsageCursor(
            day, row[0], row[1], row[2], row[3], bool(row[4]), row[5] or "", bool(row[6]), row[7] or 0, row[8] or 0.0
        ), totals

    def load_usage_amounts(self, day: dt.date) -> list[tuple[str, str, str, str, int, int, int]]:
        """What today's estimate counters counted (`sources.usage_cost.Counted`), per (endpoint, model, api
        key): the amount as exact decimal text and the prompt, completion and cached tokens it covers."""
        with self.reading() as db:
            return db.execute(
                "SELECT endpoint, model, api_key, amount, prompt, completion, cached FROM usage_amounts WHERE day = ?",
                (day.isoformat(),),
            ).fetchall()

    def load_usage_ids(self, day: dt.date) -> tuple[bytes, list[bytes]]:
        """The digests of the request ids counted on `day` (see `sources.usage_aggregate.SeenIds`):
        as last saved whole (empty if never), and what each poll since added, in order."""
        with self.reading() as db:
            row = db.execute("SELECT ids FROM usage_ids WHERE day = ?", (day.isoformat(),)).fetchone()
            added = db.execute(
                "SELECT ids FROM usage_ids_added WHERE day = ? ORDER BY rowid", (day.isoformat(),)
            ).fetchall()
        return (bytes(row[0]) if row else b""), [bytes(a[0]) for a in added]

    def save_usage(
        self,
        cursor: UsageCursor,
        totals: list[UsageRow],
        updated: float,
        keep_from: dt.date,
        *,
        ids: Sequence[memoryview] = (),
        amounts: Sequence[tuple[str, str, str, str, int, int, int]] | None = None,
        ids_added: bool = False,
    ) -> None:
        """Replace a day's cursor, totals and request ids seen (in chunks, written into the blob one
        after the other: no copy of the whole) in one transaction; forget days before `keep_from`.
        `ids_added`: `ids` are only those the poll found, appended to the day's (what is written
        grows with what a poll found, not with the day). `amounts` (as `load_usage_amounts` reads
        them) replace the counted amounts in the same transaction, so they never cover other totals
        than those saved with them."""
        day = cursor.day.isoformat()
        size = sum(c.nbytes for c in ids)
        with self.transaction("usage") as db:
            if amounts is not None:
                db.execute("DELETE FROM usage_amounts")  # only today's are ever read
                db.executemany(
                    "INSERT INTO usage_amounts VALUES (?, ?, ?, ?, ?, ?, ?, ?)", [(day, *a) for a in amounts]
                )
            if ids_added:
                if size:
                    db.execute("INSERT INTO usage_ids_added (day, ids) VALUES (?, zeroblob(?))", (day, size))
                    _write_blob(db, "usage_ids_added", db.execute("SELECT last_insert_rowid()").fetchone()[0], ids)
            else:
                db.execute("INSERT OR REPLACE INTO usage_ids (day, ids) VALUES (?, zeroblob(?))", (day, size))
                (rowid,) = db.execute("SELECT rowid FROM usage_ids WHERE day = ?", (day,)).fetchone()
                _write_blob(db, "usage_ids", rowid, ids)
                db.execute("DELETE FROM usage_ids_added WHERE day = ?", (day,))
            db.execute("DELETE FROM usage_ids WHERE day < ?", (keep_from.isoformat(),))
            db.execute("DELETE FROM usage_ids_added WHERE day < ?", (keep_from.isoformat(),))
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
            db.execute("INSERT OR REPLACE INTO usage_created VALUES (?, ?, ?)", (day, cursor.created, updated))
            db.execute("DELETE FROM usage_created WHERE day < ?", (keep_from.isoformat(),))
            db.execute("DELETE FROM usage_totals WHERE day = ?", (day,))
            db.executemany("INSERT INTO usage_totals VALUES (?, ?, ?, ?, ?, ?, ?, ?)", [(day, *t) for t in totals])
            db.execute("DELETE FROM usage_cursor WHERE day < ?", (keep_from.isoformat(),))
            db.execute("DELETE FROM usage_totals WHERE day < ?", (keep_from.isoformat(),))
