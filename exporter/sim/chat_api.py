"""The chat API's side of the simulator: the answer to a request, and its delivery (plain or SSE)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any

from exporter.sim.model import Fault

if TYPE_CHECKING:
    from exporter.sim.service import Simulator


class ChatAPI:
    """The chat API's answers (a part of `Simulator`)."""

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


class ChatRequests(BaseHTTPRequestHandler):
    """The chat API's HTTP side (a part of the server's handler, which has these)."""

    if TYPE_CHECKING:

        @property
        def sim(self) -> Simulator: ...

        def _send(self, status: int, payload: bytes, content_type: str = ..., **headers: str) -> None: ...

        def _transport_fault(self, fault: Fault | None, error_body: Callable[[int], bytes]) -> bool: ...

    def _chat_error(self, status: int, kind: str, message: str) -> None:
        self._send(status, json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode())

    def _chat(self, body: bytes) -> None:
        sim = self.sim
        fault = sim._take_fault("/v1/chat/completions")
        if sim.latency:
            time.sleep(sim.latency)
        if self._transport_fault(
            fault, lambda status: json.dumps({"error": {"message": HTTPStatus(status).phrase}}).encode()
        ):
            return
        if self.headers.get("Authorization") != f"Bearer {sim.api_key}":
            self._chat_error(401, "authentication_error", "invalid API key")
            return
        try:
            request = json.loads(body)
            model = request["model"]
        except (ValueError, KeyError, TypeError):
            self._chat_error(400, "invalid_request_error", "body must be JSON with model and messages")
            return
        if model not in {e.endpoint_id for e in sim.endpoints}:
            self._chat_error(404, "not_found_error", "endpoint not found")
            return
        if fault and fault.kind == "malformed":
            self._send(200, b'{"id": "chatcmpl-sim", "choices": [')
            return
        if fault and fault.kind == "plain_answer":
            request = {k: v for k, v in request.items() if k != "tools"}
        reasoning, content, tool_calls, prompt_tokens = sim.chat_answer(request)
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
        head = {"id": "chatcmpl-sim", "created": int(sim.clock.now().timestamp()), "model": model}
        if not request.get("stream"):
            time.sleep(sim.time_to_first_token + sim.chunk_delay * max(0, len(content) - 1))
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
            self._send(200, json.dumps(answer).encode())
            return
        include_usage = bool((request.get("stream_options") or {}).get("include_usage"))
        self._stream(head, reasoning, content, tool_calls, finish, usage if include_usage else None, fault)

    def _stream(
        self,
        head: dict[str, Any],
        reasoning: list[str],
        content: list[str],
        tool_calls: list[dict[str, Any]],
        finish: str,
        usage: dict[str, Any] | None,
        fault: Fault | None,
    ) -> None:
        sim = self.sim
        chunked = sim.stream_framing == "chunked"
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

        def event(data: str) -> None:
            payload = f"data: {data}\n\n".encode()
            self.wfile.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n" if chunked else payload)
            self.wfile.flush()

        def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> None:
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
            event(json.dumps(head | {"object": "chat.completion.chunk", "choices": [choice]}))

        try:
            chunk({"role": "assistant", "content": ""})
            time.sleep(sim.time_to_first_token)
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
            for n, delta in enumerate(deltas):
                if n:
                    time.sleep(sim.chunk_delay)
                if fault and fault.kind == "stall" and n == len(deltas) // 2:
                    time.sleep(fault.seconds)
                if fault and fault.kind == "stream_error" and n == len(deltas) // 2:
                    event(json.dumps({"error": {"message": "internal error while generating", "type": "server_error"}}))
                    break
                if fault and fault.kind == "truncate" and n == len(deltas) // 2:
                    break
                chunk(delta)
            else:
                chunk({}, finish)
                if usage is not None and not (fault and fault.kind == "no_usage"):
                    event(json.dumps(head | {"object": "chat.completion.chunk", "choices": [], "usage": usage}))
                event("[DONE]")
            if chunked:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
