"""`export focus`: past months' billed charges as FOCUS 1.0 rows (CSV), for FinOps tools.

One row per charge: a billing day (in the billing time zone), an endpoint and a billing item. The
bills API lists a month by endpoint or by item, never by both at once (a record grouped by
endpoint names no item), so each endpoint's charges by item are asked for on their own
(`instance_id`), as the history source asks for them: 2 + endpoints requests a month. A month's
rows are written only when they add up, to the last digit, to its bills by endpoint and its bills
by item; a month that does not, that the API refuses or lists nothing for is left out and named
(never written as zeros, never in part).

Amounts are the API's exact decimals in positional notation, each with a decimal point: a reader
that infers types (pandas, and so focus-validator, among them) takes a column of whole numbers for
integers, and FOCUS's quantities and costs are decimals. Only complete days: nothing from the
start of today (its bill is still growing). docs/focus.md says where each column comes from.
"""

from __future__ import annotations

import csv
import datetime as dt
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import TextIO
from urllib.parse import urlsplit

from exporter.billing import BillingAPI, BillingError, SignatureRejected, why
from exporter.core.clock import Clock, first_day, period_at, period_index
from exporter.core.logs import get_logger
from exporter.model.snapshots import DailyAmount, MonthHistory
from exporter.replay.backfill import replacing
from exporter.sources.history import fetch_month, sole

log = get_logger(__name__)

CURRENCY = re.compile(r"[A-Z]{3}")
PRODUCT = "PRODUCT_INFERENCE_ENDPOINT"
"""The product of a charge whose records name none: the one the API's documentation names."""
SERVICE_CATEGORY = "AI and Machine Learning"
UNITS = {"TOKEN": "Tokens", "TOKENS": "Tokens"}
"""A billing item's unit (FOCUS's Unit Format), by the last word of its code: ITEM_PROMPT_TOKEN."""
OTHER_UNIT = "Units"
"""FOCUS's generic count, for an item whose code names no unit known here (ConsumedUnit and
PricingUnit must not be null on a usage charge)."""
COLUMNS = (
    "AvailabilityZone", "BilledCost", "BillingAccountId", "BillingAccountName", "BillingCurrency",
    "BillingPeriodEnd", "BillingPeriodStart", "ChargeCategory", "ChargeClass", "ChargeDescription",
    "ChargeFrequency", "ChargePeriodEnd", "ChargePeriodStart", "CommitmentDiscountCategory",
    "CommitmentDiscountId", "CommitmentDiscountName", "CommitmentDiscountStatus", "CommitmentDiscountType",
    "ConsumedQuantity", "ConsumedUnit", "ContractedCost", "ContractedUnitPrice", "EffectiveCost",
    "InvoiceIssuerName", "ListCost", "ListUnitPrice", "PricingCategory", "PricingQuantity", "PricingUnit",
    "ProviderName", "PublisherName", "RegionId", "RegionName", "ResourceId", "ResourceName", "ResourceType",
    "ServiceCategory", "ServiceName", "SkuId", "SkuPriceId", "SubAccountId", "SubAccountName", "Tags",
)  # fmt: skip
"""FOCUS 1.0's columns, every one of them, in alphabetical order."""
VALIDATOR_COLUMNS = (
    ("ChargeType", "ChargeCategory"),
    ("InvoiceIssuer", "InvoiceIssuerName"),
    ("Provider", "ProviderName"),
    ("Publisher", "PublisherName"),
    ("ResourceID", "ResourceId"),
)
"""(name, the FOCUS 1.0 column it copies), written after FOCUS's own: focus-validator 1.0.0's
rules for FOCUS 1.0 still require these names of the drafts before it (and its SkuPriceId rule
reads ChargeType), so without them it fails any file."""
Row = dict[str, str | None]
Key = tuple[dt.date, str]
"""A day and an endpoint id or a billing item."""
Sums = dict[Key, tuple[Decimal, Decimal]]


class FocusError(Exception):
    """Nothing could be written: no currency, the credentials refused, or no month fetched."""


class MissingCurrency(FocusError):
    """The account's `billing.currency` is not set: a FOCUS row names its currency (a config problem)."""


class Mismatch(Exception):
    """A month's charges by endpoint and item do not add up to its bills."""


@dataclass(frozen=True, order=True)
class Charge:
    """What one row says: an endpoint's charge for one billing item on one billing day."""

    day: dt.date
    endpoint_id: str
    item: str
    product: str
    project_id: str
    billed: Decimal
    usage: Decimal


@dataclass(frozen=True)
class Account:
    """What every row says of the account: its identifiers, currency and provider."""

    account_id: str
    account_name: str | None
    currency: str
    provider: str


@dataclass(frozen=True)
class Result:
    written: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]
    """(period, why) for each month left out."""
    rows: int
    billed: Decimal
    """The rows' BilledCost summed: what the bills of the days written come to."""


