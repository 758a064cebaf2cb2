"""The digest: when it is due, what it says, and how each receiver gets it."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import replace
from decimal import Decimal
from zoneinfo import ZoneInfo

import pytest

from exporter.app.digests import digest_due
from exporter.config.rules import AnomalyRule
from exporter.config.schema import BudgetConfig, DigestConfig
from exporter.core.clock import Clock, FrozenClock
from exporter.digest.build import LISTED, FiringAlert, ProbeStat, build, p95, span
from exporter.model.snapshots import (
    AmountGap,
    BillsSnapshot,
    DailyAmount,
    HistorySnapshot,
    Latest,
    MonthBills,
    MonthHistory,
    Reconciliation,
    TokenGap,
    per_day,
)
from exporter.notifiers.digest import html, slack, subject, text

SHANGHAI = ZoneInfo("Asia/Shanghai")
SENT_ON = dt.date(2026, 11, 23)  # a Monday
RULE = AnomalyRule(alert="SpendAnomaly", signal="spend_anomaly", by=("endpoint_id",), min_amount=20, min_percent=30)


def at(day: dt.date, hour: int, minute: int = 0) -> tuple[Clock, dt.datetime]:
    now = dt.datetime.combine(day, dt.time(hour, minute), SHANGHAI)
    return Clock(SHANGHAI, FrozenClock(now)), now


@pytest.mark.parametrize(
    ("schedule", "day", "hour", "minute", "due"),
    [
        ("daily", SENT_ON, 8, 59, None),  # yesterday's 09:00 is 24 h ago: skipped, today's comes in a minute
        ("daily", SENT_ON, 9, 0, SENT_ON),
        ("daily", SENT_ON, 20, 59, SENT_ON),  # sent late, up to half a day
        ("daily", SENT_ON, 21, 1, None),
        ("daily", SENT_ON + dt.timedelta(days=1), 0, 30, None),  # 15 h late: the next one is nearer
        ("weekly", SENT_ON, 8, 0, None),
        ("weekly", SENT_ON, 9, 0, SENT_ON),
        ("weekly", SENT_ON + dt.timedelta(days=3), 20, 0, SENT_ON),
        ("weekly", SENT_ON + dt.timedelta(days=4), 9, 0, None),
    ],
)
def test_a_digest_is_due_from_its_time_until_half_its_period_has_passed(
    schedule: str, day: dt.date, hour: int, minute: int, due: dt.date | None
) -> None:
    clock, now = at(day, hour, minute)
    config = DigestConfig(schedule=schedule, at="09:00", notifiers=("hook",))  # type: ignore[arg-type]
    assert digest_due(config, now, clock) == due


def test_the_span_is_the_day_before_or_the_seven_days_before() -> None:
    assert span("daily", SENT_ON) == (dt.date(2026, 11, 22), dt.date(2026, 11, 22))
    assert span("weekly", SENT_ON) == (dt.date(2026, 11, 16), dt.date(2026, 11, 22))


def amounts(key: str, per_day: dict[dt.date, Decimal]) -> list[DailyAmount]:
    return [DailyAmount(f"{d:%Y-%m}", d, key, "prod", "proj", amount, amount) for d, amount in per_day.items()]


def month(days: int = 22) -> Latest:
    """Two endpoints and two items: ep-a spends 100 a day, ep-b 50 (200 on the 22nd)."""
    dates = [dt.date(2026, 11, d) for d in range(1, days + 1)]
    a = {d: Decimal(100) for d in dates}
    b = {d: Decimal(200 if d.day == 22 else 50) for d in dates}
    by_endpoint = tuple(amounts("ep-a", a) + amounts("ep-b", b))
    by_item = tuple(
        amounts("ITEM_PROMPT_TOKEN", {d: a[d] / 2 + b[d] / 2 for d in dates})
        + amounts("ITEM_COMPLETION_TOKEN", {d: a[d] / 2 + b[d] / 2 for d in dates})
    )
    total = sum((x.payable for x in by_item), Decimal(0))
    bills = MonthBills("2026-11", by_endpoint, by_item, total, total + Decimal(1000), Decimal(150))
    latest = Latest()
    latest.bills = BillsSnapshot((bills,), dt.date(2026, 11, 23))
    return latest


def test_the_daily_digest_says_what_yesterday_cost_against_the_day_before_and_its_baseline() -> None:
    latest = month()
    d = build(latest, schedule="daily", sent_on=SENT_ON, url="http://exporter:9877")
    assert d["kind"] == "digest"
    assert (d["day"], d["first_day"], d["period"]) == ("2026-11-22", "2026-11-22", "2026-11")
    assert d["yesterday"] == d["spend"] == "300.00"
    # 21 days of 150 before it, every weekday alike: the baseline expects 150.
    assert d["expected"] == "150.00"
    assert d["month_to_date"] == f"{150 * 21 + 300}.00"
    assert d["forecast"] == f"{150 * 21 + 300 + 1000}.00"
    assert d["top_endpoints"] == [
        {"endpoint_id": "ep-b", "amount": "200.00", "change_percent": 300.0},
        {"endpoint_id": "ep-a", "amount": "100.00", "change_percent": 0.0},
    ]
    assert [i["item"] for i in d["top_items"]] == ["ITEM_COMPLETION_TOKEN", "ITEM_PROMPT_TOKEN"]
    json.dumps(d)  # the webhook body as it is kept in the outbox


def test_the_weekly_digest_sums_the_week_and_compares_it_with_the_week_before() -> None:
    d = build(month(), schedule="weekly", sent_on=SENT_ON)
    assert (d["first_day"], d["day"]) == ("2026-11-16", "2026-11-22")
    assert d["spend"] == f"{150 * 6 + 300}.00"
    assert d["yesterday"] == "300.00"
    ep_b = next(e for e in d["top_endpoints"] if e["endpoint_id"] == "ep-b")
    assert ep_b == {"endpoint_id": "ep-b", "amount": "500.00", "change_percent": round((500 - 350) / 350 * 100, 1)}


def test_the_weekly_digest_judges_every_day_of_its_week_and_a_missing_day_makes_its_total_unknown() -> None:
    latest = month()
    d = build(latest, schedule="weekly", sent_on=SENT_ON, anomalies=[RULE])
    assert [(a["day"], a["labels"]) for a in d["anomalies"]] == [("2026-11-22", {"endpoint_id": "ep-b"})]
    assert latest.bills is not None
    current = latest.bills.current
    holed = replace(
        current,
        by_item=tuple(a for a in current.by_item if a.day != dt.date(2026, 11, 18)),
        by_endpoint=tuple(a for a in current.by_endpoint if a.day != dt.date(2026, 11, 18)),
    )
    latest.bills = BillsSnapshot((holed,), latest.bills.today)
    d = build(latest, schedule="weekly", sent_on=SENT_ON)
    assert d["spend"] is None  # six days of seven are not the week
    assert d["yesterday"] == "300.00"


def without_day(latest: Latest, day: dt.date) -> Latest:
    """`latest` with no bills held for `day` (a failed fetch, a month no longer held)."""
    assert latest.bills is not None
    current = latest.bills.current
    holed = replace(
        current,
        by_item=tuple(a for a in current.by_item if a.day != day),
        by_endpoint=tuple(a for a in current.by_endpoint if a.day != day),
    )
    latest.bills = BillsSnapshot((holed,), latest.bills.today)
    return latest


def test_the_top_figures_are_of_whole_spans_never_of_some_of_their_days() -> None:
    """A day of the week before not held: the week's top figures have no change (one against six
    days is no change); a day of the week itself not held: no top figures (some days are no week)."""
    d = build(without_day(month(), dt.date(2026, 11, 10)), schedule="weekly", sent_on=SENT_ON)
    assert [e["amount"] for e in d["top_endpoints"]] == ["700.00", "500.00"]
    assert not [e for e in [*d["top_endpoints"], *d["top_items"]] if "change_percent" in e]
    for rendered in (text(d), html(d), json.dumps(slack(d))):
        assert "Top endpoints (no change: the week before is not known)" in rendered
        assert "(new)" not in rendered
    d = build(without_day(month(), dt.date(2026, 11, 18)), schedule="weekly", sent_on=SENT_ON)
    assert (d["spend"], d["top_endpoints"], d["top_items"]) == (None, [], [])


def test_on_the_first_the_month_that_ended_is_told_against_each_monthly_budget() -> None:
    november = month(days=30)
    assert november.bills is not None
    ended = replace(november.bills.current, forecast=november.bills.current.month_to_date)
    december_first = dt.date(2026, 12, 1)
    today = DailyAmount("2026-12", december_first, "ITEM_PROMPT_TOKEN", "prod", "proj", Decimal(40), Decimal(40))
    current = MonthBills("2026-12", (), (today,), Decimal(40), Decimal(1240), Decimal(40))
    latest = Latest()
    latest.bills = BillsSnapshot((current, ended), december_first)
    budget = BudgetConfig(name="monthly", amount=Decimal(4000))
    d = build(latest, schedule="daily", sent_on=december_first, budgets=[budget])
    assert (d["day"], d["period"]) == ("2026-11-30", "2026-11")
    total = ended.month_to_date
    assert d["month_to_date"] == d["forecast"] == f"{total:.2f}"
    assert d["budgets"][0] == {
        "budget": "monthly", "period": "month", "of": "2026-11", "amount": "4000",
        "used_ratio": round(float(total / 4000), 4), "forecast_ratio": round(float(total / 4000), 4),
    }  # fmt: skip
    assert d["budgets"][1]["used_ratio"] == 0.01  # and December's, as it stands
    assert f"monthly (2026-11, ended, 4000): used {float(total / 4000):.0%}" in text(d)


@pytest.mark.parametrize(
    ("sent_on", "ended"),
    [
        (dt.date(2026, 12, 7), "2026-11"),  # the week of Nov 30 to Dec 6: it ran into December
        (dt.date(2026, 11, 30), None),  # Nov 23 to 29: no month ended in it
        (dt.date(2026, 12, 14), None),  # Dec 7 to 13
    ],
)
def test_a_weekly_digest_tells_how_the_month_its_week_ended_ended(sent_on: dt.date, ended: str | None) -> None:
    """Not only when Monday is the 1st: a week that runs into a new month tells the month before's
    total and its monthly budgets' use, beside the new month as it stands."""
    november = month(days=30)
    assert november.bills is not None
    finished = replace(november.bills.current, forecast=november.bills.current.month_to_date)
    days = {dt.date(2026, 12, d): Decimal(40) for d in range(1, 14)}
    december = MonthBills("2026-12", tuple(amounts("ep-a", days)), tuple(amounts("ITEM_PROMPT_TOKEN", days)),
                          Decimal(520), Decimal(1240), Decimal(40))  # fmt: skip
    latest = Latest()
    latest.bills = BillsSnapshot((december, finished), sent_on)
    budget = BudgetConfig(name="monthly", amount=Decimal(4000))
    d = build(latest, schedule="weekly", sent_on=sent_on, budgets=[budget])
    told = [b for b in d["budgets"] if "of" in b]
    rendered = [text(d), html(d), json.dumps(slack(d))]
    if ended is None:
        assert (told, d.get("ended")) == ([], None)
        assert not [r for r in rendered if "ended" in r]
        return
    total = finished.month_to_date
    assert d["period"] == "2026-12"
    assert d["ended"] == {"period": ended, "total": f"{total:.2f}"}
    ratio = round(float(total / 4000), 4)
    assert told == [{"budget": "monthly", "period": "month", "of": ended, "amount": "4000",
                     "used_ratio": ratio, "forecast_ratio": ratio}]  # fmt: skip
    assert [b["so_far"] for b in d["budgets"] if "of" not in b] == ["2026-12"]  # and December's, as it stands
    for r in rendered:
        assert f"Month {ended} ended: {total:.2f}" in r
        assert f"monthly ({ended}, ended, 4000): used {float(total / 4000):.0%}" in r


