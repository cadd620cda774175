"""Placement that follows the weights (#20): a node-local cache (HostPath, NodeLocalPVC) filled by a
prewarm Job holds the weights on the node that Job ran on, so the backend is pinned there (HostPath;
a NodeLocalPVC's volume pins itself), the pin survives the Job's Pod, and a backend that cannot be
scheduled there says so. And an image-only Noctaya upgrade renders the same backend Pod template."""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import pytest

from hooks.api.runtime import InferenceRuntime
from hooks.controller import observe as obs
from hooks.controller import rollout, sync
from hooks.controller.sync import Outcome, plan_children
from hooks.resources import cache as cache_res
from hooks.resources import prewarm
from hooks.resources.context import RenderContext
from tests.hooks import helpers as h
from tests.hooks.test_prewarm import COMPLETE, backend, cond, jobs, observed_job, service

WEIGHTS_NODE = "serving.noctaya.io/weights-node"
WEIGHTS_JOB = "serving.noctaya.io/weights-job"


def job_pod(job: dict, node: str, phase: str = "Succeeded", suffix: str = "x1", finished: str = "2026-01-01T00:05:00Z") -> dict:
    """The Job's Pod as the API server shows it: labelled by the Job controller, bound to ``node``."""
    name = job["metadata"]["name"]
    exit_code = 0 if phase == "Succeeded" else 1
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{name}-{suffix}", "namespace": h.NAMESPACE, "labels": {
            **job["spec"]["template"]["metadata"]["labels"], "batch.kubernetes.io/job-name": name, "job-name": name}},
        "spec": {"nodeName": node, **copy.deepcopy(job["spec"]["template"]["spec"])},
        "status": {"phase": phase, "containerStatuses": [{"name": "prewarm", "state": {"terminated": {
            "exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error", "finishedAt": finished}}}]},
    }


def own_annotations(deployment: dict) -> dict[str, str]:
    """The Deployment's annotations but the rollout's record of its inputs."""
    found = deployment["metadata"].get("annotations") or {}
    return {k: v for k, v in found.items() if k != rollout.INPUTS_ANNOTATION}


def pin_of(deployment: dict) -> list[str] | None:
    affinity = deployment["spec"]["template"]["spec"].get("affinity")
    if affinity is None:
        return None
    (term,) = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    (field,) = term["matchFields"]
    assert field["key"] == "metadata.name" and field["operator"] == "In"
    return field["values"]


def staged(svc: dict, node: str, cfg: Any = None) -> tuple[dict, list[dict], dict]:
    """First sync, then a resync with the Job complete and its Pod on ``node``: (answer, observed, job)."""
    first = sync.sync(h.sync_request(svc), cfg or h.config())
    (job,) = jobs(first)
    observed = [observed_job(c, i, **COMPLETE) if c["kind"] == "Job" else h.as_observed(c, i)
                for i, c in enumerate(first["children"])]
    answer = sync.sync(h.sync_request({**svc, "status": first["status"]}, children=observed,
                                      pods=[job_pod(job, node)]), cfg or h.config(h.LATER_TIME))
    return answer, observed, job


def settle(svc: dict, answer: dict, job: dict, pods: list[dict]) -> dict:
    """One more sync with every child as the API server would now show it."""
    observed = [observed_job(c, i, **COMPLETE) if c["kind"] == "Job" else h.as_observed(c, i)
                for i, c in enumerate(answer["children"])]
    return sync.sync(h.sync_request({**svc, "status": answer["status"]}, children=observed, pods=pods),
                     h.config(h.LATER_TIME))


