"""Traffic follows replicas (issue 41), on the real path: the gateway the hooks rendered, with the
identity they rendered (a ServiceAccount allowed to watch its namespace's EndpointSlices, the token
LocalPods plays), watching the backend Service's EndpointSlices that kube-controller-manager's
controller publishes for Pods bound by kube-scheduler, each Pod played by the stand-in kubelet on a Pod
IP of its own (tests/e2e/standin_pods.py); real KEDA, real Metacontroller, `openai` clients.

KEDA scales 0 -> 1 itself. Its 1 -> N goes through the HPA, which needs KEDA's metrics server, which
this suite does not run (the HPA then keeps its count): the tests scale the backend Deployment's
``scale`` subresource to 3, as the HPA would.

``NOCTAYA_E2E_BALANCING=service`` runs the same tests against the pooled-Service behaviour of the
release before (the gateway dials the backend Service's ClusterIP over keep-alive connections that
live forever): they fail, which is what they are for (docs/benchmarks.md, "Replicas (issue 41)").
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
import requests

from hooks.resources.context import ADMIN_PORT
from tests.e2e.cluster import Cluster, Timeline
from tests.e2e.kubelet import models_retired_at_end
from tests.e2e.netns import Network
from tests.e2e.pods import LocalPods
from tests.e2e.standin_pods import STANDIN_NAMESPACE, StandInBackend, StandInKubelet
from tests.e2e.test_scale_from_zero import (  # noqa: F401 (keda: a fixture)
    ANSWER,
    GATEWAY_PORT,
    MODEL_PORT,
    Model,
    keda,
    llmservice,
)

pytestmark = pytest.mark.timeout(300)

NAMESPACE = STANDIN_NAMESPACE
TODAY = os.environ.get("NOCTAYA_E2E_BALANCING") == "service"
# The release before: the Service address over keep-alive connections that are never renewed.
TODAY_ENV = {"NOCTAYA_ENDPOINT_SOURCE": "service", "NOCTAYA_UPSTREAM_MAX_CONNECTION_AGE_SECONDS": "0"}


@pytest.fixture(scope="module")
def replica_models(cluster: Cluster, keda: None) -> Iterator[dict[str, Model]]:  # noqa: F811
    """The module's models; at its end their LLMServices are deleted while their kubelets still play
    the Pods (a Pod nobody confirms stays Terminating), then everything stops."""
    yield from models_retired_at_end(cluster, NAMESPACE)


@pytest.fixture
def replica_model(cluster: Cluster, replica_models: dict[str, Model], timeline: Timeline,
                  pod_network: Network) -> Callable[..., Model]:
    def make(name: str, scaling: dict[str, Any], configure: Callable[[int, StandInBackend], None] | None = None,
             **kubelet_options: Any) -> Model:
        """LLMService ``name`` with ``scaling``, its gateway running as rendered (with the release
        before's balancing under NOCTAYA_E2E_BALANCING=service), its Pods played by a StandInKubelet."""
        kubelet = StandInKubelet(cluster, pod_network, name, MODEL_PORT, timeline, configure=configure,
                                 **kubelet_options).start()
        model = replica_models[name] = Model(cluster, timeline, name, NAMESPACE, server=kubelet)
        model.create(llmservice(name, NAMESPACE, scaling={"pollingInterval": "1s", **scaling},
                                endpoint={"maxQueue": 64}))
        model.gateways = LocalPods(cluster, NAMESPACE, f"{name}-gateway", env=TODAY_ENV if TODAY else None).start(1)
        model.gateways.wait_http(GATEWAY_PORT)
        model.wait_keda_connected()
        return model

    return make


def kubelet_of(model: Model) -> StandInKubelet:
    assert isinstance(model.server, StandInKubelet)
    return model.server


def scale(cluster: Cluster, model: Model, replicas: int) -> None:
    """What the HPA does for KEDA's 1 -> N (see the module doc): the Deployment's scale subresource."""
    cluster.kubectl("-n", NAMESPACE, "scale", "deployment", f"{model.name}-backend", f"--replicas={replicas}")


def queue(model: Model) -> dict[str, Any]:
    assert model.gateways is not None
    return requests.get(f"http://{model.gateways.addresses[0]}:{ADMIN_PORT}/noctaya/queue", timeout=5).json()


def shares(counts: dict[str, int]) -> str:
    total = sum(counts.values()) or 1
    return " / ".join(f"{100 * n / total:.0f}" for n in counts.values())


def test_scale_out_under_steady_load_spreads_over_every_pod(replica_model: Callable[..., Model], cluster: Cluster,
                                                            timeline: Timeline) -> None:
    """Six `openai` clients keep one Pod busy; the backend scales 1 -> 3: each Pod serves at least a
    quarter of the requests once all three are Ready (the release before: every pooled connection
    stays on the first Pod, 100 / 0 / 0)."""

    def slow(index: int, backend: StandInBackend) -> None:
        backend.response_delay = 0.05

    model = replica_model("spread", {"min": 1, "max": 3}, configure=slow)
    kubelet = kubelet_of(model)
    model.wait("the first Pod Ready", lambda: len(kubelet.ready_engines()) == 1, timeout=60)
    stop = threading.Event()
    outcomes: list[str] = []

    def client() -> None:
        api = model.client(timeout=30)
        while not stop.is_set():
            try:
                answer = api.chat.completions.create(model="spread", messages=[{"role": "user", "content": "hi"}])
                outcomes.append(answer.choices[0].message.content or "")
            except openai.APIError as exc:
                outcomes.append(f"error: {exc}")

    clients = [threading.Thread(target=client, daemon=True) for _ in range(6)]
    try:
        for thread in clients:
            thread.start()
        model.wait("load on the first Pod", lambda: len(outcomes) >= 30, timeout=60)
        scale(cluster, model, 3)
        model.wait("three Pods Ready", lambda: len(kubelet.ready_engines()) == 3, timeout=90)
        before = kubelet.served_by_pod()
        model.wait("240 requests after all three were Ready",
                   lambda: sum(kubelet.served_by_pod().values()) - sum(before.values()) >= 240, timeout=90)
        after = kubelet.served_by_pod()
    finally:
        stop.set()
        for thread in clients:
            thread.join(30)
    window = {pod: after[pod] - before.get(pod, 0) for pod in after}
    total = sum(window.values())
    timeline.note(f"shares after all three were Ready: {window} ({shares(window)} %)")
    print(f"\nscale-out 1 -> 3 under load: {total} requests after all three were Ready, shares {shares(window)} %"
          f" ({'release before' if TODAY else 'per-Pod balancing'})")
    assert all(o.strip() == ANSWER for o in outcomes), [o for o in outcomes if o.strip() != ANSWER][:3]
    assert len(window) == 3 and min(window.values()) >= 0.25 * total, window


def test_a_cold_burst_spreads_over_pods_turning_ready_at_different_times(
        replica_model: Callable[..., Model], cluster: Cluster, timeline: Timeline) -> None:
    """30 streamed requests wait for a model at zero; KEDA wakes it, it scales to 3, its Pods load
    2, 4 and 6 s: each Pod serves at least 20 % of the burst, none lost, none served twice (the
    gateway gives a Pod at most its cold batch, 8, while others are still starting)."""
    model = replica_model("burst", {"min": 0, "max": 3}, load_seconds={0: 2.0, 1: 4.0, 2: 6.0})
    kubelet = kubelet_of(model)
    kubelet.hold_streams()  # every stream stays open at its Pod until all thirty are placed
    results: list[str] = []

    def stream() -> None:
        try:
            chunks = model.client(timeout=120).chat.completions.create(
                model="burst", messages=[{"role": "user", "content": "hi"}], stream=True)
            results.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip())
        except openai.APIError as exc:
            results.append(f"error: {exc}")

    threads = [threading.Thread(target=stream, daemon=True) for _ in range(30)]
    try:
        for thread in threads:
            thread.start()
        model.wait("30 requests held", lambda: queue(model)["queued"] == 30, timeout=60)
        model.wait("KEDA woke the backend (0 -> 1)", lambda: (model.replicas() or 0) >= 1, timeout=60)
        scale(cluster, model, 3)
        model.wait("all thirty at their Pods", lambda: kubelet.streams_held() == 30, timeout=120)
    finally:
        kubelet.release_streams()
    for thread in threads:
        thread.join(60)
    served = kubelet.served_by_pod()
    ready_order = [p.name for p in sorted(kubelet.backends(), key=lambda p: p.ready_at or float("inf"))]
    timeline.note(f"burst served by Pod {served}, Pods Ready in the order {ready_order}")
    print(f"\ncold burst of 30 streams over 3 Pods turning Ready 2 s apart: {served} ({shares(served)} %)")
    assert results.count(ANSWER) == 30, results
    assert sum(served.values()) == 30 and len(served) == 3, served  # none lost, none twice
    assert min(served.values()) >= 6, served


