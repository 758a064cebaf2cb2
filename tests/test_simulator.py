"""The simulator is as strict as the specification allows; these tests send hand-made requests.

Its checks (signatures, query parameters, pages) are asked of it in process: the unit layer. Over
HTTP only what the wire carries: the status, the envelope, the Date header."""

from __future__ import annotations

import datetime as dt
import json
from decimal import Decimal
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import requests

from exporter.billing.signing import new_nonce, sign_request
from exporter.core.clock import Clock, FrozenClock
from exporter.sim import Simulator, SimulatorServer
from exporter.sim.model import SimulatorError

BILLS = "/api/v1/bills/details"
USAGES = "/api/v1/usages/details"
BILLS_QUERY = "period=2026-11&group_period=GROUP_PERIOD_DAILY&group_term=GROUP_TERM_INSTANCE"
DELAYED_ACK = 0.040
"""Linux's shortest delayed ACK, which Nagle's algorithm makes a second write on a connection wait for."""


def signed_headers(
    sim: Simulator,
    path: str,
    query: str,
    *,
    secret: str | None = None,
    key_id: str | None = None,
    label: str | None = None,
    created_offset: int = 0,
    lifetime: int | None = 300,
    nonce: str | None = None,
    mutate: dict[str, str] | None = None,
) -> dict[str, str]:
    """The signature headers of a GET without a body, made by hand; `mutate` replaces some afterwards."""
    created = int(sim.clock.now().timestamp()) + created_offset
    headers = sign_request(
        method="GET",
        query=query,
        path=path,
        body=b"",
        key_id=key_id or sim.access_key_id,
        secret=secret or sim.secret_access_key,
        label=label or sim.label,
        created=created,
        expires=created + lifetime if lifetime is not None else None,
        nonce=nonce or new_nonce(),
    ).as_dict()
    return headers | (mutate or {})


def verify(sim: Simulator, path: str, query: str, **signing: Any) -> None:
    """The simulator's check of a GET signed as `signed_headers` signs it; SimulatorError if refused."""
    sim.verify_signature("GET", query, path, signed_headers(sim, path, query, **signing), b"")


def signed_get(sim: Simulator, server: SimulatorServer, path: str, query: str, **signing: Any) -> requests.Response:
    return requests.get(f"{server.url}{path}?{query}", headers=signed_headers(sim, path, query, **signing), timeout=5)


def refused(response: requests.Response) -> str:
    body = response.json()
    assert body["code"] != 0
    assert "data" not in body
    return body["reason"]


# --- in process -------------------------------------------------------------------------------


def test_lifetime_zero_signature_is_accepted(sim: Simulator) -> None:
    verify(sim, BILLS, BILLS_QUERY, lifetime=None)


@pytest.mark.parametrize(
    ("case", "kwargs", "reason"),
    [
        ("wrong secret", {"secret": "not-the-secret"}, "SignatureMismatch"),
        ("wrong key id", {"key_id": "AKUNKNOWN"}, "AccessKeyInvalid"),
        ("wrong label", {"label": "other"}, "SignatureLabel"),
        ("created too old", {"created_offset": -301, "lifetime": None}, "SignatureExpired"),
        ("created in the future", {"created_offset": 301}, "SignatureExpired"),
        ("expired", {"created_offset": -200, "lifetime": 100}, "SignatureExpired"),
        ("wrong digest", {"mutate": {"Content-Digest": "sha-256=AAAA"}}, "DigestMismatch"),
        ("missing headers", {"mutate": {"Signature": ""}}, "SignatureMissing"),
        ("short nonce", {"nonce": "abc"}, "SignatureInput"),
    ],
)
def test_bad_signatures_are_refused(sim: Simulator, case: str, kwargs: dict, reason: str) -> None:
    with pytest.raises(SimulatorError) as refusal:
        verify(sim, BILLS, BILLS_QUERY, **kwargs)
    assert (refusal.value.http_status, refusal.value.reason) == (401, reason)
    assert refusal.value.code != 0


def test_parameters_out_of_order_are_refused(sim: Simulator) -> None:
    created = int(sim.clock.now().timestamp())
    good = sign_request(
        method="GET", query=BILLS_QUERY, path=BILLS, body=b"", key_id=sim.access_key_id,
        secret=sim.secret_access_key, label="svc", created=created, expires=None, nonce=new_nonce(),
    )  # fmt: skip
    label, params = good.signature_input.split("=", 1)
    parts = params.split(";")
    swapped = ";".join([parts[0], parts[2], parts[1], *parts[3:]])
    with pytest.raises(SimulatorError) as refusal:
        verify(sim, BILLS, BILLS_QUERY, mutate={"Signature-Input": f"{label}={swapped}"})
    assert refusal.value.reason == "SignatureInput"


