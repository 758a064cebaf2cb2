"""Spend anomaly judgements on hand-built and simulated daily series: weekdays, past spikes, unknown
days, the floors, sensitivity, and the contributors of a day's impact."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import pytest

from exporter.model.anomaly import MIN_HISTORY_DAYS, Judgement, contributors, judge, judge_all
from exporter.sim import DEFAULT_ENDPOINTS, ITEMS, SpendModel, Spike

MONDAY = dt.date(2026, 6, 1)
WEEK = (Decimal(100),) * 5 + (Decimal(40),) * 2
"""Monday … Sunday of a quiet week: busy weekdays, quiet weekends."""
FLOORS = {"min_amount": Decimal(20), "min_percent": Decimal(30)}
ENDPOINT = DEFAULT_ENDPOINTS[0].endpoint_id


def weekly(weeks: int, start: dt.date = MONDAY) -> dict[dt.date, Decimal]:
    return {start + dt.timedelta(n): WEEK[(start + dt.timedelta(n)).weekday()] for n in range(7 * weeks)}


def day(week: int, weekday: int) -> dt.date:
    return MONDAY + dt.timedelta(7 * week + weekday)


def flagged(series: dict[dt.date, Decimal], **floors: Decimal) -> list[dt.date]:
    return [d for d, j in judge_all(series, **(floors or FLOORS)).items() if j.anomalous]


def simulated(model: SpendModel, weeks: int, group: str = ENDPOINT) -> dict[dt.date, Decimal]:
    """A group's daily amounts: the (endpoint, item) amounts it covers, summed."""
    return {
        d: sum(
            (
                model.amount(d, e.endpoint_id, i)
                for e in DEFAULT_ENDPOINTS
                for i in ITEMS
                if group in ("", e.endpoint_id, i)
            ),
            Decimal(0),
        )
        for d in (model.start + dt.timedelta(n) for n in range(7 * weeks))
    }


def test_an_80_percent_spike_on_a_flat_weekly_series_is_flagged_on_that_day_only() -> None:
    series = weekly(8)
    spiked = day(5, 2)
    series[spiked] = Decimal(180)
    assert flagged(series) == [spiked]
    assert judge(series, spiked, **FLOORS) == Judgement(
        spiked, Decimal(180), Decimal("100.00"), Decimal("80.00"), Decimal("80.00"), True
    )


def test_simulated_spikes_are_flagged_on_their_days_and_nowhere_else() -> None:
    start = dt.date(2026, 5, 4)
    spikes = [Spike(start + dt.timedelta(30), ENDPOINT, 1.7), Spike(start + dt.timedelta(61), "", 1.8)]
    series = simulated(SpendModel(start, spikes=spikes), weeks=13)
    assert flagged(series) == [s.day for s in spikes]


def test_a_normal_monday_after_a_quiet_weekend_is_not_flagged() -> None:
    series = weekly(6)
    judgement = judge(series, day(5, 0), **FLOORS)
    assert judgement is not None
    assert judgement.expected == Decimal(100)
    assert not judgement.anomalous


def test_a_saturday_with_a_mondays_amount_is_flagged() -> None:
    series = weekly(6)
    saturday = day(5, 5)
    series[saturday] = Decimal(100)
    judgement = judge(series, saturday, **FLOORS)
    assert judgement is not None
    assert judgement.expected == Decimal(40)
    assert judgement.impact_percent == Decimal(150)
    assert judgement.anomalous


def test_one_big_past_spike_does_not_raise_later_expectations() -> None:
    series = weekly(10)
    series[day(4, 0)] = Decimal(1000)
    series[day(5, 0)] = Decimal(180)
    judged = judge_all(series, **FLOORS)
    assert [d for d, j in judged.items() if j.anomalous] == [day(4, 0), day(5, 0)]
    assert {j.expected for d, j in judged.items() if d > day(4, 0) and d.weekday() < 5} == {Decimal(100)}


def test_a_drop_is_not_an_anomaly_and_its_impact_stays_negative() -> None:
    series = weekly(6)
    series[day(5, 1)] = Decimal(20)
    judgement = judge(series, day(5, 1), **FLOORS)
    assert judgement is not None
    assert (judgement.impact, judgement.impact_percent, judgement.anomalous) == (Decimal(-80), Decimal(-80), False)


def test_missing_days_are_unknown_not_zero() -> None:
    """A zero-filled week would sink the recent level and make the normal days after it look like jumps."""
    series = simulated(SpendModel(MONDAY), weeks=12)
    gap = [day(6, n) for n in range(9)] + [day(3, 2), day(8, 4)]
    for d in gap:
        del series[d]
    assert flagged(series) == []
    assert judge(series, day(6, 3), **FLOORS) is None
    zero_filled = series | dict.fromkeys(gap, Decimal(0))
    assert flagged(zero_filled) != []


def test_a_day_right_after_a_long_gap_is_judged_on_the_days_known_before_it() -> None:
    series = weekly(6)
    after_gap = day(20, 0)
    series[after_gap] = Decimal(100)
    series[after_gap + dt.timedelta(1)] = Decimal(180)
    judged = judge_all(series, **FLOORS)
    assert judged[after_gap].expected == Decimal(100)
    assert not judged[after_gap].anomalous
    assert judged[after_gap + dt.timedelta(1)].anomalous


def test_too_little_history_is_not_judged() -> None:
    series = weekly(3)
    assert judge(series, day(1, 6), **FLOORS) is None  # 13 known days before it
    assert judge(series, day(2, 0), **FLOORS) is not None  # 14
    assert len(judge_all(series, **FLOORS)) == len(series) - MIN_HISTORY_DAYS
    assert judge(series, day(3, 0), **FLOORS) is None  # not in the series
    del series[day(0, 2)]
    assert judge(series, day(2, 2), **FLOORS) is None  # 15 known days before it, but one Wednesday only


