"""The long-running exporter: scheduled refreshes, the HTTP server, reload and shutdown."""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger
from prometheus_client.registry import Collector

from exporter.alerts.collector import AlertsCollector
from exporter.alerts.engine import Engine
from exporter.alerts.notifiers import RESEND, Dispatcher
from exporter.billing import BillingClient, BillingError, RetryPolicy
from exporter.bills import BillsSource
from exporter.clock import Clock
from exporter.collectors import BillsCollector, BudgetCollector, ExporterCollector, ProbeCollector, UsageCollector
from exporter.config import AlertmanagerNotifier, Config, ConfigError, ProbeConfig, load
from exporter.exposition import Exposition
from exporter.logs import mask_more
from exporter.probe import ProbeRunner
from exporter.server import ExporterServer, View
from exporter.snapshots import Latest
from exporter.state import StateStore
from exporter.usage_sync import UsageSync

log = logging.getLogger(__name__)

SHUTDOWN_GRACE = 10.0
DELIVERY_INTERVAL = 5.0
JITTER_FRACTION = 0.1
MAX_JITTER = 30.0


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
            BudgetCollector(latest, config.budgets),
            ProbeCollector(latest),
            ExporterCollector(latest, clock),
            *more,
        ]
    )


class Sources:
    """Everything built from one config: the client, the sources, the alert engine, the exposition."""

    def __init__(
        self,
        config: Config,
        latest: Latest,
        clock: Clock,
        state: StateStore,
        external_url: str,
        retry: RetryPolicy | None = None,
        previous: Sources | None = None,
    ) -> None:
        self.config = config
        self.latest = latest
        self.client = BillingClient.from_config(
            config.billing, clock, latest.count_api_call, retry, on_skew=latest.observe_clock_skew
        )
        self.bills = BillsSource(self.client, clock, config.billing.previous_month_grace_days)
        self.usage = UsageSync(self.client, clock, state, per_api_key=config.billing.per_api_key, prices=config.prices)
        if previous is not None:
            self.usage.resyncs = previous.usage.resyncs  # a counter: it goes on across a reload
        self.probes = {probe.name: self._runner(probe, previous) for probe in config.probes}
        self.refreshers: dict[str, Callable[[], None]] = {"bills": self._bills, "usage": self._usage}
        self.intervals = {"bills": config.billing.bills_interval, "usage": config.billing.usage_interval}
        for probe in config.probes:
            self.refreshers[f"probe:{probe.name}"] = partial(self._probe, self.probes[probe.name])
            self.intervals[f"probe:{probe.name}"] = probe.interval
        notifiers = config.alerts.notifiers
        self.engine = Engine(
            config.alerts,
            config.budgets,
            state,
            clock,
            latest,
            sources=lambda: list(self.refreshers),
            notifiers=[n.name for n in notifiers if not isinstance(n, AlertmanagerNotifier)],
        )
        self.dispatcher = Dispatcher(
            notifiers,
            self.engine.db,
            clock,
            self.engine.current,
            external_url,
            previous.dispatcher if previous else None,
        )
        self.exposition = build_exposition(config, latest, clock, AlertsCollector(self.engine, self.dispatcher))

    def _runner(self, probe: ProbeConfig, previous: Sources | None) -> ProbeRunner:
        """The same probe keeps its runner (and its histograms and counters) across a reload."""
        assert self.config.inference is not None  # the config requires it when there are probes
        kept = previous.probes.get(probe.name) if previous else None
        if kept is not None and kept.probe == probe and previous and previous.config.inference == self.config.inference:
            return kept
        return ProbeRunner(probe, self.config.inference)

    def _bills(self) -> None:
        self.latest.bills = self.bills.refresh()

    def _usage(self) -> None:
        self.latest.usage = self.usage.refresh()

    def _probe(self, runner: ProbeRunner) -> None:
        self.latest.publish_probe(runner.run())

    def close(self, keep: Sources | None = None) -> None:
        """Release connections; runners that `keep` took over stay open."""
        self.client.close()
        self.dispatcher.close()
        kept = set(map(id, keep.probes.values())) if keep else set()
        for runner in self.probes.values():
            if id(runner) not in kept:
                runner.close()


