"""When the digest is due: its scheduled day, and how long it waits for the day's figures."""

from __future__ import annotations

import datetime as dt

from exporter.config.schema import Config, DigestConfig
from exporter.core.clock import Clock
from exporter.model.signals import todays_bills, todays_history
from exporter.model.snapshots import Latest

DIGEST_WAIT = 3600.0
"""Seconds a due digest waits for the day's bills (and history), from its time or from the start if
later, before it goes with what there is."""


def digest_due(config: DigestConfig, now: dt.datetime, clock: Clock) -> dt.date | None:
    """The day whose digest is due at `now`: the last scheduled time passed, if it is at most half
    a period ago (a digest missed for longer is skipped: the next one is nearer)."""
    hour, minute = config.time
    today = clock.today()
    period = 7 if config.schedule == "weekly" else 1
    for back in range(period + 1):
        day = today - dt.timedelta(days=back)
        if config.schedule == "weekly" and day.weekday() != 0:
            continue
        scheduled = clock.day_start(day) + dt.timedelta(hours=hour, minutes=minute)
        if scheduled <= now:
            return day if now - scheduled <= dt.timedelta(days=period / 2) else None
    return None


def digest_ready(latest: Latest, clock: Clock, config: Config) -> bool:
    """Today's bills are in, and today's history when there is one: the day summarised is complete."""
    if not todays_bills(latest, clock):
        return False
    return config.billing.history_months == 0 or todays_history(latest, clock)
