"""A real HTTP server on 127.0.0.1 that speaks the OpenAI API (GET /v1/models, POST
/v1/chat/completions), scripted per test, recording what it saw (requests, peak concurrency).
It injects faults too: a reply that hangs until the server closes, any status with headers (429 +
Retry-After), a garbage body; `fault` makes every unscripted chat request fail that way."""
from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

import pytest

MODELS = "/v1/models"
CHAT = "/v1/chat/completions"


@dataclass
class Reply:
    status: int = 200
    delay: float = 0.0
    body: dict | str | None = None  # None: the default body for the path
    headers: dict[str, str] = field(default_factory=dict)  # e.g. {"Retry-After": "1"}
    raw: bytes | None = None  # sent as is, as "application/json" (garbage: not JSON)
    hang: bool = False  # never answers; the connection closes when the server does


HANG, ERROR_500, GARBAGE = Reply(hang=True), Reply(status=500), Reply(raw=b'{"choices": [{"mess\x00\xff')


@dataclass
class FakeOpenAI:
    """What the server answers (scripted replies per path, then defaults) and what it saw."""

    url: str = ""
    scripts: dict[str, deque[Reply]] = field(default_factory=lambda: {MODELS: deque(), CHAT: deque()})
    delay: float = 0.0  # for unscripted requests
    fault: Reply | None = None  # the reply to every unscripted chat request (a broken server)
    answer: Callable[[str], str] = lambda prompt: f"reply to: {prompt}"  # unscripted chat replies
    requests: list[dict] = field(default_factory=list)
    inflight: int = 0
    max_inflight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: threading.Event = field(default_factory=threading.Event)  # set at teardown: hung replies end

    def script(self, path: str, *replies: Reply) -> None:
        self.scripts[path].extend(replies)

    def chat_requests(self) -> list[dict]:
        return [r for r in self.requests if r["path"] == CHAT]


def _default_body(path: str, request: dict, answer: Callable[[str], str]) -> dict:
    if path == MODELS:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model", "created": 0, "owned_by": "test"}]}
    prompt = request["json"]["messages"][-1]["content"]
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request["json"]["model"],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": answer(prompt)}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


def _error_body(status: int) -> dict:
    return {"error": {"message": f"scripted error {status}", "type": "test", "code": status}}


def _handler(state: FakeOpenAI) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._serve()

        def do_POST(self) -> None:
            self._serve()

        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            request = {"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()},
                       "json": json.loads(raw) if raw else None}
            with state.lock:
                state.requests.append(request)
                script = state.scripts.get(self.path)
                if script:
                    reply = script.popleft()
                else:
                    reply = state.fault if state.fault is not None and self.path == CHAT else Reply(delay=state.delay)
                state.inflight += 1
                state.max_inflight = max(state.max_inflight, state.inflight)
            try:
                if reply.hang:
                    state.closed.wait()
                    return
                time.sleep(reply.delay)
                if reply.body is not None:
                    body = reply.body
                elif reply.status == 200 and self.path in state.scripts:
                    body = _default_body(self.path, request, state.answer)
                else:
                    body = _error_body(reply.status if reply.status != 200 else 404)
                data = reply.raw if reply.raw is not None else json.dumps(body).encode()
                self.send_response(reply.status if self.path in state.scripts else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for key, value in reply.headers.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client timed out and left
            finally:
                with state.lock:
                    state.inflight -= 1

        def log_message(self, *args) -> None:
            pass

    return Handler


@pytest.fixture
def server():
    state = FakeOpenAI()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield state
    state.closed.set()
    httpd.shutdown()
    httpd.server_close()
