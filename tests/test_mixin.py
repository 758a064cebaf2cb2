"""The monitoring mixin (mixin/): rendered by the real jsonnet, its rules checked and unit-tested by
the real promtool, every series it reads taken from the exporter's own exposition, and its dashboard
the one in grafana/ (imported, never copied)."""

from __future__ import annotations

import functools
import json
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from exporter.core.clock import Clock, FrozenClock
from exporter.sim import Simulator
from tests.conftest import require_binary
from tests.test_exposition import full_exposition

pytestmark = pytest.mark.integration  # every test runs jsonnet, most also promtool

ROOT = Path(__file__).parent.parent
MIXIN = ROOT / "mixin"
DASHBOARD = ROOT / "grafana" / "inference-cost-exporter.json"
DOCS = ROOT / "docs" / "mixin.md"
DEFAULT_SELECTOR = 'job="inference-cost-exporter"'
OTHER_SELECTOR = 'job="costs", namespace="billing"'
PROMETHEUS_OWN = {"up"}
"""Series Prometheus writes itself for every target: not in the exporter's exposition."""

SELECTED = re.compile(r"(?<![\w:])([A-Za-z_:][\w:]*)\{((?:[^}\"]|\"(?:[^\"\\]|\\.)*\")*)\}")
"""A series with its selector: `name{...}` (a brace inside a quoted value does not end it)."""
EXPORTER_METRIC = re.compile(r"(?<![\w:])inference_\w+")
RECORD = re.compile(r"^(?P<level>[a-z_]+):(?P<metric>inference_[a-z0-9_]+):(?P<operations>[a-z0-9_]+)$")
SEVERITIES = {"critical", "warning", "info"}


def render(field: str, config: dict[str, Any] | None = None) -> Any:
    """`(import "mixin.libsonnet")` with `config` merged into its `_config` (an `-e` override, as a
    user would write one), then one of its fields, by the real jsonnet."""
    return json.loads(rendered(field, json.dumps(config or {})))


@functools.cache
def rendered(field: str, override: str) -> str:
    jsonnet = require_binary("jsonnet")
    code = f"((import {json.dumps(str(MIXIN / 'mixin.libsonnet'))}) + {{ _config+:: {override} }}).{field}"
    result = subprocess.run([jsonnet, "-e", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def alerts(config: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return [rule for group in render("prometheusAlerts", config)["groups"] for rule in group["rules"]]


def records(config: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return [rule for group in render("prometheusRules", config)["groups"] for rule in group["rules"]]


def expressions(config: dict[str, Any] | None = None) -> dict[str, str]:
    """Every alert's and recording rule's expression, by its name."""
    return {rule.get("alert") or rule["record"]: rule["expr"] for rule in alerts(config) + records(config)}


def rule_file(path: Path) -> Path:
    """The alerts and the recording rules as one Prometheus rule file, as kube-prometheus' PrometheusRule holds them."""
    groups = render("prometheusAlerts")["groups"] + render("prometheusRules")["groups"]
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require_binary("promtool"), *args], capture_output=True, text=True, timeout=60)


# --- rendering and the conventions of monitoring mixins ----------------------------------------------


def test_every_alert_follows_the_mixin_guidelines() -> None:
    found = alerts()
    assert len(found) >= 8
    problems = []
    for alert in found:
        name = alert["alert"]
        if not re.fullmatch(r"InferenceCost[A-Z][A-Za-z]+", name):
            problems.append(f"{name}: not InferenceCost… in camel case")
        if alert.get("labels", {}).get("severity") not in SEVERITIES:
            problems.append(f"{name}: severity {alert.get('labels', {}).get('severity')!r}")
        if not re.fullmatch(r"\d+[smh]", alert.get("for", "")):
            problems.append(f"{name}: for {alert.get('for')!r}")
        annotations = alert.get("annotations", {})
        for key in ("summary", "description"):
            if not annotations.get(key, "").endswith("."):
                problems.append(f"{name}: {key} missing or not a sentence")
    assert problems == []
    assert len({alert["alert"] for alert in found}) == len(found), "two alerts share a name"


def test_recording_rules_are_named_level_metric_operations() -> None:
    found = records()
    assert len(found) >= 3
    for rule in found:
        name = RECORD.match(rule["record"])
        assert name is not None, rule["record"]
        # The metric part is the exporter's metric, unchanged but for `_total` dropped under rate()
        # and `_per_` between the two metrics of a ratio.
        metric = name["metric"].split("_per_")[0]
        assert re.search(rf"(?<![\w:]){metric}(_total)?\{{", rule["expr"]), (rule["record"], rule["expr"])


def test_promtool_accepts_the_alerts_and_rules(tmp_path: Path) -> None:
    path = rule_file(tmp_path / "mixin.yml")
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts()) + len(records())} rules found" in result.stdout


