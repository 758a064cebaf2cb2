"""Every alert signal in one table: its labels, windows, how the exporter computes it, and the
PromQL that computes it over this exporter's metrics (or why none can).

Config validation, rule evaluation and the `rules` export all read `SIGNALS`; adding a signal is
one entry here (and its tests).

An evaluator returns one value per `by` group, or None for "no trustworthy data now" (the source's
last refresh failed, or its snapshot is from another day): the engine then keeps the rule's state
as it is, so a failing source never reads as zero spend.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from decimal import Decimal
from typing import TYPE_CHECKING, NamedTuple

from exporter.core.clock import Clock
from exporter.core.fields import in_scope, scope_values
from exporter.model.source_names import PROBE_PREFIX, probe_source

if TYPE_CHECKING:
    from exporter.config.rules import ThresholdRule
    from exporter.model.snapshots import DailyAmount, Latest, UsageTotals

Labels = tuple[tuple[str, str], ...]
"""Sorted (name, value) pairs: a group's identity."""
Values = dict[Labels, Decimal]
Where = Mapping[str, str | tuple[str, ...]]
TODAY = "inference_billing_today_info"
ACCOUNT = "account"
"""The label of an account's series with `accounts`: any signal may be grouped and scoped by it."""


class NotExpressible(Exception):
    """A rule that only the exporter can evaluate."""


class Context(NamedTuple):
    """What an evaluator reads: the snapshots, the billing calendar, the configured sources."""

    latest: Latest
    clock: Clock
    sources: tuple[str, ...]


class Signal(NamedTuple):
    labels: tuple[str, ...]
    """What `by` and `where` may name."""
    evaluate: Callable[[ThresholdRule, Context], Values | None]
    promql: Callable[[ThresholdRule], str]
    """The expression whose value is the signal per `by` group; raises NotExpressible if none can be."""
    windows: tuple[str, ...] = ("today",)
    counts: bool = False
    """Its figures count things (tokens, requests): whole numbers, shown without decimals."""
    needs: str = ""
    """A config section without which the signal can match nothing (`prices`, `probes`)."""
    combine: Callable[[Decimal, Decimal], Decimal] = Decimal.__add__
    """How one group's values in two accounts make the group's value across them (as the PromQL's
    aggregation does): summed, or the worst of them."""


# --- grouping -------------------------------------------------------------------------------


def fresh(latest: Latest, source: str) -> bool:
    """The source's last refresh succeeded: its snapshot may be judged."""
    health = latest.health.get(source)
    return health is not None and health.success


def todays_bills(latest: Latest, clock: Clock) -> bool:
    """The bills are fresh and of today's billing day: a judgement may be made on them."""
    bills = latest.bills
    return bills is not None and fresh(latest, "bills") and bills.today == clock.today()


def todays_history(latest: Latest, clock: Clock) -> bool:
    """The history was refreshed today (its baselines and per-endpoint items are the day's)."""
    return latest.history is not None and latest.history.as_of == clock.today()


def group_of(labels: Mapping[str, str], rule: ThresholdRule) -> Labels | None:
    """The group a series belongs to, or None when `where` excludes it."""
    if any(not in_scope(value, labels.get(name, "")) for name, value in rule.where.items()):
        return None
    return tuple(sorted((name, labels.get(name, "")) for name in rule.by))


def grouping(rule: ThresholdRule) -> Callable[[Mapping[str, str]], Labels | None]:
    """`group_of` for one rule, its names sorted once: for a rule over thousands of series."""
    names, where = sorted(rule.by), tuple(rule.where.items())

    def group(labels: Mapping[str, str]) -> Labels | None:
        if where and any(not in_scope(value, labels.get(name, "")) for name, value in where):
            return None
        return tuple([(name, labels.get(name, "")) for name in names])

    return group


def _sum(pairs: Iterable[tuple[Labels | None, Decimal]], rule: ThresholdRule) -> Values:
    groups: Values = {} if rule.by else {(): Decimal(0)}
    for group, value in pairs:
        if group is not None:
            groups[group] = groups.get(group, Decimal(0)) + value
    return groups


# --- PromQL ---------------------------------------------------------------------------------


def _matcher(name: str, value: str | tuple[str, ...]) -> str:
    """`name="value"`, or for a list `name=~"a|b"` (each value's regular-expression characters
    escaped); JSON's string escapes are valid PromQL ones."""
    if isinstance(value, str):
        return f"{name}={json.dumps(value)}"
    return f"{name}=~{json.dumps('|'.join(re.escape(v) for v in scope_values(value)))}"


def _matchers(where: Where) -> str:
    """`{name="value",...}`."""
    if not where:
        return ""
    return "{" + ",".join(_matcher(name, value) for name, value in sorted(where.items())) + "}"