@pytest.mark.parametrize(("schedule", "sent_on"), [("daily", dt.date(2026, 12, 1)), ("weekly", dt.date(2026, 12, 7))])
def test_a_month_is_told_ended_only_once_the_next_month_s_bills_are_fetched(schedule: str, sent_on: dt.date) -> None:
    """A digest that goes with what there is, the new month's bills not fetched yet (the API down
    since before midnight): what is held of the month that ended may not be all of it, and is shown
    as it stands, never as how the month ended."""
    november = month(days=29)  # (the 30th never fetched)
    budget = BudgetConfig(name="monthly", amount=Decimal(10000))
    d = build(november, schedule=schedule, sent_on=sent_on, budgets=[budget])
    assert [b for b in d["budgets"] if "of" in b] == []
    assert "ended" not in d
    assert [b["so_far"] for b in d["budgets"]] == ["2026-11"]
    assert "ended" not in text(d)


def test_on_the_first_the_month_that_ended_has_no_forecast_once_its_bills_are_no_longer_held() -> None:
    november = month(days=30)
    assert november.bills is not None
    ended = november.bills.current
    december_first = dt.date(2026, 12, 1)
    current = MonthBills("2026-12", (), (), Decimal(0), Decimal(1200), Decimal(40))
    latest = Latest()
    latest.bills = BillsSnapshot((current,), december_first)  # (no grace days, no history: November is gone)
    d = build(latest, schedule="daily", sent_on=december_first)
    assert (d["period"], d["month_to_date"], d["forecast"]) == ("2026-11", None, None)
    assert "Forecast for" not in text(d)
    # Held in the history instead, it is the month's total.
    latest.history = HistorySnapshot(
        {"2026-11": MonthHistory("2026-11", ended.by_endpoint, ended.by_item, december_first)}
    )
    d = build(latest, schedule="daily", sent_on=december_first)
    assert d["forecast"] == d["month_to_date"] == f"{sum(per_day(ended.by_item).values()):.2f}"


