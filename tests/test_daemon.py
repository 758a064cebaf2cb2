"""The daemon with its real scheduler and HTTP server, against the simulator on loopback; what a reload
does to its figures and its billing API, on the simulator in process (tests/daemon_fakes.py)."""

from __future__ import annotations

import base64
import datetime as dt
import http.client
import logging
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import trustme
import yaml

from exporter.app.daemon import Daemon
from exporter.billing import RetryPolicy
from exporter.config.load import validate
from exporter.core.clock import Clock
from exporter.core.logs import LogfmtFormatter
from exporter.sim import Fault, Simulator, SimulatorServer
from tests.conftest import SHANGHAI, billing_section
from tests.daemon_fakes import InProcessBilling, fake_billing_section, metrics, readiness, unit_daemon
from tests.helpers import Receiver, logged, named, scrape, value, wait_for

FAST = RetryPolicy(attempts=2, backoff=0.01, sleep=lambda s: None)


@pytest.fixture
def clock() -> Clock:
    """The billing clock moves here (from 10:00 on 2026-11-22 in Shanghai), so refresh times differ."""
    start, origin = dt.datetime(2026, 11, 22, 10, 0, tzinfo=SHANGHAI), time.monotonic()
    return Clock(SHANGHAI, lambda: start + dt.timedelta(seconds=time.monotonic() - origin))


def daemon_config(sim: Simulator, server: SimulatorServer | None, tmp_path: Path, **billing: object) -> dict:
    """Without a server: for a daemon on the simulator in process (`unit_daemon`)."""
    fast = {"bills_interval": "300ms", "usage_interval": "200ms", "page_size": 100}
    return {
        "billing": (billing_section(sim, server, **fast) if server else fake_billing_section(sim, **fast)) | billing,
        "budgets": [{"name": "monthly", "amount": "20000"}],
        "state": {"path": str(tmp_path / "state.db")},
    }


@pytest.fixture
def daemon(sim: Simulator, server: SimulatorServer, clock: Clock, tmp_path: Path) -> Iterator[Daemon]:
    sim.add_usage(750)
    daemon = Daemon(validate(daemon_config(sim, server, tmp_path), {}), clock=clock, listen="127.0.0.1:0", retry=FAST)
    daemon.start()
    yield daemon
    daemon.stop(grace=5)


def is_ready(url: str) -> bool:
    return requests.get(f"{url}/readyz", timeout=5).status_code == 200


def test_ready_after_each_source_refreshed_once(daemon: Daemon, sim: Simulator) -> None:
    url = daemon.server.url
    wait_for(lambda: is_ready(url) and requests.get(f"{url}/readyz", timeout=5).json()["sources"]["history"] == "ok")
    body = requests.get(f"{url}/readyz", timeout=5).json()
    assert body == {
        "ready": True,
        "sources": {"bills": "ok", "history": "ok", "usage": "ok"},
        "waits_for": ["bills", "usage"],
    }
    assert requests.get(f"{url}/healthz", timeout=5).text == "ok\n"
    page = requests.get(f"{url}/", timeout=5).text
    assert '<a href="/metrics">' in page
    assert "<td>bills</td><td class=ok>ok</td>" in page
    series = scrape(url)
    assert value(series, "inference_bill_month_to_date_payable_amount", period="2026-11") == float(
        sim.bill_totals("2026-11")["total"]
    )
    requests_total = named(series, "inference_usage_requests_total")
    assert sum(requests_total.values()) == 750


def test_not_ready_until_the_first_refresh(
    sim: Simulator, server: SimulatorServer, clock: Clock, tmp_path: Path
) -> None:
    sim.inject(Fault("status", status=503, times=1000))
    daemon = Daemon(validate(daemon_config(sim, server, tmp_path), {}), clock=clock, listen="127.0.0.1:0", retry=FAST)
    daemon.start()
    try:
        url = daemon.server.url
        wait_for(lambda: value(scrape(url), "inference_exporter_refresh_success", source="usage") == 0)
        response = requests.get(f"{url}/readyz", timeout=5)
        assert response.status_code == 503
        assert response.json()["sources"]["usage"] == "never succeeded"
        sim.clear_faults()
        wait_for(lambda: is_ready(url))  # the history that failed meanwhile is checked again later: not waited for
        body = requests.get(f"{url}/readyz", timeout=5).json()
        assert "history" in body["sources"]
        assert body["waits_for"] == ["bills", "usage"]
    finally:
        daemon.stop(grace=5)


