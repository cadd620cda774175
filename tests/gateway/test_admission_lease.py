"""Flood, lease and timeout behaviour of cold admission."""

from __future__ import annotations

import http.client
import json
import resource
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from tests.gateway.conftest import wait_for

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
STREAM_BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()


def post(port: int, body: bytes = BODY, timeout: float = 60.0) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def rss_kib() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def queue(gw) -> dict:
    return requests.get(gw.admin_url + "/noctaya/queue", timeout=5).json()


def test_flood_admits_exactly_max_queue_and_serves_them_all_once_ready(backend, make_gateway) -> None:
    max_queue = 10
    gw = make_gateway(backend, max_queue=max_queue, activation_timeout_seconds=60)
    port = gw.port

    def round_trip() -> list[int]:
        with ThreadPoolExecutor(10 * max_queue) as pool:
            futures = [pool.submit(post, port, STREAM_BODY if i % 2 else BODY) for i in range(10 * max_queue)]
            # Everyone beyond maxQueue is refused at once with 429 while the admitted wait.
            wait_for(lambda: sum(f.done() for f in futures) >= 9 * max_queue, timeout=30, what="429s")
            q = queue(gw)
            assert q["queued"] == max_queue and q["inFlight"] == 0
            # KEDA's figure follows within the sampler's interval (the `active` flip at once).
            wait_for(lambda: gw.broadcaster.current().total == max_queue and gw.broadcaster.current().active,
                     timeout=5, what="demand published")
            backend.start()
            results = [f.result(timeout=60) for f in futures]
        codes = [status for status, _, _ in results]
        assert codes.count(429) == 9 * max_queue and codes.count(200) == max_queue
        for status, headers, body in results:
            if status == 429:
                assert headers["Retry-After"] == "5" and json.loads(body)["error"]["code"] == "queue_full"
            else:
                assert b"tok4" in body
        return codes

    before = rss_kib()
    round_trip()
    assert len(backend.requests_to("/v1/chat/completions")) == max_queue  # each admitted request exactly once
    # Second flood after the backend went away again: no leak across rounds.
    backend.stop()
    wait_for(lambda: not gw.broadcaster.current().active, timeout=30, what="lease over")
    gw.call(lambda: gw.app.activation.backend_unreachable())
    middle = rss_kib()
    round_trip()
    after = rss_kib()
    assert after - middle < 32 * 1024, f"RSS grew {after - middle} KiB in one flood round (started {before})"
    assert queue(gw)["queued"] == 0


def test_waiters_disconnecting_do_not_end_demand(backend, make_gateway) -> None:
    gw = make_gateway(backend, activation_timeout_seconds=30)
    socks = []
    for body in (BODY, STREAM_BODY):
        s = socket.create_connection(("127.0.0.1", gw.port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        socks.append(s)
    wait_for(lambda: queue(gw)["queued"] == 2, what="two waiters")
    for s in socks:
        s.close()
    # Slots are given back once the gateway notices the clients left...
    wait_for(lambda: queue(gw)["queued"] == 0, timeout=15, what="slots released")
    # ...but the activation lease keeps the backend wanted.
    demand = gw.broadcaster.current()
    assert demand.lease_active and demand.active
    q = queue(gw)
    assert q["lease"]["state"] == "activating" and q["lease"]["remainingSeconds"] > 20
    time.sleep(0.5)
    assert gw.broadcaster.current().active
    backend.start()
    wait_for(lambda: queue(gw)["backendReady"], what="ready")
    assert backend.requests_to("/v1/chat/completions") == []  # nobody left to forward for


def test_backend_never_ready_times_out_every_waiter_then_new_lease(backend, make_gateway) -> None:
    backend.ready = False
    backend.start()  # listening, but the model never finishes loading
    gw = make_gateway(backend, activation_timeout_seconds=1.5, max_queue=4)
    c = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=30)
    errors: list[BaseException] = []

    def streamed() -> None:
        try:
            for _ in c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], stream=True):
                pass
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=streamed) for _ in range(2)]
    for t in threads:
        t.start()
    with ThreadPoolExecutor(2) as pool:
        plain = [pool.submit(post, gw.port) for _ in range(2)]
        results = [f.result(timeout=30) for f in plain]
    for t in threads:
        t.join(30)
    for status, _, body in results:
        assert status == 504 and json.loads(body)["error"]["type"] == "activation_timeout"
    assert len(errors) == 2
    for exc in errors:
        assert isinstance(exc, openai.APIError) and "did not become ready" in str(exc)
    # The lease expired instead of signalling forever.
    wait_for(lambda: not gw.broadcaster.current().active, timeout=10, what="demand inactive after timeout")
    assert backend.requests_to("/v1/chat/completions") == []
    generation = gw.call(lambda: gw.app.activation.lease.generation)
    # A later cold request starts a new lease, and is served once the backend is ready.
    backend.ready = True
    status, _, body = post(gw.port)
    assert status == 200 and b"tok4" in body
    assert gw.call(lambda: gw.app.activation.lease.generation) == generation + 1


