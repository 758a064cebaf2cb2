"""What a reload leaves behind, and what it keeps: a refresh still in flight across it publishes
nothing for what the new config removed and judges with the new config; a reload refused on the
way changes nothing; accounts that come and go leave no series of an old config; an anomaly rule
the reload leaves as it was keeps its last judgement shown; a digest made across a reload goes to
the notifiers of the config of now. On the simulator in process
(tests/daemon_fakes.py), each refresh held at a gate while the config changes under it."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable
from decimal import Decimal
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml
from apscheduler.events import EVENT_JOB_MAX_INSTANCES, EVENT_JOB_SUBMITTED

from exporter.app import account
from exporter.app import daemon as daemon_module
from exporter.app.daemon import Daemon
from exporter.app.sources import Sources
from exporter.config.load import validate
from exporter.core.clock import Clock
from exporter.sim import Fault, Simulator, SimulatorServer, SpendModel
from exporter.state import StateError
from tests.daemon_fakes import (
    NOWHERE,
    account_simulators,
    accounts_section,
    digests_told,
    fake_billing_section,
    metrics,
    readiness,
    unit_daemon,
)
from tests.fakes import chat_runner
from tests.helpers import logged, named, value, wait_for
from tests.test_accounts_unit import AccountsBilling, AddressedBilling
from tests.test_alerts import to_hook
from tests.test_probe import CHAT
from tests.test_reconcile import PRICES, billed_week
from tests.test_spend_anomaly import RULE, YESTERDAY


def write(path: Path, document: dict) -> None:
    path.write_text(yaml.safe_dump(document))


def reload_in_flight(
    daemon: Daemon, source: str, target: Any, name: str, path: Path, document: dict,
    meanwhile: Callable[[], None] = lambda: None,
) -> None:  # fmt: skip
    """Refresh `source` on a thread of its own, held once `target.name` has done its work (a
    refresh caught in flight) while the config at `path` becomes `document` and is reloaded (and
    `meanwhile` runs); then let it finish."""
    gate, entered = threading.Event(), threading.Event()
    work = getattr(target, name)

    def waiting(*args: object, **kwargs: object) -> object:
        done = work(*args, **kwargs)
        entered.set()
        gate.wait(20)
        return done

    setattr(target, name, waiting)
    refreshing = threading.Thread(target=daemon.refresh, args=(source,))
    refreshing.start()
    try:
        assert entered.wait(20), "the refresh never came"
        write(path, document)
        assert daemon.reload()
        meanwhile()
    finally:
        gate.set()
        refreshing.join(20)
        setattr(target, name, work)
    assert not refreshing.is_alive()


@pytest.fixture
def priced(sim: Simulator) -> Simulator:
    return billed_week(sim)


def reloadable(sim: Simulator, clock: Clock, path: Path, document: dict) -> Daemon:
    """A daemon on `sim` in process, its config `document` written at `path` (reloaded from there)."""
    write(path, document)
    return unit_daemon(validate(document, {}), sim, clock, config_path=path)


def health(daemon: Daemon) -> list[str]:
    return sorted(dict(labels)["source"] for labels in named(metrics(daemon), "inference_exporter_refresh_success"))


def probes_shown(daemon: Daemon) -> list[str]:
    return sorted(dict(labels)["probe"] for labels in named(metrics(daemon), "inference_probe_success"))


def endpoints_probed(daemon: Daemon) -> list[str]:
    return sorted(dict(labels)["endpoint_id"] for labels in named(metrics(daemon), "inference_probe_success"))


def amount_gaps(daemon: Daemon) -> set[float]:
    return {round(v, 6) for v in named(metrics(daemon), "inference_reconciliation_amount_gap_ratio").values()}


def assert_probes(daemon: Daemon, probes: list[str]) -> None:
    assert probes_shown(daemon) == probes


def assert_gaps(daemon: Daemon, gaps: set[float]) -> None:
    assert amount_gaps(daemon) == gaps


def priced_at(factor: int) -> list[dict]:
    """The reconciliation's prices, `factor` times what the simulator bills."""
    fields = ("prompt_per_million", "cached_prompt_per_million", "completion_per_million")
    return [p.model_copy(update={f: getattr(p, f) * factor for f in fields}).model_dump(mode="json") for p in PRICES]


