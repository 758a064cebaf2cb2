"""What users deploy: the container, the example Prometheus/Alertmanager/Kubernetes/compose files."""

from __future__ import annotations

import base64
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
from exporter.config.load import load, validate
from exporter.config.schema import ServerConfig
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
    assert scripts["inference-cost-exporter"] == "exporter.cli:main"
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


def test_kubernetes_example_has_a_named_metrics_port_and_a_valid_config() -> None:
    documents = list(yaml.safe_load_all((EXAMPLES / "kubernetes.yaml").read_text()))
    kinds = {d["kind"]: d for d in documents}
    config = yaml.safe_load(kinds["ConfigMap"]["data"]["config.yaml"])
    validate(config, ENV)
    container = kinds["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["ports"] == [{"name": "metrics", "containerPort": 9877}]
    assert kinds["Service"]["spec"]["ports"][0]["name"] == "metrics"
    assert kinds["ServiceMonitor"]["spec"]["endpoints"][0]["port"] == "metrics"


def test_kubernetes_secret_references_resolve_to_a_secret_in_the_same_file() -> None:
    documents = list(yaml.safe_load_all((EXAMPLES / "kubernetes.yaml").read_text()))
    secrets = {
        d["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in d.get("data", {}).items()}
        | d.get("stringData", {})
        for d in documents
        if d["kind"] == "Secret"
    }
    assert secrets, "the Deployment reads its credentials from a Secret, so the file must define one"
    (deployment,) = (d for d in documents if d["kind"] == "Deployment")
    environment: dict[str, str] = {}
    references = 0
    for container in deployment["spec"]["template"]["spec"]["containers"]:
        for variable in container.get("env", []):
            reference = variable.get("valueFrom", {}).get("secretKeyRef")
            if reference is None:
                environment[variable["name"]] = variable.get("value", "")
                continue
            references += 1
            assert reference["name"] in secrets, f"{variable['name']}: no Secret named {reference['name']!r}"
            assert reference["key"] in secrets[reference["name"]], f"{variable['name']}: no key {reference['key']!r}"
            environment[variable["name"]] = secrets[reference["name"]][reference["key"]]
        for source in container.get("envFrom", []):
            if "secretRef" in source:
                references += 1
                assert source["secretRef"]["name"] in secrets, source
                environment |= secrets[source["secretRef"]["name"]]
    assert references > 0
    # Every ${VAR} the ConfigMap's config reads comes from the pod's environment (validate fails on a missing one).
    (config_map,) = (d for d in documents if d["kind"] == "ConfigMap")
    validate(yaml.safe_load(config_map["data"]["config.yaml"]), environment)
    # The values in the file are placeholders, and say so.
    for secret in secrets.values():
        for key, value in secret.items():
            assert value.startswith("REPLACE-ME"), f"{key}: a real-looking value in an example Secret"


def test_kubernetes_state_on_a_read_write_once_volume_means_one_pod_and_recreate() -> None:
    documents = list(yaml.safe_load_all((EXAMPLES / "kubernetes.yaml").read_text()))
    claims = {d["metadata"]["name"]: d for d in documents if d["kind"] == "PersistentVolumeClaim"}
    (deployment,) = (d for d in documents if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    single_writer = {
        volume["name"]
        for volume in pod.get("volumes", [])
        if "persistentVolumeClaim" in volume
        and {"ReadWriteOnce", "ReadWriteOncePod"}
        & set(claims[volume["persistentVolumeClaim"]["claimName"]]["spec"]["accessModes"])
    }
    mounts = {m["mountPath"]: m["name"] for c in pod["containers"] for m in c.get("volumeMounts", [])}
    assert single_writer & set(mounts.values()), "the example keeps its state on a ReadWriteOnce volume"
    # ... and the state file (which one exporter locks exclusively) is on that volume.
    (config_map,) = (d for d in documents if d["kind"] == "ConfigMap")
    state_path = yaml.safe_load(config_map["data"]["config.yaml"])["state"]["path"]
    state_mount = max((path for path in mounts if state_path.startswith(path.rstrip("/") + "/")), key=len)
    assert mounts[state_mount] in single_writer
    # Two pods can neither attach the volume nor take the lock together: one replica, old pod gone first.
    assert deployment["spec"].get("replicas", 1) == 1
    assert deployment["spec"].get("strategy") == {"type": "Recreate"}


def test_compose_mounts_files_that_exist() -> None:
    compose = yaml.safe_load((EXAMPLES / "docker-compose.yml").read_text())
    assert set(compose["services"]) == {"inference-cost-exporter", "prometheus", "alertmanager", "grafana"}
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (EXAMPLES / source).exists(), source


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
    assert "rule_files" not in prometheus
    assert "alerting" not in prometheus
    assert not any("alert-rules" in volume for volume in services["prometheus"].get("volumes", []))


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
