"""The simulator billing from its own usage records at a price table, as the provider would: the
exporter's estimate from usage and the bills it reads then agree, and the demo uses this."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from pathlib import Path

import pytest

from exporter.app.demo import DEMO_CONFIG
from exporter.billing import GROUP_TERM_INSTANCE, GROUP_TERM_ITEM, BillingClient
from exporter.config.load import load, validate
from exporter.config.schema import Config, PriceConfig
from exporter.core.clock import Clock
from exporter.sim import (
    DEFAULT_ENDPOINTS,
    ITEMS,
    Endpoint,
    SimPrice,
    Simulator,
    SimulatorServer,
    prices_from_config,
)
from exporter.sources.usage import UsageSync, estimate
from exporter.state import StateStore
from tests.conftest import PAGE, billing_section
from tests.daemon_fakes import fake_billing_section, metrics, unit_daemon
from tests.fakes import FakeBilling
from tests.helpers import named

PERIOD = "2026-11"
MILLION = Decimal(1_000_000)
ODD_PRICES = {
    "model-a": SimPrice(prompt=Decimal("3.37"), cached_prompt=Decimal("0.843"), completion=Decimal("13.001")),
    "model-b": SimPrice(prompt=Decimal("0.15"), cached_prompt=Decimal("0.075"), completion=Decimal("0.6")),
}
"""Prices with awkward decimals, so that any rounding or float on the way would show."""


def demo_config() -> Config:
    return load(
        DEMO_CONFIG,
        {
            "SIM_URL": "http://127.0.0.1:1",
            "SIM_ACCESS_KEY_ID": "key",
            "SIM_SECRET_ACCESS_KEY": "secret",
            "SIM_API_KEY": "api-key",
            "STATE_DIR": "/nonexistent",
        },
    )


@pytest.fixture
def demo_prices() -> tuple[PriceConfig, ...]:
    return demo_config().prices


@pytest.fixture
def priced(sim: Simulator, demo_prices: tuple[PriceConfig, ...]) -> Simulator:
    """The conftest simulator, billing at the demo's prices, as `demo` wires it."""
    sim.set_prices(prices_from_config(demo_prices))
    return sim


def tokens_by_record(sim: Simulator, day: dt.date) -> dict[tuple[str, str], int]:
    """Billed tokens per (endpoint, item), summed here from the served records, independently of
    the simulator's own counting (every distinct request once)."""
    tokens: dict[tuple[str, str], int] = {}
    seen: set[str] = set()
    for r in sim.usage_records(day):
        if r["requestId"] in seen:
            continue
        seen.add(r["requestId"])
        for item, n in (
            ("ITEM_PROMPT_TOKEN", r["promptTokens"] - r["promptCachedTokens"]),
            ("ITEM_CACHED_PROMPT_TOKEN", r["promptCachedTokens"]),
            ("ITEM_COMPLETION_TOKEN", r["completionTokens"]),
        ):
            tokens[r["endpoint"], item] = tokens.get((r["endpoint"], item), 0) + n
    return tokens


def expected_charges(sim: Simulator, day: dt.date) -> dict[tuple[str, str], tuple[Decimal, Decimal]]:
    """(payable, usage) per (endpoint, item): tokens × the price of the endpoint's model, per million."""
    assert sim.prices is not None
    tokens = tokens_by_record(sim, day)
    expected = {}
    for e in sim.endpoints:
        prices = {
            "ITEM_PROMPT_TOKEN": sim.prices[e.model].prompt,
            "ITEM_CACHED_PROMPT_TOKEN": sim.prices[e.model].cached_prompt,
            "ITEM_COMPLETION_TOKEN": sim.prices[e.model].completion,
        }
        for item in ITEMS:
            n = tokens.get((e.endpoint_id, item), 0)
            expected[e.endpoint_id, item] = (n * prices[item] / MILLION, Decimal(n))
    return expected


