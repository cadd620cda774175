"""Model delivery through the real controllers: the prewarm Job rendered by the hooks, created by real
Metacontroller, run by the real Job controller (its Pod played by kwok, which "downloads" for a few
seconds and exits 0), and the backend created only once that Job completed; then a revision change
stages beside the running backend and rolls it only when the new Job completed.

The downloader itself is tested end to end against hub protocol servers in tests/prewarm; here the
point is the lifecycle: what exists when, with real Job status driving the hooks."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.cluster import Cluster, Timeline
from tests.e2e.test_lifecycle import RUNTIME, conditions

NS = "e2e-prewarm"
NAME = "staged"

pytestmark = pytest.mark.timeout(600)


def manifest(revision: str) -> str:
    return f"""
apiVersion: serving.noctaya.io/v1alpha1
kind: LLMService
metadata:
  name: {NAME}
  namespace: {NS}
spec:
  model:
    source: hf://Qwen/Qwen2.5-0.5B-Instruct
    revision: {revision}
  runtime:
    name: llamacpp-cpu
  resources:
    accelerators: 0
  cache:
    strategy: HostPath
    hostPath: /var/lib/noctaya/cache
    prewarm: true
"""


def jobs(cluster: Cluster) -> list[dict[str, Any]]:
    out = cluster.kubectl("-n", NS, "get", "jobs", "-l", "serving.noctaya.io/component=prewarm", "-o", "json")
    return json.loads(out.stdout)["items"]


def complete(job: dict[str, Any]) -> bool:
    return any(c.get("type") == "Complete" and c.get("status") == "True" for c in (job.get("status") or {}).get("conditions") or [])


def model_path(cluster: Cluster) -> str | None:
    backend = cluster.get("deployment", f"{NAME}-backend", NS)
    if backend is None:
        return None
    env = backend["spec"]["template"]["spec"]["containers"][0]["env"]
    return next(e["value"] for e in env if e["name"] == "NOCTAYA_MODEL_PATH")


def pods(cluster: Cluster, namespace: str, selector: str) -> list[dict[str, Any]]:
    out = cluster.kubectl("-n", namespace, "get", "pods", "-l", selector, "-o", "json")
    return json.loads(out.stdout)["items"]


def job_pod_node(cluster: Cluster, job: str, namespace: str = NS) -> str | None:
    done = [p for p in pods(cluster, namespace, f"batch.kubernetes.io/job-name={job}") if p["status"].get("phase") == "Succeeded"]
    return done[0]["spec"].get("nodeName") if done else None


def pin_of(deployment: dict[str, Any] | None) -> list[str] | None:
    affinity = (((deployment or {}).get("spec") or {}).get("template") or {}).get("spec", {}).get("affinity")
    if not affinity:
        return None
    terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    return [v for t in terms for f in t.get("matchFields") or [] if f["key"] == "metadata.name" for v in f["values"]]


def test_the_backend_waits_for_the_prewarm_job_and_rolls_only_when_a_new_revision_is_staged(
        cluster: Cluster, timeline: Timeline) -> None:
    if cluster.get("inferenceruntime", "llamacpp-cpu") is None:  # an earlier file may have made (and changed) it
        cluster.kubectl("apply", "--server-side", "-f", str(RUNTIME))
    cluster.install_keda_crds()
    if cluster.get("namespace", NS) is None:
        cluster.kubectl("create", "namespace", NS)

    def snapshot() -> str:
        conds = conditions(cluster.get("llmservice", NAME, NS))
        return (f"CacheReady={conds.get('CacheReady', '?')} Ready={conds.get('Ready', '?')} "
                f"jobs={[(j['metadata']['name'], complete(j)) for j in jobs(cluster)]} model={model_path(cluster)}")

    def wait(what: str, check: Any, timeout: float = 90.0) -> float:
        return timeline.wait(what, check, snapshot, timeout,
                             lambda: [("metacontroller", cluster.log_tail("metacontroller", 15))])

    cluster.kubectl("apply", "--server-side", "-f", "-", stdin=manifest("v1"))
    wait("the prewarm Job is created and no backend", lambda: len(jobs(cluster)) == 1)
    assert cluster.get("deployment", f"{NAME}-backend", NS) is None, timeline.text()
    # Metacontroller writes the status after it created the children: wait for it (kwok's "download"
    # takes 4 s, far longer than that).
    wait("CacheReady=Unknown/PrewarmRunning while the Job runs",
         lambda: conditions(cluster.get("llmservice", NAME, NS)).get("CacheReady") == "Unknown/PrewarmRunning", 30)
    assert cluster.get("deployment", f"{NAME}-backend", NS) is None, timeline.text()
    (first,) = jobs(cluster)
    pod = first["spec"]["template"]["spec"]
    assert pod["containers"][0]["command"][:4] == ["python", "-m", "prewarm", "hub"]
    assert not any("nvidia" in k or "gpu" in k for k in (pod["containers"][0].get("resources") or {}).get("limits", {}))

    created = wait("the Job completes, then the backend is created", lambda: model_path(cluster) is not None)
    assert complete(jobs(cluster)[0]), timeline.text()
    backend = cluster.get("deployment", f"{NAME}-backend", NS)
    assert backend["spec"]["template"]["spec"]["initContainers"][0]["name"] == "wait-for-weights"
    # One node: the Job's Pod ran there, and the HostPath backend is pinned to it.
    assert pin_of(backend) == [job_pod_node(cluster, first["metadata"]["name"])], timeline.text()
    assert model_path(cluster).endswith("/noctaya/hf/Qwen/Qwen2.5-0.5B-Instruct/v1")
    wait("CacheReady=True", lambda: conditions(cluster.get("llmservice", NAME, NS)).get("CacheReady") == "True/Available")
    print(f"\nprewarm: backend created {created:.1f}s after the Job (kwok's download: 4 s)")

    # A new revision: a second Job beside the first, the running backend untouched until it completed.
    cluster.kubectl("apply", "--server-side", "-f", "-", stdin=manifest("v2"))
    wait("the v2 Job is created", lambda: any(j["metadata"]["name"] != first["metadata"]["name"] for j in jobs(cluster)))
    v2_running = [j for j in jobs(cluster) if j["metadata"]["name"] != first["metadata"]["name"] and not complete(j)]
    if v2_running:  # still downloading: the backend must still be the v1 one
        assert model_path(cluster).endswith("/v1"), timeline.text()
    rolled = wait("the backend rolls to v2 once its Job completed", lambda: (model_path(cluster) or "").endswith("/v2"))
    (only,) = jobs(cluster)  # the v1 Job is removed once the backend left it; its files stay
    assert only["metadata"]["name"] != first["metadata"]["name"] and complete(only), timeline.text()
    print(f"prewarm: revision change rolled the backend {rolled:.1f}s after the v2 Job appeared")
    cluster.kubectl("-n", NS, "delete", "llmservice", NAME, "--wait=true", "--timeout=60s")


# --- placement that follows the weights: two GPU nodes, the cache on one of them -----------------

GPU_NS = "e2e-placement"
GPU_NAME = "pinned"
GPU_NODES = ("e2e-gpu-a", "e2e-gpu-b")
POOL = "e2e.noctaya.io/pool"
GPU_RUNTIME = f"""
apiVersion: serving.noctaya.io/v1alpha1
kind: InferenceRuntime
metadata:
  name: e2e-gpu
