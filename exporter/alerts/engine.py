"""The alert state machine: pending → firing → resolved, per rule and `by` group, durable.

Every evaluation commits its state changes and the notifications they cause in one SQLite
transaction, so a crash neither loses a pending `for` timer nor re-pages what was already
queued. Budget tiers fire once per tier per period; a higher tier supersedes (inhibits) the
lower ones without a notification of its own; a new period starts clean.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import math
import sqlite3
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from functools import partial
from typing import TypeVar

from exporter.alerts import anomalies, rules
from exporter.alerts.alert import Alert, alert_key, fmt, legacy_moves, rekey, render, saved_alerts
from exporter.config.rules import AnomalyRule, BudgetRule, ThresholdRule, rule_ids, written_moves
from exporter.config.schema import AlertsConfig, BudgetConfig, PriceConfig
from exporter.core.clock import Clock
from exporter.core.fields import scope_values
from exporter.core.logs import get_logger
from exporter.core.words import NO_ENDPOINT
from exporter.model import signals
from exporter.model.events import GroupEvent
from exporter.model.snapshots import Latest
from exporter.state import AlertStore, StateError
from exporter.state.alerts import read_refused

log = get_logger(__name__)
T = TypeVar("T")

RESOLVED_KEEP = 15 * 60.0
"""How long a resolved alert is kept (and re-sent to Alertmanager) after it resolved."""
GROUP_DETAIL = 100
"""Alerts a queued group keeps in full; the rest are only counted (messages show fewer still)."""
BEYOND_CHECKED = 1000
"""Of the alerts past GROUP_DETAIL, those a queued group also keeps by key (`beyond`), for a
delivery to check they still tell its state: a group larger than both is told as it was when the
alerts it shows no longer do (a row and a check of 50,000 keys: 2 MB and a quarter of a second)."""
TRUE_LAG = 0.1
"""An alert still true with nothing else changed is saved again once its saved `last_true` is this
share of its rule's `keep_firing_for` old: a crash can end its hold that much early, never late.
Saving every alert on every evaluation wrote 20 MB a minute at 50,000 alerts firing. A reload
and a stop save every alert first (`flush`), and a rule without `keep_firing_for` never reads it."""


@dataclass(frozen=True, slots=True)
class _Found:
    """A threshold rule's group found true: its value, and its alert's key, labels and annotations."""

    value: Decimal
    key: str
    labels: dict[str, str]
    annotations: dict[str, str]
    shown: str


@dataclass(frozen=True)
class Watched:
    """One account as the engine watches it: its snapshots and sources (`signals.Account`), the
    prices its usage is priced with, and whether it keeps a history."""

    account: signals.Account
    prices: Sequence[PriceConfig] = ()
    history: bool = False
    currency: str = ""
    """Its `billing.currency` (empty: not set), which a budget's amount is told in."""

    @property
    def name(self) -> str:
        return self.account.name

    @property
    def latest(self) -> Latest:
        return self.account.latest