# --- what the expressions do, run by promtool --------------------------------------------------------


def description(alert: str, labels: dict[str, str], value: str) -> str:
    """The alert's description template filled in as Prometheus does for these few constructs
    (label values, the optional account, the value as given), so a test states whole annotations."""
    template = next(a for a in alerts() if a["alert"] == alert)["annotations"]["description"]
    account = labels.get("account")
    text = template.replace(
        "{{ with $labels.account }} (account {{ . }}){{ end }}", f" (account {account})" if account else ""
    )
    text = re.sub(r"\{\{ \$value[^}]*\}\}", value, text)
    text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m[1], ""), text)
    assert "{{" not in text, f"a template construct this test does not fill in: {text}"
    return text


def summary(alert: str) -> str:
    return str(next(a for a in alerts() if a["alert"] == alert)["annotations"]["summary"])


def expected(alert: str, labels: dict[str, str], value: str = "") -> dict[str, Any]:
    return {
        "exp_labels": {**labels, "severity": "warning"},
        "exp_annotations": {"summary": summary(alert), "description": description(alert, labels, value)},
    }


def selected(name: str, labels: dict[str, str]) -> str:
    """`name{key="value", ...}`."""
    return name + "{" + ", ".join(f'{key}="{value}"' for key, value in sorted(labels.items())) + "}"


def series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    return {"series": selected(name, labels), "values": values}