def test_too_little_history_gives_no_expected_amount_rather_than_a_guess() -> None:
    d = build(month(days=8), schedule="daily", sent_on=dt.date(2026, 11, 9))
    assert d["spend"] == "150.00"
    assert d["expected"] is None
    assert "Expected" not in text(d)


def test_no_bills_for_the_day_reads_unknown_never_zero() -> None:
    d = build(Latest(), schedule="daily", sent_on=SENT_ON)
    assert d["spend"] is None
    assert d["month_to_date"] is None
    assert "Yesterday (2026-11-22): unknown" in text(d)


def test_budgets_anomalies_gaps_alerts_and_probes_are_all_in_it() -> None:
    latest = month()
    latest.reconciliation = Reconciliation(
        tokens=(
            TokenGap(dt.date(2026, 11, 21), "ITEM_COMPLETION_TOKEN", Decimal(1050), 1000, Decimal("0.05")),
            TokenGap(dt.date(2026, 11, 21), "ITEM_PROMPT_TOKEN", Decimal(1000), 1000, Decimal(0)),
        )
    )
    d = build(
        latest,
        schedule="daily",
        sent_on=SENT_ON,
        budgets=[BudgetConfig(name="monthly", amount=Decimal(5000))],
        anomalies=[RULE],
        alerts=[FiringAlert({"alertname": "SpendAnomaly", "endpoint_id": "ep-b"}, "ep-b spent 200", 0.0)],
        probes=[ProbeStat("chat", 4, 3, [0.2, 0.4, 0.3]), ProbeStat("idle", 0, 0, [])],
        settled={dt.date(2026, 11, 21)},
    )
    assert d["budgets"] == [
        {"budget": "monthly", "period": "month", "so_far": "2026-11", "amount": "5000", "used_ratio": 0.69,
         "forecast_ratio": 0.89, "crossing": None}  # (forecast under the amount: not crossed this month)
    ]  # fmt: skip
    over = build(latest, schedule="daily", sent_on=SENT_ON, budgets=[BudgetConfig(name="low", amount=Decimal(3000))])
    (low,) = over["budgets"]  # 3,450 spent by the 22nd: crossed on the day the month to date reached 3,000
    total, crossed = Decimal(0), None
    for day, amount in sorted(per_day(latest.bills.current.by_item).items()):  # type: ignore[union-attr]
        total += amount
        if crossed is None and total >= 3000:
            crossed = day
    assert low["crossing"] == crossed.isoformat()  # type: ignore[union-attr]
    assert f"at this pace its amount is crossed on {crossed}" in text(over)
    assert d["anomalies"] == [
        {
            "alertname": "SpendAnomaly",
            "day": "2026-11-22",
            "labels": {"endpoint_id": "ep-b"},
            "actual": "200.00",
            "expected": "50.00",
            "impact_percent": 300.0,
            "contributors": [],
        },
    ]  # fmt: skip  (ep-a spent as usual; the bills here split no endpoint by item)
    assert d["reconciliation"] == [
        {"day": "2026-11-21", "item": "ITEM_COMPLETION_TOKEN", "billed": "1050", "counted": "1000", "gap_percent": 5.0}
    ]  # the item that agrees is not news
    assert d["alerts"][0]["alertname"] == "SpendAnomaly"
    assert d["probes"] == [
        {"probe": "chat", "runs": 4, "success_ratio": 0.75, "time_to_first_token_p95_seconds": 0.4},
        {"probe": "idle", "runs": 0, "success_ratio": None, "time_to_first_token_p95_seconds": None},
    ]
    body = text(d)
    for line in (
        "monthly (month 2026-11 so far, 5000): used 69%, forecast 89%",
        "SpendAnomaly 2026-11-22 endpoint_id=ep-b: 200.00 against 50.00 expected (+300%)",
        "2026-11-21 ITEM_COMPLETION_TOKEN: billed 1050 tokens, counted 1000 (+5.00%)",
        "SpendAnomaly: ep-b spent 200 [endpoint_id=ep-b]",
        "chat: 75% of 4 runs succeeded, p95 time to first token 400 ms",
        "idle: no runs",
    ):
        assert line in body
    # A day's gaps are told by the digest that first sees it settled, not again the day after.
    later = build(latest, schedule="daily", sent_on=SENT_ON, settled={SENT_ON - dt.timedelta(1)})
    assert later["reconciliation"] == []


