"""export focus: the billed charges as FOCUS 1.0 rows, a row per billing day, endpoint and item.

Checked row by row against the simulator's ledger in process (the exact decimals, the billing days
in UTC, the months left out), then end to end: an export over HTTP, judged by the FinOps
Foundation's focus-validator as a process, which must pass every rule of FOCUS 1.0 on it and
fail a file broken on purpose.
"""

from __future__ import annotations

import csv
import datetime as dt
import importlib.util
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from exporter.billing import GROUP_TERM_INSTANCE, BillingClient, BillingUnavailable, BillRecord, SignatureRejected
from exporter.config.load import validate
from exporter.core.clock import Clock, FrozenClock
from exporter.replay.focus import (
    COLUMNS,
    VALIDATOR_COLUMNS,
    Account,
    Charge,
    FocusError,
    MissingCurrency,
    Result,
    billing_period,
    export,
    number,
    row,
    unit,
)
from exporter.sim import ITEMS, Fault, Simulator, SimulatorServer, SpendModel
from tests.conftest import SHANGHAI, billing_section
from tests.fakes import FakeBilling
from tests.test_cli import run, write_config

HEADER = [*COLUMNS, *(name for name, _ in VALIDATOR_COLUMNS)]
NULL = (
    "AvailabilityZone", "ChargeClass", "CommitmentDiscountCategory", "CommitmentDiscountId", "CommitmentDiscountName",
    "CommitmentDiscountStatus", "CommitmentDiscountType", "ContractedUnitPrice", "ListUnitPrice", "RegionId",
    "RegionName", "ResourceName", "SubAccountName", "Tags",
)  # fmt: skip
"""The columns the API gives nothing for: null (an empty field) in every row."""
FIXED = (
    "BillingAccountId", "BillingAccountName", "BillingCurrency", "ChargeCategory", "ChargeFrequency",
    "PricingCategory", "ServiceCategory", "ServiceName", "ResourceType", "ConsumedUnit", "PricingUnit",
    "ProviderName", "PublisherName", "InvoiceIssuerName",
)  # fmt: skip
"""The columns alike in every row of one account's export."""


def read(path: Path) -> list[dict[str, str]]:
    with path.open(encoding="utf-8", newline="") as lines:
        reader = csv.DictReader(lines)
        assert reader.fieldnames == HEADER
        return list(reader)


def focus(client: Any, clock: Clock, periods: list[str], output: Path, **overrides: Any) -> Result:
    """`export` as the CLI calls it for an account `prod` of a config listing `accounts`."""
    arguments: dict[str, Any] = {"account": "prod", "account_name": "prod", "currency": "CNY"} | overrides
    return export(client, clock, periods, output, **arguments)


# --- the rows, against the simulator's ledger ---------------------------------------------------


