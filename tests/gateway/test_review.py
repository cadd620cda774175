"""Review findings: each test here failed before its fix in gateway/."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable

from gateway.state.readiness import ProbeResult
from tests.gateway.conftest import wait_for

MESSAGES = [{"role": "user", "content": "hi"}]


class RawBackend:
    """A scripted backend on 127.0.0.1: answers its readiness path itself and hands every other
    request (head bytes, body bytes) to ``answer(sock, head, body)``."""

    def __init__(self, answer: Callable[[socket.socket, bytes, bytes], None]) -> None:
        self.answer = answer
        self.heads: list[bytes] = []
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = sock.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(buf) < length:
                    data = sock.recv(65536)
                    if not data:
                        return
                    buf += data
                body, buf = buf[:length], buf[length:]
                if head.startswith(b"GET /health "):
                    sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    continue
                self.heads.append(head)
                self.answer(sock, head, body)
        except OSError:
            pass
        finally:
            sock.close()

    def close(self) -> None:
        self.listener.close()


LAST_CHUNK_MARK = b"\r\n0\r\n\r\n"  # the end of a chunked body (never the end of a head)


def read_until(sock: socket.socket, marker: bytes, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    deadline = time.monotonic() + timeout
    while marker not in data and time.monotonic() < deadline:
        try:
            piece = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not piece:
            break
        data += piece
    return data


def warm(gw) -> None:
    gw.call(lambda: gw.app.activation.report_probe(ProbeResult.READY))
    wait_for(lambda: gw.call(lambda: gw.app.activation.ready), what="gateway sees the backend ready")


def in_use(gw) -> int:
    return gw.call(lambda: gw.app.activation.slots.total)


# -- 1. a blocked write after a pipelined request's deadline passed is never unblocked ------------------

def test_blocked_answer_is_cut_after_the_idle_timeout_even_with_a_late_pipelined_request(make_gateway) -> None:
    big = b"x" * (48 * 1024 * 1024)

    def answer(sock: socket.socket, head: bytes, body: bytes) -> None:
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n" % len(big))
        sock.sendall(big)

    backend = RawBackend(answer)
    try:
        gw = make_gateway(backend, client_idle_timeout_seconds=1.0, client_request_timeout_seconds=0.5)
        warm(gw)
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", gw.port))
        # A request without a body, and the start of a pipelined one; then the client reads nothing.
        client.sendall(b"GET /v1/big HTTP/1.1\r\nHost: x\r\n\r\nGET /v1/next HTTP/1.1\r\n")
        wait_for(lambda: in_use(gw) == 1, what="the request in flight")
        # The answer cannot be written (nobody reads): the idle timeout must end the write and
        # free the slot, as it does without a pipelined request behind it.
        wait_for(lambda: in_use(gw) == 0, timeout=10, what="the stuck answer to be cut and its slot freed")
        client.close()
    finally:
        backend.close()


# -- 2. chunked trailers are not request headers ------------------------------------------------------

def test_chunked_trailer_fields_are_not_forwarded_as_headers(make_gateway) -> None:
    def answer(sock: socket.socket, head: bytes, body: bytes) -> None:
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")

    backend = RawBackend(answer)
    try:
        gw = make_gateway(backend)
        warm(gw)
        with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as client:
            client.sendall(b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n"
                           b"X-Trailer-Field: smuggled\r\nContent-Type: text/plain\r\n\r\n")
            reply = read_until(client, b"{}", 10)
        assert reply.startswith(b"HTTP/1.1 200 ")
        head = backend.heads[-1].lower()
        assert b"x-trailer-field" not in head
        assert head.count(b"content-type:") == 1 and b"text/plain" not in head
    finally:
        backend.close()


# -- 3. a close-delimited answer relayed chunked ends with the last chunk ---------------------------------

def test_close_delimited_backend_answer_is_terminated_for_an_http11_client(make_gateway) -> None:
    def answer(sock: socket.socket, head: bytes, body: bytes) -> None:
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\nhello")
        sock.shutdown(socket.SHUT_RDWR)
        raise OSError("closed")  # ends _serve: the body was delimited by the close

    backend = RawBackend(answer)
    try:
        gw = make_gateway(backend)
        warm(gw)
        with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as client:
            client.sendall(b"GET /v1/files/x HTTP/1.1\r\nHost: x\r\n\r\n")
            started = time.monotonic()
            # The last chunk with the line end before it: "0\r\n\r\n" alone also ends every head whose
            # X-Request-Id ends in 0 (one in 16), which cut this read short before the body.
            reply = read_until(client, LAST_CHUNK_MARK, 30)
        head, _, body = reply.partition(b"\r\n\r\n")
        assert b"transfer-encoding: chunked" in head.lower()
        # The elapsed time tells a stall (about 30 s) from a cut connection (at once).
        assert body == b"5\r\nhello\r\n0\r\n\r\n", f"after {time.monotonic() - started:.1f}s: {body!r}"
    finally:
        backend.close()


# -- 4. a backend that dies inside a committed cold stream ends it with an error frame ---------------------

def test_backend_dying_inside_a_committed_cold_stream_sends_an_error_frame(backend, make_gateway) -> None:
    gw = make_gateway(backend)  # the backend is not running: cold
    backend.die_mid_response = True
    body = json.dumps({"model": "m", "messages": MESSAGES, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", gw.port), timeout=15) as client:
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        opening = read_until(client, b"heartbeat", 10)
        assert opening.startswith(b"HTTP/1.1 200 ")  # committed as SSE while cold
        backend.start()
        rest = read_until(client, LAST_CHUNK_MARK, 15)
    assert b"chatcmpl-1" in rest  # the backend's first events were relayed
    assert b"event: error" in rest  # ... and its failure is told, not passed off as a clean end


def test_answers_while_draining_say_the_connection_closes(backend, make_gateway) -> None:
    # The gateway closes every connection after its answer once draining: a client must be told, or
    # it sends its next request (a POST it may not retry) on a connection that is about to close.
    backend.start()
    gw = make_gateway(backend)
    gw.call(lambda: setattr(gw.app, "draining", True))
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = b""
        while True:
            piece = sock.recv(65536)
            if not piece:
                break
            reply += piece
    head = reply.split(b"\r\n\r\n", 1)[0].lower()
    assert reply.startswith(b"HTTP/1.1 503") and b"connection: close" in head
