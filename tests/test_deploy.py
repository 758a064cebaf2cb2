"""What users deploy: the container, the example Prometheus, Alertmanager and compose files (Kubernetes:
test_kubernetes.py)."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from exporter.alerts.promrules import rule_file
from exporter.config.load import REFERENCE, load
from exporter.config.schema import NotifierConfig, ServerConfig
from tests.conftest import require_binary

ROOT = Path(__file__).parent.parent
EXAMPLES = ROOT / "examples"
ENV = {"BILLING_ACCESS_KEY_ID": "AK", "BILLING_SECRET_ACCESS_KEY": "s", "INFERENCE_API_KEY": "k"}


@pytest.mark.integration  # hadolint
def test_dockerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    result = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_container_runs_the_console_script_as_a_non_root_user() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["inference-cost-exporter"] == "exporter.cli:entry"
    entrypoint = next(line for line in dockerfile.splitlines() if line.startswith("ENTRYPOINT"))
    assert json.loads(entrypoint.removeprefix("ENTRYPOINT ")) == ["inference-cost-exporter", "run"]
    assert "USER 10001" in dockerfile
    assert "EXPOSE 9877" in dockerfile
    assert "HEALTHCHECK" in dockerfile
    assert "/healthz" in dockerfile


@pytest.mark.integration  # promtool
def test_example_prometheus_config_and_rules_pass_promtool() -> None:
    promtool = require_binary("promtool")
    for args in (["check", "config", "prometheus.yml"], ["check", "rules", "alert-rules.yml"]):
        result = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60, cwd=EXAMPLES)
        assert result.returncode == 0, result.stdout + result.stderr


def test_example_rules_are_what_the_rules_command_writes_for_the_example_config() -> None:
    config = load(ROOT / "config.example.yaml", ENV)
    text, skipped = rule_file(config.alerts, config.budgets)
    judged_here = ["alerts.rules[2] (SpendAnomaly)", "alerts.rules[3] (BillDisagreesWithUsage)"]
    assert [note.split(":")[0] for note in skipped] == judged_here  # only the exporter can judge these
    assert (EXAMPLES / "alert-rules.yml").read_text() == text


@pytest.mark.integration  # amtool
def test_example_alertmanager_config_passes_amtool() -> None:
    amtool = require_binary("amtool")
    result = subprocess.run(
        [amtool, "check-config", str(EXAMPLES / "alertmanager.yml")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_mounts_and_builds_what_exists() -> None:
    compose = yaml.safe_load((EXAMPLES / "docker-compose.yml").read_text())
    assert set(compose["services"]) == {"inference-cost-exporter", "prometheus", "alertmanager", "grafana"}
    named = set(compose.get("volumes") or {})
    for name, service in compose["services"].items():
        if "build" in service:
            assert (EXAMPLES / service["build"] / "Dockerfile").is_file(), name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (EXAMPLES / source).exists(), f"{name}: {source}"
            else:
                assert source in named, f"{name}: {source} is neither a file nor a volume the compose file defines"
        assert set(service.get("depends_on", [])) <= set(compose["services"]), name


def _mounted(service: dict, target: str) -> Path:
    """The host file a compose service mounts at `target` (paths relative to the compose file)."""
    for volume in service.get("volumes", []):
        source, mount = volume.split(":")[:2]
        if mount == target:
            return (EXAMPLES / source).resolve()
    raise AssertionError(f"nothing is mounted at {target}")


def test_compose_delivers_each_alert_to_alertmanager_exactly_once() -> None:
    """The exporter's `alertmanager` notifier, or Prometheus evaluating alert-rules.yml: one of them, never both."""
    services = yaml.safe_load((EXAMPLES / "docker-compose.yml").read_text())["services"]
    alertmanager = f"alertmanager:{services['alertmanager']['ports'][0].split(':')[-1]}"
    config = load(_mounted(services["inference-cost-exporter"], "/etc/inference-cost-exporter/config.yaml"), ENV)
    exporter_delivers = any(
        urlsplit(str(url)).netloc == alertmanager
        for notifier in config.alerts.notifiers
        if notifier.type == "alertmanager"
        for url in notifier.urls
    )
    prometheus = yaml.safe_load(_mounted(services["prometheus"], "/etc/prometheus/prometheus.yml").read_text())
    targets = [
        target
        for manager in (prometheus.get("alerting") or {}).get("alertmanagers", [])
        for static in manager.get("static_configs", [])
        for target in static["targets"]
    ]
    prometheus_delivers = bool(prometheus.get("rule_files")) and alertmanager in targets
    assert exporter_delivers + prometheus_delivers == 1, (exporter_delivers, prometheus_delivers)
    # The path this setup takes: the exporter evaluates (fresh data, and rules only it can compute) and
    # delivers; Prometheus scrapes only, and is not even given the rule file.
    assert exporter_delivers
    assert config.alerts.rules
    # The rules alert-rules.yml holds for Prometheus are the exporter's, should Prometheus evaluate instead.
    assert rule_file(config.alerts, config.all_budgets)[0] == (EXAMPLES / "alert-rules.yml").read_text()
    assert "rule_files" not in prometheus
    assert "alerting" not in prometheus
    assert not any("alert-rules" in volume for volume in services["prometheus"].get("volumes", []))


