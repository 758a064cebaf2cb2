"""The month-end forecast of the bills.

`forecast`, today's formula: the complete days, today at no less than the trailing week's daily
average, and that average for each day left (the model falls back on it; the `spend` signal's
`month_forecast` window per group, or narrowed by `where`, and `backfill` still project with it;
the account's is the model's).

`month_forecast`: the month's total with a prediction interval, both learnt from the account's own
daily bills (`docs/forecast.md` shows how well it does):
- Weekday factors, from the latest `SHAPE_DAYS` known days: each day's amount ÷ the mean of a week
  of known days around it; a weekday's factor is the median of its days' (a spike is one sample of
  a dozen; their mean when that is 0 though a quarter of its days billed: an account that spends
  on few days, `_weekday`), the seven scaled to average 1.
- Level: the median of the latest `LEVEL_DAYS` known days' amounts, each ÷ its weekday's factor (a
  spike is one value of 21).
- Error: the same model, run from each past day with the factors it would have had then (fitted
  again each week) and its level, forecast the next 1 … `HORIZON` known days; the log ratio of
  their actual total to the expected one is an error of that many days ahead. Per number of days
  ahead, the errors' median (a bias: what growth and spikes have added on top of a median) and
  their quantiles at the interval's level around it are taken, and smoothed over the number of
  days: the median as `a + b ÷ days`, each side's spread as a variance `a + b ÷ days + c × days`
  (an error shared by the days, their own noise averaging out, and a drift) with a, b, c ≥ 0.
- Each day left is expected at level × its weekday's factor × e^median; the point adds them to the
  month to date (today at no less than its expected amount), and is the median of the total. The
  interval is a split normal in log space around it (wider above than below where spikes lift
  totals more than anything sinks them), applied to the days left: what is billed is certain.
- With little history the errors are few: a prior error of `PRIOR_SIGMA` weighs in as
  `PRIOR_WEIGHT` days (geometrically), so the interval starts wide and narrows as the history shows
  it can. With fewer than `MIN_SHAPE_DAYS` known complete days there is no weekday rhythm to learn,
  and with a level of 0 (most of the recent days billed nothing: a pause, or spend on few days)
  the model would say nothing more will be spent, for sure: the point is today's formula, with the
  prior's interval. Where a forecast expects nothing more (or the level is 0) though the latest
  `LEVEL_DAYS` known days billed, the days left are also taken as draws of those days (of the
  latest `SHAPE_DAYS` days of the weekdays left, where the model's weekdays expect nothing more
  with a level above 0; `Draws`: a normal of their total, about a mean the days only estimate),
  and the month's total is either view's with even odds: the point, the bounds and the chances
  are the mixture's. A week that billed nothing says the pause may go on, not that it will.

Growth is left to the learnt median: a trend fitted on weekly sums (Theil–Sen) and extrapolated
did worse on the simulator's history (`bench.forecast`) at growths of −5% to +10% a month.
Money is Decimal; floats only in the error model.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from functools import lru_cache
from statistics import NormalDist
from types import MappingProxyType

from exporter.core.clock import days_in_period, first_day

TRAILING_DAYS = 7
DEFAULT_LEVEL = 0.8
"""The interval's nominal coverage (`forecast.interval`)."""
LEVEL_DAYS = 21
"""The recent known days the level is the median of (three of each weekday)."""
SHAPE_DAYS = 91
"""The latest known days the weekday factors are learnt from."""
MIN_SHAPE_DAYS = 21
"""Known complete days before the model forecasts (three of each weekday); fewer: today's formula."""
HORIZON = 31
PRIOR_SIGMA = 0.35
"""The log error assumed before the history shows any (−36% … +57% at 80%)."""
PRIOR_WEIGHT = 8
"""How many days' errors the prior counts as."""
MIN_SAMPLES = 10
"""Errors of so many days ahead before they count."""
ZERO = Decimal(0)
SEVEN = Decimal(7)
ERRORS_KEPT = 256
"""Errors of known days kept (`_errors`): the day's of each account and budget forecast, up to so many."""