def test_a_reused_nonce_is_refused(sim: Simulator) -> None:
    nonce = new_nonce()
    verify(sim, BILLS, BILLS_QUERY, nonce=nonce)
    with pytest.raises(SimulatorError) as refusal:
        verify(sim, BILLS, BILLS_QUERY, nonce=nonce)
    assert refusal.value.reason == "NonceReused"


def test_signature_covers_the_query(sim: Simulator) -> None:
    headers = signed_headers(sim, BILLS, BILLS_QUERY, lifetime=None)
    tampered = BILLS_QUERY.replace("2026-11", "2026-10")
    with pytest.raises(SimulatorError) as refusal:
        sim.verify_signature("GET", tampered, BILLS, headers, b"")
    assert refusal.value.reason == "SignatureMismatch"


@pytest.mark.parametrize(
    ("path", "query", "message"),
    [
        (BILLS, "period=2026-11&groupPeriod=GROUP_PERIOD_DAILY", "snake_case"),
        (BILLS, "period=2026-11", "group_period"),
        (BILLS, "period=2026-13&group_period=GROUP_PERIOD_DAILY", "YYYY-MM"),
        (USAGES, "date=2026-11-23", "future"),
        (USAGES, "date=2026-11-22&page_size=501", "page_size"),
        (USAGES, "date=2026-11-22&pageNum=2", "snake_case"),
        (USAGES, "date=22/11/2026", "YYYY-MM-DD"),
    ],
)
def test_bad_queries_are_refused(sim: Simulator, path: str, query: str, message: str) -> None:
    respond = {BILLS: sim.bills_response, USAGES: sim.usages_response}[path]
    with pytest.raises(SimulatorError) as refusal:
        respond(query)
    assert refusal.value.http_status == 400
    assert refusal.value.code != 0
    assert message in refusal.value.message


def test_future_date_follows_the_shanghai_calendar(sim: Simulator, frozen: FrozenClock) -> None:
    frozen.set(dt.datetime(2026, 11, 22, 16, 30, tzinfo=dt.UTC))  # 00:30 on the 23rd in Shanghai
    sim.add_usage(3)
    data = sim.usages_response("date=2026-11-23")
    assert (data["total"], data["date"]) == ("3", "2026-11-23")


def test_usage_pages_and_total_as_string(sim: Simulator) -> None:
    sim.add_usage(250)
    pages = [sim.usages_response(f"date=2026-11-22&page_num={n}&page_size=100") for n in (1, 2, 3, 4)]
    assert [len(p["list"]) for p in pages] == [100, 100, 50, 0]
    assert {p["total"] for p in pages} == {"250"}
    ids = [json.loads(r)["requestId"] for p in pages for r in p["list"]]  # records as JSON text
    assert len(set(ids)) == 250


@pytest.mark.parametrize(
    ("zone", "day"),
    [
        *((zone, dt.date(2026, 11, 22)) for zone in ("Asia/Shanghai", "Asia/Kolkata", "America/St_Johns", "UTC")),
        ("Europe/Berlin", dt.date(2026, 3, 29)),  # 23 hours: the clocks go forward
        ("Europe/Berlin", dt.date(2026, 10, 25)),  # 25 hours: back
    ],
)
def test_usage_times_fall_in_the_day_asked_across_the_whole_day(zone: str, day: dt.date) -> None:
    tz = ZoneInfo(zone)
    sim = Simulator(clock=Clock(tz, FrozenClock(dt.datetime(2026, 11, 23, 12, tzinfo=tz))))
    sim.add_usage(3000, day)
    stamps = [r["requestTime"] for r in sim.usage_records(day)]
    assert all(stamp.endswith("Z") for stamp in stamps)  # (UTC, as the specification's example)
    local = [dt.datetime.fromisoformat(stamp).astimezone(tz) for stamp in stamps]
    assert {t.date() for t in local} == {day}
    assert (min(local).hour, max(local).hour) == (0, 23)  # spread over the whole local day
    bills = sim.bill_rows(f"{day:%Y-%m}", "GROUP_TERM_ITEM")
    (end,) = {row["endTime"] for row in bills if row["startTime"] == stamp(sim.clock.day_start(day))}
    assert end == stamp(sim.clock.day_start(day + dt.timedelta(days=1)))  # the next natural day's start


