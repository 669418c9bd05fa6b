"""The HTTP side of the endpoint: a threaded server on loopback whose every request is one call of the
endpoint's `handle(method, path, api_key, body) -> (status, JSON)` (reinforge/serve/endpoint.py)."""

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
            self._send(status, answer)

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
