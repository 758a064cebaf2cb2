"""The synthetic chat probe: does an endpoint answer, how fast, and is the answer usable?

Each configured probe sends one small request per interval (chat, json, tools or thinking;
streamed or not), times it (headers, first token, gaps between chunks, end to end), checks the
answer (reading no more of it than an answer of its `max_tokens` can be), and names a failure with
one reason from a fixed list. The error text goes to the log, never into a label. The API key is
sent as a Bearer token and never logged.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import requests
from urllib3.exceptions import HTTPError as TransportError
from urllib3.exceptions import ReadTimeoutError

from exporter import __version__
from exporter.config.schema import InferenceConfig, ProbeConfig
from exporter.core.logs import get_logger
from exporter.model.snapshots import Histogram, ProbeRun, ProbeSnapshot

log = get_logger(__name__)

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, float("inf"))  # fmt: skip
"""vLLM's time-to-first-token buckets, with an edge at 2 s, so server-side and probe figures compare."""
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, float("inf"))
REASONS = (
    "http_401", "http_403", "http_404", "http_429", "http_4xx", "http_5xx", "timeout_connect", "timeout_first_token",
    "timeout_total", "stall", "stream_error", "truncated", "invalid_json", "tool_call_missing", "tool_args_invalid",
    "usage_missing", "content_mismatch", "connection", "answer_too_large",
)  # fmt: skip
CONNECT_TIMEOUT = 10.0
READ_SIZE = 64 * 1024
"""The most body bytes taken in one read; a read returns whatever has arrived, up to this."""
MAX_ANSWER_BYTES = 4 * 1024 * 1024
"""How much of an answer (decoded) a probe reads, streamed or not, before it fails the run as
`answer_too_large` and closes the connection (`answer_cap`). A probe's answer is `max_tokens` (16
by default) tokens: streamed, an event of a few hundred bytes each; whole, a few bytes each. A
server sending more is broken or hostile, and reading on would hold all it sends in memory (an
endless stream took 262 MB in 10 s, within the probe's deadline)."""
ANSWER_BYTES_PER_TOKEN = 512
"""Room for each token of `max_tokens` where that is more than MAX_ANSWER_BYTES holds, so that a
probe allowed a long answer (a thinking model's; up to 65536 tokens, 32 MiB) can take it: a real
server's stream event for one token (envelope, id, model, delta) is about 250 bytes."""
MAX_LINE_BYTES = 1024 * 1024
"""The longest line of a stream: an event line holds one delta, hundreds of bytes (a whole answer
of 65536 tokens in one delta is under this). Without it a line that never ends would be buffered
whole, up to the answer's cap."""
TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "lookup_service_status",
        "description": "Look up the current status of a service.",
        "parameters": {
            "type": "object",
            "properties": {
                "service": {"type": "string", "description": "The service's name."},
                "window_minutes": {"type": "integer", "description": "How far back to look, in minutes."},
            },
            "required": ["service"],
        },
    },
}
JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


class ProbeFailure(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def request_body(probe: ProbeConfig) -> dict[str, Any]:
    body: dict[str, Any] = {"model": probe.model, "max_tokens": probe.max_tokens, "stream": probe.stream}
    if probe.stream:
        body["stream_options"] = {"include_usage": True}
    if probe.scenario == "json":
        keys = ", ".join(f'"{key}"' for key in probe.expect_keys or ("status",))
        body["response_format"] = {"type": "json_object"}
        body["messages"] = [
            {"role": "system", "content": f"Extract the service state from the text. Reply with a JSON object with "
                                          f"the keys {keys} only; use short string values."},
            {"role": "user", "content": "Health check: the service is up and answering normally."},
        ]  # fmt: skip
    elif probe.scenario == "tools":
        body["tools"] = [TOOL]
        body["messages"] = [{"role": "user", "content": "Look up the status of the service named probe."}]
    else:
        body["messages"] = [{"role": "user", "content": "Reply with the single word: pong"}]
        if probe.scenario == "thinking":
            body["chat_template_kwargs"] = {"thinking": True}
    return body


def sse_events(chunks: Iterable[bytes]) -> Iterator[str]:
    """The `data:` payloads of a server-sent event stream, one per event, as they complete; a line
    longer than MAX_LINE_BYTES is a ProbeFailure."""
    buffer = b""
    data: list[str] = []
    for chunk in itertools.chain(chunks, [b"\n\n"]):  # a last event not closed by a blank line still counts
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        if len(buffer) > MAX_LINE_BYTES or any(len(raw) > MAX_LINE_BYTES for raw in lines):
            raise ProbeFailure("answer_too_large", f"a stream line is over {MAX_LINE_BYTES:,} bytes")
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8", errors="replace")
            if not line:
                if data:
                    yield "\n".join(data)
                    data = []
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))


