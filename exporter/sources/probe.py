"""The synthetic chat probe: does an endpoint answer, how fast, and is the answer usable?

Each configured probe sends one small request per interval (chat, json, tools or thinking;
streamed or not), times it (headers, first token, gaps between chunks, end to end), checks the
answer (reading no more of it than an answer of its `max_tokens` can be), and names a failure with
one reason from a fixed list. The error text goes to the log, never into a label. The API key is
sent as a Bearer token and never logged.

`Measurement` makes a run of what arrives (the status, then the body's pieces with their arrival
times) and does no I/O; `HTTPChat` is the wire that feeds it, and a `ProbeRunner` takes another
`ChatTransport` and clock in the unit tests.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from types import MappingProxyType
from typing import Any, Protocol
from urllib.parse import urlsplit

import requests
import urllib3
from urllib3.exceptions import HTTPError as TransportError
from urllib3.exceptions import ReadTimeoutError

from exporter import __version__
from exporter.billing.errors import ClientClosed
from exporter.config.schema import InferenceConfig, ProbeConfig
from exporter.core.deadline import Deadline
from exporter.core.lognames import MASK
from exporter.core.logs import get_logger
from exporter.core.net import network_cause
from exporter.core.watched import Cuts, Exchange, WatchedAdapter, watching
from exporter.model.snapshots import Histogram, ProbeRun, ProbeSnapshot
from exporter.sources.probe_answer import (
    E2E_BUCKETS,
    READ_SIZE,
    REASONS,
    TTFT_BUCKETS,
    Answer,
    ProbeFailure,
    answer_cap,
    apply_event,
    apply_response,
    check_answer,
    connect_timeout,
    http_reason,
    request_body,
    sse_events,
    tokens,
)

log = get_logger(__name__)

MIN_DECODE_SPAN = 0.005
"""The shortest time between a stream's first and last token that a decode rate is told for:
tokens that came in one burst (a proxy that buffers the stream) tell no rate."""
HEAD_KEPT = 64 * 1024
"""How much of a stream is kept until its first event: read as a whole answer when none comes (an
error the server sent as JSON)."""


class Silence(TimeoutError):
    """Nothing arrived by the run's next deadline (`Measurement.deadline`); `at`: when the wait ended."""

    def __init__(self, at: float) -> None:
        super().__init__("nothing arrived by the deadline")
        self.at = at


