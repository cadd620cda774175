"""What makes each golden answer right, written by hand from the spec (SPEC.md §3–§8).

A golden snapshot alone only proves the answer did not change; regenerating it
(`NOCTAYA_UPDATE_GOLDEN=1`) would accept a regression. These facts are checked against both the
committed expected.json and the live answer, so a regenerated snapshot that breaks one fails.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Answer = dict[str, Any]

# The gateway's identity (ServiceAccount + RoleBinding) comes with it: the golden requests name the
# controller without its manifest, which counts as this release's (it lists both child types).
LLM_CHILDREN = {("Deployment", "qwen-backend"), ("Service", "qwen-backend"), ("PersistentVolumeClaim", "qwen-cache"),
                ("Deployment", "qwen-gateway"), ("Service", "qwen-gateway"), ("Service", "qwen-scaler"),
                ("ServiceAccount", "qwen-gateway"), ("RoleBinding", "qwen-gateway")}


def cond(answer: Answer, ctype: str) -> str:
    for c in answer["status"]["conditions"]:
        if c["type"] == ctype:
            return f"{c['status']}/{c['reason']}"
    raise AssertionError(f"no {ctype} condition")


def kids(answer: Answer) -> set[tuple[str, str]]:
    return {(c["kind"], c["metadata"]["name"]) for c in answer.get("children", [])}


def child(answer: Answer, kind: str, name: str) -> dict[str, Any]:
    return next(c for c in answer["children"] if c["kind"] == kind and c["metadata"]["name"] == name)


def backend_pod(answer: Answer) -> dict[str, Any]:
    return child(answer, "Deployment", "qwen-backend")["spec"]["template"]["spec"]


def backend_limits(answer: Answer) -> dict[str, str]:
    return backend_pod(answer)["containers"][0]["resources"]["limits"]


def _cold_single_gateway(a: Answer) -> None:
    assert kids(a) == LLM_CHILDREN
    assert child(a, "Deployment", "qwen-backend")["spec"]["replicas"] == 0  # no Pod before demand
    assert cond(a, "Ready") == "False/Progressing" and cond(a, "AutoscalingReady") == "True/Configured"
    public = child(a, "Service", "qwen-gateway")
    assert [p["name"] for p in public["spec"]["ports"]] == ["http"]  # the gRPC scaler is never public
    # /metrics and /noctaya/queue live on the container's admin port, which no Service exposes.
    gateway = child(a, "Deployment", "qwen-gateway")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "admin", "containerPort": 9092, "protocol": "TCP"} in gateway["ports"]
    services = [c for c in a["children"] if c["kind"] == "Service"]
    assert all(p.get("targetPort") != "admin" and p["port"] != 9092 for s in services for p in s["spec"]["ports"])
    _gateway_identity(a)


def _gateway_identity(a: Answer) -> None:
    """The gateway Pod (only it: the ServiceAccount mounts nothing itself) may list and watch the
    EndpointSlices of its namespace through a RoleBinding there, and balances over the backend's Pods."""
    assert child(a, "ServiceAccount", "qwen-gateway")["automountServiceAccountToken"] is False
    binding = child(a, "RoleBinding", "qwen-gateway")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": "noctaya-gateway-endpoints"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "qwen-gateway", "namespace": "models"}]
    pod = child(a, "Deployment", "qwen-gateway")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "qwen-gateway" and pod["automountServiceAccountToken"] is True
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    assert env["NOCTAYA_ENDPOINT_SOURCE"] == "endpointslices"
    assert not {"NOCTAYA_PREFIX_AFFINITY", "NOCTAYA_POD_BATCH"} & set(env)  # balancing unset: nothing rendered