def billed_today_by_endpoint(sim: Simulator, day: dt.date) -> dict[str, Decimal]:
    return {
        e.endpoint_id: sum((sim.charge(PERIOD, day, e, item)[0] for item in ITEMS), Decimal(0)) for e in sim.endpoints
    }


def estimated_by_endpoint(sim: Simulator, day: dt.date, prices: tuple[PriceConfig, ...]) -> dict[str, Decimal]:
    """The exporter's own `estimate()` over the simulator's usage totals, summed per endpoint."""
    by_model = {p.model: p for p in prices}
    sums: dict[str, Decimal] = {}
    for (endpoint_id, model), t in sim.usage_totals(day, distinct=True).items():
        amount = estimate(by_model[model], t["prompt"], t["completion"], t["cached"])
        assert amount is not None
        sums[endpoint_id] = sums.get(endpoint_id, Decimal(0)) + amount
    return sums


# -- the demo's prices ------------------------------------------------------------------------


def test_demo_prices_cover_every_model_and_cached_tokens_are_cheaper(demo_prices: tuple[PriceConfig, ...]) -> None:
    by_model = {p.model: p for p in demo_prices}
    assert {e.model for e in DEFAULT_ENDPOINTS} <= set(by_model)
    for price in demo_prices:
        assert price.cached_prompt_per_million is not None, price.model
        assert 0 < price.cached_prompt_per_million < price.prompt_per_million, price.model
    table = prices_from_config(demo_prices)
    assert table == {
        p.model: SimPrice(p.prompt_per_million, p.cached_prompt_per_million, p.completion_per_million)
        for p in demo_prices
    }


def test_an_unset_cached_price_is_the_prompt_price_as_in_the_estimate() -> None:
    price = PriceConfig(model="m", prompt_per_million=Decimal("2"), completion_per_million=Decimal("8"))
    assert prices_from_config([price]) == {"m": SimPrice(Decimal("2"), Decimal("2"), Decimal("8"))}


def test_a_table_that_leaves_a_model_unpriced_is_refused(sim: Simulator) -> None:
    with pytest.raises(ValueError, match="model-b"):
        sim.set_prices({"model-a": ODD_PRICES["model-a"]})
    with pytest.raises(ValueError, match="model-b"):
        Simulator(prices={"model-a": ODD_PRICES["model-a"]})
    assert sim.prices is None


# -- bills from records -----------------------------------------------------------------------


@pytest.mark.parametrize("table", ["demo", "odd"])
def test_bills_are_the_records_tokens_times_the_prices_exactly(
    sim: Simulator, clock: Clock, demo_prices: tuple[PriceConfig, ...], table: str
) -> None:
    sim.set_prices(prices_from_config(demo_prices) if table == "demo" else ODD_PRICES)
    sim.add_usage(3000)
    today = clock.today()
    expected = expected_charges(sim, today)
    assert all(usage > 0 for _, usage in expected.values())
    for e in sim.endpoints:
        for item in ITEMS:
            assert sim.charge(PERIOD, today, e, item) == expected[e.endpoint_id, item]

    rows = [r for r in sim.bill_rows(PERIOD, "GROUP_TERM_INSTANCE") if r["startTime"] == "2026-11-21T16:00:00Z"]
    assert {r["instanceId"]: (r["payableAmount"], r["usageValue"]) for r in rows} == {
        e.endpoint_id: (
            str(sum((expected[e.endpoint_id, item][0] for item in ITEMS), Decimal(0))),
            str(sum((expected[e.endpoint_id, item][1] for item in ITEMS), Decimal(0))),
        )
        for e in sim.endpoints
    }
    rows = [r for r in sim.bill_rows(PERIOD, "GROUP_TERM_ITEM") if r["startTime"] == "2026-11-21T16:00:00Z"]
    assert {r["item"]: Decimal(r["payableAmount"]) for r in rows} == {
        item: sum((expected[e.endpoint_id, item][0] for e in sim.endpoints), Decimal(0)) for item in ITEMS
    }
    totals = sim.bill_totals(PERIOD)
    days = [dt.date(2026, 11, d) for d in range(1, 23)]
    for e in sim.endpoints:
        assert totals[e.endpoint_id] == sum(
            (sim.charge(PERIOD, d, e, item)[0] for d in days for item in ITEMS), Decimal(0)
        )


