"""The landing page: the month's chart, each source's last refresh, the budgets, the probes, the firing alerts and
what the bill disagrees with, as one HTML page.

The tables that grow with the endpoints, the days or the alerts show the `ROWS` rows that matter most (`top`, which
keeps them in their order): the failing probes, the alerts fired last, the largest gaps (`gap_order`); then how many
more there are and where they all are."""

from __future__ import annotations

import datetime as dt
import html
from collections.abc import Sequence
from decimal import Decimal

from exporter import __version__
from exporter.alerts.rules import summed_crossing
from exporter.config.schema import BudgetConfig
from exporter.core.fields import scope_values
from exporter.core.words import NO_ENDPOINT, counted
from exporter.digest.build import disagreeing, gap_order, top
from exporter.metrics.accounts import shared_matched, shared_parts
from exporter.model.snapshots import AmountGap, MonthBills, ProbeSnapshot, Reconciliation, SourceHealth, TokenGap
from exporter.sources.budgets import BudgetFigures, current_figures, scope_matched, summed
from exporter.web.chart import month_chart
from exporter.web.views import AccountView, View

ROWS = 20
"""At most this many rows in a table that grows with the endpoints: a screen's worth, enough to see what is wrong.
Listing every row made the page 5 MB at 5,000 endpoints; the rest are a link away."""
Probe = tuple[str, ProbeSnapshot, str | None]
"""A probe's name, its snapshot and, with several accounts, its account (escaped)."""


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _level(ratio: Decimal) -> str:
    return "bad" if ratio >= 1 else "wait" if ratio >= Decimal("0.8") else "ok"


def _gap(ratio: Decimal | None) -> str:
    return "billed, none counted" if ratio is None else f"{ratio:+.2%}"


def _more(rows: int, where: str) -> str:
    """Under a table of `rows` rows cut to ROWS: how many it left out, and where they all are."""
    return f"<p>and {rows - ROWS:,} more: see {where}</p>" if rows > ROWS else ""


def _gap_row(gap: TokenGap | AmountGap) -> str:
    if isinstance(gap, TokenGap):
        return (
            f"<tr><td>{gap.day}</td><td>{html.escape(gap.item)}</td><td>tokens</td><td>{gap.billed:f}</td>"
            f"<td>{gap.counted}</td><td class=bad>{_gap(gap.ratio)}</td></tr>"
        )
    return (
        f"<tr><td>{gap.day}</td><td>{html.escape(gap.endpoint_id or NO_ENDPOINT)}</td><td>amount</td>"
        f"<td>{gap.billed:f}</td><td>{gap.estimated.quantize(Decimal('0.01'))}</td>"
        f"<td class=bad>{_gap(gap.ratio)}</td></tr>"
    )


def _disagreements(result: Reconciliation | None) -> str:
    """The settled days whose bill disagrees with the usage counted (tokens per item, amounts per endpoint)."""
    if result is None or result.last_day is None:
        return "<p>No settled day has been reconciled yet.</p>"
    gaps = disagreeing(result)
    days = len({g.day for g in result.tokens} | {a.day for a in result.amounts})
    if not gaps:
        agree = "The settled day reconciled agrees" if days == 1 else f"The {days:,} settled days reconciled agree"
        return f"<p class=ok>{agree} with the usage counted (within 0.1%).</p>"
    return (
        f"<p>{counted(len(gaps), 'figure')} of {counted(days, 'settled day')} "
        f"disagree{'s' if len(gaps) == 1 else ''} with the usage counted:</p>"
        "<table><tr><th>day</th><th>item or endpoint</th><th>what</th><th>billed</th><th>counted or estimated</th>"
        "<th>gap</th></tr>"
        + "".join(_gap_row(gap) for gap in top(gaps, ROWS, gap_order))
        + "</table>"
        + _more(len(gaps), '<a href="/api/v1/reconciliation">Bill against usage (JSON)</a>')
    )


def _scope(budget: BudgetConfig) -> str:
    what = ", ".join(f"{k}={'|'.join(scope_values(v))}" for k, v in sorted(budget.where.items())) or "account"
    return f"{what} (usage × prices)" if budget.on_usage else what


