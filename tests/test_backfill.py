"""backfill: the bill series as a Prometheus scraping the exporter would have stored them, read
through `last_over_time(…[1h])` as the dashboards read them.

Checked sample by sample against the live exporter's own collectors (frozen clock), then end to
end as a user runs it: the command as a process, the real promtool turning its file into blocks,
the real Prometheus answering PromQL (and the dashboard's month panels) over the backfilled months
with the simulator's figures to the cent.
"""

from __future__ import annotations

import datetime as dt
import io
import itertools
import json
import math
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
import requests

from exporter.billing import BillingAPIError, BillingClient, BillingUnavailable, BillRecord, SignatureRejected
from exporter.config.load import validate
from exporter.core.clock import Clock, FrozenClock, previous_period
from exporter.metrics.collectors import BillsCollector, ExporterCollector
from exporter.model.snapshots import DailyAmount, Latest
from exporter.replay.backfill import (
    BLOCK,
    CALENDAR_STEP,
    MAX_MONTHS,
    STEP,
    WINDOW,
    BackfillError,
    Month,
    _Calendar,
    backfill,
    block_cuts,
    fetch,
    file_name,
    months,
    render,
    replacing,
    target_labels,
)
from exporter.sim import ITEMS, Fault, Simulator, SimulatorServer, SpendModel
from exporter.sources.bills import BillsSource
from tests.conftest import SHANGHAI, billing_section, require_binary
from tests.fakes import FakeBilling
from tests.helpers import free_port, serve_binary, wait_for
from tests.test_cli import ROOT, run, write_config
from tests.test_prometheus_e2e import panel_queries

CENT = Decimal("0.01")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
ENDPOINT = "inference_bill_endpoint_daily_payable_amount"
MONTH_TO_DATE = "inference_bill_month_to_date_payable_amount"
TODAY = "inference_billing_today_info"
JOB = ("job", "inference-cost-exporter")
INSTANCE = ("instance", "exporter:9877")
Key = tuple[str, frozenset[tuple[str, str]]]


def key(series: str) -> Key:
    name, _, labels = series.partition("{")
    return name, frozenset(LABEL.findall(labels))


def scan(path: Path, instants: set[int]) -> tuple[dict[int, dict[Key, str]], dict[str, tuple[int, int, int]]]:
    """The value text of every series at each of `instants`, and each series' first and last
    sample time and sample count. Fails where the file breaks what promtool and OpenMetrics need:
    one family block per name, each series' samples together, in time order, `STEP` apart
    (`CALENDAR_STEP` for the calendar's) or less before a series' last."""
    at: dict[int, dict[Key, str]] = {t: {} for t in instants}
    spans: dict[str, tuple[int, int, int]] = {}
    families: list[str] = []
    current, first, last, count = "", 0, 0, 0
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            if line.startswith("# TYPE "):
                families.append(line.split()[2])
                continue
            if line.startswith("#"):
                continue
            series, value, stamp = line.rsplit(" ", 2)
            instant = round(float(stamp))  # (a series' last sample: a millisecond before its second)
            if series != current:
                if current:
                    spans[current] = (first, last, count)
                assert series not in spans, f"{series}: its samples are not together"
                assert series.partition("{")[0] == families[-1], f"{series} outside its family's block"
                current, first, last, count = series, instant, instant, 1
            else:
                step = CALENDAR_STEP if series.startswith(TODAY) else STEP
                assert last < instant <= last + step, f"{series}: {instant} after {last}"
                last, count = instant, count + 1
            if instant in at:
                at[instant][key(series)] = value
    spans[current] = (first, last, count)
    assert len(families) == len(set(families)), families
    return at, spans


def live_series(client: BillingClient, clock: Clock, frozen: FrozenClock, instant: dt.datetime) -> dict[Key, float]:
    """What the live exporter's bills and calendar collectors expose at `instant`."""
    frozen.set(instant)
    latest = Latest()
    latest.bills = BillsSource(client, clock, 3).refresh()
    families = [*BillsCollector(latest).collect(), *ExporterCollector(latest, clock).collect()]
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in families
        if family.name.startswith(("inference_bill_", "inference_billing_"))
        for s in family.samples
    }


def day_amount(sim: Simulator, day: dt.date, endpoint_id: str | None = None) -> Decimal:
    """The simulator's payable amount of a day, for one endpoint or the account."""
    period = f"{day:%Y-%m}"
    endpoints = [e for e in sim.endpoints if endpoint_id in (None, e.endpoint_id)]
    return sum((sim.charge(period, day, e, item)[0] for e in endpoints for item in ITEMS), Decimal(0))


@pytest.fixture
def output(tmp_path: Path) -> Iterator[Path]:
    """Where a backfill goes; removed afterwards (hundreds of megabytes: not for pytest to keep)."""
    path = tmp_path / "backfill.om"
    yield path
    path.unlink(missing_ok=True)