# --- the charges --------------------------------------------------------------------------


def _sums(entries: Iterable[tuple[Key, Decimal, Decimal]]) -> Sums:
    sums: Sums = {}
    for key, billed, usage in entries:
        so_far = sums.get(key, (Decimal(0), Decimal(0)))
        sums[key] = (so_far[0] + billed, so_far[1] + usage)
    return sums


def _check(
    found: Sequence[Charge], bills: Iterable[DailyAmount], before: dt.date, key: Callable[[Charge], str], by: str
) -> None:
    """Mismatch naming the first (day, key) where the charges' sums differ from the bills `by` key."""
    ours = _sums(((c.day, key(c)), c.billed, c.usage) for c in found)
    theirs = _sums(((a.day, a.key), a.payable, a.usage) for a in bills if a.day < before)
    nothing = (Decimal(0), Decimal(0))
    for day, name in sorted(ours.keys() | theirs.keys()):
        if ours.get((day, name), nothing) != theirs.get((day, name), nothing):
            raise Mismatch(
                f"its charges by endpoint and item do not add up to its bills by {by} ({name or '(none)'} on {day})"
            )


def charges(month: MonthHistory, before: dt.date) -> tuple[Charge, ...]:
    """The month's charges of the days before `before`, by day, endpoint and item, in that order;
    Mismatch when they do not add up to its bills by endpoint and by item (day by day, payable and
    usage). A charge's project is one its endpoint's bills by endpoint give it that day: the charge's
    own when it is one of them (an endpoint billed under several projects), else their only one
    (none if several: an endpoint's own listing may label its lines otherwise)."""
    projects: dict[Key, set[str]] = {}
    for a in month.by_endpoint:
        projects.setdefault((a.day, a.key), set()).add(a.project_id)

    def project(endpoint_id: str, a: DailyAmount) -> str:
        given = projects.get((a.day, endpoint_id), set())
        return a.project_id if a.project_id in given else sole(given)

    found = sorted(
        Charge(a.day, endpoint_id, a.key, a.product or PRODUCT, project(endpoint_id, a), a.payable, a.usage)
        for endpoint_id, amounts in month.items_by_endpoint.items()
        for a in amounts
        if a.day < before
    )
    _check(found, month.by_endpoint, before, lambda c: c.endpoint_id, "endpoint")
    _check(found, month.by_item, before, lambda c: c.item, "item")
    return tuple(found)


def _month(client: BillingAPI, period: str, today: dt.date) -> tuple[Charge, ...] | str:
    """The month's charges of its complete days, or why it is left out. SignatureRejected raises."""
    try:
        month = fetch_month(client, period, today, client.concurrency)
    except SignatureRejected:
        raise
    except BillingError as error:
        said = why(error)
        log.warning(f"month skipped: {said}", period=period, error=str(error)[:300])
        return said
    if month is None:
        log.warning("month skipped: the API listed no bills for it", period=period)
        return "the API listed no bills for it"
    try:
        found = charges(month, today)
    except Mismatch as error:
        log.warning("month skipped: its charges do not add up", period=period, error=str(error))
        return str(error)
    if not found:
        return "no complete day yet"
    return found


def fetch(
    client: BillingAPI, clock: Clock, periods: Sequence[str]
) -> tuple[dict[str, tuple[Charge, ...]], list[tuple[str, str]]]:
    """Each month's charges of its complete days, and (period, why) for each month left out. A
    refused signature ends the fetch (FocusError): every month would be refused alike."""
    today = clock.today()
    found: dict[str, tuple[Charge, ...]] = {}
    skipped: list[tuple[str, str]] = []
    for period in periods:
        try:
            month = _month(client, period, today)
        except SignatureRejected as error:
            raise FocusError(str(error)) from None
        if isinstance(month, str):
            skipped.append((period, month))
        else:
            found[period] = month
    return found, skipped


# --- the rows -----------------------------------------------------------------------------


def number(amount: Decimal) -> str:
    """The decimal itself, in positional notation (the API's digits, or an exact sum of them), with
    a decimal point; zero without a sign."""
    text = format(amount.copy_abs() if amount.is_zero() else amount, "f")
    return text if "." in text else f"{text}.0"


def _utc(instant: dt.datetime) -> str:
    return instant.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _words(code: str, prefix: str) -> str:
    """An API code as words: PRODUCT_INFERENCE_ENDPOINT → Inference Endpoint."""
    return " ".join(word.capitalize() for word in code.removeprefix(prefix).split("_") if word)


def unit(item: str) -> str:
    return UNITS.get(item.rsplit("_", 1)[-1], OTHER_UNIT)


def billing_period(clock: Clock, period: str) -> tuple[str, str]:
    """The month's [start, end) in UTC: from midnight of its first day in the billing time zone."""
    following = first_day(period_at(period_index(period) + 1))
    return _utc(clock.day_start(first_day(period))), _utc(clock.day_start(following))


