"""The billing client against the simulator: paging, concurrency, retries, errors, parsing."""

from __future__ import annotations

import datetime as dt
import email.utils
import re
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from exporter.app.daemon import Daemon
from exporter.billing import (
    GROUP_TERM_INSTANCE,
    GROUP_TERM_ITEM,
    AskedToWait,
    BillingAPIError,
    BillingClient,
    BillingError,
    BillingUnavailable,
    BillRecord,
    ClientClosed,
    RecordError,
    RetryPolicy,
    SignatureRejected,
    api,
    parse_bill,
    parse_usage,
)
from exporter.billing.client import _retry_after
from exporter.billing.signing import BillingSigner
from exporter.config.load import validate
from exporter.config.schema import Config
from exporter.core.clock import Clock, FrozenClock
from exporter.sim import Endpoint, Fault, Simulator, SimulatorServer
from tests.conftest import SHANGHAI, Sleeps, billing_section
from tests.helpers import DripReceiver, LoopbackServer, wait_for


def test_bills_fetch_every_page_and_sum_exactly(sim: Simulator, client: BillingClient) -> None:
    sim.endpoints = tuple(Endpoint(f"ep-{n:02d}", "model-a", "proj-main") for n in range(10))
    records = client.bills("2026-11", GROUP_TERM_INSTANCE)
    assert len(records) == 22 * 10  # three pages of 100
    assert sim.requests_served["/api/v1/bills/details"] == 4  # and page 1 again: the list held still
    totals = sim.bill_totals("2026-11")
    for endpoint in sim.endpoints:
        got = sum(r.payable_amount for r in records if r.instance_id == endpoint.endpoint_id)
        assert got == totals[endpoint.endpoint_id]
    items = client.bills("2026-11", GROUP_TERM_ITEM)
    assert sum(r.payable_amount for r in items) == totals["total"]
    assert all(isinstance(r.payable_amount, Decimal) for r in items)
    assert {r.day.isoformat() for r in items} == {f"2026-11-{d:02d}" for d in range(1, 23)}


def test_bills_that_change_while_they_are_read_are_read_again(sim: Simulator, client: BillingClient) -> None:
    """A new endpoint's first bills arrive between page 1 and page 2: a row in every day, so the rows
    after it move a page on, and page 2 repeats rows page 1 had while others are never read, all
    adding up to the new `total`. The read sees the list moved and reads it again."""
    sim.endpoints = tuple(Endpoint(f"ep-{n:02d}", "model-a", "proj-main") for n in range(6))  # 132 rows: 2 pages
    new = Endpoint("ep-new", "model-a", "proj-main")

    def arrives(page_num: int) -> None:
        if page_num == 2 and new not in sim.endpoints:
            sim.endpoints = (new, *sim.endpoints)

    sim.before_bills_page = arrives
    records = client.bills("2026-11", GROUP_TERM_INSTANCE)
    assert len(records) == len(set(records)) == 22 * 7
    totals = sim.bill_totals("2026-11")
    for endpoint in sim.endpoints:
        assert (
            sum(r.payable_amount for r in records if r.instance_id == endpoint.endpoint_id)
            == totals[endpoint.endpoint_id]
        )


def test_an_amount_revised_while_the_bills_are_read_moves_no_row(sim: Simulator, client: BillingClient) -> None:
    """The API revising a past day's amount between pages: no row moved, so nothing is read again."""
    sim.endpoints = tuple(Endpoint(f"ep-{n:02d}", "model-a", "proj-main") for n in range(10))

    def revise(page_num: int) -> None:
        if page_num == 2:
            sim.revise_bill(dt.date(2026, 11, 1), "ep-00", "ITEM_PROMPT_TOKEN", Decimal("123.45"))

    sim.before_bills_page = revise
    assert len(client.bills("2026-11", GROUP_TERM_INSTANCE)) == 22 * 10
    assert sim.requests_served["/api/v1/bills/details"] == 4  # three pages, and page 1 again


def test_bills_that_never_hold_still_fail_the_read(sim: Simulator, client: BillingClient) -> None:
    sim.endpoints = tuple(Endpoint(f"ep-{n:02d}", "model-a", "proj-main") for n in range(6))

    def another(page_num: int) -> None:
        if page_num == 2:
            sim.endpoints = (Endpoint(f"ep-new-{len(sim.endpoints)}", "model-a", "proj-main"), *sim.endpoints)

    sim.before_bills_page = another
    with pytest.raises(RecordError, match="the list changed while it was read, 3 times running"):
        client.bills("2026-11", GROUP_TERM_INSTANCE)


