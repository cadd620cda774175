"""Forwarding details: body limits, backend failures, disconnects, headers, streaming bodies."""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time

import openai
import pytest
import requests

from gateway.state.readiness import ProbeResult
from tests.gateway.conftest import wait_for

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
