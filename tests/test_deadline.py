"""The socket deadline (exporter.core.deadline): on a clock the test moves (alarms without their thread), then on
the real alarms' thread waking a thread blocked in recv."""

from __future__ import annotations

import logging
import math
import socket
import threading
from collections.abc import Iterator

import pytest

from exporter.core.deadline import Alarms, Deadline


class Ticks:
    """A monotonic clock the test sets."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def ticks() -> Ticks:
    return Ticks()


@pytest.fixture
def alarms(ticks: Ticks) -> Alarms:
    return Alarms(ticks, threaded=False)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected pair: the exchange's socket, and its peer's."""
    ours, theirs = socket.socketpair()
    ours.settimeout(5)
    theirs.settimeout(5)
    yield ours, theirs
    ours.close()
    theirs.close()


def at(ticks: Ticks, alarms: Alarms, now: float) -> None:
    ticks.now = now
    alarms.fire_due()


def is_shut(sock: socket.socket) -> bool:
    """Whether `sock` has been shut down: its reads end at once (it is never sent anything here)."""
    return sock.recv(1) == b""


def test_it_fires_when_its_time_passes_and_shuts_the_socket_down(
    ticks: Ticks, alarms: Alarms, pair: tuple[socket.socket, socket.socket]
) -> None:
    ours, theirs = pair
    deadline = Deadline(5, alarms=alarms)
    assert deadline.watch(ours) is ours
    at(ticks, alarms, 4.9)
    assert not deadline.fired
    assert deadline.remaining() == pytest.approx(0.1)
    theirs.sendall(b"x")
    assert ours.recv(1) == b"x"  # still open
    at(ticks, alarms, 5.0)
    assert deadline.fired
    assert deadline.remaining() == 0
    assert is_shut(ours)
    assert theirs.recv(1) == b""  # the peer sees the hang-up


def test_arming_again_moves_its_time_and_none_disarms_it(ticks: Ticks, alarms: Alarms) -> None:
    deadline = Deadline(5, alarms=alarms)
    at(ticks, alarms, 3)
    assert deadline.arm(5)
    assert deadline.remaining() == 5
    at(ticks, alarms, 7)  # past the first arming's time
    assert not deadline.fired
    at(ticks, alarms, 8)
    assert deadline.fired

    never = Deadline(alarms=alarms)
    assert never.remaining() == math.inf
    assert never.arm(1)
    assert never.arm(None)
    at(ticks, alarms, 1000)
    assert not never.fired


def test_once_fired_it_stays_fired(ticks: Ticks, alarms: Alarms) -> None:
    deadline = Deadline(1, alarms=alarms)
    at(ticks, alarms, 1)
    assert not deadline.arm(10)  # the exchange is cut: too late to extend it
    assert not deadline.fire()
    assert deadline.fired


def test_fire_cuts_at_once_and_a_socket_watched_after_is_shut_down_as_it_is_watched(
    alarms: Alarms, pair: tuple[socket.socket, socket.socket]
) -> None:
    ours, _ = pair
    deadline = Deadline(alarms=alarms)
    assert deadline.fire()
    assert deadline.fired
    deadline.watch(ours)
    assert is_shut(ours)


def test_once_stopped_it_never_fires_nor_touches_a_socket(
    ticks: Ticks, alarms: Alarms, pair: tuple[socket.socket, socket.socket]
) -> None:
    ours, theirs = pair
    deadline = Deadline(1, alarms=alarms)
    deadline.watch(ours)
    deadline.stop()
    at(ticks, alarms, 2)
    assert not deadline.fired
    assert not deadline.fire()
    assert not deadline.arm(5)
    theirs.sendall(b"x")
    assert ours.recv(1) == b"x"  # untouched: the caller closes it


def test_close_stops_it_then_closes_every_watched_socket(
    ticks: Ticks, alarms: Alarms, pair: tuple[socket.socket, socket.socket]
) -> None:
    ours, theirs = pair
    deadline = Deadline(1, alarms=alarms)
    deadline.watch(ours)
    deadline.watch(theirs)
    deadline.close()
    assert ours.fileno() == theirs.fileno() == -1
    at(ticks, alarms, 2)
    assert not deadline.fired