def unit_test(tmp_path: Path, tests: list[dict[str, Any]]) -> None:
    """`promtool test rules` on the mixin's alerts and rules: every test group must pass."""
    rule_file(tmp_path / "mixin.yml")
    suite = {"rule_files": ["mixin.yml"], "evaluation_interval": "1m", "tests": tests}
    (tmp_path / "mixin_test.yml").write_text(yaml.safe_dump(suite, sort_keys=False))
    result = promtool("test", "rules", str(tmp_path / "mixin_test.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


TARGET = {"job": "inference-cost-exporter", "instance": "exporter:9877"}
ELSEWHERE = {"job": "something-else", "instance": "other:9877"}
"""A target the default selector does not pick: none of its series may alert."""


def test_promtool_unit_tests_prove_the_alerts_fire_and_stay_quiet(tmp_path: Path) -> None:
    stale, fresh = {**TARGET, "account": "prod", "source": "bills"}, {**TARGET, "source": "usage"}
    failing, flapping = {**TARGET, "source": "bills"}, {**TARGET, "source": "usage"}
    probe = {**TARGET, "probe": "chat-prod", "endpoint_id": "ep-1", "scenario": "chat"}
    last_success = "inference_exporter_last_refresh_success_timestamp_seconds"
    refresh = "inference_exporter_refresh_success"
    tests = [
        {
            "interval": "1m",
            "input_series": [
                series("up", TARGET, "1x200"),
                # Last refreshed at t=0 and never since; fresh: refreshed every minute.
                series(last_success, stale, "0x200"),
                series(last_success, fresh, "0+60x200"),
                series(last_success, {**ELSEWHERE, "source": "bills"}, "0x200"),
                # Failing from minute 2 on; failing every other minute (never for 30 minutes running).
                series(refresh, failing, "1 1 0x60"),
                series(refresh, flapping, " ".join(["0", "1"] * 31)),
                series(refresh, {**ELSEWHERE, "source": "bills"}, "0x60"),
                # The history: a month held back an hour after one failure; a history failing throughout.
                series(refresh, {**TARGET, "source": "history", "account": "lab"}, "1 0x59 1x140"),
                series(refresh, {**TARGET, "source": "history", "account": "prod"}, "1 0x200"),
                series("inference_probe_success", probe, "1 0x40"),
                series("inference_probe_success", {**probe, "probe": "chat-lab"}, "1x40"),
            ],
            "alert_rule_test": [
                # Stale beyond 7200 s from minute 121, for 5 minutes from 126.
                {"eval_time": "124m", "alertname": "InferenceCostDataStale", "exp_alerts": []},
                {"eval_time": "130m", "alertname": "InferenceCostDataStale",
                 "exp_alerts": [expected("InferenceCostDataStale", stale, "2h 10m 0s")]},
                # Failing since minute 2: for 30 minutes at 32.
                {"eval_time": "31m", "alertname": "InferenceCostRefreshFailing", "exp_alerts": []},
                {"eval_time": "33m", "alertname": "InferenceCostRefreshFailing",
                 "exp_alerts": [expected("InferenceCostRefreshFailing", failing)]},
                {"eval_time": "60m", "alertname": "InferenceCostRefreshFailing",
                 "exp_alerts": [expected("InferenceCostRefreshFailing", failing)]},
                # Not the history's failures, which have an alert of their own with a longer `for`.
                {"eval_time": "119m", "alertname": "InferenceCostHistoryFailing", "exp_alerts": []},
                {"eval_time": "125m", "alertname": "InferenceCostHistoryFailing", "exp_alerts": [
                    expected("InferenceCostHistoryFailing", {**TARGET, "source": "history", "account": "prod"})]},
                {"eval_time": "10m", "alertname": "InferenceCostProbeFailing", "exp_alerts": []},
                {"eval_time": "20m", "alertname": "InferenceCostProbeFailing",
                 "exp_alerts": [expected("InferenceCostProbeFailing", probe)]},
                {"eval_time": "60m", "alertname": "InferenceCostExporterDown", "exp_alerts": []},
                {"eval_time": "60m", "alertname": "InferenceCostExporterAbsent", "exp_alerts": []},
            ],
        },
        {
            "interval": "1m",
            "input_series": [
                series("up", TARGET, "0x30"),
                # A receiver refusing everything; another that fails now and then but delivers.
                series("inference_alert_notifications_failed_total", {**TARGET, "notifier": "hook"}, "0+1x60"),
                series("inference_alert_notifications_total", {**TARGET, "notifier": "hook"}, "5x60"),
                series("inference_alert_notifications_failed_total", {**TARGET, "notifier": "slack"}, "0+1x60"),
                series("inference_alert_notifications_total", {**TARGET, "notifier": "slack"}, "0+1x60"),
                series("inference_alert_notifications_pending", {**TARGET, "notifier": "hook"}, "0 3x60"),
                series("inference_alert_notifications_pending", {**TARGET, "notifier": "slack"}, "0 1 0x60"),
                series("inference_exporter_config_last_reload_successful", TARGET, "1 0x30"),
                series("inference_exporter_state_write_success", {**TARGET, "account": "prod"}, "1 0x30"),
                series("inference_exporter_clock_skew_seconds", TARGET, "-90x30"),
                # A notification dropped at minute 11, its receiver having refused it: told for the hour after.
                series("inference_alert_notifications_discarded_total", {**TARGET, "reason": "refused"}, "0x10 1x90"),
                series("inference_alert_notifications_discarded_total", {**TARGET, "reason": "superseded"}, "0+1x90"),
            ],
            "alert_rule_test": [
                {"eval_time": "4m", "alertname": "InferenceCostExporterDown", "exp_alerts": []},
                {"eval_time": "6m", "alertname": "InferenceCostExporterDown",
                 "exp_alerts": [expected("InferenceCostExporterDown", TARGET)]},
                {"eval_time": "30m", "alertname": "InferenceCostNotificationsFailing", "exp_alerts": [
                    expected("InferenceCostNotificationsFailing", {**TARGET, "notifier": "hook"})]},
                {"eval_time": "40m", "alertname": "InferenceCostNotificationBacklog", "exp_alerts": [
                    expected("InferenceCostNotificationBacklog", {**TARGET, "notifier": "hook"}, "3")]},
                {"eval_time": "10m", "alertname": "InferenceCostConfigReloadFailed",
                 "exp_alerts": [expected("InferenceCostConfigReloadFailed", TARGET)]},
                {"eval_time": "15m", "alertname": "InferenceCostStateWriteFailing",
                 "exp_alerts": [expected("InferenceCostStateWriteFailing", {**TARGET, "account": "prod"})]},
                {"eval_time": "15m", "alertname": "InferenceCostClockSkew",
                 "exp_alerts": [expected("InferenceCostClockSkew", TARGET, "1m 30s")]},
                {"eval_time": "10m", "alertname": "InferenceCostNotificationsRefused", "exp_alerts": []},
                {"eval_time": "15m", "alertname": "InferenceCostNotificationsRefused", "exp_alerts": [
                    expected("InferenceCostNotificationsRefused", {**TARGET, "reason": "refused"})]},
                {"eval_time": "80m", "alertname": "InferenceCostNotificationsRefused", "exp_alerts": []},
            ],
        },
        {
            "interval": "1m",
            "input_series": [series("up", ELSEWHERE, "1x30")],
            "alert_rule_test": [
                {"eval_time": "10m", "alertname": "InferenceCostExporterAbsent", "exp_alerts": []},
                {"eval_time": "20m", "alertname": "InferenceCostExporterAbsent", "exp_alerts": [
                    {"exp_labels": {"job": "inference-cost-exporter", "severity": "warning"},
                     "exp_annotations": {"summary": summary("InferenceCostExporterAbsent"),
                                         "description": description("InferenceCostExporterAbsent", {}, "")}}]},
            ],
        },
    ]  # fmt: skip
    unit_test(tmp_path, tests)


def test_promtool_unit_tests_prove_the_recording_rules(tmp_path: Path) -> None:
    month = {**TARGET, "account": "prod"}
    probe = {**TARGET, "probe": "chat-prod", "endpoint_id": "ep-1", "scenario": "chat"}
    quiet = {**probe, "probe": "chat-lab"}
    tests = [{
        "interval": "1m",
        "input_series": [
            series("inference_billing_today_info", {**TARGET, "day": "2026-11-22", "period": "2026-11"}, "1x120"),
            # Last month's figures, still served during its grace days, are not this month's.
            series("inference_bill_month_to_date_payable_amount", {**month, "period": "2026-10"}, "9000x120"),
            series("inference_bill_month_to_date_payable_amount", {**month, "period": "2026-11"}, "1234.5x120"),
            series("inference_bill_month_to_date_payable_amount", {**ELSEWHERE, "period": "2026-11"}, "7x120"),
            series("inference_bill_month_forecast_payable_amount", {**month, "period": "2026-10"}, "9100x120"),
            series("inference_bill_month_forecast_payable_amount", {**month, "period": "2026-11"}, "5000x120"),
            # One run a minute, half of them failed: half of those timeouts, half 5xx.
            series("inference_probe_runs_total", probe, "0+1x120"),
            series("inference_probe_failures_total", {**probe, "reason": "timeout_total"}, "0+0.25x120"),
            series("inference_probe_failures_total", {**probe, "reason": "http_5xx"}, "0+0.25x120"),
            series("inference_probe_runs_total", quiet, "0+1x120"),
        ],
        "promql_expr_test": [
            {"eval_time": "90m", "expr": "account:inference_bill_month_to_date_payable_amount:sum",
             "exp_samples": [{"labels": selected("account:inference_bill_month_to_date_payable_amount:sum", month),
                              "value": 1234.5}]},
            {"eval_time": "90m", "expr": "account:inference_bill_month_forecast_payable_amount:sum",
             "exp_samples": [{"labels": selected("account:inference_bill_month_forecast_payable_amount:sum", month),
                              "value": 5000}]},
            {"eval_time": "90m", "expr": "probe:inference_probe_failures_per_runs:ratio_rate1h",
             "exp_samples": [
                 {"labels": selected("probe:inference_probe_failures_per_runs:ratio_rate1h", probe), "value": 0.5},
                 {"labels": selected("probe:inference_probe_failures_per_runs:ratio_rate1h", quiet), "value": 0},
             ]},
        ],
    }]  # fmt: skip
    unit_test(tmp_path, tests)


# --- the series it reads are the exporter's ------------------------------------------------------------


def read_series(expressions: Sequence[str], texts: Sequence[str] = ()) -> set[str]:
    """The series PromQL `expressions` read (those with a selector, and every `inference_` name with
    one or not), and the exporter's metrics that annotation `texts` name."""
    names: set[str] = set()
    for expr in expressions:
        names |= {match[1] for match in SELECTED.finditer(expr)} | set(EXPORTER_METRIC.findall(expr))
    for text in texts:
        names |= set(EXPORTER_METRIC.findall(text))
    return names


def test_every_series_the_mixin_reads_is_in_the_exporters_exposition(
    sim: Simulator, clock: Clock, frozen: FrozenClock
) -> None:
    exposition = full_exposition(sim, clock, frozen).decode()
    exposed = {sample.name for family in text_string_to_metric_families(exposition) for sample in family.samples}
    rules = alerts() + records()
    annotations = [text for rule in rules for text in rule.get("annotations", {}).values()]
    read = read_series([rule["expr"] for rule in rules], annotations)
    assert "inference_exporter_last_refresh_success_timestamp_seconds" in read  # (the reading works)
    assert read - exposed == PROMETHEUS_OWN, "series the mixin reads that the exporter does not expose"


def test_reading_series_finds_misspelt_and_bare_names() -> None:
    assert read_series(['up{job="x"} == 0', 'inference_exporter_refresh_sucess{a="}"} == 0']) == {
        "up",
        "inference_exporter_refresh_sucess",
    }
    assert read_series(["rate(inference_probe_runs_total[5m])"]) == {"inference_probe_runs_total"}
    assert read_series([], ["see inference_probe_check_sucess{check} in the state file{{ .x }}"]) == {
        "inference_probe_check_sucess"
    }


# --- _config reaches every expression --------------------------------------------------------------------


def unselected(expr: str, selector: str) -> list[str]:
    """The series in `expr` whose selector does not start with `selector` (or that have none)."""
    problems = [f"{name}{{{body}}}" for name, body in SELECTED.findall(expr) if not body.startswith(selector)]
    bare = [metric[0] for metric in EXPORTER_METRIC.finditer(expr) if not expr.startswith("{", metric.end())]
    return problems + [f"{name} without a selector" for name in bare]


def selector_problems(found: dict[str, str], selector: str) -> dict[str, list[str]]:
    problems = {name: unselected(expr, selector) for name, expr in found.items()}
    return {name: listed for name, listed in problems.items() if listed}


def test_every_expression_selects_the_exporter() -> None:
    assert selector_problems(expressions(), DEFAULT_SELECTOR) == {}


def test_an_unselected_series_is_found() -> None:
    assert unselected('up{job="x"} == 0', DEFAULT_SELECTOR) == ['up{job="x"}']
    assert unselected(
        f"rate(inference_probe_runs_total[1h]) / rate(inference_probe_runs_total{{{DEFAULT_SELECTOR}}}[1h])",
        DEFAULT_SELECTOR,
    ) == ["inference_probe_runs_total without a selector"]


def test_the_exporter_selector_replaces_the_default_everywhere() -> None:
    config = {"exporterSelector": OTHER_SELECTOR}
    found = expressions(config)
    assert found.keys() == expressions().keys()
    assert [name for name, expr in found.items() if "inference-cost-exporter" in expr] == []
    assert selector_problems(found, OTHER_SELECTOR) == {}
    variables = render("grafanaDashboards", config)["inference-cost-exporter.json"]["templating"]["list"]
    job = next(variable for variable in variables if variable["name"] == "job")
    narrowed = f"label_values(inference_exporter_build_info{{{OTHER_SELECTOR}}}, job)"
    assert job["definition"] == job["query"]["query"] == narrowed


# --- the dashboard is grafana/'s ---------------------------------------------------------------------------


def dashboard_as_configured(config: dict[str, Any]) -> dict[str, Any]:
    """grafana/inference-cost-exporter.json with what `config` changes applied by hand."""
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    dashboard.update(title=config["dashboardTitle"], uid=config["dashboardUid"], tags=config["dashboardTags"])
    selector = config["exporterSelector"]
    scoped = f'job=~"$job", {selector}'
    for variable in dashboard["templating"]["list"]:
        if variable["name"] == "job":
            narrowed = f"label_values(inference_exporter_build_info{{{selector}}}, job)"
            variable["definition"] = variable["query"]["query"] = narrowed
            variable["allValue"] = None  # (All: the jobs listed, not any job)
        elif "definition" in variable:
            variable["definition"] = variable["query"]["query"] = variable["definition"].replace('job=~"$job"', scoped)
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            target["expr"] = target["expr"].replace('job=~"$job"', scoped)
    return dashboard


def test_the_dashboard_is_grafanas_file_changed_only_where_config_says() -> None:
    config = {"dashboardTitle": "Costs", "dashboardUid": "costs", "dashboardTags": ["mixin"],
              "exporterSelector": OTHER_SELECTOR}  # fmt: skip
    rendered = render("grafanaDashboards", config)
    assert list(rendered) == ["inference-cost-exporter.json"]
    assert rendered["inference-cost-exporter.json"] == dashboard_as_configured(config)


def test_every_query_of_the_dashboard_is_narrowed_by_the_selector_and_all_is_the_jobs_it_lists() -> None:
    """A matcher of the selector besides `job` (a namespace where another one has a Service of the
    same name) narrows what every panel shows, not only the list of jobs; and All is the jobs
    listed, not `.*`, which took in any exporter."""
    rendered = render("grafanaDashboards", {"exporterSelector": OTHER_SELECTOR})["inference-cost-exporter.json"]
    queries = [target["expr"] for panel in rendered["panels"] for target in panel.get("targets", [])]
    variables = {variable["name"]: variable for variable in rendered["templating"]["list"]}
    queries += [variables[name]["query"]["query"] for name in ("job", "instance", "account")]
    assert [query for query in queries if 'namespace="billing"' not in query] == []
    assert variables["job"]["allValue"] is None


def test_the_dashboards_defaults_are_its_own() -> None:
    file = json.loads(DASHBOARD.read_text())
    rendered = render("grafanaDashboards")["inference-cost-exporter.json"]
    own = {"dashboardTitle": file["title"], "dashboardUid": file["uid"], "dashboardTags": file["tags"]}
    assert rendered == dashboard_as_configured({**own, "exporterSelector": DEFAULT_SELECTOR})


def test_the_dashboard_has_one_source() -> None:
    assert sorted(path.name for path in MIXIN.rglob("*") if path.suffix == ".json") == []
    dashboards = (MIXIN / "dashboards" / "dashboards.libsonnet").read_text()
    assert "import '../../grafana/inference-cost-exporter.json'" in dashboards


# --- the docs page -------------------------------------------------------------------------------------------


def test_the_docs_name_every_alert_rule_and_setting() -> None:
    text = DOCS.read_text()
    config = render("_config")
    names = [rule["alert"] for rule in alerts()] + [rule["record"] for rule in records()] + list(config)
    assert [name for name in names if f"`{name}`" not in text] == []