spec:
  engine: vllm
  image: registry.example/vllm-stand-in:1
  args: ["--model", "$(NOCTAYA_MODEL_PATH)", "--port", "$(NOCTAYA_PORT)"]
  port: 8000
  accelerator:
    vendor: nvidia
    nodeSelector:
      {POOL}: delivery
"""
GPU_SERVICE = f"""
apiVersion: serving.noctaya.io/v1alpha1
kind: LLMService
metadata:
  name: {GPU_NAME}
  namespace: {GPU_NS}
spec:
  model:
    source: hf://Qwen/Qwen2.5-0.5B-Instruct
    revision: v1
  runtime:
    name: e2e-gpu
  resources:
    accelerators: 1
  scaling:
    min: 1
  cache:
    strategy: HostPath
    hostPath: /var/lib/noctaya/cache
    prewarm: true
"""


def test_node_local_weights_pin_the_backend_to_their_node_and_a_lost_node_is_named_within_a_minute(
        cluster: Cluster, timeline: Timeline) -> None:
    """Two tainted GPU nodes (the single-node case is the test above): the prewarm Job (placed like the
    backend: the runtime's nodeSelector and the vendor's toleration) lands on one; the backend is
    pinned there and runs there, not on the other GPU node whose cache is empty. Then that node is
    deleted: the replacement backend Pod cannot be scheduled, and the LLMService says which node holds
    the weights well within a minute; the pin holds after the Pod GC removed the Job's Pod."""
    cluster.install_keda_crds()
    taint = [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]
    for node in GPU_NODES:
        cluster.add_node(node, gpus=2, labels={POOL: "delivery"}, taints=taint)
    if cluster.get("namespace", GPU_NS) is None:
        cluster.kubectl("create", "namespace", GPU_NS)
    cluster.kubectl("apply", "--server-side", "-f", "-", stdin=GPU_RUNTIME)
    backend_name = f"{GPU_NAME}-backend"

    def llm() -> dict[str, Any] | None:
        return cluster.get("llmservice", GPU_NAME, GPU_NS)

    def backend_pods() -> list[dict[str, Any]]:
        return pods(cluster, GPU_NS, "serving.noctaya.io/component=backend")

    def snapshot() -> str:
        conds = conditions(llm())
        return (f"CacheReady={conds.get('CacheReady', '?')} BackendReady={conds.get('BackendReady', '?')} "
                f"pin={pin_of(cluster.get('deployment', backend_name, GPU_NS))} "
                f"backend pods={[(p['metadata']['name'], p['spec'].get('nodeName'), p['status'].get('phase')) for p in backend_pods()]} "
                f"prewarm pods={[(p['metadata']['name'], p['spec'].get('nodeName')) for p in pods(cluster, GPU_NS, 'serving.noctaya.io/component=prewarm')]}")

    def wait(what: str, check: Any, timeout: float = 90.0) -> float:
        return timeline.wait(what, check, snapshot, timeout,
                             lambda: [("metacontroller", cluster.log_tail("metacontroller", 15))])

    deleted: list[str] = []
    try:
        cluster.kubectl("apply", "--server-side", "-f", "-", stdin=GPU_SERVICE)
        wait("the prewarm Job is created", lambda: len(pods(cluster, GPU_NS, "serving.noctaya.io/component=prewarm")) == 1)
        out = cluster.kubectl("-n", GPU_NS, "get", "jobs", "-o", "json")
        (job,) = json.loads(out.stdout)["items"]
        job_name = job["metadata"]["name"]
        job_pod_spec = job["spec"]["template"]["spec"]
        assert job_pod_spec["nodeSelector"] == {POOL: "delivery"}, job_pod_spec  # placed like the backend
        wait("the Job's Pod succeeds on a GPU node", lambda: job_pod_node(cluster, job_name, GPU_NS) is not None)
        weights = job_pod_node(cluster, job_name, GPU_NS)
        assert weights in GPU_NODES, snapshot()
        wait("the backend is created, pinned to the weights' node",
             lambda: pin_of(cluster.get("deployment", backend_name, GPU_NS)) == [weights])
        backend = cluster.get("deployment", backend_name, GPU_NS)
        annotations = backend["metadata"]["annotations"]
        assert annotations["serving.noctaya.io/weights-node"] == weights
        assert annotations["serving.noctaya.io/weights-job"] == job_name
        wait("the backend Pod runs on that node", lambda: any(
            p["spec"].get("nodeName") == weights and p["status"].get("phase") == "Running" for p in backend_pods()))
        assert all(p["spec"].get("nodeName") == weights for p in backend_pods()), snapshot()
        wait("CacheReady names the node", lambda: (llm() or {}).get("status", {}).get("conditions") and any(
            c["type"] == "CacheReady" and c["status"] == "True" and c["message"].endswith(f"on node {weights}")
            for c in llm()["status"]["conditions"]))

        # The node holding the weights is gone; its Pods go with it (what the Pod GC does to a
        # deleted node's Pods; the backend's Pod is removed at once here, as a drain would).
        cluster.kubectl("delete", "node", weights, "--wait=true")
        deleted.append(weights)
        lost = time.monotonic()
        for p in backend_pods():
            cluster.kubectl("-n", GPU_NS, "delete", "pod", p["metadata"]["name"], "--force", "--grace-period=0",
                            "--ignore-not-found")

        def names_the_node() -> bool:
            conds = {c["type"]: c for c in ((llm() or {}).get("status") or {}).get("conditions") or []}
            cache, backend_cond = conds.get("CacheReady") or {}, conds.get("BackendReady") or {}
            return (cache.get("reason") == "WeightsNodeUnavailable" and f"node {weights}" in cache.get("message", "")
                    and backend_cond.get("reason") == "WeightsNodeUnavailable")

        wait("CacheReady and BackendReady say WeightsNodeUnavailable, naming the node", names_the_node, 60)
        took = time.monotonic() - lost
        assert took < 60, timeline.text()
        print(f"\nplacement: the lost weights node was named {took:.1f}s after it was deleted")
        other = next(n for n in GPU_NODES if n != weights)
        assert all(p["spec"].get("nodeName") in (None, "") for p in backend_pods()), "the backend moved off its weights"
        assert cluster.get("node", other) is not None

        # The Pod GC removes the deleted node's Job Pod (40 s quarantine): the pin and the condition hold.
        wait("the Job's Pod is garbage-collected", lambda: not pods(cluster, GPU_NS, f"batch.kubernetes.io/job-name={job_name}"), 120)
        time.sleep(3)
        assert pin_of(cluster.get("deployment", backend_name, GPU_NS)) == [weights], snapshot()
        assert names_the_node(), snapshot()
    finally:
        cluster.kubectl("-n", GPU_NS, "delete", "llmservice", GPU_NAME, "--wait=true", "--timeout=60s", check=False)
        for node in GPU_NODES:
            if node not in deleted:
                cluster.kubectl("delete", "node", node, "--ignore-not-found", check=False)
        cluster.kubectl("delete", "inferenceruntime", "e2e-gpu", "--ignore-not-found", check=False)


