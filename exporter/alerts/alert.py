"""An alert and its identity: its state, labels and incident, its key (its labels under its rule's
id, `config.rules.rule_key`), the ids earlier versions gave rules (moved once on upgrade), and how
its figures and annotations read."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Sequence
from decimal import Decimal
from typing import Literal

import msgspec

from exporter.config.rules import RuleConfig, rule_id, rule_ids
from exporter.model import signals
from exporter.model.events import AlertEvent

State = Literal["pending", "firing", "resolved"]


class Alert(msgspec.Struct, frozen=True, gc=False):
    """One alert of one rule. The garbage collector does not track it (`gc=False`): it holds
    strings, numbers and dicts of strings, so it can be part of no cycle. An evaluation makes one
    anew for every alert still true (`true_at`); tracked, those reached the collector's oldest
    generation at every evaluation and set off a walk over every object the daemon holds."""

    key: str
    rule: str
    labels: dict[str, str]
    annotations: dict[str, str]
    state: State
    active_since: float
    value: str
    last_true: float
    fired_at: float | None = None
    resolved_at: float | None = None
    inhibited: bool = False
    """Resolved because a higher budget tier took over: no resolve notice of its own."""
    period: str = ""
    grouped: bool = False
    """Created by a version that groups a rule's alerts into one incident. Alerts saved before it
    keep their own incident key, so their resolve closes the incident they opened."""
    incident_key: str = ""
    """The incident it opened, kept when its rule's id moved (`adopt_legacy_ids`), so its resolve
    closes that incident."""

    @property
    def incident(self) -> str:
        """What one incident covers: a rule's alerts; for a budget, its period (so every tier of
        one budget in one period escalates one incident rather than opening another)."""
        if self.incident_key:
            return self.incident_key
        if self.period:
            return fingerprint({k: v for k, v in self.labels.items() if k != "tier"} | {"period": self.period})
        return _rule_incident(self.rule) if self.grouped else self.key

    # Its changes, each a copy, named and typed here: `msgspec.structs.replace` checks no keyword.

    def true_at(self, now: float) -> Alert:
        """The same alert, true at `now` (each evaluation asks it of every alert still true)."""
        return msgspec.structs.replace(self, last_true=now)

    def reading(self, value: str, annotations: dict[str, str], now: float) -> Alert:
        """True at `now`, reading `value` (with the annotations that show it)."""
        return msgspec.structs.replace(self, annotations=annotations, value=value, last_true=now)

    def fired(self, now: float) -> Alert:
        return msgspec.structs.replace(self, state="firing", fired_at=now)

    def resolved(self, now: float, inhibited: bool = False) -> Alert:
        return msgspec.structs.replace(self, state="resolved", resolved_at=now, inhibited=inhibited)

    def moved(self, rule: str) -> Alert:
        """Under the rule id `rule` (its key follows), still closing the incident it opened."""
        key = alert_key(self.labels, rule, self.period)
        return msgspec.structs.replace(self, rule=rule, key=key, incident_key=self.incident)

    def body(self) -> str:
        """As the state file keeps it: its fields as a JSON object, in their order (written
        compactly; versions before wrote `json.dumps`'s spaces, and both read either)."""
        try:
            return _ENCODER.encode(self).decode()
        except UnicodeEncodeError:  # a lone surrogate (YAML's "\ud800" in a rule's labels): escaped as JSON can
            return json.dumps(msgspec.structs.asdict(self), separators=(",", ":"))

    def event(self, status: str) -> AlertEvent:
        """One alert's state change, as the notifiers format it (inside a group)."""
        return {
            "key": self.key,
            "dedup_key": self.incident,
            "status": status,
            "labels": self.labels,
            "annotations": self.annotations,
            "starts_at": self.fired_at or self.active_since,
            "ends_at": self.resolved_at,
            "value": self.value,
        }


_ENCODER = msgspec.json.Encoder()


def fingerprint(labels: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(sorted(labels.items())).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=1024)
def _rule_incident(rule: str) -> str:
    """The incident of a rule's alerts (each evaluation asks it of every alert firing)."""
    return fingerprint({"__rule__": rule})


def legacy_rule_ids(rules: Sequence[RuleConfig]) -> list[str]:
    """The ids versions before `rule_ids` gave: the second rule watching the same thing as an
    earlier one got `-2`, and so on (so reordering them swapped their alerts). Read only to move
    the alerts those versions saved."""
    seen: dict[str, int] = {}
    ids = []
    for rule in rules:
        base = rule_id(rule, as_written=True)
        seen[base] = seen.get(base, 0) + 1
        ids.append(base if seen[base] == 1 else f"{base}-{seen[base]}")
    return ids


def legacy_moves(rules: Sequence[RuleConfig], saved: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Which new id each old one (`legacy_rule_ids`) becomes. A rule's saved alerts tell which rule
    made them, whatever the rules' order now: the rule of their alert name and kind whose labels
    are theirs (the one with the most, so a rule without labels does not take a labelled one's
    alerts). Where none can tell (a budget's tiers fired, its alerts long resolved), the rule at the
    old id's position now, as the version that saved them numbered the rules."""
    new = rule_ids(rules)
    bases = [rule_id(rule, as_written=True) for rule in rules]
    moves: dict[str, str] = {}
    for old, body in saved:  # (rule id, alert) as saved
        if old in moves:
            continue
        try:
            labels = json.loads(body)["labels"]
        except (ValueError, KeyError, TypeError):  # (a row that cannot be read tells nothing)
            continue
        if not isinstance(labels, dict):
            continue
        makers = [
            (len(rule.labels), rid)
            for rule, base, rid in zip(rules, bases, new, strict=True)
            if base == old.split("-")[0]
            and rule.alert == labels.get("alertname")
            and rule.labels.items() <= labels.items()
        ]
        best = {rid for count, rid in makers if count == max(count for count, _ in makers)}
        if len(best) == 1:
            moves[old] = best.pop()
    for old, rid in zip(legacy_rule_ids(rules), new, strict=True):
        moves.setdefault(old, rid)
    return {old: rid for old, rid in moves.items() if old != rid}


def alert_key(labels: dict[str, str], rule: str, period: str = "") -> str:
    """An alert's key: its labels under its rule (and a budget's period)."""
    return fingerprint(labels | ({"period": period} if period else {}) | {"__rule__": rule})


def rekey(body: dict[str, object], rule: str) -> dict[str, object]:
    """A saved alert (its body as the state file holds it, read as JSON) moved to the rule id `rule`."""
    return msgspec.structs.asdict(Alert(**body).moved(rule))  # type: ignore[arg-type]


def fmt(value: Decimal, signal: str | None = None) -> str:
    """A figure for people: 2 decimals from 1 up, 4 below, no exponent; counts as whole numbers."""
    if signal is not None and signals.SIGNALS[signal].counts:
        return f"{value.quantize(Decimal(1)):f}"
    quantum = Decimal("0.01") if abs(value) >= 1 else Decimal("0.0001")
    return f"{value.quantize(quantum):f}"


def render(templates: dict[str, str], fields: dict[str, str]) -> dict[str, str]:
    """Fill `{field}` templates (the names were checked when the config was loaded)."""
    return {name: template.format_map(fields) for name, template in templates.items()}


_SAVED = msgspec.json.Decoder(Alert)


def saved_alerts(rows: Iterable[tuple[str, str]]) -> tuple[dict[str, Alert], list[str]]:
    """The alerts of saved rows (key, state as JSON), and the keys of those that cannot be read
    (damaged: not JSON, a field missing or of another type), left out: their alerts are judged
    afresh (at worst told again), where one bad row stopped the daemon from starting."""
    alerts: dict[str, Alert] = {}
    unreadable = []
    for key, body in rows:
        try:
            alerts[key] = _SAVED.decode(body)
        except msgspec.DecodeError:  # (ValidationError is one)
            unreadable.append(key)
    return alerts, unreadable
