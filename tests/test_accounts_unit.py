"""Several accounts in the unit layer: each account's billing API answered in process by its own
simulator; the engine across accounts (groups by and scoped to `account`, an account that cannot
be trusted keeping its own alerts), organisation budgets, routing, and each account's state."""

from __future__ import annotations

import datetime as dt
import gzip
import logging
from decimal import Decimal
from pathlib import Path

import pytest
import yaml
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families

from exporter.alerts.engine import Engine, Watched
from exporter.app.daemon import Daemon
from exporter.app.digests import FiringByAccount
from exporter.app.sources import account_state_path
from exporter.config.load import validate
from exporter.config.schema import BillingConfig
from exporter.core.clock import Clock, FrozenClock
from exporter.model.signals import SIGNALS
from exporter.notifiers.digest import text as digest_text
from exporter.sim import ITEMS, Fault, Simulator
from tests.daemon_fakes import (
    NOWHERE,
    InProcessBilling,
    account_simulators,
    accounts_section,
    digests_told,
    fake_billing_section,
    metrics,
    readiness,
    statuses,
    told,
)
from tests.fakes import FakeBilling
from tests.helpers import logged, named, value
from tests.test_reconcile import USAGES

BILLS = "/api/v1/bills/details"
NAMES = ("prod", "staging", "lab")


class AccountsBilling:
    """The daemon's billing factory for several accounts: each `billing` section's own simulator,
    found by its access key."""

    def __init__(self, sims: dict[str, Simulator]) -> None:
        self.sims = {sim.access_key_id: sim for sim in sims.values()}
        self.built: list[FakeBilling] = []

    def __call__(self, config: BillingConfig) -> FakeBilling:
        client = FakeBilling(self.sims[config.access_key_id], page_size=config.page_size)
        self.built.append(client)
        return client


@pytest.fixture
def sims(clock: Clock) -> dict[str, Simulator]:
    return account_simulators(clock, NAMES)


def spent_on(sim: Simulator, day: dt.date) -> Decimal:
    """What the account's bills say it spent on `day` (every endpoint, every item)."""
    period = f"{day:%Y-%m}"
    return sum((sim.charge(period, day, e, item)[0] for e in sim.endpoints for item in ITEMS), Decimal(0))


def month(sim: Simulator, endpoint: str | None = None) -> Decimal:
    totals = sim.bill_totals(f"{sim.clock.today():%Y-%m}")
    return totals["total"] if endpoint is None else totals[endpoint]


def document(sims: dict[str, Simulator], tmp_path: Path, rules: list[dict], **more: object) -> dict:
    return {
        "accounts": accounts_section(sims, history_months=0),
        "alerts": {
            "rules": rules,
            "notifiers": [
                {"name": n, "type": "webhook", "url": f"{NOWHERE}/{n}"} for n in ("pager", "chat", "finance")
            ],
        },
        "state": {"path": str(tmp_path / "state.db")},
    } | more


def daemon_on(sims: dict[str, Simulator], clock: Clock, doc: dict) -> Daemon:
    return Daemon(validate(doc, {}), clock=clock, billing=AccountsBilling(sims), serve=False)


def refresh_all(daemon: Daemon, source: str = "bills") -> list[bool]:
    return [daemon.refresh(key) for key in daemon.sources.keys(source)]


def firing(daemon: Daemon) -> set[tuple[str, str]]:
    return {
        (a.labels["alertname"], a.labels.get("account", ""))
        for a in daemon.sources.engine.current()
        if a.state == "firing"
    }


def test_a_rule_by_account_over_a_list_of_endpoints_measures_each_account_on_its_own(
    sims: dict[str, Simulator], clock: Clock, tmp_path: Path
) -> None:
    rule = {
        "alert": "TeamSpend", "signal": "spend", "window": "month", "by": ["account"],
        "where": {"endpoint_id": ["ep-prod", "ep-lab"]}, "threshold": 0,
    }  # fmt: skip
    daemon = daemon_on(sims, clock, document(sims, tmp_path, [rule]))
    try:
        assert all(refresh_all(daemon))
        daemon.alert_cycle()
        values = {a.labels["account"]: Decimal(a.value) for a in daemon.sources.engine.current()}
        # staging has neither endpoint: no group; prod and lab each their own endpoint's month
        assert set(values) == {"prod", "lab"}
        assert values["prod"] == month(sims["prod"], "ep-prod").quantize(Decimal("0.01"))
        assert values["lab"] == month(sims["lab"], "ep-lab").quantize(Decimal("0.01"))
    finally:
        daemon.stop()


def test_a_rule_without_account_in_by_sums_the_accounts_as_its_promql_does(
    sims: dict[str, Simulator], clock: Clock, tmp_path: Path
) -> None:
    rules = [
        {"alert": "Shared", "signal": "spend", "window": "month", "by": ["endpoint_id"],
         "where": {"endpoint_id": "ep-shared"}, "threshold": 0},
        {"alert": "ProdAndLab", "signal": "spend", "window": "month", "where": {"account": ["prod", "lab"]},
         "threshold": 0},
    ]  # fmt: skip
    daemon = daemon_on(sims, clock, document(sims, tmp_path, rules))
    try:
        assert all(refresh_all(daemon))
        daemon.alert_cycle()
        alerts = {a.labels["alertname"]: a for a in daemon.sources.engine.current()}
        shared = sum((month(sim, "ep-shared") for sim in sims.values()), Decimal(0))
        assert Decimal(alerts["Shared"].value) == shared.quantize(Decimal("0.01"))
        assert "account" not in alerts["Shared"].labels
        both = month(sims["prod"]) + month(sims["lab"])
        assert Decimal(alerts["ProdAndLab"].value) == both.quantize(Decimal("0.01"))
        # and the PromQL the `rules` command writes aggregates the same way
        assert SIGNALS["spend"].promql(daemon.config.alerts.rules[1]).count('account=~"lab|prod"') == 1
    finally:
        daemon.stop()


def test_an_account_that_cannot_be_trusted_keeps_its_own_alerts_and_no_other(
    sims: dict[str, Simulator], clock: Clock, tmp_path: Path
) -> None:
    rule = {"alert": "Spend", "signal": "spend", "window": "month", "by": ["account"], "threshold": "1"}
    daemon = daemon_on(sims, clock, document(sims, tmp_path, [rule]))
    try:
        assert all(refresh_all(daemon))
        daemon.alert_cycle()
        assert firing(daemon) == {("Spend", name) for name in NAMES}
        for sim in sims.values():  # every account's month falls under the threshold
            for endpoint in sim.endpoints:
                for day in range(1, clock.today().day + 1):
                    for item in ("ITEM_PROMPT_TOKEN", "ITEM_CACHED_PROMPT_TOKEN", "ITEM_COMPLETION_TOKEN"):
                        sim.revise_bill(clock.today().replace(day=day), endpoint.endpoint_id, item, Decimal(0))
        sims["staging"].inject(Fault("status", path=BILLS, status=403, times=1))  # staging's refresh is refused
        assert refresh_all(daemon) == [True, False, True]
        daemon.alert_cycle()
        assert firing(daemon) == {("Spend", "staging")}  # unknown now: kept, never read as zero
        assert refresh_all(daemon) == [True, True, True]
        daemon.alert_cycle()
        assert firing(daemon) == set()
        events = told(daemon, "pager")
        assert [e["status"] for e in events] == ["firing", "resolved", "resolved"]
        assert [sorted(a["labels"]["account"] for a in e["alerts"]) for e in events] == [
            sorted(NAMES),
            ["lab", "prod"],
            ["staging"],
        ]
    finally:
        daemon.stop()


