"""The real `openai` client through the gateway to a real local backend: warm and cold, streamed
and not, in both cold modes."""

from __future__ import annotations

import threading
import time

import openai
import pytest
import requests

from tests.gateway.conftest import wait_for
from tests.gateway.fakebackend import FakeBackend

MESSAGES = [{"role": "user", "content": "hi"}]
EXPECTED = "tok0 tok1 tok2 tok3 tok4"


def client(gw, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0,
                         timeout=kw.pop("timeout", 30.0))


def start_later(backend: FakeBackend, delay: float) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(delay), backend.start()), daemon=True)
    t.start()
    return t


def test_warm_chat_completions_streamed_and_not(backend, make_gateway) -> None:
    backend.start()
    gw = make_gateway(backend)
    c = client(gw)
    out = c.chat.completions.create(model="test-model", messages=MESSAGES)
    assert out.choices[0].message.content == EXPECTED
    chunks = [ch.choices[0].delta.content for ch in c.chat.completions.create(
        model="test-model", messages=MESSAGES, stream=True)]
    assert "".join(chunks).strip() == EXPECTED
    text = c.completions.create(model="test-model", prompt="x").choices[0].text
    assert text == EXPECTED
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(model="test-model", prompt="x", stream=True))
    assert streamed.strip() == EXPECTED
    emb = c.embeddings.create(model="test-model", input=["a", "b"])
    assert len(emb.data) == 2
    # Request bodies reach the backend byte for byte.
    sent = backend.requests_to("/v1/chat/completions")[0][2]
    assert b'"messages"' in sent and b'"model":"test-model"' in sent.replace(b" ", b"")
    # Served warm: nothing waits, the admission slots are all free again.
    assert gw.call(lambda: gw.app.activation.slots.total) == 0


@pytest.mark.parametrize("stream", [False, True])
def test_cold_keepalive_is_served_once_backend_ready(backend, make_gateway, stream) -> None:
    gw = make_gateway(backend)  # backend not running: connections refused
    c = client(gw)
    start_later(backend, 1.0)
    t0 = time.monotonic()
    if stream:
        pieces = [ch.choices[0].delta.content for ch in c.chat.completions.create(
            model="test-model", messages=MESSAGES, stream=True)]
        assert "".join(pieces).strip() == EXPECTED
    else:
        out = c.chat.completions.create(model="test-model", messages=MESSAGES)
        assert out.choices[0].message.content == EXPECTED
    assert time.monotonic() - t0 >= 0.9
    assert len(backend.requests_to("/v1/chat/completions")) == 1  # forwarded once, never replayed
    # The lease outlives the request by the ready grace, then demand goes away.
    assert gw.broadcaster.current().lease_active or gw.broadcaster.current().total == 0
    wait_for(lambda: not gw.broadcaster.current().active, what="demand inactive after ready grace")