def test_a_probe_removed_while_it_runs_does_not_come_back(
    sim: Simulator, clock: Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(account, "ProbeRunner", partial(chat_runner, sim))

    def document(probes: list[str]) -> dict:
        return {
            "billing": fake_billing_section(sim),
            "inference": {"url": NOWHERE, "api_key": sim.api_key},
            "probes": [{"name": n, "model": sim.endpoints[0].endpoint_id, "interval": "1h"} for n in probes],
            "state": {"path": str(tmp_path / "state.db")},
        }

    path = tmp_path / "config.yaml"
    daemon = reloadable(sim, clock, path, document(["kept", "removed"]))
    try:
        assert daemon.refresh("probe:kept")
        runner = daemon.sources.one.probes["removed"]
        reload_in_flight(daemon, "probe:removed", runner, "run", path, document(["kept"]),
                         meanwhile=lambda: assert_probes(daemon, ["kept"]))  # fmt: skip
        assert probes_shown(daemon) == ["kept"]  # what the run in flight found is not taken
        assert health(daemon) == ["probe:kept"]  # nor its health: its age would grow for ever
        write(path, document(["kept"]) | {"budgets": [{"name": "month", "amount": "1"}]})
        assert daemon.reload()
        assert (probes_shown(daemon), health(daemon)) == (["kept"], ["probe:kept"])
    finally:
        daemon.stop()


def test_a_probe_put_back_while_its_removed_self_runs_shows_its_own_run_only(
    sim: Simulator, clock: Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Probe x taken out while a run of it is in flight, then put back on another model: the run
    in flight shows nothing (neither its old model's series nor its health), and is run again,
    now as the probe of now (its first run found the old one's in the way)."""
    monkeypatch.setattr(account, "ProbeRunner", partial(chat_runner, sim))
    alpha, beta = sim.endpoints[0].endpoint_id, sim.endpoints[1].endpoint_id

    def document(probes: dict[str, str]) -> dict:
        return {
            "billing": fake_billing_section(sim),
            "inference": {"url": NOWHERE, "api_key": sim.api_key},
            "probes": [{"name": n, "model": m, "interval": "1h"} for n, m in probes.items()],
            "state": {"path": str(tmp_path / "state.db")},
        }

    def runs() -> dict[str, float]:
        found = named(metrics(daemon), "inference_probe_runs_total")
        return {dict(labels)["endpoint_id"]: v for labels, v in found.items() if dict(labels)["probe"] == "x"}

    path = tmp_path / "config.yaml"
    daemon = reloadable(sim, clock, path, document({"x": alpha, "other": alpha}))
    ran: list[str] = []
    monkeypatch.setattr(daemon, "_run_soon", ran.append)
    try:
        assert daemon.refresh("probe:x")
        runner = daemon.sources.one.probes["x"]

        def put_back() -> None:
            write(path, document({"x": beta, "other": alpha}))
            assert daemon.reload()
            assert not daemon.refresh("probe:x")  # its first run: the removed one's in the way

        reload_in_flight(daemon, "probe:x", runner, "run", path, document({"other": alpha}), meanwhile=put_back)
        assert runs() == {}  # what the run in flight found is not taken
        assert "probe:x" not in health(daemon)
        assert ran == ["probe:x"]  # run again at once
        assert daemon.refresh("probe:x")
        assert runs() == {beta: 1.0}
    finally:
        daemon.stop()


def test_a_probe_run_more_often_keeps_its_counts_and_one_on_another_model_starts_afresh(
    sim: Simulator, clock: Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(account, "ProbeRunner", partial(chat_runner, sim))
    alpha, beta = sim.endpoints[0].endpoint_id, sim.endpoints[1].endpoint_id

    def document(model: str, interval: str) -> dict:
        return {
            "billing": fake_billing_section(sim),
            "inference": {"url": NOWHERE, "api_key": sim.api_key},
            "probes": [{"name": "x", "model": model, "interval": interval}],
            "state": {"path": str(tmp_path / "state.db")},
        }

    def runs() -> dict[str, float]:
        return {
            dict(labels)["endpoint_id"]: v for labels, v in named(metrics(daemon), "inference_probe_runs_total").items()
        }

    path = tmp_path / "config.yaml"
    daemon = reloadable(sim, clock, path, document(alpha, "1h"))
    try:
        assert daemon.refresh("probe:x")
        assert daemon.refresh("probe:x")
        write(path, document(alpha, "5m"))
        assert daemon.reload()
        assert daemon.sources.intervals["probe:x"] == 300
        assert daemon.refresh("probe:x")
        assert runs() == {alpha: 3.0}  # what it measures is as it was: its counts go on
        write(path, document(beta, "5m"))
        assert daemon.reload()
        assert daemon.refresh("probe:x")
        assert runs() == {beta: 1.0}
    finally:
        daemon.stop()


def test_the_digest_counts_a_probe_s_runs_of_what_it_measures_now(
    sim: Simulator, clock: Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As its metrics do: a reload that moves a probe to another endpoint, or a restart that finds
    it moved, forgets its runs in the state file; one that only changes how often or how long it
    runs keeps them, and so does taking it out and putting it back as it was."""
    monkeypatch.setattr(account, "ProbeRunner", partial(chat_runner, sim))
    alpha, beta = sim.endpoints[0].endpoint_id, sim.endpoints[1].endpoint_id
    path = tmp_path / "config.yaml"

    def document(model: str | None, interval: str = "1h", timeout: str = "30s") -> dict:
        probes = [{"name": "x", "model": model, "interval": interval, "timeout": timeout}] if model else []
        return {
            "billing": fake_billing_section(sim),
            "inference": {"url": NOWHERE, "api_key": sim.api_key},
            "probes": [*probes, {"name": "other", "model": beta}],
            "state": {"path": str(tmp_path / "state.db")},
        }

    def runs_told(daemon: Daemon) -> dict[str, int]:
        body = daemon.sources.digest(clock.today() + dt.timedelta(days=1), "daily", "")
        return {line["probe"]: line["runs"] for line in body["probes"]}

    daemon = reloadable(sim, clock, path, document(alpha))
    try:
        for source in ("probe:x", "probe:x", "probe:other"):
            assert daemon.refresh(source)
        for changed in (document(alpha, "5m", "10s"), document(None), document(alpha)):
            write(path, changed)
            assert daemon.reload()
            assert runs_told(daemon) == {"x": 2, "other": 1}  # (taken out, its runs are told still)
        write(path, document(beta))
        assert daemon.reload()
        assert runs_told(daemon) == {"x": 0, "other": 1}
        assert daemon.refresh("probe:x")
        assert runs_told(daemon) == {"x": 1, "other": 1}
    finally:
        daemon.stop()
    write(path, document(alpha))  # (moved back while the exporter was down)
    daemon = unit_daemon(validate(document(alpha), {}), sim, clock, config_path=path)
    try:
        assert runs_told(daemon) == {"x": 0, "other": 1}
    finally:
        daemon.stop()


def test_runs_are_kept_only_once_the_state_file_knows_what_the_probe_measures(
    sim: Simulator, clock: Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reload moves the probe while the state file refuses to note it: no run is kept until it
    takes the note (asked again before each run), so a later reload never takes the new
    endpoint's runs for the old one's, and forgets none of them."""
    monkeypatch.setattr(account, "ProbeRunner", partial(chat_runner, sim))
    alpha, beta = sim.endpoints[0].endpoint_id, sim.endpoints[1].endpoint_id
    path = tmp_path / "config.yaml"

    def document(model: str, interval: str = "1h") -> dict:
        return {
            "billing": fake_billing_section(sim),
            "inference": {"url": NOWHERE, "api_key": sim.api_key},
            "probes": [{"name": "x", "model": model, "interval": interval}],
            "state": {"path": str(tmp_path / "state.db")},
        }

    def runs_told() -> int:
        (line,) = daemon.sources.digest(clock.today() + dt.timedelta(days=1), "daily", "")["probes"]
        return int(line["runs"])

    daemon = reloadable(sim, clock, path, document(alpha))
    try:
        assert daemon.refresh("probe:x")
        store = type(daemon.sources.one.state)
        measuring = store.measuring

        def refusing(*args: object) -> list[str]:
            raise StateError("state.db", "disk full")

        monkeypatch.setattr(store, "measuring", refusing)
        write(path, document(beta))
        assert daemon.reload()
        assert daemon.refresh("probe:x")  # (shown; not kept: the note refused again)
        assert runs_told() == 1  # (alpha's, not yet forgotten)
        monkeypatch.setattr(store, "measuring", measuring)
        assert daemon.refresh("probe:x")
        assert daemon.refresh("probe:x")
        assert runs_told() == 2  # beta's two; alpha's forgotten
        write(path, document(beta, "5m"))
        assert daemon.reload()
        assert runs_told() == 2
    finally:
        daemon.stop()


def test_a_reload_to_another_address_counts_the_history_fresh_only_once_fetched_there(
    sim: Simulator, clock: Clock, tmp_path: Path
) -> None:
    """The months of the address before are forgotten, and so is their freshness: the history's
    last success is not shown (its age counts from the reload) until it is fetched at the new
    address, and a fetch at the old one still in flight across the reload records nothing."""
    path = tmp_path / "config.yaml"

    def at(url: str) -> dict:
        return {
            "billing": fake_billing_section(sim, history_months=1, url=url),
            "state": {"path": str(tmp_path / "state.db")},
        }

    def history_success() -> dict[str, float]:
        found = named(metrics(daemon), "inference_exporter_last_refresh_success_timestamp_seconds")
        return {dict(labels)["source"]: v for labels, v in found.items() if dict(labels)["source"] == "history"}

    write(path, at(f"{NOWHERE}/a"))
    daemon = unit_daemon(
        validate(at(f"{NOWHERE}/a"), {}), sim, clock, config_path=path, billing=AddressedBilling({"": sim})
    )
    try:
        assert daemon.refresh("bills")
        assert daemon.refresh("history")
        assert list(history_success()) == ["history"]
        held = daemon.sources.one.history
        reload_in_flight(daemon, "history", held, "refresh", path, at(f"{NOWHERE}/b"))
        assert daemon.latest.history is None
        assert history_success() == {}
        assert daemon.latest.waiting_since("history") == clock.now().timestamp()
        assert daemon.refresh("history")
        assert daemon.latest.history is not None
        assert list(history_success()) == ["history"]
    finally:
        daemon.stop()


def test_a_fetch_at_the_address_before_a_reload_saves_no_month_as_the_new_address_s(
    sim: Simulator, clock: Clock, tmp_path: Path
) -> None:
    """The history's fetch at the old `billing.url` ends after the reload (the new address's months
    already looked for in the state file): its months are not saved there, where a restart would
    take them for the new address's and not fetch them."""
    path = tmp_path / "config.yaml"

    def at(url: str) -> dict:
        return {
            "billing": fake_billing_section(sim, history_months=1, url=url),
            "state": {"path": str(tmp_path / "state.db")},
        }

    write(path, at(f"{NOWHERE}/a"))
    daemon = unit_daemon(
        validate(at(f"{NOWHERE}/a"), {}), sim, clock, config_path=path, billing=AddressedBilling({"": sim})
    )
    try:

        def meanwhile() -> None:
            daemon.sources.one.history.held()  # (as the bills' forecast reads it before a first refresh)

        reload_in_flight(daemon, "history", daemon.sources.one.history, "_save", path, at(f"{NOWHERE}/b"), meanwhile)
        store = daemon.sources.one.state
        assert store.history_source() == f"{NOWHERE}/b;"
        assert store.load_history() == []
        assert daemon.refresh("history")
        assert store.load_history() != []  # (fetched at the new address, saved)
    finally:
        daemon.stop()


def with_history(sim: Simulator, tmp_path: Path, months: int) -> dict:
    """A config of `months` of history on `sim`, its state file in `tmp_path`."""
    return {"billing": fake_billing_section(sim, history_months=months), "state": {"path": str(tmp_path / "state.db")}}


def test_history_turned_off_while_it_is_fetched_stays_off(sim: Simulator, clock: Clock, tmp_path: Path) -> None:
    document = partial(with_history, sim, tmp_path)
    path = tmp_path / "config.yaml"
    daemon = reloadable(sim, clock, path, document(2))
    try:
        assert daemon.refresh("bills")
        assert daemon.refresh("usage")
        reload_in_flight(daemon, "history", daemon.sources.one.history, "refresh", path, document(0))
        assert daemon.latest.history is None  # nothing stale is judged on
        assert health(daemon) == ["bills", "usage"]
    finally:
        daemon.stop()


@pytest.mark.parametrize("when", ["fetched in flight", "the API down"])
def test_fewer_history_months_go_at_the_reload(sim: Simulator, clock: Clock, tmp_path: Path, when: str) -> None:
    """The months a reload no longer keeps are not judged on (the anomaly baseline, the forecast)
    from the reload on: not until the next look 10 minutes later, nor brought back by a fetch in
    flight, nor kept while the API fails; and dropping them asks the API nothing."""
    sim.spend = SpendModel(start=dt.date(2026, 6, 1))
    document = partial(with_history, sim, tmp_path)
    path = tmp_path / "config.yaml"
    daemon = reloadable(sim, clock, path, document(3))
    kept = [f"{clock.today().replace(day=1) - dt.timedelta(days=1):%Y-%m}"]
    try:
        assert daemon.refresh("bills")
        assert daemon.refresh("usage")
        if when == "fetched in flight":
            reload_in_flight(daemon, "history", daemon.sources.one.history, "refresh", path, document(1))
        else:
            assert daemon.refresh("history")
            sim.inject(Fault("status", path="/api/v1/bills/details", status=503, times=1000))
            write(path, document(1))
            asked = dict(sim.requests_served)
            assert daemon.reload()
            assert sim.requests_served == asked
        assert daemon.latest.history is not None
        assert list(daemon.latest.history.months) == kept
    finally:
        daemon.stop()


def test_a_bills_refresh_in_flight_across_new_prices_reconciles_at_the_new_prices(
    priced: Simulator, clock: Clock, tmp_path: Path
) -> None:
    def document(factor: int) -> dict:
        return {
            "billing": fake_billing_section(priced),
            "state": {"path": str(tmp_path / "state.db")},
            "prices": priced_at(factor),
        }

    path = tmp_path / "config.yaml"
    daemon = reloadable(priced, clock, path, document(1))
    try:
        assert daemon.refresh("usage")
        assert daemon.refresh("bills")
        assert amount_gaps(daemon) == {0.0}  # billed at the config's prices
        at_new_prices = {-0.5}  # the usage is worth twice the bills now
        reload_in_flight(daemon, "bills", daemon.sources.one.bills, "refresh", path, document(2),
                         meanwhile=lambda: assert_gaps(daemon, at_new_prices))  # fmt: skip
        assert amount_gaps(daemon) == at_new_prices  # not judged again at the old prices
    finally:
        daemon.stop()


def test_new_prices_that_a_usage_refresh_in_flight_priced_without_price_its_figures_as_it_ends(
    priced: Simulator, clock: Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refresh held after it priced the day (saving it) while a reload prices a model that had
    no price: as it ends, its figures are priced anew with no API call (they left that model's
    tokens out, until a later refresh that the API might not answer), and it runs again at once."""
    document = {"billing": fake_billing_section(priced, history_months=0), "state": {"path": str(tmp_path / "s.db")}}
    path = tmp_path / "config.yaml"
    (first, *others) = priced_at(1)
    priced.add_usage(200)
    daemon = reloadable(priced, clock, path, document | {"prices": [first]})
    ran: list[str] = []
    monkeypatch.setattr(daemon, "_run_soon", ran.append)
    try:
        reload_in_flight(daemon, "usage", daemon.sources.one.usage, "_save", path, document | {"prices": priced_at(1)})
        assert estimated_models(daemon) == {p["model"] for p in (first, *others)}
        assert ran == ["usage"]
    finally:
        daemon.stop()


def test_prices_a_second_reload_brings_as_a_refresh_in_flight_ends_are_the_ones_kept(
    priced: Simulator, clock: Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New prices come while a usage refresh runs; as it ends, about to price its figures with
    them, a second reload brings others (nothing at all): those are the prices kept, and the
    tokens of the next refresh add nothing. The refresh must not price with the prices of the
    account it looked up before the second reload came."""
    document = {"billing": fake_billing_section(priced, history_months=0), "state": {"path": str(tmp_path / "s.db")}}
    path = tmp_path / "config.yaml"
    priced.add_usage(200)
    daemon = reloadable(priced, clock, path, document | {"prices": priced_at(1)})
    monkeypatch.setattr(daemon, "_run_soon", lambda source: None)
    priced_anew, second = daemon._priced_anew, threading.Event()

    def second_reload_first(name: str) -> bool:
        if threading.current_thread() is not threading.main_thread() and not second.is_set():
            second.set()  # (the refresh's own, as it ends)
            write(path, document | {"prices": priced_at(0)})
            assert daemon.reload()
        return priced_anew(name)

    monkeypatch.setattr(daemon, "_priced_anew", second_reload_first)
    try:
        reload_in_flight(daemon, "usage", daemon.sources.one.usage, "_save", path, document | {"prices": priced_at(2)})
        assert second.is_set()
        spent = named(metrics(daemon), "inference_usage_estimated_payable_amount_total")
        priced.add_usage(300)
        assert daemon.refresh("usage")
        assert named(metrics(daemon), "inference_usage_estimated_payable_amount_total") == spent
    finally:
        daemon.stop()


def test_a_reload_to_another_project_as_the_figures_are_priced_anew_leaves_them_forgotten(
    priced: Simulator, clock: Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A usage refresh ends and prices its figures with new prices; while it does, a reload moves
    the account to another project, which forgets the figures: the old project's are not shown
    again under the new one."""
    document = {"billing": fake_billing_section(priced, history_months=0), "state": {"path": str(tmp_path / "s.db")}}
    path = tmp_path / "config.yaml"
    priced.add_usage(200)
    daemon = reloadable(priced, clock, path, document | {"prices": priced_at(1)})
    monkeypatch.setattr(daemon, "_run_soon", lambda source: None)
    usage = daemon.sources.one.usage
    reprice, moved = usage.reprice, threading.Event()

    def project_changes_meanwhile(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread() and not moved.is_set():
            moved.set()  # (the refresh's own repricing, as it ends)
            elsewhere = document["billing"] | {"project_id": "proj-other"}
            write(path, document | {"prices": priced_at(2), "billing": elsewhere})
            assert daemon.reload()
            assert daemon.latest.usage is None
        return reprice(*args, **kwargs)

    monkeypatch.setattr(usage, "reprice", project_changes_meanwhile)
    try:
        reload_in_flight(daemon, "usage", usage, "_save", path, document | {"prices": priced_at(2)})
        assert moved.is_set()
        assert daemon.latest.usage is None
    finally:
        daemon.stop()


def estimated_models(daemon: Daemon) -> set[str]:
    """The models of today's estimated spend series."""
    return {
        dict(labels)["model"] for labels in named(metrics(daemon), "inference_usage_estimated_payable_amount_total")
    }


def test_a_reload_refused_on_the_way_changes_nothing(clock: Clock, tmp_path: Path) -> None:
    sims = account_simulators(clock, ("prod", "lab"))
    for sim in sims.values():
        billed_week(sim)

    def document(names: list[str], factor: int, months: int) -> dict:
        return {
            "accounts": accounts_section({n: sims[n] for n in names}, history_months=months),
            "prices": priced_at(factor),
            "state": {"path": str(tmp_path / "state.db")},
        }

    path = tmp_path / "config.yaml"
    write(path, document(["prod"], 1, 1))
    daemon = Daemon(
        validate(document(["prod"], 1, 1), {}), config_path=path, clock=clock, billing=AccountsBilling(sims),
        serve=False,
    )  # fmt: skip
    try:
        for source in ("prod/usage", "prod/bills", "prod/history"):
            assert daemon.refresh(source), source
        prod = daemon.sources.accounts["prod"]
        before = (amount_gaps(daemon), prod.latest.history, prod.history.months, prod.bills.grace_days)
        (tmp_path / "state.lab.db").mkdir()  # the new account's state file cannot be opened: refused
        write(path, document(["prod", "lab"], 2, 0))  # new prices, history off, and a new account
        assert not daemon.reload()
        assert daemon.sources.accounts["prod"] is prod
        assert (amount_gaps(daemon), prod.latest.history, prod.history.months, prod.bills.grace_days) == before
        assert prod.latest.history is not None
        assert daemon.config.prices[0].prompt_per_million == Decimal(4)
    finally:
        daemon.stop()


def test_an_account_taken_out_and_the_one_account_back_leave_nothing_of_before(
    clock: Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One account with a probe, then `accounts:`, then one account again without the probe: the
    process's snapshots, which the one account uses, show nothing of the first config's probe."""
    sims = account_simulators(clock, ("prod",))
    sim = sims["prod"]
    monkeypatch.setattr(account, "ProbeRunner", partial(chat_runner, sim))
    state = {"path": str(tmp_path / "state.db")}
    with_probe = {
        "billing": fake_billing_section(sim),
        "state": state,
        "inference": {"url": NOWHERE, "api_key": sim.api_key},
        "probes": [{"name": "x", "model": sim.endpoints[0].endpoint_id, "interval": "1h"}],
    }
    path = tmp_path / "config.yaml"
    write(path, with_probe)
    daemon = Daemon(validate(with_probe, {}), config_path=path, clock=clock, billing=AccountsBilling(sims), serve=False)
    try:
        assert daemon.refresh("probe:x")
        assert daemon.refresh("bills")
        assert (probes_shown(daemon), health(daemon)) == (["x"], ["bills", "probe:x"])
        write(path, {"accounts": accounts_section(sims), "state": state})
        assert daemon.reload()
        write(path, {"billing": fake_billing_section(sim), "state": state})
        assert daemon.reload()
        assert probes_shown(daemon) == []
        assert health(daemon) == ["bills"]  # (its last success as it was: its age tells)

        assert daemon.refresh("probe:x") is False  # (none configured)
        write(path, with_probe)
        assert daemon.reload()
        assert daemon.refresh("probe:x")
        write(path, {"accounts": accounts_section(sims), "state": state})
        assert daemon.reload()
        write(path, with_probe)  # the same probe back: its runner is another, from nothing
        assert daemon.reload()
        assert (probes_shown(daemon), health(daemon)) == ([], ["bills"])
    finally:
        daemon.stop()


@pytest.mark.parametrize("rule", ["as it was", "changed", "as it was, the account moved to another project"])
def test_an_anomaly_rules_last_judgement_stays_shown_across_a_reload_while_the_bills_fail(
    sim: Simulator, clock: Clock, tmp_path: Path, rule: str
) -> None:
    """While the bills fail, an anomaly rule cannot judge again and shows its last judgement: a
    reload that leaves the rule as it was keeps it shown; one that changes the rule does not show
    what the old rule judged, nor one that moves the account to another project (what was judged
    was the other project's figures, forgotten with them)."""
    sim.spend = SpendModel(start=dt.date(2026, 7, 1))
    sim.add_spike(YESTERDAY, sim.endpoints[1].endpoint_id, 2.5)

    def document(anomaly: dict) -> dict:
        return {
            "billing": fake_billing_section(sim),
            "state": {"path": str(tmp_path / "state.db")},
            "alerts": to_hook(None, anomaly),
            "budgets": [{"name": "month", "amount": "100000"}],
        }

    def shown() -> int:
        return len(named(metrics(daemon), "inference_spend_expected_daily_amount"))

    path = tmp_path / "config.yaml"
    daemon = reloadable(sim, clock, path, document(RULE))
    try:
        for source in ("history", "bills"):
            assert daemon.refresh(source)
        daemon.alert_cycle()
        judged = shown()
        assert judged == len(sim.endpoints)
        sim.inject(Fault("status", path="/api/v1/bills/details", status=403, times=100))
        assert not daemon.refresh("bills")
        daemon.alert_cycle()
        assert shown() == judged
        reloaded = document(RULE if rule.startswith("as it was") else RULE | {"min_percent": 40})
        reloaded["budgets"][0]["amount"] = "200000"  # (a change elsewhere, as it was)
        if rule.endswith("another project"):
            reloaded["billing"]["project_id"] = "proj-other"
        write(path, reloaded)
        assert daemon.reload()
        daemon.alert_cycle()
        assert shown() == (judged if rule == "as it was" else 0)
    finally:
        daemon.stop()


@pytest.mark.parametrize(
    ("change", "runs_again"),
    [
        ({"forecast": {"interval": 0.5}}, {"bills"}),
        ({"billing": {"previous_month_grace_days": 5}}, {"bills"}),
        ({"billing": {"history_months": 3}}, {"history"}),
        ({"billing": {"history_months": 1}}, {"history"}),  # (fewer months: its health judged on them)
        ({"budgets": [{"name": "month", "amount": "1"}]}, set()),
    ],
    ids=["forecast interval", "grace days", "more history", "less history", "a budget"],
)
def test_a_reload_runs_again_at_once_the_sources_whose_figures_it_changes(
    sim: Simulator, clock: Clock, tmp_path: Path, change: dict, runs_again: set[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The forecast's bounds and the month's figures are made as the bills are read, and history
    months are fetched at the history's look (every 10 minutes): a reload that changes them runs
    those sources at once, not up to an interval later."""
    document = {"billing": fake_billing_section(sim, history_months=2), "state": {"path": str(tmp_path / "s.db")}}
    path = tmp_path / "config.yaml"
    daemon = reloadable(sim, clock, path, document)
    ran: list[str] = []
    monkeypatch.setattr(daemon, "_run_soon", ran.append)
    daemon.scheduler.start(paused=True)  # (a reload runs sources soon only on a running schedule)
    daemon._schedule()  # (paused: its jobs are not what is looked at)
    try:
        changed = {key: value for key, value in change.items() if key != "billing"}
        changed["billing"] = document["billing"] | change.get("billing", {})
        write(path, document | changed)
        old = daemon.sources
        assert daemon.reload()
        assert daemon.sources.changed(old) == runs_again
        assert set(ran) == runs_again  # what the reload ran at once
    finally:
        daemon.stop()


class HeldUsage:
    """A usage refresher whose first run holds until `release` is set; the next sets `again`."""

    def __init__(self) -> None:
        self.inside, self.release, self.again = threading.Event(), threading.Event(), threading.Event()
        self.runs = 0

    def __call__(self) -> None:
        self.runs += 1
        if self.runs == 1:
            self.inside.set()
            self.release.wait(10)
        else:
            self.again.set()

    def ran_again(self, daemon: Daemon) -> None:
        """The held run let go: the one asked for meanwhile runs after it, once."""
        self.release.set()
        assert self.again.wait(10)
        assert self.runs == 2
        # (the scheduler done with the job: stopped while it removes one, APScheduler's thread raises)
        wait_for(lambda: daemon.scheduler.get_job("usage:again") is None)


def held_usage(sim: Simulator, clock: Clock, tmp_path: Path) -> tuple[Daemon, HeldUsage]:
    document = {"billing": fake_billing_section(sim), "state": {"path": str(tmp_path / "s.db")}}
    daemon = unit_daemon(validate(document, {}), sim, clock)
    held = daemon.sources.refreshers["usage"] = HeldUsage()
    return daemon, held


def test_a_run_asked_for_while_the_one_asked_for_before_still_runs_is_not_lost(
    sim: Simulator, clock: Clock, tmp_path: Path
) -> None:
    """A source asked to run at once (by a reload, or by a run a reload abandoned) while the run
    asked for before is still going: it runs again after that one, not never (the scheduler runs
    one instance of a job at a time, and skips, for good, a one-off job that comes meanwhile)."""
    daemon, held = held_usage(sim, clock, tmp_path)
    taken_up = threading.Semaphore(0)  # the scheduler submitted a job, or skipped it
    daemon.scheduler.add_listener(lambda event: taken_up.release(), EVENT_JOB_SUBMITTED | EVENT_JOB_MAX_INSTANCES)
    daemon.scheduler.start()
    try:
        daemon._run_soon("usage")
        assert held.inside.wait(10)
        assert taken_up.acquire(timeout=10)
        daemon._run_soon("usage")  # while the first still runs
        assert taken_up.acquire(timeout=10)
        held.ran_again(daemon)
    finally:
        held.release.set()
        daemon.stop()


def test_the_rollover_while_the_scheduled_run_of_the_day_before_still_runs_comes_after_it(
    sim: Simulator, clock: Clock, tmp_path: Path
) -> None:
    """The usage run started before midnight is still going when the rollover job comes: the
    rollover's run is made when it ends, not dropped until the next interval."""
    daemon, held = held_usage(sim, clock, tmp_path)
    daemon.scheduler.start()
    try:
        scheduled = threading.Thread(target=daemon.refresh, args=["usage"])
        scheduled.start()
        assert held.inside.wait(10)
        rollover = threading.Thread(target=daemon._rollover, args=["usage"])
        rollover.start()
        rollover.join(10)
        assert not rollover.is_alive()  # (it asked the run in flight to run again: it waited for none)
        held.ran_again(daemon)
    finally:
        held.release.set()
        daemon.stop()


def test_a_source_a_reload_adds_runs_once_at_once(sim: Simulator, clock: Clock, tmp_path: Path) -> None:
    """History turned on: its new job runs now, and that is the only run the reload asks for."""
    document = {"billing": fake_billing_section(sim, history_months=0), "state": {"path": str(tmp_path / "s.db")}}
    path = tmp_path / "config.yaml"
    daemon = reloadable(sim, clock, path, document)
    daemon.scheduler.start(paused=True)  # (the jobs stay as the reload left them)
    daemon._schedule()
    try:
        write(path, document | {"billing": document["billing"] | {"history_months": 2}})
        assert daemon.reload()
        due_now = [job.id for job in daemon.scheduler.get_jobs() if job.next_run_time <= dt.datetime.now(dt.UTC)]
        assert [job for job in due_now if job.startswith("history")] == ["history"]
    finally:
        daemon.stop()


def test_a_reload_renaming_the_digests_notifier_while_the_digest_is_made_sends_it_once_to_the_new_name(
    sim: Simulator, clock: Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def document(notifier: str) -> dict:
        return {
            "billing": fake_billing_section(sim, history_months=0),  # (the digest waits for nothing but the bills)
            "state": {"path": str(tmp_path / "state.db")},
            "alerts": {"notifiers": [{"name": notifier, "type": "webhook", "url": f"{NOWHERE}/{notifier}"}]},
            "digest": {"at": "09:00", "notifiers": [notifier]},
        }

    path = tmp_path / "config.yaml"
    daemon = reloadable(sim, clock, path, document("hook"))
    digest = Sources.digest

    def reloaded_meanwhile(self: Sources, *args: Any, **kwargs: Any) -> object:
        monkeypatch.setattr(Sources, "digest", digest)
        body = digest(self, *args, **kwargs)
        write(path, document("renamed"))
        assert daemon.reload()
        return body

    monkeypatch.setattr(Sources, "digest", reloaded_meanwhile)
    try:
        assert daemon.refresh("bills")
        for _ in range(3):
            daemon.alert_cycle()
        assert [d["id"] for d in digests_told(daemon, "renamed")] == [f"daily:{clock.today().isoformat()}"]
        assert digests_told(daemon, "hook") == []
    finally:
        daemon.stop()


def test_the_settled_days_read_from_a_service_that_caps_its_pages_stay_held_across_a_reload_and_a_restart(
    priced: Simulator, clock: Clock, tmp_path: Path
) -> None:
    """The client reads pages of the service's cap once it shows one; a reload that changes nothing
    of billing builds the reconciliation on it: the settled days read before stay held (none read
    again, two a refresh, while the gaps of the others go unshown), and so after a restart."""
    priced.usage_page_cap = 40
    document = {
        "billing": fake_billing_section(priced, page_size=100, history_months=0),
        "state": {"path": str(tmp_path / "state.db")},
        "prices": priced_at(1),
    }
    path = tmp_path / "config.yaml"
    daemon = reloadable(priced, clock, path, document)
    try:
        held: list[dt.date] = []
        while not held or sorted(daemon.sources.one.latest.settled) != held:
            held = sorted(daemon.sources.one.latest.settled)
            assert daemon.refresh("usage")
        assert daemon.sources.one.client.page_size == 40
        gaps = named(metrics(daemon), "inference_reconciliation_token_gap_ratio")
        write(path, document | {"budgets": [{"name": "month", "amount": "100"}]})
        assert daemon.reload()
        assert daemon.refresh("usage")
        assert sorted(daemon.sources.one.latest.settled) == held
        assert named(metrics(daemon), "inference_reconciliation_token_gap_ratio") == gaps
    finally:
        daemon.stop()
    restarted = reloadable(priced, clock, path, document)
    try:
        assert restarted.refresh("usage")
        assert sorted(restarted.sources.one.latest.settled) == held
    finally:
        restarted.stop()


def test_a_reload_that_changes_a_probe_waiting_on_an_endpoint_that_hangs_runs_it_as_configured_now_at_once(
    sim: Simulator,
    server: SimulatorServer,
    clock: Clock,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Over HTTP: the run in flight, waiting on an endpoint that hangs, ends at the reload that moves
    the probe to another model with a shorter timeout (its client closed), not at its own deadline
    of two minutes; it shows nothing and logs no failure, and the probe as configured now runs at once."""
    alpha, beta = sim.endpoints[0].endpoint_id, sim.endpoints[1].endpoint_id

    def document(model: str, timeout: str) -> dict:
        return {
            "billing": fake_billing_section(sim),
            "inference": {"url": server.url, "api_key": sim.api_key},
            "probes": [{"name": "x", "model": model, "interval": "1h", "timeout": timeout}],
            "state": {"path": str(tmp_path / "state.db")},
        }

    path = tmp_path / "config.yaml"
    daemon = reloadable(sim, clock, path, document(alpha, "2m"))
    ran: list[str] = []
    monkeypatch.setattr(daemon, "_run_soon", ran.append)
    hangs = Fault("delay", CHAT, seconds=120)
    sim.inject(hangs)
    running = threading.Thread(target=daemon.refresh, args=("probe:x",), daemon=True)
    try:
        running.start()
        assert wait_for(lambda: hangs.times == 0)  # (its request arrived: it waits on the endpoint)
        write(path, document(beta, "10s"))
        assert daemon.reload()
        running.join(30)
        assert not running.is_alive()  # ended by the reload, well before its deadline
        assert ran == ["probe:x"]  # the probe of now asked to run at once
        assert probes_shown(daemon) == []
        assert not logged(caplog.records, "probe failed")
        assert daemon.refresh("probe:x")
        runs = named(metrics(daemon), "inference_probe_runs_total")
        assert {dict(labels)["endpoint_id"]: v for labels, v in runs.items()} == {beta: 1.0}
    finally:
        daemon.stop()
        running.join(30)


def probe_on(sim: Simulator, server: SimulatorServer, tmp_path: Path, model: str) -> dict:
    """A config whose probe `x` runs on `model`, every hour."""
    return {
        "billing": fake_billing_section(sim),
        "inference": {"url": server.url, "api_key": sim.api_key},
        "probes": [{"name": "x", "model": model, "interval": "1h"}],
        "state": {"path": str(tmp_path / "state.db")},
    }


def test_a_reload_that_moves_a_probe_to_another_endpoint_shows_nothing_of_the_old_one_meanwhile(
    sim: Simulator, server: SimulatorServer, clock: Clock, tmp_path: Path
) -> None:
    """Until the probe of now has run, the series are of none: the last run on the endpoint the
    config no longer probes is not shown as the probe's, nor counted fresh."""
    alpha, beta = sim.endpoints[0].endpoint_id, sim.endpoints[1].endpoint_id
    path = tmp_path / "config.yaml"
    daemon = reloadable(sim, clock, path, probe_on(sim, server, tmp_path, alpha))
    try:
        assert daemon.refresh("probe:x")
        assert endpoints_probed(daemon) == [alpha]
        write(path, probe_on(sim, server, tmp_path, beta))
        assert daemon.reload()
        assert endpoints_probed(daemon) == []
        shown = metrics(daemon)
        assert not [
            labels for labels in named(shown, "inference_exporter_refresh_success") if ("source", "probe:x") in labels
        ]
        assert daemon.refresh("probe:x")
        assert endpoints_probed(daemon) == [beta]
    finally:
        daemon.stop()


def test_a_run_of_the_probe_before_a_reload_that_moved_it_ends_unrecorded(
    sim: Simulator, server: SimulatorServer, clock: Clock, tmp_path: Path
) -> None:
    """Published as the reload came, its health is not recorded after it: the probe as configured
    now has not run, so it is neither fresh nor ready."""
    alpha, beta = sim.endpoints[0].endpoint_id, sim.endpoints[1].endpoint_id
    path = tmp_path / "config.yaml"
    daemon = reloadable(sim, clock, path, probe_on(sim, server, tmp_path, alpha))
    try:
        assert daemon.refresh("bills")
        assert daemon.refresh("usage")
        reload_in_flight(
            daemon, "probe:x", daemon.sources.one.state, "record_probe_run", path, probe_on(sim, server, tmp_path, beta)
        )
        assert endpoints_probed(daemon) == []
        assert "probe:x" not in health(daemon)
        assert not readiness(daemon)[0]
    finally:
        daemon.stop()


def test_a_reload_whose_checks_crash_is_refused_and_the_daemon_goes_on(
    priced: Simulator, clock: Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file the checks trip over (a bug of theirs) is refused like a bad one, the traceback logged:
    the running config is kept, and the reload's gauge says it failed (the daemon had exited)."""
    document = {"billing": fake_billing_section(priced), "state": {"path": str(tmp_path / "state.db")}}
    path = tmp_path / "config.yaml"
    daemon = reloadable(priced, clock, path, document)
    try:
        assert daemon.refresh("bills")

        def crashing(config_path: Path) -> None:
            raise RuntimeError("a check that crashed")

        monkeypatch.setattr(daemon_module, "load", crashing)
        assert not daemon.reload()
        assert value(metrics(daemon), "inference_exporter_config_last_reload_successful") == 0
        monkeypatch.undo()
        write(path, document | {"budgets": [{"name": ["month"], "amount": "1"}]})  # (once crashed the checks)
        assert not daemon.reload()
        assert daemon.refresh("bills")
    finally:
        daemon.stop()
