"""The daemon in the unit layer: its billing API answered in process from the simulator's ledger
(tests/fakes.py) and no HTTP server. What a scrape, the landing page or /api/v1/alerts would show
is rendered in process; what the notifiers would be told is read from the outbox, where the
engine and the digest queue it (delivering it is the integration layer's: tests with a receiver).

Nothing here delivers: a unit-layer daemon is never started (no notifier workers), so every
notification queued stays in the outbox for the test to read.
"""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

from exporter.app.daemon import Daemon
from exporter.config.schema import BillingConfig, Config
from exporter.core.clock import Clock
from exporter.model.events import GroupEvent, read_event
from exporter.sim import Simulator
from exporter.web import alerts_document, landing_page, ready
from tests.fakes import FakeBilling
from tests.helpers import Series, parse

NOWHERE = "http://127.0.0.1:1"
"""The URL of everything a unit-layer config must name but nothing asks: the billing API is in process."""


def fake_billing_section(sim: Simulator, **overrides: object) -> dict[str, object]:
    """conftest's `billing_section` for the unit layer: `sim`'s credentials, no server."""
    return {
        "url": NOWHERE,
        "access_key_id": sim.access_key_id,
        "secret_access_key": sim.secret_access_key,
        "timeout": "5s",
    } | overrides


class InProcessBilling:
    """The daemon's billing factory in the unit layer: a `FakeBilling` on `sim` for each `billing`
    section it is asked for (at its page size, for its project); `built` keeps them in order."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self.built: list[FakeBilling] = []

    def __call__(self, config: BillingConfig) -> FakeBilling:
        client = FakeBilling(self.sim, page_size=config.page_size, project_id=config.project_id)
        self.built.append(client)
        return client


def unit_daemon(
    config: Config, sim: Simulator, clock: Clock, *, config_path: Path | None = None,
    billing: InProcessBilling | None = None,
) -> Daemon:  # fmt: skip
    """A daemon on `sim` in process, without an HTTP server, not started: the test refreshes,
    evaluates and reloads it by hand."""
    return Daemon(config, config_path=config_path, clock=clock, billing=billing or InProcessBilling(sim), serve=False)


def metrics(daemon: Daemon) -> Series:
    """What a scrape of /metrics gets, rendered in process."""
    return parse(daemon.sources.exposition.render()[0].decode())


def page(daemon: Daemon) -> str:
    """The landing page, rendered in process."""
    return landing_page(daemon.view)


def alerts_api(daemon: Daemon) -> dict[str, Any]:
    """/api/v1/alerts, in process."""
    return alerts_document(daemon.view)


def readiness(daemon: Daemon) -> tuple[bool, dict[str, str]]:
    """/readyz, in process: whether ready, and each source's state."""
    return ready(daemon.view)


def _outbox(state: str, table: str, notifier: str | None) -> list[str]:
    """The undelivered rows' bodies of one outbox, oldest first (read-only, beside the daemon's connection)."""
    with closing(sqlite3.connect(f"file:{state}?mode=ro", uri=True)) as db:
        rows = db.execute(
            f"SELECT event FROM {table} WHERE delivered IS NULL AND (? IS NULL OR notifier = ?) ORDER BY id",  # noqa: S608 - one of two names
            (notifier, notifier),
        ).fetchall()
    return [text for (text,) in rows]


def told(daemon: Daemon, notifier: str | None = None) -> list[GroupEvent]:
    """The alert notifications queued for `notifier` (for any, without one), oldest first: what it
    is to be told, state change by state change. It also reads the outbox of a daemon stopped since."""
    return [read_event(text) for text in _outbox(daemon.state.path, "outbox", notifier)]


def statuses(daemon: Daemon, notifier: str | None = None) -> list[str]:
    return [event["status"] for event in told(daemon, notifier)]


def digests_told(daemon: Daemon, notifier: str | None = None) -> list[dict[str, Any]]:
    """The digests queued for `notifier` (for any, without one), oldest first, as they are sent."""
    return [json.loads(text) for text in _outbox(daemon.state.path, "digest_outbox", notifier)]


ACCOUNT_NAMES = ("prod", "staging", "lab")


def account_simulators(clock: Clock, names: tuple[str, ...] = ACCOUNT_NAMES) -> dict[str, Simulator]:
    """A simulator per account, each with its own keys and seed, an endpoint of its own (`ep-NAME`)
    and one name they share (`ep-shared`)."""
    from exporter.sim import Endpoint

    return {
        name: Simulator(
            clock=clock,
            seed=seed,
            access_key_id=f"AK{name.upper()}",
            secret_access_key=f"{name}-secret",
            endpoints=(Endpoint(f"ep-{name}", "model-a", "proj-main"), Endpoint("ep-shared", "model-b", "proj-main")),
        )
        for seed, name in enumerate(names, start=3)
    }


def accounts_section(sims: dict[str, Simulator], urls: dict[str, str] | None = None, **billing: object) -> list[dict]:
    """`accounts:` for the simulators: over HTTP at `urls`, or in process (`NOWHERE`, the unit layer)."""
    return [
        {
            "name": name,
            "billing": {
                "url": (urls or {}).get(name, NOWHERE),
                "access_key_id": sim.access_key_id,
                "secret_access_key": sim.secret_access_key,
            }
            | billing,
        }
        for name, sim in sims.items()
    ]
