"""The prewarm Job and what it gates, through the real sync hook: every cache strategy × source,
create-once conflicts, running / failed / succeeded Jobs, a revision change, missing credentials."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from hooks.controller import sync
from hooks.resources import cache as cache_res
from tests.hooks import helpers as h

STRATEGIES = ["NodeLocalPVC", "SharedPVC", "HostPath", "None"]
SOURCES = {
    "hf": "hf://Qwen/Qwen2.5-7B-Instruct",
    "modelscope": "modelscope://qwen/Qwen2.5-7B-Instruct",
    "oci": "oci://registry.example.com/models/qwen@sha256:" + "a" * 64,
    "pvc": "pvc://weights/qwen",
}
SENTINEL = "hf_SENTINEL_hooks_n3v3r_l34k"


def cache_spec(strategy: str, prewarm: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {"strategy": strategy, "prewarm": prewarm}
    if strategy == "HostPath":
        spec["hostPath"] = "/var/lib/noctaya/cache"
    return spec


def service(strategy: str = "SharedPVC", source: str = SOURCES["hf"], prewarm: bool = True, revision: str | None = None,
            **extra: Any) -> dict:
    model: dict[str, Any] = {"source": source, "credentialsSecret": {"name": "hub-token"}}
    if revision:
        model["revision"] = revision
    return h.llmservice(model=model, cache=cache_spec(strategy, prewarm), **extra)


def kinds(answer: dict) -> dict[tuple[str, str], dict]:
    return {(c["kind"], c["metadata"]["name"]): c for c in answer["children"]}


def cond(answer: dict, ctype: str) -> dict:
    return next(c for c in answer["status"]["conditions"] if c["type"] == ctype)


def jobs(answer: dict) -> list[dict]:
    return [c for c in answer["children"] if c["kind"] == "Job"]


def backend(answer: dict) -> dict | None:
    return kinds(answer).get(("Deployment", "qwen-backend"))


def with_job_status(job: dict, **status: Any) -> dict:
    out = copy.deepcopy(job)
    out["status"] = status
    return out


def observed_job(job: dict, index: int, **status: Any) -> dict:
    """A Job as the API server returns it: what the hook applied (last-applied) plus its status."""
    return with_job_status(h.as_observed(job, index), **status)


COMPLETE = {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}


def resync(svc: dict, answer: dict, job_status: dict | None = None, pods: list[dict] | None = None,
           extra_observed: list[dict] | None = None) -> dict:
    observed = []
    for i, child in enumerate(answer["children"]):
        status = job_status if child["kind"] == "Job" and job_status is not None else None
        observed.append(observed_job(child, i, **status) if status else h.as_observed(child, i))
    observed += extra_observed or []
    return sync.sync(h.sync_request({**svc, "status": answer["status"]}, children=observed, pods=pods), h.config(h.LATER_TIME))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", list(SOURCES))
@pytest.mark.parametrize("prewarm", [False, True])
def test_every_strategy_and_source(strategy: str, kind: str, prewarm: bool) -> None:
    svc = service(strategy, SOURCES[kind], prewarm)
    answer = sync.sync(h.sync_request(svc), h.config())
    allowed = (not prewarm or (strategy != "None" and kind != "pvc")) and not (kind == "oci" and strategy == "None")
    if not allowed:  # refused by the schema (CEL at admission); the hook says InvalidSpec
        assert cond(answer, "Ready")["reason"] == "InvalidSpec"
        return
    staged = (prewarm and kind in ("hf", "modelscope")) or kind == "oci"  # oci:// is always staged
    assert bool(jobs(answer)) == staged
    if staged:
        assert backend(answer) is None, "no backend before the weights are staged"
        assert cond(answer, "CacheReady")["reason"] == "PrewarmRunning"
        ready = cond(answer, "Ready")
        assert (ready["status"], ready["reason"]) == ("False", "PrewarmRunning")
        (job,) = jobs(answer)
        done = resync(svc, answer, COMPLETE)
        assert cond(done, "CacheReady")["status"] == "True"
        pod_spec = backend(done)["spec"]["template"]["spec"]
        assert pod_spec["initContainers"][0]["name"] == "wait-for-weights"
        engine_env = {e["name"]: e for e in pod_spec["containers"][0]["env"]}
        if kind == "oci":
            assert engine_env["NOCTAYA_MODEL_PATH"]["value"].endswith("/noctaya/oci/registry.example.com/models/qwen/sha256-" + "a" * 64)
            command = job["spec"]["template"]["spec"]["containers"][0]["command"]
            assert command[3] == "oci" and "--revision" not in command
            registry = next(v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == "registry-credentials")
            assert registry["secret"]["items"] == [{"key": ".dockerconfigjson", "path": "config.json"}]
        else:
            repo = SOURCES[kind].split("://", 1)[1]
            default = "main" if kind == "hf" else "master"
            assert engine_env["NOCTAYA_MODEL_PATH"]["value"].endswith(f"/noctaya/{kind}/{repo}/{default}")
        assert not any("valueFrom" in e for e in engine_env.values() if e["name"] in ("HF_TOKEN", "MODELSCOPE_API_TOKEN"))
        assert "HF_TOKEN" not in engine_env and "MODELSCOPE_API_TOKEN" not in engine_env
        cache_mount = next(m for m in pod_spec["containers"][0]["volumeMounts"] if m["name"] == "model-cache")
        assert cache_mount.get("readOnly", False) == (strategy == "SharedPVC")
        job_pod = job["spec"]["template"]["spec"]
        node_local = strategy in ("NodeLocalPVC", "HostPath")
        assert ("tolerations" in job_pod) == node_local  # placed like the backend only where the cache is one node's
        job_volume = next(v for v in job_pod["volumes"] if v["name"] == "model-cache")
        backend_volume = next(v for v in pod_spec["volumes"] if v["name"] == "model-cache")
        assert job_volume == backend_volume  # the Job fills exactly what the backend mounts
        return
    b = backend(answer)
    assert b is not None and "initContainers" not in b["spec"]["template"]["spec"]
    engine_env = {e["name"]: e for e in b["spec"]["template"]["spec"]["containers"][0]["env"]}
    if kind in ("hf", "modelscope"):  # the engine downloads itself: it needs the token and write access
        assert any(n in engine_env for n in ("HF_TOKEN", "MODELSCOPE_API_TOKEN"))
        assert "HF_HUB_OFFLINE" not in engine_env


def test_the_job_requests_no_accelerator_touches_no_device_and_is_bounded() -> None:
    svc = service("NodeLocalPVC", imagePullSecrets=[{"name": "registry-creds"}])
    (job,) = jobs(sync.sync(h.sync_request(svc), h.config()))
    spec = job["spec"]
    assert spec["backoffLimit"] == 3 and spec["activeDeadlineSeconds"] == 21600
    assert "ttlSecondsAfterFinished" not in spec  # a deleted Job would be created (and run) again
    pod_spec = spec["template"]["spec"]
    (container,) = pod_spec["containers"]
    assert container["resources"]["limits"] == {"memory": "2Gi"}  # no accelerator in requests or limits
    assert not any("gpu" in k or "npu" in k or "habana" in k for k in json.dumps(container["resources"]).split('"'))
    env = {e["name"]: e for e in container["env"]}
    assert env["TORCH_DEVICE_BACKEND_AUTOLOAD"]["value"] == "0" and env["CUDA_VISIBLE_DEVICES"]["value"] == ""
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hub-token", "key": "token"}}
    assert env["NOCTAYA_CREDENTIALS_SECRET"]["value"] == "hub-token"
    assert container["command"][:4] == ["python", "-m", "prewarm", "hub"]
    assert "--revision" in container["command"] and container["command"][container["command"].index("--revision") + 1] == "main"
    assert pod_spec["imagePullSecrets"] == [{"name": "registry-creds"}]
    assert pod_spec["restartPolicy"] == "Never" and pod_spec["automountServiceAccountToken"] is False
    assert pod_spec["tolerations"]  # the vendor toleration of the backend: it may land on the same nodes
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert job["metadata"]["labels"]["serving.noctaya.io/component"] == "prewarm"


def test_hub_settings_given_to_the_engine_reach_the_job() -> None:
    svc = service(runtime={"name": "vllm-nvidia", "env": [{"name": "HF_ENDPOINT", "value": "https://hf-mirror.example"},
                                                           {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}]})
    (job,) = jobs(sync.sync(h.sync_request(svc), h.config()))
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["HF_ENDPOINT"]["value"] == "https://hf-mirror.example" and "VLLM_LOGGING_LEVEL" not in env


def test_a_succeeded_job_is_kept_not_rerun_and_the_answer_is_stable() -> None:
    svc = service()
    first = sync.sync(h.sync_request(svc), h.config())
    done = resync(svc, first, COMPLETE)
    again = resync(svc, done, COMPLETE)
    assert json.dumps(again) == json.dumps(resync(svc, done, COMPLETE))  # byte-identical on every resync
    (job,) = jobs(again)
    assert "status" not in job  # returned as last applied: nothing for Metacontroller to change


def test_a_running_then_failed_job_says_why() -> None:
    svc = service()
    first = sync.sync(h.sync_request(svc), h.config())
    (job,) = jobs(first)
    name = job["metadata"]["name"]
    failed_pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{name}-x1", "namespace": h.NAMESPACE, "labels": {
            "serving.noctaya.io/llmservice": "qwen", "serving.noctaya.io/component": "prewarm",
            "batch.kubernetes.io/job-name": name}},
        "status": {"containerStatuses": [{"name": "prewarm", "state": {"terminated": {
            "exitCode": 1, "reason": "Error", "finishedAt": "2026-01-01T00:05:00Z",
            "message": 'hf://Qwen/Qwen2.5-7B-Instruct@main: the hub refused the token from Secret "hub-token" (HTTP 401)'}}}]},
    }
    running = resync(svc, first, {"active": 1, "failed": 1, "startTime": "2026-01-01T00:00:00Z"}, pods=[failed_pod])
    c = cond(running, "CacheReady")
    assert (c["status"], c["reason"]) == ("Unknown", "PrewarmRunning")
    assert "attempt 2 of 4" in c["message"] and "refused the token" in c["message"] and f"kubectl logs -f job/{name}" in c["message"]
    failed = resync(svc, first, {"failed": 4, "conditions": [
        {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": "Job has reached the specified backoff limit"}]},
        pods=[failed_pod])
    c = cond(failed, "CacheReady")
    assert (c["status"], c["reason"]) == ("False", "PrewarmFailed")
    assert "BackoffLimitExceeded" in c["message"] and 'Secret "hub-token"' in c["message"]
    ready = cond(failed, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "PrewarmFailed")
    assert backend(failed) is None and jobs(failed) and "status" not in jobs(failed)[0]


def test_a_job_of_another_spec_is_kept_and_reported_until_it_succeeded() -> None:
    svc = service("NodeLocalPVC")
    first = sync.sync(h.sync_request(svc), h.config())
    (job,) = jobs(first)
    other = copy.deepcopy(job)
    other["metadata"]["annotations"][cache_res.SPEC_HASH] = "0" * 16
    other["spec"]["backoffLimit"] = 9
    observed = [h.as_observed(other, 0)]
    answer = sync.sync(h.sync_request({**svc, "status": first["status"]}, children=observed), h.config(h.LATER_TIME))
    c = cond(answer, "CacheReady")
    assert (c["status"], c["reason"]) == ("False", "CacheSpecConflict") and "kubectl delete job" in c["message"]
    (kept,) = jobs(answer)
    assert kept["spec"]["backoffLimit"] == 9  # the existing Job, unchanged
    finished = sync.sync(h.sync_request({**svc, "status": first["status"]},
                                        children=[observed_job(other, 0, **COMPLETE)]), h.config(h.LATER_TIME))
    assert cond(finished, "CacheReady")["status"] == "True"  # its weights are verified; the spec no longer matters


def test_a_revision_change_stages_beside_the_old_one_then_rolls_the_backend() -> None:
    v1 = service(revision="v1")
    first = sync.sync(h.sync_request(v1), h.config())
    serving = resync(v1, first, COMPLETE)
    old_backend = backend(serving)
    assert old_backend is not None
    old_path = _model_path(old_backend)
    assert old_path.endswith("/v1")
    (old_job,) = jobs(serving)
    observed = [observed_job(c, i, **COMPLETE) if c["kind"] == "Job" else h.as_observed(c, i)
                for i, c in enumerate(serving["children"])]

    v2 = service(revision="v2")
    staging = sync.sync(h.sync_request({**v2, "status": serving["status"]}, children=observed), h.config(h.LATER_TIME))
    (new_job,) = jobs(staging)
    assert new_job["metadata"]["name"] != old_job["metadata"]["name"]
    assert "--revision" in new_job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert new_job["spec"]["template"]["spec"]["containers"][0]["command"][-3] == "v2"
    assert _model_path(backend(staging)) == old_path  # the running backend is kept exactly as it was
    assert cond(staging, "CacheReady")["reason"] == "PrewarmRunning"
    # The old revision keeps serving meanwhile: staging does not make the service unready.
    assert cond(staging, "BackendReady")["reason"] == "ScaledToZero"
    assert not cond(staging, "Ready")["reason"].startswith("Prewarm")

    observed2 = [o for o in observed if o["kind"] != "Job"] + [observed_job(new_job, 99, **COMPLETE)]
    rolled = sync.sync(h.sync_request({**v2, "status": staging["status"]}, children=observed2), h.config(h.LATER_TIME))
    assert _model_path(backend(rolled)).endswith("/v2")
    assert _model_path(backend(rolled)).rsplit("/", 1)[0] == old_path.rsplit("/", 1)[0]  # beside the old one
    wait = backend(rolled)["spec"]["template"]["spec"]["initContainers"][0]["command"]
    assert wait[:2] == ["sh", "-c"] and wait[7] == "v2" and wait[4].endswith("/v2.ready")


def _model_path(deployment: dict) -> str:
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    return next(e["value"] for e in env if e["name"] == "NOCTAYA_MODEL_PATH")


def test_a_missing_hub_secret_is_reported_from_the_jobs_pod() -> None:
    svc = service()
    first = sync.sync(h.sync_request(svc), h.config())
    (job,) = jobs(first)
    stuck = h.pod(f"{job['metadata']['name']}-abc", component="prewarm", waiting="CreateContainerConfigError",
                  message='secret "hub-token" not found')
    answer = resync(svc, first, {"active": 1}, pods=[stuck])
    c = cond(answer, "CacheReady")
    assert (c["status"], c["reason"]) == ("False", "SecretNotFound") and "hub-token" in c["message"]


def test_a_sentinel_in_a_secret_never_reaches_children_or_status() -> None:
    svc = service()
    request = h.sync_request(svc)
    # Even if a Secret's data reached the hook (it is never requested), nothing would echo it.
    request["related"]["Secret.v1"] = {f"{h.NAMESPACE}/hub-token": {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hub-token", "namespace": h.NAMESPACE},
        "data": {"token": SENTINEL}}}
    first = sync.sync(request, h.config())
    done = resync(svc, first, COMPLETE)
    for answer in (first, done):
        assert SENTINEL not in json.dumps(answer)
        for child in answer["children"]:
            for container in _containers(child):
                assert not any("token" in a.lower() and a != "--revision" for a in container.get("args") or [])
                assert SENTINEL not in json.dumps(container.get("command") or [])


def _containers(child: dict) -> list[dict]:
    template = (child.get("spec") or {}).get("template") or {}
    spec = template.get("spec") or {}
    return [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]


def test_a_missing_registry_secret_is_reported_from_the_staging_pods_words() -> None:
    svc = service(source=SOURCES["oci"])
    first = sync.sync(h.sync_request(svc), h.config())
    (job,) = jobs(first)
    # What `python -m prewarm oci` leaves in its termination message (scaler.secretfiles).
    said = h.pod(f"{job['metadata']['name']}-abc", component="prewarm", last_terminated="Error",
                 terminated_message='Secret "hub-token" not found, or it lacks a key: '
                                    "/var/run/noctaya/registry/config.json missing")
    answer = resync(svc, first, {"active": 1, "failed": 1}, pods=[said])
    c = cond(answer, "CacheReady")
    assert (c["status"], c["reason"]) == ("False", "SecretNotFound") and "hub-token" in c["message"]