def test_on_fire_runs_once_before_any_socket_is_shut_down_and_says_whether_it_expired(
    ticks: Ticks, alarms: Alarms, pair: tuple[socket.socket, socket.socket]
) -> None:
    ours, theirs = pair
    calls = []

    def on_fire(expired: bool) -> None:
        ours.sendall(b"bye")  # still open for writing
        calls.append(expired)

    expiring = Deadline(1, on_fire=on_fire, alarms=alarms)
    expiring.watch(ours)
    at(ticks, alarms, 1)
    expiring.fire()
    assert calls == [True]
    assert theirs.recv(3) == b"bye"
    assert is_shut(ours)

    calls.clear()
    fired = Deadline(on_fire=calls.append, alarms=alarms)
    fired.fire()
    fired.fire()
    assert calls == [False]


def test_a_crashing_on_fire_still_cuts_and_the_other_deadlines_fire(
    ticks: Ticks, alarms: Alarms, pair: tuple[socket.socket, socket.socket], caplog: pytest.LogCaptureFixture
) -> None:
    ours, _ = pair

    def crash(expired: bool) -> None:
        raise RuntimeError("a bug")

    crashing = Deadline(1, on_fire=crash, alarms=alarms)
    crashing.watch(ours)
    other = Deadline(1, alarms=alarms)
    with caplog.at_level(logging.ERROR, "exporter.core.deadline"):
        at(ticks, alarms, 1)
    assert crashing.fired
    assert other.fired
    assert is_shut(ours)
    assert [r.getMessage() for r in caplog.records] == ["deadline on_fire crashed"]


def test_the_alarms_fire_in_time_order_only_what_is_due(ticks: Ticks, alarms: Alarms) -> None:
    deadlines = {seconds: Deadline(seconds, alarms=alarms) for seconds in (3, 1, 2)}
    at(ticks, alarms, 1.5)
    assert {s: d.fired for s, d in deadlines.items()} == {3: False, 1: True, 2: False}
    at(ticks, alarms, 3)
    assert all(d.fired for d in deadlines.values())


@pytest.mark.parametrize("seconds", [0.05, None], ids=["its time passes", "fire is called"])
def test_a_thread_blocked_in_recv_is_woken(seconds: float | None, pair: tuple[socket.socket, socket.socket]) -> None:
    ours, _ = pair
    deadline = Deadline(seconds)  # the real alarms, on their own thread
    deadline.watch(ours)
    received = []
    reader = threading.Thread(target=lambda: received.append(ours.recv(1)))  # (else its 5 s timeout raises)
    reader.start()
    if seconds is None:
        deadline.fire()
    reader.join(10)
    assert received == [b""]
    assert deadline.fired


def test_arm_and_fired_agree_while_the_alarms_thread_fires() -> None:
    """Armed again as their times pass on the alarms' thread: each deadline either took the new time (and has not
    fired) or had fired already (and shut its socket down), never half of each."""
    pairs = [socket.socketpair() for _ in range(40)]
    deadlines = [Deadline(0.0005 * i) for i in range(len(pairs))]
    try:
        for deadline, (ours, _) in zip(deadlines, pairs, strict=True):
            deadline.watch(ours)
        for deadline, (ours, _) in zip(deadlines, pairs, strict=True):
            if deadline.arm(60):
                assert not deadline.fired
            else:
                assert deadline.fired
                assert is_shut(ours)
    finally:
        for deadline in deadlines:
            deadline.close()
        for _, theirs in pairs:
            theirs.close()


def test_it_has_passed_when_its_time_comes_before_the_alarms_fire_it(ticks: Ticks, alarms: Alarms) -> None:
    """A socket timeout set to the time left can end an exchange a moment before the alarms' thread fires the
    deadline: the deadline has passed then, though it has not fired."""
    deadline = Deadline(2.0, alarms=alarms)
    ticks.now = 1.0
    assert not deadline.passed
    ticks.now = 2.0  # due, not yet fired
    assert (deadline.fired, deadline.passed) == (False, True)
    alarms.fire_due()
    assert (deadline.fired, deadline.passed) == (True, True)
