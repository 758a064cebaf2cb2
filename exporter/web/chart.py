"""The landing page's chart of a billing month, as inline SVG (no script, nothing fetched: it works offline).

One stacked bar per billed day: the payable amount by endpoint, the `top` endpoints by month-to-date in colours
(the largest at the bottom) and the rest summed as "other" on top. Today's bar is the day so far, drawn lighter in a
dashed outline, with the rest of what the forecast expects of today hatched on top of it. Each day after today
gets a hatched bar at the forecast's daily rate (the trailing average `model.forecast` projects with: (forecast −
the complete days − today's forecast) ÷ days left), so that the bars add up to the forecast, which the headline
states. Each monthly budget is a dashed
line at its daily pace (amount ÷ days in the month). Bars, forecast and budget lines share one scale.

Every segment carries its figures (`data-day`, `data-endpoint` or `data-group="other"`, `data-amount`: the exact
Decimal) and a tooltip; the root carries the scale (`data-scale`, pixels per unit of money) and the y of zero
(`data-baseline`), so the picture can be checked against the bills. Money stays Decimal; floats are geometry only.
"""

from __future__ import annotations

import datetime as dt
import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal

from exporter.core.clock import days_in_period, first_day
from exporter.core.words import NO_ENDPOINT, counted, shortened
from exporter.model.snapshots import MonthBills

TOP_ENDPOINTS = 8
"""Endpoints shown in colours; the rest are summed as "other"."""
COLOURS = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f")
OTHER_COLOUR = "#a3acb9"
INK = "#1d2330"
GRID = "#e3e7ee"
FORECAST_STROKE = "#6b7280"
WIDTH = 900
LEFT, RIGHT = 58, 14
PLOT_HEIGHT = 250
BOTTOM = 26
LEGEND_TOP, LEGEND_ROW, LEGEND_COLUMNS = 38, 18, 4
LEGEND_CHARS = 30
LABEL_HEIGHT, LABEL_CHAR_WIDTH = 14, 7.5
"""A budget label's height and (generous) width per character, in pixels, at 12 px bold."""
BAR_FILL = 0.72
"""The share of its day's slot a bar takes."""
HATCH = "month-chart-hatch"


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def _px(value: float) -> str:
    return f"{value:.2f}"


def _money(amount: Decimal) -> str:
    return f"{amount:.2f}"


def nice_scale(highest: float) -> tuple[float, float]:
    """A round axis maximum covering `highest`, and its tick step (1, 2, 2.5 or 5 × a power of ten; ≤ 5 steps)."""
    if not highest >= 0.01:  # nothing (or a cent's fraction) to show: an axis of one unit
        highest = 1.0
    raw = highest / 5
    magnitude = 10.0 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw * (1 - 1e-9))
    return step * math.ceil(highest / step - 1e-9), step


def _tick_label(value: float, step: float) -> str:
    exponent = Decimal(repr(step)).normalize().as_tuple().exponent
    decimals = max(0, -exponent) if isinstance(exponent, int) else 0
    return f"{value:.{decimals}f}"


@dataclass(frozen=True, slots=True)
class _Segment:
    rank: int
    """Its place in the stack, from the bottom: the endpoint's rank by month-to-date; "other" comes last."""
    endpoint: str | None
    """None for "other"."""
    amount: Decimal
    endpoints: int = 1
    """How many endpoints it sums."""


@dataclass(frozen=True, slots=True)
class _Frame:
    """Where things go: the month's day slots across, one scale for money up."""

    first: dt.date
    days: int
    plot_top: float
    scale: float
    """Pixels per unit of money."""

    @property
    def baseline(self) -> float:
        return self.plot_top + PLOT_HEIGHT

    @property
    def slot(self) -> float:
        return (WIDTH - LEFT - RIGHT) / self.days

    @property
    def bar_width(self) -> float:
        return self.slot * BAR_FILL

    def bar_x(self, day: int) -> float:
        return LEFT + (day - 1) * self.slot + (self.slot - self.bar_width) / 2

    def y(self, amount: float) -> float:
        return self.baseline - amount * self.scale


