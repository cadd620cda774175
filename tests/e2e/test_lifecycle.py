"""The LLMService lifecycle through real Metacontroller (dynamic apply, discovery, finalizers, resync)
and Noctaya's hook server, installed with `kubectl apply --server-side -k metacontroller/`.

The tests share one cluster and run in file order, each bounded in time; each prints the timeline of
conditions, replica counts and hook calls it saw when it fails. The measured figures are printed
(`-s`) and recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.e2e.cluster import Cluster, Timeline
from tests.kube.apiserver import REPO_ROOT
from tests.kube.conftest import crd_names, wait_established
from tests.third_party import ThirdPartyUnavailable, module_crds

NS = "models"
NAME = "tiny"
RUNTIME = REPO_ROOT / "examples" / "runtimes" / "llamacpp-cpu.yaml"
KEDA_CRD_PREFIX = "keda.sh_"

LLMSERVICE = f"""
apiVersion: serving.noctaya.io/v1alpha1
kind: LLMService
metadata:
  name: {NAME}
  namespace: {NS}
spec:
  model:
    source: hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF
    servedName: tiny
  runtime:
    name: llamacpp-cpu
  resources:
    accelerators: 0
    cpu: "1"
    memory: 2Gi
  scaling:
    min: 0
    max: 1
  cache:
    strategy: None
