"""The HTTP side of the endpoint: a threaded server on loopback whose every request is one call of the
endpoint's `handle(method, path, api_key, body) -> (status, JSON)` (reinforge/serve/endpoint.py).

A request with `"stream": true` that succeeds is answered as server-sent events, as OpenAI streams: the
whole completion in one chunk (its text, tool calls, token ids and log-probs), one chunk with each
choice's finish reason, the usage when `stream_options.include_usage` asks for it, then `data: [DONE]`.
The endpoint samples a turn whole, so nothing arrives earlier than the answer would; harnesses that
always stream (verifiers' chat program, many agent SDKs) read it as any stream."""

from __future__ import annotations

import json
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def server(address: tuple[str, int], handle: Callable[[str, str, str | None, dict], tuple[int, dict]]
           ) -> ThreadingHTTPServer:
    """A server at `address` (bound now) answering every request with `handle`."""
    return _Server(address, _handler(handle))


def error(message: str, kind: str) -> dict:
    """An OpenAI-shaped error body (the client raises it with `message`, and `code` as `err.code`)."""
    return {"error": {"message": message, "type": kind, "code": kind}}


class _Server(ThreadingHTTPServer):
    request_queue_size = 1024     # every episode of a batch may connect at once (the default backlog is 5)
    daemon_threads = True


def _handler(handle: Callable[[str, str, str | None, dict], tuple[int, dict]]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:   # no line per request on the run's console
            pass

        def _answer(self, method: str) -> None:
            body: Any = {}
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                try:
                    body = json.loads(self.rfile.read(length))
                except ValueError as err:
                    return self._send(400, error(f"the body is not JSON: {err}", "invalid_request_error"))
            if not isinstance(body, dict):
                return self._send(400, error("the body must be a JSON object", "invalid_request_error"))
            auth = self.headers.get("Authorization") or ""
            key = auth[7:].strip() if auth.lower().startswith("bearer ") else None
            try:
                status, answer = handle(method, self.path.split("?")[0], key, body)
            except Exception as err:  # a bug here must answer the client, not leave it waiting
                status, answer = 500, error(f"{type(err).__name__}: {err}", "internal_error")
            if status == 200 and body.get("stream") is True \
                    and answer.get("object") in ("chat.completion", "text_completion"):
                options = body.get("stream_options")
                include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
                return self._send_events(stream_events(answer, include_usage))
            self._send(status, answer)

        def _send_events(self, data: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _send(self, status: int, answer: dict) -> None:
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._answer("GET")

        def do_POST(self) -> None:
            self._answer("POST")

    return Handler


def stream_events(answer: dict, include_usage: bool) -> bytes:
    """A whole chat or text completion (`answer`, as the endpoint returns it) as the server-sent events of
    a stream that delivers it in one chunk."""
    chat = answer.get("object") == "chat.completion"
    head = {"id": answer["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": answer["created"], "model": answer["model"]}
    first, last = [], []
    for choice in answer["choices"]:
        extra = {k: v for k, v in choice.items() if k not in ("message", "text", "finish_reason", "index")}
        if chat:
            message = choice["message"]
            delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
            if message.get("tool_calls"):
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
            first.append({"index": choice["index"], "delta": delta, "finish_reason": None, **extra})
            last.append({"index": choice["index"], "delta": {}, "finish_reason": choice["finish_reason"],
                         "logprobs": None})
        else:
            first.append({"index": choice["index"], "text": choice["text"], "finish_reason": None, **extra})
            last.append({"index": choice["index"], "text": "", "finish_reason": choice["finish_reason"],
                         "logprobs": None})
    chunks = [{**head, "choices": first}, {**head, "choices": last}]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": answer.get("usage")})
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
