"""The records the billing API lists, and their parsing from the JSON it answers.

Amounts parse to Decimal and a malformed record raises `RecordError` naming the field, never a
silent zero. A usage page takes a fast path when every record on it is well formed (a day's read
parses every one): msgspec decodes and checks it in one pass into `UsageRecord`s
(`decode_usage_page`); a page it refuses goes through the field-by-field checks (`parse_usage`),
which name what is wrong.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from decimal import Decimal
from typing import Annotated, Any, NamedTuple

import msgspec

from exporter.billing.errors import BillingAPIError, RecordError, SignatureRejected
from exporter.core.decimals import parse_decimal

MAX_COUNT = 10**12
"""Tokens of one request beyond this are refused: a day's sums must fit SQLite's 64-bit integers."""


class BillRecord(NamedTuple):
    period: str
    day: dt.date
    instance_id: str
    item: str
    product: str
    project_id: str
    payable_amount: Decimal
    usage_value: Decimal


Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]

Instant = Annotated[dt.datetime, msgspec.Meta(tz=True)]
"""An RFC 3339 time with its offset, as msgspec reads it (a lower-case `t` or `z` taken, fractions
beyond microseconds rounded); `parse_usage` reads it so too, and takes what `fromisoformat` takes
besides."""


class UsageRecord(
    msgspec.Struct,
    frozen=True,
    gc=False,
    rename={
        "request_id": "requestId",
        "request_time": "requestTime",
        "prompt_tokens": "promptTokens",
        "completion_tokens": "completionTokens",
        "cached_prompt_tokens": "promptCachedTokens",
    },
):
    """One request's usage, as the API documents it: a page of them is decoded and checked in one
    pass straight into these (`decode_usage_page`), no field read in Python until they are summed."""

    request_id: str
    request_time: Instant
    model: str
    endpoint: str
    prompt_tokens: Count
    completion_tokens: Count
    cached_prompt_tokens: Count
    apikey: str | None = None
    """The masked API key; None when the record has none (null or absent)."""


@dataclass(frozen=True)
class UsagePage:
    page_num: int
    records: tuple[UsageRecord, ...]
    total: int


def _field(record: dict[str, Any], name: str, where: str) -> Any:
    if name not in record:
        raise RecordError(f"{where}: missing field {name!r}")
    return record[name]


def _text(record: dict[str, Any], name: str, where: str, *, optional: bool = False) -> str:
    if optional and record.get(name) is None:
        return ""
    value = _field(record, name, where)
    if not isinstance(value, str):
        raise RecordError(f"{where}: field {name!r} is not a string")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: valid JSON, but no text a label or SQLite can hold
            raise RecordError(f"{where}: field {name!r} is not valid Unicode text") from None
    return value


def _decimal(record: dict[str, Any], name: str, where: str) -> Decimal:
    try:
        return parse_decimal(_field(record, name, where))
    except ValueError as error:
        raise RecordError(f"{where}: field {name!r} is {error}") from None


def _count(record: dict[str, Any], name: str, where: str) -> int:
    value = _field(record, name, where)
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RecordError(f"{where}: field {name!r} is not a non-negative integer")
    if value > MAX_COUNT:
        raise RecordError(f"{where}: field {name!r} is out of range (over {MAX_COUNT:,})")
    return value


def _instant(record: dict[str, Any], name: str, where: str, *, as_decoded: bool = False) -> dt.datetime:
    """A time with its offset, as `fromisoformat` reads it; `as_decoded`, as a usage page decoded
    in one pass reads it first (`Instant`), so that both readings of a record agree. Bills are read
    by `fromisoformat` alone: msgspec rounds a fraction beyond microseconds, which could move a
    bill's start to the next day."""
    value = _text(record, name, where)
    if as_decoded:
        try:
            return msgspec.convert(value, Instant)
        except msgspec.ValidationError:
            pass
    try:
        instant = dt.datetime.fromisoformat(value)
    except ValueError:
        raise RecordError(f"{where}: field {name!r} is not an RFC 3339 time: {value[:40]!r}") from None
    if instant.tzinfo is None:
        raise RecordError(f"{where}: field {name!r} has no UTC offset")
    return instant


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RecordError(f"{where}: not a JSON object")
    return value