def test_a_row_per_day_endpoint_and_item_with_the_exact_decimals_of_the_bills(
    sim: Simulator, fake: FakeBilling, clock: Clock, tmp_path: Path
) -> None:
    output = tmp_path / "focus.csv"
    result = focus(fake, clock, ["2026-09", "2026-10"], output)
    rows = read(output)
    assert len(rows) == (30 + 31) * len(sim.endpoints) * len(ITEMS)
    assert result.written == ("2026-09", "2026-10")
    assert not result.skipped
    assert result.rows == len(rows)
    projects = {e.endpoint_id: e.project_id for e in sim.endpoints}
    endpoints = {e.endpoint_id: e for e in sim.endpoints}
    for r in rows:
        day = (dt.datetime.fromisoformat(r["ChargePeriodStart"]).astimezone(SHANGHAI)).date()
        billed, usage = sim.charge(f"{day:%Y-%m}", day, endpoints[r["ResourceId"]], r["SkuId"])
        assert Decimal(r["BilledCost"]) == billed, r
        assert "." in r["BilledCost"], r
        assert Decimal(r["ConsumedQuantity"]) == usage, r
        assert r["ConsumedQuantity"].endswith(".0"), r  # tokens: whole numbers, written as decimals
        assert r["EffectiveCost"] == r["ListCost"] == r["ContractedCost"] == r["BilledCost"]
        assert r["PricingQuantity"] == r["ConsumedQuantity"]
        assert r["SubAccountId"] == projects[r["ResourceId"]]
        assert r["SkuPriceId"] == r["SkuId"]
        assert all(r[name] == r[source] for name, source in VALIDATOR_COLUMNS)
        assert all(r[name] == "" for name in NULL), r
        assert {k: r[k] for k in FIXED} == {
            "BillingAccountId": "prod",
            "BillingAccountName": "prod",
            "BillingCurrency": "CNY",
            "ChargeCategory": "Usage",
            "ChargeFrequency": "Usage-Based",
            "PricingCategory": "Standard",
            "ServiceCategory": "AI and Machine Learning",
            "ServiceName": "Inference Endpoint",
            "ResourceType": "Inference Endpoint",
            "ConsumedUnit": "Tokens",
            "PricingUnit": "Tokens",
            "ProviderName": "simulator",  # the billing API's host, none being given
            "PublisherName": "simulator",
            "InvoiceIssuerName": "simulator",
        }
    # Summed exactly, the rows are the simulator's month totals by endpoint, by item and in all.
    for period in result.written:
        truth = sim.bill_totals(period)
        month = [r for r in rows if r["BillingPeriodStart"] == billing_period(clock, period)[0]]
        for column, keys in (("ResourceId", [e.endpoint_id for e in sim.endpoints]), ("SkuId", list(ITEMS))):
            sums = {key: sum((Decimal(r["BilledCost"]) for r in month if r[column] == key), Decimal(0)) for key in keys}
            assert sums == {key: truth[key] for key in keys}, (period, column)
        assert sum((Decimal(r["BilledCost"]) for r in month), Decimal(0)) == truth["total"]
    assert result.billed == sim.bill_totals("2026-09")["total"] + sim.bill_totals("2026-10")["total"]
    # One row per charge, in a fixed order: by day, endpoint, item.
    order = [(r["ChargePeriodStart"], r["ResourceId"], r["SkuId"]) for r in rows]
    assert order == sorted(set(order))
    again = tmp_path / "again.csv"
    focus(fake, clock, ["2026-09", "2026-10"], again)
    assert again.read_bytes() == output.read_bytes()


def test_a_charge_period_is_the_billing_day_in_utc(
    sim: Simulator, fake: FakeBilling, clock: Clock, tmp_path: Path
) -> None:
    """A Shanghai billing day starts at 16:00Z the day before; the month at 16:00Z on the last day of the one before."""
    output = tmp_path / "focus.csv"
    focus(fake, clock, ["2026-10"], output)
    day = [r for r in read(output) if r["ChargePeriodStart"] == "2026-10-04T16:00:00Z"]
    assert len(day) == len(sim.endpoints) * len(ITEMS)
    assert {(r["ChargePeriodEnd"], r["BillingPeriodStart"], r["BillingPeriodEnd"]) for r in day} == {
        ("2026-10-05T16:00:00Z", "2026-09-30T16:00:00Z", "2026-10-31T16:00:00Z")
    }
    first = dt.datetime.fromisoformat(day[0]["ChargePeriodStart"])
    assert first.astimezone(SHANGHAI) == dt.datetime(2026, 10, 5, tzinfo=SHANGHAI)


def test_a_day_the_clocks_change_is_as_long_as_it_is() -> None:
    """In Berlin 25 October 2026 lasts 25 hours (summer time ends), and the billing month of
    October starts on 30 September at 22:00Z and ends on 31 October at 23:00Z."""
    clock = Clock(ZoneInfo("Europe/Berlin"))
    charge = Charge(dt.date(2026, 10, 25), "ep", "ITEM_PROMPT_TOKEN", "PRODUCT_INFERENCE_ENDPOINT", "",
                    Decimal("1E+2"), Decimal(0))  # fmt: skip
    period = billing_period(clock, "2026-10")
    assert period == ("2026-09-30T22:00:00Z", "2026-10-31T23:00:00Z")
    values = row(charge, period, clock, Account("prod", None, "EUR", "Acme"))
    assert (values["ChargePeriodStart"], values["ChargePeriodEnd"]) == ("2026-10-24T22:00:00Z", "2026-10-25T23:00:00Z")
    assert (values["BilledCost"], values["ConsumedQuantity"]) == ("100.0", "0.0")
    assert values["SubAccountId"] is None
    assert values["BillingAccountName"] is None
    assert values["ChargeDescription"] == "Prompt Token on Inference Endpoint ep"
    assert set(values) == set(COLUMNS)


