"""The dashboard serves several exporters and accounts: its `job`, `instance` and `account` variables,
and every panel query filtered by them (no server: tests/test_prometheus_e2e.py runs the queries; promtool
runs those that add figures up over replicas)."""

from __future__ import annotations

import copy
import json
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import require_binary
from tests.test_prometheus_e2e import concrete

DASHBOARD = Path(__file__).parent.parent / "grafana" / "inference-cost-exporter.json"

VARIABLES = {
    "job": "label_values(inference_exporter_build_info, job)",
    "instance": 'label_values(inference_exporter_build_info{job=~"$job"}, instance)',
    "account": 'label_values(inference_exporter_refresh_success{job=~"$job", instance=~"$instance"}, account)',
}
"""The variables after `datasource`, in this order, and their queries."""

PROCESS_LEVEL = re.compile(
    r"inference_(exporter_build_info|billing_today_info|exporter_config_last_reload_\w+|alerts\w*)"
)
"""The exporter process's series: never an `account` label, so never filtered on it (`account=~"prod"`
would drop them, and with them a join against `inference_billing_today_info`)."""

METRIC = re.compile(r"(?<![\w:])inference_[A-Za-z0-9_:]*")
SELECTOR = re.compile(r'\{((?:[^}"]|"(?:[^"\\]|\\.)*")*)\}')
MATCHER = re.compile(r'\s*([A-Za-z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')
JOIN = re.compile(r"\b(on|ignoring)\s*\(([^)]*)\)")
GROUPING = re.compile(r"\b(by|without)\s*\(([^)]*)\)")
TARGET = {("job", "=~", "$job"), ("instance", "=~", "$instance")}
TARGET_LABELS = {"job", "instance"}
ACCOUNT = ("account", "=~", "$account")


def load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", ())  # a row holds panels of its own


