"""One base URL for many models, end to end: an LLMGateway fronting three LLMServices, with real KEDA.

The shared gateway runs from the Deployment the LLMGateway's hooks rendered (``LocalPods``, with its
routing ConfigMap mounted and refreshed as the kubelet does it); each LLMService's ScaledObject dials
the shared scaler Service with its own ``model``; KEDA's operator scales each backend on its own. The
real ``openai`` client uses one base URL throughout.

The two tests share one world (module scope): the second continues where the first stopped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
import yaml

from hooks.resources import names
from tests.e2e.cluster import Cluster, Timeline
from tests.e2e.pods import LocalPods, ModelServer, stop_together
from tests.e2e.test_lifecycle import conditions
from tests.e2e.test_scale_from_zero import ANSWER, GATEWAY_PORT, MODEL_PORT, keda, llmservice  # noqa: F401
from tests.kube.apiserver import REPO_ROOT

pytestmark = pytest.mark.timeout(420)

NS = "e2e-shared"
GATEWAY = "front"
FLOODED_MAX_QUEUE = 2
MESSAGES = [{"role": "user", "content": "hi"}]
# What docs/install.md ("Enabling a namespace for LLMGateways") has users apply in each namespace that
# holds LLMGateways: Metacontroller runs with the install's RBAC only, which writes no ConfigMap elsewhere.
ENABLING_ROLEBINDING = REPO_ROOT / "metacontroller" / "llmgateway-namespace" / "rolebinding.yaml"


def llmgateway(name: str, namespace: str, **spec: Any) -> str:
    return yaml.safe_dump({"apiVersion": "serving.noctaya.io/v1alpha1", "kind": "LLMGateway",
                           "metadata": {"name": name, "namespace": namespace}, "spec": spec})


class SharedWorld:
    """The LLMGateway, its members' objects and model servers, and the shared gateway's local Pod."""

    def __init__(self, cluster: Cluster, timeline: Timeline) -> None:
        self.cluster, self.timeline = cluster, timeline
        self.servers: dict[str, ModelServer] = {}
        # No credentials: the members' ModelServers serve at their Services' names only (pods.py).
        self.gateway = LocalPods(cluster, NS, names.shared_gateway(GATEWAY), credentials=False)

    def replicas(self, model: str) -> int | None:
        backend = self.cluster.get("deployment", names.backend(model), NS)
        return None if backend is None else backend["spec"].get("replicas")

    def scaled(self, model: str) -> dict[str, str]:
        return conditions(self.cluster.get("scaledobject", names.scaled_object(model), NS))

    def snapshot(self) -> str:
        parts = []
        for model, server in sorted(self.servers.items()):
            scaled = self.scaled(model)
            parts.append(f"{model}: replicas={self.replicas(model)} SO.Ready={scaled.get('Ready', '?')} "
                         f"Active={scaled.get('Active', '?')} server={'up' if server.backend.running else 'down'}")
        gw = conditions(self.cluster.get("llmgateway", GATEWAY, NS))
        return f"LLMGateway Ready={gw.get('Ready', '?')}; " + "; ".join(parts)

    def wait(self, what: str, check: Callable[[], bool], timeout: float = 60.0) -> float:
        def logs() -> list[tuple[str, str]]:
            return [(n, self.cluster.log_tail(n, 12)) for n in ["keda-operator", "metacontroller", *self.gateway._names]]

        return self.timeline.wait(what, check, self.snapshot, timeout, logs)

    def add_model(self, name: str, **endpoint: Any) -> None:
        self.cluster.kubectl("apply", "--server-side", "-f", "-",
                             stdin=llmservice(name, NS, endpoint={"gateway": GATEWAY, **endpoint}))
        self.servers[name] = ModelServer(self.cluster, NS, name, MODEL_PORT, self.timeline)

    def wait_keda_connected(self, model: str) -> None:
        self.wait(f"KEDA reached the shared scaler for {model} (ScaledObject Ready=True)",
                  lambda: self.scaled(model).get("Ready", "").startswith("True"))

    def client(self, timeout: float = 120.0) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.gateway.url(0, GATEWAY_PORT)}/v1", api_key="unused",
                             max_retries=0, timeout=timeout)

    def listed(self) -> list[str]:
        return [m.id for m in self.client(timeout=10).models.list()]

    def stop(self) -> None:
        stop_together([*self.servers.values(), self.gateway])


@pytest.fixture(scope="module")
def world(cluster: Cluster, keda: None) -> Iterator[SharedWorld]:  # noqa: F811 (keda: the imported fixture)
    made = SharedWorld(cluster, Timeline())
    yield made
    made.stop()


def _watch_max_replicas(world: SharedWorld, models: list[str], stop: threading.Event) -> dict[str, int]:
    """The highest spec.replicas each model's backend had while ``stop`` is unset (a thread fills it)."""
    seen = {m: 0 for m in models}

    def run() -> None:
        while not stop.is_set():
            for m in models:
                seen[m] = max(seen[m], world.replicas(m) or 0)
            time.sleep(0.05)

    threading.Thread(target=run, daemon=True).start()
    return seen


