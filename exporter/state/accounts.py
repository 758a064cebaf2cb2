"""Which state file each account keeps its sources' state in (usage cursors and ids, settled days,
bill history, probe runs), kept in the process's own file (`account_files`). The file follows the
billing account (`Account.account_id`: its key and project) whatever its name, so that a rename, a
one-account config moved under `accounts:` and back, or two names swapping keys move no state; a
key rotated under the same name keeps the name's file."""

from __future__ import annotations

import itertools
import sqlite3
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from exporter.state.file import StateFile


class AccountFile(NamedTuple):
    """One account state file: `file`, "" for the process's own, else the word its path has between
    the process's file's stem and suffix (`state.prod.db`: "prod"); the billing account whose state
    it holds, the name that account had when it last used the file, and when that was (the
    configs the process built, counted)."""

    file: str
    account_id: str
    name: str
    used: int = 0


def read_account_files(db: sqlite3.Connection) -> list[AccountFile]:
    """The files known, the most recently used first."""
    rows = db.execute("SELECT file, account_id, name, used FROM account_files ORDER BY used DESC, file")
    return [AccountFile(*row) for row in rows]


def files_for(accounts: Mapping[str, str], known: Iterable[AccountFile]) -> dict[str, AccountFile]:
    """The file of each account of `accounts` (name → `account_id`), given the files `known` (the
    most recently used first):

    1. the file of its billing account, when it is the only account of that id configured (the one
       it used last; of several used then, by accounts configured alike, the one of its name);
    2. else the file last used under its name, unless that file's account is configured under
       another name (a key rotated: the name keeps its state; or two accounts configured alike);
    3. else a file of its own, named after it ("" for the one account of a config without
       `accounts`), or after it and its id when another account's file has that name already.
    """
    known = list(known)
    ids = list(accounts.values())
    files: dict[str, AccountFile] = {}
    taken: set[str] = set()
    for name, account_id in accounts.items():
        if ids.count(account_id) != 1:
            continue
        of_id = [f for f in known if f.account_id == account_id]  # (more than one: accounts once alike)
        if of_id:
            last = [f for f in of_id if f.used == of_id[0].used]
            found = next((f for f in last if f.name == name), last[0])
            files[name] = found._replace(name=name)
            taken.add(found.file)
    for name, account_id in accounts.items():
        if name in files:
            continue
        named = next((f for f in known if f.name == name and f.file not in taken), None)
        if named is not None and (named.account_id == account_id or named.account_id not in ids):
            files[name] = named._replace(account_id=account_id)
            taken.add(named.file)
    names = {f.file for f in known} | taken
    for name, account_id in accounts.items():
        if name in files:
            continue
        mark = f"{name}.{account_id[:8]}" if name else account_id[:8]
        tried = itertools.chain((name, mark), (f"{mark}.{n}" for n in itertools.count(2)))
        file = next(f for f in tried if f not in names)
        files[name] = AccountFile(file, account_id, name)
        names.add(file)
    return files


def moved(files: Mapping[str, AccountFile], known: Iterable[AccountFile]) -> set[str]:
    """The names `files` gives another file than the one they used last (of `known`, the most
    recently used first): another billing account's state came to them."""
    had: dict[str, str] = {}
    for file in known:
        had.setdefault(file.name, file.file)
    return {name for name, file in files.items() if name in had and file.file != had[name]}


class AccountTables(StateFile):
    """`account_files`."""

    def account_files(self) -> list[AccountFile]:
        with self.reading() as db:
            return read_account_files(db)

    def record_account_files(self, used: Iterable[AccountFile]) -> None:
        """Say which account each file holds now, and under which name (the others are kept: an
        account removed and added back finds its file), marked the most recently used."""
        with self.transaction() as db:  # (written at a start or reload only: see `transaction`)
            (last,) = db.execute("SELECT COALESCE(MAX(used), 0) FROM account_files").fetchone()
            db.executemany("INSERT OR REPLACE INTO account_files VALUES (?, ?, ?, ?)",
                           [(f.file, f.account_id, f.name, last + 1) for f in used])  # fmt: skip
