"""The chat API's side of the simulator: the answer to a request, and its delivery (plain or SSE)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any

from exporter.core.clock import Clock
from exporter.sim.model import Endpoint, Fault

if TYPE_CHECKING:
    from exporter.sim.service import Simulator

CHAT_PATH = "/v1/chat/completions"
WIRE_FAULTS = frozenset({"delay", "drop", "reset", "slow_body"})
"""Faults only a connection can show: the HTTP server applies them, `chat_exchange` refuses them."""


@dataclass(frozen=True)
class ChatReply:
    """One answer of the chat API before delivery: what is sent, and the pauses of the model writing it."""

    status: int
    body: bytes = b""
    """A whole answer: an error, or a completion not streamed."""
    wait: float = 0.0
    """Seconds before a whole answer is sent."""
    events: tuple[tuple[float, bytes], ...] | None = None
    """A streamed answer: each server-sent event as written, with the pause before it; None for a
    whole answer. The status and headers go out at once; the framing is the server's."""
    headers: Mapping[str, str] = field(default_factory=dict)


def _error_body(status: int) -> bytes:
    """The body of a status fault."""
    return json.dumps({"error": {"message": HTTPStatus(status).phrase}}).encode()


def _chat_error(status: int, kind: str, message: str) -> ChatReply:
    return ChatReply(status, json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode())


class ChatAPI:
    """The chat API's answers (a part of `Simulator`)."""

    # The simulator's state (set up by `Simulator`).
    clock: Clock
    api_key: str
    endpoints: tuple[Endpoint, ...]
    time_to_first_token: float
    chunk_delay: float

    if TYPE_CHECKING:

        def _take_fault(self, path: str) -> Fault | None: ...

    # -- chat API -------------------------------------------------------------------------

    def chat_answer(self, request: dict[str, Any]) -> tuple[list[str], list[str], list[dict[str, Any]], int]:
        """Reasoning pieces, content pieces, tool calls and prompt tokens for one request."""
        messages = request.get("messages") or []
        prompt_text = " ".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
        prompt_tokens = 1 + len(prompt_text) // 4
        thinking = bool((request.get("chat_template_kwargs") or {}).get("thinking"))
        reasoning = ["The ", "caller ", "wants ", "a ", "short ", "answer."] if thinking else []
        tools = request.get("tools") or []
        if tools:
            function = tools[0].get("function", {})
            properties = (function.get("parameters") or {}).get("properties") or {}
            arguments = {
                name: 1 if (spec or {}).get("type") == "integer" else "probe" for name, spec in properties.items()
            }
            call = {
                "id": "call_sim_0001",
                "type": "function",
                "function": {"name": function.get("name", ""), "arguments": json.dumps(arguments)},
            }
            return reasoning, [], [call], prompt_tokens
        if (request.get("response_format") or {}).get("type") == "json_object":
            system = " ".join(str(m.get("content", "")) for m in messages if m.get("role") == "system")
            keys = re.findall(r'"(\w+)"', system) or ["result"]
            answer = json.dumps(dict.fromkeys(keys, "ok"))
            return reasoning, [answer[i : i + 4] for i in range(0, len(answer), 4)], [], prompt_tokens
        return reasoning, ["po", "ng"], [], prompt_tokens

    def chat_exchange(self, body: bytes, authorization: str | None) -> ChatReply:
        """One request in process, answered as over HTTP with the next injected fault, for tests of a
        client's logic without a socket. What only the wire shows is the HTTP server's: latency, the
        stream's framing, and the WIRE_FAULTS (refused here, so that no test believes it ran one)."""
        fault = self._take_fault(CHAT_PATH)
        if fault and fault.kind in WIRE_FAULTS:
            raise ValueError(f"a {fault.kind!r} fault needs a connection: inject it over HTTP")
        return self.chat_reply(body, authorization, fault)

    def chat_reply(self, body: bytes, authorization: str | None, fault: Fault | None) -> ChatReply:
        """The answer to a request with `body` and the Authorization header `authorization`, given
        the fault taken for it (none of the WIRE_FAULTS)."""
        if fault and fault.kind == "status":
            retry = {"Retry-After": str(fault.retry_after)} if fault.retry_after is not None else {}
            return ChatReply(fault.status, _error_body(fault.status), headers=retry)
        if authorization != f"Bearer {self.api_key}":
            return _chat_error(401, "authentication_error", "invalid API key")
        try:
            request = json.loads(body)
            model = request["model"]
        except (ValueError, KeyError, TypeError):
            return _chat_error(400, "invalid_request_error", "body must be JSON with model and messages")
        if model not in {e.endpoint_id for e in self.endpoints}:
            return _chat_error(404, "not_found_error", "endpoint not found")
        if fault and fault.kind == "malformed":
            return ChatReply(200, b'{"id": "chatcmpl-sim", "choices": [')
        if fault and fault.kind == "plain_answer":  # (a model that does not call tools or think)
            request = {k: v for k, v in request.items() if k not in ("tools", "chat_template_kwargs")}
        reasoning, content, tool_calls, prompt_tokens = self.chat_answer(request)
        if fault and fault.kind == "bad_tool_args":
            tool_calls = [call | {"function": call["function"] | {"arguments": '{"service": '}} for call in tool_calls]
        max_tokens = request.get("max_tokens")
        finish = "tool_calls" if tool_calls else "stop"
        if isinstance(max_tokens, int) and len(reasoning) + len(content) > max_tokens:
            content = content[: max(0, max_tokens - len(reasoning))]
            finish = "length"
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(reasoning) + len(content) + (8 if tool_calls else 0),
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        head = {"id": "chatcmpl-sim", "created": int(self.clock.now().timestamp()), "model": model}
        if not request.get("stream"):
            message: dict[str, Any] = {"role": "assistant", "content": "".join(content) if not tool_calls else None}
            if reasoning:
                message["reasoning_content"] = "".join(reasoning)
            if tool_calls:
                message["tool_calls"] = tool_calls
            answer = head | {
                "object": "chat.completion",
                "usage": usage,
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            }
            wait = self.time_to_first_token + self.chunk_delay * max(0, len(content) - 1)
            return ChatReply(200, json.dumps(answer).encode(), wait=wait)
        include_usage = bool((request.get("stream_options") or {}).get("include_usage"))
        events = self._events(head, reasoning, content, tool_calls, finish, usage if include_usage else None, fault)
        return ChatReply(200, events=tuple(events))

    def _events(
        self,
        head: dict[str, Any],
        reasoning: list[str],
        content: list[str],
        tool_calls: list[dict[str, Any]],
        finish: str,
        usage: dict[str, Any] | None,
        fault: Fault | None,
    ) -> Iterator[tuple[float, bytes]]:
        """A streamed answer's events, each with the pause before it; a stall, an error or a cut
        (the stream ends there) comes at the middle delta."""

        def event(data: str) -> bytes:
            return f"data: {data}\n\n".encode()

        def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
            return event(json.dumps(head | {"object": "chat.completion.chunk", "choices": [choice]}))

        yield 0.0, chunk({"role": "assistant", "content": ""})
        deltas: list[dict[str, Any]] = [{"reasoning_content": piece} for piece in reasoning]
        deltas += [{"content": piece} for piece in content]
        for call in tool_calls:
            arguments = call["function"]["arguments"]
            deltas.append(
                {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": call["id"],
                            "type": "function",
                            "function": {"name": call["function"]["name"], "arguments": ""},
                        }
                    ]
                }
            )
            deltas += [
                {"tool_calls": [{"index": 0, "function": {"arguments": arguments[i : i + 8]}}]}
                for i in range(0, len(arguments), 8)
            ]
        kind, middle = (fault.kind if fault else None), len(deltas) // 2
        stall = fault.seconds if fault and kind == "stall" else 0.0
        pause = self.time_to_first_token
        for n, delta in enumerate(deltas):
            if n:
                pause += self.chunk_delay
            if n == middle:
                pause += stall
            if kind == "stream_error" and n == middle:
                error = {"error": {"message": "internal error while generating", "type": "server_error"}}
                yield pause, event(json.dumps(error))
                return
            if kind == "truncate" and n == middle:
                return
            yield pause, chunk(delta)
            pause = 0.0
        yield pause, chunk({}, finish)
        if usage is not None and kind != "no_usage":
            yield 0.0, event(json.dumps(head | {"object": "chat.completion.chunk", "choices": [], "usage": usage}))
        yield 0.0, event("[DONE]")