def test_every_sample_is_what_the_live_exporter_showed_then(
    sim: Simulator, server: SimulatorServer, frozen: FrozenClock, clock: Clock, output: Path
) -> None:
    sim.spend = SpendModel(start=dt.date(2026, 6, 1))
    frozen.set(dt.datetime(2026, 11, 5, 10, 0, tzinfo=SHANGHAI))
    config = validate({"billing": billing_section(sim, server, history_months=0)}, {})
    at = lambda day: int(clock.day_start(day).timestamp())  # noqa: E731
    with BillingClient.from_config(config.billing, clock) as client:
        result = backfill(client, clock, months("2026-10", None, "2026-11"), output, grace_days=3, history=False)
        assert result.written == ("2026-10", "2026-11")
        assert not result.skipped
        assert (result.start, result.end) == (
            clock.day_start(dt.date(2026, 10, 1)),
            clock.day_start(dt.date(2026, 11, 5)),
        )
        # The first day (the forecast averages September's last week, as in the grace days), a
        # grace day of September, mid-month, the month's last day, a grace day of October, and
        # yesterday (today, 5 November, is not complete: not written).
        checked = [dt.date(2026, 10, d) for d in (1, 2, 16, 31)] + [dt.date(2026, 11, d) for d in (2, 4)]
        day_ends = {day: at(day + dt.timedelta(days=1)) - STEP for day in checked}
        samples, spans = scan(output, set(day_ends.values()))
        for day in checked:
            shown = live_series(client, clock, frozen, clock.day_start(day) + dt.timedelta(hours=23, minutes=55))
            expected = {k: v for k, v in shown.items() if dict(k[1])["period"] in result.written}
            assert {k: float(v) for k, v in samples[day_ends[day]].items()} == expected, day

    assert sum(count for _, _, count in spans.values()) == result.samples
    assert len(spans) == result.series
    assert max(last for s, (_, last, _) in spans.items() if not s.startswith(TODAY)) == at(dt.date(2026, 11, 5)) - STEP
    assert max(last for s, (_, last, _) in spans.items() if s.startswith(TODAY)) == at(dt.date(2026, 11, 5)) - 300
    assert not [s for s in spans if 'day="2026-11-05"' in s]
    # A day's series from its start for as long as the exporter shows its month: to 3 November
    # (the grace days) for October's, to the end of what is written for November's.
    alpha = 'endpoint_id="ep-20261101-alpha",product="PRODUCT_INFERENCE_ENDPOINT",project_id="proj-main"}'
    october = spans[f'inference_bill_endpoint_daily_payable_amount{{period="2026-10",day="2026-10-16",{alpha}']
    assert october[:2] == (at(dt.date(2026, 10, 16)), at(dt.date(2026, 11, 4)) - STEP)
    november = spans[f'inference_bill_endpoint_daily_payable_amount{{period="2026-11",day="2026-11-03",{alpha}']
    assert november[:2] == (at(dt.date(2026, 11, 3)), at(dt.date(2026, 11, 5)) - STEP)
    info = spans['inference_billing_today_info{day="2026-10-16",period="2026-10"}']
    assert info == (at(dt.date(2026, 10, 16)), at(dt.date(2026, 10, 17)) - 300, 288)
    # Exact decimals: the month's total and a day's amount as the simulator sums them.
    last_day = samples[day_ends[dt.date(2026, 10, 31)]]
    assert last_day[key('inference_bill_month_to_date_payable_amount{period="2026-10"}')] == str(
        sim.bill_totals("2026-10")["total"]
    )
    day_16 = samples[day_ends[dt.date(2026, 10, 16)]]
    series = f'inference_bill_endpoint_daily_payable_amount{{period="2026-10",day="2026-10-16",{alpha}'
    assert Decimal(day_16[key(series)]) == day_amount(sim, dt.date(2026, 10, 16), "ep-20261101-alpha")


def test_a_series_is_seen_to_its_end_and_no_longer_across_a_half_hour_clock_change() -> None:
    """Lord Howe Island moves its clocks by half an hour (4 October 2026): a day series of
    September stays to 3 October, one of October spans the change; each one's last sample is an
    hour before its end, so `last_over_time(…[1h])` finds it exactly until then."""
    clock = Clock(ZoneInfo("Australia/Lord_Howe"))
    calendar = _Calendar(clock, 3)
    at = lambda day: int(clock.day_start(day).timestamp())  # noqa: E731
    days = (dt.date(2026, 9, 30), dt.date(2026, 10, 2), dt.date(2026, 10, 20))
    months_ = {
        day.strftime("%Y-%m"): Month(
            day.strftime("%Y-%m"), (DailyAmount(day.strftime("%Y-%m"), day, "ep", "P", "", Decimal(1), Decimal(0)),), ()
        )
        for day in days[:1]
    } | {
        "2026-10": Month(
            "2026-10", tuple(DailyAmount("2026-10", d, "ep", "P", "", Decimal(1), Decimal(0)) for d in days[1:]), ()
        )
    }
    out = io.StringIO()
    end = at(dt.date(2026, 11, 2)) + 1800  # an end off the hour too
    render(out, months_, calendar, (at(dt.date(2026, 9, 30)), end), history=False)
    last: dict[str, str] = {}
    for line in out.getvalue().splitlines():
        if line.startswith(ENDPOINT):
            series, _, stamp = line.rsplit(" ", 2)
            last[series.split('day="')[1][:10]] = stamp
    # Each a millisecond before the second a step before its end: seen until the end, not at it.
    assert last == {
        "2026-09-30": f"{at(dt.date(2026, 10, 4)) - STEP - 1}.999",  # through 3 October (its clocks change)
        "2026-10-02": f"{end - STEP - 1}.999",
        "2026-10-20": f"{end - STEP - 1}.999",
    }


def test_amounts_are_written_as_exact_decimals_and_labels_escaped(clock: Clock) -> None:
    day = dt.date(2026, 10, 5)
    amounts = [Decimal("0.1"), Decimal("0.2"), Decimal("1E+2"), Decimal("12.30"), Decimal("0.00000001")]
    odd = DailyAmount("2026-10", day, 'ep"odd\\one\nout', "P", "", Decimal("0.1") + Decimal("0.2"), Decimal(0))
    items = tuple(DailyAmount("2026-10", day, f"ITEM_{n}", "P", "", a, a * 3) for n, a in enumerate(amounts))
    month = Month("2026-10", by_endpoint=(odd,), by_item=items)
    calendar = _Calendar(clock, 3)
    start = int(clock.day_start(day).timestamp())
    out = io.StringIO()
    render(out, {"2026-10": month}, calendar, (start, start + 2 * STEP), history=False, target=(JOB,))
    lines = out.getvalue().splitlines()
    assert (
        f'inference_bill_endpoint_daily_payable_amount{{period="2026-10",day="2026-10-05",'
        f'endpoint_id="ep\\"odd\\\\one\\nout",product="P",project_id="",job="inference-cost-exporter"}} 0.3 {start}'
    ) in lines
    values = [line.rsplit(" ", 2)[1] for line in lines if line.startswith("inference_bill_item_daily_payable_amount")]
    assert values == [v for v in ("0.1", "0.2", "100", "12.30", "0.00000001") for _ in range(2)]
    to_date = 'inference_bill_month_to_date_payable_amount{period="2026-10",job="inference-cost-exporter"}'
    assert f"{to_date} 112.60000001 {start}" in lines
    assert lines[-1] == "# EOF"


