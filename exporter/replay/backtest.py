"""Replay the bill-based rules over past months: what would have fired, and when.

Every rule the daemon judges from bills (`spend` thresholds, budgets with their tiers and
`spend_anomaly`) runs through the daemon's own alert engine, day by day, on the bills as they
stood at the end of each day (every day's final amounts: revisions made later are in them) and the
months of history the daemon would have held before it. Each day is evaluated twice, a rule's
longest `for` apart, ending on the day's last second, so a rule with a `for` fires on the day its
condition held all evening. A `spend_anomaly` of a day is judged on the next one, as the daemon
does; its `day` label says which day it is about.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, closing, contextmanager, nullcontext
from dataclasses import dataclass, replace
from types import MappingProxyType

from exporter.alerts.alert import Alert
from exporter.alerts.engine import Engine, Watched
from exporter.billing import BillingAPI, BillingClient
from exporter.config.rules import AnomalyRule, BudgetRule, ThresholdRule, rule_ids
from exporter.config.schema import AlertsConfig, BillingConfig, BudgetConfig, Config
from exporter.core.clock import (
    Clock,
    FrozenClock,
    days_in_period,
    first_day,
    periods_before,
    periods_between,
    previous_period,
)
from exporter.core.logs import get_logger
from exporter.model import signals
from exporter.model.forecast import held_days
from exporter.model.snapshots import BillsSnapshot, HistorySnapshot, Latest, MonthHistory, per_day
from exporter.sources.bills import month_bills
from exporter.sources.history import fetch_month
from exporter.state import AlertStore, StateStore

log = get_logger(__name__)

REPLAYED_SIGNALS = ("spend",)
"""Threshold signals a backtest replays; the others need what bills do not hold (usage, probes)."""


@dataclass(frozen=True)
class Fired:
    day: dt.date
    alert: Alert

    def document(self) -> dict[str, object]:
        return {
            "day": self.day.isoformat(),
            "alertname": self.alert.labels["alertname"],
            "labels": self.alert.labels,
            "value": self.alert.value,
            "annotations": {k: v for k, v in self.alert.annotations.items() if k != "value"},
        }

    def line(self) -> str:
        labels = " ".join(f"{k}={v}" for k, v in self.alert.labels.items() if k != "alertname")
        summary = self.alert.annotations.get("summary", "")
        return f"{self.day}  {self.alert.labels['alertname']}  {labels}  value={self.alert.value}  {summary}"


def replayable(alerts: AlertsConfig, budgets: Sequence[BudgetConfig] = ()) -> tuple[AlertsConfig, list[str]]:
    """The rules a backtest replays, and a note for each it leaves out."""
    kept, notes = [], []
    on_usage = {budget.name for budget in budgets if budget.on_usage}
    known = {budget.name for budget in budgets}
    for index, rule in enumerate(alerts.rules):
        if isinstance(rule, BudgetRule) and rule.budget not in known:
            notes.append(f"alerts.rules[{index}] ({rule.alert}): skipped: budget {rule.budget!r} spans other accounts")
            continue
        if isinstance(rule, ThresholdRule) and rule.signal not in REPLAYED_SIGNALS:
            notes.append(f"alerts.rules[{index}] ({rule.alert}): skipped: `{rule.signal}` is not in the bills")
            continue
        if isinstance(rule, BudgetRule) and rule.budget in on_usage:
            notes.append(f"alerts.rules[{index}] ({rule.alert}): skipped: budget {rule.budget!r} is priced from usage")
            continue
        kept.append(rule)
    return alerts.model_copy(update={"rules": kept}), notes


def fetch(client: BillingAPI, periods: Sequence[str], today: dt.date) -> dict[str, MonthHistory]:
    """The months' bills; a month the API lists nothing for is left out (and said)."""
    months = {}
    for period in periods:
        month = fetch_month(client, period, today, client.concurrency)
        if month is None:
            log.warning("backtest: the API listed no bills for this month", period=period)
            continue
        months[period] = month
    return months


def _upto(month: MonthHistory, day: dt.date) -> MonthHistory:
    """The month as it stood at the end of `day`."""
    return replace(
        month,
        by_endpoint=tuple(a for a in month.by_endpoint if a.day <= day),
        by_item=tuple(a for a in month.by_item if a.day <= day),
        items_by_endpoint=MappingProxyType(
            {e: tuple(a for a in rows if a.day <= day) for e, rows in month.items_by_endpoint.items()}
        ),
    )


def _bills(
    months: dict[str, MonthHistory], day: dt.date, upto: dt.date, billing: BillingConfig, interval: float
) -> BillsSnapshot:
    """What the bills source would have held on `day` with the days up to `upto` billed, as
    `BillsSource.refresh` makes it: the previous month during the grace days, and the forecast
    (with its interval) learnt from the days the daemon would have held before the month (the
    history's months, and the previous month in the grace days)."""
    period = f"{day:%Y-%m}"
    current = _upto(months[period], upto) if period in months else MonthHistory(period, (), (), day)
    previous = previous_period(period)
    in_grace = day.day <= billing.previous_month_grace_days
    shown = [current] + ([months[previous]] if in_grace and previous in months else [])
    held = [*periods_before(period, billing.history_months), *([previous] if in_grace else [])]
    before = held_days({p: per_day(months[p].by_item) for p in held if p in months})
    snapshot = [
        month_bills(month.period, day, month.by_endpoint, month.by_item, None, before if index == 0 else {}, interval)
        for index, month in enumerate(shown)
    ]
    return BillsSnapshot(tuple(snapshot), day)