def test_the_organisation_budget_sums_every_account_and_waits_for_all_of_them(
    sims: dict[str, Simulator], clock: Clock, tmp_path: Path
) -> None:
    total = sum((month(sim) for sim in sims.values()), Decimal(0))
    two = month(sims["prod"]) + month(sims["staging"])
    doc = document(
        sims, tmp_path,
        [{"alert": "OrgBudget", "budget": "org", "tiers": [0.5, 1.0]},
         {"alert": "TwoBudget", "budget": "two", "tiers": [1.0], "notifiers": ["chat"]}],
        budgets=[
            {"name": "org", "amount": str((total * Decimal("0.9")).quantize(Decimal("0.01")))},
            {"name": "two", "amount": str((two * 2).quantize(Decimal("0.01"))),
             "where": {"account": ["prod", "staging"]}},
        ],
    )  # fmt: skip
    daemon = daemon_on(sims, clock, doc)
    try:
        sims["lab"].inject(Fault("status", path=BILLS, status=403, times=1))
        assert refresh_all(daemon) == [True, True, False]
        daemon.alert_cycle()
        series = metrics(daemon)
        assert value(series, "inference_budget_used_ratio", budget="org") is None  # lab's part unknown
        assert firing(daemon) == set()  # nor judged
        assert refresh_all(daemon) == [True, True, True]
        daemon.alert_cycle()
        series = metrics(daemon)
        used = total / Decimal(doc["budgets"][0]["amount"])
        assert value(series, "inference_budget_used_ratio", budget="org") == pytest.approx(float(used))
        assert value(series, "inference_budget_used_ratio", budget="two") == pytest.approx(0.5, rel=1e-3)
        assert value(series, "inference_budget_amount", budget="two") == float(doc["budgets"][1]["amount"])
        # The day the accounts' summed spend crossed the organisation's amount; no chance of it (several accounts)
        amount, so_far, crossed = Decimal(doc["budgets"][0]["amount"]), Decimal(0), None
        for day in (clock.today().replace(day=n) for n in range(1, clock.today().day + 1)):
            so_far += sum((spent_on(sim, day) for sim in sims.values()), Decimal(0))
            crossed = crossed or (day if so_far >= amount else None)
        assert crossed is not None
        crossing = value(series, "inference_budget_crossing_timestamp_seconds", budget="org")
        assert crossing == clock.day_start(crossed).timestamp()
        assert value(series, "inference_budget_crossing_probability", budget="org") is None
        for name in NAMES:  # each account's digest lists it, with the accounts it spans
            body = daemon.sources.digest(clock.today(), "daily", "", account=name)
            listed = body["budgets"]
            (shown,) = [b for b in listed if b["budget"] == "org"]
            assert shown["used_ratio"] == pytest.approx(float(used), abs=1e-4)
            assert (shown["crossing"], shown["accounts"]) == (crossed.isoformat(), list(NAMES))
            lines = digest_text({**body, "budgets": [shown]}).splitlines()
            assert any(line.lstrip("-• ").startswith("org (") and ", accounts prod, staging, lab): used" in line
                       for line in lines), lines  # fmt: skip
        (org,) = [a for a in daemon.sources.engine.current() if a.labels["alertname"] == "OrgBudget"]
        assert (org.state, org.labels["tier"]) == ("firing", "1")  # over 100%: the highest tier crossed
        assert "account" not in org.labels
        # TwoBudget (50%) crossed no tier; OrgBudget names no notifier: every one hears it (no digest here)
        for notifier in ("pager", "chat", "finance"):
            assert [(e["alertname"], e["status"]) for e in told(daemon, notifier)] == [("OrgBudget", "firing")]
        sims["staging"].revise_bill(clock.today(), "ep-staging", "ITEM_PROMPT_TOKEN", two * 2)  # over 100% now
        assert refresh_all(daemon) == [True, True, True]
        daemon.alert_cycle()
        assert [e["alertname"] for e in told(daemon, "chat")] == ["OrgBudget", "TwoBudget"]
        assert [e["alertname"] for e in told(daemon, "pager")] == ["OrgBudget"]  # the rule names chat alone
    finally:
        daemon.stop()


def test_a_resolve_reaches_the_notifiers_told_of_the_firing_after_a_reroute(
    sims: dict[str, Simulator], clock: Clock, tmp_path: Path
) -> None:
    rule = {"alert": "Spend", "signal": "spend", "window": "month", "threshold": "1", "notifiers": ["pager"]}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(document(sims, tmp_path, [rule])))
    daemon = Daemon(validate(yaml.safe_load(path.read_text()), {}), config_path=path, clock=clock,
                    billing=AccountsBilling(sims), serve=False)  # fmt: skip
    try:
        assert all(refresh_all(daemon))
        daemon.alert_cycle()
        assert statuses(daemon, "pager") == ["firing"]
        path.write_text(yaml.safe_dump(document(sims, tmp_path, [])))  # the rule goes
        assert daemon.reload()
        daemon.alert_cycle()
        assert statuses(daemon, "pager") == ["firing", "resolved"]
        assert statuses(daemon, "chat") == []
    finally:
        daemon.stop()


def test_each_account_keeps_its_own_state_through_restarts_and_being_removed_and_added_back(
    sims: dict[str, Simulator], clock: Clock, tmp_path: Path
) -> None:
    for sim in sims.values():
        sim.add_usage(5000)  # 10 pages of 500: a day read afresh
    doc = document(sims, tmp_path, [])
    daemon = daemon_on(sims, clock, doc)
    assert all(refresh_all(daemon, "usage"))
    assert daemon.stop()
    for name in NAMES:
        assert Path(account_state_path(doc["state"]["path"], name)).is_file()

    # staging removed: the others resume from their own files, staging's is left as it was
    without = {name: sim for name, sim in sims.items() if name != "staging"}
    before = {name: dict(sim.requests_served) for name, sim in sims.items()}
    daemon = daemon_on(without, clock, document(without, tmp_path, []))
    assert all(refresh_all(daemon, "usage"))
    series = metrics(daemon)
    for name in without:
        pages = sims[name].requests_served.get("/api/v1/usages/details", 0) - before[name].get(
            "/api/v1/usages/details", 0
        )
        assert pages <= 4  # resumed: not the day read again (10 pages)
        counted = value(
            series, "inference_usage_requests_total", account=name, endpoint_id=f"ep-{name}", model="model-a"
        )
        expected = sims[name].usage_totals(distinct=True)[(f"ep-{name}", "model-a")]["requests"]
        assert counted == expected
    assert daemon.stop()

    # staging back: its state is there, not read again from the start
    before = dict(sims["staging"].requests_served)
    daemon = daemon_on(sims, clock, doc)
    assert all(refresh_all(daemon, "usage"))
    pages = sims["staging"].requests_served.get("/api/v1/usages/details", 0) - before.get("/api/v1/usages/details", 0)
    assert pages <= 4
    assert daemon.stop()


