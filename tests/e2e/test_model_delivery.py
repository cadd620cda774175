"""Model delivery through the real controllers: the prewarm Job rendered by the hooks, created by real
Metacontroller, run by the real Job controller (its Pod played by kwok, which "downloads" for a few
seconds and exits 0), and the backend created only once that Job completed; then a revision change
stages beside the running backend and rolls it only when the new Job completed.

The downloader itself is tested end to end against hub protocol servers in tests/prewarm; here the
point is the lifecycle: what exists when, with real Job status driving the hooks."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.e2e.cluster import Cluster, Timeline
from tests.e2e.test_lifecycle import RUNTIME, conditions
from tests.kube.conftest import crd_names, wait_established
from tests.third_party import ThirdPartyUnavailable, module_crds

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


def test_the_backend_waits_for_the_prewarm_job_and_rolls_only_when_a_new_revision_is_staged(
        cluster: Cluster, timeline: Timeline) -> None:
    if cluster.get("inferenceruntime", "llamacpp-cpu") is None:  # an earlier file may have made (and changed) it
        cluster.kubectl("apply", "--server-side", "-f", str(RUNTIME))
    try:
        keda = [p for p in module_crds() if p.name.startswith("keda.sh_")]
    except ThirdPartyUnavailable as exc:
        pytest.skip(str(exc))
    cluster.kubectl("apply", "--server-side", *[a for p in keda for a in ("-f", str(p))])
    wait_established(cluster.plane, crd_names(cluster.plane, *keda))
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
