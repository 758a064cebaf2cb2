"""Several accounts in one exporter: three simulators over HTTP, one going down and one dripping,
beside a healthy one whose figures and freshness must not notice; alerts per account, routed to
the notifiers their rules name; an organisation budget over all three."""

from __future__ import annotations

import contextlib
import datetime as dt
import socket
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest
import requests
import yaml

from exporter.app.daemon import Daemon
from exporter.app.sources import account_state_path
from exporter.config.load import ConfigError, validate
from exporter.core.clock import Clock
from exporter.sim import Fault, Simulator, SimulatorServer
from tests.conftest import SHANGHAI
from tests.daemon_fakes import account_simulators, accounts_section
from tests.helpers import LoopbackServer, Receiver, named, scrape, value, wait_for

pytestmark = pytest.mark.integration


class DripBilling(LoopbackServer):
    """A billing API that answers one byte every `interval` seconds, for ever (a stuck proxy)."""

    def __init__(self, interval: float = 0.5) -> None:
        super().__init__()
        self.interval = interval
        self.url = f"http://127.0.0.1:{self.port}"

    def serve(self, connection: socket.socket) -> None:
        with connection:
            try:
                connection.recv(65536)
                for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"." * 100000:
                    if self.stopping.wait(self.interval):
                        return
                    connection.sendall(bytes([byte]))
            except OSError:
                return


@pytest.fixture
def clock() -> Clock:
    start, origin = dt.datetime(2026, 11, 22, 10, 0, tzinfo=SHANGHAI), time.monotonic()
    return Clock(SHANGHAI, lambda: start + dt.timedelta(seconds=time.monotonic() - origin))


def simulators(clock: Clock) -> dict[str, Simulator]:
    return account_simulators(clock)


def document(sims: dict[str, Simulator], urls: dict[str, str], tmp_path: Path, receivers: dict[str, Receiver]) -> dict:
    fast = {"bills_interval": "300ms", "usage_interval": "300ms", "history_months": 0, "timeout": "2s"}
    return {
        "accounts": accounts_section(sims, urls, **fast),
        "budgets": [
            {"name": "organisation", "amount": "1000000"},
            {"name": "prod-and-lab", "amount": "1000000", "where": {"account": ["prod", "lab"]}},
        ],
        "alerts": {
            "evaluation_interval": "200ms",
            "rules": [
                {  # the month so far per account: prod's is far above (a 900,000 line), the others' far below
                    "alert": "AccountSpendHigh",
                    "signal": "spend",
                    "window": "month",
                    "by": ["account"],
                    "threshold": "500000",
                    "notifiers": ["pager"],
                },
            ],
            "notifiers": [{"name": n, "type": "webhook", "url": r.url} for n, r in receivers.items()],
        },
        "digest": {"notifiers": ["finance"]},
        "state": {"path": str(tmp_path / "state.db")},
    }


def month_total(sim: Simulator) -> Decimal:
    return sim.bill_totals(f"{sim.clock.today():%Y-%m}")["total"]


@pytest.fixture
def receivers() -> Iterator[dict[str, Receiver]]:
    made = {name: Receiver() for name in ("pager", "chat", "finance")}
    yield made
    for receiver in made.values():
        receiver.stop()


