"""The synthetic probe over HTTP: what only the wire shows. Each mode end to end, both stream
framings, gzip as it arrives, statuses, real read and connect timeouts, a dropped or reset
connection, a dripping server, an endless answer cut off. The logic is in test_probe.py."""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import select
import socket
import ssl
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import trustme

from exporter.billing.errors import ClientClosed
from exporter.sim import Fault, Simulator, SimulatorServer
from exporter.sources import probe as probe_module
from exporter.sources.probe import ProbeRunner, answer_cap, unusable
from tests.helpers import LoopbackServer, logged, wait_for
from tests.test_probe import (
    CHAT,
    ENDLESS,
    SCENARIOS,
    SILENCES,
    STATUSES,
    assert_failed_once,
    assert_passed,
    configs,
    fails_once_then_recovers,
)

pytestmark = pytest.mark.integration  # every test here talks to a server on loopback

FRAMINGS = ("chunked", "close")
"""How a streamed body is delimited: HTTP chunks, or the end of the connection (no length, no chunks)."""


def runner(sim: Simulator, server: SimulatorServer, url: str | None = None, api_key: str | None = None,
           **probe: object) -> ProbeRunner:  # fmt: skip
    return runner_for(url or server.url, api_key or sim.api_key, **({"model": sim.endpoints[0].endpoint_id} | probe))


def runner_for(url: str, api_key: str = "k", **probe: object) -> ProbeRunner:
    return ProbeRunner(*configs(url, api_key, **probe))


@pytest.fixture(params=FRAMINGS)
def framing(request: pytest.FixtureRequest, sim: Simulator) -> str:
    """Each stream framing in turn, set on the simulator."""
    sim.stream_framing = request.param
    return str(request.param)


DELIVERIES = [(True, "chunked"), (True, "close"), (False, "chunked")]
"""A whole answer has a length whatever the simulator's stream framing."""


