"""The digest: once a day whatever restarts, outages and late starts happen, and what it says; on the
simulator in process, read from the outbox (tests/daemon_fakes.py). Delivered end to end, against the
simulator: through a webhook receiver, Slack's format and a real SMTP server."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import yaml

from exporter.app import digests as digests_module
from exporter.app.daemon import Daemon
from exporter.app.digests import DIGEST_WAIT, DigestQueue
from exporter.app.sources import source_key
from exporter.config.load import load, validate
from exporter.config.schema import NotifierConfig
from exporter.core.clock import Clock, FrozenClock
from exporter.delivery.dispatcher import Dispatcher
from exporter.model.events import GroupEvent
from exporter.sim import ITEMS, Fault, Simulator, SimulatorServer, prices_from_config
from exporter.state import AlertStore, StateError, StateStore
from exporter.state.alerts import NO_DIGESTS, REMOVED
from tests.conftest import billing_section
from tests.daemon_fakes import NOWHERE, digests_told, fake_billing_section, unit_daemon
from tests.helpers import Receiver, logged, wait_for
from tests.smtp import FROM, PASSWORD, TO, USER, Mailbox, Start
from tests.test_budgets import PRICES
from tests.test_reconcile import USAGES

TODAY = dt.date(2026, 11, 22)
YESTERDAY = TODAY - dt.timedelta(days=1)


def spent(sim: Simulator, day: dt.date, endpoint_id: str | None = None) -> Decimal:
    return sum(
        (
            sim.charge(f"{day:%Y-%m}", day, e, item)[0]
            for e in sim.endpoints
            for item in ITEMS
            if endpoint_id in (None, e.endpoint_id)
        ),
        Decimal(0),
    )


def document(
    sim: Simulator, server: SimulatorServer | None, tmp_path: Path, notifiers: list[dict], **extra: object
) -> dict:
    """Without `server`: for a daemon on the simulator in process."""
    if server is None:
        billing = fake_billing_section(sim, history_months=0)
    else:
        billing = billing_section(sim, server, history_months=0)
    return {
        "billing": billing,
        "state": {"path": str(tmp_path / "state.db")},
        "alerts": {"notifiers": notifiers},
        "digest": {"at": "09:00", "notifiers": [n["name"] for n in notifiers]},
    } | extra


def hook(receiver: Receiver | None) -> list[dict]:
    """`alerts.notifiers` with one webhook notifier, `hook`, posting to `receiver` (without one: to an
    address nothing asks, in the unit layer)."""
    return [{"name": "hook", "type": "webhook", "url": receiver.url if receiver else f"{NOWHERE}/hook"}]


def start(doc: dict, clock: Clock) -> Daemon:
    daemon = Daemon(validate(doc, {}), clock=clock, listen="127.0.0.1:0")
    daemon.start(schedule=False)
    return daemon


def evaluate(daemon: Daemon, *, bills: bool = True) -> None:
    """What the daemon does each minute but deliver: refresh (when asked), evaluate (which looks at the digest)."""
    if bills:
        daemon.refresh("bills")
    daemon.alert_cycle()


def cycle(daemon: Daemon, *, bills: bool = True) -> None:
    """What the daemon does each minute: `evaluate`, then deliver."""
    evaluate(daemon, bills=bills)
    daemon.deliver()


def digests(receiver: Receiver) -> list[dict]:
    return [b for b in receiver.bodies() if b.get("kind") == "digest"]


def test_the_daily_digest_goes_once_at_its_time_whatever_restarts_and_repeats(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    doc = document(sim, None, tmp_path, hook(None))
    frozen.set(dt.datetime(2026, 11, 22, 8, 0, tzinfo=clock.tz))
    daemon = unit_daemon(validate(doc, {}), sim, clock)
    try:
        evaluate(daemon)
        assert digests_told(daemon) == []  # yesterday's 09:00 is 23 h ago: skipped; today's is not due yet
        frozen.set(dt.datetime(2026, 11, 22, 9, 0, tzinfo=clock.tz))
        evaluate(daemon)
        (body,) = digests_told(daemon)
        for _ in range(3):
            frozen.advance(dt.timedelta(minutes=1))
            evaluate(daemon)
    finally:
        daemon.stop()
    daemon = unit_daemon(validate(doc, {}), sim, clock)  # a restart the same day
    try:
        evaluate(daemon)
        assert len(digests_told(daemon)) == 1
    finally:
        daemon.stop()

    # (its `url`, the server's without `server.external_url`: in the test of a receiver that is down)
    assert body["id"] == f"daily:{TODAY}"  # the digest sent on the 22nd (about the 21st): receivers drop repeats by it
    assert (body["day"], body["period"]) == (YESTERDAY.isoformat(), "2026-11")
    assert Decimal(body["yesterday"]) == spent(sim, YESTERDAY).quantize(Decimal("0.01"))
    month = sum((spent(sim, TODAY.replace(day=d)) for d in range(1, YESTERDAY.day + 1)), Decimal(0))
    assert Decimal(body["month_to_date"]) == month.quantize(Decimal("0.01"))
    assert Decimal(body["forecast"]) > month
    ranked = sorted(sim.endpoints, key=lambda e: -spent(sim, YESTERDAY, e.endpoint_id))
    assert [t["endpoint_id"] for t in body["top_endpoints"]] == [e.endpoint_id for e in ranked]
    for top in body["top_endpoints"]:
        before = spent(sim, YESTERDAY - dt.timedelta(days=1), top["endpoint_id"])
        change = (spent(sim, YESTERDAY, top["endpoint_id"]) - before) / before * 100
        assert top["change_percent"] == pytest.approx(float(change), abs=0.051)


def test_a_receiver_that_is_down_gets_the_digest_later_once_and_a_late_start_sends_it_late(
    sim: Simulator, server: SimulatorServer, clock: Clock, frozen: FrozenClock, tmp_path: Path, receiver: Receiver
) -> None:
    doc = document(sim, server, tmp_path, hook(receiver))
    frozen.set(dt.datetime(2026, 11, 22, 13, 30, tzinfo=clock.tz))  # started after 09:00: the digest goes late
    receiver.refuse = 2
    daemon = start(doc, clock)
    first_url = daemon.server.url
    try:
        cycle(daemon)
        assert receiver.attempts == 1
        assert digests(receiver) == []
    finally:
        daemon.stop()
    daemon = start(doc, clock)  # a restart while it waits in the outbox
    try:
        for _ in range(6):
            frozen.advance(dt.timedelta(minutes=10))  # past every backoff
            cycle(daemon)
        assert receiver.attempts == 3
        assert len(digests(receiver)) == 1
        assert digests(receiver)[0]["day"] == YESTERDAY.isoformat()
        assert digests(receiver)[0]["url"] == first_url  # the server's that made it (no `server.external_url`)
        assert daemon.dispatcher.pending() == {}
    finally:
        daemon.stop()


def test_a_start_long_after_the_time_still_waits_for_the_bills(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    doc = document(sim, None, tmp_path, hook(None))
    frozen.set(dt.datetime(2026, 11, 22, 10, 30, tzinfo=clock.tz))  # 90 minutes after 09:00
    daemon = unit_daemon(validate(doc, {}), sim, clock)
    try:
        daemon.refresh("usage")  # another source finishes first and starts an evaluation
        evaluate(daemon, bills=False)
        assert digests_told(daemon) == []
        frozen.advance(dt.timedelta(seconds=30))
        evaluate(daemon)  # the bills arrive
        (body,) = digests_told(daemon)
        assert Decimal(body["yesterday"]) == spent(sim, YESTERDAY).quantize(Decimal("0.01"))
    finally:
        daemon.stop()


@pytest.mark.parametrize("bills", ["come late", "never come"])
def test_a_start_near_the_end_of_the_late_window_waits_for_the_bills_past_it(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path, bills: str
) -> None:
    """Back at 20:45 for a digest at 09:00 (within its 12 hours late): it waits for the bills, past
    21:00 too, and goes when they come, or with what there is after its hour's wait."""
    doc = document(sim, None, tmp_path, hook(None))
    frozen.set(dt.datetime(2026, 11, 22, 20, 45, tzinfo=clock.tz))
    daemon = unit_daemon(validate(doc, {}), sim, clock)
    try:
        evaluate(daemon, bills=False)
        for _ in range(10):  # to 21:35: half a day past 09:00 since 21:00
            frozen.advance(dt.timedelta(minutes=5))
            evaluate(daemon, bills=False)
        assert digests_told(daemon) == []
        frozen.advance(dt.timedelta(minutes=5 if bills == "come late" else 15))  # 21:40, or 21:50
        evaluate(daemon, bills=bills == "come late")
        (body,) = digests_told(daemon)
        assert body["day"] == YESTERDAY.isoformat()
        assert (body["yesterday"] is None) == (bills == "never come")
    finally:
        daemon.stop()


