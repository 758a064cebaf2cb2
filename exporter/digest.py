"""The digest: what happened yesterday (or last week), in one message.

`build` gathers it from the daemon's snapshots as a JSON-able mapping, the webhook's body as the
design gives it: amounts as decimal strings, ratios and percentages as numbers. That mapping is
what the outbox keeps, so a digest delivered late says what it said when it was made. `text`,
`html` and `slack` render it for people.

Spend is the summarised span's (`first_day` to `day`, one day or a week): the total, the expected
amount from the anomaly baseline (`exporter.anomaly`, the account's series; absent where it has
too little history), the top endpoints and items with their change against the span before, the
month's total through `day` and its forecast. Then budgets, the anomalies the rules found, the
days that settled since the digest before whose bill disagrees with the usage counted, the alerts
firing, and each probe's
success ratio and 95th percentile time to first token over the span.
"""

from __future__ import annotations

import datetime as dt
import html as _html
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from exporter import mrkdwn
from exporter.alerts.anomalies import held, judge_groups
from exporter.anomaly import judge_all
from exporter.budgets import figures, month_spent
from exporter.reconcile import disagrees
from exporter.schema import AnomalyRule, BudgetConfig, PriceConfig
from exporter.snapshots import DailyAmount, Latest, per_day

TOP = 5
CENT = Decimal("0.01")


@dataclass(frozen=True)
class ProbeStat:
    probe: str
    runs: int
    successes: int
    ttfts: Sequence[float]
    """Time to first token of the successful runs that had one, in seconds."""


@dataclass(frozen=True)
class FiringAlert:
    labels: Mapping[str, str]
    summary: str
    since: float | None


def span(schedule: str, sent_on: dt.date) -> tuple[dt.date, dt.date]:
    """The days a digest sent on `sent_on` summarises: the day before, or the 7 days before."""
    day = sent_on - dt.timedelta(days=1)
    return (day - dt.timedelta(days=6) if schedule == "weekly" else day), day


def _money(amount: Decimal | None) -> str | None:
    return None if amount is None else f"{amount.quantize(CENT):f}"


def _percent(now: Decimal, before: Decimal | None) -> float | None:
    if before is None or before == 0:
        return None
    return round(float((now - before) / before * 100), 1)


def _sums(amounts: Iterable[DailyAmount], first: dt.date, last: dt.date) -> dict[str, Decimal]:
    sums: dict[str, Decimal] = {}
    for a in amounts:
        if first <= a.day <= last:
            sums[a.key] = sums.get(a.key, Decimal(0)) + a.payable
    return sums


def _top(key: str, amounts: Sequence[DailyAmount], first: dt.date, last: dt.date, width: int) -> list[dict[str, Any]]:
    now = _sums(amounts, first, last)
    before = _sums(amounts, first - dt.timedelta(days=width), first - dt.timedelta(days=1))
    known_before = any(first - dt.timedelta(days=width) <= a.day < first for a in amounts)
    ranked = sorted(now.items(), key=lambda pair: (-pair[1], pair[0]))[:TOP]
    return [
        {
            key: name,
            "amount": _money(amount),
            "change_percent": _percent(amount, before.get(name, Decimal(0)) if known_before else None),
        }
        for name, amount in ranked
    ]


