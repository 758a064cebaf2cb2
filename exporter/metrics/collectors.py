"""Snapshots → Prometheus metric families. Read-only: a scrape never calls the API."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Iterator, Mapping, Sequence
from decimal import Decimal
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from exporter.config.schema import BudgetConfig, PriceConfig
from exporter.core.clock import Clock
from exporter.metrics.runtime import build_labels
from exporter.model.snapshots import Histogram, Latest, ProbeSnapshot, UsageSnapshot, UsageTotals
from exporter.sources.budgets import current_figures, judge_scopes

CACHED = "Cached from the last successful refresh; a scrape never calls the API."


class BillsCollector(Collector):
    def __init__(self, latest: Latest) -> None:
        self.latest = latest

    def version(self) -> object:
        """What this collector's output depends on; the same object means the same text."""
        return self.latest.bills

    def collect(self) -> Iterator[Metric]:
        endpoint = GaugeMetricFamily(
            "inference_bill_endpoint_daily_payable_amount",
            f"One natural day's payable amount per endpoint (bills grouped by instance). {CACHED}",
            labels=["period", "day", "endpoint_id", "product", "project_id"],
        )
        item = GaugeMetricFamily(
            "inference_bill_item_daily_payable_amount",
            f"One natural day's payable amount per billing item. {CACHED}",
            labels=["period", "day", "item", "product", "project_id"],
        )
        usage = GaugeMetricFamily(
            "inference_bill_item_daily_usage",
            f"One natural day's usage value per billing item, as billed. {CACHED}",
            labels=["period", "day", "item", "product", "project_id"],
        )
        month_to_date = GaugeMetricFamily(
            "inference_bill_month_to_date_payable_amount",
            f"Payable amount of the month so far, summed over every billing item. {CACHED}",
            labels=["period"],
        )
        month_forecast = GaugeMetricFamily(
            "inference_bill_month_forecast_payable_amount",
            "Projected month-end payable amount: the complete days + each day left as the account's weekly rhythm and"
            f" level expect it (the median forecast). {CACHED}",
            labels=["period"],
        )
        lower = GaugeMetricFamily(
            "inference_bill_month_forecast_lower_payable_amount",
            f"Lower bound of the month-end forecast's interval (forecast.interval, 80% by default). {CACHED}",
            labels=["period"],
        )
        upper = GaugeMetricFamily(
            "inference_bill_month_forecast_upper_payable_amount",
            f"Upper bound of the month-end forecast's interval (forecast.interval, 80% by default). {CACHED}",
            labels=["period"],
        )
        snapshot = self.latest.bills
        for month in snapshot.months if snapshot else ():
            for a in month.by_endpoint:
                endpoint.add_metric([a.period, a.day.isoformat(), a.key, a.product, a.project_id], float(a.payable))
            for a in month.by_item:
                labels = [a.period, a.day.isoformat(), a.key, a.product, a.project_id]
                item.add_metric(labels, float(a.payable))
                usage.add_metric(labels, float(a.usage))
            month_to_date.add_metric([month.period], float(month.month_to_date))
            month_forecast.add_metric([month.period], float(month.forecast))
            if month.lower is not None and month.upper is not None:
                lower.add_metric([month.period], float(month.lower))
                upper.add_metric([month.period], float(month.upper))
        yield from (endpoint, item, usage, month_to_date, month_forecast, lower, upper)


USAGE_FIELDS = (
    ("inference_usage_requests", "Requests"),
    ("inference_usage_prompt_tokens", "Prompt tokens"),
    ("inference_usage_completion_tokens", "Completion tokens"),
    ("inference_usage_cached_prompt_tokens", "Prompt tokens served from cache"),
    ("inference_usage_estimated_payable_amount", "Estimated payable amount (tokens × configured prices)"),
)


class Versions(tuple[object, ...]):
    """The versions of what figures are made from: the same while each is the same object (the
    exposition caches a block while its version is the same object)."""

    def same(self, other: object) -> bool:
        """Each part's version is the same object (a day, compared by value, may be equal ones)."""
        return (
            isinstance(other, Versions)
            and len(other) == len(self)
            and all(a is b or (isinstance(a, dt.date) and a == b) for a, b in zip(self, other, strict=True))
        )

    def kept(self, before: Versions | None) -> Versions:
        """`before` while it is the same as these, else these."""
        return before if before is not None and self.same(before) else self


