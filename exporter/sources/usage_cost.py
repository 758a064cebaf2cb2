"""What a day's tokens cost: tokens × a model's configured price (`cost`, `estimate`), and what
today's estimate counters have counted so far (`Counted`, `count`), so that new prices price only
the tokens counted from then on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal

from exporter.config.schema import PriceConfig
from exporter.model.snapshots import UsageKey
from exporter.sources.usage_aggregate import Aggregate

MILLION = Decimal(1_000_000)


def estimate(price: PriceConfig | None, prompt: int, completion: int, cached: int) -> Decimal | None:
    """`cost`, or None for a model without a configured price."""
    return None if price is None else cost(price, prompt, completion, cached)


def cost(price: PriceConfig, prompt: int, completion: int, cached: int) -> Decimal:
    """Tokens × a model's configured price; cached prompt tokens are part of the prompt tokens."""
    cached_price = (
        price.prompt_per_million if price.cached_prompt_per_million is None else price.cached_prompt_per_million
    )
    return (
        (prompt - cached) * price.prompt_per_million + cached * cached_price + completion * price.completion_per_million
    ) / MILLION


Tokens = tuple[int, int, int]
"""prompt, completion, cached: what an estimate is made of."""


@dataclass(frozen=True, slots=True)
class Counted:
    """What today's estimate counter of one key has counted: `amount` for the tokens `covered`,
    each priced by the prices in effect when it was counted."""

    amount: Decimal
    covered: Tokens


NOTHING_COUNTED = Counted(Decimal(0), (0, 0, 0))


def count(
    counted: Mapping[UsageKey, Counted], aggregate: Aggregate, prices: Mapping[str, PriceConfig]
) -> dict[UsageKey, Counted]:
    """`counted`, with the tokens `aggregate` holds beyond it priced by `prices` and added.

    A key whose model has no price is left as it was: its tokens are priced by the first price
    its model gets (a price added to the config covers the day so far; nothing went out at a
    lower figure meanwhile, since a key that never had a price has no counter, and one whose
    price a reload took away keeps its counter at what it counted). An amount that covers
    more tokens than the key holds (counted on a list read afresh that shows fewer) is not trusted:
    that key's tokens are priced afresh.
    """
    after = dict(counted)
    for key, (_, prompt, completion, cached) in aggregate.sums.items():
        price = prices.get(key.model)
        before = after.get(key, NOTHING_COUNTED)
        if not all(had <= has for had, has in zip(before.covered, (prompt, completion, cached), strict=True)):
            before = after[key] = NOTHING_COUNTED
        if price is None or before.covered == (prompt, completion, cached):
            continue
        p, c, k = before.covered
        amount = before.amount + cost(price, prompt - p, completion - c, cached - k)
        after[key] = Counted(amount, (prompt, completion, cached))
    return after
