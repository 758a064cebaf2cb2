"""Past months of daily bills: fetched once a billing day, kept in the state file, never read as
zero spend when the API refuses a month or lists nothing for it. On the simulator's ledger in
process (tests/fakes.py), which answers an injected refusal as the server does."""

from __future__ import annotations

import datetime as dt
import logging
import signal
import threading
from decimal import Decimal
from pathlib import Path

import pytest
import yaml

from exporter.billing import (
    GROUP_TERM_INSTANCE,
    AskedToWait,
    BillingAPIError,
    BillingClient,
    BillingError,
    BillingUnavailable,
    BillRecord,
)
from exporter.cli import Terminated
from exporter.config.load import validate
from exporter.config.schema import BillingConfig
from exporter.core.clock import Clock, FrozenClock, periods_before, previous_period
from exporter.model.forecast import filled, forecast, month_forecast
from exporter.sim import Endpoint, Fault, Simulator, SpendModel
from exporter.sources.bills import BillsSource
from exporter.sources.history import HistorySource, _all, fetch_month
from exporter.state import StateError, StateStore
from tests.conftest import SHANGHAI
from tests.daemon_fakes import InProcessBilling, fake_billing_section, unit_daemon
from tests.fakes import FakeBilling
from tests.helpers import logged

BILLS = "/api/v1/bills/details"


@pytest.fixture
def modelled(sim: Simulator) -> Simulator:
    """Bills from 1 June 2026 on, with a weekly rhythm (the clock stands on 22 November)."""
    sim.spend = SpendModel(start=dt.date(2026, 6, 1))
    return sim


def served(sim: Simulator) -> int:
    return sim.requests_served.get(BILLS, 0)


def test_past_periods_cross_the_year() -> None:
    assert periods_before("2027-02", 3) == ["2026-11", "2026-12", "2027-01"]


def test_months_are_fetched_once_a_billing_day_and_kept_across_a_restart(
    modelled: Simulator, fake: FakeBilling, clock: Clock, store: StateStore, frozen: FrozenClock
) -> None:
    history = HistorySource(fake, clock, store, months=3).refresh()
    assert list(history.months) == ["2026-08", "2026-09", "2026-10"]
    for period, month in history.months.items():
        totals = modelled.bill_totals(period)
        by_item = sum(a.payable for a in month.by_item)
        assert by_item == sum(a.payable for a in month.by_endpoint) == totals["total"]
        for endpoint in modelled.endpoints:  # each endpoint's charges by item add up to its own
            split = month.items_by_endpoint[endpoint.endpoint_id]
            assert sum(a.payable for a in split) == totals[endpoint.endpoint_id]
    assert history.current is not None
    assert history.current.period == "2026-11"
    before = served(modelled)
    again = HistorySource(fake, clock, store, months=3).refresh()  # a restart the same day
    assert served(modelled) == before
    assert again == history

    day = dt.date(2026, 10, 9)
    endpoint = modelled.endpoints[0]
    modelled.revise_bill(day, endpoint.endpoint_id, "ITEM_PROMPT_TOKEN", Decimal("1234.56"))
    frozen.set(dt.datetime(2026, 11, 23, 0, 0, 5, tzinfo=SHANGHAI))  # the next billing day
    revised = HistorySource(fake, clock, store, months=3).refresh()
    endpoints = len(modelled.endpoints)
    assert served(modelled) == before + 4 * (2 + endpoints)  # each month and this one: both groupings, each endpoint
    assert revised.months["2026-10"].fetched == dt.date(2026, 11, 23)
    assert sum(a.payable for a in revised.months["2026-10"].by_item) == modelled.bill_totals("2026-10")["total"]


