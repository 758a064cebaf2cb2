"""The synthetic probe's logic without a socket: the simulator's chat answers in process, timed on a
clock that moves only when an answer pauses; bodies written out by hand, fed to `Measurement`.

What only the wire shows (framing, gzip, real read timeouts, resets, statuses end to end, the
cut-off of an endless answer) is in test_probe_http.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import pytest

from exporter.config.load import validate
from exporter.config.schema import InferenceConfig, ProbeConfig
from exporter.model.snapshots import ProbeRun, ProbeSnapshot
from exporter.sim import Fault, Simulator
from exporter.sources.probe import (
    REASONS,
    Measurement,
    ProbeFailure,
    ProbeRunner,
    Silence,
    answer_cap,
    sse_events,
    unusable,
    without,
)
from exporter.sources.probe_answer import MAX_LINE_BYTES
from tests.fakes import InProcessChat, Ticks
from tests.helpers import logged

BILLING = {"url": "http://127.0.0.1:1", "access_key_id": "AK", "secret_access_key": "s"}
CHAT = "/v1/chat/completions"


def configs(
    url: str = "http://127.0.0.1:1", api_key: str = "k", **probe: object
) -> tuple[ProbeConfig, InferenceConfig]:
    document = {
        "billing": BILLING,
        "inference": {"url": url, "api_key": api_key},
        "probes": [{"name": "p", "model": "ep", "timeout": "5s"} | probe],
    }
    config = validate(document, {})
    assert config.inference is not None
    return config.probes[0], config.inference


CUTS = ("as written", "split", "coalesced")
"""How a body arrives in pieces: one per write of the server; each write in pieces of a few bytes
(segments); the writes of one moment in one piece (a read that found them all there)."""


def in_process(sim: Simulator, cut: str = "as written", api_key: str | None = None, **probe: object) -> ProbeRunner:
    """A runner of a probe on `sim`'s first endpoint, its requests answered in process."""
    config, inference = configs(**({"model": sim.endpoints[0].endpoint_id} | probe))
    clock = Ticks()
    chat = InProcessChat(sim, clock, api_key or sim.api_key, cut)
    return ProbeRunner(config, inference, chat=chat, clock=clock)


def measure(body: Iterable[tuple[bytes, float]], **probe: object) -> ProbeRun:
    """A run of a probe answered 200 whose body arrives as `body` says (the run starts at 0 with
    the headers, and ends at 10)."""
    config, _ = configs(**probe)
    measurement = Measurement(config, 0.0)
    try:
        measurement.response(200, 0.0, body)
        reason = None
    except ProbeFailure as failure:
        reason = failure.reason
    return measurement.result(reason, 10.0)


def assert_failed_once(snapshot: ProbeSnapshot, reason: str) -> None:
    assert snapshot.last.success is False
    assert snapshot.last.reason == reason
    assert snapshot.runs == 1
    assert snapshot.failures == {r: int(r == reason) for r in REASONS}
    assert snapshot.e2e_latency.count == 0


SCENARIOS = [
    ("chat", {"expect_content": "(?i)pong"}, {"http", "content", "usage"}),
    ("json", {"expect_keys": ["status", "detail"]}, {"http", "json", "usage"}),
    ("tools", {}, {"http", "tool_call", "usage"}),
    ("thinking", {}, {"http", "content", "reasoning", "usage"}),
]
DELIVERIES = [(False, "as written"), (False, "split"), *((True, cut) for cut in CUTS)]