@pytest.mark.parametrize(
    ("amount", "text"),
    [
        ("12.30", "12.30"),  # the API's digits, trailing zero kept
        ("100", "100.0"),  # a point, so that a reader takes the column for decimals
        ("1E+2", "100.0"),
        ("0.00000001", "0.00000001"),
        ("1.5E-10", "0.00000000015"),
        ("0E-8", "0.00000000"),
        ("-0", "0.0"),
        ("-3.5", "-3.5"),
        ("123456789012345.123456789012345678", "123456789012345.123456789012345678"),  # beyond a float
    ],
)
def test_amounts_are_the_exact_decimals_in_positional_notation(amount: str, text: str) -> None:
    assert number(Decimal(amount)) == text


def test_money_given_back_on_a_line_is_usage_with_what_it_consumed() -> None:
    """FOCUS 1.0's `Usage` holds positive or negative charges for what was consumed, refunds
    included: a line revised below zero was written as `Credit` with its usage taken out of
    ConsumedQuantity, which then no longer summed to the bills' usage."""
    clock = Clock(SHANGHAI)
    period = billing_period(clock, "2026-10")
    account = Account("prod", None, "CNY", "Acme")
    for billed in (Decimal("-12.5"), Decimal("12.5")):
        charge = Charge(dt.date(2026, 10, 5), "ep", "ITEM_PROMPT_TOKEN", "PRODUCT_INFERENCE_ENDPOINT", "", billed,
                        Decimal(1000))  # fmt: skip
        values = row(charge, period, clock, account)
        assert (values["ChargeCategory"], values["ConsumedQuantity"]) == ("Usage", number(charge.usage))
        assert values["ConsumedUnit"] == values["PricingUnit"] == "Tokens"
        assert values["BilledCost"] == values["EffectiveCost"] == number(billed)


def test_a_unit_comes_from_the_item() -> None:
    assert [unit(item) for item in ITEMS] == ["Tokens"] * 3
    assert unit("ITEM_IMAGE") == "Units"  # an item whose unit is not known here: FOCUS's generic count


def test_this_month_has_only_its_complete_days(sim: Simulator, fake: FakeBilling, clock: Clock, frozen: FrozenClock,
                                               tmp_path: Path) -> None:  # fmt: skip
    output = tmp_path / "focus.csv"
    result = focus(fake, clock, ["2026-11"], output)  # today is 22 November
    starts = {r["ChargePeriodStart"] for r in read(output)}
    assert len(starts) == 21
    assert max(starts) == "2026-11-20T16:00:00Z"
    days = [dt.date(2026, 11, d) for d in range(1, 22)]
    expected = sum((sim.charge("2026-11", d, e, i)[0] for d in days for e in sim.endpoints for i in ITEMS), Decimal(0))
    assert result.billed == expected

    frozen.set(dt.datetime(2026, 11, 1, 10, 0, tzinfo=SHANGHAI))
    result = focus(fake, clock, ["2026-10", "2026-11"], output)
    assert result.written == ("2026-10",)
    assert result.skipped == (("2026-11", "no complete day yet"),)