def stamp(instant: dt.datetime) -> str:
    return instant.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.parametrize(
    ("zone", "day", "hours"),
    [
        ("Asia/Shanghai", dt.date(2026, 11, 22), 24),
        ("America/St_Johns", dt.date(2026, 3, 8), 23),  # (a -03:30 offset, on the day it changes)
        ("Asia/Kolkata", dt.date(1900, 6, 1), 24),  # (+05:21:10: the day starts off a whole minute)
    ],
)
def test_usage_record_i_is_at_the_days_start_plus_37_i_seconds_mod_a_day(zone: str, day: dt.date, hours: int) -> None:
    """Mod the natural day's length: 82,800 s on St. John's 2026-03-08, when the clocks go forward."""
    tz = ZoneInfo(zone)
    sim = Simulator(clock=Clock(tz, FrozenClock(dt.datetime(2026, 11, 23, 12, tzinfo=tz))))
    start = sim.clock.day_start(day).astimezone(dt.UTC).replace(tzinfo=None)
    length = hours * 3600
    for index in range(length):  # (every second of the day: 37 and 82,800 or 86,400 have no common factor)
        expected = (start + dt.timedelta(seconds=index * 37 % length)).isoformat() + "Z"
        assert json.loads(sim.usage_record_json(day, index))["requestTime"] == expected, index


def test_bills_by_instance_and_by_item_cover_the_same_charges(sim: Simulator) -> None:
    by_instance = sum(Decimal(r["payableAmount"]) for r in sim.bill_rows("2026-11", "GROUP_TERM_INSTANCE"))
    by_item = sum(Decimal(r["payableAmount"]) for r in sim.bill_rows("2026-11", "GROUP_TERM_ITEM"))
    assert by_instance == by_item == sim.bill_totals("2026-11")["total"]
    days = {r["startTime"] for r in sim.bill_rows("2026-11", "GROUP_TERM_ITEM")}
    assert min(days) == "2026-10-31T16:00:00Z"  # Shanghai's 1 November starts at 16:00 UTC the day before
    assert len(days) == 22


# --- over HTTP --------------------------------------------------------------------------------


def test_a_correct_signature_is_accepted(sim: Simulator, server: SimulatorServer) -> None:
    response = signed_get(sim, server, BILLS, BILLS_QUERY)
    body = response.json()
    assert (response.status_code, body["code"], body["reason"], body["message"]) == (200, 0, "OK", "success")
    assert body["data"]["total"] == 22 * len(sim.endpoints)


@pytest.mark.parametrize(
    ("query", "signing", "status", "reason", "message"),
    [
        (BILLS_QUERY, {"secret": "not-the-secret"}, 401, "SignatureMismatch", "signature does not match"),
        ("period=2026-13&group_period=GROUP_PERIOD_DAILY", {}, 400, "InvalidParameter", "YYYY-MM"),
    ],
    ids=["signature", "query"],
)
def test_a_refusal_is_an_envelope_without_data_under_its_http_status(
    sim: Simulator, server: SimulatorServer, query: str, signing: dict, status: int, reason: str, message: str
) -> None:
    response = signed_get(sim, server, BILLS, query, **signing)
    assert response.status_code == status
    assert refused(response) == reason
    assert message in response.json()["message"]


def test_responses_carry_the_simulators_date(sim: Simulator, server: SimulatorServer) -> None:
    response = signed_get(sim, server, BILLS, BILLS_QUERY)
    assert response.headers["Date"] == "Sun, 22 Nov 2026 02:00:00 GMT"


def test_an_answer_on_a_kept_alive_connection_is_not_held_back(sim: Simulator, server: SimulatorServer) -> None:
    """Headers and body go out at once: Nagle's algorithm made every answer after a connection's
    first wait for the client's delayed ACK (40 ms), which a benchmark then counted as the wire's."""
    import time

    def timed(get: Any) -> float:
        started = time.perf_counter()
        assert get(f"{server.url}/api/v1/bills/details", timeout=5).status_code == 401  # unsigned: refused, with a body
        return time.perf_counter() - started

    with requests.Session() as session:
        timed(session.get)
        kept = min(timed(session.get) for _ in range(15))
    # With Nagle's algorithm every one of them waits for the client's delayed ACK, 40 ms at least on
    # Linux: the fastest of 15 is under half that however busy the machine (its noise only adds).
    assert kept < DELAYED_ACK / 2
