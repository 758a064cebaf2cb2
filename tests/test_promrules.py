"""`rules`: the YAML alert rules as a Prometheus rule file, checked and unit-tested by the real promtool."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from exporter.alerts.promrules import rule_file
from exporter.config.load import validate
from tests.conftest import require_binary

pytestmark = pytest.mark.integration  # every test runs promtool

BILLING = {"url": "http://127.0.0.1:1", "access_key_id": "AK", "secret_access_key": "s"}
RULES = [
    {"alert": "EndpointDailySpendHigh", "signal": "spend", "window": "today", "by": ["endpoint_id"], "op": ">",
     "threshold": "50", "for": "5m", "labels": {"severity": "warning"},
     "annotations": {"summary": "{endpoint_id} spent {value} today (over {threshold})"}},
    {"alert": "ItemMonthSpend", "signal": "spend", "window": "month", "by": ["item"], "threshold": 1000},
    {"alert": "MonthForecast", "signal": "spend", "window": "month_forecast", "threshold": 9000,
     "keep_firing_for": "10m"},
    {"alert": "ForecastPerEndpoint", "signal": "spend", "window": "month_forecast", "by": ["endpoint_id"],
     "threshold": 1},
    {"alert": "EstimatedSpend", "signal": "estimated_spend", "by": ["model"], "threshold": 5},
    {"alert": "Tokens", "signal": "tokens", "where": {"model": 'we"ird\\name'}, "threshold": 1e6},
    {"alert": "Requests", "signal": "requests", "by": ["endpoint_id", "model"], "op": ">=", "threshold": 100000},
    {"alert": "ProbeSlow", "signal": "probe_latency", "by": ["probe"], "threshold": "2.5"},
    {"alert": "ProbeDown", "signal": "probe_success", "by": ["probe"], "op": "<", "threshold": 1, "for": "3m"},
    {"alert": "StaleData", "signal": "data_age", "by": ["source"], "threshold": 1800},
    {"alert": "MonthlyBudget", "budget": "monthly", "tiers": [0.5, 0.8, 1.0], "labels": {"severity": "critical"}},
    {"alert": "MonthlyBudgetForecast", "budget": "monthly", "tiers": [1.0], "basis": "forecast",
     "annotations": {"description": "crossed on {crossing_day} ({chance} chance)"}},
]  # fmt: skip


def generated(tmp_path: Path) -> tuple[Path, list[str]]:
    config = validate(
        {
            "billing": BILLING,
            "prices": [{"model": "m", "prompt_per_million": 1, "completion_per_million": 2}],
            "budgets": [{"name": "monthly", "amount": "5000"}],
            "inference": {"url": "https://api.example.com", "api_key": "k"},
            "probes": [{"name": "chat-prod", "model": "ep-1"}],
            "alerts": {"rules": RULES},
        },
        {},
    )
    text, skipped = rule_file(config.alerts, config.budgets, config.billing.zone)
    path = tmp_path / "rules.yml"
    path.write_text(text)
    return path, skipped


def passes_promtool_test(promtool: str, rules: Path, series: list, expected: list) -> None:
    """`promtool test rules` passes on `rules` fed `series` (a sample a minute) with `expected` (its
    `alert_rule_test`)."""
    one = {"interval": "1m", "input_series": series, "alert_rule_test": expected}
    tests = {"rule_files": [rules.name], "evaluation_interval": "1m", "tests": [one]}
    (test_file := rules.with_name("rules_test.yml")).write_text(yaml.safe_dump(tests, sort_keys=False))
    result = subprocess.run([promtool, "test", "rules", str(test_file)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_signal_becomes_a_rule_promtool_accepts(tmp_path: Path) -> None:
    promtool = require_binary("promtool")
    path, skipped = generated(tmp_path)
    assert skipped == [
        "alerts.rules[3] (ForecastPerEndpoint): skipped: a per-group month forecast is computed by the exporter only"
    ]
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 13 rules found" in result.stdout
    rules = yaml.safe_load(path.read_text())["groups"][0]["rules"]
    assert all("2026" not in rule["expr"] for rule in rules)  # no date or month baked in
    tokens = next(rule for rule in rules if rule["alert"] == "Tokens")
    weird = '{model="we\\"ird\\\\name"}'
    prompt, completion = (
        f"max without (instance) (sum by (job, instance) (inference_usage_{kind}_tokens_total{weird}))"
        for kind in ("prompt", "completion")
    )
    assert tokens["expr"] == f"{prompt} + {completion} > 1000000"


def test_promtool_unit_tests_prove_the_rules_fire(tmp_path: Path) -> None:
    promtool = require_binary("promtool")
    path, _ = generated(tmp_path)
    labels = 'product="PRODUCT_INFERENCE_ENDPOINT",project_id="p",period="2026-11"'

    def bill(day: str, endpoint: str, values: str) -> dict[str, str]:
        name = "inference_bill_endpoint_daily_payable_amount"
        return {"series": f'{name}{{day="{day}",endpoint_id="{endpoint}",{labels}}}', "values": values}

    series = [
        {"series": 'inference_budget_used_ratio{budget="monthly"}', "values": "0.3 0.4 0.6 0.85 0.9 1.2"},
        {"series": 'inference_budget_forecast_ratio{budget="monthly"}', "values": "0.9 0.95 1.05x8"},
        {"series": 'inference_budget_crossing_timestamp_seconds{budget="monthly"}',
         "values": "_ _ 1795363200x8"},
        {"series": 'inference_budget_crossing_probability{budget="monthly"}', "values": "0.2 0.4 0.7x8"},
        {"series": 'inference_billing_today_info{day="2026-11-22",period="2026-11"}', "values": "1x10"},
        bill("2026-11-21", "a", "100x10"),
        bill("2026-11-22", "a", "60x10"),
        bill("2026-11-21", "b", "100x10"),  # yesterday's spend must not count today
        bill("2026-11-22", "b", "10x10"),
    ]  # fmt: skip
    expected = [
        {"eval_time": "1m", "alertname": "MonthlyBudget", "exp_alerts": []},
        {"eval_time": "2m", "alertname": "MonthlyBudget", "exp_alerts": [
            {"exp_labels": {"severity": "critical", "budget": "monthly", "tier": "0.5"},
             "exp_annotations": {"summary": "Budget monthly is at 60%: tier 0.5 crossed"}}]},
        {"eval_time": "4m", "alertname": "MonthlyBudget", "exp_alerts": [
            {"exp_labels": {"severity": "critical", "budget": "monthly", "tier": "0.8"},
             "exp_annotations": {"summary": "Budget monthly is at 90%: tier 0.8 crossed"}}]},
        {"eval_time": "1m", "alertname": "MonthlyBudgetForecast", "exp_alerts": []},
        {"eval_time": "2m", "alertname": "MonthlyBudgetForecast", "exp_alerts": [
            {"exp_labels": {"budget": "monthly", "tier": "1", "basis": "forecast"},
             "exp_annotations": {"summary": "Budget monthly is forecast at 105%: tier 1 crossed",
                                 "description": "crossed on 2026-11-23 (70% chance)"}}]},
        {"eval_time": "4m", "alertname": "EndpointDailySpendHigh", "exp_alerts": []},
        {"eval_time": "5m", "alertname": "EndpointDailySpendHigh", "exp_alerts": [
            {"exp_labels": {"severity": "warning", "endpoint_id": "a"},
             "exp_annotations": {"summary": "a spent 60 today (over 50)"}}]},
    ]  # fmt: skip
    passes_promtool_test(promtool, path, series, expected)


def test_exporters_are_judged_apart_and_the_replicas_of_one_count_once(tmp_path: Path) -> None:
    """Three jobs in one Prometheus: two replicas of one exporter (each 60 spent today on endpoint a,
    over 50: one alert, without `instance`); two exporters of another job each 30 (never added up
    into 60); and an exporter whose pod restarted at another address at 20m (the same alert goes on
    firing, its `for` not started again)."""
    promtool = require_binary("promtool")
    path, _ = generated(tmp_path)
    labels = 'product="PRODUCT_INFERENCE_ENDPOINT",project_id="p",period="2026-11",day="2026-11-22"'

    def exporter(job: str, instance: str, values: str) -> list[dict[str, str]]:
        target = f'job="{job}",instance="{instance}"'
        return [
            {"series": f'inference_billing_today_info{{{target},day="2026-11-22",period="2026-11"}}',
             "values": re.sub(r"(?<![x\d])\d+", "1", values)},  # (present while the bill is)
            {"series": f'inference_bill_endpoint_daily_payable_amount{{{target},endpoint_id="a",{labels}}}',
             "values": values},
        ]  # fmt: skip

    def firing(job: str) -> dict[str, object]:
        return {"exp_labels": {"severity": "warning", "endpoint_id": "a", "job": job},
                "exp_annotations": {"summary": "a spent 60 today (over 50)"}}  # fmt: skip

    series = [
        *exporter("replicas", "r1:9877", "60x30"), *exporter("replicas", "r2:9877", "60x30"),
        *exporter("apart", "a1:9877", "30x30"), *exporter("apart", "a2:9877", "30x30"),
        *exporter("restarted", "10.0.0.1:9877", "60x19"), *exporter("restarted", "10.0.0.2:9877", "_x20 60x10"),
        *({"series": f'inference_budget_used_ratio{{job="replicas",instance="{r}",budget="monthly"}}',
           "values": "0.9x30"} for r in ("r1:9877", "r2:9877")),
    ]  # fmt: skip
    expected = [
        {"eval_time": "15m", "alertname": "EndpointDailySpendHigh",
         "exp_alerts": [firing("replicas"), firing("restarted")]},
        {"eval_time": "22m", "alertname": "EndpointDailySpendHigh",  # (a `for` of 5m started again at 20m: not yet)
         "exp_alerts": [firing("replicas"), firing("restarted")]},
        {"eval_time": "27m", "alertname": "EndpointDailySpendHigh",
         "exp_alerts": [firing("replicas"), firing("restarted")]},  # (10.0.0.1's samples gone since 24m)
        {"eval_time": "5m", "alertname": "MonthlyBudget", "exp_alerts": [
            {"exp_labels": {"severity": "critical", "budget": "monthly", "tier": "0.8", "job": "replicas"},
             "exp_annotations": {"summary": "Budget monthly is at 90%: tier 0.8 crossed"}}]},
    ]  # fmt: skip
    passes_promtool_test(promtool, path, series, expected)


def test_budget_alerts_are_one_per_exporter_without_the_targets_labels_and_tell_their_own_crossing(
    tmp_path: Path,
) -> None:
    """As a ServiceMonitor scrapes them: each sample carries `pod` (and `instance`) beside `job`. Two
    replicas of one exporter, one of them restarted as another pod at 10m, make one alert all along,
    labelled with the job only; another job with a budget of the same name, crossing on another day
    at another chance, has its own alert, and each alert's annotations tell its own exporter's day and
    chance."""
    promtool = require_binary("promtool")
    path, _ = generated(tmp_path)

    def exporter(job: str, pod: str, samples: str, ratio: float, crossing: int, chance: float) -> list[dict[str, str]]:
        """The pod's budget series, each `samples` (e.g. `{}x9 _x11`) of its value."""
        target = f'job="{job}",instance="{pod}.ns:9877",pod="{pod}",budget="monthly"'
        return [
            {"series": f"inference_budget_forecast_ratio{{{target}}}", "values": samples.format(ratio)},
            {"series": f"inference_budget_crossing_timestamp_seconds{{{target}}}", "values": samples.format(crossing)},
            {"series": f"inference_budget_crossing_probability{{{target}}}", "values": samples.format(chance)},
        ]

    day = 1795363200  # (2026-11-22 16:00 UTC: the start of 2026-11-23 in Shanghai)
    series = [
        *exporter("costs", "ice-a", "{}x20", 1.05, day, 0.7),
        *exporter("costs", "ice-b", "{}x9 _x11", 1.05, day, 0.7),
        *exporter("costs", "ice-c", "_x9 {}x11", 1.05, day, 0.7),  # (ice-b restarted as ice-c)
        *exporter("staging", "st-a", "{}x20", 1.2, day + 2 * 86400, 0.9),
    ]

    def firing(job: str, crossed: str, chance: str, value: str) -> dict[str, object]:
        return {"exp_labels": {"budget": "monthly", "tier": "1", "basis": "forecast", "job": job},
                "exp_annotations": {"summary": f"Budget monthly is forecast at {value}: tier 1 crossed",
                                    "description": f"crossed on {crossed} ({chance} chance)"}}  # fmt: skip

    alerts = [firing("costs", "2026-11-23", "70%", "105%"), firing("staging", "2026-11-25", "90%", "120%")]
    expected = [{"eval_time": f"{minute}m", "alertname": "MonthlyBudgetForecast", "exp_alerts": alerts}
                for minute in (2, 9, 10, 15)]  # fmt: skip
    passes_promtool_test(promtool, path, series, expected)


