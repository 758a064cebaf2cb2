"""The YAML alert rules as a Prometheus alerting-rule file over this exporter's metrics.

For teams that evaluate in Prometheus. No date or month is baked into an expression: the
current day and period come from `inference_billing_today_info`, so the file stays right on
every later day. Budget tiers become one rule per tier, each true only up to the next tier,
which is how the lower tiers are inhibited.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from exporter.config.rules import AnomalyRule, BudgetRule, ThresholdRule
from exporter.config.schema import AlertsConfig, BudgetConfig
from exporter.model.signals import SIGNALS, NotExpressible


def expression(rule: ThresholdRule) -> str:
    """PromQL whose value is the rule's signal, per `by` group (NotExpressible if none can be)."""
    return SIGNALS[rule.signal].promql(rule)


def _template(text: str) -> str:
    """`{value}` → `{{ $value }}`, `{label}` → `{{ $labels.label }}`; `{threshold}` etc. are filled in."""
    return re.sub(r"\{(\w+)\}", lambda m: "{{ $value }}" if m[1] == "value" else f"{{{{ $labels.{m[1]} }}}}", text)


def _duration(seconds: float) -> str:
    return f"{int(seconds)}s" if seconds == int(seconds) else f"{int(seconds * 1000)}ms"


def signal_rule(rule: ThresholdRule) -> dict[str, Any]:
    threshold = f"{rule.threshold.normalize():f}"
    entry: dict[str, Any] = {"alert": rule.alert, "expr": f"{expression(rule)} {rule.op} {threshold}"}
    if rule.for_:
        entry["for"] = _duration(rule.for_)
    if rule.keep_firing_for:
        entry["keep_firing_for"] = _duration(rule.keep_firing_for)
    if rule.labels:
        entry["labels"] = dict(rule.labels)
    default = f"{rule.alert}: {rule.signal} {{{{ $value }}}} {rule.op} {threshold}"
    annotations = {"summary": default} | {
        name: _template(template.replace("{threshold}", threshold)) for name, template in rule.annotations.items()
    }
    entry["annotations"] = annotations
    return entry


def budget_rules(rule: BudgetRule, budget: BudgetConfig) -> list[dict[str, Any]]:
    entries = []
    tiers = list(rule.tiers)
    forecast = rule.basis == "forecast"
    selector = f'{{budget="{budget.name}"}}'
    for index, tier in enumerate(tiers):
        ratio = f"inference_budget_{'forecast' if forecast else 'used'}_ratio{selector}"
        expr = f"{ratio} >= {tier:g}"
        if index + 1 < len(tiers):
            expr += f" < {tiers[index + 1]:g}"
        fields = {"budget": budget.name, "tier": f"{tier:g}", "amount": f"{budget.amount:f}", "period": budget.period,
                  "basis": rule.basis,
                  # (templates Prometheus fills when it sends the alert, from the exporter's own series)
                  "crossing_day": f"{{{{ with query `inference_budget_crossing_timestamp_seconds{selector}` }}}}"
                                  '{{ . | first | value | humanizeTimestamp }}{{ else }}not this period{{ end }}',
                  "chance": f"{{{{ with query `inference_budget_crossing_probability{selector}` }}}}"
                            '{{ . | first | value | humanizePercentage }}{{ else }}unknown{{ end }}'}  # fmt: skip
        summary = f"Budget {budget.name} is {'forecast ' if forecast else ''}at {{{{ $value | humanizePercentage }}}}"
        annotations = {"summary": f"{summary}: tier {tier:g} crossed"}
        for name, template in rule.annotations.items():
            filled = template
            for field, value in fields.items():
                filled = filled.replace(f"{{{field}}}", value)
            annotations[name] = _template(filled)
        entries.append(
            {
                "alert": rule.alert,
                "expr": expr,
                "labels": {**rule.labels, "budget": budget.name, "tier": f"{tier:g}"}
                | ({"basis": rule.basis} if forecast else {}),
                "annotations": annotations,
            }
        )
    return entries


def rule_file(alerts: AlertsConfig, budgets: tuple[BudgetConfig, ...]) -> tuple[str, list[str]]:
    """The rule file's YAML, and a note for each rule that could not be expressed."""
    entries: list[dict[str, Any]] = []
    skipped = []
    for index, rule in enumerate(alerts.rules):
        if isinstance(rule, BudgetRule):
            budget = next(b for b in budgets if b.name == rule.budget)
            entries.extend(budget_rules(rule, budget))
            continue
        if isinstance(rule, AnomalyRule):
            skipped.append(
                f"alerts.rules[{index}] ({rule.alert}): skipped: a spend anomaly is judged by the exporter only "
                "(its baseline needs the months of history it keeps; alert on its own notifications, or on "
                "inference_spend_anomaly_impact_amount)"
            )
            continue
        try:
            entries.append(signal_rule(rule))
        except NotExpressible as reason:
            skipped.append(f"alerts.rules[{index}] ({rule.alert}): skipped: {reason}")
    group = {"name": "inference-cost-exporter", "interval": _duration(alerts.evaluation_interval), "rules": entries}
    return yaml.safe_dump({"groups": [group]}, sort_keys=False, allow_unicode=True), skipped
