"""gateway.backends through a real gateway: requests balanced over backend Pods (real HTTP servers on
their own loopback addresses), the Pods' list fed as the EndpointSlice watch feeds it
(``Backends.endpoints``; the watch itself: tests/gateway/test_endpointslices.py)."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests

from gateway.state.endpoints import PodEndpoint
from tests.gateway.conftest import wait_for
from tests.gateway.fakebackend import FakeBackend
from tests.gateway.harness import ThreadedGateway
from tests.ports import free_port

ADDRESSES = ("127.0.41.1", "127.0.41.2", "127.0.41.3")


@pytest.fixture
def port() -> int:
    return free_port("127.0.41.1")


@pytest.fixture
def pods(port: int) -> Iterator[list[FakeBackend]]:
    backends = [FakeBackend(port=port, host=address) for address in ADDRESSES]
    yield backends
    for b in backends:
        b.stop()


def endpoint(index: int, port: int, *, ready: bool = True, terminating: bool = False) -> PodEndpoint:
    return PodEndpoint(f"llm-backend-{index}", ADDRESSES[index], port, ready, ready, terminating)


@pytest.fixture
def gateway(make_gateway: Callable[..., ThreadedGateway], port: int) -> Callable[..., ThreadedGateway]:
    def make(**overrides: Any) -> ThreadedGateway:
        unused = FakeBackend(port=free_port())  # the Service address: never started, never used with Pods listed
        settings = {"max_queue": 64, "activation_timeout_seconds": 20.0, **overrides}
        return make_gateway(unused, **settings)
    return make


def feed(gw: ThreadedGateway, *endpoints: PodEndpoint) -> None:
    gw.call(lambda: gw.app.backends.endpoints(tuple(endpoints)))


def chat(gw: ThreadedGateway, client: requests.Session, **extra: Any) -> requests.Response:
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], **extra}
    return client.post(f"{gw.url}/v1/chat/completions", json=body, timeout=30)


def served(pods: list[FakeBackend]) -> list[int]:
    return [len(b.requests_to("/v1/chat/completions")) for b in pods]


def load(gw: ThreadedGateway, clients: int, per_client: int, **extra: Any) -> list[int]:
    codes: list[int] = []
    lock = threading.Lock()

    def run() -> None:
        with requests.Session() as client:
            for _ in range(per_client):
                code = chat(gw, client, **extra).status_code
                with lock:
                    codes.append(code)

    threads = [threading.Thread(target=run) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return codes


def test_steady_load_spreads_over_every_ready_pod(gateway: Callable[..., ThreadedGateway], pods: list[FakeBackend],
                                                  port: int) -> None:
    for b in pods:
        b.response_delay = 0.02
        b.start()
    gw = gateway(prefix_affinity=False)
    feed(gw, *(endpoint(i, port) for i in range(3)))
    codes = load(gw, clients=12, per_client=10)
    assert codes == [200] * 120
    shares = served(pods)
    assert sum(shares) == 120 and min(shares) >= 120 * 0.25, shares


def test_scale_out_new_pods_get_their_share_at_once(gateway: Callable[..., ThreadedGateway],
                                                    pods: list[FakeBackend], port: int) -> None:
    """1 -> 3 under steady load: the new Pods are listed not ready; the gateway probes them itself and
    they take requests before any slice calls them ready."""
    for b in pods:
        b.response_delay = 0.02
        b.start()
    gw = gateway(prefix_affinity=False)
    feed(gw, endpoint(0, port))
    stop = threading.Event()
    codes: list[int] = []

    def steady() -> None:
        with requests.Session() as client:
            while not stop.is_set():
                codes.append(chat(gw, client).status_code)

    clients = [threading.Thread(target=steady) for _ in range(12)]
    for t in clients:
        t.start()
    wait_for(lambda: len(codes) >= 30, what="load on one Pod")
    feed(gw, endpoint(0, port), endpoint(1, port, ready=False), endpoint(2, port, ready=False))
    wait_for(lambda: gw.call(lambda: len(gw.app.backends.pods.eligible)) == 3, what="the new Pods probed ready")
    before = served(pods)
    wait_for(lambda: sum(served(pods)) - sum(before) >= 150, what="150 more requests")
    stop.set()
    for t in clients:
        t.join(30)
    after = [a - b for a, b in zip(served(pods), before, strict=True)]
    assert set(codes) == {200}
    assert min(after) >= sum(after) * 0.25, after
    queue = requests.get(f"{gw.admin_url}/noctaya/queue").json()["backend"]
    assert queue["source"] == "endpointslices" and {p["state"] for p in queue["pods"]} == {"eligible"}


def stream(gw: ThreadedGateway, results: list[tuple[int, str]], lock: threading.Lock) -> None:
    with requests.post(f"{gw.url}/v1/chat/completions", timeout=60, stream=True,
                       json={"model": "test-model", "stream": True, "messages": [{"role": "user", "content": "x"}]}) as r:
        text = r.text
    with lock:
        results.append((r.status_code, text))


def test_a_cold_burst_spreads_over_pods_turning_ready_at_different_times(
        gateway: Callable[..., ThreadedGateway], pods: list[FakeBackend], port: int) -> None:
    gw = gateway(pod_batch=8, prefix_affinity=False)
    feed(gw)  # no Pod: cold
    results: list[tuple[int, str]] = []
    lock = threading.Lock()
    threads = [threading.Thread(target=stream, args=(gw, results, lock)) for _ in range(30)]
    for t in threads:
        t.start()
    wait_for(lambda: gw.call(lambda: gw.app.waiting) == 30, what="30 held")
    for b in pods:
        b.stream_delay = 0.1  # each stream lasts ~0.5 s: Pods are busy while the next turn ready
    feed(gw, *(endpoint(i, port, ready=False) for i in range(3)))  # scheduled, loading
    for b in pods:  # engines answer one after another, the slice still says not ready
        b.start()
        time.sleep(0.3)
    for t in threads:
        t.join(60)
    assert len(results) == 30 and all(code == 200 and "[DONE]" in text for code, text in results)
    shares = served(pods)
    assert sum(shares) == 30, shares  # none lost, none served twice
    assert min(shares) >= 6, shares


def test_the_batch_is_off_when_no_other_pod_is_starting(gateway: Callable[..., ThreadedGateway],
                                                        pods: list[FakeBackend], port: int) -> None:
    gw = gateway(pod_batch=2, prefix_affinity=False)
    feed(gw)
    results: list[tuple[int, str]] = []
    lock = threading.Lock()
    pods[0].stream_delay = 0.05
    threads = [threading.Thread(target=stream, args=(gw, results, lock)) for _ in range(6)]
    for t in threads:
        t.start()
    wait_for(lambda: gw.call(lambda: gw.app.waiting) == 6, what="6 held")
    pods[0].start()
    feed(gw, endpoint(0, port, ready=False))
    wait_for(lambda: pods[0].in_flight == 6, what="all six on the only Pod at once")
    for t in threads:
        t.join(60)
    assert [code for code, _ in results] == [200] * 6


def test_prefix_affinity_keeps_a_conversation_on_one_pod_and_spreads_keys(
        gateway: Callable[..., ThreadedGateway], pods: list[FakeBackend], port: int) -> None:
    for b in pods:
        b.start()
    gw = gateway()
    feed(gw, *(endpoint(i, port) for i in range(3)))
    with requests.Session() as client:
        for _ in range(6):
            assert chat(gw, client, prompt_cache_key="conversation-a").status_code == 200
        homes = [i for i, n in enumerate(served(pods)) if n]
        assert len(homes) == 1 and served(pods)[homes[0]] == 6
        for n in range(60):
            assert chat(gw, client, prompt_cache_key=f"user-{n}").status_code == 200
    assert min(served(pods)) >= 8, served(pods)  # keys spread over the ring
    metrics = requests.get(f"{gw.admin_url}/metrics").text
    assert 'noctaya_gateway_affinity_requests_total{outcome="hit"} 66.0' in metrics


def test_affinity_off_spreads_one_conversation(gateway: Callable[..., ThreadedGateway], pods: list[FakeBackend],
                                               port: int) -> None:
    for b in pods:
        b.start()
    gw = gateway(prefix_affinity=False)
    feed(gw, *(endpoint(i, port) for i in range(3)))
    with requests.Session() as client:
        for _ in range(9):
            assert chat(gw, client, prompt_cache_key="conversation-a").status_code == 200
    assert served(pods) == [3, 3, 3]


def test_a_hot_prefix_spills_within_the_load_bound(gateway: Callable[..., ThreadedGateway],
                                                   pods: list[FakeBackend], port: int) -> None:
    for b in pods:
        b.response_delay = 0.2
        b.start()
    gw = gateway(affinity_load_factor=1.25)
    feed(gw, *(endpoint(i, port) for i in range(3)))
    peak = [0, 0, 0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for i, b in enumerate(pods):
                peak[i] = max(peak[i], b.in_flight)
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    codes = load(gw, clients=12, per_client=2, prompt_cache_key="one-hot-key")
    stop.set()
    watcher.join()
    assert codes == [200] * 24
    assert max(peak) <= 5, peak  # ceil(1.25 * 12 / 3): the hot key's home never holds all twelve
    assert min(served(pods)) > 0


def test_a_terminating_pod_gets_no_new_request_and_finishes_its_stream(
        gateway: Callable[..., ThreadedGateway], pods: list[FakeBackend], port: int) -> None:
    for b in pods[:2]:
        b.start()
    pods[0].stream_delay = 0.2
    gw = gateway(prefix_affinity=False)
    feed(gw, endpoint(0, port))
    results: list[tuple[int, str]] = []
    lock = threading.Lock()
    held = threading.Thread(target=stream, args=(gw, results, lock))
    held.start()
    wait_for(lambda: pods[0].in_flight == 1, what="a stream on Pod 0")
    feed(gw, endpoint(0, port, ready=False, terminating=True), endpoint(1, port))
    with requests.Session() as client:
        for _ in range(5):
            assert chat(gw, client).status_code == 200
    held.join(30)
    assert results and results[0][0] == 200 and "[DONE]" in results[0][1]
    assert served(pods)[0] == 1 and served(pods)[1] == 5


def test_a_pod_that_refuses_is_passed_over_without_an_error(gateway: Callable[..., ThreadedGateway],
                                                            pods: list[FakeBackend], port: int) -> None:
    pods[1].start()  # Pod 0 is listed ready, but nothing listens there (its engine just died)
    gw = gateway(prefix_affinity=False)
    feed(gw, endpoint(0, port), endpoint(1, port))
    with requests.Session() as client:
        assert [chat(gw, client).status_code for _ in range(6)] == [200] * 6
    assert served(pods)[1] == 6
    states = {p["name"]: p["state"] for p in requests.get(f"{gw.admin_url}/noctaya/queue").json()["backend"]["pods"]}
    assert states == {"llm-backend-0": "excluded", "llm-backend-1": "eligible"}


def test_pod_series_follow_the_listed_pods(gateway: Callable[..., ThreadedGateway], pods: list[FakeBackend],
                                           port: int) -> None:
    for b in pods:
        b.start()
    gw = gateway(prefix_affinity=False)
    feed(gw, *(endpoint(i, port) for i in range(3)))
    assert load(gw, clients=3, per_client=2) == [200] * 6
    text = requests.get(f"{gw.admin_url}/metrics").text
    for i, count in enumerate(served(pods)):
        assert f'noctaya_gateway_backend_pod_requests_total{{pod="llm-backend-{i}"}} {float(count)}' in text
        assert f'noctaya_gateway_backend_pod_outstanding_requests{{pod="llm-backend-{i}"}} 0.0' in text
    feed(gw, endpoint(0, port), endpoint(1, port))
    text = requests.get(f"{gw.admin_url}/metrics").text
    assert 'pod="llm-backend-2"' not in text and 'pod="llm-backend-1"' in text


def test_without_pods_the_service_connections_age_out(make_gateway: Callable[..., ThreadedGateway],
                                                      backend: FakeBackend) -> None:
    """Behind a Service address a pooled connection lives at most its age, so kube-proxy's choice per
    connection reaches new Pods; within the age it is reused."""
    backend.start()
    gw = make_gateway(backend, upstream_max_connection_age_seconds=0.3)
    with requests.Session() as client:
        for _ in range(5):
            assert client.post(f"{gw.url}/v1/chat/completions", json={"model": "m", "messages": []},
                               timeout=10).status_code == 200
        reused = gw.call(lambda: gw.app.pool.opened)
        time.sleep(0.4)
        assert client.post(f"{gw.url}/v1/chat/completions", json={"model": "m", "messages": []},
                           timeout=10).status_code == 200
    assert reused == 1 and gw.call(lambda: gw.app.pool.opened) == 2


def test_a_pod_answering_before_the_kubelet_gets_the_held_request(gateway: Callable[..., ThreadedGateway],
                                                                  pods: list[FakeBackend], port: int,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The slice says not ready (the kubelet's next probe and the endpoints' update are seconds away);
    the engine answers its readiness path: the held request goes now, and the lead is recorded once
    the slice catches up."""
    caplog.set_level(logging.INFO, logger="noctaya.gateway")
    gw = gateway()
    feed(gw, endpoint(0, port, ready=False))
    results: list[tuple[int, str]] = []
    lock = threading.Lock()
    held = threading.Thread(target=stream, args=(gw, results, lock))
    held.start()
    wait_for(lambda: gw.call(lambda: gw.app.waiting) == 1, what="held")
    pods[0].start()
    held.join(30)
    assert results[0][0] == 200 and served(pods) == [1, 0, 0]
    assert gw.call(lambda: gw.app.backends.pods.by_name["llm-backend-0"].endpoint.ready) is False
    feed(gw, endpoint(0, port))
    text = requests.get(f"{gw.admin_url}/metrics").text
    assert "noctaya_gateway_backend_pod_ready_lead_seconds_count 1.0" in text
    records = {r.getMessage(): r for r in caplog.records}
    assert records["cold start served"].pod == "llm-backend-0"  # which Pod served the activation
    assert records["backend pod ready"].served_before_kubelet == 1


def test_queue_page_without_a_source(make_gateway: Callable[..., ThreadedGateway], backend: FakeBackend) -> None:
    backend.start()
    gw = make_gateway(backend)
    assert json.loads(requests.get(f"{gw.admin_url}/noctaya/queue").text)["backend"]["source"] == "service"