def _multi_gateway(a: Answer) -> None:
    assert kids(a) >= LLM_CHILDREN | {("Deployment", "qwen-aggregator"),
                                      ("PodDisruptionBudget", "qwen-gateway"), ("Secret", "qwen-scaler-token")}
    # One Service for the aggregator: the scaler Service, which KEDA and the gateways both dial.
    assert ("Service", "qwen-aggregator") not in kids(a)
    scaler = child(a, "Service", "qwen-scaler")["spec"]
    assert scaler["selector"]["serving.noctaya.io/component"] == "aggregator"
    assert {p["name"]: p["port"] for p in scaler["ports"]} == {"grpc": 9090, "report": 9091}
    gateway = child(a, "Deployment", "qwen-gateway")
    assert gateway["spec"]["replicas"] == 3
    # Scaler TLS: reports go over HTTPS to the name the scaler certificate carries, verified with
    # the Secret's CA alone (the serving key never reaches a gateway).
    pod = gateway["spec"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    assert env["NOCTAYA_AGGREGATOR_URL"] == "https://qwen-scaler.models.svc.cluster.local:9091/v1/report"
    assert env["NOCTAYA_AGGREGATOR_CA_FILE"] == "/var/run/noctaya/scaler-tls/ca.crt"
    assert env["NOCTAYA_SCALER_TLS_SECRET"] == "qwen-scaler-tls"
    assert not {"NOCTAYA_SCALER_TLS_CERT_FILE", "NOCTAYA_SCALER_TLS_KEY_FILE"} & set(env)
    tls = next(v for v in pod["volumes"] if v["name"] == "scaler-tls")["secret"]
    assert tls["items"] == [{"key": "ca.crt", "path": "ca.crt"}] and tls["optional"] is True
    aggregator = child(a, "Deployment", "qwen-aggregator")["spec"]["template"]["spec"]["containers"][0]
    # Probes the report port's connection caps cannot starve, TLS or not (a TCP connect each).
    assert aggregator["readinessProbe"]["tcpSocket"] == {"port": "report"}
    assert aggregator["livenessProbe"]["tcpSocket"] == {"port": "grpc"}
    agg_env = {e["name"]: e["value"] for e in aggregator["env"]}
    assert (agg_env["NOCTAYA_MAX_MEMBERS_PER_ADDRESS"], agg_env["NOCTAYA_MAX_CONNECTIONS_PER_ADDRESS"]) == ("6", "12")
    assert "data" not in str(a["status"])  # the token Secret's data never reaches status


def _selector_runtime(a: Answer) -> None:
    # highest priority among runtimes matching engine=vllm and tier in (gpu): vllm-a100 (10) over vllm-t4 (5)
    assert cond(a, "RuntimeResolved") == "True/Resolved"
    assert "vllm-a100" in next(c for c in a["status"]["conditions"] if c["type"] == "RuntimeResolved")["message"]


def _vendor(resource: str, check: Callable[[dict[str, Any]], None] | None = None) -> Callable[[Answer], None]:
    def facts(a: Answer) -> None:
        assert backend_limits(a)[resource] == "2"  # resources.accelerators: 2 as the vendor's device resource
        if check is not None:
            check(backend_pod(a))

    return facts


def _nvidia(pod: dict[str, Any]) -> None:
    assert pod["runtimeClassName"] == "nvidia" and pod["schedulerName"] == "hami-scheduler"
    limits = pod["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpumem"] == "20000" and limits["nvidia.com/gpucores"] == "50"


def _amd(pod: dict[str, Any]) -> None:
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} in pod["volumes"]


def _ascend(pod: dict[str, Any]) -> None:
    assert pod["schedulerName"] == "volcano" and pod["priorityClassName"] == "inference"


def _vendor_none(a: Answer) -> None:
    limits = backend_limits(a)
    assert not any("/" in k for k in limits)  # no accelerator resource at all
    assert ("PersistentVolumeClaim", "qwen-cache") not in kids(a) and cond(a, "CacheReady") == "True/CacheNotUsed"


def _kept_with(reason_cond: str, reason: str) -> Callable[[Answer], None]:
    """Never destructive: every child of the running service is still returned."""

    def facts(a: Answer) -> None:
        assert kids(a) == LLM_CHILDREN
        assert cond(a, reason_cond).endswith("/" + reason) and cond(a, "Ready") == f"False/{reason}"
        assert child(a, "Deployment", "qwen-backend")["spec"]["replicas"] == 1  # KEDA's live count, kept

    return facts


