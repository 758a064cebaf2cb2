"""The alert worker's evaluations woken by refreshes take a bounded share of its CPU: each refresh
of any account asks for an evaluation of all of them, and with many accounts refreshing those
would otherwise follow one another without end. On the simulator in process."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

import pytest

from exporter.app import daemon as daemon_module
from exporter.config.load import validate
from exporter.core.clock import Clock
from exporter.sim import Simulator
from tests.daemon_fakes import fake_billing_section, unit_daemon

BURN = 0.03
"""Seconds of the worker's own CPU each evaluation takes here."""
REFRESHING = 1.5
"""Seconds of refreshes, one after another."""


def test_evaluations_woken_by_refreshes_take_a_bounded_share_of_the_workers_cpu(
    sim: Simulator, clock: Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    document = {"billing": fake_billing_section(sim), "state": {"path": str(tmp_path / "state.db")}}
    daemon = unit_daemon(validate(document, {}), sim, clock)
    evaluations: list[float] = []
    evaluate = daemon.sources.engine.evaluate

    def slow_evaluation() -> int:
        """The engine's evaluation, then `BURN` seconds of CPU (an evaluation over many accounts)."""
        changes = evaluate()
        started = time.thread_time()
        while time.thread_time() - started < BURN:
            pass
        evaluations.append(time.monotonic())
        return changes

    monkeypatch.setattr(daemon.sources.engine, "evaluate", slow_evaluation)
    daemon.start(schedule=False)
    try:
        assert daemon.refresh("bills")
        first = time.monotonic() + 30  # (a busy machine: the worker may start late, but it starts)
        while not evaluations and time.monotonic() < first:
            time.sleep(0.01)
        assert evaluations, "a refresh wakes the alert worker"
        started, woken = time.monotonic(), threading.Event()
        while time.monotonic() - started < REFRESHING:
            assert daemon.refresh("bills")
            woken.wait(0.005)
        during = [at for at in evaluations if started <= at < started + REFRESHING]
    finally:
        daemon.stop()
    # At most one evaluation per BURN ÷ EVALUATION_SHARE seconds (0.3 s here), one more at each end;
    # unbounded, an evaluation follows the last one at once: 1.5 s ÷ 30 ms = 50 of them, and even
    # with the machine's other work taking half its time, over 8.
    bound = REFRESHING * daemon_module.EVALUATION_SHARE / BURN + 2
    assert 1 <= len(during) <= bound, (len(during), bound)


def test_the_evaluation_interval_runs_from_the_last_evaluation_whatever_the_share(
    sim: Simulator, clock: Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without refreshes (the billing API down: `data_age` and `for:` need the timer), evaluations
    come `evaluation_interval` apart, not that plus the wait a refresh's would have had."""
    interval, burn = 0.2, 0.05  # (a refresh's evaluation would wait min(9 × 0.05, 0.2) = 0.2 s more)
    document = {
        "billing": fake_billing_section(sim),
        "state": {"path": str(tmp_path / "state.db")},
        "alerts": {"evaluation_interval": f"{interval * 1000:.0f}ms"},
    }
    daemon = unit_daemon(validate(document, {}), sim, clock)
    spans: list[tuple[float, float]] = []
    evaluate = daemon.sources.engine.evaluate

    def slow_evaluation() -> int:
        began = time.monotonic()
        changes = evaluate()
        started = time.thread_time()
        while time.thread_time() - started < burn:
            pass
        spans.append((began, time.monotonic()))
        return changes

    monkeypatch.setattr(daemon.sources.engine, "evaluate", slow_evaluation)
    daemon.start(schedule=False)
    try:
        deadline = time.monotonic() + 60  # (a busy machine: enough evaluations however slow it is)
        while len(spans) < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        daemon.stop()
    gaps = sorted(after[0] - before[1] for before, after in itertools.pairwise(spans))
    assert len(gaps) >= 7, gaps
    assert gaps[len(gaps) // 2] < interval * 1.5, gaps  # (0.4 s with the share's wait as well)
