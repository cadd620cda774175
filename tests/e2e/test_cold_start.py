"""A cold start made visible, through real Metacontroller, the real scheduler and the real API server.

The backend Pod is real (the real ReplicaSet controller creates it, the real scheduler binds it once a
node label lets it); its status is then written through the status subresource with timestamps this
test chooses, the way a kubelet would report a start that took minutes (kwok leaves Pods in this
namespace alone, see kwok-stages.yaml). At each step the LLMService must show the right live phase
since the right time; once Ready, `lastColdStart` must carry exactly the durations chosen; and a
resync of the unchanged world must leave the LLMService untouched (no status write at all)."""

from __future__ import annotations

import copy
import json
import time
from datetime import datetime, timedelta
from typing import Any

import pytest
import yaml

from tests.e2e.cluster import Cluster, Timeline
from tests.e2e.test_lifecycle import RUNTIME, conditions

NS = "e2e-coldstart"
NAME = "timed"
NODE = "e2e-node-1"
GATE = "e2e.noctaya.io/coldstart"

pytestmark = pytest.mark.timeout(300)

MANIFEST = f"""
apiVersion: serving.noctaya.io/v1alpha1
kind: LLMService
metadata:
  name: {NAME}
  namespace: {NS}
spec:
  model:
    source: hf://Qwen/Qwen2.5-0.5B-Instruct
    revision: v1
  runtime:
    name: llamacpp-coldstart
  resources:
    accelerators: 0
  scaling:
    min: 1
  cache:
    strategy: HostPath
    hostPath: /var/lib/noctaya/cache
    prewarm: true
"""

# Seconds after the Pod's creation: bound 12, weights wait 13..43, initialized 44, engine started 71,
# Ready 154. What the status must then say, phase by phase.
BREAKDOWN = {"scheduling": "12s", "initialization": "2s", "weightsWait": "30s", "imagePull": "27s",
             "modelLoad": "83s", "total": "154s"}


def stamp(base: datetime, seconds: int) -> str:
    return (base + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


def kubelet_status(pod: dict[str, Any], base: datetime, step: str) -> dict[str, Any]:
    """The Pod's status as a kubelet would report it at `step` of the chosen start."""
    def t(seconds: int) -> str:
        return stamp(base, seconds)
    ready = step == "Ready"
    started = step in ("LoadingModel", "Ready")
    initialized = step in ("PullingImage", "LoadingModel", "Ready")
    wait_state = ({"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": t(13), "finishedAt": t(43)}}
                  if initialized else {"running": {"startedAt": t(13)}})
    spec = pod["spec"]
    return {
        "phase": "Running" if started else "Pending",
        "hostIP": "10.0.0.1",
        "startTime": t(12),
        "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": t(12)},
            {"type": "Initialized", "status": "True" if initialized else "False", "lastTransitionTime": t(44 if initialized else 12)},
            {"type": "ContainersReady", "status": "True" if ready else "False", "lastTransitionTime": t(154 if ready else 12)},
            {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": t(154 if ready else 12)},
        ],
        "initContainerStatuses": [{"name": c["name"], "image": c["image"], "imageID": "", "ready": initialized,
                                   "restartCount": 0, "started": not initialized, "state": wait_state}
                                  for c in spec["initContainers"]],
        "containerStatuses": [{"name": c["name"], "image": c["image"], "imageID": "", "ready": ready, "restartCount": 0,
                               "started": ready,
                               "state": {"running": {"startedAt": t(71)}} if started else {"waiting": {"reason": "PodInitializing"}}}
                              for c in spec["containers"]],
    }


