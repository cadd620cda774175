"""Hypothesis strategies for valid LLMService / InferenceRuntime objects.

Choices come from the models themselves (their Literal enums and bounds), and every drawn object
is validated by the same pydantic models the hooks use, so a strategy cannot drift into specs the
API server would reject.
"""

from __future__ import annotations

from typing import Any, get_args

from hypothesis import assume
from hypothesis import strategies as st
from pydantic import ValidationError

from hooks.api.llmservice import CacheStrategy, LeadingSignal, LLMService
from hooks.api.runtime import Engine, InferenceRuntime, Vendor

LABEL = r"[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?"
names = st.one_of(
    st.from_regex(rf"{LABEL}", fullmatch=True),
    st.from_regex(rf"{LABEL}(\.{LABEL}){{0,3}}", fullmatch=True),
    # long names: longer than any child name may be
    st.from_regex(r"[a-z][a-z0-9]{40,60}(\.[a-z0-9]{10,60}){0,3}", fullmatch=True),
).filter(lambda n: len(n) <= 253)
namespaces = st.from_regex(r"[a-z]([a-z0-9-]{0,30}[a-z0-9])?", fullmatch=True)
org_name = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,15}/[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True)
durations = st.sampled_from(["1s", "5s", "30s", "90s", "2m", "5m", "10m", "1h", "1h30m", "2h"])
quantities = st.sampled_from(["1", "2", "500m", "4", "16Gi", "512Mi", "64Gi"])
label_values = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?", fullmatch=True)


@st.composite
def sources(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["hf", "modelscope", "oci", "pvc"]))
    model: dict[str, Any] = {}
    if kind in ("hf", "modelscope"):
        model["source"] = f"{kind}://{draw(org_name)}"
        if draw(st.booleans()):
            model["revision"] = draw(st.sampled_from(["main", "v1.0", "refs/pr/1", "0123abcd"]))
        if draw(st.booleans()):
            model["credentialsSecret"] = {"name": "hub-token"}
    elif kind == "oci":
        model["source"] = "oci://registry.example.com/models/qwen@sha256:" + draw(st.from_regex(r"[a-f0-9]{64}", fullmatch=True))
    else:
        sub = draw(st.sampled_from(["", "/llama", "/llama/3.2-1b", "/a_b/c.d"]))
        model["source"] = f"pvc://{draw(st.from_regex(LABEL, fullmatch=True))}{sub}"
    if draw(st.booleans()):
        model["servedName"] = draw(st.sampled_from(["qwen", "org/model:latest", "llama-3.2"]))
    return model


@st.composite
def runtime_objects(draw: st.DrawFn, name: str, labels: dict[str, str], priority: int) -> dict[str, Any]:
    vendor = draw(st.sampled_from(get_args(Vendor)))
    engine = draw(st.sampled_from(get_args(Engine)))
    spec: dict[str, Any] = {
        "engine": engine,
        "image": draw(st.sampled_from(["vllm/vllm-openai:v0.8.5", "lmsysorg/sglang:v0.4", "ghcr.io/ggml-org/llama.cpp:server"])),
        "args": ["--model", "$(NOCTAYA_MODEL_PATH)", "--port", "$(NOCTAYA_PORT)"],
        "port": draw(st.integers(1024, 65535)),
        "priority": priority,
        "accelerator": {"vendor": vendor},
    }
    if draw(st.booleans()):
        spec["accelerator"]["resourceName"] = draw(st.sampled_from(["nvidia.com/mig-1g.10gb", "amd.com/gpu", "example.com/npu"]))
    if draw(st.booleans()):
        spec["accelerator"]["nodeSelector"] = {"node.kubernetes.io/instance-type": draw(label_values)}
    if draw(st.booleans()):
        spec["accelerator"]["runtimeClassName"] = "nvidia"
    if draw(st.booleans()):
        spec["env"] = [{"name": "ENGINE_FLAG", "value": "$(NOCTAYA_SERVED_NAME)"}]
    if draw(st.booleans()):
        spec["shmSize"] = draw(quantities)
    if draw(st.booleans()):
        spec["scheduling"] = {
            "schedulerName": draw(st.sampled_from(["volcano", "hami-scheduler"])),
            "priorityClassName": "inference",
            "volcano": {"queue": draw(label_values)},
            "hami": {"gpuMemoryMiB": draw(st.integers(1, 80000)), "gpuCoresPercent": draw(st.integers(1, 100))},
        }
    if draw(st.booleans()):
        spec["probes"] = {"startup": {"path": "/ready", "periodSeconds": draw(st.integers(1, 30)), "failureThreshold": draw(st.integers(1, 200))}}
    drain = draw(st.sampled_from(["0s", "10s", "2m", "5m"]))
    spec["lifecycle"] = {"drainTimeout": drain}
    if draw(st.booleans()):
        spec["metrics"] = {
            "port": draw(st.integers(1024, 65535)),
            "inFlightMetric": "vllm:num_requests_running",
            "waitingMetric": "vllm:num_requests_waiting",
            "kvCacheUsageMetric": "vllm:kv_cache_usage_perc",
        }
    obj = {
        "apiVersion": "serving.noctaya.io/v1alpha1",
        "kind": "InferenceRuntime",
        "metadata": {"name": name, "uid": f"uid-{name}", "generation": 1, "labels": labels},
        "spec": spec,
    }
    try:
        InferenceRuntime.model_validate(obj)
    except ValidationError:
        assume(False)
    return obj


