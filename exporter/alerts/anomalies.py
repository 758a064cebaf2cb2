"""`spend_anomaly` rules: the day that ended, per group, judged against its history.

The series are the daily payable amounts the exporter holds: the past months (`history`) and the
months the bills source fetches (fresher, so they win for the same month). A day missing from both
is unknown, never zero. Each evaluation judges the last complete day in the billing time zone;
once the next day ends, that one is judged instead.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal

from exporter.config.rules import AnomalyRule
from exporter.core.clock import Clock
from exporter.core.logs import get_logger
from exporter.core.words import NO_ENDPOINT
from exporter.model.anomaly import MIN_HISTORY_DAYS, Judgement, contributors, judge_all
from exporter.model.signals import Labels
from exporter.model.snapshots import DailyAmount, Latest, MonthHistory, per_day

log = get_logger(__name__)

Series = dict[dt.date, Decimal]
_said: set[tuple[str, Labels]] = set()
"""(rule, group) pairs already logged as having too little history."""


@dataclass(frozen=True)
class Finding:
    """One group's judgement of one day, with the sub-groups carrying its impact."""

    group: Labels
    judgement: Judgement
    contributors: tuple[tuple[str, Decimal], ...]


@dataclass(frozen=True)
class Bills:
    """The daily bills a judgement reads: by endpoint, by item, and each endpoint's by item."""

    by_endpoint: tuple[DailyAmount, ...] = ()
    by_item: tuple[DailyAmount, ...] = ()
    items_by_endpoint: Mapping[str, tuple[DailyAmount, ...]] = field(default_factory=dict)


def _past(latest: Latest) -> list[MonthHistory]:
    """The history's months held: the past ones, and the current one as fetched today."""
    history = latest.history
    return [*history.months.values(), *([history.current] if history.current else [])] if history else []


def held_months(latest: Latest) -> dict[str, tuple[tuple[DailyAmount, ...], tuple[DailyAmount, ...]]]:
    """By period, the lines by endpoint and by item of the past months held and of the months the
    bills source fetched (fresher: they win for the same month)."""
    months = {month.period: (month.by_endpoint, month.by_item) for month in _past(latest)}
    for fetched in latest.bills.months if latest.bills else ():
        months[fetched.period] = (fetched.by_endpoint, fetched.by_item)
    return months


def held(latest: Latest) -> Bills:
    """The past months held and the months the bills source fetched (`held_months`)."""
    months = held_months(latest)
    split: dict[str, list[DailyAmount]] = {}  # (each endpoint's months extended, not joined anew: linear in months)
    for past in _past(latest):
        for endpoint, rows in past.items_by_endpoint.items():
            split.setdefault(endpoint, []).extend(rows)
    by_endpoint = tuple(a for endpoints, _ in months.values() for a in endpoints)
    by_item = tuple(a for _, items in months.values() for a in items)
    return Bills(by_endpoint, by_item, {endpoint: tuple(rows) for endpoint, rows in split.items()})


def _series(amounts: Iterable[DailyAmount]) -> dict[str, Series]:
    """Per key (an endpoint id or an item), its amount per day."""
    series: dict[str, Series] = {}
    for a in amounts:
        days = series.setdefault(a.key, {})
        days[a.day] = days.get(a.day, Decimal(0)) + a.payable
    return series


def judged_day(clock: Clock) -> dt.date:
    """The last complete day in the billing time zone."""
    return clock.today() - dt.timedelta(days=1)


def judge_groups(rule: AnomalyRule, bills: Bills, *days: dt.date) -> list[Finding]:
    """Judge each of `days` for every group of `rule`, day after day; an anomaly names the
    sub-groups carrying it: the endpoints of the account or of an item, the items of an endpoint.
    A group's history is indexed once for all of `days` (a weekly digest judges seven); a day
    given twice is judged once."""
    days = tuple(dict.fromkeys(days))
    endpoints, items = _series(bills.by_endpoint), _series(bills.by_item)
    split = {endpoint: _series(rows) for endpoint, rows in bills.items_by_endpoint.items()}
    groups: dict[Labels, tuple[Series, Mapping[str, Series]]]
    if rule.by == ("endpoint_id",):
        groups = {(("endpoint_id", key),): (amounts, split.get(key, {})) for key, amounts in endpoints.items()}
    elif rule.by == ("item",):
        groups = {
            (("item", key),): (amounts, {e: by_item[key] for e, by_item in split.items() if key in by_item})
            for key, amounts in items.items()
        }
    else:
        groups = {(): (per_day(bills.by_item), endpoints)}
    found: dict[dt.date, list[Finding]] = {day: [] for day in days}
    for group, (series, parts) in sorted(groups.items()):
        judged = judge_all(
            series, days, min_amount=rule.min_amount, min_percent=rule.min_percent, sensitivity=rule.sensitivity
        )
        for day in days:
            judgement = judged.get(day)
            if judgement is None:
                if day in series and (rule.alert, group) not in _said:
                    _said.add((rule.alert, group))
                    log.info("spend anomaly not judged: too little history for this group", alertname=rule.alert,
                             group=dict(group) or "account", needs_days=MIN_HISTORY_DAYS)  # fmt: skip
                continue
            shares = tuple(contributors(parts, day)) if parts and judgement.anomalous else ()
            found[day].append(Finding(group, judgement, shares))
    return [finding for day in days for finding in found[day]]


def describe(shares: Iterable[tuple[str, Decimal]]) -> str:
    """`{contributors}`: `ep-a 72%, ep-b 20%` (`(no endpoint) 5%`: the charges of no endpoint)."""
    return ", ".join(f"{name or NO_ENDPOINT} {share * 100:.0f}%" for name, share in shares)