def trailing_average(
    today: dt.date, days: Mapping[dt.date, Decimal], previous: Mapping[dt.date, Decimal] | None
) -> Decimal:
    """Today's formula's pace: the average of the trailing 7 complete days (fewer at the start of a
    month when `previous`, last month's days, is not given; today so far when there is none)."""
    first_known = today.replace(day=1)
    if previous is not None:
        first_known = (first_known - dt.timedelta(days=1)).replace(day=1)
    known = {**(previous or {}), **days}
    window = [today - dt.timedelta(days=n) for n in range(1, TRAILING_DAYS + 1)]
    window = [d for d in window if d >= first_known]
    if not window:
        return days.get(today, Decimal(0))
    return sum((known.get(d, Decimal(0)) for d in window), Decimal(0)) / len(window)


def forecast(
    period: str, today: dt.date, days: dict[dt.date, Decimal], previous: dict[dt.date, Decimal] | None
) -> tuple[Decimal, Decimal]:
    """Projected month-end and today's totals (see the module's docstring).

    `previous` is last month's days, when fetched.
    """
    month_to_date = sum(days.values(), Decimal(0))
    if period != f"{today:%Y-%m}":
        return month_to_date, Decimal(0)
    so_far = days.get(today, Decimal(0))
    average = trailing_average(today, days, previous)
    # Today at no less than it has billed so far; a credit netted into it stays taken off (so far
    # below zero: nothing billed yet is seen, and the day's usual amount is still to come).
    today_total = so_far + max(average - max(so_far, Decimal(0)), Decimal(0))
    complete = month_to_date - so_far
    return complete + today_total + average * (days_in_period(period) - today.day), today_total


def filled(period: str, days: Mapping[dt.date, Decimal]) -> dict[dt.date, Decimal]:
    """Every day of a month held whole: a day its bills list nothing for billed nothing."""
    first = first_day(period)
    month = {first + dt.timedelta(days=n): ZERO for n in range(days_in_period(period))}
    month.update(days)
    return month


def held_days(months: Mapping[str, Mapping[dt.date, Decimal]]) -> dict[dt.date, Decimal]:
    """Every day of the months held (by period), each month whole (`filled`): the history a
    forecast learns from."""
    return {d: a for period in sorted(months) for d, a in filled(period, months[period]).items()}


def crossing(days: Iterable[tuple[dt.date, Decimal]], amount: Decimal, start: Decimal = ZERO) -> dt.date | None:
    """The first of `days` (in order) by which `start` and their running sum reach `amount`."""
    total = start
    for day, spent in days:
        total += spent
        if total >= amount:
            return day
    return None


@dataclass(frozen=True)
class MonthForecast:
    """A month's total as forecast on `today`, with its interval."""

    period: str
    today: dt.date
    month_to_date: Decimal
    point: Decimal
    """The median forecast: the month to date and the expected days left."""
    lower: Decimal
    upper: Decimal
    level: float = DEFAULT_LEVEL
    """The interval's nominal coverage: the chance the month's total falls within [lower, upper]."""
    daily: Mapping[dt.date, Decimal] = field(default_factory=lambda: MappingProxyType({}))
    """The expected amount of each day left (today: what it adds to what it has billed so far)."""
    below: float = 0.0
    """The standard deviation of the log error under the point (of the days left's total)."""
    above: float = 0.0
    """The same over the point: larger where spikes lift totals more than anything sinks them."""
    draws: Draws | None = None
    """Where the forecast expects nothing more, or the level is 0, though the recent days billed (a
    pause, spend on few days): the days left as draws of those days too, and the month's total
    either view's with even odds (see the module's docstring)."""
    expected: Decimal = ZERO
    """What the error model expects the days left to add (`point` less the month to date, but with
    `draws`, whose point is the mixture's median)."""

    def crossing_day(self, amount: Decimal, spent: Decimal) -> dt.date | None:
        """The first day on which `spent` plus the expected days reach `amount` (today if it already
        has; None when it does not this month)."""
        if spent >= amount:
            return self.today
        return crossing(sorted(self.daily.items()), amount, spent)

    def chance_over(self, amount: Decimal) -> float:
        """The chance the month's total exceeds `amount`, by the interval's error model (with
        `draws`, the mean of its chance and theirs)."""
        chance = self._chance_by_error(amount)
        return chance if self.draws is None else (chance + self.draws.chance_over(amount - self.month_to_date)) / 2

    def _chance_by_error(self, amount: Decimal) -> float:
        """The error model's chance, around `expected` (`left`) of the days left: their total is
        `left` × e^error, a credit taken off the month when `left` is below 0 (a larger credit
        leaves a lower total)."""
        mtd, left = self.month_to_date, self.expected
        if left == 0 or (amount <= mtd if left > 0 else amount >= mtd):
            return 1.0 if mtd + left > amount else 0.0
        error = math.log(float(amount - mtd) / float(left))  # (the error at which the total is `amount`)
        spread = self.below if error < 0 else self.above
        above = (1.0 if error < 0 else 0.0) if spread <= 0 else 1.0 - NormalDist().cdf(error / spread)
        return above if left > 0 else 1.0 - above