SHARED_GATEWAY = "shared"  # the LLMGateway a generated member joins


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A valid LLMService and the runtimes related to it (exactly one resolvable)."""
    name = draw(names)
    by_selector = draw(st.booleans())
    runtime_name = draw(st.from_regex(LABEL, fullmatch=True))
    chosen = draw(runtime_objects(runtime_name, {"pool": "gpu"}, 10))
    runtimes = [chosen]
    if by_selector and draw(st.booleans()):
        other = runtime_name + "-low"
        runtimes.append(draw(runtime_objects(other, {"pool": "gpu"}, 1)))
    spec: dict[str, Any] = {
        "model": draw(sources()),
        "runtime": {"selector": {"matchLabels": {"pool": "gpu"}}} if by_selector else {"name": runtime_name},
    }
    if draw(st.booleans()):
        spec["runtime"]["args"] = ["--max-model-len", "8192"]
    if draw(st.booleans()):
        spec["runtime"]["env"] = [{"name": "ENGINE_FLAG", "value": "override"}]
    spec["resources"] = {"accelerators": draw(st.integers(0, 8))}
    if draw(st.booleans()):
        spec["resources"].update(cpu=draw(quantities), memory=draw(quantities))
    low = draw(st.integers(0, 3))
    spec["scaling"] = {
        "min": low,
        "max": draw(st.integers(max(low, 1), 10)),
        "targetPerReplica": draw(st.integers(1, 50)),
        "activationTimeout": draw(st.sampled_from(["1s", "30s", "5m", "1h"])),
        "cooldownPeriod": draw(durations),
        "pollingInterval": draw(st.sampled_from(["1s", "5s", "30s"])),
        "triggers": [
            {"signal": s, "threshold": "0.8", "serverAddress": "http://prometheus:9090", "maxConcurrentSequences": 64}
            for s in draw(st.lists(st.sampled_from(get_args(LeadingSignal)), max_size=3, unique=True))
        ],
    }
    strategy = draw(st.sampled_from([s for s in get_args(CacheStrategy) if s != "BakedImage"]))
    cache: dict[str, Any] = {"strategy": strategy, "size": draw(st.sampled_from(["1Gi", "50Gi", "200Gi"]))}
    if strategy == "HostPath":
        cache["hostPath"] = "/var/lib/noctaya/cache"
    if draw(st.booleans()):
        cache["storageClassName"] = "local-path"
    if strategy != "None" and not spec["model"]["source"].startswith("pvc://"):
        cache["prewarm"] = draw(st.booleans())
    spec["cache"] = cache
    endpoint: dict[str, Any] = {
        "replicas": draw(st.integers(1, 4)),
        "maxQueue": draw(st.integers(1, 500)),
        "coldRequestMode": draw(st.sampled_from(["keepalive", "reject"])),
        "service": {"type": draw(st.sampled_from(["ClusterIP", "NodePort", "LoadBalancer"]))},
    }
    if draw(st.booleans()):  # each field set or not: what the gateway's env and inputs digest follow
        balancing: dict[str, Any] = {}
        if draw(st.booleans()):
            balancing["prefixAffinity"] = draw(st.booleans())
        if draw(st.booleans()):
            balancing["coldBatchPerPod"] = draw(st.integers(1, 1024))
        endpoint["balancing"] = balancing
    # A quarter are members of a shared gateway, which take no auth or scaler TLS and one replica.
    member = draw(st.sampled_from([False, False, False, True]))
    if member:
        endpoint.update(gateway=SHARED_GATEWAY, replicas=1)
    if not member and draw(st.booleans()):
        endpoint["auth"] = {"secretRef": {"name": "client-keys", "key": "key"}}
    spec["endpoint"] = endpoint
    if not member and draw(st.booleans()):
        spec["scalerTLS"] = {"secretName": "scaler-tls", "triggerAuthentication": "keda-scaler-tls"}
    service = {
        "apiVersion": "serving.noctaya.io/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": name, "namespace": draw(namespaces), "uid": "7e0f" + "-0000" * 4, "generation": draw(st.integers(1, 9))},
        "spec": spec,
    }
    try:
        LLMService.model_validate(service)
    except ValidationError:
        assume(False)
    return service, runtimes
