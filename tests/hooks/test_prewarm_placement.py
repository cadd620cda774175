"""Where a node-local cache's prewarm Job may run: only on nodes where the backend can (issue 31).

The Job requests no accelerator, so nothing but its own selector, affinity and tolerations keeps it off
a CPU node; the backend, pinned to the node that holds the weights, could then never start. Every
shipped runtime is rendered through the real sync hook with a node-local cache, and its Job and its
backend are matched against two GPU nodes (labelled as the vendor's node labellers do, or as the
runtime's own selector asks, and tainted as GPU nodes usually are) and a CPU node, with the pool's
approximation of the scheduler's node filters (selector, required node affinity, taints)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from hooks.controller import sync
from hooks.controller.pool_facts import read_node, read_pod
from hooks.resources.cache import SPEC_HASH
from hooks.runtime import vendors
from tests.hooks import helpers as h

RUNTIMES = Path(__file__).resolve().parents[2] / "examples" / "runtimes"


def shipped_runtimes() -> list[dict[str, Any]]:
    found = []
    for path in sorted(RUNTIMES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "InferenceRuntime":
                doc = copy.deepcopy(doc)
                doc["metadata"].update(uid=f"uid-{doc['metadata']['name']}", generation=1)
                found.append(doc)
    return found


def node(name: str, labels: dict[str, str], taints: list[dict[str, str]], units: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **labels}},
            "spec": {"taints": taints}, "status": {"allocatable": {"cpu": "32", **units}}}


def cluster_for(runtime: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Two GPU nodes as this runtime's accelerators come (the vendor's labels, or the runtime's own
    selector; the vendor's taint) and one CPU node."""
    accel = runtime["spec"].get("accelerator") or {}
    adapter = vendors.ADAPTERS[accel.get("vendor", "none")]
    resource = accel.get("resourceName") or adapter.resource_name
    labels = dict(accel.get("nodeSelector") or {})
    if not labels and adapter.node_labels:
        key, value = adapter.node_labels[0]
        labels[key] = value or "present"
    taints = [{"key": adapter.taint_key, "value": "present", "effect": "NoSchedule"}] if adapter.taint_key else []
    units = {resource: "8"} if resource else {}
    gpus = [node(f"gpu-{i}", labels, taints, units) for i in (1, 2)]
    return gpus, node("cpu-1", {}, [], {})


def rendered(runtime: dict[str, Any], strategy: str) -> dict[str, Any]:
    cache: dict[str, Any] = {"strategy": strategy, "prewarm": True}
    if strategy == "HostPath":
        cache["hostPath"] = "/var/lib/noctaya/cache"
    accelerators = 0 if (runtime["spec"].get("accelerator") or {}).get("vendor", "none") == "none" else 1
    svc = h.llmservice(runtime={"name": runtime["metadata"]["name"]}, cache=cache,
                       resources={"accelerators": accelerators},
                       model={"source": "hf://Qwen/Qwen2.5-7B-Instruct"})
    return sync.sync(h.sync_request(svc, runtimes=[runtime]), h.config())


def as_pod(template_spec: dict[str, Any], name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": h.NAMESPACE}, "spec": template_spec, "status": {}}


@pytest.mark.parametrize("strategy", ["NodeLocalPVC", "HostPath"])
@pytest.mark.parametrize("runtime", shipped_runtimes(), ids=lambda r: r["metadata"]["name"])
def test_a_node_local_prewarm_job_can_only_land_where_the_backend_can_run(runtime: dict[str, Any], strategy: str) -> None:
    answer = rendered(runtime, strategy)
    [job] = [c for c in answer["children"] if c["kind"] == "Job"]
    gpus, cpu = cluster_for(runtime)
    accel = runtime["spec"].get("accelerator") or {}
    resource = accel.get("resourceName") or vendors.ADAPTERS[accel.get("vendor", "none")].resource_name or "cpu"
    job_pod = read_pod(as_pod(job["spec"]["template"]["spec"], "prewarm"), resource)
    assert job_pod is not None
    usable = {n["metadata"]["name"] for n in (*gpus, cpu) if job_pod.can_use(read_node(n, resource) or _cpu_node(n))}
    if resource == "cpu":  # a CPU runtime: every node is the backend's
        assert usable == {"gpu-1", "gpu-2", "cpu-1"}
        return
    assert usable == {"gpu-1", "gpu-2"}, f"{runtime['metadata']['name']}: the Job could land on {sorted(usable)}"
    # The CPU node is refused by the Job's own constraints, not only by the backend's device request.
    assert not job_pod.can_use(_cpu_node(cpu))


def _cpu_node(obj: dict[str, Any]):  # noqa: ANN202 - a pool_facts.Node of the CPU resource
    found = read_node(obj, "cpu")
    assert found is not None
    return found


def test_the_job_of_an_older_release_without_the_vendor_labels_is_no_spec_conflict() -> None:
    runtime = next(r for r in shipped_runtimes() if r["metadata"]["name"] == "vllm-nvidia")
    [job] = [c for c in rendered(runtime, "NodeLocalPVC")["children"] if c["kind"] == "Job"]
    assert "affinity" in job["spec"]["template"]["spec"]
    older = copy.deepcopy(job)
    del older["spec"]["template"]["spec"]["affinity"]
    assert older["metadata"]["annotations"][SPEC_HASH] == job["metadata"]["annotations"][SPEC_HASH]
    # A Job's template cannot change: the running one of the older release is kept as it is, staging.
    svc = h.llmservice(runtime={"name": "vllm-nvidia"}, cache={"strategy": "NodeLocalPVC", "prewarm": True},
                       resources={"accelerators": 1}, model={"source": "hf://Qwen/Qwen2.5-7B-Instruct"})
    answer = sync.sync(h.sync_request(svc, runtimes=[runtime], children=[h.as_observed(older, 0)]), h.config())
    [kept] = [c for c in answer["children"] if c["kind"] == "Job"]
    assert "affinity" not in kept["spec"]["template"]["spec"]
    [cache_ready] = [c for c in answer["status"]["conditions"] if c["type"] == "CacheReady"]
    assert cache_ready["reason"] == "PrewarmRunning", cache_ready


def test_a_runtime_with_its_own_selector_gets_no_vendor_labels_and_a_shared_cache_gets_no_placement() -> None:
    runtime = h.runtime(accelerator={"vendor": "nvidia", "nodeSelector": {"gpu": "h100"}})
    spec = next(c for c in rendered(runtime, "NodeLocalPVC")["children"] if c["kind"] == "Job")["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"gpu": "h100"} and "affinity" not in spec
    shared = sync.sync(h.sync_request(h.llmservice(cache={"strategy": "SharedPVC", "prewarm": True}),
                                      runtimes=[h.runtime()]), h.config())
    spec = next(c for c in shared["children"] if c["kind"] == "Job")["spec"]["template"]["spec"]
    assert not {"nodeSelector", "affinity", "tolerations"} & set(spec)