def parse_bill(raw: Any, where: str, tz: dt.tzinfo) -> BillRecord:
    record = _object(raw, where)
    return BillRecord(
        period=_text(record, "period", where),
        day=_instant(record, "startTime", where).astimezone(tz).date(),
        instance_id=_text(record, "instanceId", where, optional=True),
        item=_text(record, "item", where, optional=True),
        product=_text(record, "product", where, optional=True),
        project_id=_text(record, "projectId", where, optional=True),
        payable_amount=_decimal(record, "payableAmount", where),
        usage_value=_decimal(record, "usageValue", where),
    )


def parse_usage(raw: Any, where: str) -> UsageRecord:
    """One usage record read field by field, each check naming the field that is wrong. It takes
    what `decode_usage_page` takes, with the same result, and more besides (counts as digit strings,
    a time `fromisoformat` reads)."""
    record = _object(raw, where)
    return UsageRecord(
        request_id=_text(record, "requestId", where),
        request_time=_instant(record, "requestTime", where, as_decoded=True),
        model=_text(record, "model", where),
        endpoint=_text(record, "endpoint", where),
        apikey=None if record.get("apikey") is None else _text(record, "apikey", where),
        prompt_tokens=_count(record, "promptTokens", where),
        completion_tokens=_count(record, "completionTokens", where),
        cached_prompt_tokens=_count(record, "promptCachedTokens", where),
    )


class _UsageListing(msgspec.Struct, rename={"records": "list"}):
    records: list[UsageRecord] | None = None
    total: int | str | None = None
    date: str | None = None


class _UsageEnvelope(msgspec.Struct):
    code: int
    data: _UsageListing | None = None


_USAGE_PAGE = msgspec.json.Decoder(_UsageEnvelope)


def decode_usage_page(body: bytes) -> tuple[tuple[UsageRecord, ...], object, object] | None:
    """The records, `total` and `date` of a successful usage page, decoded and checked in one pass
    when the page is as the API documents it; None otherwise (not JSON, an error envelope, a record
    with a field missing or of another type, a count out of range, a time without its offset, text
    that is no valid Unicode): the caller then reads it field by field, which names what is wrong."""
    try:
        envelope = _USAGE_PAGE.decode(body)
    except msgspec.DecodeError:  # (ValidationError is one)
        return None
    data = envelope.data
    if envelope.code != 0 or data is None:
        return None
    return tuple(data.records or ()), data.total, data.date


def _rejected_without_envelope(status: int, what: str) -> SignatureRejected:
    return SignatureRejected(f"{what}: signature rejected (HTTP {status})", status=status, code=None, message="")


def parse_envelope(status: int, body: bytes, what: str) -> dict[str, Any]:
    """The `data` object of a successful envelope; raises for every other answer. A 401 or 403 is a
    refused signature whatever its body (a proxy's or a gateway's page, not the API's envelope)."""
    try:
        envelope = json.loads(body, parse_float=Decimal)
    except (ValueError, UnicodeDecodeError):
        if status in (401, 403):
            raise _rejected_without_envelope(status, what) from None
        if status >= 400:
            raise BillingAPIError(f"{what}: HTTP {status}", status=status, code=None, message="") from None
        raise RecordError(f"{what}: response is not JSON") from None
    code_of = envelope.get("code") if isinstance(envelope, dict) else None
    if status in (401, 403) and (not isinstance(code_of, int) or isinstance(code_of, bool)):
        raise _rejected_without_envelope(status, what)
    if not isinstance(envelope, dict) or "code" not in envelope:
        raise RecordError(f"{what}: response has no envelope (`code` missing)")
    code = envelope["code"]
    if isinstance(code, bool) or not isinstance(code, int):
        raise RecordError(f"{what}: envelope `code` is not an integer")
    message = str(envelope.get("message") or envelope.get("reason") or "")[:300]
    if status in (401, 403):
        raise SignatureRejected(
            f"{what}: signature rejected (HTTP {status}, code {code}): {message}",
            status=status,
            code=code,
            message=message,
        )
    if code != 0 or status >= 400:
        raise BillingAPIError(
            f"{what}: API error (HTTP {status}, code {code}): {message}",
            status=status,
            code=code,
            message=message,
        )
    return _object(envelope.get("data"), f"{what}: envelope `data`")
