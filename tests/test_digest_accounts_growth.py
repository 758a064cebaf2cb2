"""Each account's digest, with several accounts in one process: it tells that account's firing
alerts and those of rules not split by account, in the order the engine holds them; and the
digests of all accounts together cost work in proportion to the alerts held, not to the accounts
times the alerts (counted in Python calls, at a size and ten times it)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

from bench.common import calls_made
from bench.evaluation import Billed
from exporter.app.daemon import Daemon
from exporter.config.load import validate
from exporter.config.schema import ACCOUNT
from exporter.core.clock import Clock, FrozenClock
from tests.daemon_fakes import NOWHERE, digests_told

BILLING = {"url": NOWHERE, "access_key_id": "AK", "secret_access_key": "secret", "history_months": 0}
SPEND = {"signal": "spend", "window": "month", "threshold": "0.5"}
"""Every endpoint is billed 3.00 a day (`Billed`): over this from the month's first day."""


def daemon_of(clock: Clock, state: Path, accounts: int, endpoints: int, rules: list[dict[str, Any]]) -> Daemon:
    """A daemon over `accounts` accounts of `endpoints` endpoints each, refreshed and evaluated once
    (what fires, fires), its digest due at 10:00 and the clock before it."""
    document = {
        "accounts": [{"name": f"a{n:03d}", "billing": BILLING} for n in range(accounts)],
        "alerts": {"rules": rules, "notifiers": [{"name": "finance", "type": "webhook", "url": NOWHERE}]},
        "digest": {"notifiers": ["finance"], "at": "10:00"},
        "state": {"path": str(state / "state.db")},
    }
    config = validate(document, {})
    daemon = Daemon(config, clock=clock, billing=lambda _: Billed(endpoints, clock), serve=False)
    for account in config.accounts:
        assert daemon.refresh(f"{account.name}/bills")
        assert daemon.refresh(f"{account.name}/usage")
    daemon.alert_cycle()
    return daemon


def before_the_digest() -> tuple[Clock, FrozenClock]:
    """A billing clock (the config's time zone) frozen at 09:00 on 2026-11-22, an hour before the digest's time."""
    zone = ZoneInfo("Asia/Shanghai")
    frozen = FrozenClock(dt.datetime(2026, 11, 22, 9, 0, tzinfo=zone))
    return Clock(zone, frozen), frozen


def test_each_accounts_digest_tells_its_own_alerts_and_the_unsplit_ones_in_the_engines_order(tmp_path: Path) -> None:
    clock, frozen = before_the_digest()
    rules = [  # names that sort the unsplit rules' alerts before and after the accounts'
        {"alert": "SpendA", "by": ["endpoint_id"], **SPEND},
        {"alert": "SpendB", "by": ["account", "endpoint_id"], **SPEND},
        {"alert": "SpendC", "by": ["endpoint_id"], **SPEND},
        {"alert": "SpendD", "by": ["account", "endpoint_id"], "for": "1h", **SPEND},  # pending: in no digest
    ]
    daemon = daemon_of(clock, tmp_path, 3, 12, rules)
    try:
        held = daemon.sources.engine.current()
        assert {a.state for a in held} == {"firing", "pending"}
        frozen.advance(dt.timedelta(hours=1))
        assert daemon.digest_cycle()
        digests = {body["account"]: body for body in digests_told(daemon, "finance")}
        assert sorted(digests) == ["a000", "a001", "a002"]
        for name, body in digests.items():
            # The digest the account's own alerts make, given in the engine's order.
            own = [a for a in held if a.state == "firing" and a.labels.get(ACCOUNT, name) == name]
            expected = daemon.sources.digest(clock.today(), "daily", "", alerts=own, account=name)
            assert body == expected | {"id": f"daily:{clock.today().isoformat()}:{name}"}
            assert len(own) == 36  # 12 of its own, 2 × 12 unsplit
            assert body["more"] == {"alerts": 16}
            assert {a["alertname"] for a in body["alerts"]} == {"SpendA", "SpendB"}  # the first 20 held
            assert {a["labels"].get(ACCOUNT, name) for a in body["alerts"]} == {name}
    finally:
        daemon.stop()


def calls_of_the_digests(state: Path, accounts: int) -> int:
    """The Python and built-in functions called while each of `accounts` accounts' digests is made
    (20 endpoints each, a spend rule by account and endpoint, every alert firing)."""
    clock, frozen = before_the_digest()
    daemon = daemon_of(clock, state, accounts, 20, [{"alert": "Spend", "by": ["account", "endpoint_id"], **SPEND}])
    try:
        assert sum(a.state == "firing" for a in daemon.sources.engine.current()) == 20 * accounts
        frozen.advance(dt.timedelta(hours=1))
        calls = calls_made(daemon.digest_cycle)
        assert len(digests_told(daemon, "finance")) == accounts
        return calls
    finally:
        daemon.stop()


def test_the_digests_of_all_accounts_read_the_alerts_held_once(tmp_path: Path) -> None:
    (tmp_path / "small").mkdir()
    (tmp_path / "large").mkdir()
    small = calls_of_the_digests(tmp_path / "small", 10)
    large = calls_of_the_digests(tmp_path / "large", 100)
    # Each digest reading its own alerts: 10 times the calls; each reading every alert held: 21 times.
    assert large < 15 * small, (small, large)