def _ambiguous_runtime(a: Answer) -> None:
    assert kids(a) == set()  # a new service: nothing to keep, nothing rendered from a guess
    assert cond(a, "RuntimeResolved") == "False/AmbiguousRuntime"


def _keda_missing(a: Answer) -> None:
    assert kids(a) == LLM_CHILDREN - {("Deployment", "qwen-backend")}  # nothing could scale it
    assert cond(a, "AutoscalingReady") == "False/KEDANotInstalled"


def _steady_state_ready(a: Answer) -> None:
    assert cond(a, "Ready") == "True/Ready" and a["status"]["readyReplicas"] == 1
    assert a["status"]["endpoint"] == "http://qwen-gateway.models.svc.cluster.local/v1"


def _failing(reason: str) -> Callable[[Answer], None]:
    def facts(a: Answer) -> None:
        assert cond(a, "BackendReady") == f"False/{reason}" and cond(a, "Ready") == f"False/{reason}"
        assert kids(a) == LLM_CHILDREN  # a failing backend is reported, not torn down

    return facts


def _finalize_stop_admitting(a: Answer) -> None:
    # first step of the ordered teardown: gateways go first (no new admissions), the backend drains
    assert ("Deployment", "qwen-gateway") not in kids(a) and ("Deployment", "qwen-backend") in kids(a)
    assert a["finalized"] is False and a["resyncAfterSeconds"] > 0


def _finalize_draining_backend(a: Answer) -> None:
    assert a["finalized"] is False and a["resyncAfterSeconds"] > 0  # a Pod is still draining


def _finalize_done(a: Answer) -> None:
    assert a["finalized"] is True and kids(a) == set()


def _decorator_sync(a: Answer) -> None:
    (so,) = a["attachments"]
    spec = so["spec"]
    assert spec["scaleTargetRef"]["name"] == "qwen-backend"
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 5)
    assert spec["triggers"][0]["type"] == "external-push"
    assert "fallback" not in spec  # KEDA holds replicas while the scaler is unreachable


def _decorator_warm_windows(a: Answer) -> None:
    (so,) = a["attachments"]
    crons = [t for t in so["spec"]["triggers"] if t["type"] == "cron"]
    assert [t["metadata"]["start"] for t in crons] == ["58 7 * * MON-FRI", "45 23 * * 5", "0 0 1 * *"]
    assert [t["metadata"]["desiredReplicas"] for t in crons] == ["2", "1", "1"]
    assert [t["metadata"]["timezone"] for t in crons] == ["Europe/Berlin", "America/New_York", "UTC"]
    assert so["spec"]["triggers"][0]["type"] == "external-push" and so["spec"]["minReplicaCount"] == 0


def _decorator_keeps(a: Answer) -> None:
    assert [s["metadata"]["name"] for s in a["attachments"]] == ["qwen-backend"]  # kept without its runtime


def _decorator_finalize(a: Answer) -> None:
    assert a["finalized"] is True


def _customize(a: Answer) -> None:
    resources = {r["resource"] for r in a["relatedResources"]}
    assert {"inferenceruntimes", "customresourcedefinitions", "pods"} <= resources


def _runtime(expected: str) -> Callable[[Answer], None]:
    def facts(a: Answer) -> None:
        assert cond(a, "Accepted") == expected and a["children"] == []

    return facts


def _prewarm_running(a: Answer) -> None:
    assert cond(a, "CacheReady") == "Unknown/PrewarmRunning" and cond(a, "Ready") == "False/PrewarmRunning"
    assert not any(c["kind"] == "Deployment" and c["metadata"]["name"] == "qwen-backend" for c in a["children"])
    (job,) = [c for c in a["children"] if c["kind"] == "Job"]
    assert "status" not in job  # kept as last applied