@pytest.mark.parametrize(("stream", "stream_framing"), DELIVERIES, ids=[f"stream={s}-{f}" for s, f in DELIVERIES])
@pytest.mark.parametrize(("scenario", "extra", "checks"), SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_each_scenario_passes(
    sim: Simulator,
    server: SimulatorServer,
    scenario: str,
    extra: dict,
    checks: set[str],
    stream: bool,
    stream_framing: str,
) -> None:
    sim.time_to_first_token, sim.chunk_delay, sim.stream_framing = 0.05, 0.01, stream_framing
    assert_passed(runner(sim, server, scenario=scenario, stream=stream, **extra).run(), checks, stream)


@pytest.mark.usefixtures("framing")
def test_the_first_token_is_timed_when_it_arrives(sim: Simulator, server: SimulatorServer) -> None:
    """Not when the body ends: a body delimited by the connection's end is read as it comes too."""
    sim.time_to_first_token, sim.chunk_delay = 0.05, 0.2
    last = runner(sim, server, scenario="thinking").run().last
    assert (last.success, last.reason) == (True, None)
    rest = 7 * sim.chunk_delay  # six reasoning and two answer deltas, a pause before each but the first
    assert last.time_to_first_token is not None
    assert sim.time_to_first_token <= last.time_to_first_token < sim.time_to_first_token + rest / 2
    # (the token stamped as it came: a busy machine may stamp it a little late, never a pause late)
    assert last.duration - last.time_to_first_token >= rest - sim.chunk_delay / 2
    assert last.max_chunk_gap is not None
    assert last.max_chunk_gap >= sim.chunk_delay


def overfull_listener() -> Iterator[str]:
    """A loopback port whose accept queue is full: a new connection's handshake is never answered."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(listener.getsockname())
        fillers.append(filler)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


FAULTS = [*STATUSES, ("connection", {}, Fault("drop", CHAT), {}), ("truncated", {}, Fault("reset", CHAT), {})]
"""Failures of the exchange itself: statuses end to end, a connection dropped before the answer or
reset in the middle of its body; as (reason, simulator settings, the fault of one request, probe settings)."""


@pytest.mark.parametrize(("reason", "sim_settings", "fault", "probe"), FAULTS, ids=[f[0] for f in FAULTS])
def test_each_failure_of_the_exchange_is_produced_and_counted_once(
    sim: Simulator,
    server: SimulatorServer,
    caplog: pytest.LogCaptureFixture,
    reason: str,
    sim_settings: dict,
    fault: Fault | None,
    probe: dict,
) -> None:
    fails_once_then_recovers(sim, partial(runner, sim, server), reason, sim_settings, fault, probe)
    if reason == "truncated":  # by the reset itself, not by a body that ended without [DONE]
        [failed] = logged(caplog.records, "probe failed", reason=reason)
        assert failed.fields["detail"].startswith("the connection broke mid-answer")  # type: ignore[attr-defined]


@pytest.mark.usefixtures("framing")
@pytest.mark.parametrize(("reason", "sim_settings", "fault", "probe"), SILENCES, ids=[f[0] for f in SILENCES])
def test_a_silent_stream_is_left_at_the_read_timeout(
    sim: Simulator, server: SimulatorServer, reason: str, sim_settings: dict, fault: Fault | None, probe: dict
) -> None:
    fails_once_then_recovers(sim, partial(runner, sim, server), reason, sim_settings, fault, probe)


def test_timeout_connect(sim: Simulator, server: SimulatorServer) -> None:
    for url in overfull_listener():
        snapshot = runner(sim, server, url=url, timeout="500ms").run()
        assert_failed_once(snapshot, "timeout_connect")


def test_the_openai_client_speaks_to_the_simulator(sim: Simulator, server: SimulatorServer) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=sim.api_key)
    model = sim.endpoints[0].endpoint_id

    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "ping"}], stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "pong"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 2

    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": 'Reply with the keys "status" and "region".'},
                  {"role": "user", "content": "All good."}],
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert set(json.loads(reply.choices[0].message.content or "")) == {"status", "region"}

    from exporter.sources.probe_answer import TOOL

    called = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "status?"}],
        tools=[TOOL],  # type: ignore[list-item]
    )
    assert called.choices[0].finish_reason == "tool_calls"
    call = called.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "lookup_service_status"
    assert json.loads(call.function.arguments) == {"service": "probe", "window_minutes": 1}

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).chat.completions.create(
            model=model, messages=[{"role": "user", "content": "ping"}]
        )


def test_the_api_key_never_reaches_the_log(
    sim: Simulator, server: SimulatorServer, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    caplog.set_level(logging.DEBUG)
    sim.inject(Fault("stream_error", CHAT))
    probe_runner = runner(sim, server)
    failed = probe_runner.run()
    assert failed.last.reason == "stream_error"
    wrong = runner(sim, server, api_key="sk-live-very-secret").run()
    assert wrong.last.reason == "http_401"
    assert "probe failed" in caplog.text
    assert sim.api_key not in caplog.text
    assert "sk-live-very-secret" not in caplog.text


def test_the_api_key_is_sent_even_where_a_netrc_names_the_host(
    sim: Simulator, server: SimulatorServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """requests sends a `.netrc` entry's user and password to a host the request has no authentication
    for: the key must be the request's own, or the endpoint gets someone's password and no key."""
    netrc = tmp_path / "netrc"
    netrc.write_text("machine 127.0.0.1\nlogin someone\npassword hunter2\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    sim.time_to_first_token = 0.05
    assert_passed(runner(sim, server).run(), {"http", "content", "usage"}, stream=True)


@pytest.mark.parametrize("written", ["", "/", "/v1", "/v1/"], ids=["base", "base/", "base/v1", "base/v1/"])
def test_the_inference_url_is_taken_with_or_without_v1(sim: Simulator, server: SimulatorServer, written: str) -> None:
    """As OpenAI-style SDKs take it (…/v1) or as the spec writes it (the base address): the probe
    posts to the one chat path either way."""
    sim.time_to_first_token = 0.05
    probe_runner = runner(sim, server, url=server.url + written)
    assert probe_runner.url == f"{server.url}/v1/chat/completions"
    assert_passed(probe_runner.run(), {"http", "content", "usage"}, stream=True)


def test_a_failure_names_the_url_it_requested_and_never_the_key(
    sim: Simulator, server: SimulatorServer, caplog: pytest.LogCaptureFixture
) -> None:
    elsewhere = runner(sim, server, url=f"{server.url}/api")  # an address the API is not at
    assert_failed_once(elsewhere.run(), "http_404")
    requested = f"{server.url}/api/v1/chat/completions"
    assert elsewhere.last_detail == f"HTTP 404 (POST {requested})"
    [failed] = logged(caplog.records, "probe failed", reason="http_404")
    assert failed.fields["detail"] == f"HTTP 404 (POST {requested})"  # type: ignore[attr-defined]

    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    unreachable = runner(sim, server, url=f"http://127.0.0.1:{port}")  # (a URL with a password: refused by config)
    assert_failed_once(unreachable.run(), "connection")
    assert (
        unreachable.last_detail
        == f"connection failed (connection refused) (POST http://127.0.0.1:{port}/v1/chat/completions)"
    )
    assert sim.api_key not in caplog.text


def test_a_config_the_inference_api_cannot_be_used_with_is_told_apart_from_failed_answers(
    sim: Simulator, server: SimulatorServer
) -> None:
    """What `once` exits 2 for: the key refused, or no probe finding the API at all. An endpoint
    that fails its answer (or does not exist, beside others that answer) is the probes' finding."""
    requested = f"{server.url}/api/v1/chat/completions"
    lost = [runner(sim, server, url=f"{server.url}/api/", name=name) for name in ("a", "b")]
    for probe_runner in lost:
        probe_runner.run()
    assert unusable(lost) == (
        f"no probe found or reached the inference API; probe a: HTTP 404 (POST {requested});"
        " check inference.url (its base address, with or without /v1) and the probes' `model`"
    )
    assert unusable([*lost, ran(runner(sim, server, name="c"))]) is None  # the API is there: one answers
    assert unusable([ran(runner(sim, server, model="ep-missing")), ran(runner(sim, server, name="c"))]) is None
    assert unusable([runner(sim, server)]) is None  # not run yet
    refused = ran(runner(sim, server, api_key="wrong-key", name="k"))
    assert unusable([ran(runner(sim, server)), refused]) == (
        f"probe k: the inference API refused the key (HTTP 401); check inference.api_key"
        f" (POST {server.url}/v1/chat/completions)"
    )
    sim.inject(Fault("status", CHAT, status=503, times=2))
    failing = [ran(runner(sim, server, name=name)) for name in ("a", "b")]
    assert [r.last_reason for r in failing] == ["http_5xx", "http_5xx"]
    assert unusable(failing) is None  # an outage the exposition reports, not a config fault


def ran(probe_runner: ProbeRunner) -> ProbeRunner:
    probe_runner.run()
    return probe_runner


@contextmanager
def streaming_server(
    framing: str, body: Callable[[], Iterator[bytes]], content_type: str = "text/event-stream", **headers: str
) -> Iterator[str]:
    """A server on loopback answering every POST with an event stream in `framing`: each piece `body`
    yields is written and flushed as it comes (`length`: all of it at once, with its length, the
    connection closed after it). Yields its URL."""

    class Stream(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            for name, value in headers.items():
                self.send_header(name, value)
            if framing == "length":
                whole = b"".join(body())
                self.send_header("Content-Length", str(len(whole)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(whole)
                self.close_connection = True
                return
            if framing == "chunked":
                self.send_header("Transfer-Encoding", "chunked")
            else:
                self.send_header("Connection", "close")
            self.end_headers()
            try:
                for piece in body():
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if framing == "chunked" else piece)
                    self.wfile.flush()
                if framing == "chunked":
                    self.wfile.write(b"0\r\n\r\n")
            except OSError:
                self.close_connection = True

    server = ThreadingHTTPServer(("127.0.0.1", 0), Stream)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("framing", FRAMINGS)
def test_keep_alive_comments_do_not_hold_a_probe_past_its_deadline(framing: str) -> None:
    """A server that sends SSE comments for ever, never a token."""

    def comments() -> Iterator[bytes]:
        for _ in range(100):
            yield b": keep-alive\n\n"
            time.sleep(0.05)

    with streaming_server(framing, comments) as url:
        started = time.monotonic()
        snapshot = runner_for(url, timeout="2s", first_token_timeout="300ms").run()
        assert snapshot.last.reason == "timeout_first_token"
        assert time.monotonic() - started < 2


TOKEN = b'data: {"choices": [{"index": 0, "delta": {"content": "pong"}}]}\n\n'
FINISH = (
    b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],'
    b' "usage": {"prompt_tokens": 5, "completion_tokens": 1}}\n\ndata: [DONE]\n\n'
)


def after(seconds: float, *pieces: bytes) -> Iterator[bytes]:
    time.sleep(seconds)
    yield from pieces


PHASES = {
    # A first token later than the stall's deadline, within its own: the run passes.
    "late first token": (
        lambda: after(0.8, TOKEN, FINISH),
        {"first_token_timeout": "3s", "stall_timeout": "300ms"},
        None,
    ),
    # Keep-alive comments after the first token make no event: the stall is counted from the token.
    "comments after a token": (
        lambda: itertools.chain([TOKEN], *(after(0.1, b": keep-alive\n\n") for _ in range(60))),
        {"stall_timeout": "500ms"},
        "stall",
    ),
    # A late token, then silence: the whole request's deadline ends the wait, not a read timeout later.
    "silent after a late token": (
        lambda: itertools.chain(after(2.0, TOKEN), after(8)),
        {"timeout": "4s"},
        "timeout_total",
    ),
}


@pytest.mark.parametrize("framing", FRAMINGS)
@pytest.mark.parametrize(("body", "probe", "reason"), PHASES.values(), ids=PHASES.keys())
def test_each_wait_on_the_wire_ends_at_the_deadline_of_the_runs_phase(
    framing: str, body: Callable[[], Iterator[bytes]], probe: dict, reason: str | None
) -> None:
    with streaming_server(framing, body) as url:
        last = runner_for(url, **({"timeout": "5s"} | probe)).run().last
    assert last.reason == reason
    if reason == "stall":
        assert last.max_chunk_gap is not None
        assert last.max_chunk_gap >= 0.5
        assert last.duration < 5  # not held to the whole request's deadline
    if reason == "timeout_total":
        assert last.time_to_first_token is not None
        # At 4 s, not a read timeout of the whole 4 s after the token (at 2 s: 6 s): half a second short of it.
        assert last.duration < last.time_to_first_token + 3.5
        assert last.max_chunk_gap is not None
        assert last.max_chunk_gap >= 0.4


WHOLE = {"id": "x", "object": "chat.completion", "model": "ep",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "pong"}, "finish_reason": "stop"}],
          "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}  # fmt: skip
