"""The midnight jobs: every day of the billing zone gets its rollovers exactly once, over a year of DST changes,
in zones whose clocks skip midnight (Santiago, Beirut) or repeat it (Havana, the Azores) too."""

from __future__ import annotations

import datetime as dt
import time
from collections import Counter
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from exporter.app.daemon import Daemon
from exporter.app.schedule import DailyTrigger, SpreadInterval
from exporter.config.load import validate
from exporter.core.clock import Clock, FrozenClock, later
from exporter.sim import Simulator
from tests.daemon_fakes import InProcessBilling, account_simulators, accounts_section, fake_billing_section
from tests.fakes import FakeBilling
from tests.helpers import wait_for
from tests.test_daemon import FAST, daemon_config

ZONES = (
    "America/New_York",
    "Europe/Berlin",
    "Australia/Sydney",
    "Asia/Shanghai",
    "America/Santiago",  # 00:00 → 01:00 in September: the day's first instant is 01:00
    "Asia/Beirut",  # 00:00 → 01:00 in March, and 00:00 → 23:00 the day before in October
    "America/Havana",  # 01:00 → 00:00 in November: 00:00:05 happens twice
    "Atlantic/Azores",  # 00:00 → 01:00 in March, 01:00 → 00:00 in October
)
YEAR = [dt.date(2026, 1, 1) + dt.timedelta(days=n) for n in range(365)]


def fired(trigger: Any, tz: ZoneInfo, year: int = 2026) -> Counter[dt.date]:
    """Walk the trigger over `year` as the scheduler does (the next run after the last, a second after it ran):
    how many runs each local day gets."""
    now = dt.datetime(year - 1, 12, 31, 12, tzinfo=tz)
    previous, runs = None, Counter[dt.date]()
    for _ in range(400):
        fire = trigger.get_next_fire_time(previous, now)
        if fire.astimezone(tz).year > year:
            return runs
        runs[fire.astimezone(tz).date()] += 1
        previous, now = fire, fire + dt.timedelta(seconds=1)
    raise AssertionError("more runs than days in the year")


def local_day(instant: dt.datetime, tz: ZoneInfo) -> dt.date:
    return instant.astimezone(tz).date()


@pytest.mark.parametrize("zone", ZONES)
def test_every_day_gets_one_run_five_seconds_into_it(zone: str) -> None:
    tz = ZoneInfo(zone)
    trigger = DailyTrigger(tz, dt.timedelta(seconds=5))
    assert fired(trigger, tz) == Counter(YEAR)  # each day once: none skipped, none twice
    fire = None
    for day in YEAR:
        fire = trigger.get_next_fire_time(fire, dt.datetime(2025, 12, 31, 12, tzinfo=tz))
        start = fire.astimezone(dt.UTC) - dt.timedelta(seconds=5)  # (in UTC: elapsed time)
        assert local_day(start, tz) == day  # five seconds after the first instant of the day…
        assert local_day(start - dt.timedelta(seconds=1), tz) == day - dt.timedelta(days=1)  # …and no later


def test_the_first_instant_of_a_day_whose_midnight_is_skipped() -> None:
    santiago = ZoneInfo("America/Santiago")
    trigger = DailyTrigger(santiago, dt.timedelta(seconds=5))
    before = dt.datetime(2026, 9, 5, 23, 59, tzinfo=santiago)
    fire = trigger.get_next_fire_time(None, before).astimezone(santiago)
    assert fire.date() == dt.date(2026, 9, 6)
    assert (fire.time(), fire.utcoffset()) == (dt.time(1, 0, 5), -dt.timedelta(hours=3))  # 01:00 is its first instant


def test_a_job_starting_or_resuming_runs_at_the_next_time_not_a_past_one() -> None:
    new_york = ZoneInfo("America/New_York")
    trigger = DailyTrigger(new_york, dt.timedelta(seconds=10))
    due = dt.datetime(2026, 3, 9, 0, 0, 10, tzinfo=new_york)  # the day after the spring-forward
    assert trigger.get_next_fire_time(None, due - dt.timedelta(hours=3)) == due
    assert trigger.get_next_fire_time(None, due) == due
    assert trigger.get_next_fire_time(None, due + dt.timedelta(seconds=1)) == due + dt.timedelta(days=1)


