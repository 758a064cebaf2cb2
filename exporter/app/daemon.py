"""The long-running exporter: scheduled refreshes, the HTTP server, reload and shutdown."""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from apscheduler.events import EVENT_JOB_MAX_INSTANCES, JobSubmissionEvent
from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler

from exporter.app.account import Account, BillingFactory
from exporter.app.digests import DigestQueue
from exporter.app.schedule import (
    JITTER_FRACTION,
    MAX_JITTER,
    ROLLOVER_BILLS,
    ROLLOVER_USAGE,
    SKIPPED_RUN_NOTICE,
    DailyTrigger,
    SpreadInterval,
)
from exporter.app.sources import AccountStates, Sources, source_key
from exporter.billing import BillingError, ClientClosed, RetryPolicy
from exporter.config.load import ConfigError, load
from exporter.config.schema import Config
from exporter.core.clock import Clock, later
from exporter.core.logs import get_logger, mask_more
from exporter.delivery.dispatcher import Dispatcher
from exporter.model.snapshots import Latest
from exporter.state import AlertStore, StateError, StateStore
from exporter.web import Credentials, ExporterServer, TlsError, View, WebConfigError
from exporter.web.views import AccountView, ready

log = get_logger(__name__)

SHUTDOWN_GRACE = 10.0
EVALUATION_SHARE = 0.1
"""Of the alert worker's CPU, at most this share goes to evaluations woken by refreshes: after one
that took T seconds of it, the next waits T × (1 ÷ share − 1), however many refreshes asked for
one meanwhile (at most `alerts.evaluation_interval`). Each refresh of any account asks for an
evaluation of every account, so without it the evaluations' CPU would grow with the square of the
accounts; an evaluation of a few accounts, milliseconds long, waits milliseconds."""
SCHEDULER_THREADS = 1024
RUN_SOON_INSTANCES = SCHEDULER_THREADS
"""Instances of one source's run-soon job the scheduler starts at once (`_run_soon`): as many as
it has threads, since all but one return at once."""


def digest_notifiers(config: Config) -> tuple[str, ...] | None:
    """The notifiers the config's digests go to; None without `digest`."""
    return config.digest.notifiers if config.digest is not None else None


