"""The alert rules' config: threshold, budget and anomaly rules, what each may name, and their ids
(what a rule watches plus its labels: the key its alerts are saved under, kept across reorderings)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from decimal import Decimal
from typing import Annotated, Any, Literal

from exporter.core.fields import Amount, Duration, Name, ScopeValue, Strict, scope_values
from exporter.core.typed import Discriminator, Field, Tag, field_validator, model_validator
from exporter.model.signals import SIGNALS

OPERATORS = (">", ">=", "<", "<=", "==", "!=")
MAX_TIER = 10
LABEL_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
"""A label's or an annotation's name, whole (`fullmatch`: `$` would let a trailing line break by)."""
RESERVED_LABELS = ("alertname", "alertstate")


ACCOUNT_LABEL = "account"
"""What every signal may name in `by` and `where` when the config lists `accounts`."""


class _Rule(Strict):
    alert: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    notifiers: tuple[Name, ...] | None = None
    """Where its alerts go; every notifier that takes alerts when unset."""

    @field_validator("notifiers")
    @classmethod
    def _some_notifiers(cls, notifiers: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if notifiers is not None and not notifiers:
            raise ValueError("an empty list sends the rule's alerts nowhere: leave `notifiers` out for every one")
        if notifiers is not None and len(set(notifiers)) != len(notifiers):
            raise ValueError("names a notifier twice")
        return notifiers

    def _check(self, fields: set[str]) -> None:
        """Label and annotation names, and annotation templates naming only `fields`."""
        for name in self.labels:
            if not re.fullmatch(LABEL_NAME, name) or name in RESERVED_LABELS:
                raise ValueError(f"label {name!r} is not a valid alert label name")
            if name.startswith("__"):  # (Prometheus would refuse the scrape that shows the alert)
                raise ValueError(f"label {name!r} starts with __, which Prometheus keeps for its own labels")
        for name, template in self.annotations.items():
            if not re.fullmatch(LABEL_NAME, name):
                raise ValueError(
                    f"annotation {name!r} is not a valid annotation name (letters, digits and _, not starting"
                    " with a digit): Alertmanager and Prometheus refuse it"
                )
            for field in re.findall(r"\{([^{}]*)\}", template):
                if field not in fields:
                    raise ValueError(f"annotation {name!r} names unknown field {{{field}}}")


class ThresholdRule(_Rule):
    """A signal per `by` group compared with a threshold (see `exporter.model.signals`)."""

    signal: str
    window: Literal["today", "month", "month_forecast"] = "today"
    by: tuple[Name, ...] = ()
    where: dict[str, ScopeValue] = Field(default_factory=dict)
    op: Literal[OPERATORS] = ">"  # type: ignore[valid-type]
    threshold: Amount
    for_: Duration = Field(0.0, alias="for")
    keep_firing_for: Duration = 0.0

    @field_validator("signal")
    @classmethod
    def _known_signal(cls, signal: str) -> str:
        names = [repr(name) for name in [*SIGNALS, ANOMALY_SIGNAL]]
        if signal not in SIGNALS:
            raise ValueError(f"must be one of {', '.join(names[:-1])} or {names[-1]}")
        return signal

    @model_validator(mode="after")
    def _shape(self) -> ThresholdRule:
        signal = SIGNALS[self.signal]
        if len(set(self.by)) < len(self.by):
            raise ValueError("`by` names a label twice")
        for name in (*self.by, *self.where):
            if name not in signal.labels and name != ACCOUNT_LABEL:
                raise ValueError(f"signal {self.signal!r} has no label {name!r} (it has {', '.join(signal.labels)})")
        if self.signal == "spend" and {"endpoint_id", "item"} <= {*self.by, *self.where}:
            raise ValueError("spend is billed by endpoint or by item, not both: use one of them")
        if self.signal == "spend" and {"project_id", "item"} <= {*self.by, *self.where}:
            raise ValueError("spend by project_id is read from the bills by endpoint, whose lines carry no item")
        if self.signal == "reconciliation_gap" and {"endpoint_id", "item"} <= {*self.by, *self.where}:
            raise ValueError("reconciliation_gap is by item (tokens) or by endpoint_id (amounts), not both")
        if self.window not in signal.windows:
            windows = ", ".join(signal.windows)
            raise ValueError(f"signal {self.signal!r} has no `{self.window}` window (it has {windows})")
        self._check({"value", "threshold", *self.by, *self.where})
        return self


class BudgetRule(_Rule):
    """A budget's tiers, each firing once per budget period."""

    budget: Name
    tiers: Annotated[tuple[float, ...], Field(min_length=1)]
    basis: Literal["actual", "forecast"] = "actual"
    """What a tier is a share of: what was spent, or what the month is forecast to end at (its
    `{crossing_day}` the day the forecast's pace crosses the amount)."""

    @field_validator("tiers")
    @classmethod
    def _tiers(cls, tiers: tuple[float, ...]) -> tuple[float, ...]:
        for tier in tiers:
            if not 0 < tier <= MAX_TIER:
                raise ValueError(f"tier {tier} is outside (0, {MAX_TIER}]")
        if list(tiers) != sorted(set(tiers)):
            raise ValueError("tiers must be increasing and distinct")
        return tiers

    @model_validator(mode="after")
    def _shape(self) -> BudgetRule:
        self._check({"value", "budget", "tier", "amount", "period", "basis", "crossing_day", "chance"})
        return self