@pytest.mark.parametrize("source", ["hf://Qwen/Qwen2.5-7B-Instruct", "oci://registry.example.com/models/qwen@sha256:" + "b" * 64])
def test_a_hostpath_backend_is_pinned_to_the_node_the_job_staged_on(source: str) -> None:
    svc = service("HostPath", source=source)
    answer, _observed, job = staged(svc, "gpu-b")
    b = backend(answer)
    assert pin_of(b) == ["gpu-b"]
    assert own_annotations(b) == {WEIGHTS_JOB: job["metadata"]["name"], WEIGHTS_NODE: "gpu-b"}
    c = cond(answer, "CacheReady")
    assert (c["status"], c["reason"]) == ("True", "Available") and c["message"].endswith("on node gpu-b")
    # A failed earlier attempt on another node does not count: only the succeeded Pod staged the weights.
    first = sync.sync(h.sync_request(svc), h.config())
    observed = [observed_job(c, i, **COMPLETE) if c["kind"] == "Job" else h.as_observed(c, i)
                for i, c in enumerate(first["children"])]
    pods = [job_pod(job, "gpu-a", phase="Failed", suffix="a0", finished="2026-01-01T00:09:00Z"), job_pod(job, "gpu-b")]
    again = sync.sync(h.sync_request({**svc, "status": first["status"]}, children=observed, pods=pods), h.config(h.LATER_TIME))
    assert pin_of(backend(again)) == ["gpu-b"]


def test_the_pin_is_stable_across_resyncs_and_outlives_the_jobs_pod() -> None:
    svc = service("HostPath")
    answer, _observed, job = staged(svc, "gpu-b")
    with_pod = settle(svc, answer, job, [job_pod(job, "gpu-b")])
    without_pod = settle(svc, answer, job, [])  # garbage-collected (its node deleted, or the Pod GC)
    assert json.dumps(with_pod) == json.dumps(without_pod)  # byte-identical for the hook server
    assert json.dumps(settle(svc, without_pod, job, [])) == json.dumps(without_pod)
    assert pin_of(backend(without_pod)) == ["gpu-b"]


def test_a_recorded_pin_of_another_job_is_not_reused_and_a_new_revision_follows_its_own_job() -> None:
    v1 = service("HostPath", revision="v1")
    serving, _observed, v1_job = staged(v1, "gpu-b")
    settled = [observed_job(c, i, **COMPLETE) if c["kind"] == "Job" else h.as_observed(c, i)
               for i, c in enumerate(serving["children"])]
    v2 = service("HostPath", revision="v2")
    staging = sync.sync(h.sync_request({**v2, "status": serving["status"]}, children=settled), h.config(h.LATER_TIME))
    (v2_job,) = [j for j in jobs(staging) if j["metadata"]["name"] != v1_job["metadata"]["name"]]
    assert pin_of(backend(staging)) == ["gpu-b"]  # the running backend is kept as it is meanwhile
    done = [o for o in settled if o["kind"] != "Job"] + [observed_job(v2_job, 99, **COMPLETE)]
    rolled = sync.sync(h.sync_request({**v2, "status": staging["status"]}, children=done,
                                      pods=[job_pod(v2_job, "gpu-a")]), h.config(h.LATER_TIME))
    assert pin_of(backend(rolled)) == ["gpu-a"]
    assert backend(rolled)["metadata"]["annotations"][WEIGHTS_JOB] == v2_job["metadata"]["name"]
    # Without the v2 Job's Pod, the v1 Job's record says nothing about v2: no pin rather than a wrong one.
    unknown = sync.sync(h.sync_request({**v2, "status": staging["status"]}, children=done), h.config(h.LATER_TIME))
    assert pin_of(backend(unknown)) is None


def test_node_local_pvc_records_the_node_without_pinning_and_names_the_job_as_first_consumer() -> None:
    svc = service("NodeLocalPVC")
    first = sync.sync(h.sync_request(svc), h.config())
    (job,) = jobs(first)
    pending = sync.sync(h.sync_request({**svc, "status": first["status"]}, children=[
        h.as_observed(c, i) for i, c in enumerate(first["children"]) if c["kind"] == "PersistentVolumeClaim"]),
        h.config(h.LATER_TIME))
    assert cond(pending, "CacheReady")["reason"] == "PrewarmRunning"
    answer, _observed, _job = staged(svc, "gpu-b")
    b = backend(answer)
    assert pin_of(b) is None  # the volume's own node affinity places the Pod; a zonal disk may move
    assert b["metadata"]["annotations"][WEIGHTS_NODE] == "gpu-b"


