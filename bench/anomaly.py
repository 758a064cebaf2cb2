"""Spend anomaly detection on six months of simulated history with known spikes: recall, false
alarms per group per 90 days, and the time to judge every day of every group.

History: `SpendModel` (±15% noise, weekly rhythm, 3% growth a month) for the default endpoints ×
items. Groups, as `spend_anomaly` rules make them: each endpoint (its items summed), each item (its
endpoints summed) and the account (""). Spikes of +60% or more land on random days after the first
three weeks, each on an endpoint, an item or the account, sized so that the usual amount of the
spiked group × (factor − 1) passes the amount floor with room to spare. A spike is found when its
own group is flagged on its day; a flag is false only when no spike touches any member of the group
on that day.

python -m bench.anomaly [--seed 7] [--seeds 10] [--spikes 12] [--min-percent 30] [--noise 0.15]
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import time
from dataclasses import dataclass
from decimal import Decimal

from exporter.model.anomaly import Judgement, contributors, judge_all
from exporter.sim import DEFAULT_ENDPOINTS, ITEMS, SpendModel, Spike

START = dt.date(2026, 5, 1)
END = dt.date(2026, 10, 31)
SPIKE_AFTER = dt.timedelta(weeks=3)
MIN_FACTOR = 1.6
MAX_FACTOR = 2.5
MIN_AMOUNT = Decimal(20)
SENSITIVITY = Decimal(3)
FLOOR_ROOM = 1.5
"""A spike's usual impact is at least this × the amount floor, so noise cannot sink it below."""
ENDPOINTS = tuple(e.endpoint_id for e in DEFAULT_ENDPOINTS)
GROUPS = (*ENDPOINTS, *ITEMS, "")


def members(group: str) -> list[tuple[str, str]]:
    """The (endpoint, item) pairs a group sums."""
    return [(e, i) for e in ENDPOINTS for i in ITEMS if group in ("", e, i)]


def days() -> list[dt.date]:
    return [START + dt.timedelta(n) for n in range((END - START).days + 1)]


def touches(spike: Spike, group: str) -> bool:
    return any(spike.group in ("", e, i) for e, i in members(group))


def make_spikes(model: SpendModel, rng: random.Random, count: int) -> list[Spike]:
    candidates = [d for d in days() if d >= START + SPIKE_AFTER]
    spikes = []
    for day in sorted(rng.sample(candidates, count)):
        group = rng.choice(GROUPS)
        usual = sum(model.usual(day, e, i) for e, i in members(group))
        factor = max(rng.uniform(MIN_FACTOR, MAX_FACTOR), 1 + FLOOR_ROOM * float(MIN_AMOUNT) / usual)
        spikes.append(Spike(day, group, round(factor, 2)))
    return spikes


def series(model: SpendModel) -> dict[str, dict[dt.date, Decimal]]:
    amounts = {(d, e, i): model.amount(d, e, i) for d in days() for e in ENDPOINTS for i in ITEMS}
    return {
        group: {d: sum((amounts[d, e, i] for e, i in members(group)), Decimal(0)) for d in days()} for group in GROUPS
    }


@dataclass(frozen=True)
class Outcome:
    seed: int
    spikes: list[Spike]
    found: list[bool]
    spike_judgements: list[Judgement | None]
    """each spike's judgement in its own group"""
    quiet_peak: Decimal
    """the highest impact percent on any group's day that no spike touches"""
    named_first: list[bool]
    """for each spike on an endpoint or an item: the account's contributors by that label name it first"""
    false_alarms: dict[str, list[dt.date]]
    flagged: dict[str, list[dt.date]]
    judged_days: dict[str, int]
    seconds: float

    @property
    def recall(self) -> float:
        return sum(self.found) / len(self.spikes)

    def per_90_days(self, group: str) -> float:
        return len(self.false_alarms[group]) / self.judged_days[group] * 90

    @property
    def worst_false_alarms(self) -> float:
        return max(self.per_90_days(g) for g in GROUPS)