@dataclass
class Answer:
    """What a (streamed or whole) chat completion said, assembled."""

    content: str = ""
    reasoning: str = ""
    tool_calls: dict[int, dict[str, str]] = field(default_factory=dict)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    done: bool = False

    def add_delta(self, delta: dict[str, Any]) -> tuple[bool, bool]:
        """Merge one streamed delta; returns (has reasoning text, has answer text or tool call)."""
        reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
        content = delta.get("content") or ""
        self.reasoning += reasoning
        self.content += content
        calls = delta.get("tool_calls") or []
        for call in calls:
            entry = self.tool_calls.setdefault(int(call.get("index", 0)), {"name": "", "arguments": ""})
            function = call.get("function") or {}
            entry["name"] += function.get("name") or ""
            entry["arguments"] += function.get("arguments") or ""
        return bool(reasoning), bool(content or calls)

    def add_message(self, message: dict[str, Any]) -> None:
        self.add_delta(message)
        for index, call in enumerate(message.get("tool_calls") or []):
            function = call.get("function") or {}
            self.tool_calls[index] = {"name": function.get("name") or "", "arguments": function.get("arguments") or ""}


def apply_event(data: str, answer: Answer) -> tuple[bool, bool]:
    """Merge one stream event into `answer`; returns (has reasoning text, has answer text or tool call).

    Anything that is not the documented shape is a ProbeFailure, never a crash.
    """
    try:
        event = json.loads(data)
    except ValueError:
        raise ProbeFailure("invalid_json", f"a stream event is not JSON: {data[:80]!r}") from None
    if not isinstance(event, dict):
        raise ProbeFailure("invalid_json", "a stream event is not a JSON object")
    if "error" in event:
        raise ProbeFailure("stream_error", f"error inside the stream: {str(event['error'])[:120]}")
    reasoning = text = False
    try:
        if event.get("usage"):
            answer.usage = dict(event["usage"])
        for choice in event.get("choices") or []:
            has_reasoning, has_text = answer.add_delta(choice.get("delta") or {})
            reasoning, text = reasoning or has_reasoning, text or has_text
            if choice.get("finish_reason"):
                answer.finish_reason = str(choice["finish_reason"])
    except (TypeError, ValueError, AttributeError):
        raise ProbeFailure("invalid_json", f"a stream event has an unexpected shape: {data[:80]!r}") from None
    return reasoning, text


def apply_response(text: str, answer: Answer) -> None:
    """A whole (non-streamed) chat completion into `answer`; the wrong shape is a ProbeFailure."""
    document = _json_object(text, "the response")
    if "error" in document:
        raise ProbeFailure("stream_error", f"error in the response: {str(document['error'])[:120]}")
    try:
        choice = (document.get("choices") or [{}])[0]
        answer.add_message(choice.get("message") or {})
        answer.finish_reason = str(choice["finish_reason"]) if choice.get("finish_reason") else None
        if document.get("usage"):
            answer.usage = dict(document["usage"])
    except (TypeError, ValueError, AttributeError, IndexError, KeyError):
        raise ProbeFailure("invalid_json", f"the response has an unexpected shape: {text[:80]!r}") from None


