"""One account's sources, built from its config: the billing client, the refreshed sources and
their metrics; and the refresh the `once` and `digest` commands run with them. `app.sources`
composes the accounts with the alert engine, the notifiers and the exposition."""

from __future__ import annotations

import datetime as dt
import hashlib
import time
from collections.abc import Callable, Iterable
from functools import cached_property, partial

from prometheus_client.registry import Collector

from exporter.billing import BillingAPI, BillingClient, BillingError, BillingUnavailable, ClientClosed, RetryPolicy
from exporter.config.schema import BillingConfig, Config, ProbeConfig
from exporter.core.clock import Clock
from exporter.core.logs import get_logger
from exporter.metrics.collectors import (
    BillsCollector,
    BudgetCollector,
    ExporterCollector,
    ProbeCollector,
    ReconciliationCollector,
    UsageCollector,
)
from exporter.metrics.exposition import Exposition
from exporter.model.snapshots import Latest
from exporter.model.source_names import PROBE_PREFIX, probe_source
from exporter.sources.bills import BillsSource
from exporter.sources.history import HistorySource
from exporter.sources.probe import ProbeRunner
from exporter.sources.reconcile import SettledUsage, reconcile
from exporter.sources.usage import UsageSync
from exporter.state import StateError, StateStore

log = get_logger(__name__)

HISTORY_CHECK = 600.0
"""Seconds between looks at the history (each month is fetched once per billing day): at most
this long after midnight, the day that ended is judged for anomalies."""

PROBE_RUNS_KEPT = 12 * 86400.0
"""Seconds a probe run is kept for the digest: a weekly one may go 3.5 days late, about the week before."""


def collectors(config: Config, latest: Latest, clock: Clock, part: str = "all") -> list[Collector]:
    """One account's collectors (`part` of its ExporterCollector: `all`, or `account` without the
    process's own series, which several accounts share)."""
    return [
        BillsCollector(latest),
        UsageCollector(latest, config.billing.per_api_key, clock),
        BudgetCollector(latest, config.budgets, config.prices, clock),
        ReconciliationCollector(latest),
        ProbeCollector(latest),
        ExporterCollector(latest, clock, part=part),
    ]


def build_exposition(config: Config, latest: Latest, clock: Clock, *more: Collector) -> Exposition:
    return Exposition([*collectors(config, latest, clock), *more])


def _client_settings(billing: BillingConfig) -> dict[str, object]:
    """What the billing client and the usage sync are built from: the rest (intervals, grace days)
    changes on a reload without a new client."""
    return billing.model_dump(
        exclude={"bills_interval", "usage_interval", "previous_month_grace_days", "history_months", "currency"}
    )


BillingFactory = Callable[[BillingConfig], BillingAPI]
"""Builds the billing API for a config's `billing` section: the HTTP client in production, an
in-process fake in the unit tests."""


class HistoryBehind(BillingUnavailable):
    """The history's refresh used the months it could fetch, and missed some: a failure of the
    source (its freshness says so), not of a command that reads the history once."""


class RefreshFailed(Exception):
    """A source's refresh failed in `Sources.refresh_once`; the message names the source."""

    def __init__(self, source: str, error: BillingError) -> None:
        super().__init__(f"{source}: {error}")
        self.source = source


def account_ids(config: Config) -> dict[str, str]:
    """Each configured account's `billing_account_id`, by name ("" for the one account of a config
    without `accounts`)."""
    return {name: billing_account_id(account.billing) for name, account in config.account_configs()}


def billing_account_id(billing: BillingConfig) -> str:
    """Which billing account and project `billing` reads, whatever the account's name in the
    config: a digest of its access key id and project (what the state file keeps of them)."""
    whose = f"{billing.access_key_id}\n{billing.project_id}"
    return hashlib.blake2b(whose.encode(), digest_size=16).hexdigest()


