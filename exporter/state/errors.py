"""What can go wrong with the state file, in words: `StateError` names the file and its fault, and
`fault` reads an SQLite error as one. A module of its own so that the lock and the connection,
which both raise it, need not import each other."""

from __future__ import annotations

import sqlite3


class StateError(Exception):
    """The state file cannot be used; the message names the file and the fault in plain words."""

    def __init__(self, path: str, message: str, *, corrupt: bool = False, fault: str = "") -> None:
        super().__init__(message)
        self.path = path
        self.fault = fault or message
        """The fault alone, e.g. "is corrupt (database disk image is malformed)"."""
        self.corrupt = corrupt
        """True when the file holds something that is not a sound SQLite database
        (`StateStore(path, reset=True)` moves such a file aside)."""


def fault_of(error: sqlite3.Error) -> tuple[str, bool]:
    """What an SQLite error means for the file, in words to follow "state file X", and whether it
    is corrupt."""
    name = getattr(error, "sqlite_errorname", "") or ""
    detail = str(error)
    if name == "SQLITE_NOTADB":
        return f"is not a SQLite database ({detail})", True
    if name.startswith("SQLITE_CORRUPT"):
        return f"is corrupt ({detail})", True
    if name.startswith("SQLITE_READONLY"):
        return f"is read-only ({detail})", False
    if name == "SQLITE_FULL":
        return f"cannot be written: the disk is full ({detail})", False
    if name.startswith("SQLITE_IOERR"):
        return f"cannot be read or written ({detail})", False
    if name.startswith("SQLITE_CANTOPEN"):
        return f"cannot be opened ({detail})", False
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
        return f"is locked by another connection ({detail})", False
    return f"failed ({detail})", False
