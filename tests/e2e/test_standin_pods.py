"""Backend Pods with IPs of their own (tests/e2e/standin_pods.py, tests/e2e/netns.py) in the real
cluster: the Deployment the hooks rendered, scaled by KEDA, its Pods made by kube-controller-manager
and bound by kube-scheduler, played by the stand-in kubelet (kwok plays nothing in
``STANDIN_NAMESPACE``), published by kube-controller-manager's EndpointSlice controller. What a
component balancing over the backend's Pods reads (the Service's EndpointSlices) names addresses
that each reach one Pod's server."""

from __future__ import annotations

import ipaddress
import threading
from collections.abc import Callable, Iterator

import openai
import pytest
import requests

from tests.e2e.cluster import Cluster, Timeline
from tests.e2e.kubelet import endpoint_slice_addresses, models_retired_at_end
from tests.e2e.netns import Network
from tests.e2e.standin_pods import STANDIN_NAMESPACE, StandInKubelet
from tests.e2e.test_scale_from_zero import ANSWER, MODEL_PORT, Model, keda, llmservice  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(300)

NAMESPACE = STANDIN_NAMESPACE
READINESS_LAG = 3.0  # the backend reported Ready this long after its server first answers /health
LOAD_SECONDS = {0: 0.0, 1: 3.0, 2: 6.0}  # by Pod: they turn Ready one after another


@pytest.fixture(scope="module")
def standins(cluster: Cluster, keda: None) -> Iterator[dict[str, Model]]:  # noqa: F811
    """The module's models; at its end their LLMServices are deleted while their kubelets still play
    the Pods (a Pod nobody confirms stays Terminating, and later modules wait for every backend in
    the cluster to be gone), then everything stops."""
    yield from models_retired_at_end(cluster, NAMESPACE)


@pytest.fixture
def standin_model(cluster: Cluster, standins: dict[str, Model], timeline: Timeline,
                  pod_network: Network) -> Callable[..., Model]:
    def make(name: str, replicas: int, started: Callable[[StandInKubelet], None] | None = None,
             **kubelet_options: object) -> Model:
        """LLMService ``name`` held at ``replicas`` backend Pods (scaling min = max), its gateway
        running; the Pods played by a StandInKubelet with ``kubelet_options``, given to ``started``
        before the LLMService exists."""
        if name in standins:
            standins[name].timeline = standins[name].server.timeline = timeline
            return standins[name]
        kubelet = StandInKubelet(cluster, pod_network, name, MODEL_PORT, timeline, **kubelet_options).start()
        if started is not None:
            started(kubelet)
        model = standins[name] = Model(cluster, timeline, name, NAMESPACE, server=kubelet)
        model.create(llmservice(name, NAMESPACE, scaling={"min": replicas, "max": replicas}))
        model.start_pods()
        model.wait_keda_connected()
        return model

    return make


def standin(model: Model) -> StandInKubelet:
    assert isinstance(model.server, StandInKubelet)
    return model.server


def ready_addresses(cluster: Cluster, service: str) -> set[str]:
    return {address for address, conds in endpoint_slice_addresses(cluster, NAMESPACE, service).items()
            if conds.get("ready")}


def ask(address: str) -> str:
    """A chat completion sent straight to one Pod's IP, as a gateway balancing over Pods sends it."""
    client = openai.OpenAI(base_url=f"http://{address}:{MODEL_PORT}/v1", api_key="unused", max_retries=0, timeout=30)
    answer = client.chat.completions.create(model="trio", messages=[{"role": "user", "content": "hi"}])
    return (answer.choices[0].message.content or "").strip()