def test_three_accounts_one_down_one_dripping(clock: Clock, tmp_path: Path, receivers: dict[str, Receiver]) -> None:
    sims = simulators(clock)
    sims["prod"].revise_bill(clock.today(), "ep-prod", "ITEM_PROMPT_TOKEN", Decimal("900000"))  # prod spends far more
    servers: dict[str, SimulatorServer] = {name: sim.serve() for name, sim in sims.items()}
    drip = DripBilling()
    urls = {name: server.url for name, server in servers.items()}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(document(sims, urls, tmp_path, receivers)))
    daemon = Daemon(validate(yaml.safe_load(path.read_text()), {}), config_path=path, clock=clock, listen="127.0.0.1:0")
    daemon.start()
    metrics_url = daemon.server.url
    try:
        series = wait_for(
            lambda: (
                (s := scrape(metrics_url))
                and all(value(s, "inference_exporter_refresh_success", account=n, source="bills") == 1 for n in sims)
                and value(s, "inference_budget_used_ratio", budget="organisation") is not None
                and s
            ),
            timeout=30,
        )
        before = {n: month_total(sim) for n, sim in sims.items()}
        organisation = sum(before.values(), Decimal(0)) / Decimal(1000000)
        assert Decimal(str(value(series, "inference_budget_used_ratio", budget="organisation"))) == pytest.approx(
            organisation, rel=Decimal("1e-12")
        )

        # staging goes down, lab drips (its URL now a server that answers a byte
        # every half second): a reload that changes lab alone
        sims["staging"].inject(Fault("drop", times=10**9))  # every request: the connection closed, no answer
        document_now = yaml.safe_load(path.read_text())
        document_now["accounts"][2]["billing"]["url"] = drip.url
        path.write_text(yaml.safe_dump(document_now))
        assert daemon.reload()

        # prod's figures move on; they must reach /metrics to the cent while the others fail or hang
        ages: list[float] = []
        for round_ in range(6):
            sims["prod"].revise_bill(clock.today(), "ep-shared", "ITEM_COMPLETION_TOKEN", Decimal(f"{round_ + 1}.07"))
            wanted = month_total(sims["prod"])

            def prod_current(wanted: Decimal = wanted) -> bool:
                s = scrape(metrics_url)
                ages.append(
                    clock.now().timestamp()
                    - (
                        value(
                            s,
                            "inference_exporter_last_refresh_success_timestamp_seconds",
                            account="prod",
                            source="bills",
                        )
                        or 0
                    )
                )
                shown = sum(
                    Decimal(str(v))
                    for labels, v in named(s, "inference_bill_item_daily_payable_amount").items()
                    if ("account", "prod") in labels and ("period", f"{clock.today():%Y-%m}") in labels
                )
                return abs(shown - wanted) < Decimal("0.005")

            wait_for(prod_current, timeout=10)
        # staging's failure is said (after the client's retries), while prod stays fresh
        series = wait_for(
            lambda: (
                (s := scrape(metrics_url))
                and value(s, "inference_exporter_refresh_success", account="staging", source="bills") == 0
                and s
            ),
            timeout=30,
        )
        assert value(series, "inference_exporter_refresh_success", account="prod", source="bills") == 1
        prod_age = clock.now().timestamp() - value(
            series, "inference_exporter_last_refresh_success_timestamp_seconds", account="prod", source="bills"
        )
        # Refreshed every 0.3 s; on a loaded machine a few seconds late at worst (5.8 s seen at load 16). Held
        # behind lab's dripping answer it would stop for good, and behind staging's retries lose 4-8 s a round.
        assert max([*ages, prod_age]) < 8.0, f"prod's bills went {max(ages):.1f} s without a refresh"
        lab_age = clock.now().timestamp() - value(
            series, "inference_exporter_last_refresh_success_timestamp_seconds", account="lab", source="bills"
        )
        assert lab_age > 2.0  # lab's last success is from before it began to drip: its age says so
        assert drip.connections >= 1
        # each of lab's requests is cut as its 2 s timeout passes: once its attempts are spent, its
        # failure is said too, not a refresh in flight for ever
        wait_for(
            lambda: (
                value(scrape(metrics_url), "inference_exporter_refresh_success", account="lab", source="bills") == 0
            ),
            timeout=60,
        )
        assert drip.connections >= 4

        # the organisation's budget sums the three (staging's and lab's last good figures)
        now_total = month_total(sims["prod"]) + before["staging"] + before["lab"]
        shown = Decimal(str(value(series, "inference_budget_used_ratio", budget="organisation")))
        assert shown == pytest.approx(now_total / Decimal(1000000), rel=Decimal("1e-12"))
        assert value(series, "inference_budget_used_ratio", budget="prod-and-lab") == pytest.approx(
            float((month_total(sims["prod"]) + before["lab"]) / Decimal(1000000))
        )

        # one account's alert, to the one notifier its rule names
        alerts = wait_for(lambda: receivers["pager"].bodies(), timeout=15)
        fired = [a for body in alerts for a in body["alerts"]]
        assert {a["labels"]["account"] for a in fired} == {"prod"}
        time.sleep(0.5)
        assert receivers["chat"].bodies() == []  # not named by the rule
        told_finance = receivers["finance"].bodies()
        assert [b for b in told_finance if b.get("kind") != "digest"] == []  # only the digest names it
        assert sorted(b["account"] for b in told_finance) == sorted(sims)  # a digest per account
        states = daemon.sources.engine.current()
        assert [a.labels["account"] for a in states if a.state == "firing"] == ["prod"]

        # the landing page, readiness and the alerts API know the accounts
        page = requests.get(daemon.server.url, timeout=10).text
        for name in sims:
            assert f"<tr><td>{name}</td>" in page
        summary = {name: page.split(f"<tr><td>{name}</td>", 1)[1].split("</tr>", 1)[0] for name in sims}
        assert summary["staging"].endswith(" failing</td>")  # its own sources, not another account's
        assert summary["prod"].endswith(" ok</td>")
        assert "<td>organisation</td><td>every account</td>" in page
        assert "<td>prod-and-lab</td><td>lab, prod</td>" in page
        ready = requests.get(f"{daemon.server.url}/readyz", timeout=10).json()
        assert ready["sources"]["prod/bills"] == "ok"
        assert ready["sources"]["staging/bills"].startswith("failing")
        listed = requests.get(f"{daemon.server.url}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
        assert {a["labels"]["account"] for a in listed} == {"prod"}
    finally:
        daemon.stop(grace=3)
        drip.stop()
        for server in servers.values():
            server.stop()
    assert Path(account_state_path(str(tmp_path / "state.db"), "prod")).is_file()


def test_readiness_waits_for_each_account_to_be_tried_and_one_to_serve_not_for_one_that_fails(
    clock: Clock, tmp_path: Path
) -> None:
    """One account's API refuses its key from the start: the other's figures are served, and the pod
    is ready once the refused account has been tried (its sources `never succeeded` in the body). A
    reload that adds an account with a wrong key does not take the pod out of service for good; with
    every account refused, there is nothing to serve."""
    sims = simulators(clock)
    servers = {name: sim.serve() for name, sim in sims.items()}
    urls = {name: server.url for name, server in servers.items()}
    fast = {"bills_interval": "300ms", "usage_interval": "300ms", "history_months": 0, "timeout": "2s"}
    accounts = accounts_section(sims, urls, **fast)
    accounts[1]["billing"]["secret_access_key"] = "wrong"  # (staging: refused, every time)
    path = tmp_path / "config.yaml"

    def write(kept: list[dict]) -> None:
        path.write_text(yaml.safe_dump({"accounts": kept, "state": {"path": str(tmp_path / "state.db")}}))

    def readiness() -> tuple[int, dict]:
        response = requests.get(f"{daemon.server.url}/readyz", timeout=10)
        return response.status_code, response.json()

    write(accounts[:2])
    daemon = Daemon(validate(yaml.safe_load(path.read_text()), {}), config_path=path, clock=clock, listen="127.0.0.1:0")
    daemon.start()
    try:
        body = wait_for(lambda: (found := readiness())[0] == 200 and found[1], timeout=30)
        assert body["sources"]["prod/bills"] == body["sources"]["prod/usage"] == "ok"
        assert body["sources"]["staging/bills"] == body["sources"]["staging/usage"] == "never succeeded"
        assert (
            value(scrape(daemon.server.url), "inference_exporter_refresh_success", account="staging", source="bills")
            == 0
        )

        accounts[2]["billing"]["secret_access_key"] = "wrong too"  # (lab, added by a reload: refused too)
        write(accounts)
        assert daemon.reload()
        wait_for(lambda: readiness()[1]["sources"].get("lab/bills") == "never succeeded", timeout=30)
        time.sleep(1)  # (several refreshes of each)
        assert readiness()[0] == 200

        write([accounts[1], accounts[2]])  # (prod taken out: no account left that is served)
        assert daemon.reload()
        wait_for(lambda: readiness()[0] == 503, timeout=30)
    finally:
        daemon.stop(grace=3)
        for server in servers.values():
            server.stop()


def test_accounts_and_billing_exclude_each_other() -> None:
    sim = Simulator()
    section = {"url": "http://127.0.0.1:9", "access_key_id": sim.access_key_id, "secret_access_key": "s"}
    with pytest.raises(ConfigError, match="exclude each other"):
        validate({"billing": section, "accounts": [{"name": "a", "billing": section}]}, {})
    with pytest.raises(ConfigError, match="share their billing days"):
        validate(
            {
                "accounts": [
                    {"name": "a", "billing": section},
                    {"name": "b", "billing": section | {"timezone": "UTC"}},
                ]
            },
            {},
        )


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"budgets": [{"name": "b", "amount": 5, "where": {"account": "nope"}}]}, "unknown account 'nope'"),
        ({"budgets": [{"name": "b", "amount": 5, "where": {"account": ["a", "x"]}}]}, "unknown account 'x'"),
        (
            {"alerts": {"rules": [{"alert": "A", "signal": "spend", "threshold": 1, "notifiers": ["ghost"]}]}},
            "unknown notifier 'ghost'",
        ),
        (
            {"alerts": {"rules": [{"alert": "A", "signal": "spend", "threshold": 1, "where": {"account": "zz"}}]}},
            "'zz' matches nothing (known: a, b)",
        ),
    ],
)
def test_what_names_an_account_or_a_notifier_must_name_one_that_exists(extra: dict, expected: str) -> None:
    section = {"url": "http://127.0.0.1:9", "access_key_id": "AK", "secret_access_key": "s"}
    document = {"accounts": [{"name": "a", "billing": section}, {"name": "b", "billing": section}]} | extra
    with pytest.raises(ConfigError) as raised:
        validate(document, {})
    assert any(expected in detail for detail in raised.value.details), raised.value.details