ANOMALY_SIGNAL = "spend_anomaly"
ANOMALY_FIELDS = ("day", "actual", "expected", "impact", "impact_percent", "contributors", "value")
"""What an anomaly rule's annotations may name, besides its `by` labels."""


class AnomalyRule(_Rule):
    """A complete day's spend per `by` group judged against what its history makes expected
    (see `exporter.model.anomaly`): fires when the impact passes both floors."""

    signal: Literal["spend_anomaly"]
    by: tuple[Literal["endpoint_id", "item"], ...] = Field((), max_length=1)
    min_amount: Amount
    min_percent: Annotated[Decimal, Field(ge=0)]
    sensitivity: Annotated[Decimal, Field(gt=0, le=100)] = Decimal(3)

    @model_validator(mode="after")
    def _shape(self) -> AnomalyRule:
        self._check({*ANOMALY_FIELDS, *self.by})
        return self


def _rule_kind(rule: Any) -> str:
    if isinstance(rule, dict):
        if rule.get("signal") == ANOMALY_SIGNAL:
            return "anomaly-rule"
        return "budget-rule" if rule.get("budget") is not None and rule.get("signal") is None else "threshold-rule"
    if isinstance(rule, AnomalyRule):
        return "anomaly-rule"
    return "budget-rule" if isinstance(rule, BudgetRule) else "threshold-rule"


RuleConfig = Annotated[
    Annotated[ThresholdRule, Tag("threshold-rule")]
    | Annotated[BudgetRule, Tag("budget-rule")]
    | Annotated[AnomalyRule, Tag("anomaly-rule")],
    Discriminator(_rule_kind),
]
"""A rule is a threshold rule (`signal` with `threshold`), a budget rule (`budget`) or an
anomaly rule (`signal: spend_anomaly`): the keys it has say which."""


def _watched(rule: RuleConfig, as_written: bool) -> str:
    """What a rule watches, under its alert name, as the text its id is the hash of."""
    if isinstance(rule, BudgetRule):  # in the shape rules had before they had two types, so ids stay
        identity: list[object] = [rule.alert, None, "today", [], [], rule.budget]
        if rule.basis != "actual":  # (a rule on the forecast is another rule than one on what was spent)
            identity.append(rule.basis)
        return json.dumps(identity)
    by = list(rule.by) if as_written else sorted(rule.by)
    if isinstance(rule, AnomalyRule):
        identity = [rule.alert, rule.signal, "day", by, [], None]
    else:  # (a `where` list is held sorted: `_scope_value`)
        identity = [rule.alert, rule.signal, rule.window, by, sorted(rule.where.items()), None]
    return json.dumps(identity)