class LagWatch:
    """From before the backend Pods exist: whenever a Pod's server answers its readiness path but the
    kubelet has not yet made it Ready (the lag), what the API says of it then. Read in that order
    (the API first, then that the kubelet still has not turned it Ready, which it does before it
    patches the status), each observation is one the API made during the lag."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.seen: list[tuple[str, str, bool | None]] = []  # (Pod, its Ready condition, its endpoint's ready)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, kubelet: StandInKubelet) -> None:
        self._thread = threading.Thread(target=self._run, args=(kubelet,), daemon=True)
        self._thread.start()

    def _run(self, kubelet: StandInKubelet) -> None:
        while not self._stop.wait(0.1):
            for pod in [p for p in kubelet.backends() if p.answered_at is not None and p.ready_at is None]:
                try:
                    obj = self.cluster.api(f"/api/v1/namespaces/{NAMESPACE}/pods/{pod.name}")
                except requests.RequestException:
                    continue
                ready = [c["status"] for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == "Ready"]
                endpoint = endpoint_slice_addresses(self.cluster, NAMESPACE, f"{kubelet.service}-backend").get(
                    pod.address, {}).get("ready")
                if pod.ready_at is None:
                    self.seen.append((pod.name, ",".join(ready), endpoint))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)


def test_three_backend_pods_each_serve_on_the_ip_their_endpointslice_names(
        standin_model: Callable[..., Model], cluster: Cluster, pod_network: Network, timeline: Timeline) -> None:
    watch = LagWatch(cluster)
    try:
        model = standin_model("trio", 3, started=watch.start, readiness_lag=READINESS_LAG, load_seconds=LOAD_SECONDS)
        kubelet = standin(model)
        model.wait("3 backend Pods ready in the backend Service's EndpointSlice",
                   lambda: len(ready_addresses(cluster, "trio-backend")) == 3, timeout=120)
    finally:
        watch.stop()
    # During each Pod's lag its server answered, but the API said not Ready and the EndpointSlice
    # listed its IP not ready (or not yet).
    timeline.note(f"during the lag: {watch.seen}")
    assert {name for name, _ready, _endpoint in watch.seen} == {p.name for p in kubelet.backends()}, watch.seen
    assert all(ready == "False" and endpoint is not True for _name, ready, endpoint in watch.seen), watch.seen
    pods = kubelet.backends()
    published = endpoint_slice_addresses(cluster, NAMESPACE, "trio-backend")
    assert len(pods) == 3 and set(published) == {p.address for p in pods}, (published, kubelet.pod_states())
    assert {c["pod"] for c in published.values()} == {p.name for p in pods}, published
    assert all(ipaddress.ip_address(a) in pod_network.pod_range for a in published), published
    assert all(p.address in pod_network.addresses for p in pods), "each Pod IP is plumbed on this machine"

    # Each IP reaches its own Pod's server, and only that one.
    for pod in pods:
        assert ask(pod.address) == ANSWER, kubelet.pod_states()
    assert kubelet.served_by_pod() == {p.name: 1 for p in pods}, kubelet.served_by_pod()

    # Ready after the lag: every Pod's server answered before its Pod was Ready, and the Pods turned
    # Ready in the order they finished loading.
    for pod in pods:
        moments = [what for _at, what in kubelet.events if what.startswith(f"{pod.name}: ")]
        answered = next(i for i, what in enumerate(moments) if "engine answered readiness" in what)
        ready = next(i for i, what in enumerate(moments) if what.startswith(f"{pod.name}: Ready"))
        assert answered < ready and pod.answered_at is not None and pod.ready_at is not None, moments
    by_ready = sorted(pods, key=lambda p: p.ready_at or 0.0)
    assert [p.index for p in by_ready] == sorted(p.index for p in pods), kubelet.pod_states()
    print(f"\nstand-in Pods: {len(pods)} Pod IPs {sorted(published)} ready in the EndpointSlice, each served "
          f"its own request ({kubelet.served_by_pod()})")


def test_a_deleted_pod_leaves_its_endpointslice_at_once_and_finishes_its_held_stream(
        standin_model: Callable[..., Model], cluster: Cluster, pod_network: Network, timeline: Timeline) -> None:
    model = standin_model("trio", 3, readiness_lag=READINESS_LAG, load_seconds=LOAD_SECONDS)
    kubelet = standin(model)
    model.wait("3 backend Pods ready in the EndpointSlice",
               lambda: len(ready_addresses(cluster, "trio-backend")) == 3, timeout=120)
    victim = kubelet.ready_engines()[0]
    served_before = kubelet.served(victim.name)
    kubelet.hold_streams()
    result: dict[str, object] = {}

    def stream() -> None:
        client = openai.OpenAI(base_url=f"http://{victim.address}:{MODEL_PORT}/v1", api_key="unused",
                               max_retries=0, timeout=120)
        try:
            chunks = client.chat.completions.create(model="trio", messages=[{"role": "user", "content": "hi"}],
                                                    stream=True)
            result["text"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
        except Exception as exc:  # noqa: BLE001 - the assertion below reports it
            result["error"] = exc

    thread = threading.Thread(target=stream, daemon=True)
    try:
        thread.start()
        model.wait("the stream held open at the victim Pod", lambda: kubelet.backend(victim.name).streams_held == 1,
                   timeout=30)
        cluster.kubectl("-n", NAMESPACE, "delete", "pod", victim.name, "--wait=false")
        model.wait("the victim no longer ready in the EndpointSlice",
                   lambda: victim.address not in ready_addresses(cluster, "trio-backend"), timeout=30)
        model.wait("the victim's server refuses new connections", lambda: _refused(victim.address), timeout=30)
        # Still draining: its stream in flight, the Pod object Terminating, out of the Service.
        backend = kubelet.backend(victim.name)
        assert victim.deleting and not victim.ready and backend.in_flight == 1, kubelet.pod_states()
        assert victim.address not in kubelet.service_ip.endpoints, kubelet.service_ip.endpoints
        pod = cluster.get("pod", victim.name, NAMESPACE)
        assert pod is not None and pod["metadata"].get("deletionTimestamp"), "the Pod object waits for the drain"
    finally:
        kubelet.release_streams()
    thread.join(60)
    assert "error" not in result and result.get("text") == ANSWER, (result, timeline.text())
    model.wait("the victim's Pod object removed once drained", lambda: cluster.get("pod", victim.name, NAMESPACE)
               is None, timeout=60)
    assert victim.address not in pod_network.addresses, "the Pod's address goes with it"
    assert kubelet.served(victim.name) == served_before + 1, kubelet.served_by_pod()
    model.wait("a replacement Pod ready: 3 in the EndpointSlice again",
               lambda: len(ready_addresses(cluster, "trio-backend")) == 3, timeout=120)
    assert victim.address not in ready_addresses(cluster, "trio-backend")


def _refused(address: str) -> bool:
    try:
        requests.get(f"http://{address}:{MODEL_PORT}/health", timeout=2)
    except requests.ConnectionError:
        return True
    return False
