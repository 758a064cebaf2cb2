"""The stand-in service's vocabulary: endpoints, prices, faults, a day's usage, and the helpers
that make its records and bills deterministic functions of a seed."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from exporter.config.schema import PriceConfig

PRODUCT = "PRODUCT_INFERENCE_ENDPOINT"
ITEMS = ("ITEM_PROMPT_TOKEN", "ITEM_COMPLETION_TOKEN", "ITEM_CACHED_PROMPT_TOKEN")
PROMPT_ITEM, COMPLETION_ITEM, CACHED_PROMPT_ITEM = ITEMS
TENANT = "tenant-0001"
SIGNATURE_WINDOW = 300
BILLS_QUERY = {
    "period",
    "group_period",
    "start_time",
    "end_time",
    "page_num",
    "page_size",
    "project_id",
    "group_term",
    "product",
    "instance_id",
    "bill_id",
    "order_id",
}
USAGES_QUERY = {"date", "page_num", "page_size", "project_id", "model"}
MAX_PAGE_SIZE = 500


@dataclass(frozen=True)
class Endpoint:
    endpoint_id: str
    model: str
    project_id: str


DEFAULT_ENDPOINTS = (
    Endpoint("ep-20261101-alpha", "model-a", "proj-main"),
    Endpoint("ep-20261101-beta", "model-b", "proj-main"),
    Endpoint("ep-20261102-gamma", "model-a", "proj-lab"),
)
API_KEYS = ("sk-7f3a********", "sk-19cc********")
MILLION = Decimal(1_000_000)


@dataclass(frozen=True)
class SimPrice:
    """What the simulator bills per million tokens of one model, per billing item."""

    prompt: Decimal
    """Uncached prompt tokens (ITEM_PROMPT_TOKEN)."""
    cached_prompt: Decimal
    """Prompt tokens served from cache (ITEM_CACHED_PROMPT_TOKEN)."""
    completion: Decimal
    """Completion tokens (ITEM_COMPLETION_TOKEN)."""

    def per_item(self) -> dict[str, Decimal]:
        return {
            PROMPT_ITEM: self.prompt,
            CACHED_PROMPT_ITEM: self.cached_prompt,
            COMPLETION_ITEM: self.completion,
        }


def prices_from_config(prices: Iterable[PriceConfig]) -> dict[str, SimPrice]:
    """The exporter configuration's `prices` as the simulator's table, so one table (the config's)
    both bills and estimates. A missing cached price is the prompt price, as in the exporter's estimate."""
    return {
        p.model: SimPrice(
            prompt=p.prompt_per_million,
            cached_prompt=p.prompt_per_million if p.cached_prompt_per_million is None else p.cached_prompt_per_million,
            completion=p.completion_per_million,
        )
        for p in prices
    }


@dataclass
class Fault:
    """One injected fault, applied to the next `times` requests whose path starts with `path`.

    kind: status (HTTP `status`, envelope body, after `seconds`), code (HTTP 200, non-zero `code`), reset (the
    connection reset in the middle of the body), slow_body (the body stops in the middle for
    `seconds`, then the connection is closed), malformed
    (a body that is not JSON), drop (connection closed with no answer), delay (`seconds`, then
    the normal answer), bad_amount (one bill's payableAmount not a number), total_mismatch
    (`total` one higher than the records), bad_value (the first record's `field` set to `value`,
    any JSON value), plain_answer (tools and thinking ignored) / bad_tool_args (arguments
    not JSON) / stream_error / truncate / no_usage / stall (chat
    streams only).
    """

    kind: str
    path: str = "/"
    times: int = 1
    status: int = 500
    retry_after: int | None = None
    seconds: float = 0.0
    field: str = ""
    value: Any = None
    gate: threading.Event | None = None
    """A status answer waits for this to be set (a test then orders its answer after its own steps)."""


@dataclass
class UsageDay:
    count: int = 0
    order: list[int] | None = None
    newest_first: bool = False
    """List the newest record first (new records arrive at the head), as consoles often do."""
    removals: int = 0
    """How often records were taken out of the listing: the one change that can shrink the set of
    distinct records (reordering and repeating cannot; new records only add to it), so the only one
    after which billed token sums must be counted again from scratch."""

    def indices(self) -> list[int] | range:
        if self.order is not None:
            return self.order
        return range(self.count - 1, -1, -1) if self.newest_first else range(self.count)


class SimulatorError(Exception):
    def __init__(self, http_status: int, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.http_status = http_status
        self.code = code
        self.reason = reason
        self.message = message


class _RawList(list[str]):
    """A list whose items are already JSON text; `_encode` splices them in as they are."""


_SPLICE = "\u0000raw-list\u0000"


def _encode(payload: dict[str, Any]) -> bytes:
    data = payload.get("data")
    if not isinstance(data, dict) or not isinstance(raw := data.get("list"), _RawList):
        return json.dumps(payload).encode()
    text = json.dumps(payload | {"data": data | {"list": _SPLICE}})
    return text.replace(json.dumps(_SPLICE), "[" + ", ".join(raw) + "]", 1).encode()


def _json(item: str | dict[str, Any]) -> str:
    return item if isinstance(item, str) else json.dumps(item)


CONTENT_FAULTS = frozenset({"bad_amount", "bad_value", "total_mismatch"})
"""The faults that change what a listing says rather than how it travels (the in-process fake
applies these; the others are the wire's)."""


def corrupt(data: dict[str, Any], fault: Fault) -> dict[str, Any]:
    """A listing's `data` as a content fault changes it (unchanged for any other fault)."""
    if fault.kind == "bad_amount" and data["list"]:
        first = data["list"][0]
        if isinstance(first, str):  # a usage record, as JSON text
            data["list"] = _RawList([json.dumps(json.loads(first) | {"promptTokens": "12,5"}), *data["list"][1:]])
        else:
            data["list"][0] = first | {"payableAmount": "12,5"}
    if fault.kind == "bad_value" and data["list"]:
        first = data["list"][0]
        record = json.loads(first) if isinstance(first, str) else first
        data["list"] = _RawList([json.dumps(record | {fault.field: fault.value}), *map(_json, data["list"][1:])])
    if fault.kind == "total_mismatch":
        data["total"] = type(data["total"])(int(data["total"]) + 1)
    return data


def _mix(x: int) -> int:
    """A cheap, well-spread 64-bit hash of an integer (splitmix64's finaliser)."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def _unit(*parts: object) -> int:
    digest = hashlib.sha256("|".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big")


def _record_tokens(h: int) -> tuple[int, int, int]:
    """Prompt, completion and cached prompt tokens of the record whose hash is `h`: one definition
    for the usage records served and the bills computed from them."""
    prompt = 50 + h % 2000
    return prompt, 1 + (h >> 8) % 800, (h >> 16) % (prompt + 1)


@dataclass
class _DayTokens:
    """Billed token counts of one day's records, per (endpoint id, item); extended as records arrive."""

    basis: tuple[Any, ...]
    """What the counts were computed under (seed, endpoints, removals): any change means counting again."""
    counted: int
    """Records 0..counted-1 (those still listed) are in `tokens`."""
    tokens: dict[tuple[str, str], int]