def test_cached_prompt_tokens_bill_for_less_than_uncached_ones(priced: Simulator, clock: Clock) -> None:
    priced.add_usage(2000)
    today = clock.today()
    for e in priced.endpoints:
        uncached, uncached_tokens = priced.charge(PERIOD, today, e, "ITEM_PROMPT_TOKEN")
        cached, cached_tokens = priced.charge(PERIOD, today, e, "ITEM_CACHED_PROMPT_TOKEN")
        assert cached / cached_tokens < uncached / uncached_tokens


def test_the_exporters_estimate_equals_the_bill_per_endpoint(
    priced: Simulator, clock: Clock, demo_prices: tuple[PriceConfig, ...]
) -> None:
    priced.add_usage(5000)
    today = clock.today()
    assert estimated_by_endpoint(priced, today, demo_prices) == billed_today_by_endpoint(priced, today)


def test_served_bills_and_synced_estimate_agree_over_http(
    priced: Simulator,
    server: SimulatorServer,
    clock: Clock,
    store: StateStore,
    demo_prices: tuple[PriceConfig, ...],
) -> None:
    """The whole exporter path: bills through the billing client, usage through the usage sync."""
    priced.add_usage(1234)
    today = clock.today()
    config = validate({"billing": billing_section(priced, server, page_size=PAGE)}, {})
    with BillingClient.from_config(config.billing, clock) as client:
        billed = {b.instance_id: b for b in client.bills(PERIOD, GROUP_TERM_INSTANCE) if b.day == today}
        items = {b.item: b for b in client.bills(PERIOD, GROUP_TERM_ITEM) if b.day == today}
        snapshot = UsageSync(client, clock, store, per_api_key=True, prices=demo_prices).refresh()
    expected = expected_charges(priced, today)
    for e in priced.endpoints:
        assert billed[e.endpoint_id].payable_amount == sum(
            (expected[e.endpoint_id, item][0] for item in ITEMS), Decimal(0)
        )
    for item in ITEMS:
        assert items[item].payable_amount == sum(
            (expected[e.endpoint_id, item][0] for e in priced.endpoints), Decimal(0)
        )
        assert items[item].usage_value == sum((expected[e.endpoint_id, item][1] for e in priced.endpoints), Decimal(0))
    estimated: dict[str, Decimal] = {}
    for key, totals in snapshot.totals.items():
        assert totals.estimated_payable is not None
        estimated[key.endpoint_id] = estimated.get(key.endpoint_id, Decimal(0)) + totals.estimated_payable
    assert estimated == {endpoint_id: bill.payable_amount for endpoint_id, bill in billed.items()}


def test_bills_follow_records_as_they_arrive(priced: Simulator, clock: Clock) -> None:
    today = clock.today()
    priced.add_usage(100)
    before = priced.bill_rows(PERIOD, "GROUP_TERM_INSTANCE")
    priced.add_usage(50)
    after = priced.bill_rows(PERIOD, "GROUP_TERM_INSTANCE")
    assert before != after
    alpha = priced.endpoints[0]
    assert (
        priced.charge(PERIOD, today, alpha, "ITEM_COMPLETION_TOKEN")
        == (expected_charges(priced, today)[alpha.endpoint_id, "ITEM_COMPLETION_TOKEN"])
    )


