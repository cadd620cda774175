"""The drain (gateway/drain.py) and the requests held for a cold backend, over real sockets: when the
drain starts refusing, a request held silently (not streamed) is answered a retryable 503 with
``Retry-After`` at that moment, not when the grace ends; a held streamed request (its 200 committed)
keeps its heartbeats and is still served once the backend is ready within the grace."""

from __future__ import annotations

import json
import socket

import openai
import pytest

from gateway.drain import Drainer
from tests.gateway.conftest import wait_for
from tests.gateway.harness import ThreadedGateway

pytestmark = pytest.mark.timeout(120)

MESSAGES = [{"role": "user", "content": "hi"}]
GRACE = 60.0  # never reached here: what is asserted happens before it ends (or the test times out)


def post(stream: bool) -> bytes:
    body = json.dumps({"model": "test-model", "messages": MESSAGES, "stream": stream}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body)


def read_until(sock: socket.socket, marker: bytes) -> bytes:
    data = b""
    while marker not in data:
        piece = sock.recv(65536)
        if not piece:
            break
        data += piece
    return data


def queued(gw: ThreadedGateway) -> int:
    return gw.call(lambda: gw.app.waiting)


def test_held_requests_that_are_not_streamed_get_a_retryable_503_when_the_drain_starts_refusing(
        backend, make_gateway) -> None:
    gw = make_gateway(backend, activation_timeout_seconds=GRACE + 30)
    drainer = Drainer(gw.server, GRACE, delay=0.1)
    with socket.create_connection(("127.0.0.1", gw.port), timeout=20) as silent, \
            socket.create_connection(("127.0.0.1", gw.port), timeout=20) as streamed:
        silent.sendall(post(stream=False))
        streamed.sendall(post(stream=True))
        assert read_until(streamed, b"heartbeat").startswith(b"HTTP/1.1 200 ")  # committed as SSE
        wait_for(lambda: queued(gw) == 2, what="both held")
        gw.call(drainer.begin)
        answer = read_until(silent, b"}}")
        # Answered by the drain's refusal, not by the end of its grace (the waiters are not aborted).
        assert gw.call(lambda: (gw.app.draining, gw.app.activation.aborted)) == (True, False)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 "), answer
        assert b"\r\nretry-after: 1" in head.lower() and b"\r\nconnection: close" in head.lower()
        assert json.loads(body)["error"]["code"] == "gateway_draining"
        assert silent.recv(1) == b""  # the connection closes: the retry goes elsewhere
        assert queued(gw) == 1  # the streamed one still waits, heartbeats going
        assert b"heartbeat" in read_until(streamed, b"heartbeat")
        backend.start()  # ready within the grace: the streamed request is served
        rest = read_until(streamed, b"0\r\n\r\n")
    assert b"chatcmpl" in rest and b"[DONE]" in rest and b"event: error" not in rest
    assert drainer.done.wait(30) and drainer.unfinished == 0  # nothing left when it stopped
    assert [path for _, path, _ in backend.requests if path == "/v1/chat/completions"] == ["/v1/chat/completions"]


def test_a_held_request_refused_by_the_drain_is_retried_by_the_openai_client_and_the_drain_ends(
        backend, make_gateway) -> None:
    """What the 503 is for: the SDK retries it, on a new connection. The refused request was the
    last one admitted, so the drain ends at once (not after its grace) and this gateway stops: the
    retry finds it gone (behind a Service it reaches another gateway)."""
    import threading

    gw = make_gateway(backend, activation_timeout_seconds=GRACE + 30)
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=1, timeout=GRACE)
    failure: list[BaseException] = []

    def ask() -> None:
        try:
            client.chat.completions.create(model="test-model", messages=MESSAGES)
        except openai.APIError as exc:
            failure.append(exc)

    caller = threading.Thread(target=ask, daemon=True)
    caller.start()
    wait_for(lambda: queued(gw) == 1, what="held")
    drainer = Drainer(gw.server, GRACE, delay=0.0)
    gw.call(drainer.begin)
    caller.join(30)
    assert drainer.done.wait(30) and drainer.unfinished == 0
    assert gw.call(lambda: gw.app.activation.aborted) is False  # ended with nothing held, not by the grace
    refusals = gw.call(lambda: gw.app.metrics.render()).decode()
    assert 'noctaya_gateway_rejections_total{reason="draining"} 1.0' in refusals
    assert failure and isinstance(failure[0], openai.APIConnectionError), failure  # the retry, gateway gone
