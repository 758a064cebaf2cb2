"""Everything built from a config: its accounts (`app.account`), the alert engine over all of
them, the notifiers' dispatcher and the exposition; and the digest made from them."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from decimal import Decimal
from functools import cached_property
from pathlib import Path
from typing import Any

from prometheus_client.registry import Collector

from exporter.alerts.alert import Alert
from exporter.alerts.engine import Engine, Watched
from exporter.app.account import (
    Account,
    BillingFactory,
    RefreshFailed,
    account_ids,
    build_exposition,
    collectors,
)
from exporter.billing import BillingError, RetryPolicy
from exporter.config.rules import AnomalyRule, BudgetRule, RuleConfig, ThresholdRule, rule_ids
from exporter.config.schema import ACCOUNT, BudgetConfig, Config
from exporter.core.clock import Clock
from exporter.core.fields import in_scope
from exporter.delivery.dispatcher import Dispatcher
from exporter.digest.build import FiringAlert, ProbeStat, SharedBudget, build, ended_month, fetched_after, span
from exporter.metrics.accounts import SharedBudgetCollector, shared_parts
from exporter.metrics.alerts import AlertsCollector
from exporter.metrics.assembled import AssembledExposition
from exporter.metrics.collectors import BudgetCollector, ExporterCollector
from exporter.metrics.exposition import Exposition
from exporter.metrics.runtime import RUNTIME_COLLECTORS
from exporter.model import signals
from exporter.model.snapshots import Latest, SourceHealth
from exporter.notifiers.registry import outbox
from exporter.sources.budgets import month_spent
from exporter.sources.reconcile import settled_at
from exporter.state import AlertStore, StateStore
from exporter.state.accounts import files_for, moved

__all__ = [
    "Account",
    "AccountStates",
    "RefreshFailed",
    "Sources",
    "account_state_path",
    "build_exposition",
    "source_key",
]

TOLD_BACK = 31
"""Days before the last settled day that a digest tells the reconciliation of, at most: a day
judged later than that (or after a daemon down for longer) is told by no digest; the landing page
and /api/v1/reconciliation show it."""

AccountState = Callable[[str], StateStore]
"""An account state file, by its `AccountFile.file`."""


def source_key(account: str, source: str) -> str:
    """How the daemon names an account's source: `bills`, or with several accounts `prod/bills`."""
    return f"{account}/{source}" if account else source


def account_state_path(path: str, file: str) -> str:
    """Where an account keeps its sources' state, in the file `file` (`AccountFile.file`: named
    after the account that first used it): beside the process's state file, `exporter.db` →
    `exporter.prod.db` (the process's own keeps the alerts and the outbox)."""
    if path == ":memory:":
        return path
    base = Path(path)
    return str(base.with_name(f"{base.stem}.{file}{base.suffix or '.db'}"))