class UsageCollector(Collector):
    """Today's usage (and the day before's), per (endpoint, model[, API key]) as the config says. A
    snapshot counted the other way (a reload toggled `per_api_key`; a refresh of before it still
    in flight) is summed over its keys when it has them and they are not wanted, and not shown
    when they are wanted and it has not: never two series under one label set, nor a key that
    is none."""

    def __init__(self, latest: Latest, per_api_key: bool, clock: Clock) -> None:
        self.latest = latest
        self.per_api_key = per_api_key
        self.labels = ["endpoint_id", "model", "api_key"] if per_api_key else ["endpoint_id", "model"]
        self.clock = clock
        """The billing day's clock: a snapshot of a day that has ended is not today's."""
        self._version: Versions | None = None

    def version(self) -> object:
        """The billing day and the snapshot: the same object while neither changes."""
        self._version = Versions((self.clock.today(), self.latest.usage)).kept(self._version)
        return self._version

    def _rows(self, snapshot: UsageSnapshot) -> list[tuple[list[str], tuple[Any, ...]]]:
        """(labels, values) of each series `snapshot` makes under this collector's labels."""
        if snapshot.per_api_key is not None and snapshot.per_api_key != self.per_api_key:
            if self.per_api_key:
                return []  # (not known per key yet)
            summed: dict[tuple[str, str], list[Any]] = {}
            for key, totals in snapshot.totals.items():
                values = _usage_values(totals)
                found = summed.get((key.endpoint_id, key.model))
                summed[key.endpoint_id, key.model] = (
                    list(values)
                    if found is None
                    else [None if a is None or b is None else a + b for a, b in zip(found, values, strict=True)]
                )
            return [([endpoint, model], tuple(values)) for (endpoint, model), values in summed.items()]
        width = len(self.labels)
        return [
            ([key.endpoint_id, key.model, key.api_key][:width], _usage_values(totals))
            for key, totals in snapshot.totals.items()
        ]

    def collect(self) -> Iterator[Metric]:
        today_note = (
            f"today in the billing time zone, reset at the day's start (absent until the day's first refresh). {CACHED}"
        )
        today = [CounterMetricFamily(name, f"{text} {today_note}", labels=self.labels) for name, text in USAGE_FIELDS]
        previous = [
            GaugeMetricFamily(
                name.replace("inference_usage_", "inference_usage_previous_day_"),
                f"{text} of the previous billing day, final after its last full pull at the rollover.",
                labels=["day", *self.labels],
            )
            for name, text in USAGE_FIELDS
        ]
        resyncs = CounterMetricFamily(
            "inference_exporter_usage_resyncs",
            "Full re-reads of the day because the incremental view no longer matched the API's.",
        )
        snapshot = self.latest.usage
        day = self.clock.today()
        if snapshot is not None:
            # A day that has ended is not shown as today's, nor one before the day before as the day
            # before: until the next usage refresh after midnight (seconds; while the API fails, for
            # as long as it does), the counters are absent, not yesterday's.
            if snapshot.day == day:
                for labels, values in self._rows(snapshot):
                    for counter, value in zip(today, values, strict=True):
                        if value is not None:
                            counter.add_metric(labels, float(value), created=snapshot.created)
            done = snapshot.previous_day
            if done is not None and done.day == day - dt.timedelta(days=1):
                for labels, values in self._rows(done):
                    for gauge, value in zip(previous, values, strict=True):
                        if value is not None:
                            gauge.add_metric([done.day.isoformat(), *labels], float(value))
            resyncs.add_metric([], snapshot.resyncs)
        yield from today
        yield from previous
        yield resyncs


def _usage_values(t: UsageTotals) -> tuple[int, int, int, int, Decimal | None]:
    return t.requests, t.prompt_tokens, t.completion_tokens, t.cached_prompt_tokens, t.estimated_payable


def budget_families() -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
    """The budgets' families, empty: amount, used and forecast ratios, whether the scope matched."""
    amount = GaugeMetricFamily("inference_budget_amount", "Configured budget amount.", labels=["budget"])
    used = GaugeMetricFamily(
        "inference_budget_used_ratio",
        f"Payable amount of the budget's period ÷ the budget. {CACHED}",
        labels=["budget"],
    )
    forecast = GaugeMetricFamily(
        "inference_budget_forecast_ratio",
        f"Forecast payable amount at the end of the budget's period ÷ the budget. {CACHED}",
        labels=["budget"],
    )
    matched = GaugeMetricFamily(
        "inference_budget_scope_matched",
        "1 if anything the budget's source holds (bill lines, or usage records) matches its `where`, else 0:"
        f" a misspelt scope would read 0% for ever; 1 without `where`. {CACHED}",
        labels=["budget"],
    )
    return amount, used, forecast, matched


