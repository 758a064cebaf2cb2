"""The YAML alert rules as a Prometheus alerting-rule file over this exporter's metrics.

For teams that evaluate in Prometheus. No date or month is baked into an expression: the
current day and period come from `inference_billing_today_info`, so the file stays right on
every later day. Budget tiers become one rule per tier, each true only up to the next tier,
which is how the lower tiers are inhibited.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Any
from zoneinfo import ZoneInfo

import yaml

from exporter.config.rules import AnomalyRule, BudgetRule, ThresholdRule
from exporter.config.schema import AlertsConfig, BudgetConfig
from exporter.model.signals import SIGNALS, NotExpressible, aggregate


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


def _own(query: str) -> str:
    """A template pipeline making `query` (with a `%q` for the job and one for the account) the
    alert's own exporter's series: another exporter with a budget of the same name has its own day
    and chance (`account=""` matches a series without the label)."""
    return f"printf `{query}` $labels.job $labels.account"


def budget_rules(rule: BudgetRule, budget: BudgetConfig, zone: ZoneInfo | None = None) -> list[dict[str, Any]]:
    """A rule per tier. `{crossing_day}` is read from the exporter's crossing series when Prometheus
    sends the alert, as the billing day (`zone`): its start moved to midday in that zone (Prometheus'
    templates know UTC only), so a change of the clocks cannot move it to another day."""
    entries = []
    offset = zone.utcoffset(dt.datetime.now(zone)) if zone is not None else None
    shift = int(offset.total_seconds() if offset is not None else 0) + 12 * 3600
    tiers = list(rule.tiers)
    forecast = rule.basis == "forecast"
    selector = f'{{budget="{budget.name}"}}'
    own = f'{{budget="{budget.name}",job=%q,account=%q}}'
    # Per exporter, as the signals are: a job's replicas tell the same ratio and count once, and the
    # alert keeps only `job` (and an account's `account`), not the target's other labels (`pod`...),
    # so that it outlives a pod restarted at another address.
    ratio = aggregate(f"inference_budget_{'forecast' if forecast else 'used'}_ratio{selector}", ("account",), "max")
    for index, tier in enumerate(tiers):
        expr = f"{ratio} >= {tier:g}"
        if index + 1 < len(tiers):
            expr += f" < {tiers[index + 1]:g}"
        # (templates Prometheus fills when it sends the alert, from the exporter's own series)
        crossing = _own(f"inference_budget_crossing_timestamp_seconds{own} + {shift}")
        day = '{{ (. | first | value | toTime).Format "2006-01-02" }}'
        chance = _own(f"inference_budget_crossing_probability{own}")
        fields = {
            "budget": budget.name,
            "tier": f"{tier:g}",
            "amount": f"{budget.amount:f}",
            "period": budget.period,
            "basis": rule.basis,
            "crossing_day": f"{{{{ with {crossing} | query }}}}{day}{{{{ else }}}}not this period{{{{ end }}}}",
            "chance": f"{{{{ with {chance} | query }}}}{{{{ . | first | value | humanizePercentage }}}}"
            "{{ else }}unknown{{ end }}",
        }
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


def rule_file(
    alerts: AlertsConfig, budgets: tuple[BudgetConfig, ...], zone: ZoneInfo | None = None
) -> tuple[str, list[str]]:
    """The rule file's YAML, and a note for each rule that could not be expressed; `zone`: the
    billing time zone, whose days `{crossing_day}` names."""
    entries: list[dict[str, Any]] = []
    skipped = []
    for index, rule in enumerate(alerts.rules):
        if isinstance(rule, BudgetRule):
            budget = next(b for b in budgets if b.name == rule.budget)
            entries.extend(budget_rules(rule, budget, zone))
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
