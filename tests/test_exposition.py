"""The exposition: a golden file pins names, types and label names; the real promtool checks it.

Its figures come from the simulator in process (tests/fakes.py: the billing API and the probe's chat
answers), which report their calls as the HTTP clients do."""

from __future__ import annotations

import datetime as dt
import gzip
import json
import os
import platform
import socket
import subprocess
import zlib
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from exporter import __version__
from exporter.alerts.engine import Engine
from exporter.app.account import build_exposition
from exporter.app.sources import Sources
from exporter.config.load import validate
from exporter.config.schema import Config
from exporter.core.clock import Clock, FrozenClock
from exporter.delivery.dispatcher import Dispatcher
from exporter.metrics import exposition as exposition_module
from exporter.metrics.alerts import AlertsCollector
from exporter.metrics.assembled import AssembledExposition
from exporter.metrics.runtime import REVISION_ENV, RUNTIME_COLLECTORS, revision
from exporter.model.snapshots import Latest
from exporter.sim import Simulator
from exporter.sources.bills import BillsSource
from exporter.sources.history import HistorySource
from exporter.sources.reconcile import DEFAULT_ITEMS, SettledUsage, reconcile
from exporter.sources.usage import UsageSync
from exporter.state import AlertStore, StateStore
from tests.conftest import DATA, require_binary
from tests.daemon_fakes import NOWHERE, InProcessBilling, fake_billing_section
from tests.fakes import FakeBilling, chat_runner

GOLDEN = DATA / "exposition.golden"
OPENMETRICS = "application/openmetrics-text; version=1.0.0"


def full_latest(sim: Simulator, clock: Clock, frozen: FrozenClock) -> tuple[Config, Latest]:
    """Every metric family with samples: two days of usage (so the previous day is final), bills, budgets."""
    config = validate(
        {
            "billing": fake_billing_section(sim),
            "prices": [{"model": "model-a", "prompt_per_million": "4", "completion_per_million": "16"}],
            "budgets": [{"name": "monthly", "amount": "20000"}, {"name": "daily", "amount": "600", "period": "day"},
                        {"name": "spent", "amount": "1"}],  # (crossed: its crossing day has a sample)
            "inference": {"url": NOWHERE, "api_key": sim.api_key},
            "probes": [{"name": "chat-prod", "model": sim.endpoints[0].endpoint_id, "scenario": "thinking"}],
            "alerts": {
                "rules": [{"alert": "UsageHigh", "signal": "requests", "by": ["model"], "threshold": 1,
                           "labels": {"severity": "warning"}},
                          {"alert": "SpendAnomaly", "signal": "spend_anomaly", "by": ["endpoint_id"],
                           "min_amount": "20", "min_percent": 30}],
                "notifiers": [{"name": "hook", "type": "webhook", "url": "http://127.0.0.1:1/hook"}],
            },
        },
        {},
    )  # fmt: skip
    latest = Latest()
    client = FakeBilling(sim, on_response=latest.count_api_call, on_skew=latest.observe_clock_skew, clock=clock)
    usage = UsageSync(client, clock, StateStore(":memory:"), per_api_key=False, prices=config.prices)
    sim.add_usage(300)
    usage.refresh()
    frozen.advance(dt.timedelta(days=1))
    sim.add_usage(120)
    latest.usage = usage.refresh()
    latest.record("usage", success=True, at=frozen().timestamp(), duration=1.0)
    latest.bills = BillsSource(client, clock, 3).refresh()
    latest.history = HistorySource(client, clock, StateStore(":memory:"), 2).refresh()
    settled = SettledUsage(client, clock, StateStore(":memory:"), settle=6 * 3600, days_per_refresh=2,
                           per_api_key=False).refresh(clock.today().replace(day=1))  # fmt: skip
    latest.reconciliation = reconcile(latest.bills, settled, DEFAULT_ITEMS, config.prices)
    latest.record("bills", success=False, at=frozen().timestamp(), duration=1.0, error="x")
    assert config.inference is not None
    sim.time_to_first_token, sim.chunk_delay = 0.05, 0.02  # a model that takes time to write: a decode rate
    latest.publish_probe(chat_runner(sim, config.probes[0], config.inference).run())
    return config, latest


