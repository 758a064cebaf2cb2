"""The budgets that span several accounts (the organisation's): their figures summed over the
accounts they span, and their collector. (How several accounts make one exposition: `assembled`.)"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from exporter.alerts.rules import summed_crossing
from exporter.config.schema import BudgetConfig, PriceConfig
from exporter.core.clock import Clock
from exporter.metrics.collectors import Versions, budget_families, crossing_families
from exporter.model.snapshots import Latest
from exporter.sources.budgets import BudgetFigures, figures, scope_matched, summed


def shared_parts(
    budget: BudgetConfig, spans: Iterable[tuple[Latest, Sequence[PriceConfig]]], today: dt.date | None
) -> list[BudgetFigures] | None:
    """A budget's figures in each account it spans, as each last refreshed; None while one of them
    has none for the current period (a part unknown is never read as zero)."""
    inner = budget.in_account()
    parts: list[BudgetFigures] = []
    current = {today.isoformat(), f"{today:%Y-%m}"} if today is not None else None
    for latest, prices in spans:
        found = figures(inner, latest, prices)
        if found is None or (current is not None and found.period not in current):
            return None
        if parts and found.period != parts[0].period:
            return None
        parts.append(found)
    return parts or None


def shared_matched(budget: BudgetConfig, spans: Iterable[tuple[Latest, Sequence[PriceConfig]]]) -> bool | None:
    """Whether the budget's scope matches anything in any account it spans (`scope_matched`); None
    while none of them can say."""
    seen = [scope_matched(budget.in_account(), latest) for latest, _ in spans]
    return any(seen) if any(s is not None for s in seen) else None


class SharedBudgetCollector(Collector):
    """The budgets that span several accounts (the organisation's): their amount, used and forecast
    ratios over every account they span, the day their summed spend crosses the amount (at the
    accounts' summed pace) and, spanning one account, the chance it does; and whether their scope
    matched anything in any of them."""

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
        self._version = current.kept(self._version)
        return self._version

    def _spans(self, budget: BudgetConfig) -> list[tuple[Latest, Sequence[PriceConfig]]]:
        return [(latest, prices) for name, latest, prices in self.accounts if budget.spans(name)]

    def collect(self) -> Iterator[Metric]:
        amount, used, forecast, matched = budget_families()
        crossing, chance = crossing_families()
        today = self.clock.today()
        for budget in self.budgets:
            spans = self._spans(budget)
            amount.add_metric([budget.name], float(budget.amount))
            parts = shared_parts(budget, spans, today)
            if parts is not None:
                spent, projected = summed(parts).ratios(budget.amount)
                used.add_metric([budget.name], float(spent))
                forecast.add_metric([budget.name], float(projected))
                day = summed_crossing(parts, budget.amount)
                if day is not None:
                    crossing.add_metric([budget.name], self.clock.day_start(day).timestamp())
                probability = parts[0].chance(budget.amount) if len(parts) == 1 else None
                if probability is not None:
                    chance.add_metric([budget.name], probability)
            found = shared_matched(budget, spans)
            if found is not None:
                matched.add_metric([budget.name], 1.0 if found else 0.0)
        yield from (amount, used, forecast, matched, crossing, chance)