@dataclass(frozen=True)
class Draws:
    """What the days left add when each is a draw of the recent known days: a normal (the sum of
    many draws) of `mean` and `spread`, about a mean those days only estimate (their number), and
    never below `floor`."""

    mean: float
    spread: float
    floor: float
    """The least the days left can add: nothing, unless the recent days held credits."""

    @classmethod
    def of(cls, recent: Sequence[Decimal], days: int, so_far: Decimal) -> Draws:
        """`days` left, today among them, which has billed `so_far` of its draw."""
        values = [float(a) for a in recent]
        mean = sum(values) / len(values)
        variance = sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)
        billed = max(float(so_far), 0.0)
        draws = days - 1 + (max(1.0 - billed / mean, 0.0) if mean > 0 else 1.0)  # (today's share still to come)
        spread = math.sqrt(variance * draws * (1 + draws / len(values)))
        return cls(mean * draws, spread, min(0.0, min(values) * days))

    def chance_over(self, left: Decimal) -> float:
        """The chance the days left add more than `left`."""
        x = float(left)
        if x < self.floor:
            return 1.0
        if self.spread <= 0:
            return 1.0 if self.mean > x else 0.0
        return 1.0 - NormalDist(self.mean, self.spread).cdf(x)


Factors = tuple[Decimal, ...]
"""Monday … Sunday, averaging 1."""


def _median(values: Sequence[Decimal]) -> Decimal:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _quantile(ordered: Sequence[float], q: float) -> float:
    """The `q` quantile of sorted values, interpolated."""
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _week_around(known: Mapping[dt.date, Decimal], day: dt.date) -> Decimal | None:
    """The mean of a week of known days holding `day`: centred on it when known, else the nearest."""
    for back in (3, 2, 4, 1, 5, 0, 6):
        week = [known.get(day + dt.timedelta(days=n - back)) for n in range(7)]
        if all(amount is not None for amount in week):
            return sum((a for a in week if a is not None), ZERO) / SEVEN
    return None


def _factors(known: Mapping[dt.date, Decimal], last: dt.date) -> Factors | None:
    """The weekday factors from the latest `SHAPE_DAYS` known days up to `last`; None while a
    weekday has fewer than three days with a known week around them."""
    return _shape(known, sorted(d for d in known if d <= last)[-SHAPE_DAYS:])


