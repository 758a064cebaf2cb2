"""Months of daily spend as a real account shows it: a weekly rhythm, noise, growth, and spikes.

The simulator bills a day with no usage records of its own from this model when one is set
(`Simulator.spend`), so history, anomaly detection and backfill have something true to work on,
and tests and benchmarks know exactly which days were unusual.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from decimal import Decimal

from exporter.sim.model import _unit

WEEKLY = (1.0, 1.08, 1.1, 1.05, 0.97, 0.55, 0.45)
"""Monday … Sunday: weekdays busy, weekends quiet."""
CENT = Decimal("0.01")


@dataclass(frozen=True)
class Spike:
    """`factor` × the usual amount on `day`, for `group`: an endpoint id, an item, or "" (every
    endpoint and item of the account)."""

    day: dt.date
    group: str
    factor: float


@dataclass
class SpendModel:
    """Daily payable amounts per (endpoint, item): `base` on an average day at `start`, each
    endpoint and item weighted (0.5–1.5, from the seed), × the weekday's share in `weekly`,
    × `growth` compounded per 30 days from `start`, × uniform noise within ±`noise`, × every
    spike that covers it. Deterministic: the same model gives the same amounts."""

    start: dt.date
    seed: int = 7
    base: Decimal = Decimal(40)
    weekly: tuple[float, ...] = WEEKLY
    noise: float = 0.15
    growth: float = 0.03
    spikes: list[Spike] = field(default_factory=list)

    def usual(self, day: dt.date, endpoint_id: str, item: str) -> float:
        """The amount without noise or spikes (what a perfect baseline would expect)."""
        weight = 0.5 + _unit(self.seed, "weight", endpoint_id, item) % 1000 / 1000
        trend: float = (1 + self.growth) ** ((day - self.start).days / 30)
        return float(self.base) * weight * self.weekly[day.weekday()] * trend

    def amount(self, day: dt.date, endpoint_id: str, item: str) -> Decimal:
        jitter = 1 + self.noise * (2 * (_unit(self.seed, "noise", day, endpoint_id, item) % 10_000) / 10_000 - 1)
        value = self.usual(day, endpoint_id, item) * jitter
        for spike in self.spikes:
            if spike.day == day and spike.group in ("", endpoint_id, item):
                value *= spike.factor
        return Decimal(repr(value)).quantize(CENT)
