"""The documentation: its metrics reference is generated from the exposition itself and its config
reference checked against the config models, so neither can drift; the example digest is the
code's own; the site builds with every link and anchor checked, and the README's links resolve.

`UPDATE_DOCS=1 pytest tests/test_docs.py` rewrites the table and the example digest after a
deliberate change.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import sys
import typing
from decimal import Decimal
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter.core.clock import Clock, FrozenClock
from exporter.core.typed import Model
from exporter.notifiers.digest import text as digest_text
from exporter.sim import Simulator
from tests.test_exposition import full_exposition

SHANGHAI = ZoneInfo("Asia/Shanghai")
ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
METRICS_PAGE = ROOT / "docs" / "metrics.md"
CONFIG_PAGE = ROOT / "docs" / "configuration.md"
DIGEST_PAGE = ROOT / "docs" / "digest.md"
UPDATE = bool(os.environ.get("UPDATE_DOCS") or os.environ.get("UPDATE_README"))
START, END = "<!-- metrics-reference:start -->", "<!-- metrics-reference:end -->"
LABELS_FROM_RULES = {"inference_alerts": "alertname, alertstate, and the rule's `by` labels and `labels`"}
"""Families whose labels come from the config's rules: the sample exposition's would mislead."""


def reference(exposition: bytes) -> str:
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for family in text_string_to_metric_families(exposition.decode()):
        if family.name.endswith("_created"):
            continue  # counters' start times, written beside them
        name = f"{family.name}_total" if family.type == "counter" else family.name
        assert family.samples, f"{name} has no sample in the full exposition: its labels would go unlisted"
        labels = ", ".join(sorted({label for s in family.samples for label in s.labels} - {"le"}))
        labels = LABELS_FROM_RULES.get(name, labels)
        rows.append(f"| `{name}` | {family.type} | {labels} | {family.documentation} |")
    return "\n".join(rows)


def test_the_metrics_reference_lists_exactly_the_metrics_the_code_exposes(
    sim: Simulator, clock: Clock, frozen: FrozenClock
) -> None:
    table = reference(full_exposition(sim, clock, frozen))
    text = METRICS_PAGE.read_text()
    if UPDATE:
        text = re.sub(f"{START}.*{END}", f"{START}\n{table}\n{END}", text, flags=re.DOTALL)
        METRICS_PAGE.write_text(text)
    documented = text.split(START, 1)[1].split(END, 1)[0].strip()
    in_readme = set(re.findall(r"^\| `(\w+)`", documented, flags=re.MULTILINE))
    in_code = set(re.findall(r"^\| `(\w+)`", table, flags=re.MULTILINE))
    assert in_code - in_readme == set(), "metrics the code exposes but the reference does not list"
    assert in_readme - in_code == set(), "metrics the reference lists but the code does not expose"
    assert documented == table, "the metrics reference is stale: rerun with UPDATE_DOCS=1"


def _models_in(annotation: object) -> tuple[list[type[Model]], bool]:
    """The config models inside a field's type, and whether they come in a list."""
    if isinstance(annotation, type) and issubclass(annotation, Model):
        return [annotation], False
    models: list[type[Model]] = []
    listed = typing.get_origin(annotation) is tuple
    for arg in typing.get_args(annotation):
        inner, inner_listed = _models_in(arg)
        models += inner
        listed = listed or inner_listed
    return models, listed


ACCOUNT_SECTIONS = ("billing", "inference", "probes", "prices", "budgets")
"""An account's sections: the top-level ones', documented once there."""


def config_keys(model: type[Model], prefix: str = "") -> set[str]:
    """Every key path a config may hold, from the config models themselves (an account's sections
    as the key itself: their keys are the top-level sections')."""
    keys = set()
    for name, field in model.model_fields.items():
        key = f"{prefix}{field.alias or name}"
        models, listed = _models_in(field.annotation)
        if prefix == "accounts[]." and name in ACCOUNT_SECTIONS:
            keys.add(key)
            continue
        if not models:
            keys.add(key)
        for sub in models:
            keys |= config_keys(sub, f"{key}[]." if listed else f"{key}.")
    return keys