def crossing_families() -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
    """When each budget's amount is crossed at the forecast's pace, and the chance it is."""
    crossing = GaugeMetricFamily(
        "inference_budget_crossing_timestamp_seconds",
        "Start of the billing day on which the budget's period spends its amount: the day it did, or the day it"
        f" does at the forecast's pace; absent when it does not this period. {CACHED}",
        labels=["budget"],
    )
    chance = GaugeMetricFamily(
        "inference_budget_crossing_probability",
        f"Chance the budget's month ends over its amount, from the forecast's error (month budgets on bills). {CACHED}",
        labels=["budget"],
    )
    return crossing, chance


class BudgetCollector(Collector):
    def __init__(
        self,
        latest: Latest,
        budgets: Iterable[BudgetConfig],
        prices: Sequence[PriceConfig] = (),
        clock: Clock | None = None,
    ) -> None:
        self.latest = latest
        self.clock = clock
        self.budgets = tuple(budgets)
        self.prices = tuple(prices)
        self.on_usage = any(budget.on_usage for budget in self.budgets)
        self._version: Versions | None = None

    def version(self) -> object:
        """The snapshots the figures are made from, as one object while none of them changes."""
        latest = self.latest
        today = self.clock.today() if self.clock is not None else None  # a new day ends the day's figures
        current = (today, latest.bills, latest.history, *((latest.usage, latest.settled) if self.on_usage else ()))
        self._version = Versions(current).kept(self._version)
        return self._version

    def collect(self) -> Iterator[Metric]:
        amount, used, forecast, matched = budget_families()
        crossing, chance = crossing_families()
        today = self.clock.today() if self.clock is not None else None
        for budget, figures in current_figures(self.latest, self.budgets, self.prices, today):
            amount.add_metric([budget.name], float(budget.amount))
            if figures is None:
                continue
            spent, projected = figures.ratios(budget.amount)
            used.add_metric([budget.name], float(spent))
            forecast.add_metric([budget.name], float(projected))
            day = figures.crossing(budget.amount)
            if day is not None and self.clock is not None:
                crossing.add_metric([budget.name], self.clock.day_start(day).timestamp())
            probability = figures.chance(budget.amount)
            if probability is not None:
                chance.add_metric([budget.name], probability)
        for budget, found in judge_scopes(self.latest, self.budgets):
            if found is not None:
                matched.add_metric([budget.name], 1.0 if found else 0.0)
        yield from (amount, used, forecast, matched, crossing, chance)


class ReconciliationCollector(Collector):
    """Per settled day: billed against counted tokens per item, billed against estimated amounts per endpoint."""

    def __init__(self, latest: Latest) -> None:
        self.latest = latest

    def version(self) -> object:
        return self.latest.reconciliation

    def collect(self) -> Iterator[Metric]:
        result = self.latest.reconciliation
        if result is None:
            return
        billed = GaugeMetricFamily(
            "inference_reconciliation_billed_tokens",
            f"Tokens a settled day's bill charges for the item (usageValue). {CACHED}",
            labels=["day", "item"],
        )
        counted = GaugeMetricFamily(
            "inference_reconciliation_counted_tokens",
            "Tokens of the kind the item bills, counted from that day's usage records.",
            labels=["day", "item"],
        )
        token_gap = GaugeMetricFamily(
            "inference_reconciliation_token_gap_ratio",
            "(billed − counted) ÷ counted tokens of the item that day (absent when none were counted).",
            labels=["day", "item"],
        )
        amount_gap = GaugeMetricFamily(
            "inference_reconciliation_amount_gap_ratio",
            "(billed − estimated) ÷ estimated payable amount of the endpoint that day, where prices cover its models.",
            labels=["day", "endpoint_id"],
        )
        for gap in result.tokens:
            labels = [gap.day.isoformat(), gap.item]
            billed.add_metric(labels, float(gap.billed))
            counted.add_metric(labels, float(gap.counted))
            if gap.ratio is not None:
                token_gap.add_metric(labels, float(gap.ratio))
        for amount in result.amounts:
            if amount.ratio is not None:
                amount_gap.add_metric([amount.day.isoformat(), amount.endpoint_id], float(amount.ratio))
        yield from (billed, counted, token_gap, amount_gap)


