"""What each budget has used of its period, and what it is forecast to use, for every scope.

A budget without `where` covers the account: the month to date and forecast of the bills. A
scope on billed labels (`endpoint_id`, `item`, `product`, `project_id`) sums the bills' lines it
matches: by endpoint when it names an endpoint or a project (the bills' lines by item carry no
project), by item otherwise (the item grouping covers every charge). A scope on usage labels
(`model`, `api_key`, with `endpoint_id` if wanted) prices the matching usage with `prices`:
today's counters, yesterday as its last pull left it, and the settled days read in full before.
The forecast of a billed scope is the bills' (`model.forecast.month_forecast`), on the scope's own
days and those of the months held before; a usage scope's is today's formula (`model.forecast.forecast`)
on its own days, which gives its pace (the day it crosses an amount), not its error.

Figures are given only when every day they add up is known: a usage scope's month waits until
each past day of the month has been read, and a row of a model without a price leaves the
scope without figures rather than low ones (a failing source never reads as zero spend).

A scope that matches nothing (a misspelt endpoint, item, model or key) would read 0% for ever,
green everywhere: `scope_matched` says whether it matched anything its source holds, and
`judge_scopes` logs it once when it does not.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal

from exporter.config.schema import BudgetConfig, PriceConfig
from exporter.core.clock import days_in_period
from exporter.core.fields import in_scope, scope_values
from exporter.core.logs import get_logger
from exporter.model.forecast import (
    TRAILING_DAYS,
    MonthForecast,
    crossing,
    forecast,
    held_days,
    month_forecast,
    trailing_average,
)
from exporter.model.snapshots import DailyAmount, Latest, MonthBills, MonthHistory, UsageRow, UsageSnapshot, per_day
from exporter.sources.usage import estimate

log = get_logger(__name__)

Days = dict[dt.date, Decimal]
Scope = Mapping[str, str | tuple[str, ...]]


@dataclass(frozen=True)
class BudgetFigures:
    period: str
    """The budget period measured: `2026-11`, or `2026-11-22` for a daily budget."""
    spent: Decimal
    projected: Decimal
    """Forecast at the period's end."""
    outlook: MonthForecast | None = None
    """A month budget's forecast in full (its expected days and its error), for when its pace
    crosses the amount and the chance it does; None for a day budget or one priced from usage."""
    days: tuple[tuple[dt.date, Decimal], ...] = ()
    """A month budget's days so far, in order (for the day its spend crossed an amount)."""
    expected: Mapping[dt.date, Decimal] | None = None
    """A month budget priced from usage: what each day left is expected to add (today's rest among
    them), at the pace of today's formula; its `outlook`'s days otherwise."""

    @property
    def ahead(self) -> Mapping[dt.date, Decimal] | None:
        """What each day left of a month budget is expected to add; None when not known."""
        return self.outlook.daily if self.outlook is not None else self.expected

    def ratios(self, amount: Decimal) -> tuple[Decimal, Decimal]:
        return self.spent / amount, self.projected / amount

    def crossing(self, amount: Decimal) -> dt.date | None:
        """The day the spend crosses `amount`: the day it did, when it has; else the day it does at
        the forecast's pace (a day budget: today, when its forecast reaches it). None when it does
        not this period, or when that is not known."""
        if len(self.period) == 10:  # a day budget
            return dt.date.fromisoformat(self.period) if max(self.spent, self.projected) >= amount else None
        if self.spent >= amount:
            return crossing(self.days, amount)
        ahead = self.ahead
        return None if ahead is None else crossing(sorted(ahead.items()), amount, self.spent)

    def chance(self, amount: Decimal) -> float | None:
        """The chance the period ends over `amount`, from the forecast's error; None unknown."""
        return None if self.outlook is None else self.outlook.chance_over(amount)


def summed(parts: Sequence[BudgetFigures]) -> BudgetFigures:
    """The figures of a budget over several accounts: their spend and forecast summed, for their
    one period (`parts` not empty). Its crossing is `alerts.rules.summed_crossing`'s."""
    return BudgetFigures(
        parts[0].period, sum((p.spent for p in parts), Decimal(0)), sum((p.projected for p in parts), Decimal(0))
    )