def _shape(known: Mapping[dt.date, Decimal], days: Sequence[dt.date]) -> Factors | None:
    """`_factors` of the known days `days` (in order, the window), each weekday's `_weekday`."""
    window = {d: known[d] for d in days}
    ratios: list[list[Decimal]] = [[] for _ in range(7)]
    for day, amount in window.items():
        mean = _week_around(window, day)
        if mean is not None and mean > 0:
            ratios[day.weekday()].append(amount / mean)
    if any(len(r) < MIN_SHAPE_DAYS // 7 for r in ratios):
        return None
    medians = [_weekday(r) for r in ratios]
    total = sum(medians, ZERO)
    return tuple(m * SEVEN / total for m in medians) if total > 0 else None


def _weekday(ratios: Sequence[Decimal]) -> Decimal:
    """A weekday's factor, before the seven are scaled: the median of its days' ratios, so that a
    spike is one of a dozen (a weekend that bills nothing but for one batch job stays at 0). When
    that median is 0 though a quarter of its days or more billed, their mean: the account spends on
    few days, whichever they are, and the days that bill are what it bills, not spikes (the median
    would expect nothing on that weekday, and for sure)."""
    median = _median(ratios)
    if median != 0 or 4 * sum(1 for r in ratios if r != 0) < len(ratios):
        return median
    return sum(ratios, ZERO) / len(ratios)


def _level(known: Mapping[dt.date, Decimal], factors: Factors, last: dt.date) -> Decimal | None:
    """The median of the latest `LEVEL_DAYS` known days up to `last`, each ÷ its weekday's factor."""
    days = sorted(d for d in known if d <= last)[-LEVEL_DAYS:]
    values = [known[d] / factors[d.weekday()] for d in days if factors[d.weekday()] > 0]
    return _median(values) if values else None


@dataclass(frozen=True)
class _Errors:
    """The log error of the expected total of the next `days` days: its median, `a + b ÷ days`, and
    its spreads below and above it, each a variance `a + b ÷ days + c × days`."""

    centre: tuple[float, float] = (0.0, 0.0)
    below: tuple[float, float, float] = (PRIOR_SIGMA**2, 0.0, 0.0)
    above: tuple[float, float, float] = (PRIOR_SIGMA**2, 0.0, 0.0)

    def at(self, days: int) -> tuple[float, float, float]:
        """The median, and the standard deviations below and above it, for `days` days."""
        k = max(days, 1)
        return (
            self.centre[0] + self.centre[1] / k,
            math.sqrt(self.below[0] + self.below[1] / k + self.below[2] * k),
            math.sqrt(self.above[0] + self.above[1] / k + self.above[2] * k),
        )


def _errors(known: Mapping[dt.date, Decimal], level: float) -> _Errors:
    """The model's log errors over the known days, as it would have made them (see the module's
    docstring), fitted with the prior weighed in. The same known days give the same errors: kept
    for the next forecast of the day (every bills refresh, each step of a backtest's day), which
    knows the same days, as the month's days before today are all it adds to the history."""
    return _errors_of(tuple(sorted(known.items())), level)


@lru_cache(maxsize=ERRORS_KEPT)
def _errors_of(known_days: tuple[tuple[dt.date, Decimal], ...], level: float) -> _Errors:
    known = dict(known_days)
    days = list(known)
    values = {d: float(a) for d, a in known.items()}
    samples: dict[int, list[float]] = {}
    factors: Factors | None = None
    fitted: dt.date | None = None
    for n, anchor in enumerate(days):
        if n + 1 < MIN_SHAPE_DAYS:
            continue
        if fitted is None or (anchor - fitted).days >= 7:  # (`_factors(known, anchor)`, from the days in order)
            factors, fitted = _shape(known, days[max(0, n + 1 - SHAPE_DAYS) : n + 1]), anchor
        if factors is None:
            continue
        weekdays = [float(f) for f in factors]
        recent = sorted(values[d] / weekdays[d.weekday()]
                        for d in days[max(0, n + 1 - LEVEL_DAYS) : n + 1] if weekdays[d.weekday()] > 0)  # fmt: skip
        base = _quantile(recent, 0.5) if recent else 0.0
        if base <= 0:
            continue
        actual = expected = 0.0
        for k in range(1, HORIZON + 1):
            day = anchor + dt.timedelta(days=k)
            if day not in values:
                break
            actual += values[day]
            expected += base * weekdays[day.weekday()]
            if expected > 0:
                samples.setdefault(k, []).append(math.log(max(actual / expected, 1e-3)))
    return _fitted(samples, level)


def _fitted(samples: Mapping[int, Sequence[float]], level: float) -> _Errors:
    """Each number of days ahead's median and spreads at `level`, smoothed, raised toward the prior
    while the errors are few."""
    z = NormalDist().inv_cdf((1 + level) / 2)
    kept = {k: sorted(errors) for k, errors in samples.items() if len(errors) >= MIN_SAMPLES}
    if not kept:
        return _Errors()
    medians = [([1.0, 1.0 / k], _quantile(ordered, 0.5), len(ordered)) for k, ordered in kept.items()]
    solved = _least_squares(medians, 2) if len(medians) > 1 else None
    a, b = solved if solved is not None else (medians[0][1], 0.0)
    # Each side's spread from the smoothed median, not each number of days' own: where the curve
    # misses the medians (growth adds up the further ahead), the interval widens to hold the errors.
    below, above = [], []
    for k, ordered in kept.items():
        centre = a + b / k
        below.append((k, (max(centre - _quantile(ordered, (1 - level) / 2), 0.0) / z) ** 2, len(ordered)))
        above.append((k, (max(_quantile(ordered, (1 + level) / 2) - centre, 0.0) / z) ** 2, len(ordered)))
    count = len(samples[1])
    weight = count / (count + PRIOR_WEIGHT)
    return _Errors(
        (a * weight, b * weight), _towards_prior(_curve(below), weight), _towards_prior(_curve(above), weight)
    )


def _towards_prior(variance: tuple[float, float, float], weight: float) -> tuple[float, float, float]:
    """The curve scaled so that its variance a day ahead is the samples' ^ weight × the prior's ^ (1 − weight)."""
    a, b, c = variance
    prior = PRIOR_SIGMA**2
    if a + b + c <= 0:  # errors with no spread at all (a flat history): the prior's share is all there is
        return prior * (1 - weight), 0.0, 0.0
    scale = (prior / (a + b + c)) ** (1 - weight)
    return a * scale, b * scale, c * scale


def _curve(points: Sequence[tuple[int, float, int]]) -> tuple[float, float, float]:
    """Weighted least squares of y = a + b ÷ k + c × k with a, b, c ≥ 0: the best fit of those on
    each set of the terms whose coefficients all come out non-negative."""
    best: tuple[float, tuple[float, float, float]] = (math.inf, (0.0, 0.0, 0.0))
    for terms in ((0, 1, 2), (0, 1), (0, 2), (1, 2), (0,), (1,), (2,)):
        rows = [([(1.0, 1.0 / k, float(k))[t] for t in terms], y, w) for k, y, w in points]
        solved = _least_squares(rows, len(terms))
        if solved is None or any(c < 0 for c in solved):
            continue
        residual = sum(w * (y - sum(c * x for c, x in zip(solved, xs, strict=True))) ** 2 for xs, y, w in rows)
        if residual < best[0]:
            coefficients = [0.0, 0.0, 0.0]
            for t, c in zip(terms, solved, strict=True):
                coefficients[t] = c
            best = (residual, (coefficients[0], coefficients[1], coefficients[2]))
    return best[1]


def _least_squares(rows: Sequence[tuple[Sequence[float], float, int]], size: int) -> list[float] | None:
    """The weighted normal equations of `rows` (terms, y, weight) solved; None when singular."""
    matrix = [[sum(w * xs[i] * xs[j] for xs, _, w in rows) for j in range(size)]
              + [sum(w * xs[i] * y for xs, y, w in rows)] for i in range(size)]  # fmt: skip
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(matrix[r][col]))
        if abs(matrix[pivot][col]) < 1e-12:
            return None
        matrix[col], matrix[pivot] = matrix[pivot], matrix[col]
        for r in range(size):
            if r != col:
                f = matrix[r][col] / matrix[col][col]
                matrix[r] = [a - f * b for a, b in zip(matrix[r], matrix[col], strict=True)]
    return [matrix[i][size] / matrix[i][i] for i in range(size)]