def test_a_source_that_has_not_refreshed_since_the_exporter_started_is_as_old_as_the_exporter(tmp_path: Path) -> None:
    """As the exporter judges `data_age` itself: a pod restarted while the API refuses its key shows
    no last-success timestamp for the bills, only their `refresh_success` 0; the rule still fires
    once the process is older than the threshold. Usage, refreshed every minute, never does."""
    promtool = require_binary("promtool")
    path, _ = generated(tmp_path)
    target = 'job="exporter",instance="10.0.0.1:9877"'
    series = [
        {"series": f"process_start_time_seconds{{{target}}}", "values": "0x45"},  # (started at 0)
        {"series": f'inference_exporter_refresh_success{{{target},source="bills"}}', "values": "0x45"},
        {"series": f'inference_exporter_refresh_success{{{target},source="usage"}}', "values": "1x45"},
        {"series": f'inference_exporter_last_refresh_success_timestamp_seconds{{{target},source="usage"}}',
         "values": "0+60x45"},
    ]  # fmt: skip
    expected = [
        {"eval_time": "25m", "alertname": "StaleData", "exp_alerts": []},
        {"eval_time": "31m", "alertname": "StaleData", "exp_alerts": [
            {"exp_labels": {"source": "bills", "job": "exporter"},
             "exp_annotations": {"summary": "StaleData: data_age 1860 > 1800"}}]},  # (31 minutes: since start)
    ]  # fmt: skip
    passes_promtool_test(promtool, path, series, expected)