def test_a_reload_that_changes_one_account_leaves_the_others_alone(
    sims: dict[str, Simulator], clock: Clock, tmp_path: Path
) -> None:
    path = tmp_path / "config.yaml"
    doc = document(sims, tmp_path, [])
    path.write_text(yaml.safe_dump(doc))
    daemon = Daemon(validate(doc, {}), config_path=path, clock=clock, billing=AccountsBilling(sims), serve=False)
    try:
        assert all(refresh_all(daemon))
        before = dict(daemon.sources.accounts)
        doc["accounts"][2]["billing"]["page_size"] = 100
        path.write_text(yaml.safe_dump(doc))
        old = daemon.sources
        assert daemon.reload()
        after = daemon.sources.accounts
        assert after["prod"].client is before["prod"].client  # its refreshes in flight go on with it
        assert after["staging"].client is before["staging"].client
        assert after["lab"].client is not before["lab"].client
        assert daemon.sources.changed(old) == {"lab/bills", "lab/usage"}
        assert after["prod"].latest is before["prod"].latest  # its figures and health stay
    finally:
        daemon.stop()


def test_one_account_again_after_several_shows_nothing_of_the_one_before(
    sims: dict[str, Simulator], clock: Clock, tmp_path: Path
) -> None:
    """One account (prod's), then several, then one again (staging's): the one account's snapshots
    are the process's, which still held prod's. None of it is shown, judged or counted ready, and
    a refresh of the account a reload took out, still in flight, publishes nothing. (Prod's back
    keeps its figures: test_an_account_taken_out_and_the_one_account_back_leave_nothing_of_before.)"""
    path = tmp_path / "config.yaml"

    def one(name: str) -> dict:
        billing = fake_billing_section(sims[name], history_months=0)
        return {"billing": billing, "state": {"path": str(tmp_path / "state.db")}}

    path.write_text(yaml.safe_dump(one("prod")))
    daemon = Daemon(
        validate(one("prod"), {}), config_path=path, clock=clock, billing=AccountsBilling(sims), serve=False
    )
    try:
        assert daemon.refresh("bills")
        assert daemon.refresh("usage")
        assert readiness(daemon)[0]
        alone = daemon.sources.one
        path.write_text(yaml.safe_dump(document(sims, tmp_path, [])))
        assert daemon.reload()
        assert alone.replaced()  # (taken out: a refresh of it in flight publishes nothing)
        path.write_text(yaml.safe_dump(one("staging")))
        assert daemon.reload()
        assert (daemon.latest.bills, daemon.latest.usage, dict(daemon.latest.health)) == (None, None, {})
        assert readiness(daemon) == (False, {"bills": "not refreshed yet", "usage": "not refreshed yet"})
        assert daemon.refresh("bills")
        assert value(
            metrics(daemon), "inference_bill_month_to_date_payable_amount", period=f"{clock.today():%Y-%m}"
        ) == (float(month(sims["staging"])))
    finally:
        daemon.stop()


class AddressedBilling(AccountsBilling):
    """`AccountsBilling` whose clients are at the configured address (the history's source)."""

    def __call__(self, config: BillingConfig) -> FakeBilling:
        client = super().__call__(config)
        client.base_url = str(config.url)
        return client


def test_one_account_back_after_several_at_another_address_keeps_its_figures_not_its_history(
    sims: dict[str, Simulator], clock: Clock, tmp_path: Path
) -> None:
    """The same key and project, but another API's address: its last good figures stay shown (a
    proxy's address, it may be), its history months are never learnt from until fetched there, as
    a reload from one address to another within one config does."""
    path = tmp_path / "config.yaml"

    def one(url: str) -> dict:
        billing = fake_billing_section(sims["prod"], history_months=1, url=url)
        return {"billing": billing, "state": {"path": str(tmp_path / "state.db")}}

    def back_at(url: str) -> Daemon:
        path.write_text(yaml.safe_dump(one(f"{NOWHERE}/a")))
        daemon = Daemon(validate(one(f"{NOWHERE}/a"), {}), config_path=path, clock=clock,
                        billing=AddressedBilling(sims), serve=False)  # fmt: skip
        assert daemon.refresh("bills")
        assert daemon.refresh("history")
        path.write_text(yaml.safe_dump(document({"prod": sims["prod"]}, tmp_path, [])))
        assert daemon.reload()
        path.write_text(yaml.safe_dump(one(url)))
        assert daemon.reload()
        return daemon

    for url, history_kept in ((f"{NOWHERE}/a", True), (f"{NOWHERE}/b", False)):
        daemon = back_at(url)
        try:
            assert daemon.latest.bills is not None
            assert (daemon.latest.history is not None) == history_kept, url
        finally:
            daemon.stop()


def test_a_budget_spanning_more_accounts_relabels_its_alert_not_doubles_it(
    sims: dict[str, Simulator], clock: Clock, tmp_path: Path
) -> None:
    """A budget of prod, then of prod and staging (its alerts say no account then): the prod alert
    resolves and the tier fires once, relabelled; not a second alert beside one left firing, with
    its figures of before, till the month's end."""
    path = tmp_path / "config.yaml"
    rule = {"alert": "B", "budget": "b", "tiers": [0.5], "notifiers": ["pager"]}

    def write(where: dict) -> None:
        path.write_text(
            yaml.safe_dump(document(sims, tmp_path, [rule], budgets=[{"name": "b", "amount": "1", "where": where}]))
        )

    write({"account": "prod"})
    daemon = Daemon(validate(yaml.safe_load(path.read_text()), {}), config_path=path, clock=clock,
                    billing=AccountsBilling(sims), serve=False)  # fmt: skip
    try:
        assert all(refresh_all(daemon))
        daemon.alert_cycle()
        write({"account": ["prod", "staging"]})
        assert daemon.reload()
        assert all(refresh_all(daemon))
        daemon.alert_cycle()
        firing = [a.labels.get("account") for a in daemon.sources.engine.current() if a.state == "firing"]
        assert firing == [None]
        said = [(e["status"], [a["labels"].get("account") for a in e["alerts"]]) for e in told(daemon, "pager")]
        assert said == [("firing", ["prod"]), ("resolved", ["prod"]), ("firing", [None])]
    finally:
        daemon.stop()