def targets(dashboard: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for panel in panels(dashboard):
        for target in panel.get("targets", ()):
            yield panel["title"], target


def matchers(body: str) -> set[tuple[str, str, str]]:
    found, at = set(), 0
    while at < len(body):
        matcher = MATCHER.match(body, at)
        if matcher is None:
            raise ValueError(f"cannot read the selector {{{body}}}")
        found.add((matcher[1], matcher[2], matcher[3]))
        at = matcher.end()
    return found


def labels(clause: str) -> set[str]:
    return {label.strip() for label in clause.split(",")} - {""}


def account_level(expr: str) -> bool:
    return any(not PROCESS_LEVEL.fullmatch(metric[0]) for metric in METRIC.finditer(expr))


def expr_problems(expr: str) -> list[str]:
    """What keeps `expr` from showing only the chosen exporters and accounts, and them apart."""
    problems = []
    for metric in METRIC.finditer(expr):
        name = metric[0]
        selector = SELECTOR.match(expr, metric.end())
        if selector is None:
            problems.append(f"{name} without a label selector")
            continue
        found = matchers(selector[1])
        required = set(TARGET)
        if PROCESS_LEVEL.fullmatch(name):
            if any(label == "account" for label, _, _ in found):
                problems.append(f"{name} is the process's: it has no account label to filter on")
        else:
            required.add(ACCOUNT)
        problems += [f'{name} without {label}{op}"{value}"' for label, op, value in sorted(required - found)]
    for join in JOIN.finditer(expr):
        joined = labels(join[2])
        if (join[1] == "on" and not joined >= TARGET_LABELS) or (join[1] == "ignoring" and joined & TARGET_LABELS):
            problems.append(f"{join[0]} matches series of different exporters")
    if account_level(expr):
        for grouping in GROUPING.finditer(expr):
            kept = "account" in labels(grouping[2])
            if kept != (grouping[1] == "by"):
                problems.append(f"{grouping[0]} sums the figures of different accounts")
    return problems


def query_problems(dashboard: dict[str, Any]) -> list[str]:
    problems = []
    for title, target in targets(dashboard):
        expr = target.get("expr", "")
        problems += [f"{title} ({target.get('refId')}): {problem}" for problem in expr_problems(expr)]
        legend = target.get("legendFormat", "__auto")
        if (
            target.get("format") != "table"
            and legend != "__auto"
            and account_level(expr)
            and "{{account}}" not in legend
        ):
            problems.append(f"{title} ({target.get('refId')}): legend {legend!r} does not name the account")
    return problems


def variable_problems(dashboard: dict[str, Any]) -> list[str]:
    variables = dashboard["templating"]["list"]
    names = [variable["name"] for variable in variables]
    if names[: len(VARIABLES) + 1] != ["datasource", *VARIABLES]:
        return [f"variables {names}, not datasource, {', '.join(VARIABLES)} first"]
    problems = []
    for variable in variables[1 : len(VARIABLES) + 1]:
        name, query = variable["name"], variable.get("query")
        text = query.get("query") if isinstance(query, dict) else query
        expected = {
            "type": "query",
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": VARIABLES[name],
            "definition": VARIABLES[name],
            "multi": True,
            "includeAll": True,
            "allValue": ".*",  # All also matches series without the label (`account=~".*"`), unlike `.+`
            "sort": 1,  # alphabetical, ascending
        }
        actual = {**variable, "query": text, "definition": variable.get("definition", text)}
        problems += [f"{name}: {key} is {actual.get(key)!r}, not {value!r}" for key, value in expected.items()
                     if actual.get(key) != value]  # fmt: skip
        if variable.get("refresh") not in (1, 2):  # on dashboard load, on time range change (and load)
            problems.append(f"{name}: refresh is {variable.get('refresh')!r}, never")
    return problems


def test_job_instance_and_account_variables_follow_the_datasource() -> None:
    assert variable_problems(load()) == []


def test_every_panel_query_is_filtered_by_the_variables() -> None:
    dashboard = load()
    assert sum(1 for _ in targets(dashboard)) >= 15
    assert query_problems(dashboard) == []


def test_the_selectors_are_read_whole() -> None:
    selector = '{a="}", job=~"$job",instance=~"$instance" ,account=~"$account"}'  # a brace in a value, loose commas
    expr = f"sum by (le, account) (rate(inference_x_bucket{selector}[5m]))"
    assert expr_problems(expr) == []
    with pytest.raises(ValueError, match="cannot read"):
        expr_problems('inference_x{job=~"$job" instance=~"$instance"}')


def first_target(title: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda dashboard: next(t for panel_title, t in targets(dashboard) if panel_title.startswith(title))


def edit(title: str, old: str, new: str) -> Callable[[dict[str, Any]], None]:
    def broken(dashboard: dict[str, Any]) -> None:
        target = first_target(title)(dashboard)
        assert old in target["expr"]
        target["expr"] = target["expr"].replace(old, new, 1)

    return broken


def relabel(title: str, legend: str) -> Callable[[dict[str, Any]], None]:
    return lambda dashboard: first_target(title)(dashboard).update(legendFormat=legend)


def add_panel(expr: str, in_row: bool = False) -> Callable[[dict[str, Any]], None]:
    def broken(dashboard: dict[str, Any]) -> None:
        panel = {"id": 99, "type": "timeseries", "title": "Added later", "targets": [{"refId": "A", "expr": expr}]}
        dashboard["panels"].append({"id": 98, "type": "row", "title": "Row", "panels": [panel]} if in_row else panel)

    return broken


BROKEN_QUERIES = {
    "a panel without filters": (
        add_panel("sum by (probe) (rate(inference_probe_runs_total[5m]))"),
        "inference_probe_runs_total without a label selector",
    ),
    "a panel in a row without filters": (
        add_panel("inference_probe_success", in_row=True),
        "inference_probe_success without a label selector",
    ),
    "a panel filtered on job only": (
        add_panel('inference_probe_success{job=~"$job", account=~"$account"}'),
        'inference_probe_success without instance=~"$instance"',
    ),
    "no job filter": (
        edit("Month to date", 'job=~"$job", ', ""),
        'inference_bill_month_to_date_payable_amount without job=~"$job"',
    ),
    "no instance filter on today": (
        edit("Billed today", ', instance=~"$instance"})', "})"),
        'inference_billing_today_info without instance=~"$instance"',
    ),
    "no account filter": (
        edit("Last refresh", ', account=~"$account"', ""),
        'inference_exporter_refresh_success without account=~"$account"',
    ),
    "an account filter on today": (
        edit("Billed today", 'instance=~"$instance"})', 'instance=~"$instance", account=~"$account"})'),
        "inference_billing_today_info is the process's",
    ),
    "one job, not any chosen": (
        edit("Budget used", 'job=~"$job"', 'job="$job"'),
        'inference_budget_used_ratio without job=~"$job"',
    ),
    "today joined on the day alone": (
        edit("Billed today", "on(job, instance, day)", "on(day)"),
        "on(day) matches series of different exporters",
    ),
    "endpoints summed over accounts": (
        edit("Billed today", "by (endpoint_id, account)", "by (endpoint_id)"),
        "by (endpoint_id) sums the figures of different accounts",
    ),
    "quantiles over accounts": (
        edit("Probe end-to-end", "by (le, probe, account)", "by (le, probe)"),
        "by (le, probe) sums the figures of different accounts",
    ),
    "a legend without the account": (
        relabel("Requests per second", "{{endpoint_id}} / {{model}}"),
        "legend '{{endpoint_id}} / {{model}}' does not name the account",
    ),
}


@pytest.mark.parametrize(("breaking", "problem"), BROKEN_QUERIES.values(), ids=BROKEN_QUERIES.keys())
def test_a_query_without_the_filters_fails(breaking: Callable[[dict[str, Any]], None], problem: str) -> None:
    dashboard = copy.deepcopy(load())
    breaking(dashboard)
    assert any(problem in found for found in query_problems(dashboard)), query_problems(dashboard)


def drop_variable(name: str) -> Callable[[dict[str, Any]], None]:
    def broken(dashboard: dict[str, Any]) -> None:
        dashboard["templating"]["list"] = [v for v in dashboard["templating"]["list"] if v["name"] != name]

    return broken


def set_field(name: str, **fields: object) -> Callable[[dict[str, Any]], None]:
    def broken(dashboard: dict[str, Any]) -> None:
        next(v for v in dashboard["templating"]["list"] if v["name"] == name).update(fields)

    return broken


BROKEN_VARIABLES = {
    "no account variable": (drop_variable("account"), "not datasource, job, instance, account first"),
    "All is the values found": (set_field("account", allValue=None), "account: allValue is None"),
    "All matches only series with the label": (set_field("account", allValue=".+"), "account: allValue is '.+'"),
    "single choice": (set_field("instance", multi=False), "instance: multi is False"),
    "no All": (set_field("job", includeAll=False), "job: includeAll is False"),
    "never refreshed": (set_field("instance", refresh=0), "instance: refresh is 0"),
    "unsorted": (set_field("account", sort=0), "account: sort is 0"),
    "instances of every job": (
        set_field("instance", query="label_values(inference_exporter_build_info, instance)"),
        "instance: query is 'label_values(inference_exporter_build_info, instance)'",
    ),
}


@pytest.mark.parametrize(("breaking", "problem"), BROKEN_VARIABLES.values(), ids=BROKEN_VARIABLES.keys())
def test_a_variable_without_its_properties_fails(breaking: Callable[[dict[str, Any]], None], problem: str) -> None:
    dashboard = copy.deepcopy(load())
    breaking(dashboard)
    assert any(problem in found for found in variable_problems(dashboard)), variable_problems(dashboard)


def test_the_usage_counters_are_read_over_several_refreshes() -> None:
    """The usage counters move once each `usage_interval`: a rate over less than a few of them (as
    `$__rate_interval` is, at a 30 s scrape) reads 0 between refreshes and a refresh's whole step
    at once."""
    from exporter.config.schema import BillingConfig

    refresh = BillingConfig.model_fields["usage_interval"].default
    seconds = {"s": 1, "m": 60, "h": 3600}
    windows = [
        (title, window)
        for title, target in targets(load())
        if "inference_usage_" in target["expr"]
        for window in re.findall(r"inference_usage_\w+_total\{[^}]*\}\[([^\]]+)\]", target["expr"])
    ]
    assert len(windows) >= 3  # the tokens (prompt and completion) and the requests
    for title, window in windows:
        assert re.fullmatch(r"\d+[smh]", window), f"{title}: {window}"
        assert int(window[:-1]) * seconds[window[-1]] >= 3 * refresh, f"{title}: {window}"


SUMMED = {
    "Daily payable amount this month, by endpoint": 15,
    "Daily payable amount this month, by billing item": 15,
    "Billed today, by endpoint": 15,
    "Estimated spend today, by endpoint and model": 27,
    "Tokens per second, by endpoint and model": 3,
    "Requests per second, by endpoint and model": 1.5,
}
"""The panels that add figures up, and their sum at 18m over `replicated_series`: what one exporter
shows (bills 10, estimated 18; tokens 2/s, requests 1/s) and what another job's shows (half as
much), added up."""


def replicated_series() -> list[dict[str, str]]:
    """An exporter of two replicas (job `ha`), which show the same account's figures, and another
    exporter (job `other`) of half as much, a sample a minute."""
    series = []
    for job, instance, scale in (("ha", "r1:9877", 2), ("ha", "r2:9877", 2), ("other", "o1:9877", 1)):
        target = f'job="{job}",instance="{instance}"'
        bill = f'{target},day="2026-11-22",period="2026-11",product="P",project_id="p"'
        usage = f'{target},endpoint_id="ep-{job}",model="m"'
        series += [
            {"series": f'inference_billing_today_info{{{target},day="2026-11-22",period="2026-11"}}', "values": "1x20"},
            {"series": f'inference_bill_endpoint_daily_payable_amount{{{bill},endpoint_id="ep-{job}"}}',
             "values": f"{5 * scale}x20"},
            {"series": f'inference_bill_item_daily_payable_amount{{{bill},item="ITEM_{job}"}}',
             "values": f"{5 * scale}x20"},
            {"series": f"inference_usage_estimated_payable_amount_total{{{usage}}}", "values": f"0+{scale / 2}x20"},
            {"series": f"inference_usage_prompt_tokens_total{{{usage}}}", "values": f"0+{30 * scale}x20"},
            {"series": f"inference_usage_completion_tokens_total{{{usage}}}", "values": f"0+{30 * scale}x20"},
            {"series": f"inference_usage_requests_total{{{usage}}}", "values": f"0+{30 * scale}x20"},
        ]  # fmt: skip
    return series


@pytest.mark.integration  # promtool
def test_the_replicas_of_one_exporter_are_counted_once(tmp_path: Path) -> None:
    """Two replicas watching one account (docs/deployment.md) show the same figures: a panel that
    adds figures up takes each exporter's once, with the dashboard's variables at All, as the
    alert rules do; two exporters (two jobs) are still added up."""
    promtool = require_binary("promtool")
    queries = {title: concrete(target["expr"]) for title, target in targets(load()) if title in SUMMED}
    assert set(queries) == set(SUMMED)
    tests = [
        {"expr": f"sum({expr})", "eval_time": "18m", "exp_samples": [{"labels": "{}", "value": SUMMED[title]}]}
        for title, expr in queries.items()
    ]
    (tmp_path / "rules.yml").write_text("groups: []\n")
    test_file = tmp_path / "test.yml"
    one = {"interval": "1m", "input_series": replicated_series(), "promql_expr_test": tests}
    test_file.write_text(yaml.safe_dump({"rule_files": ["rules.yml"], "tests": [one]}, sort_keys=False))
    result = subprocess.run([promtool, "test", "rules", str(test_file)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