def test_names_from_the_api_cannot_inject_markup_into_html_or_slack() -> None:
    latest = month()
    hostile = "<script>alert(1)</script>&<!here>"
    d = build(latest, schedule="daily", sent_on=SENT_ON, alerts=[FiringAlert({"alertname": "A"}, hostile, None)])
    assert hostile not in html(d)
    assert "&lt;script&gt;" in html(d)
    rendered = json.dumps(slack(d))
    assert "<script>" not in rendered
    assert "<!here>" not in rendered
    assert "&lt;!here&gt;" in rendered
    assert slack(d)["text"] == subject(d)


def test_p95_is_the_nearest_rank() -> None:
    assert p95([]) is None
    assert p95([1.0]) == 1.0
    assert p95([float(n) for n in range(1, 101)]) == 95.0
    assert p95([float(n) for n in range(1, 21)]) == 19.0


def test_past_listed_rows_it_tells_the_largest_anomalies_and_gaps_and_the_latest_alerts_and_counts_the_rest() -> None:
    """Endpoints ep-00 to ep-24 spend 10 a day; on the 22nd ep-n spends 10 + 20 × n: every one but ep-00 is
    an anomaly. Each is also off against its usage on the 21st by (n + 1)%, and has an alert that fired n
    minutes before the first one's."""
    dates = [dt.date(2026, 11, d) for d in range(1, 23)]
    names = [f"ep-{n:02d}" for n in range(LISTED + 5)]
    by_endpoint = [
        a
        for n, e in enumerate(names)
        for a in amounts(e, {d: Decimal(10 + 20 * n if d.day == 22 else 10) for d in dates})
    ]
    latest = Latest()
    latest.bills = BillsSnapshot(
        (MonthBills("2026-11", tuple(by_endpoint), (), Decimal(0), Decimal(0), Decimal(0)),), SENT_ON
    )
    settled = dt.date(2026, 11, 21)
    latest.reconciliation = Reconciliation(
        amounts=tuple(AmountGap(settled, e, Decimal(1), Decimal(1), Decimal(n + 1) / 100) for n, e in enumerate(names))
    )
    alerts = [FiringAlert({"alertname": "Spend", "endpoint_id": e}, "", 3600.0 - 60 * n) for n, e in enumerate(names)]
    d = build(
        latest, schedule="daily", sent_on=SENT_ON, anomalies=[RULE], alerts=alerts, settled={settled},
        url="http://exporter:9877",
    )  # fmt: skip
    # The largest impact, the largest gap: the last LISTED endpoints; the alerts fired last: the first LISTED.
    assert [a["labels"]["endpoint_id"] for a in d["anomalies"]] == names[-LISTED:]
    assert [g["endpoint_id"] for g in d["reconciliation"]] == names[-LISTED:]
    assert [a["labels"]["endpoint_id"] for a in d["alerts"]] == names[:LISTED]
    assert d["more"] == {"anomalies": 4, "reconciliation": 5, "alerts": 5}
    json.dumps(d)
    # Each rendering says what was left out, and where the exporter lists it all.
    lines = text(d).splitlines()
    for title, more in (
        ("Spend anomalies", "and 4 more"),
        ("Bill against usage", "and 5 more: see http://exporter:9877/api/v1/reconciliation"),
        ("Firing alerts", "and 5 more: see http://exporter:9877/api/v1/alerts"),
    ):
        section = lines[lines.index(title) :]
        assert section[LISTED + 1] == f"  {more}", title  # the title, LISTED rows, then the line
    assert "and 5 more: see http://exporter:9877/api/v1/alerts" in html(d)
    assert "and 5 more" in json.dumps(slack(d))