def test_an_account_a_reload_adds_after_the_digest_time_waits_for_its_bills_before_its_digest(
    sims: dict[str, Simulator], clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    """Added at 14:00, its digest of the day (09:00) still due: made once its bills are read, not at
    once with nothing read (its wait for them counts from when it was added, as the others' from the
    start), and not made again."""
    path = tmp_path / "config.yaml"

    def write(names: tuple[str, ...]) -> None:
        doc = document({n: sims[n] for n in names}, tmp_path, []) | {"digest": {"at": "09:00", "notifiers": ["chat"]}}
        path.write_text(yaml.safe_dump(doc))

    frozen.set(dt.datetime(2026, 11, 22, 8, 0, tzinfo=clock.tz))
    write(("prod", "staging"))
    daemon = Daemon(validate(yaml.safe_load(path.read_text()), {}), config_path=path, clock=clock,
                    billing=AccountsBilling(sims), serve=False)  # fmt: skip
    try:
        frozen.set(dt.datetime(2026, 11, 22, 9, 0, tzinfo=clock.tz))
        assert all(refresh_all(daemon))
        daemon.alert_cycle()
        assert sorted(d["account"] for d in digests_told(daemon)) == ["prod", "staging"]
        frozen.set(dt.datetime(2026, 11, 22, 14, 0, tzinfo=clock.tz))
        write(("prod", "staging", "lab"))
        assert daemon.reload()
        daemon.alert_cycle()  # (at once after a reload, before the new account's bills)
        assert [d["account"] for d in digests_told(daemon)].count("lab") == 0
        assert daemon.refresh("lab/bills")
        daemon.alert_cycle()
        (lab,) = [d for d in digests_told(daemon) if d["account"] == "lab"]
        assert lab["spend"] is not None
    finally:
        daemon.stop()


def test_a_day_s_digest_is_told_once_when_its_account_moves_under_accounts_and_is_renamed(
    sims: dict[str, Simulator], clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    """One account, its digest of the day made; then the same billing account under `accounts:` as
    `prod` beside `staging`, then renamed `production`: the key of its digest gains its name, but
    the day is told once. `staging`, another billing account, has its own; the next day's go under
    the names of now."""
    path = tmp_path / "config.yaml"
    rest = document({}, tmp_path, []) | {"digest": {"at": "09:00", "notifiers": ["chat"]}}
    del rest["accounts"]

    def write(billing: dict | None = None, **accounts: str) -> None:
        doc = rest | ({"billing": billing} if billing else {})
        if accounts:  # name → the simulator whose account it is
            doc["accounts"] = accounts_section({name: sims[sim] for name, sim in accounts.items()}, history_months=0)
        path.write_text(yaml.safe_dump(doc))

    def ids() -> list[str]:
        return [d["id"] for d in digests_told(daemon)]

    frozen.set(dt.datetime(2026, 11, 22, 9, 0, tzinfo=clock.tz))
    write(fake_billing_section(sims["prod"], history_months=0))
    daemon = Daemon(validate(yaml.safe_load(path.read_text()), {}), config_path=path, clock=clock,
                    billing=AccountsBilling(sims), serve=False)  # fmt: skip
    try:
        assert all(refresh_all(daemon))
        daemon.alert_cycle()
        assert ids() == ["daily:2026-11-22"]
        for accounts in ({"prod": "prod", "staging": "staging"}, {"production": "prod", "staging": "staging"}):
            frozen.advance(dt.timedelta(minutes=5))
            write(**accounts)
            assert daemon.reload()
            assert all(refresh_all(daemon))
            daemon.alert_cycle()
            assert ids() == ["daily:2026-11-22", "daily:2026-11-22:staging"]
        frozen.set(dt.datetime(2026, 11, 23, 9, 0, tzinfo=clock.tz))
        assert all(refresh_all(daemon))
        daemon.alert_cycle()
        assert ids()[2:] == ["daily:2026-11-23:production", "daily:2026-11-23:staging"]
        # Renamed again while its name before goes to another account: still its own day told.
        frozen.advance(dt.timedelta(minutes=5))
        write(main="prod", production="lab", staging="staging")
        assert daemon.reload()
        assert all(refresh_all(daemon))
        daemon.alert_cycle()
        assert "daily:2026-11-23:main" not in ids()
    finally:
        daemon.stop()


def write_with_digest(path: Path, sims: dict[str, Simulator], **accounts: str) -> None:
    """A config of `accounts` (each name: the simulator whose billing account it is), its digest at
    09:00 to `chat`, written at `path`."""
    doc = document({}, path.parent, []) | {"digest": {"at": "09:00", "notifiers": ["chat"]}}
    doc["accounts"] = accounts_section({n: sims[sim] for n, sim in accounts.items()}, history_months=0)
    path.write_text(yaml.safe_dump(doc))


def reloadable(path: Path, clock: Clock, sims: dict[str, Simulator]) -> Daemon:
    """A daemon on the config at `path`, reloaded from there."""
    config = validate(yaml.safe_load(path.read_text()), {})
    return Daemon(config, config_path=path, clock=clock, billing=AccountsBilling(sims), serve=False)


@pytest.mark.parametrize(
    ("before", "after", "name"),
    [
        ({"prod": "prod", "staging": "staging"}, {"main": "prod", "staging": "staging", "prod": "lab"}, "prod"),
        ({"a": "prod", "b": "prod"}, {"b": "prod", "a": "lab"}, "a"),
    ],
    ids=["renamed", "of-accounts-alike"],
)
def test_a_name_a_reload_gives_to_another_account_after_its_digest_went_holds_back_none_of_that_one(
    sims: dict[str, Simulator], clock: Clock, frozen: FrozenClock, tmp_path: Path,
    before: dict[str, str], after: dict[str, str], name: str,
) -> None:  # fmt: skip
    """After the day's digests went, `name` goes to `lab`'s billing account (`prod`'s renamed
    `main`, or one of two accounts alike): the digest made under `name` was `prod`'s, `lab`'s was
    not made: it goes, under a key of its own (receivers drop a repeat by it), once."""
    path = tmp_path / "config.yaml"
    frozen.set(dt.datetime(2026, 11, 22, 9, 0, tzinfo=clock.tz))
    write_with_digest(path, sims, **before)
    daemon = reloadable(path, clock, sims)
    try:
        assert all(refresh_all(daemon))
        for _ in range(2):  # (the second look finds the day's digests made)
            daemon.alert_cycle()
        write_with_digest(path, sims, **after)
        assert daemon.reload()
        for _ in range(2):
            assert all(refresh_all(daemon))
            daemon.alert_cycle()
        told = [(d["id"], d["spend"]) for d in digests_told(daemon)]
    finally:
        daemon.stop()
    lab = daemon.sources.accounts[name].account_id
    assert [i for i, _ in told] == [f"daily:2026-11-22:{n}" for n in before] + [f"daily:2026-11-22:{name}:{lab[:12]}"]
    assert Decimal(told[-1][1]) == spent_on(sims["lab"], dt.date(2026, 11, 21)).quantize(Decimal("0.01"))


def test_an_access_key_rotated_after_the_day_s_digest_went_is_the_same_account(
    sims: dict[str, Simulator], clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    """`prod` with a new access key (another billing account id, the one before no longer
    configured): its digest of the day went, and goes not again under a key of its own."""
    path = tmp_path / "config.yaml"
    billing = InProcessBilling(sims["prod"])

    def write(key: str) -> None:
        doc = document({}, tmp_path, []) | {"digest": {"at": "09:00", "notifiers": ["chat"]}}
        doc["accounts"] = accounts_section({"prod": sims["prod"], "staging": sims["staging"]}, history_months=0)
        doc["accounts"][0]["billing"]["access_key_id"] = key
        path.write_text(yaml.safe_dump(doc))

    frozen.set(dt.datetime(2026, 11, 22, 9, 0, tzinfo=clock.tz))
    write("AK-BEFORE")
    daemon = Daemon(validate(yaml.safe_load(path.read_text()), {}), config_path=path, clock=clock, billing=billing,
                    serve=False)  # fmt: skip
    try:
        assert all(refresh_all(daemon))
        daemon.alert_cycle()
        write("AK-NOW")
        assert daemon.reload()
        for _ in range(2):
            assert all(refresh_all(daemon))
            daemon.alert_cycle()
        assert [d["id"] for d in digests_told(daemon)] == ["daily:2026-11-22:prod", "daily:2026-11-22:staging"]
    finally:
        daemon.stop()


def test_of_two_accounts_configured_alike_the_one_left_still_tells_its_day(
    sims: dict[str, Simulator], clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    """`a` and `b` have the same key and project: when `a`, whose digest went, is taken out while
    `b`'s waits for its bills, `b`'s is no rename of `a`'s: it goes."""
    path = tmp_path / "config.yaml"

    def write(*names: str) -> None:
        doc = document(dict.fromkeys(names, sims["prod"]), tmp_path, []) | {
            "digest": {"at": "09:00", "notifiers": ["chat"]}
        }
        path.write_text(yaml.safe_dump(doc))

    frozen.set(dt.datetime(2026, 11, 22, 9, 0, tzinfo=clock.tz))
    write("a", "b")
    daemon = Daemon(validate(yaml.safe_load(path.read_text()), {}), config_path=path, clock=clock,
                    billing=AccountsBilling(sims), serve=False)  # fmt: skip
    try:
        assert daemon.refresh("a/bills")
        daemon.alert_cycle()
        write("b")
        assert daemon.reload()
        assert daemon.refresh("b/bills")
        daemon.alert_cycle()
        assert [d["id"] for d in digests_told(daemon)] == ["daily:2026-11-22:a", "daily:2026-11-22:b"]
    finally:
        daemon.stop()


def steady(exposition: bytes) -> bytes:
    """The exposition without the samples of the process's own series (`process_*`, `python_*`), which move by
    themselves between two scrapes."""
    return b"".join(
        line for line in exposition.splitlines(keepends=True) if not line.startswith((b"process_", b"python_"))
    )


def test_every_series_of_an_account_carries_it_under_one_help_and_type(
    sims: dict[str, Simulator], clock: Clock, tmp_path: Path
) -> None:
    for sim in sims.values():
        sim.add_usage(300)
    doc = document(
        sims, tmp_path, [{"alert": "Spend", "signal": "spend", "window": "month", "by": ["account"], "threshold": 1}],
        budgets=[{"name": "org", "amount": "100000"}],
    )  # fmt: skip
    doc["accounts"][0]["budgets"] = [{"name": "prod-only", "amount": "5000"}]
    daemon = daemon_on(sims, clock, doc)
    try:
        assert all(refresh_all(daemon)) and all(refresh_all(daemon, "usage"))  # noqa: PT018
        daemon.alert_cycle()
        for accept in ("", "application/openmetrics-text; version=1.0.0"):
            body = daemon.sources.exposition.render(accept)[0]
            text = body.decode()
            types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
            assert len(types) == len(set(types)), "a family declared twice"
            gzipped = daemon.sources.exposition.render(accept, gzipped=True)[0]
            assert steady(gzip.decompress(gzipped)) == steady(body)
        families = list(openmetrics_families(text))  # the OpenMetrics parser takes it (one family, one block)
        assert len(families) == len(types)
        series = metrics(daemon)
        process = (
            "inference_exporter_build_info", "inference_billing_today_info", "inference_exporter_config_last",
            "inference_exporter_state_write_success",  # the process's file; each account's file with `account`
            "process_", "python_",  # client_python's default collectors: the process's own
        )  # fmt: skip
        unlabelled = {
            name for (name, labels) in series if "account" not in dict(labels) and not name.startswith(process)
        }
        assert unlabelled <= {
            "inference_alerts", "inference_budget_amount", "inference_budget_used_ratio",
            "inference_budget_forecast_ratio", "inference_budget_scope_matched",
        } | {name for name in unlabelled if name.startswith("inference_alert_")}  # fmt: skip
        org = {dict(labels).get("budget") for (name, labels) in series if name == "inference_budget_amount"}
        assert org == {"org", "prod-only"}
        assert value(series, "inference_budget_amount", budget="prod-only", account="prod") == 5000
        assert value(series, "inference_budget_amount", budget="org") == 100000
        assert value(series, "inference_exporter_state_write_success") == 1
        assert value(series, "inference_exporter_state_write_success", account="lab") == 1
        for name in NAMES:  # each account's usage as its simulator counts it
            counted = value(
                series, "inference_usage_requests_total", account=name, endpoint_id=f"ep-{name}", model="model-a"
            )
            assert counted == sims[name].usage_totals(distinct=True)[(f"ep-{name}", "model-a")]["requests"]
    finally:
        daemon.stop()


def test_blocks_are_rendered_once_per_snapshot_even_with_an_account_that_has_none(
    sims: dict[str, Simulator], clock: Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from exporter.metrics import accounts, collectors

    rendered: list[object] = []
    for kind in (collectors.BillsCollector, accounts.SharedBudgetCollector):
        original = kind.collect
        monkeypatch.setattr(kind, "collect", lambda self, o=original: (rendered.append(self), o(self))[1])
    daemon = daemon_on(sims, clock, document(sims, tmp_path, [], budgets=[{"name": "org", "amount": "1000"}]))
    try:
        sims["lab"].inject(Fault("status", path=BILLS, status=403, times=1))  # lab has no bills yet
        assert refresh_all(daemon) == [True, True, False]
        first = steady(daemon.sources.exposition.render()[0])
        count = len(rendered)
        assert count > 0
        assert steady(daemon.sources.exposition.render()[0]) == first
        assert len(rendered) == count  # nothing rendered again: no snapshot changed
        assert daemon.refresh("lab/bills")
        assert steady(daemon.sources.exposition.render()[0]) != first
        again = rendered[count:]
        lab = daemon.sources.accounts["lab"].latest
        # lab's bills (in both formats, by the refresh's prepare) and the budgets over every account: nothing else
        assert {type(c).__name__ for c in again} == {"BillsCollector", "SharedBudgetCollector"}
        assert all(c.latest is lab for c in again if isinstance(c, collectors.BillsCollector))
    finally:
        daemon.stop()


def test_a_refresh_looks_at_its_own_accounts_blocks_only(
    sims: dict[str, Simulator], clock: Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After one account's refresh, the exposition is prepared from that account's collectors and
    those spanning the accounts: with N accounts a refresh costs what it costs with one, not N."""
    from exporter.metrics import collectors

    asked: list[object] = []
    original = collectors.BillsCollector.version
    monkeypatch.setattr(
        collectors.BillsCollector, "version", lambda self: (asked.append(self.latest), original(self))[1]
    )
    daemon = daemon_on(sims, clock, document(sims, tmp_path, [], budgets=[{"name": "org", "amount": "1000"}]))
    try:
        assert all(refresh_all(daemon))
        asked.clear()
        assert daemon.refresh("staging/bills")
        assert asked
        assert all(latest is daemon.sources.accounts["staging"].latest for latest in asked)
        series = metrics(daemon)  # a scrape still shows every account's bills
        assert {
            dict(labels)["account"] for name, labels in series if name == "inference_bill_month_to_date_payable_amount"
        } == set(NAMES)
    finally:
        daemon.stop()


def test_an_annotation_may_name_what_the_rule_selects(sims: dict[str, Simulator], clock: Clock, tmp_path: Path) -> None:
    rule = {
        "alert": "Spend", "signal": "spend", "window": "month", "threshold": 1,
        "where": {"account": "prod", "endpoint_id": ["ep-prod", "ep-shared"]},
        "annotations": {"summary": "{account} ({endpoint_id}) spent {value}"},
    }  # fmt: skip
    daemon = daemon_on(sims, clock, document(sims, tmp_path, [rule]))
    try:
        assert all(refresh_all(daemon))
        daemon.alert_cycle()
        (alert,) = daemon.sources.engine.current()
        assert alert.annotations["summary"] == f"prod (ep-prod|ep-shared) spent {alert.value}"
    finally:
        daemon.stop()


def test_a_rule_that_matches_no_series_is_empty_not_zero(clock: Clock) -> None:
    """A `data_age` rule on a source nobody has: no group (its PromQL returns nothing too), never 0."""
    from exporter.config.rules import ThresholdRule
    from exporter.model import signals
    from exporter.model.snapshots import Latest

    rule = ThresholdRule(alert="A", signal="data_age", where={"source": "nope"}, op="<", threshold=Decimal(1))
    one = signals.Account("", Latest(), lambda: ["bills"])
    assert signals.evaluate_accounts(rule, [one], clock) == ({}, set())


ANOMALY = {"alert": "SpendAnomaly", "signal": "spend_anomaly", "by": ["endpoint_id"], "min_amount": "20",
           "min_percent": 30}  # fmt: skip


def test_anomalies_are_judged_per_account_kept_while_unknown_and_resolved_when_their_account_goes(
    sims: dict[str, Simulator], clock: Clock, tmp_path: Path
) -> None:
    from exporter.sim import SpendModel

    yesterday = clock.today() - dt.timedelta(days=1)
    for sim in sims.values():
        sim.spend = SpendModel(start=dt.date(2026, 7, 1))
    sims["lab"].add_spike(yesterday, "ep-lab", 2.5)
    doc = document(sims, tmp_path, [ANOMALY])
    for account in doc["accounts"]:
        account["billing"]["history_months"] = 3
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(doc))
    daemon = Daemon(validate(doc, {}), config_path=path, clock=clock, billing=AccountsBilling(sims), serve=False)
    try:
        assert all(refresh_all(daemon, "history")) and all(refresh_all(daemon))  # noqa: PT018
        daemon.alert_cycle()
        assert firing(daemon) == {("SpendAnomaly", "lab")}
        (alert,) = daemon.sources.engine.current()
        assert alert.labels["endpoint_id"] == "ep-lab"

        def judged() -> dict[tuple[str, str], float]:
            found = {}
            for labels, v in named(metrics(daemon), "inference_spend_anomaly_impact_amount").items():
                key = (dict(labels)["account"], dict(labels)["endpoint_id"])
                assert key not in found  # one series per account and group
                found[key] = v
            return found

        before = judged()
        assert set(before) == {(name, e) for name in NAMES for e in (f"ep-{name}", "ep-shared")}
        assert before[("lab", "ep-lab")] == max(before.values())

        sims["lab"].inject(Fault("status", path=BILLS, status=403, times=1))
        assert refresh_all(daemon) == [True, True, False]
        daemon.alert_cycle()
        assert judged() == before  # lab not judged now: its last judgement stays, and its alert
        assert firing(daemon) == {("SpendAnomaly", "lab")}

        del doc["accounts"][2]  # lab goes: its day is judged no more, its alert resolves
        path.write_text(yaml.safe_dump(doc))
        assert daemon.reload()
        daemon.alert_cycle()
        assert firing(daemon) == set()
        assert statuses(daemon, "pager") == ["firing", "resolved"]
    finally:
        daemon.stop()


def test_one_account_s_figures_that_cannot_be_computed_are_logged_once_and_hold_back_no_other(
    sims: dict[str, Simulator], clock: Clock, tmp_path: Path, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    judge = Engine._judge

    def failing_for_prod(engine: Engine, rule: object, rid: str, watched: Watched, day: dt.date) -> object:
        if watched.name == "prod":
            raise ArithmeticError("a figure this code cannot compute")
        return judge(engine, rule, rid, watched, day)  # type: ignore[arg-type]

    monkeypatch.setattr(Engine, "_judge", failing_for_prod)  # (a fault of this code, in one account)
    rule = {"alert": "Anomaly", "signal": "spend_anomaly", "by": ["endpoint_id"], "min_amount": "1", "min_percent": 1}
    daemon = daemon_on(sims, clock, document(sims, tmp_path, [rule]))
    try:
        assert all(refresh_all(daemon))
        for _ in range(3):
            daemon.alert_cycle()
        assert len(logged(caplog.records, "a rule's figures could not be computed; its alerts keep their state")) == 1
        assert not logged(caplog.records, "a rule's figures are computed again")
        judged = named(metrics(daemon), "inference_spend_expected_daily_amount")
        assert {dict(labels)["account"] for labels in judged} == {"staging", "lab"}  # the others judged on
    finally:
        daemon.stop()


def assert_counted(daemon: Daemon, accounts: dict[str, Simulator]) -> None:
    """Each account's requests of the day, as its simulator lists them (each request once), under its name."""
    series = metrics(daemon)
    for name, sim in accounts.items():
        for (endpoint, model), sums in sim.usage_totals(distinct=True).items():
            counted = value(series, "inference_usage_requests_total", account=name, endpoint_id=endpoint, model=model)
            assert counted == sums["requests"]


@pytest.mark.parametrize("restart", [False, True])
def test_two_accounts_that_swap_names_each_go_on_from_their_own_state_and_show_nothing_of_the_other(
    clock: Clock, tmp_path: Path, restart: bool
) -> None:
    """prod's key and staging's swapped (by a reload, or while the exporter was down): no account
    is a key rotated, each is still configured. Neither name shows what it showed before (nor is
    counted fresh) until its sources refresh; each then goes on from its own account's state,
    with the other's request ids (the simulators' are alike) never taken for its own."""
    sims = account_simulators(clock, ("prod", "staging"))
    for sim in sims.values():
        sim.add_usage(5000)  # 10 pages of 500
    path = tmp_path / "config.yaml"
    swapped = {"prod": sims["staging"], "staging": sims["prod"]}
    first, second = ({"accounts": accounts_section(s, history_months=0), "state": {"path": str(tmp_path / "state.db")}}
                     for s in (sims, swapped))  # fmt: skip
    path.write_text(yaml.safe_dump(first))
    billing = AccountsBilling(sims)
    daemon = Daemon(validate(first, {}), config_path=path, clock=clock, billing=billing, serve=False)
    try:
        assert all(daemon.refresh(key) for key in list(daemon.sources.refreshers))
        for sim in sims.values():
            sim.add_usage(300)
        path.write_text(yaml.safe_dump(second))
        if restart:
            daemon.stop()
            daemon = Daemon(validate(second, {}), config_path=path, clock=clock, billing=billing, serve=False)
        else:
            assert daemon.reload()
        series = metrics(daemon)
        assert named(series, "inference_bill_month_to_date_payable_amount") == {}
        assert not [k for k in daemon.sources.health() if k.endswith(("/bills", "/usage"))]
        before = {id(sim): sim.requests_served.get(USAGES, 0) for sim in sims.values()}
        assert all(daemon.refresh(key) for key in list(daemon.sources.refreshers))
        series = metrics(daemon)
        for name, sim in swapped.items():
            assert sim.requests_served[USAGES] - before[id(sim)] < 5300 / 500  # resumed: not the day read again
            payable = value(series, "inference_bill_month_to_date_payable_amount", account=name,
                            period=f"{clock.today():%Y-%m}")  # fmt: skip
            assert payable == float(month(sim))
        assert_counted(daemon, swapped)
    finally:
        daemon.stop()


def test_a_name_whose_account_went_on_under_another_starts_afresh_for_the_account_given_it(
    clock: Clock, tmp_path: Path
) -> None:
    """prod renamed production, and another account added as prod: production goes on from prod's
    state, and the new prod counts its own day from the start (its request ids alike to the other's)."""
    sims = account_simulators(clock, ("prod", "lab"))
    for sim in sims.values():
        sim.add_usage(5000)
    path = tmp_path / "config.yaml"
    state = {"path": str(tmp_path / "state.db")}
    first = {"accounts": accounts_section({"prod": sims["prod"]}, history_months=0), "state": state}
    renamed = {"production": sims["prod"], "prod": sims["lab"]}
    second = {"accounts": accounts_section(renamed, history_months=0), "state": state}
    path.write_text(yaml.safe_dump(first))
    daemon = Daemon(validate(first, {}), config_path=path, clock=clock, billing=AccountsBilling(sims), serve=False)
    try:
        assert daemon.refresh("prod/usage")
        path.write_text(yaml.safe_dump(second))
        assert daemon.reload()
        before = sims["prod"].requests_served[USAGES]
        assert all(daemon.refresh(key) for key in daemon.sources.keys("usage"))
        assert sims["prod"].requests_served[USAGES] - before < 5000 / 500  # production resumed
        assert_counted(daemon, renamed)
    finally:
        daemon.stop()


def test_an_account_taken_out_while_failing_and_put_back_failing_alike_is_logged_again(
    sims: dict[str, Simulator], clock: Clock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A failure is logged once while it lasts: the account taken out by a reload and put back is a
    new start, its failure said again at error."""
    path = tmp_path / "config.yaml"
    doc = document(sims, tmp_path, [])
    without = document({name: sim for name, sim in sims.items() if name != "prod"}, tmp_path, [])
    path.write_text(yaml.safe_dump(doc))
    daemon = Daemon(validate(doc, {}), config_path=path, clock=clock, billing=AccountsBilling(sims), serve=False)
    sims["prod"].inject(Fault("status", "/api/v1/bills", status=400, times=10**6))
    try:
        for config in (doc, without, doc):
            path.write_text(yaml.safe_dump(config))
            assert daemon.reload()
            if config is doc:
                assert not daemon.refresh("prod/bills")
                assert not daemon.refresh("prod/bills")
    finally:
        daemon.stop()
    failed = [r for r in logged(caplog.records, "refresh failed", source="prod/bills") if r.levelno == logging.ERROR]
    assert len(failed) == 2


def test_a_reload_refused_on_the_way_moves_no_account_to_another_s_state(
    sims: dict[str, Simulator], clock: Clock, tmp_path: Path
) -> None:
    """prod and staging swap keys, and lab (added) has a state file that cannot be read: the reload
    is refused, and neither then, nor after a restart on the config before, does an account go on
    from another's state."""
    for sim in sims.values():
        sim.add_usage(3000)
    path = tmp_path / "config.yaml"
    state = {"path": str(tmp_path / "state.db")}
    two = {name: sims[name] for name in ("prod", "staging")}
    first = {"accounts": accounts_section(two, history_months=0), "state": state}
    swapped = {"prod": sims["staging"], "staging": sims["prod"], "lab": sims["lab"]}
    second = {"accounts": accounts_section(swapped, history_months=0), "state": state}
    Path(account_state_path(state["path"], "lab")).write_bytes(b"not a state file" * 100)
    path.write_text(yaml.safe_dump(first))
    daemon = Daemon(validate(first, {}), config_path=path, clock=clock, billing=AccountsBilling(sims), serve=False)
    try:
        assert all(daemon.refresh(key) for key in daemon.sources.keys("usage"))
        path.write_text(yaml.safe_dump(second))
        assert not daemon.reload()
    finally:
        daemon.stop()
    path.write_text(yaml.safe_dump(first))
    before = {name: sim.requests_served[USAGES] for name, sim in two.items()}
    daemon = Daemon(validate(first, {}), config_path=path, clock=clock, billing=AccountsBilling(sims), serve=False)
    try:
        assert all(daemon.refresh(key) for key in daemon.sources.keys("usage"))
        for name, sim in two.items():
            assert sim.requests_served[USAGES] - before[name] < 3000 / 500  # resumed, from its own
        assert_counted(daemon, two)
    finally:
        daemon.stop()


def test_an_account_renamed_onto_a_name_whose_account_the_same_reload_takes_out_shows_nothing_of_that_one(
    clock: Clock, tmp_path: Path
) -> None:
    """prod renamed staging, staging's own account taken out: the name's figures were the other
    account's, so none is shown (nor counted fresh) until its sources refresh; then they are prod's,
    gone on from prod's state (no jump from staging's count to prod's)."""
    sims = account_simulators(clock, ("prod", "staging"))
    for sim in sims.values():
        sim.add_usage(3000)
    path = tmp_path / "config.yaml"
    state = {"path": str(tmp_path / "state.db")}
    first = {"accounts": accounts_section(sims, history_months=0), "state": state}
    second = {"accounts": accounts_section({"staging": sims["prod"]}, history_months=0), "state": state}
    path.write_text(yaml.safe_dump(first))
    daemon = Daemon(validate(first, {}), config_path=path, clock=clock, billing=AccountsBilling(sims), serve=False)
    try:
        assert all(daemon.refresh(key) for key in list(daemon.sources.refreshers))
        path.write_text(yaml.safe_dump(second))
        assert daemon.reload()
        assert named(metrics(daemon), "inference_bill_month_to_date_payable_amount") == {}
        assert named(metrics(daemon), "inference_usage_requests_total") == {}
        assert not [k for k in daemon.sources.health() if k.endswith(("/bills", "/usage"))]
        before = sims["prod"].requests_served[USAGES]
        assert all(daemon.refresh(key) for key in list(daemon.sources.refreshers))
        assert sims["prod"].requests_served[USAGES] - before < 3000 / 500  # resumed from prod's own
        assert_counted(daemon, {"staging": sims["prod"]})
    finally:
        daemon.stop()


def test_with_one_account_the_digest_holds_every_alert_whatever_its_labels(
    sims: dict[str, Simulator], clock: Clock, tmp_path: Path
) -> None:
    """Without `accounts`, an `account` label is one a rule's `labels` set (a team's name): the one
    digest there is holds its alert, as the daemon's round of digests does."""
    rule = {"alert": "Spend", "signal": "spend", "window": "month", "threshold": 1, "labels": {"account": "finance"}}
    doc = {"billing": fake_billing_section(sims["prod"]), "alerts": {"rules": [rule]},
           "state": {"path": str(tmp_path / "state.db")}}  # fmt: skip
    daemon = Daemon(validate(doc, {}), clock=clock, billing=AccountsBilling(sims), serve=False)
    try:
        assert daemon.refresh("bills")
        daemon.alert_cycle()
        sources = daemon.sources
        (name,) = sources.accounts
        bodies = [
            sources.digest(clock.today(), "daily", ""),
            # (the round's: the alerts grouped by account, as `DigestQueue` and the `digest` command give them)
            sources.digest(clock.today(), "daily", "", account=name,
                           alerts=FiringByAccount(sources.engine.current, sources.config.several).of(name)),
        ]  # fmt: skip
    finally:
        daemon.stop()
    assert [[a["alertname"] for a in body["alerts"]] for body in bodies] == [["Spend"], ["Spend"]]


def test_an_account_a_reload_adds_or_renames_does_not_take_the_others_out_of_service(
    sims: dict[str, Simulator], clock: Clock, tmp_path: Path
) -> None:
    """At start every account is tried before the exporter is ready; once it has been, an account a
    reload adds (its API slow, hanging, or its key mistyped) or renames is not waited for: the others'
    figures stay in service, and /readyz names the new one `not refreshed yet`."""
    path = tmp_path / "config.yaml"
    two = {name: sims[name] for name in ("prod", "staging")}
    path.write_text(yaml.safe_dump(document(two, tmp_path, [])))
    daemon = Daemon(validate(document(two, tmp_path, []), {}), config_path=path, clock=clock,
                    billing=AccountsBilling(sims), serve=False)  # fmt: skip
    try:
        assert not readiness(daemon)[0]  # (nothing tried yet)
        assert daemon.refresh("prod/bills")
        assert daemon.refresh("prod/usage")
        assert not readiness(daemon)[0]  # (staging not tried yet, at start)
        assert all(daemon.refresh(key) for key in ("staging/bills", "staging/usage"))
        assert readiness(daemon)[0]
        renamed = {"prod": sims["prod"], "stg": sims["staging"], "lab": sims["lab"]}
        path.write_text(yaml.safe_dump(document(renamed, tmp_path, [])))
        assert daemon.reload()
        ready, states = readiness(daemon)
        assert ready
        assert (states["lab/bills"], states["stg/bills"], states["prod/bills"]) == ("not refreshed yet",) * 2 + ("ok",)
    finally:
        daemon.stop()


def test_an_account_s_digest_holds_the_alerts_of_rules_not_split_by_account_only_where_they_count_it(
    sims: dict[str, Simulator], clock: Clock, tmp_path: Path
) -> None:
    """A rule narrowed to other accounts, or a budget rule whose budget spans other accounts, is not
    the account's: its alert is left out of that account's digest (as the budgets section leaves the
    budget out), and told in the digests of the accounts it counts."""
    rules = [
        {"alert": "ProdSpendHigh", "signal": "spend", "window": "month", "where": {"account": "prod"}, "threshold": 1},
        {"alert": "Everywhere", "signal": "spend", "window": "month", "threshold": 1},
        {"alert": "TwoBudget", "budget": "two", "tiers": [0.5]},
    ]
    two = {"name": "two", "amount": "100", "where": {"account": ["prod", "staging"]}}
    daemon = daemon_on(sims, clock, document(sims, tmp_path, rules, budgets=[two]))
    try:
        assert refresh_all(daemon) == [True, True, True]
        daemon.alert_cycle()
        assert {a.labels["alertname"] for a in daemon.sources.engine.current() if a.state == "firing"} == {
            "ProdSpendHigh", "Everywhere", "TwoBudget"
        }  # fmt: skip
        digests = {name: daemon.sources.digest(clock.today(), "daily", "", account=name) for name in NAMES}
        told = {name: sorted(a["alertname"] for a in body["alerts"]) for name, body in digests.items()}
    finally:
        daemon.stop()
    assert told == {
        "prod": ["Everywhere", "ProdSpendHigh", "TwoBudget"],
        "staging": ["Everywhere", "TwoBudget"],
        "lab": ["Everywhere"],
    }


def test_the_organisation_budget_is_told_ended_only_once_every_account_s_new_month_is_fetched(
    sims: dict[str, Simulator], clock: Clock, frozen: FrozenClock, tmp_path: Path
) -> None:
    """lab's bills last fetched before midnight (its API down since): what it holds of November may
    not be all of it, so the organisation's November is not told as ended in prod's digest; once
    lab's December is fetched, it is, with the whole month."""
    frozen.set(clock.at(dt.date(2026, 11, 30), 23, 0))
    doc = document(sims, tmp_path, [], budgets=[{"name": "org", "amount": "100000"}])
    daemon = daemon_on(sims, clock, doc)
    try:
        assert refresh_all(daemon) == [True, True, True]
        frozen.set(clock.at(dt.date(2026, 12, 1), 10, 0))
        assert [daemon.refresh(f"{name}/bills") for name in ("prod", "staging")] == [True, True]

        def ended() -> list[dict]:
            body = daemon.sources.digest(dt.date(2026, 12, 1), "daily", "", account="prod")
            return [b for b in body["budgets"] if b["budget"] == "org" and "of" in b]

        assert ended() == []
        assert daemon.refresh("lab/bills")
        (line,) = ended()
        whole = sum((sim.bill_totals("2026-11")["total"] for sim in sims.values()), Decimal(0))
        assert line["used_ratio"] == round(float(whole / 100000), 4)
    finally:
        daemon.stop()


@pytest.mark.parametrize(("schedule", "sent_on"), [("daily", dt.date(2026, 12, 1)), ("weekly", dt.date(2026, 12, 7))])
def test_each_account_s_digest_tells_how_the_organisation_budget_ended_the_month(
    sims: dict[str, Simulator], clock: Clock, frozen: FrozenClock, tmp_path: Path, schedule: str, sent_on: dt.date
) -> None:
    """As an account's own monthly budget: the month that ended against the amount, summed over
    the accounts it spans, beside the new month as it stands; on the 1st, or in the weekly digest
    of the week that ran into the new month (November held in the grace days, for the test)."""
    frozen.set(clock.at(sent_on, 10, 0))
    ended = sum((sim.bill_totals("2026-11")["total"] for sim in sims.values()), Decimal(0))
    doc = document(sims, tmp_path, [], budgets=[{"name": "org", "amount": "100000"}])
    for account in doc["accounts"]:
        account["billing"]["previous_month_grace_days"] = 7
    daemon = daemon_on(sims, clock, doc)
    try:
        assert refresh_all(daemon) == [True, True, True]
        for name in NAMES:
            body = daemon.sources.digest(sent_on, schedule, "", account=name)
            (line,) = [b for b in body["budgets"] if b["budget"] == "org" and "of" in b]
            assert (line["of"], line["accounts"]) == ("2026-11", list(NAMES))
            assert line["used_ratio"] == round(float(ended / 100000), 4)
            assert "org (2026-11, ended, 100000, accounts prod, staging, lab): used" in digest_text(body)
    finally:
        daemon.stop()