def _stacks(month: MonthBills, top: int) -> tuple[list[str], dict[str, Decimal], dict[dt.date, list[_Segment]], int]:
    """The endpoints shown (by month-to-date, largest first), every endpoint's month-to-date, each day's
    segments bottom up, and how many endpoints are "other". Rows of a (day, endpoint) that differ in product
    or project are summed."""
    amounts: dict[tuple[dt.date, str], Decimal] = {}
    totals: dict[str, Decimal] = {}
    start = first_day(month.period)
    for row in month.by_endpoint:
        if row.day.month != start.month or row.day.year != start.year:
            continue  # a day outside the month is not drawn, so it neither scales nor counts
        amounts[row.day, row.key] = amounts.get((row.day, row.key), Decimal(0)) + row.payable
        totals[row.key] = totals.get(row.key, Decimal(0)) + row.payable
    ranked = sorted(totals, key=lambda key: (-totals[key], key))
    shown = ranked[: max(1, top)]
    rank = {key: index for index, key in enumerate(shown)}
    stacks: dict[dt.date, list[_Segment]] = {}
    other: dict[dt.date, tuple[Decimal, int]] = {}
    for (day, key), amount in amounts.items():
        if key in rank:
            stacks.setdefault(day, []).append(_Segment(rank[key], key, amount))
        else:
            summed, count = other.get(day, (Decimal(0), 0))
            other[day] = (summed + amount, count + 1)
    for day, (summed, count) in other.items():
        stacks.setdefault(day, []).append(_Segment(len(shown), None, summed, count))
    for segments in stacks.values():
        segments.sort(key=lambda segment: segment.rank)
    return shown, totals, stacks, len(ranked) - len(shown)


def _day_bar(day: dt.date, segments: list[_Segment], frame: _Frame, is_today: bool) -> list[str]:
    iso = day.isoformat()
    total = sum((s.amount for s in segments), Decimal(0))
    today_class, partial = (" today", ' data-partial="true"') if is_today else ("", "")
    out = [
        f'<g class="day{today_class}" data-day="{iso}" data-total="{total:f}"{partial}>'
        f"<title>{iso}: {_money(total)}{' so far (today)' if is_today else ''}</title>"
    ]
    x, width = _px(frame.bar_x(day.day)), _px(frame.bar_width)
    lighter = ' fill-opacity="0.45"' if is_today else ""
    stacked = 0.0
    for segment in segments:
        if segment.amount <= 0:
            continue  # a credit (or nothing) has no height in a stack; the day's total counts it
        size = float(segment.amount) * frame.scale
        stacked += size
        if segment.endpoint is None:
            name, who, colour = f"other ({counted(segment.endpoints, 'endpoint')})", 'data-group="other"', OTHER_COLOUR
        else:
            name, who = segment.endpoint or NO_ENDPOINT, f'data-endpoint="{_esc(segment.endpoint)}"'
            colour = COLOURS[segment.rank % len(COLOURS)]
        out.append(
            f'<rect class="bar" data-day="{iso}" {who} data-amount="{segment.amount:f}" x="{x}" '
            f'y="{_px(frame.baseline - stacked)}" width="{width}" height="{_px(size)}" fill="{colour}"{lighter}>'
            f"<title>{_esc(name)}, {iso}: {_money(segment.amount)}</title></rect>"
        )
    if is_today:
        out.append(
            f'<rect class="today-outline" x="{x}" y="{_px(frame.baseline - stacked)}" width="{width}" '
            f'height="{_px(stacked)}" fill="none" stroke="{INK}" stroke-dasharray="3 2"/>'
        )
    out.append("</g>")
    return out


def _forecast_bars(rate: Decimal, after: int, frame: _Frame) -> list[str]:
    """A hatched bar at `rate` on each day after day `after`."""
    size = float(rate) * frame.scale
    out = []
    for day in range(after + 1, frame.days + 1):
        iso = (frame.first + dt.timedelta(days=day - 1)).isoformat()
        out.append(
            f'<rect class="forecast" data-day="{iso}" data-amount="{_money(rate)}" x="{_px(frame.bar_x(day))}" '
            f'y="{_px(frame.baseline - size)}" width="{_px(frame.bar_width)}" height="{_px(size)}" '
            f'fill="url(#{HATCH})" stroke="{FORECAST_STROKE}" stroke-dasharray="3 2">'
            f"<title>forecast, {iso}: {_money(rate)}</title></rect>"
        )
    return out