TARGET = ("job", "instance")
"""The labels Prometheus gives each exporter it scrapes. Every expression sums each target's
figures apart, never two exporters' together, then keeps the job: the replicas of one exporter (a
job's instances, which tell the same figures) count once, and an alert keeps its labels when the
instance changes (a pod restarted at another address). Exporters of different accounts go in
different jobs, or in one exporter with `accounts`."""
_ON_TARGET = ", ".join(TARGET)


def aggregate(expression: str, by: tuple[str, ...], op: str = "sum") -> str:
    """`op` of `expression` per target and group, then the replicas' highest (`min`: their lowest)."""
    per_target = f"{op} by ({', '.join((*TARGET, *by))}) ({expression})"
    return f"{'min' if op == 'min' else 'max'} without (instance) ({per_target})"


def _today(on: str) -> str:
    """`and` the day's (`on="day"`) or the month's (`"period"`) series of each exporter."""
    return f"and on({_ON_TARGET}, {on}) {TODAY}"


def _metric(name: str, op: str = "sum") -> Callable[[ThresholdRule], str]:
    """PromQL for a signal that is one metric, aggregated per group."""
    return lambda rule: aggregate(f"{name}{_matchers(rule.where)}", rule.by, op)


# --- spend (bills) --------------------------------------------------------------------------


def _bill_key(rule: ThresholdRule) -> str:
    """Bills come by endpoint or by item: the rule's labels say which. A project is read from the
    lines by endpoint, as a budget's is (the lines by item carry none where the API is asked for
    every project)."""
    return "endpoint_id" if {"endpoint_id", "project_id"} & {*rule.by, *rule.where} else "item"


def _grouped(
    snapshot: object, kind: object, rule: ThresholdRule, series: Callable[[], Iterable[tuple[dict[str, str], Decimal]]]
) -> Values:
    """The `series` (each its labels and value) summed by the rule's groups, made once per snapshot
    (never changed: bills per refresh, usage per poll) for each `kind` of series and way of
    grouping, and kept on it: at 5,000 endpoints, ten rules by endpoint made 50,000 groups anew at
    every evaluation. Each caller gets a copy of its own (the groups themselves are shared)."""
    cache: dict[tuple[object, ...], Values] = snapshot.__dict__.setdefault("_grouped", {})
    shape = (kind, tuple(sorted(rule.by)), tuple(sorted(rule.where.items())))
    found = cache.get(shape)
    if found is None:
        group_of_labels = grouping(rule)
        found = cache[shape] = _sum(((group_of_labels(labels), value) for labels, value in series()), rule)
    return dict(found)


def spend(rule: ThresholdRule, context: Context) -> Values | None:
    bills, today = context.latest.bills, context.clock.today()
    if bills is None or not todays_bills(context.latest, context.clock):
        return None
    key = _bill_key(rule)

    def groups(month_index: int) -> Iterable[tuple[Labels | None, DailyAmount]]:
        month = bills.months[month_index]
        seen: dict[tuple[str, str, str], Labels | None] = {}  # (a group per endpoint or item, not per day)
        for a in month.by_endpoint if key == "endpoint_id" else month.by_item:
            labels = (a.key, a.product, a.project_id)
            if labels not in seen:
                seen[labels] = group_of({key: a.key, "product": a.product, "project_id": a.project_id}, rule)
            yield seen[labels], a

    if rule.window in ("today", "month"):
        month, day = bills.current, today if rule.window == "today" else None
        return _grouped(
            month,
            (key, day),
            rule,
            lambda: (
                ({key: k, "product": product, "project_id": project}, amount)
                for (k, product, project), amount in month.totals(key == "endpoint_id", day).items()
            ),
        )
    if not rule.by and not rule.where:  # the account's: the bills' own forecast, as its metric and PromQL read it
        return {(): bills.current.forecast}
    current: dict[Labels, list[DailyAmount]] = {} if rule.by else {(): []}
    for group, a in groups(0):
        if group is not None:
            current.setdefault(group, []).append(a)
    previous: dict[Labels, list[DailyAmount]] = {}
    for group, a in groups(1) if len(bills.months) > 1 else ():
        if group is not None:
            previous.setdefault(group, []).append(a)
    # (Imported here: the config's checks read SIGNALS, and `check` and `rules` load no snapshots.)
    from exporter.model.forecast import forecast
    from exporter.model.snapshots import per_day

    period = bills.current.period
    return {
        group: forecast(period, today, per_day(days), per_day(previous.get(group, [])) if previous else None)[0]
        for group, days in current.items()
    }