def test_the_gaps_tell_nothing_counted_first_then_the_largest_then_the_newest_day() -> None:
    days = [dt.date(2026, 11, 20), dt.date(2026, 11, 21)]
    gaps = [
        TokenGap(day, f"ITEM_{n:02d}", Decimal(1), 1, Decimal(n) / 100 if n else None)
        for day in days
        for n in range(15)
    ] + [TokenGap(days[0], "ITEM_X", Decimal(1), 0, None)]
    latest = month()
    latest.reconciliation = Reconciliation(tokens=tuple(gaps))
    d = build(latest, schedule="daily", sent_on=SENT_ON, settled={days[0], days[1]})
    # Nothing counted (3), then 14% down to 7% (two each), then of the two at 6% the one of the 21st.
    kept = [
        g
        for g in gaps
        if g.ratio is None or g.ratio >= Decimal("0.07") or (g.ratio, g.day) == (Decimal("0.06"), days[1])
    ]
    assert len(kept) == LISTED
    assert [(g["day"], g["item"]) for g in d["reconciliation"]] == [(g.day.isoformat(), g.item) for g in kept]
    assert d["more"] == {"reconciliation": len(gaps) - LISTED}


def test_up_to_listed_rows_each_list_is_whole_and_there_is_no_more() -> None:
    latest = month()
    alerts = [FiringAlert({"alertname": f"A{n}"}, "", float(n)) for n in range(LISTED)]
    d = build(latest, schedule="daily", sent_on=SENT_ON, alerts=alerts)
    assert [a["alertname"] for a in d["alerts"]] == [f"A{n}" for n in range(LISTED)]
    assert "more" not in d


