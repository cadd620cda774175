"""Forwarding details: body limits, backend failures, disconnects, headers, streaming bodies, and
backends whose responses the gateway refuses (interim floods, bad statuses, transfer codings)."""

from __future__ import annotations

import gzip
import http.client
import json
import os
import re
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator

import openai
import pytest
import requests

from gateway.state.readiness import ProbeResult
from gateway.wire import MAX_INTERIM_RESPONSES, chunk
from tests.gateway.conftest import wait_for
from tests.ports import free_port

MESSAGES = [{"role": "user", "content": "hi"}]


def test_body_over_limit_is_413_before_admission(backend, make_gateway) -> None:
    backend.start()
    gw = make_gateway(backend, max_body_bytes=1024)
    resp = requests.post(gw.url + "/v1/chat/completions", data=b"x" * 2048,
                         headers={"Content-Type": "application/json"}, timeout=10)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    # Chunked upload without a length: cut off while relaying, still 413.
    def gen():
        for _ in range(8):
            yield b"y" * 512

    resp = requests.post(gw.url + "/v1/echo", data=gen(), timeout=10)
    assert resp.status_code == 413
    assert requests.get(gw.admin_url + "/noctaya/queue", timeout=5).json()["queued"] == 0
    with pytest.raises(openai.APIStatusError) as info:
        openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "z" * 4096}])
    assert info.value.status_code == 413


def test_large_body_streams_through_byte_for_byte(backend, make_gateway) -> None:
    backend.start()
    gw = make_gateway(backend)
    requests.post(gw.url + "/v1/embeddings", json={"input": "a"}, timeout=10)  # warm: streaming path
    payload = os.urandom(3 * 1024 * 1024)
    resp = requests.post(gw.url + "/v1/echo", data=payload, timeout=30)
    assert resp.status_code == 200 and resp.content == payload

    def gen():
        for i in range(0, len(payload), 100_000):
            yield payload[i:i + 100_000]

    resp = requests.post(gw.url + "/v1/echo", data=gen(), timeout=30)  # chunked upload
    assert resp.status_code == 200 and resp.content == payload


def test_hop_by_hop_headers_are_not_forwarded(backend, make_gateway) -> None:
    backend.start()
    gw = make_gateway(backend)
    requests.post(gw.url + "/v1/embeddings", json={"input": "a"}, timeout=10,
                  headers={"Connection": "keep-alive, X-Private", "X-Private": "1", "Te": "trailers",
                           "X-Kept": "yes", "Proxy-Authorization": "secret"})
    seen = {k.lower(): v for k, v in backend.last_headers.items()}
    assert seen["x-kept"] == "yes" and "x-private" not in seen and "te" not in seen
    assert "proxy-authorization" not in seen and seen["x-forwarded-for"] == "127.0.0.1"
    assert seen["host"] == f"127.0.0.1:{backend.port}"


def test_backend_dying_mid_response_is_502_or_error_event(backend, make_gateway) -> None:
    backend.start()
    gw = make_gateway(backend)
    c = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=30)
    c.embeddings.create(model="m", input="warm-up")
    backend.die_mid_response = True
    # Non-streamed: the head was committed, so the client sees a truncated body.
    started = time.monotonic()
    with pytest.raises(openai.APIConnectionError) as info:
        c.chat.completions.create(model="m", messages=MESSAGES)
    assert not isinstance(info.value, openai.APITimeoutError) and time.monotonic() - started < 10
    # Streamed: the committed SSE stream ends with an error event the client raises.
    with pytest.raises(openai.APIError, match="failed while serving"):
        for _ in c.chat.completions.create(model="m", messages=MESSAGES, stream=True):
            pass
    assert len(backend.requests_to("/v1/chat/completions")) == 2  # never replayed
    # The backend dies before answering at all -> 502 JSON.
    backend.die_mid_response = False
    backend.stop()
    dead = socket.socket()
    dead.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    dead.bind(("127.0.0.1", backend.port))
    dead.listen(16)

    def accept_and_drop() -> None:  # reads each request, answers nothing, hangs up
        while True:
            try:
                conn, _ = dead.accept()
            except OSError:
                return
            conn.recv(65536)
            conn.close()

    threading.Thread(target=accept_and_drop, daemon=True).start()
    gw.call(lambda: gw.app.activation.report_probe(ProbeResult.READY))
    gw.call(lambda: gw.app.pool.clear())
    resp = requests.post(gw.url + "/v1/chat/completions", json={"model": "m", "messages": MESSAGES}, timeout=10)
    dead.close()
    assert resp.status_code == 502 and resp.json()["error"]["type"] == "backend_error"