def month_forecast(
    period: str,
    today: dt.date,
    days: Mapping[dt.date, Decimal],
    history: Mapping[dt.date, Decimal] | None = None,
    level: float = DEFAULT_LEVEL,
) -> MonthForecast:
    """The month's total as forecast on `today`, with its `level` interval.

    `days`: the month's bills by day (today's so far); a day before today it lacks billed nothing.
    `history`: the account's known days before the month, each month held whole (`filled`); a day
    absent is unknown, never zero. A month that has ended is its total.
    """
    month_to_date = sum(days.values(), ZERO)
    first = first_day(period)
    if period != f"{today:%Y-%m}":
        return MonthForecast(period, today, month_to_date, month_to_date, month_to_date, month_to_date, level)
    known = {d: a for d, a in (history or {}).items() if d < first}
    known.update({d: a for d, a in filled(period, days).items() if d < today})
    last = today - dt.timedelta(days=1)
    left = [today + dt.timedelta(days=n) for n in range(days_in_period(period) - today.day + 1)]
    so_far = days.get(today, ZERO)
    factors = _factors(known, last)
    base = _level(known, factors, last) if factors is not None else None
    if factors is None or base is None or base <= 0:  # (0: most recent days billed nothing, a pause)
        start = (first - dt.timedelta(days=1)).replace(day=1)
        previous = {d: a for d, a in known.items() if start <= d < first} or None
        point, today_end = forecast(period, today, dict(days), previous)
        average = (point - month_to_date - (today_end - so_far)) / (len(left) - 1) if len(left) > 1 else ZERO
        daily = dict.fromkeys(left, average)
        daily[today] = today_end - so_far
        errors = _Errors()
    else:
        errors = _errors(known, level)
        bias = Decimal(repr(math.exp(errors.at(len(left))[0])))
        daily = {d: base * factors[d.weekday()] * bias for d in left}
        daily[today] = max(daily[today] - max(so_far, ZERO), ZERO)  # (a credit today stays taken off)
        point = month_to_date + sum(daily.values(), ZERO)
    # Nothing more expected, or a level of 0, while the recent days billed: the days left are their
    # draws too (a pause may end; an account that spends on few days will).
    # (Of the model's weekdays, only those left: a weekend it knows bills nothing is not a pause.)
    level_zero = base is not None and base <= 0
    weekdays = {d.weekday() for d in left} if factors is not None and not level_zero else set(range(7))
    window = sorted(known)[-(LEVEL_DAYS if len(weekdays) == 7 else SHAPE_DAYS) :]
    recent = [known[d] for d in window if d.weekday() in weekdays]
    draws = None
    if len(recent) >= TRAILING_DAYS and any(recent) and (point == month_to_date or level_zero):
        draws = Draws.of(recent, len(left), so_far)
    _, below, above = errors.at(len(left))
    z = NormalDist().inv_cdf((1 + level) / 2)
    rest = point - month_to_date
    lower = month_to_date + rest * Decimal(repr(math.exp(-z * below)))
    upper = month_to_date + rest * Decimal(repr(math.exp(z * above)))
    if upper < lower:  # credits outweighing charges: the days left take money off, and the bounds swap
        lower, upper = upper, lower
    outlook = MonthForecast(
        period, today, month_to_date, point, lower, upper, level, MappingProxyType(daily), below, above, draws, rest
    )
    if draws is None:
        return outlook
    # Either view with even odds: the point and the bounds are the mixture's median and quantiles.
    reach = draws.spread * (4 + z)  # (past the draws' quantile the mixture's tail needs, at any level)
    ends = (lower - month_to_date, upper - month_to_date, Decimal(repr(draws.floor)), ZERO,
            Decimal(repr(draws.mean - reach)), Decimal(repr(draws.mean + reach)))  # fmt: skip
    low, high = min(ends), max(ends)
    point, lower, upper = (
        month_to_date + _exceeded_with(outlook, chance, low, high) for chance in (0.5, (1 + level) / 2, (1 - level) / 2)
    )
    return dataclasses.replace(
        outlook, point=point, lower=lower, upper=upper, daily=MappingProxyType(_spread(daily, point - month_to_date))
    )