def _prewarm_staged(a: Answer) -> None:
    assert cond(a, "CacheReady") == "True/Available"
    pod = child(a, "Deployment", "qwen-backend")["spec"]["template"]["spec"]
    assert pod["initContainers"][0]["name"] == "wait-for-weights"
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["NOCTAYA_MODEL_PATH"].endswith("/noctaya/hf/Qwen/Qwen2.5-32B-Instruct/v1.1") and env["HF_HUB_OFFLINE"] == "1"
    assert "HF_TOKEN" not in env


# A member of the LLMGateway `chat`: no gateway children of its own, the shared URL and scaler.
MEMBER_CHILDREN = {("Deployment", "qwen-backend"), ("Service", "qwen-backend"), ("PersistentVolumeClaim", "qwen-cache")}
SHARED_URL = "http://chat-llmgw.models.svc.cluster.local/v1"


def _shared_member_ready(a: Answer) -> None:
    assert kids(a) == MEMBER_CHILDREN
    assert a["status"]["endpoint"] == SHARED_URL
    assert cond(a, "GatewayReady") == "True/Available" and cond(a, "Ready") == "True/Ready"
    assert "chat-llmgwscaler.models.svc.cluster.local:9090" in next(
        c["message"] for c in a["status"]["conditions"] if c["type"] == "AutoscalingReady")


def _shared_member_gateway_missing(a: Answer) -> None:
    assert kids(a) == MEMBER_CHILDREN
    assert a["status"]["endpoint"] == SHARED_URL
    assert cond(a, "GatewayReady") == "False/GatewayNotFound" and cond(a, "Ready").startswith("False/")


def _decorator_shared_member(a: Answer) -> None:
    (so,) = a["attachments"]
    assert so["spec"]["triggers"][0]["metadata"] == {
        "scalerAddress": "chat-llmgwscaler.models.svc.cluster.local:9090", "targetPerReplica": "10", "model": "qwen-7b"}


def _customize_shared_member(a: Answer) -> None:
    _customize(a)
    assert {"apiVersion": "serving.noctaya.io/v1alpha1", "resource": "llmgateways", "namespace": "models",
            "names": ["chat"]} in a["relatedResources"]


FACTS: dict[str, Callable[[Answer], None]] = {
    "cold-single-gateway": _cold_single_gateway,
    "multi-gateway": _multi_gateway,
    "selector-runtime": _selector_runtime,
    "vendor-nvidia": _vendor("nvidia.com/gpu", _nvidia),
    "vendor-amd": _vendor("amd.com/gpu", _amd),
    "vendor-intel-gaudi": _vendor("habana.ai/gaudi"),
    "vendor-ascend": _vendor("huawei.com/Ascend910", _ascend),
    "vendor-none": _vendor_none,
    "missing-runtime": _kept_with("RuntimeResolved", "RuntimeNotFound"),
    "ambiguous-runtime": _ambiguous_runtime,
    "keda-missing": _keda_missing,
    "keda-removed-later": _kept_with("AutoscalingReady", "KEDANotInstalled"),
    "invalid-spec-existing-children": _kept_with("RuntimeResolved", "InvalidSpec"),
    "steady-state-ready": _steady_state_ready,
    "backend-failures": _failing("OOMKilled"),
    "image-pull-failed": _failing("ImagePullFailed"),
    "finalize-stop-admitting": _finalize_stop_admitting,
    "finalize-draining-backend": _finalize_draining_backend,
    "finalize-done": _finalize_done,
    "decorator-sync": _decorator_sync,
    "decorator-warm-windows": _decorator_warm_windows,
    "decorator-keeps-attachment-without-runtime": _decorator_keeps,
    "decorator-finalize": _decorator_finalize,
    "customize-by-name": _customize,
    "customize-by-selector": _customize,
    "runtime-accepted": _runtime("True/Accepted"),
    "runtime-rejected": _runtime("False/InvalidSpec"),
    "prewarm-running": _prewarm_running,
    "prewarm-staged": _prewarm_staged,
    "shared-member-ready": _shared_member_ready,
    "shared-member-gateway-missing": _shared_member_gateway_missing,
    "decorator-shared-member": _decorator_shared_member,
    "customize-shared-member": _customize_shared_member,
}
