"""The gateway's half of a cold start, timed: a staged activation through `python -m gateway` (its
scaler child pushing to a real StreamIsActive stream), a backend that comes up a known delay after
the push and answers its first byte a known delay later, and the real `openai` client measuring the
time to first token it saw. Each histogram must hold exactly that activation's intervals."""

from __future__ import annotations

import queue
import re
import threading
import time

import openai
import pytest
import requests

from gateway.activation import Activation
from gateway.metrics import GatewayMetrics
from gateway.state.pod import PodState
from gateway.state.readiness import ProbeResult
from scaler import externalscaler_pb2_grpc as pb_grpc
from tests.gateway.conftest import wait_for
from tests.gateway.fakebackend import FakeBackend
from tests.gateway.test_process import GatewayProcess, read_stream

READY_AFTER_PUSH = 1.5  # the backend listens this long after KEDA was told `true`
FIRST_BYTE_AFTER_READY = 1.0  # and then takes this long to its first byte
SLACK = 0.6  # probing every 50 ms, process scheduling on a loaded 2-core CI machine


def scrape(gw: GatewayProcess) -> dict[str, float]:
    out = {}
    for line in requests.get(gw.admin_url + "/metrics", timeout=5).text.splitlines():
        m = re.match(r"^(noctaya_gateway_(?:activation_phase|time_to_first_token)_seconds_(?:sum|count))\{(\w+)=\"(\w+)\"\} (\S+)$", line)
        if m:
            out[f"{m[1]}[{m[3]}]"] = float(m[4])
    return out


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "held"])
def test_each_phase_of_a_staged_cold_start_is_observed_once_with_its_interval(
        backend: FakeBackend, channel_factory, stream: bool) -> None:
    backend.first_byte_delay = FIRST_BYTE_AFTER_READY
    gw = GatewayProcess(backend, NOCTAYA_ACTIVATION_TIMEOUT_SECONDS="60", NOCTAYA_HEARTBEAT_SECONDS="0.3")
    try:
        stub = pb_grpc.ExternalScalerStub(channel_factory(gw.scaler_port))
        pushes: queue.Queue = queue.Queue()
        read_stream(stub, pushes)
        assert pushes.get(timeout=10)[1] is False
        marks: dict[str, float] = {}

        def keda_and_kubernetes() -> None:  # KEDA hears `true`; the backend is Ready a known delay later
            at, value = pushes.get(timeout=30)
            assert value is True
            marks["pushed"] = at
            time.sleep(READY_AFTER_PUSH)
            backend.start()
            marks["ready"] = time.monotonic()

        waker = threading.Thread(target=keda_and_kubernetes, daemon=True)
        waker.start()
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        sent = time.monotonic()
        if stream:
            chunks = client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}],
                                                    stream=True)
            first = next(iter(chunks))
            client_ttft = time.monotonic() - sent
            assert first.choices[0].delta.content.startswith("tok0")
            for _ in chunks:
                pass
        else:
            answer = client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}])
            client_ttft = time.monotonic() - sent
            assert answer.choices[0].message.content.startswith("tok0")
        waker.join(5)
        m = wait_for(lambda: (lambda s: s if s.get("noctaya_gateway_time_to_first_token_seconds_count[cold]") else None)(scrape(gw)),
                     timeout=10, what="the cold answer observed")
        for phase in ("admission_to_push", "push_to_ready", "ready_to_first_byte"):
            assert m[f"noctaya_gateway_activation_phase_seconds_count[{phase}]"] == 1, (phase, m)
        admission_to_push = m["noctaya_gateway_activation_phase_seconds_sum[admission_to_push]"]
        push_to_ready = m["noctaya_gateway_activation_phase_seconds_sum[push_to_ready]"]
        ready_to_first_byte = m["noctaya_gateway_activation_phase_seconds_sum[ready_to_first_byte]"]
        assert 0 <= admission_to_push <= marks["pushed"] - sent + 0.05, m
        assert READY_AFTER_PUSH <= push_to_ready <= READY_AFTER_PUSH + SLACK, m
        assert FIRST_BYTE_AFTER_READY <= ready_to_first_byte <= FIRST_BYTE_AFTER_READY + SLACK, m
        gateway_ttft = m["noctaya_gateway_time_to_first_token_seconds_sum[cold]"]
        phases = admission_to_push + push_to_ready + ready_to_first_byte
        assert phases - 0.05 <= gateway_ttft <= phases + SLACK, m  # the phases add up to what the client waited
        assert gateway_ttft <= client_ttft <= gateway_ttft + SLACK, (client_ttft, m)
        assert m.get("noctaya_gateway_time_to_first_token_seconds_count[warm]", 0) == 0

        # Warm now: its time to first token is the backend's first-byte delay, and no phase moves.
        backend.first_byte_delay = 0.2
        client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}])
        # /metrics is served from the control thread: the observation may land a moment after the answer.
        after = wait_for(lambda: (a := scrape(gw)).get("noctaya_gateway_time_to_first_token_seconds_count[warm]") == 1
                         and a, 10, 0.02, "the warm observation")
        assert 0.2 <= after["noctaya_gateway_time_to_first_token_seconds_sum[warm]"] <= 0.2 + SLACK
        for phase in ("admission_to_push", "push_to_ready", "ready_to_first_byte"):
            assert after[f"noctaya_gateway_activation_phase_seconds_count[{phase}]"] == 1
    finally:
        gw.stop()