class Daemon:
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
        self.scheduler = BackgroundScheduler(
            timezone=self.clock.tz,
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": None},
        )
        view = View(
            self.latest,
            render=lambda accept: self.sources.exposition.render(accept),
            sources=lambda: list(self.sources.refreshers),
            alerts=lambda: self.sources.engine.current(),
            budgets=lambda: self.sources.config.budgets,
            now=lambda: self.clock.now().timestamp(),
        )
        host, port = parse_listen(listen or config.server.listen)
        self.server = ExporterServer((host, port), view, config.server)
        self.sources = self._sources(config)

    def _sources(self, config: Config, previous: Sources | None = None) -> Sources:
        external_url = config.server.external_url or self.server.url
        return Sources(config, self.latest, self.clock, self.state, external_url, self.retry, previous)

    @property
    def config(self) -> Config:
        return self.sources.config

    # -- refreshing --

    def refresh(self, source: str) -> bool:
        """Refresh one source now; a failure keeps the last good snapshot. False if it failed or was busy."""
        refresher = self.sources.refreshers[source]
        lock = self._locks.setdefault(source, threading.Lock())
        if not lock.acquire(blocking=False):
            log.debug("refresh skipped source=%s reason=busy", source)
            return False
        started = time.perf_counter()
        try:
            with self._busy():
                refresher()
        except BillingError as error:
            self._failed(source, started, str(error))
            return False
        except Exception as error:  # a bug must not stop the schedule; it is logged with its traceback
            log.exception("refresh crashed source=%s", source)
            self._failed(source, started, f"internal error ({type(error).__name__})")
            return False
        else:
            self._record(source, started, success=True)
            self.sources.exposition.render()  # render the new snapshot's text here, not in a scrape
            if self._failing.pop(source, None) is not None:
                log.info("refresh recovered source=%s", source)
            self.alert_cycle()
            return True
        finally:
            lock.release()

    def _record(self, source: str, started: float, *, success: bool, error: str = "") -> None:
        at = self.clock.now().timestamp()
        self.latest.record(source, success=success, at=at, duration=time.perf_counter() - started, error=error)

    def _failed(self, source: str, started: float, error: str) -> None:
        self._record(source, started, success=False, error=error)
        if self._failing.get(source) != error:
            log.error("refresh failed source=%s error=%r (serving the last good data)", source, error)
        else:
            log.debug("refresh still failing source=%s", source)
        self._failing[source] = error

    # -- alerts --

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

    def alert_cycle(self) -> None:
        """Evaluate the rules, deliver what is due, and tell Alertmanager at once about any change.

        One cycle at a time, across reloads too: two engines must never work on one state file.
        """
        with self._busy(), self._alerts_lock:
            sources = self.sources
            try:
                changes = sources.engine.evaluate()
            except Exception:  # a bug must not stop the schedule; it is logged with its traceback
                log.exception("alert evaluation crashed")
                return
            self._deliver(sources)
            if changes:
                sources.dispatcher.resend_alertmanager()

    def deliver(self) -> None:
        with self._busy(), self._alerts_lock:
            self._deliver(self.sources)

    @staticmethod
    def _deliver(sources: Sources) -> None:
        try:
            sources.dispatcher.deliver()
        except Exception:  # a bug must not stop the schedule; it is logged with its traceback
            log.exception("notification delivery crashed")

    def _schedule(self) -> None:
        for job in self.scheduler.get_jobs():
            job.remove()
        now = dt.datetime.now(self.clock.tz)  # the scheduler runs on real time; the billing clock may not
        for source, interval in self.sources.intervals.items():
            self.scheduler.add_job(
                self.refresh,
                IntervalTrigger(seconds=interval, jitter=min(MAX_JITTER, interval * JITTER_FRACTION)),
                args=[source],
                id=source,
                next_run_time=now,
            )
        # Roll the usage day over right after the billing zone's midnight, not up to an interval later.
        self.scheduler.add_job(
            self.refresh, CronTrigger(hour=0, minute=0, second=5, timezone=self.clock.tz), args=["usage"], id="rollover"
        )
        self.scheduler.add_job(
            self.alert_cycle, IntervalTrigger(seconds=self.config.alerts.evaluation_interval), id="evaluate"
        )
        self.scheduler.add_job(self.deliver, IntervalTrigger(seconds=DELIVERY_INTERVAL), id="deliver")
        self.scheduler.add_job(
            lambda: self.sources.dispatcher.resend_alertmanager(), IntervalTrigger(seconds=RESEND), id="alertmanager"
        )

    # -- lifecycle --

    def start(self, schedule: bool = True) -> None:
        """Serve HTTP and, unless `schedule` is False (tests drive it by hand then), run the jobs."""
        self.server.start()
        if schedule:
            self._schedule()
            self.scheduler.start()
        log.info("listening url=%s sources=%s", self.server.url, ",".join(self.sources.refreshers))

    def reload(self) -> bool:
        """Load the config file again; a bad one is refused and the running one kept."""
        if self.config_path is None:
            return False
        try:
            config = load(self.config_path)
        except ConfigError as error:
            log.error("config reload refused (keeping the running config): %s", "; ".join(error.details))
            self.latest.reloaded(success=False)
            return False
        if config.server != self.config.server:
            log.warning("config reload: server settings change only on restart")
        if config.state != self.config.state:
            log.warning("config reload: state.path changes only on restart")
        if config.billing.timezone != self.config.billing.timezone:
            log.error("config reload refused: billing.timezone changes only on restart (the days would disagree)")
            self.latest.reloaded(success=False)
            return False
        mask_more(config.secret_values())
        with self._alerts_lock:  # the new engine loads the alert state no evaluation is writing
            old = self.sources
            self.sources = self._sources(config, old)
        self.latest.forget(set(old.refreshers) - set(self.sources.refreshers))
        threading.Thread(target=old.close, args=(self.sources,), name="close-old-sources", daemon=True).start()
        if self.scheduler.running:
            self._schedule()
        self.latest.reloaded(success=True)
        log.info("config reloaded path=%s", self.config_path)
        return True

    def stop(self, grace: float = SHUTDOWN_GRACE) -> bool:
        """Stop scheduling, close the server; wait up to `grace` for refreshes in flight. True if none is left."""
        if self.scheduler.running:
            self.scheduler.shutdown(wait=False)
        self.server.stop()
        self.sources.close()
        deadline = time.monotonic() + grace
        with self._idle:
            while self._active and time.monotonic() < deadline:
                self._idle.wait(deadline - time.monotonic())
            finished = self._active == 0
        if finished:
            self.state.close()
        else:
            log.warning("abandoning a refresh still in flight after %.0fs", grace)
        return finished
