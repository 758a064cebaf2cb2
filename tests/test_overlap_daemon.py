"""Faults that overlap with normal work, against the running daemon: a reload in each phase of a
refresh, a receiver that drips its answer beside a healthy one, thousands of alerts at once.

Every case asks two questions: are the figures right afterwards (against the simulator), and did
the freshness gauges tell the truth throughout (a watcher scrapes all along). What the daemon
decides (alerts grouped, resolved, prices and probes changed by a reload, a state file that turns
read-only) runs on the daemon with the simulator in process (tests/daemon_fakes.py), read from its
exposition and its outbox; what the wire does (a reload mid-fetch with the real client, receivers
that drip or redirect, deliveries, a notifier's new type) over HTTP.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from decimal import Decimal
from functools import partial
from pathlib import Path

import pytest
import requests
import yaml

from exporter.app import account
from exporter.app.daemon import Daemon
from exporter.billing import RetryPolicy
from exporter.config.load import ConfigError, validate
from exporter.core.clock import Clock
from exporter.notifiers.pagerduty import pagerduty_payload
from exporter.notifiers.slack import slack_payload
from exporter.notifiers.webhook import webhook_payload
from exporter.sim import ITEMS, Endpoint, Fault, Simulator, SimulatorServer
from tests.conftest import SHANGHAI, billing_section
from tests.daemon_fakes import NOWHERE, fake_billing_section, metrics, statuses, told, unit_daemon
from tests.fakes import chat_runner
from tests.helpers import DripReceiver, Receiver, logged, named, scrape, value, wait_for

FAST = RetryPolicy(attempts=2, backoff=0.01, sleep=lambda s: None)


@pytest.fixture
def clock() -> Clock:
    """Moves with real time from 10:00 on 2026-11-22 in Shanghai, so ages mean something."""
    start, origin = dt.datetime(2026, 11, 22, 10, 0, tzinfo=SHANGHAI), time.monotonic()
    return Clock(SHANGHAI, lambda: start + dt.timedelta(seconds=time.monotonic() - origin))


class Watcher:
    """Scrapes all along and keeps what the freshness gauges and the usage figures said."""

    def __init__(self, daemon: Daemon, source: str = "usage") -> None:
        self.daemon = daemon
        self.source = source
        self.seen: list[tuple[float, float | None, float | None, float | None]] = []
        """(billing clock now, success, last success, requests today)"""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                series = scrape(self.daemon.server.url)
            except requests.RequestException:
                continue
            requests_today = named(series, "inference_usage_requests_total")
            self.seen.append(
                (
                    self.daemon.clock.now().timestamp(),
                    value(series, "inference_exporter_refresh_success", source=self.source),
                    value(series, "inference_exporter_last_refresh_success_timestamp_seconds", source=self.source),
                    sum(requests_today.values()) if requests_today else None,
                )
            )

    def stop(self) -> list[tuple[float, float | None, float | None, float | None]]:
        self._stop.set()
        self._thread.join()
        return self.seen


def assert_truthful(seen: list[tuple[float, float | None, float | None, float | None]], max_age: float) -> None:
    """The last-success time never goes back, and while success says 1 the data is never older
    than `max_age` (a refresh stuck for good while success stays 1 is the lie this catches)."""
    assert seen, "the watcher saw nothing"
    last = [s[2] for s in seen if s[2] is not None]
    assert last == sorted(last)
    stale = [(now - at) for now, ok, at, _ in seen if ok == 1 and at is not None and now - at > max_age]
    assert not stale, f"success 1 with data {max(stale):.1f}s old"


def write(path: Path, document: dict) -> None:
    path.write_text(yaml.safe_dump(document))


@pytest.fixture
def slow_sim(sim: Simulator) -> Simulator:
    sim.latency = 0.1  # every billing request takes 100 ms: a day's read takes a while
    return sim


def section(sim: Simulator, server: SimulatorServer | None, **overrides: object) -> dict[str, object]:
    """The billing section on `server`; without one, the unit layer's (the billing API in process)."""
    return billing_section(sim, server, **overrides) if server is not None else fake_billing_section(sim, **overrides)