class Measurement:
    """One run of a probe made from what arrives: the status, then the body's pieces (decoded), each
    with the time it arrived. It does no I/O and reads no clock: the times are the caller's (`HTTPChat`
    stamps them from the runner's clock; the unit tests write them down).

    Each wait has one deadline (`deadline`), by the phase the run is in: the first token's
    (`first_token_timeout`) until a streamed answer's first token, then the stall's
    (`stall_timeout` after the last event), never later than the whole request's (`timeout`); a
    whole (not streamed) answer has the whole request's alone. A piece that arrives after it, and a
    wait that ends at it (`silent`), fail the run for that phase's reason.

    `response` raises a ProbeFailure for the first thing wrong; `result` is the run either way.
    """

    def __init__(self, probe: ProbeConfig, started: float) -> None:
        self.probe = probe
        self.started = started
        self.answer = Answer()
        self.checks: dict[str, bool] = {"http": False}
        self.headers: float | None = None
        self.first_token: float | None = None
        self.first_reasoning: float | None = None
        self.first_answer: float | None = None
        """These four: seconds from `started` to that arrival, once seen."""
        self.last_token: float | None = None
        """Seconds from `started` to the arrival of the last event with a token in it."""
        self._events = 0
        self._head = b""
        """A stream's first HEAD_KEPT bytes, while no event has come."""
        self.max_gap: float | None = None
        """The longest wait between two events after the first token."""
        self._arrived = started
        """When the piece being parsed arrived: the time of each event it completes."""
        self._last_event = started
        """When the last event arrived: a stall is counted from it, not from bytes that make none
        (keep-alive comments)."""

    def response(self, status: int, at: float, body: Iterable[tuple[bytes, float]]) -> None:
        """The status, whose headers arrived at `at`; the body as it arrives; the scenario's checks.

        Taking the next piece of `body` may raise Silence (nothing arrived by `deadline()`) or
        ConnectionError (the connection broke): failures of the run as well.
        """
        self.headers = at - self.started
        if status >= 400:
            raise ProbeFailure(http_reason(status), f"HTTP {status}")
        self.checks["http"] = True
        try:
            if self.probe.stream:
                self._read_stream(body)
            else:
                apply_response(b"".join(self._within_limits(body)).decode("utf-8", errors="replace"), self.answer)
        except Silence as silence:
            raise self.silent(silence.at) from None
        except ConnectionError as error:
            raise ProbeFailure("truncated", f"the connection broke mid-answer ({error})") from None
        check_answer(self.probe, self.answer, self.checks)
        self.checks["usage"] = self.answer.usage is not None and tokens(self.answer.usage, "completion_tokens") > 0
        if not self.checks["usage"]:
            raise ProbeFailure("usage_missing", "the response carries no usage")

    def result(self, reason: str | None, ended: float) -> ProbeRun:
        """The run, failed for `reason` (None: it passed), ended at `ended`."""
        duration = ended - self.started
        completion = tokens(self.answer.usage, "completion_tokens")
        first, last = self.first_token, self.last_token
        if not self.probe.stream:
            rate = completion / duration if completion and duration > 0 else None
        elif first is not None and last is not None and completion > 1 and last - first >= MIN_DECODE_SPAN:
            rate = (completion - 1) / (last - first)  # (the tokens after the first, over the time they took)
        else:
            rate = None  # (one token, or all of them in one burst, a buffering proxy's: no rate to tell)
        return ProbeRun(
            success=reason is None,
            reason=reason,
            checks=MappingProxyType(self.checks),
            duration=duration,
            time_to_headers=self.headers,
            time_to_first_token=first,
            time_to_first_reasoning_token=self.first_reasoning,
            time_to_first_answer_token=self.first_answer,
            max_chunk_gap=self.max_gap,
            prompt_tokens=tokens(self.answer.usage, "prompt_tokens"),
            completion_tokens=completion,
            output_tokens_per_second=rate,
        )

    def deadline(self) -> float:
        """When the next piece must have arrived, on the caller's clock (see the class)."""
        return self._next()[0]

    def _next(self) -> tuple[float, str]:
        """The next deadline and the reason a run fails for at it."""
        probe, started = self.probe, self.started
        whole = (started + probe.timeout, "timeout_total")
        if not probe.stream:
            return whole
        if self.first_token is None:
            phase = (started + (probe.first_token_timeout or probe.timeout), "timeout_first_token")
        else:
            phase = (self._last_event + (probe.stall_timeout or probe.timeout), "stall")
        return phase if phase[0] <= whole[0] else whole

    def silent(self, at: float) -> ProbeFailure:
        """The failure of a run whose wait for the next piece ended at `at`, at its deadline: after the
        first token, the silence counts as a gap between chunks (it was at least that long)."""
        reason = self._next()[1]
        gap = at - self._last_event
        if self.first_token is not None:
            self.max_gap = max(self.max_gap or 0.0, gap)
        if reason == "stall":
            return ProbeFailure(reason, f"{gap:.1f}s without an event")
        if reason == "timeout_first_token":
            return ProbeFailure(reason, f"no token after {at - self.started:.1f}s")
        return ProbeFailure(reason, f"the answer took over {self.probe.timeout:g}s")

    def _within_limits(self, body: Iterable[tuple[bytes, float]]) -> Iterator[bytes]:
        """The body's bytes, each piece checked as it arrives: past `answer_cap` is a ProbeFailure, so
        an endless body cannot fill memory (counted decoded: a small gzip body can inflate to any
        size), and so is a piece past the deadline, so a server trickling keep-alive bytes cannot
        hold the probe past it."""
        cap = answer_cap(self.probe)
        read = 0
        for chunk, at in body:
            read += len(chunk)
            if read > cap:
                raise ProbeFailure("answer_too_large", f"the answer is over {cap:,} bytes")
            if at > self.deadline():
                raise self.silent(at)
            self._arrived = at
            if self.probe.stream and not self._events and len(self._head) < HEAD_KEPT:
                self._head += chunk[: HEAD_KEPT - len(self._head)]
            yield chunk

    def _read_stream(self, body: Iterable[tuple[bytes, float]]) -> None:
        """The events into the answer, timed; an event comes when the piece completing it arrived, so
        the deadline `_within_limits` checked for that piece holds for its events too."""
        answer = self.answer
        self.checks["stream_complete"] = False
        for data in sse_events(self._within_limits(body)):
            self._events += 1
            now = self._arrived
            if self.first_token is not None:
                self.max_gap = max(self.max_gap or 0.0, now - self._last_event)
            self._last_event = now
            if data == "[DONE]":
                answer.done = True
                break
            reasoning, text = apply_event(data, answer)
            elapsed = now - self.started
            if reasoning or text:
                self.last_token = elapsed
            if (reasoning or text) and self.first_token is None:
                self.first_token = elapsed
            if reasoning and self.first_reasoning is None:
                self.first_reasoning = elapsed
            if text and self.first_answer is None:
                self.first_answer = elapsed
        if not answer.done and not self._events and self._head:
            # No event at all: an error the server sent as JSON (with a 200) is told as such.
            try:
                apply_response(self._head.decode("utf-8", errors="replace"), Answer())
            except ProbeFailure as failure:
                if failure.reason == "stream_error":
                    raise
        if not answer.done or answer.finish_reason is None:
            what = "[DONE]" if not answer.done else "a finish reason"
            raise ProbeFailure("truncated", f"the stream ended without {what}")
        self.checks["stream_complete"] = True


