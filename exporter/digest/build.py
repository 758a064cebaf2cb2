"""The digest: what happened yesterday (or last week), in one message.

`build` gathers it from the daemon's snapshots as a JSON-able mapping, the webhook's body as the
design gives it: amounts as decimal strings, ratios and percentages as numbers. That mapping is
what the outbox keeps, so a digest delivered late says what it said when it was made.
`exporter.notifiers.digest` renders it for people.

Spend is the summarised span's (`first_day` to `day`, one day or a week): the total, the expected
amount from the anomaly baseline (`exporter.model.anomaly`, the account's series; absent where it has
too little history), the top endpoints and items with their change against the span before, the
month's total through `day` and its forecast. Then budgets as they stand when the digest is made
(not as of `day`: each says the period it measures, `so_far`, the month or the day in progress; on
a month's first day, also the month that ended, `of`), the anomalies the rules found, the
settled days judged since the digest before whose bill disagrees with the usage counted, the alerts
firing, and each probe's
success ratio and 95th percentile time to first token over the span.

The anomalies, the disagreeing figures and the alerts, one per endpoint (per rule, per day), are each
cut to the `LISTED` that matter most (`top`): the largest impacts, the largest gaps (`gap_order`), the
alerts fired last; each then the newest day first. `more` counts what each left out, and is there only
when something was.
"""

from __future__ import annotations

import datetime as dt
import heapq
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, TypeVar

from exporter.alerts.anomalies import held, held_months, judge_groups
from exporter.alerts.rules import summed_crossing
from exporter.config.rules import AnomalyRule
from exporter.config.schema import BudgetConfig, PriceConfig
from exporter.model.anomaly import Judgement, judge_all
from exporter.model.snapshots import AmountGap, DailyAmount, Latest, Reconciliation, TokenGap, per_day
from exporter.sources.budgets import BudgetFigures, figures, month_spent, summed
from exporter.sources.reconcile import disagrees

TOP = 5
LISTED = 20
"""At most this many anomalies, disagreeing figures and firing alerts: listed whole, one per endpoint, they
made a digest of 14 MB at 5,000 endpoints (bench.landing)."""
CENT = Decimal("0.01")
T = TypeVar("T")


@dataclass(frozen=True)
class ProbeStat:
    probe: str
    runs: int
    successes: int
    ttfts: Sequence[float]
    """Time to first token of the runs that had one, in seconds: those that failed after it too (a
    check, a stall), as `inference_probe_time_to_first_token_seconds` counts them, so the digest's
    95th percentile and a dashboard's agree."""


@dataclass(frozen=True)
class FiringAlert:
    labels: Mapping[str, str]
    summary: str
    since: float | None


def span(schedule: str, sent_on: dt.date) -> tuple[dt.date, dt.date]:
    """The days a digest sent on `sent_on` summarises: the day before, or the 7 days before."""
    day = sent_on - dt.timedelta(days=1)
    return (day - dt.timedelta(days=6) if schedule == "weekly" else day), day


def ended_month(schedule: str, sent_on: dt.date, latest: Latest) -> str | None:
    """The month whose last day the digest sent on `sent_on` summarises ("YYYY-MM"), told how it
    ended: a daily digest's on the 1st, a weekly one's whose seven days end a month or run into the
    next (a span of seven days ends at most one month); None for the others, and until the next
    month's bills are fetched (what is held of the month may not be all of it then)."""
    first, day = span(schedule, sent_on)
    ended = f"{first:%Y-%m}"
    return ended if ended != f"{day + dt.timedelta(days=1):%Y-%m}" and fetched_after(latest, ended) else None


def fetched_after(latest: Latest, period: str) -> bool:
    """Whether the bills of a month after `period` are fetched (`period` has ended in them)."""
    return latest.bills is not None and latest.bills.current.period > period


def _money(amount: Decimal | None) -> str | None:
    return None if amount is None else f"{amount.quantize(CENT):f}"


def _percent(now: Decimal, before: Decimal | None) -> float | None:
    if before is None or before == 0:
        return None
    return round(float((now - before) / before * 100), 1)


SharedBudget = tuple[BudgetConfig, Sequence[BudgetFigures] | None, tuple[str, ...], Decimal | None]
"""A budget that spans several accounts, its figures in each (None: one of them has none yet), the
accounts it spans, and what they spent in the month the digest's span ended (`ended_month`) by the
bills held (None: no month ended, or it is not held in every one of them)."""


def _ended(budget: BudgetConfig, period: str, spent: Decimal) -> dict[str, Any]:
    """How a month budget stands for the month that ended (`period`): what was spent in it."""
    ratio = round(float(spent / budget.amount), 4)
    return {"budget": budget.name, "period": "month", "of": period, "amount": f"{budget.amount:f}",
            "used_ratio": ratio, "forecast_ratio": ratio}  # fmt: skip