def test_account_needs_accounts() -> None:
    section = {"url": "http://127.0.0.1:9", "access_key_id": "AK", "secret_access_key": "s"}
    rule = {"alert": "A", "signal": "spend", "threshold": 1, "by": ["account"]}
    with pytest.raises(ConfigError) as raised:
        validate({"billing": section, "alerts": {"rules": [rule]}}, {})
    assert any("only `accounts` gives" in detail for detail in raised.value.details), raised.value.details


def two_accounts(tmp_path: Path, sims: dict[str, Simulator], urls: dict[str, str]) -> Path:
    path = tmp_path / "accounts.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "accounts": accounts_section(sims, urls, history_months=0),
                "alerts": {
                    "rules": [
                        {"alert": "Paged", "signal": "spend", "threshold": 1, "notifiers": ["pager"]},
                        {"alert": "Everywhere", "signal": "spend", "threshold": 1, "by": ["account"]},
                    ],
                    "notifiers": [
                        {"name": n, "type": "webhook", "url": "http://127.0.0.1:9/"}
                        for n in ("pager", "chat", "finance")
                    ],
                },
                "digest": {"notifiers": ["finance"]},
                "state": {"path": str(tmp_path / "state.db")},
            }
        )
    )
    return path


def test_the_commands_know_accounts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.test_cli import invoke

    clock = Clock(SHANGHAI)  # the commands' clock is the real one
    sims = {name: sim for name, sim in simulators(clock).items() if name != "lab"}
    servers = {name: sim.serve() for name, sim in sims.items()}
    try:
        path = two_accounts(tmp_path, sims, {name: server.url for name, server in servers.items()})
        checked = invoke(monkeypatch, capsys, "check", "--config", str(path))
        assert checked.returncode == 0, checked.stderr
        assert "2 accounts" in checked.stdout
        assert "  rule Paged: to pager\n" in checked.stdout
        assert "  rule Everywhere: to pager, chat\n" in checked.stdout  # not to the digest's notifier

        refused = invoke(monkeypatch, capsys, "backtest", "--config", str(path), "--from", f"{clock.period()}")
        assert refused.returncode == 2
        assert "name one with --account (prod, staging)" in refused.stderr
        unknown = invoke(
            monkeypatch, capsys, "backtest", "--config", str(path), "--from", clock.period(), "--account", "x"
        )
        assert "no account 'x' (accounts: prod, staging)" in unknown.stderr

        output = tmp_path / "prod.om"
        first = f"{clock.today().replace(day=1) - dt.timedelta(days=1):%Y-%m}"
        filled = invoke(
            monkeypatch, capsys, "backfill", "--config", str(path), "--from", first, "--to", first,
            "--output", str(output), "--account", "staging",
        )  # fmt: skip
        assert filled.returncode == 0, filled.stderr
        lines = [line for line in output.read_text().splitlines() if line.startswith("inference_bill_endpoint_daily")]
        assert lines
        assert all('account="staging"' in line for line in lines)
        assert not any("ep-prod" in line for line in lines)  # staging's own endpoints only
        calendar = [line for line in output.read_text().splitlines() if line.startswith("inference_billing_today_info")]
        assert calendar
        assert not any("account=" in line for line in calendar)  # the process's own series, as live: no account
        twice = invoke(
            monkeypatch, capsys, "backfill", "--config", str(path), "--from", first, "--to", first,
            "--output", str(tmp_path / "twice.om"), "--account", "staging", "--label", "account=staging",
        )  # fmt: skip
        assert twice.returncode == 2
        assert "account is the exporter's own label with `accounts` (here staging, from --account)" in twice.stderr
        assert not (tmp_path / "twice.om").exists()

        once = invoke(monkeypatch, capsys, "once", "--config", str(path))
        assert once.returncode == 0, once.stderr
        for name, sim in sims.items():  # each account's month, to the cent, under its name
            shown = sum(
                Decimal(line.rsplit(" ", 1)[1])
                for line in once.stdout.splitlines()
                if line.startswith("inference_bill_item_daily_payable_amount{")
                and f'account="{name}"' in line
                and f'period="{clock.today():%Y-%m}"' in line
            )
            assert abs(shown - month_total(sim)) < Decimal("0.005")

        digests = invoke(monkeypatch, capsys, "digest", "--config", str(path))
        assert digests.returncode == 0, digests.stderr
        assert "inference spend of prod" in digests.stdout
        assert "inference spend of staging" in digests.stdout

        asked = {name: sum(sim.requests_served.values()) for name, sim in sims.items()}
        unknown = invoke(monkeypatch, capsys, "digest", "--config", str(path), "--account", "prd")
        assert unknown.returncode == 2
        assert unknown.stderr.endswith("inference-cost-exporter digest: no account 'prd' (accounts: prod, staging)\n")
        assert "note: no state file" not in unknown.stderr
        assert {name: sum(sim.requests_served.values()) for name, sim in sims.items()} == asked  # none made
        servers["staging"].stop()  # the account not asked for is down
        alone = invoke(monkeypatch, capsys, "digest", "--config", str(path), "--account", "prod")
        assert alone.returncode == 0, alone.stderr
        assert "inference spend of prod" in alone.stdout
        assert "inference spend of staging" not in alone.stdout
        assert "inference-cost-exporter digest: note: staging/bills: " in alone.stderr
        down = invoke(monkeypatch, capsys, "digest", "--config", str(path), "--account", "staging")
        assert down.returncode == 2
        assert down.stderr.splitlines()[-1].startswith("inference-cost-exporter: staging/bills: ")
    finally:
        for server in servers.values():
            server.stop()