def test_a_repeated_record_bills_once_and_a_removed_one_not_at_all(
    priced: Simulator, clock: Clock, demo_prices: tuple[PriceConfig, ...]
) -> None:
    today = clock.today()
    priced.add_usage(600)
    priced.repeat_usage(position=5, at=300)
    priced.add_usage(10)
    assert billed_today_by_endpoint(priced, today) == estimated_by_endpoint(priced, today, demo_prices)
    priced.remove_usage([0, 1, 2])
    priced.add_usage(10)
    assert sum(t["requests"] for t in priced.usage_totals(today, distinct=True).values()) == 617
    expected = expected_charges(priced, today)
    for e in priced.endpoints:
        for item in ITEMS:
            assert priced.charge(PERIOD, today, e, item) == expected[e.endpoint_id, item]
    assert billed_today_by_endpoint(priced, today) == estimated_by_endpoint(priced, today, demo_prices)


def test_a_day_without_records_keeps_its_deterministic_random_bills(priced: Simulator, clock: Clock) -> None:
    today = clock.today()
    priced.add_usage(500)
    unpriced = Simulator(clock=clock)
    yesterday = today - dt.timedelta(days=1)
    for e in priced.endpoints:
        for item in ITEMS:
            assert priced.charge(PERIOD, yesterday, e, item) == unpriced.charge(PERIOD, yesterday, e, item)
    rows = priced.bill_rows(PERIOD, "GROUP_TERM_INSTANCE")
    assert len(rows) == 22 * len(priced.endpoints)  # every day of the month so far has bills
    assert all(Decimal(r["payableAmount"]) > 0 for r in rows)


def test_a_revised_bill_still_wins(priced: Simulator, clock: Clock, fake: FakeBilling) -> None:
    today = clock.today()
    priced.add_usage(400)
    alpha = priced.endpoints[0]
    tokens = expected_charges(priced, today)[alpha.endpoint_id, "ITEM_PROMPT_TOKEN"][1]
    priced.bill_rows(PERIOD, "GROUP_TERM_ITEM")  # cached before the revision
    priced.revise_bill(today, alpha.endpoint_id, "ITEM_PROMPT_TOKEN", Decimal("123.45"))
    assert priced.charge(PERIOD, today, alpha, "ITEM_PROMPT_TOKEN") == (Decimal("123.45"), tokens)
    served = {b.instance_id: b.payable_amount for b in fake.bills(PERIOD, GROUP_TERM_INSTANCE) if b.day == today}
    assert served[alpha.endpoint_id] == billed_today_by_endpoint(priced, today)[alpha.endpoint_id]
    assert served[alpha.endpoint_id] == Decimal("123.45") + sum(
        (priced.charge(PERIOD, today, alpha, item)[0] for item in ITEMS[1:]), Decimal(0)
    )


def test_set_prices_drops_bills_computed_before(sim: Simulator, clock: Clock) -> None:
    sim.add_usage(300)
    unpriced_rows = sim.bill_rows(PERIOD, "GROUP_TERM_ITEM")
    sim.set_prices(ODD_PRICES)
    priced_rows = sim.bill_rows(PERIOD, "GROUP_TERM_ITEM")
    assert priced_rows[:-3] == unpriced_rows[:-3]  # past days: unchanged
    assert priced_rows[-3:] != unpriced_rows[-3:]  # today: from its records
    sim.set_prices(None)
    assert sim.bill_rows(PERIOD, "GROUP_TERM_ITEM") == unpriced_rows


def test_bills_follow_a_change_of_endpoints(priced: Simulator, clock: Clock) -> None:
    priced.add_usage(300)
    priced.bill_totals(PERIOD)
    priced.endpoints = (*priced.endpoints, Endpoint("ep-20261103-delta", "model-b", "proj-lab"))
    today = clock.today()
    expected = expected_charges(priced, today)
    assert expected["ep-20261103-delta", "ITEM_COMPLETION_TOKEN"][1] > 0
    for e in priced.endpoints:
        for item in ITEMS:
            assert priced.charge(PERIOD, today, e, item) == expected[e.endpoint_id, item]


# -- without prices nothing changes -----------------------------------------------------------


