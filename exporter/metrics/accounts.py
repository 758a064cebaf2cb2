"""The budgets that span several accounts (the organisation's): their figures summed over the
accounts they span, and their collector. (How several accounts make one exposition: `assembled`.)"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from exporter.config.schema import BudgetConfig, PriceConfig
from exporter.core.clock import Clock
from exporter.metrics.collectors import budget_families
from exporter.model.snapshots import Latest
from exporter.sources.budgets import BudgetFigures, figures, scope_matched


class Versions(tuple[object, ...]):
    """The versions of what figures are made from: the same while each is the same object."""

    def same(self, other: object) -> bool:
        """Each part's version is the same object (a day, compared by value, may be equal ones)."""
        return (
            isinstance(other, Versions)
            and len(other) == len(self)
            and all(a is b or (isinstance(a, dt.date) and a == b) for a, b in zip(self, other, strict=True))
        )


def shared_figures(
    budget: BudgetConfig, spans: Iterable[tuple[Latest, Sequence[PriceConfig]]], today: dt.date | None
) -> BudgetFigures | None:
    """A budget's figures summed over the accounts it spans, each as it last refreshed; None while
    one of them has none for the current period (a part unknown is never read as zero)."""
    inner = budget.in_account()
    total: BudgetFigures | None = None
    current = {today.isoformat(), f"{today:%Y-%m}"} if today is not None else None
    for latest, prices in spans:
        found = figures(inner, latest, prices)
        if found is None or (current is not None and found.period not in current):
            return None
        if total is not None and found.period != total.period:
            return None
        total = (
            found
            if total is None
            else BudgetFigures(found.period, total.spent + found.spent, total.projected + found.projected)
        )
    return total


class SharedBudgetCollector(Collector):
    """The budgets that span several accounts (the organisation's): their amount, used and forecast
    ratios over every account they span, and whether their scope matched anything in any of them."""

    def __init__(
        self,
        accounts: Sequence[tuple[str, Latest, Sequence[PriceConfig]]],
        budgets: Iterable[BudgetConfig],
        clock: Clock,
    ) -> None:
        self.accounts = tuple(accounts)
        self.budgets = tuple(budgets)
        self.clock = clock
        self._version: Versions | None = None

    def version(self) -> object:
        """The snapshots of every account the figures are made from, and the day: the same object
        while none of them changes."""
        current = Versions(
            [
                self.clock.today(),
                *(x for _, latest, _ in self.accounts for x in (latest.bills, latest.history, latest.usage)),
                *(latest.settled for _, latest, _ in self.accounts),
            ]
        )
        if self._version is None or not (self._version[0] == current[0] and self._version.same(current)):
            self._version = current
        return self._version

    def _spans(self, budget: BudgetConfig) -> list[tuple[Latest, Sequence[PriceConfig]]]:
        wanted = budget.accounts
        return [(latest, prices) for name, latest, prices in self.accounts if wanted is None or name in wanted]

    def collect(self) -> Iterator[Metric]:
        amount, used, forecast, matched = budget_families()
        today = self.clock.today()
        for budget in self.budgets:
            spans = self._spans(budget)
            amount.add_metric([budget.name], float(budget.amount))
            found = shared_figures(budget, spans, today)
            if found is not None:
                ratios = found.ratios(budget.amount)
                used.add_metric([budget.name], float(ratios[0]))
                forecast.add_metric([budget.name], float(ratios[1]))
            seen = [scope_matched(budget.in_account(), latest) for latest, _ in spans]
            if any(s is not None for s in seen):
                matched.add_metric([budget.name], 1.0 if any(seen) else 0.0)
        yield from (amount, used, forecast, matched)