def test_rules_over_several_accounts_select_and_group_as_the_exporter_does(tmp_path: Path) -> None:
    """`by: [account]` and a list in `where` (a value with a regular expression's characters in it)."""
    promtool = require_binary("promtool")
    rule = {"alert": "TeamSpend", "signal": "spend", "window": "today", "by": ["account", "endpoint_id"],
            "where": {"endpoint_id": ["a", "b-1.x"], "account": ["prod", "lab"]}, "threshold": 50}  # fmt: skip
    config = validate(
        {
            "accounts": [{"name": n, "billing": BILLING} for n in ("prod", "staging", "lab")],
            "alerts": {"rules": [rule]},
        },
        {},
    )
    text, skipped = rule_file(config.alerts, config.budgets)
    assert skipped == []
    (path := tmp_path / "rules.yml").write_text(text)
    labels = 'product="PRODUCT_INFERENCE_ENDPOINT",project_id="p",period="2026-11",day="2026-11-22"'

    def bill(account: str, endpoint: str, value: int) -> dict[str, str]:
        name = "inference_bill_endpoint_daily_payable_amount"
        return {"series": f'{name}{{account="{account}",endpoint_id="{endpoint}",{labels}}}', "values": f"{value}x5"}

    series = [
        {"series": 'inference_billing_today_info{day="2026-11-22",period="2026-11"}', "values": "1x5"},
        bill("prod", "a", 60), bill("prod", "b-1.x", 70), bill("prod", "b-1yx", 90),  # `.` is no wildcard
        bill("staging", "a", 80),  # not an account the rule names
        bill("lab", "a", 40),  # under the threshold
    ]  # fmt: skip
    expected = [{"eval_time": "2m", "alertname": "TeamSpend", "exp_alerts": [
        {"exp_labels": {"account": "prod", "endpoint_id": "a"},
         "exp_annotations": {"summary": "TeamSpend: spend 60 > 50"}},
        {"exp_labels": {"account": "prod", "endpoint_id": "b-1.x"},
         "exp_annotations": {"summary": "TeamSpend: spend 70 > 50"}},
    ]}]  # fmt: skip
    passes_promtool_test(promtool, path, series, expected)
