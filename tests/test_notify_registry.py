"""The notifier registry and the config schema name the same kinds."""

from __future__ import annotations

from typing import get_args

from exporter.config.schema import NotifierConfig
from exporter.notifiers.registry import KINDS


def test_every_notifier_model_has_a_kind_and_every_kind_a_model() -> None:
    types = {get_args(model.model_fields["type"].annotation)[0] for model in get_args(NotifierConfig)}
    assert types == set(KINDS)
