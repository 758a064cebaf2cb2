"""`backfill`: past months' daily bills as OpenMetrics text for `promtool tsdb create-blocks-from
openmetrics`, so that dashboards show the months before the exporter ran.

The file holds the series the live exporter exposes from its bills (names, labels, TYPE and HELP
as its collectors write them), with timestamps, as a Prometheus scraping it through those months
would have stored them, but a bill series' samples are an hour apart (`STEP`):

- a day's series (payable by endpoint, payable and usage by item) appear at the start of that day
  and stay as long as the exporter shows their month: to its end, and through the next month's
  first `previous_month_grace_days` days. Their value is the day's final billed amount throughout:
  how a day's bill grew within it is not known any more;
- each month's month to date and month-end forecast with its interval's bounds, every day as the
  exporter would have computed them at that day's end, from the months before it the exporter
  would have held then (in the grace days last month; with history, `history_months` of them,
  fetched from before `--from` too);
- `inference_billing_today_info` for every day, every `CALENDAR_STEP`, so the dashboards' "this
  month" and "today" selections (`and on(period) inference_billing_today_info`) work in the past.

A bill series is read through `last_over_time(…[1h])` (`WINDOW`), as the dashboards read it:
samples an hour apart instead of Prometheus' 5-minute lookback make the file 11.5 times smaller, and
over the live exporter's series the window gives what the plain selector gives.

Only complete days are written: nothing from the start of today (its bill is still growing; the live
exporter shows it), and nothing from the last three hours (promtool's advice: that time may still
be in a running Prometheus' head block). Amounts are written as the exact decimals the API gave
and their exact sums; Prometheus reads each as the same float the live exposition gives.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import os
import re
import stat
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import TextIO

from prometheus_client.core import Metric

from exporter.billing import GROUP_TERM_INSTANCE, GROUP_TERM_ITEM, BillingAPI, BillingError, SignatureRejected, why
from exporter.core.clock import (
    Clock,
    first_day,
    month_problem,
    period_at,
    period_index,
    periods_before,
    periods_between,
    previous_period,
)
from exporter.core.logs import get_logger
from exporter.metrics.collectors import BillsCollector, ExporterCollector
from exporter.model.forecast import DEFAULT_LEVEL, held_days, month_forecast
from exporter.model.snapshots import DailyAmount, Latest, per_day
from exporter.replay import MAX_MONTHS
from exporter.sources.bills import daily_amounts

log = get_logger(__name__)

STEP = 3600
"""Seconds between a bill series' samples, each series' first at its own start (a day's, in the
billing time zone). Read through `last_over_time(…[1h])`, a series is found from its first sample
until an hour after its last: until the start of the day it is no longer shown. Growing with the
square of a month's days (a day's series stays to the month's end), these are most of the file."""
CALENDAR_STEP = 300
"""Seconds between `inference_billing_today_info`'s samples: the dashboards join on it with a plain
selector, which finds a sample only within Prometheus' 5-minute lookback (a window on it would
match yesterday's and today's at once for an hour after midnight). One series a day: a small part
of the file."""
WINDOW = "1h"
"""The range over which queries read a backfilled bill series (`last_over_time`): `STEP`."""
BLOCK = 486 * 3600
"""The blocks `promtool tsdb create-blocks-from openmetrics --max-block-duration=486h` writes:
486 hours (the longest of its ranges, 2 hours times powers of 3, within that), each from a multiple
of it since the Unix epoch. It reads a file once for its times, then again for each block, so a
file of many blocks costs it the file's size times their number: `--output-dir` writes a file for
each, which it reads twice whatever the range, and whose block no other file's overlaps."""
HEAD_BLOCK = dt.timedelta(hours=3)
"""Nothing this recent: promtool's advice, as a running Prometheus may still be writing that time."""
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
OWN_LABELS = frozenset({"period", "day", "endpoint_id", "item", "product", "project_id"})
ENDPOINT_DAILY = "inference_bill_endpoint_daily_payable_amount"
ITEM_DAILY = "inference_bill_item_daily_payable_amount"
ITEM_USAGE = "inference_bill_item_daily_usage"
MONTH_TO_DATE = "inference_bill_month_to_date_payable_amount"
MONTH_FORECAST = "inference_bill_month_forecast_payable_amount"
MONTH_LOWER = "inference_bill_month_forecast_lower_payable_amount"
MONTH_UPPER = "inference_bill_month_forecast_upper_payable_amount"
TODAY_INFO = "inference_billing_today_info"
FILE_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)
"""What an --output that is not a regular file may be, to name it."""
Labels = tuple[tuple[str, str], ...]


