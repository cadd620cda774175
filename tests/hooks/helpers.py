"""Builders of Metacontroller-shaped v2 hook requests, and an API-server-like echo of children."""

from __future__ import annotations

import copy
import json
from typing import Any

from hooks.config import HookConfig

NAMESPACE = "models"
UID = "5b0c7c1e-3f4a-4b8e-9d2a-0c1d2e3f4a5b"
FIXED_TIME = "2026-01-01T00:00:00Z"
LATER_TIME = "2026-01-01T01:00:00Z"
TOKEN_KEY = b"noctaya-test-token-key-0123456789"

CHILD_GROUPS = (
    "Deployment.apps/v1",
    "Service.v1",
    "Secret.v1",
    "PodDisruptionBudget.policy/v1",
    "PersistentVolumeClaim.v1",
    "Job.batch/v1",
    # The gateway's identity (noctaya-llmservice lists both since balancing over the backend's Pods).
    "ServiceAccount.v1",
    "RoleBinding.rbac.authorization.k8s.io/v1",
)
KEDA_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "scaledobjects.keda.sh", "uid": "crd-uid", "resourceVersion": "7"},
    "spec": {"group": "keda.sh", "names": {"kind": "ScaledObject", "plural": "scaledobjects"}, "scope": "Namespaced"},
}


# Not the release's image (hooks/version.py): the golden fixtures stay as they are when a release
# bumps the version, and an upgrade's effect is tested on its own (test_placement.py).
IMAGE = "ghcr.io/noctaya/noctaya:test"


def config(clock_time: str = FIXED_TIME) -> HookConfig:
    return HookConfig(
        image=IMAGE,
        image_pull_policy="IfNotPresent",
        cluster_domain="cluster.local",
        token_key=TOKEN_KEY,
        clock=lambda: clock_time,
    )


def runtime(name: str = "vllm-nvidia", vendor: str = "nvidia", priority: int = 0, labels: dict | None = None, **spec: Any) -> dict:
    body: dict[str, Any] = {
        "engine": "vllm",
        "image": "vllm/vllm-openai:v0.8.5",
        "args": ["--model", "$(NOCTAYA_MODEL_PATH)", "--served-model-name", "$(NOCTAYA_SERVED_NAME)", "--port", "$(NOCTAYA_PORT)"],
        "port": 8000,
        "priority": priority,
        "accelerator": {"vendor": vendor},
        "metrics": {
            "inFlightMetric": "vllm:num_requests_running",
            "waitingMetric": "vllm:num_requests_waiting",
            "kvCacheUsageMetric": "vllm:kv_cache_usage_perc",
        },
    }
    body.update(spec)
    return {
        "apiVersion": "serving.noctaya.io/v1alpha1",
        "kind": "InferenceRuntime",
        "metadata": {"name": name, "uid": f"uid-{name}", "generation": 1, "labels": labels or {}},
        "spec": body,
    }


def llmservice(name: str = "qwen", generation: int = 1, status: dict | None = None, **spec: Any) -> dict:
    body: dict[str, Any] = {
        "model": {"source": "hf://Qwen/Qwen2.5-7B-Instruct"},
        "runtime": {"name": "vllm-nvidia"},
    }
    body.update(spec)
    obj = {
        "apiVersion": "serving.noctaya.io/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": UID, "generation": generation},
        "spec": body,
    }
    if status is not None:
        obj["status"] = status
    return obj


def llmgateway(name: str = "chat", ready: str | None = "True", models: list[dict] | None = None,
               reason: str = "Available", message: str = "1/1 gateways available") -> dict:
    """An LLMGateway as its controller reports it: status.url, status.models ({name: served model,
    service: LLMService}) and the Ready condition (none when `ready` is None)."""
    status: dict[str, Any] = {
        "url": f"http://{name}-llmgw.{NAMESPACE}.svc.cluster.local/v1",
        "models": [{"name": "qwen", "service": "qwen"}] if models is None else models,
    }
    if ready is not None:
        status["conditions"] = [{"type": "Ready", "status": ready, "reason": reason, "message": message,
                                 "lastTransitionTime": FIXED_TIME}]
    return {"apiVersion": "serving.noctaya.io/v1alpha1", "kind": "LLMGateway",
            "metadata": {"name": name, "namespace": NAMESPACE, "uid": f"uid-{name}", "generation": 1},
            "spec": {}, "status": status}


def _keyed(objs: list[dict], cluster_scoped: bool = False) -> dict[str, dict]:
    out = {}
    for o in objs:
        meta = o["metadata"]
        key = meta["name"] if cluster_scoped else f"{meta.get('namespace', NAMESPACE)}/{meta['name']}"
        out[key] = o
    return out