def test_cold_stream_gets_200_and_heartbeats_at_once(backend, make_gateway) -> None:
    gw = make_gateway(backend, heartbeat_seconds=0.1)
    with requests.post(gw.url + "/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "stream": True},
                       stream=True, timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        lines = resp.iter_lines()
        assert next(lines) == b": heartbeat"
        assert next(lines) == b""
        assert next(lines) == b": heartbeat"  # a second one, 0.1 s later, while still cold
        q = requests.get(gw.admin_url + "/noctaya/queue", timeout=5).json()
        assert q["queued"] == 1 and q["lease"]["state"] == "activating" and q["backendReady"] is False
        backend.start()
        rest = b"\n".join(lines)
    assert rest.count(b"data: {") == 5 and rest.rstrip().endswith(b"data: [DONE]")


def test_backend_error_on_committed_stream_becomes_sse_error_event(backend, make_gateway) -> None:
    gw = make_gateway(backend)
    start_later(backend, 0.5)
    with pytest.raises(openai.APIError, match="reject-me is not served"):
        for _ in client(gw).chat.completions.create(model="reject-me", messages=MESSAGES, stream=True):
            pass


def test_reject_mode_answers_503_and_still_wakes_backend(backend, make_gateway) -> None:
    gw = make_gateway(backend, cold_mode="reject", retry_after_seconds=10)
    resp = requests.post(gw.url + "/v1/chat/completions", json={"model": "m", "messages": MESSAGES}, timeout=10)
    assert resp.status_code == 503 and resp.headers["Retry-After"] == "10"
    assert resp.json()["error"]["code"] == "backend_activating"
    # The lease keeps demand up (this is what wakes the backend through KEDA) with no slot held.
    demand = wait_for(lambda: gw.broadcaster.current().lease_active and gw.broadcaster.current(), what="lease")
    assert demand.lease_active and demand.total == 0
    with pytest.raises(openai.InternalServerError):
        client(gw).chat.completions.create(model="m", messages=MESSAGES, stream=True)
    backend.start()
    wait_for(lambda: requests.get(gw.admin_url + "/noctaya/queue", timeout=5).json()["backendReady"], what="ready")
    assert client(gw).chat.completions.create(model="m", messages=MESSAGES).choices[0].message.content == EXPECTED
    assert len(backend.requests_to("/v1/chat/completions")) == 1


def test_models_answered_locally_while_cold_without_demand(backend, make_gateway) -> None:
    gw = make_gateway(backend)
    models = client(gw).models.list()
    assert [m.id for m in models.data] == ["test-model"]
    assert not gw.broadcaster.current().active  # listing never wakes a GPU
    time.sleep(0.3)
    assert backend.health_checks == 0 and gw.call(lambda: gw.app.activation.prober.probes_sent) == 0
    # Once warm, the backend's own listing is relayed.
    backend.start()
    client(gw).chat.completions.create(model="m", messages=MESSAGES)
    assert client(gw).models.list().data[0].owned_by == "fake-backend"
    # Scaled to zero while the gateway still believes it ready: the listing falls back to the local
    # answer without a single demand transition (a brief in-flight count would wake KEDA).
    wait_for(lambda: not gw.broadcaster.current().active, what="idle")
    backend.stop()
    version = gw.broadcaster.version
    assert [m.id for m in client(gw).models.list().data] == ["test-model"]
    assert gw.broadcaster.version == version and not gw.broadcaster.current().active


def test_backend_scaled_to_zero_between_requests_turns_next_request_cold(backend, make_gateway) -> None:
    backend.start()
    gw = make_gateway(backend)
    c = client(gw)
    c.chat.completions.create(model="m", messages=MESSAGES)
    wait_for(lambda: gw.call(lambda: gw.app.activation.ready), what="ready")
    backend.stop()  # the Pod goes away; the gateway still believes it ready (no demand: no probes)
    start_later(backend, 1.0)
    out = c.chat.completions.create(model="m", messages=MESSAGES)  # refused -> held as cold -> served
    assert out.choices[0].message.content == EXPECTED
    assert gw.call(lambda: gw.app.metrics.cold_requests.value) >= 2


def test_metrics_cover_codes_cold_activation_ttfb_and_readiness(backend, make_gateway) -> None:
    gw = make_gateway(backend, max_queue=1)
    start_later(backend, 0.3)
    client(gw).chat.completions.create(model="m", messages=MESSAGES)
    requests.get(gw.url + "/nope", timeout=5)
    text = requests.get(gw.admin_url + "/metrics", timeout=5).text
    assert 'noctaya_gateway_requests_total{code="200"} 1.0' in text
    assert 'noctaya_gateway_requests_total{code="404"} 1.0' in text
    assert "noctaya_gateway_cold_requests_total 1.0" in text
    assert "noctaya_gateway_activation_duration_seconds_count 1.0" in text
    assert "noctaya_gateway_time_to_first_byte_seconds_count 1.0" in text
    assert "noctaya_gateway_backend_ready 1.0" in text
    assert "noctaya_gateway_queue_depth 0.0" in text and "noctaya_gateway_in_flight 0.0" in text
    assert 'noctaya_gateway_rejections_total{reason="queue_full"} 0.0' in text
