"""The probes' block, rendered a probe at a time: the same bytes as the collector rendered whole, in both
formats, through runs, removals and additions; a run renders that probe's series alone."""

from __future__ import annotations

import gc
import gzip
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator

import pytest
from prometheus_client import CollectorRegistry, parser
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import parser as openmetrics_parser
from prometheus_client.registry import Collector

from exporter.metrics import assembled as assembled_module
from exporter.metrics import exposition as exposition_module
from exporter.metrics.assembled import AssembledExposition
from exporter.metrics.collectors import ProbeCollector
from exporter.metrics.exposition import Exposition
from exporter.model.snapshots import Histogram, Latest, ProbeRun, ProbeSnapshot
from exporter.model.source_names import probe_source

FORMATS = ["", "application/openmetrics-text; version=1.0.0"]
PARSERS: dict[str, Callable[[str], Iterable[Metric]]] = {
    FORMATS[0]: parser.text_string_to_metric_families,
    FORMATS[1]: openmetrics_parser.text_string_to_metric_families,
}
"""Each format's parser (OpenMetrics': strict, it refuses a family that comes twice or out of its group)."""
BOUNDS = (0.1, 0.5, 1.0, 2.0, float("inf"))


def snapshot(name: str, runs: int, endpoint: str = "ep-1") -> ProbeSnapshot:
    """A probe after `runs` runs: its figures differ with `runs`, some of them absent on odd ones."""
    odd = runs % 2 == 1
    last = ProbeRun(
        success=not odd,
        reason="timeout" if odd else None,
        checks={"status": True, "json": not odd},
        duration=0.25 * runs,
        time_to_headers=None if odd else 0.05,
        time_to_first_token=0.1 * runs,
        time_to_first_answer_token=None if odd else 0.2,
        max_chunk_gap=0.01 * runs,
        output_tokens_per_second=None if odd else 40.0 + runs,
    )
    histogram = Histogram(BOUNDS, tuple(runs + n for n in range(len(BOUNDS))), 1.5 * runs)
    failures = {"timeout": runs // 2} if runs > 1 else {}
    return ProbeSnapshot(name, endpoint, "chat", last, runs, failures, {"prompt": 7 * runs}, histogram, histogram)


def removed(latest: Latest, *names: str) -> None:
    """The probes `names` taken out of the config by a reload (the others kept)."""
    latest.configure({probe_source(name) for name in latest.probes if name not in names}, time.time())


def whole(latest: Latest, accept: str) -> bytes:
    """The probes' collector rendered whole by prometheus_client, as every run rendered it before."""
    registry = CollectorRegistry()
    registry.register(ProbeCollector(latest))
    return choose_encoder(accept)[0](registry)


def scraped(exposition: Exposition, accept: str) -> bytes:
    """A plain scrape's body, checked against the gzipped scrape's."""
    body = exposition.render(accept)[0]
    assert gzip.decompress(exposition.render(accept, gzipped=True)[0]) == body
    return body


def without(text: bytes, probe: str) -> list[bytes]:
    return [line for line in text.splitlines() if f'probe="{probe}"'.encode() not in line]


@pytest.mark.parametrize("accept", FORMATS)
def test_the_block_is_the_whole_collectors_through_runs_removals_and_additions(accept: str) -> None:
    latest = Latest()
    exposition = Exposition([ProbeCollector(latest)])
    assert scraped(exposition, accept) == whole(latest, accept)  # no probe: the families' headers alone
    assert scraped(exposition, accept).count(b"# HELP inference_probe_") == 13

    for n, name in enumerate(["zeta", "alpha", "é-probe", 'say "hi"\\', "b_2"]):
        latest.publish_probe(snapshot(name, n, endpoint=f"ep-{n}\n\r# {n}"))  # (a label holds \r unescaped)
        exposition.prepare()
    assert scraped(exposition, accept) == whole(latest, accept)

    latest.publish_probe(snapshot("alpha", 7))
    exposition.prepare()
    assert scraped(exposition, accept) == whole(latest, accept)

    removed(latest, "alpha", "zeta")
    exposition.prepare()
    body = scraped(exposition, accept)
    assert body == whole(latest, accept)
    assert b'probe="alpha"' not in body
    assert b'probe="zeta"' not in body

    latest.configure({*map(probe_source, latest.probes), probe_source("alpha")}, time.time())  # (a reload adds it back)
    latest.publish_probe(snapshot("alpha", 2, endpoint="ep-new"))
    exposition.prepare()
    body = scraped(exposition, accept)
    assert body == whole(latest, accept)
    assert b'inference_probe_runs_total{endpoint_id="ep-new",probe="alpha",scenario="chat"} 2.0' in body

    removed(latest, *latest.probes)
    assert scraped(exposition, accept) == whole(latest, accept)


@pytest.fixture
def rendered(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """What the exposition's encoders render from now on."""
    texts: list[bytes] = []

    def recording(accept: str) -> tuple[Callable[[Collector], bytes], str]:
        encoder, content_type = choose_encoder(accept)

        def recorded(collector: Collector) -> bytes:
            texts.append(encoder(collector))
            return texts[-1]

        return recorded, content_type

    monkeypatch.setattr(exposition_module, "choose_encoder", recording)
    return texts


def test_a_run_renders_its_probes_series_alone_and_leaves_the_others_as_they_were(rendered: list[bytes]) -> None:
    latest = Latest()
    exposition = Exposition([ProbeCollector(latest)])
    names = [f"probe-{n:02d}" for n in range(12)]
    for n, name in enumerate(names):
        latest.publish_probe(snapshot(name, n))
    exposition.prepare()
    before = {accept: scraped(exposition, accept) for accept in FORMATS}

    rendered.clear()
    latest.publish_probe(snapshot("probe-05", 20))
    exposition.prepare()
    series = [line for text in rendered for line in text.splitlines() if not line.startswith(b"#")]
    assert series  # in both formats, and nobody else's
    assert all(b'probe="probe-05"' in line for line in series)

    for accept in FORMATS:
        after = scraped(exposition, accept)
        assert after == whole(latest, accept)
        assert without(after, "probe-05") == without(before[accept], "probe-05")
        assert b'inference_probe_runs_total{endpoint_id="ep-1",probe="probe-05",scenario="chat"} 20.0' in after

    rendered.clear()
    for accept in FORMATS:
        scraped(exposition, accept)
    assert rendered == []  # the scrapes joined what the run rendered


def test_replaced_and_removed_snapshots_are_not_kept() -> None:
    """Past the next scrape, which replaces the block cached for the probes as they were."""
    latest = Latest()
    exposition = Exposition([ProbeCollector(latest)])
    latest.publish_probe(snapshot("stays", 1))
    first = snapshot("goes", 1)
    latest.publish_probe(first)
    exposition.prepare()
    for accept in FORMATS:
        scraped(exposition, accept)
    second = snapshot("goes", 2)
    latest.publish_probe(second)
    exposition.prepare()
    for accept in FORMATS:
        scraped(exposition, accept)
    old, gone = weakref.ref(first), weakref.ref(second)
    del first, second
    gc.collect()
    assert old() is None

    removed(latest, "goes")
    exposition.prepare()
    for accept in FORMATS:
        assert b'probe="goes"' not in scraped(exposition, accept)
    gc.collect()
    assert gone() is None


def test_a_probe_that_cannot_be_rendered_is_left_out_and_the_others_served(caplog: pytest.LogCaptureFixture) -> None:
    latest = Latest()
    exposition = Exposition([ProbeCollector(latest)])
    latest.publish_probe(snapshot("fine", 1))
    latest.publish_probe(snapshot("broken", 1, endpoint="ep\ud800x"))  # no text encoding can hold it
    for accept in FORMATS:
        for _ in range(2):
            exposition.prepare()
            body = scraped(exposition, accept)
            assert b'probe="fine"' in body
            assert b'probe="broken"' not in body
    errors = [r for r in caplog.records if r.getMessage() == "metrics left out of /metrics"]
    assert len(errors) == len({r.fields["during"] for r in errors}) == 2  # type: ignore[attr-defined]
    # (once for each format, not per scrape)
    assert {r.fields["collector"] for r in errors} == {"ProbeCollector"}  # type: ignore[attr-defined]


def test_scrapes_during_runs_see_each_family_whole_and_end_at_the_last_figures() -> None:
    latest = Latest()
    exposition = Exposition([ProbeCollector(latest)])
    names = [f"probe-{n}" for n in range(6)]
    for name in names:
        latest.publish_probe(snapshot(name, 0))
    done = threading.Event()
    failures: list[Exception] = []

    def runs(name: str) -> None:
        for n in range(1, 40):
            latest.publish_probe(snapshot(name, n))
            exposition.prepare()

    def scraper() -> None:
        """Plain and gzipped, each on its own (a run may come between the two)."""
        try:
            while not done.is_set():
                for accept in FORMATS:
                    for body in (exposition.render(accept)[0], gzip.decompress(exposition.render(accept, True)[0])):
                        families = list(PARSERS[accept](body.decode()))
                        assert len({family.name for family in families}) == len(families) == 13
                        assert all(s.labels["probe"] in names for family in families for s in family.samples)
        except Exception as error:  # reported by the test's thread
            failures.append(error)

    threads = [threading.Thread(target=runs, args=(name,)) for name in names]
    watcher = threading.Thread(target=scraper)
    watcher.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done.set()
    watcher.join()
    assert failures == []
    for accept in FORMATS:
        assert scraped(exposition, accept) == whole(latest, accept)
    assert all(snapshot.runs == 39 for snapshot in latest.probes.values())


# -- several accounts --


class _Whole(Collector):
    """An account's probes as one collector with no parts: rendered whole, as every run rendered them before."""

    def __init__(self, collector: ProbeCollector) -> None:
        self.collector = collector

    def version(self) -> object:
        return self.collector.version()

    def collect(self) -> Iterator[Metric]:
        return self.collector.collect()


def accounts_of(latests: dict[str, Latest], parted: bool = True) -> AssembledExposition:
    probes = [ProbeCollector(latest) for latest in latests.values()]
    return AssembledExposition([list(zip(latests, probes if parted else map(_Whole, probes), strict=True))])


def assembled_scrape(exposition: AssembledExposition, accept: str) -> bytes:
    body = exposition.render(accept)[0]
    assert gzip.decompress(exposition.render(accept, gzipped=True)[0]) == body
    return body


@pytest.mark.parametrize("accept", FORMATS)
def test_with_several_accounts_the_block_is_as_each_accounts_probes_rendered_whole(accept: str) -> None:
    latests = {"prod": Latest(), "lab": Latest()}
    exposition, reference = accounts_of(latests), accounts_of(latests, parted=False)
    assert assembled_scrape(exposition, accept) == assembled_scrape(reference, accept)
    for n, name in enumerate(["zeta", "alpha", 'say "hi"\\']):
        for account, latest in latests.items():
            latest.publish_probe(snapshot(name, n, endpoint=f"ep-{account}\r# {n}"))
            exposition.prepare(account)
    assert assembled_scrape(exposition, accept) == assembled_scrape(reference, accept)
    latests["lab"].publish_probe(snapshot("alpha", 9))
    exposition.prepare("lab")
    removed(latests["prod"], "zeta")
    exposition.prepare("prod")
    body = assembled_scrape(exposition, accept)
    assert body == assembled_scrape(reference, accept)
    assert b'account="prod",endpoint_id="ep-prod\r# 0",probe="zeta"' not in body
    assert b'account="lab",endpoint_id="ep-lab\r# 0",probe="zeta"' in body


def test_with_several_accounts_a_run_renders_its_probes_series_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    latests = {"prod": Latest(), "lab": Latest()}
    exposition = accounts_of(latests)
    for account, latest in latests.items():
        for n in range(8):
            latest.publish_probe(snapshot(f"probe-{n}", n))
        exposition.prepare(account)
    rendered: list[bytes] = []

    def recording(accept: str) -> tuple[Callable[[Collector], bytes], str]:
        encoder, content_type = choose_encoder(accept)
        return lambda collector: rendered.append(encoder(collector)) or rendered[-1], content_type

    monkeypatch.setattr(assembled_module, "choose_encoder", recording)
    latests["lab"].publish_probe(snapshot("probe-3", 20))
    exposition.prepare("lab")
    series = [line for text in rendered for line in text.splitlines() if not line.startswith(b"#")]
    assert series  # in both formats, and nobody else's
    assert all(b'account="lab"' in line and b'probe="probe-3"' in line for line in series)