def sync_request(
    parent: dict,
    runtimes: list[dict] | None = None,
    children: list[dict] | None = None,
    keda: bool = True,
    pods: list[dict] | None = None,
    secrets: list[dict] | None = None,
    finalizing: bool = False,
    gateways: list[dict] | None = None,
) -> dict:
    groups: dict[str, dict] = {g: {} for g in CHILD_GROUPS}
    for child in children or []:
        groups.setdefault(f"{child['kind']}.{child['apiVersion']}", {}).update(_keyed([child]))
    related: dict[str, dict] = {
        "InferenceRuntime.serving.noctaya.io/v1alpha1": _keyed(runtimes if runtimes is not None else [runtime()], True),
        "CustomResourceDefinition.apiextensions.k8s.io/v1": _keyed([KEDA_CRD], True) if keda else {},
        "Pod.v1": _keyed(pods or []),
    }
    if secrets is not None:
        related["Secret.v1"] = _keyed(secrets)
    if gateways is not None:  # what customize relates for a member of a shared gateway (endpoint.gateway)
        related["LLMGateway.serving.noctaya.io/v1alpha1"] = _keyed(gateways)
    return {
        "controller": {"apiVersion": "metacontroller.k8s.io/v1alpha1", "kind": "CompositeController", "metadata": {"name": "noctaya-llmservice"}},
        "parent": parent,
        "children": groups,
        "related": related,
        "finalizing": finalizing,
    }


def decorator_request(obj: dict, runtimes: list[dict] | None = None, attachments: list[dict] | None = None, finalizing: bool = False) -> dict:
    return {
        "controller": {"apiVersion": "metacontroller.k8s.io/v1alpha1", "kind": "DecoratorController", "metadata": {"name": "noctaya-llmservice-autoscaling"}},
        "object": obj,
        "attachments": {"ScaledObject.keda.sh/v1alpha1": _keyed(attachments or [])},
        "related": {"InferenceRuntime.serving.noctaya.io/v1alpha1": _keyed(runtimes if runtimes is not None else [runtime()], True)},
        "finalizing": finalizing,
    }


def as_observed(child: dict, index: int = 0, **status: Any) -> dict:
    """A child as the API server would return it after Metacontroller applied it. A Deployment given
    a status `replicas` count has settled there, so its `spec.replicas` says the same (for the backend:
    KEDA scaled it to that)."""
    obj = copy.deepcopy(child)
    meta = obj.setdefault("metadata", {})
    meta.setdefault("namespace", NAMESPACE)
    annotations = meta.setdefault("annotations", {})
    annotations["metacontroller.k8s.io/last-applied-configuration"] = json.dumps(child, sort_keys=True)
    meta.update(
        uid=f"child-uid-{index}",
        resourceVersion=str(1000 + index),
        creationTimestamp="2026-01-01T00:00:00Z",
        generation=1,
        ownerReferences=[{"apiVersion": "serving.noctaya.io/v1alpha1", "kind": "LLMService", "name": "parent", "uid": UID, "controller": True}],
        managedFields=[{"manager": "metacontroller", "operation": "Update"}],
    )
    if obj["kind"] == "Deployment":
        obj["spec"]["replicas"] = status.get("replicas", obj["spec"].get("replicas", 1))
        obj["status"] = {"observedGeneration": 1, "replicas": 0, **status}
    elif obj["kind"] == "Service":
        obj["spec"]["clusterIP"] = f"10.0.0.{index + 10}"
        obj["status"] = {"loadBalancer": {}}
    elif obj["kind"] == "PersistentVolumeClaim":
        obj["status"] = {"phase": status.get("phase", "Pending")}
    return obj


def observe_all(children: list[dict]) -> list[dict]:
    return [as_observed(c, i) for i, c in enumerate(children)]


def pod(name: str, *, scheduled: bool = True, waiting: str | None = None, last_terminated: str | None = None,
        restarts: int = 0, ready: bool = False, service: str = "qwen", component: str = "backend",
        message: str = "details", terminated_message: str | None = None) -> dict:
    cs: dict[str, Any] = {"name": "engine", "image": "vllm/vllm-openai:v0.8.5", "restartCount": restarts, "ready": ready, "state": {}}
    if waiting:
        cs["state"] = {"waiting": {"reason": waiting, "message": message}}
    elif ready:
        cs["state"] = {"running": {"startedAt": "2026-01-01T00:00:40Z"}}
    if last_terminated:
        cs["lastState"] = {"terminated": {"reason": last_terminated, "exitCode": 137, "finishedAt": "2026-01-01T00:00:50Z"}}
        if terminated_message:
            cs["lastState"]["terminated"]["message"] = terminated_message
    # A start as the kubelet reports it: created 00:00, bound 00:02, initialized 00:03, engine started
    # 00:40 (image pulled), Ready 01:30 (model loaded).
    conditions: list[dict[str, Any]] = []
    if not scheduled:
        conditions.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                           "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."})
    else:
        conditions.append({"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-01-01T00:00:02Z"})
        conditions.append({"type": "Initialized", "status": "True", "lastTransitionTime": "2026-01-01T00:00:03Z"})
        conditions.append({"type": "Ready", "status": "True" if ready else "False",
                           "lastTransitionTime": "2026-01-01T00:01:30Z" if ready else "2026-01-01T00:00:03Z"})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "creationTimestamp": "2026-01-01T00:00:00Z",
                     "labels": {"serving.noctaya.io/llmservice": service, "serving.noctaya.io/component": component}},
        "status": {"phase": "Pending" if not ready else "Running", "conditions": conditions,
                   "containerStatuses": [cs] if scheduled else []},
    }


def by_kind_name(children: list[dict]) -> dict[tuple[str, str], dict]:
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def observed_with_jobs_complete(answer: dict) -> list[dict]:
    """Every child of ``answer`` as the API server returns it, its Jobs (prewarm, staging) Complete."""
    observed = []
    for i, child in enumerate(answer["children"]):
        seen = as_observed(child, i)
        if child["kind"] == "Job":
            seen["status"] = {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}
        observed.append(seen)
    return observed