def _rest_of_today(today: dt.date, rest: Decimal, segments: list[_Segment], frame: _Frame) -> str:
    """What the forecast still expects of today, hatched on top of today's bar."""
    below = sum(float(s.amount) for s in segments if s.amount > 0) * frame.scale
    size = float(rest) * frame.scale
    iso = today.isoformat()
    return (
        f'<rect class="rest-of-today" data-day="{iso}" data-amount="{_money(rest)}" x="{_px(frame.bar_x(today.day))}" '
        f'y="{_px(frame.baseline - below - size)}" width="{_px(frame.bar_width)}" height="{_px(size)}" '
        f'fill="url(#{HATCH})" stroke="{FORECAST_STROKE}" stroke-dasharray="3 2">'
        f"<title>forecast, rest of {iso}: {_money(rest)}</title></rect>"
    )


def _budget_lines(budgets: Sequence[tuple[str, Decimal]], frame: _Frame) -> list[str]:
    """A dashed line per budget at its daily pace, labelled just above at the right end; a label that would
    overlap another moves left of it."""
    out = []
    placed: list[tuple[float, float]] = []  # (label's y, label's left end)
    paces = [(name, amount, amount / frame.days) for name, amount in budgets]
    for name, amount, pace in sorted(paces, key=lambda p: -p[2]):
        y = frame.y(float(pace))
        label = f"{name}: {amount:f}/month"
        label_y = max(y - 4, frame.plot_top + 10)
        clashing = [left - 12 for other_y, left in placed if abs(other_y - label_y) < LABEL_HEIGHT]
        right = min([WIDTH - RIGHT - 2.0, *clashing])
        placed.append((label_y, right - len(label) * LABEL_CHAR_WIDTH))
        out.append(
            f'<g class="budget" data-budget="{_esc(name)}" data-amount="{amount:f}" data-pace="{_money(pace)}">'
            f"<title>{_esc(label)} ({_money(pace)}/day)</title>"
            f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{_px(y)}" y2="{_px(y)}" stroke="{INK}" '
            f'stroke-width="1.5" stroke-dasharray="6 3"/>'
            f'<text x="{_px(right)}" y="{_px(label_y)}" text-anchor="end" font-weight="600" '
            f'stroke="#fff" stroke-width="3" paint-order="stroke">{_esc(label)}</text></g>'
        )
    return out


def _axes(frame: _Frame, axis_max: float, step: float, today_day: int) -> list[str]:
    """Grid lines with round values up the left; the day numbers along the bottom, today's in bold."""
    out = []
    for n in range(round(axis_max / step) + 1):
        y = frame.y(n * step)
        out.append(
            f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{_px(y)}" y2="{_px(y)}" stroke="{GRID}"/>'
            f'<text class="tick" x="{LEFT - 6}" y="{_px(y + 4)}" text-anchor="end" font-size="11">'
            f"{_tick_label(n * step, step)}</text>"
        )
    for day in range(1, frame.days + 1):
        bold = ' font-weight="700"' if day == today_day else ""
        out.append(
            f'<text class="day-number" x="{_px(LEFT + (day - 0.5) * frame.slot)}" y="{frame.baseline + 16}" '
            f'text-anchor="middle" font-size="10"{bold}>{day}</text>'
        )
    return out