def test_client_disconnect_reaches_the_backend(backend, make_gateway) -> None:
    backend.tokens = 200
    backend.stream_delay = 0.05
    backend.start()
    gw = make_gateway(backend)
    requests.post(gw.url + "/v1/embeddings", json={"input": "a"}, timeout=10)  # warm
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=10)
    body = json.dumps({"model": "m", "messages": MESSAGES, "stream": True})
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.read1(100).startswith(b"data: ")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_for(lambda: backend.client_disconnects >= 1, timeout=20, what="backend saw the disconnect")
    wait_for(lambda: requests.get(gw.admin_url + "/noctaya/queue", timeout=5).json()["inFlight"] == 0, what="slot back")


def test_unknown_paths_and_keepalive_reuse(backend, make_gateway) -> None:
    backend.start()
    gw = make_gateway(backend)
    assert requests.get(gw.url + "/nope", timeout=5).status_code == 404
    with requests.Session() as s:
        for _ in range(20):
            assert s.post(gw.url + "/v1/embeddings", json={"input": "a"}, timeout=10).status_code == 200
    # Warm traffic reuses pooled backend connections instead of one connection per request.
    assert gw.call(lambda: len(gw.app.pool._idle)) >= 1
    started = time.monotonic()
    assert requests.get(gw.url + "/v1/models", timeout=5).json()["data"][0]["owned_by"] == "fake-backend"
    assert time.monotonic() - started < 5


def test_client_disconnect_during_a_long_non_streamed_answer_frees_the_slot(backend, make_gateway) -> None:
    backend.start()
    gw = make_gateway(backend)
    requests.post(gw.url + "/v1/embeddings", json={"input": "a"}, timeout=10)  # warm
    backend.response_delay = 30.0
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=10)
    conn.request("POST", "/v1/chat/completions", json.dumps({"model": "m", "messages": MESSAGES}),
                 {"Content-Type": "application/json"})
    wait_for(lambda: requests.get(gw.admin_url + "/noctaya/queue", timeout=5).json()["inFlight"] == 1, what="in flight")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    # The backend connection is hung up at once (not after the 30 s answer), freeing the slot.
    wait_for(lambda: requests.get(gw.admin_url + "/noctaya/queue", timeout=5).json()["inFlight"] == 0, timeout=15,
             what="slot released after client hang-up")


@pytest.mark.parametrize("path", ["/v1/../metrics", "/v1/./models/../../admin", "/v1/%2e%2e/metrics",
                                  "/v1/chat/%2E%2E/%2E%2E/x"])
def test_dot_segments_never_reach_the_backend(backend, make_gateway, path: str) -> None:
    backend.start()
    gw = make_gateway(backend)
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 404"), reply[:200]
    assert all("/.." not in p and "%2e" not in p.lower() for _, p, _ in backend.requests)


# -- hostile backends: responses the gateway must not relay (gateway.wire.UpstreamParser) ---------

PROCESSING = b"HTTP/1.1 102 Processing\r\n\r\n"
PROTOCOL_ERRORS_METRIC = "noctaya_gateway_upstream_protocol_errors_total"