@pytest.mark.parametrize(
    ("min_amount", "min_percent", "anomalous"),
    [
        ("20", "30", True),
        ("60", "60", True),  # both floors are reached exactly
        ("61", "30", False),  # min_amount alone
        ("20", "61", False),  # min_percent alone
        ("61", "61", False),  # both
    ],
)
def test_each_floor_suppresses_an_anomaly_below_it(min_amount: str, min_percent: str, anomalous: bool) -> None:
    series = weekly(6)
    series[day(5, 3)] = Decimal(160)
    judgement = judge(series, day(5, 3), min_amount=Decimal(min_amount), min_percent=Decimal(min_percent))
    assert judgement is not None
    assert judgement.anomalous is anomalous


@pytest.mark.parametrize("idle_weekdays", [(5, 6), tuple(range(7))], ids=["quiet-weekends", "idle-group"])
def test_a_day_whose_expected_amount_is_zero_passes_the_percent_floor(idle_weekdays: tuple[int, ...]) -> None:
    series = {d: Decimal(0) if d.weekday() in idle_weekdays else a for d, a in weekly(6).items()}
    series[day(5, 5)] = Decimal(50)
    judgement = judge(series, day(5, 5), **FLOORS)
    assert judgement is not None
    assert (judgement.expected, judgement.impact_percent, judgement.anomalous) == (Decimal(0), None, True)


def test_a_lasting_change_is_flagged_for_a_few_days_then_taken_as_the_new_normal() -> None:
    series = weekly(14)
    change = day(6, 3)
    for d in series:
        if d >= change:
            series[d] *= 2
    assert flagged(series) == [change + dt.timedelta(n) for n in range(4)]


def test_higher_sensitivity_flags_fewer_days() -> None:
    series = simulated(SpendModel(MONDAY, noise=0.4), weeks=26)
    counts = [
        len(flagged(series, min_amount=Decimal(0), min_percent=Decimal(0), sensitivity=Decimal(s)))
        for s in (1, 2, 3, 4)
    ]
    assert counts == sorted(counts, reverse=True)
    assert counts[0] > counts[-1]
    assert flagged(series) == []


def test_a_growing_account_is_followed_not_flagged() -> None:
    assert flagged(simulated(SpendModel(MONDAY, growth=0.3), weeks=26, group="")) == []


def test_judge_all_agrees_with_judge_and_keeps_the_amounts_precision() -> None:
    series = simulated(SpendModel(MONDAY), weeks=6)
    series[day(5, 0)] = Decimal("123.4567")
    judged = judge_all(series, **FLOORS)
    assert judged == {d: judge(series, d, **FLOORS) for d in series if d >= day(2, 0)}
    assert judged[day(5, 0)].expected.as_tuple().exponent == -4
    assert judged[day(4, 0)].expected.as_tuple().exponent == -2


def test_contributors_name_the_spiked_part_first_with_shares_of_the_positive_impact() -> None:
    weeks = 6
    parts = {"a": weekly(weeks), "b": weekly(weeks), "c": weekly(weeks), "d": weekly(weeks)}
    spiked = day(5, 1)
    parts["b"][spiked] = Decimal(300)  # +200
    parts["a"][spiked] = Decimal(150)  # +50
    parts["c"][spiked] = Decimal(90)  # −10, not a contributor
    ranked = contributors(parts, spiked)
    assert ranked == [("b", Decimal("0.8")), ("a", Decimal("0.2"))]
    assert contributors(parts, spiked, top=1) == [("b", Decimal("0.8"))]


def test_contributors_shares_never_sum_above_one_and_a_new_part_carries_all_it_spends() -> None:
    parts = {name: weekly(6) for name in ("a", "b", "c")}
    spiked = day(5, 1)
    for name in parts:
        parts[name][spiked] = Decimal(200)  # +100 each, +150 for the new part: ninths, never exact
    parts["new"] = {spiked: Decimal(150)}
    ranked = contributors(parts, spiked, top=4)
    assert ranked[0] == ("new", Decimal("0.3333"))
    assert [share for _, share in ranked] == sorted((share for _, share in ranked), reverse=True)
    assert sum(share for _, share in ranked) <= 1
    assert contributors(parts, day(6, 0)) == []  # a day no part knows


def test_an_expected_amount_too_large_for_the_bill_s_places_is_judged_at_decimal_s_precision() -> None:
    """A week of bills of 9 × 10^14 written to twelve places after quiet weeks: the expected amount
    (the weekday's factor times the level) passes what 28 digits hold at those places; it is judged
    as finely as they hold it, never refused (InvalidOperation), and so is a percent of 10^25."""
    start = dt.date(2026, 8, 3)  # a Monday
    series = {start + dt.timedelta(n): Decimal(10000 if n % 7 == 0 else "0.01") for n in range(56)}
    huge = Decimal("900000000000000.000000000001")
    series |= {start + dt.timedelta(n): huge for n in range(56, 64)}
    found = judge(series, start + dt.timedelta(63), min_amount=Decimal(1), min_percent=Decimal(1))
    assert found is not None
    assert len(found.expected.as_tuple().digits) <= 28
    tiny = {start + dt.timedelta(n): Decimal("0.000000000001") for n in range(63)} | {start + dt.timedelta(63): huge}
    spike = judge(tiny, start + dt.timedelta(63), min_amount=Decimal(1), min_percent=Decimal(1))
    assert spike is not None
    assert spike.anomalous
