"""The long-running exporter: scheduled refreshes, the HTTP server, reload and shutdown."""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

from apscheduler.events import EVENT_JOB_MAX_INSTANCES, JobSubmissionEvent
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.interval import IntervalTrigger
from prometheus_client.registry import Collector

from exporter.alerts.engine import Alert, Engine
from exporter.billing import BillingClient, BillingError, ClientClosed, RetryPolicy
from exporter.config.load import ConfigError, load
from exporter.config.schema import AnomalyRule, BillingConfig, Config, DigestConfig, ProbeConfig
from exporter.core.clock import Clock, day_start
from exporter.core.logs import get_logger, mask_more
from exporter.delivery.dispatcher import Dispatcher
from exporter.digest.build import FiringAlert, ProbeStat, build, span
from exporter.metrics.alerts import AlertsCollector
from exporter.metrics.collectors import (
    BillsCollector,
    BudgetCollector,
    ExporterCollector,
    ProbeCollector,
    ReconciliationCollector,
    UsageCollector,
)
from exporter.metrics.exposition import Exposition
from exporter.model.signals import todays_bills, todays_history
from exporter.model.snapshots import Latest, probe_source
from exporter.notifiers.registry import outbox
from exporter.sources.bills import BillsSource
from exporter.sources.history import HistorySource
from exporter.sources.probe import ProbeRunner
from exporter.sources.reconcile import SettledUsage, reconcile
from exporter.sources.usage import UsageSync
from exporter.state import AlertStore, StateError, StateStore
from exporter.web.server import Credentials, ExporterServer, TlsError, View

log = get_logger(__name__)

SHUTDOWN_GRACE = 10.0