def days(first: str, last: str) -> tuple[dt.date, dt.date]:
    """The first and last day of the months `first` … `last`."""
    return first_day(first), first_day(last).replace(day=days_in_period(last))


def replay(
    config: Config, months: dict[str, MonthHistory], first: str, last: str, today: dt.date, account: str = ""
) -> list[Fired]:
    """Each alert that would have fired over the complete days of `first` … `last` (before
    `today`), on the day it would have fired; a day's spend anomaly fires the day after it, the
    one after the range included.

    Each day is evaluated as it began (its own bills not in yet: the daemon's `today` windows
    start from nothing, so an alert on them fires anew each day) and as it ended (its final
    bills), twice then, the longest `for` apart, so a rule with a `for` fires on the day its
    condition held all evening.
    """
    alerts, _ = replayable(config.alerts, config.budgets)
    frozen = FrozenClock(dt.datetime.combine(dt.date(2000, 1, 1), dt.time(), config.billing.zone))
    clock = Clock(config.billing.zone, frozen)
    latest = Latest()
    store = StateStore(":memory:")
    history = config.billing.history_months > 0
    one = [Watched(signals.Account(account, latest, lambda: ["bills"]), (), history)] if account else []
    # One account of several: its budgets scoped to it, as the daemon's engine has them (their alerts say which).
    budgets = (
        [b.model_copy(update={"where": {**b.where, "account": account}}) for b in config.budgets]
        if account
        else config.budgets
    )
    engine = Engine(alerts, budgets, AlertStore(store), clock, latest, lambda: ["bills"], history=history, accounts=one)
    anomaly_rules = {rid for rule, rid in zip(alerts.rules, rule_ids(alerts.rules), strict=True)
                     if isinstance(rule, AnomalyRule)}  # fmt: skip
    hold = max((r.for_ for r in alerts.rules if isinstance(r, ThresholdRule)), default=0.0)
    start, end = days(first, last)
    end = min(end, today - dt.timedelta(days=1))
    fired: list[Fired] = []
    firing: set[str] = set()
    day = start
    with closing(store), _engine_logs_at_debug():
        while day <= min(end + dt.timedelta(days=1), today):
            period = f"{day:%Y-%m}"
            held = periods_before(period, config.billing.history_months)
            # The day's bills judged as its end nears, and once more `hold` later (a `for` waited
            # out); never before the day began (a `for` of a day or more waits across days instead).
            closing_second = 24 * 3600 - 1.0
            evening = (
                [] if day > end else [max(30.0, closing_second - hold), closing_second] if hold else [closing_second]
            )
            for upto, seconds in [(day - dt.timedelta(days=1), 30.0)] + [(day, s) for s in evening]:
                latest.history = HistorySnapshot(
                    MappingProxyType({p: months[p] for p in held if p in months}),
                    _upto(months[period], upto) if period in months else None,
                    as_of=day,
                )
                latest.bills = _bills(months, day, upto, config.billing, config.forecast.interval)
                instant = dt.datetime.combine(day, dt.time(), config.billing.zone) + dt.timedelta(seconds=seconds)
                frozen.set(instant)
                latest.record("bills", success=True, at=instant.timestamp(), duration=0.0)
                engine.evaluate()
                now = {a.key: a for a in engine.current() if a.state == "firing"}
                for key in sorted(now.keys() - firing, key=lambda key: (now[key].labels["alertname"], key)):
                    alert = now[key]
                    about = dt.date.fromisoformat(alert.labels["day"]) if alert.rule in anomaly_rules else day
                    if start <= about <= end:
                        fired.append(Fired(day, alert))
                firing = set(now)
            day += dt.timedelta(days=1)
    return fired


@contextmanager
def _engine_logs_at_debug() -> Iterator[None]:
    """The engine logs each alert firing and resolving at info, as the daemon should; in a replay
    those are the results over again, a few hundred lines for months of `today` windows, among
    which the results were lost. They are left to debug: below it, the replay's engine says
    warnings and errors only."""
    engine = logging.getLogger("exporter.alerts")
    level = engine.level
    if not engine.isEnabledFor(logging.DEBUG):
        engine.setLevel(logging.WARNING)
    try:
        yield
    finally:
        engine.setLevel(level)


def render(fired: Sequence[Fired], form: str) -> str:
    if form == "json":
        return "".join(json.dumps(f.document(), sort_keys=False) + "\n" for f in fired)
    return "".join(f.line() + "\n" for f in fired)


def backtest(
    config: Config, first: str, last: str, clock: Clock, client: BillingAPI | None = None, account: str = ""
) -> tuple[list[Fired], list[str]]:
    """Fetch `first` … `last` (and the history months before them) from `client` (unless given, the
    HTTP client on `config.billing`, closed after) and replay them; with the notes on what was left
    out. Days from today on are not replayed (they have not ended)."""
    today = clock.today()
    periods = [*periods_before(first, config.billing.history_months), *periods_between(first, last)]
    opened: AbstractContextManager[BillingAPI] = (
        BillingClient.from_config(config.billing, clock) if client is None else nullcontext(client)
    )
    with opened as api:
        months = fetch(api, [p for p in periods if p <= clock.period(today)], today)
    _, notes = replayable(config.alerts, config.budgets)
    if account:
        notes += [
            f"alerts.rules[{index}] ({rule.alert}): replayed on account {account!r} alone; the daemon combines"
            " the accounts it selects"
            for index, rule in enumerate(config.alerts.rules)
            if isinstance(rule, ThresholdRule) and "account" not in rule.by and rule.where.get("account") != account
        ]
    notes += [f"{p}: no bills" for p in periods_between(first, last) if p not in months and p <= clock.period(today)]
    return replay(config, months, first, last, today, account), notes
