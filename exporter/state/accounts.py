"""What follows an account of the config to a new name (a rename, or a one-account config moved
under `accounts:` and back): the names the accounts had when the process last built them, in the
process's own file (`account_names`), and the tables of an account's sources, taken from the file
of the name it had (`account_state`, `put_account_state`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from exporter.state.file import StateFile

ACCOUNT_TABLES = (
    "usage_cursor",
    "usage_head",
    "usage_created",
    "usage_totals",
    "usage_ids",
    "usage_ids_added",
    "usage_amounts",
    "settled_days",
    "settled_usage",
    "bill_history",
    "probe_runs",
)
"""The tables of an account's sources: the usage sync's, the reconciliation's, the bill history's
and the probe runs the digest reads."""
ACCOUNT_META = ("history_source",)
"""What of `meta` is the account's: where its bill history was fetched from."""


class AccountRows(NamedTuple):
    """An account's tables as `AccountTables.account_state` read them."""

    tables: dict[str, list[tuple[object, ...]]]
    meta: list[tuple[str, str]]


class AccountTables(StateFile):
    """`account_names`; and any file's account tables, taken whole from another."""

    def account_names(self) -> dict[str, str]:
        """The accounts as the process last built them: name ("" for the one account of a config
        without `accounts`) → `Account.account_id`."""
        with self.reading() as db:
            return dict(db.execute("SELECT name, account_id FROM account_names"))

    def record_account_names(self, names: Mapping[str, str]) -> None:
        with self.transaction() as db:
            db.execute("DELETE FROM account_names")
            db.executemany("INSERT INTO account_names VALUES (?, ?)", names.items())

    def account_state(self) -> AccountRows:
        """This file's account tables and `ACCOUNT_META`, read at one time."""
        marks = ", ".join("?" * len(ACCOUNT_META))
        with self.reading() as db:
            tables = {table: db.execute(f"SELECT * FROM {table} ORDER BY rowid").fetchall() for table in ACCOUNT_TABLES}  # noqa: S608 - the names above
            meta = db.execute(f"SELECT key, value FROM meta WHERE key IN ({marks})", ACCOUNT_META).fetchall()  # noqa: S608 - marks
        return AccountRows(tables, meta)

    def put_account_state(self, rows: AccountRows) -> int:
        """Replace this file's account tables with `rows` (another file's `account_state`: of the
        name the account had); the rows written."""
        marks = ", ".join("?" * len(ACCOUNT_META))
        with self.transaction() as db:
            for table, found in rows.tables.items():
                db.execute(f"DELETE FROM {table}")  # noqa: S608 - the names above
                if found:
                    db.executemany(f"INSERT INTO {table} VALUES ({', '.join('?' * len(found[0]))})", found)  # noqa: S608 - marks
            db.execute(f"DELETE FROM meta WHERE key IN ({marks})", ACCOUNT_META)  # noqa: S608 - marks
            db.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", rows.meta)
        return sum(map(len, rows.tables.values()))