EVENTS = [
    {"choices": [{"index": 0, "delta": {"content": "pong"}}]},
    {
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1},
    },
]


def events(*payloads: object) -> Callable[[], Iterator[bytes]]:
    return lambda: (f"data: {p if isinstance(p, str) else json.dumps(p)}\n\n".encode() for p in payloads)


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_of_a_length_on_a_connection_the_server_then_closes_is_read_whole(stream: bool) -> None:
    """`Connection: close` with a `Content-Length` (a proxy's, an HTTP/1.0 server's): the socket is
    gone once the body is read, which the next read's timeout must not trip on."""
    body = events(*EVENTS, "[DONE]") if stream else (lambda: iter([json.dumps(WHOLE).encode()]))
    with streaming_server("length", body, "text/event-stream" if stream else "application/json") as url:
        last = runner_for(url, stream=stream, expect_content="^pong$").run().last
    assert (last.success, last.reason) == (True, None)


def test_tokens_that_come_at_once_tell_no_decode_rate() -> None:
    """A proxy that buffers the stream hands 16 tokens over in one write: no rate (it told tens of
    thousands a second), rather than one nothing measured."""
    deltas = [{"choices": [{"index": 0, "delta": {"content": "po" if n else "p"}}]} for n in range(16)]
    end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
           "usage": {"prompt_tokens": 5, "completion_tokens": 16}}  # fmt: skip
    with streaming_server("length", events(*deltas, end, "[DONE]")) as url:
        last = runner_for(url, stream=True, max_tokens=16).run().last
    assert (last.success, last.completion_tokens) == (True, 16)
    assert last.output_tokens_per_second is None