def p95(values: Sequence[float]) -> float | None:
    """The nearest-rank 95th percentile."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


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
    settled: tuple[dt.date, dt.date] | None = None,
    url: str = "",
) -> dict[str, Any]:
    """The digest sent on `sent_on` (see the module's docstring). `anomalies`: the spend anomaly
    rules, each judged on every day of the span as the daemon judges it. `settled`: the days that
    settled since the digest before (each day's reconciliation gaps are told once); the span by
    default."""
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
    if current is not None and current.period > period:
        forecast = sum(month_days.values(), Decimal(0))  # a month that has ended: its total
    digest: dict[str, Any] = {
        "kind": "digest",
        "schedule": schedule,
        "first_day": first.isoformat(),
        "day": day.isoformat(),
        "period": period,
        "spend": _money(spend),
        "yesterday": _money(totals.get(day)),
        "expected": _money(expected),
        "month_to_date": _money(sum(month_days.values(), Decimal(0)) if month_days else None),
        "forecast": _money(forecast),
        "budgets": [],
        "top_endpoints": _top("endpoint_id", bills.by_endpoint, first, day, width),
        "top_items": _top("item", bills.by_item, first, day, width),
        "anomalies": [],
        "reconciliation": [],
        "alerts": [],
        "probes": [],
        "url": url,
    }
    for budget in budgets:
        ended = month_spent(budget, latest, period) if current is not None and current.period > period else None
        if budget.period == "month" and ended is not None:  # the 1st: how the month that ended stands
            ratio = round(float(ended / budget.amount), 4)
            digest["budgets"].append(
                {"budget": budget.name, "period": "month", "of": period, "amount": f"{budget.amount:f}",
                 "used_ratio": ratio, "forecast_ratio": ratio}
            )  # fmt: skip
        found = figures(budget, latest, prices)
        used, projected = found.ratios(budget.amount) if found is not None else (None, None)
        digest["budgets"].append(
            {
                "budget": budget.name,
                "period": budget.period,
                "amount": f"{budget.amount:f}",
                "used_ratio": None if used is None else round(float(used), 4),
                "forecast_ratio": None if projected is None else round(float(projected), 4),
            }
        )
    for rule in anomalies:
        for on in days:
            for finding in judge_groups(rule, bills, on):
                if not finding.judgement.anomalous:
                    continue
                j = finding.judgement
                digest["anomalies"].append(
                    {
                        "alertname": rule.alert,
                        "day": on.isoformat(),
                        "labels": dict(finding.group),
                        "actual": _money(j.actual),
                        "expected": _money(j.expected),
                        "impact_percent": None if j.impact_percent is None else float(j.impact_percent),
                        "contributors": [{"name": n, "share": float(s)} for n, s in finding.contributors],
                    }
                )
    rec = latest.reconciliation
    oldest, newest = settled or (first, day)
    for gap in rec.tokens if rec is not None else ():
        if oldest <= gap.day <= newest and disagrees(gap.ratio):
            digest["reconciliation"].append(
                {
                    "day": gap.day.isoformat(),
                    "item": gap.item,
                    "billed": f"{gap.billed:f}",
                    "counted": str(gap.counted),
                    "gap_percent": None if gap.ratio is None else round(float(gap.ratio * 100), 2),
                }
            )
    for amount in rec.amounts if rec is not None else ():
        if oldest <= amount.day <= newest and disagrees(amount.ratio):
            digest["reconciliation"].append(
                {
                    "day": amount.day.isoformat(),
                    "endpoint_id": amount.endpoint_id,
                    "billed": _money(amount.billed),
                    "estimated": _money(amount.estimated),
                    "gap_percent": None if amount.ratio is None else round(float(amount.ratio * 100), 2),
                }
            )
    for alert in alerts:
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
    return digest


# -- rendering ----------------------------------------------------------------------------------


def _span_name(d: Mapping[str, Any]) -> str:
    return d["day"] if d["first_day"] == d["day"] else f"{d['first_day']} to {d['day']}"


def subject(d: Mapping[str, Any]) -> str:
    what = "Weekly" if d["schedule"] == "weekly" else "Daily"
    spend = d["spend"] if d["spend"] is not None else "unknown"
    expected = f" (expected {d['expected']})" if d["expected"] else ""
    return f"{what} inference spend {_span_name(d)}: {spend}{expected}"


def _change(value: float | None) -> str:
    return "new" if value is None else f"{value:+.1f}%"


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.0%}"


def _sections(d: Mapping[str, Any]) -> list[tuple[str, list[str]]]:
    """The digest as titled lists of lines (plain text; each renderer escapes or formats them)."""
    unknown = "unknown (no bills for it yet)"
    span_word = "Last week" if d["schedule"] == "weekly" else "Yesterday"
    spend = [f"{span_word} ({_span_name(d)}): {d['spend'] if d['spend'] is not None else unknown}"]
    if d["expected"] is not None:
        spend.append(f"Expected: {d['expected']}")
    spend.append(f"Month to date ({d['period']}): {d['month_to_date'] or unknown}")
    if d["forecast"] is not None:
        spend.append(f"Forecast for {d['period']}: {d['forecast']}")
    sections = [("Spend", spend)]
    if d["budgets"]:
        sections.append(
            (
                "Budgets",
                [
                    f"{b['budget']} ({b['of']}, ended, {b['amount']}): used {_ratio(b['used_ratio'])}"
                    if "of" in b
                    else f"{b['budget']} ({b['period']}, {b['amount']}): used {_ratio(b['used_ratio'])},"
                    f" forecast {_ratio(b['forecast_ratio'])} (now)"
                    for b in d["budgets"]
                ],
            )
        )
    against = "the week before" if d["schedule"] == "weekly" else "the day before"
    for title, key, rows in (
        ("Top endpoints", "endpoint_id", d["top_endpoints"]),
        ("Top items", "item", d["top_items"]),
    ):
        if rows:
            sections.append(
                (
                    f"{title} (change against {against})",
                    [f"{r[key]}: {r['amount']} ({_change(r['change_percent'])})" for r in rows],
                )
            )
    if d["anomalies"]:
        lines = []
        for a in d["anomalies"]:
            group = ", ".join(f"{k}={v}" for k, v in a["labels"].items()) or "account"
            share = ", ".join(f"{c['name']} {c['share']:.0%}" for c in a["contributors"])
            impact = "" if a["impact_percent"] is None else f" ({a['impact_percent']:+.0f}%)"
            lines.append(
                f"{a['alertname']} {a['day']} {group}: {a['actual']} against {a['expected']} expected{impact}"
                + (f"; {share}" if share else "")
            )
        sections.append(("Spend anomalies", lines))
    if d["reconciliation"]:
        lines = []
        for g in d["reconciliation"]:
            gap = "billed, none counted" if g["gap_percent"] is None else f"{g['gap_percent']:+.2f}%"
            if "item" in g:
                lines.append(f"{g['day']} {g['item']}: billed {g['billed']} tokens, counted {g['counted']} ({gap})")
            else:
                lines.append(f"{g['day']} {g['endpoint_id']}: billed {g['billed']}, estimated {g['estimated']} ({gap})")
        sections.append(("Bill against usage", lines))
    firing = []
    for a in d["alerts"]:
        labels = ", ".join(f"{k}={v}" for k, v in a["labels"].items())
        firing.append(f"{a['alertname']}: {a['summary']}" + (f" [{labels}]" if labels else ""))
    sections.append(("Firing alerts", firing or ["none"]))
    if d["probes"]:
        lines = []
        for p in d["probes"]:
            ttft = p["time_to_first_token_p95_seconds"]
            if not p["runs"]:
                lines.append(f"{p['probe']}: no runs")
                continue
            lines.append(
                f"{p['probe']}: {_ratio(p['success_ratio'])} of {p['runs']} runs succeeded"
                + ("" if ttft is None else f", p95 time to first token {ttft * 1000:.0f} ms")
            )
        sections.append(("Probes", lines))
    return sections


def text(d: Mapping[str, Any]) -> str:
    out = [subject(d), ""]
    for title, lines in _sections(d):
        out += [title, *(f"  {line}" for line in lines), ""]
    if d["url"]:
        out.append(d["url"] + "/")
    return "\n".join(out).rstrip() + "\n"


def html(d: Mapping[str, Any]) -> str:
    e = _html.escape
    parts = [f"<h2>{e(subject(d))}</h2>"]
    for title, lines in _sections(d):
        parts.append(f"<h3>{e(title)}</h3><ul>" + "".join(f"<li>{e(line)}</li>" for line in lines) + "</ul>")
    if d["url"]:
        parts.append(f'<p><a href="{e(d["url"])}/">{e(d["url"])}/</a></p>')
    return '<!doctype html><html><body style="font-family: sans-serif">' + "".join(parts) + "</body></html>"


def slack(d: Mapping[str, Any]) -> dict[str, Any]:
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": {"type": "plain_text", "text": mrkdwn.cap(subject(d), mrkdwn.HEADER)}}
    ]
    for title, lines in _sections(d):
        body = f"*{mrkdwn.escape(title)}*\n" + "\n".join(f"• {mrkdwn.escape(line)}" for line in lines)
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": mrkdwn.cap(body)}})
    if d["url"]:
        blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": f"<{d['url']}/|exporter>"}]})
    return {"text": mrkdwn.cap(mrkdwn.escape(subject(d))), "blocks": blocks}