def reload_document(sim: Simulator, server: SimulatorServer | None, tmp_path: Path, **billing: object) -> dict:
    return {
        # Intervals of an hour: after the first runs, only a reload's "run again now" refreshes a source.
        "billing": section(sim, server, page_size=100, concurrency=2, usage_interval="1h", bills_interval="1h")
        | billing,
        "budgets": [{"name": "monthly", "amount": "20000"}],
        "state": {"path": str(tmp_path / "state.db")},
    }


PHASES = {
    "first-page": (2400, 2, 1),
    "parallel-pages": (2400, 2, 6),
    "last-page": (2400, 2, 24),
    "all-submitted-some-queued": (500, 1, 2),  # pages 2-5 submitted at once, 4 and 5 still queued
}


@pytest.mark.parametrize(("records", "concurrency", "page"), PHASES.values(), ids=PHASES.keys())
def test_a_reload_that_replaces_the_client_mid_fetch_abandons_it_and_runs_again(
    slow_sim: Simulator, server: SimulatorServer, clock: Clock, tmp_path: Path, caplog: pytest.LogCaptureFixture,
    records: int, concurrency: int, page: int,
) -> None:  # fmt: skip
    sim = slow_sim
    sim.add_usage(records)
    path = tmp_path / "config.yaml"
    document = reload_document(sim, server, tmp_path, concurrency=concurrency)
    write(path, document)
    daemon = Daemon(validate(document, {}), config_path=path, clock=clock, listen="127.0.0.1:0", retry=FAST)
    reloaded = threading.Event()
    reload_at: list[float] = []

    def reload_once(page_num: int) -> None:
        if page_num == page and not reloaded.is_set():
            reloaded.set()
            write(path, reload_document(sim, server, tmp_path, concurrency=concurrency + 1))  # `billing` changes
            reload_at.append(time.monotonic())
            threading.Thread(target=daemon.reload, daemon=True).start()

    sim.before_usage_page = reload_once
    caplog.set_level(logging.INFO, logger="exporter.app")
    daemon.start()
    watcher = Watcher(daemon)
    try:
        url = daemon.server.url
        wait_for(lambda: reloaded.is_set(), timeout=30)
        abandoned = wait_for(lambda: logged(caplog.records, "refresh abandoned", source="usage"), timeout=10)
        assert abandoned[0].created - (time.time() - (time.monotonic() - reload_at[0])) < 2.0  # promptly
        wait_for(lambda: requests.get(f"{url}/readyz", timeout=5).status_code == 200, timeout=30)
        series = wait_for(lambda: (s := scrape(url)) and sum(named(s, "inference_usage_requests_total").values()) and s)
        assert value(series, "inference_exporter_refresh_success", source="usage") == 1
        assert sum(named(series, "inference_usage_requests_total").values()) == records
        assert daemon.config.billing.concurrency == concurrency + 1
    finally:
        seen = watcher.stop()
        daemon.stop(grace=5)
    assert_truthful(seen, max_age=8.0)
    assert {s[3] for s in seen if s[3] is not None} <= {records}  # never a partial figure
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_reload_that_keeps_billing_lets_the_fetch_finish_and_the_schedule_stand(
    slow_sim: Simulator, server: SimulatorServer, clock: Clock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sim = slow_sim
    sim.add_usage(2400)
    path = tmp_path / "config.yaml"
    document = reload_document(sim, server, tmp_path)
    write(path, document)
    daemon = Daemon(validate(document, {}), config_path=path, clock=clock, listen="127.0.0.1:0", retry=FAST)
    reloaded = threading.Event()
    before: dict[str, object] = {}

    def reload_once(page_num: int) -> None:
        if page_num == 6 and not reloaded.is_set():
            reloaded.set()
            before.update({job.id: job.next_run_time for job in daemon.scheduler.get_jobs()})
            before["client"] = daemon.sources.client
            changed = document | {"budgets": [{"name": "monthly", "amount": "30000"}]}
            changed["billing"] = document["billing"] | {"usage_interval": "2h"}  # an interval: no new client
            write(path, changed)
            threading.Thread(target=daemon.reload, daemon=True).start()

    sim.before_usage_page = reload_once
    caplog.set_level(logging.INFO, logger="exporter.app")
    daemon.start()
    try:
        url = daemon.server.url
        wait_for(lambda: reloaded.is_set(), timeout=30)
        wait_for(lambda: daemon.config.budgets[0].amount == 30000)
        after = {job.id: job.next_run_time for job in daemon.scheduler.get_jobs()}
        assert after["bills"] == before["bills"]  # not re-run at once
        assert daemon.sources.client is before["client"]
        wait_for(lambda: requests.get(f"{url}/readyz", timeout=5).status_code == 200, timeout=30)
        assert sum(named(scrape(url), "inference_usage_requests_total").values()) == 2400
    finally:
        daemon.stop(grace=5)
    # (the reload abandoned nothing; the history may still be fetching when the test stops the daemon)
    assert not [r for r in caplog.records if "abandoned: the config was reloaded" in r.getMessage()]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def alerting_document(
    sim: Simulator, server: SimulatorServer | None, tmp_path: Path, notifiers: list[dict], **rule: object
) -> dict:
    return {
        "billing": section(sim, server, usage_interval="200ms", bills_interval="300ms", page_size=100),
        "state": {"path": str(tmp_path / "state.db")},
        "alerts": {
            "evaluation_interval": "200ms",
            "rules": [{"alert": "SpendHigh", "signal": "spend", "by": ["endpoint_id"], "threshold": "0"} | rule],
            "notifiers": notifiers,
        },
    }


def test_a_dripping_receiver_delays_only_itself(
    sim: Simulator, server: SimulatorServer, clock: Clock, tmp_path: Path, receiver: Receiver,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    drip = DripReceiver(interval=0.3)
    sim.add_usage(500)
    notifiers = [
        {"name": "drip", "type": "webhook", "url": drip.url},
        {"name": "hook", "type": "webhook", "url": receiver.url},
    ]
    document = alerting_document(sim, server, tmp_path, notifiers)
    path = tmp_path / "config.yaml"
    write(path, document)
    daemon = Daemon(validate(document, {}), config_path=path, clock=clock, listen="127.0.0.1:0", retry=FAST)
    daemon.dispatcher.deadline = 1.0
    caplog.set_level(logging.INFO)
    daemon.start()
    watcher = Watcher(daemon)
    try:
        bodies = wait_for(receiver.bodies, timeout=15)
        assert len(bodies) == 1
        assert len(bodies[0]["alerts"]) == len(sim.endpoints)  # one message for the rule's three alerts
        wait_for(lambda: daemon.dispatcher.failed["drip"] >= 1, timeout=15)
        sim.add_usage(25)  # refreshes go on meanwhile: the new records show up
        wait_for(lambda: sum(named(scrape(daemon.server.url), "inference_usage_requests_total").values()) == 525)
        document["alerts"]["repeat_interval"] = "2h"
        write(path, document)
        assert daemon.reload()  # a reload while the receiver drips neither waits on it nor stalls it
        time.sleep(2)
        assert drip.connections >= 1
        assert daemon.dispatcher.sent["drip"] == 0
        started = time.monotonic()
    finally:
        seen = watcher.stop()
        stopped = daemon.stop(grace=5)
        drip.stop()
    assert stopped
    assert time.monotonic() - started < 5
    assert_truthful(seen, max_age=3.0)
    failures = logged(caplog.records, "notification failed", notifier="drip")
    assert failures
    assert failures[0].fields["reason"] == "no complete answer within 1s"  # type: ignore[attr-defined]


def posted(daemon: Daemon) -> tuple[list[dict], list[dict], list[dict]]:
    """What the webhook `hook`, the Slack `chat` and the PagerDuty `pager` notifiers are to post,
    read from their outboxes (nothing for PagerDuty where it has nothing to be told)."""
    hook = [webhook_payload(event, "hook", "", "") for event in told(daemon, "hook")]
    slack = [slack_payload(event, "") for event in told(daemon, "chat")]
    pager = [body for event in told(daemon, "pager") if (body := pagerduty_payload(event, "rk", "")) is not None]
    return hook, slack, pager


def test_hundreds_of_alerts_are_one_message_per_rule_and_change(sim: Simulator, clock: Clock, tmp_path: Path) -> None:
    sim.endpoints = tuple(Endpoint(f"ep-{n:05d}", "model-a", "proj-main") for n in range(150))
    notifiers = [
        {"name": "hook", "type": "webhook", "url": f"{NOWHERE}/hook"},
        {"name": "chat", "type": "slack", "url": f"{NOWHERE}/slack"},
        {"name": "pager", "type": "pagerduty", "routing_key": "rk", "url": f"{NOWHERE}/pd"},
    ]
    daemon = unit_daemon(validate(alerting_document(sim, None, tmp_path, notifiers), {}), sim, clock)
    try:
        assert daemon.refresh("bills")
        daemon.alert_cycle()
        hooks, slacks, pagers = posted(daemon)
        (hook,) = hooks
        assert hook["status"] == "firing"
        assert len(hook["alerts"]) == 100
        assert hook["truncatedAlerts"] == 50
        assert hook["commonLabels"] == {"alertname": "SpendHigh"}
        (slack,) = slacks
        assert slack["text"] == "[FIRING] SpendHigh: 150 alerts"
        assert "and 140 more" in slack["blocks"][0]["text"]["text"]
        (pager,) = pagers
        assert pager["event_action"] == "trigger"
        assert pager["payload"]["custom_details"]["total"] == 150

        for endpoint in sim.endpoints[:90]:  # some resolve, the others go on firing
            for item in ITEMS:
                sim.revise_bill(clock.today(), endpoint.endpoint_id, item, Decimal(0))
        assert daemon.refresh("bills")
        daemon.alert_cycle()
        hooks, slacks, pagers = posted(daemon)
        resolved = hooks[1:]  # (the group still fires, as Alertmanager's would: its alerts say they resolved)
        assert [
            (b["status"], {a["status"] for a in b["alerts"]}, b["truncatedAlerts"] + len(b["alerts"])) for b in resolved
        ] == [("firing", {"resolved"}, 90)]
        assert len(slacks) == 2
        assert len(pagers) == 1  # the incident stays open: 60 alerts still fire

        for endpoint in sim.endpoints[90:]:
            for item in ITEMS:
                sim.revise_bill(clock.today(), endpoint.endpoint_id, item, Decimal(0))
        assert daemon.refresh("bills")
        daemon.alert_cycle()
        hooks, _, pagers = posted(daemon)
        assert hooks[-1]["status"] == "resolved"  # the last of the group
        last = pagers[-1]
        assert (last["event_action"], last["dedup_key"]) == ("resolve", pager["dedup_key"])
        assert len(hooks) == 3
        assert value(metrics(daemon), "inference_alert_notifications_pending", notifier="hook") == 3
    finally:
        daemon.stop()


def test_a_redirect_is_a_failure_that_names_where_it_points(
    sim: Simulator, server: SimulatorServer, clock: Clock, tmp_path: Path, receiver: Receiver,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    receiver.redirect_to = "https://127.0.0.1:9/elsewhere?token=s3cret"  # (where a webhook's token moves to https)
    notifiers = [{"name": "hook", "type": "webhook", "url": receiver.url}]
    daemon = Daemon(
        validate(alerting_document(sim, server, tmp_path, notifiers), {}), clock=clock, listen="127.0.0.1:0"
    )
    caplog.set_level(logging.INFO)
    daemon.start(schedule=False)
    try:
        assert daemon.refresh("bills")
        daemon.alert_cycle()
        daemon.deliver()
        assert receiver.attempts == 1
        assert receiver.gets == 0
        assert receiver.bodies() == []
        assert daemon.dispatcher.sent["hook"] == 0
        assert daemon.dispatcher.failed["hook"] == 1
        assert daemon.dispatcher.pending() == {"hook": 1}
    finally:
        daemon.stop()
    (line,) = logged(caplog.records, "notification failed", notifier="hook")
    # Where it points, not its path or query: they may carry the token.
    assert line.fields["reason"].startswith("HTTP 302 (redirect to https://127.0.0.1:9;")  # type: ignore[attr-defined]


def probe_document(sim: Simulator, tmp_path: Path, probes: list[str]) -> dict:
    """The unit layer's: the billing API and the probes' chat answered in process (`chat_runner`)."""
    return {
        "billing": fake_billing_section(sim),
        "inference": {"url": NOWHERE, "api_key": sim.api_key},
        "probes": [{"name": name, "model": sim.endpoints[0].endpoint_id, "interval": "1h"} for name in probes],
        "state": {"path": str(tmp_path / "state.db")},
        "alerts": {
            "rules": [{"alert": "ProbeDown", "signal": "probe_success", "by": ["probe"], "op": "<", "threshold": 1}],
            "notifiers": [{"name": "hook", "type": "webhook", "url": NOWHERE}],
        },
    }


def test_an_alert_whose_probe_is_removed_resolves(
    sim: Simulator, clock: Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(account, "ProbeRunner", partial(chat_runner, sim))  # the daemon's probes, in process
    path = tmp_path / "config.yaml"
    document = probe_document(sim, tmp_path, ["broken", "fine"])
    write(path, document)
    daemon = unit_daemon(validate(document, {}), sim, clock, config_path=path)
    try:
        sim.inject(Fault("status", "/v1/chat/completions", status=503))
        assert daemon.refresh("probe:broken")
        assert daemon.refresh("probe:fine")
        daemon.alert_cycle()
        assert [(e["status"], e["alerts"][0]["labels"]["probe"]) for e in told(daemon)] == [("firing", "broken")]
        write(path, probe_document(sim, tmp_path, ["fine"]))
        assert daemon.reload()
        daemon.alert_cycle()
        assert statuses(daemon) == ["firing", "resolved"]
        assert named(metrics(daemon), "inference_alerts") == {}
    finally:
        daemon.stop()


def test_a_probe_rule_with_no_probe_left_is_refused(sim: Simulator, tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"alerts.rules\[0\].signal \(alert ProbeDown\): signal 'probe_success' needs a"
    ):
        validate(probe_document(sim, tmp_path, []), {})
    document = probe_document(sim, tmp_path, ["fine"])
    document["alerts"]["rules"][0]["where"] = {"probe": "fien"}
    with pytest.raises(ConfigError, match=r"where.probe \(alert ProbeDown\): 'fien' matches nothing \(known: fine\)"):
        validate(document, {})


def test_a_state_file_that_turns_read_only_is_named_and_metrics_keep_serving(
    sim: Simulator, clock: Clock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sim.add_usage(300)
    daemon = unit_daemon(validate(reload_document(sim, None, tmp_path), {}), sim, clock)
    caplog.set_level(logging.INFO, logger="exporter.app")
    try:
        assert daemon.refresh("usage")
        daemon.alert_cycle()
        assert value(metrics(daemon), "inference_exporter_state_write_success") == 1
        daemon.state._db.execute("PRAGMA query_only = ON")  # as a file turned read-only would answer
        sim.add_usage(20)
        assert not daemon.refresh("usage")
        series = metrics(daemon)
        assert value(series, "inference_exporter_state_write_success") == 0
        assert value(series, "inference_exporter_refresh_success", source="usage") == 0
        assert sum(named(series, "inference_usage_requests_total").values()) == 300  # the last good figures
        error = daemon.latest.health["usage"].error
        assert f"state file {tmp_path / 'state.db'} is read-only" in error
        daemon.state._db.execute("PRAGMA query_only = OFF")
        assert daemon.refresh("usage")
        series = metrics(daemon)
        assert value(series, "inference_exporter_state_write_success") == 1
        assert sum(named(series, "inference_usage_requests_total").values()) == 320
        assert value(series, "inference_exporter_usage_resyncs_total") == 0  # it went on where it had stopped
    finally:
        daemon.stop()
    failures = logged(caplog.records, "refresh failed", source="usage")
    assert len(failures) == 1


def test_a_scrape_is_answered_while_a_save_holds_the_state_file(
    sim: Simulator, server: SimulatorServer, clock: Clock, tmp_path: Path
) -> None:
    """A scrape reads the state file (the notifications waiting) beside the writer: a long save or
    a slow disk holding the write lock does not hold up /metrics, nor blank the figure."""
    notifiers = [{"name": "hook", "type": "webhook", "url": f"{NOWHERE}/hook"}]  # refused: it stays queued
    daemon = Daemon(
        validate(alerting_document(sim, server, tmp_path, notifiers), {}), clock=clock, listen="127.0.0.1:0"
    )
    daemon.start(schedule=False)
    held, release = threading.Event(), threading.Event()

    def save() -> None:
        with daemon.state.transaction():
            held.set()
            release.wait(60)

    saving = threading.Thread(target=save)
    try:
        assert daemon.refresh("bills")
        daemon.alert_cycle()
        assert value(scrape(daemon.server.url), "inference_alert_notifications_pending", notifier="hook") == 1
        saving.start()
        assert held.wait(30)
        series = scrape(daemon.server.url)  # (10 s at most: a scrape waiting for the save fails here)
        assert saving.is_alive()  # answered while the save still held the file
        assert value(series, "inference_alert_notifications_pending", notifier="hook") == 1
    finally:
        release.set()
        if saving.is_alive():
            saving.join(30)
        daemon.stop()


def test_a_delivery_the_state_file_cannot_record_is_not_sent_again(
    sim: Simulator, server: SimulatorServer, clock: Clock, tmp_path: Path, receiver: Receiver
) -> None:
    notifiers = [{"name": "hook", "type": "webhook", "url": receiver.url}]
    daemon = Daemon(
        validate(alerting_document(sim, server, tmp_path, notifiers), {}), clock=clock, listen="127.0.0.1:0"
    )
    receiver.on_post = lambda: daemon.state._db.execute("PRAGMA query_only = ON")  # refuses to record it
    daemon.start(schedule=False)
    try:
        assert daemon.refresh("bills")
        daemon.alert_cycle()
        wait_for(lambda: receiver.attempts == 1)
        time.sleep(5)  # two and a half polls of the notifier's worker
        assert receiver.attempts == 1
        assert value(scrape(daemon.server.url), "inference_exporter_state_write_success") == 0
        receiver.on_post = None
        daemon.state._db.execute("PRAGMA query_only = OFF")
        wait_for(lambda: not daemon.dispatcher.pending().get("hook"))
        time.sleep(2.5)
        assert receiver.attempts == 1
        assert [b["status"] for b in receiver.bodies()] == ["firing"]
    finally:
        daemon.stop()


def test_a_notifier_that_changes_type_on_reload_delivers_as_its_new_type(
    sim: Simulator, server: SimulatorServer, clock: Clock, tmp_path: Path, receiver: Receiver
) -> None:
    path = tmp_path / "config.yaml"
    document = alerting_document(sim, server, tmp_path, [{"name": "n", "type": "webhook", "url": f"{receiver.url}/x"}])
    write(path, document)
    daemon = Daemon(validate(document, {}), config_path=path, clock=clock, listen="127.0.0.1:0")
    daemon.start(schedule=False)
    try:
        document["alerts"]["notifiers"] = [{"name": "n", "type": "alertmanager", "urls": [receiver.url]}]
        write(path, document)
        assert daemon.reload()
        assert daemon.refresh("bills")
        assert daemon.refresh("usage")  # (judged on fresh figures: an Alertmanager is sent them)
        daemon.alert_cycle()
        wait_for(lambda: receiver.bodies("/api/v2/alerts"), timeout=10)
        assert receiver.bodies("/x") == []
    finally:
        daemon.stop()


def test_new_prices_apply_at_once_on_reload_to_what_is_counted_next(
    sim: Simulator, clock: Clock, tmp_path: Path
) -> None:
    """The counter keeps what it counted at the old prices (it never goes down); the records
    counted after the reload are priced with the new ones, with no refresh needed to take them."""
    sim.add_usage(200)
    path = tmp_path / "config.yaml"
    prices = [{"model": m, "prompt_per_million": "1", "completion_per_million": "2"} for m in ("model-a", "model-b")]
    document = reload_document(sim, None, tmp_path) | {"prices": prices}
    write(path, document)
    daemon = unit_daemon(validate(document, {}), sim, clock, config_path=path)

    def sample() -> tuple[dict, dict, dict]:
        series = metrics(daemon)
        return (
            named(series, "inference_usage_estimated_payable_amount_total"),
            named(series, "inference_usage_prompt_tokens_total"),
            named(series, "inference_usage_completion_tokens_total"),
        )

    try:
        assert daemon.refresh("usage")
        before, prompt_before, completion_before = sample()
        document["prices"] = [p | {"prompt_per_million": "1000", "completion_per_million": "2000"} for p in prices]
        write(path, document)
        served = dict(sim.requests_served)
        assert daemon.reload()
        assert sample()[0] == before  # what was counted stays counted
        assert sim.requests_served == served  # no refresh was needed
        sim.add_usage(100)
        assert daemon.refresh("usage")
        after, prompt_after, completion_after = sample()
    finally:
        daemon.stop()
    assert before.keys() == after.keys()
    for key in before:
        new_tokens = (prompt_after[key] - prompt_before[key]) * 1000 + (
            completion_after[key] - completion_before[key]
        ) * 2000
        assert after[key] - before[key] == pytest.approx(new_tokens / 1_000_000)


def test_an_alertmanager_peer_that_drips_does_not_hold_back_the_other(
    clock: Clock, receiver: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    from exporter.alerts.alert import Alert
    from exporter.delivery.dispatcher import Dispatcher
    from exporter.notifiers.alertmanager import AlertmanagerNotifier
    from exporter.state import AlertStore, StateStore

    drip = DripReceiver(interval=0.3)
    peers = AlertmanagerNotifier.model_validate(
        {"name": "am", "type": "alertmanager", "urls": [drip.url.removesuffix("/hook"), receiver.url]}
    )
    now = clock.now().timestamp()
    alert = Alert("k", "SpendHigh", {"alertname": "SpendHigh"}, {}, "firing", now, "1", now, fired_at=now)
    dispatcher = Dispatcher([peers], AlertStore(StateStore(":memory:")), clock, lambda _: [alert], "http://exporter")
    dispatcher.deadline = 60.0  # the dripping peer holds its post for as long as the test lets it
    caplog.set_level(logging.INFO)
    sending = threading.Thread(target=dispatcher.resend_now, daemon=True)
    sending.start()
    try:
        (body,) = wait_for(receiver.bodies, timeout=20)  # the healthy peer is not queued behind the other
        assert [a["labels"] for a in body] == [alert.labels]
        assert sending.is_alive()  # while the other peer still drips
    finally:
        drip.stop()  # its post ends now, failed
    sending.join(20)
    assert not sending.is_alive()
    assert dispatcher.sent["am"] == 1
    assert dispatcher.failed["am"] == 1
    (failure,) = logged(caplog.records, "notification failed", notifier="am")
    assert failure.fields["target"] == "urls[0]"  # type: ignore[attr-defined]


def test_a_notifier_removed_and_added_again_tells_its_failures_afresh(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """A failure is logged once until the notifier recovers; a reload that removes the notifier
    ends that, so the one added again under its name has its first failure told, and no recovery
    from a failure of the one removed."""
    from exporter.delivery.dispatcher import Dispatcher
    from exporter.notifiers.webhook import WebhookNotifier
    from exporter.state import AlertStore, StateStore

    hook = WebhookNotifier.model_validate({"name": "hook", "type": "webhook", "url": f"{NOWHERE}/hook"})
    dispatcher = Dispatcher([hook], AlertStore(StateStore(":memory:")), clock, lambda _: [], "http://exporter")
    caplog.set_level(logging.INFO)
    for _ in range(2):
        assert dispatcher.post("hook", str(hook.url), {}) is not None  # refused: nothing listens
    assert len(logged(caplog.records, "notification failed", notifier="hook")) == 1
    dispatcher.configure([], "http://exporter")
    assert dispatcher.post("hook", str(hook.url), {}) is not None  # on the wire as it was removed: not told
    assert len(logged(caplog.records, "notification failed", notifier="hook")) == 1
    dispatcher.configure([hook], "http://exporter")
    assert dispatcher.post("hook", str(hook.url), {}) is not None
    assert len(logged(caplog.records, "notification failed", notifier="hook")) == 2
    assert dispatcher.failed == {"hook": 1}  # the new one's own
    dispatcher.configure([], "http://exporter")
    dispatcher.configure([hook], "http://exporter")
    assert dispatcher.outcome("hook", None) is None  # a success of the new one: nothing to recover from
    assert not logged(caplog.records, "notifier recovered")