def test_one_base_url_lists_three_cold_models_wakes_only_the_one_asked_and_a_flood_stays_with_its_model(
        world: SharedWorld, cluster: Cluster, timeline: Timeline) -> None:
    world.timeline = timeline
    cluster.kubectl("create", "namespace", NS)
    cluster.kubectl("apply", "--server-side", "-f", "-", stdin=llmgateway(GATEWAY, NS))
    # Not enabled yet: the gateway says so and renders nothing (no Pod waiting for a routing ConfigMap
    # Metacontroller may not write here) ...
    world.wait("LLMGateway Accepted=False/NamespaceNotEnabled (no RoleBinding yet)", lambda: (
        conditions(cluster.get("llmgateway", GATEWAY, NS)).get("Accepted") == "False/NamespaceNotEnabled"))
    assert cluster.get("deployment", names.shared_gateway(GATEWAY), NS) is None
    # ... until the RoleBinding exists, applied as the docs say; Metacontroller re-syncs the gateway on it.
    cluster.kubectl("apply", "--server-side", "-n", NS, "-f", str(ENABLING_ROLEBINDING))
    world.add_model("model-a", maxQueue=FLOODED_MAX_QUEUE)
    world.add_model("model-b")
    world.add_model("model-c")
    world.wait("shared gateway Deployment, routing ConfigMap with three models, three ScaledObjects", lambda: (
        conditions(cluster.get("llmgateway", GATEWAY, NS)).get("Accepted") == "True/Accepted"
        and cluster.get("deployment", names.shared_gateway(GATEWAY), NS) is not None
        and all(f'"{m}"' in str((cluster.get("configmap", names.shared_routes(GATEWAY), NS) or {}).get("data"))
                for m in ("model-a", "model-b", "model-c"))
        and all(cluster.get("scaledobject", names.scaled_object(m), NS) for m in ("model-a", "model-b", "model-c"))))
    # No member renders a gateway of its own.
    assert cluster.get("deployment", names.gateway("model-a"), NS) is None
    world.gateway.start()
    world.gateway.wait_http(GATEWAY_PORT)
    for model in ("model-a", "model-b"):  # model-c's server starts in the next test
        world.servers[model].start()
    for model in ("model-a", "model-b", "model-c"):
        world.wait_keda_connected(model)

    # Listing answers every member while all are at zero, and wakes nothing.
    assert world.listed() == ["model-a", "model-b", "model-c"], timeline.text()
    time.sleep(3.0)
    assert [world.replicas(m) for m in ("model-a", "model-b", "model-c")] == [0, 0, 0], timeline.text()
    assert not any(s.pods_seen for s in world.servers.values()), timeline.text()
    timeline.note("models.list(): three cold models, nothing woke")

    # A streamed chat to B wakes B only.
    stop = threading.Event()
    peaks = _watch_max_replicas(world, ["model-a", "model-b", "model-c"], stop)
    t0 = time.monotonic()
    text = "".join(chunk.choices[0].delta.content or "" for chunk in world.client().chat.completions.create(
        model="model-b", messages=MESSAGES, stream=True) if chunk.choices).strip()
    cold_b = time.monotonic() - t0
    time.sleep(2.0)  # KEDA's pollingInterval is 1 s: a wrongly woken model would show by now
    stop.set()
    assert text == ANSWER, timeline.text()
    assert peaks == {"model-a": 0, "model-b": 1, "model-c": 0}, f"{peaks}\n{timeline.text()}"
    assert not world.scaled("model-a").get("Active", "").startswith("True")
    timeline.note(f"model-b streamed from cold in {cold_b:.2f}s; only model-b's ScaledObject went 0 -> 1")

    # Model A flooded at 10x its maxQueue: 429s for A only, while B (warm) answers every request.
    outcomes: dict[str, list[Any]] = {"model-a": [], "model-b": []}

    def ask(model: str) -> None:
        try:
            world.client().chat.completions.create(model=model, messages=MESSAGES)
            outcomes[model].append(200)
        except openai.APIStatusError as exc:
            outcomes[model].append(exc.status_code)

    flood = [threading.Thread(target=ask, args=("model-a",), daemon=True) for _ in range(10 * FLOODED_MAX_QUEUE)]
    others = [threading.Thread(target=ask, args=("model-b",), daemon=True) for _ in range(5)]
    for t in [*flood, *others]:
        t.start()
    for t in [*flood, *others]:
        t.join(120)
    a = sorted(outcomes["model-a"])
    assert outcomes["model-b"] == [200] * 5, f"{outcomes}\n{timeline.text()}"
    assert a.count(429) >= 10 * FLOODED_MAX_QUEUE - FLOODED_MAX_QUEUE, f"{outcomes}\n{timeline.text()}"
    assert set(a) <= {200, 429}, f"{outcomes}\n{timeline.text()}"
    timeline.note(f"model-a flood: {a.count(429)} x 429, {a.count(200)} answered; model-b: 5 x 200")

    # An unknown model: OpenAI's 404 model_not_found, and nothing wakes for it.
    with pytest.raises(openai.NotFoundError) as unknown:
        world.client().chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert unknown.value.code == "model_not_found", unknown.value.response.text
    assert world.replicas("model-c") == 0
    print(f"\nshared gateway: model-b cold stream {cold_b:.2f} s through real KEDA; model-a flood "
          f"{a.count(429)}/{len(a)} refused 429 while model-b answered 5/5")


