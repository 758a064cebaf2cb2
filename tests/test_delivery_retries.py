"""How long a notification the receiver does not take keeps being tried, and how it is counted when
given up: a receiver down for days is tried every few minutes, never faster; one that refuses a
notification outright has it dropped and counted as discarded."""

from __future__ import annotations

import contextlib
import datetime as dt
import threading
import time
from collections.abc import Callable, Collection, Iterator
from email.utils import format_datetime
from functools import partial

import pytest

from exporter.config.load import validate
from exporter.core.clock import Clock, FrozenClock
from exporter.delivery.dispatcher import BACKOFF_MAX, GIVE_UP_AFTER, WAIT_ASKED_MAX, Dispatcher
from exporter.sim import Simulator
from exporter.state import AlertStore, StateError, StateStore
from tests.conftest import SHANGHAI
from tests.daemon_fakes import fake_billing_section
from tests.helpers import Receiver


@pytest.fixture
def frozen() -> FrozenClock:
    return FrozenClock(dt.datetime(2026, 11, 22, 10, 0, tzinfo=SHANGHAI))


@pytest.fixture
def queued(frozen: FrozenClock, receiver: Receiver) -> Iterator[tuple[Dispatcher, AlertStore]]:
    """A dispatcher whose one webhook notifier, `hook`, posts to `receiver`, one notification queued."""
    document = {"billing": fake_billing_section(Simulator(seed=1)),
                "alerts": {"notifiers": [{"name": "hook", "type": "webhook", "url": receiver.url}]}}  # fmt: skip
    store = AlertStore(StateStore(":memory:"))
    clock = Clock(SHANGHAI, frozen)
    dispatcher = Dispatcher(validate(document, {}).alerts.notifiers, store, clock, lambda _: [], "")
    now = clock.now().timestamp()
    alert = {"key": "k", "dedup_key": "d", "status": "resolved", "labels": {"alertname": "A"}, "annotations": {},
             "starts_at": now - 60, "ends_at": now, "value": "1"}  # fmt: skip
    event = {"status": "resolved", "alertname": "A", "dedup_key": "d", "total": 1, "still_firing": 0, "alerts": [alert]}
    with store.store.transaction() as db:
        AlertStore.enqueue(db, "hook", event, now)  # type: ignore[arg-type]
    yield dispatcher, store
    dispatcher.close()


def test_a_receiver_down_for_days_is_tried_again_within_the_longest_backoff(
    frozen: FrozenClock, receiver: Receiver, queued: tuple[Dispatcher, AlertStore]
) -> None:
    """A week of 503s leaves some two thousand tries behind the notification: the next one fails
    as the others did (no crash, which would retry at every poll), and waits its backoff."""
    dispatcher, store = queued
    receiver.refuse = 10**9
    with store.store.transaction() as db:  # (a week of tries, at most five minutes apart)
        db.execute("UPDATE outbox SET attempts = 2016")
    for _ in range(3):
        dispatcher.deliver()
        head = store.head("hook")
        assert head is not None
        now = frozen().timestamp()
        assert now < head.next_attempt <= now + BACKOFF_MAX * 1.2
        frozen.set(dt.datetime.fromtimestamp(head.next_attempt + 0.001, dt.UTC))  # (a datetime keeps microseconds)
    assert (receiver.attempts, head.attempts) == (3, 2019)


def test_a_notification_refused_outright_is_dropped_and_counted_as_discarded(
    frozen: FrozenClock, receiver: Receiver, queued: tuple[Dispatcher, AlertStore]
) -> None:
    dispatcher, _ = queued
    receiver.redirect_to = "https://elsewhere.example/"  # (a redirect is never followed: refused)
    for _ in range(GIVE_UP_AFTER):
        frozen.advance(dt.timedelta(seconds=BACKOFF_MAX * 1.2))
        dispatcher.deliver()
    sent, failed, discarded = dispatcher.counts()
    assert (sent["hook"], failed["hook"], dispatcher.pending()) == (0, GIVE_UP_AFTER, {})
    assert discarded["refused"] == 1


