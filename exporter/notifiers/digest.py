"""How a digest reads: its subject, plain text, HTML and Slack blocks, from the body
`exporter.digest.build` makes (a JSON-able mapping, as the digest outbox holds it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from exporter.core import mrkdwn
from exporter.core.words import NO_ENDPOINT, counted


def _span_name(d: Mapping[str, Any]) -> str:
    return d["day"] if d["first_day"] == d["day"] else f"{d['first_day']} to {d['day']}"


def _money(d: Mapping[str, Any], amount: str | None) -> str | None:
    """An amount with the digest's currency after it, when the config names one."""
    currency = d.get("currency")  # (not in a digest queued by an earlier version)
    return f"{amount} {currency}" if currency and amount is not None else amount


def subject(d: Mapping[str, Any]) -> str:
    what = "Weekly" if d["schedule"] == "weekly" else "Daily"
    spend = _money(d, d["spend"]) if d["spend"] is not None else "unknown"
    expected = f" (expected {_money(d, d['expected'])})" if d["expected"] else ""
    account = f" of {d['account']}" if d.get("account") else ""
    return f"{what} inference spend{account} {_span_name(d)}: {spend}{expected}"


def _change(value: float | None) -> str:
    return "new" if value is None else f"{value:+.1f}%"


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.0%}"


def _more(d: Mapping[str, Any], key: str, path: str) -> list[str]:
    """The line that says how many of a list the digest left out (`LISTED` are listed), and where
    the exporter lists them all."""
    count = d.get("more", {}).get(key, 0)
    if not count:
        return []
    where = f": see {d['url']}{path}" if path and d["url"] else ""
    return [f"and {count:,} more{where}"]


def _budget(d: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    """A budget as the digest was made, not as of the day it summarises: the period it measures
    (the month or the day in progress, or on the 1st the month that ended) is in its line."""
    amount = _money(d, b["amount"])
    spans = b.get("accounts")  # (a budget over several accounts: the organisation's)
    over = f", accounts {', '.join(spans)}" if spans else ""
    if "of" in b:
        return f"{b['budget']} ({b['of']}, ended, {amount}{over}): used {_ratio(b['used_ratio'])}"
    period, so_far = b["period"], b.get("so_far")
    measured = f"{period} {so_far}" if so_far else "this month" if period == "month" else "today"
    crossing = b.get("crossing")  # (a digest queued by a version without it has none)
    when = f"; at this pace its amount is crossed on {crossing}" if crossing else ""
    return (
        f"{b['budget']} ({measured} so far, {amount}{over}): used {_ratio(b['used_ratio'])},"
        f" forecast {_ratio(b['forecast_ratio'])}{when}"
    )


def _sections(d: Mapping[str, Any]) -> list[tuple[str, list[str]]]:
    """The digest as titled lists of lines (plain text; each renderer escapes or formats them)."""
    unknown = "unknown (no bills for it yet)"
    span_word = "Last week" if d["schedule"] == "weekly" else "Yesterday"
    spend = [f"{span_word} ({_span_name(d)}): {_money(d, d['spend']) if d['spend'] is not None else unknown}"]
    if d["expected"] is not None:
        spend.append(f"Expected: {_money(d, d['expected'])}")
    spend.append(f"Month to date ({d['period']}): {_money(d, d['month_to_date']) or unknown}")
    if d["forecast"] is not None:
        spend.append(f"Forecast for {d['period']}: {_money(d, d['forecast'])}")
    if ended := d.get("ended"):  # (a week that ran into a new month: how the one before ended)
        spend.append(f"Month {ended['period']} ended: {_money(d, ended['total']) or unknown}")
    sections = [("Spend", spend)]
    if d["budgets"]:
        sections.append(("Budgets as they stand now", [_budget(d, b) for b in d["budgets"]]))
    against = "the week before" if d["schedule"] == "weekly" else "the day before"
    for title, key, rows in (
        ("Top endpoints", "endpoint_id", d["top_endpoints"]),
        ("Top items", "item", d["top_items"]),
    ):
        if not rows:
            continue
        known = "change_percent" in rows[0]  # (the change is each row's, or none's: not known)
        heading = f"{title} (change against {against})" if known else f"{title} (no change: {against} is not known)"
        lines = [
            f"{r[key] or NO_ENDPOINT}: {_money(d, r['amount'])}"
            + (f" ({_change(r['change_percent'])})" if known else "")
            for r in rows
        ]
        sections.append((heading, lines))
    if d["anomalies"]:
        lines = []
        for a in d["anomalies"]:
            group = ", ".join(f"{k}={v or NO_ENDPOINT}" for k, v in a["labels"].items()) or "account"
            share = ", ".join(f"{c['name'] or NO_ENDPOINT} {c['share']:.0%}" for c in a["contributors"])
            impact = "" if a["impact_percent"] is None else f" ({a['impact_percent']:+.0f}%)"
            lines.append(
                f"{a['alertname']} {a['day']} {group}: {_money(d, a['actual'])} against {_money(d, a['expected'])}"
                f" expected{impact}" + (f"; {share}" if share else "")
            )
        sections.append(("Spend anomalies", lines + _more(d, "anomalies", "")))
    if d["reconciliation"]:
        lines = []
        for g in d["reconciliation"]:
            gap = "billed, none counted" if g["gap_percent"] is None else f"{g['gap_percent']:+.2f}%"
            if "item" in g:
                lines.append(f"{g['day']} {g['item']}: billed {g['billed']} tokens, counted {g['counted']} ({gap})")
            else:
                billed, estimated = _money(d, g["billed"]), _money(d, g["estimated"])
                endpoint = g["endpoint_id"] or NO_ENDPOINT
                lines.append(f"{g['day']} {endpoint}: billed {billed}, estimated {estimated} ({gap})")
        sections.append(("Bill against usage", lines + _more(d, "reconciliation", "/api/v1/reconciliation")))
    firing = []
    for a in d["alerts"]:
        labels = ", ".join(f"{k}={v}" for k, v in a["labels"].items())
        firing.append(f"{a['alertname']}: {a['summary']}" + (f" [{labels}]" if labels else ""))
    sections.append(("Firing alerts", firing + _more(d, "alerts", "/api/v1/alerts") or ["none"]))
    if d["probes"]:
        lines = []
        for p in d["probes"]:
            ttft = p["time_to_first_token_p95_seconds"]
            if not p["runs"]:
                lines.append(f"{p['probe']}: no runs")
                continue
            lines.append(
                f"{p['probe']}: {_ratio(p['success_ratio'])} of {counted(p['runs'], 'run')} succeeded"
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
    from html import escape as e  # (here: `check` reads the config without it)

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