class Answers:
    """A billing client whose answers per month are given: records, or an error to raise."""

    def __init__(self, answers: dict[str, list[BillRecord] | Exception]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    def bills(self, period: str, group_term: str) -> list[BillRecord]:
        self.asked.append(period)
        answer = self.answers[period]
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_a_month_refused_or_empty_is_left_out_never_zeros(clock: Clock, tmp_path: Path) -> None:
    record = BillRecord("2026-09", dt.date(2026, 9, 3), "ep-1", "", "P", "", Decimal("5.5"), Decimal(1))
    refused = BillingAPIError("bills 2026-08: code 100500", status=200, code=100500, message="internal")
    down = BillingUnavailable("bills 2026-10: connection refused (gave up after 4 attempts)")
    client = Answers({"2026-07": [], "2026-08": refused, "2026-09": [record], "2026-10": down})
    found, skipped = fetch(client, ["2026-07", "2026-08", "2026-09", "2026-10"])  # type: ignore[arg-type]
    assert list(found) == ["2026-09"]
    assert skipped == [
        ("2026-07", "the API listed no bills for it"),
        ("2026-08", "the API refused it"),
        ("2026-10", "the API could not be reached, or kept failing"),
    ]

    output = tmp_path / "backfill.om"
    output.write_text("an earlier backfill\n")
    nothing = Answers({"2026-07": [], "2026-08": refused})
    with pytest.raises(BackfillError, match="nothing written"):
        backfill(nothing, clock, ["2026-07", "2026-08"], output, grace_days=3, history=True)  # type: ignore[arg-type]
    assert output.read_text() == "an earlier backfill\n"
    assert [p.name for p in tmp_path.iterdir()] == ["backfill.om"]

    signature = SignatureRejected("signature rejected (HTTP 401)", status=401, code=None, message="")
    with pytest.raises(BackfillError, match="signature rejected"):
        backfill(Answers({"2026-07": signature}), clock, ["2026-07", "2026-08"], output, grace_days=3, history=True)  # type: ignore[arg-type]  # fmt: skip


def samples_of(path: Path) -> list[str]:
    return [line for line in path.read_text(encoding="utf-8").splitlines() if not line.startswith("#")]


@pytest.mark.parametrize(
    ("zone", "now", "first"),
    [
        ("Asia/Shanghai", dt.datetime(2026, 11, 22, 10, 0), "2026-08"),
        ("Etc/GMT+1", dt.datetime(2026, 11, 22, 10, 0), "2026-08"),
        ("Etc/GMT-4", dt.datetime(2026, 9, 20, 1, 2), "2026-06"),
        ("Etc/GMT-4", dt.datetime(2026, 9, 20, 1, 40), "2026-06"),
    ],
)
def test_files_cut_where_promtool_cuts_its_blocks_hold_the_one_files_samples(
    frozen: FrozenClock, tmp_path: Path, output: Path, zone: str, now: dt.datetime, first: str
) -> None:
    """`--output-dir`: each file's samples lie in one of promtool's blocks, a block no other file
    reaches, and together the files hold the one file's samples, each once; no file is empty. At
    UTC-1 a day starts at 01:00 UTC, so a day series' last sample (a millisecond before the hour
    before its end) falls just before a cut (00:00 UTC) on some days: it stays in the earlier file.
    At UTC+4, at 01:02, what is written ends 2 minutes after a block begins (18:00 UTC, 3 hours
    before): the samples there are all the last of their series, the earlier file's; at 01:40, 40
    minutes after, a file of its own."""
    clock = Clock(ZoneInfo(zone), frozen)
    frozen.set(now.replace(tzinfo=clock.tz))
    sim = Simulator(clock=clock, spend=SpendModel(start=dt.date(2026, 5, 1)))
    periods = months(first, None, clock.period())
    whole = backfill(FakeBilling(sim), clock, periods, output, grace_days=3, history=True)
    directory = tmp_path / "files"
    split = backfill(FakeBilling(sim), clock, periods, directory, grace_days=3, history=True, directory=True)
    assert (split.written, split.series, split.samples, split.start, split.end) == (
        whole.written, whole.series, whole.samples, whole.start, whole.end
    )  # fmt: skip
    start, end = int(split.start.timestamp()), int(split.end.timestamp())
    names = [file_name(at) for at in (start, *block_cuts(start, end))]
    assert [p.name for p in split.files] == sorted(p.name for p in directory.iterdir()) == names  # (in time order)
    assert len(names) >= 5

    blocks, together, cut_edges = [], Counter[str](), 0
    families = [line for line in output.read_text(encoding="utf-8").splitlines() if line.startswith("#")]
    for path in split.files:
        scan(path, set())  # (each file as promtool and OpenMetrics need it)
        assert [line for line in path.read_text(encoding="utf-8").splitlines() if line.startswith("#")] == families
        lines = samples_of(path)
        times = [float(line.rsplit(" ", 1)[1]) for line in lines]
        (block,) = {math.floor(t) // BLOCK for t in times}  # (one, and not none)
        blocks.append(block)
        together.update(lines)
        cut_edges += sum(1 for t in times if (math.floor(t) + 1) % BLOCK == 0 and t % 1)
    assert blocks == sorted(set(blocks))  # (one block a file, never another's)
    assert together == Counter(samples_of(output))
    assert cut_edges > 0 if zone == "Etc/GMT+1" else cut_edges == 0


def test_an_output_directory_keeps_to_its_own_files(sim: Simulator, clock: Clock, tmp_path: Path) -> None:
    """The same command again replaces its own files; a directory holding another `.om` file (which
    would be loaded with them) or a file in its place is refused; a run that fails leaves the
    files as they were, and no partial one; a directory it made, it removes."""
    sim.spend = SpendModel(start=dt.date(2026, 8, 1))
    directory = tmp_path / "files"
    write = lambda client: backfill(client, clock, ["2026-10"], directory, grace_days=3, history=False, directory=True)  # noqa: E731
    refused = BillingAPIError("bills 2026-10: code 100500", status=200, code=100500, message="internal")
    with pytest.raises(BackfillError, match="nothing written"):
        write(Answers({"2026-10": refused}))
    assert not directory.exists()
    with pytest.raises(FileNotFoundError):
        backfill(FakeBilling(sim), clock, ["2026-10"], tmp_path / "no" / "such", grace_days=3, history=False,
                 directory=True)  # fmt: skip
    assert not (tmp_path / "no").exists()

    first = write(FakeBilling(sim))
    written = {path: path.read_bytes() for path in first.files}
    first.files[0].write_text("an earlier run's\n")
    assert write(FakeBilling(sim)).files == first.files
    assert {path: path.read_bytes() for path in first.files} == written

    with pytest.raises(BackfillError, match="nothing written"):
        write(Answers({"2026-10": refused}))
    assert {path: path.read_bytes() for path in first.files} == written
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(BackfillError, match="nothing written"):  # (a directory it did not make stays)
        backfill(Answers({"2026-10": refused}), clock, ["2026-10"], empty, grace_days=3, history=False, directory=True)  # type: ignore[arg-type]  # fmt: skip
    assert empty.is_dir()
    (directory / "backfill-20260101T0000Z.om").write_text("another run's\n")
    (directory / "notes.txt").write_text("not OpenMetrics: left alone\n")
    with pytest.raises(FileExistsError, match=r"it holds backfill-20260101T0000Z\.om, which this run does not write"):
        write(FakeBilling(sim))
    (directory / "z.om").write_text("another\n")
    with pytest.raises(FileExistsError, match=r"it holds backfill-20260101T0000Z\.om and 1 more, which"):
        write(FakeBilling(sim))
    assert {path: path.read_bytes() for path in first.files} == written
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        [*(p.name for p in first.files), "backfill-20260101T0000Z.om", "notes.txt", "z.om"]
    )
    (tmp_path / "a-file").write_text("kept\n")
    with pytest.raises(FileExistsError, match="it is not a directory"):
        backfill(FakeBilling(sim), clock, ["2026-10"], tmp_path / "a-file", grace_days=3, history=False, directory=True)
    assert (tmp_path / "a-file").read_text() == "kept\n"


class Meddling(FakeBilling):
    """The fake billing API, doing `meddle` as the first bills are asked for (while a run is under way)."""

    def __init__(self, sim: Simulator, meddle: Callable[[], object]) -> None:
        super().__init__(sim)
        self.meddle: Callable[[], object] | None = meddle

    def bills(self, period: str, group_term: str) -> list[BillRecord]:
        if self.meddle is not None:
            self.meddle, meddle = None, self.meddle
            meddle()
        return super().bills(period, group_term)


def test_a_run_that_fails_as_its_files_are_finished_replaces_none_of_them(
    sim: Simulator, clock: Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory put in place of the second file while the run fetches: every file is finished
    and checked before any replaces an earlier one, so none does. A Ctrl-C among the replaces
    waits until they are all done; an error among them (not a signal) is raised at once."""
    sim.spend = SpendModel(start=dt.date(2026, 8, 1))
    directory = tmp_path / "files"
    write = lambda client: backfill(client, clock, ["2026-09", "2026-10"], directory, grace_days=3, history=False,  # noqa: E731
                                    directory=True)  # fmt: skip
    files = write(FakeBilling(sim)).files
    assert len(files) >= 3
    for path in files:
        path.write_text("an earlier run's\n")

    def a_directory_in_place_of_the_second() -> None:  # (one before it and one after: in neither order)
        files[1].unlink()
        files[1].mkdir()

    with pytest.raises(FileExistsError, match="it is a directory, not a regular file"):
        write(Meddling(sim, a_directory_in_place_of_the_second))
    assert [path.read_text() for path in files if path != files[1]] == ["an earlier run's\n"] * (len(files) - 1)
    assert not list(directory.glob(".*.partial"))

    files[1].rmdir()
    replace, calls = os.replace, []

    def interrupted_once(source: Path, target: Path) -> None:
        calls.append(target)
        if len(calls) == 2:
            raise KeyboardInterrupt
        replace(source, target)

    monkeypatch.setattr(os, "replace", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        write(FakeBilling(sim))
    assert all(path.read_text().startswith("# TYPE ") for path in files)
    assert not list(directory.glob(".*.partial"))

    def failing_once(source: Path, target: Path) -> None:  # (an error, not a signal: raised, not tried again)
        calls.append(target)
        if len(calls) == 2:
            raise ValueError("a fault of ours")
        replace(source, target)

    calls.clear()
    monkeypatch.setattr(os, "replace", failing_once)
    with pytest.raises(ValueError, match="a fault of ours"):
        write(FakeBilling(sim))
    assert len(calls) == 2
    assert not list(directory.glob(".*.partial"))


@pytest.mark.parametrize(
    ("first", "last", "error"),
    [
        ("2026-13", None, "argument --from: '2026-13' is not a month (YYYY-MM)"),
        ("2026-9", None, "argument --from: '2026-9' is not a month (YYYY-MM)"),
        ("0001-01", None, "argument --from: 0001-01 is before 1970"),
        ("0000-01", "0000-02", "argument --from: 0000-01 is before 1970"),
        ("2026-09", "26-10", "argument --to: '26-10' is not a month (YYYY-MM)"),
        ("2026-10", "2026-09", "argument --from: 2026-10 is after --to 2026-09"),
        ("2026-12", None, "argument --from: 2026-12 is in the future (this month is 2026-11)"),
        ("2026-10", "2027-01", "argument --to: 2027-01 is in the future (this month is 2026-11)"),
        ("2024-01", "2026-10", "34 months from 2024-01 to 2026-10: at most 24 at once"),
    ],
)
def test_bad_months_are_refused_with_the_reason(first: str, last: str | None, error: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(error)}$"):
        months(first, last, "2026-11")


def test_months_run_from_the_first_to_the_last_across_a_year() -> None:
    assert months("2025-11", "2026-02", "2026-11") == ["2025-11", "2025-12", "2026-01", "2026-02"]
    assert months("2026-11", None, "2026-11") == ["2026-11"]
    assert len(months("2024-12", None, "2026-11")) == MAX_MONTHS  # the cap itself is allowed


@pytest.mark.parametrize(
    ("pairs", "error"),
    [
        (["job"], "argument --label: 'job' is not NAME=VALUE (a Prometheus label name, a value)"),
        (["job="], "argument --label: 'job=' is not NAME=VALUE (a Prometheus label name, a value)"),
        (["1job=x"], "argument --label: '1job=x' is not NAME=VALUE (a Prometheus label name, a value)"),
        (["__name__=x"], "argument --label: '__name__=x' is not NAME=VALUE (a Prometheus label name, a value)"),
        (["day=x"], "argument --label: day is a label of the bill series themselves"),
        (["job=a", "job=b"], "argument --label: job is given twice"),
    ],
)
def test_bad_labels_are_refused_with_the_reason(pairs: list[str], error: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(error)}$"):
        target_labels(pairs)
    assert target_labels(["job=a", "instance=h:1"]) == (("job", "a"), ("instance", "h:1"))


# --- the command, as a process ----------------------------------------------------------------


def billing_months(count: int) -> list[str]:
    """The `count` months before this one (the billing zone's, on the real clock), oldest first."""
    periods = [Clock(SHANGHAI).period()]
    for _ in range(count):
        periods.insert(0, previous_period(periods[0]))
    return periods[:-1]


@pytest.fixture
def spending() -> Iterator[tuple[Simulator, SimulatorServer]]:
    """A simulator on the real clock (the command signs with it) billing five months of history."""
    sim = Simulator(spend=SpendModel(start=dt.date.today() - dt.timedelta(days=160)))
    server = sim.serve()
    yield sim, server
    server.stop()


@pytest.mark.integration  # the command as a process, against a simulator on loopback
@pytest.mark.parametrize(
    "args",
    [
        ["--from", "2026-13"],
        ["--from", "2026-10", "--to", "2026-09"],
        ["--from", "2999-01"],
        ["--from", "2026-10", "--label", "job"],
        ["--from", "2026-10", "--output", "/nonexistent-directory/backfill.om"],
        ["--from", "2026-10", "--output", "/tmp/a-directory-it-would-make-a-file-of/"],
        ["--from", "2026-10", "--output", "/tmp/a-directory-it-would-make-a-file-of/."],
    ],
)
def test_bad_arguments_exit_2_with_one_line(
    tmp_path: Path, spending: tuple[Simulator, SimulatorServer], args: list[str]
) -> None:
    sim, server = spending
    config = write_config(tmp_path, sim, server)
    result = run("backfill", "--config", str(config), "--output", str(tmp_path / "out.om"), *args,
                 env={"TEST_BILLING_SECRET": sim.secret_access_key})  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("inference-cost-exporter backfill: ")
    assert not (tmp_path / "out.om").exists()


@pytest.mark.integration  # the command as a process, against a simulator on loopback
@pytest.mark.parametrize(
    ("signum", "status", "said"), [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")]
)
@pytest.mark.parametrize("times", [1, 3])
def test_ctrl_c_or_sigterm_is_one_line_and_leaves_no_file(
    tmp_path: Path, spending: tuple[Simulator, SimulatorServer], signum: int, status: int, said: str, times: int
) -> None:
    """Interrupted while it fetches (answers take a second), by Ctrl-C or by SIGTERM (`kill`, a
    timeout), once or again while it stops (Ctrl-C pressed again, a supervisor's SIGTERM sent
    again): its exit status, one line saying so, no traceback, and no output file, partial or not."""
    sim, server = spending
    sim.latency = 1.0
    config = write_config(tmp_path, sim, server)
    output = tmp_path / "out.om"
    month = f"{dt.date.today() - dt.timedelta(days=100):%Y-%m}"
    process = subprocess.Popen(
        [sys.executable, "-m", "exporter.cli", "backfill", "--config", str(config), "--from", month,
         "--output", str(output)],
        env={**os.environ, "TEST_BILLING_SECRET": sim.secret_access_key},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        wait_for(lambda: sum(sim.requests_served.values()) > 0, timeout=30)  # (fetching)
        assert (tmp_path / ".out.om.partial").exists()
        for _ in range(times):
            process.send_signal(signum)
            time.sleep(0.002)
        _, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == status, stderr
    assert stderr.strip().splitlines()[-1] == f"inference-cost-exporter: backfill: {said}"
    assert "Traceback" not in stderr
    assert not list(tmp_path.glob("*out.om*"))


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def directory(path: Path) -> Path:
    path.mkdir()
    (path / "kept").write_text("kept\n")
    return path


def device(path: Path) -> Path:
    """A character device: as root, a node of its own with /dev/null's numbers (so that a regression
    replaces that one, not the machine's /dev/null); else /dev/null itself, which a user cannot replace."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.stat("/dev/null").st_rdev)
    except PermissionError:
        return Path("/dev/null")
    return path


def unix_socket(path: Path) -> Path:
    with socket.socket(socket.AF_UNIX) as bound:
        bound.bind(str(path))  # the socket file stays after the socket is closed
    return path


def link_to_fifo(path: Path) -> Path:
    path.symlink_to(fifo(path.with_name("fifo")))
    return path


def identity(path: Path) -> tuple[tuple[int, int, int], ...]:
    """What the path is, and what it points to: replacing either changes it."""
    return tuple((s.st_ino, s.st_mode, s.st_rdev) for s in (os.lstat(path), os.stat(path)))


@pytest.mark.integration  # the command as a process, against a simulator on loopback
@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (fifo, "a FIFO"),
        (directory, "a directory"),
        (device, "a character device"),
        (unix_socket, "a socket"),
        (link_to_fifo, "a symbolic link to a FIFO"),
    ],
    ids=["fifo", "directory", "device", "socket", "link-to-fifo"],
)
def test_an_output_that_is_not_a_regular_file_is_refused_and_left_as_it_is(
    tmp_path: Path, spending: tuple[Simulator, SimulatorServer], make: Callable[[Path], Path], kind: str
) -> None:
    """Replacing it would put a regular file where a FIFO, a device node or a directory was (a device
    node in /dev, as root): refused with one line naming it, before any month is fetched."""
    sim, server = spending
    config = write_config(tmp_path, sim, server)
    target = make(tmp_path / "out")
    before = identity(target)
    month = billing_months(1)[0]
    result = run("backfill", "--config", str(config), "--from", month, "--to", month, "--output", str(target),
                 env={"TEST_BILLING_SECRET": sim.secret_access_key})  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"inference-cost-exporter backfill: cannot write {target}: it is {kind}, not a regular file (left as it is)"
    ]
    assert identity(target) == before
    assert not target.with_name(f".{target.name}.partial").exists()
    if kind == "a directory":
        assert [p.name for p in target.iterdir()] == ["kept"]
    assert sim.requests_served == {}


@pytest.mark.integration  # the command as a process, against a simulator on loopback
def test_refused_credentials_write_nothing_and_name_no_secret(
    tmp_path: Path, spending: tuple[Simulator, SimulatorServer]
) -> None:
    sim, server = spending
    (tmp_path / "out.om").write_text("kept\n")
    wrong = "wrong-" + sim.secret_access_key[::-1]
    month = billing_months(1)[0]
    result = run("backfill", "--config", str(write_config(tmp_path, sim, server, log_level="debug")), "--from", month,
                 "--to", month, "--output", str(tmp_path / "out.om"), env={"TEST_BILLING_SECRET": wrong})  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "signature" in result.stderr.splitlines()[-1]
    assert wrong not in result.stderr + result.stdout
    assert (tmp_path / "out.om").read_text() == "kept\n"


@pytest.mark.integration  # the command as a process, against a simulator on loopback
def test_output_dir_writes_a_file_a_block_and_says_how_to_load_them(
    tmp_path: Path, spending: tuple[Simulator, SimulatorServer]
) -> None:
    sim, server = spending
    config = write_config(tmp_path, sim, server)
    env = {"TEST_BILLING_SECRET": sim.secret_access_key}
    first, *_, last = billing_months(3)
    directory = tmp_path / "a dir"
    result = run("backfill", "--config", str(config), "--from", first, "--to", last, "--output-dir", str(directory),
                 "--label", "=".join(JOB), "--label", "=".join(INSTANCE), env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr
    files = sorted(directory.iterdir())
    assert len(files) >= 4
    assert all(p.name.startswith("backfill-") and p.suffix == ".om" for p in files)
    assert result.stdout.startswith(f"wrote {directory} ({len(files)} files): {first}, ")
    load = "promtool tsdb create-blocks-from openmetrics --max-block-duration=486h"
    assert f"load them with: for file in '{directory}'/*.om; do {load} \"$file\" DIR; done" in result.stdout
    assert subprocess.run(["grep", "-rqF", sim.secret_access_key, str(directory)]).returncode == 1

    served = dict(sim.requests_served)
    for args, said in (
        (["--output", str(tmp_path / "out.om"), "--output-dir", str(directory)], "not allowed with argument"),
        (["--output-dir", ""], "backfill: error: --output-dir names no directory"),
        ([], "one of the arguments --output --output-dir is required"),
    ):
        refused = run("backfill", "--config", str(config), "--from", first, *args, env=env)
        assert refused.returncode == 2, refused.stderr
        assert said in refused.stderr
    (directory / "another.om").write_text("another run's\n")
    refused = run("backfill", "--config", str(config), "--from", first, "--output-dir", str(directory), env=env)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.splitlines() == [
        f"inference-cost-exporter backfill: cannot write {directory}: it holds another.om, which this run does not"
        " write; loaded with these, another run's files would repeat or mix samples (remove them, or choose another"
        " directory)"
    ]
    assert sorted(directory.iterdir()) == sorted([*files, directory / "another.om"])
    assert sim.requests_served == served  # (refused before any request)


def query(url: str, expr: str, at: float) -> list[dict]:
    body = requests.get(f"{url}/api/v1/query", params={"query": expr, "time": f"{at:.3f}"}, timeout=10).json()
    assert body["status"] == "success", f"{expr}: {body.get('error')}"
    return body["data"]["result"]


@pytest.mark.integration  # the command as a process, then promtool and Prometheus
@pytest.mark.timeout(360)  # promtool and Prometheus beside three other workers on two cores: over 120 s at load 16
def test_prometheus_answers_over_the_backfilled_months_with_the_simulators_figures(
    tmp_path: Path, output: Path, spending: tuple[Simulator, SimulatorServer]
) -> None:
    promtool, prometheus = require_binary("promtool"), require_binary("prometheus")
    sim, server = spending
    refused, *written = billing_months(4)
    sim.inject(Fault("code", "/api/v1/bills", times=1))  # the first request: the first month's
    config = write_config(tmp_path, sim, server)
    result = run("backfill", "--config", str(config), "--from", refused, "--to", written[-1], "--output", str(output),
                 "--label", "=".join(JOB), "--label", "=".join(INSTANCE),
                 env={"TEST_BILLING_SECRET": sim.secret_access_key})  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"inference-cost-exporter backfill: {refused} skipped: the API refused it" in result.stderr
    assert "note:" not in result.stderr
    assert sim.secret_access_key not in result.stderr + result.stdout
    assert result.stdout.startswith(f"wrote {output}: {', '.join(written)}: ")
    assert subprocess.run(["grep", "-qF", sim.secret_access_key, str(output)]).returncode == 1

    # promtool's lint over one instant of the file (every series alive then, their HELP and TYPE),
    # and its OpenMetrics parser over all of it, into blocks as docs/backfill.md says.
    mid = Clock(SHANGHAI).day_start(dt.date.fromisoformat(f"{written[1]}-15")) + dt.timedelta(hours=12)
    instant = ["grep", "-E", f"^#| {int(mid.timestamp())}$", str(output)]
    excerpt = subprocess.run(instant, capture_output=True, check=True).stdout
    assert excerpt.count(b"\n") > 100
    lint = subprocess.run([promtool, "check", "metrics"], input=excerpt, capture_output=True, timeout=60)
    assert lint.returncode == 0, lint.stdout.decode() + lint.stderr.decode()
    blocks = tmp_path / "data"
    load = ["tsdb", "create-blocks-from", "openmetrics", "--max-block-duration=486h", str(output), str(blocks)]
    created = subprocess.run([promtool, *load], capture_output=True, text=True, timeout=300)
    assert created.returncode == 0, created.stderr
    output.unlink()

    (tmp_path / "prometheus.yml").write_text("scrape_configs: []\n")
    port = free_port()
    command = [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={blocks}",
               "--storage.tsdb.retention.time=10y", f"--web.listen-address=127.0.0.1:{port}"]  # fmt: skip
    with contextmanager(serve_binary)(command, port) as url:
        for period in written:
            check_month(url, sim, period)
        check_edges(url, sim, refused, written[-1])


def check_month(url: str, sim: Simulator, period: str) -> None:
    """PromQL over one backfilled month gives the simulator's figures, and so do the dashboard's
    panels that pick this month or today (`and on(period|day) inference_billing_today_info`)."""
    at = lambda day: Clock(SHANGHAI).day_start(day).timestamp()  # noqa: E731
    first = dt.date.fromisoformat(f"{period}-01")
    following = (first + dt.timedelta(days=31)).replace(day=1)
    truth = sim.bill_totals(period)
    target = f'job="{JOB[1]}",instance="{INSTANCE[1]}"'
    month_end = at(following) - 1  # the month's last second: every day of it is shown

    by_endpoint = query(
        url, f'sum by (endpoint_id) (last_over_time({ENDPOINT}{{period="{period}"}}[{WINDOW}]))', month_end
    )
    assert {r["metric"]["endpoint_id"]: Decimal(r["value"][1]).quantize(CENT) for r in by_endpoint} == {
        e.endpoint_id: truth[e.endpoint_id] for e in sim.endpoints
    }
    item = f'inference_bill_item_daily_payable_amount{{period="{period}"}}'
    by_item = query(url, f"sum by (item) (last_over_time({item}[{WINDOW}]))", month_end)
    assert {r["metric"]["item"]: Decimal(r["value"][1]).quantize(CENT) for r in by_item} == {i: truth[i] for i in ITEMS}
    to_date = query(url, f'last_over_time({MONTH_TO_DATE}{{period="{period}",{target}}}[{WINDOW}])', month_end)
    assert [Decimal(r["value"][1]) for r in to_date] == [truth["total"]]

    day = first + dt.timedelta(days=9)  # one day's value at its end; no series before it began
    amounts = query(
        url, f'last_over_time({ENDPOINT}{{day="{day}",{target}}}[{WINDOW}])', at(day + dt.timedelta(days=1)) - 1
    )
    assert {r["metric"]["endpoint_id"]: Decimal(r["value"][1]) for r in amounts} == {
        e.endpoint_id: day_amount(sim, day, e.endpoint_id) for e in sim.endpoints
    }
    assert query(url, f'last_over_time({ENDPOINT}{{day="{day}"}}[{WINDOW}])', at(day) - 1) == []

    day = first + dt.timedelta(days=19)
    instant = at(day) + 12 * 3600 + 3599  # 59:59 after a bill sample, 4:59 after a calendar one
    panels = [(title, expr) for title, expr in panel_queries() if "inference_billing_today_info" in expr]
    assert len(panels) >= 4
    for title, expr in panels:
        answer = query(url, expr, instant)
        assert answer, f"{title}: {expr} on {day}"
        assert {r["metric"].get("period", period) for r in answer} == {period}, title
        assert all(first <= dt.date.fromisoformat(r["metric"].get("day", str(day))) <= day for r in answer), title
    month_to_date = query(url, f"last_over_time({MONTH_TO_DATE}[{WINDOW}]) and on(period) {TODAY}", instant)
    expected = sum((day_amount(sim, first + dt.timedelta(days=n)) for n in range(20)), Decimal(0))
    assert [Decimal(r["value"][1]) for r in month_to_date] == [expected]
    bars = query(
        url, f"sum by (day, endpoint_id) (last_over_time({ENDPOINT}[{WINDOW}]) and on(period) {TODAY})", instant
    )
    assert len(bars) == 20 * len(sim.endpoints)
    today = query(url, f"sum by (endpoint_id) (last_over_time({ENDPOINT}[{WINDOW}]) and on(day) {TODAY})", instant)
    assert {r["metric"]["endpoint_id"]: Decimal(r["value"][1]) for r in today} == {
        e.endpoint_id: day_amount(sim, day, e.endpoint_id) for e in sim.endpoints
    }


def check_edges(url: str, sim: Simulator, refused: str, last: str) -> None:
    """The refused month is absent (never zeros); the last month stays through the next one's
    grace days (3), then goes."""
    clock = Clock(SHANGHAI)
    at = lambda day: clock.day_start(day).timestamp()  # noqa: E731
    first = dt.date.fromisoformat(f"{refused}-01")
    bills = f'{{__name__=~"inference_bill_.+",period="{refused}"}}'
    assert query(url, f"last_over_time({bills}[{WINDOW}])", at(first) + 20 * 86400) == []
    start = dt.date.fromisoformat(f"{last}-01")
    following = (start + dt.timedelta(days=31)).replace(day=1)
    second_day = at(following) + 86400 + 43200
    shown = f'count(last_over_time({ENDPOINT}{{period="{last}"}}[{WINDOW}]))'
    hidden = at(following + dt.timedelta(days=3))
    written = min(at(clock.today()), time.time() - 3 * 3600)
    for instant in (second_day, hidden - 1):  # in the grace days, to their last second
        if instant < written:
            answer = query(url, shown, instant)
            assert [int(r["value"][1]) for r in answer] == [(following - start).days * len(sim.endpoints)]
    if hidden < written:
        assert query(url, shown, hidden) == []  # (at the very instant too: Prometheus 2 takes both ends of a window)
        assert query(url, shown, hidden + 1) == []
    assert query(url, shown, hidden + 43200) == []


@pytest.mark.integration  # promtool and Prometheus, twice
@pytest.mark.timeout(360)
def test_files_a_block_each_load_into_blocks_apart_that_answer_as_the_one_file(
    sim: Simulator, clock: Clock, tmp_path: Path, output: Path
) -> None:
    """`--output-dir`, as docs/backfill.md loads it: promtool makes one block of each file, no two
    overlapping, the blocks it makes of the one file, and Prometheus answers the dashboard's
    queries over them as over the one file, at the cuts and in the grace days too."""
    promtool, prometheus = require_binary("promtool"), require_binary("prometheus")
    sim.spend = SpendModel(start=dt.date(2026, 8, 1))
    periods = months("2026-09", "2026-10", "2026-11")
    whole = backfill(FakeBilling(sim), clock, periods, output, grace_days=3, history=False)
    split = backfill(FakeBilling(sim), clock, periods, tmp_path / "files", grace_days=3, history=False, directory=True)
    load = ["tsdb", "create-blocks-from", "openmetrics", "--max-block-duration=486h"]
    for name, files in (("whole", whole.files), ("split", split.files)):
        for path in files:
            created = subprocess.run(
                [promtool, *load, str(path), str(tmp_path / name)], capture_output=True, text=True, timeout=300
            )
            assert created.returncode == 0, created.stderr
    spans = {
        name: sorted(
            (meta["minTime"], meta["maxTime"])
            for meta in (json.loads(p.read_text()) for p in (tmp_path / name).glob("*/meta.json"))
        )
        for name in ("whole", "split")
    }
    assert len(spans["split"]) == len(split.files) >= 3
    assert all(earlier[1] <= later[0] for earlier, later in itertools.pairwise(spans["split"]))  # (never overlapping)
    assert spans["split"] == spans["whole"]  # (the blocks promtool makes of the one file)

    (tmp_path / "prometheus.yml").write_text("scrape_configs: []\n")
    panels = [expr for _, expr in panel_queries() if "inference_billing_today_info" in expr]
    cuts = block_cuts(int(whole.start.timestamp()), int(whole.end.timestamp()))
    instants = [
        clock.day_start(dt.date(2026, 10, day)).timestamp() + seconds
        for day in (1, 2, 3, 4, 15)
        for seconds in (0, 1800, 43200, 86399)
    ] + [cut + offset for cut in cuts for offset in (-1, 0, 1, 3599)]
    answers = {}
    for name in ("whole", "split"):
        port = free_port()
        command = [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / name}",
                   "--storage.tsdb.retention.time=10y", f"--web.listen-address=127.0.0.1:{port}"]  # fmt: skip
        with contextmanager(serve_binary)(command, port) as url:
            answers[name] = [
                sorted((str(sorted(r["metric"].items())), r["value"][1]) for r in query(url, expr, at))
                for expr in panels
                for at in instants
            ]
    assert sum(map(bool, answers["whole"])) > len(answers["whole"]) // 2  # (the queries find series)
    assert answers["split"] == answers["whole"]


def test_an_output_that_is_a_link_to_a_regular_file_is_written_through_the_link(tmp_path: Path) -> None:
    """The file the link points to is replaced; the link stays a link (it had been replaced by a file)."""
    target = tmp_path / "real.om"
    target.write_text("old\n")
    link = tmp_path / "link.om"
    link.symlink_to(target)
    with replacing(link) as out:
        out.write("new\n")
    assert link.is_symlink()
    assert target.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.om", "real.om"]


def test_a_file_replaced_keeps_its_permissions_and_a_read_only_one_is_left_as_it_is(tmp_path: Path) -> None:
    """An export made private (0600) stays private once written again; a new file is made as any
    file is (the umask's); one the user cannot write is refused, not replaced through its directory."""
    private = tmp_path / "private.om"
    private.write_text("old\n")
    private.chmod(0o600)
    with replacing(private) as out:
        out.write("new\n")
    assert (private.read_text(), stat.S_IMODE(private.stat().st_mode)) == ("new\n", 0o600)
    umask = os.umask(0o022)
    os.umask(umask)
    with replacing(tmp_path / "new.om") as out:
        out.write("new\n")
    assert stat.S_IMODE((tmp_path / "new.om").stat().st_mode) == 0o666 & ~umask
    if os.geteuid() != 0:  # (root writes whatever the bits say)
        private.chmod(0o444)
        with pytest.raises(PermissionError, match="read-only"), replacing(private) as out:
            out.write("newer\n")
        assert private.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.om", "private.om"]


def test_a_partial_left_or_planted_is_made_anew_never_written_through(tmp_path: Path) -> None:
    """A partial an earlier run left, or a link to another file put where the partial goes (as root,
    in a directory others write): the partial is made anew, the file the link names left as it is;
    the extended attributes of the file replaced (an ACL's entries among them) are kept."""
    output, partial, victim = tmp_path / "out.om", tmp_path / ".out.om.partial", tmp_path / "victim"
    victim.write_text("precious\n")
    victim.chmod(0o600)
    output.write_text("old\n")
    try:
        os.setxattr(output, "user.owner-team", b"finance")
        attributes = True
    except OSError:  # (a file system without them)
        attributes = False
    for planted in ("link", "leftover"):
        if planted == "link":
            partial.symlink_to(victim)
        else:
            partial.write_text("half of an earlier run\n")
        with replacing(output) as out:
            out.write(f"new {planted}\n")
        assert output.read_text() == f"new {planted}\n"
        assert (victim.read_text(), stat.S_IMODE(victim.stat().st_mode)) == ("precious\n", 0o600)
        assert not partial.is_symlink()
        assert not partial.exists()
        if attributes:
            assert os.getxattr(output, "user.owner-team") == b"finance"


class Refusing:
    """The simulator's bills, in process, but for the months given, which the API refuses."""

    def __init__(self, sim: Simulator, refused: set[str]) -> None:
        self.client, self.refused = FakeBilling(sim), refused

    def bills(self, period: str, group_term: str) -> list[BillRecord]:
        if period in self.refused:
            raise BillingAPIError(f"bills {period}: code 100500", status=200, code=100500, message="internal")
        return self.client.bills(period, group_term)


@pytest.mark.parametrize(
    ("longer", "shorter", "refused"),
    [("2026-09", "2026-10", "2026-09"), ("2026-09", "2026-11", "2026-10")],
    ids=["the first month refused", "a month in the history window refused"],
)
def test_a_month_s_forecasts_learn_from_the_months_before_it_whatever_was_asked_before(
    sim: Simulator, clock: Clock, frozen: FrozenClock, tmp_path: Path, longer: str, shorter: str, refused: str
) -> None:
    """From `longer` or from `shorter`, `shorter`'s forecasts past its grace days are the same: they
    learn from the `history_months` before it that the API gives, as the exporter held them (not
    from none when --from's own month was refused, nor from an older month in a refused one's place)."""
    sim.spend = SpendModel(start=dt.date(2026, 4, 1))
    frozen.set(dt.datetime(2026, 11, 20, 10, 0, tzinfo=SHANGHAI))
    client = Refusing(sim, {refused})
    outputs = {}
    for first in (longer, shorter):
        outputs[first] = tmp_path / f"from-{first}.om"
        backfill(client, clock, months(first, None, "2026-11"), outputs[first], grace_days=3, history=True)  # type: ignore[arg-type]
    days = [dt.date.fromisoformat(f"{shorter}-{d:02d}") for d in (5, 10, 15)]
    ends = {day: int(clock.day_start(day + dt.timedelta(days=1)).timestamp()) - STEP for day in days}
    forecasts = {}
    for first, path in outputs.items():
        samples, _ = scan(path, set(ends.values()))
        forecasts[first] = [
            {k: v for k, v in samples[ends[day]].items() if k[0].startswith("inference_bill_month_forecast")}
            for day in days
        ]
        assert all(forecasts[first]), first
    assert forecasts[longer] == forecasts[shorter]
