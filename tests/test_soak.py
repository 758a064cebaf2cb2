"""A short soak (the full one is `python -m bench.soak`): faults, appends (some mid-read), reloads,
a dripping receiver, a day and a month rollover on a fast clock, then every figure against the
simulator's truth."""

from __future__ import annotations

from bench.soak import run_soak


def test_short_soak_keeps_every_figure_and_alert() -> None:
    report = run_soak(duration=12.0, speed=900.0, seed=7)
    assert report.faults > 10
    assert report.reloads >= 5
    assert {"2026-11-30", "2026-12-01"} <= report.days  # it crossed midnight and a month end
    assert report.checks, report
    failed = [check for check, passed in report.checks.items() if not passed]
    assert failed == [], (failed, report.notes, report.delivered, report.due)
    assert report.delivered == report.due
