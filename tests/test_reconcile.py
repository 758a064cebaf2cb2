"""Reconciliation against the simulator, whose bills are computed from its own usage records at
a price table: agreement to the token, an injected gap found where it is and nowhere else, failed
reads retried (never a gap of −100%), restarts that do not read a day twice, and the month's turn.
On the simulator's ledger in process (tests/fakes.py), the daemon's own alert too (tests/daemon_fakes.py),
but for a refused read, which is injected on the wire."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from pathlib import Path

import msgspec
import pytest

from exporter.app.sources import Sources
from exporter.billing import BillingAPI, BillingClient
from exporter.config.load import validate
from exporter.config.schema import PriceConfig
from exporter.core.clock import Clock, FrozenClock
from exporter.model.snapshots import Latest
from exporter.sim import Fault, Simulator, prices_from_config
from exporter.sources.bills import BillsSource
from exporter.sources.reconcile import DEFAULT_ITEMS, SettledUsage, reconcile
from exporter.state import StateStore
from tests.conftest import SHANGHAI
from tests.daemon_fakes import InProcessBilling, fake_billing_section, metrics, page, statuses, told
from tests.fakes import FakeBilling
from tests.helpers import named

USAGES = "/api/v1/usages/details"
PRICES = (
    PriceConfig(model="model-a", prompt_per_million=Decimal(4), cached_prompt_per_million=Decimal(1),
                completion_per_million=Decimal(16)),
    PriceConfig(model="model-b", prompt_per_million=Decimal(2), cached_prompt_per_million=Decimal("0.5"),
                completion_per_million=Decimal(8)),
)  # fmt: skip
DAYS = [dt.date(2026, 11, d) for d in range(15, 22)]
SIX_HOURS = 6 * 3600.0


def billed_week(sim: Simulator) -> Simulator:
    """A week of past days with usage records, billed from them at the config's prices."""
    sim.set_prices(prices_from_config(PRICES))
    for n, day in enumerate(DAYS):
        sim.add_usage(150 + 40 * n, day)
    return sim


@pytest.fixture
def priced(sim: Simulator) -> Simulator:
    return billed_week(sim)


def settled_usage(client: BillingAPI, clock: Clock, store: StateStore, per_refresh: int = 10) -> SettledUsage:
    return SettledUsage(client, clock, store, settle=SIX_HOURS, days_per_refresh=per_refresh, per_api_key=False)


def read_all(source: SettledUsage, first: dt.date) -> dict[dt.date, list]:
    held = source.refresh(first)
    while len(held) < len(source.settled_days(first)):
        held = source.refresh(first)
    return held


def served(sim: Simulator) -> int:
    return sim.requests_served.get(USAGES, 0)


def test_consistent_bills_and_records_agree_to_the_token(
    priced: Simulator, fake: FakeBilling, clock: Clock, store: StateStore
) -> None:
    held = read_all(settled_usage(fake, clock, store), DAYS[0])
    assert sorted(held) == DAYS  # today (the 22nd) has not ended, let alone settled
    result = reconcile(BillsSource(fake, clock, 3).refresh(), held, DEFAULT_ITEMS, PRICES)
    assert {g.day for g in result.tokens} == set(DAYS)
    assert len(result.tokens) == len(DAYS) * 3
    for gap in result.tokens:
        assert gap.counted == gap.billed > 0
        assert gap.ratio == 0
    assert len(result.amounts) == len(DAYS) * len(priced.endpoints)
    for amount in result.amounts:
        assert amount.billed == amount.estimated > 0
        assert amount.ratio == 0


def test_a_five_percent_gap_is_found_on_its_day_and_item_and_nowhere_else(
    priced: Simulator, fake: FakeBilling, clock: Clock, store: StateStore
) -> None:
    day = DAYS[3]
    priced.distort_bill(day, Decimal("1.05"), item="ITEM_COMPLETION_TOKEN")
    held = read_all(settled_usage(fake, clock, store), DAYS[0])
    result = reconcile(BillsSource(fake, clock, 3).refresh(), held, DEFAULT_ITEMS, PRICES)
    off = [(g.day, g.item) for g in result.tokens if g.ratio != 0]
    assert off == [(day, "ITEM_COMPLETION_TOKEN")]
    (gap,) = [g for g in result.tokens if g.ratio != 0]
    assert abs(gap.ratio - Decimal("0.05")) < Decimal("0.0001")  # type: ignore[operator]
    # every endpoint's amount that day is off by the completion share of it, and only that day
    assert {a.day for a in result.amounts if a.ratio != 0} == {day}