class Account:
    """One account's sources, built from its config (`Config.account_configs`).

    Built again on each reload; what the reload does not change is carried over from `previous`
    (the billing client and its sources when `billing` is unchanged, so refreshes in flight go
    on undisturbed; a probe whose config is unchanged, with its histograms and counters).
    """

    client: BillingAPI
    bills: BillsSource
    history: HistorySource
    usage: UsageSync

    def __init__(
        self,
        name: str,
        config: Config,
        latest: Latest,
        clock: Clock,
        state: StateStore,
        retry: RetryPolicy | None = None,
        previous: Account | None = None,
        billing: BillingFactory | None = None,
        moved: bool = False,
    ) -> None:
        """`name`: the `account` label (empty for the one account of a config without `accounts`).
        `billing`: what builds the billing API when `billing` is new or changed (unless given, the
        HTTP client, with `retry`, reporting its calls and the clock skew it sees to `latest`).
        `moved`: its state file is not the one its name had (another billing account's state
        came to the name: a rename onto it, two names swapped, `files_for`)."""
        self.name = name
        self.config = config
        self.moved = moved
        """Whether another billing account's state came to this name (`files_for`): nothing the
        name showed before is this one's."""
        self.latest = latest
        self.successor: Account | None = None
        """The account a reload built in this one's place (`activate`)."""
        self.removed = False
        """Whether a reload took it out of the config (`Sources`): a refresh of it still in flight
        publishes nothing (its snapshots may be those of an account built afresh later)."""
        self._previous = previous
        if previous is not None and _client_settings(previous.config.billing) == _client_settings(config.billing):
            self.client, self.usage = previous.client, previous.usage
            self.bills, self.history = previous.bills, previous.history
        else:
            if billing is None:
                billing = partial(
                    BillingClient.from_config, clock=clock, on_response=latest.count_api_call, retry=retry,
                    on_skew=latest.observe_clock_skew,
                )  # fmt: skip
            self.client = billing(config.billing)
            if previous is not None:
                self.client.carry_over(previous.client)
            history = HistorySource(
                self.client, clock, state, config.billing.history_months,
                wide=lambda: all(
                    (health := latest.health.get(source)) is not None and health.last_success is not None
                    for source in ("bills", "usage")
                ),
            )  # fmt: skip
            # (until the history's first refresh, the months the state file holds: a forecast made at
            # start-up is the one made before it, not one without the trailing week, for a bills interval)
            self.bills = BillsSource(
                self.client, clock, config.billing.previous_month_grace_days,
                history=lambda: latest.history if latest.history is not None else history.held(),
                interval=config.forecast.interval,
            )  # fmt: skip
            self.history = history
            self.usage = UsageSync(
                self.client, clock, state, per_api_key=config.billing.per_api_key, prices=config.prices,
                skew=lambda: latest.clock_skew,
            )  # fmt: skip
            if previous is not None:
                self.usage.resyncs = previous.usage.resyncs  # a counter: it goes on across a reload
        self.clock = clock
        self.state = state
        self.settled = SettledUsage(
            self.client, clock, state,
            settle=config.reconciliation.settle,
            days_per_refresh=config.reconciliation.days_per_refresh,
            per_api_key=config.billing.per_api_key,
        )  # fmt: skip
        if previous is not None:
            self.settled.carry_over(previous.settled)
        self.probes = {probe.name: self._runner(probe, previous) for probe in config.probes}
        self._runs_refused = ""
        """The state file's refusal of the last probe run it was to keep (for the digest), if any."""
        self._measured = False
        """Whether the state file knows what each probe measures now (`_measuring`): until it does,
        no run is kept, as a later start or reload would take those of a moved probe for its old
        endpoint's and forget them."""
        self.refreshers: dict[str, Callable[[], None]] = {"bills": self._bills, "usage": self._usage}
        self.intervals = {"bills": config.billing.bills_interval, "usage": config.billing.usage_interval}
        if config.billing.history_months:
            self.refreshers["history"] = self._history
            self.intervals["history"] = HISTORY_CHECK
        for probe in config.probes:
            self.refreshers[probe_source(probe.name)] = partial(self._probe, self.probes[probe.name])
            self.intervals[probe_source(probe.name)] = probe.interval
        self.awaited = [name for name in self.refreshers if name != "history"]
        """The sources readiness waits for: all but the history. Past months feed the anomaly rules
        and, after the previous month's grace days, the forecast's trailing week (until they arrive,
        a forecast early in the month reads only the month's own days), not the figures that make
        an exporter worth scraping; at thousands of endpoints they take minutes to fetch."""

    def activate(self) -> bool:
        """Make this account's config the one its shared parts follow: the sources it carries over,
        its snapshots (`Latest.configure`), and the reconciliation (a reload's items and prices
        apply at once). Called once everything a reload builds is built, so that a reload refused
        on the way changes nothing; from then on, a refresh of the account it replaces that is
        still in flight judges with this one's config. True when the figures held were another
        project's or account's, and are forgotten (what was judged on them is not its own either)."""
        forgot, now = False, self.clock.now().timestamp()
        self.bills.grace_days = self.config.billing.previous_month_grace_days
        self.bills.interval = self.config.forecast.interval
        self.history.months = self.config.billing.history_months
        previous, self._previous = self._previous, None
        whose, self.latest.whose = self.latest.whose, (self.account_id, self.history.source)
        if previous is None:  # (at start, nothing is held; the one account back after several holds its before)
            self.latest.forget_probes(now)  # (its runners are new)
            if whose is not None and whose[0] != self.account_id:  # (another account's)
                self.latest.forget_figures(now)
                forgot = True
            elif whose is not None and whose[1] != self.history.source:
                self.latest.forget_history(now)  # (another API's months: as below)
        else:
            previous.successor = self  # (first: a refresh of it in flight publishes nothing of another project)
            renewed = [name for name, runner in self.probes.items() if previous.probes.get(name) not in (None, runner)]
            if renewed:  # (another endpoint or address: what the runs before measured is not its)
                self.latest.forget_probes(now, renewed)
            if previous.client.project_id != self.client.project_id or self.moved:
                self.latest.forget_figures(now)  # another project's, or account's: nothing of before is its own
                forgot = True
            elif previous.history.source != self.history.source:
                self.latest.forget_history(now)  # another API's months: never learnt from until fetched
        self.latest.configure(self.refreshers, now)
        self.latest.keep_history(self.config.billing.history_months)  # (fewer: they go now, the API up or not)
        self._reconcile()
        self._measuring()
        return forgot

    def _measuring(self) -> None:
        """The digest's runs of a probe moved to another endpoint or address (by a reload, or while
        the exporter was down) are forgotten, as its metrics are (`forget_probes`). A state file
        that refuses is asked again before the next run is kept (`_measured`)."""
        if self.config.inference is None:
            return
        try:
            moved = self.state.measuring({name: runner.measures for name, runner in self.probes.items()})
        except StateError as error:  # (its runs stay, the digest counts them, until it takes it: said)
            if not self._runs_refused:
                log.warning("the runs of moved probes not forgotten in the state file", error=str(error)[:200])
            self._runs_refused = str(error)
            return
        self._measured = True
        if moved:
            log.info("probe runs forgotten: the probe measures another endpoint or address", probes=", ".join(moved))

    def refresh_once(self, names: Iterable[str] | None = None) -> None:
        """Refresh each source once (those named, in the order given; else all), recording its
        health as the daemon does: what the `once` and `digest` commands run. The first failure
        stops it (RefreshFailed); a history missing some months is recorded as failed, said in the
        log, and the rest goes on with the months it has."""
        for name in self.refreshers if names is None else [n for n in names if n in self.refreshers]:
            started = time.perf_counter()
            try:
                self.refreshers[name]()
            except HistoryBehind as error:
                log.warning("history incomplete", error=str(error))
                self.latest.record(name, success=False, at=time.time(), duration=time.perf_counter() - started,
                                   error=str(error))  # fmt: skip
                continue
            except BillingError as error:
                raise RefreshFailed(name, error) from error
            self.latest.record(name, success=True, at=time.time(), duration=time.perf_counter() - started)

    def _runner(self, probe: ProbeConfig, previous: Account | None) -> ProbeRunner:
        """The same probe keeps its runner (and its histograms and counters) across a reload; how
        often it runs is not what it measures (`interval` is the schedule's alone)."""
        assert self.config.inference is not None  # the config requires it when there are probes
        kept = previous.probes.get(probe.name) if previous else None
        if (
            kept is not None
            and kept.probe.model_copy(update={"interval": probe.interval}) == probe
            and previous
            and previous.config.inference == self.config.inference
        ):
            return kept
        return ProbeRunner(probe, self.config.inference)

    def _current(self) -> Account:
        """The latest account a reload built in this one's place (this one, if none)."""
        current = self
        while current.successor is not None:
            current = current.successor
        return current

    @cached_property
    def account_id(self) -> str:
        """Which billing account and project this is, whatever its name in the config (see
        `billing_account_id`)."""
        return billing_account_id(self.config.billing)

    def replaced(self) -> bool:
        """Whether a reload has put an account of another billing project in this one's place (or
        another billing account's state came to its name: `moved`), or taken it out: what a
        refresh of it read since is not that account's to show
        (`forget_figures` dropped what was)."""
        current, moved = self, False
        while current.successor is not None:
            current = current.successor
            moved = moved or current.moved
        return current.removed or current.client.project_id != self.client.project_id or moved

    def overtaken(self, source: str) -> bool:
        """Whether what a refresh of `source` by this account did is not the account's of now to
        record: `replaced`, or, for a probe, a reload gave it another runner (another endpoint,
        scenario or address) while this one's ran."""
        if self.replaced():
            return True
        if source == "history":  # (months of another address a reload put aside: `forget_history`)
            return self._current().history.source != self.history.source
        name = source.removeprefix(PROBE_PREFIX)
        return source != name and self._current().probes.get(name) is not self.probes.get(name)

    def _publish(self, source: str = "", **figures: object) -> None:
        """Show these figures, unless `overtaken` (the `source` refreshed; `replaced` for none):
        ClientClosed then, the refresh publishes nothing, and runs again with the new client, if the
        account is still configured."""
        if not self.latest.publish(lambda: self.overtaken(source), **figures):
            raise ClientClosed("the billing project or address was changed, or the account removed (config reload)")

    def _bills(self) -> None:
        self._publish(bills=self.bills.refresh())
        self._reconcile()

    def _history(self) -> None:
        """The months fetched are used even when some are not: the refresh then fails all the same,
        so that its freshness says the history is incomplete (each month missing is tried again an
        hour later)."""
        self._publish("history", history=self.history.refresh())
        if self.history.behind:
            raise HistoryBehind(f"{', '.join(self.history.behind)} not fetched today (tried again within the hour)")

    def _usage(self) -> None:
        self._publish(usage=self.usage.refresh())
        # Then (today's figures are out already) a few settled days, each read once in full.
        today = self.clock.today()
        first = today.replace(day=1)
        if today.day <= self.config.billing.previous_month_grace_days:
            first = (first - dt.timedelta(days=1)).replace(day=1)  # the last month's last days settle now
        try:
            settled = self.settled.refresh(first)
        except StateError as error:
            log.warning("settled usage not kept: the state file refused it", error=str(error)[:200])
            return
        if settled is not self.latest.settled:  # a day read, or the window moved: judged again
            self._publish(settled=settled)
            self._reconcile()

    def _reconcile(self) -> None:
        """Judge the bills against the settled usage, with the items and prices of the config in
        force (the latest account built in this one's place, for a refresh still in flight): each
        settled day against bills asked for after it ended (a bill from before, its refresh failing
        since, is not the day's whole one)."""
        current = self._current()
        bills = self.latest.bills
        if bills is not None:
            rec = current.config.reconciliation
            final = {
                day: rows
                for day, rows in self.latest.settled.items()
                if bills.asked is None or self.clock.day_start(day + dt.timedelta(days=1)).timestamp() <= bills.asked
            }
            self._publish(reconciliation=reconcile(bills, final, rec.items, current.config.prices))

    def _probe(self, runner: ProbeRunner) -> None:
        snapshot = runner.run()
        if not self.latest.publish_probe(snapshot, lambda: self.overtaken(probe_source(runner.probe.name))):
            # A reload changed, or took out, the probe while it ran (and may have put one back under
            # its name, whose first run found this one's in the way): nothing of it is shown; the
            # probe of now runs again at once, if there is one.
            raise ClientClosed(f"probe {runner.probe.name}: changed by a config reload while it ran")
        now = self.clock.now().timestamp()
        if not self._measured:
            self._measuring()
            if not self._measured:  # (the state file refuses: said by `_measuring`)
                return
        try:  # for the digest's ratios and percentiles over a day; the metrics do not need it
            self.state.record_probe_run(
                snapshot.probe, now, snapshot.last.success, snapshot.last.time_to_first_token,
                keep_from=now - PROBE_RUNS_KEPT, measured=runner.measures,
            )  # fmt: skip
        except StateError as error:
            if str(error) != self._runs_refused:  # (said once while the state file refuses, not every run)
                log.warning("probe runs not kept for the digest: the state file refuses them", error=str(error)[:200])
            self._runs_refused = str(error)
        else:
            self._runs_refused = ""

    def changed(self, previous: Account) -> set[str]:
        """The sources whose way of refreshing this config changed (they run again at once)."""
        changed = {name for name in self.refreshers if name not in previous.refreshers}
        if self.client is not previous.client:
            changed |= {"bills", "usage", "history"} & set(self.refreshers)
        changed |= {probe_source(n) for n, r in self.probes.items() if previous.probes.get(n) is not r}
        config, before = self.config, previous.config
        if (config.forecast, config.billing.previous_month_grace_days) != (
            before.forecast,
            before.billing.previous_month_grace_days,
        ):
            changed.add("bills")  # (the forecast and the month's figures are made as the bills are read)
        if config.billing.history_months != before.billing.history_months and "history" in self.refreshers:
            # More: the months it did not hold are fetched now, not at its next look. Fewer: its health
            # is judged now on the months kept (with no request), not still failed for one it dropped.
            changed.add("history")
        return changed

    def close(self, keep: Account | None = None, cut: bool = True) -> None:
        """Release connections; what `keep` took over stays open. `cut`: the billing requests on the
        wire too (a stop), rather than leave them to end within their timeout (a reload)."""
        if keep is None or keep.client is not self.client:
            self.client.close(cut=cut)
        kept = set(map(id, keep.probes.values())) if keep else set()
        for runner in self.probes.values():
            if id(runner) not in kept:
                runner.close()