class _SkippedRunNotice(logging.Filter):
    """APScheduler warns when a run is skipped because the previous one still runs; for a slow
    source that is normal, so the daemon says it itself, at debug, naming the source."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "maximum number of running instances reached" not in str(record.msg)


SKIPPED_RUN_NOTICE = _SkippedRunNotice()
HISTORY_CHECK = 600.0
"""Seconds between looks at the history (each month is fetched once per billing day): at most
this long after midnight, the day that ended is judged for anomalies."""
PROBE_RUNS_KEPT = 12 * 86400.0
"""Seconds a probe run is kept for the digest: a weekly one may go 3.5 days late, about the week before."""
DIGEST_WAIT = 3600.0
"""Seconds a due digest waits for the day's bills (and history), from its time or from the start if
later, before it goes with what there is."""
JITTER_FRACTION = 0.1
MAX_JITTER = 30.0
ROLLOVER_USAGE = dt.timedelta(seconds=5)
"""How long into a billing day the usage day is rolled over."""
ROLLOVER_BILLS = dt.timedelta(seconds=10)
"""How long into a billing day its bills are fetched."""


class DailyTrigger(BaseTrigger):  # type: ignore[misc]  # APScheduler has no type hints
    """Fires once on each day of `tz`, `delay` after the day's first instant.

    Not a CronTrigger(hour=0, …): APScheduler 3.11's skips the day after a spring-forward (New York, Berlin,
    Sydney) and never returns on a midnight that repeats (Havana); its CalendarIntervalTrigger skips the days
    whose midnight does not exist (Santiago, Beirut).
    """

    def __init__(self, tz: ZoneInfo, delay: dt.timedelta) -> None:
        self.tz = tz
        self.delay = delay

    def get_next_fire_time(self, previous_fire_time: dt.datetime | None, now: dt.datetime) -> dt.datetime:
        """The first run after `previous_fire_time` (the next day's, even if that is past: the scheduler coalesces
        missed runs); for a job starting, the first at or after `now`."""
        after = previous_fire_time or now
        day = (after.astimezone(dt.UTC) - self.delay).astimezone(self.tz).date() - dt.timedelta(days=1)
        while True:
            fire = day_start(day, self.tz) + self.delay  # (in UTC: elapsed time, whatever the clocks do)
            if fire > previous_fire_time if previous_fire_time is not None else fire >= now:
                return fire.astimezone(self.tz)
            day += dt.timedelta(days=1)

    def __str__(self) -> str:
        return f"daily, {self.delay} into the day in {self.tz.key}"


def digest_due(config: DigestConfig, now: dt.datetime, clock: Clock) -> dt.date | None:
    """The day whose digest is due at `now`: the last scheduled time passed, if it is at most half
    a period ago (a digest missed for longer is skipped: the next one is nearer)."""
    hour, minute = config.time
    today = clock.today()
    period = 7 if config.schedule == "weekly" else 1
    for back in range(period + 1):
        day = today - dt.timedelta(days=back)
        if config.schedule == "weekly" and day.weekday() != 0:
            continue
        scheduled = clock.day_start(day) + dt.timedelta(hours=hour, minutes=minute)
        if scheduled <= now:
            return day if now - scheduled <= dt.timedelta(days=period / 2) else None
    return None


def parse_listen(address: str) -> tuple[str, int]:
    """`:9877`, `127.0.0.1:9877` or `[::1]:9877` → (host, port); an empty host means every address."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"listen address {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def build_exposition(config: Config, latest: Latest, clock: Clock, *more: Collector) -> Exposition:
    return Exposition(
        [
            BillsCollector(latest),
            UsageCollector(latest, config.billing.per_api_key),
            BudgetCollector(latest, config.budgets, config.prices, clock),
            ReconciliationCollector(latest),
            ProbeCollector(latest),
            ExporterCollector(latest, clock),
            *more,
        ]
    )


def _client_settings(billing: BillingConfig) -> dict[str, object]:
    """What the billing client and the usage sync are built from: the rest (intervals, grace days)
    changes on a reload without a new client."""
    return billing.model_dump(
        exclude={"bills_interval", "usage_interval", "previous_month_grace_days", "history_months"}
    )


class Sources:
    """Everything built from one config: the client, the sources, the alert engine, the exposition.

    Built again on each reload; what the reload does not change is carried over from `previous`
    (the billing client and its sources when `billing` is unchanged, so refreshes in flight go
    on undisturbed; a probe whose config is unchanged, with its histograms and counters).
    """

    client: BillingClient
    bills: BillsSource
    history: HistorySource
    usage: UsageSync

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
    ) -> None:
        """`dispatcher`: the daemon's, which outlives reloads; without one (`once`), one that
        delivers only when asked."""
        self.config = config
        self.latest = latest
        # One AlertStore for the engine and the dispatcher: the daemon's (its dispatcher's), or a new one.
        alert_store = dispatcher.store if dispatcher is not None else AlertStore(state)
        # First, since it reads the state file (which may fail): nothing else is built in vain then.
        self.engine = Engine(
            config.alerts,
            config.budgets,
            alert_store,
            clock,
            latest,
            sources=lambda: list(self.refreshers),
            notifiers=[n.name for n in config.alerts.notifiers if outbox(n) is not None],
            history=config.billing.history_months > 0,
            prices=config.prices,
        )
        if previous is not None and _client_settings(previous.config.billing) == _client_settings(config.billing):
            self.client, self.usage = previous.client, previous.usage
            self.bills, self.history = previous.bills, previous.history
            self.bills.grace_days = config.billing.previous_month_grace_days
            self.history.months = config.billing.history_months
        else:
            self.client = BillingClient.from_config(
                config.billing, clock, latest.count_api_call, retry, on_skew=latest.observe_clock_skew
            )
            self.bills = BillsSource(
                self.client, clock, config.billing.previous_month_grace_days, history=lambda: latest.history
            )
            self.history = HistorySource(self.client, clock, state, config.billing.history_months)
            self.usage = UsageSync(
                self.client, clock, state, per_api_key=config.billing.per_api_key, prices=config.prices
            )
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
        self.probes = {probe.name: self._runner(probe, previous) for probe in config.probes}
        self.refreshers: dict[str, Callable[[], None]] = {"bills": self._bills, "usage": self._usage}
        self.intervals = {"bills": config.billing.bills_interval, "usage": config.billing.usage_interval}
        if config.billing.history_months:
            self.refreshers["history"] = self._history
            self.intervals["history"] = HISTORY_CHECK
        else:
            latest.history = None  # (a reload that turns it off: nothing stale is judged on)
        for probe in config.probes:
            self.refreshers[probe_source(probe.name)] = partial(self._probe, self.probes[probe.name])
            self.intervals[probe_source(probe.name)] = probe.interval
        if dispatcher is None:
            dispatcher = Dispatcher(config.alerts.notifiers, alert_store, clock, self.engine.current, external_url)
        self.dispatcher = dispatcher
        self.exposition = build_exposition(config, latest, clock, AlertsCollector(self.engine, dispatcher))
        self._reconcile()  # a reload's items and prices apply at once

    def _runner(self, probe: ProbeConfig, previous: Sources | None) -> ProbeRunner:
        """The same probe keeps its runner (and its histograms and counters) across a reload."""
        assert self.config.inference is not None  # the config requires it when there are probes
        kept = previous.probes.get(probe.name) if previous else None
        if kept is not None and kept.probe == probe and previous and previous.config.inference == self.config.inference:
            return kept
        return ProbeRunner(probe, self.config.inference)

    def _bills(self) -> None:
        self.latest.bills = self.bills.refresh()
        self._reconcile()

    def _history(self) -> None:
        self.latest.history = self.history.refresh()

    def _usage(self) -> None:
        self.latest.usage = self.usage.refresh()
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
            self.latest.settled = settled
            self._reconcile()

    def _reconcile(self) -> None:
        if self.latest.bills is not None:
            rec = self.config.reconciliation
            self.latest.reconciliation = reconcile(
                self.latest.bills, self.latest.settled, rec.items, self.config.prices
            )

    def _probe(self, runner: ProbeRunner) -> None:
        snapshot = runner.run()
        self.latest.publish_probe(snapshot)
        now = self.clock.now().timestamp()
        try:  # for the digest's ratios and percentiles over a day; the metrics do not need it
            self.state.record_probe_run(
                snapshot.probe, now, snapshot.last.success, snapshot.last.time_to_first_token,
                keep_from=now - PROBE_RUNS_KEPT,
            )  # fmt: skip
        except StateError as error:
            log.warning("probe run not kept for the digest: the state file refused it", error=str(error)[:200])

    def digest_span(self, sent_on: dt.date, schedule: str) -> tuple[float, float]:
        """The timestamps the digest sent on `sent_on` covers: [start, end)."""
        first, day = span(schedule, sent_on)
        return self.clock.day_start(first).timestamp(), self.clock.day_start(day + dt.timedelta(days=1)).timestamp()

    def digest(
        self,
        sent_on: dt.date,
        schedule: str,
        url: str,
        *,
        runs: Sequence[tuple[str, bool, float | None]] | None = None,
        alerts: Sequence[Alert] | None = None,
    ) -> dict[str, Any]:
        """The digest sent on `sent_on` from what this config's sources hold now; the probe runs
        and alerts are this daemon's unless given (`digest` the command reads a daemon's file)."""
        if runs is None:
            runs = self.state.probe_runs(*self.digest_span(sent_on, schedule))
        per_probe: dict[str, list[tuple[bool, float | None]]] = {name: [] for name in self.probes}
        for probe, success, ttft in runs:
            per_probe.setdefault(probe, []).append((success, ttft))
        probes = [
            ProbeStat(name, len(rs), sum(s for s, _ in rs), [t for s, t in rs if s and t is not None])
            for name, rs in sorted(per_probe.items())
        ]
        firing = [
            FiringAlert(a.labels, a.annotations.get("summary", ""), a.fired_at)
            for a in (self.engine.current() if alerts is None else alerts)
            if a.state == "firing"
        ]
        at = self.config.digest.time if self.config.digest is not None else (9, 0)
        sent_at = self.clock.day_start(sent_on) + dt.timedelta(hours=at[0], minutes=at[1])
        settle = dt.timedelta(seconds=self.config.reconciliation.settle)
        last = sent_on
        while self.clock.day_start(last + dt.timedelta(days=1)) + settle > sent_at:
            last -= dt.timedelta(days=1)
        first_day, final_day = span(schedule, sent_on)
        settled = (last - (final_day - first_day), last)  # the days whose settling this digest is the first to see
        anomalies = [rule for rule in self.config.alerts.rules if isinstance(rule, AnomalyRule)]
        return build(
            self.latest, schedule=schedule, sent_on=sent_on, budgets=self.config.budgets, prices=self.config.prices,
            anomalies=anomalies, alerts=firing, probes=probes, settled=settled, url=url,
        )  # fmt: skip

    def changed(self, previous: Sources) -> set[str]:
        """The sources whose way of refreshing this config changed (they run again at once)."""
        changed = {name for name in self.refreshers if name not in previous.refreshers}
        if self.client is not previous.client:
            changed |= {"bills", "usage", "history"} & set(self.refreshers)
        changed |= {probe_source(n) for n, r in self.probes.items() if previous.probes.get(n) is not r}
        return changed

    def close(self, keep: Sources | None = None) -> None:
        """Release connections; what `keep` took over stays open."""
        if keep is None or keep.client is not self.client:
            self.client.close()
        kept = set(map(id, keep.probes.values())) if keep else set()
        for runner in self.probes.values():
            if id(runner) not in kept:
                runner.close()