def test_it_waits_for_todays_bills_then_goes_with_what_there_is(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    doc = document(sim, None, tmp_path, hook(None))
    frozen.set(dt.datetime(2026, 11, 22, 9, 0, tzinfo=clock.tz))
    daemon = unit_daemon(validate(doc, {}), sim, clock)
    try:
        evaluate(daemon, bills=False)
        assert digests_told(daemon) == []  # no bills yet: a digest of unknowns would be worse than a late one
        frozen.advance(dt.timedelta(seconds=DIGEST_WAIT - 60))
        evaluate(daemon, bills=False)
        assert digests_told(daemon) == []
        frozen.advance(dt.timedelta(seconds=60))
        evaluate(daemon, bills=False)
        (body,) = digests_told(daemon)
        assert body["yesterday"] is None  # unknown, never zero
        assert body["month_to_date"] is None
    finally:
        daemon.stop()


def test_slack_gets_blocks_and_email_gets_text_and_html_over_tls(
    sim: Simulator, server: SimulatorServer, clock: Clock, frozen: FrozenClock, tmp_path: Path, receiver: Receiver,
    start_smtp: Start, mailbox: Mailbox, ca_file: str,
) -> None:  # fmt: skip
    smtp = start_smtp()
    notifiers = [
        {"name": "chat", "type": "slack", "url": f"{receiver.url}/slack"},
        {"name": "mail", "type": "email", "smtp": f"127.0.0.1:{smtp.port}", "from": FROM, "to": TO,
         "username": USER, "password": PASSWORD, "ca_file": ca_file},
    ]  # fmt: skip
    doc = document(sim, server, tmp_path, notifiers)
    frozen.set(dt.datetime(2026, 11, 22, 9, 5, tzinfo=clock.tz))
    daemon = start(doc, clock)
    try:
        cycle(daemon)
        wait_for(lambda: mailbox.messages)
    finally:
        daemon.stop()
    (slack,) = receiver.bodies("/slack")
    assert slack["text"].startswith(f"Daily inference spend {YESTERDAY}: ")
    assert [b["type"] for b in slack["blocks"]][:2] == ["header", "section"]
    assert any("Top endpoints" in b.get("text", {}).get("text", "") for b in slack["blocks"])
    (mail,) = mailbox.messages
    assert mail.tls
    assert mail.login == USER
    assert mail.message["Subject"] == slack["text"]
    plain = mail.message.get_body(("plain",))
    rich = mail.message.get_body(("html",))
    assert plain is not None
    assert rich is not None
    amount = f"{spent(sim, YESTERDAY).quantize(Decimal('0.01'))}"
    assert f"Yesterday ({YESTERDAY}): {amount}" in plain.get_content()
    assert f"Yesterday ({YESTERDAY}): {amount}" in rich.get_content()


def test_the_digest_counts_the_probe_runs_of_the_day(
    sim: Simulator, server: SimulatorServer, clock: Clock, frozen: FrozenClock, tmp_path: Path, receiver: Receiver
) -> None:
    doc = document(
        sim, server, tmp_path, hook(receiver),
        inference={"url": server.url, "api_key": sim.api_key},
        probes=[{"name": "chat", "model": sim.endpoints[0].endpoint_id}],
    )  # fmt: skip
    frozen.set(dt.datetime(2026, 11, 21, 23, 0, tzinfo=clock.tz))
    daemon = start(doc, clock)
    try:
        for _ in range(3):
            daemon.refresh("probe:chat")
            frozen.advance(dt.timedelta(minutes=10))
        sim.inject(Fault("status", path="/", status=500))
        daemon.refresh("probe:chat")  # yesterday's fourth run fails
        sim.inject(Fault("status", path="/", status=500))
        frozen.set(dt.datetime(2026, 11, 22, 0, 30, tzinfo=clock.tz))  # today: not in yesterday's digest
        daemon.refresh("probe:chat")
        frozen.set(dt.datetime(2026, 11, 22, 9, 0, tzinfo=clock.tz))
        cycle(daemon)
    finally:
        daemon.stop()
    (body,) = digests(receiver)
    (probe,) = body["probes"]
    assert probe["probe"] == "chat"
    assert probe["runs"] == 4
    assert probe["success_ratio"] == 0.75
    assert 0 < probe["time_to_first_token_p95_seconds"] < 30


def test_the_digest_s_time_to_first_token_counts_the_runs_the_histogram_counts(
    sim: Simulator, clock: Clock, tmp_path: Path
) -> None:
    """A run that had its first token and then failed (a check, a stall) is in the probe's time to
    first token histogram: its 95th percentile in the digest counts it too; a run with no first
    token (an error status) is in neither."""
    document = {
        "billing": fake_billing_section(sim),
        "inference": {"url": NOWHERE, "api_key": sim.api_key},
        "probes": [{"name": "chat", "model": sim.endpoints[0].endpoint_id}],
        "state": {"path": str(tmp_path / "state.db")},
    }
    daemon = unit_daemon(validate(document, {}), sim, clock)
    try:
        runs = [("chat", True, 0.2), ("chat", False, 4.0), ("chat", False, None)]
        (probe,) = daemon.sources.digest(clock.today(), "daily", "", runs=runs)["probes"]
    finally:
        daemon.stop()
    assert (probe["runs"], probe["success_ratio"]) == (3, 0.3333)
    assert probe["time_to_first_token_p95_seconds"] == 4.0


@pytest.fixture
def live() -> Iterator[tuple[Simulator, SimulatorServer]]:
    """A simulator on the real clock: the command runs in a process of its own, on the real clock too."""
    sim = Simulator(clock=Clock(clock_zone()))
    server = sim.serve()
    yield sim, server
    server.stop()


def test_the_digest_command_tells_a_state_file_it_cannot_read_from_one_that_is_not_there(
    live: tuple[Simulator, SimulatorServer], tmp_path: Path
) -> None:
    """A damaged file, or another program's, at `state.path`: said so (and why, in the log line
    before), not "no state file"; the digest is printed all the same, left as it was."""
    doc = document(*live, tmp_path, [{"name": "hook", "type": "webhook", "url": NOWHERE}])
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(doc))
    state = Path(doc["state"]["path"])
    state.write_bytes(b"not a database at all" * 100)
    printed = subprocess.run([sys.executable, "-m", "exporter.cli", "digest", "--config", str(path)],
                             capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert printed.returncode == 0, printed.stderr
    assert f"the state file {state} cannot be read (the warning above says why)" in printed.stderr
    assert "state file not read" in printed.stderr
    assert state.read_bytes() == b"not a database at all" * 100
    state.unlink()
    state.mkdir()
    printed = subprocess.run([sys.executable, "-m", "exporter.cli", "digest", "--config", str(path)],
                             capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert printed.returncode == 0, printed.stderr
    assert f"the state file {state} is not a file" in printed.stderr


def test_the_digest_command_prints_it_and_sends_it_when_asked(
    live: tuple[Simulator, SimulatorServer], tmp_path: Path, receiver: Receiver
) -> None:
    oncall = Receiver()  # takes alerts, not the digest: --send must not page it
    notifiers = [{"name": "hook", "type": "webhook", "url": receiver.url},
                 {"name": "oncall", "type": "webhook", "url": oncall.url}]  # fmt: skip
    doc = document(*live, tmp_path, notifiers[:1]) | {"budgets": [{"name": "tiny", "amount": "0.01"}]}
    doc["alerts"] = {"notifiers": notifiers, "rules": [{"alert": "Tiny", "budget": "tiny", "tiers": [1.0]}]}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(doc))
    command = [sys.executable, "-m", "exporter.cli", "digest", "--config", str(path)]
    printed = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert printed.returncode == 0, printed.stderr
    today = dt.datetime.now(clock_zone()).date()
    yesterday = today - dt.timedelta(days=1)
    assert printed.stdout.startswith(f"Daily inference spend {yesterday}: ")
    assert "Top endpoints (change against the day before)" in printed.stdout
    assert f"the state file {doc['state']['path']} is not there" in printed.stderr  # no daemon ran here
    assert digests(receiver) == []

    sent = subprocess.run([*command, "--send"], capture_output=True, text=True, timeout=60, check=False)
    assert sent.returncode == 0, sent.stderr
    assert "hook: sent" in sent.stderr
    (body,) = digests(receiver)
    assert body["day"] == yesterday.isoformat()
    assert body["id"].startswith("now:")  # not the daemon's digest of the day: a receiver keeps both

    assert [b.get("kind", b.get("status")) for b in receiver.bodies()] == ["digest"]  # no alert either
    assert oncall.bodies() == []
    oncall.stop()

    receiver.refuse = 10
    refused = subprocess.run([*command, "--send"], capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode == 2
    assert "hook: not sent" in refused.stderr
    assert 'msg="notification failed"' in refused.stderr  # tried once: no retry said
    assert "will retry" not in refused.stderr


def test_the_digest_command_names_the_saved_alerts_it_cannot_read(
    live: tuple[Simulator, SimulatorServer], tmp_path: Path, receiver: Receiver
) -> None:
    """Read from a daemon's state file, a damaged one is left out of the digest, and said."""
    import sqlite3

    from exporter.state import StateStore

    path = tmp_path / "config.yaml"
    path.write_text(
        yaml.safe_dump(document(*live, tmp_path, [{"name": "hook", "type": "webhook", "url": receiver.url}]))
    )
    StateStore(tmp_path / "state.db").close()
    with sqlite3.connect(tmp_path / "state.db") as db:
        db.execute("INSERT INTO alert_state VALUES ('damaged-key', 'rule', 'not json {')")
    command = [sys.executable, "-m", "exporter.cli", "digest", "--config", str(path)]
    printed = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert printed.returncode == 0, printed.stderr
    assert "note: 1 saved alerts cannot be read, left out: damaged-key" in printed.stderr


def clock_zone() -> dt.tzinfo:
    from zoneinfo import ZoneInfo

    return ZoneInfo("Asia/Shanghai")


def test_a_days_bill_gap_is_told_by_the_first_digest_after_it_settles_and_not_again(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    doc = document(sim, None, tmp_path, hook(None), prices=PRICES, reconciliation={"settle": "30h"})
    sim.set_prices(prices_from_config(validate(doc, {}).prices))  # days with records are billed from them
    off = YESTERDAY - dt.timedelta(days=1)  # the 20th: it settles at 06:00 on the 22nd, after 30 h
    for day in (off, YESTERDAY, TODAY):
        sim.add_usage(500, day)
    sim.distort_bill(off, Decimal("1.05"), item="ITEM_COMPLETION_TOKEN")
    frozen.set(dt.datetime(2026, 11, 22, 9, 0, tzinfo=clock.tz))
    daemon = unit_daemon(validate(doc, {}), sim, clock)
    try:
        daemon.refresh("usage")  # today's sync, then the settled days, the most recent first
        evaluate(daemon)
        frozen.set(dt.datetime(2026, 11, 23, 9, 0, tzinfo=clock.tz))
        sim.add_usage(500)  # the 23rd has records too
        daemon.refresh("usage")
        evaluate(daemon)
    finally:
        daemon.stop()
    first, second = digests_told(daemon)
    assert [(g["day"], g.get("item"), g["gap_percent"]) for g in first["reconciliation"] if "item" in g] == [
        (off.isoformat(), "ITEM_COMPLETION_TOKEN", 5.0)
    ]
    assert second["day"] == TODAY.isoformat()
    assert second["reconciliation"] == []  # the 21st, settled since, agrees; the 20th was told the day before


def told_gaps(digest: dict) -> list[tuple[str, str]]:
    return [(g["day"], g["item"]) for g in digest["reconciliation"] if "item" in g]


@pytest.mark.parametrize("change", ["none", "key-rotated", "upgraded"])
def test_a_days_bill_gap_is_told_once_across_an_access_key_rotation_or_an_upgrade(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path, change: str
) -> None:
    """The 20th's gap, told by the digest of the 22nd; after it, the access key is rotated (another
    billing account id, the same project) or the state file is one whose days told were kept by
    name only (a version before): none of the next three digests tells it again."""
    doc = document(sim, None, tmp_path, hook(None), prices=PRICES, reconciliation={"settle": "30h"})
    sim.set_prices(prices_from_config(validate(doc, {}).prices))
    off = YESTERDAY - dt.timedelta(days=1)
    for day in (off, YESTERDAY, TODAY):
        sim.add_usage(500, day)
    sim.distort_bill(off, Decimal("1.05"), item="ITEM_COMPLETION_TOKEN")
    (path := tmp_path / "config.yaml").write_text(yaml.safe_dump(doc))
    frozen.set(dt.datetime(2026, 11, 22, 9, 0, tzinfo=clock.tz))
    daemon = unit_daemon(validate(doc, {}), sim, clock, config_path=path)
    try:
        daemon.refresh("usage")
        evaluate(daemon)
        if change == "key-rotated":
            path.write_text(yaml.safe_dump(doc | {"billing": doc["billing"] | {"access_key_id": "AK-ROTATED"}}))
            assert daemon.reload()
        elif change == "upgraded":
            with daemon.dispatcher.store.store.transaction() as db:
                db.execute("DELETE FROM digest_told_by")
        for day in (23, 24, 25):
            frozen.set(dt.datetime(2026, 11, day, 9, 0, tzinfo=clock.tz))
            sim.add_usage(500)
            daemon.refresh("usage")
            evaluate(daemon)
    finally:
        daemon.stop()
    assert [told_gaps(d) for d in digests_told(daemon)] == [[(off.isoformat(), "ITEM_COMPLETION_TOKEN")], [], [], []]


def test_a_days_bill_gap_told_under_a_rotated_key_is_not_told_again_when_the_key_is_rotated_back(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    """The key rotated after the digest of the 22nd, and back after that of the 23rd, which told the
    21st's gap (settled at 06:00 on the 23rd): the 24th's and 25th's tell it not again."""
    doc = document(sim, None, tmp_path, hook(None), prices=PRICES, reconciliation={"settle": "30h"})
    sim.set_prices(prices_from_config(validate(doc, {}).prices))
    for day in (YESTERDAY - dt.timedelta(days=1), YESTERDAY, TODAY):
        sim.add_usage(500, day)
    sim.distort_bill(YESTERDAY, Decimal("1.05"), item="ITEM_COMPLETION_TOKEN")
    (path := tmp_path / "config.yaml").write_text(yaml.safe_dump(doc))
    rotated = doc | {"billing": doc["billing"] | {"access_key_id": "AK-ROTATED"}}
    frozen.set(dt.datetime(2026, 11, 22, 9, 0, tzinfo=clock.tz))
    daemon = unit_daemon(validate(doc, {}), sim, clock, config_path=path)
    try:
        for day, then in ((22, rotated), (23, doc), (24, None), (25, None)):
            frozen.set(dt.datetime(2026, 11, day, 9, 0, tzinfo=clock.tz))
            sim.add_usage(500)
            daemon.refresh("usage")
            evaluate(daemon)
            if then is not None:
                path.write_text(yaml.safe_dump(then))
                assert daemon.reload()
    finally:
        daemon.stop()
    gap = [(YESTERDAY.isoformat(), "ITEM_COMPLETION_TOKEN")]
    assert [told_gaps(d) for d in digests_told(daemon)] == [[], gap, [], []]


@pytest.mark.parametrize("moved", [False, True], ids=["as-it-was", "moved-under-accounts"])
def test_a_days_bill_gap_that_settles_while_no_digest_is_made_is_told_by_the_next(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path, moved: bool
) -> None:
    """The daemon is down from after the digest of the 22nd until the 24th's time (the 23rd's is
    not made: missed by more than half a day): the 21st, which settled meanwhile, is told by the
    digest of the 24th, and not again; also when the daemon comes back with its account moved
    under `accounts:` (the days its digests told, kept by name, are those of the name before)."""
    doc = document(sim, None, tmp_path, hook(None), prices=PRICES, reconciliation={"settle": "30h"})
    sim.set_prices(prices_from_config(validate(doc, {}).prices))
    off = YESTERDAY  # the 21st: it settles at 06:00 on the 23rd, after 30 h
    for day in (off - dt.timedelta(days=1), off, TODAY):
        sim.add_usage(500, day)
    sim.distort_bill(off, Decimal("1.05"), item="ITEM_COMPLETION_TOKEN")
    frozen.set(dt.datetime(2026, 11, 22, 9, 0, tzinfo=clock.tz))
    daemon = unit_daemon(validate(doc, {}), sim, clock)
    daemon.refresh("usage")
    evaluate(daemon)
    daemon.stop()
    sim.add_usage(500, TODAY + dt.timedelta(days=1))  # the 23rd, while the daemon is down
    frozen.set(dt.datetime(2026, 11, 24, 9, 0, tzinfo=clock.tz))
    sim.add_usage(500)
    if moved:
        doc = {k: v for k, v in doc.items() if k != "billing"} | {
            "accounts": [{"name": "prod", "billing": doc["billing"]}]
        }
    daemon = unit_daemon(validate(doc, {}), sim, clock)

    def refreshed_and_evaluated() -> None:
        for source in ("usage", "bills"):  # (usage: the settled days not read yet, the most recent first)
            assert all(daemon.refresh(key) for key in daemon.sources.keys(source))
        daemon.alert_cycle()

    try:
        refreshed_and_evaluated()
        frozen.set(dt.datetime(2026, 11, 25, 9, 0, tzinfo=clock.tz))
        sim.add_usage(500)
        refreshed_and_evaluated()
    finally:
        daemon.stop()
    days = [d["day"] for d in digests_told(daemon)]  # (each the day before the one it is sent on)
    assert days == ["2026-11-21", "2026-11-23", "2026-11-24"]
    assert [told_gaps(d) for d in digests_told(daemon)] == [[], [(off.isoformat(), "ITEM_COMPLETION_TOKEN")], []]


def test_a_days_bill_gap_judged_only_after_the_digest_that_saw_it_settle_is_told_by_the_next(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    """The digest goes at 06:00, the minute the 20th settles, before a usage refresh has read that
    day: its gap is told the next day, once."""
    doc = document(sim, None, tmp_path, hook(None), prices=PRICES, reconciliation={"settle": "30h"})
    doc["digest"]["at"] = "06:00"
    sim.set_prices(prices_from_config(validate(doc, {}).prices))
    off = YESTERDAY - dt.timedelta(days=1)  # the 20th: it settles at 06:00 on the 22nd
    for day in (off, YESTERDAY, TODAY):
        sim.add_usage(500, day)
    sim.distort_bill(off, Decimal("1.05"), item="ITEM_COMPLETION_TOKEN")
    daemon = unit_daemon(validate(doc, {}), sim, clock)
    try:
        for day in (22, 23, 24):
            frozen.set(dt.datetime(2026, 11, day, 5, 59, tzinfo=clock.tz))
            sim.add_usage(500)
            daemon.refresh("usage")  # today's, then the days settled by now
            frozen.set(dt.datetime(2026, 11, day, 6, 0, tzinfo=clock.tz))
            evaluate(daemon)
    finally:
        daemon.stop()
    assert [told_gaps(d) for d in digests_told(daemon)] == [[], [(off.isoformat(), "ITEM_COMPLETION_TOKEN")], []]


def test_a_digest_time_moved_earlier_tells_no_day_twice(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    """From 09:00 to 05:00: at 05:00 on the 23rd the day last settled is still the 20th (the 21st
    settles at 06:00), which the digest of the 22nd told."""
    doc = document(sim, None, tmp_path, hook(None), prices=PRICES, reconciliation={"settle": "30h"})
    sim.set_prices(prices_from_config(validate(doc, {}).prices))
    off = YESTERDAY - dt.timedelta(days=1)  # the 20th: it settles at 06:00 on the 22nd
    for day in (off, YESTERDAY, TODAY):
        sim.add_usage(500, day)
    sim.distort_bill(off, Decimal("1.05"), item="ITEM_COMPLETION_TOKEN")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(doc))
    frozen.set(dt.datetime(2026, 11, 22, 9, 0, tzinfo=clock.tz))
    daemon = unit_daemon(validate(doc, {}), sim, clock, config_path=path)
    try:
        daemon.refresh("usage")
        evaluate(daemon)
        path.write_text(yaml.safe_dump(doc | {"digest": doc["digest"] | {"at": "05:00"}}))
        assert daemon.reload()
        frozen.set(dt.datetime(2026, 11, 23, 5, 0, tzinfo=clock.tz))
        sim.add_usage(500)
        daemon.refresh("usage")
        evaluate(daemon)
    finally:
        daemon.stop()
    first, second = digests_told(daemon)
    assert told_gaps(first) == [(off.isoformat(), "ITEM_COMPLETION_TOKEN")]
    assert second["day"] == "2026-11-22"  # sent on the 23rd
    assert told_gaps(second) == []


def told_ids(daemon: Daemon) -> list[str]:
    return [d["id"] for d in digests_told(daemon)]


def switched(daemon: Daemon, path: Path, doc: dict, frozen: FrozenClock, clock: Clock, *steps: tuple) -> None:
    """Each step: at its time (a datetime, in the billing zone), a digest config reloaded (or None:
    as it is), then a look at the digest."""
    for at, digest in steps:
        frozen.set(at.replace(tzinfo=clock.tz))
        if digest is not None:
            path.write_text(yaml.safe_dump(doc | {"digest": doc["digest"] | digest}))
            assert daemon.reload()
        evaluate(daemon)


def daily_from(first: dt.date, last: dt.date, at: int = 9) -> list[tuple]:
    return [
        (dt.datetime.combine(first + dt.timedelta(days=n), dt.time(at, 30)), None)
        for n in range((last - first).days + 1)
    ]


def days_of(schedule: str, first: dt.date, last: dt.date) -> list[str]:
    return [f"{schedule}:{first + dt.timedelta(days=n)}" for n in range((last - first).days + 1)]


@pytest.mark.parametrize("rotated", [False, True], ids=["same-key", "key-rotated-too"])
def test_a_schedule_made_weekly_mid_week_sends_no_weekly_digest_of_days_the_daily_ones_told(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path, rotated: bool
) -> None:
    """Daily since Monday the 16th, weekly from Wednesday the 25th: Monday the 23rd's weekly digest,
    still due (half a week has not passed), would tell the 16th to the 22nd, which the daily ones
    told; the next Monday's goes, and so does the next day's daily one when daily again. The same
    when the reload to weekly rotates the access key too."""
    doc = document(sim, None, tmp_path, hook(None))
    (path := tmp_path / "config.yaml").write_text(yaml.safe_dump(doc))
    frozen.set(dt.datetime(2026, 11, 16, 9, 30, tzinfo=clock.tz))
    daemon = unit_daemon(validate(doc, {}), sim, clock, config_path=path)
    after = doc | {"billing": doc["billing"] | {"access_key_id": "AK-ROTATED"}} if rotated else doc
    try:
        switched(
            daemon, path, after, frozen, clock, *daily_from(dt.date(2026, 11, 16), dt.date(2026, 11, 25)),
            (dt.datetime(2026, 11, 25, 10, 0), {"schedule": "weekly"}), (dt.datetime(2026, 11, 30, 9, 30), None),
            (dt.datetime(2026, 12, 1, 9, 30), {"schedule": "daily"}),
        )  # fmt: skip
    finally:
        daemon.stop()
    dailies = days_of("daily", dt.date(2026, 11, 16), dt.date(2026, 11, 25))
    assert told_ids(daemon) == [*dailies, "weekly:2026-11-30", "daily:2026-12-01"]


@pytest.mark.parametrize(("before", "after"), [("weekly", "daily"), ("daily", "weekly")])
def test_a_schedule_switched_on_a_monday_to_a_later_time_tells_sunday_once(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path, before: str, after: str
) -> None:
    """A week of `before` at 08:00, the last on Monday the 30th telling Sunday; switched then to
    `after` at 09:00, whose digest of the day would tell Sunday (and the week) again. The next
    Monday's goes."""
    doc = document(sim, None, tmp_path, hook(None))
    doc["digest"] |= {"schedule": before, "at": "08:00"}
    (path := tmp_path / "config.yaml").write_text(yaml.safe_dump(doc))
    frozen.set(dt.datetime(2026, 11, 23, 8, 30, tzinfo=clock.tz))  # a Monday
    daemon = unit_daemon(validate(doc, {}), sim, clock, config_path=path)
    try:
        switched(
            daemon, path, doc, frozen, clock, *daily_from(dt.date(2026, 11, 23), dt.date(2026, 11, 30), at=8),
            (dt.datetime(2026, 11, 30, 9, 30), {"schedule": after, "at": "09:00"}),
            (dt.datetime(2026, 12, 7, 9, 30), None),
        )  # fmt: skip
    finally:
        daemon.stop()
    first = ["weekly:2026-11-23", "weekly:2026-11-30"] if before == "weekly" else days_of(
        "daily", dt.date(2026, 11, 23), dt.date(2026, 11, 30))  # fmt: skip
    assert told_ids(daemon) == [*first, f"{after}:2026-12-07"]


def test_a_weekly_digest_whose_days_the_daily_ones_told_in_part_goes(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    """Weekly (Monday the 23rd tells the 16th to the 22nd), daily at 08:00 from noon on Friday the
    27th (telling the 26th to the 29th), weekly at 09:00 again on Monday the 30th: that Monday's
    weekly digest goes, or the 23rd to the 25th would be told by none."""
    doc = document(sim, None, tmp_path, hook(None))
    doc["digest"] |= {"schedule": "weekly"}
    (path := tmp_path / "config.yaml").write_text(yaml.safe_dump(doc))
    frozen.set(dt.datetime(2026, 11, 23, 9, 30, tzinfo=clock.tz))
    daemon = unit_daemon(validate(doc, {}), sim, clock, config_path=path)
    try:
        switched(
            daemon, path, doc, frozen, clock, (dt.datetime(2026, 11, 23, 9, 30), None),
            (dt.datetime(2026, 11, 27, 12, 0), {"schedule": "daily", "at": "08:00"}),
            *daily_from(dt.date(2026, 11, 28), dt.date(2026, 11, 30), at=8),
            (dt.datetime(2026, 11, 30, 9, 30), {"schedule": "weekly", "at": "09:00"}),
        )  # fmt: skip
    finally:
        daemon.stop()
    dailies = days_of("daily", dt.date(2026, 11, 27), dt.date(2026, 11, 30))
    assert told_ids(daemon) == ["weekly:2026-11-23", *dailies, "weekly:2026-11-30"]


def test_the_reconciliation_days_a_digest_told_are_its_billing_account_s_whatever_the_names() -> None:
    """Two accounts' names swapped by a reload: each goes on from the days its own digests told.
    An access key rotated (another billing account id of the same project, the one before no longer
    configured) goes on from those of the id before; a name whose digests were another account's
    (configured now, or of another project) gives none of them. Accounts configured alike go by
    their names; a state file of a version before, which kept the days by name only, by the name."""
    store = AlertStore(StateStore(":memory:"))
    queue = DigestQueue(Clock(), contextlib.nullcontext, threading.Lock(), threading.Event())

    def made(name: str, account_id: str, told: list[int], sent_on: int = 21, *, marked: bool = True) -> None:
        """As `_account` queues it: the days it tells and those it went on from; `marked`: alone."""
        day, days = dt.date(2026, 11, sent_on - 1), [dt.date(2026, 11, d) for d in told]
        store.enqueue_digest(
            f"daily:2026-11-{sent_on}:{name}", ["chat"], {}, 0.0, told=(name, days), account_id=account_id,
            span=(day, day) if marked else None,
        )  # fmt: skip

    def told_before(
        name: str, account_id: str, *configured: str, project: str = "", alike: bool = False
    ) -> list[int] | None:
        sources = SimpleNamespace(alike=frozenset([account_id] if alike else []), account_ids=frozenset(configured))
        account = SimpleNamespace(account_id=account_id, client=SimpleNamespace(project_id=project))
        here = SimpleNamespace(store=store)
        last = store.digest_last_owner(name)
        ids = digests_module._ids(sources, account, last)  # type: ignore[arg-type]
        told = queue._told_before(here, sources, account, ids, name, last is not None)  # type: ignore[arg-type]
        return None if told is None else sorted(day.day for day in told)

    made("prod", "A", [17, 18])
    made("staging", "B", [16])
    assert told_before("staging", "A", "A", "B") == [17, 18]  # (A renamed staging, B renamed prod)
    made("staging", "A", [17, 18, 19], sent_on=22)  # (A's digest made first in the round)
    assert told_before("prod", "B", "A", "B") == [16]
    assert told_before("prod", "C", "A", "C") is None  # (prod is A's, still configured)
    assert told_before("staging", "C", "C", project="p2") is None  # (A's, of another project)
    assert told_before("staging", "A2", "A2", "B") == [17, 18, 19]  # (A's key rotated)
    made("staging", "A2", [17, 18, 19, 20], sent_on=23)
    made("staging", "A2", [21], sent_on=24, marked=False)  # (alike with another for a day)
    assert told_before("staging", "A2", "A2", "B", alike=True) == [16, 17, 18, 19, 20, 21]  # (by name: B's too)
    assert told_before("staging", "A2", "A2", "B") == [17, 18, 19, 20, 21]
    with store.store.transaction() as db:  # (a version before: days by name only, no digest marked)
        db.execute("DELETE FROM digest_told_by")
        db.execute("DELETE FROM digest_spans")
    assert told_before("staging", "A2", "A2", "B") == [16, 17, 18, 19, 20, 21]


def test_a_clock_that_ran_ahead_and_a_time_moved_past_midnight_hold_back_no_digest(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    """A digest is skipped only for one of its billing account timed since its own: not for one made
    while the host's clock ran a week ahead (corrected, the days go on), nor for the day before's
    digest, made after midnight (its hour's wait for the bills), when `digest.at` moves to 00:15."""
    doc = document(sim, None, tmp_path, hook(None))
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(doc))
    frozen.set(dt.datetime(2026, 11, 29, 9, 0, tzinfo=clock.tz))  # a week ahead
    daemon = unit_daemon(validate(doc, {}), sim, clock, config_path=path)
    try:
        evaluate(daemon)
        for day in (20, 21):  # corrected
            frozen.set(dt.datetime(2026, 11, day, 9, 0, tzinfo=clock.tz))
            evaluate(daemon)
        path.write_text(yaml.safe_dump(doc | {"digest": doc["digest"] | {"at": "23:30"}}))
        assert daemon.reload()
        frozen.set(dt.datetime(2026, 11, 22, 0, 30, tzinfo=clock.tz))  # the 21st's 23:30 digest, an hour late
        evaluate(daemon, bills=False)
        path.write_text(yaml.safe_dump(doc | {"digest": doc["digest"] | {"at": "00:15"}}))
        assert daemon.reload()
        for minutes in (5, 120):
            frozen.advance(dt.timedelta(minutes=minutes))
            evaluate(daemon)
    finally:
        daemon.stop()
    assert [d["id"] for d in digests_told(daemon)] == [
        "daily:2026-11-29", "daily:2026-11-20", "daily:2026-11-21", "daily:2026-11-22"
    ]  # fmt: skip


def test_an_smtp_server_that_refuses_gets_the_digest_later_once_with_the_same_message_id(
    sim: Simulator, server: SimulatorServer, clock: Clock, frozen: FrozenClock, tmp_path: Path,
    start_smtp: Start, mailbox: Mailbox, ca_file: str,
) -> None:  # fmt: skip
    smtp = start_smtp()
    mail = {"name": "mail", "type": "email", "smtp": f"127.0.0.1:{smtp.port}", "from": FROM, "to": TO,
            "username": USER, "password": PASSWORD, "ca_file": ca_file}  # fmt: skip
    doc = document(sim, server, tmp_path, [mail])
    mailbox.data_replies = ["451 4.3.0 try again later", "421 4.7.0 too busy"]
    frozen.set(dt.datetime(2026, 11, 22, 9, 0, tzinfo=clock.tz))
    daemon = start(doc, clock)
    try:
        cycle(daemon)
        assert len(mailbox.attempts) == 1
        assert mailbox.messages == []
        for _ in range(6):
            frozen.advance(dt.timedelta(minutes=10))
            cycle(daemon, bills=False)
        assert len(mailbox.attempts) == 3
        (delivered,) = mailbox.messages
        assert {m["Message-ID"] for m in mailbox.attempts} == {delivered.message["Message-ID"]}
        assert delivered.message["Subject"].startswith(f"Daily inference spend {YESTERDAY}")
        assert daemon.dispatcher.pending() == {}
    finally:
        daemon.stop()


@pytest.mark.parametrize(
    ("day", "scheduled"),
    [
        (dt.date(2026, 10, 18), "00:30"),  # an ordinary day: 01:30 BST
        (dt.date(2026, 10, 25), "00:30"),  # the clocks go back at 02:00 BST: the first 01:30
        (dt.date(2026, 3, 29), "01:30"),  # they go from 01:00 to 02:00: 01:30 as the clocks before read it
    ],
)
def test_a_digest_s_time_and_its_wait_for_bills_are_instants_on_the_days_the_clocks_change(
    tmp_path: Path, day: dt.date, scheduled: str
) -> None:
    """A 01:30 digest in Europe/London with no bills coming: queued the wait (an hour) after its time,
    as the clocks go, not two hours on the night they go back (a timedelta added to the zone's time
    is wall-clock time)."""
    london = ZoneInfo("Europe/London")
    start = dt.datetime.combine(day, dt.time(), london).astimezone(dt.UTC)
    frozen = FrozenClock(start)
    clock = Clock(london, frozen)
    sim = Simulator(clock=clock)
    document = {
        "billing": fake_billing_section(sim, history_months=0, timezone="Europe/London"),
        "state": {"path": str(tmp_path / "state.db")},
        "alerts": {"notifiers": [{"name": "hook", "type": "webhook", "url": f"{NOWHERE}/hook"}]},
        "digest": {"at": "01:30", "notifiers": ["hook"]},
    }
    daemon = unit_daemon(validate(document, {}), sim, clock)
    try:
        for minute in range(6 * 60):
            frozen.set(start + dt.timedelta(minutes=minute))
            daemon.alert_cycle()  # (no bills refresh: it waits for them, then goes without)
            if digests_told(daemon):
                break
        queued = frozen().astimezone(dt.UTC)
        expected = dt.datetime.combine(day, dt.time.fromisoformat(scheduled), dt.UTC) + dt.timedelta(
            seconds=DIGEST_WAIT
        )
        assert queued == expected
    finally:
        daemon.stop()


@pytest.mark.integration  # (receivers on loopback)
def test_a_queued_digest_of_a_notifier_a_reload_takes_out_of_digest_notifiers_is_not_delivered(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    """`mail` stays an alert notifier; its receiver was down when the digest was queued and is back
    after the reload: the digest is no longer its to tell (counted as discarded), `hook` has its own."""
    hook, mail = Receiver(), Receiver()
    mail.refuse = 1
    frozen.set(dt.datetime(2026, 11, 22, 9, 0, tzinfo=clock.tz))

    def document(digest_to: list[str]) -> dict:
        return {
            "billing": fake_billing_section(sim, history_months=0),
            "state": {"path": str(tmp_path / "state.db")},
            "alerts": {"notifiers": [{"name": "hook", "type": "webhook", "url": hook.url},
                                     {"name": "mail", "type": "webhook", "url": mail.url}]},
            "digest": {"at": "09:00", "notifiers": digest_to},
        }  # fmt: skip

    (path := tmp_path / "config.yaml").write_text(yaml.safe_dump(document(["hook", "mail"])))
    daemon = unit_daemon(validate(document(["hook", "mail"]), {}), sim, clock, config_path=path)
    try:
        assert daemon.refresh("bills")
        daemon.alert_cycle()
        daemon.deliver()
        assert (len(hook.bodies()), len(mail.bodies()), mail.attempts) == (1, 0, 1)
        path.write_text(yaml.safe_dump(document(["hook"])))
        assert daemon.reload()
        frozen.advance(dt.timedelta(minutes=10))
        daemon.deliver()
        assert mail.bodies() == []
        assert daemon.dispatcher.discarded["notifier_removed"] == 1
        assert not any(daemon.dispatcher.pending().values())
    finally:
        daemon.stop()
        hook.stop()
        mail.stop()


@pytest.mark.integration  # (receivers on loopback)
@pytest.mark.parametrize(
    ("mail_stays", "restart"), [(False, False), (True, False), (False, True)],
    ids=["reload-mail-removed", "reload-mail-an-alert-notifier-still", "restart-mail-removed"],
)  # fmt: skip
def test_a_queued_digest_a_reload_takes_from_its_notifier_goes_to_the_one_that_replaced_it_once(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path, mail_stays: bool, restart: bool
) -> None:
    """`mail` was down when the digest was queued; a reload (or a restart) sends digests to `chat`
    instead, and removes `mail` or keeps it for alerts: the digest is `chat`'s to deliver, once,
    with its `id`, and not `mail`'s when it is back. (Beside a notifier that took it, it would go to
    no new one: test_a_queued_digest_of_a_notifier_a_reload_takes_out_of_digest_notifiers_is_not_delivered.)"""
    mail, chat = Receiver(), Receiver()
    mail.refuse = 1
    frozen.set(dt.datetime(2026, 11, 22, 9, 0, tzinfo=clock.tz))

    def document(alerts_to: list[str], digest_to: list[str]) -> dict:
        urls = {"mail": mail.url, "chat": chat.url}
        return {
            "billing": fake_billing_section(sim, history_months=0),
            "state": {"path": str(tmp_path / "state.db")},
            "alerts": {"notifiers": [{"name": n, "type": "webhook", "url": urls[n]} for n in alerts_to]},
            "digest": {"at": "09:00", "notifiers": digest_to},
        }

    (path := tmp_path / "config.yaml").write_text(yaml.safe_dump(document(["mail"], ["mail"])))
    daemon = unit_daemon(validate(document(["mail"], ["mail"]), {}), sim, clock, config_path=path)
    try:
        assert daemon.refresh("bills")
        daemon.alert_cycle()
        daemon.deliver()
        assert (mail.attempts, mail.bodies(), chat.bodies()) == (1, [], [])
        path.write_text(yaml.safe_dump(after := document(["mail", "chat"] if mail_stays else ["chat"], ["chat"])))
        if restart:
            daemon.stop()
            daemon = unit_daemon(validate(after, {}), sim, clock, config_path=path)
        else:
            assert daemon.reload()
        for _ in range(3):
            frozen.advance(dt.timedelta(minutes=10))
            daemon.alert_cycle()
            daemon.deliver()
        (digest,) = chat.bodies()
        assert (digest["kind"], digest["id"]) == ("digest", f"daily:{TODAY}")
        assert mail.bodies() == []
        assert daemon.dispatcher.discarded["notifier_removed"] == 1
        assert not any(daemon.dispatcher.pending().values())
    finally:
        daemon.stop()
        mail.stop()
        chat.stop()


def webhooks(*names: str) -> list[NotifierConfig]:
    doc = {"billing": fake_billing_section(Simulator(seed=1)), "alerts": {"notifiers": [
        {"name": n, "type": "webhook", "url": f"{NOWHERE}/{n}"} for n in names]}}  # fmt: skip
    return validate(doc, {}).alerts.notifiers


def waiting(store: AlertStore) -> list[tuple[str, str]]:
    """The digests waiting: (notifier, id)."""
    with store.store.reading() as db:
        rows = db.execute("SELECT notifier, event FROM digest_outbox WHERE delivered IS NULL ORDER BY id").fetchall()
    return [(notifier, json.loads(event)["id"]) for notifier, event in rows]


def test_a_digest_handed_on_goes_back_to_a_notifier_renamed_back_and_not_past_a_week_from_its_queueing(
    clock: Clock,
) -> None:
    """`mail` renamed `chat` and back before its receiver took the digest: `mail` has it again (its
    dropped row is no delivery). A digest handed on from notifier to notifier is handed on for a
    week from when it was made, not a week from each hand-on."""
    store, now = AlertStore(StateStore(":memory:")), clock.now().timestamp()
    store.enqueue_digest("daily:2026-11-22", ["mail"], {"kind": "digest"}, now)
    assert store.discard(["chat"], now + 60, REMOVED, ["chat"]) == ({"mail": 1}, {"chat": 1})
    assert store.discard(["mail"], now + 120, REMOVED, ["mail"]) == ({"chat": 1}, {"mail": 1})
    assert waiting(store) == [("mail", "daily:2026-11-22")]
    head = store.head("mail")
    assert head is not None
    assert head.created == now + 120  # (queued for it then: how long its email recipients are owed it counts from then)
    store.discard(["a"], now + 4 * 86400, REMOVED, ["a"])
    assert waiting(store) == [("a", "daily:2026-11-22")]
    store.discard(["b"], now + 8 * 86400, REMOVED, ["b"])
    assert waiting(store) == []  # queued 8 days ago: not handed on to `b`
    with store.store.reading() as db:
        assert {n for (n,) in db.execute("SELECT notifier FROM digest_outbox")} == {"mail", "chat", "a"}


def test_a_digest_behind_an_alert_for_a_receiver_that_is_down_goes_to_the_notifier_that_took_its_place(
    clock: Clock, frozen: FrozenClock
) -> None:
    """`mail` stays an alert notifier, its receiver down with a resolve queued before the digest: a
    reload that sends digests to `hook` hands the digest on at once, not once the resolve goes (its
    receiver may stay down past the week a digest is handed on for)."""
    store = AlertStore(StateStore(":memory:"))
    wanted = ["mail"]
    dispatcher = Dispatcher(webhooks("mail", "hook"), store, clock, lambda _: [], "", digests_to=lambda: wanted)
    now = clock.now().timestamp()
    resolve: GroupEvent = {
        "status": "resolved", "alertname": "A", "dedup_key": "d", "total": 1, "still_firing": 0,
        "alerts": [{"key": "k", "dedup_key": "d", "status": "resolved", "labels": {"alertname": "A"},
                    "annotations": {}, "starts_at": now - 60, "ends_at": now, "value": "1"}],  # type: ignore[typeddict-item]
    }  # fmt: skip
    with store.store.transaction() as db:
        AlertStore.enqueue(db, "mail", resolve, now)
    store.enqueue_digest("daily:2026-11-22", ["mail"], {"kind": "digest"}, now)
    wanted = ["hook"]
    dispatcher.configure(webhooks("mail", "hook"), "")
    assert waiting(store) == [("hook", "daily:2026-11-22")]
    assert dispatcher.discarded["notifier_removed"] == 1  # (`mail`'s: its notification is never delivered)


def test_a_round_of_digests_a_reload_overtakes_queues_none_for_the_notifier_it_took_digests_from(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    """The round began under the config before (digests to `mail`); the reload (digests to `hook`)
    comes before it queues: it queues nothing, and the next round queues for `hook`."""
    notifiers = [{"name": n, "type": "webhook", "url": f"{NOWHERE}/{n}"} for n in ("mail", "hook")]
    doc = document(sim, None, tmp_path, notifiers)
    (path := tmp_path / "config.yaml").write_text(
        yaml.safe_dump(doc | {"digest": doc["digest"] | {"notifiers": ["mail"]}})
    )
    frozen.set(dt.datetime(2026, 11, 23, 9, 30, tzinfo=clock.tz))
    daemon = unit_daemon(load(path), sim, clock, config_path=path)
    try:
        assert daemon.refresh("bills")
        before = daemon.sources
        path.write_text(yaml.safe_dump(doc | {"digest": doc["digest"] | {"notifiers": ["hook"]}}))
        assert daemon.reload()
        assert not daemon._digests.queue(before, daemon.dispatcher, "")
        assert waiting(daemon.dispatcher.store) == []
        daemon.alert_cycle()
        assert waiting(daemon.dispatcher.store) == [("hook", "daily:2026-11-23")]
    finally:
        daemon.stop()


def test_a_queued_digest_dropped_across_a_reload_goes_to_the_digest_notifiers_of_when_it_is_written(
    clock: Clock,
) -> None:
    """Dropped for `chat` while the state file refused to write it, then written after a reload that
    names `hook` instead (the file refusing the reload's own drop too): `hook` gets it, not the
    `chat` that reload removed, and it is counted dropped once written. Dropped between the
    reload's new config and its notifiers reaching the dispatcher: it waits for the one named then."""
    store = AlertStore(StateStore(":memory:"))
    wanted = ["chat"]
    dispatcher = Dispatcher(webhooks("mail", "chat", "hook"), store, clock, lambda _: [], "", digests_to=lambda: wanted)
    store.enqueue_digest("daily:2026-11-22", ["mail"], {"kind": "digest"}, clock.now().timestamp())
    refuse = {"drop_waiting": True, "discard": True}

    def refusing(name: str) -> Any:
        write = getattr(store, name)

        def refused(*args: Any, **kwargs: Any) -> Any:
            if refuse.pop(name, False):
                raise StateError("state.db", "disk full")
            return write(*args, **kwargs)

        return refused

    store.drop_waiting = refusing("drop_waiting")  # type: ignore[method-assign]
    store.discard = refusing("discard")  # type: ignore[method-assign]
    with pytest.raises(StateError):
        dispatcher.deliver()
    wanted = ["hook"]
    dispatcher.configure(webhooks("mail", "hook"), "")  # (its drop refused: the digest is still `mail`'s)
    assert waiting(store) == [("mail", "daily:2026-11-22")]
    assert dispatcher.discarded["notifier_removed"] == 0  # (not written yet)
    dispatcher.deliver()  # (nothing listens: it stays queued)
    assert waiting(store) == [("hook", "daily:2026-11-22")]
    assert dispatcher.discarded["notifier_removed"] == 1  # (counted once written)

    store = AlertStore(StateStore(":memory:"))
    wanted = ["mail"]
    dispatcher = Dispatcher(webhooks("mail"), store, clock, lambda _: [], "", digests_to=lambda: wanted)
    store.enqueue_digest("daily:2026-11-22", ["mail"], {"kind": "digest"}, clock.now().timestamp())
    wanted = ["chat"]  # (a reload swaps the config, then configures the dispatcher)
    dispatcher.deliver()
    dispatcher.configure(webhooks("mail", "chat"), "")
    assert waiting(store) == [("chat", "daily:2026-11-22")]


def test_a_digest_dropped_unread_while_the_state_file_refused_and_then_by_a_reload_is_counted_once(
    clock: Clock,
) -> None:
    """A digest `mail` cannot read is dropped; the state file refuses to write so. A reload then
    sends digests to `hook` and drops it as `mail`'s no more, counted so. The refused drop, written
    when `mail` delivers again, finds it dropped: not counted a second time, nor its reason changed."""
    store = AlertStore(StateStore(":memory:"))
    wanted = ["mail"]
    dispatcher = Dispatcher(webhooks("mail", "hook"), store, clock, lambda _: [], "", digests_to=lambda: wanted)
    store.enqueue_digest("daily:2026-11-22", ["mail"], {"kind": "digest"}, clock.now().timestamp())
    with store.store.transaction("outbox") as db:
        db.execute("UPDATE digest_outbox SET event = '[1]'")  # (not a digest: unreadable)
    drop_waiting, refused = store.drop_waiting, []

    def refusing_once(*args: Any, **kwargs: Any) -> list[str] | None:
        if not refused:
            refused.append(args)
            raise StateError("state.db", "disk full")
        return drop_waiting(*args, **kwargs)

    store.drop_waiting = refusing_once  # type: ignore[method-assign]
    with pytest.raises(StateError):
        dispatcher.deliver()
    wanted = ["hook"]
    dispatcher.configure(webhooks("mail", "hook"), "")
    dispatcher.deliver()
    assert refused
    assert (dispatcher.discarded["notifier_removed"], dispatcher.discarded["unreadable"]) == (1, 0)
    with store.store.reading() as db:
        assert db.execute("SELECT notifier, last_error FROM digest_outbox").fetchall() == [("mail", NO_DIGESTS)]


def test_a_digest_a_reload_hands_on_as_its_worker_takes_it_up_is_dropped_once(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """The reload that sends digests to `hook` comes as `mail`'s worker has read the digest at the
    head of its queue: the reload hands it on and counts it dropped; the worker, finding it
    `mail`'s no more, neither counts it again nor logs it handed on to no one."""
    store = AlertStore(StateStore(":memory:"))
    wanted = ["mail"]
    dispatcher = Dispatcher(webhooks("mail", "hook"), store, clock, lambda _: [], "", digests_to=lambda: wanted)
    store.enqueue_digest("daily:2026-11-22", ["mail"], {"kind": "digest"}, clock.now().timestamp())
    head = store.head

    def read_then_reloaded(name: str, now: float) -> Any:
        nonlocal wanted
        found = head(name, now)
        if name == "mail" and wanted == ["mail"]:
            wanted = ["hook"]
            dispatcher.configure(webhooks("mail", "hook"), "")
        return found

    store.head = read_then_reloaded  # type: ignore[method-assign]
    caplog.set_level("INFO")
    dispatcher._drain("mail")
    assert waiting(store) == [("hook", "daily:2026-11-22")]
    assert dispatcher.discarded["notifier_removed"] == 1
    assert not logged(caplog.records, "queued digest dropped: its notifier takes no digests any more")


def test_a_digest_made_after_its_month_ended_tells_the_month_s_whole_total(tmp_path: Path) -> None:
    """A 22:00 digest of 30 November (about the 29th), made at 01:00 on 1 December, the exporter down
    at its time: the month has ended, and its forecast is what it came to, every day of it."""
    shanghai = ZoneInfo("Asia/Shanghai")
    frozen = FrozenClock(dt.datetime(2026, 12, 1, 1, 0, tzinfo=shanghai))
    clock = Clock(shanghai, frozen)
    sim = Simulator(clock=clock)
    document = {
        "billing": fake_billing_section(sim, history_months=0),
        "state": {"path": str(tmp_path / "state.db")},
        "alerts": {"notifiers": [{"name": "hook", "type": "webhook", "url": f"{NOWHERE}/hook"}]},
        "digest": {"at": "22:00", "notifiers": ["hook"]},
    }
    daemon = unit_daemon(validate(document, {}), sim, clock)
    try:
        assert daemon.refresh("bills")
        daemon.alert_cycle()
        (digest,) = digests_told(daemon)
        assert (digest["day"], digest["period"]) == ("2026-11-29", "2026-11")
        november = sim.bill_totals("2026-11")["total"]
        assert Decimal(digest["forecast"]) == november.quantize(Decimal("0.01"))
    finally:
        daemon.stop()


def under(doc: dict, name: str) -> dict:
    """`doc`'s one account moved under `accounts:`, named `name`."""
    account = {"name": name} | {key: doc[key] for key in ("billing", "inference", "probes")}
    return {key: value for key, value in doc.items() if key not in account} | {"accounts": [account]}


@pytest.mark.parametrize(
    ("before", "after", "restart"),
    [
        ("", "prod", False),  # a one-account config moved under `accounts:`
        ("prod", "production", False),  # renamed
        ("prod", "production", True),  # renamed while the exporter was down
        ("prod", "", False),  # moved back to a one-account config
    ],
)
def test_an_account_under_a_new_name_keeps_its_sources_state_and_the_digest_its_probe_runs(
    sim: Simulator,
    server: SimulatorServer,
    clock: Clock,
    frozen: FrozenClock,
    tmp_path: Path,
    receiver: Receiver,
    before: str,
    after: str,
    restart: bool,
) -> None:
    """The same billing account under a new name goes on in the state file it had: its usage day,
    settled days, history and probe runs (the digest of the day before tells its four runs, where
    it had told none), nothing read again."""
    base = document(sim, None, tmp_path, hook(receiver),
                    inference={"url": server.url, "api_key": sim.api_key},
                    probes=[{"name": "chat", "model": sim.endpoints[0].endpoint_id}])  # fmt: skip
    base["billing"]["history_months"] = 1
    base["reconciliation"] = {"days_per_refresh": 31}  # (every settled day read at the first refresh)
    first, second = (under(base, name) if name else base for name in (before, after))
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(first))
    frozen.set(dt.datetime(2026, 11, 21, 12, 0, tzinfo=clock.tz))
    daemon = unit_daemon(validate(first, {}), sim, clock, config_path=path)
    try:
        for source in daemon.sources.refreshers:
            assert daemon.refresh(source)
        for _ in range(3):
            frozen.advance(dt.timedelta(minutes=10))
            assert daemon.refresh(source_key(before, "probe:chat"))
        frozen.set(dt.datetime(2026, 11, 22, 8, 0, tzinfo=clock.tz))
        for source in daemon.sources.refreshers:
            assert daemon.refresh(source)
        served = dict(sim.requests_served)
        assert daemon.refresh(source_key(before, "usage"))
        poll = sim.requests_served[USAGES] - served[USAGES]  # (what a poll that finds nothing asks)
        path.write_text(yaml.safe_dump(second))
        if restart:
            daemon.stop()
            daemon = unit_daemon(validate(second, {}), sim, clock, config_path=path)
        else:
            assert daemon.reload()
        served = dict(sim.requests_served)
        assert daemon.refresh(source_key(after, "usage"))
        assert daemon.refresh(source_key(after, "history"))
        assert sim.requests_served == served | {USAGES: served[USAGES] + poll}  # nothing read again
        frozen.set(dt.datetime(2026, 11, 22, 9, 0, tzinfo=clock.tz))
        assert daemon.refresh(source_key(after, "bills"))
        cycle(daemon, bills=False)
    finally:
        daemon.stop()
    (body,) = digests(receiver)
    (probe,) = body["probes"]
    assert (body["day"], probe["runs"]) == ("2026-11-21", 4)