def test_a_month_refused_or_listing_nothing_is_left_out_never_zeros(
    sim: Simulator, fake: FakeBilling, clock: Clock, tmp_path: Path
) -> None:
    sim.spend = SpendModel(start=dt.date(2026, 9, 1))  # no bills before September
    sim.inject(Fault("status", "/api/v1/bills", status=400, times=1))  # the first request: July's
    output = tmp_path / "focus.csv"
    result = focus(fake, clock, ["2026-07", "2026-08", "2026-09", "2026-10"], output)
    assert result.written == ("2026-09", "2026-10")
    assert result.skipped == (
        ("2026-07", "the API refused it"),
        ("2026-08", "the API listed no bills for it"),
    )
    assert {r["BillingPeriodStart"] for r in read(output)} == {"2026-08-31T16:00:00Z", "2026-09-30T16:00:00Z"}

    output.write_text("an earlier export\n")
    sim.inject(Fault("status", "/api/v1/bills", status=400, times=1))
    with pytest.raises(FocusError) as refused:
        focus(fake, clock, ["2026-07", "2026-08"], output)
    assert str(refused.value) == (
        "nothing written: no month of 2026-07 … 2026-08 could be fetched"
        " (2026-07: the API refused it; 2026-08: the API listed no bills for it)"
    )
    assert output.read_text() == "an earlier export\n"
    assert [p.name for p in tmp_path.iterdir()] == ["focus.csv"]


class Tampered:
    """The fake's answers, but an endpoint's charges by item changed for one month as `how` says."""

    def __init__(self, inner: FakeBilling, how: str) -> None:
        self.inner, self.how = inner, how
        self.base_url, self.project_id, self.page_size = inner.base_url, inner.project_id, inner.page_size
        self.concurrency = inner.concurrency

    def bills(self, period: str, group_term: str, instance_id: str = "") -> list[BillRecord]:
        records = self.inner.bills(period, group_term, instance_id)
        if period != "2026-10" or instance_id != "ep-20261101-beta":
            return records
        last = records[-1]
        if self.how == "dropped":
            return records[:-1]
        other = next(item for item in ITEMS if item != last.item)  # the same amount under another item
        return [*records[:-1], last._replace(item=other)]


@pytest.mark.parametrize(
    ("how", "why"),
    [
        ("dropped", "its charges by endpoint and item do not add up to its bills by endpoint "
                    "(ep-20261101-beta on 2026-10-31)"),
        ("relabelled", "its charges by endpoint and item do not add up to its bills by item "
                       "(ITEM_CACHED_PROMPT_TOKEN on 2026-10-31)"),
    ],
)  # fmt: skip
def test_charges_that_do_not_add_up_to_the_bills_leave_the_month_out(
    fake: FakeBilling, clock: Clock, tmp_path: Path, how: str, why: str
) -> None:
    output = tmp_path / "focus.csv"
    result = focus(Tampered(fake, how), clock, ["2026-09", "2026-10"], output)
    assert result.written == ("2026-09",)
    assert result.skipped == (("2026-10", why),)


class Unattributed:
    """The fake's answers, with a 5.00 charge on 7 October the bills tie to no endpoint (no
    `instanceId`): as the API lists such a charge, the whole account's when asked for an empty
    `instance_id`."""

    DAY = dt.date(2026, 10, 7)

    def __init__(self, inner: FakeBilling, endpoints_project: str | None = None) -> None:
        """`endpoints_project`: the project each endpoint's own listing labels its lines with
        (another than the account's listings give them)."""
        self.inner, self.endpoints_project = inner, endpoints_project
        self.base_url, self.project_id, self.page_size = inner.base_url, inner.project_id, inner.page_size
        self.concurrency = inner.concurrency

    def bills(self, period: str, group_term: str, instance_id: str = "") -> list[BillRecord]:
        records = self.inner.bills(period, group_term, instance_id)
        if instance_id and self.endpoints_project is not None:
            records = [r._replace(project_id=self.endpoints_project) for r in records]
        if period != "2026-10" or instance_id:
            return records
        item = "" if group_term == GROUP_TERM_INSTANCE else "ITEM_SERVICE_FEE"
        fee = BillRecord(
            period, self.DAY, "", item, "PRODUCT_INFERENCE_ENDPOINT", "proj-main", Decimal("5.00"), Decimal(0)
        )
        return [*records, fee]