def _accounts(view: View, accounts: Sequence[AccountView]) -> tuple[str, str, list[Probe], str]:
    """With several accounts: their month so far, their budgets and the organisation's, their
    probes and their bills against usage (each table with an `account` column)."""
    today = view.today()
    health: dict[str, list[SourceHealth]] = {}  # by account (`<account>/<source>`: a name holds no slash)
    for key, state in view.sources_health().items():
        owner, slash, _ = key.partition("/")
        if slash:
            health.setdefault(owner, []).append(state)
    rows, budgets, gaps = [], [], []
    probes: list[Probe] = []
    for account in accounts:
        name = html.escape(account.name)
        bills = account.latest.bills
        month = bills.current if bills is not None else None
        states = health.get(account.name, [])
        failing = sum(not h.success for h in states)
        forecast = None if month is None or _over(month, today) else month.forecast.quantize(Decimal(1))
        rows.append(
            f"<tr><td>{name}</td><td>{'—' if month is None else f'{month.month_to_date:f}'}</td>"
            f"<td>{'—' if forecast is None else f'{forecast:f}'}</td>"
            + (f"<td class=bad>{failing} failing</td>" if failing else f"<td class=ok>{len(states)} ok</td>")
            + "</tr>"
        )
        for budget, found in current_figures(account.latest, account.budgets, account.prices, today):
            ratios = None if found is None else found.ratios(budget.amount)
            unmatched = scope_matched(budget, account.latest) is False
            budgets.append(_budget_row(budget, ratios, name, unmatched, _crosses(found, budget)))
        probes += [(probe, snapshot, name) for probe, snapshot in sorted(account.latest.probes.items())]
        if account.latest.reconciliation is not None:
            gaps.append(f"<h3>{name}</h3>{_disagreements(account.latest.reconciliation)}")
    spans = {a.name: (a.latest, a.prices) for a in accounts}
    for budget in view.shared_budgets():
        spanned = [spans[n] for n in spans if budget.spans(n)]
        parts = shared_parts(budget, spanned, today)
        who = html.escape("every account" if budget.accounts is None else ", ".join(budget.accounts))
        ratios = None if parts is None else summed(parts).ratios(budget.amount)
        day = None if parts is None else summed_crossing(parts, budget.amount)
        unmatched = shared_matched(budget, spanned) is False
        budgets.append(_budget_row(budget, ratios, who, unmatched, "—" if day is None else day.isoformat()))
    summary = (
        "<table><tr><th>account</th><th>month to date</th><th>month forecast</th><th>sources</th></tr>"
        + "".join(rows)
        + "</table>"
    )
    return summary, "".join(budgets), probes, "".join(gaps) or "<p>No settled day has been reconciled yet.</p>"


def _over(month: MonthBills, today: dt.date | None) -> bool:
    """Whether the billing day has left `month` (its bills not read since the month ended): it is
    shown as over, with no forecast."""
    return today is not None and f"{today:%Y-%m}" != month.period


def _crosses(found: BudgetFigures | None, budget: BudgetConfig) -> str:
    """The day the budget's amount is (or was) crossed at the forecast's pace, or a dash."""
    day = None if found is None else found.crossing(budget.amount)
    return "—" if day is None else day.isoformat()


def _budget_row(
    budget: BudgetConfig,
    ratios: tuple[Decimal, Decimal] | None,
    account: str,
    unmatched: bool = False,
    crosses: str = "—",
) -> str:
    return (
        f"<tr><td>{html.escape(budget.name)}</td><td>{account}</td><td>{html.escape(_scope(budget))}"
        + ("<br><span class=bad>matches nothing</span>" if unmatched else "")
        + f"</td><td>{html.escape(budget.period)}</td><td>{budget.amount:f}</td>"
        + (
            f"<td class={_level(ratios[0])}>{ratios[0]:.1%}</td><td class={_level(ratios[1])}>{ratios[1]:.1%}</td>"
            if ratios
            else "<td class=wait>—</td><td class=wait>—</td>"
        )
        + f"<td>{crosses}</td></tr>"
    )


def _probe_row(name: str, p: ProbeSnapshot, account: str | None = None) -> str:
    return (
        f"<tr><td>{html.escape(name)}</td>"
        + ("" if account is None else f"<td>{account}</td>")
        + f"<td>{html.escape(p.endpoint_id)}</td><td>{html.escape(p.scenario)}</td>"
        f"<td class={'ok' if p.last.success else 'bad'}>{'ok' if p.last.success else html.escape(p.last.reason or '')}"
        f"</td><td>{p.last.duration * 1000:.0f} ms</td>"
        f"<td>{'' if p.last.time_to_first_token is None else f'{p.last.time_to_first_token * 1000:.0f} ms'}</td></tr>"
    )


