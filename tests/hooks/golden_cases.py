"""The golden cases: each builds one Metacontroller-shaped request and names the hook it goes to.

`NOCTAYA_UPDATE_GOLDEN=1 .venv/bin/pytest tests/hooks/test_golden.py` rewrites
tests/fixtures/hooks/<case>/{request,expected}.json from these builders; otherwise the committed
request.json is fed to the hook and the answer must equal expected.json exactly.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from hooks.config import HookConfig
from hooks.controller import autoscaling, customize, finalize, runtime_status, sync
from tests.hooks import helpers as h

HOOKS: dict[str, Callable[[dict[str, Any], HookConfig | None], dict[str, Any]]] = {
    "customize": customize.customize,
    "sync": sync.sync,
    "finalize": finalize.finalize,
    "autoscaling.customize": autoscaling.customize,
    "autoscaling.sync": autoscaling.sync,
    "runtime_status.sync": runtime_status.sync,
}


def _running(service: dict, runtimes: list[dict] | None = None, ready: bool = True) -> tuple[dict, list[dict]]:
    """A service that has been synced before: its status and its children as the API returns them."""
    first = sync.sync(h.sync_request(service, runtimes=runtimes), h.config())
    observed = []
    for i, child in enumerate(first["children"]):
        extra: dict[str, Any] = {}
        if child["kind"] == "Deployment" and ready:
            replicas = child["spec"].get("replicas") or 1  # a backend created at 0, scaled to 1 by KEDA
            extra = {"replicas": replicas, "readyReplicas": replicas, "availableReplicas": replicas}
        observed.append(h.as_observed(child, i, **extra))
    status = sync.sync(h.sync_request(service, runtimes=runtimes, children=observed), h.config())["status"]
    return status, observed


def cold_single_gateway() -> tuple[str, dict]:
    return "sync", h.sync_request(h.llmservice())


def multi_gateway() -> tuple[str, dict]:
    svc = h.llmservice(
        endpoint={
            "replicas": 3,
            "maxQueue": 50,
            "coldRequestMode": "reject",
            "retryAfterSeconds": 20,
            "auth": {"secretRef": {"name": "qwen-api-key"}},
            "service": {"type": "LoadBalancer", "annotations": {"service.beta.kubernetes.io/aws-load-balancer-internal": "true"}},
        },
        scaling={
            "min": 0,
            "max": 4,
            "targetPerReplica": 8,
            "cooldownPeriod": "10m",
            "pollingInterval": "10s",
            "triggers": [
                {"signal": "KVCacheUsage", "threshold": "0.8", "serverAddress": "http://prometheus.monitoring.svc:9090"},
                {"signal": "InFlightRatio", "threshold": "0.75", "maxConcurrentSequences": 64,
                 "serverAddress": "http://prometheus.monitoring.svc:9090"},
            ],
        },
        scalerTLS={"secretName": "qwen-scaler-tls", "triggerAuthentication": "qwen-keda-tls"},
        cache={"strategy": "SharedPVC", "size": "200Gi", "storageClassName": "nfs"},
    )
    secrets = [
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "qwen-api-key", "namespace": h.NAMESPACE}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "qwen-scaler-tls", "namespace": h.NAMESPACE}},
    ]
    return "sync", h.sync_request(svc, secrets=secrets)


def selector_runtime() -> tuple[str, dict]:
    runtimes = [
        h.runtime("vllm-a100", priority=10, labels={"engine": "vllm", "tier": "gpu"}),
        h.runtime("vllm-t4", priority=5, labels={"engine": "vllm", "tier": "gpu"}),
        h.runtime("sglang-h100", priority=50, labels={"engine": "sglang", "tier": "gpu"}),
    ]
    svc = h.llmservice(runtime={"selector": {"matchLabels": {"engine": "vllm"}, "matchExpressions": [
        {"key": "tier", "operator": "In", "values": ["gpu"]}]}})
    return "sync", h.sync_request(svc, runtimes=runtimes)


def _vendor(vendor: str, **spec: Any) -> Callable[[], tuple[str, dict]]:
    def build() -> tuple[str, dict]:
        rt = h.runtime(f"rt-{vendor}", vendor=vendor, **spec)
        svc_spec: dict[str, Any] = {"runtime": {"name": f"rt-{vendor}"}}
        if vendor == "none":
            svc_spec["resources"] = {"accelerators": 0, "cpu": "4", "memory": "8Gi"}
            svc_spec["model"] = {"source": "pvc://models-store/llama/3.2-1b-gguf", "servedName": "llama-3.2-1b"}
            svc_spec["cache"] = {"strategy": "None", "size": "1Gi"}
        else:
            svc_spec["resources"] = {"accelerators": 2, "cpu": "8", "memory": "64Gi"}
        return "sync", h.sync_request(h.llmservice(**svc_spec), runtimes=[rt])

    return build


def missing_runtime() -> tuple[str, dict]:
    status, observed = _running(h.llmservice())
    return "sync", h.sync_request(h.llmservice(status=status), runtimes=[], children=observed)


def ambiguous_runtime() -> tuple[str, dict]:
    runtimes = [h.runtime("vllm-a", priority=10, labels={"engine": "vllm"}), h.runtime("vllm-b", priority=10, labels={"engine": "vllm"})]
    svc = h.llmservice(runtime={"selector": {"matchLabels": {"engine": "vllm"}}})
    return "sync", h.sync_request(svc, runtimes=runtimes)


def keda_missing() -> tuple[str, dict]:
    return "sync", h.sync_request(h.llmservice(), keda=False)


def keda_removed_later() -> tuple[str, dict]:
    status, observed = _running(h.llmservice())
    return "sync", h.sync_request(h.llmservice(status=status), children=observed, keda=False)


def invalid_spec_existing_children() -> tuple[str, dict]:
    status, observed = _running(h.llmservice())
    bad = h.llmservice(generation=2, status=status, scaling={"min": 3, "max": 1})
    return "sync", h.sync_request(bad, children=observed)


def steady_state_ready() -> tuple[str, dict]:
    status, observed = _running(h.llmservice())
    return "sync", h.sync_request(h.llmservice(status=status), children=observed, pods=[h.pod("qwen-backend-7d9f-abcde", ready=True)])


def backend_failures() -> tuple[str, dict]:
    status, observed = _running(h.llmservice(scaling={"max": 3}), ready=False)
    pods = [
        h.pod("qwen-backend-7d9f-aaaaa", scheduled=False),
        h.pod("qwen-backend-7d9f-bbbbb", waiting="CrashLoopBackOff", last_terminated="OOMKilled", restarts=4),
    ]
    return "sync", h.sync_request(h.llmservice(scaling={"max": 3}, status=status), children=observed, pods=pods)


def image_pull_failed() -> tuple[str, dict]:
    status, observed = _running(h.llmservice(), ready=False)
    pods = [h.pod("qwen-backend-7d9f-ccccc", waiting="ImagePullBackOff")]
    return "sync", h.sync_request(h.llmservice(status=status), children=observed, pods=pods)


def _deleting(service: dict) -> dict:
    svc = copy.deepcopy(service)
    svc["metadata"]["deletionTimestamp"] = "2026-01-01T02:00:00Z"
    return svc


def finalize_stop_admitting() -> tuple[str, dict]:
    svc = h.llmservice(endpoint={"replicas": 2})
    status, observed = _running(svc)
    return "finalize", h.sync_request(_deleting(h.llmservice(endpoint={"replicas": 2}, status=status)), children=observed,
                                      pods=[h.pod("qwen-backend-7d9f-abcde", ready=True)], finalizing=True)


def finalize_draining_backend() -> tuple[str, dict]:
    svc = h.llmservice()
    status, observed = _running(svc)
    backend_only = [c for c in observed if c["metadata"]["labels"]["serving.noctaya.io/component"] in ("backend", "cache")]
    draining = h.pod("qwen-backend-7d9f-abcde", ready=True)
    draining["metadata"]["deletionTimestamp"] = "2026-01-01T02:00:05Z"
    return "sync", h.sync_request(_deleting(h.llmservice(status=status)), children=backend_only, pods=[draining], finalizing=True)


def finalize_done() -> tuple[str, dict]:
    status, _ = _running(h.llmservice())
    return "finalize", h.sync_request(_deleting(h.llmservice(status=status)), children=[], finalizing=True)


def decorator_sync() -> tuple[str, dict]:
    svc = h.llmservice(scaling={"min": 1, "max": 5, "triggers": [
        {"signal": "WaitingRequests", "threshold": "4", "serverAddress": "http://prometheus.monitoring.svc:9090"}]})
    return "autoscaling.sync", h.decorator_request(svc)


# A cold start of 83 s on record: leadTime auto opens the office-hours window 2 minutes early.
MEASURED_COLD_START = {"pod": "qwen-backend-7d9f-abcde", "startedAt": "2026-01-01T00:00:00Z",
                       "readyAt": "2026-01-01T00:01:23Z", "scheduling": "2s", "initialization": "1s",
                       "weightsWait": "0s", "imagePull": "30s", "modelLoad": "50s", "total": "83s"}
WARM_WINDOWS = [
    {"start": "0 8 * * MON-FRI", "end": "0 18 * * MON-FRI", "timeZone": "Europe/Berlin", "replicas": 2,
     "leadTime": "auto"},
    {"start": "30 0 * * SAT", "end": "0 2 * * SAT", "timeZone": "America/New_York", "leadTime": "45m"},
    # The whole 1st of each month. (A start firing every 30 minutes would open it at its last firing
    # only, 23:30: KEDA is active while the next end comes before the next start; refused.)
    {"start": "0 0 1 * *", "end": "59 23 1 * *"},
]


def decorator_warm_windows() -> tuple[str, dict]:
    svc = h.llmservice(scaling={"min": 0, "max": 3, "schedules": WARM_WINDOWS},
                       status={"lastColdStart": MEASURED_COLD_START})
    return "autoscaling.sync", h.decorator_request(svc)


def decorator_keeps_attachment_without_runtime() -> tuple[str, dict]:
    svc = h.llmservice()
    desired = autoscaling.sync(h.decorator_request(svc), h.config())["attachments"][0]
    return "autoscaling.sync", h.decorator_request(svc, runtimes=[], attachments=[h.as_observed(desired)])


def decorator_finalize() -> tuple[str, dict]:
    return "autoscaling.sync", h.decorator_request(_deleting(h.llmservice()), finalizing=True)


def customize_by_name() -> tuple[str, dict]:
    svc = h.llmservice(model={"source": "hf://meta-llama/Llama-3.1-8B-Instruct", "credentialsSecret": {"name": "hf-token"}},
                       endpoint={"auth": {"secretRef": {"name": "api-key", "key": "key"}}})
    return "customize", {"controller": {"metadata": {"name": "noctaya-llmservice"}}, "parent": svc}


def customize_by_selector() -> tuple[str, dict]:
    svc = h.llmservice(runtime={"selector": {"matchLabels": {"engine": "vllm"}}})
    return "customize", {"controller": {"metadata": {"name": "noctaya-llmservice"}}, "parent": svc}


def runtime_accepted() -> tuple[str, dict]:
    return "runtime_status.sync", {"controller": {}, "parent": h.runtime(), "children": {}, "related": {}, "finalizing": False}


def runtime_rejected() -> tuple[str, dict]:
    rt = h.runtime(engine="custom", args=[], lifecycle={"drainTimeout": "2m", "terminationGracePeriodSeconds": 30})
    rt["status"] = {"conditions": [{"type": "Accepted", "status": "False", "reason": "InvalidSpec", "message": "old",
                                    "lastTransitionTime": "2025-12-31T00:00:00Z"}]}
    return "runtime_status.sync", {"controller": {}, "parent": rt, "children": {}, "related": {}, "finalizing": False}


def _prewarmed(job_status: dict[str, Any]) -> tuple[str, dict]:
    """A SharedPVC prewarm of a gated model, synced once; its Job observed with ``job_status``."""
    service = h.llmservice(model={"source": "hf://Qwen/Qwen2.5-32B-Instruct", "revision": "v1.1",
                                  "credentialsSecret": {"name": "hub-token"}},
                           cache={"strategy": "SharedPVC", "size": "100Gi", "storageClassName": "nfs", "prewarm": True})
    first = sync.sync(h.sync_request(service), h.config())
    observed = []
    for i, child in enumerate(first["children"]):
        seen = h.as_observed(child, i)
        if child["kind"] == "Job":
            seen["status"] = copy.deepcopy(job_status)
        observed.append(seen)
    return "sync", h.sync_request({**service, "status": first["status"]}, children=observed)


def prewarm_running() -> tuple[str, dict]:
    return _prewarmed({"active": 1, "startTime": "2026-01-01T00:00:00Z"})


def prewarm_staged() -> tuple[str, dict]:
    return _prewarmed({"succeeded": 1, "startTime": "2026-01-01T00:00:00Z",
                       "conditions": [{"type": "Complete", "status": "True"}]})


# A member of the shared gateway `chat` (spec.endpoint.gateway), serving "qwen-7b".
def _member(**status: Any) -> dict:
    return h.llmservice(model={"source": "hf://Qwen/Qwen2.5-7B-Instruct", "servedName": "qwen-7b"},
                        endpoint={"gateway": "chat", "maxQueue": 20, "coldRequestMode": "reject"}, **status)


_CHAT = h.llmgateway("chat", models=[{"name": "qwen-7b", "service": "qwen"}])


def shared_member_ready() -> tuple[str, dict]:
    first = sync.sync(h.sync_request(_member(), gateways=[_CHAT]), h.config())
    observed = [h.as_observed(c, i, replicas=1, readyReplicas=1) if c["kind"] == "Deployment" else h.as_observed(c, i)
                for i, c in enumerate(first["children"])]
    return "sync", h.sync_request(_member(status=first["status"]), children=observed, gateways=[_CHAT],
                                  pods=[h.pod("qwen-backend-7d9f-abcde", ready=True)])


def shared_member_gateway_missing() -> tuple[str, dict]:
    return "sync", h.sync_request(_member(), gateways=[])


def decorator_shared_member() -> tuple[str, dict]:
    return "autoscaling.sync", h.decorator_request(_member())


def customize_shared_member() -> tuple[str, dict]:
    return "customize", {"controller": {"metadata": {"name": "noctaya-llmservice"}}, "parent": _member()}


CASES: dict[str, Callable[[], tuple[str, dict]]] = {
    "cold-single-gateway": cold_single_gateway,
    "multi-gateway": multi_gateway,
    "selector-runtime": selector_runtime,
    "vendor-nvidia": _vendor("nvidia", scheduling={"schedulerName": "hami-scheduler", "hami": {"gpuMemoryMiB": 20000, "gpuCoresPercent": 50}},
                             accelerator={"vendor": "nvidia", "runtimeClassName": "nvidia", "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}}),
    "vendor-amd": _vendor("amd", shmSize="16Gi"),
    "vendor-intel-gaudi": _vendor("intel-gaudi", image="vault.habana.ai/gaudi-docker/1.20.0/ubuntu22.04/habanalabs/pytorch-installer-2.6.0:latest"),
    "vendor-ascend": _vendor("ascend", scheduling={"schedulerName": "volcano", "priorityClassName": "inference",
                                                   "volcano": {"queue": "llm", "podGroup": "qwen-pg"}},
                             accelerator={"vendor": "ascend", "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "npu", "effect": "NoSchedule"}]}),
    "vendor-none": _vendor("none", engine="llamacpp", image="ghcr.io/ggml-org/llama.cpp:server-b5000",
                           args=["-m", "$(NOCTAYA_MODEL_PATH)/model.gguf", "--port", "$(NOCTAYA_PORT)", "--host", "0.0.0.0"],
                           probes={"startup": {"path": "/health", "periodSeconds": 5, "failureThreshold": 24}},
                           lifecycle={"drainTimeout": "30s"}),
    "missing-runtime": missing_runtime,
    "ambiguous-runtime": ambiguous_runtime,
    "keda-missing": keda_missing,
    "keda-removed-later": keda_removed_later,
    "invalid-spec-existing-children": invalid_spec_existing_children,
    "steady-state-ready": steady_state_ready,
    "backend-failures": backend_failures,
    "image-pull-failed": image_pull_failed,
    "finalize-stop-admitting": finalize_stop_admitting,
    "finalize-draining-backend": finalize_draining_backend,
    "finalize-done": finalize_done,
    "decorator-sync": decorator_sync,
    "decorator-warm-windows": decorator_warm_windows,
    "decorator-keeps-attachment-without-runtime": decorator_keeps_attachment_without_runtime,
    "decorator-finalize": decorator_finalize,
    "customize-by-name": customize_by_name,
    "customize-by-selector": customize_by_selector,
    "runtime-accepted": runtime_accepted,
    "runtime-rejected": runtime_rejected,
    "prewarm-running": prewarm_running,
    "prewarm-staged": prewarm_staged,
    "shared-member-ready": shared_member_ready,
    "shared-member-gateway-missing": shared_member_gateway_missing,
    "decorator-shared-member": decorator_shared_member,
    "customize-shared-member": customize_shared_member,
}
