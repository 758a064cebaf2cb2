"""End to end: the real Prometheus scrapes `demo`, and every dashboard query returns series."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.conftest import require_binary
from tests.helpers import free_port, serve_binary, wait_for
from tests.test_cli import ready, spawn

ROOT = Path(__file__).parent.parent
DASHBOARD = ROOT / "grafana" / "inference-cost-exporter.json"
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "1h",
    # The dashboard's own variables at All: `.*` also matches the demo's series, which have no `account` label.
    "$job": ".*",
    "$instance": ".*",
    "$account": ".*",
}


def panel_queries() -> list[tuple[str, str]]:
    """Every panel query, its variables replaced as Grafana would (tests/test_backfill.py runs some as they are)."""
    dashboard = json.loads(DASHBOARD.read_text())
    panels = []
    for panel in dashboard["panels"]:
        panels.extend(panel.get("panels", [panel]))  # rows hold panels of their own
    return [(panel["title"], concrete(target["expr"])) for panel in panels for target in panel.get("targets", [])]


def concrete(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


@pytest.fixture(scope="module")
def demo() -> Iterator[str]:
    process, url = spawn("demo")
    try:
        wait_for(lambda: ready(url), timeout=60)
        yield url
    finally:
        process.terminate()
        process.communicate(timeout=15)


@pytest.fixture(scope="module")
def prometheus(demo: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = require_binary("prometheus")
    workdir = tmp_path_factory.mktemp("prometheus")
    target = demo.removeprefix("http://")
    (workdir / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"scrape_configs:\n  - job_name: demo\n    static_configs:\n      - targets: ['{target}']\n"
    )
    port = free_port()
    yield from serve_binary(
        [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        port,
    )  # fmt: skip


def query(prometheus: str, expr: str) -> list[dict]:
    response = requests.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10)
    body = response.json()
    assert body["status"] == "success", f"{expr}: {body.get('error')}"
    return body["data"]["result"]


def scrapes(prometheus: str) -> int:
    result = query(prometheus, "count_over_time(inference_exporter_build_info[5m])")
    return int(float(result[0]["value"][1])) if result else 0


def test_every_dashboard_query_returns_series(prometheus: str) -> None:
    queries = panel_queries()
    assert len(queries) >= 15
    # Scrapes over more than one probe interval and usage sync (5 s each in the demo), so rates and quantiles
    # have two different samples to work with.
    wait_for(lambda: scrapes(prometheus) >= 8, timeout=60, interval=0.5)
    empty = []
    for title, expr in queries:
        assert "$" not in re.sub(r"\$value", "", expr), f"{title}: unknown variable in {expr}"

        def returns(expr: str = expr) -> bool:
            return bool(query(prometheus, expr))

        try:
            wait_for(returns, timeout=30, interval=1.0)
        except AssertionError:
            empty.append(f"{title}: {expr}")
    assert empty == [], "queries with no series:\n" + "\n".join(empty)


def test_promtool_check_metrics_on_a_scrape(demo: str) -> None:
    promtool = require_binary("promtool")
    exposition = requests.get(f"{demo}/metrics", timeout=10).content
    result = subprocess.run([promtool, "check", "metrics"], input=exposition, capture_output=True, timeout=60)
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
