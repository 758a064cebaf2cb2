"""The landing page's month chart (exporter.web.chart): its bars, forecast and budget lines against the bills."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from decimal import Decimal
from html.parser import HTMLParser

import pytest

from exporter.config.schema import BudgetConfig
from exporter.core.clock import Clock, days_in_period
from exporter.metrics.accounts import SharedBudgetCollector
from exporter.model.snapshots import BillsSnapshot, DailyAmount, Latest, MonthBills, per_day
from exporter.sources.bills import forecast
from exporter.web import View, landing_page
from exporter.web.chart import COLOURS, OTHER_COLOUR, month_chart, nice_scale
from exporter.web.views import AccountView
from tests.conftest import SHANGHAI

CENT = Decimal("0.01")
PX = 0.011
"""Geometry is written to 0.01 px: a height and the amount × scale it stands for may differ by half that, twice."""


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    title: str = ""
    text: str = ""

    @property
    def classes(self) -> list[str]:
        return self.attrs.get("class", "").split()

    def number(self, name: str) -> float:
        return float(self.attrs[name])


@dataclass
class Chart:
    """A parsed page or chart: every element in document order, with its title (tooltip) and text."""

    elements: list[Element] = field(default_factory=list)

    def find(self, tag: str, css: str) -> list[Element]:
        return [e for e in self.elements if e.tag == tag and css in e.classes]

    @property
    def svg(self) -> Element:
        (svg,) = self.find("svg", "month-chart")
        return svg

    @property
    def bars(self) -> list[Element]:
        return self.find("rect", "bar")

    @property
    def forecasts(self) -> list[Element]:
        return self.find("rect", "forecast")

    @property
    def scale(self) -> float:
        return self.svg.number("data-scale")

    @property
    def baseline(self) -> float:
        return self.svg.number("data-baseline")

    def amounts(self) -> dict[tuple[str, str], Decimal]:
        """Each coloured segment's amount by (day, endpoint)."""
        amounts: dict[tuple[str, str], Decimal] = {}
        for bar in self.bars:
            if "data-endpoint" in bar.attrs:
                key = (bar.attrs["data-day"], bar.attrs["data-endpoint"])
                assert key not in amounts, f"two segments for {key}"
                amounts[key] = Decimal(bar.attrs["data-amount"])
        return amounts