class TwoProjects:
    """Bills of one day in which endpoint ep-a is billed under two projects (7.00 under p1, 1.00
    under p2) and ep-b under p1, grouped by endpoint or by item as the API groups them."""

    base_url, project_id, page_size, concurrency = "https://billing.example.com", "", 100, 1
    DAY = dt.date(2026, 11, 2)
    LINES = (("ep-a", "p1", Decimal("7.00")), ("ep-a", "p2", Decimal("1.00")), ("ep-b", "p1", Decimal("2.00")))

    def bills(self, period: str, group_term: str, instance_id: str = "") -> list[BillRecord]:
        sums: dict[tuple[str, str, str], Decimal] = {}
        for endpoint, project, amount in self.LINES:
            if period == "2026-11" and instance_id in ("", endpoint):
                key = (endpoint if group_term == GROUP_TERM_INSTANCE or instance_id else "",
                       "" if group_term == GROUP_TERM_INSTANCE else "ITEM_PROMPT_TOKEN", project)  # fmt: skip
                sums[key] = sums.get(key, Decimal(0)) + amount
        return [
            BillRecord(period, self.DAY, endpoint, item, "PRODUCT_INFERENCE_ENDPOINT", project, amount, amount * 100)
            for (endpoint, item, project), amount in sorted(sums.items())
        ]


def test_an_endpoint_billed_under_two_projects_on_a_day_has_each_charge_under_its_own(tmp_path: Path) -> None:
    clock = Clock(SHANGHAI, FrozenClock(dt.datetime(2026, 11, 10, 4, tzinfo=dt.UTC)))
    output = tmp_path / "focus.csv"
    focus(TwoProjects(), clock, ["2026-11"], output)
    rows = {(r["ResourceId"], r["SubAccountId"]): r["BilledCost"] for r in read(output)}
    assert rows == {("ep-a", "p1"): "7.00", ("ep-a", "p2"): "1.00", ("ep-b", "p1"): "2.00"}


@pytest.mark.parametrize("endpoints_project", [None, "proj-other"])
def test_a_charge_of_no_endpoint_is_a_row_of_no_resource(
    fake: FakeBilling, clock: Clock, tmp_path: Path, endpoints_project: str | None
) -> None:
    """Also when an endpoint's own listing labels its lines with another project than the account's
    listing does: the charges of no endpoint are the fee alone."""
    output = tmp_path / "focus.csv"
    result = focus(Unattributed(fake, endpoints_project), clock, ["2026-10"], output)
    assert [r["SkuId"] for r in read(output) if not r["ResourceId"]] == ["ITEM_SERVICE_FEE"]
    assert result.written == ("2026-10",)
    (fee,) = [r for r in read(output) if r["SkuId"] == "ITEM_SERVICE_FEE"]
    assert (fee["BilledCost"], fee["ResourceId"], fee["ResourceType"]) == ("5.00", "", "")
    assert fee["ChargePeriodStart"] == "2026-10-06T16:00:00Z"
    assert result.billed == sum((Decimal(r["BilledCost"]) for r in read(output)), Decimal(0))
    assert result.billed == focus(fake, clock, ["2026-10"], tmp_path / "without.csv").billed + Decimal("5.00")


class Unreachable:
    base_url, project_id, page_size, concurrency = "https://billing.example", "", 100, 1

    def bills(self, period: str, group_term: str, instance_id: str = "") -> list[BillRecord]:
        raise BillingUnavailable("GET https://billing.example/api/v1/bills/details: connection refused")


def test_a_month_that_could_not_be_fetched_says_why(clock: Clock, tmp_path: Path) -> None:
    with pytest.raises(FocusError, match=r"\(2026-10: the API could not be reached, or kept failing\)"):
        focus(Unreachable(), clock, ["2026-10"], tmp_path / "focus.csv")