def _budget(budget: BudgetConfig, found: BudgetFigures | None, crossing: dt.date | None) -> dict[str, Any]:
    """A budget as it stands (`found`: its figures, None while unknown), with the day its amount is
    (or was) crossed at the forecast's pace, when it is this period."""
    used, projected = found.ratios(budget.amount) if found is not None else (None, None)
    return {
        "budget": budget.name,
        "period": budget.period,
        "so_far": found.period if found is not None else None,
        "amount": f"{budget.amount:f}",
        "used_ratio": None if used is None else round(float(used), 4),
        "forecast_ratio": None if projected is None else round(float(projected), 4),
        "crossing": None if crossing is None else crossing.isoformat(),
    }


def top(rows: Sequence[T], n: int, key: Callable[[T], Any]) -> list[T]:
    """The `n` rows first by `key`, in the order they came: a list cut short reads as the whole one with
    rows left out, and one of `n` rows or fewer is unchanged. A selection, not a sort of every row."""
    if len(rows) <= n:
        return list(rows)
    return [rows[i] for i in sorted(heapq.nsmallest(n, range(len(rows)), key=lambda i: key(rows[i])))]


def disagreeing(result: Reconciliation | None) -> list[TokenGap | AmountGap]:
    """The figures whose bill disagrees with the usage counted: tokens per item, then amounts per endpoint."""
    figures: list[TokenGap | AmountGap] = [*result.tokens, *result.amounts] if result is not None else []
    return [gap for gap in figures if disagrees(gap.ratio)]


def gap_order(gap: TokenGap | AmountGap) -> tuple[bool, Decimal, int]:
    """The largest gap first (a bill for what nothing counted before any ratio), then the newest day."""
    if gap.ratio is None:
        return False, Decimal(0), -gap.day.toordinal()
    return True, -abs(gap.ratio), -gap.day.toordinal()


def _by_impact(judgement: Judgement) -> tuple[Decimal, int]:
    """The largest impact (actual − expected) first, then the newest day."""
    return -judgement.impact, -judgement.day.toordinal()


def gap_entry(gap: TokenGap | AmountGap) -> dict[str, Any]:
    """A figure whose bill disagrees with the usage counted, as the digest and /api/v1/reconciliation give it."""
    percent = None if gap.ratio is None else round(float(gap.ratio * 100), 2)
    if isinstance(gap, TokenGap):
        return {
            "day": gap.day.isoformat(),
            "item": gap.item,
            "billed": f"{gap.billed:f}",
            "counted": str(gap.counted),
            "gap_percent": percent,
        }
    return {
        "day": gap.day.isoformat(),
        "endpoint_id": gap.endpoint_id,
        "billed": _money(gap.billed),
        "estimated": _money(gap.estimated),
        "gap_percent": percent,
    }


def _sums(amounts: Iterable[DailyAmount], first: dt.date, last: dt.date) -> dict[str, Decimal]:
    sums: dict[str, Decimal] = {}
    for a in amounts:
        if first <= a.day <= last:
            sums[a.key] = sums.get(a.key, Decimal(0)) + a.payable
    return sums


def _top(
    key: str, amounts: Sequence[DailyAmount], span: Sequence[dt.date], held: AbstractSet[dt.date]
) -> list[dict[str, Any]]:
    """The largest of the `span`'s days, with their change against the span before (None: nothing
    spent then); none when a day of the span has no bills held (a sum of some of its days is no
    span's), and no change when a day of the span before has none (a week against some of the week
    before is no change: not "new" either)."""
    if not all(day in held for day in span):
        return []
    first, width = span[0], len(span)
    now = _sums(amounts, first, span[-1])
    before = _sums(amounts, first - dt.timedelta(days=width), first - dt.timedelta(days=1))
    known_before = all(day - dt.timedelta(days=width) in held for day in span)
    ranked = sorted(now.items(), key=lambda pair: (-pair[1], pair[0]))[:TOP]
    top: list[dict[str, Any]] = [{key: name, "amount": _money(amount)} for name, amount in ranked]
    if known_before:
        for row, (name, amount) in zip(top, ranked, strict=True):
            row["change_percent"] = _percent(amount, before.get(name, Decimal(0)))
    return top