class ExporterCollector(Collector):
    """The exporter's own health: per-source refresh status, API calls, build, billing calendar.

    `part`: `all`; `account` (an account's: its sources, API calls and clock skew) or `process`
    (what several accounts share: build, calendar, reloads)."""

    def __init__(self, latest: Latest, clock: Clock, part: str = "all") -> None:
        self.latest = latest
        self.clock = clock
        self.part = part
        self._version: tuple[object, ...] = ()
        if part == "account":  # (its figures move only with a refresh, an API call or the skew seen)
            self.version = self._account_version

    def _account_version(self) -> object:
        """What an account's part is made from, as one object while none of it changes."""
        latest = self.latest
        current = (latest.health, latest.api_calls_counted, latest.clock_skew)
        if not self._version or current[0] is not self._version[0] or current[1:] != self._version[1:]:
            self._version = current
        return self._version

    def collect(self) -> Iterator[Metric]:
        families = list(self._collect())
        account = {
            "inference_exporter_refresh_success",
            "inference_exporter_last_refresh_success_timestamp_seconds",
            "inference_exporter_refresh_duration_seconds",
            "inference_exporter_api_requests",
            "inference_exporter_clock_skew_seconds",
        }
        for family in families:
            if self.part == "all" or (family.name in account) == (self.part == "account"):
                yield family

    def _collect(self) -> Iterator[Metric]:
        success = GaugeMetricFamily(
            "inference_exporter_refresh_success",
            "1 if the last refresh of the source succeeded, else 0 (its figures are then the last good ones).",
            labels=["source"],
        )
        last_success = GaugeMetricFamily(
            "inference_exporter_last_refresh_success_timestamp_seconds",
            "Unix time of the source's last successful refresh; now minus this is the data's age.",
            labels=["source"],
        )
        duration = GaugeMetricFamily(
            "inference_exporter_refresh_duration_seconds", "Duration of the source's last refresh.", labels=["source"]
        )
        for source, health in sorted(self.latest.health.items()):
            success.add_metric([source], 1.0 if health.success else 0.0)
            if health.last_success is not None:
                last_success.add_metric([source], health.last_success)
            duration.add_metric([source], health.duration)
        calls = CounterMetricFamily(
            "inference_exporter_api_requests",
            "HTTP calls made to the service, by API and status code (timeout or error when no whole answer came).",
            labels=["api", "code"],
        )
        for (api, code), count in sorted(self.latest.api_calls().items()):
            calls.add_metric([api, code], count)
        build = GaugeMetricFamily(
            "inference_exporter_build_info",
            "Always 1; the exporter's version, the source revision it was built from, and the Python running it.",
            labels=["version", "revision", "python_version"],
        )
        build.add_metric(list(build_labels()), 1.0)
        today = self.clock.today()
        calendar = GaugeMetricFamily(
            "inference_billing_today_info",
            "Always 1; today's date and month in the billing time zone, for `and on(day)` in PromQL.",
            labels=["day", "period"],
        )
        calendar.add_metric([today.isoformat(), self.clock.period(today)], 1.0)
        reload_ok = GaugeMetricFamily(
            "inference_exporter_config_last_reload_successful", "1 if the last config (re)load succeeded, else 0."
        )
        reload_ok.add_metric([], 1.0 if self.latest.config_reload_success else 0.0)
        reload_time = GaugeMetricFamily(
            "inference_exporter_config_last_reload_success_timestamp_seconds",
            "Unix time of the last successful config (re)load.",
        )
        reload_time.add_metric([], self.latest.config_reload_timestamp)
        skew = GaugeMetricFamily(
            "inference_exporter_clock_skew_seconds",
            "The billing API's clock (its Date header) minus this host's; over a minute off, signatures get refused.",
        )
        if self.latest.clock_skew is not None:
            skew.add_metric([], self.latest.clock_skew)
        yield from (success, last_success, duration, calls, build, calendar, reload_ok, reload_time, skew)


PROBE_LABELS = ["probe", "endpoint_id", "scenario"]


def _buckets(histogram: Histogram) -> list[tuple[str, float]]:
    return [
        ("+Inf" if b == float("inf") else repr(b), c) for b, c in zip(histogram.bounds, histogram.counts, strict=True)
    ]


_NO_PROBE = object()
"""The version of the probes' families without samples (they never change)."""


