"""The simulator is as strict as the specification allows; these tests send hand-made requests."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import pytest
import requests

from exporter.billing.signing import new_nonce, sign_request
from exporter.core.clock import FrozenClock
from exporter.sim import Simulator, SimulatorServer

BILLS = "/api/v1/bills/details"
USAGES = "/api/v1/usages/details"
BILLS_QUERY = "period=2026-11&group_period=GROUP_PERIOD_DAILY&group_term=GROUP_TERM_INSTANCE"


def signed_get(
    sim: Simulator,
    server: SimulatorServer,
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
) -> requests.Response:
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
    headers |= mutate or {}
    return requests.get(f"{server.url}{path}?{query}", headers=headers, timeout=5)


def refused(response: requests.Response) -> str:
    body = response.json()
    assert body["code"] != 0
    assert "data" not in body
    return body["reason"]


def test_a_correct_signature_is_accepted(sim: Simulator, server: SimulatorServer) -> None:
    response = signed_get(sim, server, BILLS, BILLS_QUERY)
    body = response.json()
    assert (response.status_code, body["code"], body["reason"], body["message"]) == (200, 0, "OK", "success")
    assert body["data"]["total"] == 22 * len(sim.endpoints)


def test_lifetime_zero_signature_is_accepted(sim: Simulator, server: SimulatorServer) -> None:
    assert signed_get(sim, server, BILLS, BILLS_QUERY, lifetime=None).json()["code"] == 0


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
def test_bad_signatures_are_refused(
    sim: Simulator, server: SimulatorServer, case: str, kwargs: dict, reason: str
) -> None:
    response = signed_get(sim, server, BILLS, BILLS_QUERY, **kwargs)
    assert response.status_code == 401
    assert refused(response) == reason


def test_parameters_out_of_order_are_refused(sim: Simulator, server: SimulatorServer) -> None:
    created = int(sim.clock.now().timestamp())
    good = sign_request(
        method="GET", query=BILLS_QUERY, path=BILLS, body=b"", key_id=sim.access_key_id,
        secret=sim.secret_access_key, label="svc", created=created, expires=None, nonce=new_nonce(),
    )  # fmt: skip
    label, params = good.signature_input.split("=", 1)
    parts = params.split(";")
    swapped = ";".join([parts[0], parts[2], parts[1], *parts[3:]])
    response = signed_get(sim, server, BILLS, BILLS_QUERY, mutate={"Signature-Input": f"{label}={swapped}"})
    assert refused(response) == "SignatureInput"


def test_a_reused_nonce_is_refused(sim: Simulator, server: SimulatorServer) -> None:
    nonce = new_nonce()
    assert signed_get(sim, server, BILLS, BILLS_QUERY, nonce=nonce).json()["code"] == 0
    assert refused(signed_get(sim, server, BILLS, BILLS_QUERY, nonce=nonce)) == "NonceReused"


def test_signature_covers_the_query(sim: Simulator, server: SimulatorServer) -> None:
    created = int(sim.clock.now().timestamp())
    headers = sign_request(
        method="GET", query=BILLS_QUERY, path=BILLS, body=b"", key_id=sim.access_key_id,
        secret=sim.secret_access_key, label="svc", created=created, expires=None, nonce=new_nonce(),
    ).as_dict()  # fmt: skip
    tampered = BILLS_QUERY.replace("2026-11", "2026-10")
    response = requests.get(f"{server.url}{BILLS}?{tampered}", headers=headers, timeout=5)
    assert refused(response) == "SignatureMismatch"


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
def test_bad_queries_are_refused(sim: Simulator, server: SimulatorServer, path: str, query: str, message: str) -> None:
    response = signed_get(sim, server, path, query)
    assert response.status_code == 400
    refused(response)
    assert message in response.json()["message"]


def test_future_date_follows_the_shanghai_calendar(
    sim: Simulator, server: SimulatorServer, frozen: FrozenClock
) -> None:
    frozen.set(dt.datetime(2026, 11, 22, 16, 30, tzinfo=dt.UTC))  # 00:30 on the 23rd in Shanghai
    sim.add_usage(3)
    body = signed_get(sim, server, USAGES, "date=2026-11-23").json()
    assert (body["code"], body["data"]["total"], body["data"]["date"]) == (0, "3", "2026-11-23")


def test_usage_pages_and_total_as_string(sim: Simulator, server: SimulatorServer) -> None:
    sim.add_usage(250)
    pages = [
        signed_get(sim, server, USAGES, f"date=2026-11-22&page_num={n}&page_size=100").json() for n in (1, 2, 3, 4)
    ]
    assert [len(p["data"]["list"]) for p in pages] == [100, 100, 50, 0]
    assert {p["data"]["total"] for p in pages} == {"250"}
    ids = [r["requestId"] for p in pages for r in p["data"]["list"]]
    assert len(set(ids)) == 250


def test_bills_by_instance_and_by_item_cover_the_same_charges(sim: Simulator) -> None:
    by_instance = sum(Decimal(r["payableAmount"]) for r in sim.bill_rows("2026-11", "GROUP_TERM_INSTANCE"))
    by_item = sum(Decimal(r["payableAmount"]) for r in sim.bill_rows("2026-11", "GROUP_TERM_ITEM"))
    assert by_instance == by_item == sim.bill_totals("2026-11")["total"]
    days = {r["startTime"] for r in sim.bill_rows("2026-11", "GROUP_TERM_ITEM")}
    assert min(days) == "2026-10-31T16:00:00Z"  # Shanghai's 1 November starts at 16:00 UTC the day before
    assert len(days) == 22


def test_responses_carry_the_simulators_date(sim: Simulator, server: SimulatorServer) -> None:
    response = signed_get(sim, server, BILLS, BILLS_QUERY)
    assert response.headers["Date"] == "Sun, 22 Nov 2026 02:00:00 GMT"