def test_without_prices_bills_are_the_old_deterministic_amounts(sim: Simulator, clock: Clock) -> None:
    """Values computed by the simulator before prices existed, pinned: many tests depend on them."""
    assert sim.prices is None
    today = clock.today()
    sim.add_usage(500)  # records do not move unpriced bills
    alpha, beta, gamma = sim.endpoints
    assert sim.charge(PERIOD, today, alpha, "ITEM_PROMPT_TOKEN") == (Decimal("64.65103847"), Decimal("4550095"))
    assert sim.charge(PERIOD, today, beta, "ITEM_CACHED_PROMPT_TOKEN") == (Decimal("20.40722775"), Decimal("1710153"))
    assert sim.charge(PERIOD, dt.date(2026, 11, 1), gamma, "ITEM_COMPLETION_TOKEN") == (
        Decimal("22.97657482"),
        Decimal("2811170"),
    )
    assert sim.bill_totals(PERIOD)["total"] == Decimal("8260.81595979")
    assert sim.records_billed == 0


# -- efficiency -------------------------------------------------------------------------------


def test_serving_bills_reads_each_record_once(priced: Simulator, fake: FakeBilling, clock: Clock) -> None:
    """Not a timing: the count of records read to compute bills, over many requests and appends."""
    appends, requests_per_append, batch = 20, 5, 250
    priced.add_usage(10_000)
    fake.bills(PERIOD, GROUP_TERM_INSTANCE)
    assert priced.records_billed == 10_000
    for _ in range(appends):
        priced.add_usage(batch)
        fake.bills(PERIOD, GROUP_TERM_INSTANCE)  # the simulator's answer to the API's request, every page of it
        for _ in range(requests_per_append):
            priced.bill_rows(PERIOD, "GROUP_TERM_ITEM", project_id="proj-main")
            priced.bill_totals(PERIOD)
    assert priced.records_billed == 10_000 + appends * batch  # each record once, not once per request
    priced.remove_usage([7])
    fake.bills(PERIOD, GROUP_TERM_INSTANCE)
    for _ in range(requests_per_append):
        priced.bill_rows(PERIOD, "GROUP_TERM_ITEM")
    assert priced.records_billed == 2 * (10_000 + appends * batch) - 1  # a removal: the day counted once more


def test_a_200k_record_day_is_counted_once(priced: Simulator) -> None:
    priced.add_usage(200_000)
    priced.bill_rows(PERIOD, "GROUP_TERM_INSTANCE")
    for _ in range(10):
        priced.add_usage(30)
        priced.bill_rows(PERIOD, "GROUP_TERM_INSTANCE")
        priced.bill_rows(PERIOD, "GROUP_TERM_ITEM")
    assert priced.records_billed == 200_300


# -- the demo's claim, through the daemon -------------------------------------------------------


def test_the_daemons_estimated_and_billed_today_agree(
    priced: Simulator, clock: Clock, demo_prices: tuple[PriceConfig, ...], tmp_path: Path
) -> None:
    sim = priced
    sim.add_usage(3000)
    config = validate(
        {
            "billing": fake_billing_section(sim),
            "prices": [p.model_dump(exclude_none=True) for p in demo_prices],
            "state": {"path": str(tmp_path / "state.db")},
        },
        {},
    )
    daemon = unit_daemon(config, sim, clock)
    try:
        assert daemon.refresh("bills")
        assert daemon.refresh("usage")
        series = metrics(daemon)
    finally:
        daemon.stop(grace=5)
    today = clock.today().isoformat()
    billed = {
        dict(labels)["endpoint_id"]: v
        for labels, v in named(series, "inference_bill_endpoint_daily_payable_amount").items()
        if dict(labels)["day"] == today
    }
    estimated: dict[str, float] = {}
    for labels, v in named(series, "inference_usage_estimated_payable_amount_total").items():
        estimated[dict(labels)["endpoint_id"]] = estimated.get(dict(labels)["endpoint_id"], 0.0) + v
    assert set(billed) == set(estimated) == {e.endpoint_id for e in sim.endpoints}
    for endpoint_id, amount in billed.items():
        assert estimated[endpoint_id] == pytest.approx(amount, rel=1e-12)
