"""Alert state and notification delivery as metrics."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from exporter.alerts.engine import Engine
from exporter.delivery.dispatcher import Dispatcher
from exporter.state import StateError, StateStore


class AlertsCollector(Collector):
    def __init__(
        self, engine: Engine, dispatcher: Dispatcher, accounts: Callable[[], Iterable[tuple[str, StateStore]]] = tuple
    ) -> None:
        """`accounts`: with several accounts, each one's name and state file (whose writes are said too)."""
        self.engine = engine
        self.dispatcher = dispatcher
        self.accounts = accounts

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
        sent = CounterMetricFamily(
            "inference_alert_notifications", "Notifications delivered (the receiver answered 2xx).", labels=["notifier"]
        )
        failed = CounterMetricFamily(
            "inference_alert_notifications_failed",
            "Failed delivery attempts (each is retried; see ..._pending).",
            labels=["notifier"],
        )
        for name in sorted(self.dispatcher.sent):
            sent.add_metric([name], self.dispatcher.sent[name])
            failed.add_metric([name], self.dispatcher.failed[name])
        discarded = CounterMetricFamily(
            "inference_alert_notifications_discarded",
            "Queued notifications never delivered: reason=notifier_removed (their notifier left the config),"
            " superseded (their alerts changed state again before delivery).",
            labels=["reason"],
        )
        for reason, count in sorted(self.dispatcher.discarded.items()):
            discarded.add_metric([reason], count)
        pending = GaugeMetricFamily(
            "inference_alert_notifications_pending",
            "Notifications in the outbox waiting for delivery.",
            labels=["notifier"],
        )
        with contextlib.suppress(StateError):  # a failing state file: its own gauge and the log say so
            backlog = self.dispatcher.pending()
            for notifier in self.dispatcher.outbox_notifiers:
                pending.add_metric([notifier.name], backlog.get(notifier.name, 0))
        state = GaugeMetricFamily(
            "inference_exporter_state_write_success",
            "1 if the last write to the state file succeeded, else 0 (alert states and the usage cursor are"
            " then not saved; the log names the file and the fault).",
        )
        state.add_metric([], 0.0 if self.engine.db.store.write_error else 1.0)
        for account, store in self.accounts():
            state.samples.append(
                Sample(state.name, {"account": account}, 0.0 if store.write_error else 1.0, None, None)
            )
        yield from (sent, failed, discarded, pending, state)

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
