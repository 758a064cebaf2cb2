"""`simulate`: the stand-in service a user tries the exporter against before an account is at hand."""

from __future__ import annotations

from pathlib import Path

from exporter.app.demo import simulated
from exporter.config.load import validate
from exporter.core.clock import Clock
from exporter.sim import Simulator
from tests.daemon_fakes import fake_billing_section, metrics, unit_daemon
from tests.helpers import named

GAP_RULE = {"alert": "BillDisagreesWithUsage", "signal": "reconciliation_gap", "by": ["item"], "threshold": "0.02"}
"""The example config's rule."""


def test_the_settled_days_simulate_serves_reconcile(clock: Clock, tmp_path: Path) -> None:
    """Their bills are of the usage records it serves for them, as an account's are: the example's
    rule on a bill that disagrees with its usage does not fire on the first day a user tries it."""
    sim = simulated(Simulator(clock=clock), 2000)
    document = {
        "billing": fake_billing_section(sim),
        "state": {"path": str(tmp_path / "state.db")},
        "alerts": {"rules": [GAP_RULE]},
    }
    daemon = unit_daemon(validate(document, {}), sim, clock)
    try:
        assert daemon.refresh("bills")
        while True:  # (two settled days read a refresh)
            held = len(daemon.sources.one.latest.settled)
            assert daemon.refresh("usage")
            assert daemon.refresh("bills")
            if len(daemon.sources.one.latest.settled) == held:
                break
        assert held >= clock.today().day - 1
        daemon.alert_cycle()
        assert named(metrics(daemon), "inference_alerts") == {}
        gaps = named(metrics(daemon), "inference_reconciliation_token_gap_ratio")
        assert gaps
        assert max(abs(v) for v in gaps.values()) < 0.001
    finally:
        daemon.stop()