def _scoped(budget: BudgetConfig, month: MonthBills | MonthHistory) -> Iterator[DailyAmount]:
    """The lines of `month` a billed scope takes: by endpoint when it names an endpoint or a
    project (the lines by item carry no project), by item otherwise. A scope that names its
    endpoints or items reads their lines alone (`_lines`)."""
    where = budget.where
    by_endpoint = bool({"endpoint_id", "project_id"} & set(where))
    named = where.get("endpoint_id" if by_endpoint else "item")
    if named is None:
        lines: Iterable[DailyAmount] = month.by_endpoint if by_endpoint else month.by_item
    else:
        index = _lines(month, by_endpoint)
        lines = [a for key in dict.fromkeys(scope_values(named)) for a in index.get(key, ())]
    return (
        a
        for a in lines
        if in_scope(where.get("product"), a.product) and in_scope(where.get("project_id"), a.project_id)
    )


def _lines(month: MonthBills | MonthHistory, by_endpoint: bool) -> Mapping[str, tuple[DailyAmount, ...]]:
    """The month's lines by endpoint (or by item) per endpoint id (item): made once per month
    (kept on it, which is never changed). With a budget for each of E endpoints, each reading every
    line of the month, an evaluation grew with E²: 1 s at 2,000 endpoints."""
    cache: dict[bool, Mapping[str, tuple[DailyAmount, ...]]] = month.__dict__.setdefault("_lines", {})
    index = cache.get(by_endpoint)
    if index is None:
        grouped: dict[str, list[DailyAmount]] = {}
        for a in month.by_endpoint if by_endpoint else month.by_item:
            grouped.setdefault(a.key, []).append(a)
        index = cache[by_endpoint] = {key: tuple(rows) for key, rows in grouped.items()}
    return index


def _billed_month(latest: Latest, budget: BudgetConfig, period: str) -> Days | None:
    """The scope's billed amount per day of `period`: from the bills, or else the history."""
    bills = latest.bills
    for month in bills.months if bills is not None else ():
        if month.period == period:
            return per_day(_scoped(budget, month))
    held = latest.history.months.get(period) if latest.history is not None else None
    return None if held is None else per_day(_scoped(budget, held))


def _usage_in_scope(where: Scope, endpoint: str, model: str, api_key: str) -> bool:
    return (
        in_scope(where.get("endpoint_id"), endpoint)
        and in_scope(where.get("model"), model)
        and in_scope(where.get("api_key"), api_key)
    )


class _Pricer:
    """Usage rows of one scope, priced; `unpriced` once a matching row's model has no price."""

    def __init__(self, where: Scope, prices: Sequence[PriceConfig]) -> None:
        self.where = where
        self.prices = {p.model: p for p in prices}
        self.unpriced = False

    def matches(self, endpoint: str, model: str, api_key: str) -> bool:
        return _usage_in_scope(self.where, endpoint, model, api_key)

    def price(self, model: str, prompt: int, completion: int, cached: int) -> Decimal:
        amount = estimate(self.prices.get(model), prompt, completion, cached)
        if amount is None:
            self.unpriced = True
            return Decimal(0)
        return amount

    def rows(self, rows: Iterable[UsageRow]) -> Decimal:
        return sum(
            (self.price(m, p, c, k) for e, m, a, _, p, c, k in rows if self.matches(e, m, a)),
            Decimal(0),
        )

    def snapshot(self, usage: UsageSnapshot) -> Decimal:
        return sum(
            (
                self.price(key.model, t.prompt_tokens, t.completion_tokens, t.cached_prompt_tokens)
                for key, t in usage.totals.items()
                if self.matches(key.endpoint_id, key.model, key.api_key)
            ),
            Decimal(0),
        )


def _usage_known(latest: Latest, usage: UsageSnapshot, pricer: _Pricer) -> Days:
    """The scope's priced usage on every day known: the settled days, yesterday's last pull, today."""
    known: Days = {day: pricer.rows(rows) for day, rows in latest.settled.items()}
    if usage.previous_day is not None and usage.previous_day.day not in known:
        known[usage.previous_day.day] = pricer.snapshot(usage.previous_day)
    known[usage.day] = pricer.snapshot(usage)
    return known


def _window_before(today: dt.date, days: Days) -> Days | None:
    """The last month's days in today's trailing window, when every one of them is known."""
    first = today.replace(day=1)
    window = [today - dt.timedelta(days=n) for n in range(1, TRAILING_DAYS + 1)]
    wanted = [d for d in window if d < first]
    if not wanted or any(d not in days for d in wanted):
        return None
    return {d: days[d] for d in wanted}


