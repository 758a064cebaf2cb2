"""Spend anomalies: is a group's payable amount on a complete day unusually high for that group?

Pure: a group's daily amounts in, a judgement out. A day missing from a series is unknown (a failed
fetch), never zero: the baseline just has fewer samples. Only days strictly before the judged day
`D` count, and "the last N known days" skips unknown days, so a day judged right after a gap still
uses the days known before it.

Expected amount = the weekday's factor × the group's current level (multiplicative, medians only):
- A known day's factor is its amount ÷ the median amount of its week: the 7 days ending on it (for a
  day in the group's first week, the group's first 7 days), when at least `MIN_WEEK_KNOWN` (5) of
  them are known. Every such week holds each weekday once, so the factors of all weekdays share one
  base, and growth or a lasting change of level divides out of them.
- `factor(w)`: the median factor of the last `WEEKS` (6) known days on weekday `w` that have one.
  Weekends and Mondays each compare with their own kind; a past spike is one sample of six and
  cannot move a median. A weekday with fewer than `MIN_SAME_WEEKDAY` (2) samples has no factor.
- `level`: the median, over the last `LEVEL_DAYS` (7) known days `x`, of `amount(x) ÷ factor(x's
  weekday)`: a week holds each weekday once; the level follows growth closely (half a week behind),
  and takes a lasting change as the new normal after about four days, while a one-day spike is one
  value of seven.
- `expected(D) = factor(D's weekday) × level`, rounded to the precision of D's own amount (at least
  cents). Where the weeks give no factor (a group that mostly spends nothing, or whose weeks are too
  broken by gaps), expected is the median of the weekday's last 6 known amounts; a weekday with
  fewer than 2 of them is not judged.

Spread (how far this group's days usually stray from such a baseline): for each of the last
`SPREAD_DAYS` (42) known days `x`, the residual `amount(x) ÷ (factor of x's weekday from its other
samples × the median level of the 6 known days around x) − 1`, a baseline that leaves x out, so it
errs as much as the judged day's own; the spread is `MAD_TO_SIGMA` (1.4826) × the residuals' median
absolute deviation: a relative standard deviation that past spikes do not widen.

A day is anomalous when its impact (actual − expected) reaches `min_amount`, its impact percent
reaches `min_percent` (an expected amount of 0 passes this floor whenever the impact is positive),
and the impact exceeds `sensitivity` × spread × expected: a noisy group needs a bigger jump. Only
increases are anomalies; the impact stays signed in the judgement.
"""

from __future__ import annotations

import datetime as dt
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import ROUND_DOWN, Decimal

MIN_HISTORY_DAYS = 14
"""A group with fewer known days before the judged day is not judged."""
WEEKS = 6
MIN_SAME_WEEKDAY = 2
MIN_WEEK_KNOWN = 5
LEVEL_DAYS = 7
SPREAD_DAYS = 7 * WEEKS
MAD_TO_SIGMA = Decimal("1.4826")
"""The median absolute deviation of normal noise × this is its standard deviation."""
CENT = Decimal("0.01")
DIGITS = 28
"""Decimal's precision: a figure quantized to more digits than this is no figure (InvalidOperation)."""
FINEST = Decimal("1e-12")
"""The finest an expected amount is written: a bill written finer (the API may) is judged to this."""
SHARE = Decimal("0.0001")
HUNDRED = Decimal(100)


@dataclass(frozen=True)
class Judgement:
    day: dt.date
    actual: Decimal
    expected: Decimal
    impact: Decimal
    """actual − expected"""
    impact_percent: Decimal | None
    """impact ÷ expected × 100, to 0.01; None when expected is 0"""
    anomalous: bool


def _median(values: Sequence[Decimal]) -> Decimal:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


