"""The landing page in a real browser (headless Chromium): the month's chart, sources, budgets, probes, firing
alerts."""

from __future__ import annotations

import html
import json
import os
import subprocess
from decimal import Decimal
from pathlib import Path

import pytest
import requests

from exporter.app.daemon import Daemon
from exporter.config.load import validate
from exporter.core.clock import Clock
from exporter.sim import Simulator, SimulatorServer
from tests.conftest import billing_section, require_binary
from tests.helpers import named, scrape, value
from tests.test_chart import parse_chart

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
    month, with its amount to the cent and a height of amount × the chart's scale; the forecast bars at
    the trailing week's average; the monthly budget's line at its daily pace."""
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
    # The days after today at the trailing week's average, which the forecast projects with.
    rate = float(sum(v for (d, _), v in billed.items() if "2026-11-15" <= d <= "2026-11-21")) / 7

    # The DOM Chromium built from the page.
    dom = chromium("--dump-dom", url, profile=tmp_path / "profile-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    chart = parse_chart(dom.stdout)
    shown = chart.amounts()
    assert shown.keys() == billed.keys()
    for key, amount in billed.items():
        assert abs(shown[key] - amount) < Decimal("0.005"), key
    assert [f.attrs["data-day"] for f in chart.forecasts] == [f"2026-11-{d}" for d in range(23, 31)]
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
