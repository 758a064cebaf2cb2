"""The probe's table: each run's outcome and time to first token, kept for the digest's success
ratios and percentiles (the probe's metrics come from its runner, not from here)."""

from __future__ import annotations

import sqlite3

from exporter.state.file import StateFile


def read_probe_runs(db: sqlite3.Connection, start: float, end: float) -> list[tuple[str, bool, float | None]]:
    """(probe, success, time to first token) of the runs in [start, end)."""
    rows = db.execute(
        "SELECT probe, success, time_to_first_token FROM probe_runs WHERE at >= ? AND at < ? ORDER BY at", (start, end)
    ).fetchall()
    return [(probe, bool(success), ttft) for probe, success, ttft in rows]


class ProbeTable(StateFile):
    """`probe_runs`."""

    def record_probe_run(self, probe: str, at: float, success: bool, ttft: float | None, *, keep_from: float) -> None:
        """One probe run (for the digest's success ratios and percentiles); forget runs before `keep_from`."""
        with self.transaction("probes") as db:
            db.execute("INSERT INTO probe_runs VALUES (?, ?, ?, ?)", (probe, at, int(success), ttft))
            db.execute("DELETE FROM probe_runs WHERE at < ?", (keep_from,))

    def probe_runs(self, start: float, end: float) -> list[tuple[str, bool, float | None]]:
        """(probe, success, time to first token) of the runs in [start, end)."""
        with self.reading() as db:
            return read_probe_runs(db, start, end)
