"""A small OpenAI-compatible backend for the gateway tests (real HTTP on 127.0.0.1).

It can be stopped and restarted on the same port (a backend scaled to zero refuses connections),
have its readiness path fail while listening (a model still loading), stream SSE slowly, die in the
middle of a response, and it records what it received so tests can check nothing was replayed.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.ports import free_port

MODEL = "test-model"


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # A woken backend gets every held request at once: socketserver's default backlog of 5 would
    # drop SYNs and turn a burst into connect timeouts.
    request_queue_size = 128
    backend: FakeBackend


def send_json(handler: BaseHTTPRequestHandler, code: int, doc: Any) -> None:
    """A JSON answer with its length (the stand-ins' one way to answer JSON)."""
    body = json.dumps(doc).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY, as uvicorn and other real servers set it: the handler writes a response's head and
    # body separately, and with Nagle the body waited for the ACK of the head, which the gateway's
    # kept-alive upstream connection delays ~40 ms - every pooled request took 40 ms more.
    disable_nagle_algorithm = True
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    def setup(self) -> None:
        super().setup()
        self.server.backend.track(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.backend.untrack(self.connection)

    def _send_json(self, code: int, doc: Any) -> None:
        send_json(self, code, doc)

    def do_GET(self) -> None:
        b = self.server.backend
        b.record(self.command, self.path, b"", dict(self.headers))
        if self.path == b.readiness_path:
            b.health_checks += 1
            if b.ready:
                self._send_json(200, {"status": "ok"})
            else:
                self._send_json(503, {"status": "loading"})
            return
        if self.path == "/v1/models":
            self._send_json(200, {"object": "list", "data": [
                {"id": MODEL, "object": "model", "created": 1, "owned_by": "fake-backend"}]})
            return
        if self.path == "/static":
            self._send_json(200, {"ok": True})
            return
        self._send_json(404, {"error": {"message": "not found", "type": "invalid_request_error"}})

    def do_POST(self) -> None:
        b = self.server.backend
        b.begin_request()
        try:
            self._post(b)
        finally:
            b.end_request()

    def _post(self, b: FakeBackend) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if b.refuse_over is not None and length > b.refuse_over:
            self.rfile.read(length)  # read off the connection (it stays usable), not parsed, not recorded
            self._send_json(400, {"error": {"message": "request too large", "type": "invalid_request_error"}})
            return
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = self._read_chunked()
        else:
            body = self.rfile.read(length)
        b.record(self.command, self.path, body, dict(self.headers))
        if self.path == "/v1/echo":
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if self.path in ("/v1/audio/transcriptions", "/v1/audio/translations"):  # multipart: not parsed here
            self._send_json(200, {"text": f"heard {len(body)} bytes"})
            return
        try:
            doc = json.loads(body) if body else {}
        except ValueError:
            self._send_json(400, {"error": {"message": "bad json", "type": "invalid_request_error"}})
            return
        if doc.get("model") == "reject-me":
            self._send_json(400, {"error": {"message": "model reject-me is not served", "type": "invalid_request_error",
                                            "code": "model_not_found"}})
            return
        if self.path == "/v1/embeddings":
            inputs = doc.get("input", "")
            inputs = inputs if isinstance(inputs, list) else [inputs]
            self._send_json(200, {"object": "list", "model": MODEL, "data": [
                {"object": "embedding", "index": i, "embedding": [0.1, 0.2, 0.3]} for i, _ in enumerate(inputs)],
                "usage": {"prompt_tokens": 1, "total_tokens": 1}})
            return
        chat = self.path == "/v1/chat/completions"
        if not chat and self.path != "/v1/completions":
            self._send_json(404, {"error": {"message": "not found", "type": "invalid_request_error"}})
            return
        words = [f"tok{i}" for i in range(b.tokens)]
        if b.first_byte_delay:
            time.sleep(b.first_byte_delay)
        if doc.get("stream"):
            self._stream(words, chat)
            return
        if b.die_mid_response:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b'{"id": "cmpl-1", "choi')
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        if b.response_delay:
            time.sleep(b.response_delay)  # a long non-streamed generation
        text = " ".join(words)
        if chat:
            result = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": MODEL,
                      "choices": [{"index": 0, "finish_reason": "stop",
                                   "message": {"role": "assistant", "content": text}}],
                      "usage": {"prompt_tokens": 1, "completion_tokens": b.tokens, "total_tokens": b.tokens + 1}}
        else:
            result = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL,
                      "choices": [{"index": 0, "finish_reason": "stop", "text": text, "logprobs": None}],
                      "usage": {"prompt_tokens": 1, "completion_tokens": b.tokens, "total_tokens": b.tokens + 1}}
        self._send_json(200, result)

    def _read_chunked(self) -> bytes:
        out = bytearray()
        while True:
            size = int(self.rfile.readline().strip(), 16)
            if size == 0:
                self.rfile.readline()
                return bytes(out)
            out += self.rfile.read(size)
            self.rfile.readline()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _stream(self, words: list[str], chat: bool) -> None:
        b = self.server.backend
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for i, word in enumerate(words):
                if chat:
                    delta = {"content": word + " "} if i else {"role": "assistant", "content": word + " "}
                    event = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                             "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
                else:
                    event = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL,
                             "choices": [{"index": 0, "text": word + " ", "finish_reason": None, "logprobs": None}]}
                self._chunk(b"data: " + json.dumps(event).encode() + b"\n\n")
                if b.die_mid_response and i == 1:
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                if b.stream_delay:
                    time.sleep(b.stream_delay)
            self._chunk(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:
            b.client_disconnects += 1  # the gateway closed our connection: the client went away
            self.close_connection = True


class FakeBackend:
    def __init__(self, port: int | None = None, readiness_path: str = "/health", host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port or free_port()
        self.readiness_path = readiness_path
        self.ready = True
        self.tokens = 5
        self.stream_delay = 0.0
        self.response_delay = 0.0
        self.first_byte_delay = 0.0  # before anything of a completion's answer (prefill)
        self.die_mid_response = False
        # A POST whose Content-Length exceeds this is answered 400 without being parsed or recorded
        # (a flood of 8 MiB bodies neither holds the GIL in json.loads nor piles up in memory).
        self.refuse_over: int | None = None
        self.health_checks = 0
        self.client_disconnects = 0
        self.requests: list[tuple[str, str, bytes]] = []
        self.in_flight = 0  # POSTs being answered (what a preStop drain waits for)
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._server is not None

    def record(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> None:
        with self._lock:
            if path != self.readiness_path:
                self.requests.append((method, path, body))
            self.last_headers = headers

    def track(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections.add(conn)

    def untrack(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections.discard(conn)

    def begin_request(self) -> None:
        with self._lock:
            self.in_flight += 1

    def end_request(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def requests_to(self, path: str) -> list[tuple[str, str, bytes]]:
        with self._lock:
            return [r for r in self.requests if r[1] == path]

    def start(self) -> FakeBackend:
        deadline = time.monotonic() + 10
        while True:
            try:
                server = _Server((self.host, self.port), _Handler)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        server.backend = self
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def drain(self, grace: float) -> float:
        """What a Pod's preStop drain does on scale-in: no new connections (the listener closes, as
        the Pod leaves its Service's endpoints), requests already in flight are answered for up to
        ``grace`` seconds, then the Pod is gone (:meth:`stop`). Returns the seconds waited."""
        started = time.monotonic()
        server = self._server
        if server is not None:
            server.shutdown()
            server.server_close()
        while time.monotonic() - started < grace:
            with self._lock:
                if self.in_flight <= 0:
                    break
            time.sleep(0.02)
        self.stop()
        return time.monotonic() - started

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        with self._lock:
            conns, self._connections = self._connections, set()
        for conn in conns:  # a dead Pod takes its connections with it
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> FakeBackend:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