def test_budgets_say_they_are_now_not_yesterday_in_every_form() -> None:
    """The digest is about yesterday; its budgets are as they stand when it is made (the month and
    the day in progress): each form says so, and names the period each budget measures."""
    latest = month()  # the bills' today: the 23rd, the day the digest is made
    budgets = [BudgetConfig(name="monthly", amount=Decimal(5000)),
               BudgetConfig(name="daily", amount=Decimal(500), period="day")]  # fmt: skip
    d = build(latest, schedule="daily", sent_on=SENT_ON, budgets=budgets)
    assert d["day"] == "2026-11-22"
    assert [(b["budget"], b["so_far"]) for b in d["budgets"]] == [("monthly", "2026-11"), ("daily", "2026-11-23")]
    lines = ["monthly (month 2026-11 so far, 5000): used 69%, forecast 89%",
             "daily (day 2026-11-23 so far, 500): used 0%, forecast 30%"]  # fmt: skip
    assert "Budgets as they stand now\n" + "".join(f"  {line}\n" for line in lines) in text(d)
    assert "<h3>Budgets as they stand now</h3><ul>" + "".join(f"<li>{line}</li>" for line in lines) in html(d)
    [section] = [b["text"]["text"] for b in slack(d)["blocks"] if b["text"]["text"].startswith("*Budgets")]
    assert section == "*Budgets as they stand now*\n" + "\n".join(f"• {line}" for line in lines)
    # A digest an earlier version queued (no `so_far`) still reads as now, not as yesterday.
    earlier = {**d, "budgets": [{k: v for k, v in b.items() if k != "so_far"} for b in d["budgets"]]}
    assert "monthly (this month so far, 5000)" in text(earlier)
    assert "daily (today so far, 500)" in text(earlier)