def test_a_held_request_is_forwarded_the_moment_its_engine_answers(replica_model: Callable[..., Model],
                                                                    timeline: Timeline) -> None:
    """The kubelet reports the Pod Ready 5 s after its engine first answers /health; the gateway,
    probing the Pod itself, forwards the held request before that (the release before waits for
    the kubelet and the Service)."""
    model = replica_model("lag", {"min": 0, "max": 1}, readiness_lag=5.0, load_seconds=1.0)
    kubelet = kubelet_of(model)
    text, first = "", None
    started = time.monotonic()
    chunks = model.client(timeout=120).chat.completions.create(
        model="lag", messages=[{"role": "user", "content": "hi"}], stream=True)
    for chunk in chunks:
        delta = chunk.choices[0].delta.content if chunk.choices else None
        if delta:
            first = first if first is not None else time.monotonic()
            text += delta
    (pod,) = kubelet.backends()
    assert text.strip() == ANSWER and first is not None and pod.answered_at is not None, kubelet.pod_states()
    model.wait("the kubelet's Ready, 5 s after", lambda: pod.ready_at is not None, timeout=30)
    assert pod.ready_at is not None
    lead = pod.ready_at - first
    timeline.note(f"engine answered {pod.answered_at - started:.2f}s, first token {first - started:.2f}s, "
                  f"kubelet Ready {pod.ready_at - started:.2f}s after the request")
    print(f"\nreadiness lag 5 s: first token {first - pod.answered_at:+.2f} s after the engine first answered "
          f"(the kubelet's probe, every 0.2 s), {lead:.2f} s before the kubelet's Ready")
    # The first token left before the Pod was Ready at all: the gateway did not wait for the kubelet.
    assert first < pod.ready_at, timeline.text()
    events = queue(model)["backend"]
    assert events["source"] == ("service" if TODAY else "endpointslices"), events