@pytest.mark.parametrize("stream", [False, True])
def test_what_the_endpoint_sends_is_a_failure_counted_never_a_crash_of_the_run(stream: bool) -> None:
    """JSON nested past what the parser goes (a hostile endpoint): `invalid_json`, counted once,
    as any answer of the wrong shape (it raised out of the run: the success gauge stayed as it was)."""
    deep = "[" * 200_000 + "]" * 200_000
    body = events(deep, "[DONE]") if stream else (lambda: iter([deep.encode()]))
    with streaming_server("length", body, "text/event-stream" if stream else "application/json") as url:
        runner = runner_for(url, stream=stream)
        last = runner.run().last
    assert (last.success, last.reason) == (False, "invalid_json")
    assert runner.failures["invalid_json"] == 1


@pytest.mark.parametrize("stream", [False, True])
def test_an_error_of_null_beside_a_good_answer_is_no_error(stream: bool) -> None:
    body = events(*[e | {"error": None} for e in EVENTS], "[DONE]") if stream else (
        lambda: iter([json.dumps(WHOLE | {"error": None}).encode()])
    )  # fmt: skip
    with streaming_server("length", body, "text/event-stream" if stream else "application/json") as url:
        last = runner_for(url, stream=stream, expect_content="^pong$").run().last
    assert (last.success, last.reason) == (True, None)