SHIPPED_RUNTIMES = Path(__file__).resolve().parents[2] / "examples" / "runtimes"
SPREAD_NS = "e2e-job-placement"
SPREAD_GPU_NODES = ("e2e-spread-gpu-a", "e2e-spread-gpu-b")
SPREAD_CPU_NODE = "e2e-spread-cpu"


def test_a_node_local_prewarm_job_of_a_shipped_tolerations_only_runtime_lands_only_on_gpu_nodes(
        cluster: Cluster, timeline: Timeline) -> None:
    """The shipped vllm-nvidia runtime tolerates the GPU taint and names no node selector: only the
    backend's GPU request keeps its Pods off CPU nodes, and the prewarm Job requests none. Two GPU nodes
    (labelled nvidia.com/gpu.present=true by NVIDIA's GPU feature discovery, tainted nvidia.com/gpu) and
    a CPU node (untainted, and the suite's kwok node besides): every Job of four node-local models,
    scheduled by the real kube-scheduler, runs on a GPU node (without the vendor's node labels the
    scheduler placed Jobs on the untainted nodes), and each backend follows its weights there."""
    cluster.install_keda_crds()
    taint = [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]
    for node in SPREAD_GPU_NODES:
        cluster.add_node(node, gpus=4, labels={"nvidia.com/gpu.present": "true"}, taints=taint)
    cluster.add_node(SPREAD_CPU_NODE)
    if cluster.get("namespace", SPREAD_NS) is None:
        cluster.kubectl("create", "namespace", SPREAD_NS)
    runtime = yaml.safe_load((SHIPPED_RUNTIMES / "vllm-nvidia.yaml").read_text())
    assert "nodeSelector" not in runtime["spec"]["accelerator"], "the shipped runtime is tolerations-only no more"
    cluster.kubectl("apply", "--server-side", "-f", str(SHIPPED_RUNTIMES / "vllm-nvidia.yaml"))
    names = [f"spread-{i}" for i in range(4)]
    try:
        for name in names:
            cluster.kubectl("apply", "--server-side", "-f", "-", stdin=GPU_SERVICE.replace(
                f"name: {GPU_NAME}", f"name: {name}").replace(f"namespace: {GPU_NS}", f"namespace: {SPREAD_NS}").replace(
                "name: e2e-gpu", f"name: {runtime['metadata']['name']}"))

        def placed() -> dict[str, str | None]:
            out = {}
            for job in json.loads(cluster.kubectl("-n", SPREAD_NS, "get", "jobs", "-o", "json").stdout)["items"]:
                owner = job["metadata"]["labels"].get("serving.noctaya.io/llmservice")
                out[owner] = job_pod_node(cluster, job["metadata"]["name"], SPREAD_NS)
            return out

        timeline.wait("every model's prewarm Job succeeded", lambda: len(placed()) == len(names) and all(placed().values()),
                      lambda: str(placed()), 120, lambda: [("metacontroller", cluster.log_tail("metacontroller", 15))])
        where = placed()
        timeline.note(f"prewarm Jobs ran on: {where}")
        assert set(where.values()) <= set(SPREAD_GPU_NODES), f"a Job ran where no backend can: {where}"
        for name in names:
            timeline.wait(f"{name}: the backend pinned to its weights' node", lambda n=name: pin_of(
                cluster.get("deployment", f"{n}-backend", SPREAD_NS)) == [where[n]], lambda: str(where), 60,
                lambda: [("metacontroller", cluster.log_tail("metacontroller", 15))])
        print(f"\nnode-local prewarm Jobs of the shipped vllm-nvidia runtime (2 GPU nodes, 1 CPU node): {sorted(where.values())}")
    finally:
        cluster.kubectl("delete", "namespace", SPREAD_NS, "--wait=true", "--timeout=90s", check=False)
        for node in (*SPREAD_GPU_NODES, SPREAD_CPU_NODE):
            cluster.kubectl("delete", "node", node, "--ignore-not-found", check=False)
        cluster.kubectl("delete", "inferenceruntime", runtime["metadata"]["name"], "--ignore-not-found", check=False)
