"""A usage page's two readings agree: the one-pass decoding (msgspec) of a well-formed page, and
the field-by-field checks it hands everything else to, which name what is wrong."""

from __future__ import annotations

import json
from typing import Any

import pytest

from exporter.billing import RecordError
from exporter.billing.records import decode_usage_page, parse_usage

GOOD = {
    "requestId": "req-1",
    "requestTime": "2026-11-26T10:00:00+08:00",
    "model": "model-a",
    "endpoint": "ep-1",
    "apikey": "ak-***1",
    "promptTokens": 120,
    "completionTokens": 30,
    "promptCachedTokens": 0,
}


def page(*records: dict[str, Any], code: int = 0, total: object = None) -> bytes:
    data = {"list": list(records), "total": len(records) if total is None else total, "date": "2026-11-26"}
    return json.dumps({"code": code, "message": "success", "data": data}).encode()


def checked(body: bytes) -> tuple[Any, ...]:
    return tuple(parse_usage(raw, f"record {i}") for i, raw in enumerate(json.loads(body)["data"]["list"]))


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"apikey": None},
        {"apikey": ""},
        {"model": "modèle-ü", "endpoint": "端点-1"},  # valid text that is not ASCII
        {"requestTime": "2026-11-26T02:00:00Z"},
        {"requestTime": "2026-11-26T02:00:00.123456Z"},
        {"promptTokens": 10**12},
    ],
    ids=["as-documented", "null-key", "empty-key", "unicode", "utc", "micros", "max-count"],
)
def test_a_well_formed_page_reads_the_same_both_ways(change: dict[str, Any]) -> None:
    body = page(GOOD | change, GOOD | change | {"requestId": "req-2"})
    fast = decode_usage_page(body)
    assert fast is not None
    records, total, date = fast
    assert records == checked(body)
    assert (total, date) == (2, "2026-11-26")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"promptTokens": -1}, "field 'promptTokens' is not a non-negative integer"),
        ({"promptTokens": 10**12 + 1}, "field 'promptTokens' is out of range"),
        ({"completionTokens": True}, "field 'completionTokens' is not a non-negative integer"),
        ({"completionTokens": 1.5}, "field 'completionTokens' is not a non-negative integer"),
        ({"requestTime": "2026-11-26T10:00:00"}, "field 'requestTime' has no UTC offset"),
        ({"requestTime": "yesterday"}, "field 'requestTime' is not an RFC 3339 time"),
        ({"model": 7}, "field 'model' is not a string"),
        ({"endpoint": None}, "field 'endpoint' is not a string"),
    ],
)
def test_a_page_with_a_bad_record_is_left_to_the_checks_that_name_it(change: dict[str, Any], message: str) -> None:
    body = page(GOOD, GOOD | change)
    assert decode_usage_page(body) is None
    with pytest.raises(RecordError, match=message):
        checked(body)


def test_what_the_checks_accept_beyond_the_documented_form_is_still_read() -> None:
    """Counts as digit strings and a missing key are not the documented form, but the checks take
    them: the page goes that way, with the same result."""
    body = page(GOOD | {"promptTokens": "120"}, {k: v for k, v in GOOD.items() if k != "apikey"})
    assert decode_usage_page(body) is None
    assert checked(body)[0].prompt_tokens == 120
    assert checked(body)[1].apikey is None


def test_a_lone_surrogate_is_no_text_either_way() -> None:
    body = page(GOOD).replace(b'"ep-1"', b'"ep-\\ud800"')
    assert decode_usage_page(body) is None
    with pytest.raises(RecordError, match="field 'endpoint' is not valid Unicode text"):
        checked(body)


def test_an_error_envelope_is_not_a_page() -> None:
    assert decode_usage_page(page(GOOD, code=100500)) is None
    assert decode_usage_page(b"<html>busy</html>") is None
    assert decode_usage_page(page(GOOD, total="2"))[1] == "2"  # type: ignore[index]  # (`total` is checked by the caller)


@pytest.mark.parametrize(
    "when",
    ["2026-03-01t12:00:00z", "2026-03-01T23:59:59.99999951Z", "2026-03-01 12:00:00+08:00", "2026-03-01T12:00Z"],
)
def test_a_time_reads_alike_both_ways_at_the_edges_of_rfc_3339(when: str) -> None:
    """Either both readings take the time, with the same value, or the checks refuse it (and the
    one-pass reading leaves it to them): a record's fate never depends on its page's neighbours."""
    body = page(GOOD | {"requestTime": when})
    fast = decode_usage_page(body)
    try:
        expected = checked(body)
    except RecordError:
        assert fast is None
    else:
        assert fast is None or fast[0] == expected