def test_one_activation_is_timed_once_however_many_workers_admit_cold_requests() -> None:
    now = [100.0]
    pod = PodState(3, 30, None)
    workers = [Activation(max_queue=30, activation_timeout=60, ready_grace=1, metrics=GatewayMetrics(pod, i),
                          probe=lambda: ProbeResult.REFUSED, probe_interval=0.05, clock=lambda: now[0])
               for i in range(3)]
    for worker in workers:
        worker.cold_admission()
    now[0] = 100.5
    pod.mark_pushed(100.5)
    now[0] = 103.0
    for worker in workers:
        worker.report_probe(ProbeResult.READY)
    now[0] = 103.25
    for worker in workers:
        worker.first_byte_forwarded(now[0])
    text = workers[0].metrics.render().decode()
    assert 'noctaya_gateway_activation_phase_seconds_count{phase="admission_to_push"} 1.0' in text
    assert 'noctaya_gateway_activation_phase_seconds_sum{phase="admission_to_push"} 0.5' in text
    assert 'noctaya_gateway_activation_phase_seconds_sum{phase="push_to_ready"} 2.5' in text
    assert 'noctaya_gateway_activation_phase_seconds_sum{phase="ready_to_first_byte"} 0.25' in text
    # The next activation (after the leases ended) is timed again, by whichever worker comes first.
    now[0] = 200.0
    for worker in workers:
        worker.report_probe(ProbeResult.REFUSED)
        worker.tick()
    workers[2].cold_admission()
    workers[0].cold_admission()
    now[0] = 201.0
    for worker in workers:
        worker.report_probe(ProbeResult.READY)
    assert 'noctaya_gateway_activation_phase_seconds_count{phase="admission_to_push"} 1.0' in workers[1].metrics.render().decode()
    assert 'noctaya_gateway_activation_phase_seconds_count{phase="push_to_ready"} 1.0' in workers[1].metrics.render().decode()


def test_a_worker_that_died_holding_the_claim_does_not_stop_timing_for_good() -> None:
    pod = PodState(2, 10, None)
    assert pod.claim_activation(10.0, stale_after=30.0)  # worker 0 claims, then dies
    assert not pod.claim_activation(20.0, stale_after=30.0)
    assert pod.claim_activation(41.0, stale_after=30.0)


def test_an_activation_is_timed_from_the_request_even_when_its_body_comes_late(
        backend: FakeBackend, channel_factory) -> None:
    # Demand is made only once the body is complete (a trickled request must not wake a model), yet
    # the activation is timed from the request's first byte: the client waited for its upload too.
    import socket

    gw = GatewayProcess(backend, NOCTAYA_ACTIVATION_TIMEOUT_SECONDS="60")
    try:
        stub = pb_grpc.ExternalScalerStub(channel_factory(gw.scaler_port))
        pushes: queue.Queue = queue.Queue()
        read_stream(stub, pushes)
        assert pushes.get(timeout=10)[1] is False
        body = b'{"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}'
        with socket.create_connection(("127.0.0.1", gw.port), timeout=30) as sock:
            sent = time.monotonic()
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body))
            with pytest.raises(queue.Empty):
                pushes.get(timeout=0.8)  # the head alone makes no demand
            sock.sendall(body)
            at, value = pushes.get(timeout=10)
            assert value is True and at - sent >= 0.8
            backend.start()
            answer = sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        m = wait_for(lambda: (lambda s: s if s.get("noctaya_gateway_activation_phase_seconds_count[push_to_ready]") else None)(scrape(gw)),
                     timeout=10, what="the activation observed")
        assert m["noctaya_gateway_activation_phase_seconds_count[admission_to_push]"] == 1, m
        assert 0.75 <= m["noctaya_gateway_activation_phase_seconds_sum[admission_to_push]"] <= at - sent + 0.05, m
    finally:
        gw.stop()