def test_a_fourth_model_joins_while_a_cold_request_for_another_is_held_and_that_request_completes(
        world: SharedWorld, cluster: Cluster, timeline: Timeline) -> None:
    if not world.gateway.addresses:
        pytest.skip("continues the previous test")
    world.timeline = timeline
    for server in world.servers.values():
        server.timeline = timeline
    held: list[Any] = []

    def cold_c() -> None:
        try:
            stream = world.client(timeout=180).chat.completions.create(model="model-c", messages=MESSAGES, stream=True)
            held.append("".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices).strip())
        except Exception as exc:  # noqa: BLE001 - recorded for the assertion below
            held.append(exc)

    holder = threading.Thread(target=cold_c, daemon=True)
    holder.start()
    # model-c's server is not started yet, so its request is held however fast KEDA and kwok are.
    world.wait("model-c's cold request made KEDA scale it (request held)", lambda: (world.replicas("model-c") or 0) >= 1)
    t0 = time.monotonic()
    world.add_model("model-d")
    world.wait("model-d listed by the shared gateway", lambda: "model-d" in world.listed(), timeout=60)
    listed_after = time.monotonic() - t0
    assert holder.is_alive() and not held, f"the held request ended before its model woke: {held}"
    assert world.replicas("model-d") in (0, None), "listing a new model must not wake it"
    timeline.note(f"model-d listed {listed_after:.1f}s after it was applied; model-c's request still held")
    world.servers["model-c"].start()
    holder.join(120)
    assert held == [ANSWER], f"{held}\n{timeline.text()}"
    assert world.listed() == ["model-a", "model-b", "model-c", "model-d"]
    print(f"\nshared gateway: a fourth model listed {listed_after:.1f} s after `kubectl apply` (Metacontroller "
          f"sync + the suite's 1 s ConfigMap refresh); the held cold request of model-c completed")


def test_deleting_a_member_keeps_its_backend_past_its_route_and_deleting_the_gateway_lets_a_warm_member_reach_zero(
        world: SharedWorld, cluster: Cluster, timeline: Timeline) -> None:
    """Issue 28's deletions on the real control plane, continuing the world above: a member's backend
    outlives its route (the grace the hook server is given: tests/e2e/conftest.py), and once the
    LLMGateway is gone, a warm member's ScaledObject scales it to zero."""
    from tests.e2e.cluster import ROUTE_GRACE_SECONDS

    if not world.gateway.addresses:
        pytest.skip("continues the previous tests")
    world.timeline = timeline
    for server in world.servers.values():
        server.timeline = timeline

    def routed(model: str) -> bool:
        return f'"{model}"' in str((cluster.get("configmap", names.shared_routes(GATEWAY), NS) or {}).get("data"))

    # model-c is warm (the previous test woke it): delete it while it is routed.
    assert routed("model-c") and (world.replicas("model-c") or 0) >= 1
    cluster.kubectl("-n", NS, "delete", "llmservice", "model-c", "--wait=false")
    world.wait("model-c dropped from the routing table", lambda: not routed("model-c"))
    unrouted = time.monotonic()
    assert cluster.get("deployment", names.backend("model-c"), NS) is not None, "the backend went before its route"
    world.wait("model-c's backend removed after the route grace", lambda: (
        cluster.get("deployment", names.backend("model-c"), NS) is None), timeout=60)
    outlived = time.monotonic() - unrouted
    assert outlived >= ROUTE_GRACE_SECONDS - 1.5, f"the backend outlived its route by {outlived:.1f}s only"
    world.wait("model-c gone", lambda: cluster.get("llmservice", "model-c", NS) is None, timeout=60)

    # model-b warm, then its LLMGateway deleted: nothing can route to it any more, so it must reach zero.
    assert world.client().chat.completions.create(model="model-b", messages=MESSAGES).choices[0].message.content == ANSWER
    assert (world.replicas("model-b") or 0) >= 1
    cluster.kubectl("-n", NS, "delete", "llmgateway", GATEWAY, "--wait=false")
    t0 = time.monotonic()
    world.wait("model-b: AutoscalingReady=False/GatewayNotFound and a ScaledObject without the gone scaler", lambda: (
        conditions(cluster.get("llmservice", "model-b", NS)).get("AutoscalingReady") == "False/GatewayNotFound"
        and [t["type"] for t in (cluster.get("scaledobject", names.scaled_object("model-b"), NS) or {})
             .get("spec", {}).get("triggers", [])] == ["kubernetes-workload"]))
    world.wait("model-b scaled to zero by KEDA", lambda: world.replicas("model-b") == 0, timeout=120)
    to_zero = time.monotonic() - t0
    print(f"\nshared gateway deletions: model-c's backend outlived its route by {outlived:.1f} s (grace "
          f"{ROUTE_GRACE_SECONDS} s); model-b reached zero {to_zero:.1f} s after its LLMGateway was deleted")