def test_a_day_whose_usage_read_fails_is_read_later_and_never_shown_as_a_gap(
    priced: Simulator, client: BillingClient, clock: Clock, store: StateStore
) -> None:
    source = settled_usage(client, clock, store, per_refresh=1)
    priced.inject(Fault("status", USAGES, status=400))  # the first read (the most recent day) is refused
    held = source.refresh(DAYS[0])
    assert held == {}
    result = reconcile(BillsSource(client, clock, 3).refresh(), held, DEFAULT_ITEMS, PRICES)
    assert result.tokens == ()  # no figures, rather than −100%
    assert result.amounts == ()
    assert sorted(source.refresh(DAYS[0])) == [DAYS[-2]]  # the others go first meanwhile ...
    source._retry_at.clear()  # (a quarter of an hour later)
    assert sorted(source.refresh(DAYS[0])) == [DAYS[-2], DAYS[-1]]  # ... and it is read then


def test_each_day_is_read_once_most_recent_first_a_few_per_refresh_and_not_again_after_a_restart(
    priced: Simulator, fake: FakeBilling, clock: Clock, store: StateStore
) -> None:
    source = settled_usage(fake, clock, store, per_refresh=2)
    assert sorted(source.refresh(DAYS[0])) == DAYS[-2:]
    read_all(source, DAYS[0])
    before = served(priced)
    restarted = settled_usage(fake, clock, store, per_refresh=2)
    assert sorted(restarted.refresh(DAYS[0])) == DAYS
    assert served(priced) == before