@pytest.mark.parametrize(("stream", "cut"), DELIVERIES, ids=[f"stream={s}-{c}" for s, c in DELIVERIES])
@pytest.mark.parametrize(("scenario", "extra", "checks"), SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_each_scenario_passes(
    sim: Simulator, scenario: str, extra: dict, checks: set[str], stream: bool, cut: str
) -> None:
    sim.time_to_first_token, sim.chunk_delay = 0.05, 0.01
    snapshot = in_process(sim, cut, scenario=scenario, stream=stream, **extra).run()
    assert_passed(snapshot, checks, stream)
    last = snapshot.last
    if stream:
        assert (last.time_to_headers, last.time_to_first_token) == (0, pytest.approx(0.05))
    else:
        assert last.time_to_headers == last.duration  # a whole answer comes with its headers


def assert_passed(snapshot: ProbeSnapshot, checks: set[str], stream: bool) -> None:
    """A run of a scenario passed, its first token (streamed) 50 ms or more after the start."""
    last = snapshot.last
    assert (last.success, last.reason) == (True, None)
    expected = checks | ({"stream_complete"} if stream else set())
    assert dict(last.checks) == dict.fromkeys(expected, True)
    assert last.completion_tokens > 0
    assert last.prompt_tokens > 0
    assert snapshot.tokens == {"prompt": last.prompt_tokens, "completion": last.completion_tokens}
    assert last.duration >= 0.05
    if stream:
        assert last.time_to_first_token is not None
        assert 0.05 <= last.time_to_first_token <= last.duration
        assert snapshot.time_to_first_token.count == 1
    else:
        assert last.time_to_first_token is None
    assert snapshot.e2e_latency.count == 1


@pytest.mark.parametrize("stream", [True, False])
def test_a_run_is_timed_on_the_clock_it_is_given(sim: Simulator, stream: bool) -> None:
    """The answer "pong" in two deltas, 50 ms to the first and 10 ms more to the second: the run in
    exact figures."""
    sim.time_to_first_token, sim.chunk_delay = 0.05, 0.01
    last = in_process(sim, stream=stream).run().last
    assert last.duration == pytest.approx(0.06)
    assert last.completion_tokens == 2
    if stream:
        assert (last.time_to_headers, last.time_to_first_token) == (0, pytest.approx(0.05))
        assert last.max_chunk_gap == pytest.approx(0.01)
        # The token after the first, over the 10 ms it took (one a 10 ms is 100 a second).
        assert last.output_tokens_per_second == pytest.approx(1 / 0.01)
    else:
        assert (last.time_to_headers, last.time_to_first_token, last.max_chunk_gap) == (pytest.approx(0.06), None, None)
        assert last.output_tokens_per_second == pytest.approx(2 / 0.06)  # over the whole run


@pytest.mark.parametrize("cut", CUTS)
def test_thinking_times_reasoning_and_answer_apart(sim: Simulator, cut: str) -> None:
    """Six reasoning deltas, then two of the answer, 20 ms apart; however the bytes are cut."""
    sim.time_to_first_token, sim.chunk_delay = 0.05, 0.02
    last = in_process(sim, cut, scenario="thinking").run().last
    assert last.time_to_first_token == last.time_to_first_reasoning_token == pytest.approx(0.05)
    assert last.time_to_first_answer_token == pytest.approx(0.05 + 6 * 0.02)
    assert last.max_chunk_gap == pytest.approx(0.02)
    assert last.duration == pytest.approx(0.05 + 7 * 0.02)


STATUSES = [
    ("http_401", {}, None, {"api_key": "wrong-key"}),
    ("http_403", {}, Fault("status", CHAT, status=403), {}),
    ("http_404", {}, None, {"model": "ep-does-not-exist"}),
    ("http_429", {}, Fault("status", CHAT, status=429, retry_after=1), {}),
    ("http_4xx", {}, Fault("status", CHAT, status=400), {}),
    ("http_5xx", {}, Fault("status", CHAT, status=502), {}),
]
SILENCES = [
    ("timeout_first_token", {"time_to_first_token": 1.0}, None, {"first_token_timeout": "300ms"}),
    ("stall", {}, Fault("stall", CHAT, seconds=1.0), {"stall_timeout": "300ms"}),
]
"""A stream gone silent, for longer than the read timeout."""
FAULTS = [
    *STATUSES,
    *SILENCES,
    ("timeout_total", {"chunk_delay": 0.15}, None, {"scenario": "thinking", "timeout": "600ms"}),
    ("stream_error", {}, Fault("stream_error", CHAT), {}),
    ("truncated", {}, Fault("truncate", CHAT), {}),
    ("invalid_json", {}, Fault("malformed", CHAT), {"stream": False}),
    ("tool_call_missing", {}, Fault("plain_answer", CHAT), {"scenario": "tools"}),
    ("tool_args_invalid", {}, Fault("bad_tool_args", CHAT), {"scenario": "tools"}),
    ("usage_missing", {}, Fault("no_usage", CHAT), {}),
    ("content_mismatch", {}, None, {"expect_content": "^hello$"}),
    ("content_mismatch", {}, Fault("plain_answer", CHAT), {"scenario": "thinking"}),  # no reasoning came back
]
"""Each reason the simulator's answers can produce in process: as (reason, simulator settings, the
fault of one request, probe settings). Those of a connection (`connection`, `timeout_connect`, a
reset) are in test_probe_http.py."""


@pytest.mark.parametrize(("reason", "sim_settings", "fault", "probe"), FAULTS, ids=[f[0] for f in FAULTS])
def test_each_failure_reason_is_produced_and_counted_once(
    sim: Simulator, reason: str, sim_settings: dict, fault: Fault | None, probe: dict
) -> None:
    fails_once_then_recovers(sim, partial(in_process, sim), reason, sim_settings, fault, probe)


def fails_once_then_recovers(
    sim: Simulator,
    runner: Callable[..., ProbeRunner],
    reason: str,
    sim_settings: dict,
    fault: Fault | None,
    probe: dict,
) -> None:
    """A run with `sim_settings` and `fault` fails for `reason` alone; with both undone the next run
    passes, the failure still counted (unless the probe itself is wrong: key, model, content)."""
    for name, value in sim_settings.items():
        setattr(sim, name, value)
    if fault:
        sim.inject(dataclasses.replace(fault))  # a copy: the simulator counts down the `times` of the one it holds
    probe = dict(probe)
    api_key = probe.pop("api_key", None)
    probe_runner = runner(api_key=api_key, **probe)
    assert_failed_once(probe_runner.run(), reason)
    assert probe_runner.last_reason == reason
    assert probe_runner.last_detail is not None
    assert probe_runner.last_detail.endswith(f" (POST {probe_runner.url})")  # every failure names where it went
    sim.clear_faults()
    for name in sim_settings:
        setattr(sim, name, 0.0)
    if not (api_key or "model" in probe or "expect_content" in probe):
        recovered = probe_runner.run()  # the fault was for one request only
        assert recovered.last.success, recovered.last.reason
        assert recovered.failures[reason] == 1


@pytest.mark.parametrize(
    ("sim_settings", "fault", "probe", "reason", "gave_up"),
    [
        ({"time_to_first_token": 1.0}, None, {"first_token_timeout": "300ms"}, "timeout_first_token", 0.3),
        ({"time_to_first_token": 1.0}, None, {"stream": False, "timeout": "600ms"}, "timeout_total", 0.6),
        (
            {"time_to_first_token": 1.0},
            None,
            {"stream": False, "first_token_timeout": "300ms", "stall_timeout": "200ms"},
            None,
            None,
        ),  # a whole answer: the streamed deadlines do not apply
        ({"time_to_first_token": 0.5}, None, {"first_token_timeout": "800ms", "stall_timeout": "300ms"}, None, None),
        ({}, Fault("stall", CHAT, seconds=1.0), {"stall_timeout": "300ms"}, "stall", 0.3),
    ],
    ids=[
        "first token",
        "whole answer",
        "whole answer, streamed deadlines",
        "a stall shorter than the first token's",
        "stall",
    ],
)
def test_a_silent_endpoint_is_left_at_the_read_timeout(
    sim: Simulator, sim_settings: dict, fault: Fault | None, probe: dict, reason: str, gave_up: float
) -> None:
    """Each wait ends at the deadline of the run's phase: the run ends when that much silence has
    passed (from the start: the answer's other pieces come at once), not when the late piece comes;
    a first token later than the stall's deadline but within its own passes (None: the run passes)."""
    for name, value in sim_settings.items():
        setattr(sim, name, value)
    if fault:
        sim.inject(fault)
    last = in_process(sim, **probe).run().last
    assert last.reason == reason
    if gave_up is not None:
        assert last.duration == pytest.approx(gave_up)


def test_each_wait_ends_at_the_deadline_of_the_runs_phase() -> None:
    """Until a streamed answer's first token, the first token's deadline; then the stall's, from the
    last event (bytes that make none, keep-alive comments, do not move it); never past the whole
    request's. A whole answer has the whole request's alone."""
    usage = {"prompt_tokens": 5, "completion_tokens": 2}
    pieces = [
        (event({"role": "assistant"}), 101.0),  # not a token
        (event({"content": "po"}), 104.0),  # the first token
        (b": keep-alive\n\n", 105.0),
        (event({"content": "ng"}, "stop"), 105.5),
        (event(usage=usage) + b"data: [DONE]\n\n", 106.0),
    ]

    answer = {"choices": [{"message": {"content": "pong"}, "finish_reason": "stop"}], "usage": usage}
    text = json.dumps(answer).encode()
    whole = [(text[n * 20 : (n + 1) * 20] if n < 4 else text[80:], at) for n, (_, at) in enumerate(pieces)]
    """The whole answer, arriving in pieces at the same times."""

    def deadlines(timeout: str, **probe: object) -> list[float]:
        config, _ = configs(timeout=timeout, first_token_timeout="8s", stall_timeout="2s", **probe)
        measurement = Measurement(config, 100.0)
        seen = []

        def body() -> Iterator[tuple[bytes, float]]:
            for piece in pieces if config.stream else whole:
                seen.append(measurement.deadline())
                yield piece

        if timeout == "30s":
            measurement.response(200, 100.0, body())
        else:
            with pytest.raises(ProbeFailure) as failed:
                measurement.response(200, 100.0, body())
            assert failed.value.reason == "timeout_total"
        return seen

    assert deadlines("30s") == [108.0, 108.0, 106.0, 106.0, 107.5]
    assert deadlines("5s") == [105.0] * 4  # (the piece at 105.5 comes too late: the run fails at it)
    assert deadlines("30s", stream=False) == [130.0] * 5


def test_a_failure_is_logged_once_until_the_probe_recovers(sim: Simulator, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    sim.inject(Fault("stream_error", CHAT, times=2))
    probe_runner = in_process(sim)
    assert [probe_runner.run().last.reason for _ in range(3)] == ["stream_error", "stream_error", None]
    [failed] = logged(caplog.records, "probe failed", probe="p", reason="stream_error")
    assert failed.fields["detail"].endswith(" (POST http://127.0.0.1:1/v1/chat/completions)")  # type: ignore[attr-defined]
    assert len(logged(caplog.records, "probe recovered", probe="p")) == 1
    assert (probe_runner.last_reason, probe_runner.last_detail) == (None, None)


def event(delta: dict[str, Any] | None = None, finish: str | None = None, usage: dict | None = None) -> bytes:
    """One stream event, as a server writes it."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return f"data: {json.dumps({'choices': choices} | ({'usage': usage} if usage else {}))}\n\n".encode()


ROLE = event({"role": "assistant", "content": ""})
PONG = event({"content": "pong"})
END = event({}, "stop", {"prompt_tokens": 5, "completion_tokens": 1}) + b"data: [DONE]\n\n"


def then_raise(pieces: Iterable[tuple[bytes, float]], error: Exception) -> Iterator[tuple[bytes, float]]:
    yield from pieces
    raise error


@pytest.mark.parametrize(
    ("stream", "before", "error", "reason", "first_token"),
    [
        (True, [], Silence(5.0), "timeout_first_token", None),
        (True, [(ROLE, 0.1)], Silence(5.0), "timeout_first_token", None),  # a role is not a token
        (True, [(ROLE, 0.1), (PONG, 0.2)], Silence(1.2), "stall", 0.2),
        (True, [(ROLE, 0.1), (PONG, 0.2)], ConnectionError("ProtocolError"), "truncated", 0.2),
        (False, [(b'{"choices": [', 0.1)], Silence(5.0), "timeout_total", None),
        (False, [(b'{"choices": [', 0.1)], ConnectionError("ProtocolError"), "truncated", None),
    ],
    ids=["silent", "silent after the role", "stalled", "broken", "whole silent", "whole broken"],
)
def test_silence_or_a_broken_connection_mid_body(
    stream: bool, before: list[tuple[bytes, float]], error: Exception, reason: str, first_token: float | None
) -> None:
    """What the transport reports while the body comes: silence until the run's deadline (Silence,
    here 5 s for the whole request and the first token, 1 s for a stall) or a broken connection
    (ConnectionError). A stall counts as the longest gap: it was at least that long."""
    run = measure(then_raise(before, error), stream=stream, stall_timeout="1s")
    assert (run.success, run.reason, run.checks["http"]) == (False, reason, True)
    assert run.time_to_first_token == first_token
    if reason == "stall":
        assert run.max_chunk_gap == pytest.approx(1.0)


def test_a_stream_ending_without_a_finish_reason_is_truncated() -> None:
    run = measure([(ROLE, 0.1), (PONG, 0.2), (b"data: [DONE]\n\n", 0.3)])
    assert run.reason == "truncated"
    assert run.checks["stream_complete"] is False
    assert measure([(ROLE, 0.1), (PONG, 0.2), (END, 0.3)]).success


def test_each_piece_is_held_to_the_deadlines_not_only_each_event() -> None:
    """A server that sends SSE comments for ever, never a token, ends the run at the first piece
    past the first-token deadline, though no event has come."""
    step = 0.0625  # exact in binary: the 5th piece is the first past 300 ms
    pulled = 0

    def comments() -> Iterator[tuple[bytes, float]]:
        nonlocal pulled
        for n in range(1, 1000):
            pulled = n
            yield b": keep-alive\n\n", n * step

    run = measure(comments(), timeout="2s", first_token_timeout="300ms")
    assert run.reason == "timeout_first_token"
    assert pulled == 5
    late = [(ROLE, 0.1), (PONG, 0.2), (event({"content": "!"}), 2.5), (END, 2.6)]
    assert measure(late, timeout="2s").reason == "timeout_total"


def test_sse_parser_joins_split_lines_and_multi_line_data() -> None:
    chunks = [b'data: {"a"', b": 1}\n\n: a comment\n\ndata: line one\n", b"data: line two\r\n\r\n", b"data: [DONE]"]
    assert list(sse_events(chunks)) == ['{"a": 1}', "line one\nline two", "[DONE]"]


def test_an_endless_sse_line_is_refused_at_the_line_cap() -> None:
    """A single line that never ends (no newline) is not buffered without end: the parser gives up
    once the line outgrows MAX_LINE_BYTES, having pulled no more than that from the body."""
    piece = b"x" * 4096
    pulled = 0

    def endless_line() -> Iterator[bytes]:
        nonlocal pulled
        yield b"data: "
        for _ in range(4 * MAX_LINE_BYTES // len(piece)):  # bounded, so a parser without the cap ends too
            pulled += len(piece)
            yield piece

    with pytest.raises(ProbeFailure) as failure:
        list(sse_events(endless_line()))
    assert failure.value.reason == "answer_too_large"
    assert pulled <= MAX_LINE_BYTES + len(piece)


EVENT = (
    b'data: {"id":"chatcmpl-0","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
)
ENDLESS = {
    "events": (True, "text/event-stream", b"", EVENT * (32 * 1024 // len(EVENT))),
    "line": (True, "text/event-stream", b"data: ", b"x" * 32 * 1024),
    "body": (False, "application/json", b'{"choices": [{"message": {"content": "', b"a" * 32 * 1024),
}
"""What an endless answer repeats: valid stream events, one line without a newline, or a whole
(non-streamed) body that never ends; as (stream, Content-Type, head, piece)."""


@pytest.mark.parametrize("kind", ENDLESS)
def test_an_endless_answer_fails_the_run_at_the_cap(kind: str) -> None:
    """`answer_too_large` (not the deadline), having taken no more than the cap and one piece."""
    stream, _, head, piece = ENDLESS[kind]
    config, _ = configs(stream=stream, timeout="10s")
    cap = answer_cap(config)
    pulled = 0

    def endless() -> Iterator[tuple[bytes, float]]:
        nonlocal pulled
        if head:
            yield head, 0.0
        for _ in range(4 * cap // len(piece)):  # bounded, so a reader without the cap ends too
            pulled += len(piece)
            yield piece, 0.001

    run = measure(endless(), stream=stream, timeout="10s")
    assert (run.success, run.reason) == (False, "answer_too_large")
    assert pulled <= cap + len(piece)


def test_a_long_answer_within_max_tokens_still_passes() -> None:
    """The cap grows with `max_tokens`: a streamed answer of that many tokens, each in an event of
    a real server's size, passes, though it is larger than the cap of a small probe."""
    tokens = 32768
    choice = {"index": 0, "delta": {"content": " a"}, "logprobs": None, "finish_reason": None}
    first = {"id": "chatcmpl-" + "0" * 32, "object": "chat.completion.chunk", "created": 1_700_000_000,
             "model": "ep", "system_fingerprint": "fp_0", "choices": [choice]}  # fmt: skip
    last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": tokens}}  # fmt: skip
    body = f"data: {json.dumps(first)}\n\n".encode() * tokens + f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n".encode()
    assert len(body) > answer_cap(configs()[0])
    assert answer_cap(configs(max_tokens=tokens)[0]) >= len(body)
    run = measure([(body[i : i + 65536], 1.0) for i in range(0, len(body), 65536)], max_tokens=tokens, timeout="30s")
    assert (run.success, run.reason) == (True, None)
    assert run.completion_tokens == tokens


class Echoing:
    """An endpoint whose error, inside a 200 stream, echoes the API key after `before` characters."""

    def __init__(self, key: str, before: int) -> None:
        self.error = "x" * before + f" bad key {key} given"

    @contextmanager
    def post(
        self, body: dict[str, Any], deadline: Callable[[], float]
    ) -> Iterator[tuple[int, list[tuple[bytes, float]]]]:
        yield 200, [(f"data: {json.dumps({'error': self.error})}\n\n".encode(), 0.0)]

    def close(self) -> None:
        """Nothing to release."""


@pytest.mark.parametrize("before", [0, 100, 105, 106])
def test_an_api_key_an_endpoint_echoes_is_masked_where_its_message_is_cut(before: int) -> None:
    """The error text is cut at 120 characters: wherever the cut falls in the key, no start of it of
    six characters or more is left (106: only five are, too few to mask)."""
    key = "sk-secretkey123456"
    config, inference = configs(api_key=key)
    probe_runner = ProbeRunner(config, inference, chat=Echoing(key, before), clock=Ticks())
    assert probe_runner.run().last.reason == "stream_error"
    detail = probe_runner.last_detail
    assert detail is not None
    assert key[:6] not in detail
    assert ("***" in detail) == (before != 106)
    assert without("sk-s, a name", key) == "sk-s, a name"  # shorter than six: no key to mask
    for short in ("", "k", "key"):  # (as the log's masks: too short to mask without masking words)
        assert without("no token after 3.5s", short) == "no token after 3.5s"
    assert without("no token after 3.5s", "token") == "no *** after 3.5s"


class Crashing:
    """A chat whose reading has a bug: a KeyError from deep inside."""

    @contextmanager
    def post(self, body: dict[str, Any], deadline: Callable[[], float]) -> Iterator[tuple[int, list]]:
        raise KeyError("a bug deep inside")
        yield  # (a generator, as the others)

    def close(self) -> None:
        """Nothing to release."""


def test_a_crash_of_the_probe_s_own_fails_the_run_with_its_traceback_and_blames_no_config(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its last success must not stand, and neither the URL nor the key is said to be wrong."""
    config, inference = configs()
    runner = ProbeRunner(config, inference, chat=Crashing(), clock=Ticks())
    assert_failed_once(runner.run(), "connection")
    assert runner.crashed
    assert "a bug; see the log" in str(runner.last_detail)
    (record,) = [r for r in caplog.records if r.getMessage().startswith("probe crashed")]
    assert record.exc_info is not None
    assert unusable([runner]) is None