class ProbeCollector(Collector):
    """The synthetic probes: the last run of each, and running totals since start-up."""

    def __init__(self, latest: Latest) -> None:
        self.latest = latest

    def version(self) -> object:
        return self.latest.probes

    def parts(self) -> Iterator[tuple[object, Collector]]:
        """The families without samples (every header, even with no probe), then each probe's series alone
        under its snapshot, in the order of the whole: a run replaces one probe's snapshot, so the exposition
        renders that probe's series again and joins the rest as they were, not every probe's afresh."""
        yield _NO_PROBE, _Probes({})
        for name, snapshot in sorted(self.latest.probes.items()):
            yield snapshot, _Probes({name: snapshot})

    def collect(self) -> Iterator[Metric]:
        return _Probes(self.latest.probes).collect()


class _Probes(Collector):
    """The probes' families with these probes' samples."""

    def __init__(self, probes: Mapping[str, ProbeSnapshot]) -> None:
        self.probes = probes

    def collect(self) -> Iterator[Metric]:
        def gauge(name: str, text: str, extra: list[str] | None = None) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, text, labels=PROBE_LABELS + (extra or []))

        success = gauge("inference_probe_success", "1 if the probe's last run passed every check, else 0.")
        duration = gauge("inference_probe_duration_seconds", "The probe's last run, whole request.")
        headers = gauge("inference_probe_time_to_headers_seconds", "The probe's last run: until response headers.")
        reasoning = gauge(
            "inference_probe_time_to_first_reasoning_token_seconds",
            "The last thinking run: until the first reasoning text.",
        )
        answer = gauge(
            "inference_probe_time_to_first_answer_token_seconds", "The last streamed run: until the first answer text."
        )
        gap = gauge(
            "inference_probe_max_chunk_gap_seconds", "The last streamed run: the longest silence between chunks."
        )
        rate = gauge(
            "inference_probe_output_tokens_per_second",
            "The last run: the completion tokens after the first ÷ the time from the first to the last"
            " (absent when they came within 5 ms: a burst; a long answer a proxy buffered is read in pieces"
            " and may still show a rate); not streamed, completion tokens ÷ the whole run.",
        )
        check = gauge("inference_probe_check_success", "The last run's checks, 1 passed, 0 failed.", ["check"])
        ttft = HistogramMetricFamily(
            "inference_probe_time_to_first_token_seconds",
            "Time to the first non-empty delta of streamed probe runs (vLLM's buckets, plus 2 s).",
            labels=PROBE_LABELS,
        )
        e2e = HistogramMetricFamily(
            "inference_probe_e2e_latency_seconds",
            "Whole-request latency of successful probe runs.",
            labels=PROBE_LABELS,
        )
        runs = CounterMetricFamily("inference_probe_runs", "Probe runs since start-up.", labels=PROBE_LABELS)
        failures = CounterMetricFamily(
            "inference_probe_failures", "Failed probe runs, by reason (a fixed list).", labels=[*PROBE_LABELS, "reason"]
        )
        tokens = CounterMetricFamily(
            "inference_probe_tokens", "Tokens the probes used (their own cost).", labels=[*PROBE_LABELS, "token_type"]
        )
        for name, snapshot in sorted(self.probes.items()):
            labels = [name, snapshot.endpoint_id, snapshot.scenario]
            last = snapshot.last
            success.add_metric(labels, 1.0 if last.success else 0.0)
            duration.add_metric(labels, last.duration)
            for family, value in (
                (headers, last.time_to_headers),
                (reasoning, last.time_to_first_reasoning_token),
                (answer, last.time_to_first_answer_token),
                (gap, last.max_chunk_gap),
                (rate, last.output_tokens_per_second),
            ):
                if value is not None:
                    family.add_metric(labels, value)
            for check_name, passed in sorted(last.checks.items()):
                check.add_metric([*labels, check_name], 1.0 if passed else 0.0)
            for histogram_family, histogram in ((ttft, snapshot.time_to_first_token), (e2e, snapshot.e2e_latency)):
                histogram_family.add_metric(labels, _buckets(histogram), histogram.total)
            runs.add_metric(labels, snapshot.runs)
            for reason, count in sorted(snapshot.failures.items()):
                failures.add_metric([*labels, reason], count)
            for token_type, count in sorted(snapshot.tokens.items()):
                tokens.add_metric([*labels, token_type], count)
        yield from (success, duration, headers, reasoning, answer, gap, rate, check, ttft, e2e, runs, failures, tokens)
