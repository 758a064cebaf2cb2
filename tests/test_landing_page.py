"""The landing page in a real browser (headless Chromium): the month's chart, sources, budgets, probes, firing
alerts; and bounded at any number of endpoints, its tables cut to the rows that matter most, with links to the rest."""

from __future__ import annotations

import datetime as dt
import html
import json
import os
import re
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import requests

from exporter.alerts.alert import Alert, State
from exporter.app.daemon import Daemon
from exporter.config.load import validate
from exporter.core.clock import Clock
from exporter.model.snapshots import (
    AmountGap,
    Histogram,
    Latest,
    ProbeRun,
    ProbeSnapshot,
    Reconciliation,
    TokenGap,
)
from exporter.sim import Simulator, SimulatorServer
from exporter.web import ExporterServer, View, landing_page
from exporter.web.page import ROWS
from exporter.web.views import AccountView
from tests.conftest import billing_section, require_binary
from tests.helpers import named, scrape, value
from tests.test_chart import parse_chart
from tests.test_server import BILLING

SCREENSHOT_DIR = Path(os.environ.get("SCREENSHOT_DIR", Path(__file__).parent.parent / "test-output"))


def keep(shot: Path) -> Path:
    """A copy of a screenshot in SCREENSHOT_DIR, replaced at once: runs at the same time (pytest-xdist
    workers, another run) never see one half written."""
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    kept, partial = SCREENSHOT_DIR / shot.name, SCREENSHOT_DIR / f".{shot.name}.{os.getpid()}"
    partial.write_bytes(shot.read_bytes())
    partial.replace(kept)
    return kept