def test_the_config_reference_documents_every_config_key() -> None:
    from exporter.config.schema import Config

    text = CONFIG_PAGE.read_text()
    table = text.split("<!-- config-reference:start -->", 1)[1].split("<!-- config-reference:end -->", 1)[0]
    documented = set(re.findall(r"^\| `([\w.\[\]]+)`", table, flags=re.MULTILINE))
    in_code = config_keys(Config)
    assert in_code - documented == set(), "config keys the reference does not document"
    assert documented - in_code == set(), "keys the reference documents that the config does not have"


DIGEST_START, DIGEST_END = "<!-- example-digest:start -->", "<!-- example-digest:end -->"
JSON_START, JSON_END = "<!-- example-digest-json:start -->", "<!-- example-digest-json:end -->"


def example_digest() -> dict:
    """The demo's account at 09:00 on 2026-11-23: four months of history with yesterday's spike,
    settled days with one bill 5% off, and a day of probe runs (their timings fixed here, so the
    example does not change from run to run)."""
    from exporter.app.demo import DEMO_CONFIG, demo_history, demo_reconciled_days
    from exporter.app.sources import Sources
    from exporter.config.load import load
    from exporter.model.snapshots import Latest
    from exporter.sim import prices_from_config
    from exporter.state import StateStore

    frozen = FrozenClock(dt.datetime(2026, 11, 23, 9, 0, tzinfo=SHANGHAI))
    clock = Clock(SHANGHAI, frozen)
    sim = Simulator(clock=clock)
    sim.spend = demo_history(clock.today())
    settled = demo_reconciled_days(clock.today())
    for day in settled:
        sim.add_usage(2_000, day)
    # The newest of them is off by 5%, and settles (after 48 h here) just before this digest.
    sim.distort_bill(settled[0], Decimal("1.05"), item="ITEM_COMPLETION_TOKEN")
    server = sim.serve()
    try:
        environ = {
            "SIM_URL": server.url, "SIM_ACCESS_KEY_ID": sim.access_key_id, "SIM_API_KEY": sim.api_key,
            "SIM_SECRET_ACCESS_KEY": sim.secret_access_key, "STATE_DIR": "/tmp",
        }  # fmt: skip
        config = load(DEMO_CONFIG, environ)
        config = config.model_copy(
            update={"reconciliation": config.reconciliation.model_copy(update={"settle": 48 * 3600.0})}
        )
        sim.set_prices(prices_from_config(config.prices))
        latest = Latest()
        sources = Sources(config, latest, clock, StateStore(":memory:"))
        try:
            for name in ("bills", "history", "usage"):  # the two newest settled days
                sources.refreshers[name]()
                latest.record(name, success=True, at=frozen().timestamp(), duration=0.0)
            sources.engine.evaluate()
            yesterday = clock.day_start(clock.today() - dt.timedelta(days=1)).timestamp()
            for minute in range(0, 1440, 5):  # a run every 5 minutes; two failed, first tokens 300-540 ms
                ttft = 0.3 + (minute * 7 % 241) / 1000
                success = minute not in (605, 610)
                sources.state.record_probe_run("chat-stream", yesterday + minute * 60, success, ttft, keep_from=0)
            return sources.digest(clock.today(), "daily", "http://localhost:9877")
        finally:
            sources.close()
    finally:
        server.stop()


@pytest.mark.integration  # the simulator on loopback
def test_the_digest_page_shows_the_example_digest_as_the_code_writes_it() -> None:
    body = example_digest()
    plain = digest_text(body)
    abridged = {k: (v[:2] if isinstance(v, list) else v) for k, v in body.items()}
    example = "```json\n" + json.dumps(abridged, indent=1, ensure_ascii=False) + "\n```"
    text = DIGEST_PAGE.read_text()
    block = "```\n" + plain + "```"
    if UPDATE:
        text = re.sub(f"{DIGEST_START}.*{DIGEST_END}", f"{DIGEST_START}\n{block}\n{DIGEST_END}", text, flags=re.DOTALL)
        text = re.sub(f"{JSON_START}.*{JSON_END}", f"{JSON_START}\n{example}\n{JSON_END}", text, flags=re.DOTALL)
        DIGEST_PAGE.write_text(text)
    assert text.split(DIGEST_START, 1)[1].split(DIGEST_END, 1)[0].strip() == block, "rerun with UPDATE_DOCS=1"
    assert text.split(JSON_START, 1)[1].split(JSON_END, 1)[0].strip() == example, "rerun with UPDATE_DOCS=1"
    # What the example must show, whatever its figures: the spike, the 5% gap, the probes.
    assert "Spend anomalies" in plain
    assert "ep-20261101-beta" in plain.split("Spend anomalies", 1)[1]
    assert "ITEM_COMPLETION_TOKEN: billed" in plain
    assert "chat-stream: 99% of 288 runs succeeded" in plain


