"""What a probe asks and what it accepts: the request body of each mode, the stream's events, the
answer they add up to and its checks, and the fixed list of failure reasons."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from exporter.config.schema import ProbeConfig

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
    longer than MAX_LINE_BYTES is a ProbeFailure. Each piece is looked through once: a long line
    arriving a few bytes at a time costs its length, not its length times its pieces."""
    pending = bytearray()  # (the line not ended yet)
    data: list[str] = []
    for chunk in itertools.chain(chunks, [b"\n\n"]):  # a last event not closed by a blank line still counts
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            if len(pending) + end - start > MAX_LINE_BYTES:
                raise ProbeFailure("answer_too_large", f"a stream line is over {MAX_LINE_BYTES:,} bytes")
            raw = bytes(pending) + chunk[start:end] if pending else chunk[start:end]
            pending.clear()
            start = end + 1
            line = raw.rstrip(b"\r").decode("utf-8", errors="replace")
            if not line:
                if data:
                    yield "\n".join(data)
                    data = []
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
        pending += memoryview(chunk)[start:]
        if len(pending) > MAX_LINE_BYTES:
            raise ProbeFailure("answer_too_large", f"a stream line is over {MAX_LINE_BYTES:,} bytes")


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
    except (ValueError, RecursionError):  # (RecursionError: nested past what the parser goes)
        raise ProbeFailure("invalid_json", f"a stream event is not JSON: {data[:80]!r}") from None
    if not isinstance(event, dict):
        raise ProbeFailure("invalid_json", "a stream event is not a JSON object")
    if event.get("error"):  # (`"error": null` beside a good answer says there is none)
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
    if document.get("error"):
        raise ProbeFailure("stream_error", f"error in the response: {str(document['error'])[:120]}")
    try:
        choice = (document.get("choices") or [{}])[0]
        answer.add_message(choice.get("message") or {})
        answer.finish_reason = str(choice["finish_reason"]) if choice.get("finish_reason") else None
        if document.get("usage"):
            answer.usage = dict(document["usage"])
    except (TypeError, ValueError, AttributeError, IndexError, KeyError):
        raise ProbeFailure("invalid_json", f"the response has an unexpected shape: {text[:80]!r}") from None


def tokens(usage: dict[str, Any] | None, name: str) -> int:
    value = (usage or {}).get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _json_object(text: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
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
            if not checks["reasoning"]:
                raise ProbeFailure("content_mismatch", "no reasoning came back (is thinking on for this model?)")


def answer_cap(probe: ProbeConfig) -> int:
    """The most answer bytes (decoded) a run of `probe` reads (see MAX_ANSWER_BYTES)."""
    return max(MAX_ANSWER_BYTES, probe.max_tokens * ANSWER_BYTES_PER_TOKEN)


def connect_timeout(probe: ProbeConfig) -> float:
    """How long a run waits for its connection (each read waits until the run's next deadline,
    `Measurement.deadline`)."""
    return min(CONNECT_TIMEOUT, probe.timeout)


def http_reason(status: int) -> str:
    if status in (401, 403, 404, 429):
        return f"http_{status}"
    return "http_5xx" if status >= 500 else "http_4xx"