class AccountStates:
    """The accounts' state files, each opened when first needed and kept open while the process
    runs (an account a reload removes and adds back finds its state as it left it)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._open: dict[str, StateStore] = {}

    def open(self, file: str) -> StateStore:
        store = self._open.get(file)
        if store is None:
            store = self._open[file] = StateStore(account_state_path(self.path, file))
        return store

    def close(self) -> None:
        for store in self._open.values():
            store.close()


def process_budgets(config: Config) -> tuple[BudgetConfig, ...]:
    """Every budget as the engine measures it: with several accounts, an account's own budget is
    scoped to it (`where.account`), a top-level one to the accounts it names (all without)."""
    if not config.several:
        return config.budgets
    own = (
        b.model_copy(update={"where": {**b.where, ACCOUNT: account.name}})
        for account in config.accounts
        for b in account.budgets
    )
    return (*config.budgets, *own)


class Sources:
    """The accounts of a config, the engine that watches them, the dispatcher and the exposition.

    Built again on each reload; each account carries over from `previous` what its reload does
    not change (see `Account`), and keeps its snapshots (`latests`) while its name stays.
    """

    def __init__(
        self,
        config: Config,
        latest: Latest,
        clock: Clock,
        state: StateStore,
        external_url: str = "",
        retry: RetryPolicy | None = None,
        previous: Sources | None = None,
        dispatcher: Dispatcher | None = None,
        billing: BillingFactory | None = None,
        account_state: AccountState | None = None,
    ) -> None:
        """`latest` and `state`: the process's (and the state file of the one account without
        `accounts`, unless it had another's). `dispatcher`: the daemon's, which outlives reloads;
        without one (`once`), one that delivers only when asked. `account_state`: opens the
        accounts' state files (which file is each account's, `state` keeps: `files_for`); without
        it, the accounts of several keep theirs in memory."""
        self.config = config
        self.latest = latest
        self.clock = clock
        self.state = state
        named = config.account_configs()
        held: dict[str, Latest] = previous.latests if previous is not None else {}
        self.latests: dict[str, Latest] = {
            name: held.get(name) or Latest(started=clock.now().timestamp()) if name else latest for name, _ in named
        }  # (an account a reload adds is waited for from then)
        # One AlertStore for the engine and the dispatcher: the daemon's (its dispatcher's), or a new one.
        alert_store = dispatcher.store if dispatcher is not None else AlertStore(state)
        self.accounts: dict[str, Account] = {}
        watched = [
            Watched(
                signals.Account(name, self.latests[name], self._sources_of(name)),
                account_config.prices,
                account_config.billing.history_months > 0,
                account_config.billing.currency,
            )
            for name, account_config in named
        ]
        # First, since it reads the state file (which may fail): nothing else is built in vain then.
        self.engine = Engine(
            config.alerts,
            process_budgets(config),
            alert_store,
            clock,
            None,
            sources=lambda: (),
            notifiers=[n.name for n in config.alerts.notifiers if outbox(n) is not None],
            accounts=watched,
            routes=config.alert_routes(),
        )
        if previous is not None:
            self.engine.routed_anew(previous.engine)
            self.engine.carry_judged(previous.engine)
        held_accounts = previous.accounts if previous is not None else {}
        # Each account's state file follows its billing account, whatever its name (see files_for).
        known = state.account_files() if account_state is not None else []
        files = files_for(account_ids(config), known) if account_state is not None else {}
        moved_in = moved(files, known)
        for name, account_config in named:
            kept = held_accounts.get(name)
            if account_state is None:
                store = state if not name else StateStore(":memory:")
            else:
                store = state if not files[name].file else account_state(files[name].file)
            self.accounts[name] = Account(
                name, account_config, self.latests[name], clock, store, retry=retry, previous=kept, billing=billing,
                moved=name in moved_in,
            )  # fmt: skip
        self.refreshers: dict[str, Callable[[], None]] = {}
        self.intervals: dict[str, float] = {}
        self.awaited: list[str] = []
        """The sources readiness waits for (each account's `awaited`)."""
        self.phases: dict[str, float] = {}
        """Where in its interval each source runs, as a share of it: the accounts spread evenly
        (the n-th of N at n ÷ N), so that their refreshes do not all come at once."""
        for n, (name, account) in enumerate(self.accounts.items()):
            for source, refresher in account.refreshers.items():
                self.refreshers[source_key(name, source)] = refresher
                self.intervals[source_key(name, source)] = account.intervals[source]
                self.phases[source_key(name, source)] = n / len(self.accounts)
            self.awaited += [source_key(name, source) for source in account.awaited]
        if dispatcher is None:
            dispatcher = Dispatcher(config.alerts.notifiers, alert_store, clock, self.engine.current, external_url)
        self.dispatcher = dispatcher
        states = [(name, a.state) for name, a in self.accounts.items()] if config.several else []
        self.alerts_collector = AlertsCollector(self.engine, dispatcher, lambda: states)
        """The alerts' series in the exposition: the alert worker renders them after evaluating."""
        self.exposition = self._exposition()
        if files:  # (before they take over: a reload refused records nothing)
            self.state.record_account_files(files.values())
        for name, account in self.accounts.items():  # (last: a reload refused on the way changes nothing)
            if account.activate():
                self.engine.forget_judged(name)
        for name, gone in held_accounts.items():
            gone.removed = name not in self.accounts
        ids = Counter(account.account_id for account in self.accounts.values())
        self.account_ids = frozenset(ids)
        """The billing accounts (`Account.account_id`) the configured accounts are of."""
        self.alike = frozenset(account_id for account_id, count in ids.items() if count > 1)
        """Those that more than one configured account is of."""

    def _sources_of(self, name: str) -> Callable[[], Iterable[str]]:
        return lambda: list(self.accounts[name].refreshers) if name in self.accounts else []

    def _exposition(self) -> Exposition | AssembledExposition:
        """Every account's series, the alerts', and the process's own (RUNTIME_COLLECTORS: client_python's
        defaults, last)."""
        if not self.config.several:
            one = self.accounts[""]
            return build_exposition(one.config, one.latest, self.clock, self.alerts_collector, *RUNTIME_COLLECTORS)
        per_account = {
            name: collectors(a.config, a.latest, self.clock, part="account") for name, a in self.accounts.items()
        }
        kinds: list[list[tuple[str, Collector]]] = [
            [(name, found[n]) for name, found in per_account.items()]
            for n in range(len(next(iter(per_account.values()))))
        ]
        shared = SharedBudgetCollector(
            [(name, a.latest, a.config.prices) for name, a in self.accounts.items()],
            self.config.shared_budgets,
            self.clock,
        )
        budgets = next(k for k, parts in enumerate(kinds) if isinstance(parts[0][1], BudgetCollector))
        kinds[budgets].append(("", shared))  # (one HELP and TYPE for the accounts' budgets and these)
        kinds.append([("", ExporterCollector(self.latest, self.clock, part="process"))])
        kinds.append([("", self.alerts_collector)])
        kinds += [[("", collector)] for collector in RUNTIME_COLLECTORS]
        return AssembledExposition(kinds)

    # -- one account (the config's only one) --

    @property
    def one(self) -> Account:
        """The account of a config without `accounts` (the first one with)."""
        return next(iter(self.accounts.values()))

    @property
    def client(self) -> Any:
        return self.one.client

    @property
    def usage(self) -> Any:
        return self.one.usage

    @property
    def bills(self) -> Any:
        return self.one.bills

    @property
    def history(self) -> Any:
        return self.one.history

    @property
    def settled(self) -> Any:
        return self.one.settled

    @property
    def probes(self) -> Any:
        return self.one.probes

    # -- refreshing --

    def health(self) -> dict[str, SourceHealth]:
        """Every configured source's health under its key (`prod/bills` with several accounts)."""
        return {
            source_key(name, source): health
            for name, account in self.accounts.items()
            for source, health in account.latest.health.items()
        }

    def locate(self, key: str) -> tuple[Account, str] | None:
        """The account and source a `source_key` names; None when no account has it now."""
        name, _, source = key.rpartition("/")
        account = self.accounts.get(name)
        if account is None or source not in account.refreshers:
            return None
        return account, source

    def keys(self, source: str) -> list[str]:
        """Every account's key for `source` (`bills`: each account's bills)."""
        return [source_key(name, source) for name, a in self.accounts.items() if source in a.refreshers]

    def refresh_once(
        self, names: Iterable[str] | None = None, needed: Collection[str] | None = None
    ) -> list[RefreshFailed]:
        """Refresh each source of every account once (those named, in the order given; else all),
        recording its health as the daemon does. The first failure of an account `needed` (None:
        every one) stops it (RefreshFailed, naming the account's source as `prod/bills`); that of
        another ends its account's refresh only, and is returned."""
        others: list[RefreshFailed] = []
        for name, account in self.accounts.items():
            try:
                account.refresh_once(names)
            except RefreshFailed as failed:
                if not name:
                    raise
                cause = failed.__cause__
                assert isinstance(cause, BillingError)
                named = RefreshFailed(source_key(name, failed.source), cause)
                if needed is None or name in needed:
                    raise named from cause
                others.append(named)
        return others

    def changed(self, previous: Sources) -> set[str]:
        """The sources whose way of refreshing this config changed (they run again at once)."""
        changed: set[str] = set()
        for name, account in self.accounts.items():
            before = previous.accounts.get(name)
            found = set(account.refreshers) if before is None else account.changed(before)
            changed |= {source_key(name, source) for source in found}
        return changed

    def close(self, keep: Sources | None = None) -> None:
        """Release connections; what `keep` (a reload's) took over stays open. A stop cuts the
        billing requests on the wire; a reload leaves them to end, within their timeout, as the
        answer of one may ask the client it made to wait (`BillingClient.carry_over`)."""
        for name, account in self.accounts.items():
            account.close(keep.accounts.get(name) if keep is not None else None, cut=keep is None)

    # -- the digest --

    def _shared_budgets(self, account: str, ended: str | None) -> list[SharedBudget]:
        """The budgets spanning `account` and others, each with its figures in every account it spans
        (as `/metrics` has them), their names, and what they spent in `ended` (the month the digest's
        span ended, None for none; unknown until each account's bills of the month after it are
        fetched: what one holds of the month may not be all of it): for the account's digest."""
        today = self.clock.today()
        found: list[SharedBudget] = []
        for budget in self.config.shared_budgets:
            names = tuple(n for n in self.accounts if budget.spans(n))
            if account in names:
                spans = [(self.accounts[n].latest, self.accounts[n].config.prices) for n in names]
                spent: Decimal | None = None
                if ended is not None:
                    each = [
                        month_spent(budget.in_account(), latest, ended) if fetched_after(latest, ended) else None
                        for latest in (self.accounts[n].latest for n in names)
                    ]
                    spent = None if None in each else sum((s for s in each if s is not None), Decimal(0))
                found.append((budget, shared_parts(budget, spans, today), names, spent))
        return found

    def _counting(self, account: str) -> Callable[[Alert], bool]:
        """Whether an alert is one `account`'s digest holds: with several accounts, its own (its
        `account` label) and those of rules not split by account that count it (a threshold rule
        unless its `where` names other accounts, a budget rule unless its budget spans others);
        with one, every alert (an `account` label there is one a rule's `labels` set)."""
        if not self.config.several:
            return lambda alert: True
        rules, shared = self._rules_by_id, self._shared_by_name

        def counts(alert: Alert) -> bool:
            if ACCOUNT in alert.labels:
                return alert.labels[ACCOUNT] == account
            rule = rules.get(alert.rule)
            if isinstance(rule, ThresholdRule):
                return in_scope(rule.where.get(ACCOUNT), account)
            if isinstance(rule, BudgetRule) and rule.budget in shared:
                return shared[rule.budget].spans(account)
            return True  # (a rule no longer configured: its alert is told where it was)

        return counts

    @cached_property
    def _rules_by_id(self) -> Mapping[str, RuleConfig]:
        """The config's rules by id (made once: a reload builds new sources, and a round of digests
        asks for every account)."""
        rules = self.config.alerts.rules
        return dict(zip(rule_ids(rules), rules, strict=True))

    @cached_property
    def _shared_by_name(self) -> Mapping[str, BudgetConfig]:
        return {budget.name: budget for budget in self.config.shared_budgets}

    def digest_span(self, sent_on: dt.date, schedule: str) -> tuple[float, float]:
        """The timestamps the digest sent on `sent_on` covers: [start, end)."""
        first, day = span(schedule, sent_on)
        return self.clock.day_start(first).timestamp(), self.clock.day_start(day + dt.timedelta(days=1)).timestamp()

    def digest_settled(
        self, sent_on: dt.date, schedule: str, account: str = "", told: AbstractSet[dt.date] | None = None
    ) -> tuple[frozenset[dt.date], frozenset[dt.date]]:
        """The settled days whose reconciliation `account`'s digest sent on `sent_on` tells, and the
        days to keep as told with it. `told`, the days its digests told before: each day is told by
        the first digest made after it was judged, whether digests were skipped meanwhile (a daemon
        down at their time), their time moved or a day judged late (its usage read later), up to
        TOLD_BACK days back. None (none kept yet: the first digest, or one the command makes): the
        days that settled since the digest before by the schedule, every day before them kept as
        told (those judged later too: the settled days read after a first start are not told), and
        those of them judged by then. A day is told once it has settled by the digest's time
        (`reconciliation.settle`)."""
        at = self.config.digest.time if self.config.digest is not None else (9, 0)
        sent_at = self.clock.at(sent_on, *at)
        settle = dt.timedelta(seconds=self.config.reconciliation.settle)
        last = sent_on
        while settled_at(self.clock, last, settle) > sent_at:
            last -= dt.timedelta(days=1)
        result = self.accounts[account].latest.reconciliation
        judged: set[dt.date] = set()
        if result is not None:
            judged = {g.day for g in result.tokens if g.day <= last} | {g.day for g in result.amounts if g.day <= last}
        if told is None:
            first_day, final_day = span(schedule, sent_on)
            width = (final_day - first_day).days + 1
            window = {last - dt.timedelta(days=n) for n in range(width)}
            before = {last - dt.timedelta(days=n) for n in range(width, TOLD_BACK + 1)}  # judged or not
            return frozenset(window), frozenset(judged | before)
        oldest = last - dt.timedelta(days=TOLD_BACK)
        new = frozenset(day for day in judged if day > oldest and day not in told)
        return new, new

    def digest(
        self,
        sent_on: dt.date,
        schedule: str,
        url: str,
        *,
        runs: Sequence[tuple[str, bool, float | None]] | None = None,
        alerts: Sequence[Alert] | None = None,
        account: str = "",
        settled: AbstractSet[dt.date] | None = None,
    ) -> dict[str, Any]:
        """The digest of one account (the only one without `accounts`) sent on `sent_on`, from what
        its sources hold now; the probe runs and alerts are this daemon's unless given (`digest`
        the command reads a daemon's file). With several accounts, it holds the alerts of that
        account and of the rules not split by account that count it (`_spanning`). `settled`: the
        settled days whose reconciliation it tells (`digest_settled`: without the days told before,
        those that settled since the digest before by the schedule)."""
        one = self.accounts[account]
        if runs is None:
            runs = one.state.probe_runs(*self.digest_span(sent_on, schedule))
        per_probe: dict[str, list[tuple[bool, float | None]]] = {name: [] for name in one.probes}
        for probe, success, ttft in runs:
            per_probe.setdefault(probe, []).append((success, ttft))
        probes = [
            ProbeStat(name, len(rs), sum(s for s, _ in rs), [t for _, t in rs if t is not None])
            for name, rs in sorted(per_probe.items())
        ]
        counts = self._counting(account)
        firing = [
            FiringAlert(a.labels, a.annotations.get("summary", ""), a.fired_at)
            for a in (self.engine.current() if alerts is None else alerts)
            if a.state == "firing" and counts(a)
        ]
        if settled is None:
            settled = self.digest_settled(sent_on, schedule, account)[0]
        anomalies = [rule for rule in self.config.alerts.rules if isinstance(rule, AnomalyRule)]
        shared = self._shared_budgets(account, ended_month(schedule, sent_on, one.latest))
        body = build(
            one.latest, schedule=schedule, sent_on=sent_on, budgets=one.config.budgets, prices=one.config.prices,
            anomalies=anomalies, alerts=firing, probes=probes, settled=settled, url=url,
            currency=one.config.billing.currency, shared=shared,
        )  # fmt: skip
        if account:
            body["account"] = account
        return body