def _legend(entries: list[tuple[str, str, str]]) -> list[str]:
    """(swatch markup at 0,0; label; tooltip) in rows of LEGEND_COLUMNS."""
    column = (WIDTH - LEFT - RIGHT) / LEGEND_COLUMNS
    out = []
    for index, (swatch, label, tooltip) in enumerate(entries):
        short = shortened(label, LEGEND_CHARS)
        x, y = LEFT + (index % LEGEND_COLUMNS) * column, LEGEND_TOP + (index // LEGEND_COLUMNS) * LEGEND_ROW
        out.append(
            f'<g class="legend" transform="translate({_px(x)},{y})"><title>{_esc(tooltip)}</title>{swatch}'
            f'<text x="15" y="9.5">{_esc(short)}</text></g>'
        )
    return out


def _swatch(fill: str, extra: str = "") -> str:
    return f'<rect width="10" height="10" fill="{fill}"{extra}/>'


def month_chart(
    month: MonthBills, today: dt.date, budgets: Sequence[tuple[str, Decimal]], *, top: int = TOP_ENDPOINTS
) -> str:
    """The month's chart as an HTML fragment (an `<svg>`), or a short paragraph when it has no bills yet.

    `today`: the billing day (its bar is partial; the days after it are forecast). `budgets`: the monthly
    budgets, (name, amount). `top`: how many endpoints get their own colour.
    """
    if not month.by_endpoint:
        return "<p>No bills yet.</p>"
    period = month.period
    days = days_in_period(period)
    first = first_day(period)
    shown, totals, stacks, others = _stacks(month, top)

    # Where today is: in this month, or after it (every day complete), or (oddly) before it.
    if (today.year, today.month) == (first.year, first.month):
        today_day, days_left = today.day, days - today.day
    else:
        today_day, days_left = (days + 1 if today > first else 0), 0
    so_far = sum((a.payable for a in month.by_endpoint if a.day == today), Decimal(0))
    rest_of_today = max(Decimal(0), month.today_forecast - so_far) if 1 <= today_day <= days else Decimal(0)
    complete = month.month_to_date - so_far
    rate = max(Decimal(0), (month.forecast - complete - month.today_forecast) / days_left) if days_left else None

    if today_day > days:
        headline = f"{period}: {_money(month.month_to_date)} in all"
    else:
        headline = f"{period}: {_money(month.month_to_date)} so far · forecast {_money(month.forecast)} for the month"
        if rate is not None:
            headline += f" ({_money(rate)}/day over the {days_left} day{'s' if days_left > 1 else ''} left)"

    entries = [
        (
            _swatch(COLOURS[index % len(COLOURS)]),
            key or NO_ENDPOINT,
            f"{key or NO_ENDPOINT}: {_money(totals[key])} this month",
        )
        for index, key in enumerate(shown)
    ]
    if others:
        label = f"other ({counted(others, 'endpoint')})"
        entries.append((_swatch(OTHER_COLOUR), label, label))
    if 1 <= today_day <= days:
        today_swatch = _swatch(INK, f' fill-opacity="0.25" stroke="{INK}" stroke-dasharray="2 1"')
        entries.append((today_swatch, "today so far", "today so far (partial)"))
    if rate is not None:
        forecast_swatch = _swatch(f"url(#{HATCH})", f' stroke="{FORECAST_STROKE}"')
        entries.append((forecast_swatch, f"forecast {_money(rate)}/day", f"{_money(month.forecast)} for the month"))

    # One scale for the bars, the forecast and the budget lines: the highest of them sets it.
    day_totals = [sum((s.amount for s in segments if s.amount > 0), Decimal(0)) for segments in stacks.values()]
    day_totals.append(month.today_forecast)  # today's bar with the rest of its forecast on top
    highest = max([*day_totals, rate or Decimal(0), *(amount / days for _, amount in budgets)])
    axis_max, step = nice_scale(float(highest))
    plot_top = LEGEND_TOP + math.ceil(len(entries) / LEGEND_COLUMNS) * LEGEND_ROW + 14
    frame = _Frame(first, days, plot_top, PLOT_HEIGHT / axis_max)
    height = frame.baseline + BOTTOM

    out = [
        f'<svg class="month-chart" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" style="max-width:100%;height:auto" role="img" '
        f'aria-label="{_esc(headline)}" font-family="system-ui, sans-serif" font-size="12" fill="{INK}" '
        f'data-period="{_esc(period)}" data-scale="{frame.scale!r}" data-baseline="{frame.baseline}" '
        f'data-month-to-date="{month.month_to_date:f}" data-forecast="{month.forecast:f}" '
        f'data-rate="{"" if rate is None else _money(rate)}">',
        f"<title>{_esc(headline)}</title>",
        f'<defs><pattern id="{HATCH}" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><rect width="6" height="6" fill="#fff"/>'
        '<line x1="0" y1="0" x2="0" y2="6" stroke="#9aa3ad" stroke-width="2"/></pattern></defs>',
        f'<text class="headline" x="{LEFT}" y="18" font-size="14" font-weight="600">{_esc(headline)}</text>',
        *_legend(entries),
        *_axes(frame, axis_max, step, today_day),
    ]
    last = first + dt.timedelta(days=days - 1)
    for day in sorted(stacks):
        if first <= day <= last:
            out.extend(_day_bar(day, stacks[day], frame, day.day == today_day))
    if rest_of_today > 0:
        out.append(_rest_of_today(today, rest_of_today, stacks.get(today, []), frame))
    if rate is not None:
        out.extend(_forecast_bars(rate, today_day, frame))
    out.extend(_budget_lines(budgets, frame))
    out.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{frame.baseline}" y2="{frame.baseline}" stroke="{INK}"/>')
    out.append("</svg>")
    return "".join(out)