def test_a_month_the_api_refuses_is_skipped_never_zero(
    modelled: Simulator, fake: FakeBilling, clock: Clock, store: StateStore, frozen: FrozenClock,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    caplog.set_level(logging.WARNING)
    modelled.inject(Fault("status", BILLS, status=403))  # the first request: the oldest month's
    history = HistorySource(fake, clock, store, months=3).refresh()
    assert list(history.months) == ["2026-09", "2026-10"]
    assert history.item_days("2026-08") is None
    (skipped,) = logged(caplog.records, "history month skipped", period="2026-08")
    assert skipped.fields["kept"] == "nothing"  # type: ignore[attr-defined]

    kept = history.months["2026-10"]
    modelled.inject(Fault("status", BILLS, status=403, times=100))
    frozen.set(dt.datetime(2026, 11, 23, 9, 0, tzinfo=SHANGHAI))  # the next day: every month is due again
    with pytest.raises(BillingError):  # every month tried failed: the refresh fails, honestly
        HistorySource(fake, clock, store, months=3).refresh()
    assert {row[0]: row[4] for row in store.load_history()}["2026-10"] == "2026-11-22"  # the copy was kept
    modelled.clear_faults()
    assert HistorySource(fake, clock, store, months=3).refresh().months["2026-10"].by_item == kept.by_item


def test_a_month_before_the_account_opened_is_absent(
    sim: Simulator, fake: FakeBilling, clock: Clock, store: StateStore, caplog: pytest.LogCaptureFixture
) -> None:
    sim.spend = SpendModel(start=dt.date(2026, 10, 1))
    caplog.set_level(logging.WARNING)
    history = HistorySource(fake, clock, store, months=3).refresh()
    assert list(history.months) == ["2026-10"]
    assert {
        r.fields["period"] for r in logged(caplog.records, "history month skipped: the API listed no bills for it")
    } == {  # type: ignore[attr-defined]
        "2026-08",
        "2026-09",
    }


def test_the_month_start_forecast_reads_the_days_before_it_from_the_history(
    modelled: Simulator, fake: FakeBilling, clock: Clock, store: StateStore, frozen: FrozenClock
) -> None:
    frozen.set(dt.datetime(2026, 11, 3, 12, 0, tzinfo=SHANGHAI))  # past the grace days (0 here)
    history = HistorySource(fake, clock, store, months=2).refresh()
    alone = BillsSource(fake, clock, grace_days=0).refresh().current
    with_history = BillsSource(fake, clock, grace_days=0, history=lambda: history).refresh().current
    days = {a.day: Decimal(0) for a in with_history.by_item}
    for a in with_history.by_item:
        days[a.day] += a.payable
    october = history.item_days(previous_period("2026-11"))
    assert october is not None
    # With it, the forecast learns the account's weekly rhythm and level from the months held.
    held = {d: a for p in sorted(history.months) for d, a in filled(p, history.item_days(p) or {}).items()}
    assert max(held) == dt.date(2026, 10, 31)
    expected = month_forecast("2026-11", clock.today(), days, held)
    assert (with_history.forecast, with_history.lower, with_history.upper) == (
        expected.point,
        expected.lower,
        expected.upper,
    )
    assert with_history.today_forecast == days[clock.today()] + expected.daily[clock.today()]
    # without it, the two complete days of November stand for the week: a weekend-heavy guess
    assert alone.forecast == forecast("2026-11", clock.today(), days, None)[0] != with_history.forecast


def test_a_month_listing_nothing_is_asked_once_a_day_and_a_refused_one_an_hour_later(
    sim: Simulator, fake: FakeBilling, clock: Clock, store: StateStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from exporter.sources import history as module

    sim.spend = SpendModel(start=dt.date(2026, 10, 1))  # August and September list nothing
    source = HistorySource(fake, clock, store, months=3)
    source.refresh()
    before = served(sim)
    source.refresh()
    assert served(sim) == before  # the empty months are not asked again today

    sim.inject(Fault("status", BILLS, status=403))
    source._empty.clear()  # (as on the next day)
    source.refresh()  # August refused
    asked = served(sim)
    source.refresh()
    assert served(sim) == asked  # not again within the hour...
    monkeypatch.setattr(module, "RETRY_AFTER", 0.0)
    source._retry_at.clear()
    source.refresh()
    assert served(sim) > asked  # ...but after it


def test_a_state_file_that_refuses_the_history_still_has_it_used(
    modelled: Simulator, fake: FakeBilling, clock: Clock, store: StateStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from exporter.state import StateError

    def refuse(*args: object, **kwargs: object) -> None:
        raise StateError(store.path, "attempt to write a readonly database")

    monkeypatch.setattr(store, "save_history", refuse)
    history = HistorySource(fake, clock, store, months=2).refresh()
    assert list(history.months) == ["2026-09", "2026-10"]
    assert history.as_of == clock.today()


def test_the_state_file_is_read_once_then_the_months_are_kept_in_memory(
    modelled: Simulator, fake: FakeBilling, clock: Clock, store: StateStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    loads = []
    load = store.load_history
    monkeypatch.setattr(store, "load_history", lambda: loads.append(1) or load())
    source = HistorySource(fake, clock, store, months=2)
    first = source.refresh()
    assert source.refresh() == first  # every ten minutes: nothing fetched, nothing read
    assert loads == [1]


@pytest.mark.integration  # over HTTP: requests in flight at once
@pytest.mark.parametrize("wide", [True, False], ids=["wide", "narrow"])
def test_a_month_is_fetched_with_the_clients_requests_in_flight_once_allowed(
    modelled: Simulator, small_pages: BillingClient, clock: Clock, store: StateStore, wide: bool
) -> None:
    """Once bills and usage have their first figures (`wide`), a month's requests go out as many at
    once as the client keeps in flight (3 here); before, one at a time (every listing here is one
    page long). The months are the same."""
    modelled.endpoints = tuple(Endpoint(f"ep-{n}", "model-a", "proj-main") for n in range(3))
    modelled.latency = 0.2  # (requests made at once overlap, however busy the machine)
    history = HistorySource(small_pages, clock, store, months=2, wide=lambda: wide).refresh()
    if wide:
        assert 2 <= modelled.max_in_flight <= small_pages.concurrency
    else:
        assert modelled.max_in_flight == 1
    modelled.latency = 0.0
    again = HistorySource(FakeBilling(modelled), clock, StateStore(":memory:"), months=2).refresh()
    assert history.months == again.months
    assert history.current is not None
    assert again.current is not None
    assert history.current.items_by_endpoint == again.current.items_by_endpoint


def test_months_that_all_fail_together_are_asked_again_at_the_next_check(
    modelled: Simulator, fake: FakeBilling, clock: Clock, store: StateStore
) -> None:
    """Every month failing at once is an outage, not months refused on their own: none is held
    back for the hour, so the next check (ten minutes later) fetches them all."""
    modelled.inject(Fault("status", BILLS, status=403, times=1000))
    source = HistorySource(fake, clock, store, months=3)
    with pytest.raises(BillingError):
        source.refresh()
    modelled.clear_faults()
    history = source.refresh()
    assert list(history.months) == ["2026-08", "2026-09", "2026-10"]


def test_months_a_retry_after_cut_off_mid_fetch_are_asked_again_at_the_next_check(
    modelled: Simulator, fake: FakeBilling, clock: Clock, store: StateStore
) -> None:
    """August fetched, then the API asks to wait (a 429's Retry-After): the months after it fail
    without being asked. They are not refused, so not held back the hour: the next check, once the
    wait is over, fetches them."""

    class WaitingAfterAugust:
        concurrency = 1
        base_url, project_id = fake.base_url, fake.project_id
        waiting = True

        def bills(self, period: str, group_term: str, instance_id: str = "") -> object:
            if period != "2026-08" and self.waiting:
                raise AskedToWait("the API asked not to be asked again for 150s more (Retry-After)")
            return fake.bills(period, group_term, instance_id)

    client = WaitingAfterAugust()
    source = HistorySource(client, clock, store, months=3)  # type: ignore[arg-type]
    assert list(source.refresh().months) == ["2026-08"]
    assert source.behind == ["2026-09", "2026-10", "2026-11"]
    client.waiting = False  # ten minutes on, the wait over
    history = source.refresh()
    assert list(history.months) == ["2026-08", "2026-09", "2026-10"]
    assert history.current is not None
    assert source.behind == []


def test_a_month_failing_every_retry_on_its_own_is_held_back_the_hour(
    modelled: Simulator, fake: FakeBilling, clock: Clock, store: StateStore
) -> None:
    """September answered with a 503 at every retry while the other months are fetched: a month
    failing on its own, not asked again (with every retry) at each 10-minute check."""

    class FailingSeptember:
        concurrency = 1
        base_url, project_id = fake.base_url, fake.project_id
        asked = 0

        def bills(self, period: str, group_term: str, instance_id: str = "") -> object:
            if period == "2026-09":
                self.asked += 1
                raise BillingUnavailable("bills 2026-09: HTTP 503 (gave up after 4 attempts)")
            return fake.bills(period, group_term, instance_id)

    client = FailingSeptember()
    source = HistorySource(client, clock, store, months=3)  # type: ignore[arg-type]
    assert list(source.refresh().months) == ["2026-08", "2026-10"]
    asked = client.asked
    source.refresh()  # the next check, within the hour
    assert client.asked == asked
    assert source.behind == ["2026-09"]


def test_a_month_refused_alone_is_held_back_the_hour_even_when_it_is_the_only_one_due(
    modelled: Simulator, fake: FakeBilling, clock: Clock, store: StateStore
) -> None:
    """August refused while the other months are fetched; an hour on, when it is the only month
    due, it is still a month refused, not an outage: not asked again every check."""

    class RefusingAugust:
        concurrency = 1
        base_url, project_id = fake.base_url, fake.project_id

        def __init__(self) -> None:
            self.asked = 0

        def bills(self, period: str, group_term: str, instance_id: str = "") -> object:
            if period == "2026-08":
                self.asked += 1
                raise BillingAPIError("refused", status=403, code=100403, message="refused")
            return fake.bills(period, group_term, instance_id)

    client = RefusingAugust()
    source = HistorySource(client, clock, store, months=3)  # type: ignore[arg-type]
    assert list(source.refresh().months) == ["2026-09", "2026-10"]
    assert source.behind == ["2026-08"]  # the history is incomplete: the refresh says so (the account's)
    source._retry_at.clear()  # (an hour later)
    with pytest.raises(BillingError):
        source.refresh()  # August alone, refused again
    asked = client.asked
    source.refresh()  # ten minutes later: not asked
    assert client.asked == asked
    assert source.behind == ["2026-08"]  # still missing, though nothing was due


class RefusingAugust(FakeBilling):
    """The fake's answers, August's bills refused (a 403); `asked`: the refused askings."""

    def __init__(self, sim: Simulator) -> None:
        super().__init__(sim)
        self.asked: list[str] = []

    def bills(self, period: str, group_term: str, instance_id: str = "") -> list[BillRecord]:
        if period == "2026-08":
            self.asked.append(period)
            raise BillingAPIError("refused", status=403, code=100403, message="forbidden")
        return super().bills(period, group_term, instance_id)


class RefusingAugustBilling(InProcessBilling):
    """The daemon's billing factory, its clients `RefusingAugust`."""

    built: list[RefusingAugust]  # type: ignore[assignment]

    def __call__(self, config: BillingConfig) -> RefusingAugust:
        self.built.append(client := RefusingAugust(self.sim))
        return client


def test_a_history_with_a_month_missing_is_used_and_its_refresh_fails(
    modelled: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    """August refused all day: the months fetched are used (the forecast and the anomalies learn
    from them), and the history's freshness says it is incomplete at every check, not only when
    August is asked again."""
    factory = RefusingAugustBilling(modelled)
    document = {"billing": fake_billing_section(modelled), "state": {"path": str(tmp_path / "state.db")}}
    daemon = unit_daemon(validate(document, {}), modelled, clock, billing=factory)
    try:
        for _ in range(3):  # the first look, then two more within the hour (August not asked again)
            assert not daemon.refresh("history")
            assert daemon.latest.history is not None
            assert sorted(daemon.latest.history.months) == ["2026-09", "2026-10"]
            assert daemon.latest.health["history"].success is False
            frozen.advance(dt.timedelta(minutes=10))
        assert [period for client in factory.built for period in client.asked] == ["2026-08"]  # held the hour
        # What `once` and `digest` run: the rest goes on, the history said incomplete.
        daemon.sources.one.refresh_once(("bills", "history", "usage"))
        assert daemon.latest.health["history"].success is False
        assert daemon.latest.health["usage"].success is True
    finally:
        daemon.stop()


def test_a_reload_that_no_longer_keeps_the_missing_month_says_the_history_is_whole_at_once(
    modelled: Simulator, clock: Clock, tmp_path: Path
) -> None:
    """August refused, the history said incomplete; a reload to one month (October) keeps it no
    longer: the history runs again at once, asks nothing, and is whole."""

    def document(months: int) -> dict:
        billing = fake_billing_section(modelled, history_months=months)
        return {"billing": billing, "state": {"path": str(tmp_path / "state.db")}}

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(document(3)))
    daemon = unit_daemon(
        validate(document(3), {}), modelled, clock, config_path=path, billing=RefusingAugustBilling(modelled)
    )
    try:
        assert not daemon.refresh("history")
        path.write_text(yaml.safe_dump(document(1)))
        old = daemon.sources
        assert daemon.reload()
        assert "history" in daemon.sources.changed(old)  # run again at once
        asked = dict(modelled.requests_served)
        assert daemon.refresh("history")
        assert modelled.requests_served == asked
        assert daemon.latest.health["history"].success
        assert daemon.latest.history is not None
        assert list(daemon.latest.history.months) == ["2026-10"]
    finally:
        daemon.stop()


def test_months_held_for_another_project_are_fetched_again_never_learnt_from(
    modelled: Simulator, fake: FakeBilling, clock: Clock, store: StateStore
) -> None:
    """The same day, with `billing.project_id` changed (a reload, or a restart): the months the state
    file holds are the whole tenant's, and are fetched again for the project, not kept as fetched today."""
    tenant = HistorySource(fake, clock, store, months=3).refresh()
    lab = FakeBilling(modelled, project_id="proj-lab")
    before = served(modelled)
    project = HistorySource(lab, clock, store, months=3).refresh()
    assert served(modelled) > before  # asked again
    lab_endpoints = {e.endpoint_id for e in modelled.endpoints if e.project_id == "proj-lab"}
    for period, month in project.months.items():
        assert {a.key for a in month.by_endpoint} == lab_endpoints
        assert sum(a.payable for a in month.by_item) < sum(a.payable for a in tenant.months[period].by_item)
    again = served(modelled)
    HistorySource(lab, clock, store, months=3).refresh()  # a restart, the same project: held, not asked
    assert served(modelled) == again


def test_a_state_file_that_refuses_to_forget_another_source_s_months_holds_back_nothing(
    modelled: Simulator, fake: FakeBilling, clock: Clock, store: StateStore, caplog: pytest.LogCaptureFixture
) -> None:
    HistorySource(fake, clock, store, months=3).refresh()
    lab = FakeBilling(modelled, project_id="proj-lab")

    def refused(source: str, *, keep: bool = False) -> None:
        raise StateError("state.db", "the state file refused the write (disk full)")

    store.forget_history = refused  # type: ignore[method-assign]  # (a full disk, as the state file says it)
    project = HistorySource(lab, clock, store, months=3).refresh()
    lab_endpoints = {e.endpoint_id for e in modelled.endpoints if e.project_id == "proj-lab"}
    assert {a.key for a in project.months["2026-10"].by_endpoint} == lab_endpoints
    assert logged(caplog.records, "history of another source not forgotten in the state file")


def test_months_an_earlier_version_saved_without_their_source_are_kept(
    modelled: Simulator, fake: FakeBilling, clock: Clock, store: StateStore
) -> None:
    HistorySource(fake, clock, store, months=3).refresh()
    with store.transaction() as db:  # as a version that did not say where its months came from left it
        db.execute("DELETE FROM meta WHERE key = 'history_source'")
    before = served(modelled)
    assert list(HistorySource(fake, clock, store, months=3).refresh().months) == ["2026-08", "2026-09", "2026-10"]
    assert served(modelled) == before  # taken as this config's: not asked again


def test_a_reload_to_another_project_never_leaves_the_months_of_the_one_before(
    modelled: Simulator, clock: Clock, tmp_path: Path
) -> None:
    """A reload that changes `billing.project_id`, whose history then cannot be fetched: the months
    held before (the whole tenant's) are not left published, to be learnt from as the project's."""

    class Factory(InProcessBilling):
        def __call__(self, config: BillingConfig) -> FakeBilling:
            client = FakeBilling(self.sim, project_id=config.project_id)
            if config.project_id:  # (the project's history is refused)
                client.bills = lambda *args, **kwargs: (_ for _ in ()).throw(  # type: ignore[method-assign]
                    BillingAPIError("refused", status=403, code=100403, message="forbidden")
                )
            self.built.append(client)
            return client

    path = tmp_path / "config.yaml"
    document = {"billing": fake_billing_section(modelled), "state": {"path": str(tmp_path / "state.db")}}
    path.write_text(yaml.safe_dump(document))
    daemon = unit_daemon(validate(document, {}), modelled, clock, config_path=path, billing=Factory(modelled))
    try:
        assert daemon.refresh("history")
        assert daemon.latest.history is not None
        document["billing"] = document["billing"] | {"project_id": "proj-lab"}
        path.write_text(yaml.safe_dump(document))
        daemon.reload()
        assert not daemon.refresh("history")
        assert daemon.latest.history is None
    finally:
        daemon.stop()


class Listed:
    """A billing API listing the same lines for every month: `instances` by endpoint, `items` by item
    for the account, `of` each endpoint's by item (as the API answers, an empty `instance_id` lists
    the account's)."""

    base_url, project_id, page_size, concurrency = "https://billing.example", "", 100, 1

    def __init__(self, instances: list[BillRecord], items: list[BillRecord], of: dict[str, list[BillRecord]]) -> None:
        self.instances, self.items, self.of = instances, items, of

    def bills(self, period: str, group_term: str, instance_id: str = "") -> list[BillRecord]:
        if group_term == GROUP_TERM_INSTANCE:
            return self.instances
        return self.of[instance_id] if instance_id else self.items


def test_the_charges_of_no_endpoint_are_the_account_s_less_every_endpoint_s_each_under_its_product() -> None:
    """Two lines of no endpoint on a day, of two products and projects; an endpoint's own listing
    labels its lines with another project than the account's listing: each item of no endpoint
    keeps its product, and no project (two are named that day)."""
    day, money = dt.date(2026, 10, 7), Decimal

    def line(instance: str, item: str, product: str, project: str, amount: str) -> BillRecord:
        return BillRecord("2026-10", day, instance, item, product, project, money(amount), money(0))

    api = Listed(
        instances=[line("", "", "PRODUCT_FINE_TUNING", "proj-a", "3"), line("", "", "PRODUCT_STORAGE", "proj-b", "2"),
                   line("ep-1", "", "PRODUCT_INFERENCE", "proj-main", "10")],
        items=[line("", "ITEM_TRAINING", "PRODUCT_FINE_TUNING", "proj-a", "3"),
               line("", "ITEM_STORAGE", "PRODUCT_STORAGE", "proj-b", "2"),
               line("", "ITEM_PROMPT", "PRODUCT_INFERENCE", "proj-main", "10")],
        of={"ep-1": [line("ep-1", "ITEM_PROMPT", "PRODUCT_INFERENCE", "proj-other", "10")]},
    )  # fmt: skip
    month = fetch_month(api, "2026-10", dt.date(2026, 11, 22))
    assert month is not None
    assert [(a.key, a.product, a.project_id, a.payable) for a in month.items_by_endpoint[""]] == [
        ("ITEM_STORAGE", "PRODUCT_STORAGE", "", money(2)),
        ("ITEM_TRAINING", "PRODUCT_FINE_TUNING", "", money(3)),
    ]


@pytest.mark.parametrize("stop_with", [KeyboardInterrupt, Terminated])
def test_a_command_stopped_while_months_are_fetched_does_not_wait_for_those_running(
    stop_with: type[BaseException],
) -> None:
    """Ctrl-C or SIGTERM (turned into an exception in the main thread) while months are fetched in
    parallel: it reaches the command at once, whose close then cuts the requests still running,
    instead of waiting here for them (each retrying a hung API for minutes)."""
    release = threading.Event()
    finished: list[int] = []

    def hung() -> int:
        release.wait(10)
        finished.append(1)
        return 1

    def stop(signum: int, frame: object) -> None:
        raise stop_with

    previous = signal.signal(signal.SIGALRM, stop)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(stop_with):
            _all([hung, hung, hung], 2)
        assert finished == []  # (not waited for)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        release.set()


def test_a_month_saved_before_it_ended_is_not_published_while_its_fetch_fails(
    modelled: Simulator, frozen: FrozenClock, clock: Clock, store: StateStore
) -> None:
    """Read on 12 October (October saved as it stood then), next on 6 November with October refused:
    the history published holds August and September, not October's first 12 days as its month
    (its other days would read as nothing spent, in the forecast and the anomaly rules)."""
    frozen.set(dt.datetime(2026, 10, 12, 10, 0, tzinfo=SHANGHAI))
    fake = FakeBilling(modelled, clock=clock)
    assert sorted(HistorySource(fake, clock, store, months=3).refresh().months) == ["2026-07", "2026-08", "2026-09"]
    frozen.set(dt.datetime(2026, 11, 6, 10, 0, tzinfo=SHANGHAI))

    class RefusingOctober:
        concurrency = 1
        base_url, project_id = fake.base_url, fake.project_id

        def bills(self, period: str, group_term: str, instance_id: str = "") -> object:
            if period == "2026-10":
                raise BillingUnavailable("bills 2026-10: HTTP 503 (gave up after 4 attempts)")
            return fake.bills(period, group_term, instance_id)

    source = HistorySource(RefusingOctober(), clock, store, months=3)  # type: ignore[arg-type]
    assert source.held() is not None
    assert "2026-10" not in source.held().months  # type: ignore[union-attr]
    assert sorted(source.refresh().months) == ["2026-08", "2026-09"]
    assert source.behind == ["2026-10"]
