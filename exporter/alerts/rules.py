"""A rule's signal, computed from the current snapshots: one value per `by` group.

`None` means "no trustworthy data now" (the source's last refresh failed, or its snapshot is
from another day): the engine then keeps the rule's state as it is, so a failing source never
reads as zero spend.
"""

from __future__ import annotations

import datetime as dt
import operator
from collections.abc import Callable, Iterable, Mapping
from decimal import Decimal

from exporter.bills import forecast, per_day
from exporter.clock import Clock
from exporter.collectors import budget_status
from exporter.config import BudgetConfig, RuleConfig
from exporter.snapshots import PROBE_PREFIX, DailyAmount, Latest, UsageTotals, probe_source

Labels = tuple[tuple[str, str], ...]
"""Sorted (name, value) pairs: a group's identity."""

COMPARE: dict[str, Callable[[Decimal, Decimal], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
}


def _fresh(latest: Latest, source: str) -> bool:
    health = latest.health.get(source)
    return health is not None and health.success


def _group(labels: Mapping[str, str], rule: RuleConfig) -> Labels | None:
    """The group a series belongs to, or None when `where` excludes it."""
    if any(labels.get(name) != value for name, value in rule.where.items()):
        return None
    return tuple(sorted((name, labels.get(name, "")) for name in rule.by))


def _sum(pairs: Iterable[tuple[Labels | None, Decimal]], rule: RuleConfig) -> dict[Labels, Decimal]:
    groups: dict[Labels, Decimal] = {} if rule.by else {(): Decimal(0)}
    for group, value in pairs:
        if group is not None:
            groups[group] = groups.get(group, Decimal(0)) + value
    return groups


def _amount_labels(amount: DailyAmount, key: str) -> dict[str, str]:
    return {key: amount.key, "product": amount.product, "project_id": amount.project_id}


def spend(rule: RuleConfig, latest: Latest, today: dt.date) -> dict[Labels, Decimal] | None:
    bills = latest.bills
    if bills is None or not _fresh(latest, "bills") or bills.today != today:
        return None
    by_endpoint = "endpoint_id" in {*rule.by, *rule.where}
    key = "endpoint_id" if by_endpoint else "item"
    month = bills.current

    def amounts(month_index: int) -> tuple[DailyAmount, ...]:
        chosen = bills.months[month_index]
        return chosen.by_endpoint if by_endpoint else chosen.by_item

    if rule.window == "today":
        return _sum(((_group(_amount_labels(a, key), rule), a.payable) for a in amounts(0) if a.day == today), rule)
    if rule.window == "month":
        return _sum(((_group(_amount_labels(a, key), rule), a.payable) for a in amounts(0)), rule)
    # month_forecast: the bills forecast, per group
    current: dict[Labels, list[DailyAmount]] = {} if rule.by else {(): []}
    for a in amounts(0):
        group = _group(_amount_labels(a, key), rule)
        if group is not None:
            current.setdefault(group, []).append(a)
    previous: dict[Labels, list[DailyAmount]] = {}
    if len(bills.months) > 1:
        for a in amounts(1):
            group = _group(_amount_labels(a, key), rule)
            if group is not None:
                previous.setdefault(group, []).append(a)
    return {
        group: forecast(month.period, today, per_day(days), per_day(previous.get(group, [])) if previous else None)[0]
        for group, days in current.items()
    }


def _usage_value(signal: str, totals: UsageTotals) -> Decimal | None:
    if signal == "estimated_spend":
        return totals.estimated_payable
    if signal == "tokens":
        return Decimal(totals.prompt_tokens + totals.completion_tokens)
    return Decimal(totals.requests)


def usage(rule: RuleConfig, latest: Latest, today: dt.date) -> dict[Labels, Decimal] | None:
    snapshot = latest.usage
    if snapshot is None or not _fresh(latest, "usage") or snapshot.day != today:
        return None
    pairs = []
    for key, totals in snapshot.totals.items():
        value = _usage_value(rule.signal or "", totals)
        if value is not None:
            labels = {"endpoint_id": key.endpoint_id, "model": key.model, "api_key": key.api_key}
            pairs.append((_group(labels, rule), value))
    return _sum(pairs, rule)


def data_age(rule: RuleConfig, latest: Latest, now: float, sources: Iterable[str]) -> dict[Labels, Decimal]:
    """Seconds since each source's last successful refresh (since start-up if it never had one)."""
    groups: dict[Labels, Decimal] = {}
    for source in sources:
        health = latest.health.get(source)
        since = health.last_success if health and health.last_success is not None else latest.started
        group = _group({"source": source}, rule)
        if group is not None:
            groups[group] = max(groups.get(group, Decimal(0)), Decimal(str(round(now - since, 3))))
    return groups


def evaluate(rule: RuleConfig, latest: Latest, clock: Clock, sources: Iterable[str]) -> dict[Labels, Decimal] | None:
    """The signal's value per group, or None when the data cannot be trusted right now."""
    today = clock.today()
    if rule.signal == "spend":
        return spend(rule, latest, today)
    if rule.signal in ("estimated_spend", "tokens", "requests"):
        return usage(rule, latest, today)
    if rule.signal == "data_age":
        return data_age(rule, latest, clock.now().timestamp(), sources)
    return probe(rule, latest, sources)


def probe(rule: RuleConfig, latest: Latest, sources: Iterable[str]) -> dict[Labels, Decimal] | None:
    """The configured probes' last runs: latency (seconds, the worst in a group) or success (1/0,
    the worst in a group). With no probe configured any more, no group is left (its alerts
    resolve); with probes configured that have not run yet, there is nothing to judge."""
    configured = {source for source in sources if source.startswith(PROBE_PREFIX)}
    runs = {name: snapshot for name, snapshot in latest.probes.items() if probe_source(name) in configured}
    if not runs:
        return None if configured else {}
    groups: dict[Labels, Decimal] = {}
    latency = rule.signal == "probe_latency"
    for name, snapshot in runs.items():
        group = _group({"probe": name, "endpoint_id": snapshot.endpoint_id, "scenario": snapshot.scenario}, rule)
        if group is None:
            continue
        value = Decimal(str(round(snapshot.last.duration, 6))) if latency else Decimal(int(snapshot.last.success))
        worst = max if latency else min
        groups[group] = worst(groups[group], value) if group in groups else value
    return groups


def budget_ratio(budget: BudgetConfig, latest: Latest, clock: Clock) -> tuple[str, Decimal] | None:
    """The budget's period key (`2026-11` or `2026-11-22`) and the share of it used, from fresh bills
    of today only (what the metrics show may be older)."""
    bills = latest.bills
    today = clock.today()
    if bills is None or not _fresh(latest, "bills") or bills.today != today:
        return None
    ((_, ratios),) = budget_status(latest, [budget])
    assert ratios is not None
    return (bills.current.period if budget.period == "month" else today.isoformat()), ratios[0]