def test_probing_is_shared_and_stops_when_idle(backend, make_gateway) -> None:
    backend.ready = False
    backend.start()
    gw = make_gateway(backend, activation_timeout_seconds=1.0, max_queue=50)
    with ThreadPoolExecutor(50) as pool:
        futures = [pool.submit(post, gw.port) for _ in range(50)]
        time.sleep(0.5)
        checks = backend.health_checks
        assert [f.result(timeout=30)[0] for f in futures] == [504] * 50
    # One prober at <= 50 ms cadence (test config), not one probe per waiting request.
    assert checks <= 0.5 / 0.05 + 3
    wait_for(lambda: not gw.broadcaster.current().active, what="idle")
    time.sleep(0.2)
    settled = backend.health_checks
    time.sleep(0.5)
    assert backend.health_checks == settled  # idle gateway: no probe traffic


@pytest.mark.parametrize("mode", ["keepalive", "reject"])
def test_cold_requests_publish_demand_at_once(backend, make_gateway, mode) -> None:
    gw = make_gateway(backend, cold_mode=mode)
    version = gw.broadcaster.version
    t = threading.Thread(target=post, args=(gw.port,), daemon=True)
    t.start()
    version, demand = gw.broadcaster.wait_for_change(version, 10)
    assert demand.active  # the very first transition (the admission) is already active demand
    deadline = time.monotonic() + 10
    while not demand.lease_active and time.monotonic() < deadline:
        version, demand = gw.broadcaster.wait_for_change(version, 1)
    assert demand.lease_active
    backend.start()
    t.join(30)


def test_bodies_held_while_cold_are_bounded_in_bytes(backend, make_gateway) -> None:
    gw = make_gateway(backend, max_queue=50, max_body_bytes=64 * 1024, max_held_body_bytes=256 * 1024)
    big = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 60_000}]}).encode()
    with ThreadPoolExecutor(10) as pool:
        futures = [pool.submit(post, gw.port, big) for _ in range(10)]
        # 256 KiB holds four ~60 KB bodies; the rest are refused at once, before being read.
        wait_for(lambda: sum(f.done() for f in futures) >= 6, timeout=30, what="byte-budget 429s")
        assert queue(gw)["queued"] == 4
        backend.start()
        results = [f.result(timeout=60) for f in futures]
    codes = sorted(status for status, _, _ in results)
    assert codes == [200] * 4 + [429] * 6
    refused = [json.loads(body) for status, _, body in results if status == 429]
    assert all(doc["error"]["code"] == "queue_full" for doc in refused)
    text = requests.get(gw.admin_url + "/metrics", timeout=5).text
    assert 'noctaya_gateway_rejections_total{reason="queue_bytes_full"} 6.0' in text


def test_slow_chunked_uploads_hold_only_what_they_sent(backend, make_gateway) -> None:
    """A chunked upload counts its bytes as they arrive, not the whole body limit, as upload bytes
    (never held bytes), and takes no slot and makes no demand before it is complete: two slow
    uploaders cannot make other cold requests 429, nor wake the model."""
    gw = make_gateway(backend, max_queue=10, max_body_bytes=64 * 1024, max_held_body_bytes=128 * 1024)
    slow = []
    try:
        for _ in range(2):
            sock = socket.create_connection(("127.0.0.1", gw.port), timeout=10)
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n")
            slow.append(sock)
        wait_for(lambda: queue(gw)["uploadBytes"] == 10, timeout=10, what="two slow uploads reading (5 bytes each)")
        state = queue(gw)
        assert state["heldBytes"] == 0 and state["queued"] == 0 and not state["demand"]["active"] and state["lease"]["state"] == "idle"
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(post, gw.port, BODY)
            wait_for(lambda: queue(gw)["queued"] == 1, timeout=10, what="a normal cold request held, not refused")
            backend.start()
            status, _, _ = fut.result(timeout=30)
        assert status == 200
    finally:
        for sock in slow:
            sock.close()


def test_a_chunked_upload_beyond_the_upload_budget_is_refused(backend, make_gateway) -> None:
    # The worker's upload bound defaults to the held budget's size (16 KiB here).
    gw = make_gateway(backend, max_queue=10, max_body_bytes=256 * 1024, max_held_body_bytes=16 * 1024)
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
        chunk = b"x" * 8192
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            for _ in range(9):  # 72 KiB: one full 64 KiB read, far beyond the 16 KiB budget
                sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        except OSError:
            pass  # the gateway may close as soon as it refuses
        reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 429") and b"upload_bytes_full" in reply, reply[:300]
    state = queue(gw)
    assert state["queued"] == 0 and state["uploadBytes"] == 0 and state["heldBytes"] == 0


def test_a_failing_demand_sink_never_fails_client_requests(backend, make_gateway) -> None:
    from scaler.demand import DemandBroadcaster

    class Broken(DemandBroadcaster):
        def publish(self, demand):  # type: ignore[override]
            super().publish(demand)
            raise RuntimeError("sink failed after storing")

    gw = make_gateway(backend, broadcaster=Broken())
    backend.start()
    status, _, body = post(gw.port)
    assert status == 200 and b"tok4" in body
    wait_for(lambda: gw.broadcaster.current().active, what="the value itself was stored")
