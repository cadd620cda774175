"""gateway.endpointslices: parsing slices, and the list-then-watch against an API that fails in every
way the gateway must survive (tests/gateway/fakekube.py). The real kube-apiserver, with the
rendered Role: tests/kube/test_gateway_endpoints.py."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from gateway.endpointslices import (
    MAX_EVENT_BYTES,
    InClusterCredentials,
    NotInCluster,
    SliceWatch,
    endpoints_of,
    parse_slice,
    service_of,
)
from gateway.state.endpoints import PodEndpoint
from tests.gateway.conftest import wait_for
from tests.gateway.fakebackend import FakeBackend
from tests.gateway.fakekube import FakeKube, slice_object
from tests.gateway.harness import ThreadedGateway
from tests.ports import free_port


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[FakeKube]:
    k = FakeKube(tmp_path)
    yield k
    k.stop()


def test_service_of() -> None:
    assert service_of("llm-backend.models.svc.cluster.local", "models") == "llm-backend"
    assert service_of("llm-backend.models.svc", "models") == "llm-backend"
    assert service_of("llm-backend.models", "models") == "llm-backend"
    assert service_of("llm-backend", "models") == "llm-backend"
    assert service_of("llm-backend.other.svc", "models") is None  # another namespace: not ours to read
    assert service_of("10.0.0.4", "models") is None
    assert service_of("llm-backend.models.example.com", "models") is None


def test_parse_slice_reads_conditions_as_the_api_defines_them() -> None:
    obj = slice_object("s1", "svc", [("a", "10.0.0.1", True)])
    obj["endpoints"].append({"addresses": ["10.0.0.2"]})  # no conditions, no targetRef: ready, named by address
    obj["endpoints"].append({"addresses": []})  # refused
    obj["endpoints"].append({"addresses": ["10.0.0.3"], "conditions": {"ready": False, "terminating": True}})
    parsed = parse_slice(obj)
    assert parsed is not None and parsed.service == "svc" and parsed.ports == (("http", 8000),)
    assert parsed.endpoints == (("a", "10.0.0.1", True, True, False), ("10.0.0.2", "10.0.0.2", True, True, False),
                                ("10.0.0.3", "10.0.0.3", False, False, True))
    assert parse_slice({**obj, "addressType": "FQDN"}) is None
    assert parse_slice({**obj, "metadata": {"name": "x"}}) is None  # no service label
    assert parse_slice("junk") is None


def test_endpoints_over_slices_pick_the_named_port() -> None:
    one = parse_slice(slice_object("s1", "svc", [("a", "10.0.0.1", True)]))
    two = slice_object("s2", "svc", [("a", "10.0.0.1", False), ("b", "10.0.0.2", True)], port=9000)
    two["ports"] = [{"name": "metrics", "port": 9100}, {"name": "http", "port": 9000}]
    parsed = [one, parse_slice(two)]
    assert endpoints_of(parsed, "http") == (PodEndpoint("a", "10.0.0.1", 9000, False, False, False),
                                            PodEndpoint("b", "10.0.0.2", 9000, True, True, False))


def test_credentials(tmp_path: Path) -> None:
    with pytest.raises(NotInCluster, match="KUBERNETES_SERVICE_HOST"):
        InClusterCredentials.from_env({}, str(tmp_path))
    with pytest.raises(NotInCluster, match="token"):
        InClusterCredentials.from_env({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, str(tmp_path))


class Recorder:
    def __init__(self) -> None:
        self.seen: list[dict | None] = []

    def __call__(self, slices: dict | None) -> None:
        self.seen.append(None if slices is None else {k: v.endpoints for k, v in slices.items()})


def watch(kube: FakeKube, **kwargs: float) -> tuple[SliceWatch, Recorder]:
    recorder = Recorder()
    creds = InClusterCredentials.from_env(kube.environ, str(kube.account))
    return SliceWatch(creds, recorder, label_selector="kubernetes.io/service-name=svc", **kwargs).start(), recorder


def test_list_pages_then_watch_events(kube: FakeKube) -> None:
    for i in range(1200):  # more than two list pages
        kube.slices[f"s{i:04d}"] = slice_object(f"s{i:04d}", "svc", [(f"p{i}", f"10.1.{i // 250}.{i % 250}", True)])
    w, seen = watch(kube)
    try:
        wait_for(lambda: seen.seen and len(seen.seen[0]) == 1200, what="the listed slices")
        assert kube.lists == 3 and kube.selectors[0] == "kubernetes.io/service-name=svc"
        wait_for(lambda: kube.watches == 1, what="the watch")
        kube.put(slice_object("s0000", "svc", [("p0", "10.1.0.0", False)]))
        wait_for(lambda: len(seen.seen) == 2, what="a change")
        assert seen.seen[1]["s0000"] == (("p0", "10.1.0.0", False, False, False),)
        kube.delete("s0001")
        kube.send({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "99"}}})
        wait_for(lambda: len(seen.seen) == 3 and "s0001" not in seen.seen[2], what="a deletion")
    finally:
        w.stop()


def test_an_expired_watch_lists_again(kube: FakeKube) -> None:
    w, seen = watch(kube)
    try:
        wait_for(lambda: kube.watches == 1, what="the watch")
        kube.send({"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}})
        wait_for(lambda: kube.lists == 2 and kube.watches == 2, what="a fresh list and watch")
        kube.end_watch()  # the server ends the watch: watch again (after the back-off, as it ended at once)
        wait_for(lambda: kube.watches == 3, what="the watch resumed")
        assert w.failures == 1 and kube.lists == 3
    finally:
        w.stop()


def test_an_oversized_event_or_junk_is_a_failure_not_a_crash(kube: FakeKube) -> None:
    w, seen = watch(kube)
    try:
        wait_for(lambda: kube.watches == 1, what="the watch")
        kube.send(b"x" * (MAX_EVENT_BYTES + 10) + b"\n")
        wait_for(lambda: w.failures == 1 and kube.watches == 2, timeout=20, what="a bounded failure and a retry")
        kube.send(b"{not json\n")
        wait_for(lambda: w.failures == 2 and kube.watches == 3, timeout=20, what="junk refused")
    finally:
        w.stop()


def test_a_refusal_keeps_retrying_and_turns_stale(kube: FakeKube, caplog: pytest.LogCaptureFixture) -> None:
    w, seen = watch(kube, stale_seconds=0.5)
    try:
        wait_for(lambda: kube.watches == 1, what="the watch")
        kube.status = 403  # the Role was deleted: every attempt is refused from now on
        kube.end_watch()
        wait_for(lambda: seen.seen[-1] is None, timeout=20, what="subscribers told the source is stale")
        assert w.failures >= 2
        refused = [r for r in caplog.records if "endpoint source failing" in r.getMessage()
                   and r.reason.startswith("forbidden")]
        assert len(refused) == 1  # once per kind of failure, not per attempt
        kube.status = 200
        wait_for(lambda: seen.seen[-1] is not None, timeout=40, what="back once the API answers")
    finally:
        w.stop()


def test_a_gateway_balances_over_the_pods_the_watch_lists(kube: FakeKube, tmp_path: Path) -> None:
    """The whole path in one process: the fake API lists two Pods of the backend Service; the gateway
    sends requests to both, never to the Service address; a Pod turning terminating stops its share."""
    port = free_port("127.0.42.1")
    pods = [FakeBackend(port=port, host=f"127.0.42.{i}").start() for i in (1, 2)]
    kube.put(slice_object("llm-backend-abc", "llm-backend",
                          [("pod-1", "127.0.42.1", True), ("pod-2", "127.0.42.2", True)], port=port))
    from gateway.config import GatewayConfig

    config = GatewayConfig(backend_url=f"http://llm-backend.ns.svc:{free_port()}", served_model_name="m",
                           listen_host="127.0.0.1", listen_port=0, admin_port=0, scaler_mode="off",
                           endpoint_source="endpointslices", service_account_dir=str(kube.account),
                           prefix_affinity=False, probe_interval_seconds=0.05)
    gw = ThreadedGateway(config, feed_environ=kube.environ).start()
    try:
        wait_for(lambda: gw.call(lambda: gw.app.backends.pods is not None and len(gw.app.backends.pods.eligible) == 2),
                 what="two Pods from the watch")
        assert kube.selectors[0] == "kubernetes.io/service-name=llm-backend"
        with requests.Session() as client:
            for _ in range(10):
                assert client.post(f"{gw.url}/v1/chat/completions", json={"model": "m", "messages": []},
                                   timeout=10).status_code == 200
        assert [len(p.requests_to("/v1/chat/completions")) for p in pods] == [5, 5]
        kube.put(slice_object("llm-backend-abc", "llm-backend", [("pod-1", "127.0.42.1", True),
                                                                  ("pod-2", "127.0.42.2", False)], port=port,
                              terminating=("pod-2",)))
        wait_for(lambda: gw.call(lambda: len(gw.app.backends.pods.eligible)) == 1, what="pod-2 terminating")
        with requests.Session() as client:
            for _ in range(4):
                assert client.post(f"{gw.url}/v1/chat/completions", json={"model": "m", "messages": []},
                                   timeout=10).status_code == 200
        assert [len(p.requests_to("/v1/chat/completions")) for p in pods] == [9, 5]
        queue = json.loads(requests.get(f"{gw.admin_url}/noctaya/queue", timeout=5).text)["backend"]
        assert queue["service"] == "llm-backend"
    finally:
        gw.stop()
        for p in pods:
            p.stop()


def test_stale_source_falls_back_to_the_service_address(kube: FakeKube) -> None:
    backend = FakeBackend(port=free_port()).start()
    kube.put(slice_object("llm-backend-abc", "llm-backend", [("pod-1", "127.0.43.1", True)], port=free_port()))
    from gateway.config import GatewayConfig

    config = GatewayConfig(backend_url=f"http://127.0.0.1:{backend.port}", served_model_name="m",
                           listen_host="127.0.0.1", listen_port=0, admin_port=0, scaler_mode="off",
                           endpoint_source="endpointslices", service_account_dir=str(kube.account))
    gw = ThreadedGateway(config, feed_environ=kube.environ).start()
    try:  # the backend URL is an address, not a Service of the namespace: no watch, the address serves
        assert gw.call(lambda: gw.app.backends.pods) is None and kube.lists == 0
        assert requests.post(f"{gw.url}/v1/chat/completions", json={"model": "m", "messages": []},
                             timeout=10).status_code == 200
    finally:
        gw.stop()
        backend.stop()
    time.sleep(0)


def test_a_shared_gateway_watches_the_namespace_once_for_every_model(kube: FakeKube) -> None:
    from gateway.config import GatewayConfig
    from gateway.modeltable import parse_model_table
    from gateway.shared import SharedGatewayApp

    port = free_port("127.0.44.1")
    pods = {name: FakeBackend(port=port, host=f"127.0.44.{i}").start() for i, name in ((1, "a1"), (2, "a2"), (3, "b1"))}
    kube.put(slice_object("a-backend-x", "a-backend", [("a1", "127.0.44.1", True), ("a2", "127.0.44.2", True)],
                          port=port))
    kube.put(slice_object("b-backend-x", "b-backend", [("b1", "127.0.44.3", True)], port=port))
    base = GatewayConfig(backend_url="http://unused:1", served_model_name="unused", listen_host="127.0.0.1",
                         listen_port=0, admin_port=0, scaler_mode="off", endpoint_source="endpointslices",
                         service_account_dir=str(kube.account), prefix_affinity=False,
                         model_table_file="/nonexistent/models.json", max_held_body_bytes=64 * 2**20)
    table = parse_model_table(json.dumps({"models": [
        {"name": "a", "backendURL": f"http://a-backend.ns.svc:{free_port()}"},
        {"name": "b", "backendURL": f"http://b-backend.ns.svc.cluster.local:{free_port()}"},
    ]}).encode(), base)
    gw = ThreadedGateway(base, feed_environ=kube.environ, app_factory=lambda feed, ns: SharedGatewayApp(
        base, table, feed=feed, namespace=ns)).start()
    try:
        wait_for(lambda: gw.call(lambda: all(app.backends.pods is not None for app in gw.app.apps.values())),
                 what="both models' Pods")
        assert kube.selectors[0] == ""  # the namespace's slices, one watch for every model
        with requests.Session() as client:
            for model in ("a", "a", "b", "a", "a", "b"):
                assert client.post(f"{gw.url}/v1/chat/completions", json={"model": model, "messages": []},
                                   timeout=10).status_code == 200
        assert {n: len(p.requests_to("/v1/chat/completions")) for n, p in pods.items()} == {"a1": 2, "a2": 2, "b1": 2}
        assert kube.watches == 1
    finally:
        gw.stop()
        for p in pods.values():
            p.stop()


def test_a_server_ending_every_watch_at_once_is_no_busy_loop(kube: FakeKube) -> None:
    """A proxy that cuts every watch the moment it starts: lists and watches back off (1 s doubling),
    they do not spin."""
    w, seen = watch(kube)
    try:
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:
            kube.end_watch()
            time.sleep(0.05)
        assert kube.lists <= 5, kube.lists  # 0 s, ~1 s, ~3 s (jittered): not one per cut (80 cuts)
        assert seen.seen[-1] is not None  # every list succeeded: the Pods stay known
    finally:
        w.stop()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_the_shipped_process_balances_in_every_worker(kube: FakeKube, workers: str) -> None:
    """`python -m gateway` as rendered (NOCTAYA_ENDPOINT_SOURCE=endpointslices), one worker or a
    supervisor and two: each worker watches and balances on its own; /metrics sums the Pods' counters
    over the workers."""
    from tests.gateway.test_process import GatewayProcess

    port = free_port("127.0.46.1")
    pods = [FakeBackend(port=port, host=f"127.0.46.{i}").start() for i in (1, 2)]
    kube.put(slice_object("llm-backend-abc", "llm-backend",
                          [("pod-1", "127.0.46.1", True), ("pod-2", "127.0.46.2", True)], port=port))
    service = FakeBackend(port=free_port())  # the Service address: never started, so never used
    gw = GatewayProcess(service, NOCTAYA_GATEWAY_WORKERS=workers, NOCTAYA_BACKEND_URL=f"http://llm-backend.ns.svc:{port}",
                        NOCTAYA_ENDPOINT_SOURCE="endpointslices", NOCTAYA_SERVICE_ACCOUNT_DIR=str(kube.account),
                        NOCTAYA_PREFIX_AFFINITY="false", NOCTAYA_SCALER_MODE="off", **kube.environ)
    try:
        wait_for(lambda: kube.watches >= int(workers), what="a watch per worker")
        codes = [requests.post(f"{gw.url}/v1/chat/completions", json={"model": "test-model", "messages": []},
                               headers={"Connection": "close"}, timeout=10).status_code for _ in range(20)]
        assert codes == [200] * 20
        served = [len(p.requests_to("/v1/chat/completions")) for p in pods]
        assert sum(served) == 20 and min(served) >= 5, served
        text = requests.get(f"{gw.admin_url}/metrics", timeout=5).text
        for i, count in enumerate(served, start=1):
            assert f'noctaya_gateway_backend_pod_requests_total{{pod="pod-{i}"}} {float(count)}' in text, text[-3000:]
    finally:
        gw.stop()
        for p in pods:
            p.stop()