@pytest.mark.parametrize(
    ("accounts", "budgets", "expected"),
    [
        (  # an account's own budget on api_key, without per_api_key there
            [{"name": "a", "budgets": [{"name": "b", "amount": 5, "where": {"api_key": "sk-ab****"}}]}],
            [],
            "accounts[0].budgets[0].where.api_key (budget 'b'): usage is counted per API key only with",
        ),
        (  # a top-level budget over an account that cannot price the model
            [{"name": "a", "prices": [{"model": "m", "prompt_per_million": 1, "completion_per_million": 1}]},
             {"name": "c"}],
            [{"name": "b", "amount": 5, "where": {"model": "m"}}],
            "budgets[0].where.model (budget 'b'): model 'm' has no entry in `prices` (account 'c')",
        ),
    ],
)  # fmt: skip
def test_budget_scopes_are_checked_against_each_account_they_are_measured_on(
    accounts: list[dict], budgets: list[dict], expected: str
) -> None:
    section = {"url": "http://127.0.0.1:9", "access_key_id": "AK", "secret_access_key": "s"}
    document = {"accounts": [{"billing": section} | a for a in accounts], "budgets": budgets}
    with pytest.raises(ConfigError) as raised:
        validate(document, {})
    assert any(detail.startswith(expected) for detail in raised.value.details), raised.value.details