def parse_listen(address: str) -> tuple[str, int]:
    """`:9877`, `127.0.0.1:9877` or `[::1]:9877` → (host, port); an empty host means every address
    (IPv6 and IPv4). An IPv6 address is in brackets, as in a URL."""
    host, sep, port = address.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    name = host[1:-1] if bracketed else host
    if (
        not (sep and port.isascii() and port.isdigit() and int(port) <= 65535)
        or "[" in name
        or "]" in name
        or (":" in name and not bracketed)
    ):
        raise ValueError(f"listen address {address!r} is not HOST:PORT (an IPv6 address in brackets: [::1]:9877)")
    return name, int(port)


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
        web_config: str | Path | None = None,
        retry: RetryPolicy | None = None,
        billing: BillingFactory | None = None,
        serve: bool = True,
    ) -> None:
        """The HTTP server is bound here (a port in use fails now, with OSError) and serves from `start`;
        `listen` overrides `server.listen`; `web_config`, a web configuration file in exporter-toolkit's format,
        secures it instead of `server.tls` and `server.basic_auth` (WebConfigError if bad, or if the config sets
        those too), read again on each reload. `billing` builds the billing API for each new `billing`
        section (the HTTP client with `retry` unless given). `serve` False: no HTTP server at all, the
        rest as ever (the unit tests read the exposition and the landing page in process)."""
        self.config_path = config_path
        self.web_config = web_config
        self.state_path = config.state.path
        self.retry = retry
        self.billing = billing
        self.clock = clock or Clock(config.billing.zone)
        self.latest = Latest(started=self.clock.now().timestamp())  # (the billing clock's, as `data_age` reads it)
        self.state = StateStore(config.state.path)
        self._account_states = AccountStates(config.state.path)
        self._locks: dict[str, threading.Lock] = {}
        self._active = 0
        self._idle = threading.Condition()
        self._failing: dict[str, str] = {}
        self._alerts_lock = threading.Lock()
        self._alerts_due = threading.Event()
        self._alerts_error = ""
        self._stopping = threading.Event()
        self._started = self.clock.now()
        self._intervals: dict[str, float] = {}
        self._again: set[str] = set()
        """Sources to refresh once more as soon as the run in flight ends (a reload changed them)."""
        self.scheduler = BackgroundScheduler(
            timezone=self.clock.tz,
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": None},
            # A thread for every job that may run at once (one per source of each account): an
            # account whose API hangs holds its own jobs' threads, never the threads another's need.
            # Threads are made as jobs start, so the bound costs nothing until used.
            executors={"default": ThreadPoolExecutor(max_workers=SCHEDULER_THREADS)},
        )
        self.scheduler.add_listener(self._skipped, EVENT_JOB_MAX_INSTANCES)
        scheduler_log = logging.getLogger("apscheduler.scheduler")
        if SKIPPED_RUN_NOTICE not in scheduler_log.filters:
            scheduler_log.addFilter(SKIPPED_RUN_NOTICE)
        self.view = View(
            self.latest,
            render=lambda accept: self.sources.exposition.render(accept),
            render_gzipped=lambda accept: self.sources.exposition.render(accept, gzipped=True),
            sources=lambda: list(self.sources.refreshers),
            awaited=lambda: self.sources.awaited,
            alerts=lambda: self.sources.engine.current(),
            budgets=lambda: self.sources.config.budgets,
            prices=lambda: self.sources.config.prices,
            today=self.clock.today,
            now=lambda: self.clock.now().timestamp(),
            health=lambda: self.sources.health(),
            accounts=self._accounts_view,
            shared_budgets=lambda: self.sources.config.shared_budgets,
        )
        """What the HTTP server shows, read afresh on each request."""
        self._server: ExporterServer | None = None
        if serve:
            address = parse_listen(listen or config.server.listen)
            self._server = ExporterServer(address, self.view, config.server, web_config=web_config)
        self._listen = None if listen else config.server.listen
        """The configured address the server listens on; None when `--listen` overrides the config's."""
        self.dispatcher = Dispatcher(
            config.alerts.notifiers,
            AlertStore(self.state),
            self.clock,
            lambda notifier: self.sources.engine.current(notifier),
            self._external_url(config),
            routed=lambda rule: self.sources.engine.routed(rule),
            digests_to=lambda: digest_notifiers(self.sources.config if hasattr(self, "sources") else config),
            judged_first=True,
        )  # (asked once before Sources is built: configuring the dispatcher drops what a restart removed)
        self.sources = Sources(
            config, self.latest, self.clock, self.state, retry=retry, dispatcher=self.dispatcher, billing=billing,
            account_state=self._account_states.open,
        )  # fmt: skip
        self._alert_worker = threading.Thread(target=self._alert_loop, name="alerts", daemon=True)
        self._digests = DigestQueue(self.clock, self._busy, self._alerts_lock, self._stopping)

    def _accounts_view(self) -> list[AccountView] | None:
        """The accounts for the landing page; None for the one account of a config without `accounts`."""
        sources = self.sources
        if not sources.config.several:
            return None
        return [AccountView(n, a.latest, a.config.budgets, a.config.prices) for n, a in sources.accounts.items()]

    @property
    def server(self) -> ExporterServer:
        """The HTTP server; AttributeError for a daemon made with `serve` False."""
        if self._server is None:
            raise AttributeError("this daemon has no HTTP server (serve=False)")
        return self._server

    def _external_url(self, config: Config) -> str:
        return config.server.external_url or (self._server.url if self._server is not None else "")

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
        located = sources.locate(source)
        if refresher is None or located is None:
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
            self._failed(located, source, started, str(error))
            return False
        except Exception as error:  # a bug must not stop the schedule; it is logged with its traceback
            log.exception("refresh crashed", source=source)
            self._failed(located, source, started, f"internal error ({type(error).__name__})")
            return False
        else:
            self._record(located, started, success=True)
            sources.exposition.prepare(located[0].name)  # render and compress the new snapshot here, not in a scrape
            if self._failing.pop(source, None) is not None:
                log.info("refresh recovered", source=source)
            self._alerts_due.set()
            return True
        finally:
            lock.release()
            account = self.sources.accounts.get(located[0].name)
            if located[1] == "usage" and account is not None and account.usage.priced_before():
                self._priced_anew(account.name)  # (new prices came while it ran, whatever its end)
            if source in self._again:
                self._run_soon(source)

    def _record(self, located: tuple[Account, str], started: float, *, success: bool, error: str = "") -> None:
        (account, source), at = located, self.clock.now().timestamp()
        account.latest.record(
            source, success=success, at=at, duration=time.perf_counter() - started, error=error,
            replaced=lambda: account.overtaken(source),
        )  # fmt: skip

    def _failed(self, located: tuple[Account, str], source: str, started: float, error: str) -> None:
        self._record(located, started, success=False, error=error)
        account, inner = located
        health = account.latest.health.get(inner)
        if health is None:  # (not recorded: a reload removed the source, or moved the account to another project)
            return
        if self._failing.get(source) != error:
            served = "serving the last good data" if health.last_success else "no data yet"
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
        """Evaluates after successful refreshes (not before `EVALUATION_SHARE` allows) and
        `evaluation_interval` after the last evaluation."""
        not_before = 0.0
        while not self._stopping.is_set():
            interval = self.config.alerts.evaluation_interval
            if self._alerts_due.wait(interval):  # woken by a refresh (or a reload, or a stop)
                self._stopping.wait(max(not_before - time.monotonic(), 0.0))  # (those meanwhile share this one)
            self._alerts_due.clear()
            if self._stopping.is_set():
                return
            started = time.thread_time()  # (this thread's CPU: not its waits for the lock, the disk or the GIL)
            self.alert_cycle()
            rest = (time.thread_time() - started) * (1 / EVALUATION_SHARE - 1)
            not_before = time.monotonic() + min(rest, interval)

    def alert_cycle(self) -> None:
        """Evaluate the rules now and hand what changed to the notifiers' workers (never waits on them).

        One cycle at a time, across reloads too: two engines must never work on one state file.
        """
        with self._busy(), self._alerts_lock:
            if self._stopping.is_set():  # the state file is about to close
                return
            # (before: figures that come during it were not judged on; only until the first judgement)
            fresh = self.dispatcher.awaiting_judgement and ready(self.view)[0]
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
            if fresh:  # (on what readiness waits for: not usage's alone)
                self.dispatcher.judged()
        try:  # the alerts' series rendered here if they changed, not in the next scrape
            sources = self.sources  # (one reload's: the exposition and its collector together)
            sources.exposition.prepare(only=sources.alerts_collector)
        except Exception:  # a bug must not stop the alert worker; it is logged with its traceback
            log.exception("rendering the alerts' series crashed")
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
            return self._digests.queue(self.sources, self.dispatcher, self._external_url(self.config))
        except Exception:  # a bug here must not stop the alert worker; it is logged with its traceback
            log.exception("digest crashed")
            return False

    def deliver(self) -> None:
        """Deliver what is due here and now (the workers do it by themselves; tests and the soak
        call this to know delivery has happened)."""
        with self._busy():
            self.dispatcher.deliver()

    # -- scheduling --

    def _schedule(self, now: dt.datetime | None = None) -> None:
        """Bring the jobs in line with the config: a source whose interval is unchanged keeps its
        schedule (a reload does not make every source run at once); new sources run now (`now`:
        the scheduler's real time, unless a test gives it)."""
        now = now or dt.datetime.now(self.clock.tz)  # the scheduler runs on real time; the billing clock may not
        wanted = self.sources.intervals
        for source in set(self._intervals) - set(wanted):
            self.scheduler.remove_job(source)
            del self._intervals[source]
        for source, interval in wanted.items():
            # Run now, then at the source's phase: with several accounts, the n-th of N next runs
            # (N - n) ÷ N of an interval from now, so that their runs come spread over the interval.
            # (A lone account's next run is an interval away.)
            first = later(now, interval * (1 - self.sources.phases.get(source, 0.0)))
            jitter = min(MAX_JITTER, interval * JITTER_FRACTION)
            trigger = SpreadInterval(seconds=interval, jitter=jitter, start_date=first, timezone=self.clock.tz)
            if source not in self._intervals:
                self.scheduler.add_job(self.refresh, trigger, args=[source], id=source, next_run_time=now)
            elif self._intervals[source] != interval:
                self.scheduler.reschedule_job(source, trigger=trigger)
            self._intervals[source] = interval

    def _reprice(self, old: Sources) -> None:
        """New prices: today's and yesterday's estimates change now, not at the next usage refresh.
        A refresh in flight prices its own figures with them."""
        for name, account in self.sources.accounts.items():
            before = old.accounts.get(name)
            if before is None or before.config.prices == account.config.prices:
                continue
            account.usage.set_prices(account.config.prices)
            if not self._priced_anew(name):
                self._run_soon(source_key(name, "usage"))  # (the refresh in flight: new figures, at once)

    def _priced_anew(self, name: str) -> bool:
        """Today's and yesterday's usage estimates of the account `name` is now priced with the
        prices the last reload set on its usage, with no API call; False when a usage refresh is in
        flight (it prices its figures with them, or, if it began before they came, `refresh` calls
        this again as it ends, failed or not). The account is looked up here, as it is now: one a
        caller looked up before may have been replaced by a reload since (the usage lock keeps
        refreshes out, not reloads: a reload that comes after is caught as the figures are shown)."""
        key = source_key(name, "usage")
        lock = self._locks.setdefault(key, threading.Lock())
        if not lock.acquire(blocking=False):
            return False
        try:
            account = self.sources.accounts.get(name)
            snapshot = account.usage.reprice() if account is not None else None
            # (shown unless a reload to another project took the account's figures meanwhile)
            if (
                account is not None
                and snapshot is not None
                and account.latest.publish(lambda: account.overtaken("usage"), usage=snapshot)
            ):
                self.sources.exposition.prepare(name)
        finally:
            lock.release()
            if key in self._again:  # a forced refresh found the lock taken here
                self._run_soon(key)
        return True

    def _rollover(self, source: str) -> None:
        """`source` of the only account now; with several accounts, each one's beside its schedule
        (one account slow to answer delays no other's)."""
        keys = self.sources.keys(source)
        if keys == [source]:
            self.refresh(source, again=True)  # (after the scheduled run, if that one still runs)
            return
        for key in keys:
            self._run_soon(key)

    @staticmethod
    def _skipped(event: JobSubmissionEvent) -> None:
        log.debug("scheduled run skipped: the previous one is still running", source=event.job_id)

    def _run_soon(self, source: str) -> None:
        """Run `source` now, beside its schedule (a one-off job: the interval job may be the one
        still running, and APScheduler would skip it)."""
        if self.scheduler.running and not self._stopping.is_set():
            # Any number at once: `refresh` lets one run and has the others ask it to run again. With the
            # scheduler's one instance, a run asked for while the one asked for before still ran (a
            # reload's, then the run it abandoned) was skipped for good: the source waited an interval.
            self.scheduler.add_job(
                self.refresh, args=[source], kwargs={"again": True}, id=f"{source}:again", replace_existing=True,
                max_instances=RUN_SOON_INSTANCES,
            )  # fmt: skip

    # -- lifecycle --

    def start(self, schedule: bool = True) -> None:
        """Serve HTTP, evaluate alerts and deliver; unless `schedule` is False (tests refresh by
        hand then), run the refresh jobs."""
        if self._server is not None:
            self._server.start()
        self.dispatcher.start()
        self._alert_worker.start()
        if schedule:
            self._schedule()
            # Roll the usage day over right after the billing zone's midnight, not up to an interval later.
            rollover = DailyTrigger(self.clock.tz, ROLLOVER_USAGE)
            self.scheduler.add_job(self._rollover, rollover, args=["usage"], id="rollover")
            # And the new day's bills: a daily budget's figures of the day that ended are not shown as today's.
            rollover_bills = DailyTrigger(self.clock.tz, ROLLOVER_BILLS)
            self.scheduler.add_job(self._rollover, rollover_bills, args=["bills"], id="rollover-bills")
            self.scheduler.start()
        if self._server is not None:
            log.info("listening", url=self._server.url, sources=",".join(self.sources.refreshers))

    def reload(self) -> bool:
        """Load the config file again; a bad one is refused and the running one kept, as is one whose certificate
        or key does not load, or whose web configuration file (read again too) is bad. The server's certificate, key,
        password and headers apply to the next connections and requests (the files are read again); the listen
        address and state.path change only on restart, which the log says at warning."""
        if self.config_path is None:
            return False
        try:
            config = load(self.config_path)
        except ConfigError as error:
            log.error("config reload refused (keeping the running config)", errors="; ".join(error.details))
            self.latest.reloaded(success=False)
            return False
        except Exception:  # a bug in the checks: the file is refused, the daemon goes on (traceback logged)
            log.exception("config reload refused: checking the file crashed (keeping the running config)")
            self.latest.reloaded(success=False)
            return False
        if config.billing.timezone != self.config.billing.timezone:
            log.error("config reload refused: billing.timezone changes only on restart (the days would disagree)")
            self.latest.reloaded(success=False)
            return False
        mask_more(config.secret_values())
        try:  # read again even where the paths are the same: a renewed certificate often keeps them
            before = self._server.credentials if self._server is not None else None
            credentials = Credentials.load(config.server, self.web_config, before)
        except (TlsError, WebConfigError) as error:
            log.error("config reload refused (keeping the running config)", error=str(error))
            self.latest.reloaded(success=False)
            return False
        if self._server is not None and self._listen is not None and config.server.listen != self._listen:
            log.warning(
                "config reload: server.listen changes only on restart", listening=self._server.url,
                configured=config.server.listen,
            )  # fmt: skip
        if config.state != self.config.state:
            log.warning("config reload: state.path changes only on restart")
        with self._alerts_lock:  # the new engine loads the alert state no evaluation is writing
            old = self.sources
            try:
                old.engine.flush()  # the new engine reads the alerts from the state file
                self.sources = Sources(
                    config, self.latest, self.clock, self.state, retry=self.retry, previous=old,
                    dispatcher=self.dispatcher, billing=self.billing, account_state=self._account_states.open,
                )  # fmt: skip
            except StateError as error:
                log.error("config reload refused (keeping the running config)", error=str(error))
                self.latest.reloaded(success=False)
                return False
            # A source the reload took out forgets how it failed: added back and failing alike, it is logged again.
            self._failing = {
                source: error for source, error in self._failing.items() if source in self.sources.refreshers
            }
            if self._server is not None:
                self._server.use(credentials)  # (before the URL is taken: TLS may have been turned on or off)
            self.dispatcher.configure(config.alerts.notifiers, self._external_url(config))
        self._reprice(old)
        try:  # the new exposition's blocks rendered here, not in the next scrape
            self.sources.exposition.prepare()
        except Exception:  # a bug must not stop the reload half done; it is logged with its traceback
            log.exception("rendering the reloaded metrics crashed")
        threading.Thread(target=old.close, args=(self.sources,), name="close-old-sources", daemon=True).start()
        if self.scheduler.running:
            scheduled = set(self._intervals)
            self._schedule()  # (a new source's job runs now)
            for source in self.sources.changed(old) & scheduled:
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
        if self._server is not None:
            self._server.stop()
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
        if not self._alert_worker.is_alive():  # (refreshes still in flight write no alerts)
            with self._alerts_lock:
                try:
                    self.sources.engine.flush()
                except StateError as error:
                    log.warning("alerts still true not saved at stop: a hold may end early", error=str(error))
        if finished:
            self.state.close()
            self._account_states.close()
        else:
            log.warning("abandoning work still in flight", after_seconds=grace)
        return finished
