"""The documentation's pictures are the demo's: `inference-cost-exporter demo` as a user runs it, its
landing page and the month's chart on it taken by the real Chromium. They go to SCREENSHOT_DIR
(test-output/); `UPDATE_DOCS=1` also puts them in docs/, where the README and the site show them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from tests.helpers import free_port, wait_for
from tests.test_landing_page import chromium, keep

DOCS = Path(__file__).parent.parent / "docs"


@pytest.mark.integration  # the demo as a process, and Chromium
@pytest.mark.timeout(300)
def test_the_docs_pictures_are_the_demos_landing_page_and_chart(tmp_path: Path) -> None:
    port = free_port()
    demo = subprocess.Popen(
        [sys.executable, "-m", "exporter.cli", "demo", "--listen", f"127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:

        def settled() -> str | None:
            """The page once every source has refreshed and the anomaly the demo stages fires."""
            try:
                if requests.get(f"{url}/readyz", timeout=5).status_code != 200:
                    return None
                page = requests.get(f"{url}/", timeout=10).text
            except requests.ConnectionError:
                return None
            return page if "SpendAnomaly" in page else None

        page = wait_for(settled, timeout=180, interval=1.0)
        assert "never" not in page.split("<h2>Sources</h2>", 1)[1].split("</table>", 1)[0]
        shots = {"landing-page.png": url + "/"}
        chart = re.search(r"<svg class=\"month-chart\".*?</svg>", page, flags=re.DOTALL)
        assert chart is not None
        style = re.search(r"<style>.*?</style>", page, flags=re.DOTALL)
        alone = tmp_path / "chart.html"
        alone.write_text(f"<!doctype html><meta charset=utf-8>{style.group(0) if style else ''}{chart.group(0)}")
        shots["chart.png"] = alone.as_uri()
        for name, address in shots.items():
            shot = tmp_path / name
            size = "--window-size=1200,1500" if name == "landing-page.png" else "--window-size=1000,460"
            taken = chromium(f"--screenshot={shot}", size, address, profile=tmp_path / f"profile-{name}")
            assert taken.returncode == 0, taken.stderr[-2000:]
            assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            kept = keep(shot)
            if os.environ.get("UPDATE_DOCS"):
                shutil.copy(kept, DOCS / name)
    finally:
        demo.terminate()
        demo.wait(timeout=30)
