"""The probe's table: each run's outcome and time to first token, kept for the digest's success
ratios and percentiles (the probe's metrics come from its runner, not from here)."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping

from exporter.state.file import StateFile


def read_probe_runs(db: sqlite3.Connection, start: float, end: float) -> list[tuple[str, bool, float | None]]:
    """(probe, success, time to first token) of the runs in [start, end)."""
    rows = db.execute(
        "SELECT probe, success, time_to_first_token FROM probe_runs WHERE at >= ? AND at < ? ORDER BY at", (start, end)
    ).fetchall()
    return [(probe, bool(success), ttft) for probe, success, ttft in rows]


class ProbeTable(StateFile):
    """`probe_runs`."""

    def record_probe_run(
        self, probe: str, at: float, success: bool, ttft: float | None, *, keep_from: float, measured: str | None = None
    ) -> bool:
        """One probe run (for the digest's success ratios and percentiles) of what the probe measured
        (`measuring`, when given); forget runs before `keep_from`. False, and nothing kept, when the
        probe measures something else now (a reload moved it while this run was on its way here)."""
        with self.transaction("probes") as db:
            if measured is not None and _measured(db).get(probe, measured) != measured:
                return False
            db.execute("INSERT INTO probe_runs VALUES (?, ?, ?, ?)", (probe, at, int(success), ttft))
            db.execute("DELETE FROM probe_runs WHERE at < ?", (keep_from,))
        return True

    def measuring(self, measured: Mapping[str, str]) -> list[str]:
        """The probes measure `measured` (each probe's name: what it measures) from now on: the runs
        held of a probe that measured something else (a reload or a restart moved it to another
        endpoint or address) are forgotten, as none of them is of what its digest line is about.
        The probes whose runs it forgot. (Runs kept by an earlier version, which said nothing of
        what they measured, are taken as the config's.)"""
        with self.transaction("probes") as db:
            before = _measured(db)
            moved = sorted(name for name, what in measured.items() if before.get(name, what) != what)
            db.executemany("DELETE FROM probe_runs WHERE probe = ?", [(name,) for name in moved])
            held = {name for (name,) in db.execute("SELECT DISTINCT probe FROM probe_runs")}
            kept = {name: what for name, what in before.items() if name in held} | dict(measured)
            # (a probe taken out keeps what it measured while its runs are held: put back, it is judged)
            kept_text = json.dumps(kept, sort_keys=True)
            db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('probes_measured', ?)", (kept_text,))
        return moved

    def probe_runs(self, start: float, end: float) -> list[tuple[str, bool, float | None]]:
        """(probe, success, time to first token) of the runs in [start, end)."""
        with self.reading() as db:
            return read_probe_runs(db, start, end)


def _measured(db: sqlite3.Connection) -> dict[str, str]:
    """What each probe measures, as `measuring` last noted it (nothing for a note damaged or none)."""
    row = db.execute("SELECT value FROM meta WHERE key = 'probes_measured'").fetchone()
    try:
        noted = json.loads(row[0]) if row is not None else {}
    except ValueError:  # (damaged: the runs held are taken as the config's)
        return {}
    return noted if isinstance(noted, dict) else {}
