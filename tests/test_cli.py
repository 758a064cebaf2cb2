"""The command line: run as a real process against the simulator on loopback, and in process where it
starts nothing (`check`, `--help`)."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import platform
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import bcrypt
import pytest
import requests
import trustme
import yaml

from exporter import __version__
from exporter.config.load import MISSING_TOLD
from exporter.core.clock import Clock
from exporter.metrics.runtime import REVISION_ENV
from exporter.sim import DEFAULT_ENDPOINTS, Fault, Simulator, SimulatorServer
from tests.helpers import DripReceiver, Receiver, free_port, named, scrape, value, wait_for

ROOT = Path(__file__).parent.parent
SAMPLE = re.compile(r"^(?P<name>[a-z_]+)\{(?P<labels>[^}]*)\} (?P<value>\S+)$")


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "exporter.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
    )


def invoke(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The command run in process (`main`), for the commands that start no server and no thread: its
    exit status and what it printed, as `run` reports them."""
    from exporter.cli import main

    for name, setting in (env or {}).items():
        monkeypatch.setenv(name, setting)
    monkeypatch.chdir(ROOT)
    root = logging.getLogger()
    # A command sets up logging on the root logger, to this test's captured stderr: put back what was
    # there, or later tests of this worker would log to a stream closed with this one's capture.
    handlers, level, scheduler = list(root.handlers), root.level, logging.getLogger("apscheduler").level
    try:
        code = main(list(args))
    except SystemExit as stopped:
        code = stopped.code if isinstance(stopped.code, int) else 1
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        logging.getLogger("apscheduler").setLevel(scheduler)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out, err)


def write_config(
    tmp_path: Path,
    sim: Simulator,
    server: SimulatorServer,
    log_level: str = "info",
    state: Path | None = None,
    **billing: object,
) -> Path:
    """A config for the simulator, its secret from TEST_BILLING_SECRET; with `state`, a state file there."""
    document = {
        "billing": {
            "url": server.url,
            "access_key_id": sim.access_key_id,
            "secret_access_key": "${TEST_BILLING_SECRET}",
            "page_size": 100,
            "timeout": "5s",
        }
        | billing,
        "prices": [{"model": "model-a", "prompt_per_million": "4", "completion_per_million": "16"}],
        "budgets": [{"name": "monthly", "amount": "20000"}],
        "log": {"level": log_level},
    }
    if state is not None:
        document["state"] = {"path": str(state)}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def samples(exposition: str, name: str) -> list[tuple[dict[str, str], Decimal]]:
    found = []
    for line in exposition.splitlines():
        match = SAMPLE.match(line)
        if match and match["name"] == name:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match["labels"]))
            found.append((labels, Decimal(match["value"])))
    return found


def test_check_accepts_the_example_and_exits_zero(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    env = {"BILLING_ACCESS_KEY_ID": "AK", "BILLING_SECRET_ACCESS_KEY": "s", "INFERENCE_API_KEY": "k"}
    result = invoke(monkeypatch, capsys, "check", "--config", "config.example.yaml", env=env)
    assert result.returncode == 0, result.stderr
    assert "valid" in result.stdout
    assert "; digest daily at 09:00 to hook)" in result.stdout


def test_check_prints_every_error_and_exits_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "billing:\n  url: ftp://x\n  access_key_id: AK\n  secret_access_key: ${UNSET_VAR_XYZ}\n  page_size: 501\n"
    )
    monkeypatch.delenv("UNSET_VAR_XYZ", raising=False)
    result = invoke(monkeypatch, capsys, "check", "--config", str(path))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines == [
        f"{path}: billing.secret_access_key: environment variable UNSET_VAR_XYZ is not set",
        f"{path}: billing.url: must be an http:// or https:// URL",
        f"{path}: billing.page_size: must be ≤ 500",
    ]
    assert "Traceback" not in result.stderr


