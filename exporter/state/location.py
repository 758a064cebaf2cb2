"""Where a state file can be kept: found without opening one, so that `check` imports no database."""

from __future__ import annotations

import os
from pathlib import Path


def directory_writable(directory: Path) -> bool:
    """Whether a file can be created in `directory` (tried, since root ignores the permission bits)."""
    return _can_make_in(directory, directory=False)


def _can_make_in(parent: Path, *, directory: bool) -> bool:
    """Whether a `directory` (else a file) can be made in `parent`, and removed: made under a name no
    other has, then removed (by hand, as `tempfile` does it: importing that alone costs `check` a
    twentieth of its start-up). A directory that takes new names but lets none go (append-only) keeps
    the one made, and is refused: SQLite removes its journal files beside the state file."""
    for _ in range(16):
        trial = parent / f".inference-cost-exporter-{os.urandom(8).hex()}"
        try:
            if directory:
                os.mkdir(trial, 0o700)
                os.rmdir(trial)
            else:
                os.close(os.open(trial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
                os.unlink(trial)
        except FileExistsError:
            continue
        except OSError:
            return False
        return True
    return False


def location_problem(path: str | Path) -> str:
    """Why no state file could be kept at `path` ("" if one could), found leaving nothing behind:
    what is missing of its directory is tried by making a directory there, a file in one that is
    there by making a temporary one (root passes every permission check, not /proc's or a
    read-only mount's refusal)."""
    if str(path) == ":memory:":
        return ""
    target = Path(path)
    if target.is_dir():
        return f"{target} is a directory"
    if target.exists() and not target.is_file():
        return f"{target} is not a regular file (a device, a FIFO or a socket)"
    existing = target.parent
    while not os.path.lexists(existing) and existing != existing.parent:  # (a dangling link is there: not made)
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK) or not _can_make_in(existing, directory=existing != target.parent):
        return f"the directory {existing} is not writable"
    if target.exists() and not os.access(target, os.R_OK | os.W_OK):
        return f"{target} is not readable and writable"
    return ""
