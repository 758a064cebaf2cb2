"""Alert state and notification delivery as metrics.

At 50,000 alerts firing, rendering their series took half a second, while they change only when
the engine evaluates or reloads and Prometheus may scrape every few seconds. The collector is
therefore in two parts for the exposition (`exposition.Parted`): the alerts' series, under the
engine's `version`, rendered once per change of it; and the notification figures, small and
changing with each delivery, under a version that changes with them. A scrape with neither changed
is served from the exposition's cache, text and gzip alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from exporter.alerts.engine import Engine
from exporter.delivery.dispatcher import Dispatcher
from exporter.state import StateError, StateStore


class _AlertStates(Collector):
    """The pending and firing alerts, and the anomaly rules' last judged days."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        alerts = Metric(
            "inference_alerts",
            "1 per pending or firing alert, with the rule's and the group's labels (like Prometheus' ALERTS).",
            "gauge",
        )
        for alert in self.engine.current():
            if alert.state in ("pending", "firing"):
                alerts.add_sample("inference_alerts", {**alert.labels, "alertstate": alert.state}, 1.0)
        yield alerts
        yield from self._anomalies()

    def _anomalies(self) -> Iterator[Metric]:
        """The last judged day of each spend_anomaly rule, per group (only when there are such rules)."""
        judged = list(self.engine.judged.values())
        if not judged:
            return
        expected = Metric(
            "inference_spend_expected_daily_amount",
            "What a spend_anomaly rule's baseline expected its group to spend on the last complete day judged.",
            "gauge",
        )
        impact = Metric(
            "inference_spend_anomaly_impact_amount",
            "Actual minus expected payable amount of that day (an anomaly when it passes the rule's floors).",
            "gauge",
        )
        for rule, day, findings, account in judged:
            named = {"account": account} if account else {}
            for finding in findings:
                labels = {**named, **dict(finding.group), "alertname": rule.alert, "day": day}
                expected.add_sample("inference_spend_expected_daily_amount", labels, float(finding.judgement.expected))
                impact.add_sample("inference_spend_anomaly_impact_amount", labels, float(finding.judgement.impact))
        yield from (expected, impact)


@dataclass(frozen=True)
class _Figures:
    """What the notification families show, read at one time."""

    delivered: tuple[tuple[str, int, int], ...]
    """Per notifier, in name order: notifications sent and attempts failed."""
    discarded: tuple[tuple[str, int], ...]
    pending: tuple[tuple[str, int], ...]
    """Per outbox notifier, its backlog; none when the state file cannot say."""
    written: float
    """0.0 while a save to the state file that failed has not been made since, else 1.0."""
    accounts_written: tuple[tuple[str, float], ...]


class _Notifications(Collector):
    """The notification families of one reading of the figures: the same object, the same text."""

    def __init__(self, figures: _Figures) -> None:
        self.figures = figures

    def collect(self) -> Iterator[Metric]:
        figures = self.figures
        sent = CounterMetricFamily(
            "inference_alert_notifications", "Notifications delivered (the receiver answered 2xx).", labels=["notifier"]
        )
        failed = CounterMetricFamily(
            "inference_alert_notifications_failed",
            "Failed delivery attempts (each is retried; see ..._pending).",
            labels=["notifier"],
        )
        for name, delivered, failures in figures.delivered:
            sent.add_metric([name], delivered)
            failed.add_metric([name], failures)
        discarded = CounterMetricFamily(
            "inference_alert_notifications_discarded",
            "Queued notifications never delivered: reason=notifier_removed (their notifier left the config, or"
            " for a digest digest.notifiers), superseded (their alerts changed state again before delivery),"
            " refused (their receiver refused them outright 5 times in a row, or the email recipients still owed them"
            " for a day), unreadable (their row in the state file could not be read).",
            labels=["reason"],
        )
        for reason, count in figures.discarded:
            discarded.add_metric([reason], count)
        pending = GaugeMetricFamily(
            "inference_alert_notifications_pending",
            "Notifications in the outbox waiting for delivery.",
            labels=["notifier"],
        )
        for name, backlog in figures.pending:
            pending.add_metric([name], backlog)
        state = GaugeMetricFamily(
            "inference_exporter_state_write_success",
            "0 while a save to the state file that failed (of the usage, the alerts, the outbox...) has not"
            " been made since (an hour at most once other saves succeed), else 1 (what failed is not saved;"
            " the log names the file and the fault).",
        )
        state.add_metric([], figures.written)
        for account, written in figures.accounts_written:
            state.samples.append(Sample(state.name, {"account": account}, written, None, None))
        yield from (sent, failed, discarded, pending, state)


class AlertsCollector(Collector):
    """The alerts' series and the notification figures, in two parts (`parts`) with a version each."""

    refreshed = False
    """Its series change with evaluations, not refreshes: the alert worker prepares it (`exposition.prepare`),
    a refresh does not (its version reads the main state file, which an evaluation holds)."""

    def __init__(
        self, engine: Engine, dispatcher: Dispatcher, accounts: Callable[[], Iterable[tuple[str, StateStore]]] = tuple
    ) -> None:
        """`accounts`: with several accounts, each one's name and state file (whose writes are said too)."""
        self.engine = engine
        self.dispatcher = dispatcher
        self.accounts = accounts
        self._notifications: _Notifications | None = None
        """The figures as last read, kept while they read the same: their part and its version."""
        self._version: tuple[object, _Notifications] | None = None
        """What `version` last gave, given again while both of its halves are the same objects."""

    def version(self) -> object:
        """The engine's version and the figures' together; the same object while neither changes."""
        alerts, notifications = self.engine.version, self._notified()
        last = self._version
        if last is None or last[0] is not alerts or last[1] is not notifications:
            last = self._version = (alerts, notifications)  # (two scrapes at once may each make one: both right)
        return last

    def parts(self) -> Iterator[tuple[object, Collector]]:
        """The alerts' series under the engine's version (read before they are), then the figures
        as `version` last read them (a scrape asks it first: they are read once a scrape)."""
        yield self.engine.version, _AlertStates(self.engine)
        notifications = self._notifications or self._notified()
        yield notifications, notifications

    def collect(self) -> Iterator[Metric]:
        yield from _AlertStates(self.engine).collect()
        yield from _Notifications(self._figures()).collect()

    def _notified(self) -> _Notifications:
        """The notification figures now, as the same object as last time if they read the same."""
        figures, last = self._figures(), self._notifications
        if last is None or last.figures != figures:
            last = self._notifications = _Notifications(figures)
        return last

    def _figures(self) -> _Figures:
        dispatcher = self.dispatcher
        sent, failed, discarded = dispatcher.counts()
        pending: tuple[tuple[str, int], ...] = ()
        with contextlib.suppress(StateError):  # a failing state file: its own gauge and the log say so
            backlog = dispatcher.pending()
            pending = tuple((notifier.name, backlog.get(notifier.name, 0)) for notifier in dispatcher.outbox_notifiers)
        return _Figures(
            delivered=tuple((name, sent[name], failed.get(name, 0)) for name in sorted(sent)),
            discarded=tuple(sorted(discarded.items())),
            pending=pending,
            written=0.0 if self.engine.db.store.write_error else 1.0,
            accounts_written=tuple((account, 0.0 if store.write_error else 1.0) for account, store in self.accounts()),
        )