def test_a_drop_the_state_file_refused_is_counted_once_it_is_written(
    frozen: FrozenClock, receiver: Receiver, queued: tuple[Dispatcher, AlertStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused outright for the last time, the notification is dropped; the state file refuses to
    write so once, and the drop is written when delivery resumes: counted then, once."""
    dispatcher, store = queued
    receiver.redirect_to = "https://elsewhere.example/"  # (a redirect is never followed: refused)
    drop_waiting, refused = store.drop_waiting, []

    def refusing_once(table: str, entry_id: int, now: float, reason: str, to: Collection[str]) -> list[str] | None:
        if not refused:
            refused.append(entry_id)
            raise StateError(":memory:", "database is locked")
        return drop_waiting(table, entry_id, now, reason, to)

    monkeypatch.setattr(store, "drop_waiting", refusing_once)
    for _ in range(GIVE_UP_AFTER):
        frozen.advance(dt.timedelta(seconds=BACKOFF_MAX * 1.2))
        suppress_state_errors(dispatcher.deliver)
    assert refused
    assert (dispatcher.counts()[2]["refused"], dispatcher.pending()) == (0, {"hook": 1})  # (not written: waits)
    for _ in range(2):
        dispatcher.deliver()
        assert (dispatcher.counts()[2]["refused"], dispatcher.pending()) == (1, {})
    assert receiver.attempts == GIVE_UP_AFTER


def test_a_notification_taken_as_a_reload_renames_its_notifier_is_not_dropped_when_its_delivery_is_unsaved(
    receiver: Receiver, queued: tuple[Dispatcher, AlertStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The receiver took it; the state file refused to write so once: it still waited, and was
    dropped as its notifier's, counted and logged so, though delivered (a digest, handed on: sent
    twice)."""
    dispatcher, store = queued
    arrived, release = threading.Event(), threading.Event()
    delivered, refused = store.delivered, []

    def hold() -> None:
        arrived.set()
        release.wait(10)

    def refusing_once(entry_id: int, now: float, *, table: str = "outbox") -> None:
        if not refused:
            refused.append(entry_id)
            raise StateError(":memory:", "database is locked")
        delivered(entry_id, now, table=table)

    receiver.on_post = hold
    monkeypatch.setattr(store, "delivered", refusing_once)
    monkeypatch.setattr(dispatcher, "deliver", partial(suppress_state_errors, dispatcher.deliver))
    assert renamed_mid_delivery(dispatcher, receiver, arrived, release) == 0
    assert refused
    with store.store.reading() as db:
        assert db.execute("SELECT last_error FROM outbox").fetchall() == [("",)]  # (not dropped)


def suppress_state_errors(call: Callable[[], object]) -> None:
    with contextlib.suppress(StateError):
        call()


def renamed_mid_delivery(
    dispatcher: Dispatcher, receiver: Receiver, started: threading.Event, release: threading.Event
) -> int:
    """`deliver` in a thread until `started`; a reload renaming its notifier; `release`, and the
    delivery's end: how many notifications were counted as dropped for a removed notifier."""
    sending = threading.Thread(target=dispatcher.deliver)
    sending.start()
    assert started.wait(10)
    configure(dispatcher, receiver, "renamed")
    release.set()
    sending.join(10)
    return dispatcher.counts()[2]["notifier_removed"]


def configure(dispatcher: Dispatcher, receiver: Receiver, name: str) -> None:
    """A reload that leaves one webhook notifier, `name`, posting to `receiver`."""
    document = {"billing": fake_billing_section(Simulator(seed=1)),
                "alerts": {"notifiers": [{"name": name, "type": "webhook", "url": receiver.url}]}}  # fmt: skip
    dispatcher.configure(validate(document, {}).alerts.notifiers, "")


@pytest.mark.parametrize("answer", ["taken", "refused"])
def test_a_notification_on_the_wire_as_a_reload_renames_its_notifier_is_counted_as_what_became_of_it(
    receiver: Receiver, queued: tuple[Dispatcher, AlertStore], answer: str
) -> None:
    """Its POST is under way when a reload renames the notifier (the same URL): taken, it is
    delivered, not dropped (it was logged and counted as dropped while the receiver had it);
    refused, it is dropped then, and counted once."""
    dispatcher, store = queued
    arrived, release = threading.Event(), threading.Event()

    def hold() -> None:
        arrived.set()
        release.wait(10)

    receiver.on_post, receiver.refuse = hold, int(answer == "refused")
    assert renamed_mid_delivery(dispatcher, receiver, arrived, release) == int(answer == "refused")
    assert dispatcher.pending() == {}
    with store.store.reading() as db:
        ((done, why),) = db.execute("SELECT delivered IS NOT NULL, last_error FROM outbox").fetchall()
    assert (done, bool(why)) == (1, answer == "refused")


@pytest.mark.parametrize("answer", ["taken", "refused"])
def test_a_reload_that_lands_as_the_worker_takes_a_notification_up_counts_it_as_what_became_of_it(
    receiver: Receiver, queued: tuple[Dispatcher, AlertStore], answer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reload comes after the worker read the queue's head, before it sent it (while it reads
    the alerts' states): the head was counted as dropped, and sent all the same."""
    dispatcher, store = queued
    inside, release = threading.Event(), threading.Event()
    states = store.alert_states

    def held(keys: list[str]) -> object:
        inside.set()
        release.wait(10)
        return states(keys)

    monkeypatch.setattr(store, "alert_states", held)
    receiver.refuse = int(answer == "refused")
    assert renamed_mid_delivery(dispatcher, receiver, inside, release) == int(answer == "refused")
    assert len(receiver.received) == int(answer == "taken")


def test_a_notification_refused_on_the_wire_as_reloads_remove_its_notifier_and_add_it_back_is_dropped(
    receiver: Receiver, queued: tuple[Dispatcher, AlertStore]
) -> None:
    """A notifier added back under its name starts with an empty queue: the row sent as it was
    removed, refused, went back to the queue of the notifier added back."""
    dispatcher, _ = queued
    arrived, release = threading.Event(), threading.Event()

    def hold() -> None:
        arrived.set()
        release.wait(10)

    receiver.on_post, receiver.refuse = hold, 1
    sending = threading.Thread(target=dispatcher.deliver)
    sending.start()
    assert arrived.wait(10)
    for name in ("renamed", "hook"):
        configure(dispatcher, receiver, name)
    release.set()
    sending.join(10)
    assert dispatcher.pending() == {}
    assert dispatcher.counts()[2]["notifier_removed"] == 1


@pytest.mark.parametrize("answer", ["taken", "refused"])
@pytest.mark.parametrize(
    "reload",
    ["its notifier removed", "its notifier kept, digests sent to another", "removed and added back",
     "digests sent to another and back"],
)  # fmt: skip
def test_a_digest_on_the_wire_as_a_reload_takes_digests_from_its_notifier_is_left_to_its_answer(
    receiver: Receiver, frozen: FrozenClock, reload: str, answer: str
) -> None:
    """Taken, it was delivered, not dropped (it was counted as dropped and handed on); refused, it
    goes to the notifier that takes digests now, at once (not after its backoff)."""
    store = AlertStore(StateStore(":memory:"))
    clock = Clock(SHANGHAI, frozen)

    def hooks(*names: str) -> list:
        listed = [{"name": n, "type": "webhook", "url": receiver.url if n == "hook" else f"{receiver.url}/{n}"}
                  for n in names]  # fmt: skip
        return list(validate({"billing": fake_billing_section(Simulator(seed=1)),
                              "alerts": {"notifiers": listed}}, {}).alerts.notifiers)  # fmt: skip

    wanted = ["hook"]
    dispatcher = Dispatcher(hooks("hook", "other"), store, clock, lambda _: [], "", digests_to=lambda: wanted)
    try:
        store.enqueue_digest("daily:2026-11-22", ["hook"], {"kind": "digest", "text": "x"}, clock.now().timestamp())
        arrived, release = threading.Event(), threading.Event()

        def hold() -> None:
            arrived.set()
            release.wait(10)

        receiver.on_post, receiver.refuse = hold, int(answer == "refused")
        sending = threading.Thread(target=dispatcher._drain, args=("hook",))
        sending.start()
        assert arrived.wait(10)
        wanted = ["other"]
        dispatcher.configure(hooks("other") if "removed" in reload else hooks("hook", "other"), "")
        if "back" in reload:  # (a later reload gives its digests back: they are its to retry)
            wanted = ["hook"]
            dispatcher.configure(hooks("hook", "other"), "")
        release.set()
        sending.join(10)
        _, _, discarded = dispatcher.counts()
        with store.store.reading() as db:
            rows = db.execute("SELECT notifier, delivered IS NOT NULL FROM digest_outbox ORDER BY id").fetchall()
        if answer == "taken":
            assert (discarded["notifier_removed"], rows) == (0, [("hook", 1)])
        elif "back" in reload:
            assert (discarded["notifier_removed"], rows) == (0, [("hook", 0)])
        else:
            assert (discarded["notifier_removed"], rows) == (1, [("hook", 1), ("other", 0)])
    finally:
        dispatcher.close()


@pytest.mark.parametrize(
    "damage",
    ["cut short", "an alert without its key", "an event without its status", "an alert without its labels",
     "a digest that is a list"],
)  # fmt: skip
def test_a_queued_notification_that_cannot_be_read_is_dropped_and_the_next_goes_out(
    receiver: Receiver, queued: tuple[Dispatcher, AlertStore], damage: str
) -> None:
    """Its row damaged in the state file (a disk's rot, a hand's edit): dropped, counted, and what
    waits behind it is delivered (it stopped every delivery of the notifier, a traceback a poll)."""
    dispatcher, store = queued
    with store.store.transaction() as db:
        db.execute("INSERT INTO outbox (notifier, event, created, next_attempt)"
                   " SELECT notifier, event, created, next_attempt FROM outbox")  # fmt: skip
        (first,) = db.execute("SELECT MIN(id) FROM outbox").fetchone()
        if damage == "cut short":
            db.execute("UPDATE outbox SET event = substr(event, 1, 20) WHERE id = ?", (first,))
        elif damage.startswith(("an alert", "an event")):
            field = {"key": "$.alerts[0].key", "status": "$.status", "labels": "$.alerts[0].labels"}[damage.split()[-1]]
            db.execute("UPDATE outbox SET event = json_remove(event, ?) WHERE id = ?", (field, first))
        else:
            db.execute("INSERT INTO digest_outbox (notifier, event, created, next_attempt) VALUES ('hook', '[]', 0, 0)")
    dispatcher.deliver()
    _, _, discarded = dispatcher.counts()
    assert discarded["unreadable"] == 1
    assert len(receiver.bodies()) == (2 if damage.startswith("a digest") else 1)  # (the alerts' two, whole)
    assert dispatcher.pending() == {}


def test_a_refusal_after_the_receiver_was_down_is_one_refusal_not_the_last_try(
    frozen: FrozenClock, receiver: Receiver, queued: tuple[Dispatcher, AlertStore]
) -> None:
    """Six 503s (the receiver down), then one 404 (an ingress in a rollout), then the receiver back:
    the notification is delivered; it is given up only after GIVE_UP_AFTER refusals in a row."""
    dispatcher, store = queued
    receiver.answers = [(503, {})] * 6 + [(404, {})]
    for _ in range(8):
        dispatcher.deliver()
        frozen.advance(dt.timedelta(seconds=BACKOFF_MAX * 1.2))
    sent, _, discarded = dispatcher.counts()
    assert (sent["hook"], discarded["refused"], len(receiver.bodies())) == (1, 0, 1)
    # A receiver that refuses it outright after an outage has it dropped within minutes (its retries
    # are paced by the refusals, not by the outage's tries), not after 5 tries 5 minutes apart.
    with store.store.transaction() as db:
        db.execute("UPDATE outbox SET delivered = NULL, attempts = 100")
    receiver.answers = [(404, {})] * GIVE_UP_AFTER
    started = frozen().timestamp()
    while dispatcher.pending():
        dispatcher.deliver()
        head = store.head("hook")
        frozen.set(dt.datetime.fromtimestamp(head.next_attempt + 0.001 if head else frozen().timestamp(), dt.UTC))
    assert dispatcher.counts()[2]["refused"] == 1
    assert frozen().timestamp() - started < 2 * 60


@pytest.mark.parametrize("asked", ["600", "an HTTP date 600 s on"])
def test_a_receiver_that_asks_to_wait_is_not_tried_again_sooner(
    frozen: FrozenClock, receiver: Receiver, queued: tuple[Dispatcher, AlertStore], asked: str
) -> None:
    dispatcher, store = queued
    wait = 600.0
    when = format_datetime(dt.datetime.fromtimestamp(time.time() + wait, dt.UTC), usegmt=True)
    receiver.answers = [(429, {"Retry-After": "600" if asked == "600" else when})]
    dispatcher.deliver()
    head = store.head("hook")
    assert head is not None
    assert head.next_attempt - frozen().timestamp() >= wait - 5  # (an HTTP date: to the second)
    receiver.answers = [(503, {"Retry-After": str(10 * 86400)})]  # (a day and more: an hour at most)
    frozen.set(dt.datetime.fromtimestamp(head.next_attempt + 1, dt.UTC))
    dispatcher.deliver()
    head = store.head("hook")
    assert head is not None
    assert head.next_attempt - frozen().timestamp() == pytest.approx(WAIT_ASKED_MAX, abs=1)


def test_a_state_file_that_refuses_pauses_delivery_said_once_and_its_recovery_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A disk full for an hour was an error line every poll of every notifier."""
    from exporter.delivery.dispatcher import _Worker
    from exporter.state import StateError
    from tests.helpers import logged, wait_for

    caplog.set_level("INFO")
    outcomes = [StateError("state.db", "disk full")] * 5 + [StateError("state.db", "read-only")] * 3 + [None] * 3
    done = []

    def work() -> None:
        outcome = outcomes[len(done)] if len(done) < len(outcomes) else None
        done.append(outcome)
        if outcome is not None:
            raise outcome

    worker = _Worker("hook", work, 0.001)
    try:
        wait_for(lambda: len(done) >= len(outcomes))
    finally:
        worker.stop()
        worker.join(5)
    paused = [r.__dict__.get("fields", {}).get("error") for r in logged(caplog.records, "notification delivery paused")]
    assert paused == ["disk full", "read-only"]
    assert len(logged(caplog.records, "notification delivery resumed")) == 1