@pytest.mark.parametrize(
    ("currency", "name", "error"),
    [
        ("", None, "billing.currency is not set: a FOCUS export names the currency of every amount "
                   "(set it to the account's, e.g. CNY)"),
        ("", "prod", "account prod: billing.currency is not set: a FOCUS export names the currency of every amount "
                     "(set it to the account's, e.g. CNY)"),
        ("cny", None, "billing.currency 'cny' is not an ISO 4217 currency code: a FOCUS export names the currency "
                      "of every amount (set it to the account's, e.g. CNY)"),
    ],
)  # fmt: skip
def test_no_currency_is_refused_before_anything_is_fetched_or_written(
    sim: Simulator, fake: FakeBilling, clock: Clock, tmp_path: Path, currency: str, name: str | None, error: str
) -> None:
    output = tmp_path / "focus.csv"
    output.write_text("an earlier export\n")
    with pytest.raises(MissingCurrency) as refused:
        focus(fake, clock, ["2026-10"], output, currency=currency, account_name=name)
    assert str(refused.value) == error
    assert isinstance(refused.value, FocusError)
    assert sim.requests_served == {}
    assert output.read_text() == "an earlier export\n"
    assert [p.name for p in tmp_path.iterdir()] == ["focus.csv"]


class Refusing:
    base_url, project_id, page_size, concurrency = "https://openapi.example.com", "", 500, 1

    def bills(self, period: str, group_term: str, instance_id: str = "") -> list[BillRecord]:
        raise SignatureRejected("bills: signature rejected (HTTP 401)", status=401, code=None, message="")


def test_a_refused_signature_ends_the_export_and_keeps_the_earlier_file(clock: Clock, tmp_path: Path) -> None:
    output = tmp_path / "focus.csv"
    output.write_text("an earlier export\n")
    with pytest.raises(FocusError, match="signature rejected"):
        focus(Refusing(), clock, ["2026-09", "2026-10"], output)
    assert output.read_text() == "an earlier export\n"


def test_the_provider_is_named_as_given_and_the_account_id_apart_from_its_name(
    fake: FakeBilling, clock: Clock, tmp_path: Path
) -> None:
    output = tmp_path / "focus.csv"
    focus(fake, clock, ["2026-10"], output, account="AK-PUBLIC-ID", account_name=None, provider="Acme Inference")
    rows = read(output)
    assert {(r["BillingAccountId"], r["BillingAccountName"]) for r in rows} == {("AK-PUBLIC-ID", "")}
    assert {(r["ProviderName"], r["PublisherName"], r["InvoiceIssuerName"], r["Provider"]) for r in rows} == {
        ("Acme Inference",) * 4
    }


# --- focus-validator, the FinOps Foundation's -------------------------------------------------


def focus_validator() -> tuple[str, Path]:
    """The validator installed beside this interpreter, and the directory to run it from: 1.0.0
    reads its list of currency codes at a path relative to the working directory (its package's
    parent). Skipped when absent, unless CI is set (then it must be there)."""
    binary = Path(sys.executable).parent / "focus-validator"
    spec = importlib.util.find_spec("focus_validator")
    if binary.is_file() and spec is not None and spec.origin is not None:
        return str(binary), Path(spec.origin).parent.parent
    if os.environ.get("CI"):
        pytest.fail("focus-validator is not installed; CI must install it (pip install -e '.[test]')")
    pytest.skip("focus-validator is not installed (pip install -e '.[test]')")


def judged(path: Path, report: Path) -> tuple[str, dict[str, str]]:
    """focus-validator's verdict on `path` for FOCUS 1.0: the last line it prints, and each rule's
    outcome in its JUnit report (passed, or its first child's tag: failure, error, skipped)."""
    binary, where = focus_validator()
    command = [binary, "--data-file", str(path.resolve()), "--validate-version", "1.0"]
    console = subprocess.run(command, cwd=where, capture_output=True, text=True, timeout=120)
    assert console.returncode == 0, console.stderr  # (it exits 0 either way: the verdict is what it prints)
    junit = [*command, "--output-type", "unittest", "--output-destination", str(report.resolve())]
    written = subprocess.run(junit, cwd=where, capture_output=True, text=True, timeout=120)
    assert written.returncode == 0, written.stderr
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):  # noqa: S314 - the report the validator just wrote
        children = list(case)
        outcomes[case.attrib["name"].split(" :: ")[0]] = children[0].tag if children else "passed"
    return console.stdout.strip().splitlines()[-1], outcomes