def config_variables(text: str) -> set[str]:
    """The environment variables a config references as ${VAR}, in its values (not in its comments)."""

    def strings(node: object) -> list[str]:
        if isinstance(node, dict):
            return [s for value in node.values() for s in strings(value)]
        if isinstance(node, list):
            return [s for value in node for s in strings(value)]
        return [node] if isinstance(node, str) else []

    return {name for value in strings(yaml.safe_load(text)) for _, name in REFERENCE.findall(value) if name}


def notifier_destinations(notifier: NotifierConfig) -> list[tuple[str, int]]:
    """The hosts and ports a notifier sends to."""
    match notifier.type:
        case "alertmanager":
            urls = [str(url) for url in notifier.urls]
        case "webhook" | "pagerduty":
            urls = [str(notifier.url)]
        case "slack":
            urls = [notifier.url.get_secret_value()]
        case "email":
            return [(notifier.host, notifier.port)]
        case _:
            raise AssertionError(f"notifier {notifier.name}: say where a {notifier.type} notifier sends")
    return [url_destination(url) for url in urls]


def url_destination(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname, url
    return parts.hostname, parts.port or {"http": 80, "https": 443}[parts.scheme]


def _listens_on(service: dict) -> set[int]:
    """The ports a compose service's container listens on, as its `ports` and `expose` say."""
    ports = [str(port).split(":")[-1] for port in service.get("ports", [])] + [
        str(p) for p in service.get("expose", [])
    ]
    return {int(port.split("/")[0]) for port in ports}


def test_compose_delivers_the_exporters_alerts_to_services_it_runs() -> None:
    """Every notifier of the mounted config (the digest's too) sends to a service of the compose file, on
    a port it listens on; the services Prometheus and Grafana name are there too."""
    services = yaml.safe_load((EXAMPLES / "docker-compose.yml").read_text())["services"]
    exporter = services["inference-cost-exporter"]
    mounted = _mounted(exporter, "/etc/inference-cost-exporter/config.yaml")
    passed = {variable.split("=")[0] for variable in exporter.get("environment", [])}
    referenced = config_variables(mounted.read_text())
    assert referenced <= passed, "a ${VAR} the config reads that the compose file does not pass on"
    config = load(mounted, dict.fromkeys(referenced, "placeholder"))
    assert config.alerts.notifiers
    for notifier in config.alerts.notifiers:
        for host, port in notifier_destinations(notifier):
            assert host in services, f"notifier {notifier.name}: no service {host!r}"
            assert port in _listens_on(services[host]), f"notifier {notifier.name}: {host} does not listen on {port}"
    prometheus = yaml.safe_load(_mounted(services["prometheus"], "/etc/prometheus/prometheus.yml").read_text())
    targets = [t for job in prometheus["scrape_configs"] for static in job["static_configs"] for t in static["targets"]]
    datasources = ROOT / "grafana" / "provisioning" / "datasources"
    urls = [d["url"] for path in datasources.glob("*.yaml") for d in yaml.safe_load(path.read_text())["datasources"]]
    for host, port in [url_destination(f"http://{target}") for target in targets] + [url_destination(u) for u in urls]:
        assert host in services, host
        assert port in _listens_on(services[host]), f"{host}:{port}"


@pytest.mark.integration  # promtool
def test_the_commented_prometheus_evaluates_alternative_is_a_valid_config(tmp_path: Path) -> None:
    """prometheus.yml says: uncomment rule_files and alerting to evaluate in Prometheus instead. That must work."""
    promtool = require_binary("promtool")
    lines = (EXAMPLES / "prometheus.yml").read_text().splitlines()
    start = lines.index("# rule_files:")
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("#"))
    uncommented = [line.removeprefix("#").removeprefix(" ") for line in lines[start:end]]
    (tmp_path / "prometheus.yml").write_text("\n".join(lines[:start] + uncommented + lines[end:]) + "\n")
    shutil.copy(EXAMPLES / "alert-rules.yml", tmp_path)
    prometheus = yaml.safe_load((tmp_path / "prometheus.yml").read_text())
    assert prometheus["rule_files"] == ["alert-rules.yml"]
    assert prometheus["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["alertmanager:9093"]
    result = subprocess.run(
        [promtool, "check", "config", "prometheus.yml"], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rule files found" in result.stdout


def _healthcheck() -> tuple[list[str], str]:
    """The Dockerfile's HEALTHCHECK command, as Docker runs it, and the HEALTHCHECK_URL default the image sets."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    instruction = next(line for line in text.splitlines() if line.startswith("HEALTHCHECK "))
    command = instruction.split(" CMD ", 1)[1].strip()
    default = next(line for line in text.splitlines() if line.startswith("ENV HEALTHCHECK_URL="))
    default = default.removeprefix("ENV HEALTHCHECK_URL=")
    if command.startswith("["):
        return json.loads(command), default  # exec form: Docker runs it without a shell
    return ["/bin/sh", "-c", command], default  # shell form: Docker runs it with /bin/sh -c


def run_healthcheck(url: str) -> subprocess.CompletedProcess[str]:
    """Run the HEALTHCHECK command line itself (no Docker here), `python` being this interpreter."""
    command, _ = _healthcheck()
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    environment = {"PATH": path, "HEALTHCHECK_URL": url}
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=15)


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        status = {"/healthz": 200, "/sick": 503}.get(self.path, 404)
        self.send_response(status)
        self.send_header("Content-Length", "3")
        self.end_headers()
        self.wfile.write(b"ok\n")

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the http.server signature
        pass


@contextmanager
def health_server(context: ssl.SSLContext | None = None) -> Iterator[str]:
    """A tiny server on a random loopback port answering /healthz 200 and /sick 503; yields its base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    if context is not None:
        server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"{'https' if context else 'http'}://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_healthcheck_default_is_the_exporters_default_listen_port() -> None:
    command, default = _healthcheck()
    port = ServerConfig().listen.rsplit(":", 1)[1]
    assert default == f"http://127.0.0.1:{port}/healthz"
    assert f"EXPOSE {port}" in (ROOT / "Dockerfile").read_text()
    assert "HEALTHCHECK_URL" in " ".join(command)
    assert default in " ".join(command), "the fallback in the command and the image's ENV must agree"


@pytest.mark.integration  # a server on loopback and the HEALTHCHECK command as a process
def test_the_healthcheck_follows_healthcheck_url() -> None:
    with health_server() as base:
        healthy = run_healthcheck(f"{base}/healthz")
        assert healthy.returncode == 0, healthy.stderr
        sick = run_healthcheck(f"{base}/sick")
        assert sick.returncode != 0
        assert "503" in sick.stderr
    with socket.socket() as probe:  # a port nothing listens on: bound, then closed
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    refused = run_healthcheck(f"http://127.0.0.1:{closed}/healthz")
    assert refused.returncode != 0
    assert "refused" in refused.stderr.lower()


@pytest.fixture
def self_signed(tmp_path: Path) -> ssl.SSLContext:
    """A server context with a self-signed certificate for a name that is not 127.0.0.1: no client could verify it."""
    openssl = require_binary("openssl")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=exporter.internal",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context


@pytest.mark.integration  # openssl, a server on loopback and the HEALTHCHECK command
def test_the_healthcheck_accepts_a_self_signed_certificate_over_https(self_signed: ssl.SSLContext) -> None:
    with health_server(self_signed) as base:
        healthy = run_healthcheck(f"{base}/healthz")
        assert healthy.returncode == 0, healthy.stderr
        assert run_healthcheck(f"{base}/sick").returncode != 0


@pytest.mark.integration  # pip wheel
def test_the_wheel_holds_every_module(tmp_path: Path) -> None:
    """What the container installs: a wheel built from the project, with every subpackage in it."""
    import zipfile

    # Built from what the Dockerfile copies, copied here: pip builds in the source tree (build/,
    # *.egg-info), which runs at the same time (pytest-xdist workers, another run) must not share.
    project = tmp_path / "project"
    shutil.copytree(ROOT / "exporter", project / "exporter", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, project / name)
    wheels = tmp_path / "wheels"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(wheels), str(project)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (wheel,) = wheels.glob("inference_cost_exporter-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {str(p.relative_to(ROOT)) for pattern in ("*.py", "*.yaml") for p in (ROOT / "exporter").rglob(pattern)}
    assert sources <= names, sorted(sources - names)


def test_the_build_context_is_what_the_dockerfile_copies_and_nothing_else() -> None:
    """.dockerignore lets through exactly the Dockerfile's sources: a credentials file or a state
    database of the checkout never travels to the builder."""
    copied = set()
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            copied |= set(line.split()[1:-1])
    ignore = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert ignore[0] == "*"
    assert {line.removeprefix("!") for line in ignore if line.startswith("!")} == copied