def test_a_cold_start_shows_each_phase_live_and_keeps_its_breakdown_stable_across_resyncs(
        cluster: Cluster, timeline: Timeline) -> None:
    cluster.install_keda_crds()
    # A runtime whose Pods need a node label no node has yet: the Pod waits in Scheduling until the
    # test adds it (a cluster with no free accelerator node, then the node autoscaler).
    runtime = yaml.safe_load(RUNTIME.read_text())
    runtime["metadata"] = {"name": "llamacpp-coldstart"}
    runtime["spec"]["accelerator"]["nodeSelector"] = {GATE: "open"}
    cluster.kubectl("apply", "--server-side", "-f", "-", stdin=json.dumps(runtime))
    if cluster.get("namespace", NS) is None:
        cluster.kubectl("create", "namespace", NS)

    def service() -> dict[str, Any]:
        return cluster.get("llmservice", NAME, NS) or {}

    def backend_pod() -> dict[str, Any] | None:
        out = cluster.kubectl("-n", NS, "get", "pods", "-l", "serving.noctaya.io/component=backend", "-o", "json")
        items = [p for p in json.loads(out.stdout)["items"] if not p["metadata"].get("deletionTimestamp")]
        return items[0] if items else None

    def snapshot() -> str:
        status = service().get("status") or {}
        pod = backend_pod() or {}
        return (f"phase={status.get('phase')} since={status.get('phaseSince')} last={status.get('lastColdStart')} "
                f"Ready={conditions(service()).get('Ready')} pod={(pod.get('metadata') or {}).get('name')} "
                f"node={(pod.get('spec') or {}).get('nodeName')}")

    def wait(what: str, check: Any, timeout: float = 60.0) -> float:
        return timeline.wait(what, check, snapshot, timeout, lambda: [("metacontroller", cluster.log_tail("metacontroller", 15))])

    def shows(phase: str, since: str) -> bool:
        status = service().get("status") or {}
        return status.get("phase") == phase and status.get("phaseSince") == since

    def prewarm_bound() -> bool:
        out = cluster.kubectl("-n", NS, "get", "pods", "-l", "serving.noctaya.io/component=prewarm", "-o", "json")
        return any(p["spec"].get("nodeName") for p in json.loads(out.stdout)["items"])

    try:
        # The prewarm Job's Pod gets the same node selector (the HostPath cache is on that node): the
        # label is there while it is scheduled, and gone before the backend Pod comes (kwok's
        # "download" takes 4 s).
        cluster.kubectl("label", "node", NODE, f"{GATE}=open", "--overwrite")
        cluster.kubectl("apply", "--server-side", "-f", "-", stdin=MANIFEST)
        wait("the prewarm Job's Pod is bound", prewarm_bound, 30)
        cluster.kubectl("label", "node", NODE, f"{GATE}-")
        assert backend_pod() is None, timeline.text()
        wait("the prewarm Job completes and the backend Pod is created", lambda: backend_pod() is not None, 60)
        pod = backend_pod()
        assert pod is not None
        created = pod["metadata"]["creationTimestamp"]
        base = datetime.fromisoformat(created.replace("Z", "+00:00"))
        wait("Scheduling since the Pod's creation (no node has the label)", lambda: shows("Scheduling", created))

        cluster.kubectl("label", "node", NODE, f"{GATE}=open")
        wait("the real scheduler binds the Pod", lambda: bool(((backend_pod() or {}).get("spec") or {}).get("nodeName")))
        for step, since in (("Initializing", 12), ("PullingImage", 44), ("LoadingModel", 71), ("Ready", 154)):
            live = backend_pod()
            assert live is not None
            body = copy.deepcopy(live)
            body["status"] = kubelet_status(live, base, step)
            cluster.kubectl("replace", "--subresource=status", "-f", "-", stdin=json.dumps(body))
            wait(f"{step} since creation+{since}s", lambda s=step, t=since: shows(s, stamp(base, t)))  # type: ignore[misc]

        record = service()["status"].get("lastColdStart")
        assert record == {"pod": pod["metadata"]["name"], "startedAt": created, "readyAt": stamp(base, 154), **BREAKDOWN}, \
            timeline.text()
        columns = cluster.kubectl("-n", NS, "get", "llmservice", NAME).stdout.splitlines()
        header = columns[0].split()
        assert header[:8] == ["NAME", "RUNTIME", "REPLICAS", "READY", "PHASE", "SINCE", "LAST", "COLD"], columns
        assert columns[1].split()[4] == "Ready" and columns[1].split()[-2] == "154s", columns

        # A resync of an unchanged, settled world writes nothing. Settled first: after the Pod turned
        # Ready the ReplicaSet and Deployment controllers still update their status, and each update
        # legitimately resyncs and rewrites the LLMService's conditions (BackendReady turns True). So:
        # wait for BackendReady=True and for a whole sync of the parent that wrote nothing, then force
        # another full sync and require that it, too, wrote nothing.
        touches = iter(range(1, 1_000_000))

        def full_sync() -> None:
            """Touch the Pod (a related object) and return once a sync of this parent that began after
            the touch has finished, status write included. Metacontroller works on one parent at a
            time: with at most one sync in flight at the touch, the second sync answered after it began
            after the touch, and the third began only once the second was done writing."""
            target = cluster.hook_calls_for("llmservice_sync", f"{NS}/{NAME}") + 3
            while (seen := cluster.hook_calls_for("llmservice_sync", f"{NS}/{NAME}")) < target:
                cluster.kubectl("-n", NS, "annotate", "pod", pod["metadata"]["name"], "--overwrite",
                                f"e2e.noctaya.io/touched={next(touches)}")
                wait(f"Metacontroller syncs {NS}/{NAME} (call {seen + 1})",
                     lambda n=seen: cluster.hook_calls_for("llmservice_sync", f"{NS}/{NAME}") > n, 30)  # type: ignore[misc]

        wait("BackendReady=True (the Deployment counts the ready Pod)",
             lambda: conditions(service()).get("BackendReady", "").startswith("True/"))
        deadline = time.monotonic() + 90
        while True:
            version = service()["metadata"]["resourceVersion"]
            full_sync()
            if service()["metadata"]["resourceVersion"] == version:
                timeline.note(f"settled: resourceVersion {version} unchanged across a full sync")
                break
            assert time.monotonic() < deadline, f"the LLMService never settled\n{timeline.text()}"

        before = service()
        full_sync()
        after = service()
        assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"], timeline.text()
        assert json.dumps(after["status"], sort_keys=True) == json.dumps(before["status"], sort_keys=True)
        print(f"\ncold start: {record}")
    finally:
        cluster.kubectl("label", "node", NODE, f"{GATE}-", check=False)
        cluster.kubectl("-n", NS, "delete", "llmservice", NAME, "--wait=true", "--timeout=60s", check=False)
        cluster.kubectl("delete", "inferenceruntime", "llamacpp-coldstart", "--wait=true", "--timeout=30s", check=False)