def test_a_terminating_pod_gets_no_new_request_and_finishes_its_stream(replica_model: Callable[..., Model],
                                                                       cluster: Cluster,
                                                                       timeline: Timeline) -> None:
    def long_stream(index: int, backend: StandInBackend) -> None:
        backend.tokens, backend.stream_delay = 50, 0.05  # seconds of stream once released

    model = replica_model("drain", {"min": 2, "max": 2}, configure=long_stream)
    kubelet = kubelet_of(model)
    model.wait("two Pods Ready", lambda: len(kubelet.ready_engines()) == 2, timeout=60)
    kubelet.hold_streams()
    result: dict[str, str] = {}

    def stream() -> None:
        chunks = model.client(timeout=120).chat.completions.create(
            model="drain", messages=[{"role": "user", "content": "hi"}], stream=True)
        result["text"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    try:
        model.wait("the stream open at a Pod", lambda: kubelet.streams_held() == 1, timeout=30)
        victim = next(p for p in kubelet.backends() if p.engine is not None and p.engine.streams_held == 1)
        kubelet.release_streams()  # every Pod answers again (the replacement too) but the victim:
        victim.engine.hold_streams()  # its stream (50 tokens 50 ms apart) is held again after a token or two
        cluster.kubectl("-n", NAMESPACE, "delete", "pod", victim.name, "--wait=false")
        model.wait("the gateway sees the victim terminating",
                   lambda: any(p["name"] == victim.name and p["state"] == "excluded"
                               for p in queue(model)["backend"]["pods"]) or TODAY, timeout=30)
        api = model.client(timeout=30)
        answers = [api.chat.completions.create(model="drain", messages=[{"role": "user", "content": "hi"}])
                   .choices[0].message.content for _ in range(6)]
        assert len([a for a in answers if a and a.strip()]) == 6, answers
        served_victim = kubelet.served(victim.name)
    finally:
        kubelet.release_streams()
    thread.join(60)
    timeline.note(f"served by Pod {kubelet.served_by_pod()}")
    assert result.get("text") == " ".join(f"tok{i}" for i in range(50)), (result, timeline.text())  # finished
    assert served_victim == 1, kubelet.served_by_pod()  # the terminating Pod got nothing new
