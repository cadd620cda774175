"""The admin plane is not starved by the data plane: a real `python -m gateway` (one worker, which also
serves KEDA's scaler) gets 8 MiB hostile JSON bodies from several connections at line rate for a cold
model, while the kubelet's probe (/healthz on the admin port) and KEDA's IsActive are timed. Each
must answer within the kubelet's default timeout, 1 s.

The body is the issue's: 8 MiB of 62-deep brackets with a wrong closer at the end. The regular
expression that checked bodies before (bench.jsonscan_regex_baseline) held the only loop ~2 s per
body; gateway.jsonscan now scans in steps of 256 KiB and the gateway yields to its hub between them.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from scaler import externalscaler_pb2_grpc as pb_grpc
from tests.gateway.abuse_harness import GatewayPod, MiB, exchange, get, model_name, request_bytes, wait_until
from tests.gateway.fakebackend import FakeBackend

pytestmark = pytest.mark.timeout(60)

KUBELET_TIMEOUT = 1.0
CLIENTS = 4
FLOOD_SECONDS = 6.0


def hostile_body(size: int = 8 * MiB) -> bytes:
    """Valid up to its last byte: a '}' where a ']' belongs. Names the rendered model."""
    head = b'{"model":"%s","stream":true,"x":[' % model_name().encode()
    chain = b"[" * 61 + b"]" * 61 + b","
    filler = chain * ((size - len(head) - 2) // len(chain))
    body = head + filler + b"1"
    return body + b"}" * (size - len(body))


def test_hostile_json_floods_cannot_delay_probes_or_the_scaler() -> None:
    backend = FakeBackend()  # not started: the model is cold, so every body is scanned before it waits
    pod = GatewayPod(backend.port, NOCTAYA_GATEWAY_WORKERS="1", NOCTAYA_SCALER_MODE="local",
                     NOCTAYA_CLIENT_REQUEST_TIMEOUT_SECONDS="60")
    raw = request_bytes("POST", "/v1/chat/completions", hostile_body())
    stop = threading.Event()
    answers: list[int] = []

    def flood(i: int) -> None:
        while not stop.is_set():
            response = exchange(pod.port, raw, source=f"127.0.2.{1 + i}", timeout=60)
            answers.append(response.status if response is not None else 0)

    channel = grpc.insecure_channel(f"127.0.0.1:{pod.scaler_port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=20)
        stub = pb_grpc.ExternalScalerStub(channel)
        threads = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        wait_until(lambda: len(answers) >= CLIENTS, 30, "the first hostile bodies answered")
        probes: list[float] = []
        scaler: list[float] = []
        deadline = time.monotonic() + FLOOD_SECONDS
        while time.monotonic() < deadline:
            started = time.monotonic()
            assert get(pod.admin_port, "/healthz", timeout=10).status == 200
            probes.append(time.monotonic() - started)
            started = time.monotonic()
            stub.IsActive(pod.ref, timeout=10)
            scaler.append(time.monotonic() - started)
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(30)
        # The flood was real: bodies scanned (and refused) throughout, none woke the model.
        assert len(answers) >= 2 * CLIENTS and set(answers) == {400}, answers
        print(f"\n{len(answers)} hostile bodies answered; /healthz slowest {max(probes) * 1000:.0f} ms, median "
              f"{sorted(probes)[len(probes) // 2] * 1000:.0f} ms ({len(probes)}); IsActive slowest "
              f"{max(scaler) * 1000:.0f} ms, median {sorted(scaler)[len(scaler) // 2] * 1000:.0f} ms")
        assert max(probes) < KUBELET_TIMEOUT, (max(probes), sorted(probes)[-5:])
        assert max(scaler) < KUBELET_TIMEOUT, (max(scaler), sorted(scaler)[-5:])
    finally:
        stop.set()
        channel.close()
        logs = pod.stop()
    assert "Traceback" not in logs