def _tokens(usage: dict[str, Any] | None, name: str) -> int:
    value = (usage or {}).get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _json_object(text: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        raise ProbeFailure("invalid_json", f"{what} is not JSON: {text[:80]!r}") from None
    if not isinstance(value, dict):
        raise ProbeFailure("invalid_json", f"{what} is not a JSON object")
    return value


def check_answer(probe: ProbeConfig, answer: Answer, checks: dict[str, bool]) -> None:
    """The scenario's own checks; raises the first failure."""
    if probe.scenario == "json":
        checks["json"] = False
        document = _json_object(answer.content, "the answer")
        missing = [key for key in probe.expect_keys if key not in document]
        if missing:
            raise ProbeFailure("content_mismatch", f"the JSON answer lacks {missing}")
        checks["json"] = True
    elif probe.scenario == "tools":
        checks["tool_call"] = False
        if not answer.tool_calls or answer.finish_reason != "tool_calls":
            raise ProbeFailure("tool_call_missing", f"no tool call (finish_reason {answer.finish_reason!r})")
        call = answer.tool_calls[min(answer.tool_calls)]
        schema = TOOL["function"]["parameters"]
        if call["name"] != TOOL["function"]["name"]:
            raise ProbeFailure("tool_args_invalid", f"called unknown tool {call['name'][:40]!r}")
        try:
            arguments = _json_object(call["arguments"], "the tool arguments")
        except ProbeFailure as failure:
            raise ProbeFailure("tool_args_invalid", str(failure)) from None
        for name in schema["required"]:
            if name not in arguments:
                raise ProbeFailure("tool_args_invalid", f"tool arguments lack {name!r}")
        for name, value in arguments.items():
            spec = schema["properties"].get(name)
            if (
                spec is None
                or not isinstance(value, JSON_TYPES[spec["type"]])
                or isinstance(value, bool) != (spec["type"] == "boolean")
            ):
                raise ProbeFailure("tool_args_invalid", f"tool argument {name!r} does not fit the schema")
        checks["tool_call"] = True
    else:
        checks["content"] = False
        if not answer.content.strip():
            raise ProbeFailure("content_mismatch", "the answer is empty")
        if probe.expect_content and not re.search(probe.expect_content, answer.content):
            raise ProbeFailure("content_mismatch", f"the answer does not match expect_content: {answer.content[:80]!r}")
        checks["content"] = True
        if probe.scenario == "thinking":
            checks["reasoning"] = bool(answer.reasoning)


def answer_cap(probe: ProbeConfig) -> int:
    """The most answer bytes (decoded) a run of `probe` reads (see MAX_ANSWER_BYTES)."""
    return max(MAX_ANSWER_BYTES, probe.max_tokens * ANSWER_BYTES_PER_TOKEN)


def _http_reason(status: int) -> str:
    if status in (401, 403, 404, 429):
        return f"http_{status}"
    return "http_5xx" if status >= 500 else "http_4xx"


class ProbeRunner:
    """Runs one configured probe; keeps its running totals (histograms, counters)."""

    def __init__(self, probe: ProbeConfig, inference: InferenceConfig) -> None:
        self.probe = probe
        self.url = f"{inference.url}/v1/chat/completions"
        self._session = requests.Session()
        self._session.headers["Authorization"] = f"Bearer {inference.api_key.get_secret_value()}"
        self._session.headers["User-Agent"] = f"inference-cost-exporter/{__version__}"
        self._lock = threading.Lock()
        self.runs = 0
        self.failures = dict.fromkeys(REASONS, 0)
        self.tokens = {"prompt": 0, "completion": 0}
        self.ttft = Histogram(TTFT_BUCKETS, (0,) * len(TTFT_BUCKETS))
        self.e2e = Histogram(E2E_BUCKETS, (0,) * len(E2E_BUCKETS))
        self._last_reason: str | None = None

    def close(self) -> None:
        self._session.close()

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
        checks: dict[str, bool] = {"http": False}
        timing: dict[str, float | None] = {}
        answer = Answer()
        started = time.perf_counter()
        try:
            self._request(answer, checks, timing, started)
            check_answer(probe, answer, checks)
            checks["usage"] = answer.usage is not None and _tokens(answer.usage, "completion_tokens") > 0
            if not checks["usage"]:
                raise ProbeFailure("usage_missing", "the response carries no usage")
            reason = None
        except ProbeFailure as failure:
            reason = failure.reason
            if reason != self._last_reason:
                log.warning("probe failed", probe=probe.name, reason=reason, detail=str(failure))
        if reason is None and self._last_reason is not None:
            log.info("probe recovered", probe=probe.name)
        self._last_reason = reason
        duration = time.perf_counter() - started
        completion = _tokens(answer.usage, "completion_tokens")
        first = timing.get("first_token")
        decode = duration - first if first is not None and probe.stream else duration
        return ProbeRun(
            success=reason is None,
            reason=reason,
            checks=MappingProxyType(checks),
            duration=duration,
            time_to_headers=timing.get("headers"),
            time_to_first_token=first,
            time_to_first_reasoning_token=timing.get("first_reasoning"),
            time_to_first_answer_token=timing.get("first_answer"),
            max_chunk_gap=timing.get("max_gap"),
            prompt_tokens=_tokens(answer.usage, "prompt_tokens"),
            completion_tokens=completion,
            output_tokens_per_second=completion / decode if completion and decode > 0 else None,
        )

    def _request(
        self, answer: Answer, checks: dict[str, bool], timing: dict[str, float | None], started: float
    ) -> None:
        probe = self.probe
        first_deadline = probe.first_token_timeout or probe.timeout
        stall = probe.stall_timeout or probe.timeout
        read_timeout = min(probe.timeout, first_deadline, stall)
        try:
            response = self._session.post(
                self.url,
                json=request_body(probe),
                stream=True,
                timeout=(min(CONNECT_TIMEOUT, probe.timeout), read_timeout),
            )
        except requests.ConnectTimeout:
            raise ProbeFailure("timeout_connect", "connecting timed out") from None
        except requests.ReadTimeout:
            raise ProbeFailure("timeout_first_token", "no response headers in time") from None
        except requests.RequestException as error:
            raise ProbeFailure("connection", f"connection failed ({type(error).__name__})") from None
        timing["headers"] = time.perf_counter() - started
        with response:
            if response.status_code >= 400:
                raise ProbeFailure(_http_reason(response.status_code), f"HTTP {response.status_code}")
            checks["http"] = True
            try:
                chunks = self._within_deadlines(response, timing, started, first_deadline)
                if probe.stream:
                    self._read_stream(chunks, answer, checks, timing, started, first_deadline)
                else:
                    apply_response(b"".join(chunks).decode("utf-8", errors="replace"), answer)
            except ReadTimeoutError:
                waited = "timeout_first_token" if timing.get("first_token") is None else "stall"
                raise ProbeFailure(waited, "the stream went silent") from None
            except TransportError as error:
                raise ProbeFailure("truncated", f"the connection broke mid-answer ({type(error).__name__})") from None

    def _within_deadlines(
        self, response: requests.Response, timing: dict[str, float | None], started: float, first_deadline: float
    ) -> Iterator[bytes]:
        """The body (decoded) as it arrives, whatever its framing; the first-token and whole-request
        deadlines are checked on every piece, so a server trickling keep-alive bytes cannot hold the
        probe past them, and the body past `answer_cap` is a ProbeFailure, so an endless one cannot
        fill memory (counted decoded: a small gzip body can inflate to any size).

        `read1` hands over whatever has arrived. `iter_content(chunk_size=None)` would read a body that
        has neither chunks nor a length (it ends when the connection closes) to its end before yielding.
        """
        cap = answer_cap(self.probe)
        read = 0
        while chunk := response.raw.read1(READ_SIZE, decode_content=True):
            read += len(chunk)
            if read > cap:
                raise ProbeFailure("answer_too_large", f"the answer is over {cap:,} bytes")
            elapsed = time.perf_counter() - started
            if self.probe.stream and timing.get("first_token") is None and elapsed > first_deadline:
                raise ProbeFailure("timeout_first_token", f"no token after {elapsed:.1f}s")
            if elapsed > self.probe.timeout:
                raise ProbeFailure("timeout_total", f"the answer took over {self.probe.timeout:.0f}s")
            yield chunk

    def _read_stream(
        self,
        chunks: Iterator[bytes],
        answer: Answer,
        checks: dict[str, bool],
        timing: dict[str, float | None],
        started: float,
        first_deadline: float,
    ) -> None:
        probe = self.probe
        stall = probe.stall_timeout or probe.timeout
        last = time.perf_counter()
        checks["stream_complete"] = False
        for data in sse_events(chunks):
            now = time.perf_counter()
            gap, last = now - last, now
            if timing.get("first_token") is not None:
                timing["max_gap"] = max(timing.get("max_gap") or 0.0, gap)
                if gap > stall:
                    raise ProbeFailure("stall", f"{gap:.1f}s between chunks")
            elif now - started > first_deadline:
                raise ProbeFailure("timeout_first_token", f"no token after {now - started:.1f}s")
            if now - started > probe.timeout:
                raise ProbeFailure("timeout_total", f"the answer took over {probe.timeout:.0f}s")
            if data == "[DONE]":
                answer.done = True
                break
            reasoning, text = apply_event(data, answer)
            elapsed = now - started
            if (reasoning or text) and timing.get("first_token") is None:
                timing["first_token"] = elapsed
            if reasoning and timing.get("first_reasoning") is None:
                timing["first_reasoning"] = elapsed
            if text and timing.get("first_answer") is None:
                timing["first_answer"] = elapsed
        if not answer.done or answer.finish_reason is None:
            what = "[DONE]" if not answer.done else "a finish reason"
            raise ProbeFailure("truncated", f"the stream ended without {what}")
        checks["stream_complete"] = True