def landing_page(view: View) -> str:
    now = view.now()
    rows = []
    health = view.sources_health()
    for source in view.sources():
        entry = health.get(source)
        if entry is None:
            rows.append(f"<tr><td>{html.escape(source)}</td><td class=wait>pending</td><td>—</td><td></td></tr>")
            continue
        state, css = ("ok", "ok") if entry.success else ("failing", "bad")
        age = _age(now - entry.last_success) + " ago" if entry.last_success else "never"
        rows.append(
            f"<tr><td>{html.escape(source)}</td><td class={css}>{state}</td><td>{age}</td>"
            f"<td>{html.escape(entry.error)}</td></tr>"
        )
    firing = [a for a in view.alerts() if a.state == "firing"]
    alert_rows = "".join(
        f"<tr><td class=bad>{html.escape(a.labels['alertname'])}</td>"
        f"<td>{html.escape(', '.join(f'{k}={v}' for k, v in sorted(a.labels.items()) if k != 'alertname'))}</td>"
        f"<td>{html.escape(a.annotations.get('summary', ''))}</td><td>{_age(now - (a.fired_at or now))}</td></tr>"
        for a in top(firing, ROWS, lambda a: -(a.fired_at or now))
    )
    alerts = (
        "<table><tr><th>alert</th><th>labels</th><th>summary</th><th>firing for</th></tr>"
        + alert_rows
        + "</table>"
        + _more(len(firing), '<a href="/api/v1/alerts">Alerts (JSON)</a>')
        if firing
        else "<p>No alert is firing.</p>"
    )
    budget_rows = "".join(
        f"<tr><td>{html.escape(b.name)}</td><td>{html.escape(_scope(b))}"
        + ("<br><span class=bad>matches nothing</span>" if scope_matched(b, view.latest) is False else "")
        + f"</td><td>{html.escape(b.period)}</td><td>{b.amount:f}</td>"
        + (
            f"<td class={_level(r[0])}>{r[0]:.1%}</td><td class={_level(r[1])}>{r[1]:.1%}</td>"
            if r
            else "<td class=wait>—</td><td class=wait>—</td>"
        )
        + f"<td>{_crosses(found, b)}</td></tr>"
        for b, found in current_figures(view.latest, view.budgets(), view.prices(), view.today())
        for r in [None if found is None else found.ratios(b.amount)]
    )
    probed: list[Probe] = [(name, p, None) for name, p in sorted(view.latest.probes.items())]
    probe_head = "<table><tr><th>probe</th><th>endpoint</th>"
    reconciliation = _disagreements(view.latest.reconciliation)
    bills = view.latest.bills
    # The account's monthly budgets: a scoped one against the whole account's bars would mislead.
    monthly = [(b.name, b.amount) for b in view.budgets() if b.period == "month" and not b.where]
    chart = "<p>No bills yet.</p>"
    if bills is not None:  # (a month the billing day has left, its bills not read since: over, not "so far")
        today = view.today()
        chart = month_chart(
            bills.current, today if today is not None and _over(bills.current, today) else bills.today, monthly
        )
    budget_head = "<table><tr><th>budget</th><th>scope</th>"
    several = view.accounts() if view.accounts is not None else None
    if several is not None:  # several accounts: a table of them instead of one account's chart
        chart, budget_rows, probed, reconciliation = _accounts(view, several)
        budget_head = "<table><tr><th>budget</th><th>account</th><th>scope</th>"
        probe_head = "<table><tr><th>probe</th><th>account</th><th>endpoint</th>"
    budgets = (
        budget_head
        + "<th>period</th><th>amount</th><th>used</th><th>forecast</th><th>crossed at this pace</th></tr>"
        + budget_rows
        + "</table>"
        if budget_rows
        else "<p>No budget is configured.</p>"
    )
    probes = (
        probe_head
        + "<th>scenario</th><th>last run</th><th>duration</th><th>first token</th></tr>"
        + "".join(_probe_row(*probe) for probe in top(probed, ROWS, lambda probe: probe[1].last.success))
        + "</table>"
        + _more(len(probed), '<a href="/metrics">Metrics</a> (inference_probe_success)')
        if probed
        else "<p>No probe has run.</p>"
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>inference-cost-exporter</title>
<style>
body {{ font: 15px/1.5 system-ui, sans-serif; margin: 2rem auto; max-width: 60rem; padding: 0 1rem; color: #1d2330; }}
table {{ border-collapse: collapse; width: 100%; margin-bottom: 2rem; }}
td, th {{ text-align: left; padding: .35rem .6rem; border-bottom: 1px solid #dde2ea; }}
.ok {{ color: #1a7f37; font-weight: 600; }} .bad {{ color: #c62828; font-weight: 600; }} .wait {{ color: #8a6d00; }}
</style></head><body>
<h1>inference-cost-exporter <small>{html.escape(__version__)}</small></h1>
<p><a href="/metrics">Metrics</a> · <a href="/healthz">Health</a> · <a href="/readyz">Readiness</a>
 · <a href="/api/v1/alerts">Alerts (JSON)</a></p>
<h2>{"Accounts" if several is not None else "This month"}</h2>
{chart}
<h2>Sources</h2>
<table><tr><th>source</th><th>last refresh</th><th>last success</th><th>error</th></tr>
{"".join(rows)}
</table>
<h2>Budgets</h2>
{budgets}
<h2>Probes</h2>
{probes}
<h2>Firing alerts</h2>
{alerts}
<h2>Bill against usage</h2>
{reconciliation}
</body></html>
"""
