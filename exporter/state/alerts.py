"""The alert store: the alert engine's state (each alert's state, what was last sent to whom, the
budget tiers fired) and the outboxes its notifications and the digests wait in until the dispatcher
delivers them. One module, since one evaluation commits state and notifications together, and
moving the alerts to new rule ids moves their queued notifications too."""

from __future__ import annotations

import datetime as dt
import json
import math
import sqlite3
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from exporter.model.events import GroupEvent, read_event
from exporter.state.file import StateFile
from exporter.state.migrations import OUTBOXES

REMOVED = "its notifier was removed from the config"
NO_DIGESTS = "its notifier takes no digests any more (digest.notifiers)"
RECONFIGURED = (REMOVED, NO_DIGESTS)
"""Why a queued notification was dropped when a config change took it from its notifier (the
dispatcher's reasons): a digest so dropped was not had (`_hand_on`)."""

DONE_KEPT = 7 * 86400.0
"""Seconds an outbox's row is kept once delivered or dropped."""

TOLD_KEPT = 62
"""Days before the newest day a digest told that the days told are kept: longer than any digest
looks back (`sources.TOLD_BACK`)."""


def read_alert_states(db: sqlite3.Connection) -> dict[str, tuple[str, str]]:
    """Each alert's key → (its rule, its state as JSON)."""
    return {key: (rule, body) for key, rule, body in db.execute("SELECT key, rule, body FROM alert_state")}


def read_pending(db: sqlite3.Connection) -> dict[str, int]:
    """Notifier → its notifications not yet delivered (alert groups and digests)."""
    rows = db.execute(
        "SELECT notifier, COUNT(*) FROM (SELECT notifier FROM outbox WHERE delivered IS NULL"
        " UNION ALL SELECT notifier FROM digest_outbox WHERE delivered IS NULL) GROUP BY notifier"
    ).fetchall()
    return dict(rows)


def read_refused(db: sqlite3.Connection) -> set[str]:
    """The notifiers with a notification not delivered that was tried and failed (their receiver
    down, or refusing): not one that merely waits its turn."""
    rows = db.execute(  # (not one owed only to some email recipients: the others took it)
        "SELECT notifier FROM outbox WHERE delivered IS NULL AND attempts > 0 AND recipients = ''"
        " UNION SELECT notifier FROM digest_outbox WHERE delivered IS NULL AND attempts > 0 AND recipients = ''"
    ).fetchall()
    return {notifier for (notifier,) in rows}


class UnreadableEntry(Exception):
    """An outbox row that cannot be read (its text damaged: a disk's, a hand's): `head` gives it
    so, for the dispatcher to drop it and go on with the queue rather than stop at it."""

    def __init__(self, entry_id: int, table: str, error: Exception) -> None:
        super().__init__(f"queued notification {entry_id} ({table}) cannot be read: {type(error).__name__}")
        self.id, self.table = entry_id, table


@dataclass(frozen=True)
class OutboxEntry:
    id: int
    notifier: str
    event: GroupEvent
    attempts: int
    next_attempt: float
    digest: dict[str, Any] | None = None
    """A digest (`exporter.digest.build`) instead of an alert group: `event` is then empty."""
    recipients: tuple[str, ...] = ()
    """The email recipients still owed it when others took it already; () while nobody has."""
    created: float = 0.0

    @property
    def table(self) -> str:
        return "outbox" if self.digest is None else "digest_outbox"


NO_EVENT: GroupEvent = {"status": "", "alertname": "", "dedup_key": "", "alerts": [], "total": 0, "still_firing": 0}


def _done(db: sqlite3.Connection, table: str, entry_id: int, now: float, dropped: str, waiting: bool = False) -> bool:
    """An outbox's row done with (`dropped`: why, when it was not delivered), with `waiting` only
    if it still waits; whether it was. Rows done with more than DONE_KEPT ago are forgotten."""
    done = db.execute(
        f"UPDATE {table} SET delivered = ?, attempts = attempts + 1, last_error = ? WHERE id = ?"  # noqa: S608
        + (" AND delivered IS NULL" if waiting else ""),
        (now, dropped, entry_id),
    ).rowcount
    db.execute(f"DELETE FROM {table} WHERE delivered IS NOT NULL AND delivered < ?", (now - DONE_KEPT,))  # noqa: S608
    return done > 0