def _days_before(latest: Latest, budget: BudgetConfig, period: str) -> Days:
    """The scope's every day of the months before `period` that are held (the history's, and last
    month's in its grace days), each month whole: what its forecast learns its rhythm and error from."""
    months: dict[str, MonthBills | MonthHistory] = dict(latest.history.months) if latest.history is not None else {}
    bills = latest.bills
    months.update({m.period: m for m in (bills.months[1:] if bills is not None else ())})
    return held_days({held: per_day(_scoped(budget, month)) for held, month in months.items() if held < period})


def _outlook(latest: Latest, budget: BudgetConfig, month: MonthBills, today: dt.date, days: Days) -> MonthForecast:
    """The scope's month forecast, made once per bills snapshot, history and scope (kept on the
    snapshot, which is never changed): every evaluation, scrape and page asks it again, and its
    error model reads every day held."""
    cache: dict[object, tuple[object, MonthForecast]] = month.__dict__.setdefault("_outlooks", {})
    key = (repr(sorted(budget.where.items())), today)
    held = cache.get(key)
    if held is not None and held[0] is latest.history:
        return held[1]
    outlook = month_forecast(month.period, today, days, _days_before(latest, budget, month.period), month.interval)
    cache[key] = (latest.history, outlook)
    return outlook


def figures(budget: BudgetConfig, latest: Latest, prices: Sequence[PriceConfig] = ()) -> BudgetFigures | None:
    """What the budget has used of its current period and is forecast to use; None while unknown."""
    bills = latest.bills
    if budget.on_usage:
        return _usage_figures(budget, latest, prices)
    if bills is None:
        return None
    today, month = bills.today, bills.current
    if budget.where:
        days = _billed_month(latest, budget, month.period) or {}
        outlook = _outlook(latest, budget, month, today, days)
        so_far = days.get(today, Decimal(0))
        month_end, today_end = outlook.point, so_far + outlook.daily.get(today, Decimal(0))
    else:  # the account: the bills' own figures and forecast, so the budget agrees with their metrics to the cent
        days = per_day(month.by_item)
        outlook = month.outlook or _outlook(latest, budget, month, today, days)
        month_end, today_end = month.forecast, month.today_forecast
    if budget.period == "month":
        spent = sum(days.values(), Decimal(0))
        return BudgetFigures(month.period, spent, month_end, outlook, tuple(sorted(days.items())))
    return BudgetFigures(today.isoformat(), days.get(today, Decimal(0)), today_end)


def _usage_figures(budget: BudgetConfig, latest: Latest, prices: Sequence[PriceConfig]) -> BudgetFigures | None:
    usage = latest.usage
    if usage is None:
        return None
    today = usage.day
    pricer = _Pricer(budget.where, prices)
    known = _usage_known(latest, usage, pricer)
    if pricer.unpriced:
        return None
    if budget.period == "day":
        # Today's forecast as the bills': max(so far, the trailing week's average), over the days known.
        so_far = known[today]
        window = [known[d] for d in (today - dt.timedelta(days=n) for n in range(1, TRAILING_DAYS + 1)) if d in known]
        average = sum(window, Decimal(0)) / len(window) if window else so_far
        return BudgetFigures(today.isoformat(), so_far, max(so_far, average))
    first = today.replace(day=1)
    month_days = {first + dt.timedelta(days=n): known.get(first + dt.timedelta(days=n)) for n in range(today.day)}
    if any(amount is None for amount in month_days.values()):
        return None  # a past day of the month not read yet: no month figure rather than a low one
    days = {d: a for d, a in month_days.items() if a is not None}
    period = f"{today:%Y-%m}"
    before = _window_before(today, known)
    month_end, today_end = forecast(period, today, days, before)
    spent, so_far, left = (
        sum(days.values(), Decimal(0)),
        days.get(today, Decimal(0)),
        days_in_period(period) - today.day,
    )
    pace = trailing_average(today, days, before)
    expected = {today: today_end - so_far} | {today + dt.timedelta(days=n): pace for n in range(1, left + 1)}
    return BudgetFigures(period, spent, month_end, days=tuple(sorted(days.items())), expected=expected)


def month_spent(budget: BudgetConfig, latest: Latest, period: str) -> Decimal | None:
    """What a budget's scope spent in `period` by the bills held (a month that has ended, for the
    digest on the 1st); None for a scope priced from usage, or a month not held."""
    if budget.on_usage:
        return None
    days = _billed_month(latest, budget, period)
    return None if days is None else sum(days.values(), Decimal(0))