def test_the_days_held_are_read_from_the_state_file_once_and_unchanged_they_are_the_same_mapping(
    priced: Simulator, fake: FakeBilling, clock: Clock, store: StateStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = settled_usage(fake, clock, store, per_refresh=len(DAYS))
    loads = []
    load = store.load_settled_usage
    monkeypatch.setattr(store, "load_settled_usage", lambda *args: loads.append(args) or load(*args))
    held = source.refresh(DAYS[0])
    assert sorted(held) == DAYS
    again = source.refresh(DAYS[0])
    assert again is held  # nothing read: the daemon judges nothing again
    assert len(loads) == 1
    later = source.refresh(DAYS[1])  # the window moves on (a new month): no state file read either
    assert sorted(later) == DAYS[1:]
    assert len(loads) == 1


def test_a_day_is_read_only_once_it_has_settled(
    priced: Simulator, fake: FakeBilling, clock: Clock, store: StateStore, frozen: FrozenClock
) -> None:
    frozen.set(dt.datetime(2026, 11, 22, 5, 59, tzinfo=SHANGHAI))
    assert settled_usage(fake, clock, store).settled_days(DAYS[0])[-1] == dt.date(2026, 11, 20)
    frozen.set(dt.datetime(2026, 11, 22, 6, 0, tzinfo=SHANGHAI))
    assert settled_usage(fake, clock, store).settled_days(DAYS[0])[-1] == dt.date(2026, 11, 21)


def test_the_previous_months_last_days_stay_reconciled_in_the_grace_days(
    priced: Simulator, fake: FakeBilling, clock: Clock, store: StateStore, frozen: FrozenClock
) -> None:
    last = dt.date(2026, 11, 30)
    for day in [dt.date(2026, 11, d) for d in range(22, 31)] + [dt.date(2026, 12, 1)]:
        priced.add_usage(120, day)  # every day with records (a day without any is billed at random)
    frozen.set(dt.datetime(2026, 12, 2, 9, 0, tzinfo=SHANGHAI))
    held = read_all(settled_usage(fake, clock, store), DAYS[0])
    assert last in held
    result = reconcile(BillsSource(fake, clock, 3).refresh(), held, DEFAULT_ITEMS, PRICES)
    assert {g.day for g in result.tokens} >= {last}
    assert all(g.ratio == 0 for g in result.tokens)


def test_the_daemon_alerts_on_the_last_settled_days_gap_and_exposes_every_days_figures(
    priced: Simulator, clock: Clock, tmp_path: Path
) -> None:
    from tests.test_alerts import evaluated, to_hook, unit

    priced.distort_bill(DAYS[-1], Decimal("1.05"), item="ITEM_COMPLETION_TOKEN")
    rule = {"alert": "BillDisagrees", "signal": "reconciliation_gap", "by": ["item"], "threshold": "0.01",
            "annotations": {"summary": "{item}: the bill is {value} off the usage counted"}}  # fmt: skip
    prices = [p.model_dump(mode="json") for p in PRICES]
    daemon = unit(priced, clock, tmp_path, to_hook(None, rule), prices=prices)
    try:
        assert evaluated(daemon, "usage")  # today first, then the two most recent settled days
        assert evaluated(daemon, "bills")
        assert statuses(daemon) == ["firing"]
        (alert,) = told(daemon)[0]["alerts"]
        assert alert["labels"]["item"] == "ITEM_COMPLETION_TOKEN"
        assert alert["annotations"]["summary"] == "ITEM_COMPLETION_TOKEN: the bill is 0.0500 off the usage counted"
        series = metrics(daemon)
        gaps = {
            (dict(k)["day"], dict(k)["item"]): v
            for k, v in named(series, "inference_reconciliation_token_gap_ratio").items()
        }
        assert {day for day, _ in gaps} == {DAYS[-1].isoformat(), DAYS[-2].isoformat()}
        assert {key for key, v in gaps.items() if v != 0} == {(DAYS[-1].isoformat(), "ITEM_COMPLETION_TOKEN")}
        assert f"<td>{DAYS[-1]}</td><td>ITEM_COMPLETION_TOKEN</td><td>tokens</td>" in page(daemon)
    finally:
        daemon.stop(grace=5)


def test_a_line_the_bill_leaves_out_is_a_gap_of_minus_one_not_a_day_without_figures(
    priced: Simulator, fake: FakeBilling, clock: Clock, store: StateStore
) -> None:
    from dataclasses import replace

    held = read_all(settled_usage(fake, clock, store), DAYS[0])
    bills = BillsSource(fake, clock, 3).refresh()
    day, endpoint = DAYS[2], priced.endpoints[0].endpoint_id
    month = bills.months[0]
    partial = replace(
        month,
        by_item=tuple(a for a in month.by_item if not (a.day == day and a.key == "ITEM_COMPLETION_TOKEN")),
        by_endpoint=tuple(a for a in month.by_endpoint if not (a.day == day and a.key == endpoint)),
    )
    result = reconcile(replace(bills, months=(partial,)), held, DEFAULT_ITEMS, PRICES)
    off = {(g.day, g.item): g.ratio for g in result.tokens if g.ratio != 0}
    assert off == {(day, "ITEM_COMPLETION_TOKEN"): -1}
    assert {(a.day, a.endpoint_id): a.ratio for a in result.amounts if a.ratio != 0} == {(day, endpoint): -1}


def test_a_charge_of_no_endpoint_has_no_amount_gap(
    priced: Simulator, fake: FakeBilling, clock: Clock, store: StateStore
) -> None:
    """A fee of the account's (a bill line with an empty `instanceId`) has no usage records to
    explain it: it is not an endpoint billed for what nothing counted."""
    from dataclasses import replace

    held = read_all(settled_usage(fake, clock, store), DAYS[0])
    bills = BillsSource(fake, clock, 3).refresh()
    month = bills.months[0]
    fee = msgspec.structs.replace(next(a for a in month.by_endpoint if a.day == DAYS[2]), key="", payable=Decimal(5))
    with_fee = replace(month, by_endpoint=(*month.by_endpoint, fee))
    result = reconcile(replace(bills, months=(with_fee,)), held, DEFAULT_ITEMS, PRICES)
    assert result == reconcile(bills, held, DEFAULT_ITEMS, PRICES)
    assert all(a.ratio == 0 for a in result.amounts)


def test_days_read_from_another_account_are_read_again(
    priced: Simulator, fake: FakeBilling, clock: Clock, store: StateStore
) -> None:
    read_all(settled_usage(fake, clock, store), DAYS[0])
    other = SettledUsage(fake, clock, store, settle=SIX_HOURS, days_per_refresh=10, per_api_key=True)
    before = served(priced)
    assert other.refresh(DAYS[0]) != {}  # (per api key: another reading of the account)
    assert served(priced) > before


def test_the_signal_judges_each_group_on_its_own_last_day_and_a_bill_for_nothing_counted_is_a_full_gap(
    clock: Clock,
) -> None:
    from exporter.config.load import validate
    from exporter.model.signals import evaluate
    from exporter.model.snapshots import AmountGap, BillsSnapshot, Latest, Reconciliation

    latest = Latest()
    latest.bills = BillsSnapshot((), clock.today())
    latest.record("bills", success=True, at=0.0, duration=0.0)
    a, b = DAYS[-2], DAYS[-1]
    latest.reconciliation = Reconciliation(
        amounts=(
            AmountGap(a, "ep-1", Decimal(110), Decimal(100), Decimal("0.1")),  # no figure on the last day
            AmountGap(b, "ep-2", Decimal(5), Decimal(0), None),  # billed, nothing counted
            AmountGap(a, "ep-2", Decimal(100), Decimal(100), Decimal(0)),
        )
    )
    rule_config = {"alert": "Gap", "signal": "reconciliation_gap", "by": ["endpoint_id"], "threshold": 0}
    billing = {"url": "https://x", "access_key_id": "a", "secret_access_key": "b"}
    config = validate({"billing": billing, "alerts": {"rules": [rule_config]}}, {})
    (rule,) = config.alerts.rules
    values = evaluate(rule, latest, clock, ["bills"])  # type: ignore[arg-type]
    assert values == {(("endpoint_id", "ep-1"),): Decimal("0.1"), (("endpoint_id", "ep-2"),): Decimal(1)}


def test_a_settled_day_is_judged_against_bills_asked_for_once_it_had_settled(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    """Bills refused from 20:00 on the 21st, usage fine: at 07:00 on the 22nd the 21st has settled and
    its usage is read in full, but the bills held are from before it ended: no figure for it (not a
    gap of a quarter); once the bills come again, it is judged, and agrees."""
    from tests.daemon_fakes import fake_billing_section, unit_daemon

    day = dt.date(2026, 11, 21)
    frozen.set(dt.datetime(2026, 11, 21, 20, 0, tzinfo=SHANGHAI))
    sim.set_prices(prices_from_config(PRICES))
    sim.add_usage(300, day)
    prices = [p.model_dump(mode="json") for p in PRICES]
    document = {"billing": fake_billing_section(sim), "prices": prices, "state": {"path": str(tmp_path / "s.db")}}
    daemon = unit_daemon(validate(document, {}), sim, clock)
    try:
        assert daemon.refresh("bills") and daemon.refresh("usage")  # noqa: PT018
        sim.add_usage(100, day)  # the rest of the 21st's requests
        sim.inject(Fault("status", "/api/v1/bills/details", status=403, times=10**6))
        frozen.set(dt.datetime(2026, 11, 22, 7, 0, tzinfo=SHANGHAI))
        assert not daemon.refresh("bills")
        assert daemon.refresh("usage")
        assert day in daemon.latest.settled  # read in full...
        gaps = named(metrics(daemon), "inference_reconciliation_token_gap_ratio")
        assert not [labels for labels in gaps if dict(labels)["day"] == day.isoformat()]  # ...and not judged
        sim.clear_faults()
        assert daemon.refresh("bills")
        gaps = named(metrics(daemon), "inference_reconciliation_token_gap_ratio")
        judged = [v for labels, v in gaps.items() if dict(labels)["day"] == day.isoformat()]
        assert judged
        assert set(judged) == {0.0}
    finally:
        daemon.stop()


def test_the_days_held_stay_held_when_the_pages_read_are_smaller_since_or_a_version_before_named_their_size(
    priced: Simulator, fake: FakeBilling, clock: Clock, store: StateStore
) -> None:
    """A service's page cap, shown since, makes the client read smaller pages (a reload's source is
    built on it): a whole day's sums are the same in any page size, so the days held, also those a
    version before saved naming the size they were read in, are not read again."""
    read_all(settled_usage(fake, clock, store), DAYS[0])
    fake.adopt_cap(fake.page_size // 3)
    before = served(priced)
    assert sorted(settled_usage(fake, clock, store).refresh(DAYS[0])) == DAYS
    with store.transaction() as db:  # as a version before named them
        db.execute("UPDATE settled_days SET account = replace(account, ';per_api_key=', ';page_size=500;per_api_key=')")
    assert sorted(settled_usage(fake, clock, store).refresh(DAYS[0])) == DAYS
    assert served(priced) == before
    # counted otherwise, they are read again
    other = SettledUsage(fake, clock, store, settle=SIX_HOURS, days_per_refresh=len(DAYS), per_api_key=True)
    assert sorted(other.refresh(DAYS[0])) == DAYS
    assert served(priced) != before


def test_a_day_whose_read_failed_waits_its_turn_across_a_reload(priced: Simulator, clock: Clock) -> None:
    """The reconciliation a reload builds in place of one whose read of a day failed takes on its
    wait: the day is not asked for again at once (the others go first meanwhile)."""
    store = StateStore(":memory:")
    document = {"billing": fake_billing_section(priced, history_months=0), "reconciliation": {"days_per_refresh": 1}}
    first = Sources(validate(document, {}), Latest(), clock, store, billing=InProcessBilling(priced))
    priced.inject(Fault("status", USAGES, status=400))
    assert first.one.settled.refresh(DAYS[0]) == {}
    document["budgets"] = [{"name": "month", "amount": "100"}]  # (billing unchanged)
    reloaded = Sources(validate(document, {}), first.latest, clock, store, previous=first,
                       billing=InProcessBilling(priced))  # fmt: skip
    assert sorted(reloaded.one.settled.refresh(DAYS[0])) == [DAYS[-2]]