class _Parser(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.chart = Chart()
        self.stack: list[Element] = []
        self.in_title = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "title":
            self.in_title = True
            return
        element = Element(tag, {name: value or "" for name, value in attrs})
        self.chart.elements.append(element)
        self.stack.append(element)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.chart.elements.append(Element(tag, {name: value or "" for name, value in attrs}))

    def handle_endtag(self, tag: str) -> None:
        if tag == "title":
            self.in_title = False
            return
        while self.stack and self.stack.pop().tag != tag:
            pass

    def handle_data(self, data: str) -> None:
        """A title is its parent's tooltip; other text counts in every open element's (as textContent)."""
        if self.in_title:
            if self.stack:
                self.stack[-1].title += data
            return
        for element in self.stack:
            element.text += data


def parse_chart(page: str) -> Chart:
    parser = _Parser()
    parser.feed(page)
    parser.close()
    return parser.chart


Row = tuple[int, str, str, str, str]
"""(day of the month, endpoint, product, project, payable amount)."""


def month_of(period: str, today: dt.date, rows: Iterable[Row]) -> MonthBills:
    """A month's bills as BillsSource makes them: month to date and the forecast from the daily totals."""
    year, number = (int(p) for p in period.split("-"))
    by_endpoint = tuple(
        DailyAmount(period, dt.date(year, number, day), key, product, project, Decimal(amount), Decimal(0))
        for day, key, product, project, amount in rows
    )
    days = per_day(by_endpoint)
    month_end, today_end = forecast(period, today, days, None)
    return MonthBills(period, by_endpoint, by_endpoint, sum(days.values(), Decimal(0)), month_end, today_end)


def simple_rows(last_day: int, endpoints: int = 3) -> list[Row]:
    """Every endpoint billed every day up to `last_day`, with amounts that differ by day and endpoint."""
    return [
        (day, f"ep-{e}", "P", "proj", f"{(day * 7 + e * 13) % 40 + 5 + e * 10}.{(day * e) % 100:02d}")
        for day in range(1, last_day + 1)
        for e in range(endpoints)
    ]


def expected_sums(rows: Iterable[Row], period: str) -> dict[tuple[str, str], Decimal]:
    sums: dict[tuple[str, str], Decimal] = {}
    for day, key, _, _, amount in rows:
        k = (f"{period}-{day:02d}", key)
        sums[k] = sums.get(k, Decimal(0)) + Decimal(amount)
    return sums


TODAY = dt.date(2026, 11, 22)


def test_segments_match_the_bills_per_day_and_endpoint() -> None:
    """Rows sharing a (day, endpoint) with another product or project are one segment: their sum."""
    rows = [
        *simple_rows(22),
        (5, "ep-1", "OTHER_PRODUCT", "proj", "3.335"),
        (5, "ep-1", "P", "proj-lab", "1.111"),
        (22, "ep-2", "P", "proj-lab", "0.004"),
    ]
    chart = parse_chart(month_chart(month_of("2026-11", TODAY, rows), TODAY, []))
    expected = expected_sums(rows, "2026-11")
    shown = chart.amounts()
    assert shown.keys() == expected.keys()
    for key, amount in expected.items():
        assert shown[key].quantize(CENT) == amount.quantize(CENT), key
    five = next(b for b in chart.bars if b.attrs["data-day"] == "2026-11-05" and b.attrs["data-endpoint"] == "ep-1")
    assert five.title == f"ep-1, 2026-11-05: {expected['2026-11-05', 'ep-1']:.2f}"


def test_heights_are_proportional_to_the_amounts_on_one_scale() -> None:
    chart = parse_chart(month_chart(month_of("2026-11", TODAY, simple_rows(22)), TODAY, []))
    for bar in chart.bars:
        assert bar.number("height") == pytest.approx(float(bar.attrs["data-amount"]) * chart.scale, abs=PX)
    tall = sorted(chart.bars, key=lambda b: b.number("height"))[-2:]
    (a, b) = tall
    assert a.number("height") / b.number("height") == pytest.approx(
        float(Decimal(a.attrs["data-amount"]) / Decimal(b.attrs["data-amount"])), rel=1e-3
    )
    # The tallest day stays inside the plot, under the axis maximum.
    top = max(Decimal(g.attrs["data-total"]) for g in chart.find("g", "day"))
    ticks = [float(t.text) for t in chart.find("text", "tick")]
    assert ticks[0] == 0
    assert ticks[-1] >= float(top)
    assert (ticks[-1] - ticks[0]) * chart.scale == pytest.approx(250)


def test_a_stack_is_ordered_by_month_to_date_and_adds_up_to_the_day() -> None:
    rows = simple_rows(22)
    month = month_of("2026-11", TODAY, rows)
    chart = parse_chart(month_chart(month, TODAY, []))
    ranking = ["ep-2", "ep-1", "ep-0"]  # ep-2 has the most this month (its amounts are the highest)
    totals = {key: sum((Decimal(a) for _, k, _, _, a in rows if k == key), Decimal(0)) for key in ranking}
    assert sorted(totals, key=lambda k: -totals[k]) == ranking
    days = {g.attrs["data-day"]: g for g in chart.find("g", "day")}
    assert len(days) == 22
    for day, group in days.items():
        segments = [b for b in chart.bars if b.attrs["data-day"] == day]
        assert [b.attrs["data-endpoint"] for b in segments] == ranking
        bottom = chart.baseline
        for bar in segments:  # bottom up, each on the one before
            assert bar.number("y") + bar.number("height") == pytest.approx(bottom, abs=PX)
            bottom = bar.number("y")
        total = sum((Decimal(b.attrs["data-amount"]) for b in segments), Decimal(0))
        assert Decimal(group.attrs["data-total"]) == total == sum(Decimal(a) for d, *_, a in rows if d == int(day[-2:]))
        assert chart.baseline - bottom == pytest.approx(float(total) * chart.scale, abs=PX)
        # One width and position per day: the stack is one bar.
        assert len({(b.attrs["x"], b.attrs["width"]) for b in segments}) == 1
    # Colours follow the rank, as in the legend.
    assert [b.attrs["fill"] for b in chart.bars[:3]] == list(COLOURS[:3])
    legend = [g.text for g in chart.find("g", "legend")]
    assert legend[:3] == ranking


def test_today_is_partial_and_the_days_after_it_are_forecast_at_the_forecasts_rate() -> None:
    month = month_of("2026-11", TODAY, simple_rows(22))
    chart = parse_chart(month_chart(month, TODAY, []))
    (today,) = chart.find("g", "today")
    assert today.attrs["data-day"] == "2026-11-22"
    assert today.attrs["data-partial"] == "true"
    assert all(
        ("fill-opacity" in b.attrs) == (b.attrs["data-day"] == "2026-11-22") for b in chart.bars
    )  # today lighter
    assert len(chart.find("rect", "today-outline")) == 1

    so_far = sum((a.payable for a in month.by_endpoint if a.day == TODAY), Decimal(0))
    complete = month.month_to_date - so_far
    average = sum((a.payable for a in month.by_endpoint if 15 <= a.day.day <= 21), Decimal(0)) / 7
    rate = (month.forecast - complete - month.today_forecast) / 8  # 30 days, 22 billed: 8 left
    assert rate.quantize(CENT) == average.quantize(CENT)  # the trailing week's average the forecast projects with
    assert month.forecast > month.month_to_date
    (rest,) = chart.find("rect", "rest-of-today")  # the rest of what the forecast expects of today, on top
    assert Decimal(rest.attrs["data-amount"]) == (month.today_forecast - so_far).quantize(CENT)
    assert rest.number("y") + rest.number("height") == pytest.approx(
        chart.baseline - float(so_far) * chart.scale, abs=PX
    )
    assert [f.attrs["data-day"] for f in chart.forecasts] == [f"2026-11-{d}" for d in range(23, 31)]
    for bar in chart.forecasts:
        assert Decimal(bar.attrs["data-amount"]) == rate.quantize(CENT)
        assert bar.number("height") == pytest.approx(float(rate) * chart.scale, abs=PX)
        assert bar.number("y") + bar.number("height") == pytest.approx(chart.baseline, abs=PX)
        assert bar.title == f"forecast, {bar.attrs['data-day']}: {rate:.2f}"
    # The bars add up to the forecast, which the headline states.
    drawn = month.month_to_date + Decimal(rest.attrs["data-amount"])
    drawn += sum(Decimal(f.attrs["data-amount"]) for f in chart.forecasts)
    assert abs(drawn - month.forecast) <= CENT * 9
    (headline,) = chart.find("text", "headline")
    assert f"forecast {month.forecast:.2f} for the month" in headline.text
    assert f"{month.month_to_date:.2f} so far" in headline.text
    assert Decimal(chart.svg.attrs["data-forecast"]) == month.forecast


def test_budget_lines_are_at_the_daily_pace_on_the_bars_scale() -> None:
    month = month_of("2026-11", TODAY, simple_rows(22))
    budgets = [("monthly", Decimal("5000")), ("stretch", Decimal("400"))]
    chart = parse_chart(month_chart(month, TODAY, budgets))
    lines = {g.attrs["data-budget"]: g for g in chart.find("g", "budget")}
    assert lines.keys() == {"monthly", "stretch"}
    elements = chart.elements
    for name, amount in budgets:
        group = lines[name]
        line = elements[elements.index(group) + 1]
        label = elements[elements.index(group) + 2]
        pace = amount / 30
        assert line.tag == "line"
        assert line.attrs["y1"] == line.attrs["y2"]
        assert line.number("y1") == pytest.approx(chart.baseline - float(pace) * chart.scale, abs=PX)
        assert label.text == f"{name}: {amount}/month"
        assert Decimal(group.attrs["data-pace"]) == pace.quantize(CENT)
    # The monthly pace (166.67/day) is above every day's bar: the scale reaches it, so the line is inside the plot.
    assert max(Decimal(g.attrs["data-total"]) for g in chart.find("g", "day")) < Decimal(5000) / 30
    ticks = [float(t.text) for t in chart.find("text", "tick")]
    assert ticks[-1] >= 5000 / 30


def test_close_budget_labels_do_not_overlap() -> None:
    month = month_of("2026-11", TODAY, simple_rows(22))
    chart = parse_chart(month_chart(month, TODAY, [("a", Decimal(3000)), ("b", Decimal(3010))]))
    labels = [t for t in chart.elements if t.tag == "text" and t.text.endswith("/month")]
    assert len(labels) == 2
    (first, second) = labels
    assert second.number("x") < first.number("x") - len(first.text) * 6  # moved left, clear of the first


@pytest.mark.parametrize(("value", "top", "step"), [(0, 1, 0.2), (1, 1, 0.2), (7.3, 8, 2), (412, 500, 100),
                                                    (9001, 10000, 2000), (0.034, 0.04, 0.01)])  # fmt: skip
def test_the_axis_has_round_ticks(value: float, top: float, step: float) -> None:
    assert nice_scale(value) == (pytest.approx(top), pytest.approx(step))


def test_endpoints_beyond_the_top_eight_are_other() -> None:
    rows = [(day, f"ep-{e:02d}", "P", "proj", f"{e + 1}.{day:02d}") for day in range(1, 23) for e in range(50)]
    chart = parse_chart(month_chart(month_of("2026-11", TODAY, rows), TODAY, []))
    top = [f"ep-{e:02d}" for e in range(49, 41, -1)]  # the highest amounts
    assert {b.attrs["data-endpoint"] for b in chart.bars if "data-endpoint" in b.attrs} == set(top)
    others = [b for b in chart.bars if b.attrs.get("data-group") == "other"]
    assert len(others) == 22
    for bar in others:
        day = int(bar.attrs["data-day"][-2:])
        rest = sum(Decimal(a) for d, key, _, _, a in rows if d == day and key not in top)
        assert Decimal(bar.attrs["data-amount"]) == rest
        assert bar.attrs["fill"] == OTHER_COLOUR
        assert bar.title == f"other (42 endpoints), {bar.attrs['data-day']}: {rest:.2f}"
        assert bar.number("height") == pytest.approx(float(rest) * chart.scale, abs=PX)
    # "other" is stacked last (on top).
    day_one = [b for b in chart.bars if b.attrs["data-day"] == "2026-11-01"]
    assert day_one[-1].attrs.get("data-group") == "other"
    assert [b.attrs["data-endpoint"] for b in day_one[:-1]] == top
    legend = [g.text for g in chart.find("g", "legend")]
    assert legend[:9] == [*top, "other (42 endpoints)"]
    # A smaller top N.
    three = parse_chart(month_chart(month_of("2026-11", TODAY, rows), TODAY, [], top=3))
    assert {b.attrs.get("data-endpoint", "other") for b in three.bars} == {"ep-49", "ep-48", "ep-47", "other"}


def test_a_hostile_endpoint_id_is_escaped() -> None:
    hostile = "<script>alert('x')</script>\"&><img src=x onerror=alert(1)>"
    rows = [(1, hostile, "P", "proj", "10"), (2, "ep-1", "P", "proj", "5")]
    page = month_chart(month_of("2026-11", TODAY, rows), TODAY, [("<b>budget</b>", Decimal(100))])
    for raw in ("<script", "<img", "<b>"):
        assert raw not in page
    chart = parse_chart(page)
    assert {b.attrs["data-endpoint"] for b in chart.bars} == {hostile, "ep-1"}
    bar = next(b for b in chart.bars if b.attrs["data-endpoint"] == hostile)
    assert bar.title == f"{hostile}, 2026-11-01: 10.00"
    assert chart.find("g", "budget")[0].attrs["data-budget"] == "<b>budget</b>"
    # Only the chart's own elements: nothing the id smuggled in.
    assert {e.tag for e in chart.elements} <= {"svg", "defs", "pattern", "rect", "line", "text", "g"}


def test_charges_of_no_endpoint_are_named_so() -> None:
    """A fee the bills tie to no endpoint (an empty `instanceId`): its bar and its legend entry say
    "(no endpoint)", not a blank name."""
    rows = [(1, "", "P", "proj", "10"), (2, "ep-1", "P", "proj", "5")]
    page = month_chart(month_of("2026-11", TODAY, rows), TODAY, [])
    chart = parse_chart(page)
    bar = next(b for b in chart.bars if b.attrs["data-endpoint"] == "")
    assert bar.title == "(no endpoint), 2026-11-01: 10.00"
    assert "(no endpoint): 10.00 this month" in page


def test_no_bills_yet() -> None:
    assert month_chart(month_of("2026-11", TODAY, []), TODAY, [("monthly", Decimal(100))]) == "<p>No bills yet.</p>"
    page = landing_page(View(Latest(), lambda accept: (b"", ""), lambda: ["bills"]))
    assert "<h2>This month</h2>\n<p>No bills yet.</p>" in page


@pytest.mark.parametrize(("period", "today", "days"), [("2026-02", 20, 28), ("2026-12", 20, 31), ("2028-02", 3, 29)])
def test_a_month_of_any_length(period: str, today: int, days: int) -> None:
    day = dt.date(int(period[:4]), int(period[5:]), today)
    month = month_of(period, day, simple_rows(today))
    chart = parse_chart(month_chart(month, day, [("monthly", Decimal(3100))]))
    assert days_in_period(period) == days
    assert [t.text for t in chart.find("text", "day-number")] == [str(d) for d in range(1, days + 1)]
    assert [f.attrs["data-day"] for f in chart.forecasts] == [f"{period}-{d:02d}" for d in range(today + 1, days + 1)]
    so_far = sum((a.payable for a in month.by_endpoint if a.day == day), Decimal(0))
    rate = (month.forecast - (month.month_to_date - so_far) - month.today_forecast) / (days - today)
    assert Decimal(chart.forecasts[0].attrs["data-amount"]) == rate.quantize(CENT)
    (line,) = [e for e in chart.elements if e.tag == "line" and e.attrs.get("stroke-dasharray") == "6 3"]
    assert line.number("y1") == pytest.approx(chart.baseline - 3100 / days * chart.scale, abs=PX)
    # Each day's slot is a 1/days share of the plot: the last bar ends inside it, before the right edge.
    slots = [b.number("x") for b in chart.find("rect", "forecast")]
    if len(slots) > 1:
        assert slots[1] - slots[0] == pytest.approx((900 - 58 - 14) / days, abs=PX)
    assert chart.forecasts[-1].number("x") + chart.forecasts[-1].number("width") < 900 - 14


def test_the_last_day_of_the_month_has_no_forecast_bars() -> None:
    last = dt.date(2026, 11, 30)
    month = month_of("2026-11", last, simple_rows(30))
    chart = parse_chart(month_chart(month, last, [("monthly", Decimal(900))]))
    assert chart.forecasts == []
    assert chart.svg.attrs["data-rate"] == ""
    (today,) = chart.find("g", "today")
    assert today.attrs["data-day"] == "2026-11-30"
    assert len(chart.find("g", "day")) == 30
    assert "forecast" not in " ".join(g.text for g in chart.find("g", "legend"))


def test_a_month_that_is_over_has_no_partial_day_nor_forecast() -> None:
    month = month_of("2026-10", dt.date(2026, 11, 2), simple_rows(31))
    chart = parse_chart(month_chart(month, dt.date(2026, 11, 2), []))
    assert chart.forecasts == []
    assert chart.find("g", "today") == []
    (headline,) = chart.find("text", "headline")
    assert headline.text == f"2026-10: {month.month_to_date:.2f} in all"


def test_the_landing_page_shows_the_chart_with_the_accounts_monthly_budgets_only() -> None:
    month = month_of("2026-11", TODAY, simple_rows(22))
    latest = Latest(bills=BillsSnapshot(months=(month,), today=TODAY))
    budgets = (
        BudgetConfig(name="monthly", amount=Decimal(9000)),
        BudgetConfig(name="daily", amount=Decimal(500), period="day"),
        BudgetConfig(name="team", amount=Decimal(3000), where={"endpoint_id": "ep-1"}),
    )
    page = landing_page(View(latest, lambda accept: (b"", ""), lambda: ["bills"], budgets=lambda: budgets))
    assert page.index("<h2>This month</h2>") < page.index("<svg") < page.index("<h2>Sources</h2>")
    chart = parse_chart(page)
    assert [g.attrs["data-budget"] for g in chart.find("g", "budget")] == ["monthly"]
    assert chart.amounts() == expected_sums(simple_rows(22), "2026-11")
    # A scoped budget's line against the whole account's bars would mislead: it is in the table only.
    assert "<td>daily</td><td>account</td><td>day</td><td>500</td>" in page
    team = budgets[2]
    used = sum((a.payable for a in month.by_endpoint if a.key == "ep-1"), Decimal(0)) / team.amount
    assert f"<td>team</td><td>endpoint_id=ep-1</td><td>month</td><td>3000</td><td class=ok>{used:.1%}</td>" in page
    assert not math.isnan(chart.scale)


def test_with_several_accounts_the_budgets_over_them_show_the_crossing_day_and_an_empty_scope_as_metrics_do() -> None:
    """An organisation budget that the accounts' summed pace crosses this month, and one scoped on an
    endpoint none of them bills: the page says what `/metrics` says (the day, and `matches nothing`)."""
    rows = {"prod": simple_rows(22), "lab": simple_rows(22, endpoints=2)}
    accounts = [
        AccountView(name, Latest(bills=BillsSnapshot(months=(month_of("2026-11", TODAY, r),), today=TODAY)), (), ())
        for name, r in rows.items()
    ]
    spent = sum((a.latest.bills.current.month_to_date for a in accounts), Decimal(0))  # type: ignore[union-attr]
    shared = (
        BudgetConfig(name="org", amount=(spent * Decimal("1.2")).quantize(Decimal(1))),  # (crossed before the end)
        BudgetConfig(name="org-none", amount=Decimal(1000), where={"endpoint_id": "ep-none"}),
    )
    clock = Clock(now_fn=lambda: dt.datetime.combine(TODAY, dt.time(12), tzinfo=SHANGHAI))
    collector = SharedBudgetCollector([(a.name, a.latest, a.prices) for a in accounts], shared, clock)
    series = {(m.name, s.labels["budget"]): s.value for m in collector.collect() for s in m.samples}
    crossing = series[("inference_budget_crossing_timestamp_seconds", "org")]
    assert ("inference_budget_crossing_timestamp_seconds", "org-none") not in series
    assert series[("inference_budget_scope_matched", "org")] == 1.0
    assert series[("inference_budget_scope_matched", "org-none")] == 0.0
    day = dt.datetime.fromtimestamp(crossing, SHANGHAI).date()
    assert TODAY < day <= dt.date(2026, 11, 30)

    view = View(Latest(), lambda accept: (b"", ""), list, accounts=lambda: accounts, shared_budgets=lambda: shared)
    page = landing_page(view)
    org = page.split("<tr><td>org</td>", 1)[1].split("</tr>", 1)[0]
    assert org.startswith("<td>every account</td><td>account</td>")
    assert org.endswith(f"<td>{day.isoformat()}</td>")
    none = page.split("<tr><td>org-none</td>", 1)[1].split("</tr>", 1)[0]
    assert "<span class=bad>matches nothing</span>" in none
    assert none.endswith("<td>—</td>")


def test_a_month_the_billing_day_has_left_unread_since_is_over_on_the_page_not_so_far() -> None:
    """On 1 December, the bills failing since before midnight: the page's chart is November's, over
    (its total "in all", no forecast nor today), not "so far" with a forecast for a month that ended."""
    month = month_of("2026-11", dt.date(2026, 11, 30), simple_rows(30))
    latest = Latest(bills=BillsSnapshot(months=(month,), today=dt.date(2026, 11, 30)))
    view = View(latest, lambda accept: (b"", ""), lambda: ["bills"], today=lambda: dt.date(2026, 12, 1))
    chart = parse_chart(landing_page(view))
    (headline,) = chart.find("text", "headline")
    assert headline.text == f"2026-11: {month.month_to_date:.2f} in all"
    assert chart.forecasts == []
    assert chart.find("g", "today") == []
    on_the_day = View(latest, lambda accept: (b"", ""), lambda: ["bills"], today=lambda: dt.date(2026, 11, 30))
    assert "so far" in parse_chart(landing_page(on_the_day)).find("text", "headline")[0].text
    accounts = [AccountView("prod", latest, (), ())]  # (with several accounts: their table says the same)
    for day, shown in ((dt.date(2026, 12, 1), "—"), (dt.date(2026, 11, 30), f"{month.forecast.quantize(1):f}")):
        table = landing_page(View(Latest(), lambda accept: (b"", ""), list, today=lambda day=day: day,
                                  accounts=lambda: accounts))  # fmt: skip
        assert f"<tr><td>prod</td><td>{month.month_to_date:f}</td><td>{shown}</td>" in table


def test_a_row_dated_outside_the_month_neither_scales_nor_counts_and_a_tiny_budget_draws() -> None:
    month = month_of("2026-11", TODAY, simple_rows(22))
    stray = DailyAmount("2026-11", dt.date(2026, 10, 31), "ep-0", "P", "proj", Decimal(1000), Decimal(0))
    with_stray = replace(month, by_endpoint=(*month.by_endpoint, stray))
    assert parse_chart(month_chart(with_stray, TODAY, [])).scale == parse_chart(month_chart(month, TODAY, [])).scale
    empty = month_of("2026-11", TODAY, [(1, "ep-0", "P", "proj", "0")])
    chart = parse_chart(month_chart(empty, TODAY, [("tiny", Decimal("1E-321"))]))
    assert chart.scale > 0