def current_figures(
    latest: Latest, budgets: Iterable[BudgetConfig], prices: Sequence[PriceConfig] = (), today: dt.date | None = None
) -> list[tuple[BudgetConfig, BudgetFigures | None]]:
    """Each budget with its figures (None while unknown, and, given `today`, while they are of a
    period that has ended: just after midnight, before the new day's bills)."""
    current = {today.isoformat(), f"{today:%Y-%m}"} if today is not None else None
    found: list[tuple[BudgetConfig, BudgetFigures | None]] = []
    for budget in budgets:
        these = figures(budget, latest, prices)
        ended = these is not None and current is not None and these.period not in current
        found.append((budget, None if ended else these))
    return found


def budget_status(
    latest: Latest, budgets: Iterable[BudgetConfig], prices: Sequence[PriceConfig] = (), today: dt.date | None = None
) -> list[tuple[BudgetConfig, tuple[Decimal, Decimal] | None]]:
    """Each budget with its used and forecast ratios (None while unknown: `current_figures`)."""
    return [
        (budget, None if found is None else found.ratios(budget.amount))
        for budget, found in current_figures(latest, budgets, prices, today)
    ]


def scope_matched(budget: BudgetConfig, latest: Latest) -> bool | None:
    """Whether the budget's `where` matches anything the source it is scoped on holds: a line of
    the bills (their months, and the history's) for a billed scope; a key of the usage (today,
    the finalised day before, the settled days) for a usage scope. True without `where`; None
    until that source has refreshed, and while it holds nothing at all (an account without a
    single line says nothing about a scope)."""
    where = budget.where
    if not where:
        return True
    if budget.on_usage:
        usage = latest.usage
        if usage is None:
            return None
        keys = [*usage.totals, *(usage.previous_day.totals if usage.previous_day is not None else ())]
        held = [(k.endpoint_id, k.model, k.api_key) for k in keys]
        held += [(e, m, a) for rows in latest.settled.values() for e, m, a, *_ in rows]
        return any(_usage_in_scope(where, *key) for key in held) if held else None
    if latest.bills is None:
        return None
    months = [*latest.bills.months, *(latest.history.months.values() if latest.history is not None else ())]
    if not any(month.by_endpoint or month.by_item for month in months):
        return None
    return any(next(_scoped(budget, month), None) is not None for month in months)


def _scope_text(budget: BudgetConfig) -> str:
    """`endpoint_id=ep-1, model=m`."""
    return ", ".join(f"{k}={'|'.join(scope_values(v))}" for k, v in sorted(budget.where.items()))


def unmatched_values(budget: BudgetConfig, latest: Latest) -> list[str]:
    """The values of a list in the budget's `where` that match nothing its source holds, each as
    `endpoint_id=ep-x` (a list whose every value matches nothing is `scope_matched`'s to say)."""
    missed = []
    for key, wanted in budget.where.items():
        if not isinstance(wanted, tuple) or len(wanted) < 2:
            continue
        for value in wanted:
            alone = budget.model_copy(update={"where": {**budget.where, key: value}})
            if scope_matched(alone, latest) is False:
                missed.append(f"{key}={value}")
    return missed


def judge_scopes(latest: Latest, budgets: Iterable[BudgetConfig]) -> list[tuple[BudgetConfig, bool | None]]:
    """Each budget with `scope_matched`. A scope that matches nothing is logged as a warning once,
    and again only after it matched something in between (the memory of it is `latest`'s, so a
    reload that keeps the scope says nothing new); so is a value of a list in it that matches
    nothing while the others do (`endpoint_id: [ep-a, ep-typo]`)."""
    judged: list[tuple[BudgetConfig, bool | None]] = []
    for budget in budgets:
        matched = scope_matched(budget, latest)
        if matched is not None and latest.note_scope(budget.name, _scope_text(budget), matched):
            log.warning(
                "budget scope matches nothing; the budget reads 0% until it does",
                budget=budget.name,
                scope=_scope_text(budget),
                source="usage" if budget.on_usage else "bills",
            )
        if matched:
            missed = unmatched_values(budget, latest)
            if latest.note_scope(f"{budget.name} (values)", ", ".join(missed), not missed):
                log.warning(
                    "budget scope: values that match nothing",
                    budget=budget.name,
                    values=", ".join(missed),
                    source="usage" if budget.on_usage else "bills",
                )
        judged.append((budget, matched))
    return judged