def test_an_outage_keeps_the_last_values_and_recovers(
    daemon: Daemon, sim: Simulator, caplog: pytest.LogCaptureFixture
) -> None:
    url = daemon.server.url
    wait_for(lambda: is_ready(url))
    before = scrape(url)
    counters_before = named(before, "inference_usage_requests_total")

    caplog.set_level(logging.DEBUG, logger="exporter.app")
    sim.inject(Fault("status", status=503, times=10_000))
    first = wait_for(
        lambda: (
            (s := scrape(url))
            and value(s, "inference_exporter_refresh_success", source="usage") == 0
            and value(s, "inference_exporter_refresh_success", source="bills") == 0
            and s
        )
    )
    failed = daemon.latest.api_calls().get(("usages", "503"), 0)
    wait_for(lambda: daemon.latest.api_calls().get(("usages", "503"), 0) >= failed + 10)  # more failed refreshes
    later = scrape(url)
    for name in (
        "inference_usage_requests_total",
        "inference_bill_month_to_date_payable_amount",
        "inference_exporter_last_refresh_success_timestamp_seconds",
    ):
        assert named(later, name) == named(first, name)
    assert named(later, "inference_usage_requests_total") == counters_before
    assert value(later, "inference_exporter_refresh_success", source="usage") == 0
    failures = [r for r in logged(caplog.records, "refresh failed", source="usage") if r.levelno == logging.ERROR]
    assert len(failures) == 1  # once per state change, not once per refresh

    sim.clear_faults()
    sim.add_usage(40)
    after = wait_for(
        lambda: (
            (s := scrape(url))
            and value(s, "inference_exporter_refresh_success", source="usage") == 1
            and sum(named(s, "inference_usage_requests_total").values()) == 790
            and s
        )
    )
    for labels, count in counters_before.items():
        assert named(after, "inference_usage_requests_total")[labels] >= count
    # (logged just after the figures are swapped in: on a busy machine a scrape can see them first)
    wait_for(lambda: logged(caplog.records, "refresh recovered", source="usage"))