@dataclass
class Engine:
    config: AlertsConfig
    budgets: Sequence[BudgetConfig]
    """Every budget; with several accounts, each scoped to the accounts it spans (`where.account`,
    every account without it)."""
    db: AlertStore
    """The alert tables of the state file (the dispatcher delivers from the same one)."""
    clock: Clock
    latest: Latest | None
    """The one account's snapshots (None with `accounts`: see `accounts`)."""
    sources: Callable[[], Iterable[str]]
    notifiers: Sequence[str] = ()
    """Names of the notifiers that get one notification per state change (not Alertmanager)."""
    alerts: dict[str, Alert] = field(default_factory=dict)
    history: bool = False
    """History is configured: anomaly rules wait for the day's history before they judge."""
    prices: Sequence[PriceConfig] = ()
    """What budgets scoped on usage are priced with."""
    judged: dict[str, tuple[AnomalyRule, str, list[anomalies.Finding], str]] = field(default_factory=dict)
    """Per anomaly rule (and account, with several): the day last judged, each group's judgement and
    the account's name (for the metrics)."""
    accounts: Sequence[Watched] = ()
    """With `accounts`, each of them (named); else the one account of `latest`, `sources`, `prices`
    and `history`, unnamed."""
    routes: dict[str, tuple[str, ...]] | None = None
    """Per rule id, the notifiers its alerts go to (`routes`); every one of `notifiers` when None."""

    def __post_init__(self) -> None:
        if not self.accounts:
            assert self.latest is not None
            one = signals.Account("", self.latest, self.sources)
            self.accounts = (Watched(one, self.prices, self.history),)
        self._lock = threading.Lock()
        self._unreadable: dict[str, str] = {}
        """The saved alerts that could not be read (key → rule), as last said."""
        self._transitions = 0
        self._sent = self.db.load_sent()
        self._anomaly_inputs: dict[str, tuple[object, object, str]] = {}
        """Per anomaly rule and account, the snapshots and day its last judgement was made from."""
        self._findings: dict[str, list[anomalies.Finding]] = {}
        """Per anomaly rule and account, that judgement."""
        self._queued: list[tuple[str, Alert, str]] = []
        """(notifier, alert, status) decided in this evaluation; queued as groups at its end."""
        self._saved_true: dict[str, float] = {}
        """Per alert whose `last_true` in memory is newer than the state file's, the saved one."""
        self._routed_anew: dict[str, set[str]] = {}
        """Per rule id, the notifiers a reload routed it to that the config before did not
        (`routed_anew`): each is queued what fires at the next evaluation, whatever it was told
        before (a firing queued for it then was dropped when the rule was routed away)."""
        self._tier_shown: dict[str, tuple[object, ...]] = {}
        """A told budget tier's figures as last made (what its annotations show; an engine has one config):
        made again only when they move."""
        self._found: dict[str, dict[signals.Labels, _Found]] = {}
        """Per threshold rule id, each group it found true at the last evaluation with data, and
        what its alert said: a group at the same value says the same (the rules are this engine's)."""
        self._by_rule: dict[str, list[str]] = {}
        """Each rule's alerts' keys as an evaluation starts."""
        self._budget_named = {budget.name: budget for budget in self.budgets}  # (names are unique)
        self._version: object = object()
        self._changed = False
        """What the alerts show changed in memory since `_version` was last replaced."""
        self._crashed: set[str] = set()
        """The rules whose figures could not be computed at their last evaluation (`_computed`)."""
        self._load()
        self.adopt_legacy_ids()
        self._publish()

    def carry_judged(self, before: Engine) -> None:
        """Take over the last judgement of each anomaly rule `before` had that this config has as
        it was, for each account it still watches: shown on until the rule judges again (a reload
        while the bills fail, or before the day's history came, must not blank what was judged)."""
        names = [watched.name for watched in self.accounts]
        kept = {}
        for rule, rid in zip(self.config.rules, rule_ids(self.config.rules), strict=True):
            if isinstance(rule, AnomalyRule):
                for name in names:
                    key = f"{rid}/{name}" if name else rid
                    if (entry := before.judged.get(key)) is not None and entry[0] == rule:
                        kept[key] = entry
        with self._lock:
            self.judged, self._changed = kept, True
            self._publish()

    def forget_judged(self, account: str) -> None:
        """Drop what the anomaly rules last judged of `account` (carried over by `carry_judged`):
        its figures were another project's or account's (`Account.activate`), so the expected and
        impact amounts judged on them are not shown as its own while it cannot be judged again."""
        with self._lock:
            judged = {key: entry for key, entry in self.judged.items() if entry[3] != account}
            if len(judged) != len(self.judged):
                self.judged, self._changed = judged, True
                self._publish()

    def adopt_legacy_ids(self) -> None:
        """Alerts saved by a version whose rule ids depended on the rules' order (once per state
        file), or on the order of a rule's `by` or `where` list (`written_moves`), move to their
        rule's id now, so an upgrade re-pages nothing."""
        if self.db.legacy_rule_ids:
            moves = legacy_moves(self.config.rules, self.db.load_states().values())
        else:
            moves = written_moves(self.config.rules, self.db.saved_rules)
            if not moves:
                return
        moved = self.db.adopt_rule_ids(moves, rekey)
        if moved:
            log.info("saved alerts moved to their rules' new ids", alerts=moved)
        self._load()

    def _load(self) -> None:
        """The alert state as last committed."""
        self._unsure = True  # until both are read: memory may hold what the state file does not
        states = self.db.load_states()
        alerts, unreadable = saved_alerts((key, body) for key, (_, body) in states.items())
        if set(unreadable) - self._unreadable.keys():  # (said once: a failed evaluation reads them again)
            log.error("saved alerts cannot be read: judged afresh", alerts=len(unreadable), keys=unreadable[:5])
        self._unreadable = {key: states[key][0] for key in unreadable}
        sent = self.db.load_sent()
        self.alerts, self._sent, self._saved_true, self._unsure = alerts, sent, {}, False
        self._tier_shown = {}
        self._changed = True

    # -- evaluation --

    def evaluate(self) -> int:
        """Evaluate every rule now; returns how many alerts changed state (fired, resolved, inhibited).

        If the evaluation cannot be committed (the state file refuses the write), the state in
        memory goes back to what was committed, so the next evaluation decides (and notifies) again;
        if that read fails too, the next evaluation reads it first (an alert still true is not
        written again: memory must hold nothing the state file lacks but `last_true`).
        """
        with self._lock:
            self._queued.clear()
            if self._unsure:  # an evaluation failed and so did reading back what was committed
                self._load()
            try:
                return self._evaluate()
            except BaseException:
                with contextlib.suppress(StateError):  # then the original failure says enough
                    self._load()
                raise
            finally:
                self._publish()  # (memory changed even when the evaluation failed)

    @property
    def version(self) -> object:
        """Stands for what the alerts show (`current`'s alerts, their labels and states, and
        `judged`): the same object, the same; a new one once an evaluation or a read of the state
        file has changed any of it. Replaced only when the change is complete, so what is rendered
        after reading it is at least as new as it."""
        return self._version

    def _publish(self) -> None:
        """A new `version` if what the alerts show changed (called holding the lock, or at start)."""
        if self._changed:
            self._version = object()
            self._changed = False

    def _evaluate(self) -> int:
        with self.db.store.transaction("alerts") as db:
            now = self.clock.now().timestamp()
            before = self._transitions
            ids = rule_ids(self.config.rules)
            unreadable = self._drop_unreadable(db)
            # First the alerts whose rule a reload removed: their resolves are queued before what
            # the rules fire now (a rule changed in what it watches, not its labels, is another
            # rule: its alerts of the same labels must reach a receiver after the old ones' resolve).
            for key in list(self.alerts):  # (keys alone: 50,000 pairs made at once woke the collector)
                alert = self.alerts[key]
                gone = alert.rule not in ids
                if gone and alert.state == "firing":
                    self._resolve(db, alert, now)
                    if alert.period:  # a budget's tier: the rule added back fires it again (it was told resolved)
                        self.db.forget_tiers(db, alert.rule, alert.period)
                elif (gone and alert.state == "pending") or (  # never told: dropped, as when its condition clears
                    alert.state == "resolved" and now - (alert.resolved_at or now) > RESOLVED_KEEP
                ):
                    self._delete(db, key)
            self._by_rule = {}
            for key, alert in self.alerts.items():
                self._by_rule.setdefault(alert.rule, []).append(key)
            for rule, rid in zip(self.config.rules, ids, strict=True):
                if isinstance(rule, BudgetRule):
                    self._budget(db, rule, rid, now)
                elif isinstance(rule, AnomalyRule):
                    self._anomaly(db, rule, rid, now)
                else:
                    self._signal(db, rule, rid, now)
            once = {rid for rule, rid in zip(self.config.rules, ids, strict=True) if isinstance(rule, AnomalyRule)}
            self._repeat(db, now, skip=once)
            self._enqueue(db, now)
        self._routed_anew.clear()  # (told now, or nothing of theirs fires; kept if the state file refused it)
        for key in unreadable:  # (gone now: not before the commit, which a failure rolls back)
            self._unreadable.pop(key, None)
        return self._transitions - before

    def _drop_unreadable(self, db: sqlite3.Connection) -> dict[str, str]:
        """Delete the saved alerts that could not be read (key → rule), with who was told of them:
        judged afresh from now on, not read (and said) again at every start and reload. (One saved
        anew since is its own again.) A budget's tier one held fires again, if still crossed: the
        highest marked in the period being judged (a month's, or a day's), when no alert of the rule
        there can be read (one that fires holds that tier; one resolved told its tier). Those
        deleted: forgotten once the transaction commits."""
        unreadable = {key: rule for key, rule in self._unreadable.items() if key not in self.alerts}
        for key in unreadable:
            self.db.delete_state(db, key)
        if unreadable:
            self._sent = {told: at for told, at in self._sent.items() if told[0] not in unreadable}
        current = {self.clock.period(), self.clock.today().isoformat()}
        for rule in set(unreadable.values()):
            marked: dict[str, list[float]] = {}
            for period, tier in self.db.tiers_of(db, rule):
                if period in current:
                    marked.setdefault(period, []).append(tier)
            for period, tiers in marked.items():
                if not any(a.rule == rule and a.period == period for a in self.alerts.values()):
                    self.db.forget_tiers(db, rule, period, [max(tiers)])
        return unreadable

    def _computed(self, rid: str, compute: Callable[[], T]) -> T | None:  # (`rid`: an account's part too)
        """`compute()`: a rule's figures, which change no state; None (the rule's alerts keep their
        state, as with no data to trust) if it raises, logged with its traceback when it first does,
        so that one rule's figures that cannot be computed hold back no other rule."""
        try:
            found = compute()
        except Exception:
            if rid not in self._crashed:
                self._crashed.add(rid)
                log.exception("a rule's figures could not be computed; its alerts keep their state", rule=rid)
            return None
        if rid in self._crashed:
            self._crashed.discard(rid)
            log.info("a rule's figures are computed again", rule=rid)
        return found

    def _signal(self, db: sqlite3.Connection, rule: ThresholdRule, rid: str, now: float) -> None:
        evaluated = self._computed(
            rid, lambda: signals.evaluate_accounts(rule, [w.account for w in self.accounts], self.clock)
        )
        if evaluated is None:
            return  # no trustworthy data: every alert of this rule keeps its state
        values, unknown = evaluated
        active: set[str] = set()
        known, found = self._found.get(rid, {}), {}
        lag = rule.keep_firing_for * TRUE_LAG if rule.keep_firing_for else float("inf")
        for group, value in values.items():
            if not rules.COMPARE[rule.op](value, rule.threshold):
                continue
            true = known.get(group)
            if true is None or true.value != value:
                true = self._true(rule, rid, group, value, None if true is None else true.key)
            found[group] = true
            active.add(true.key)
            self._active(db, rid, true.key, true.labels, true.annotations, true.shown, rule.for_, now, lag=lag)
        self._found[rid] = found
        for key in self._by_rule.get(rid, ()):
            alert = self.alerts.get(key)
            if alert is None or key in active or alert.state == "resolved":
                continue
            if alert.labels.get(signals.ACCOUNT) in unknown:
                continue  # its account's data cannot be trusted now: it keeps its state
            if alert.state == "pending":
                self._delete(db, key)
            elif now - alert.last_true >= rule.keep_firing_for:
                self._resolve(db, alert, now)

    @staticmethod
    def _true(rule: ThresholdRule, rid: str, group: signals.Labels, value: Decimal, key: str | None) -> _Found:
        """What the rule's alert for `group` says at `value` (its key given when known)."""
        labels = {"alertname": rule.alert, **rule.labels, **dict(group)}
        shown, limit = fmt(value, rule.signal), fmt(rule.threshold, rule.signal)
        scoped = {name: "|".join(scope_values(wanted)) for name, wanted in rule.where.items()}
        fields = {**scoped, **dict(group), "value": shown, "threshold": limit}
        default = f"{rule.alert}: {rule.signal} {shown} {rule.op} {limit}"
        annotations = {"summary": default} | render(rule.annotations, fields) | {"value": shown}
        return _Found(value, key or alert_key(labels, rid), labels, annotations, shown)

    def _anomaly(self, db: sqlite3.Connection, rule: AnomalyRule, rid: str, now: float) -> None:
        """One alert per anomalous group and day (`day` is a label): a revised bill updates it
        without notifying again; when the next day is judged, or a revision makes the day usual,
        it resolves. With several accounts, each account's groups are judged on its own history
        (and carry its `account` label)."""
        judged_day = anomalies.judged_day(self.clock)
        day = judged_day.isoformat()
        judged = dict(self.judged)
        firing: dict[str, list[str]] = {}  # the rule's firing alerts by account: each looks at its own, not at all held
        for key in self._by_rule.get(rid, ()):
            alert = self.alerts.get(key)
            if alert is not None and alert.state == "firing":
                firing.setdefault(alert.labels.get(signals.ACCOUNT, ""), []).append(key)
        for watched in self.accounts:
            findings = self._computed(f"{rid}/{watched.name}", partial(self._judge, rule, rid, watched, judged_day))
            if findings is None:
                continue  # not judged now: its last judgement stays shown, its alerts as they are
            self._anomalies(db, rule, rid, watched.name, findings, day, now, firing.pop(watched.name, []))
            judged[f"{rid}/{watched.name}" if watched.name else rid] = (rule, day, findings, watched.name)
        if judged != self.judged:  # (the same rules' findings are the same lists while their inputs are)
            self._changed = True
        self.judged = judged  # replaced whole: scrapes read it unlocked
        names = {watched.name for watched in self.accounts}
        for account, keys in firing.items():
            if account in names:
                continue  # not judged now
            for key in keys:  # an account a reload removed: its day is judged no more
                if (alert := self.alerts[key]).state == "firing":
                    self._resolve(db, alert, now)

    def _judge(
        self, rule: AnomalyRule, rid: str, watched: Watched, judged_day: dt.date
    ) -> list[anomalies.Finding] | None:
        """The account's groups judged for `judged_day`, or None while its data cannot tell."""
        latest, key = watched.latest, f"{rid}/{watched.name}"
        if watched.history and not signals.todays_history(latest, self.clock):
            return None  # the baseline (and the items behind an endpoint) come with today's history: not yet
        if not signals.todays_bills(latest, self.clock):
            return None  # no trustworthy bills now: the rule's alerts keep their state
        bills, history, day = latest.bills, latest.history, judged_day.isoformat()
        earlier = self._anomaly_inputs.get(key)
        if earlier is not None and earlier[0] is bills and earlier[1] is history and earlier[2] == day:
            return self._findings[key]  # the same snapshots and day: the same judgement
        findings = anomalies.judge_groups(rule, anomalies.held(latest), judged_day)
        self._anomaly_inputs[key] = (bills, history, day)
        self._findings[key] = findings
        return findings

    def _anomalies(
        self,
        db: sqlite3.Connection,
        rule: AnomalyRule,
        rid: str,
        account: str,
        findings: list[anomalies.Finding],
        day: str,
        now: float,
        firing: Sequence[str],
    ) -> None:
        """The account's alerts of the rule for `findings`; `firing`: the keys of those firing before."""
        named = {signals.ACCOUNT: account} if account else {}
        active: set[str] = set()
        for finding in findings:
            judged = finding.judgement
            if not judged.anomalous:
                continue
            group = dict(finding.group)
            labels = {"alertname": rule.alert, **rule.labels, **named, **group, "day": day}
            percent = "n/a" if judged.impact_percent is None else f"{judged.impact_percent:.0f}"
            fields = {
                **group,
                "day": day,
                "actual": fmt(judged.actual),
                "expected": fmt(judged.expected),
                "impact": fmt(judged.impact),
                "impact_percent": percent,
                "contributors": anomalies.describe(finding.contributors) or "n/a",
                "value": fmt(judged.impact),
            }
            who = ", ".join(f"{k}={v or NO_ENDPOINT}" for k, v in {**named, **group}.items()) or "the account"
            default = (
                f"{rule.alert}: {who} spent {fields['actual']} on {day}, {fields['impact']} ({percent}%) above "
                f"the expected {fields['expected']}"
            )
            annotations = {"summary": default} | render(rule.annotations, fields) | {"value": fields["value"]}
            key = alert_key(labels, rid)
            active.add(key)
            self._active(db, rid, key, labels, annotations, fields["value"], 0.0, now)
        judged_groups = {finding.group for finding in findings}
        for key in firing:
            alert = self.alerts[key]
            if key in active or alert.state != "firing":
                continue
            alert_group: signals.Labels = tuple(sorted((name, alert.labels.get(name, "")) for name in rule.by))
            if alert.labels.get("day") != day or alert_group in judged_groups:  # a new day, or judged usual now
                self._resolve(db, alert, now)

    def _active(
        self,
        db: sqlite3.Connection,
        rid: str,
        key: str,
        labels: dict[str, str],
        annotations: dict[str, str],
        value: str,
        hold: float,
        now: float,
        period: str = "",
        lag: float = float("inf"),
    ) -> None:
        """The alert of `key` is true now; saved when it is new, fires, or reads otherwise, and
        else once its saved `last_true` is `lag` old."""
        alert = self.alerts.get(key)
        if alert is None or alert.state == "resolved":
            alert = Alert(key, rid, labels, annotations, "pending", now, value, now, period=period, grouped=True)
            self._saved_true.pop(key, None)
        elif alert.annotations == annotations and alert.value == value:
            saved = self._saved_true.setdefault(key, alert.last_true)
            if not (alert.state == "pending" and now - alert.active_since >= hold) and now - saved < lag:
                self.alerts[key] = alert.true_at(now)
                return
        alert = alert.reading(value, annotations, now)
        if alert.state == "pending" and now - alert.active_since >= hold:
            alert = alert.fired(now)
            self._transitions += 1
            log.info("alert firing", alertname=labels["alertname"], labels=labels, value=value)
            self._notify(db, alert, "firing", now)
        self._save(db, alert)

    def _resolve(self, db: sqlite3.Connection, alert: Alert, now: float, inhibited: bool = False) -> None:
        self._tier_shown.pop(alert.key, None)  # (fired again, its figures are made anew)
        resolved = alert.resolved(now, inhibited)
        self._transitions += 1
        self._save(db, resolved)
        how = "inhibited" if inhibited else "resolved"
        log.info(f"alert {how}", alertname=alert.labels["alertname"], labels=alert.labels)
        if not inhibited:
            self._notify(db, resolved, "resolved", now)

    def _budget(self, db: sqlite3.Connection, rule: BudgetRule, rid: str, now: float) -> None:
        budget = self._budget_named[rule.budget]
        spanned = [w for w in self.accounts if budget.spans(w.name)]
        spans = [(w.latest, w.prices) for w in spanned]
        measured = self._computed(rid, lambda: rules.budget_ratio(budget.in_account(), spans, self.clock, rule.basis))
        if measured is None:
            return
        period, ratio = measured.period, measured.ratio
        firing = [a for a in map(self.alerts.get, self._by_rule.get(rid, ())) if a is not None and a.state == "firing"]
        value = {t: Decimal(str(t)) for t in rule.tiers}
        labelled = {f"{t:g}": v for t, v in value.items()}  # (a label is the tier to 6 digits)
        named = budget.accounts or ()
        account = named[0] if len(named) == 1 else None  # (one account's budget: its alerts say which)
        crossed = [t for t in rule.tiers if value[t] <= ratio]
        for alert in firing:
            if alert.period != period or alert.labels.get(signals.ACCOUNT) != account:
                # A new period starts clean, and so does one a reload made (month and day, and back),
                # or an alert a reload relabelled (the accounts the budget spans): its tiers were told
                # resolved, so they fire again as crossed.
                self._resolve(db, alert, now)
                self.db.forget_tiers(db, rid, alert.period)
            elif alert.labels["tier"] not in labelled:
                # A tier a reload took out: told resolved (no tier of the rule's any more); the
                # highest tier still crossed fires now (it made that one inhibited: never told on
                # its own), and a tier taken out fires again if a reload puts it back, crossed.
                self._resolve(db, alert, now)
                gone = [t for t in self.db.tiers_fired(rid, period) if t not in value]
                self.db.forget_tiers(db, rid, period, [*gone, *crossed[-1:]])
            elif ratio < labelled[alert.labels["tier"]]:
                # Fell back under it: the forecast (its tier fired: not again this period), or the
                # spend against an amount or scope a reload changed (or the bills revised down):
                # then the highest tier still crossed fires now (it may not have been told on its
                # own) and those above the spend fire again as it crosses them anew.
                self._resolve(db, alert, now)
                if rule.basis == "actual":
                    again = [t for t in rule.tiers if value[t] > ratio] + crossed[-1:]
                    self.db.forget_tiers(db, rid, period, again)
        if not crossed:
            return
        fired = self.db.tiers_fired(rid, period)
        tier = max(crossed)
        if tier in fired:  # told: while it fires, its figures are those of now (a new amount, revised bills)
            told = next((a for a in firing if a.labels["tier"] == f"{tier:g}" and a.period == period), None)
            if told is None or self.alerts[told.key].state != "firing":
                return
            shown = (fmt(ratio), measured.crossing, measured.chance)
            if self._tier_shown.get(told.key) == shown:
                return  # (made again only when they move: a thousand tiers firing, half an evaluation more)
            self._tier_shown[told.key] = shown
        else:
            for earlier in firing:
                still = self.alerts.get(earlier.key)
                if still is not None and still.state == "firing":  # (those the loop above left firing)
                    self._resolve(db, still, now, inhibited=True)
            self.db.mark_tiers(db, rid, period, crossed)
        labels = {"alertname": rule.alert, **rule.labels, "budget": budget.name, "tier": f"{tier:g}"}
        if rule.basis != "actual":  # (an alert on the forecast is not the same alert as one on the spend)
            labels["basis"] = rule.basis
        if account is not None:
            labels[signals.ACCOUNT] = account
        crossing = "not this period" if measured.crossing is None else measured.crossing.isoformat()
        chance = "unknown" if measured.chance is None else f"{measured.chance:.0%}"
        currencies = {w.currency for w in spanned if w.currency}  # (the config refuses two)
        amount = fmt(budget.amount) + "".join(f" {c}" for c in currencies)
        fields = {
            "budget": budget.name,
            "tier": f"{tier:g}",
            "amount": fmt(budget.amount),
            "period": period,
            "value": fmt(ratio),
            "basis": rule.basis,
            "crossing_day": crossing,
            "chance": chance,
        }
        if rule.basis == "forecast":
            default = (
                f"Budget {budget.name} ({period}) is forecast at {ratio:.0%} of {amount}: tier {tier:g}"
                f" crossed; at this pace the amount is crossed on {crossing} (chance {chance})"
            )
        else:
            default = f"Budget {budget.name} ({period}) is at {ratio:.0%} of {amount}: tier {tier:g} crossed"
        annotations = {"summary": default} | render(rule.annotations, fields) | {"value": fmt(ratio)}
        key = alert_key(labels, rid, period)
        self._active(db, rid, key, labels, annotations, fmt(ratio), 0.0, now, period)

    def routed_anew(self, before: Engine) -> None:
        """Note the notifiers this config routes a rule of `before`'s (the engine a reload replaces)
        to that `before` did not."""
        kept = set(rule_ids(before.config.rules))  # (a new rule's firings go to all its notifiers anyway)
        for rid in rule_ids(self.config.rules):
            if rid not in kept:
                continue
            routed = set(self.routed(rid))
            # (and those a reload before routed it to, when no evaluation has told them yet)
            anew = (routed - set(before.routed(rid))) | (before._routed_anew.get(rid, set()) & routed)
            if anew:
                self._routed_anew[rid] = anew

    def routed(self, rule: str) -> Sequence[str]:
        """The notifiers that get one notification per state change of the rule's alerts."""
        if self.routes is None:
            return self.notifiers
        return [n for n in self.routes.get(rule, ()) if n in self.notifiers]

    def _repeat(self, db: sqlite3.Connection, now: float, skip: set[str]) -> None:
        """Remind of firing alerts every `repeat_interval`; not those of `skip` (a day's spend
        anomaly is told once)."""
        if not self.notifiers:
            return
        routed: dict[str, Sequence[str]] = {}
        refused: set[str] | None = None
        for alert in self.alerts.values():
            if alert.state != "firing" or alert.rule in skip:
                continue
            notifiers = routed.get(alert.rule)
            if notifiers is None:
                notifiers = routed[alert.rule] = self.routed(alert.rule)
            anew = self._routed_anew.get(alert.rule, ())
            for notifier in notifiers:
                if notifier in anew and self._sent.get((alert.key, notifier)) == now:
                    continue  # (queued its firing in this evaluation already)
                if notifier in anew or now - self._sent.get((alert.key, notifier), 0.0) >= self.config.repeat_interval:
                    if refused is None:
                        refused = read_refused(db)
                    told = notifier not in anew and (
                        self._sent.get((alert.key, notifier), -math.inf) >= (alert.fired_at or -math.inf)
                    )
                    if notifier in refused and told:
                        # Its receiver is down (what waits for it failed): a reminder would pile up
                        # behind; what waits is the firing it gets, and the next reminder counts from now.
                        # (One never told this firing, routed to it since, gets it queued all the same.)
                        self.db.mark_sent(db, alert.key, notifier, now)
                        self._sent[(alert.key, notifier)] = now
                        continue
                    self._notify(db, alert, "firing", now, only=notifier)

    def _notify(self, db: sqlite3.Connection, alert: Alert, status: str, now: float, only: str | None = None) -> None:
        """Queue the change for the notifiers the alert's rule routes to; a resolve for those told
        of this firing, routed to it now or not (a reload routed it elsewhere, or removed it), and
        not for one routed to since this firing began, never told it. (A resolve that waited for a
        notifier the rule was routed away from is delivered even when a new firing overtook it:
        the dispatcher's `_current`.)"""
        if status == "resolved":
            since = alert.fired_at if alert.fired_at is not None else -math.inf  # (fired, when not known)
            # Who was told, as the state file has it: the dispatcher forgets a firing it dropped
            # as routed away (never told), which this engine's marks, read at its start, still hold.
            told = self.db.sent_of(db, alert.key)
            for notifier in self.notifiers:
                if notifier not in told:
                    self._sent.pop((alert.key, notifier), None)
            notifiers = [n for n in self.notifiers if told.get(n, -math.inf) >= since]
        else:
            notifiers = list(self.routed(alert.rule))
        for notifier in [only] if only else notifiers:
            self._queued.append((notifier, alert, status))
            self.db.mark_sent(db, alert.key, notifier, now)
            self._sent[(alert.key, notifier)] = now

    def _enqueue(self, db: sqlite3.Connection, now: float) -> None:
        """One outbox message per notifier, rule, state and incident: 10,000 alerts of one rule
        that fire together are one message, not 10,000."""
        groups: dict[tuple[str, str, str, str], list[Alert]] = {}
        for notifier, alert, status in self._queued:
            groups.setdefault((notifier, alert.rule, status, alert.incident), []).append(alert)
        self._queued.clear()
        if not groups:
            return
        firing: dict[str, int] = {}
        for alert in self.alerts.values():
            if alert.state == "firing":
                firing[alert.incident] = firing.get(alert.incident, 0) + 1
        for (notifier, _, status, incident), alerts in groups.items():
            event: GroupEvent = {
                "status": status,
                "alertname": alerts[0].labels["alertname"],
                "dedup_key": incident,
                "alerts": [a.event(status) for a in alerts[:GROUP_DETAIL]],
                "total": len(alerts),
                "still_firing": firing.get(incident, 0),
            }
            if len(alerts) > GROUP_DETAIL:
                beyond = alerts[GROUP_DETAIL : GROUP_DETAIL + BEYOND_CHECKED]
                event["beyond"] = [(a.key, a.fired_at or a.active_since) for a in beyond]
            self.db.enqueue(db, notifier, event, now)

    def _save(self, db: sqlite3.Connection, alert: Alert) -> None:
        before = self.alerts.get(alert.key)
        if before is None or before.state != alert.state or before.labels is not alert.labels:
            self._changed = True  # (a new value or annotation alone changes nothing `version` stands for)
        self.alerts[alert.key] = alert
        self._saved_true.pop(alert.key, None)
        self.db.save_state(db, alert.key, alert.rule, alert.body())

    def _delete(self, db: sqlite3.Connection, key: str) -> None:
        del self.alerts[key]
        self._tier_shown.pop(key, None)
        self._changed = True
        self._saved_true.pop(key, None)
        self.db.delete_state(db, key)

    def flush(self) -> None:
        """Save every alert whose `last_true` the state file holds older (`TRUE_LAG`): before a
        reload's engine reads the state file, and at a stop."""
        with self._lock:
            if not self._saved_true:
                return
            with self.db.store.transaction("alerts") as db:
                for key in self._saved_true:
                    alert = self.alerts.get(key)
                    if alert is not None:
                        self.db.save_state(db, key, alert.rule, alert.body())
            self._saved_true = {}

    # -- views --

    def current(self, notifier: str | None = None) -> list[Alert]:
        """The alerts held now; given a notifier, those of the rules routed to it, and the resolved."""
        with self._lock:
            alerts = sorted(self.alerts.values(), key=lambda a: (a.labels["alertname"], a.key))
        if notifier is None or self.routes is None:
            return alerts
        # A resolved alert goes to every one: its rule may have been routed there before a reload
        # removed it or routed it elsewhere (a resolve of an alert a receiver never had is a no-op).
        return [a for a in alerts if a.state == "resolved" or notifier in self.routes.get(a.rule, ())]