class ChatRequests(BaseHTTPRequestHandler):
    """The chat API's HTTP side (a part of the server's handler, which has these)."""

    if TYPE_CHECKING:

        @property
        def sim(self) -> Simulator: ...

        def _send(self, status: int, payload: bytes, content_type: str = ..., **headers: str) -> None: ...

        def _transport_fault(self, fault: Fault | None, error_body: Callable[[int], bytes]) -> bool: ...

    def _chat(self, body: bytes) -> None:
        sim = self.sim
        fault = sim._take_fault(CHAT_PATH)
        if sim.latency:
            time.sleep(sim.latency)
        if fault and fault.kind in WIRE_FAULTS and self._transport_fault(fault, _error_body):
            return
        reply = sim.chat_reply(body, self.headers.get("Authorization"), fault)
        if reply.events is None:
            if reply.wait:
                time.sleep(reply.wait)
            self._send(reply.status, reply.body, **reply.headers)
        else:
            self._stream(reply.events)

    def _stream(self, events: tuple[tuple[float, bytes], ...]) -> None:
        chunked = self.sim.stream_framing == "chunked"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            # Neither a length nor chunks: the body ends when the connection does.
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        try:
            for pause, payload in events:
                if pause:
                    time.sleep(pause)
                self.wfile.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n" if chunked else payload)
                self.wfile.flush()
            if chunked:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