@pytest.fixture
def over_http(sim: Simulator, server: SimulatorServer, clock: Clock) -> Iterator[BillingClient]:
    config = validate({"billing": billing_section(sim, server)}, {})
    with BillingClient.from_config(config.billing, clock) as client:
        yield client


@pytest.mark.integration  # the simulator on loopback, then focus-validator as a process
def test_focus_validator_passes_every_rule_on_the_export_and_fails_a_broken_file(
    over_http: BillingClient, clock: Clock, tmp_path: Path
) -> None:
    _, where = focus_validator()
    rules = sorted(p.stem for p in (where / "focus_validator" / "rules" / "version_sets" / "1.0").glob("*.yaml"))
    assert len(rules) > 100
    output = tmp_path / "focus.csv"
    result = export(over_http, clock, ["2026-09", "2026-10"], output, account="prod", currency="CNY")
    assert result.written == ("2026-09", "2026-10")

    verdict, outcomes = judged(output, tmp_path / "report.xml")
    assert verdict == "Validation succeeded."
    assert sorted(outcomes) == rules
    assert {rule: outcome for rule, outcome in outcomes.items() if outcome != "passed"} == {}

    # The same rows with a charge period in Shanghai time (not UTC) and no BillingCurrency: both caught.
    rows = read(output)
    rows[0]["ChargePeriodStart"] = "2026-09-01T00:00:00+08:00"
    broken = tmp_path / "broken.csv"
    with broken.open("w", encoding="utf-8", newline="") as out:
        writer = csv.DictWriter(out, [c for c in HEADER if c != "BillingCurrency"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    verdict, outcomes = judged(broken, tmp_path / "broken.xml")
    assert verdict == "Validation failed!"
    failed = {rule for rule, outcome in outcomes.items() if outcome == "failure"}
    assert {"ChargePeriodStart_IsDateTime", "BillingCurrency_Required"} <= failed


@pytest.mark.integration  # the command as a process, against a simulator on loopback
def test_the_command_writes_the_months_and_says_what_it_wrote(tmp_path: Path) -> None:
    sim = Simulator(spend=SpendModel(start=dt.date.today() - dt.timedelta(days=100)))
    server = sim.serve()
    try:
        env = {"TEST_BILLING_SECRET": sim.secret_access_key}
        month = (Clock().today().replace(day=1) - dt.timedelta(days=1)).strftime("%Y-%m")  # (the billing day)
        output = tmp_path / "charges.csv"
        without = write_config(tmp_path, sim, server)
        refused = run("export", "focus", "--config", str(without), "--from", month, "--to", month,
                      "--output", str(output), env=env)  # fmt: skip
        assert refused.returncode == 1
        assert "billing.currency is not set" in refused.stderr
        assert not output.exists()

        config = write_config(tmp_path, sim, server, currency="CNY")
        for named in (f"{tmp_path}/charges/", f"{tmp_path}/charges/."):
            directory = run("export", "focus", "--config", str(config), "--from", month, "--to", month,
                            "--output", named, env=env)  # fmt: skip
            assert directory.returncode == 2
            assert directory.stderr.endswith("names a directory; give a file's name\n")
            assert not (tmp_path / "charges").exists()
        result = run("export", "focus", "--config", str(config), "--from", month, "--to", month,
                     "--output", str(output), env=env)  # fmt: skip
        assert result.returncode == 0, result.stderr
        rows = read(output)
        billed = sum((Decimal(row["BilledCost"]) for row in rows), Decimal(0))
        assert billed == sim.bill_totals(month)["total"]
        assert result.stdout == f"wrote {output}: {month}: {len(rows):,} rows (FOCUS 1.0), {billed:f} CNY billed\n"
        assert sim.secret_access_key not in result.stdout + result.stderr
    finally:
        server.stop()