def row(charge: Charge, period: tuple[str, str], clock: Clock, account: Account) -> Row:
    """The FOCUS 1.0 columns of one charge (None: null)."""
    billed, usage, service = number(charge.billed), number(charge.usage), _words(charge.product, "PRODUCT_")
    return {
        "AvailabilityZone": None,
        "BilledCost": billed,
        "BillingAccountId": account.account_id,
        "BillingAccountName": account.account_name,
        "BillingCurrency": account.currency,
        "BillingPeriodEnd": period[1],
        "BillingPeriodStart": period[0],
        "ChargeCategory": "Usage",  # (every line is of an item consumed; money given back on it, a refund, too)
        "ChargeClass": None,
        "ChargeDescription": f"{_words(charge.item, 'ITEM_')} on {service}"
        + (f" {charge.endpoint_id}" if charge.endpoint_id else ", of no endpoint"),
        "ChargeFrequency": "Usage-Based",
        "ChargePeriodEnd": _utc(clock.day_start(charge.day + dt.timedelta(days=1))),
        "ChargePeriodStart": _utc(clock.day_start(charge.day)),
        "CommitmentDiscountCategory": None,
        "CommitmentDiscountId": None,
        "CommitmentDiscountName": None,
        "CommitmentDiscountStatus": None,
        "CommitmentDiscountType": None,
        "ConsumedQuantity": usage,
        "ConsumedUnit": unit(charge.item),
        "ContractedCost": billed,
        "ContractedUnitPrice": None,
        "EffectiveCost": billed,
        "InvoiceIssuerName": account.provider,
        "ListCost": billed,
        "ListUnitPrice": None,
        "PricingCategory": "Standard",
        "PricingQuantity": usage,
        "PricingUnit": unit(charge.item),
        "ProviderName": account.provider,
        "PublisherName": account.provider,
        "RegionId": None,
        "RegionName": None,
        "ResourceId": charge.endpoint_id or None,  # (a charge the bills tie to no endpoint: of no resource)
        "ResourceName": None,
        "ResourceType": service if charge.endpoint_id else None,
        "ServiceCategory": SERVICE_CATEGORY,
        "ServiceName": service,
        "SkuId": charge.item,
        "SkuPriceId": charge.item,
        "SubAccountId": charge.project_id or None,
        "SubAccountName": None,
        "Tags": None,
    }


def write(out: TextIO, months: Mapping[str, Sequence[Charge]], clock: Clock, account: Account) -> int:
    """The header and a row per charge, months in order, each month's charges as `charges` orders
    them; a null is an empty field. Returns the number of rows."""
    header = [*COLUMNS, *(name for name, _ in VALIDATOR_COLUMNS)]
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    rows = 0
    for period in sorted(months):
        bounds = billing_period(clock, period)
        for charge in months[period]:
            values = row(charge, bounds, clock, account)
            writer.writerow([*(values[c] for c in COLUMNS), *(values[source] for _, source in VALIDATOR_COLUMNS)])
            rows += 1
    return rows


def export(
    client: BillingAPI,
    clock: Clock,
    periods: Sequence[str],
    output: Path,
    *,
    account: str,
    currency: str,
    account_name: str | None = None,
    provider: str | None = None,
) -> Result:
    """Fetch `periods` (oldest first) and write their charges to `output` as FOCUS 1.0 CSV.

    `account`: BillingAccountId; `account_name`: BillingAccountName (null when None); `currency`:
    the account's `billing.currency`; `provider`: ProviderName, PublisherName and InvoiceIssuerName
    (the billing API's host when None). MissingCurrency when `currency` is not an ISO 4217 code,
    before anything is fetched or opened; FocusError when nothing could be written (`output` is
    then left as it was); OSError when `output` cannot be written, FileExistsError when it is there
    and is not a regular file (it is left as it is too).
    """
    if not account:
        raise ValueError("account: BillingAccountId must not be empty")
    if not CURRENCY.fullmatch(currency):
        where = f"account {account_name}: " if account_name else ""
        said = "is not set" if not currency else f"{currency!r} is not an ISO 4217 currency code"
        raise MissingCurrency(
            f"{where}billing.currency {said}: a FOCUS export names the currency of every amount "
            "(set it to the account's, e.g. CNY)"
        )
    named = Account(account, account_name, currency, provider or urlsplit(client.base_url).hostname or client.base_url)
    with replacing(output) as out:
        found, skipped = fetch(client, clock, periods)
        if not found:
            why = "; ".join(f"{period}: {reason}" for period, reason in skipped)
            raise FocusError(f"nothing written: no month of {periods[0]} … {periods[-1]} could be fetched ({why})")
        rows = write(out, found, clock, named)
    return Result(
        written=tuple(sorted(found)),
        skipped=tuple(skipped),
        rows=rows,
        billed=sum((c.billed for month in found.values() for c in month), Decimal(0)),
    )