def run(seed: int, spike_count: int, min_percent: Decimal, noise: float) -> Outcome:
    model = SpendModel(START, seed=seed, noise=noise)
    model.spikes = make_spikes(model, random.Random(seed), spike_count)
    by_group = series(model)
    started = time.perf_counter()
    judged = {
        g: judge_all(s, min_amount=MIN_AMOUNT, min_percent=min_percent, sensitivity=SENSITIVITY)
        for g, s in by_group.items()
    }
    seconds = time.perf_counter() - started
    flagged = {g: [d for d, j in judged[g].items() if j.anomalous] for g in GROUPS}
    found = [s.day in flagged[s.group] for s in model.spikes]
    quiet = [
        j.impact_percent
        for g in GROUPS
        for d, j in judged[g].items()
        if j.impact_percent is not None and not any(s.day == d and touches(s, g) for s in model.spikes)
    ]
    false_alarms = {
        g: [d for d in flagged[g] if not any(s.day == d and touches(s, g) for s in model.spikes)] for g in GROUPS
    }
    named_first = []
    for spike in model.spikes:
        for labels in (ENDPOINTS, ITEMS):
            if spike.group in labels:
                ranked = contributors({g: by_group[g] for g in labels}, spike.day)
                named_first.append(bool(ranked) and ranked[0][0] == spike.group)
    return Outcome(
        seed,
        model.spikes,
        found,
        [judged[s.group].get(s.day) for s in model.spikes],
        max(quiet),
        named_first,
        false_alarms,
        flagged,
        {g: len(judged[g]) for g in GROUPS},
        seconds,
    )


def named(*outcomes: Outcome) -> str:
    return f"{sum(sum(o.named_first) for o in outcomes)}/{sum(len(o.named_first) for o in outcomes)}"


def label(group: str) -> str:
    return group or "(account)"


def report(outcome: Outcome, min_percent: Decimal, noise: float) -> None:
    print(
        f"seed {outcome.seed}: {START} … {END}, noise ±{noise:.0%}, {len(GROUPS)} groups, {len(outcome.spikes)} spikes"
    )
    print(
        f"min_amount {MIN_AMOUNT}, min_percent {min_percent}, sensitivity {SENSITIVITY}; "
        f"judged {sum(outcome.judged_days.values())} group-days in {outcome.seconds * 1000:.0f} ms"
    )
    for spike, found, judged in zip(outcome.spikes, outcome.found, outcome.spike_judgements, strict=True):
        impact = f"impact {judged.impact} ({judged.impact_percent}%)" if judged else "not judged"
        verdict = "found" if found else "MISSED"
        print(f"  spike {spike.day} ×{spike.factor:<4} {label(spike.group):<26} {impact:<26} {verdict}")
    print(f"recall {outcome.recall:.2f} ({sum(outcome.found)}/{len(outcome.spikes)})")
    print(f"highest impact on a day no spike touches: {outcome.quiet_peak}%")
    print(f"account's contributors name the spiked endpoint or item first: {named(outcome)}")
    for group in GROUPS:
        flagged = ", ".join(
            f"{d}{'' if d not in outcome.false_alarms[group] else '(false)'}" for d in outcome.flagged[group]
        )
        print(
            f"  {label(group):<26} false alarms {outcome.per_90_days(group):.2f}/90 d "
            f"({len(outcome.false_alarms[group])} in {outcome.judged_days[group]} d); flagged: {flagged or '-'}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--seeds", type=int, default=10, help="seeds seed … seed + N − 1 for the summary")
    parser.add_argument("--spikes", type=int, default=12)
    parser.add_argument("--min-percent", type=Decimal, default=Decimal(30))
    parser.add_argument("--noise", type=float, default=0.15)
    args = parser.parse_args(argv)
    seeds = range(args.seed, args.seed + max(1, args.seeds))
    outcomes = [run(seed, args.spikes, args.min_percent, args.noise) for seed in seeds]
    report(outcomes[0], args.min_percent, args.noise)
    print(
        f"across seeds {seeds[0]}…{seeds[-1]}: min recall {min(o.recall for o in outcomes):.2f}, "
        f"max false alarms {max(o.worst_false_alarms for o in outcomes):.2f}/group/90 d "
        f"(total {sum(len(f) for o in outcomes for f in o.false_alarms.values())}), "
        f"highest impact on a quiet day {max(o.quiet_peak for o in outcomes)}%, "
        f"lowest on a spike {min(j.impact_percent or 0 for o in outcomes for j in o.spike_judgements if j)}%, "
        f"contributors named first {named(*outcomes)}, max time {max(o.seconds for o in outcomes) * 1000:.0f} ms"
    )


if __name__ == "__main__":
    main()
