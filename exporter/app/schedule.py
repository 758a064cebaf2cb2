"""When refreshes run: intervals with jitter, and the daily rollovers just after the billing zone's
midnight (a trigger of our own: APScheduler's cron and calendar triggers miss days around DST)."""

from __future__ import annotations

import datetime as dt
import logging
import math
import random
from zoneinfo import ZoneInfo

from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.interval import IntervalTrigger

from exporter.core.clock import day_start


class _SkippedRunNotice(logging.Filter):
    """APScheduler warns when a run is skipped because the previous one still runs; for a slow
    source that is normal, so the daemon says it itself, at debug, naming the source."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "maximum number of running instances reached" not in str(record.msg)


SKIPPED_RUN_NOTICE = _SkippedRunNotice()

JITTER_FRACTION = 0.1

MAX_JITTER = 30.0

ROLLOVER_USAGE = dt.timedelta(seconds=5)
"""How long into a billing day the usage day is rolled over."""

ROLLOVER_BILLS = dt.timedelta(seconds=10)
"""How long into a billing day its bills are fetched."""


class SpreadInterval(IntervalTrigger):  # type: ignore[misc]  # APScheduler has no type hints
    """Runs every interval on a fixed grid from `start_date`, each up to `jitter` seconds late.

    APScheduler's IntervalTrigger counts each interval from the last run, jitter included, so a
    source's runs drift by a random walk: sources started together stay in step for hours, then
    bunch again by chance. On a grid each keeps the phase it started with (the daemon spreads the
    accounts over the interval), and the mean interval is the interval, not the interval and half
    the jitter.
    """

    def get_next_fire_time(self, previous_fire_time: dt.datetime | None, now: dt.datetime) -> dt.datetime | None:
        """The first grid point after both `now` and the last run (a late run skips to the next
        point: the scheduler coalesces), plus jitter."""
        start, length = self.start_date.timestamp(), self.interval_length
        after = now.timestamp() if previous_fire_time is None else max(now, previous_fire_time).timestamp()
        steps = 0 if after < start else math.floor((after - start) / length) + 1
        fire = start + steps * length + (random.uniform(0, self.jitter) if self.jitter else 0.0)
        if self.end_date and fire > self.end_date.timestamp():
            return None
        return dt.datetime.fromtimestamp(fire, tz=self.timezone)


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