def chromium(*args: str, profile: Path) -> subprocess.CompletedProcess[str]:
    binary = require_binary("chromium")
    flags = [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}",
    ]  # fmt: skip
    return subprocess.run([binary, *flags, *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def daemon(sim: Simulator, server: SimulatorServer, clock: Clock, tmp_path: Path) -> Daemon:
    document = {
        "billing": billing_section(sim, server),
        "inference": {"url": server.url, "api_key": sim.api_key},
        "probes": [{"name": "chat-stream", "model": sim.endpoints[0].endpoint_id}],
        "budgets": [
            {"name": "monthly", "amount": "9000"},
            {"name": "daily", "amount": "500", "period": "day"},
            {"name": "alpha-team", "amount": "3500", "where": {"endpoint_id": sim.endpoints[0].endpoint_id}},
        ],
        "alerts": {
            "rules": [
                {"alert": "MonthlyBudget", "budget": "monthly", "tiers": [0.5, 0.9], "labels": {"severity": "critical"}}
            ]
        },
        "state": {"path": str(tmp_path / "state.db")},
    }
    daemon = Daemon(validate(document, {}), clock=clock, listen="127.0.0.1:0")
    daemon.start(schedule=False)
    for source in ("bills", "usage", "probe:chat-stream"):
        assert daemon.refresh(source)
    yield daemon
    daemon.stop()


def test_landing_page_renders_in_chromium(daemon: Daemon, tmp_path: Path) -> None:
    url = f"{daemon.server.url}/"
    dom = chromium("--dump-dom", url, profile=tmp_path / "profile-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    page = dom.stdout
    expected = (
        "<h2>Sources</h2>",
        '<td>bills</td><td class="ok">ok</td><td>0s ago</td>',
        "<td>monthly</td>",
        "<td>chat-stream</td>",
        '<td class="bad">MonthlyBudget</td>',
        "budget=monthly, severity=critical, tier=0.9",
    )
    for text in expected:
        assert text in page, text
    shot = tmp_path / "landing-page.png"
    result = chromium(f"--screenshot={shot}", "--window-size=1200,1500", url, profile=tmp_path / "profile-shot")
    assert result.returncode == 0, result.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"landing page screenshot: {keep(shot)}")


MEASURE = """<script>
const chart = document.querySelector("svg.month-chart");
const box = chart.getBoundingClientRect();
const place = (e) => { const b = e.getBoundingClientRect(); return {top: b.top - box.top, bottom: b.bottom - box.top,
  left: b.left - box.left, width: b.width, height: b.height}; };
const rects = [...chart.querySelectorAll("rect.bar, rect.forecast")].map((r) => ({kind: r.getAttribute("class"),
  day: r.dataset.day, endpoint: r.dataset.endpoint ?? null, amount: r.dataset.amount, ...place(r)}));
const lines = [...chart.querySelectorAll("g.budget")].map((g) => ({budget: g.dataset.budget,
  ...place(g.querySelector("line"))}));
const out = document.createElement("pre");
out.id = "measured";
out.textContent = JSON.stringify({width: box.width, height: box.height, rects, lines});
document.body.append(out);
</script>"""
"""Measures the chart as laid out: each bar's and budget line's box, relative to the chart's (CSS pixels)."""


@pytest.mark.integration
def test_month_chart_in_chromium_matches_the_bills(daemon: Daemon, tmp_path: Path) -> None:
    """The chart Chromium lays out shows the bills /metrics serves: one segment per (day, endpoint) of the
    month, with its amount to the cent and a height of amount × the chart's scale; the forecast bars
    sharing what the forecast adds after today; the monthly budget's line at its daily pace."""
    url = f"{daemon.server.url}/"
    series = scrape(daemon.server.url)
    billed: dict[tuple[str, str], Decimal] = {}
    for labels, amount in named(series, "inference_bill_endpoint_daily_payable_amount").items():
        label = dict(labels)
        if label["period"] == "2026-11":
            key = (label["day"], label["endpoint_id"])
            billed[key] = billed.get(key, Decimal(0)) + Decimal(repr(amount))
    assert len(billed) == 22 * 3  # 1-22 November, three endpoints
    month_to_date = value(series, "inference_bill_month_to_date_payable_amount", period="2026-11")
    month_end = value(series, "inference_bill_month_forecast_payable_amount", period="2026-11")
    assert month_to_date is not None
    assert month_end is not None

    # The DOM Chromium built from the page.
    dom = chromium("--dump-dom", url, profile=tmp_path / "profile-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    chart = parse_chart(dom.stdout)
    shown = chart.amounts()
    assert shown.keys() == billed.keys()
    for key, amount in billed.items():
        assert abs(shown[key] - amount) < Decimal("0.005"), key
    assert [f.attrs["data-day"] for f in chart.forecasts] == [f"2026-11-{d}" for d in range(23, 31)]
    # The days after today share what the forecast adds beyond the month so far and the rest of today.
    rest = sum(float(r.attrs["data-amount"]) for r in chart.find("rect", "rest-of-today"))
    rate = (month_end - month_to_date - rest) / len(chart.forecasts)
    for bar in chart.forecasts:
        assert float(bar.attrs["data-amount"]) == pytest.approx(rate, abs=0.006)
    assert [g.attrs["data-budget"] for g in chart.find("g", "budget")] == ["monthly"]  # not the daily one

    # The chart as laid out: its boxes against the amounts, on the chart's one scale.
    # The page as served, plus the script that measures it (the page itself has none).
    served = requests.get(url, timeout=10)
    served.raise_for_status()
    page = served.text.replace("</body>", MEASURE + "</body>")
    harness = tmp_path / "measure.html"
    harness.write_text(page, encoding="utf-8")
    measured = chromium("--dump-dom", "--window-size=1200,900", harness.as_uri(), profile=tmp_path / "profile-measure")
    assert measured.returncode == 0, measured.stderr[-2000:]
    start = measured.stdout.index('<pre id="measured">') + len('<pre id="measured">')
    layout = json.loads(html.unescape(measured.stdout[start : measured.stdout.index("</pre>", start)]))
    svg = chart.svg
    zoom = layout["width"] / svg.number("width")
    assert zoom == pytest.approx(1)  # the window is wide enough for the chart at its own size
    assert layout["height"] == pytest.approx(svg.number("height") * zoom, abs=0.5)
    scale, baseline = chart.scale * zoom, chart.baseline * zoom
    assert len(layout["rects"]) == len(chart.bars) + len(chart.forecasts) == 22 * 3 + 8
    bottoms: dict[str, float] = {}
    for rect in layout["rects"]:
        amount = float(billed[rect["day"], rect["endpoint"]]) if rect["kind"] == "bar" else rate
        assert rect["height"] == pytest.approx(amount * scale, abs=0.05), rect
        if rect["kind"] == "bar":
            # Stacked: each segment sits on the one below it, the lowest on the baseline.
            assert rect["bottom"] == pytest.approx(bottoms.get(rect["day"], baseline), abs=0.05), rect
            bottoms[rect["day"]] = rect["top"]
        else:
            assert rect["bottom"] == pytest.approx(baseline, abs=0.05), rect
    for day, top in bottoms.items():
        total = sum(float(v) for (d, _), v in billed.items() if d == day)
        assert baseline - top == pytest.approx(total * scale, abs=0.1), day
    (line,) = layout["lines"]
    assert line["budget"] == "monthly"
    assert line["top"] == pytest.approx(baseline - 9000 / 30 * scale, abs=0.05)

    # A picture of the chart: it is at the top of the page.
    shot = tmp_path / "chart.png"
    result = chromium(
        f"--screenshot={shot}", "--window-size=1200,570", "--hide-scrollbars", url, profile=tmp_path / "profile-shot"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"chart screenshot: {keep(shot)}")


# -- bounded at any number of endpoints: the tables that grow show the rows that matter most, and say where the rest are

NOW = dt.datetime(2026, 11, 23, 9, tzinfo=dt.UTC).timestamp()
DAYS = (dt.date(2026, 11, 20), dt.date(2026, 11, 21))
MORE = re.compile(r'<p>and ([\d,]+) more: see <a href="([^"]+)">')
GAP_ROW = re.compile(r"<tr><td>([\d-]+)</td><td>([^<]+)</td><td>(?:tokens|amount)</td>")
ALERT_ROW = re.compile(r"<tr><td class=bad>[^<]+</td><td>endpoint_id=([^,<]+)")
PROBE_ROW = re.compile(r"<tr><td>([^<]+)</td><td>ep-")


def reconciliation(endpoints: int) -> Reconciliation:
    """Two settled days of `endpoints` endpoints whose bills all disagree: ep-00000 billed with nothing
    counted, the others off by 2% to 15% (each size on two endpoints a day, over and under, from ep-00001)
    or by 1%; and a token figure that agrees each day, which is not news."""
    amounts = []
    for day in DAYS:
        for n in range(endpoints):
            ratio = None if n == 0 else Decimal(n % 15 + 1) / 100 * (-1 if n % 2 else 1)
            amounts.append(AmountGap(day, f"ep-{n:05d}", Decimal("2.00"), Decimal("1.90"), ratio))
    tokens = tuple(TokenGap(day, "ITEM_PROMPT_TOKEN", Decimal(1000), 1000, Decimal(0)) for day in DAYS)
    return Reconciliation(tokens, tuple(amounts))


def firing(endpoints: int) -> list[Alert]:
    """One alert firing per endpoint, fired (n × 7 mod count) + 1 minutes ago, so that the most recent are
    spread over the list; and one pending alert, which is not firing."""

    def alert(endpoint: str, state: State, fired_at: float | None = None) -> Alert:
        labels = {"alertname": "EndpointSpend", "endpoint_id": endpoint}
        return Alert(f"EndpointSpend/{endpoint}", "EndpointSpend", labels, {"summary": "over"}, state, NOW - 7200, "2",
                     NOW, fired_at=fired_at)  # fmt: skip

    alerts = [alert(f"ep-{n:05d}", "firing", NOW - 60 * (n * 7 % endpoints + 1)) for n in range(endpoints)]
    return [*alerts, alert("ep-x", "pending")]


def probes(count: int, failing: Sequence[int]) -> dict[str, ProbeSnapshot]:
    def run(n: int) -> ProbeRun:
        return ProbeRun(False, "timeout", {}, 30.0) if n in failing else ProbeRun(True, None, {}, 0.4)

    histogram = Histogram((1.0,), (1,))
    return {
        f"probe-{n:03d}": ProbeSnapshot(
            f"probe-{n:03d}", f"ep-{n:05d}", "chat", run(n), 1, {}, {}, histogram, histogram
        )
        for n in range(count)
    }


def snapshot(endpoints: int, probe_count: int = 0, failing: Sequence[int] = ()) -> Latest:
    latest = Latest()
    latest.reconciliation = reconciliation(endpoints)
    latest.probes = probes(probe_count, failing)
    return latest


def view_of(latest: Latest, alerts: Sequence[Alert] = (), accounts: Sequence[AccountView] | None = None) -> View:
    return View(
        latest, lambda accept: (b"", ""), lambda: ["bills"], alerts=lambda: alerts, now=lambda: NOW,
        accounts=None if accounts is None else lambda: accounts,
    )  # fmt: skip


def section(page: str, heading: str) -> str:
    """What the page shows under `<h2>heading</h2>`, up to the next heading."""
    return page.split(f"<h2>{heading}</h2>", 1)[1].split("<h2>", 1)[0]


def test_past_rows_firing_alerts_the_page_shows_the_latest_fired_and_links_to_the_rest() -> None:
    alerts = firing(ROWS + 5)
    part = section(landing_page(view_of(Latest(), alerts)), "Firing alerts")
    latest = sorted((a for a in alerts if a.state == "firing"), key=lambda a: -(a.fired_at or 0))[:ROWS]
    assert ALERT_ROW.findall(part) == [a.labels["endpoint_id"] for a in alerts if a in latest]  # in the list's order
    assert MORE.findall(part) == [("5", "/api/v1/alerts")]


def test_a_gap_of_no_endpoint_is_named_so() -> None:
    latest = snapshot(1)
    assert latest.reconciliation is not None
    fee = AmountGap(DAYS[0], "", Decimal("3.00"), Decimal(0), None)  # (billed, of a fee: nothing counted)
    latest.reconciliation = replace(latest.reconciliation, amounts=(fee,))
    part = section(landing_page(view_of(latest)), "Bill against usage")
    assert f"<td>{DAYS[0]}</td><td>(no endpoint)</td><td>amount</td>" in part


def test_past_rows_disagreeing_figures_the_page_shows_the_largest_gaps_newest_day_first() -> None:
    latest = snapshot(30)
    part = section(landing_page(view_of(latest)), "Bill against usage")
    shown = GAP_ROW.findall(part)
    assert len(shown) == ROWS
    assert latest.reconciliation is not None
    gaps = {(str(a.day), a.endpoint_id): a.ratio for a in latest.reconciliation.amounts}
    # Nothing counted (2), then 15% down to 12% (4 each), then of the four at 11% the two on the newer day.
    expected = [
        key for key, ratio in gaps.items()
        if ratio is None or abs(ratio) >= Decimal("0.12") or (abs(ratio) == Decimal("0.11") and key[0] == str(DAYS[1]))
    ]  # fmt: skip
    assert shown == expected  # in the reconciliation's order
    assert f"<p>{len(gaps)} figures of 2 settled days disagree" in part  # every one counted
    assert MORE.findall(part) == [(str(len(gaps) - ROWS), "/api/v1/reconciliation")]


def test_past_rows_probes_the_page_shows_the_failing_ones_first() -> None:
    failing = (5, 17, ROWS + 2)
    latest = snapshot(0, probe_count=ROWS + 4, failing=failing)
    part = section(landing_page(view_of(latest)), "Probes")
    names = sorted(latest.probes)
    ok = [name for n, name in enumerate(names) if n not in failing]
    kept = {names[n] for n in failing} | set(ok[: ROWS - len(failing)])
    assert PROBE_ROW.findall(part) == [name for name in names if name in kept]
    assert MORE.findall(part) == [("4", "/metrics")]


def test_up_to_rows_each_table_shows_every_row_in_its_order_and_no_more_line() -> None:
    latest = snapshot(ROWS // 2, probe_count=ROWS, failing=(3,))  # two days: ROWS figures
    alerts = firing(ROWS)
    page = landing_page(view_of(latest, alerts))
    assert latest.reconciliation is not None
    figures = [(str(a.day), a.endpoint_id) for a in latest.reconciliation.amounts]
    assert GAP_ROW.findall(section(page, "Bill against usage")) == figures
    assert ALERT_ROW.findall(section(page, "Firing alerts")) == [a.labels["endpoint_id"] for a in alerts[:-1]]
    assert PROBE_ROW.findall(section(page, "Probes")) == sorted(latest.probes)
    assert " more: see " not in page


def test_the_page_stays_the_same_size_at_ten_times_the_endpoints() -> None:
    def size(endpoints: int) -> int:
        return len(landing_page(view_of(snapshot(endpoints, endpoints, range(0, endpoints, 3)), firing(endpoints))))

    small, large = size(200), size(2000)
    assert abs(large - small) < 100  # a few digits of the counts


def test_with_several_accounts_each_accounts_figures_are_cut_and_the_probes_of_all_of_them() -> None:
    accounts = [AccountView(name, snapshot(30, ROWS, failing=(2,)), (), ()) for name in ("prod", "lab")]
    page = landing_page(view_of(Latest(), accounts=accounts))
    for name in ("prod", "lab"):
        part = page.split(f"<h3>{name}</h3>", 1)[1].split("<h3>", 1)[0]
        assert len(GAP_ROW.findall(part)) == ROWS
        assert MORE.findall(part) == [(str(60 - ROWS), "/api/v1/reconciliation")]
    probe_rows = re.findall(r"<tr><td>(probe-\d+)</td><td>(\w+)</td>", section(page, "Probes"))
    assert len(probe_rows) == ROWS
    assert {("probe-002", "prod"), ("probe-002", "lab")} <= set(probe_rows)  # the failing ones of both
    assert MORE.findall(section(page, "Probes")) == [(str(ROWS), "/metrics")]


@contextmanager
def serving(view: View) -> Iterator[str]:
    """An exporter's HTTP server on loopback showing `view`; its URL."""
    server = ExporterServer(("127.0.0.1", 0), view, validate({"billing": BILLING}, {}).server)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def followed(url: str, part: str) -> tuple[int, dict[str, Any]]:
    """The count of the "more" line under `part` of the page at `url`, and the JSON its link answers."""
    page = requests.get(f"{url}/", timeout=10)
    page.raise_for_status()
    [(count, href)] = MORE.findall(section(page.text, part))
    linked = requests.get(f"{url}{href}", timeout=10)
    linked.raise_for_status()
    assert linked.headers["Content-Type"] == "application/json"
    return int(count.replace(",", "")), linked.json()


@pytest.mark.integration  # a real server
def test_the_more_lines_link_to_every_alert_and_every_disagreeing_figure() -> None:
    latest, alerts = snapshot(30), firing(ROWS + 5)
    with serving(view_of(latest, alerts)) as url:
        more, listed = followed(url, "Bill against usage")
        assert latest.reconciliation is not None
        figures = latest.reconciliation.amounts
        assert more == len(figures) - ROWS
        found = listed["data"]["disagreements"]
        assert [(f["day"], f["endpoint_id"]) for f in found] == [(str(a.day), a.endpoint_id) for a in figures]
        assert found[0] == {"day": "2026-11-20", "endpoint_id": "ep-00000", "billed": "2.00", "estimated": "1.90",
                            "gap_percent": None, "what": "amount"}  # fmt: skip
        assert [f["gap_percent"] for f in found] == [None if a.ratio is None else float(a.ratio * 100) for a in figures]
        more, listed = followed(url, "Firing alerts")
        assert more == 5
        assert sum(a["state"] == "firing" for a in listed["data"]["alerts"]) == ROWS + 5


@pytest.mark.integration  # a real server
def test_with_several_accounts_the_reconciliation_api_names_each_figures_account() -> None:
    accounts = [AccountView(name, snapshot(15), (), ()) for name in ("prod", "lab")]
    with serving(view_of(Latest(), accounts=accounts)) as url:
        answer = requests.get(f"{url}/api/v1/reconciliation", timeout=10)
    answer.raise_for_status()
    found = answer.json()["data"]["disagreements"]
    assert [(f["account"], f["day"], f["endpoint_id"]) for f in found] == [
        (account.name, str(a.day), a.endpoint_id)
        for account in accounts
        if account.latest.reconciliation is not None
        for a in account.latest.reconciliation.amounts
    ]