"""

pytestmark = pytest.mark.timeout(600)


def conditions(obj: dict[str, Any] | None) -> dict[str, str]:
    conds = ((obj or {}).get("status") or {}).get("conditions") or []
    return {c["type"]: f"{c['status']}/{c.get('reason', '')}" for c in conds}


def snapshot(cluster: Cluster) -> str:
    svc = cluster.get("llmservice", NAME, NS)
    backend = cluster.get("deployment", f"{NAME}-backend", NS)
    conds = conditions(svc)
    replicas = (backend or {}).get("spec", {}).get("replicas", "-") if backend else "absent"
    calls = {k: int(v) for k, v in cluster.hook_calls().items() if v}
    return (f"Ready={conds.get('Ready', '?')} Autoscaling={conds.get('AutoscalingReady', '?')} "
            f"Runtime={conds.get('RuntimeResolved', '?')} backend.replicas={replicas} hook calls={calls}")


def wait_for(cluster: Cluster, timeline: Timeline, what: str, check: Callable[[], bool], timeout: float = 60.0) -> float:
    """Poll ``check`` until true; note every change of the world on the way; seconds waited."""
    return timeline.wait(what, check, lambda: snapshot(cluster), timeout,
                         lambda: [("metacontroller", cluster.log_tail("metacontroller", 15))])


def test_runtime_is_accepted_by_the_real_controller(cluster: Cluster, timeline: Timeline) -> None:
    cluster.kubectl("apply", "--server-side", "-f", str(RUNTIME))
    cluster.kubectl("create", "namespace", NS)

    def accepted() -> bool:
        runtime = cluster.get("inferenceruntime", "llamacpp-cpu")
        return conditions(runtime).get("Accepted", "").startswith("True")

    wait_for(cluster, timeline, "InferenceRuntime Accepted", accepted)


def test_without_keda_no_backend_then_keda_arrives_and_backend_starts_at_zero(cluster: Cluster, timeline: Timeline) -> None:
    cluster.kubectl("apply", "--server-side", "-f", "-", stdin=LLMSERVICE)

    def keda_missing() -> bool:
        return conditions(cluster.get("llmservice", NAME, NS)).get("AutoscalingReady") == "False/KEDANotInstalled"

    wait_for(cluster, timeline, "AutoscalingReady=False/KEDANotInstalled", keda_missing)
    assert cluster.get("deployment", f"{NAME}-gateway", NS) is not None
    assert cluster.get("deployment", f"{NAME}-backend", NS) is None  # nothing could scale it

    try:
        keda = [p for p in module_crds() if p.name.startswith(KEDA_CRD_PREFIX)]
    except ThirdPartyUnavailable as exc:
        pytest.skip(str(exc))
    cluster.kubectl("apply", "--server-side", *[a for p in keda for a in ("-f", str(p))])
    wait_established(cluster.plane, crd_names(cluster.plane, *keda))
    timeline.note("KEDA CRDs installed")

    def backend_created() -> bool:
        return cluster.get("deployment", f"{NAME}-backend", NS) is not None

    waited = wait_for(cluster, timeline, "backend Deployment created after KEDA's CRDs", backend_created)
    backend = cluster.get("deployment", f"{NAME}-backend", NS)
    # Created idle: the API server's default of 1 would book a Pod before any demand.
    assert backend["spec"]["replicas"] == 0, timeline.text()
    print(f"\nKEDA CRDs installed -> backend Deployment created: {waited:.1f}s (spec.replicas 0)")

    def scaled_object() -> bool:
        return cluster.get("scaledobject", f"{NAME}-backend", NS) is not None

    wait_for(cluster, timeline, "ScaledObject attached by the autoscaling controller", scaled_object)


def _touch(cluster: Cluster, value: str) -> None:
    """A metadata change: Metacontroller syncs the parent at once."""
    cluster.kubectl("-n", NS, "annotate", "--overwrite", "llmservice", NAME, f"e2e.noctaya.io/touch={value}")


@pytest.mark.parametrize("count", [1, 0])
def test_replicas_set_by_keda_survive_every_sync(cluster: Cluster, timeline: Timeline, count: int) -> None:
    # What KEDA does: write the scale subresource. Later syncs must keep the count (Metacontroller's
    # merge overwrites any scalar the hook returns, and deletes a field once returned then omitted).
    cluster.kubectl("-n", NS, "scale", "deployment", f"{NAME}-backend", f"--replicas={count}")
    timeline.note(f"scaled backend to {count} (as KEDA would)")
    before = cluster.hook_calls().get("llmservice_sync", 0)
    # One touch at a time: touches in quick succession coalesce into one sync in Metacontroller's queue.
    for i in range(3):
        _touch(cluster, f"{count}-{i}")
        wait_for(cluster, timeline, f"sync {i + 1} of 3",
                 lambda i=i: cluster.hook_calls().get("llmservice_sync", 0) >= before + i + 1)
    time.sleep(1.0)  # let Metacontroller apply the last answer
    backend = cluster.get("deployment", f"{NAME}-backend", NS)
    timeline.note(snapshot(cluster))
    assert backend["spec"]["replicas"] == count, timeline.text()


def test_runtime_gone_keeps_every_child_and_says_why(cluster: Cluster, timeline: Timeline) -> None:
    def child_names() -> set[str]:
        out = cluster.kubectl("-n", NS, "get", "deployments,services", "-o", "name").stdout
        return set(out.split())

    before = child_names()
    cluster.kubectl("-n", NS, "patch", "llmservice", NAME, "--type=merge", "-p", '{"spec":{"runtime":{"name":"no-such-runtime"}}}')

    def not_found() -> bool:
        return conditions(cluster.get("llmservice", NAME, NS)).get("RuntimeResolved", "").endswith("RuntimeNotFound")

    wait_for(cluster, timeline, "RuntimeResolved=False/RuntimeNotFound", not_found)
    time.sleep(1.0)
    assert child_names() == before, timeline.text()  # never destructive
    cluster.kubectl("-n", NS, "patch", "llmservice", NAME, "--type=merge", "-p", '{"spec":{"runtime":{"name":"llamacpp-cpu"}}}')
    wait_for(cluster, timeline, "runtime resolved again",
             lambda: conditions(cluster.get("llmservice", NAME, NS)).get("RuntimeResolved", "").startswith("True"))


def test_runtime_change_rolls_the_backend_and_keeps_its_replicas(cluster: Cluster, timeline: Timeline) -> None:
    cluster.kubectl("-n", NS, "scale", "deployment", f"{NAME}-backend", "--replicas=1")
    before = cluster.get("deployment", f"{NAME}-backend", NS)
    cluster.kubectl("patch", "inferenceruntime", "llamacpp-cpu", "--type=json",
                    "-p", '[{"op":"add","path":"/spec/args/-","value":"--ctx-size=4096"}]')
    timeline.note("runtime args changed: --ctx-size=4096 added")

    def rolled() -> bool:
        backend = cluster.get("deployment", f"{NAME}-backend", NS)
        args = backend["spec"]["template"]["spec"]["containers"][0].get("args", [])
        return "--ctx-size=4096" in args

    waited = wait_for(cluster, timeline, "backend Pod template carries the new runtime args", rolled)
    after = cluster.get("deployment", f"{NAME}-backend", NS)
    assert after["metadata"]["generation"] > before["metadata"]["generation"]  # a rollout, not a new object
    assert after["metadata"]["uid"] == before["metadata"]["uid"]
    assert after["spec"]["replicas"] == 1, timeline.text()  # KEDA's count survives the roll
    print(f"\nInferenceRuntime change -> backend template updated: {waited:.1f}s")
    cluster.kubectl("-n", NS, "scale", "deployment", f"{NAME}-backend", "--replicas=0")


def test_no_hook_hot_loop_while_idle(cluster: Cluster, timeline: Timeline) -> None:
    # Let the last change settle, then count calls over one idle minute (the controllers resync every 60 s).
    time.sleep(5.0)
    before = cluster.hook_calls()
    timeline.note(f"hook calls before the idle minute: {before}")
    time.sleep(60.0)
    after = cluster.hook_calls()
    per_hook = {hook: after.get(hook, 0) - before.get(hook, 0) for hook in after}
    timeline.note(f"calls during the idle minute: {per_hook}")
    print(f"\nhook calls per idle minute (1 LLMService, 1 InferenceRuntime): {per_hook}")
    for hook, calls in per_hook.items():
        assert calls <= 2, f"{hook}: {calls} calls in an idle minute\n{timeline.text()}"


def test_delete_finalizes_and_leaves_no_finalizer(cluster: Cluster, timeline: Timeline) -> None:
    t0 = time.monotonic()
    cluster.kubectl("-n", NS, "delete", "llmservice", NAME, "--wait=false")
    waited = wait_for(cluster, timeline, "LLMService gone", lambda: cluster.get("llmservice", NAME, NS) is None, timeout=120)
    assert cluster.hook_calls().get("llmservice_finalize", 0) >= 1, timeline.text()
    print(f"\nLLMService delete -> finalized and gone: {waited:.1f}s")
    assert time.monotonic() - t0 < 120