def test_an_error_a_streamed_probe_is_answered_as_json_is_told_as_the_error() -> None:
    """HTTP 200 and `{"error": …}` rather than a stream: `stream_error` (as a probe not streamed
    is told), not a stream cut short."""
    error = {"error": {"message": "rate limit exceeded for this endpoint", "type": "rate_limit"}}
    with streaming_server("length", lambda: iter([json.dumps(error).encode()]), "application/json") as url:
        last = runner_for(url, stream=True).run().last
    assert (last.success, last.reason) == (False, "stream_error")


@pytest.mark.parametrize("framing", FRAMINGS)
def test_a_gzip_encoded_stream_is_decoded_as_it_arrives(framing: str) -> None:
    gap = 0.3
    events = [
        {"choices": [{"index": 0, "delta": {"content": "pong"}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
         "usage": {"prompt_tokens": 5, "completion_tokens": 1}},
    ]  # fmt: skip

    def gzipped() -> Iterator[bytes]:
        gzip = zlib.compressobj(wbits=31)
        for n, data in enumerate([*map(json.dumps, events), "[DONE]"]):
            if n:
                time.sleep(gap)
            yield gzip.compress(f"data: {data}\n\n".encode()) + gzip.flush(zlib.Z_SYNC_FLUSH)
        yield gzip.flush()

    with streaming_server(framing, gzipped, **{"Content-Encoding": "gzip"}) as url:
        last = runner_for(url, expect_content="^pong$").run().last
    assert (last.success, last.reason) == (True, None)
    assert last.time_to_first_token is not None
    # Decoded as it arrived: the first token was seen well before the end, two gaps (read whole, it would be
    # seen at the end). How soon after the request it came depends on the machine's load; not asserted.
    assert last.duration - last.time_to_first_token >= 1.5 * gap  # (the sleeps are not measured to the microsecond)


SEND_BUFFER = 64 * 1024
"""The hostile server's socket send buffer, pinned small so that what it counts as sent is what left it."""


def receive_buffer_limit() -> int:
    """The most a loopback receive buffer can hold: Linux autotunes it up to tcp_rmem's maximum."""
    try:
        return int(Path("/proc/sys/net/ipv4/tcp_rmem").read_text().split()[2])
    except (OSError, IndexError, ValueError):
        return 6 * 1024 * 1024  # Linux's default maximum


def read_request(connection: socket.socket) -> None:
    """Read one request, headers and body, so that what arrives next on the connection is its close."""
    received = b""
    while b"\r\n\r\n" not in received:
        piece = connection.recv(65536)
        if not piece:
            return
        received += piece
    head, _, body = received.partition(b"\r\n\r\n")
    length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    left = int(length[1]) - len(body) if length else 0
    while left > 0 and (piece := connection.recv(left)):
        left -= len(piece)


class EndlessAnswer(LoopbackServer):
    """A chat endpoint gone wrong: it answers 200, sends `head`, then `piece` over and over, and
    counts what it managed to send before the client closed the connection (`closed` is then set).
    It stops sending at `budget` and waits for the close, so that a client that never stops reading
    cannot take this machine's memory."""

    def __init__(self, framing: str, content_type: str, head: bytes, piece: bytes) -> None:
        self.framing, self.content_type, self.head, self.piece = framing, content_type, head, piece
        self.budget = 0
        """Set before the client connects."""
        self.sent = 0
        self.closed = threading.Event()
        super().__init__()
        self.url = f"http://127.0.0.1:{self.port}"

    def frame(self, data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data) if self.framing == "chunked" else data

    def serve(self, connection: socket.socket) -> None:
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        framing = "Transfer-Encoding: chunked" if self.framing == "chunked" else "Connection: close"
        with connection:
            try:
                read_request(connection)
                connection.sendall(
                    f"HTTP/1.1 200 OK\r\nContent-Type: {self.content_type}\r\n{framing}\r\n\r\n".encode()
                )
                if self.head:  # an empty chunk would end a chunked body
                    connection.sendall(self.frame(self.head))
                piece = self.frame(self.piece)
                while self.sent < self.budget:
                    connection.sendall(piece)
                    self.sent += len(self.piece)
                connection.recv(1)  # the budget is spent: wait for the client to give up
            except OSError:
                pass
            self.closed.set()


@pytest.mark.parametrize("framing", FRAMINGS)
@pytest.mark.parametrize("kind", ENDLESS)
def test_an_endless_answer_fails_the_run_at_the_cap_and_is_cut_off(framing: str, kind: str) -> None:
    """The run fails as `answer_too_large` (not at its deadline), the probe closes the connection,
    and the server sent no more than the cap and what the socket buffers between them hold."""
    stream, content_type, head, piece = ENDLESS[kind]
    server = EndlessAnswer(framing, content_type, head, piece)
    probe_runner = runner_for(server.url, stream=stream, timeout="10s")
    cap = answer_cap(probe_runner.probe)
    bound = cap + receive_buffer_limit() + 4 * SEND_BUFFER + len(piece)
    server.budget = bound + cap  # a probe reading on without a cap shows as more than `bound`
    try:
        snapshot = probe_runner.run()
        assert server.closed.wait(10), "the probe kept the connection open"
    finally:
        server.stop()
        probe_runner.close()
    assert_failed_once(snapshot, "answer_too_large")
    assert server.sent <= bound


@contextmanager
def each_connection(serve: Callable[[socket.socket], None]) -> Iterator[str]:
    """A listener on loopback handing each connection to `serve` on a thread of its own; yields
    its HOST:PORT."""
    listener = socket.create_server(("127.0.0.1", 0))

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                threading.Thread(target=serve, args=(listener.accept()[0],), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


def test_connecting_counts_toward_the_whole_request_s_deadline(
    ca: trustme.CA, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TLS server that starts its handshake 2 s after the connection, then never answers: the run
    ends at its 4 s deadline, the handshake's time included (not 4 s after the handshake)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(tmp_path / "ca.pem"))
    monkeypatch.setattr(probe_module, "connect_timeout", lambda probe: 120.0)  # (connecting ends on its own later)
    held: list[socket.socket] = []

    def late(connection: socket.socket) -> None:
        time.sleep(2.0)
        with contextlib.suppress(OSError):
            tls = context.wrap_socket(connection, server_side=True)
            held.append(tls)
            tls.recv(65536)  # the request, never answered

    try:
        with each_connection(late) as address:
            for stream, reason in ((False, "timeout_total"), (True, "timeout_first_token")):
                last = runner_for(f"https://{address}", stream=stream, timeout="4s").run().last
                assert last.reason == reason
                assert last.duration < 5.5  # (4 s; after the handshake, a whole 4 s more: 6)
    finally:
        for tls in held:
            tls.close()


@pytest.mark.parametrize("where", ["TLS handshake", "proxy CONNECT", "proxy CONNECT dripped"])
def test_a_deadline_passed_while_connecting_is_a_timeout_connecting(
    ca: trustme.CA, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A TLS server that never answers the handshake, an HTTPS proxy that never answers CONNECT, or
    answers it a byte at a time for 3 s (each read within its timeout): the run ends at its
    first-token or whole deadline, as `timeout_connect` (the request was never sent), not as a wait
    for the answer's first token."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("inference.example").configure_cert(context)
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(tmp_path / "ca.pem"))
    monkeypatch.setattr(probe_module, "connect_timeout", lambda probe: 120.0)  # (the run's deadline ends it)
    held: list[socket.socket] = []

    def serve(connection: socket.socket) -> None:
        held.append(connection)
        if where == "proxy CONNECT dripped":
            with contextlib.suppress(OSError):
                read_request(connection)
                for byte in b"HTTP/1.1 200 Connection established\r\n\r\n":
                    connection.sendall(bytes([byte]))
                    time.sleep(0.08)
                tls = context.wrap_socket(connection, server_side=True)
                held.append(tls)
                tls.recv(65536)  # (the request, were it sent: never answered)

    with each_connection(serve) as address:
        url = f"https://{address}"
        if where != "TLS handshake":
            monkeypatch.setenv("HTTPS_PROXY", f"http://{address}")
            monkeypatch.setenv("NO_PROXY", "")
            url = "https://inference.example"
        try:
            for deadlines in ({"first_token_timeout": "1s", "timeout": "4s"}, {"stream": False, "timeout": "1s"}):
                last = runner_for(url, **deadlines).run().last
                assert (last.reason, last.time_to_first_token) == ("timeout_connect", None)
                assert last.duration < 3.5  # (1 s)
        finally:
            for connection in held:
                connection.close()


def test_headers_dripped_a_byte_at_a_time_end_at_the_requests_deadline() -> None:
    """A server that sends its status line, then a header a byte every 0.2 s (each read well within
    its timeout), for up to 20 s: the run ends at its 2 s deadline, not when the server is done."""

    def drip(connection: socket.socket) -> None:
        with contextlib.suppress(OSError), connection:
            read_request(connection)
            connection.sendall(b"HTTP/1.1 200 OK\r\nX-Drip: ")
            for _ in range(100):
                time.sleep(0.2)
                connection.sendall(b"a")

    with each_connection(drip) as address:
        for stream, reason in ((False, "timeout_total"), (True, "timeout_first_token")):
            started = time.monotonic()
            last = runner_for(f"http://{address}", stream=stream, timeout="2s").run().last
            assert last.reason == reason
            assert time.monotonic() - started < 6.0  # (2 s; the drip lasts 20)


def assert_cut_at_once(probe: ProbeRunner, waiting: Callable[[], object], caplog: pytest.LogCaptureFixture) -> None:
    """Run `probe` on a thread of its own, close it once `waiting()` (the run waits on the other
    side), and check the run ended then (its deadline is minutes away) as ClientClosed: nothing of
    it counted, no failure logged (it is not the endpoint's doing); a run after the close is
    refused at once."""
    ended: list[BaseException | None] = []

    def run() -> None:
        try:
            probe.run()
            ended.append(None)
        except BaseException as error:
            ended.append(error)

    running = threading.Thread(target=run, daemon=True)
    running.start()
    assert wait_for(waiting)
    probe.close()
    running.join(30)  # well within the run's own deadline of two minutes
    assert not running.is_alive()
    assert len(ended) == 1
    assert isinstance(ended[0], ClientClosed)
    assert probe.runs == 0
    assert not logged(caplog.records, "probe failed")
    with pytest.raises(ClientClosed):
        probe.run()


@pytest.mark.parametrize("kind", ["delay", "stall"])
def test_closing_the_runner_ends_a_run_in_flight_at_once(
    sim: Simulator, server: SimulatorServer, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A reload that changes or removes a probe closes its runner: a run waiting on an endpoint that
    hangs, for the headers or mid-stream, ends then."""
    hangs = Fault(kind, CHAT, seconds=120)
    sim.inject(hangs)
    assert_cut_at_once(runner(sim, server, timeout="2m"), lambda: hangs.times == 0, caplog)


ANSWER = json.dumps({
    "id": "chatcmpl-1", "object": "chat.completion", "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello."}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
}).encode()  # fmt: skip
"""A whole chat answer, not streamed."""


@pytest.mark.parametrize("where", ["TLS handshake", "proxy CONNECT", "answer sent, connection held"])
def test_closing_the_runner_ends_a_run_at_once_wherever_it_waits(
    ca: trustme.CA, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    """Also while connecting: a TLS server that never answers the handshake, an HTTPS proxy that
    never answers CONNECT. And a whole answer the end of the connection delimits (no length, no
    chunks), sent, the connection then held open: the end the cut makes is not the answer's."""
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(tmp_path / "ca.pem"))
    monkeypatch.setattr(probe_module, "connect_timeout", lambda probe: 120.0)  # (connecting ends on its own later)
    held: list[socket.socket] = []

    def serve(connection: socket.socket) -> None:
        held.append(connection)  # (kept open: the test's end closes the listener, not these)
        if where == "answer sent, connection held":
            with contextlib.suppress(OSError):
                read_request(connection)
                connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n" + ANSWER)
                held.append(connection)
        elif where == "proxy CONNECT":
            with contextlib.suppress(OSError):
                connection.recv(65536)
                held.append(connection)

    with each_connection(serve) as address:
        if where == "TLS handshake":
            probe = runner_for(f"https://{address}", timeout="2m")
        elif where == "proxy CONNECT":
            monkeypatch.setenv("HTTPS_PROXY", f"http://{address}")
            monkeypatch.setenv("NO_PROXY", "")
            probe = runner_for("https://inference.example", timeout="2m")
        else:
            probe = runner_for(f"http://{address}", timeout="2m", stream=False)
        waits = 1 if where == "TLS handshake" else 2  # (accepted; and, but for the handshake, answered or read)
        try:
            assert_cut_at_once(probe, lambda: len(held) >= waits, caplog)
        finally:
            for connection in held:
                connection.close()


def relay(one: socket.socket, other: socket.socket) -> None:
    """Bytes both ways between two sockets (either may be TLS) until either ends."""
    with contextlib.suppress(OSError, ValueError):
        while True:
            ready = [one] if isinstance(one, ssl.SSLSocket) and one.pending() else []
            ready = ready or select.select([one, other], [], [], 60)[0]
            for source in ready:
                data = source.recv(65536)
                if not data:
                    return
                (other if source is one else one).sendall(data)


def test_closing_the_runner_through_an_https_proxy_ends_its_run_at_once(
    ca: trustme.CA, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An HTTPS endpoint through an HTTPS proxy (TLS inside TLS, whose connection is no socket of
    its own): the run waiting for the headers is cut, and closing raises nothing."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(tmp_path / "ca.pem"))
    monkeypatch.setenv("NO_PROXY", "")
    asked: list[socket.socket] = []

    def endpoint(connection: socket.socket) -> None:  # the request read, never answered
        with contextlib.suppress(OSError):
            secure = context.wrap_socket(connection, server_side=True)
            read_request(secure)
            asked.append(secure)

    def tunnel(connection: socket.socket) -> None:
        with contextlib.suppress(OSError):
            secure = context.wrap_socket(connection, server_side=True)
            target = read_head(secure).split(b" ")[1].decode()
            host, _, port = target.rpartition(":")
            with socket.create_connection((host, int(port))) as upstream:
                secure.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                relay(secure, upstream)

    with each_connection(endpoint) as address, each_connection(tunnel) as proxy:
        monkeypatch.setenv("HTTPS_PROXY", f"https://{proxy}")
        try:
            assert_cut_at_once(runner_for(f"https://{address}", timeout="2m"), lambda: asked, caplog)
        finally:
            for connection in asked:
                connection.close()


def read_head(connection: socket.socket) -> bytes:
    head = b""
    while b"\r\n\r\n" not in head and (piece := connection.recv(65536)):
        head += piece
    return head


class _Redirecting(BaseHTTPRequestHandler):
    """Answers every POST with a redirect to an address no URL can hold."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(307)
        self.send_header("Location", "http://[::1/v1/chat/completions")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_a_redirect_to_no_address_fails_the_run_and_does_not_crash_it() -> None:
    """requests raises a bare ValueError there: the run is a failure, counted, not a crash that
    left the last run's success standing."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Redirecting)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    probe = runner_for(f"http://127.0.0.1:{server.server_address[1]}", model="ep")
    try:
        snapshot = probe.run()
    finally:
        server.shutdown()
        server.server_close()
    assert_failed_once(snapshot, "connection")
    assert "could not be made" in str(probe.last_detail)