class ChatTransport(Protocol):
    """Where a probe's requests go: the endpoint over HTTP (`HTTPChat`), or in the tests a fake."""

    def post(
        self, body: dict[str, Any], deadline: Callable[[], float]
    ) -> AbstractContextManager[tuple[int, Iterable[tuple[bytes, float]]]]:
        """Send `body`; the status and the body as `Measurement.response` takes them. Each wait, for
        the headers and for each piece of the body, ends at `deadline()` (a time on the runner's
        clock, which moves as the run goes on) with Silence. A request that gets no status
        otherwise (no connection) is a ProbeFailure."""
        ...

    def close(self) -> None: ...


CHAT_PATH = "/v1/chat/completions"
"""The chat completion's path on `inference.url` (which the config takes with or without `/v1`,
and keeps without)."""
REFUSED_KEY = ("http_401", "http_403")
NOT_THERE = ("http_404", "connection", "timeout_connect")
"""Failures that say the inference API is not at `inference.url`, or not reachable there, rather
than how an endpoint answered."""


def chat_url(inference: InferenceConfig) -> str:
    return f"{inference.url}{CHAT_PATH}"


def shown_url(url: str) -> str:
    """`url` as a message may show it: without a user name and password written into it."""
    parts = urlsplit(url)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


CLOSED = "the probe's client was closed (config reload or shutdown)"
CONNECTING = "connecting timed out (the host name's lookup, TCP, a proxy's CONNECT or the TLS handshake)"


class _Bearer(requests.auth.AuthBase):
    """The API key as a Bearer token, as the request's own authentication: a header set on the
    session would give way to a `.netrc` entry for the host, which requests reads for a request
    without one (and would send in its place)."""

    def __init__(self, key: str) -> None:
        self._key = key

    def __call__(self, request: requests.PreparedRequest) -> requests.PreparedRequest:
        request.headers["Authorization"] = f"Bearer {self._key}"
        return request