class BackfillError(Exception):
    """Nothing could be written: no complete day asked for, the credentials refused, or no month fetched."""


@dataclass(frozen=True)
class Month:
    period: str
    by_endpoint: tuple[DailyAmount, ...]
    by_item: tuple[DailyAmount, ...]


@dataclass(frozen=True)
class Result:
    written: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]
    """(period, why) for each month left out."""
    series: int
    samples: int
    start: dt.datetime
    end: dt.datetime
    """The samples lie in [start, end)."""
    files: tuple[Path, ...]
    """The files written, in time order."""


# --- the command's arguments ----------------------------------------------------------------


def months(first: str, last: str | None, current: str) -> list[str]:
    """`--from` … `--to` (this month when not given), oldest first; ValueError with a one-line reason."""
    for option, text in (("--from", first), ("--to", last)):
        if text is not None and (problem := month_problem(text)):
            raise ValueError(f"argument {option}: {problem}")
    last = last or current
    for option, text in (("--from", first), ("--to", last)):
        if text > current:
            raise ValueError(f"argument {option}: {text} is in the future (this month is {current})")
    if first > last:
        raise ValueError(f"argument --from: {first} is after --to {last}")
    check_range(first, last)
    return periods_between(first, last)


def check_range(first: str, last: str) -> None:
    """ValueError with a one-line reason when `first` … `last` holds more than MAX_MONTHS months."""
    count = period_index(last) - period_index(first) + 1
    if count > MAX_MONTHS:
        raise ValueError(f"{count} months from {first} to {last}: at most {MAX_MONTHS} at once")


def target_labels(pairs: Iterable[str]) -> Labels:
    """`--label NAME=VALUE`s: the labels Prometheus adds to the exporter's series when it scrapes
    them (`job`, `instance`, any from relabelling), without which a backfilled series is not the live one."""
    labels: dict[str, str] = {}
    for pair in pairs:
        name, equals, value = pair.partition("=")
        if not equals or not value or not LABEL_NAME.fullmatch(name) or name.startswith("__"):
            raise ValueError(f"argument --label: {pair!r} is not NAME=VALUE (a Prometheus label name, a value)")
        if name in OWN_LABELS:
            raise ValueError(f"argument --label: {name} is a label of the bill series themselves")
        if name in labels:
            raise ValueError(f"argument --label: {name} is given twice")
        labels[name] = value
    return tuple(labels.items())


# --- the bills ---------------------------------------------------------------------------


def fetch(client: BillingAPI, periods: Sequence[str]) -> tuple[dict[str, Month], list[tuple[str, str]]]:
    """Each month's daily bills, by endpoint and by item. A month the API refuses or lists nothing
    for is logged and left out (never written as zeros); a refused signature ends the fetch, since
    every month would be refused alike."""
    found: dict[str, Month] = {}
    skipped: list[tuple[str, str]] = []
    for period in periods:
        try:
            instances = client.bills(period, GROUP_TERM_INSTANCE)
            items = client.bills(period, GROUP_TERM_ITEM)
        except SignatureRejected as error:
            raise BackfillError(str(error)) from None
        except BillingError as error:
            said = why(error)
            log.warning(f"month skipped: {said}", period=period, error=str(error)[:300])
            skipped.append((period, said))
            continue
        if not instances and not items:
            log.warning("month skipped: the API listed no bills for it", period=period)
            skipped.append((period, "the API listed no bills for it"))
            continue
        found[period] = Month(period, daily_amounts(instances, "instance"), daily_amounts(items, "item"))
    return found, skipped


def _months_before(client: BillingAPI, first: str, count: int) -> dict[str, dict[dt.date, Decimal]]:
    """The account's days of the `count` months before `first`, by period: what the first months'
    forecasts learn from (the exporter would have held them). A month that cannot be fetched is
    left out, and the forecasts then learn from fewer."""
    found: dict[str, dict[dt.date, Decimal]] = {}
    period = first
    for _ in range(count):
        period = previous_period(period)
        try:
            days = per_day(daily_amounts(client.bills(period, GROUP_TERM_ITEM), "item"))
        except BillingError as error:
            log.warning("a month before --from could not be fetched: the first forecasts learn from fewer days",
                        period=period, error=str(error))  # fmt: skip
            continue
        if days:
            found[period] = days
    return found