def _exceeded_with(outlook: MonthForecast, chance: float, low: Decimal, high: Decimal) -> Decimal:
    """The least amount the days left may add that `outlook` gives `chance` or less of being
    exceeded, between `low` and `high` (where it is), found by halving the span 64 times; one of
    the views' point masses (nothing more, the formula's credits, the least the draws add) when it
    is that one."""
    mtd, span = outlook.month_to_date, high - low
    if outlook.chance_over(mtd + low) <= chance:
        return low
    for _ in range(64):  # (the chance falls as the amount grows)
        middle = (low + high) / 2
        if outlook.chance_over(mtd + middle) <= chance:
            high = middle
        else:
            low = middle
    draws = outlook.draws
    atoms = (ZERO, outlook.expected, Decimal(repr(draws.floor))) if draws is not None else ()
    for atom in atoms:
        if abs(high - atom) <= span / 2**40 and outlook.chance_over(mtd + atom) <= chance:
            return atom
    return high


def _spread(daily: Mapping[dt.date, Decimal], total: Decimal) -> dict[dt.date, Decimal]:
    """`daily` scaled to add up to `total` (evenly spread when it adds up to nothing)."""
    whole = sum(daily.values(), ZERO)
    if whole > 0:
        return {d: a * total / whole for d, a in daily.items()}
    return dict.fromkeys(daily, total / len(daily)) if daily else {}