def spend_promql(rule: ThresholdRule) -> str:
    metric = f"inference_bill_{'endpoint' if _bill_key(rule) == 'endpoint_id' else 'item'}_daily_payable_amount"
    selector = _matchers(rule.where)
    if rule.window == "today":
        return aggregate(f"{metric}{selector} {_today('day')}", rule.by)
    if rule.window == "month":
        return aggregate(f"{metric}{selector} {_today('period')}", rule.by)
    if rule.by or rule.where:
        raise NotExpressible("a per-group month forecast is computed by the exporter only")
    return aggregate(f"inference_bill_month_forecast_payable_amount {_today('period')}", ())


# --- usage ----------------------------------------------------------------------------------


def _usage(value: Callable[[UsageTotals], Decimal | None]) -> Callable[[ThresholdRule, Context], Values | None]:
    """An evaluator over today's usage totals: `value` of each (endpoint, model[, api key]),
    summed by the rule's groups once per usage snapshot (`_grouped`)."""

    def evaluate(rule: ThresholdRule, context: Context) -> Values | None:
        snapshot = context.latest.usage
        if snapshot is None or not fresh(context.latest, "usage") or snapshot.day != context.clock.today():
            return None

        def series() -> Iterator[tuple[dict[str, str], Decimal]]:
            for key, totals in snapshot.totals.items():
                figure = value(totals)
                if figure is not None:
                    yield {"endpoint_id": key.endpoint_id, "model": key.model, "api_key": key.api_key}, figure

        return _grouped(snapshot, value, rule, series)

    return evaluate


def tokens_promql(rule: ThresholdRule) -> str:
    selector = _matchers(rule.where)
    prompt = aggregate(f"inference_usage_prompt_tokens_total{selector}", rule.by)
    completion = aggregate(f"inference_usage_completion_tokens_total{selector}", rule.by)
    return f"{prompt} + {completion}"


# --- the exporter's own health and the probes -------------------------------------------------


def data_age(rule: ThresholdRule, context: Context) -> Values:
    """Seconds since each source's last successful refresh (since start-up if it never had one, or
    since a reload added it or forgot its figures)."""
    now, latest = context.clock.now().timestamp(), context.latest
    groups: Values = {}
    for source in context.sources:
        health = latest.health.get(source)
        since = health.last_success if health and health.last_success is not None else latest.waiting_since(source)
        group = group_of({"source": source}, rule)
        if group is not None:
            groups[group] = max(groups.get(group, Decimal(0)), Decimal(str(round(now - since, 3))))
    return groups


def _probe(latency: bool) -> Callable[[ThresholdRule, Context], Values | None]:
    """The configured probes' last runs: latency (seconds, the worst in a group) or success (1/0,
    the worst in a group). With no probe configured any more, no group is left (its alerts
    resolve); with probes configured that have not run yet, there is nothing to judge."""

    def evaluate(rule: ThresholdRule, context: Context) -> Values | None:
        configured = {source for source in context.sources if source.startswith(PROBE_PREFIX)}
        runs = {n: s for n, s in context.latest.probes.items() if probe_source(n) in configured}
        if not runs:
            return None if configured else {}
        groups: Values = {}
        worst = max if latency else min
        for name, snapshot in runs.items():
            group = group_of({"probe": name, "endpoint_id": snapshot.endpoint_id, "scenario": snapshot.scenario}, rule)
            if group is None:
                continue
            value = Decimal(str(round(snapshot.last.duration, 6))) if latency else Decimal(int(snapshot.last.success))
            groups[group] = worst(groups[group], value) if group in groups else value
        return groups

    return evaluate


def data_age_promql(rule: ThresholdRule) -> str:
    """As `data_age`: a source that has not refreshed since the process started (no timestamp
    yet, its `refresh_success` 0) is as old as the process (client_python's `process_start_time_seconds`)."""
    matchers = _matchers(rule.where)
    since_start = (
        f"inference_exporter_refresh_success{matchers} * 0 + on({_ON_TARGET}) group_left process_start_time_seconds"
    )
    age = f"time() - (inference_exporter_last_refresh_success_timestamp_seconds{matchers} or {since_start})"
    return aggregate(age, rule.by, "max")


# --- reconciliation ---------------------------------------------------------------------------


def reconciliation_gap(rule: ThresholdRule, context: Context) -> Values | None:
    """Each group's absolute gap ratio on its last settled day with a figure: tokens per item (the
    largest, without `by`), or amounts per endpoint when the rule names `endpoint_id`. A bill for
    what nothing counted (no ratio) is a gap of 1: all of it unexplained."""
    result = context.latest.reconciliation
    if result is None or not fresh(context.latest, "bills"):
        return None
    if "endpoint_id" in {*rule.by, *rule.where}:
        figures = [(a.day, {"endpoint_id": a.endpoint_id}, a.ratio) for a in result.amounts]
    else:
        figures = [(g.day, {"item": g.item}, g.ratio) for g in result.tokens]
    last: dict[tuple[str, ...], dt.date] = {}
    for day, labels, _ in figures:
        key = tuple(labels.values())
        last[key] = max(last.get(key, day), day)
    groups: Values = {}
    for day, labels, gap in figures:
        group = group_of(labels, rule)
        if group is not None and day == last[tuple(labels.values())]:
            value = Decimal(1) if gap is None else abs(gap)
            groups[group] = max(groups.get(group, Decimal(0)), value)
    return groups