def test_reload_refuses_a_bad_config_and_keeps_running(sim: Simulator, clock: Clock, tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    document = daemon_config(sim, None, tmp_path)
    path.write_text(yaml.safe_dump(document))
    daemon = unit_daemon(validate(document, {}), sim, clock, config_path=path)
    try:
        for source in list(daemon.sources.refreshers):
            assert daemon.refresh(source)
        assert readiness(daemon)[0]
        path.write_text("billing:\n  page_size: 501\n")
        assert daemon.reload() is False
        series = metrics(daemon)
        assert value(series, "inference_exporter_config_last_reload_successful") == 0
        assert value(series, "inference_exporter_refresh_success", source="bills") == 1

        document["budgets"] = [{"name": "monthly", "amount": "40000"}]
        path.write_text(yaml.safe_dump(document))
        assert daemon.reload() is True
        series = metrics(daemon)
        assert value(series, "inference_exporter_config_last_reload_successful") == 1
        assert value(series, "inference_budget_amount", budget="monthly") == 40000
    finally:
        daemon.stop(grace=5)


def test_a_reload_keeps_the_billing_api_while_its_section_is_unchanged_and_builds_a_new_one_when_it_changes(
    sim: Simulator, clock: Clock, tmp_path: Path
) -> None:
    path = tmp_path / "config.yaml"
    document = daemon_config(sim, None, tmp_path)
    path.write_text(yaml.safe_dump(document))
    billing = InProcessBilling(sim)
    daemon = unit_daemon(validate(document, {}), sim, clock, config_path=path, billing=billing)
    try:
        with pytest.raises(AttributeError, match="no HTTP server"):
            daemon.server  # noqa: B018 - the property raises
        (first,) = billing.built
        assert daemon.sources.client is first
        document["billing"]["usage_interval"] = "5m"  # when to refresh, not how: the same client goes on
        path.write_text(yaml.safe_dump(document))
        assert daemon.reload()
        assert billing.built == [first]
        assert daemon.sources.client is daemon.sources.usage.client is first

        document["billing"]["page_size"] = 50
        path.write_text(yaml.safe_dump(document))
        assert daemon.reload()
        _, second = billing.built
        assert daemon.sources.client is daemon.sources.usage.client is daemon.sources.bills.client is second
        assert second.page_size == 50
        sim.add_usage(120)
        served = sim.requests_served.get("/api/v1/usages/details", 0)
        assert daemon.refresh("usage")
        assert sim.requests_served["/api/v1/usages/details"] >= served + 3  # pages of 50 now
        assert sum(named(metrics(daemon), "inference_usage_requests_total").values()) == 120
    finally:
        daemon.stop(grace=5)


def test_a_scrape_never_calls_the_api(daemon: Daemon, sim: Simulator) -> None:
    url = daemon.server.url
    wait_for(lambda: is_ready(url))
    daemon.scheduler.pause()
    wait_for(lambda: daemon._active == 0)
    served = dict(sim.requests_served)
    for _ in range(5):
        scrape(url)
    assert sim.requests_served == served


def test_probes_run_as_sources_and_feed_probe_alerts(
    sim: Simulator, server: SimulatorServer, clock: Clock, tmp_path: Path, receiver: Receiver
) -> None:
    document = daemon_config(sim, server, tmp_path) | {
        "inference": {"url": server.url, "api_key": sim.api_key},
        "probes": [{"name": "chat-stream", "model": sim.endpoints[1].endpoint_id, "interval": "200ms"}],
        "alerts": {
            "rules": [{"alert": "ProbeFailing", "signal": "probe_success", "by": ["probe"], "op": "<", "threshold": 1}],
            "notifiers": [{"name": "hook", "type": "webhook", "url": receiver.url}],
        },
    }
    daemon = Daemon(validate(document, {}), clock=clock, listen="127.0.0.1:0", retry=FAST)
    daemon.start()
    try:
        url = daemon.server.url
        wait_for(lambda: is_ready(url))
        assert "probe:chat-stream" in requests.get(f"{url}/readyz", timeout=5).json()["sources"]
        labels = {"probe": "chat-stream", "endpoint_id": sim.endpoints[1].endpoint_id, "scenario": "chat"}
        assert value(scrape(url), "inference_probe_success", **labels) == 1
        sim.inject(Fault("status", "/v1/chat/completions", status=503, times=10_000))
        wait_for(lambda: [b["status"] for b in receiver.bodies()] == ["firing"])
        series = scrape(url)
        assert value(series, "inference_probe_success", **labels) == 0
        assert value(series, "inference_exporter_refresh_success", source="probe:chat-stream") == 1
        assert value(series, "inference_probe_failures_total", **labels, reason="http_5xx") >= 1
        sim.clear_faults()
        wait_for(lambda: [b["status"] for b in receiver.bodies()] == ["firing", "resolved"])
    finally:
        daemon.stop(grace=5)


def test_a_run_skipped_for_a_slow_source_is_our_debug_line_not_a_warning(
    sim: Simulator, server: SimulatorServer, clock: Clock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sim.latency = 0.4  # each usage refresh outlasts its 100 ms interval
    sim.add_usage(10)
    document = daemon_config(sim, server, tmp_path, usage_interval="100ms", bills_interval="1h")
    daemon = Daemon(validate(document, {}), clock=clock, listen="127.0.0.1:0", retry=FAST)
    caplog.set_level(logging.DEBUG)
    daemon.start()
    try:
        wait_for(lambda: logged(caplog.records, "scheduled run skipped", source="usage"), timeout=20)
    finally:
        daemon.stop(grace=5)
    assert not [r for r in caplog.records if "maximum number of running instances" in r.getMessage()]


OLD_PASSWORD, NEW_PASSWORD = "old-scrape-pass-0451", "new-scrape-pass-7182"


def write_certificate(ca: trustme.CA, directory: Path) -> bytes:
    """A certificate for 127.0.0.1 by the test CA, written as cert.pem and key.pem in `directory`; its DER."""
    leaf = ca.issue_cert("127.0.0.1")
    leaf.cert_chain_pems[0].write_to_path(str(directory / "cert.pem"))
    leaf.private_key_pem.write_to_path(str(directory / "key.pem"))
    return ssl.PEM_cert_to_DER_cert(leaf.cert_chain_pems[0].bytes().decode())


def served_certificate(daemon: Daemon, ca_file: str) -> bytes:
    """The certificate a new TLS connection to the daemon is shown (DER)."""
    context = ssl.create_default_context(cafile=ca_file)
    with (
        socket.create_connection(daemon.server.server_address[:2], timeout=10) as plain,
        context.wrap_socket(plain, server_hostname="127.0.0.1") as connection,
    ):
        certificate = connection.getpeercert(binary_form=True)
    assert certificate is not None
    return certificate


def status(daemon: Daemon, password: str, ca_file: str) -> int:
    url = f"{daemon.server.url}/metrics"
    return requests.get(url, auth=("prometheus", password), verify=ca_file, timeout=10).status_code


@pytest.fixture
def tls_daemon(
    sim: Simulator, server: SimulatorServer, clock: Clock, tmp_path: Path, ca: trustme.CA
) -> Iterator[tuple[Daemon, dict, Path]]:
    """A daemon serving HTTPS with basic auth, started from a config file; the document, for the test to change
    and write again."""
    write_certificate(ca, tmp_path)
    path = tmp_path / "config.yaml"
    document = daemon_config(sim, server, tmp_path) | {
        "server": {
            "listen": "127.0.0.1:0",
            "tls": {"cert_file": str(tmp_path / "cert.pem"), "key_file": str(tmp_path / "key.pem")},
            "basic_auth": {"username": "prometheus", "password": OLD_PASSWORD},
        }
    }
    path.write_text(yaml.safe_dump(document))
    daemon = Daemon(validate(document, {}), config_path=path, clock=clock, retry=FAST)
    daemon.start(schedule=False)
    yield daemon, document, path
    daemon.stop(grace=5)


def test_a_reload_rotates_the_password_and_the_certificate_without_dropping_connections(
    tls_daemon: tuple[Daemon, dict, Path], ca: trustme.CA, ca_file: str, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    daemon, document, path = tls_daemon
    caplog.set_level(logging.DEBUG)
    first = served_certificate(daemon, ca_file)
    assert status(daemon, OLD_PASSWORD, ca_file) == 200
    host, port = daemon.server.server_address[:2]
    kept = http.client.HTTPSConnection(host, port, context=ssl.create_default_context(cafile=ca_file), timeout=10)
    kept.request("GET", "/healthz")
    assert kept.getresponse().read() == b"ok\n"
    in_flight = kept.sock

    second = write_certificate(ca, tmp_path)  # renewed in place: the same paths, new contents
    document["server"]["basic_auth"]["password"] = NEW_PASSWORD
    path.write_text(yaml.safe_dump(document))
    assert daemon.reload() is True

    assert served_certificate(daemon, ca_file) == second != first
    assert status(daemon, OLD_PASSWORD, ca_file) == 401
    assert status(daemon, NEW_PASSWORD, ca_file) == 200
    token = base64.b64encode(f"prometheus:{NEW_PASSWORD}".encode()).decode()
    kept.request("GET", "/metrics", headers={"Authorization": f"Basic {token}"})  # the connection of before
    assert kept.getresponse().status == 200
    assert kept.sock is in_flight
    assert in_flight.getpeercert(binary_form=True) == first  # its session goes on as it began
    kept.close()
    series = scrape(daemon.server.url, verify=ca_file, auth=("prometheus", NEW_PASSWORD))
    assert value(series, "inference_exporter_config_last_reload_successful") == 1
    formatter = LogfmtFormatter()
    for record in caplog.records:
        line = formatter.format(record)
        assert OLD_PASSWORD not in line
        assert NEW_PASSWORD not in line


def test_a_reload_whose_certificate_does_not_load_is_refused_whole(
    tls_daemon: tuple[Daemon, dict, Path], ca: trustme.CA, ca_file: str, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    daemon, document, path = tls_daemon
    first = served_certificate(daemon, ca_file)
    (tmp_path / "cert.pem").write_text("-----BEGIN CERTIFICATE-----\nnot one\n-----END CERTIFICATE-----\n")
    document["server"]["basic_auth"]["password"] = NEW_PASSWORD
    document["budgets"] = [{"name": "monthly", "amount": "40000"}]
    path.write_text(yaml.safe_dump(document))
    assert daemon.reload() is False

    [refusal] = logged(caplog.records, "config reload refused")
    assert refusal.levelno == logging.ERROR
    assert "server.tls" in refusal.fields["error"]  # type: ignore[attr-defined]
    assert str(tmp_path / "cert.pem") in refusal.fields["error"]  # type: ignore[attr-defined]
    assert served_certificate(daemon, ca_file) == first
    assert status(daemon, NEW_PASSWORD, ca_file) == 401  # nothing of the refused config applies
    series = scrape(daemon.server.url, verify=ca_file, auth=("prometheus", OLD_PASSWORD))
    assert value(series, "inference_exporter_config_last_reload_successful") == 0
    assert value(series, "inference_budget_amount", budget="monthly") == 20000

    second = write_certificate(ca, tmp_path)
    assert daemon.reload() is True
    assert served_certificate(daemon, ca_file) == second
    assert status(daemon, NEW_PASSWORD, ca_file) == 200


def test_a_reload_says_the_listen_address_changes_only_on_restart_and_applies_the_rest(
    tls_daemon: tuple[Daemon, dict, Path], ca_file: str, caplog: pytest.LogCaptureFixture
) -> None:
    daemon, document, path = tls_daemon
    url = daemon.server.url
    document["server"]["listen"] = "127.0.0.1:1"
    document["server"]["basic_auth"]["password"] = NEW_PASSWORD
    path.write_text(yaml.safe_dump(document))
    assert daemon.reload() is True

    [warning] = logged(caplog.records, "config reload: server.listen changes only on restart")
    assert warning.levelno == logging.WARNING
    assert daemon.server.url == url
    assert status(daemon, NEW_PASSWORD, ca_file) == 200