class HTTPChat:
    """The chat API over HTTP: the API key as a Bearer token (never logged), the body read as it arrives."""

    def __init__(self, probe: ProbeConfig, inference: InferenceConfig, clock: Callable[[], float]) -> None:
        self.url = chat_url(inference)
        self._clock = clock
        self._session = requests.Session()
        for prefix in ("http://", "https://"):
            self._session.mount(prefix, WatchedAdapter())
        self._session.auth = _Bearer(inference.api_key.get_secret_value())
        self._session.headers["User-Agent"] = f"inference-cost-exporter/{__version__}"
        self._connect = connect_timeout(probe)
        self._cuts = Cuts()
        """A Deadline over each request in flight, which `close` fires."""

    def close(self) -> None:
        """Release the connections, and end a request in flight at once (ClientClosed): the probe a
        reload put in this one's place runs without waiting for this one's deadline (minutes, it may
        be, on an endpoint that hangs)."""
        self._cuts.cut()
        self._session.close()

    @contextmanager
    def post(
        self, body: dict[str, Any], deadline: Callable[[], float]
    ) -> Iterator[tuple[int, Iterator[tuple[bytes, float]]]]:
        wait = self._wait(deadline)
        # The whole wait for the headers, connecting (a proxy's CONNECT, the TLS handshake) included:
        # urllib3 takes the time connecting took off the read timeout.
        # (requests' adapter takes urllib3's Timeout as it is, though its stubs do not say so)
        timeout: Any = urllib3.Timeout(connect=min(self._connect, wait), read=wait, total=wait)
        if self._cuts.cutting:
            raise ClientClosed(CLOSED)
        cut = Deadline()
        with self._cuts.over(cut) as copies, self._cut_ends_it(cut):
            headers = Deadline(wait)  # (the headers' whole wait: a server may drip them a byte at a time)
            try:
                with watching((headers, cut), (headers, cut), copies) as exchange:
                    response = self._session.post(self.url, json=body, stream=True, timeout=timeout)
            except requests.ConnectTimeout:
                raise ProbeFailure("timeout_connect", CONNECTING) from None
            except requests.ReadTimeout:
                raise self._silence(exchange) from None
            except requests.RequestException as error:
                if headers.fired:  # (cut at the deadline, the headers still coming)
                    raise self._silence(exchange) from None
                raise ProbeFailure("connection", f"connection failed ({network_cause(error)})") from None
            except (ValueError, UnicodeError) as error:  # (a redirect to no address: requests' own error)
                raise ProbeFailure("connection", f"the request could not be made ({error})") from None
            finally:
                headers.stop()
            if headers.fired:  # (cut as the last of them came)
                response.close()
                raise Silence(self._clock())
            with response:  # (its socket watched by `cut` since the request went: `watching`)
                try:
                    yield response.status_code, self._arrivals(response, deadline, cut)
                finally:
                    cut.stop()  # (before the connection goes back to the pool, or is closed)

    def _silence(self, exchange: Exchange) -> Exception:
        """The deadline passed before the headers came: still connecting (a TLS handshake or a
        proxy's CONNECT that does not end), or once the request was sent."""
        if not exchange.sent:
            return ProbeFailure("timeout_connect", CONNECTING)
        return Silence(self._clock())

    @staticmethod
    @contextmanager
    def _cut_ends_it(cut: Deadline) -> Iterator[None]:
        """Whatever a request cut by `close` ended in (a failure, a silence, a stream ended short) is
        not the endpoint's doing: ClientClosed."""
        try:
            yield
        except Exception:
            if cut.fired:
                raise ClientClosed(CLOSED) from None
            raise

    def _wait(self, deadline: Callable[[], float]) -> float:
        """The read timeout of the next wait: until `deadline()`; Silence if that has passed."""
        now = self._clock()
        wait = deadline() - now
        if wait <= 0:
            raise Silence(now)
        return wait

    def _arrivals(
        self, response: requests.Response, deadline: Callable[[], float], cut: Deadline
    ) -> Iterator[tuple[bytes, float]]:
        """The body (decoded) as it arrives, whatever its framing, each piece with the time it came;
        a read still waiting at `deadline()` as Silence, a broken connection as ConnectionError.

        `read1` hands over whatever has arrived. `iter_content(chunk_size=None)` would read a body that
        has neither chunks nor a length (it ends when the connection closes) to its end before yielding.
        Each read's timeout is set on the connection's socket, as urllib3 sets the request's.
        """
        raw, clock = response.raw, self._clock
        connection = raw.connection
        sock = getattr(connection, "kept", None) or getattr(connection, "sock", None)
        try:
            while True:
                wait = self._wait(deadline)
                if sock is not None:
                    try:
                        sock.settimeout(wait)
                    except OSError:  # closed: by the cut, or by urllib3 once a body of a length was read
                        if cut.fired:  # (on a connection the server closes after it: `Connection: close`)
                            raise ClientClosed(CLOSED) from None
                        sock = None  # (what is left is in the buffers: read without a wait)
                chunk = raw.read1(READ_SIZE, decode_content=True)
                if not chunk:
                    if cut.fired:  # (the end of a body the connection's end delimits, or the cut's?)
                        raise ClientClosed(CLOSED)
                    return
                yield chunk, clock()
        except ReadTimeoutError:
            raise Silence(clock()) from None
        except TransportError as error:
            raise ConnectionError(type(error).__name__) from None