def reconciliation_promql(rule: ThresholdRule) -> str:
    raise NotExpressible("which day has settled is known to the exporter only")


USAGE_LABELS = ("endpoint_id", "model", "api_key")
PROBE_LABELS = ("probe", "endpoint_id", "scenario")

SIGNALS: dict[str, Signal] = {
    "spend": Signal(
        labels=("endpoint_id", "item", "product", "project_id"),
        evaluate=spend,
        promql=spend_promql,
        windows=("today", "month", "month_forecast"),
    ),
    "estimated_spend": Signal(
        labels=USAGE_LABELS,
        evaluate=_usage(lambda t: t.estimated_payable),
        promql=_metric("inference_usage_estimated_payable_amount_total"),
        needs="prices",
    ),
    "tokens": Signal(
        labels=USAGE_LABELS,
        evaluate=_usage(lambda t: Decimal(t.prompt_tokens + t.completion_tokens)),
        promql=tokens_promql,
        counts=True,
    ),
    "requests": Signal(
        labels=USAGE_LABELS,
        evaluate=_usage(lambda t: Decimal(t.requests)),
        promql=_metric("inference_usage_requests_total"),
        counts=True,
    ),
    "probe_latency": Signal(
        labels=PROBE_LABELS,
        evaluate=_probe(latency=True),
        promql=_metric("inference_probe_duration_seconds", "max"),
        needs="probes",
        combine=max,
    ),
    "probe_success": Signal(
        labels=PROBE_LABELS,
        evaluate=_probe(latency=False),
        promql=_metric("inference_probe_success", "min"),
        needs="probes",
        combine=min,
    ),
    "data_age": Signal(labels=("source",), evaluate=data_age, promql=data_age_promql, combine=max),
    "reconciliation_gap": Signal(
        labels=("item", "endpoint_id"), evaluate=reconciliation_gap, promql=reconciliation_promql, combine=max
    ),
}
"""The signals a threshold rule may name, by name."""


def evaluate(rule: ThresholdRule, latest: Latest, clock: Clock, sources: Iterable[str]) -> Values | None:
    """The rule's signal per group, or None when the data cannot be trusted right now."""
    return SIGNALS[rule.signal].evaluate(rule, Context(latest, clock, tuple(sources)))


class Account(NamedTuple):
    """What a rule is evaluated on in one account: its name (the `account` label; empty for the one
    account of a config without `accounts`), its snapshots and its configured sources."""

    name: str
    latest: Latest
    sources: Callable[[], Iterable[str]]


def evaluate_accounts(rule: ThresholdRule, accounts: Iterable[Account], clock: Clock) -> tuple[Values, set[str]] | None:
    """The rule's signal per group across the accounts its `where` lets through, as its PromQL
    aggregates their series: a group is labelled with its account when `by` names `account`, and
    else combines the accounts' values (`Signal.combine`). Also the accounts whose data cannot be
    trusted right now (their groups are unknown: their alerts keep their state). None when the
    whole is unknown: an account that cannot be trusted is part of every group not split by account."""
    signal = SIGNALS[rule.signal]
    split = ACCOUNT in rule.by
    wanted = rule.where.get(ACCOUNT)
    inner = rule
    if split or wanted is not None:
        inner = rule.model_copy(
            update={
                "by": tuple(n for n in rule.by if n != ACCOUNT),
                "where": {k: v for k, v in rule.where.items() if k != ACCOUNT},
            }
        )
    values: Values = {}
    unknown: set[str] = set()
    evaluated = False
    for account in accounts:
        if not in_scope(wanted, account.name):
            continue
        evaluated = True
        found = signal.evaluate(inner, Context(account.latest, clock, tuple(account.sources())))
        if found is None:
            if not split:
                return None
            unknown.add(account.name)
            continue
        for group, value in found.items():
            if split:
                group = tuple(sorted((*group, (ACCOUNT, account.name))))
            values[group] = signal.combine(values[group], value) if group in values else value
    if not evaluated and not rule.by and signal.combine is Decimal.__add__:
        values[()] = Decimal(0)  # (no account in scope: nothing spent, as a sum over no series)
    return values, unknown
