"""The README's metrics reference is generated from the exposition itself, so it cannot drift.

`UPDATE_README=1 pytest tests/test_docs.py` rewrites the table after a deliberate change.
"""

from __future__ import annotations

import os
import re
import typing
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

from exporter.clock import Clock, FrozenClock
from exporter.sim import Simulator, SimulatorServer
from tests.test_exposition import full_exposition

README = Path(__file__).parent.parent / "README.md"
START, END = "<!-- metrics-reference:start -->", "<!-- metrics-reference:end -->"
LABELS_FROM_RULES = {"inference_alerts": "alertname, alertstate, and the rule's `by` labels and `labels`"}
"""Families whose labels come from the config's rules: the sample exposition's would mislead."""


def reference(exposition: bytes) -> str:
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for family in text_string_to_metric_families(exposition.decode()):
        if family.name.endswith("_created"):
            continue  # counters' start times, written beside them
        name = f"{family.name}_total" if family.type == "counter" else family.name
        labels = ", ".join(sorted({label for s in family.samples for label in s.labels} - {"le"}))
        labels = LABELS_FROM_RULES.get(name, labels)
        rows.append(f"| `{name}` | {family.type} | {labels} | {family.documentation} |")
    return "\n".join(rows)


def test_readme_lists_exactly_the_metrics_the_code_exposes(
    sim: Simulator, server: SimulatorServer, clock: Clock, frozen: FrozenClock
) -> None:
    table = reference(full_exposition(sim, server, clock, frozen))
    text = README.read_text()
    if os.environ.get("UPDATE_README"):
        text = re.sub(f"{START}.*{END}", f"{START}\n{table}\n{END}", text, flags=re.DOTALL)
        README.write_text(text)
    documented = text.split(START, 1)[1].split(END, 1)[0].strip()
    in_readme = set(re.findall(r"^\| `(\w+)`", documented, flags=re.MULTILINE))
    in_code = set(re.findall(r"^\| `(\w+)`", table, flags=re.MULTILINE))
    assert in_code - in_readme == set(), "metrics the code exposes but the README does not list"
    assert in_readme - in_code == set(), "metrics the README lists but the code does not expose"
    assert documented == table, "the README's metrics reference is stale: rerun with UPDATE_README=1"


def _models_in(annotation: object) -> tuple[list[type[BaseModel]], bool]:
    """The config models inside a field's type, and whether they come in a list."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation], False
    models: list[type[BaseModel]] = []
    listed = typing.get_origin(annotation) is tuple
    for arg in typing.get_args(annotation):
        inner, inner_listed = _models_in(arg)
        models += inner
        listed = listed or inner_listed
    return models, listed


def config_keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every key path a config may hold, from the config models themselves."""
    keys = set()
    for name, field in model.model_fields.items():
        key = f"{prefix}{field.alias or name}"
        models, listed = _models_in(field.annotation)
        if not models:
            keys.add(key)
        for sub in models:
            keys |= config_keys(sub, f"{key}[]." if listed else f"{key}.")
    return keys


def test_readme_documents_every_config_key() -> None:
    from exporter.schema import Config

    text = README.read_text()
    table = text.split("<!-- config-reference:start -->", 1)[1].split("<!-- config-reference:end -->", 1)[0]
    documented = set(re.findall(r"^\| `([\w.\[\]]+)`", table, flags=re.MULTILINE))
    in_code = config_keys(Config)
    assert in_code - documented == set(), "config keys the README does not document"
    assert documented - in_code == set(), "keys the README documents that the config does not have"