def p95(values: Sequence[float]) -> float | None:
    """The nearest-rank 95th percentile."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def _month_total(latest: Latest, period: str) -> Decimal | None:
    """The total of a month that has ended, from the bills or the history holding it; None once
    neither does (a month without bills is unknown, never zero)."""
    month = held_months(latest).get(period)
    return None if month is None else sum((a.payable for a in month[1]), Decimal(0))


def build(
    latest: Latest,
    *,
    schedule: str,
    sent_on: dt.date,
    budgets: Sequence[BudgetConfig] = (),
    prices: Sequence[PriceConfig] = (),
    anomalies: Sequence[AnomalyRule] = (),
    alerts: Sequence[FiringAlert] = (),
    probes: Sequence[ProbeStat] = (),
    settled: AbstractSet[dt.date] | None = None,
    url: str = "",
    currency: str = "",
    shared: Sequence[SharedBudget] = (),
) -> dict[str, Any]:
    """The digest sent on `sent_on` (see the module's docstring). `anomalies`: the spend anomaly
    rules, each judged on every day of the span as the daemon judges it. `settled`: the settled
    days whose reconciliation gaps it tells (each day's are told once: `Sources.digest_settled`);
    the span's by default. `currency`: the amounts' (`billing.currency`), empty when unknown. `shared`: the
    budgets that span this account and others, listed after its own with the accounts they span."""
    first, day = span(schedule, sent_on)
    width = (day - first).days + 1
    bills = held(latest)
    totals = per_day(bills.by_item)
    days = [first + dt.timedelta(days=n) for n in range(width)]
    # A day without bills is unknown (a failed fetch), never zero: the span's total is then unknown.
    spend = sum((totals[d] for d in days), Decimal(0)) if all(d in totals for d in days) else None
    judged = judge_all(totals, days, min_amount=Decimal(0), min_percent=Decimal(0))  # the baseline, not alerts
    expected = sum((j.expected for j in judged.values()), Decimal(0)) if len(judged) == width else None
    period = f"{day:%Y-%m}"
    month_days = {d: a for d, a in totals.items() if f"{d:%Y-%m}" == period and d <= day}
    current = latest.bills.current if latest.bills is not None else None
    forecast = current.forecast if current is not None and current.period == period else None
    if fetched_after(latest, period):  # a month that has ended: its total, if still held
        forecast = _month_total(latest, period)
    digest: dict[str, Any] = {
        "kind": "digest",
        "schedule": schedule,
        "first_day": first.isoformat(),
        "day": day.isoformat(),
        "period": period,
        "currency": currency,
        "spend": _money(spend),
        "yesterday": _money(totals.get(day)),
        "expected": _money(expected),
        "month_to_date": _money(sum(month_days.values(), Decimal(0)) if month_days else None),
        "forecast": _money(forecast),
        "budgets": [],
        "top_endpoints": _top("endpoint_id", bills.by_endpoint, days, totals.keys()),
        "top_items": _top("item", bills.by_item, days, totals.keys()),
        "anomalies": [],
        "reconciliation": [],
        "alerts": [],
        "probes": [],
        "url": url,
    }
    ended = ended_month(schedule, sent_on, latest)
    if ended is not None and ended != period:  # (a week that ran into a new month: the one it ended)
        digest["ended"] = {"period": ended, "total": _money(_month_total(latest, ended))}
    for budget in budgets:
        if ended is not None and budget.period == "month" and (spent := month_spent(budget, latest, ended)) is not None:
            digest["budgets"].append(_ended(budget, ended, spent))
        found = figures(budget, latest, prices)
        digest["budgets"].append(_budget(budget, found, found.crossing(budget.amount) if found is not None else None))
    for budget, parts, accounts, spent in shared:  # (spent: in the month `ended`, None with none)
        if budget.period == "month" and ended is not None and spent is not None:
            digest["budgets"].append(_ended(budget, ended, spent) | {"accounts": list(accounts)})
        total, crosses = (summed(parts), summed_crossing(parts, budget.amount)) if parts else (None, None)
        digest["budgets"].append(_budget(budget, total, crosses) | {"accounts": list(accounts)})
    anomalous = [(rule, f) for rule in anomalies for f in judge_groups(rule, bills, *days) if f.judgement.anomalous]
    for rule, finding in top(anomalous, LISTED, lambda pair: _by_impact(pair[1].judgement)):
        j = finding.judgement
        digest["anomalies"].append(
            {
                "alertname": rule.alert,
                "day": j.day.isoformat(),
                "labels": dict(finding.group),
                "actual": _money(j.actual),
                "expected": _money(j.expected),
                "impact_percent": None if j.impact_percent is None else float(j.impact_percent),
                "contributors": [{"name": n, "share": float(s)} for n, s in finding.contributors],
            }
        )
    told = set(days) if settled is None else settled
    gaps = [gap for gap in disagreeing(latest.reconciliation) if gap.day in told]
    digest["reconciliation"] = [gap_entry(g) for g in top(gaps, LISTED, gap_order)]
    for alert in top(alerts, LISTED, lambda a: (a.since is None, -(a.since or 0))):
        digest["alerts"].append(
            {
                "alertname": alert.labels.get("alertname", ""),
                "labels": {k: v for k, v in sorted(alert.labels.items()) if k != "alertname"},
                "summary": alert.summary,
                "since": None if alert.since is None else dt.datetime.fromtimestamp(alert.since, dt.UTC).isoformat(),
            }
        )
    for stat in probes:
        digest["probes"].append(
            {
                "probe": stat.probe,
                "runs": stat.runs,
                "success_ratio": round(stat.successes / stat.runs, 4) if stat.runs else None,
                "time_to_first_token_p95_seconds": None if (p := p95(stat.ttfts)) is None else round(p, 3),
            }
        )
    more = {"anomalies": len(anomalous), "reconciliation": len(gaps), "alerts": len(alerts)}
    if left := {name: count - LISTED for name, count in more.items() if count > LISTED}:
        digest["more"] = left
    return digest