def full_exposition(sim: Simulator, clock: Clock, frozen: FrozenClock) -> bytes:
    """With an alert firing, so the alert families have samples too; and the process's own series last, as the
    daemon's exposition has them (`Sources`)."""
    config, latest = full_latest(sim, clock, frozen)
    store = StateStore(":memory:")
    engine = Engine(
        config.alerts, config.budgets, AlertStore(store), clock, latest, lambda: ["bills", "usage"], ["hook"]
    )
    latest.record("bills", success=True, at=frozen().timestamp(), duration=1.0)  # fresh for the anomaly rule
    engine.evaluate()
    latest.record("bills", success=False, at=frozen().timestamp(), duration=1.0, error="x")
    dispatcher = Dispatcher(config.alerts.notifiers, engine.db, clock, engine.current, "http://exporter:9877")
    alerts = AlertsCollector(engine, dispatcher)
    return build_exposition(config, latest, clock, alerts, *RUNTIME_COLLECTORS).render()[0]


def shape(exposition: bytes) -> str:
    """Name, type, and the label names of each sample: what dashboards and rules depend on."""
    lines = []
    for family in text_string_to_metric_families(exposition.decode()):
        lines.append(f"# TYPE {family.name} {family.type}")
        lines.extend(sorted({f"{s.name}{{{','.join(sorted(s.labels))}}}" for s in family.samples}))
    return "\n".join(lines) + "\n"


def test_exposition_matches_the_golden_shape(sim: Simulator, clock: Clock, frozen: FrozenClock) -> None:
    got = shape(full_exposition(sim, clock, frozen))
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(got)
    assert got == GOLDEN.read_text(), "exposition changed; if intended, rerun with UPDATE_GOLDEN=1 and review the diff"


@pytest.mark.integration  # runs the promtool binary
def test_promtool_check_metrics_passes(sim: Simulator, clock: Clock, frozen: FrozenClock) -> None:
    promtool = require_binary("promtool")
    exposition = full_exposition(sim, clock, frozen)
    result = subprocess.run([promtool, "check", "metrics"], input=exposition, capture_output=True, timeout=60)
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
    assert result.stdout.decode().strip() == ""
    assert result.stderr.decode().strip() == ""


def test_after_midnight_a_day_that_ended_is_not_shown_as_today_nor_the_day_before_as_yesterday(
    sim: Simulator, clock: Clock, frozen: FrozenClock
) -> None:
    """Usage refreshed on the 23rd (the 22nd final as the day before), then the usage API fails from
    before midnight: on the 24th the counters are absent, not the 23rd's as if they were today's, and
    the 22nd is not the day before; once usage refreshes again, the 24th is counted from its start."""
    config, latest = full_latest(sim, clock, frozen)
    exposition = build_exposition(config, latest, clock)

    def usage() -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        found: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        for family in text_string_to_metric_families(exposition.render()[0].decode()):
            for s in family.samples:
                if s.name.startswith("inference_usage_requests") or s.name.startswith(
                    "inference_usage_previous_day_requests"
                ):
                    found.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
        return found

    before = usage()
    assert sum(before["inference_usage_requests_total"].values()) == 120  # (the 23rd's, today)
    assert {dict(k)["day"] for k in before["inference_usage_previous_day_requests"]} == {"2026-11-22"}
    frozen.advance(dt.timedelta(days=1))  # (the 24th; no refresh succeeds meanwhile)
    after = usage()
    assert "inference_usage_requests_total" not in after
    assert "inference_usage_previous_day_requests" not in after
    usage_sync = UsageSync(FakeBilling(sim, clock=clock), clock, StateStore(":memory:"), per_api_key=False)
    sim.add_usage(7)
    latest.usage = usage_sync.refresh()
    again = usage()
    assert sum(again["inference_usage_requests_total"].values()) == 7
    created = [s.value for f in text_string_to_metric_families(exposition.render()[0].decode())
               for s in f.samples if s.name == "inference_usage_requests_created"]  # fmt: skip
    assert set(created) == {clock.day_start(clock.today()).timestamp()}  # (the 24th's start)


def test_cached_blocks_equal_a_fresh_render_and_follow_new_snapshots(
    sim: Simulator, clock: Clock, frozen: FrozenClock
) -> None:
    config, latest = full_latest(sim, clock, frozen)
    exposition = build_exposition(config, latest, clock)

    def fresh() -> bytes:
        registry = CollectorRegistry()
        for collector in exposition.collectors:
            registry.register(collector)
        return generate_latest(registry)

    first, content_type = exposition.render()
    assert content_type.startswith("text/plain")
    assert exposition.render()[0] == first == fresh()

    previous_bills = latest.bills
    sim.add_usage(5)
    latest.bills = BillsSource(FakeBilling(sim), clock, 3).refresh()
    assert latest.bills is not previous_bills
    assert exposition.render()[0] == fresh()

    openmetrics, om_type = exposition.render("application/openmetrics-text; version=1.0.0")
    assert om_type.startswith("application/openmetrics-text")
    assert openmetrics.count(b"# EOF") == 1
    assert openmetrics.endswith(b"# EOF\n")
    assert exposition.render("application/openmetrics-text; version=1.0.0")[0] == openmetrics