def test_amounts_carry_the_currency_when_the_config_names_it() -> None:
    latest = month()
    latest.reconciliation = Reconciliation(
        amounts=(AmountGap(dt.date(2026, 11, 21), "ep-a", Decimal("105"), Decimal("100"), Decimal("0.05")),)
    )
    d = build(latest, schedule="daily", sent_on=SENT_ON, budgets=[BudgetConfig(name="monthly", amount=Decimal(5000))],
              anomalies=[RULE], settled={dt.date(2026, 11, 21)}, currency="CNY")  # fmt: skip
    assert d["currency"] == "CNY"
    assert d["spend"] == "300.00"  # the JSON's amounts stay decimal strings, the currency beside them
    assert subject(d) == "Daily inference spend 2026-11-22: 300.00 CNY (expected 150.00 CNY)"
    body = text(d)
    for line in (
        "Yesterday (2026-11-22): 300.00 CNY",
        "Expected: 150.00 CNY",
        f"Month to date (2026-11): {150 * 21 + 300}.00 CNY",
        f"Forecast for 2026-11: {150 * 21 + 300 + 1000}.00 CNY",
        "monthly (month 2026-11 so far, 5000 CNY): used 69%, forecast 89%",
        "ep-b: 200.00 CNY (+300.0%)",
        "SpendAnomaly 2026-11-22 endpoint_id=ep-b: 200.00 CNY against 50.00 CNY expected (+300%)",
        "2026-11-21 ep-a: billed 105.00 CNY, estimated 100.00 CNY (+5.00%)",
    ):
        assert f"  {line}\n" in body
    assert "300.00 CNY" in html(d)
    assert "300.00 CNY" in json.dumps(slack(d))
    unknown = build(latest, schedule="daily", sent_on=SENT_ON)
    assert unknown["currency"] == ""
    assert subject(unknown) == "Daily inference spend 2026-11-22: 300.00 (expected 150.00)"


def test_a_count_of_one_run_is_singular() -> None:
    d = build(month(), schedule="daily", sent_on=SENT_ON, probes=[ProbeStat("chat", 1, 1, [0.25])])
    assert "chat: 100% of 1 run succeeded, p95 time to first token 250 ms" in text(d)