# --- the file ----------------------------------------------------------------------------


def _number(amount: Decimal) -> str:
    """The decimal itself, never in exponent form (the API's digits, or an exact sum of them)."""
    return format(amount, "f")


def _escape(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class _Calendar:
    """The billing time zone's days as Unix times, and how long the exporter shows a month."""

    def __init__(self, clock: Clock, grace_days: int) -> None:
        self.clock = clock
        self.grace_days = grace_days

    def at(self, day: dt.date) -> int:
        return int(self.clock.day_start(day).timestamp())

    def hidden_from(self, period: str) -> dt.date:
        """The first day the exporter no longer shows `period`: after the next month's grace days."""
        return first_day(period_at(period_index(period) + 1)) + dt.timedelta(days=self.grace_days)


class _Writer:
    """OpenMetrics text: each family once, each series' samples together and in time order, every
    sample within [start, end). With several outputs, each takes the samples from its cut on (the
    first from `start`): each output is a file of its own, every family in it."""

    def __init__(self, outs: Sequence[TextIO], target: Labels, start: int, end: int, cuts: Sequence[int] = ()) -> None:
        if len(cuts) != len(outs) - 1 or list(cuts) != sorted(cuts) or not all(start < c < end for c in cuts):
            raise ValueError(f"{len(outs)} outputs need as many cuts, less one, ascending within [{start}, {end})")
        self.outs = outs
        self.cuts = cuts
        self.target = target
        self.start = start
        self.end = end
        self.series = 0
        self.samples = 0

    def family(self, family: Metric) -> None:
        for out in self.outs:
            out.write(f"# TYPE {family.name} {family.type}\n# HELP {family.name} {_escape(family.documentation)}\n")

    def close(self) -> None:
        for out in self.outs:
            out.write("# EOF\n")

    def write(
        self,
        name: str,
        labels: Labels,
        segments: Iterable[tuple[str, int, int]],
        step: int = STEP,
        target: Labels | None = None,
    ) -> None:
        """One series: `value` from `since` until `until` for each segment, in time order, a sample
        every `step` from `since` (the first within [start, end)) and the last `step` before its end.
        Its labels are `labels` and `target` (the writer's, unless given)."""
        added = self.target if target is None else target
        text = ",".join(f'{key}="{_escape(value)}"' for key, value in (*labels, *added))
        written = 0
        for value, since, until in segments:
            first = since + max(0, -(-(self.start - since) // step)) * step
            stop = min(until, self.end)
            stamps = list(range(first, stop, step))
            if len(stamps) > 1 and stamps[-1] != stop - step:
                stamps[-1] = stop - step  # seen until `stop`: a day of 23.5 hours, an end off the hour
            if not stamps:
                continue
            times: list[int | str] = list(stamps)
            begins = [bisect_left(stamps, cut) for cut in self.cuts]  # (where each output's samples begin)
            if stamps[-1] == stop - step:
                # A millisecond earlier: seen until just before `stop`, never at it (Prometheus 2
                # takes both ends of a window: yesterday's series and today's would be found at once).
                # On a cut, it is the earlier output's.
                times[-1] = f"{stop - step - 1}.999"
                begins = [len(stamps) if cut == stamps[-1] else at for cut, at in zip(self.cuts, begins, strict=True)]
            prefix = f"{name}{{{text}}} {value} "
            for out, low, high in zip(self.outs, [0, *begins], [*begins, len(times)], strict=True):
                if low < high:
                    out.write("".join(f"{prefix}{t}\n" for t in times[low:high]))
            written += len(times)
        if written:
            self.series += 1
            self.samples += written


def _families(clock: Clock) -> dict[str, Metric]:
    """The bill families and the calendar, with TYPE and HELP exactly as the live exporter writes them."""
    latest = Latest()
    found = {family.name: family for family in BillsCollector(latest).collect()}
    found |= {family.name: family for family in ExporterCollector(latest, clock).collect()}
    return found


def _daily(a: DailyAmount, key: str) -> Labels:
    return (
        ("period", a.period),
        ("day", a.day.isoformat()),
        (key, a.key),
        ("product", a.product),
        ("project_id", a.project_id),
    )


def _month_figures(
    month: Month,
    earlier: Mapping[str, dict[dt.date, Decimal]],
    calendar: _Calendar,
    until: int,
    history: int,
    level: float,
) -> Iterator[tuple[dt.date, tuple[Decimal, Decimal, Decimal, Decimal]]]:
    """(day, (month to date, forecast, its interval's bounds at `level`)) for each day the exporter
    shows the month, as at that day's end, from the months before it the exporter would have held
    then: the `history` months before it, or else last month in the month's first grace days
    (`earlier`: the account's days of the months at hand, by period)."""
    days = per_day(month.by_item)
    previous = previous_period(month.period)
    held_always = [p for p in periods_before(month.period, history) if p in earlier]  # (not older: gaps stay gaps)
    day = first_day(month.period)
    while day < calendar.hidden_from(month.period) and calendar.at(day) < until:
        so_far = {d: amount for d, amount in days.items() if d <= day}
        held = held_always or ([previous] if previous in earlier and day.day <= calendar.grace_days else [])
        known = held_days({p: earlier[p] for p in held})
        outlook = month_forecast(month.period, day, so_far, known, level)
        yield day, (sum(so_far.values(), Decimal(0)), outlook.point, outlook.lower, outlook.upper)
        day += dt.timedelta(days=1)


def render(
    out: TextIO,
    months: Mapping[str, Month],
    calendar: _Calendar,
    span: tuple[int, int],
    *,
    history: bool,
    before: Mapping[str, dict[dt.date, Decimal]] | None = None,
    target: Labels = (),
    account: str = "",
    step: int = STEP,
    history_months: int = 3,
    level: float = DEFAULT_LEVEL,
    cuts: Sequence[tuple[int, TextIO]] = (),
) -> tuple[int, int]:
    """Write the months' series over `span` (Unix seconds, [start, end)) to `out`, or, with `cuts`
    ((time, output) by time, within the span), the samples from each cut's time on to its output
    instead, each output a whole file. `before`: the account's
    days of the months before the first month, by period; `account`: the `account` label of an
    account of several, on its series (`inference_billing_today_info`, the process's own, has none);
    `step`: seconds between a bill series' samples (`CALENDAR_STEP` writes them as a Prometheus
    scraping every 5 minutes stores them, for queries without `last_over_time`). Returns the number
    of series and of samples."""
    families = _families(calendar.clock)
    labels = (*target, *([("account", account)] if account else []))
    writer = _Writer([out, *(o for _, o in cuts)], labels, *span, [t for t, _ in cuts])
    ordered = [months[period] for period in sorted(months)]
    account_days = {**(before or {}), **{m.period: per_day(m.by_item) for m in ordered}}
    for name, key, amounts in (
        (ENDPOINT_DAILY, "endpoint_id", [(m.period, a, a.payable) for m in ordered for a in m.by_endpoint]),
        (ITEM_DAILY, "item", [(m.period, a, a.payable) for m in ordered for a in m.by_item]),
        (ITEM_USAGE, "item", [(m.period, a, a.usage) for m in ordered for a in m.by_item]),
    ):
        writer.family(families[name])
        for period, a, amount in amounts:
            shown_until = calendar.at(calendar.hidden_from(period))
            writer.write(name, _daily(a, key), [(_number(amount), calendar.at(a.day), shown_until)], step)
    held = history_months if history else 0
    figures = {m.period: list(_month_figures(m, account_days, calendar, span[1], held, level)) for m in ordered}
    day_long = dt.timedelta(days=1)
    for index, name in enumerate((MONTH_TO_DATE, MONTH_FORECAST, MONTH_LOWER, MONTH_UPPER)):
        writer.family(families[name])
        for period, rows in figures.items():
            segments = [(_number(values[index]), calendar.at(day), calendar.at(day + day_long)) for day, values in rows]
            writer.write(name, (("period", period),), segments, step)
    writer.family(families[TODAY_INFO])
    day = dt.datetime.fromtimestamp(span[0], calendar.clock.tz).date()
    while calendar.at(day) < span[1]:
        following = day + dt.timedelta(days=1)
        info = (("day", day.isoformat()), ("period", calendar.clock.period(day)))
        writer.write(TODAY_INFO, info, [("1", calendar.at(day), calendar.at(following))], CALENDAR_STEP, target)
        day = following
    writer.close()
    return writer.series, writer.samples


def _refuse_unless_regular(path: Path) -> None:
    """FileExistsError when `path` is there and is not a regular file (or a link to one): the
    replace would put a regular file in place of a FIFO, a device node (as root, in /dev), a
    socket or a directory. A new path, or a link to nothing, is written as a new file."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return
    if stat.S_ISREG(mode):
        return
    kind = next((name for test, name in FILE_KINDS if test(mode)), "something else")
    if path.is_symlink():
        kind = f"a symbolic link to {kind}"
    raise FileExistsError(errno.EEXIST, f"it is {kind}, not a regular file (left as it is)", str(path))


class _Partial:
    """A new file beside `path`, written to replace it (see `replacing`). What is at `path` is
    checked as it is opened. A symbolic link is written through: the file it points to is replaced,
    the link left as it is."""

    def __init__(self, path: Path) -> None:
        _refuse_unless_regular(path)
        if path.is_symlink():
            path = Path(os.path.realpath(path))
        try:
            before: os.stat_result | None = path.stat()
        except FileNotFoundError:
            before = None
        if before is not None and not os.access(path, os.W_OK):  # (a replace needs only the directory's leave)
            raise PermissionError(errno.EACCES, "it is read-only (left as it is)", str(path))
        partial = path.with_name(f".{path.name}.partial")
        # A partial an earlier run left (or a link put in its place) goes first: the file is made anew,
        # never opened through a link to another.
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        fd = os.open(partial, flags, 0o600 if before is not None else 0o666)
        try:
            if before is not None:
                _take_on(fd, path, before)
            self.out = open(fd, "w", encoding="utf-8", newline="\n", buffering=1 << 20)  # noqa: SIM115 - closed below
        except BaseException:
            os.close(fd)
            partial.unlink(missing_ok=True)
            raise
        self.path = path
        self.partial = partial

    def abandon(self) -> None:
        with contextlib.suppress(OSError):  # (its last write may be what failed: a full disk)
            self.out.close()
        self.partial.unlink(missing_ok=True)


@contextmanager
def replacing(path: Path) -> Iterator[TextIO]:
    """A file beside `path` that replaces it once complete, and is removed if anything fails: a
    failed run leaves an earlier file as it was (`replacing_all` of one)."""
    with replacing_all([path]) as (out,):
        yield out


@contextmanager
def replacing_all(paths: Sequence[Path]) -> Iterator[list[TextIO]]:
    """Files beside `paths` that replace them once every one is complete, removed if anything
    fails: a failed run leaves the earlier files as they were, never some new and some old. All
    are opened at once, so a bad output fails first; what is at each path is checked then, and
    again once every file is written whole (flushed: a full disk fails there) before any is
    replaced, as a run takes minutes. A signal among the replaces waits until they are done."""
    made: list[_Partial] = []
    try:
        for path in paths:
            made.append(_Partial(path))
        yield [partial.out for partial in made]
        for partial in made:
            partial.out.close()
            _refuse_unless_regular(partial.path)
    except BaseException:
        for partial in made:
            partial.abandon()
        raise
    interrupted: BaseException | None = None
    for at, partial in enumerate(made):
        while True:
            try:
                if partial.partial.exists():  # (not when the signal came just after its replace)
                    os.replace(partial.partial, partial.path)
                break
            except Exception:  # (refused by the file system: the files before it are replaced already)
                for later in made[at:]:
                    later.partial.unlink(missing_ok=True)
                raise
            except BaseException as error:  # (Ctrl-C, SIGTERM: the rest take a moment, and go first)
                interrupted = error
    if interrupted is not None:
        raise interrupted


def _take_on(fd: int, path: Path, before: os.stat_result) -> None:
    """The new file at `fd` as the one at `path` is (`before`): a billing export made private stays
    private, one shared with a group stays shared. Its owner and group (the group alone where a
    member may not give the file away), its extended attributes (an ACL's entries among them), then
    its permission bits."""
    if (before.st_uid, before.st_gid) != (os.geteuid(), os.getegid()):
        try:
            os.fchown(fd, before.st_uid, before.st_gid)
        except PermissionError:
            with contextlib.suppress(PermissionError):
                os.fchown(fd, -1, before.st_gid)
    with contextlib.suppress(OSError):  # (a file system without them)
        for name in os.listxattr(path):
            with contextlib.suppress(OSError):
                os.setxattr(fd, name, os.getxattr(path, name))
    os.fchmod(fd, stat.S_IMODE(before.st_mode))


def block_cuts(start: int, end: int) -> list[int]:
    """promtool's block boundaries within (start, end), where `--output-dir`'s files are cut; none
    in the last `CALENDAR_STEP` before `end`, where every sample might be the last of its series,
    written a millisecond before the boundary (a file there could be empty)."""
    return list(range((start // BLOCK + 1) * BLOCK, end - CALENDAR_STEP, BLOCK))


def file_name(start: int) -> str:
    """The name of `--output-dir`'s file of samples from `start` on: its UTC time, so that the
    names sort as the files' times do (`backfill-20261010T0000Z.om`)."""
    return f"backfill-{dt.datetime.fromtimestamp(start, dt.UTC):%Y%m%dT%H%MZ}.om"


def outputs(output: Path, start: int, end: int, directory: bool) -> tuple[list[Path], list[int]]:
    """The files a run over [start, end) writes to `output` (a file, or with `directory` a
    directory's files, `block_cuts` apart), and the time each after the first begins at."""
    if not directory:
        return [output], []
    cuts = block_cuts(start, end)
    return [output / file_name(at) for at in (start, *cuts)], cuts


def _prepare(directory: Path, names: Iterable[str]) -> bool:
    """`directory`, made if it is not there (True then: a run that fails removes it); FileExistsError
    when it is something else, or holds a `.om` file this run does not write (`names`): loaded with
    these, another run's file would repeat their samples, or mix an earlier day's figures with
    them. Files of these names are replaced, so the same command run again replaces its own files."""
    if directory.exists() and not directory.is_dir():
        raise FileExistsError(errno.EEXIST, "it is not a directory (left as it is)", str(directory))
    try:
        directory.mkdir()
        return True
    except FileExistsError:
        pass
    others = sorted(
        entry.name for entry in directory.iterdir() if entry.name.endswith(".om") and entry.name not in names
    )
    if others:
        raise FileExistsError(
            errno.EEXIST,
            f"it holds {others[0]}{f' and {len(others) - 1} more' if len(others) > 1 else ''}, which this run"
            " does not write; loaded with these, another run's files would repeat or mix samples (remove them,"
            " or choose another directory)",
            str(directory),
        )
    return False


def backfill(
    client: BillingAPI,
    clock: Clock,
    periods: Sequence[str],
    output: Path,
    *,
    grace_days: int,
    history: bool,
    target: Labels = (),
    account: str = "",
    history_months: int = 3,
    level: float = DEFAULT_LEVEL,
    directory: bool = False,
) -> Result:
    """Fetch `periods` (consecutive, oldest first) and write their series to `output`: a file, or,
    with `directory`, a directory of files cut where promtool cuts its blocks (`BLOCK`), named by
    `file_name`.

    `grace_days`, `history` and `history_months` as the exporter's `billing.previous_month_grace_days`,
    `billing.history_months > 0` and `billing.history_months`; `account` as `render` takes it.
    BackfillError when nothing could be written (`output` is then left as it was); OSError when
    `output` cannot be written, FileExistsError when it is there and is not a regular file, or
    not a directory, or a directory holding other `.om` files (it is left as it is too). The files
    replace their namesakes only once every one is complete.
    """
    calendar = _Calendar(clock, grace_days)
    now = clock.now()
    start = calendar.at(first_day(periods[0]))
    end = min(
        calendar.at(calendar.hidden_from(periods[-1])),
        calendar.at(now.date()),
        int((now - HEAD_BLOCK).timestamp()),
    )
    if end <= start:
        raise BackfillError(f"nothing to backfill yet: {periods[0]} has no complete day")
    files, cuts = outputs(output, start, end, directory)
    made = _prepare(output, {path.name for path in files}) if directory else False
    try:
        with replacing_all(files) as (out, *more):
            found, skipped = fetch(client, periods)
            if not found:
                raise BackfillError(f"nothing written: no month of {periods[0]} … {periods[-1]} could be fetched")
            count = history_months if history else 1 if grace_days else 0
            before = _months_before(client, periods[0], count)  # (whether --from's own month was found or not)
            series, samples = render(out, found, calendar, (start, end), history=history, before=before,
                                     target=target, account=account, history_months=history_months, level=level,
                                     cuts=list(zip(cuts, more, strict=True)))  # fmt: skip
    except BaseException:
        if made:
            with contextlib.suppress(OSError):
                output.rmdir()
        raise
    return Result(
        written=tuple(sorted(found)),
        skipped=tuple(skipped),
        series=series,
        samples=samples,
        start=dt.datetime.fromtimestamp(start, clock.tz),
        end=dt.datetime.fromtimestamp(end, clock.tz),
        files=tuple(files),
    )