class RawBackend:
    """A backend on a raw socket: its readiness path answered normally, every other request by
    ``respond(conn)``, which may write anything (forever, until the gateway hangs up)."""

    def __init__(self, respond: Callable[[socket.socket], None]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._respond = respond
        self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                request = conn.recv(65536)  # the gateway sends a small request in one write
                if request.startswith(b"GET /health"):
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
                elif request:
                    self._respond(conn)
            except OSError:
                pass  # the gateway hung up, as these tests want it to

    def close(self) -> None:
        self._listener.close()


@pytest.fixture
def raw_backend() -> Iterator[Callable[[Callable[[socket.socket], None]], RawBackend]]:
    made: list[RawBackend] = []

    def make(respond: Callable[[socket.socket], None]) -> RawBackend:
        made.append(RawBackend(respond))
        return made[-1]

    yield make
    for backend in made:
        backend.close()


def warm_gateway(make_gateway, backend: RawBackend):
    """A gateway that forwards at once: these tests time the backend's answer, not an activation."""
    gw = make_gateway(backend)
    gw.call(lambda: gw.app.activation.report_probe(ProbeResult.READY))
    wait_for(lambda: gw.call(lambda: gw.app.activation.ready), what="backend ready")
    return gw


def chat(gw, **kwargs) -> requests.Response:
    return requests.post(gw.url + "/v1/chat/completions", json={"model": "m", "messages": MESSAGES},
                         timeout=kwargs.pop("timeout", 10), **kwargs)


def protocol_errors(gw) -> dict[str, float]:
    text = requests.get(gw.admin_url + "/metrics", timeout=5).text
    found = re.findall(PROTOCOL_ERRORS_METRIC + r'\{reason="(\w+)"\} (\S+)', text)
    return {reason: float(value) for reason, value in found if float(value)}


def assert_refused(resp: requests.Response) -> None:
    assert resp.status_code == 502, resp.content[:200]
    error = resp.json()["error"]
    assert error["code"] == "upstream_protocol_error" and error["type"] == "backend_error"
    assert resp.headers["x-request-id"]


def test_a_backend_flooding_102_gets_a_502_at_once_and_the_gateway_holds_nothing(raw_backend, make_gateway) -> None:
    flooded = [0]

    def flood(conn: socket.socket) -> None:
        block = PROCESSING * 4096  # 112 KiB per write, forever: the issue's +24 MiB in 6 s
        while True:
            conn.sendall(block)
            flooded[0] += len(block)

    gw = warm_gateway(make_gateway, raw_backend(flood))
    tracemalloc.start()
    try:
        started = time.monotonic()
        resp = chat(gw, timeout=5)  # not the 600 s upstream deadline
        elapsed = time.monotonic() - started
        _, peak = tracemalloc.get_traced_memory()  # every thread of this process, the gateway's too
    finally:
        tracemalloc.stop()
    assert_refused(resp)
    assert elapsed < 1.0, elapsed
    assert peak < 4 * 1024 * 1024, peak
    assert protocol_errors(gw) == {"too_many_interim": 1.0}
    # The gateway closed the backend connection: the flood stops instead of filling a socket buffer.
    wait_for(lambda: (lambda before: (time.sleep(0.2), flooded[0] == before)[1])(flooded[0]), timeout=5,
             what="the flood stopped")


@pytest.mark.parametrize("interim", [MAX_INTERIM_RESPONSES, MAX_INTERIM_RESPONSES + 1])
def test_interim_heads_exactly_at_the_limit_are_skipped(raw_backend, make_gateway, interim: int) -> None:
    body = b'{"id":"chatcmpl-1","object":"chat.completion"}'

    def respond(conn: socket.socket) -> None:
        for i in range(interim):
            conn.sendall(b"HTTP/1.1 103 Early Hints\r\nLink: </x%d>; rel=preload\r\n\r\n" % i)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                     b"Connection: close\r\n\r\n%s" % (len(body), body))

    gw = warm_gateway(make_gateway, raw_backend(respond))
    resp = chat(gw)
    if interim <= MAX_INTERIM_RESPONSES:
        assert resp.status_code == 200 and resp.content == body and "link" not in resp.headers
        assert protocol_errors(gw) == {}
    else:
        assert_refused(resp)
        assert protocol_errors(gw) == {"too_many_interim": 1.0}


RESPONSES = {
    "status 600": (b"HTTP/1.1 600 Beyond\r\nContent-Length: 2\r\n\r\nok", "invalid_status"),
    "status 099": (b"HTTP/1.1 099 Before\r\nContent-Length: 2\r\n\r\nok", "invalid_status"),
    "status 000": (b"HTTP/1.1 000 Zero\r\nContent-Length: 2\r\n\r\nok", "invalid_status"),
    "101 unasked": (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
                    "switching_protocols"),
    "gzip, chunked": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
                      + chunk(gzip.compress(b'{"id":"x"}')) + b"0\r\n\r\n", "transfer_coding"),
    "chunked, chunked": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
                         "transfer_coding"),
    "identity": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: identity\r\n\r\nok", "transfer_coding"),
    "unknown coding": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: x-custom\r\n\r\nok", "transfer_coding"),
    "chunked in HTTP/1.0": (b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
                            "transfer_coding"),
    "Content-Length and chunked": (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n"
                                   b"2\r\nok\r\n0\r\n\r\n", "malformed"),
    "Content-Lengths differing": (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok",
                                  "malformed"),
    "Content-Length not a number": (b"HTTP/1.1 200 OK\r\nContent-Length: 2x\r\n\r\nok", "malformed"),
}