@pytest.mark.integration  # mkdocs as a process
@pytest.mark.timeout(300)
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """Every page in the navigation, every link and anchor found (mkdocs.yml: strict, validation)."""
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=240, env=os.environ | {"NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-4000:]
    assert (tmp_path / "site" / "metrics.html").is_file()  # (pages as files: the site works opened from disk)


def test_every_link_of_the_readme_resolves() -> None:
    """The README is read on its own (on the repository's page): its links to files in the
    repository, the docs pages among them, must name files that are there, and their anchors
    headings that are."""
    text = README.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [link for link in links if "://" not in link]
    assert len(local) > 10
    for link in local:
        path, _, anchor = link.partition("#")
        target = ROOT / path if path else README
        assert target.exists(), link
        if anchor:
            headings = re.findall(r"(?m)^#+ (.+)$", target.read_text())
            slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
            assert anchor in slugs, link


def test_every_yaml_block_of_the_docs_is_yaml() -> None:
    """A reader copies them: a `${VAR}` left unquoted inside `{ }` is no YAML at all."""
    import yaml

    blocks = 0
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for found in re.finditer(r"```ya?ml\n(.*?)```", page.read_text(), re.S):
            blocks += 1
            try:
                yaml.safe_load(found.group(1))
            except yaml.YAMLError as error:
                pytest.fail(f"{page.name}: a YAML block is no YAML: {error}")
    assert blocks > 10


def test_every_config_block_of_the_docs_is_a_config_check_accepts() -> None:
    """A block of the config's own keys, put in a config with the billing API's address and keys and
    the notifiers the blocks name (what a reader's config has already), is valid as it is written:
    a reader copies it. So is a list of rules, as `alerts.rules` beside the budget they name. Its
    `${VARIABLES}` set."""
    import yaml

    from exporter.config.load import REFERENCE, validate
    from exporter.config.schema import Config

    keys = {field.alias or name for name, field in Config.model_fields.items()}
    base = {
        "billing": {"url": "https://openapi.example.com", "access_key_id": "ak", "secret_access_key": "sk"},
        "alerts": {"notifiers": [
            {"name": "chat", "type": "slack", "url": "https://hooks.slack.com/services/T/B/x"},
            {"name": "mail", "type": "email", "smtp": "smtp.example.com:587", "from": "a@example.com",
             "to": ["b@example.com"]},
        ]},
    }  # fmt: skip
    checked = rule_lists = 0
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for found in re.finditer(r"```ya?ml\n(.*?)```", page.read_text(), re.S):
            block = yaml.safe_load(found.group(1))
            environ = {name: "placeholder" for _, name in REFERENCE.findall(found.group(1)) if name}
            if isinstance(block, list) and block and all(isinstance(r, dict) and "alert" in r for r in block):
                budget = {"name": "monthly", "period": "month", "amount": "1000"}
                validate(_merged(base, {"budgets": [budget], "alerts": {"rules": block}}), environ)
                rule_lists += 1
                continue
            if not isinstance(block, dict) or not set(block) <= keys:
                continue  # (a Prometheus, Kubernetes or web config)
            document = block if "accounts" in block else _merged(base, block)
            validate(document, environ)  # (raises, naming what it refuses)
            checked += 1
    assert checked >= 3
    assert rule_lists >= 4


def _merged(base: dict, block: dict) -> dict:
    merged = dict(base)
    for key, value in block.items():
        merged[key] = (
            _merged(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
        )
    return merged
