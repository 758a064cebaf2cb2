"""The landing page and the digest with everything firing, at N and at 10 × N endpoints: a month of bills
(every endpoint billed every day, three times its usual on the last one, so the anomaly rules find every
endpoint), every settled day disagreeing with its usage for every endpoint and item, `--rules` rules by
endpoint all firing. Each is built from snapshots made here (no server, no billing API), `--repeat` times,
and the fastest taken: what else runs on the machine only ever adds to a time.

The page and the digest must stay the same size at any endpoint count (bytes ratio ≈ 1) and take time in
proportion to it (time ratio ≈ 10).

python -m bench.landing [--endpoints 500] [--rules 10] [--repeat 3]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
from collections.abc import Callable
from decimal import Decimal

from bench.common import fastest
from exporter.alerts.alert import Alert
from exporter.config.rules import AnomalyRule
from exporter.config.schema import BudgetConfig
from exporter.digest.build import FiringAlert, ProbeStat, build
from exporter.model.snapshots import (
    AmountGap,
    BillsSnapshot,
    DailyAmount,
    Histogram,
    Latest,
    MonthBills,
    ProbeRun,
    ProbeSnapshot,
    Reconciliation,
    TokenGap,
    per_day,
)
from exporter.web import View, landing_page

DAYS = 29
"""November 2026 billed through the 29th (with more days, October's too); the weekly digest is sent
on Monday the 30th. The days reconciled: all but the two newest."""
SENT_ON = dt.date(2026, 11, 30)
ITEMS = ("ITEM_PROMPT_TOKEN", "ITEM_COMPLETION_TOKEN", "ITEM_CACHED_PROMPT_TOKEN")
PROBES = ("chat-stream", "json-mode", "thinking", "tools")
ANOMALIES = (
    AnomalyRule(alert="EndpointAnomaly", signal="spend_anomaly", by=("endpoint_id",), min_amount=Decimal(1),
                min_percent=Decimal(10)),
    AnomalyRule(alert="SpendAnomaly", signal="spend_anomaly", by=(), min_amount=Decimal(1), min_percent=Decimal(10)),
)  # fmt: skip
"""Every endpoint's last day is an anomaly, and the account's."""


def _latest(names: list[str], billed: int) -> Latest:
    days = [SENT_ON - dt.timedelta(days=d) for d in range(billed, 0, -1)]
    usual = {e: Decimal(1 + n % 7) for n, e in enumerate(names)}
    months = []
    for period in sorted({f"{d:%Y-%m}" for d in days}):
        month = [d for d in days if f"{d:%Y-%m}" == period]
        by_endpoint = tuple(
            DailyAmount(period, d, e, "inference", "proj", usual[e] * (3 if d == days[-1] else 1), Decimal(0))
            for d in month
            for e in names
        )
        total = per_day(by_endpoint)
        by_item = tuple(
            DailyAmount(period, d, i, "inference", "proj", total[d] / 3, Decimal(1000 * len(names)))
            for d in month
            for i in ITEMS
        )
        spent = sum(total.values(), Decimal(0))
        months.append(MonthBills(period, by_endpoint, by_item, spent, spent, total[month[-1]]))
    latest = Latest()
    latest.bills = BillsSnapshot(tuple(months), SENT_ON)
    settled = days[:-2]
    latest.reconciliation = Reconciliation(
        tokens=tuple(
            TokenGap(d, i, Decimal(1050), 1000 - d.day, Decimal(50 + d.day) / 1000) for d in settled for i in ITEMS
        ),
        amounts=tuple(
            AmountGap(d, e, usual[e], usual[e] * Decimal("0.97"), Decimal(n % 97 + 2) / 1000 if n % 11 else None)
            for d in settled
            for n, e in enumerate(names)
        ),
    )
    run = ProbeRun(True, None, {}, 0.4, time_to_first_token=0.2)
    latest.probes = {
        name: ProbeSnapshot(name, names[n], "chat", run if n else ProbeRun(False, "timeout", {}, 30.0), 10, {}, {},
                            Histogram((1.0,), (1,)), Histogram((1.0,), (1,)))
        for n, name in enumerate(PROBES)
    }  # fmt: skip
    return latest


def _alerts(names: list[str], rules: int, now: float) -> list[Alert]:
    return [
        Alert(
            key=f"EndpointSpend{r}/{e}", rule=f"EndpointSpend{r}",
            labels={"alertname": f"EndpointSpend{r}", "endpoint_id": e, "severity": "warning"},
            annotations={"summary": f"{e} spent over its threshold"}, state="firing",
            active_since=now - 3600 - n, value="2", last_true=now, fired_at=now - 3000 - n,
        )
        for r in range(rules)
        for n, e in enumerate(names)
    ]  # fmt: skip


def _fastest(run: Callable[[], bytes], repeat: int) -> tuple[float, int]:
    """(the fastest run's seconds, bytes made)."""
    seconds, made = fastest(run, repeat)
    return seconds, len(made)


def measure(endpoints: int, rules: int, repeat: int, billed: int = DAYS) -> dict[str, tuple[float, int]]:
    """Each of the page and the digest: (seconds to build, its bytes), the month billed through
    day `billed`."""
    names = [f"ep-{n:05d}" for n in range(endpoints)]
    now = dt.datetime.combine(SENT_ON, dt.time(9), dt.UTC).timestamp()
    latest, alerts = _latest(names, billed), _alerts(names, rules, now)
    budgets = [BudgetConfig(name="monthly", amount=Decimal(10 * endpoints * DAYS)),
               BudgetConfig(name="first", amount=Decimal(100), where={"endpoint_id": names[0]})]  # fmt: skip
    view = View(
        latest, lambda accept: (b"", ""), lambda: ["bills", "usage", "history"], alerts=lambda: alerts,
        budgets=lambda: budgets, today=lambda: SENT_ON, now=lambda: now,
    )  # fmt: skip
    firing = [FiringAlert(a.labels, a.annotations["summary"], a.fired_at) for a in alerts]
    probes = [ProbeStat(name, 288, 286, [0.3] * 286) for name in PROBES]
    settled = (SENT_ON - dt.timedelta(days=9), SENT_ON - dt.timedelta(days=3))

    def digest() -> bytes:
        body = build(latest, schedule="weekly", sent_on=SENT_ON, budgets=budgets, anomalies=ANOMALIES,
                     alerts=firing, probes=probes, settled=settled, url="http://exporter:9877")  # fmt: skip
        return json.dumps(body).encode()

    return {"page": _fastest(lambda: landing_page(view).encode(), repeat), "digest": _fastest(digest, repeat)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoints", type=int, default=500)
    parser.add_argument("--rules", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    small, large = args.endpoints, 10 * args.endpoints
    print(f"landing page and weekly digest, everything firing ({args.rules} rules by endpoint), {DAYS} days billed, "
          f"{DAYS - 2} settled days disagreeing for every endpoint; fastest of {args.repeat}")  # fmt: skip
    results = {}
    for endpoints in (small, large):
        results[endpoints] = measure(endpoints, args.rules, args.repeat)
        shown = ", ".join(f"{what} {size:,} bytes in {seconds * 1000:.0f} ms"
                          for what, (seconds, size) in results[endpoints].items())  # fmt: skip
        print(f"  {endpoints:,} endpoints ({endpoints * args.rules:,} alerts firing): {shown}")
    for what in ("page", "digest"):
        (t_small, b_small), (t_large, b_large) = results[small][what], results[large][what]
        print(f"  {what}, {large:,} ÷ {small:,}: bytes {b_large / b_small:.2f} (bounded: 1), "
              f"time {t_large / t_small:.1f} (linear: 10)")  # fmt: skip
    more = 2 * DAYS
    held = measure(small, args.rules, args.repeat, billed=more)
    for what in ("page", "digest"):
        (t_more, b_more), (t_month, b_month) = held[what], results[small][what]
        print(f"  {what} at {small:,} endpoints, {more} days billed (October's too) ÷ {DAYS}:"
              f" bytes {b_more / b_month:.2f}, time {t_more / t_month:.1f} (linear: at most 2)")  # fmt: skip


if __name__ == "__main__":
    main()