class ProbeRunner:
    """Runs one configured probe; keeps its running totals (histograms, counters).

    Requests go to `chat` (the endpoint over HTTP unless given) and are timed by `clock`: the unit
    tests give the simulator's chat API in process and a clock that moves only when they say.
    """

    def __init__(
        self,
        probe: ProbeConfig,
        inference: InferenceConfig,
        chat: ChatTransport | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.probe = probe
        self.url = shown_url(chat_url(inference))
        """Where its requests go, as its failures name it."""
        self.measures = json.dumps([self.url, probe.model, probe.scenario, probe.stream])
        """What its runs are of: the endpoint, the request's kind and where it goes (without
        credentials); a probe's runs of another are not its (`ProbeTable.measuring`)."""
        self._key = inference.api_key.get_secret_value()
        self._clock = clock
        self._chat = chat if chat is not None else HTTPChat(probe, inference, clock)
        self._lock = threading.Lock()
        self.runs = 0
        self.failures = dict.fromkeys(REASONS, 0)
        self.tokens = {"prompt": 0, "completion": 0}
        self.ttft = Histogram(TTFT_BUCKETS, (0,) * len(TTFT_BUCKETS))
        self.e2e = Histogram(E2E_BUCKETS, (0,) * len(E2E_BUCKETS))
        self.last_reason: str | None = None
        self.last_detail: str | None = None
        """Why the last run failed, in words, with the URL it requested; None when it passed."""
        self.crashed = False
        """Whether the last run failed by a bug of the probe's own (counted as `connection`, logged
        with its traceback), not for anything the endpoint or the config did."""

    def close(self) -> None:
        self._chat.close()

    def run(self) -> ProbeSnapshot:
        """One probe request, recorded; never raises for what the endpoint does."""
        with self._lock:
            result = self._measure()
            self.runs += 1
            if result.reason:
                self.failures[result.reason] += 1
            self.tokens["prompt"] += result.prompt_tokens
            self.tokens["completion"] += result.completion_tokens
            if result.time_to_first_token is not None:
                self.ttft = self.ttft.observe(result.time_to_first_token)
            if result.success:
                self.e2e = self.e2e.observe(result.duration)
            return ProbeSnapshot(
                probe=self.probe.name,
                endpoint_id=self.probe.model,
                scenario=self.probe.scenario,
                last=result,
                runs=self.runs,
                failures=MappingProxyType(dict(self.failures)),
                tokens=MappingProxyType(dict(self.tokens)),
                time_to_first_token=self.ttft,
                e2e_latency=self.e2e,
            )

    def _measure(self) -> ProbeRun:
        probe = self.probe
        measurement = Measurement(probe, self._clock())
        reason = detail = None
        self.crashed = False
        try:
            try:
                with self._chat.post(request_body(probe), measurement.deadline) as (status, body):
                    measurement.response(status, self._clock(), body)
            except Silence as silence:  # (waiting for the headers)
                raise measurement.silent(silence.at) from None
        except ProbeFailure as failure:
            reason, detail = failure.reason, f"{without(str(failure), self._key)} (POST {self.url})"
            if reason != self.last_reason:
                log.warning("probe failed", probe=probe.name, reason=reason, detail=detail)
        except ClientClosed:
            raise
        except Exception as error:  # a bug: the run failed all the same, and its figures must not stand
            reason, detail = (
                "connection",
                f"the probe crashed ({type(error).__name__}: a bug; see the log) (POST {self.url})",
            )
            self.crashed = True
            log.exception("probe crashed: the run counts as failed", probe=probe.name)
        if reason is None and self.last_reason is not None:
            log.info("probe recovered", probe=probe.name)
        self.last_reason, self.last_detail = reason, detail
        return measurement.result(reason, self._clock())


SHORTEST_SHOWN = 6
"""The shortest start of a secret that `without` masks."""


def without(text: str, secret: str) -> str:
    """`text` (what an endpoint said, cut short) with `secret` masked, and any start of it of
    SHORTEST_SHOWN characters or more: an endpoint that echoes the API key in its error can have it
    cut in the middle, which masking the whole key alone would leave in the log. A key shorter than
    the log's masks take (4 characters) is left, as there: it would mask letters of every word."""
    if len(secret) < 4:
        return text
    for length in range(len(secret), min(SHORTEST_SHOWN, len(secret)) - 1, -1):
        if secret[:length] in text:
            text = text.replace(secret[:length], MASK)
    return text


def unusable(runners: Iterable[ProbeRunner]) -> str | None:
    """Why the last runs of one account's probes say its inference API cannot be used as configured,
    in one line (with the URL requested, never the key), or None: the key refused, or every probe
    failing to find or reach the API (a wrong `inference.url`). A failed answer (a 5xx, a timeout
    after connecting, a wrong answer, one endpoint that does not exist) is what probes measure, not
    a fault of the config."""
    ran = [runner for runner in runners if runner.runs]
    for runner in ran:
        if runner.last_reason in REFUSED_KEY:
            status = runner.last_reason.removeprefix("http_")
            return (
                f"probe {runner.probe.name}: the inference API refused the key (HTTP {status}); "
                f"check inference.api_key (POST {runner.url})"
            )
    if ran and all(runner.last_reason in NOT_THERE and not runner.crashed for runner in ran):
        first = ran[0]
        return (
            f"no probe found or reached the inference API; probe {first.probe.name}: {first.last_detail};"
            " check inference.url (its base address, with or without /v1) and the probes' `model`"
        )
    return None