def test_an_organisation_budget_on_api_keys_is_accepted_when_every_account_counts_them() -> None:
    section = {"url": "http://127.0.0.1:9", "access_key_id": "AK", "secret_access_key": "s", "per_api_key": True}
    prices = [{"model": "m", "prompt_per_million": 1, "completion_per_million": 1}]
    config = validate(
        {
            "accounts": [{"name": "a", "billing": section}, {"name": "b", "billing": section}],
            "prices": prices,
            "budgets": [{"name": "keys", "amount": 5, "where": {"api_key": ["sk-ab****", "sk-cd****"]}}],
        },
        {},
    )
    assert config.shared_budgets[0].name == "keys"


def test_the_digest_command_reads_each_account_s_probe_runs_from_the_file_it_has(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The daemon kept prod's probe runs of yesterday in prod's file, and staging's, the one
    account of the config before, in the process's own; the config now names prod production,
    before staging: `digest` tells each its own runs (the file follows the account, not the name)."""
    from exporter.app.account import billing_account_id
    from exporter.config.schema import BillingConfig
    from exporter.state import StateStore
    from exporter.state.accounts import AccountFile
    from tests.test_cli import invoke

    clock = Clock(SHANGHAI)
    sims = {name: sim for name, sim in simulators(clock).items() if name != "lab"}
    servers = {name: sim.serve() for name, sim in sims.items()}
    try:
        named_now = {"production": sims["prod"], "staging": sims["staging"]}
        urls = {"staging": servers["staging"].url, "production": servers["prod"].url}
        accounts = accounts_section(named_now, urls, history_months=0)
        for account, sim in zip(accounts, named_now.values(), strict=True):
            account["probes"] = [{"name": "chat", "model": sim.endpoints[0].endpoint_id}]
            account["inference"] = {"url": "http://127.0.0.1:9", "api_key": sim.api_key}
        state = tmp_path / "state.db"
        path = tmp_path / "accounts.yaml"
        path.write_text(yaml.safe_dump({"accounts": accounts, "digest": {"notifiers": ["finance"]},
                                        "alerts": {"notifiers": [{"name": "finance", "type": "webhook",
                                                                  "url": "http://127.0.0.1:9/"}]},
                                        "state": {"path": str(state)}}))  # fmt: skip
        ids = {a["name"]: billing_account_id(BillingConfig.model_validate(a["billing"])) for a in accounts}
        yesterday = clock.day_start(clock.today() - dt.timedelta(days=1)).timestamp()
        with contextlib.closing(StateStore(str(state))) as process:  # as the daemon left them
            process.record_account_files(
                [AccountFile("", ids["staging"], ""), AccountFile("prod", ids["production"], "prod")]
            )
            process.record_probe_run("chat", yesterday + 600, False, None, keep_from=0)
        with contextlib.closing(StateStore(account_state_path(str(state), "prod"))) as own:
            for minutes in (10, 20, 30):
                own.record_probe_run("chat", yesterday + 60 * minutes, True, 0.5, keep_from=0)
        told = invoke(monkeypatch, capsys, "digest", "--config", str(path))
        assert told.returncode == 0, told.stderr
        production, staging = told.stdout.split("Daily inference spend of ")[1:]
        assert staging.startswith("staging ")
        assert "chat: 0% of 1 run succeeded" in staging
        assert "chat: 100% of 3 runs succeeded" in production
    finally:
        for server in servers.values():
            server.stop()
