"""The stand-in backend's drain (what the e2e suite's kwok Pods do instead of a kubelet's preStop):
a stream in flight finishes whole, a new connection is refused, and the wait is bounded."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import requests

from tests.gateway.fakebackend import FakeBackend


def test_drain_answers_what_is_in_flight_and_refuses_new_connections() -> None:
    backend = FakeBackend().start()
    backend.stream_delay = 0.1  # 5 tokens: about half a second
    chunks: list[bytes] = []

    def stream() -> None:
        with requests.post(f"{backend.url}/v1/chat/completions", json={"model": "m", "stream": True},
                           stream=True, timeout=10) as r:
            chunks.extend(r.iter_lines())

    client = threading.Thread(target=stream)
    client.start()
    deadline = time.monotonic() + 5
    while backend.in_flight == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert backend.in_flight == 1
    waited = backend.drain(grace=10)
    client.join(5)
    assert b"data: [DONE]" in chunks, chunks
    assert 0.2 < waited < 5 and not backend.running
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", backend.port), timeout=1).close()


def test_drain_gives_up_after_its_grace() -> None:
    backend = FakeBackend().start()
    backend.stream_delay = 1.0
    done = threading.Event()

    def stream() -> None:
        try:
            with requests.post(f"{backend.url}/v1/chat/completions", json={"model": "m", "stream": True},
                               stream=True, timeout=10) as r:
                for _ in r.iter_lines():
                    pass
        except requests.RequestException:
            pass
        done.set()

    threading.Thread(target=stream, daemon=True).start()
    deadline = time.monotonic() + 5
    while backend.in_flight == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert 0.4 < backend.drain(grace=0.5) < 2
    assert done.wait(5), "the cut stream's client was left hanging"
