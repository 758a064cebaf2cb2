"""Soak: the daemon against the simulator with random faults, appends (some while a day's pages
are being read), config reloads (half of them replacing the billing client mid-refresh, each
reversing the order of the rules, every third removing a notifier while it is failing and the
next adding it back), a receiver that drips its answers beside a healthy one, and day and month
rollovers on a fast clock; then every figure checked against the simulator's truth.

    python -m bench.soak [--minutes 10] [--speed 600] [--examples 200]

Prints the checks and two ratios: alerts delivered ÷ alerts due (must be exactly 1), and the
RSS growth between the first quarter and the end. Then it runs the property-based test of config
changes (`tests/test_config_changes_property.py`) with `--examples` examples, where `make test`
runs a few. `tests/test_soak.py` runs a short soak.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import random
import resource
import sqlite3
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from zoneinfo import ZoneInfo

from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from exporter.app.daemon import Daemon
from exporter.billing import RetryPolicy
from exporter.config.load import load
from exporter.core.clock import Clock
from exporter.delivery.dispatcher import SUPERSEDED
from exporter.sim import Fault, Simulator
from tests.helpers import DripReceiver, Receiver, named, scrape, value
from tests.test_config_changes_property import Pipeline

SHANGHAI = ZoneInfo("Asia/Shanghai")
PATHS = ("/api/v1/bills/details", "/api/v1/usages/details", "/v1/chat/completions")
KINDS = ("status", "status", "drop", "reset", "malformed", "code")
CANARY = {"alert": "Canary", "signal": "probe_success", "op": "<", "threshold": 2}
"""A rule that fires whenever the probe has run (its success is 0 or 1)."""


def fast_clock(start: dt.datetime, speed: float) -> Clock:
    origin = time.monotonic()
    return Clock(SHANGHAI, lambda: start + dt.timedelta(seconds=(time.monotonic() - origin) * speed))


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class Report:
    checks: dict[str, bool] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    faults: int = 0
    appended: int = 0
    reloads: int = 0
    oldest: float = 0.0
    """The oldest usage data seen (real seconds) while its refresh_success said 1."""
    days: set[str] = field(default_factory=set)
    delivered: int = 0
    due: int = 0
    rss_start: float = 0.0
    rss_end: float = 0.0

    @property
    def ok(self) -> bool:
        return all(self.checks.values())


def _repeat(stop: threading.Event, every: float, action: Callable[[], None]) -> threading.Thread:
    def loop() -> None:
        while not stop.wait(every):
            action()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def _changes(receiver: Receiver) -> dict[str, list[tuple[str, str, str, str]]]:
    """What a receiver was told of each alert, as it knows alerts (by their labels): (status,
    startsAt, endsAt, the budget period it is of, if it is a budget's) in order."""
    told: dict[str, list[tuple[str, str, str, str]]] = {}
    for body in receiver.bodies():
        for alert in body["alerts"]:
            labels = json.dumps(sorted(alert["labels"].items()))
            period = alert["annotations"].get("period", "")
            told.setdefault(labels, []).append((alert["status"], alert["startsAt"], alert["endsAt"], period))
    return told


def run_soak(duration: float, speed: float = 600.0, seed: int = 1, fault_rate: float = 0.05) -> Report:
    """Run for `duration` real seconds from 22:00 on 30 November (Shanghai), `speed` × real time."""
    rng = random.Random(seed)
    clock = fast_clock(dt.datetime(2026, 11, 30, 22, 0, tzinfo=SHANGHAI), speed)
    sim = Simulator(clock=clock, time_to_first_token=0.005)
    sim.add_usage(3000)
    server = sim.serve()
    receiver = Receiver()
    flaky = Receiver()
    """A notifier that fails, is removed while failing, and comes back (at a path per return)."""
    returns: dict[str, int] = {"/flaky/0": 0}
    """Per return of `flaky`, the last outbox id when it came back: nothing older may reach it."""
    left_queued = True
    drip = DripReceiver(interval=0.5)
    report = Report()
    scratch = tempfile.TemporaryDirectory(prefix="soak-")
    workdir = Path(scratch.name)
    document = (
        {
            "billing": {"url": server.url, "access_key_id": sim.access_key_id,
                        "secret_access_key": sim.secret_access_key, "bills_interval": "700ms",
                        "usage_interval": "300ms", "page_size": 200, "timeout": "2s"},
            "inference": {"url": server.url, "api_key": sim.api_key},
            "probes": [{"name": "chat", "model": sim.endpoints[0].endpoint_id, "interval": "400ms", "timeout": "2s"}],
            "budgets": [{"name": "daily", "amount": "400", "period": "day"}],
            "alerts": {
                "evaluation_interval": "300ms",
                "repeat_interval": "2h",  # in billing-clock time: about 12 s at 600×
                "rules": [
                    {"alert": "EndpointSpend", "signal": "spend", "by": ["endpoint_id"], "threshold": 120,
                     "labels": {"severity": "warning"}},
                    {"alert": "EndpointSpend", "signal": "spend", "by": ["endpoint_id"], "threshold": 180,
                     "labels": {"severity": "critical"}},
                    {"alert": "DailyBudget", "budget": "daily", "tiers": [0.5, 0.9],
                     "annotations": {"period": "{period}"}},
                    {"alert": "ProbeDown", "signal": "probe_success", "op": "<", "threshold": 1},
                ],
                "notifiers": [{"name": "hook", "type": "webhook", "url": receiver.url},
                              {"name": "slow", "type": "webhook", "url": drip.url},
                              {"name": "flaky", "type": "webhook", "url": f"{flaky.url}/flaky/0"}],
            },
            "state": {"path": str(workdir / "state.db")},
        }
    )  # fmt: skip
    path = workdir / "config.yaml"
    path.write_text(json.dumps(document))
    daemon = Daemon(
        load(path), config_path=path, clock=clock, listen="127.0.0.1:0", retry=RetryPolicy(attempts=3, backoff=0.05)
    )
    daemon.dispatcher.deadline = 1.0
    stop = threading.Event()
    monotonic_ok = True
    last_counts: dict[tuple[object, float], float] = {}

    def inject() -> None:
        if rng.random() < fault_rate * 4:
            sim.inject(Fault(rng.choice(KINDS), rng.choice(PATHS), status=rng.choice((500, 502, 503, 429))))
            report.faults += 1

    def append() -> None:
        count = rng.randint(1, 25)
        sim.add_usage(count)
        report.appended += count

    def append_mid_read(page_num: int) -> None:
        if page_num > 1 and rng.random() < 0.2:
            append()

    def reload() -> None:
        """Every other reload changes `billing` (a new client, abandoning a refresh in flight); each
        reverses the rules (two tiers share an alert name); `flaky` fails before every third, which
        removes it, and the next brings it back, healthy, at a new path."""
        nonlocal left_queued
        report.reloads += 1
        document["billing"]["concurrency"] = 3 if report.reloads % 2 else 4
        document["budgets"][0]["amount"] = str(400 + report.reloads % 3)
        alerts = document["alerts"]
        alerts["rules"].reverse()
        step = report.reloads % 3
        back = step == 1 and all(n["name"] != "flaky" for n in alerts["notifiers"])
        if step == 2:  # `flaky` fails, and a rule that always fires gives it something to queue
            flaky.refuse = 10**9
            alerts["rules"].append(CANARY)
        elif step == 0:
            alerts["notifiers"] = [n for n in alerts["notifiers"] if n["name"] != "flaky"]
            alerts["rules"] = [r for r in alerts["rules"] if r != CANARY]
        elif back:
            flaky.refuse = 0
            url = f"{flaky.url}/flaky/{report.reloads}"
            alerts["notifiers"] = [*alerts["notifiers"], {"name": "flaky", "type": "webhook", "url": url}]
            with sqlite3.connect(workdir / "state.db") as db:  # whatever was queued before it came back
                (last,) = db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'outbox'").fetchone()
            returns[f"/flaky/{report.reloads}"] = last
        path.write_text(json.dumps(document))
        if not daemon.reload():
            report.checks["every reload was taken"] = False
        if step == 0:
            left_queued = left_queued and "flaky" not in daemon.dispatcher.pending()

    def refuse() -> None:
        if rng.random() < fault_rate:
            receiver.refuse += 1

    def watch() -> None:
        """Counters never go down while their `_created` stays the same."""
        nonlocal monotonic_ok
        series = scrape(daemon.server.url)
        created = named(series, "inference_usage_requests_created")
        for labels, count in named(series, "inference_usage_requests_total").items():
            key = (labels, created.get(labels, 0.0))
            if count < last_counts.get(key, 0.0):
                monotonic_ok = False
            last_counts[key] = count
        report.days.update(dict(labels)["day"] for labels in named(series, "inference_billing_today_info"))
        at = value(series, "inference_exporter_last_refresh_success_timestamp_seconds", source="usage")
        if value(series, "inference_exporter_refresh_success", source="usage") == 1 and at is not None:
            report.oldest = max(report.oldest, (clock.now().timestamp() - at) / speed)

    sim.before_usage_page = append_mid_read
    daemon.start()
    threads = [_repeat(stop, 0.05, inject), _repeat(stop, 0.05, append), _repeat(stop, 0.1, refuse),
               _repeat(stop, 0.25, watch), _repeat(stop, 1.3, reload)]  # fmt: skip
    time.sleep(duration / 4)
    report.rss_start = rss_mb()
    time.sleep(duration * 3 / 4)
    stop.set()
    for thread in threads:
        thread.join(5)
    daemon.scheduler.pause()
    sim.clear_faults()
    sim.before_usage_page = None
    receiver.refuse = 0

    # Settle: every source once more without faults (waiting out a job still in flight), then drain.
    for source in daemon.sources.refreshers:
        for _ in range(100):
            if daemon.refresh(source):
                break
            time.sleep(0.1)
    # The alert worker goes on evaluating (the fast clock keeps reminders coming), so the check is
    # against a moment when the outbox held nothing undelivered: every entry up to `settled` is due.
    settled = 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        daemon.deliver()
        with sqlite3.connect(workdir / "state.db") as db:
            last, undelivered = db.execute(
                "SELECT MAX(id), COUNT(*) - COUNT(delivered) FROM outbox WHERE notifier = 'hook'"
            ).fetchone()
        if last and not undelivered:
            settled = last
            break
        time.sleep(0.05)
    report.rss_end = rss_mb()

    latest = daemon.latest
    today = clock.today()
    usage = latest.usage
    assert usage is not None
    got = {(k.endpoint_id, k.model): t.requests for k, t in usage.totals.items()}
    report.checks["usage today equals the simulator's"] = usage.day == today and got == {
        key: sums["requests"] for key, sums in sim.usage_totals(today).items()
    }
    previous = usage.previous_day
    if previous is not None:
        truth = sum(sums["requests"] for sums in sim.usage_totals(previous.day).values())
        late = truth - previous.records
        report.checks["previous day finalised"] = 0 <= late <= 25  # at most one append racing the midnight pull
        report.notes.append(f"previous day {previous.day}: {previous.records} records finalised, {late} after")
    bills = latest.bills
    assert bills is not None
    report.checks["bills equal the simulator's"] = (
        bills.current.month_to_date == sim.bill_totals(bills.current.period)["total"]
    )
    report.checks["counters never went down within a day"] = monotonic_ok

    with sqlite3.connect(workdir / "state.db") as db:
        # Due: every notification for `hook` but those overtaken while it refused them (a firing
        # whose alerts resolved before it could go out is never delivered; what overtook it is).
        dropped = dict(
            db.execute(
                "SELECT last_error, COUNT(*) FROM outbox WHERE notifier = 'hook' AND id <= ? AND delivered IS NOT NULL"
                " AND last_error != '' GROUP BY last_error",
                (settled,),
            ).fetchall()
        )
        report.due = db.execute(
            "SELECT COUNT(*) FROM outbox WHERE notifier = 'hook' AND id <= ?", (settled,)
        ).fetchone()[0] - dropped.get(SUPERSEDED, 0)
    report.checks["nothing for hook was dropped but what its alerts overtook"] = set(dropped) <= {SUPERSEDED}
    report.notes.append(f"{dropped.get(SUPERSEDED, 0)} notifications overtaken before delivery, not sent")
    bodies = [body for body in receiver.bodies() if int(body["notificationId"].rsplit("-", 1)[1]) <= settled]
    report.delivered = len(bodies)
    identities = [body["notificationId"] for body in bodies]
    report.checks["no notification delivered twice"] = len(set(identities)) == len(identities)
    report.checks["every alert due was delivered"] = report.delivered == report.due > 0
    report.checks["usage stayed fresh beside the dripping receiver"] = report.oldest < 5.0
    firing_again = [
        labels
        for labels, changes in _changes(receiver).items()
        for (status, _, ended, period), (next_status, started, _, next_period) in itertools.pairwise(changes)
        if (status, next_status) == ("resolved", "firing") and ended == started and period == next_period
    ]  # (a day budget's tier resolved at its day's end and fired at once for the next day, its bill
    #    already over the tier as the simulator bills a whole day from midnight: a new period, not a flap)
    report.checks["reversing the rules resolved and fired nothing again"] = firing_again == []
    stale = [
        r["body"]["notificationId"]
        for r in flaky.received
        if int(r["body"]["notificationId"].rsplit("-", 1)[1]) <= returns[r["path"]]
    ]
    report.checks["a notifier removed while failing kept no queue"] = (
        left_queued and daemon.dispatcher.discarded["notifier_removed"] > 0
    )
    report.checks["added back, it got nothing queued before"] = stale == [] and len(returns) > 1
    report.checks["the dripping receiver was tried, and never counted delivered"] = (
        drip.connections > 0 and daemon.dispatcher.sent["slow"] == 0
    )
    daemon.stop(grace=5)
    server.stop()
    receiver.stop()
    flaky.stop()
    drip.stop()
    scratch.cleanup()
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--speed", type=float, default=600.0)
    parser.add_argument("--examples", type=int, default=200, help="property-based examples of config changes")
    args = parser.parse_args(argv)
    report = run_soak(args.minutes * 60, args.speed)
    simulated = dt.timedelta(seconds=args.minutes * 60 * args.speed)
    print(f"soak: {args.minutes:g} min real, {simulated} on the billing clock, days seen {sorted(report.days)}")
    print(f"  {report.faults} faults injected, {report.appended} usage records appended, {report.reloads} reloads")
    for check, passed in report.checks.items():
        print(f"  {'ok  ' if passed else 'FAIL'} {check}")
    for note in report.notes:
        print(f"  {note}")
    print(f"  alerts delivered ÷ alerts due: {report.delivered}/{report.due} = "
          f"{report.delivered / report.due if report.due else float('nan'):.2f}  (must be exactly 1)")  # fmt: skip
    print(f"  oldest usage data while its refresh_success said 1: {report.oldest:.1f} s real")
    print(f"  peak RSS {report.rss_start:.1f} MB after the first quarter, {report.rss_end:.1f} MB at the end")
    if args.examples:
        started = time.monotonic()
        run_state_machine_as_test(Pipeline, settings=settings(Pipeline.TestCase.settings, max_examples=args.examples))
        print(f"  config changes: {args.examples} random sequences of reloads held every property "
              f"({time.monotonic() - started:.0f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
