"""What users deploy: the container, the example Prometheus/Alertmanager/Kubernetes/compose files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

from exporter.alerts.promrules import rule_file
from exporter.config import load, validate
from tests.conftest import require_binary

ROOT = Path(__file__).parent.parent
EXAMPLES = ROOT / "examples"
ENV = {"BILLING_ACCESS_KEY_ID": "AK", "BILLING_SECRET_ACCESS_KEY": "s", "INFERENCE_API_KEY": "k"}


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


def test_example_prometheus_config_and_rules_pass_promtool() -> None:
    promtool = require_binary("promtool")
    for args in (["check", "config", "prometheus.yml"], ["check", "rules", "alert-rules.yml"]):
        result = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60, cwd=EXAMPLES)
        assert result.returncode == 0, result.stdout + result.stderr


def test_example_rules_are_what_the_rules_command_writes_for_the_example_config() -> None:
    config = load(ROOT / "config.example.yaml", ENV)
    text, skipped = rule_file(config.alerts, config.budgets)
    assert skipped == []
    assert (EXAMPLES / "alert-rules.yml").read_text() == text


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


def test_compose_mounts_files_that_exist() -> None:
    compose = yaml.safe_load((EXAMPLES / "docker-compose.yml").read_text())
    assert set(compose["services"]) == {"inference-cost-exporter", "prometheus", "alertmanager", "grafana"}
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (EXAMPLES / source).exists(), source


def test_the_wheel_holds_every_module(tmp_path: Path) -> None:
    """What the container installs: a wheel built from the project, with every subpackage in it."""
    import zipfile

    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (wheel,) = tmp_path.glob("inference_cost_exporter-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {str(p.relative_to(ROOT)) for pattern in ("*.py", "*.yaml") for p in (ROOT / "exporter").rglob(pattern)}
    assert sources <= names, sorted(sources - names)