def _hand_on(db: sqlite3.Connection, digest: tuple[str, str | None], to: Collection[str], now: float) -> list[str]:
    """Queue a digest (its text and `id`) for each notifier of `to` that has it neither waiting
    nor done with, but for a queue a config change dropped (`RECONFIGURED`: a notifier renamed and
    renamed back gets it again); not one made before what rows are kept for once done (DONE_KEPT:
    who had it is no longer known), nor one whose making is not known. Those it was queued for."""
    text, key = digest
    made = db.execute("SELECT made FROM digests WHERE key = ?", (key,)).fetchone() if key is not None else None
    if made is None or made[0] < now - DONE_KEPT:
        return []
    marks = ",".join("?" * len(RECONFIGURED))
    had = {
        name
        for (name,) in db.execute(
            f"SELECT notifier FROM digest_outbox WHERE json_extract(event, '$.id') = ?"  # noqa: S608 - marks
            f" AND (delivered IS NULL OR last_error NOT IN ({marks}))",
            (key, *RECONFIGURED),
        )
    }
    names = [name for name in dict.fromkeys(to) if name not in had]
    db.executemany(
        "INSERT INTO digest_outbox (notifier, event, created, next_attempt) VALUES (?, ?, ?, ?)",
        [(name, text, now, now) for name in names],
    )
    return names