def test_check_counts_in_words_that_agree_names_the_currency_and_the_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.yaml"
    one_of_each = {
        "billing": {"url": "https://b", "access_key_id": "AK", "secret_access_key": "written-here", "currency": "CNY"},
        "inference": {"url": "https://i/v1", "api_key": "${K}"},
        "probes": [{"name": "p", "model": "ep"}],
        "budgets": [{"name": "monthly", "amount": 100}],
        "alerts": {"rules": [{"alert": "B", "budget": "monthly", "tiers": [1]}],
                   "notifiers": [{"name": "hook", "type": "webhook", "url": "http://r/h"}]},
    }  # fmt: skip
    path.write_text(yaml.safe_dump(one_of_each))
    path.chmod(0o644)
    result = invoke(monkeypatch, capsys, "check", "--config", str(path), env={"K": "k"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == f"{path}: valid (1 probe, 1 budget, 1 rule, 1 notifier; amounts in CNY)"
    assert result.stderr.splitlines() == [
        f"{path}: warning: billing.secret_access_key: a secret is written in the config file; use ${{VAR}} or"
        " ${file:PATH}",
        f"{path}: warning: the file is world-readable and holds secrets (chmod o-r)",
    ]

    several = {
        "accounts": [{"name": name, "billing": one_of_each["billing"] | {"currency": currency}}
                     for name, currency in (("prod", "USD"), ("lab", ""))],
        "budgets": [{"name": "a", "amount": 1}, {"name": "b", "amount": 2}],
    }  # fmt: skip
    path.write_text(yaml.safe_dump(several))
    result = invoke(monkeypatch, capsys, "check", "--config", str(path))
    assert result.stdout.splitlines() == [
        f"{path}: valid (2 accounts, 0 probes, 2 budgets, 0 rules, 0 notifiers)",
        "  account prod: https://b, 0 probes, 0 budgets; amounts in USD",
        "  account lab: https://b, 0 probes, 0 budgets; currency not set (billing.currency)",
    ]


def test_once_prints_amounts_that_sum_to_the_simulators_totals(
    tmp_path: Path, live: tuple[Simulator, SimulatorServer]
) -> None:
    sim, server = live
    sim.add_usage(1234)
    result = run(
        "once",
        "--config",
        str(write_config(tmp_path, sim, server, log_level="debug")),
        env={"TEST_BILLING_SECRET": sim.secret_access_key},
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    period = sim.clock.period()
    truth = sim.bill_totals(period)

    by_endpoint: dict[str, Decimal] = {}
    for labels, amount in samples(out, "inference_bill_endpoint_daily_payable_amount"):
        assert labels["period"] == period
        by_endpoint[labels["endpoint_id"]] = by_endpoint.get(labels["endpoint_id"], Decimal(0)) + amount
    assert by_endpoint == {e.endpoint_id: truth[e.endpoint_id] for e in sim.endpoints}

    by_item: dict[str, Decimal] = {}
    for labels, amount in samples(out, "inference_bill_item_daily_payable_amount"):
        by_item[labels["item"]] = by_item.get(labels["item"], Decimal(0)) + amount
    assert by_item == {item: truth[item] for item in by_item}
    assert sum(by_item.values()) == truth["total"]
    assert samples(out, "inference_bill_month_to_date_payable_amount")[0] == ({"period": period}, truth["total"])

    usage = sim.usage_totals()
    for metric, field in [
        ("inference_usage_requests_total", "requests"),
        ("inference_usage_prompt_tokens_total", "prompt"),
        ("inference_usage_completion_tokens_total", "completion"),
        ("inference_usage_cached_prompt_tokens_total", "cached"),
    ]:
        got = {(lb["endpoint_id"], lb["model"]): int(v) for lb, v in samples(out, metric)}
        assert got == {key: sums[field] for key, sums in usage.items()}, metric

    estimated = {
        (lb["endpoint_id"], lb["model"]): v for lb, v in samples(out, "inference_usage_estimated_payable_amount_total")
    }
    assert set(estimated) == {key for key in usage if key[1] == "model-a"}
    for key, amount in estimated.items():
        expected = (Decimal(usage[key]["prompt"]) * 4 + Decimal(usage[key]["completion"]) * 16) / 1_000_000
        assert abs(amount - expected) < Decimal("1e-9")
    refreshed = [({"source": source}, 1) for source in ("bills", "history", "usage")]
    assert samples(out, "inference_exporter_refresh_success") == refreshed
    assert "component=urllib3" in result.stderr  # debug logging was on, and still no secret in it
    assert sim.secret_access_key not in out + result.stderr


def test_once_with_a_wrong_secret_says_signature_rejected(
    tmp_path: Path, live: tuple[Simulator, SimulatorServer]
) -> None:
    sim, server = live
    result = run(
        "once", "--config", str(write_config(tmp_path, sim, server)), env={"TEST_BILLING_SECRET": "wrong-s3cret-value"}
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert "signature rejected" in result.stderr
    assert "Traceback" not in result.stderr
    assert "wrong-s3cret-value" not in result.stderr


def test_once_when_the_api_is_unreachable_or_refuses(tmp_path: Path, live: tuple[Simulator, SimulatorServer]) -> None:
    sim, server = live
    config = write_config(tmp_path, sim, server)
    sim.inject(Fault("code", times=1))
    refused = run("once", "--config", str(config), env={"TEST_BILLING_SECRET": sim.secret_access_key})
    assert refused.returncode == 2
    assert "API error" in refused.stderr
    assert "service is busy" in refused.stderr
    server.stop()
    unreachable = run("once", "--config", str(config), env={"TEST_BILLING_SECRET": sim.secret_access_key})
    assert unreachable.returncode == 2
    host = server.url.removeprefix("http://")
    assert f"connection to {host} failed: connection refused" in unreachable.stderr
    assert "Traceback" not in unreachable.stderr


def test_run_serves_reloads_on_sighup_and_stops_on_sigterm(
    tmp_path: Path, live: tuple[Simulator, SimulatorServer]
) -> None:
    sim, server = live
    sim.add_usage(100)
    config = write_config(tmp_path, sim, server, state=tmp_path / "state.db")
    process, url = spawn("run", "--config", str(config), env={"TEST_BILLING_SECRET": sim.secret_access_key})
    try:
        wait_for(lambda: ready(url), timeout=30)
        config.write_text("billing: {page_size: 501}\n")
        process.send_signal(signal.SIGHUP)
        wait_for(lambda: value(scrape(url), "inference_exporter_config_last_reload_successful") == 0)
        assert ready(url)
        stops_within_10_s(process)
    finally:
        process.kill()
        _, stderr = process.communicate()
    assert "config reload refused" in stderr
    assert "billing.page_size: must be ≤ 500" in stderr
    assert sim.secret_access_key not in stderr


def test_sigterm_stops_run_within_10_s_while_the_billing_api_drips_its_answer(
    tmp_path: Path, live: tuple[Simulator, SimulatorServer]
) -> None:
    """The billing API sends its headers, then a byte every 0.2 s: every read comes well within the
    30 s timeout. SIGTERM stops the process within the 10 s the docs promise, the requests on the
    wire cut, and it exits 0 (it was once held until a SIGKILL)."""
    sim, server = live
    drip = DripReceiver(interval=0.2)
    config = write_config(tmp_path, sim, server, state=tmp_path / "state.db", url=f"http://127.0.0.1:{drip.port}")
    config.write_text(config.read_text().replace("timeout: 5s", "timeout: 30s"))
    process, url = spawn("run", "--config", str(config), env={"TEST_BILLING_SECRET": sim.secret_access_key})
    try:
        wait_for(lambda: drip.connections >= 2, timeout=30)  # (bills and usage, each on the wire)
        wait_for(lambda: requests.get(f"{url}/healthz", timeout=2).status_code == 200, timeout=30)
        stops_within_10_s(process)
    finally:
        process.kill()
        process.communicate()
        drip.stop()


def stops_within_10_s(process: subprocess.Popen[str]) -> None:
    """SIGTERM stops `run` with exit 0 within the 10 s the docs promise."""
    process.send_signal(signal.SIGTERM)
    started = time.monotonic()
    assert process.wait(timeout=30) == 0
    assert time.monotonic() - started < 10


def spawn(
    *args: str, env: dict[str, str] | None = None, listen: str = "--listen", scheme: str = "http"
) -> tuple[subprocess.Popen[str], str]:
    """Start the command in the background, listening on a free loopback port (given with the flag `listen`);
    returns it and its URL."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "exporter.cli", *args, listen, f"127.0.0.1:{port}"],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    return process, f"{scheme}://127.0.0.1:{port}"


def ready(url: str) -> bool:
    try:
        return requests.get(f"{url}/readyz", timeout=2).status_code == 200
    except requests.ConnectionError:
        return False


@pytest.mark.integration  # runs the demo as a process
def test_demo_serves_metrics_from_the_embedded_simulator() -> None:
    process, url = spawn("demo", listen="--web.listen-address")
    try:
        wait_for(lambda: ready(url), timeout=30)
        series = scrape(url)
        assert sum(v for (name, _), v in series.items() if name == "inference_usage_requests_total") >= 20_000
        assert value(series, "inference_budget_amount", budget="monthly") == 15000

        # yesterday one endpoint spent three times its usual: the demo's anomaly rule fires on it
        def anomalies() -> list[dict[str, dict[str, str]]]:
            alerts = requests.get(f"{url}/api/v1/alerts", timeout=5).json()["data"]["alerts"]
            return [a for a in alerts if a["labels"]["alertname"] == "SpendAnomaly" and a["state"] == "firing"]

        fired = wait_for(anomalies, timeout=30)
        assert [a["labels"]["endpoint_id"] for a in fired] == [DEFAULT_ENDPOINTS[1].endpoint_id]

        # and of its settled days with usage records, one is billed 5% more completion tokens than counted
        def gaps() -> dict[tuple[str, str], float]:
            found = named(scrape(url), "inference_reconciliation_token_gap_ratio")
            return {(dict(labels)["day"], dict(labels)["item"]): v for labels, v in found.items()}

        wait_for(lambda: len({day for day, _ in gaps()}) == 3, timeout=60)
        off = {key: round(v, 4) for key, v in gaps().items() if v != 0}
        middle = (Clock().today() - dt.timedelta(days=4)).isoformat()  # the billing zone's days
        assert off == {(middle, "ITEM_COMPLETION_TOKEN"): 0.05}
        page = requests.get(f"{url}/", timeout=5).text
        assert f"<td>{middle}</td><td>ITEM_COMPLETION_TOKEN</td>" in page
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=15) == 0
    finally:
        process.kill()
        stdout, _ = process.communicate()
    assert f"metrics       {url}/metrics" in stdout


def test_kill_9_and_restart_mid_firing_sends_no_duplicate(
    tmp_path: Path, live: tuple[Simulator, SimulatorServer], receiver: Receiver
) -> None:
    sim, server = live
    config = write_config(tmp_path, sim, server)
    document = yaml.safe_load(config.read_text())
    document["state"] = {"path": str(tmp_path / "state.db")}
    document["alerts"] = {
        "evaluation_interval": "200ms",
        "rules": [{"alert": "AnySpend", "signal": "spend", "by": ["endpoint_id"], "threshold": 0}],
        "notifiers": [{"name": "hook", "type": "webhook", "url": receiver.url}],
    }
    config.write_text(yaml.safe_dump(document))
    env = {"TEST_BILLING_SECRET": sim.secret_access_key}

    def delivered(url: str) -> bool:
        series = scrape(url)
        return value(series, "inference_alert_notifications_pending", notifier="hook") == 0 and bool(
            value(series, "inference_alert_notifications_total", notifier="hook")
        )

    first, url = spawn("run", "--config", str(config), env=env)
    try:
        wait_for(lambda: ready(url) and delivered(url), timeout=30)
    finally:
        first.kill()  # SIGKILL: no clean shutdown
        first.communicate()
    (body,) = receiver.bodies()  # one message for the rule's alerts that fired together
    assert len(body["alerts"]) == len(sim.endpoints)

    second, url = spawn("run", "--config", str(config), env=env)
    try:
        wait_for(lambda: ready(url), timeout=30)
        evaluations = wait_for(lambda: len(firing_alerts(url)) == len(sim.endpoints) and firing_alerts(url))
        assert {a["labels"]["endpoint_id"] for a in evaluations} == {e.endpoint_id for e in sim.endpoints}
        time.sleep(1.0)  # five more evaluation intervals: a duplicate would have been queued and sent by now
    finally:
        second.send_signal(signal.SIGTERM)
        second.communicate(timeout=15)
    assert [body["status"] for body in receiver.bodies()] == ["firing"]


def firing_alerts(url: str) -> list[dict]:
    alerts = requests.get(f"{url}/api/v1/alerts", timeout=5).json()["data"]["alerts"]
    return [a for a in alerts if a["state"] == "firing"]


@pytest.fixture
def busy_cores() -> Iterator[None]:
    """Both cores kept busy by other processes, as on a loaded machine."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield
    for hog in hogs:
        hog.kill()
        hog.wait()


def reloads_then_stops(process: subprocess.Popen[str], url: str, reloads: int) -> None:
    """Each SIGHUP is seen as a reload (its timestamp moves); then SIGTERM stops the process."""
    stamp = "inference_exporter_config_last_reload_success_timestamp_seconds"
    wait_for(lambda: ready(url), timeout=60)
    for _ in range(reloads):
        before = value(scrape(url), stamp)
        process.send_signal(signal.SIGHUP)
        wait_for(lambda: value(scrape(url), stamp) != before, timeout=15)  # noqa: B023 - waited on at once
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=20) == 0


def test_no_signal_is_lost_under_load(
    tmp_path: Path, live: tuple[Simulator, SimulatorServer], busy_cores: None
) -> None:
    sim, server = live
    config = write_config(tmp_path, sim, server, state=tmp_path / "state.db")
    for reloads in (10, 2, 2):
        process, url = spawn("run", "--config", str(config), env={"TEST_BILLING_SECRET": sim.secret_access_key})
        try:
            reloads_then_stops(process, url, reloads)
        except Exception as error:  # what the process said tells which side failed
            process.kill()
            _, stderr = process.communicate()
            raise AssertionError(f"exit status {process.returncode}; its log ends:\n{stderr[-6000:]}") from error
        finally:
            process.kill()
            process.communicate()


def check_command(tmp_path: Path, unbuffered: str) -> tuple[list[str], dict[str, str]]:
    """`check` of a valid config, and its environment: its output buffered, or not (`PYTHONUNBUFFERED`,
    as images set it)."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"billing": {"url": "http://127.0.0.1:1", "access_key_id": "a",
                                                  "secret_access_key": "${TEST_SECRET}"}}))  # fmt: skip
    env = {name: v for name, v in os.environ.items() if name != "PYTHONUNBUFFERED"} | {"TEST_SECRET": "s"}
    return [sys.executable, "-m", "exporter.cli", "check", "--config", str(config)], env | (
        {"PYTHONUNBUFFERED": "1"} if unbuffered else {}
    )


@pytest.mark.parametrize("unbuffered", ["1", ""])
def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path: Path, unbuffered: str) -> None:
    """`check | head -1`: the reader gone before the output is written, no traceback."""
    command, env = check_command(tmp_path, unbuffered)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    assert process.stdout is not None
    process.stdout.close()  # (before anything is written: the write fails, whatever the timing)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 141  # (as SIGPIPE ends other tools; not 1, a bad config's)
    assert stderr == ""


def test_yaml_aliases_that_expand_a_hundred_million_fold_cost_what_the_file_holds(tmp_path: Path) -> None:
    """Ten aliases of ten aliases, eight deep (a config pasted together, or a ConfigMap reload): each
    value is done once, as YAML shares it, not 10^8 times; under a memory limit that a copy of every
    value would break long before the subprocess timeout."""
    lines = [
        'billing: {url: "http://127.0.0.1:1", access_key_id: AK, secret_access_key: s}',
        "a: &a [" + ", ".join(["x"] * 10) + "]",
    ]
    for before, name in zip("abcdefg", "bcdefgh", strict=True):
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{before}"] * 10) + "]")
    config = tmp_path / "aliases.yaml"
    config.write_text("\n".join(lines) + "\n")

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    def checked() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "exporter.cli", "check", "--config", str(config)], capture_output=True, text=True,
            cwd=ROOT, timeout=120, preexec_fn=limited,
        )  # fmt: skip

    result = checked()
    assert result.returncode == 1
    assert result.stderr.splitlines() == [f"{config}: {name}: unknown key" for name in "abcdefgh"]
    # Each of its values a variable not set, and the aliases wrapped in lists of their own, 3,000 of
    # them: the places written in the file are told, and at most MISSING_TOLD of those aliases repeat.
    lines = ['billing: {url: "http://127.0.0.1:1", access_key_id: AK, secret_access_key: s}',
             "a: &a [" + ", ".join(['"${NOPE}"'] * 10) + "]", "b: &b [" + ", ".join(["*a"] * 10) + "]",
             "c: &c [" + ", ".join(["*b"] * 10) + "]", "d: [" + ", ".join(["[*c]"] * 3000) + "]"]  # fmt: skip
    config.write_text("\n".join(lines) + "\n")
    result = checked()
    assert result.returncode == 1
    told = result.stderr.splitlines()
    assert [f"{config}: a[{n}]: environment variable NOPE is not set" for n in range(10)] == told[:10]
    unknown = [f"{config}: {name}: unknown key" for name in "abcd"]
    assert [line for line in told if line in unknown] == unknown
    assert 10 + len(unknown) < len(told) <= 10 + len(unknown) + MISSING_TOLD
    # And a merge (`<<`) of a mapping of such values into 3,000 mappings: its copies are repeats too.
    values = ", ".join(f'k{n}: "${{NOPE}}"' for n in range(100))
    lines[1:] = [f"m: &m {{{values}}}", "x: [" + ", ".join(["{<<: *m}"] * 3000) + "]"]
    config.write_text("\n".join(lines) + "\n")
    result = checked()
    told = result.stderr.splitlines()
    assert (result.returncode, told[:2]) == (1, [f"{config}: m.k0: environment variable NOPE is not set",
                                               f"{config}: m.k1: environment variable NOPE is not set"])  # fmt: skip
    assert 100 < len(told) <= 100 + 2 + MISSING_TOLD
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["check", "rules"])
def test_a_command_started_without_a_standard_output_writes_nowhere(tmp_path: Path, command: str) -> None:
    """`rules --config c.yaml >&-`: no traceback, the command's own status."""
    check, env = check_command(tmp_path, "")
    result = subprocess.run(
        [*check[:3], command, *check[4:]], stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env, timeout=60,
        preexec_fn=lambda: os.close(1),
    )  # fmt: skip
    assert (result.returncode, result.stderr) == (0, "")


@pytest.mark.parametrize("command", ["check", "rules"])
def test_a_command_started_without_a_standard_error_says_all_and_succeeds(tmp_path: Path, command: str) -> None:
    """`check --config c.yaml 2>&-`: its whole output, and the exit status of a valid config (the
    program ends without the interpreter's teardown once its streams, those it has, are flushed)."""
    check, env = check_command(tmp_path, "")
    result = subprocess.run(
        [*check[:3], command, *check[4:]], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env, timeout=60,
        preexec_fn=lambda: os.close(2),
    )  # fmt: skip
    written = subprocess.run(
        [*check[:3], command, *check[4:]], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60
    )
    assert (result.returncode, written.returncode) == (0, 0)
    assert result.stdout == written.stdout != ""


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")
@pytest.mark.parametrize("unbuffered", ["1", ""])
def test_an_output_that_cannot_be_written_is_one_line(tmp_path: Path, unbuffered: str) -> None:
    """`once > metrics.prom` on a full disk: one line, and not the exit status of a bad config."""
    command, env = check_command(tmp_path, unbuffered)
    with Path("/dev/full").open("w") as full:
        result = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env, timeout=60)
    assert result.returncode == 2
    assert result.stderr == "inference-cost-exporter: check: cannot write its output: No space left on device\n"


@pytest.mark.parametrize("address", ["foo", "127.0.0.1:99999", "::1:9877"])
def test_a_bad_listen_address_is_one_line(
    tmp_path: Path, live: tuple[Simulator, SimulatorServer], address: str
) -> None:
    sim, server = live
    config = write_config(tmp_path, sim, server)
    result = run("run", "--config", str(config), "--listen", address, env={"TEST_BILLING_SECRET": "x"})
    assert result.returncode == 1
    assert result.stderr == (
        f"inference-cost-exporter: listen address {address!r} is not HOST:PORT (for example :9877, "
        "127.0.0.1:9877 or [::1]:9877; the port 0 to 65535)\n"
    )


def test_check_names_a_state_path_that_cannot_be_created(
    tmp_path: Path, live: tuple[Simulator, SimulatorServer]
) -> None:
    sim, server = live
    config = write_config(tmp_path, sim, server)
    document = yaml.safe_load(config.read_text())
    (tmp_path / "a-file").write_text("")
    document["state"] = {"path": str(tmp_path / "a-file" / "state.db")}
    config.write_text(yaml.safe_dump(document))
    result = run("check", env={"TEST_BILLING_SECRET": "x", "INFERENCE_COST_EXPORTER_CONFIG": str(config)})
    assert result.returncode == 0  # the file is valid; where it runs, the state directory may well exist
    assert "warning: state.path: on this machine no state file can be kept at " in result.stderr
    assert str(tmp_path / "a-file" / "state.db") in result.stderr
    assert f"{tmp_path / 'a-file'} is not a directory" in result.stderr


def test_the_config_variable_set_empty_is_not_set() -> None:
    result = run("check", env={"INFERENCE_COST_EXPORTER_CONFIG": ""})
    assert result.returncode == 2
    assert "the following arguments are required: --config" in result.stderr


def test_once_says_so_when_the_inference_api_refuses_the_key(
    tmp_path: Path, live: tuple[Simulator, SimulatorServer]
) -> None:
    sim, server = live
    config = write_config(tmp_path, sim, server)
    document = yaml.safe_load(config.read_text())
    document["inference"] = {"url": server.url, "api_key": "${TEST_INFERENCE_KEY}"}
    document["probes"] = [{"name": "chat", "model": sim.endpoints[0].endpoint_id}]
    config.write_text(yaml.safe_dump(document))
    env = {"TEST_BILLING_SECRET": sim.secret_access_key, "TEST_INFERENCE_KEY": "wrong-inference-key"}
    result = run("once", "--config", str(config), env=env)
    assert result.returncode == 2
    assert "probe chat: the inference API refused the key (HTTP 401); check inference.api_key" in result.stderr
    assert "wrong-inference-key" not in result.stderr + result.stdout
    good = run("once", "--config", str(config), env=env | {"TEST_INFERENCE_KEY": sim.api_key})
    assert good.returncode == 0, good.stderr


def test_once_takes_the_inference_url_with_or_without_v1_and_names_a_wrong_one(
    tmp_path: Path, live: tuple[Simulator, SimulatorServer]
) -> None:
    sim, server = live
    config = write_config(tmp_path, sim, server)
    document = yaml.safe_load(config.read_text())
    document["probes"] = [{"name": "chat", "model": sim.endpoints[0].endpoint_id}]
    env = {"TEST_BILLING_SECRET": sim.secret_access_key, "TEST_INFERENCE_KEY": sim.api_key}
    for url, code in ((f"{server.url}/v1", 0), (f"{server.url}/v1/", 0), (server.url, 0), (f"{server.url}/api", 2)):
        document["inference"] = {"url": url, "api_key": "${TEST_INFERENCE_KEY}"}
        config.write_text(yaml.safe_dump(document))
        result = run("once", "--config", str(config), env=env)
        assert result.returncode == code, (url, result.stderr)
        if code:  # every probe failed to find the API: the line says where it asked
            assert f"(POST {server.url}/api/v1/chat/completions)" in result.stderr
            assert "check inference.url" in result.stderr
            assert [line for line in result.stderr.splitlines() if line.startswith("inference-cost-exporter:")] == [
                result.stderr.strip().splitlines()[-1]
            ]  # one line saying why, last
            assert sim.api_key not in result.stderr


def test_ctrl_c_names_the_command_it_stopped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """(As it stops `backfill` over the wire: test_backfill.py.) `export focus` is two words;
    `backtest --format json` is `backtest`."""
    from exporter.cli import commands

    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    for name, args, said in (
        ("cmd_export_focus", ["export", "focus", "--from", "2026-01", "--output", "x"], "export focus"),
        ("cmd_backtest", ["backtest", "--from", "2026-01", "--format", "json"], "backtest"),
    ):
        monkeypatch.setattr(commands, name, interrupted)
        result = invoke(monkeypatch, capsys, *args, "--config", "c.yaml")
        assert (result.returncode, result.stderr) == (130, f"inference-cost-exporter: {said}: interrupted\n")


def test_a_command_run_in_process_puts_the_signal_handlers_of_before_back(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`main` run by another program (the tests): its SIGTERM and Ctrl-C handlers last as long as
    the command, however it ends (its result, a bad config's SystemExit, a signal that stopped it),
    not for the rest of the process (the program's `entry` keeps ignoring them after a stop, as it
    exits: test_backfill's Ctrl-C pressed again)."""
    from exporter.cli import config_commands

    def checked(args: object) -> int:
        assert signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM]  # (its own, while it runs)
        return 0

    def stopped(args: object) -> int:
        signal.raise_signal(signal.SIGTERM)
        return 0

    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    for command, status in ((checked, 0), (stopped, 143)):
        monkeypatch.setattr(config_commands, "cmd_check", command)
        assert invoke(monkeypatch, capsys, "check", "--config", "c.yaml").returncode == status
        assert {signum: signal.getsignal(signum) for signum in before} == before
    assert invoke(monkeypatch, capsys, "once", "--config", "missing.yaml").returncode == 1  # (SystemExit)
    assert {signum: signal.getsignal(signum) for signum in before} == before


@pytest.mark.parametrize(
    ("flag", "value", "problem"),
    [("--records", "-5", "must be a whole number, 0 or more"), ("--records", "many", "not a whole number: 'many'"),
     ("--latency", "-1", "must be a number of seconds, 0 or more"),
     ("--ttft", "nan", "must be a number of seconds, 0 or more"),
     ("--chunk-delay", "soon", "not a number of seconds: 'soon'")],
)  # fmt: skip
def test_the_simulator_s_pace_is_refused_when_it_is_no_pace(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], flag: str, value: str, problem: str
) -> None:
    result = invoke(monkeypatch, capsys, "simulate", flag, value)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"inference-cost-exporter simulate: error: argument {flag}: {problem}"
    )


@pytest.mark.parametrize("command", ["check", "once", "run", "rules", "demo", "simulate"])
def test_every_command_explains_itself(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    result = invoke(monkeypatch, capsys, command, "--help")
    assert result.returncode == 0
    _, description, *_ = result.stdout.split("\n\n")
    assert len(description.split()) > 8  # a sentence, not just the usage line
    if command in ("check", "once", "run", "rules"):
        assert "INFERENCE_COST_EXPORTER_CONFIG" in result.stdout
    assert "(default:" in result.stdout or command in ("check", "once", "run", "rules")


@pytest.mark.parametrize("command", ["run", "demo"])
def test_web_listen_address_and_listen_are_one_option(command: str) -> None:
    from exporter.cli import build_parser

    config = ["--config", "config.yaml"] if command == "run" else []
    for flag in ("--web.listen-address", "--listen"):
        args = build_parser().parse_args([command, *config, flag, "127.0.0.1:1234"])
        assert args.listen == "127.0.0.1:1234"


@pytest.mark.parametrize(
    "command", ["check", "once", "run", "digest", "rules", "backtest", "backfill", "demo", "simulate"]
)
def test_help_gives_no_default_an_option_does_not_have(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("INFERENCE_COST_EXPORTER_CONFIG", raising=False)
    text = " ".join(invoke(monkeypatch, capsys, command, "--help").stdout.split())  # (unwrapped)
    for nothing in ("(default: None)", "(default: False)", "(default: [])"):
        assert nothing not in text
    if command == "demo":
        assert "where the exporter listens (default: 127.0.0.1:9877)" in text
        assert "debug, info, warn or error (default: info)" in text


def write_web_config(path: Path, password: str, **more: object) -> Path:
    """A web configuration file: HTTPS with cert.pem and key.pem beside it, and the user `prometheus`."""
    users = {"prometheus": bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode()}
    document = {"tls_server_config": {"cert_file": "cert.pem", "key_file": "key.pem"}, "basic_auth_users": users}
    path.write_text(yaml.safe_dump(document | more))
    return path


@pytest.mark.integration  # the daemon as a process, over HTTPS
def test_run_takes_the_prometheus_exporters_flags(
    tmp_path: Path, live: tuple[Simulator, SimulatorServer], ca: trustme.CA, ca_file: str
) -> None:
    sim, server = live
    config = write_config(tmp_path, sim, server, state=tmp_path / "state.db")  # logs at info, as logfmt
    leaf = ca.issue_cert("127.0.0.1")
    leaf.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    leaf.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    web = write_web_config(tmp_path / "web.yml", "first-pass")
    env = {"TEST_BILLING_SECRET": sim.secret_access_key, REVISION_ENV: "0a1b2c3"}
    process, url = spawn(
        "run", "--config", str(config), "--web.config.file", str(web), "--log.level", "debug", "--log.format", "json",
        env=env, listen="--web.listen-address", scheme="https",
    )  # fmt: skip

    def status(password: str) -> int:
        try:
            return requests.get(f"{url}/metrics", auth=("prometheus", password), verify=ca_file, timeout=5).status_code
        except requests.ConnectionError:
            return 0

    try:
        wait_for(lambda: status("first-pass") == 200, timeout=30)
        assert status("wrong") == 401
        series = scrape(url, auth=("prometheus", "first-pass"), verify=ca_file)
        build = {"version": __version__, "revision": "0a1b2c3", "python_version": platform.python_version()}
        assert value(series, "inference_exporter_build_info", **build) == 1
        [started] = named(series, "process_start_time_seconds").values()
        assert time.time() - 60 < started <= time.time()  # this process's, started just now
        [python] = named(series, "python_info")
        assert dict(python)["version"] == platform.python_version()

        write_web_config(web, "second-pass")
        process.send_signal(signal.SIGHUP)  # the web configuration file is read again with the config
        wait_for(lambda: status("second-pass") == 200, timeout=15)
        assert status("first-pass") == 401
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
    finally:
        process.kill()
        _, stderr = process.communicate()
    lines = [json.loads(line) for line in stderr.splitlines()]  # JSON, though the config says text
    assert any(line["level"] == "debug" for line in lines)  # and debug, though it says info
    assert any(line["msg"] == "listening" and line["url"] == url for line in lines)


def test_a_bad_web_config_file_is_refused_naming_the_file_and_the_field(
    tmp_path: Path, live: tuple[Simulator, SimulatorServer]
) -> None:
    sim, server = live
    config = write_config(tmp_path, sim, server, state=tmp_path / "state.db")
    web = tmp_path / "web.yml"
    web.write_text("basic_auth_users:\n  prometheus: hunter2\ntls_server_config:\n  min_version: TLS9\n")
    env = {"TEST_BILLING_SECRET": sim.secret_access_key}
    result = run("run", "--config", str(config), "--web.config.file", str(web), "--listen", "127.0.0.1:0", env=env)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"{web}: tls_server_config.min_version: unknown TLS version 'TLS9' (one of TLS12, TLS13)",
        f"{web}: basic_auth_users.prometheus: not a bcrypt hash ($2a$, $2b$ or $2y$); make one with "
        "`htpasswd -nBC 10 \"\" | tr -d ':\\n'`",
    ]

    document = yaml.safe_load(config.read_text()) | {
        "server": {"basic_auth": {"username": "prometheus", "password": "${TEST_SCRAPE_PASSWORD}"}}
    }
    config.write_text(yaml.safe_dump(document))
    write_web_config(web, "pass")
    result = run(
        "run", "--config", str(config), "--web.config.file", str(web), "--listen", "127.0.0.1:0",
        env=env | {"TEST_SCRAPE_PASSWORD": "pass"},
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"{web}: the config's server.basic_auth would secure the server too; use this file or those keys, not both"
    ]


@pytest.mark.parametrize("command", ["simulate", "demo"])
def test_a_port_in_use_is_one_line_and_exit_1(command: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        result = run(command, "--listen", address)
    assert result.returncode == 1
    assert (
        result.stderr.strip().splitlines()[-1]
        == f"inference-cost-exporter: cannot listen on {address}: Address already in use"
    )
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("command", "needed"), [("check", []), ("export focus", ["--from", "2026-10", "--output", "x.csv"])]
)
def test_an_unknown_argument_after_a_command_gets_that_command_s_usage(command: str, needed: list[str]) -> None:
    result = run(*command.split(), "--bogus", "--config", str(ROOT / "config.example.yaml"), *needed)
    assert result.returncode == 2
    assert result.stderr.startswith(f"usage: inference-cost-exporter {command} ")
    assert result.stderr.endswith(f"inference-cost-exporter {command}: error: unrecognized arguments: --bogus\n")