def _labelled(rule: RuleConfig) -> str:
    """A rule's labels as the text its key's second part is the hash of ("" without labels)."""
    return json.dumps([json.dumps(sorted(rule.labels.items()))]) if rule.labels else ""


def _sha256(text: str) -> str:
    import hashlib  # (here: `check` and `rules` compare rules by their texts, and start without it)

    return hashlib.sha256(text.encode()).hexdigest()


def rule_id(rule: RuleConfig, *, as_written: bool = False) -> str:
    """What a rule watches, under its alert name: the same across restarts and reloads while that
    stays (its threshold, tiers, `for` and annotations may change, and the order of its `by`).
    `as_written`: the id versions before gave it, with `by` in the config's order (read only to
    move the alerts they saved: `written_moves`)."""
    return _sha256(_watched(rule, as_written))[:16]


def rule_key(rule: RuleConfig, *, as_written: bool = False) -> str:
    """A rule's identity: `rule_id`, and its labels when it has some. Rules that watch the same
    thing under one alert name (warning and critical tiers) are told apart by their labels, as
    Alertmanager tells their alerts apart, never by their place in the list; so changing a rule's
    labels makes it another rule (its alerts resolve, the new ones fire), and two rules alike in
    that too are refused (`twin_rules`): their alerts could not be told apart."""
    base = rule_id(rule, as_written=as_written)
    if not rule.labels:
        return base  # the id every earlier version gave such a rule
    return f"{base}-{_sha256(_labelled(rule))[:8]}"  # (the shape ids have had since layout 1)


def _unhashed_key(rule: RuleConfig) -> tuple[str, str]:
    """What `rule_key` is made of: two rules have one key when they have one of these."""
    return _watched(rule, False), _labelled(rule)


def rule_ids(rules: Sequence[RuleConfig]) -> list[str]:
    """Each rule's id (`config.rules.rule_key`), whatever its position and whatever rules come before or
    after it."""
    return [rule_key(rule) for rule in rules]


def written_moves(rules: Sequence[RuleConfig], saved: Callable[[], AbstractSet[str]]) -> dict[str, str]:
    """The rule ids of `saved()` that versions before gave these rules (`rule_id(as_written=True)`:
    a `by` out of order), each with its rule's id now. `saved` is asked only when a rule has a `by`
    out of order (a read of every alert saved, at each start and reload)."""
    moves = {old: new for rule in rules if (old := rule_key(rule, as_written=True)) != (new := rule_key(rule))}
    if not moves:
        return {}
    held = saved()
    return {old: new for old, new in moves.items() if old in held}


def twin_rules(rules: Sequence[RuleConfig]) -> list[tuple[int, int]]:
    """(earlier, later) positions of rules that would make the same alerts."""
    first: dict[tuple[str, str], int] = {}
    twins = []
    for n, rule in enumerate(rules):
        key = _unhashed_key(rule)
        if key in first:
            twins.append((first[key], n))
        else:
            first[key] = n
    return twins


def label_twins(rules: Sequence[RuleConfig]) -> list[tuple[int, int]]:
    """(earlier, later) positions of threshold rules that watch different things yet whose alerts
    can have the same labels, every such pair: the same alert name, `labels` and `by` names (`where`,
    `signal` and `window` make no label), unless a `where` on a name of `by` keeps their groups
    apart. The engine tells such alerts apart by their rules; Alertmanager, by their labels only."""
    alike: dict[str, list[tuple[int, ThresholdRule]]] = {}
    for n, rule in enumerate(rules):
        if isinstance(rule, ThresholdRule):
            labels = json.dumps([rule.alert, sorted(rule.labels.items()), sorted(rule.by)])
            alike.setdefault(labels, []).append((n, rule))
    twins = []
    for found in alike.values():
        for at, (later, b) in enumerate(found):
            for earlier, a in found[:at]:
                apart = any(
                    name in a.where and name in b.where
                    and not set(scope_values(a.where[name])) & set(scope_values(b.where[name]))
                    for name in a.by
                )  # fmt: skip
                if not apart and _unhashed_key(a) != _unhashed_key(b):  # (the same key: `twin_rules`)
                    twins.append((earlier, later))
    return twins