class _History:
    """One group's known days, indexed once (with each day's factor cached) so that judging every
    day of a series costs little."""

    def __init__(self, series: Mapping[dt.date, Decimal]) -> None:
        self.series = series
        self.days = sorted(series)
        self.by_weekday = [[day for day in self.days if day.weekday() == weekday] for weekday in range(7)]
        self.day_factors: dict[dt.date, Decimal | None] = {}

    def known_before(self, day: dt.date) -> int:
        return bisect_left(self.days, day)

    def factor(self, x: dt.date, day: dt.date) -> Decimal | None:
        """x's amount ÷ the median amount of its week, the week ending before `day`."""
        first = max(x - dt.timedelta(6), self.days[0])
        end = first + dt.timedelta(7)
        if end <= day and x in self.day_factors:
            return self.day_factors[x]
        week = [
            self.series[d] for d in self.days[bisect_left(self.days, first) : bisect_left(self.days, min(end, day))]
        ]
        factor = None
        if len(week) >= MIN_WEEK_KNOWN and (median := _median(week)) > 0:
            factor = self.series[x] / median
        if end <= day:
            self.day_factors[x] = factor
        return factor

    def samples(self, day: dt.date) -> list[dict[dt.date, Decimal]]:
        """For each weekday, the factors of its last WEEKS known days before `day` that have one."""
        samples = []
        for days in self.by_weekday:
            found: dict[dt.date, Decimal] = {}
            for x in reversed(days[: bisect_left(days, day)]):
                if (factor := self.factor(x, day)) is not None:
                    found[x] = factor
                    if len(found) == WEEKS:
                        break
            samples.append(found)
        return samples

    def weekday_factors(self, samples: list[dict[dt.date, Decimal]]) -> list[Decimal | None]:
        return [_median(list(s.values())) if len(s) >= MIN_SAME_WEEKDAY else None for s in samples]

    def levels(self, days: Sequence[dt.date], factors: list[Decimal | None]) -> list[Decimal | None]:
        """Each day's amount ÷ its weekday's factor: the level that day speaks for."""
        return [
            self.series[x] / factor if (factor := factors[x.weekday()]) is not None and factor > 0 else None
            for x in days
        ]

    def expected(self, day: dt.date, factors: list[Decimal | None]) -> Decimal | None:
        """factor(day's weekday) × level, unrounded; else (no week to take a factor from: a group that
        mostly spends nothing, or whose weeks are too broken) the median of the weekday's last WEEKS
        known amounts; None when it has fewer than MIN_SAME_WEEKDAY."""
        own = factors[day.weekday()]
        known = self.known_before(day)
        levels = [v for v in self.levels(self.days[max(0, known - LEVEL_DAYS) : known], factors) if v is not None]
        if own is not None and levels:
            return own * _median(levels)
        days = self.by_weekday[day.weekday()]
        end = bisect_left(days, day)
        amounts = [self.series[x] for x in days[max(0, end - WEEKS) : end]]
        return _median(amounts) if len(amounts) >= MIN_SAME_WEEKDAY else None

    def spread(self, day: dt.date, samples: list[dict[dt.date, Decimal]], factors: list[Decimal | None]) -> Decimal:
        """How far the last SPREAD_DAYS known days strayed from a baseline that leaves each out: a
        relative standard deviation, robust, so past spikes do not widen it."""
        known = self.known_before(day)
        recent = self.days[max(0, known - SPREAD_DAYS) : known]
        levels = self.levels(recent, factors)
        residuals = []
        for i, x in enumerate(recent):
            weekday = samples[x.weekday()]
            others = [f for d, f in weekday.items() if d != x]
            lo = min(max(0, i - LEVEL_DAYS // 2), max(0, len(recent) - LEVEL_DAYS))
            around = [v for j, v in enumerate(levels[lo : lo + LEVEL_DAYS], lo) if j != i and v is not None]
            if others and around and (usual := _median(others) * _median(around)) > 0:
                residuals.append(self.series[x] / usual - 1)
        if not residuals:
            return Decimal(0)
        centre = _median(residuals)
        return MAD_TO_SIGMA * _median([abs(r - centre) for r in residuals])

    def judge(self, day: dt.date, min_amount: Decimal, min_percent: Decimal, sensitivity: Decimal) -> Judgement | None:
        if day not in self.series or self.known_before(day) < MIN_HISTORY_DAYS:
            return None
        samples = self.samples(day)
        factors = self.weekday_factors(samples)
        unrounded = self.expected(day, factors)
        if unrounded is None:
            return None
        actual = self.series[day]
        exponent = actual.as_tuple().exponent
        # (as finely as the bill is written, to a cent at least and FINEST at most)
        precision = max(FINEST, min(CENT, Decimal(1).scaleb(exponent))) if isinstance(exponent, int) else CENT
        expected = _quantized(unrounded, precision)
        impact = actual - expected
        percent = _quantized(impact / expected * HUNDRED, CENT) if expected else None
        anomalous = (
            impact >= min_amount
            and (percent is None or percent >= min_percent)
            and impact > sensitivity * self.spread(day, samples, factors) * abs(expected)
        )
        return Judgement(day, actual, expected, impact, percent, anomalous)


def judge(
    series: Mapping[dt.date, Decimal],
    day: dt.date,
    *,
    min_amount: Decimal,
    min_percent: Decimal,
    sensitivity: Decimal = Decimal(3),
) -> Judgement | None:
    """None when `day` is not in `series` or fewer than MIN_HISTORY_DAYS days before it are (or
    fewer than MIN_SAME_WEEKDAY of them fall on its weekday)."""
    return _History(series).judge(day, min_amount, min_percent, sensitivity)


def judge_all(
    series: Mapping[dt.date, Decimal],
    days: Iterable[dt.date] | None = None,
    *,
    min_amount: Decimal,
    min_percent: Decimal,
    sensitivity: Decimal = Decimal(3),
) -> dict[dt.date, Judgement]:
    """`judge` for each of `days` (every day of `series` by default), indexing the series once; the
    days `judge` answers None for are left out."""
    history = _History(series)
    judged = {}
    for day in sorted(series) if days is None else days:
        judgement = history.judge(day, min_amount, min_percent, sensitivity)
        if judgement is not None:
            judged[day] = judgement
    return judged


def contributors(
    parts: Mapping[str, Mapping[dt.date, Decimal]], day: dt.date, top: int = 3
) -> list[tuple[str, Decimal]]:
    """The sub-groups (e.g. the items of an endpoint) carrying the day's impact: each part's own
    actual − expected on `day` (same baseline), those with a positive impact, with their share of
    the positive impacts' sum (a Decimal in [0, 1], rounded down to 0.0001), largest first, at most
    `top`.

    A day is known when any part has an amount for it; a part with no amount on a known day spent
    nothing then (bills list only what was billed), so a part that is new on `day` carries all of
    its amount as impact."""
    known = set().union(*(series.keys() for series in parts.values()))
    if day not in known:
        return []
    impacts = {}
    for name, series in parts.items():
        history = _History({d: series.get(d, Decimal(0)) for d in known})
        expected = history.expected(day, history.weekday_factors(history.samples(day)))
        if expected is None:
            continue
        impact = series.get(day, Decimal(0)) - expected
        if impact > 0:
            impacts[name] = impact
    total = sum(impacts.values(), Decimal(0))
    ranked = sorted(impacts.items(), key=lambda pair: (-pair[1], pair[0]))[:top]
    return [(name, (impact / total).quantize(SHARE, rounding=ROUND_DOWN)) for name, impact in ranked]


def _quantized(value: Decimal, step: Decimal) -> Decimal:
    """`value` to `step`, or as finely as DIGITS digits hold it when that is coarser (an expected
    amount of 10^16 to the bill's twelve places, a percent of 10^25: each would be refused)."""
    if value and value.adjusted() - step.adjusted() >= DIGITS:
        step = Decimal(1).scaleb(value.adjusted() - DIGITS + 1)
    return value.quantize(step)