@pytest.mark.parametrize("several", [False, True], ids=["one account", "several accounts"])
def test_a_collector_that_cannot_render_is_left_out_and_the_rest_served(
    caplog: pytest.LogCaptureFixture, several: bool
) -> None:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from exporter.metrics.assembled import AssembledExposition
    from exporter.metrics.exposition import OPENMETRICS_ACCEPT, Exposition

    class Fine:
        def collect(self) -> Iterator[GaugeMetricFamily]:
            family = GaugeMetricFamily("inference_fine", "Fine.", labels=["l"])
            family.add_metric(["ok"], 1.0)
            yield family

    class Broken:
        def collect(self) -> Iterator[Metric]:
            first = CounterMetricFamily("inference_broken_first", "Renders, in lines that differ by format.")
            first.add_metric([], 1.0)
            yield first
            family = GaugeMetricFamily("inference_broken", "Broken.", labels=["l"])
            family.add_metric(["ep\ud800x"], 1.0)  # no text encoding can hold it (where it is differs by format)
            yield family

    exposition: Exposition | AssembledExposition = (
        AssembledExposition([[("a", Broken())], [("a", Fine())]])  # type: ignore[list-item]
        if several
        else Exposition([Broken(), Fine()])  # type: ignore[list-item]
    )
    fine = b'inference_fine{account="a",l="ok"} 1.0' if several else b'inference_fine{l="ok"} 1.0'
    for _ in range(3):  # scrapes in both formats, taking turns (a person's and Prometheus')
        for accept in ("", OPENMETRICS_ACCEPT):
            body, _ = exposition.render(accept)
            assert fine in body
            assert b"inference_broken" not in body
            assert gzip.decompress(exposition.render(accept, gzipped=True)[0]) == body
    errors = [r for r in caplog.records if r.getMessage() == "metrics left out of /metrics"]
    assert len(errors) == 2  # once for each format (its position in the text differs), not per scrape
    assert {r.fields["collector"] for r in errors} == {"Broken"}  # type: ignore[attr-defined]


@pytest.mark.parametrize("several", [False, True], ids=["one account", "several accounts"])
@pytest.mark.parametrize("failing", ["version", "parts"])
def test_a_collector_whose_version_or_parts_fail_is_left_out_and_the_rest_served(
    caplog: pytest.LogCaptureFixture, several: bool, failing: str
) -> None:
    """As one that cannot be rendered: in scrapes and in `prepare` alike (a refresh, the alert
    worker), which go on. A collector without a version is not rendered by `prepare` at all (every
    scrape renders it)."""
    from exporter.metrics.assembled import AssembledExposition
    from exporter.metrics.exposition import OPENMETRICS_ACCEPT, Exposition

    class Fine:
        collected = 0

        def collect(self) -> Iterator[GaugeMetricFamily]:
            type(self).collected += 1
            family = GaugeMetricFamily("inference_fine", "Fine.")
            family.add_metric([], 1.0)
            yield family

    class Failing:
        def version(self) -> object:
            if failing == "version":
                raise KeyError("gone")
            return self

        def parts(self) -> Iterator[tuple[object, Collector]]:
            yield self, Fine()
            raise KeyError("gone")

        def collect(self) -> Iterator[Metric]:
            yield from ()

    if failing == "version":
        del Failing.parts  # (a plain versioned collector)
    fine, broken = Fine(), Failing()
    exposition: Exposition | AssembledExposition = (
        AssembledExposition([[("a", broken)], [("a", fine)]])  # type: ignore[list-item]
        if several
        else Exposition([broken, fine])  # type: ignore[list-item]
    )
    exposition.prepare()
    exposition.prepare(only=broken)  # type: ignore[arg-type]
    assert Fine.collected == 0
    for accept in ("", OPENMETRICS_ACCEPT):
        body = exposition.render(accept)[0]
        assert body.count(b"inference_fine") == 3  # the fine collector's, and not the failing one's part
        assert gzip.decompress(exposition.render(accept, gzipped=True)[0]) == body
    errors = [r for r in caplog.records if r.getMessage() == "metrics left out of /metrics"]
    assert errors
    assert {r.fields["collector"] for r in errors} == {"Failing"}  # type: ignore[attr-defined]


