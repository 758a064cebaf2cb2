"""The billing time zone's calendar: today, the month `period`, and day boundaries.

Every notion of "day" in the exporter comes from here, never from the host's zone.
`now` is injectable so tests can cross midnight or a month end without sleeping.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Callable
from typing import NamedTuple
from zoneinfo import ZoneInfo

DEFAULT_TIMEZONE = "Asia/Shanghai"


def _utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class Clock(NamedTuple):  # (a record, not a dataclass: the CLI starts without importing dataclasses)
    tz: ZoneInfo = ZoneInfo(DEFAULT_TIMEZONE)
    now_fn: Callable[[], dt.datetime] = _utc_now

    def now(self) -> dt.datetime:
        """The current instant, aware, in the billing time zone."""
        return self.now_fn().astimezone(self.tz)

    def today(self) -> dt.date:
        return self.now().date()

    def period(self, day: dt.date | None = None) -> str:
        """The billing month `YYYY-MM` that holds `day` (today by default)."""
        day = day or self.today()
        return f"{day.year:04d}-{day.month:02d}"

    def day_start(self, day: dt.date) -> dt.datetime:
        """The first instant of `day`, in the billing zone (see `day_start`). (Python adds a timedelta to
        it, and compares it with another of the zone, by the wall clock: on a day the clocks change,
        take it `.astimezone(dt.UTC)` first, or its `timestamp()`.)"""
        return day_start(day, self.tz).astimezone(self.tz)

    def at(self, day: dt.date, hour: int, minute: int) -> dt.datetime:
        """The instant (in UTC) the billing zone's clocks read `hour:minute` on `day`: the first of the
        two where they read it twice, and where they skip it, as the clocks before the jump would
        have read it (01:30 on the night they go from 01:00 to 02:00 is 02:30)."""
        return dt.datetime.combine(day, dt.time(hour, minute), tzinfo=self.tz).astimezone(dt.UTC)


def day_start(day: dt.date, tz: ZoneInfo) -> dt.datetime:
    """The first instant of `day` in `tz`, in UTC: its midnight, or, where the clocks skip midnight (Santiago goes
    from 23:59:59 to 01:00 one night in September), the instant they jump."""
    midnight = dt.datetime.combine(day, dt.time())
    # A skipped midnight reads as two instants: by the offset before the jump (fold=0, after it) and by the offset
    # after it (fold=1, before it); a repeated one too, the first of them being the day's start.
    low, high = sorted(midnight.replace(tzinfo=tz, fold=fold).astimezone(dt.UTC) for fold in (0, 1))
    if low.astimezone(tz).date() >= day:
        return low
    first, last = int(low.timestamp()), int(high.timestamp())
    while last - first > 1:  # the jump, to the second: zones change on whole seconds
        middle = (first + last) // 2
        if dt.datetime.fromtimestamp(middle, tz).date() >= day:
            last = middle
        else:
            first = middle
    return dt.datetime.fromtimestamp(last, dt.UTC)


def iso(timestamp: float | None) -> str:
    """A Unix time as Alertmanager and Prometheus write it (UTC, microseconds); None as their zero time."""
    if timestamp is None:
        return "0001-01-01T00:00:00Z"
    return dt.datetime.fromtimestamp(timestamp, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


PERIOD = re.compile(r"\d{4}-(0[1-9]|1[0-2])")
"""A billing month as written: YYYY-MM."""
FIRST_YEAR = 1970
"""No month a command takes is before this one's (Unix time's first): a billing API has none, and
the years before 2 do not even have a previous month."""


def month_problem(text: str) -> str | None:
    """Why `text` is no month a command takes (`--from`, `--to`), or None."""
    if not PERIOD.fullmatch(text):
        return f"{text!r} is not a month (YYYY-MM)"
    if int(text[:4]) < FIRST_YEAR:
        return f"{text} is before {FIRST_YEAR}"
    return None


def period_index(period: str) -> int:
    """Months since year 0: periods as numbers, to count and step by."""
    year, month = (int(part) for part in period.split("-"))
    return year * 12 + month - 1


def period_at(index: int) -> str:
    return f"{index // 12:04d}-{index % 12 + 1:02d}"


def previous_period(period: str) -> str:
    return period_at(period_index(period) - 1)


def periods_between(first: str, last: str) -> list[str]:
    """`first` … `last` (both included), oldest first."""
    return [period_at(index) for index in range(period_index(first), period_index(last) + 1)]


def periods_before(period: str, count: int) -> list[str]:
    """The `count` billing months before `period`, oldest first."""
    return [period_at(period_index(period) - n) for n in range(count, 0, -1)]


def first_day(period: str) -> dt.date:
    """The first day of the billing month `YYYY-MM`."""
    year, month = (int(part) for part in period.split("-"))
    return dt.date(year, month, 1)


def days_in_period(period: str) -> int:
    following = first_day(period_at(period_index(period) + 1))
    return (following - dt.timedelta(days=1)).day


def later(instant: dt.datetime, seconds: float) -> dt.datetime:
    """`seconds` of real time after `instant` (aware), in its zone: added in UTC, as a datetime of a
    zone adds by its wall clock (an hour off on the night the clocks go back)."""
    return (instant.astimezone(dt.UTC) + dt.timedelta(seconds=seconds)).astimezone(instant.tzinfo)


class FrozenClock:
    """A settable `now_fn` for tests, demos and benchmarks."""

    def __init__(self, start: dt.datetime) -> None:
        if start.tzinfo is None:
            raise ValueError("FrozenClock needs an aware datetime")
        self._now = start

    def __call__(self) -> dt.datetime:
        return self._now

    def set(self, instant: dt.datetime) -> None:
        self._now = instant

    def advance(self, delta: dt.timedelta) -> None:
        """Move on by `delta` of real time (added in UTC: a zone's datetime adds by its wall clock, an
        hour off on the night the clocks change)."""
        self._now = later(self._now, delta.total_seconds())