def test_the_pending_claim_message_names_the_jobs_pod_as_first_consumer() -> None:
    for prewarmed in (True, False):
        parsed, _ = sync.parse_service(service("NodeLocalPVC", prewarm=prewarmed))
        ctx = RenderContext(service=parsed, runtime=InferenceRuntime.model_validate(h.runtime()),
                            namespace=h.NAMESPACE, config=h.config())
        claim = cache_res.claim(ctx)
        children = {("PersistentVolumeClaim.v1", claim["metadata"]["name"]): h.as_observed(claim, 0)}
        if prewarmed:
            job = prewarm.job(ctx, {"persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}})
            children[("Job.batch/v1", job["metadata"]["name"])] = observed_job(job, 1, active=1)
        out = Outcome()
        plan_children(ctx, obs.Observed(children=children), out, True, {})
        message = out.conditions["CacheReady"].message
        if prewarmed:
            assert "staging" in message and "binds on the node this Job's Pod runs on (its first consumer)" in message
        else:
            assert "binds with the first backend Pod" in message


def test_shared_caches_are_not_pinned() -> None:
    answer, _observed, _job = staged(service("SharedPVC"), "gpu-b")
    b = backend(answer)
    assert pin_of(b) is None and own_annotations(b) == {}


def unschedulable_backend(message: str) -> dict:
    p = h.pod("qwen-backend-7d9f-abcde", scheduled=False)
    p["status"]["conditions"][0]["message"] = message
    return p


def test_a_backend_that_cannot_reach_its_weights_says_so_at_once() -> None:
    svc = service("HostPath")
    answer, _observed, job = staged(svc, "gpu-b")
    said = "0/2 nodes are available: 2 node(s) didn't match Pod's node affinity/selector."
    stuck = settle(svc, answer, job, [unschedulable_backend(said)])  # the Job's Pod is gone with its node
    for ctype in ("CacheReady", "BackendReady"):
        c = cond(stuck, ctype)
        assert (c["status"], c["reason"]) == ("False", "WeightsNodeUnavailable"), c
        assert "node gpu-b" in c["message"] and said in c["message"]
        assert f"kubectl delete job {job['metadata']['name']}" in c["message"]
    assert (cond(stuck, "Ready")["status"], cond(stuck, "Ready")["reason"]) == ("False", "WeightsNodeUnavailable")
    assert pin_of(backend(stuck)) == ["gpu-b"]  # the pin is kept: the weights are nowhere else
    # Once the node is back and the Pod scheduled, the condition clears.
    back = settle(svc, stuck, job, [])
    assert cond(back, "CacheReady")["status"] == "True"


def test_unschedulable_without_a_node_local_pin_stays_unschedulable() -> None:
    svc = service("SharedPVC")
    answer, _observed, job = staged(svc, "gpu-b")
    stuck = settle(svc, answer, job, [unschedulable_backend("0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")])
    assert cond(stuck, "BackendReady")["reason"] == "Unschedulable"
    assert cond(stuck, "CacheReady")["status"] == "True"


def test_the_job_is_placed_like_the_backend_where_the_cache_is_one_nodes() -> None:
    rt = h.runtime(accelerator={"vendor": "nvidia", "nodeSelector": {"pool": "gpu"},
                                "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}]})
    for strategy in ("HostPath", "NodeLocalPVC", "SharedPVC"):
        first = sync.sync(h.sync_request(service(strategy), runtimes=[rt]), h.config())
        (job,) = jobs(first)
        pod_spec = job["spec"]["template"]["spec"]
        if strategy == "SharedPVC":
            assert "nodeSelector" not in pod_spec and "tolerations" not in pod_spec
            continue
        observed = [observed_job(c, i, **COMPLETE) if c["kind"] == "Job" else h.as_observed(c, i)
                    for i, c in enumerate(first["children"])]
        done = sync.sync(h.sync_request({**service(strategy), "status": first["status"]}, runtimes=[rt],
                                        children=observed, pods=[job_pod(job, "gpu-b")]), h.config(h.LATER_TIME))
        backend_spec = backend(done)["spec"]["template"]["spec"]
        assert pod_spec["nodeSelector"] == backend_spec["nodeSelector"] == {"pool": "gpu"}
        assert pod_spec["tolerations"] == backend_spec["tolerations"]


# --- #7: a Noctaya upgrade changes no backend ---------------------------------------------------


@pytest.mark.parametrize("strategy", ["HostPath", "NodeLocalPVC", "SharedPVC"])
@pytest.mark.parametrize("source", ["hf://Qwen/Qwen2.5-7B-Instruct", "oci://registry.example.com/models/qwen@sha256:" + "c" * 64])
def test_an_image_only_upgrade_leaves_the_backend_pod_template_unchanged(strategy: str, source: str) -> None:
    old = h.config()
    new = dataclasses.replace(old, image="ghcr.io/noctaya/noctaya:99.0.0", image_pull_policy="Always")
    svc = service(strategy, source=source)
    before, _observed, job = staged(svc, "gpu-b", old)
    after, _observed, _job = staged(svc, "gpu-b", new)
    t_before, t_after = backend(before)["spec"]["template"], backend(after)["spec"]["template"]
    assert t_before == t_after
    assert cache_res.spec_hash(t_before) == cache_res.spec_hash(t_after)
    assert json.dumps(backend(before)) == json.dumps(backend(after))
    assert "noctaya" not in json.dumps(t_before["spec"]["initContainers"][0]["image"])
    assert t_before["spec"]["initContainers"][0]["image"] == t_before["spec"]["containers"][0]["image"]
    # The Job runs the new image, yet an upgrade is no CacheSpecConflict for it.
    (j_after,) = jobs(sync.sync(h.sync_request(svc), new))
    assert j_after["spec"]["template"]["spec"]["containers"][0]["image"] == "ghcr.io/noctaya/noctaya:99.0.0"
    assert j_after["metadata"]["annotations"] == job["metadata"]["annotations"]


def test_the_rendered_marker_wait_runs_in_a_posix_shell(tmp_path: Any) -> None:
    """The init container's own command, run by this machine's sh with the cache at ``tmp_path``:
    at once when the marker names the revision, a bounded failure with a message otherwise."""
    import shutil
    import subprocess

    sh = shutil.which("sh")
    if sh is None:
        pytest.skip("no sh")
    first = sync.sync(h.sync_request(service("HostPath", revision="v1")), h.config())
    (job,) = jobs(first)
    answer, _observed, _job = staged(service("HostPath", revision="v1"), "gpu-b")
    init = backend(answer)["spec"]["template"]["spec"]["initContainers"][0]
    mount = init["volumeMounts"][0]["mountPath"]
    command = [str(tmp_path) + a[len(mount):] if a.startswith(mount + "/") else a for a in init["command"]]
    command[-1] = "2"  # the timeout, in seconds
    marker, model_dir, source, revision = command[4:8]

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sh, *command[1:]], capture_output=True, text=True, timeout=30)

    missing = run()
    assert missing.returncode == 1 and "not in the cache on this node after 2 s" in missing.stderr
    assert job["metadata"]["name"] in missing.stderr
    from pathlib import Path

    Path(model_dir).mkdir(parents=True)
    Path(marker).write_text(json.dumps({"source": source, "revision": "v0"}))
    assert run().returncode == 1  # another revision's marker is not this one's
    Path(marker).write_text(json.dumps({"source": source, "revision": revision, "files": 4}))
    ok = run()
    assert ok.returncode == 0 and f"{source}@v1 is in the cache; starting the engine" in ok.stdout