@pytest.mark.parametrize("several", [False, True], ids=["one account", "several accounts"])
@pytest.mark.parametrize(
    ("failing", "fails_at", "shown"),
    [("version", {2, 4}, [True, False, True, False]), ("parts", {1, 3}, [False, True, False, True])],
)
def test_a_collector_whose_version_or_parts_failed_once_is_served_again_and_a_new_failure_logged(
    caplog: pytest.LogCaptureFixture, several: bool, failing: str, fails_at: set[int], shown: list[bool]
) -> None:
    """A failure leaves the block out of that scrape only (nothing is kept for its version), and a
    failure after a success is logged again."""
    from exporter.metrics.assembled import AssembledExposition
    from exporter.metrics.exposition import Exposition

    calls = [0]

    class Part:
        def collect(self) -> Iterator[GaugeMetricFamily]:
            family = GaugeMetricFamily("inference_flaky", "Flaky.")
            family.add_metric([], 1.0)
            yield family

    class Flaky:
        def version(self) -> object:
            if failing == "parts":
                return object()  # (new parts every scrape: each asks for them)
            calls[0] += 1
            if calls[0] in fails_at:
                raise OSError("the state file is busy")
            return self

        def parts(self) -> Iterator[tuple[object, Collector]]:
            calls[0] += 1
            if calls[0] in fails_at:
                raise OSError("the state file is busy")
            yield self, Part()

        def collect(self) -> Iterator[Metric]:
            yield from Part().collect()

    if failing == "version":
        del Flaky.parts  # (a plain versioned collector)
    flaky = Flaky()
    exposition: Exposition | AssembledExposition = (
        AssembledExposition([[("a", flaky)]]) if several else Exposition([flaky])  # type: ignore[list-item]
    )
    assert [b"inference_flaky" in exposition.render()[0] for _ in shown] == shown
    errors = [r for r in caplog.records if r.getMessage() == "metrics left out of /metrics"]
    assert len(errors) == len(fails_at)


def gunzip_one_member(body: bytes) -> bytes:
    """`body` decoded as a single gzip member, which must be the whole of it (curl reads no further)."""
    reader = zlib.decompressobj(16 + zlib.MAX_WBITS)
    text = reader.decompress(body)
    assert reader.eof
    assert reader.unused_data == b""
    return text


def test_gzipped_exposition_is_one_member_holding_the_text(sim: Simulator, clock: Clock, frozen: FrozenClock) -> None:
    config, latest = full_latest(sim, clock, frozen)
    exposition = build_exposition(config, latest, clock)
    for accept in ("", OPENMETRICS):
        text, content_type = exposition.render(accept)
        for _ in range(2):  # compressed, then from the cached pieces
            body, gzipped_type = exposition.render(accept, gzipped=True)
            assert gzipped_type == content_type
            assert gunzip_one_member(body) == text
            assert gzip.decompress(body) == text