def test_usage_pages_until_a_short_page(sim: Simulator, client: BillingClient) -> None:
    sim.add_usage(1234)
    pages = sorted(client.usage_pages(sim.clock.today()), key=lambda p: p.page_num)  # they come as they arrive
    assert [p.page_num for p in pages] == [1, 2, 3]
    assert [len(p.records) for p in pages] == [500, 500, 234]
    assert {p.total for p in pages} == {1234}
    assert len({r.request_id for p in pages for r in p.records}) == 1234


def test_pages_are_parsed_by_their_reader_and_the_page_threads_only_fetch(
    sim: Simulator, client: BillingClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page thread goes straight on to its next request once it has an answer: the records are
    made in the thread that reads the pages (and counts them), every page of the day's list read."""
    sim.add_usage(2345)
    decoded_in: list[int] = []
    decode = api.decode_usage_page

    def recorded(body: bytes) -> object:
        decoded_in.append(threading.get_ident())
        return decode(body)

    monkeypatch.setattr(api, "decode_usage_page", recorded)
    pages = list(client.usage_pages(sim.clock.today()))
    assert sorted(p.page_num for p in pages) == [1, 2, 3, 4, 5]
    assert sum(len(p.records) for p in pages) == 2345
    assert decoded_in == [threading.get_ident()] * 5


def test_bill_pages_are_parsed_by_their_reader_too(
    sim: Simulator, client: BillingClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each bill is made once, in the thread that reads the pages (page 1 read again at the end is
    read again: its 100 bills twice)."""
    sim.endpoints = tuple(Endpoint(f"ep-{n:02d}", "model-a", "proj-main") for n in range(10))
    parsed_in: list[int] = []
    parse = api.parse_bill

    def recorded(*args: Any) -> BillRecord:
        parsed_in.append(threading.get_ident())
        return parse(*args)

    monkeypatch.setattr(api, "parse_bill", recorded)
    assert len(client.bills("2026-11", GROUP_TERM_INSTANCE)) == 22 * 10  # three pages of 100
    assert parsed_in == [threading.get_ident()] * (22 * 10 + 100)


def test_usage_with_an_exact_multiple_stops_when_total_is_reached(sim: Simulator, client: BillingClient) -> None:
    sim.add_usage(1000)
    pages = list(client.usage_pages(sim.clock.today()))
    assert [len(p.records) for p in pages] == [500, 500]


def test_usage_pages_go_on_while_records_arrive(sim: Simulator, client: BillingClient) -> None:
    sim.add_usage(1000)
    pages = client.usage_pages(sim.clock.today())
    first = next(pages)
    sim.add_usage(700)  # arrives after the first page told total=1000
    rest = list(pages)
    assert first.total == 1000
    assert [len(p.records) for p in [first, *rest]] == [500, 500, 500, 200]
    assert rest[-1].total == 1700


def test_pages_in_flight_are_bounded_by_concurrency(
    sim: Simulator, server: SimulatorServer, clock: Clock, sleeps: Sleeps
) -> None:
    sim.add_usage(5000)
    sim.latency = 0.05
    config = validate({"billing": billing_section(sim, server, concurrency=3, page_size=100)}, {})
    with BillingClient.from_config(config.billing, clock, retry=RetryPolicy(sleep=sleeps)) as client:
        records = sum(len(p.records) for p in client.usage_pages(clock.today()))
    assert records == 5000
    assert sim.max_in_flight == 3


def test_no_more_threads_fetch_pages_than_requests_may_be_in_flight(
    sim: Simulator, server: SimulatorServer, clock: Clock
) -> None:
    """Threads beyond the slots only waited for one, at a cost in CPU for every page."""
    sim.add_usage(5000)
    sim.latency = 0.01
    config = validate({"billing": billing_section(sim, server, concurrency=3, page_size=100)}, {})
    with BillingClient.from_config(config.billing, clock) as client:
        records = sum(len(p.records) for p in client.usage_pages(clock.today()))
        fetching = list(client._pool._threads)
    assert records == 5000
    assert 1 <= len(fetching) <= 3, fetching


def test_a_page_waiting_out_its_backoff_holds_no_other_page_up(
    sim: Simulator, server: SimulatorServer, clock: Clock
) -> None:
    """One request at a time. Page 2 fails and waits before its retry; the pages after it are
    fetched meanwhile (the wait ends only when they have been, or after 10 s)."""
    sim.add_usage(2500)
    answered: list[int] = []
    others = threading.Event()

    def failing_after_the_first(page_num: int) -> None:
        answered.append(page_num)
        if page_num == 1:
            sim.inject(Fault("status", path="/", status=503))  # (page 2 is the next request)
        if {3, 4, 5} <= set(answered):
            others.set()

    waited: list[bool] = []
    sim.before_usage_page = failing_after_the_first
    config = validate({"billing": billing_section(sim, server, concurrency=1)}, {})
    with BillingClient.from_config(
        config.billing, clock, retry=RetryPolicy(sleep=lambda s: waited.append(others.wait(10)))
    ) as client:
        pages = {p.page_num: len(p.records) for p in client.usage_pages(clock.today())}
    assert pages == {1: 500, 2: 500, 3: 500, 4: 500, 5: 500}
    assert waited == [True]
    assert answered.index(2) > answered.index(5)


def test_a_request_that_waited_for_a_slot_is_signed_again_when_the_time_moved(
    sim: Simulator, server: SimulatorServer, frozen: FrozenClock, clock: Clock
) -> None:
    """Pages 2 and 3 are signed at once; one waits for the one slot while the other is answered,
    and meanwhile the time moves past the first signature's expiry."""
    sim.add_usage(1500)
    answered: list[int] = []

    def time_moves_at_the_first_of_the_rest(page_num: int) -> None:
        answered.append(page_num)
        if len(answered) == 2:
            frozen.advance(dt.timedelta(seconds=30))

    sim.before_usage_page = time_moves_at_the_first_of_the_rest
    section = billing_section(sim, server, concurrency=1, page_size=500, signature_lifetime="10s")
    config = validate({"billing": section}, {})
    with BillingClient.from_config(config.billing, clock) as client:
        pages = list(client.usage_pages(clock.today()))
    assert sorted(p.page_num for p in pages) == [1, 2, 3]
    assert sum(len(p.records) for p in pages) == 1500


def test_a_request_waiting_for_a_slot_is_not_sent_once_the_client_is_closed(
    sim: Simulator, server: SimulatorServer, clock: Clock
) -> None:
    """Pages 2 and 3 through one slot; the client is closed while the first of them is answered."""
    sim.add_usage(1500)
    config = validate({"billing": billing_section(sim, server, concurrency=1)}, {})
    client = BillingClient.from_config(config.billing, clock)
    answered: list[int] = []

    def close_at_the_first_of_the_rest(page_num: int) -> None:
        answered.append(page_num)
        if len(answered) == 2:
            client.close()

    sim.before_usage_page = close_at_the_first_of_the_rest
    try:
        with pytest.raises(ClientClosed):
            list(client.usage_pages(clock.today()))
        client._pool.shutdown(wait=True)  # (the page that was waiting has taken the slot, and stopped)
    finally:
        client.close()
    assert len(answered) == 2


@pytest.mark.parametrize("slots", [1, 2])
def test_requests_signed_before_a_clock_correction_are_signed_again_with_it(
    sim: Simulator, server: SimulatorServer, slots: int
) -> None:
    """Two listings at once, our clock 10 minutes fast. Through one slot: the first is refused and
    corrects the clock, and the second, signed while it waited, goes out signed with the correction.
    Through two: both are refused, and the one that finds the clock corrected by the other tries
    again with it."""
    skewed = Clock(SHANGHAI, lambda: sim.clock.now() + dt.timedelta(minutes=10))
    config = validate({"billing": billing_section(sim, server, concurrency=slots)}, {})
    seen: list[tuple[str, str]] = []
    client = BillingClient.from_config(config.billing, skewed, lambda *call: seen.append(call))
    with client, ThreadPoolExecutor(2) as pool:
        listings = [pool.submit(client.bills, "2026-11", GROUP_TERM_ITEM) for _ in range(2)]
        assert [len(listing.result()) for listing in listings] == [66, 66]
    assert seen.count(("bills", "200")) == 2
    if slots == 1:  # (the clock corrected before the slot went to the request waiting for it)
        assert seen.count(("bills", "401")) == 1


def test_retries_5xx_and_dropped_connections_then_succeeds(
    sim: Simulator, client: BillingClient, sleeps: Sleeps
) -> None:
    sim.inject(Fault("status", status=503, times=1))
    sim.inject(Fault("drop", times=1))
    records = client.bills("2026-11", GROUP_TERM_ITEM)
    assert len(records) == 22 * 3
    assert len(sleeps) == 2
    assert all(0 < pause <= 1.0 for pause in sleeps)  # jittered exponential backoff from 0.5 s


def test_a_body_that_stops_coming_is_reported_a_timeout_and_retried(
    sim: Simulator, server: SimulatorServer, clock: Clock, sleeps: Sleeps
) -> None:
    sim.inject(Fault("slow_body", seconds=3))
    config = validate({"billing": billing_section(sim, server, timeout="1s")}, {})
    seen: list[tuple[str, str]] = []
    client = BillingClient.from_config(
        config.billing, clock, lambda *call: seen.append(call), RetryPolicy(sleep=sleeps)
    )
    with client:
        assert len(client.bills("2026-11", GROUP_TERM_ITEM)) == 66
    assert seen == [("bills", "timeout"), ("bills", "200")]
    assert len(sleeps) == 1


def read_in_background(client: BillingClient) -> tuple[threading.Thread, list[BillingError]]:
    """A listing of the month's bills read on a thread of its own, started; and the error it ends in."""
    ended: list[BillingError] = []

    def read() -> None:
        try:
            client.bills("2026-11", GROUP_TERM_ITEM)
        except BillingError as error:
            ended.append(error)

    reading = threading.Thread(target=read, daemon=True)
    reading.start()
    return reading, ended


def test_an_answer_dripped_a_byte_at_a_time_is_cut_at_the_timeout_and_retried(clock: Clock, sleeps: Sleeps) -> None:
    """A proxy that sends the headers, then a byte of the body every 0.2 s: each read comes within
    the 1 s timeout, yet the request is cut as its second passes (a timeout) and the listing fails
    after its attempts, instead of being read for ever."""
    drip = DripReceiver(interval=0.2)
    section = {"url": f"http://127.0.0.1:{drip.port}", "access_key_id": "AK", "secret_access_key": "s", "timeout": "1s"}
    seen: list[tuple[str, str]] = []
    client = BillingClient.from_config(
        validate({"billing": section}, {}).billing, clock, lambda *call: seen.append(call), RetryPolicy(sleep=sleeps)
    )
    reading, failed = read_in_background(client)
    try:
        reading.join(timeout=60)  # (4 attempts of a second each; without a cut, never)
        assert not reading.is_alive(), "the dripped answer was still being read"
    finally:
        client.close()
        drip.stop()
    assert isinstance(failed[0], BillingUnavailable)
    assert "timed out (gave up after 4 attempts)" in str(failed[0])
    assert seen == [("bills", "timeout")] * 4
    assert drip.connections == 4


def test_closing_the_client_cuts_a_request_on_the_wire(clock: Clock) -> None:
    """An API that takes the request and never answers, with the default 30 s timeout: `close` (a
    reload, a stop) ends the listing with ClientClosed, and hangs up the request, whose thread a
    process stopping waits for, at once rather than once the timeout has passed."""
    silent = Silent()
    section = {"url": f"http://127.0.0.1:{silent.port}", "access_key_id": "AK", "secret_access_key": "s"}
    seen: list[tuple[str, str]] = []
    client = BillingClient.from_config(validate({"billing": section}, {}).billing, clock, lambda *c: seen.append(c))
    reading, ended = read_in_background(client)
    try:
        wait_for(lambda: silent.requests == 1, timeout=10)
        client.close()
        reading.join(timeout=15)
        # (half the timeout: a request left on the wire would hang up only once it had passed)
        assert silent.hung_up.wait(timeout=15), "the request on the wire went on after close"
    finally:
        client.close()
        silent.stop()
    assert isinstance(ended[0], ClientClosed)
    assert seen == []  # (no answer, nor a timeout, to count)


class Silent(LoopbackServer):
    """An API that reads each request and never answers it; `hung_up` once a client hangs up."""

    def __init__(self) -> None:
        super().__init__()
        self.requests = 0
        self.hung_up = threading.Event()

    def serve(self, connection: socket.socket) -> None:
        with connection:
            if connection.recv(65536):
                self.requests += 1
            connection.settimeout(60)
            try:
                if not connection.recv(1):
                    self.hung_up.set()
            except OSError:
                self.hung_up.set()


def test_429_honours_retry_after(sim: Simulator, client: BillingClient, sleeps: Sleeps) -> None:
    sim.inject(Fault("status", status=429, retry_after=7))
    client.bills("2026-11", GROUP_TERM_ITEM)
    assert sleeps == [7.0]


def test_a_retry_after_longer_than_a_refresh_waits_is_honoured_across_refreshes(
    sim: Simulator, client: BillingClient, sleeps: Sleeps
) -> None:
    """Asked to wait ten minutes: the read ends at once (no wait of two minutes then a request ten
    minutes too early), and the listing is not asked again before then; the other one still is."""
    sim.inject(Fault("status", status=429, retry_after=600))
    with pytest.raises(AskedToWait, match=r"HTTP 429 \(rate limited\), and asked to wait 600s"):
        client.bills("2026-11", GROUP_TERM_ITEM)
    served = sim.requests_served["/api/v1/bills/details"]
    with pytest.raises(AskedToWait, match=r"asked not to be asked again for \d+s more") as held:
        client.bills("2026-11", GROUP_TERM_INSTANCE)
    (left,) = re.findall(r"for (\d+)s more", str(held.value))
    assert 540 <= int(left) <= 600  # (what is left of the ten minutes, however busy the machine)
    assert sim.requests_served["/api/v1/bills/details"] == served  # nothing sent
    assert sleeps == []
    sim.add_usage(10)
    assert sum(len(p.records) for p in client.usage_pages(sim.clock.today())) == 10


def test_a_long_retry_after_on_the_last_attempt_holds_too_and_a_hold_is_at_most_an_hour(
    sim: Simulator, client: BillingClient, sleeps: Sleeps
) -> None:
    sim.inject(Fault("status", status=502, times=3))
    sim.inject(Fault("status", status=429, retry_after=600))
    with pytest.raises(BillingUnavailable, match="asked to wait 600s"):
        client.bills("2026-11", GROUP_TERM_ITEM)
    served = sim.requests_served["/api/v1/bills/details"]
    with pytest.raises(BillingUnavailable, match="asked not to be asked again"):
        client.bills("2026-11", GROUP_TERM_ITEM)
    assert sim.requests_served["/api/v1/bills/details"] == served
    sim.add_usage(1)
    sim.inject(Fault("status", status=429, retry_after=10**10))  # a date years ahead, from a gateway gone wrong
    with pytest.raises(
        BillingUnavailable, match=r"asked to wait 10000000000s \(Retry-After\): not asked again for 3600s"
    ):
        list(client.usage_pages(sim.clock.today()))


def test_a_wait_the_api_asked_for_holds_the_client_a_reload_builds_in_its_place(
    sim: Simulator, server: SimulatorServer, clock: Clock, sleeps: Sleeps, tmp_path: Path
) -> None:
    """Asked to wait ten minutes, then reloaded with a config that builds a new billing client (a
    new page size): the new client does not ask that listing before then either."""
    path = tmp_path / "config.yaml"
    document = {"billing": billing_section(sim, server), "state": {"path": str(tmp_path / "state.db")}}
    path.write_text(yaml.safe_dump(document))
    daemon = Daemon(validate(document, {}), config_path=path, clock=clock, retry=RetryPolicy(sleep=sleeps), serve=False)
    try:
        sim.inject(Fault("status", status=429, retry_after=600))
        assert not daemon.refresh("bills")
        assert "asked to wait 600s" in daemon.latest.health["bills"].error
        served = sim.requests_served["/api/v1/bills/details"]
        before = daemon.sources.accounts[""].client
        document["billing"]["page_size"] = 100
        path.write_text(yaml.safe_dump(document))
        assert daemon.reload()
        assert daemon.sources.accounts[""].client is not before
        assert not daemon.refresh("bills")
        assert "asked not to be asked again" in daemon.latest.health["bills"].error
        assert sim.requests_served["/api/v1/bills/details"] == served  # nothing sent
        sim.add_usage(10)
        assert daemon.refresh("usage")  # the other listing is asked as ever
    finally:
        daemon.stop()


def test_a_short_wait_asked_of_a_client_a_reload_closed_is_waited_out_by_the_one_made_in_its_place(
    sim: Simulator, config: Config, clock: Clock, sleeps: Sleeps
) -> None:
    """A 429 asking for 20 s while the old client waits to retry; a reload closes it: the new one
    does not ask before those 20 s are over either (it waits them out, then asks)."""

    def reload(seconds: float) -> None:  # (the old client's retry pause, cut by a reload's close)
        sleeps.append(seconds)
        old.close()

    old = BillingClient.from_config(config.billing, clock, retry=RetryPolicy(sleep=reload))
    asked_before_the_wait: list[int] = []

    def wait(seconds: float) -> None:
        sleeps.append(seconds)
        asked_before_the_wait.append(sim.requests_served["/api/v1/bills/details"])

    new = BillingClient.from_config(config.billing, clock, retry=RetryPolicy(sleep=wait))
    new.carry_over(old)
    sim.inject(Fault("status", status=429, retry_after=20, times=1))
    with pytest.raises(ClientClosed):
        old.bills("2026-11", GROUP_TERM_ITEM)
    assert sleeps == [20.0]
    served = sim.requests_served["/api/v1/bills/details"]
    with new:
        assert new.bills("2026-11", GROUP_TERM_ITEM)
    assert len(sleeps) == 2
    assert 19 < sleeps[1] <= 20  # what was left of the 20 s, waited before the new client's first request
    assert asked_before_the_wait == [served]
    assert sim.requests_served["/api/v1/bills/details"] > served


def test_a_wait_asked_for_in_answer_to_a_client_closed_meanwhile_holds_the_one_made_in_its_place(
    sim: Simulator, config: Config, clock: Clock, sleeps: Sleeps
) -> None:
    """The request was sent before a reload closed its client; its answer, a long Retry-After,
    comes after: the client the reload made does not ask before then either."""
    answers: list[tuple[str, str]] = []
    told = answers.append
    old = BillingClient.from_config(config.billing, clock, lambda *call: told(call), RetryPolicy(sleep=sleeps))
    new = BillingClient.from_config(config.billing, clock, retry=RetryPolicy(sleep=sleeps))
    new.carry_over(old)
    answer = threading.Event()
    sim.inject(Fault("status", status=429, retry_after=600, gate=answer))
    with new, ThreadPoolExecutor(1) as pool:
        reading = pool.submit(old.bills, "2026-11", GROUP_TERM_ITEM)
        wait_for(lambda: sim.requests_served.get("/api/v1/bills/details"))
        old.close(cut=False)  # (as a reload does, once the new client is in place: the request goes on)
        with pytest.raises(ClientClosed):
            reading.result(10)
        answer.set()  # the 429 comes now
        wait_for(lambda: answers)  # the 429, to the closed client
        with pytest.raises(BillingUnavailable, match="asked not to be asked again"):
            new.bills("2026-11", GROUP_TERM_ITEM)
    assert answers == [("bills", "429")]
    assert sim.requests_served["/api/v1/bills/details"] == 1


def test_a_retry_after_date_is_read_with_or_without_its_zone_and_nonsense_is_no_wait() -> None:
    soon = dt.datetime.now(dt.UTC) + dt.timedelta(minutes=10)
    response = requests.Response()
    for written in (email.utils.format_datetime(soon), email.utils.format_datetime(soon).replace("+0000", "-0000")):
        response.headers["Retry-After"] = written
        assert 590 < (_retry_after(response) or 0) <= 600, written
    for nonsense in ("²", "soon", "-5"):
        response.headers["Retry-After"] = nonsense
        assert _retry_after(response) is None


def test_gives_up_after_the_last_attempt(sim: Simulator, client: BillingClient, sleeps: Sleeps) -> None:
    sim.inject(Fault("status", status=502, times=10))
    with pytest.raises(BillingUnavailable, match=r"HTTP 502.*4 attempts"):
        client.bills("2026-11", GROUP_TERM_ITEM)
    assert len(sleeps) == 3


def test_other_4xx_and_envelope_errors_are_not_retried(sim: Simulator, client: BillingClient, sleeps: Sleeps) -> None:
    sim.inject(Fault("status", status=400))
    with pytest.raises(BillingAPIError, match="HTTP 400"):
        client.bills("2026-11", GROUP_TERM_ITEM)
    sim.inject(Fault("code"))
    with pytest.raises(BillingAPIError, match="service is busy") as raised:
        client.bills("2026-11", GROUP_TERM_ITEM)
    assert raised.value.code == 100503
    assert sleeps == []


def test_malformed_json_and_bad_records_name_the_problem(sim: Simulator, client: BillingClient) -> None:
    sim.inject(Fault("malformed"))
    with pytest.raises(RecordError, match="not JSON"):
        client.bills("2026-11", GROUP_TERM_ITEM)
    sim.inject(Fault("bad_amount"))
    with pytest.raises(RecordError, match=r"record 0: field 'payableAmount' is not a decimal: '12,5'"):
        client.bills("2026-11", GROUP_TERM_ITEM)


def test_total_disagreeing_with_the_pages_is_an_error(sim: Simulator, client: BillingClient) -> None:
    sim.inject(Fault("total_mismatch", times=100))  # every answer: one more than the list holds
    with pytest.raises(RecordError, match="`total` says 67"):
        client.bills("2026-11", GROUP_TERM_ITEM)


def test_a_wrong_secret_is_signature_rejected_without_the_secret(
    sim: Simulator, server: SimulatorServer, clock: Clock, sleeps: Sleeps
) -> None:
    config = validate({"billing": billing_section(sim, server, secret_access_key="wrong-secret-123")}, {})
    client = BillingClient.from_config(config.billing, clock, retry=RetryPolicy(sleep=sleeps))
    with client, pytest.raises(SignatureRejected, match="signature rejected") as raised:
        client.bills("2026-11", GROUP_TERM_ITEM)
    assert "wrong-secret-123" not in str(raised.value)
    assert sleeps == []


@pytest.mark.parametrize("minutes", [10, -7])
def test_a_skewed_clock_is_corrected_from_the_servers_date(
    config: Config, sim: Simulator, sleeps: Sleeps, minutes: int, caplog: pytest.LogCaptureFixture
) -> None:
    skewed = Clock(SHANGHAI, lambda: sim.clock.now() + dt.timedelta(minutes=minutes))
    seen: list[tuple[str, str]] = []
    skews: list[float] = []
    client = BillingClient.from_config(
        config.billing, skewed, lambda *call: seen.append(call), RetryPolicy(sleep=sleeps), on_skew=skews.append
    )
    with client:
        assert len(client.bills("2026-11", GROUP_TERM_ITEM)) == 66
        assert len(client.bills("2026-11", GROUP_TERM_INSTANCE)) == 66
    assert seen == [("bills", "401"), ("bills", "200"), ("bills", "200")]  # refused once, then signed right
    assert client.clock_skew == -minutes * 60
    assert skews == [-minutes * 60] * 3
    assert sum("clock skew" in r.getMessage() for r in caplog.records) == 1  # logged once, not per request


def test_the_skew_follows_each_date_the_server_gives_against_our_clock_as_it_is_then(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A `Date` said again is read once and measured against our clock as it is when it comes;
    a new one is read afresh; one that is no date tells nothing, however often it comes."""
    read: list[str] = []
    parse = email.utils.parsedate_to_datetime

    def counted(header: str) -> dt.datetime:
        read.append(header)
        return parse(header)

    monkeypatch.setattr(email.utils, "parsedate_to_datetime", counted)
    ours = [1_800_000_000.0]
    signer = BillingSigner("AKID", "secret", time_fn=lambda: ours[0])
    skews: list[float] = []
    client = BillingClient("http://127.0.0.1:9", signer, tz=SHANGHAI, on_skew=skews.append)
    at = email.utils.formatdate(ours[0], usegmt=True)
    with client:
        client._observe_clock(at)
        ours[0] += 7
        client._observe_clock(at)
        client._observe_clock("not a date")
        client._observe_clock("not a date")
        client._observe_clock(later := email.utils.formatdate(ours[0] + 3, usegmt=True))
        client._observe_clock(at)
    assert skews == [0, -7, 3, -7]
    assert client.clock_skew == -7
    assert read == [at, "not a date", "not a date", later, at]


def test_a_wrong_secret_is_not_retried_when_the_clocks_agree(
    sim: Simulator, server: SimulatorServer, clock: Clock, sleeps: Sleeps
) -> None:
    seen: list[tuple[str, str]] = []
    config = validate({"billing": billing_section(sim, server, secret_access_key="nope")}, {})
    client = BillingClient.from_config(
        config.billing, clock, lambda *call: seen.append(call), RetryPolicy(sleep=sleeps)
    )
    with client, pytest.raises(SignatureRejected):
        client.bills("2026-11", GROUP_TERM_ITEM)
    assert seen == [("bills", "401")]
    assert client.clock_skew == 0


def test_project_filter_is_sent_snake_case(sim: Simulator, server: SimulatorServer, clock: Clock) -> None:
    config = validate({"billing": billing_section(sim, server, project_id="proj-lab")}, {})
    sim.add_usage(300)
    with BillingClient.from_config(config.billing, clock) as client:
        bills = client.bills("2026-11", GROUP_TERM_INSTANCE)
        usage = [r for p in client.usage_pages(clock.today()) for r in p.records]
    assert {b.instance_id for b in bills} == {"ep-20261102-gamma"}
    assert usage
    assert {r.endpoint for r in usage} == {"ep-20261102-gamma"}


def test_the_environments_proxy_is_used_and_no_proxy_bypasses_it(
    sim: Simulator, server: SimulatorServer, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The environment is read once per client (not per page), and still as requests reads it: an
    address only the proxy can reach (the simulator, which takes the absolute form a proxy is sent)
    is read through `HTTP_PROXY`, and `NO_PROXY` for its host goes around the proxy."""
    unreachable = "http://billing.invalid"
    config = validate({"billing": billing_section(sim, server, url=unreachable)}, {})
    sim.add_usage(7)
    for name in ("HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", server.url)
    with BillingClient.from_config(config.billing, clock) as client:
        assert sum(len(page.records) for page in client.usage_pages(clock.today())) == 7
        monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # (refused) read once: not seen now
        assert sum(len(page.records) for page in client.usage_pages(clock.today())) == 7
    monkeypatch.setenv("HTTP_PROXY", server.url)
    monkeypatch.setenv("NO_PROXY", "billing.invalid")
    bypassing = BillingClient.from_config(config.billing, clock, retry=RetryPolicy(attempts=1))
    with bypassing, pytest.raises(BillingUnavailable, match=r"billing\.invalid"):
        list(bypassing.usage_pages(clock.today()))


def test_api_calls_are_reported_by_status(
    sim: Simulator, server: SimulatorServer, config: Config, clock: Clock
) -> None:
    seen: list[tuple[str, str]] = []
    sim.inject(Fault("status", status=503))
    retry = RetryPolicy(sleep=lambda seconds: None)
    with BillingClient.from_config(config.billing, clock, lambda *call: seen.append(call), retry=retry) as client:
        client.bills("2026-11", GROUP_TERM_ITEM)
    assert seen == [("bills", "503"), ("bills", "200")]


GOOD_BILL = {
    "tenantId": "t", "projectId": "p", "period": "2026-11", "instanceId": "ep-1",
    "product": "PRODUCT_INFERENCE_ENDPOINT",
    "startTime": "2026-11-21T16:00:00Z", "endTime": "2026-11-22T16:00:00Z", "payableAmount": "1.23456789",
    "usageValue": "100", "item": "ITEM_PROMPT_TOKEN",
}  # fmt: skip
GOOD_USAGE = {
    "requestId": "r1", "requestTime": "2026-11-22T01:00:00Z", "tenantId": "t", "model": "m", "endpoint": "ep-1",
    "apikey": "sk-ab****", "promptTokens": 10, "completionTokens": 5, "promptCachedTokens": 2,
}  # fmt: skip


def test_bill_day_is_the_shanghai_day_of_start_time() -> None:
    bill = parse_bill(GOOD_BILL, "bill", SHANGHAI)
    assert bill.day.isoformat() == "2026-11-22"


def test_a_bills_start_a_tenth_of_a_microsecond_before_midnight_stays_on_its_day() -> None:
    """Digits beyond the microsecond are cut, never rounded up into the next day."""
    bill = parse_bill(GOOD_BILL | {"startTime": "2026-11-22T23:59:59.9999996+08:00"}, "bill", SHANGHAI)
    assert bill.day.isoformat() == "2026-11-22"
    assert bill.payable_amount == Decimal("1.23456789")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"payableAmount": "abc"}, "'payableAmount' is not a decimal"),
        ({"payableAmount": "NaN"}, "'payableAmount' is not a decimal: 'NaN'"),
        ({"payableAmount": None}, "'payableAmount' is not a decimal"),
        ({"usageValue": True}, "'usageValue' is not a decimal"),
        ({"startTime": "yesterday"}, "'startTime' is not an RFC 3339 time"),
        ({"startTime": "2026-11-21T16:00:00"}, "'startTime' has no UTC offset"),
        ({"period": 202611}, "'period' is not a string"),
    ],
)
def test_malformed_bill_records_name_the_field(change: dict, message: str) -> None:
    with pytest.raises(RecordError, match=message):
        parse_bill(GOOD_BILL | change, "bill", SHANGHAI)
    broken = dict(GOOD_BILL)
    del broken["payableAmount"]
    with pytest.raises(RecordError, match="missing field 'payableAmount'"):
        parse_bill(broken, "bill", SHANGHAI)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"promptTokens": -1}, "'promptTokens' is not a non-negative integer"),
        ({"completionTokens": 1.5}, "'completionTokens' is not a non-negative integer"),
        ({"promptCachedTokens": "many"}, "'promptCachedTokens' is not a non-negative integer"),
        ({"requestId": None}, "'requestId' is not a string"),
    ],
)
def test_malformed_usage_records_name_the_field(change: dict, message: str) -> None:
    with pytest.raises(RecordError, match=message):
        parse_usage(GOOD_USAGE | change, "usage")


def test_usage_record_parses() -> None:
    record = parse_usage(GOOD_USAGE | {"promptTokens": "10"}, "usage")
    assert (record.apikey, record.prompt_tokens, record.completion_tokens, record.cached_prompt_tokens) == (
        "sk-ab****",
        10,
        5,
        2,
    )


def test_a_clock_correction_is_dropped_once_our_clock_is_right_again(
    config: Config, sim: Simulator, sleeps: Sleeps
) -> None:
    offset = [dt.timedelta(minutes=6)]
    drifting = Clock(SHANGHAI, lambda: sim.clock.now() + offset[0])
    seen: list[tuple[str, str]] = []
    with BillingClient.from_config(
        config.billing, drifting, lambda *c: seen.append(c), RetryPolicy(sleep=sleeps)
    ) as client:
        client.bills("2026-11", GROUP_TERM_ITEM)
        offset[0] = dt.timedelta(0)  # NTP fixed the host clock: the old correction is now 6 minutes off
        client.bills("2026-11", GROUP_TERM_ITEM)
        client.bills("2026-11", GROUP_TERM_ITEM)
    assert [code for _, code in seen] == ["401", "200", "401", "200", "200"]
    assert client.clock_skew == 0