class Daemon:
    """The scheduler's refreshes, the alert worker, the notifiers' workers and the HTTP server.

    Nothing here waits on anything slower than itself: a refresh only wakes the alert worker,
    the alert worker only queues notifications, and each notifier delivers on its own thread.
    """

    def __init__(
        self,
        config: Config,
        *,
        config_path: str | Path | None = None,
        clock: Clock | None = None,
        listen: str | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.config_path = config_path
        self.retry = retry
        self.clock = clock or Clock(config.billing.zone)
        self.latest = Latest()
        self.state = StateStore(config.state.path)
        self._locks: dict[str, threading.Lock] = {}
        self._active = 0
        self._idle = threading.Condition()
        self._failing: dict[str, str] = {}
        self._alerts_lock = threading.Lock()
        self._alerts_due = threading.Event()
        self._alerts_error = ""
        self._digest_error = ""
        self._stopping = threading.Event()
        self._started = self.clock.now()
        self._intervals: dict[str, float] = {}
        self._again: set[str] = set()
        """Sources to refresh once more as soon as the run in flight ends (a reload changed them)."""
        self.scheduler = BackgroundScheduler(
            timezone=self.clock.tz,
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": None},
        )
        self.scheduler.add_listener(self._skipped, EVENT_JOB_MAX_INSTANCES)
        scheduler_log = logging.getLogger("apscheduler.scheduler")
        if SKIPPED_RUN_NOTICE not in scheduler_log.filters:
            scheduler_log.addFilter(SKIPPED_RUN_NOTICE)
        view = View(
            self.latest,
            render=lambda accept: self.sources.exposition.render(accept),
            render_gzipped=lambda accept: self.sources.exposition.render(accept, gzipped=True),
            sources=lambda: list(self.sources.refreshers),
            alerts=lambda: self.sources.engine.current(),
            budgets=lambda: self.sources.config.budgets,
            prices=lambda: self.sources.config.prices,
            today=self.clock.today,
            now=lambda: self.clock.now().timestamp(),
        )
        host, port = parse_listen(listen or config.server.listen)
        self.server = ExporterServer((host, port), view, config.server)
        self._listen = None if listen else config.server.listen
        """The configured address the server listens on; None when `--listen` overrides the config's."""
        self.dispatcher = Dispatcher(
            config.alerts.notifiers,
            AlertStore(self.state),
            self.clock,
            lambda: self.sources.engine.current(),
            self._external_url(config),
        )
        self.sources = Sources(config, self.latest, self.clock, self.state, retry=retry, dispatcher=self.dispatcher)
        self._alert_worker = threading.Thread(target=self._alert_loop, name="alerts", daemon=True)

    def _external_url(self, config: Config) -> str:
        return config.server.external_url or self.server.url

    @property
    def config(self) -> Config:
        return self.sources.config

    # -- refreshing --

    def refresh(self, source: str, *, again: bool = False) -> bool:
        """Refresh one source now; a failure keeps the last good snapshot. False if it failed or was busy.

        `again`: this run must happen (the config changed); if a run is in flight, that run starts
        another when it ends.
        """
        sources = self.sources
        refresher = sources.refreshers.get(source)
        if refresher is None:
            return False  # a reload removed it
        lock = self._locks.setdefault(source, threading.Lock())
        if not lock.acquire(blocking=False):
            if not again:
                log.debug("refresh skipped", source=source, reason="busy")
                return False
            self._again.add(source)
            if not lock.acquire(blocking=False):  # (tried again: the run in flight may have just ended)
                return False
        self._again.discard(source)
        started = time.perf_counter()
        try:
            with self._busy():
                refresher()
        except ClientClosed:
            # A reload (or the shutdown) closed the client mid-refresh: nothing wrong with the source,
            # so its health stays as it was (its age keeps growing); after a reload it runs again at
            # once with the new client.
            if self._stopping.is_set():
                log.info("refresh abandoned: shutting down", source=source)
            else:
                log.info("refresh abandoned: the config was reloaded; it runs again now", source=source)
                self._again.add(source)
            return False
        except (BillingError, StateError) as error:
            self._failed(source, started, str(error))
            return False
        except Exception as error:  # a bug must not stop the schedule; it is logged with its traceback
            log.exception("refresh crashed", source=source)
            self._failed(source, started, f"internal error ({type(error).__name__})")
            return False
        else:
            self._record(source, started, success=True)
            sources.exposition.prepare()  # render and compress the new snapshot here, not in a scrape
            if self._failing.pop(source, None) is not None:
                log.info("refresh recovered", source=source)
            self._alerts_due.set()
            return True
        finally:
            lock.release()
            if source in self._again:
                self._run_soon(source)

    def _record(self, source: str, started: float, *, success: bool, error: str = "") -> None:
        at = self.clock.now().timestamp()
        self.latest.record(source, success=success, at=at, duration=time.perf_counter() - started, error=error)

    def _failed(self, source: str, started: float, error: str) -> None:
        self._record(source, started, success=False, error=error)
        if self._failing.get(source) != error:
            served = "serving the last good data" if self.latest.health[source].last_success else "no data yet"
            log.error("refresh failed", source=source, error=error, serving=served)
        else:
            log.debug("refresh still failing", source=source)
        self._failing[source] = error

    @contextmanager
    def _busy(self) -> Iterator[None]:
        """Counts work in flight, so that `stop` waits for it (and closes the state file after it)."""
        with self._idle:
            self._active += 1
        try:
            yield
        finally:
            with self._idle:
                self._active -= 1
                self._idle.notify_all()

    # -- alerts --

    def _alert_loop(self) -> None:
        """Evaluates after each successful refresh and every `evaluation_interval`."""
        while not self._stopping.is_set():
            self._alerts_due.wait(self.config.alerts.evaluation_interval)
            self._alerts_due.clear()
            if not self._stopping.is_set():
                self.alert_cycle()

    def alert_cycle(self) -> None:
        """Evaluate the rules now and hand what changed to the notifiers' workers (never waits on them).

        One cycle at a time, across reloads too: two engines must never work on one state file.
        """
        with self._busy(), self._alerts_lock:
            if self._stopping.is_set():  # the state file is about to close
                return
            try:
                changes = self.sources.engine.evaluate()
            except StateError as error:
                if self._alerts_error != str(error):
                    log.error("alert evaluation failed (alert states unchanged)", error=str(error))
                self._alerts_error = str(error)
                return
            except Exception:  # a bug must not stop the schedule; it is logged with its traceback
                log.exception("alert evaluation crashed")
                return
            if self._alerts_error:
                log.info("alert evaluation recovered")
                self._alerts_error = ""
        self.digest_cycle()
        self.dispatcher.poke()
        if changes:
            self.dispatcher.resend()

    def digest_cycle(self) -> bool:
        """Queue the digest when its time has come and it was not queued before (once per day or
        week, across restarts: one missed while the daemon was down goes late, up to half its
        period late). It waits for today's bills (and history) up to DIGEST_WAIT from its time or
        from the start, whichever is later. True if queued; never raises (alerting goes on)."""
        try:
            return self._digest()
        except Exception:  # a bug here must not stop the alert worker; it is logged with its traceback
            log.exception("digest crashed")
            return False

    def _digest(self) -> bool:
        config = self.config.digest
        if config is None or self._stopping.is_set():  # (stopping: the state file is about to close)
            return False
        now = self.clock.now()
        sent_on = digest_due(config, now, self.clock)
        if sent_on is None:
            return False
        key = f"{config.schedule}:{sent_on.isoformat()}"
        with self._busy():
            try:
                if self.dispatcher.store.digest_made(key):
                    return False
                scheduled = self.clock.day_start(sent_on) + dt.timedelta(hours=config.time[0], minutes=config.time[1])
                waited_from = max(scheduled, self._started)
                if not self._digest_ready() and now < waited_from + dt.timedelta(seconds=DIGEST_WAIT):
                    return False
                body = self.sources.digest(sent_on, config.schedule, self._external_url(self.config))
                # For the notifiers configured now: a reload meanwhile may have removed one (and
                # dropped its queue), which a digest queued after it must not fill again.
                with self._alerts_lock:
                    current = {n.name for n in self.dispatcher.outbox_notifiers}
                    names = [name for name in config.notifiers if name in current]
                    queued = self.dispatcher.store.enqueue_digest(key, names, body, now.timestamp())
            except StateError as error:
                if self._digest_error != str(error):
                    log.error("digest not queued: the state file refused it (tried again each evaluation)",
                              error=str(error))  # fmt: skip
                self._digest_error = str(error)
                return False
        if self._digest_error:
            log.info("digest queueing recovered")
            self._digest_error = ""
        if queued:
            log.info("digest queued", day=body["day"], schedule=config.schedule, notifiers=",".join(config.notifiers))
            self.dispatcher.poke()
        return queued

    def _digest_ready(self) -> bool:
        """Today's bills are in, and today's history when there is one: the day summarised is complete."""
        if not todays_bills(self.latest, self.clock):
            return False
        return self.config.billing.history_months == 0 or todays_history(self.latest, self.clock)

    def deliver(self) -> None:
        """Deliver what is due here and now (the workers do it by themselves; tests and the soak
        call this to know delivery has happened)."""
        with self._busy():
            self.dispatcher.deliver()

    # -- scheduling --

    def _schedule(self) -> None:
        """Bring the jobs in line with the config: a source whose interval is unchanged keeps its
        schedule (a reload does not make every source run at once); new sources run now."""
        now = dt.datetime.now(self.clock.tz)  # the scheduler runs on real time; the billing clock may not
        wanted = self.sources.intervals
        for source in set(self._intervals) - set(wanted):
            self.scheduler.remove_job(source)
            del self._intervals[source]
        for source, interval in wanted.items():
            trigger = IntervalTrigger(seconds=interval, jitter=min(MAX_JITTER, interval * JITTER_FRACTION))
            if source not in self._intervals:
                self.scheduler.add_job(self.refresh, trigger, args=[source], id=source, next_run_time=now)
            elif self._intervals[source] != interval:
                self.scheduler.reschedule_job(source, trigger=trigger)
            self._intervals[source] = interval

    def _reprice(self) -> None:
        """New prices: today's and yesterday's estimates change now, not at the next usage refresh.
        A refresh in flight prices its own figures with them."""
        lock = self._locks.setdefault("usage", threading.Lock())
        if not lock.acquire(blocking=False):
            self.sources.usage.prices = {p.model: p for p in self.config.prices}
            return
        try:
            snapshot = self.sources.usage.reprice(self.config.prices)
            if snapshot is not None:
                self.latest.usage = snapshot
                self.sources.exposition.prepare()
        finally:
            lock.release()
            if "usage" in self._again:  # a forced refresh found the lock taken here
                self._run_soon("usage")

    @staticmethod
    def _skipped(event: JobSubmissionEvent) -> None:
        log.debug("scheduled run skipped: the previous one is still running", source=event.job_id)

    def _run_soon(self, source: str) -> None:
        """Run `source` now, beside its schedule (a one-off job: the interval job may be the one
        still running, and APScheduler would skip it)."""
        if self.scheduler.running and not self._stopping.is_set():
            self.scheduler.add_job(
                self.refresh, args=[source], kwargs={"again": True}, id=f"{source}:again", replace_existing=True
            )

    # -- lifecycle --

    def start(self, schedule: bool = True) -> None:
        """Serve HTTP, evaluate alerts and deliver; unless `schedule` is False (tests refresh by
        hand then), run the refresh jobs."""
        self.server.start()
        self.dispatcher.start()
        self._alert_worker.start()
        if schedule:
            self._schedule()
            # Roll the usage day over right after the billing zone's midnight, not up to an interval later.
            rollover = DailyTrigger(self.clock.tz, ROLLOVER_USAGE)
            self.scheduler.add_job(self.refresh, rollover, args=["usage"], id="rollover")
            # And the new day's bills: a daily budget's figures of the day that ended are not shown as today's.
            rollover_bills = DailyTrigger(self.clock.tz, ROLLOVER_BILLS)
            self.scheduler.add_job(self.refresh, rollover_bills, args=["bills"], id="rollover-bills")
            self.scheduler.start()
        log.info("listening", url=self.server.url, sources=",".join(self.sources.refreshers))

    def reload(self) -> bool:
        """Load the config file again; a bad one is refused and the running one kept, as is one whose certificate
        or key does not load. The server's certificate, key and password apply to the next connections and
        requests (the files are read again); the listen address and state.path change only on restart, which the
        log says at warning."""
        if self.config_path is None:
            return False
        try:
            config = load(self.config_path)
        except ConfigError as error:
            log.error("config reload refused (keeping the running config)", errors="; ".join(error.details))
            self.latest.reloaded(success=False)
            return False
        if config.billing.timezone != self.config.billing.timezone:
            log.error("config reload refused: billing.timezone changes only on restart (the days would disagree)")
            self.latest.reloaded(success=False)
            return False
        mask_more(config.secret_values())
        try:  # read again even where the paths are the same: a renewed certificate often keeps them
            credentials = Credentials.load(config.server)
        except TlsError as error:
            log.error("config reload refused (keeping the running config)", error=str(error))
            self.latest.reloaded(success=False)
            return False
        if self._listen is not None and config.server.listen != self._listen:
            log.warning(
                "config reload: server.listen changes only on restart", listening=self.server.url,
                configured=config.server.listen,
            )  # fmt: skip
        if config.state != self.config.state:
            log.warning("config reload: state.path changes only on restart")
        with self._alerts_lock:  # the new engine loads the alert state no evaluation is writing
            old = self.sources
            try:
                self.sources = Sources(
                    config, self.latest, self.clock, self.state, retry=self.retry, previous=old,
                    dispatcher=self.dispatcher,
                )  # fmt: skip
            except StateError as error:
                log.error("config reload refused (keeping the running config)", error=str(error))
                self.latest.reloaded(success=False)
                return False
            self.server.use(credentials)  # (before the URL is taken: TLS may have been turned on or off)
            self.dispatcher.configure(config.alerts.notifiers, self._external_url(config))
        self.latest.forget(set(old.refreshers) - set(self.sources.refreshers))
        if config.prices != old.config.prices:
            self._reprice()
        threading.Thread(target=old.close, args=(self.sources,), name="close-old-sources", daemon=True).start()
        if self.scheduler.running:
            self._schedule()
            for source in self.sources.changed(old):
                self._run_soon(source)
        self._alerts_due.set()
        self.latest.reloaded(success=True)
        log.info("config reloaded", path=self.config_path)
        return True

    def stop(self, grace: float = SHUTDOWN_GRACE) -> bool:
        """Stop scheduling, close the server; wait up to `grace` for work in flight. True if none is left."""
        deadline = time.monotonic() + grace
        self._stopping.set()
        self._alerts_due.set()
        if self.scheduler.running:
            self.scheduler.shutdown(wait=False)
        self.server.stop()
        self.dispatcher.close()
        self.sources.close()
        finished = self.dispatcher.join(deadline - time.monotonic())
        if self._alert_worker.is_alive():
            self._alert_worker.join(max(0.0, deadline - time.monotonic()))
            finished = finished and not self._alert_worker.is_alive()
        with self._idle:
            while self._active and time.monotonic() < deadline:
                self._idle.wait(deadline - time.monotonic())
            finished = finished and self._active == 0
        if finished:
            self.state.close()
        else:
            log.warning("abandoning work still in flight", after_seconds=grace)
        return finished