def test_a_gzipped_scrape_compresses_only_the_blocks_whose_snapshot_changed(
    sim: Simulator, clock: Clock, frozen: FrozenClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, latest = full_latest(sim, clock, frozen)
    exposition = build_exposition(config, latest, clock)
    deflate, deflated = exposition_module.deflate, []
    monkeypatch.setattr(exposition_module, "deflate", lambda text: deflated.append(text) or deflate(text))

    def compressed(accept: str = "") -> list[bytes]:
        """The texts a gzipped render compressed; the render must decode to the plain one."""
        deflated.clear()
        assert gunzip_one_member(exposition.render(accept, gzipped=True)[0]) == exposition.render(accept)[0]
        return list(deflated)

    assert len(compressed()) == len(exposition.collectors)
    exposition.render()  # a plain scrape keeps the pieces
    (health,) = compressed()  # the health block is rendered, so compressed, on every scrape
    assert b"inference_exporter_build_info" in health

    sim.add_usage(5)
    latest.bills = BillsSource(FakeBilling(sim), clock, 3).refresh()
    bills, budgets, health = compressed()  # the budget figures are worked out from the bills
    assert bills.startswith(b"# HELP inference_bill_")
    assert budgets.startswith(b"# HELP inference_budget_")
    assert b"inference_exporter_build_info" in health
    assert len(compressed()) == 1

    assert len(compressed(OPENMETRICS)) == len(exposition.collectors) + 1  # its own blocks, and its # EOF
    health, eof = compressed(OPENMETRICS)
    assert b"inference_exporter_build_info" in health
    assert eof == b"# EOF\n"


@pytest.mark.parametrize("several", [False, True])
def test_the_daemons_exposition_has_the_process_series_rendered_afresh_each_scrape(
    sim: Simulator, clock: Clock, several: bool
) -> None:
    billing = fake_billing_section(sim)
    document = {"accounts": [{"name": "a", "billing": billing}, {"name": "b", "billing": billing}]} if several else {
        "billing": billing
    }  # fmt: skip
    sources = Sources(validate(document, {}), Latest(), clock, StateStore(":memory:"), billing=InProcessBilling(sim))
    try:

        def scrape() -> dict[str, dict[frozenset[tuple[str, str]], float]]:
            families: dict[str, dict[frozenset[tuple[str, str]], float]] = {}
            for family in text_string_to_metric_families(sources.exposition.render()[0].decode()):
                for sample in family.samples:
                    families.setdefault(sample.name, {})[frozenset(sample.labels.items())] = sample.value
            return families

        before = scrape()
        assert {"process_start_time_seconds", "process_resident_memory_bytes", "python_gc_collections_total"} <= set(
            before
        )
        [info] = before["python_info"]
        assert dict(info)["version"] == platform.python_version()
        assert all("account" not in dict(labels) for labels in before["process_open_fds"])
        opened = [socket.socket() for _ in range(8)]  # the same snapshots, 8 more descriptors open
        try:
            after = scrape()
        finally:
            for one in opened:
                one.close()
        assert next(iter(after["process_open_fds"].values())) >= next(iter(before["process_open_fds"].values())) + 8
    finally:
        sources.close()


def test_build_info_says_the_version_the_revision_and_the_python(
    sim: Simulator, clock: Clock, frozen: FrozenClock
) -> None:
    [(labels, one)] = [
        (dict(sample.labels), sample.value)
        for family in text_string_to_metric_families(full_exposition(sim, clock, frozen).decode())
        for sample in family.samples
        if sample.name == "inference_exporter_build_info"
    ]
    assert one == 1
    assert labels == {"version": __version__, "revision": revision(), "python_version": platform.python_version()}


def test_the_revision_comes_from_the_environment_else_the_installed_commit(tmp_path: Path) -> None:
    info = tmp_path / "inference_cost_exporter-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: inference-cost-exporter\nVersion: 0.1.0\n")
    installed = metadata.PathDistribution(info)
    assert revision({}, installed) == "unknown"  # no direct_url.json: from an index, or a wheel
    (info / "direct_url.json").write_text(json.dumps({"url": "file:///src", "dir_info": {"editable": True}}))
    assert revision({}, installed) == "unknown"  # a local directory: no commit recorded
    commit = "0123456789abcdef0123456789abcdef01234567"
    (info / "direct_url.json").write_text(
        json.dumps({"url": "https://example.com/x.git", "vcs_info": {"vcs": "git", "commit_id": commit}})
    )
    assert revision({}, installed) == commit
    assert revision({REVISION_ENV: " 9f8e7d6 "}, installed) == "9f8e7d6"  # set where the image was built
    assert revision({REVISION_ENV: ""}, installed) == commit
    (info / "direct_url.json").write_text("not json")
    assert revision({}, installed) == "unknown"


class _Endpoints(Collector):
    """A gauge per endpoint id, as the bills' API names them (any text), versioned like a snapshot."""

    def __init__(self, ids: list[str]) -> None:
        self.ids = ids
        self.snapshot = object()

    def version(self) -> object:
        return self.snapshot

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily("inference_test_spend", "Spend.", labels=["endpoint_id"])
        for n, endpoint in enumerate(self.ids):
            gauge.add_metric([endpoint], float(n))
        yield gauge


@pytest.mark.parametrize("accept", ["", "application/openmetrics-text; version=1.0.0"])
def test_an_endpoint_id_holding_a_carriage_return_keeps_its_sample_whole_with_several_accounts(accept: str) -> None:
    """prometheus_client writes \\r in a label value as it is: the accounts' pieces are cut into
    lines at \\n alone, or such a sample was cut in two (half of it taken for a header and lost)."""
    ids = ["ep-1", "ep\r# 2", "ep\r# HELP inference_test_spend x", "ep\r\n3"]
    assembled = AssembledExposition([[("prod", _Endpoints(ids)), ("lab", _Endpoints(ids[:1]))]])
    text = assembled.render(accept)[0].decode()
    parse = text_string_to_metric_families if not accept else openmetrics_families
    (family,) = [f for f in parse(text) if f.name == "inference_test_spend"]
    assert sorted((s.labels["account"], s.labels["endpoint_id"]) for s in family.samples) == sorted(
        [("prod", endpoint) for endpoint in ids] + [("lab", "ep-1")]
    )