@pytest.mark.parametrize(
    ("zone", "over_http"),
    [
        pytest.param("America/New_York", False, id="America/New_York"),
        pytest.param("Europe/Berlin", False, id="Europe/Berlin"),
        pytest.param("Australia/Sydney", False, id="Australia/Sydney"),
        pytest.param("America/Santiago", True, marks=pytest.mark.integration, id="America/Santiago-http"),
    ],
)
def test_the_daemons_midnight_jobs_run_every_day_of_the_billing_zone(
    zone: str, over_http: bool, sim: Simulator, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The scheduler as it runs (its first refreshes too); on the simulator in process, and once, end to
    end, with the HTTP server and the billing API over HTTP."""
    tz = ZoneInfo(zone)
    start, origin = dt.datetime(2026, 1, 1, 10, 0, tzinfo=tz), time.monotonic()
    clock = Clock(tz, lambda: start + dt.timedelta(seconds=time.monotonic() - origin))
    server = request.getfixturevalue("server") if over_http else None
    document = daemon_config(sim, server, tmp_path, timezone=zone, bills_interval="1h", usage_interval="1h")
    if over_http:
        daemon = Daemon(validate(document, {}), clock=clock, listen="127.0.0.1:0", retry=FAST)
    else:
        daemon = Daemon(validate(document, {}), clock=clock, billing=InProcessBilling(sim), serve=False)
    daemon.start()
    try:
        for job in ("rollover", "rollover-bills"):
            assert fired(daemon.scheduler.get_job(job).trigger, tz) == Counter(YEAR), job
    finally:
        daemon.stop(grace=5)


@pytest.mark.parametrize("zone", ["America/New_York", "Europe/London", "Asia/Shanghai"])
def test_a_sources_next_run_is_an_interval_of_real_time_away_on_the_night_the_clocks_go_back(zone: str) -> None:
    """Started (or rescheduled by a reload) at 01:55 on the night the clocks go back: the next usage
    run is 5 minutes of real time later, not 65 (the wall clock's 02:00 comes an hour later)."""
    tz = ZoneInfo(zone)
    nights = {"America/New_York": dt.datetime(2026, 11, 1, 1, 55), "Europe/London": dt.datetime(2026, 10, 25, 1, 55)}
    now = nights.get(zone, dt.datetime(2026, 11, 1, 1, 55)).replace(tzinfo=tz)  # (the first 01:55 of two)
    for seconds in (300.0, 900.0, 3600.0, 86400.0):
        assert later(now, seconds).timestamp() - now.timestamp() == seconds
        assert later(now, seconds).tzinfo is tz


def test_the_daemons_next_runs_are_their_interval_of_real_time_away_on_the_night_the_clocks_go_back(
    tmp_path: Path,
) -> None:
    """The daemon scheduling its sources at 01:55 on New York's night the clocks go back: each
    source's grid starts its interval of real time later (usage 5 minutes, not 65)."""
    tz = ZoneInfo("America/New_York")
    now = dt.datetime(2026, 11, 1, 1, 55, tzinfo=tz)
    clock = Clock(tz, lambda: now)
    sim = Simulator(clock=clock)
    billing = fake_billing_section(sim, history_months=0, timezone="America/New_York", usage_interval="5m")
    document = {"billing": billing, "state": {"path": str(tmp_path / "state.db")}}
    daemon = Daemon(validate(document, {}), clock=clock, billing=InProcessBilling(sim), serve=False)
    try:
        daemon._schedule(now)
        for source, interval in daemon.sources.intervals.items():
            start = daemon.scheduler.get_job(source).trigger.start_date
            assert start.timestamp() - now.timestamp() == interval, source
    finally:
        daemon.stop(grace=1)


def test_the_test_clock_advances_by_real_time_on_the_night_the_clocks_go_back() -> None:
    tz = ZoneInfo("America/New_York")
    frozen = FrozenClock(dt.datetime(2026, 11, 1, 1, 30, tzinfo=tz))  # (01:30 EDT, the first of two)
    before = frozen().timestamp()
    frozen.advance(dt.timedelta(hours=1))
    assert frozen().timestamp() - before == 3600  # (01:30 EST: the wall clock reads the same)
    assert frozen().strftime("%H:%M %Z") == "01:30 EST"


def test_an_interval_keeps_its_phase_whatever_the_jitter() -> None:
    """Each run lands on its own grid point plus at most the jitter, however late the previous one
    ran: the jitter does not carry over, so sources started apart stay apart."""
    start = dt.datetime(2026, 3, 1, 12, tzinfo=dt.UTC)
    trigger = SpreadInterval(seconds=10, jitter=1.0, start_date=start, timezone=dt.UTC)
    now = start - dt.timedelta(seconds=7)
    previous = None
    for n in range(500):
        fire = trigger.get_next_fire_time(previous, now)
        late = (fire - start).total_seconds() - 10 * n
        assert 0 <= late <= 1.0, (n, late)
        previous, now = fire, fire + dt.timedelta(seconds=0.5)  # the run took half a second


def test_a_run_that_overran_its_interval_skips_to_the_next_grid_point() -> None:
    start = dt.datetime(2026, 3, 1, 12, tzinfo=dt.UTC)
    trigger = SpreadInterval(seconds=10, start_date=start, timezone=dt.UTC)
    fire = trigger.get_next_fire_time(start, start + dt.timedelta(seconds=25))
    assert fire == start + dt.timedelta(seconds=30)
    assert trigger.get_next_fire_time(None, start - dt.timedelta(seconds=3)) == start


def test_the_accounts_refreshes_are_spread_over_their_interval(tmp_path: Path) -> None:
    """Every account refreshes at start-up; after that, the n-th of N at n ÷ N of the interval
    before the first account's next run, so N accounts never run in step (a lone account's next run
    is an interval after its first, as ever)."""
    clock = Clock(ZoneInfo("UTC"))
    sims = account_simulators(clock, tuple(f"a{n}" for n in range(5)))
    document = {
        "accounts": accounts_section(sims, history_months=0, bills_interval="1h", usage_interval="10m"),
        "state": {"path": str(tmp_path / "state.db")},
    }
    billing = {sim.access_key_id: sim for sim in sims.values()}
    daemon = Daemon(
        validate(document, {}), clock=clock, billing=lambda c: FakeBilling(billing[c.access_key_id]), serve=False
    )
    started = dt.datetime.now(dt.UTC)
    daemon.start()
    try:
        for source, interval in (("usage", 600.0), ("bills", 3600.0)):
            wait_for(lambda s=source: all(s in daemon.sources.accounts[a].latest.health for a in sims))
            due = [(daemon.scheduler.get_job(f"{a}/{source}").next_run_time - started).total_seconds() for a in sims]
            jitter = interval * 0.1
            for n, at in enumerate(due):
                expected = interval * (1 - n / len(sims))
                assert expected - 5 <= at <= expected + jitter + 5, (source, n, at, expected)
    finally:
        daemon.stop(grace=5)