@pytest.mark.parametrize("case", sorted(RESPONSES))
def test_a_response_the_gateway_cannot_relay_is_a_502(raw_backend, make_gateway, case: str) -> None:
    raw, reason = RESPONSES[case]
    gw = warm_gateway(make_gateway, raw_backend(lambda conn: conn.sendall(raw)))
    assert_refused(chat(gw))
    assert protocol_errors(gw) == {reason: 1.0}


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_well_framed_bodies_are_relayed_byte_for_byte(raw_backend, make_gateway, framing: str) -> None:
    payload = os.urandom(300_000)
    pieces = [payload[i:i + 70_000] for i in range(0, len(payload), 70_000)]

    def respond(conn: socket.socket) -> None:
        conn.sendall(PROCESSING + b"HTTP/1.1 100 Continue\r\n\r\n")  # interim heads, skipped
        if framing == "chunked":
            conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
            for piece in pieces:
                conn.sendall(chunk(piece))
            conn.sendall(b"0\r\n\r\n")
        else:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(payload))
            for piece in pieces:
                conn.sendall(piece)

    gw = warm_gateway(make_gateway, raw_backend(respond))
    resp = chat(gw)
    assert resp.status_code == 200 and resp.content == payload
    assert protocol_errors(gw) == {}


def sse_stream(gw) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=10)
    conn.request("POST", "/v1/chat/completions", json.dumps({"model": "m", "messages": MESSAGES, "stream": True}),
                  {"Content-Type": "application/json"})
    return conn.getresponse()


def test_sse_is_still_streamed_event_by_event(raw_backend, make_gateway) -> None:
    go = threading.Event()
    first, second = b'data: {"n":1}\n\n', b'data: {"n":2}\n\ndata: [DONE]\n\n'

    def respond(conn: socket.socket) -> None:
        conn.sendall(PROCESSING + b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + chunk(first))
        go.wait(10)  # the second event only once the client has the first: nothing waits for the end
        conn.sendall(chunk(second) + b"0\r\n\r\n")

    gw = warm_gateway(make_gateway, raw_backend(respond))
    resp = sse_stream(gw)
    assert resp.status == 200 and resp.getheader("content-type") == "text/event-stream"
    assert resp.read1(65536) == first
    go.set()
    assert resp.read() == second


def test_a_malformed_chunk_mid_stream_ends_it_with_an_error_event(raw_backend, make_gateway) -> None:
    first = b'data: {"n":1}\n\n'

    def respond(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + chunk(first))
        time.sleep(0.2)  # a later read: the head and first event have gone to the client
        conn.sendall(b"zz\r\nnot a chunk\r\n")

    gw = warm_gateway(make_gateway, raw_backend(respond))
    resp = sse_stream(gw)
    assert resp.status == 200
    body = resp.read()
    assert body.startswith(first) and body.count(b"event: error") == 1
    error = json.loads(body.split(b"event: error\ndata: ", 1)[1])["error"]
    assert error["code"] == "upstream_protocol_error"
    assert protocol_errors(gw) == {"malformed": 1.0}


def test_a_response_nobody_asked_for_never_reaches_the_client(raw_backend, make_gateway) -> None:
    injected = b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\nX-Injected: 1\r\n\r\ninjected"

    def respond(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}" + injected)

    gw = warm_gateway(make_gateway, raw_backend(respond))
    with requests.Session() as session:  # one client connection: an injected answer would be read as the next
        for _ in range(3):
            resp = session.post(gw.url + "/v1/chat/completions", json={"model": "m", "messages": MESSAGES}, timeout=10)
            assert resp.status_code == 200 and resp.content == b"{}" and "x-injected" not in resp.headers
    assert gw.call(lambda: len(gw.app.pool._idle)) == 0  # such a connection is never reused
