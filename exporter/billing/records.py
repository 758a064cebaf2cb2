"""The records the billing API lists, and their parsing from the JSON it answers.

Amounts parse to Decimal and a malformed record raises `RecordError` naming the field, never a
silent zero. A usage page takes a fast path when every record on it is well formed (a day's read
parses every one): msgspec decodes and checks it in one pass (`decode_usage_page`); anything it
refuses goes through the field-by-field checks, which name what is wrong.
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


class UsageRecord(NamedTuple):
    request_id: str
    request_time: dt.datetime
    model: str
    endpoint: str
    apikey: str
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


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


def _instant(record: dict[str, Any], name: str, where: str) -> dt.datetime:
    value = _text(record, name, where)
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
    """One usage record. The common, well-formed case takes a fast path; anything else goes
    through the field-by-field checks, which name the field that is wrong."""
    try:
        request_id, model, endpoint = raw["requestId"], raw["model"], raw["endpoint"]
        apikey = raw.get("apikey") or ""
        prompt, completion, cached = raw["promptTokens"], raw["completionTokens"], raw["promptCachedTokens"]
        request_time = dt.datetime.fromisoformat(raw["requestTime"])
    except (KeyError, TypeError, ValueError, AttributeError):
        pass
    else:
        if (
            type(request_id) is str
            and type(model) is str
            and type(endpoint) is str
            and type(apikey) is str
            and request_id.isascii()
            and model.isascii()
            and endpoint.isascii()
            and apikey.isascii()
            and type(prompt) is int
            and type(completion) is int
            and type(cached) is int
            and 0 <= prompt <= MAX_COUNT
            and 0 <= completion <= MAX_COUNT
            and 0 <= cached <= MAX_COUNT
            and request_time.tzinfo is not None
        ):
            return UsageRecord(request_id, request_time, model, endpoint, apikey, prompt, completion, cached)
    return _parse_usage_checked(raw, where)


Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]


class _Usage(msgspec.Struct, rename="camel"):
    """A usage record as the API documents it (what `parse_usage` accepts on its fast path)."""

    request_id: str
    request_time: str
    """Parsed as the checks parse it (`fromisoformat`): msgspec's RFC 3339 takes more (a lower-case
    `t` or `z`) and rounds fractions beyond microseconds where `fromisoformat` refuses them."""
    model: str
    endpoint: str
    prompt_tokens: Count
    completion_tokens: Count
    prompt_cached_tokens: Count
    apikey: str | None = None


class _UsageListing(msgspec.Struct, rename={"records": "list"}):
    records: list[_Usage] | None = None
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
    records = []
    for r in data.records or ():
        try:
            at = dt.datetime.fromisoformat(r.request_time)
        except ValueError:
            return None
        if at.tzinfo is None:
            return None
        records.append(
            UsageRecord(
                r.request_id,
                at,
                r.model,
                r.endpoint,
                r.apikey or "",
                r.prompt_tokens,
                r.completion_tokens,
                r.prompt_cached_tokens,
            )
        )
    return tuple(records), data.total, data.date


def _parse_usage_checked(raw: Any, where: str) -> UsageRecord:
    record = _object(raw, where)
    return UsageRecord(
        request_id=_text(record, "requestId", where),
        request_time=_instant(record, "requestTime", where),
        model=_text(record, "model", where),
        endpoint=_text(record, "endpoint", where),
        apikey=_text(record, "apikey", where, optional=True),
        prompt_tokens=_count(record, "promptTokens", where),
        completion_tokens=_count(record, "completionTokens", where),
        cached_prompt_tokens=_count(record, "promptCachedTokens", where),
    )


def parse_envelope(status: int, body: bytes, what: str) -> dict[str, Any]:
    """The `data` object of a successful envelope; raises for every other answer."""
    try:
        envelope = json.loads(body, parse_float=Decimal)
    except (ValueError, UnicodeDecodeError):
        if status >= 400:
            raise BillingAPIError(f"{what}: HTTP {status}", status=status, code=None, message="") from None
        raise RecordError(f"{what}: response is not JSON") from None
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