class AlertStore:
    """Alert state, what was last sent to whom, budget tiers fired, and the delivery outbox.

    `StateStore.transaction()` groups a whole evaluation: state changes and the notifications
    they cause are committed together or not at all.
    """

    def __init__(self, store: StateFile) -> None:
        self.store = store

    def load_states(self) -> dict[str, tuple[str, str]]:
        with self.store.reading() as db:
            return read_alert_states(db)

    def saved_rules(self) -> set[str]:
        """The rule ids of the alerts saved."""
        with self.store.reading() as db:
            return {rule for (rule,) in db.execute("SELECT DISTINCT rule FROM alert_state")}

    def load_sent(self) -> dict[tuple[str, str], float]:
        with self.store.reading() as db:
            rows = db.execute("SELECT key, notifier, sent FROM alert_sent").fetchall()
        return {(key, notifier): sent for key, notifier, sent in rows}

    def tiers_fired(self, rule: str, period: str) -> set[float]:
        with self.store.reading() as db:
            rows = db.execute("SELECT tier FROM budget_tiers WHERE rule = ? AND period = ?", (rule, period)).fetchall()
        return {tier for (tier,) in rows}

    @staticmethod
    def save_state(db: sqlite3.Connection, key: str, rule: str, body: str) -> None:
        db.execute("INSERT OR REPLACE INTO alert_state VALUES (?, ?, ?)", (key, rule, body))

    @staticmethod
    def delete_state(db: sqlite3.Connection, key: str) -> None:
        db.execute("DELETE FROM alert_state WHERE key = ?", (key,))
        db.execute("DELETE FROM alert_sent WHERE key = ?", (key,))

    @staticmethod
    def sent_of(db: sqlite3.Connection, key: str) -> dict[str, float]:
        """The notifiers told of `key`, and when (the marks as they stand: the dispatcher takes one
        away, `forget_sent`, when it drops a firing it never delivered)."""
        return dict(db.execute("SELECT notifier, sent FROM alert_sent WHERE key = ?", (key,)).fetchall())

    @staticmethod
    def mark_sent(db: sqlite3.Connection, key: str, notifier: str, sent: float) -> None:
        db.execute("INSERT OR REPLACE INTO alert_sent VALUES (?, ?, ?)", (key, notifier, sent))

    @staticmethod
    def forget_tiers(db: sqlite3.Connection, rule: str, period: str, tiers: Iterable[float] | None = None) -> None:
        """The tiers of `rule` fired in `period` (those of `tiers` alone, when given) may fire again."""
        if tiers is None:
            db.execute("DELETE FROM budget_tiers WHERE rule = ? AND period = ?", (rule, period))
        else:
            query = "DELETE FROM budget_tiers WHERE rule = ? AND period = ? AND tier = ?"
            db.executemany(query, [(rule, period, tier) for tier in tiers])

    @staticmethod
    def tiers_of(db: sqlite3.Connection, rule: str) -> list[tuple[str, float]]:
        """(period, tier) of every tier of `rule` fired."""
        return db.execute("SELECT period, tier FROM budget_tiers WHERE rule = ?", (rule,)).fetchall()

    @staticmethod
    def mark_tiers(db: sqlite3.Connection, rule: str, period: str, tiers: list[float]) -> None:
        db.executemany("INSERT OR IGNORE INTO budget_tiers VALUES (?, ?, ?)", [(rule, period, t) for t in tiers])

    @staticmethod
    def enqueue(db: sqlite3.Connection, notifier: str, event: GroupEvent, now: float) -> None:
        db.execute(
            "INSERT INTO outbox (notifier, event, created, next_attempt) VALUES (?, ?, ?, ?)",
            (notifier, json.dumps(event), now, now),
        )

    def forget_sent(self, notifier: str, keys: Iterable[str], sent: float) -> None:
        """These alerts were not told to `notifier` after all (the firing queued for it at `sent` was
        dropped): their marks go, if that firing made them, or a reminder due meanwhile moved them on
        without a notification; not one a notification still queued for the notifier made (a later
        firing: its resolve is owed)."""
        with self.store.transaction("outbox") as db:
            db.executemany(
                "DELETE FROM alert_sent WHERE key = ? AND notifier = ? AND (sent = ? OR (sent > ? AND NOT EXISTS ("
                "SELECT 1 FROM outbox WHERE outbox.notifier = alert_sent.notifier AND outbox.delivered IS NULL"
                " AND outbox.created = alert_sent.sent)))",
                [(k, notifier, sent, sent) for k in keys],
            )

    def digest_made(self, key: str) -> bool:
        with self.store.reading() as db:
            return db.execute("SELECT 1 FROM digests WHERE key = ?", (key,)).fetchone() is not None

    def digest_told(self, account: str, account_id: str = "") -> set[dt.date] | None:
        """The settled days whose reconciliation the digests of the account named `account` have
        told (`enqueue_digest`), or those of the billing account `account_id`, whatever its names;
        None before its first digest that told any."""
        with self.store.reading() as db:
            if account_id:
                rows = db.execute("SELECT day FROM digest_told_by WHERE account_id = ?", (account_id,)).fetchall()
            else:
                rows = db.execute("SELECT day FROM digest_told WHERE account = ?", (account,)).fetchall()
        return {dt.date.fromisoformat(day) for (day,) in rows} if rows else None

    def digest_spans(self, account_id: str, first: dt.date, last: dt.date) -> list[tuple[dt.date, dt.date]]:
        """The digests of the account `account_id` (`enqueue_digest`, marked), under any name, that
        told a day from `first` to `last`: the first and last days each told."""
        with self.store.reading() as db:
            rows = db.execute(
                "SELECT first_day, last_day FROM digest_spans WHERE account_id = ? AND last_day >= ?"
                " AND first_day <= ? AND marked",
                (account_id, first.isoformat(), last.isoformat()),
            ).fetchall()
        return [(dt.date.fromisoformat(a), dt.date.fromisoformat(b)) for a, b in rows]

    def digest_owners(self, name: str, days: tuple[dt.date, dt.date]) -> set[str]:
        """The billing accounts whose digests (`enqueue_digest`) of `days` (the first and last they
        told) went under `name`."""
        with self.store.reading() as db:
            rows = db.execute(
                "SELECT DISTINCT account_id FROM digest_spans WHERE name = ? AND first_day = ? AND last_day = ?",
                (name, days[0].isoformat(), days[1].isoformat()),
            )
            return {account_id for (account_id,) in rows}

    def digest_last_owner(self, name: str) -> tuple[str, str] | None:
        """The billing account and project of the last digest marked (by the last day it told) that
        went under `name`; None if none is kept."""
        with self.store.reading() as db:
            row = db.execute(
                "SELECT account_id, project_id FROM digest_spans WHERE name = ? AND marked"
                " ORDER BY last_day DESC, rowid DESC LIMIT 1",
                (name,),
            ).fetchone()
        return None if row is None else (row[0], row[1])

    def enqueue_digest(
        self, key: str, notifiers: Sequence[str], body: Mapping[str, object], now: float,
        told: tuple[str, Iterable[dt.date]] = ("", ()), account_id: str = "", project_id: str = "",
        span: tuple[dt.date, dt.date] | None = None, marked: bool = True,
    ) -> bool:  # fmt: skip
        """Queue the digest `key` (`daily:2026-11-23`) for each notifier, once: False when it was
        queued before (a restart, a second look at the same time). The body gets `id`: the key, so a
        receiver can tell digests apart and drop a repeat. `told`: an account and the settled days
        whose reconciliation this digest tells, kept with it (`digest_told`) for a while after the
        newest (TOLD_KEPT days). `account_id`: the billing account it is of, whatever its name: the
        settled days it tells are kept by it too; with `span` (the first and last days it tells),
        so are those days, with its name (`told`'s) and `project_id`: `marked` (`digest_spans`,
        `digest_last_owner`), or only as whose the digest under that name was (`digest_owners`:
        an account configured alike with another)."""
        account, days = told
        days = sorted(days)
        with self.store.transaction("outbox") as db:
            if db.execute("INSERT OR IGNORE INTO digests VALUES (?, ?)", (key, now)).rowcount == 0:
                return False
            if account_id and span is not None:
                mark = (account_id, account, span[0].isoformat(), span[1].isoformat(), project_id, int(marked))
                db.execute("INSERT OR IGNORE INTO digest_spans VALUES (?, ?, ?, ?, ?, ?)", mark)
                forgotten = span[1] - dt.timedelta(days=TOLD_KEPT)
                db.execute("DELETE FROM digest_spans WHERE last_day < ?", (forgotten.isoformat(),))
            text = json.dumps({**body, "id": key})
            db.executemany(
                "INSERT INTO digest_outbox (notifier, event, created, next_attempt) VALUES (?, ?, ?, ?)",
                [(name, text, now, now) for name in notifiers],
            )
            db.execute("DELETE FROM digests WHERE made < ?", (now - 60 * 86400,))
            if days:
                rows = [(account, day.isoformat()) for day in days]
                db.executemany("INSERT OR IGNORE INTO digest_told VALUES (?, ?)", rows)
                forgotten = days[-1] - dt.timedelta(days=TOLD_KEPT)
                db.execute("DELETE FROM digest_told WHERE account = ? AND day < ?", (account, forgotten.isoformat()))
                if account_id:
                    db.executemany(
                        "INSERT OR IGNORE INTO digest_told_by VALUES (?, ?)", [(account_id, d) for _, d in rows]
                    )
                    db.execute(
                        "DELETE FROM digest_told_by WHERE account_id = ? AND day < ?",
                        (account_id, forgotten.isoformat()),
                    )
        return True

    def head(self, notifier: str, now: float = math.inf) -> OutboxEntry | None:
        """The oldest undelivered notification for a notifier: delivery is in order, one at a time;
        alerts first, then digests (kept apart, so a version without digests never reads one). One
        that only some email recipients are still owed is out of that order: it is the head only
        once its retry is due (at `now`), so one full mailbox never holds back the rest."""
        with self.store.reading() as db:
            for table in OUTBOXES:
                row = db.execute(
                    f"SELECT id, notifier, event, attempts, next_attempt, recipients, created FROM {table}"  # noqa: S608 - one of two names
                    " WHERE notifier = ? AND delivered IS NULL AND (recipients = '' OR next_attempt <= ?)"
                    " ORDER BY id LIMIT 1",
                    (notifier, now),
                ).fetchone()
                if row is not None:
                    break
        if row is None:
            return None
        entry_id, name, text, attempts, next_attempt, recipients, created = row
        try:
            owed = tuple(json.loads(recipients)) if recipients else ()
            if table == "digest_outbox":
                digest = json.loads(text)
                if not isinstance(digest, dict):
                    raise TypeError("not a digest")
                return OutboxEntry(entry_id, name, NO_EVENT, attempts, next_attempt, digest, owed, created)
            event = read_event(text)
            msgspec.convert(event, GroupEvent)  # (every field a delivery reads, of its kind)
            return OutboxEntry(entry_id, name, event, attempts, next_attempt, None, owed, created)
        except (ValueError, KeyError, TypeError, msgspec.ValidationError) as error:
            raise UnreadableEntry(entry_id, table, error) from None

    def delivered(self, entry_id: int, now: float, *, table: str = "outbox") -> None:
        """Done with: delivered."""
        assert table in OUTBOXES
        with self.store.transaction("outbox") as db:
            _done(db, table, entry_id, now, "")

    def drop_waiting(self, table: str, entry_id: int, now: float, reason: str, to: Collection[str]) -> list[str] | None:
        """Drop one queued row with `reason` if it still waits (None when it does not: delivered,
        or dropped already), read or not (a row that cannot be read goes too); a digest so dropped
        is queued for each notifier of `to`, those that take digests now, that has not had it (its
        receivers drop a repeat by its `id` all the same): what a reload took from one goes to
        those that replaced it. Those it was queued for, in their order."""
        assert table in OUTBOXES
        with self.store.transaction("outbox") as db:
            if not _done(db, table, entry_id, now, reason, waiting=True):
                return None
            if table != "digest_outbox" or not to:
                return []
            row = db.execute(
                "SELECT event, json_extract(event, '$.id') FROM digest_outbox WHERE id = ?", (entry_id,)
            ).fetchone()
            return _hand_on(db, row, to, now)

    def failed(
        self, entry_id: int, next_attempt: float, error: str, *, table: str = "outbox", recipients: Sequence[str] = ()
    ) -> None:
        """A failed attempt; `recipients`: the email recipients still owed it, when others took it."""
        assert table in OUTBOXES
        with self.store.transaction("outbox") as db:
            db.execute(
                f"UPDATE {table} SET attempts = attempts + 1, next_attempt = ?, last_error = ?,"  # noqa: S608
                " recipients = COALESCE(NULLIF(?, ''), recipients) WHERE id = ?",
                (next_attempt, error[:500], json.dumps(list(recipients)) if recipients else "", entry_id),
            )

    def discard(
        self,
        keep: Iterable[str],
        now: float,
        reason: str,
        digests_to: Collection[str] = (),
        *,
        digests: bool = False,
        sending: Collection[tuple[str, int]] = (),
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Mark done, with `reason`, what waits for any notifier but those in `keep` (a notifier a
        reload removed, or that is no longer one with a queue), and forget what was sent to them (one
        added again under the same name is then told what fires, as a new one is). A digest dropped
        so goes to each of `digests_to` (of `keep`) that has not had it (`drop_waiting`). `digests`:
        the digests only, of the notifiers that take none now (`keep`: those that do), whatever
        waits before them in their queues. `sending`: the rows being sent (table, id), left to
        their outcome. How many were waiting, per notifier; and how many digests each of
        `digests_to` was given."""
        kept = sorted(set(keep))
        marks = ",".join("?" * len(kept))
        dropped: dict[str, int] = {}
        given: dict[str, int] = {}
        found: list[tuple[str, str | None]] = []
        with self.store.transaction("outbox") as db:
            for table in ("digest_outbox",) if digests else OUTBOXES:
                busy = [entry_id for at, entry_id in sending if at == table]
                where = f"delivered IS NULL AND notifier NOT IN ({marks}) AND id NOT IN ({','.join(map(str, busy))})"
                rows = db.execute(f"SELECT notifier, COUNT(*) FROM {table} WHERE {where} GROUP BY notifier", kept)  # noqa: S608
                for name, count in rows.fetchall():
                    dropped[name] = dropped.get(name, 0) + count
                if table == "digest_outbox":
                    by_digest = (
                        f"SELECT event, json_extract(event, '$.id') AS digest FROM {table}"  # noqa: S608
                        f" WHERE {where} GROUP BY coalesce(digest, id) ORDER BY min(id)"
                    )
                    found = db.execute(by_digest, kept).fetchall()
                db.execute(f"UPDATE {table} SET delivered = ?, last_error = ? WHERE {where}", (now, reason, *kept))  # noqa: S608
            for digest in found:
                for name in _hand_on(db, digest, [n for n in digests_to if n in kept], now):
                    given[name] = given.get(name, 0) + 1
            if not digests:
                db.execute(f"DELETE FROM alert_sent WHERE notifier NOT IN ({marks})", kept)  # noqa: S608
        return dropped, given

    def alert_states(self, keys: Iterable[str]) -> dict[str, tuple[str, float | None, str]]:
        """The current state of each of these alerts that is kept (one resolved long ago is not),
        when its episode started (when it fired; while pending, since when), and its rule."""
        wanted = list(dict.fromkeys(keys))
        found: dict[str, tuple[str, float | None, str]] = {}
        with self.store.reading() as db:
            for start in range(0, len(wanted), 500):
                chunk = wanted[start : start + 500]
                marks = ",".join("?" * len(chunk))
                since = "coalesce(json_extract(body, '$.fired_at'), json_extract(body, '$.active_since'))"
                query = (
                    f"SELECT key, json_extract(body, '$.state'), {since}, rule FROM alert_state WHERE key IN ({marks})"  # noqa: S608
                )
                found.update((key, (state, since, rule)) for key, state, since, rule in db.execute(query, chunk))
        return found

    @property
    def legacy_rule_ids(self) -> bool:
        """The file's alerts were saved with rule ids that depend on the rules' order (layout 0), and
        have not been moved yet."""
        with self.store.reading() as db:
            return db.execute("SELECT 1 FROM meta WHERE key = 'rule_ids'").fetchone() is not None

    def adopt_rule_ids(self, moves: Mapping[str, str], rekey: Callable[[dict[str, Any], str], dict[str, Any]]) -> int:
        """Rewrite the alert tables from old rule ids to new ones, once per file: each saved alert of a
        moved rule becomes `rekey(body, new id)` (its new key, the incident it opened kept), its
        alert_sent rows and queued notifications follow its key, and budget tiers fired follow their
        rule. Then the file no longer says its ids are by position. Returns how many alerts moved."""
        with self.store.transaction("alerts") as db:
            # Read everything, then write: an old id may be another rule's new one.
            renamed: dict[str, str] = {}
            alerts, unread = [], []
            for old_key, rule, text in db.execute("SELECT key, rule, body FROM alert_state").fetchall():
                if rule in moves:
                    try:
                        body = rekey(json.loads(text), moves[rule])
                    except (ValueError, TypeError):  # (a row that cannot be read: its alert is judged afresh)
                        unread.append((moves[rule], old_key))  # (its rule moves, as its tiers do)
                        continue
                    renamed[old_key] = body["key"]
                    alerts.append((body["key"], moves[rule], json.dumps(body)))
            sent = db.execute("SELECT key, notifier, sent FROM alert_sent").fetchall()
            tiers = db.execute("SELECT rule, period, tier FROM budget_tiers").fetchall()
            db.executemany("DELETE FROM alert_state WHERE key = ?", [(key,) for key in renamed])
            db.executemany("INSERT OR REPLACE INTO alert_state VALUES (?, ?, ?)", alerts)
            db.executemany("UPDATE alert_state SET rule = ? WHERE key = ?", unread)
            db.execute("DELETE FROM alert_sent")
            db.executemany(
                "INSERT OR REPLACE INTO alert_sent VALUES (?, ?, ?)",
                [(renamed.get(key, key), notifier, at) for key, notifier, at in sent],
            )
            db.execute("DELETE FROM budget_tiers")
            db.executemany(
                "INSERT OR IGNORE INTO budget_tiers VALUES (?, ?, ?)",
                [(moves.get(rule, rule), period, tier) for rule, period, tier in tiers],
            )
            if renamed:
                for entry_id, text in db.execute("SELECT id, event FROM outbox WHERE delivered IS NULL").fetchall():
                    event = read_event(text)
                    for alert in event["alerts"]:
                        alert["key"] = renamed.get(alert["key"], alert["key"])
                    if "beyond" in event:  # (the alerts past the first GROUP_DETAIL, by key)
                        event["beyond"] = [(renamed.get(key, key), since) for key, since in event["beyond"]]
                    db.execute("UPDATE outbox SET event = ? WHERE id = ?", (json.dumps(event), entry_id))
            db.execute("DELETE FROM meta WHERE key = 'rule_ids'")
        return len(renamed)

    def pending_count(self) -> dict[str, int]:
        """Notifications waiting per notifier, as last committed: read beside the writer (`peeking`),
        as every scrape reads it and no save may hold a scrape up."""
        with self.store.peeking() as db:
            return read_pending(db)
