"""Runtime selection, vendor adapters, scheduling hints and the vendor-neutral pod."""

from __future__ import annotations

import pytest

from hooks.api.llmservice import LLMService, RuntimeRef
from hooks.api.runtime import Accelerator, InferenceRuntime
from hooks.api.status import Reason
from hooks.controller import sync
from hooks.runtime import pod, vendors
from hooks.runtime.select import select_runtime
from tests.hooks import helpers as h


def _ref(**kw: object) -> RuntimeRef:
    return RuntimeRef.model_validate(kw)


def test_select_by_name_and_missing() -> None:
    got = select_runtime(_ref(name="b"), [h.runtime("a"), h.runtime("b")])
    assert got.resolved and got.runtime.metadata.name == "b"
    missing = select_runtime(_ref(name="c"), [h.runtime("a")])
    assert not missing.resolved and missing.reason == Reason.RUNTIME_NOT_FOUND


def test_select_invalid_named_runtime_is_reported() -> None:
    broken = h.runtime("a", engine="custom", args=[])
    got = select_runtime(_ref(name="a"), [broken])
    assert got.reason == Reason.INVALID_SPEC and "custom engine needs a command" in got.message


def test_selector_highest_priority_wins_and_ties_are_ambiguous() -> None:
    rts = [h.runtime("low", priority=1, labels={"x": "1"}), h.runtime("high", priority=9, labels={"x": "1"}),
           h.runtime("other", priority=99, labels={"x": "2"})]
    got = select_runtime(_ref(selector={"matchLabels": {"x": "1"}}), rts)
    assert got.runtime.metadata.name == "high"
    tie = select_runtime(_ref(selector={"matchLabels": {"x": "1"}}), [*rts, h.runtime("twin", priority=9, labels={"x": "1"})])
    assert not tie.resolved and tie.reason == Reason.AMBIGUOUS_RUNTIME and "high, twin" in tie.message
    # Invalid candidates are skipped (and named), never chosen.
    bad = h.runtime("zbad", priority=100, labels={"x": "1"}, engine="custom", args=[])
    skip = select_runtime(_ref(selector={"matchLabels": {"x": "1"}}), [*rts, bad])
    assert skip.runtime.metadata.name == "high" and "zbad" in skip.message
    none = select_runtime(_ref(selector={"matchExpressions": [{"key": "x", "operator": "In", "values": ["3"]}]}), rts)
    assert none.reason == Reason.RUNTIME_NOT_FOUND


@pytest.mark.parametrize(
    ("vendor", "resource"),
    [("nvidia", "nvidia.com/gpu"), ("amd", "amd.com/gpu"), ("intel-gaudi", "habana.ai/gaudi"),
     ("ascend", "huawei.com/Ascend910"), ("none", None)],
)
def test_vendor_adapters(vendor: str, resource: str | None) -> None:
    place = vendors.placement(Accelerator(vendor=vendor), 2)
    assert place.limits == ({resource: "2"} if resource else {})
    assert [t["key"] for t in place.tolerations] == ([resource] if resource else [])
    assert vendors.placement(Accelerator(vendor=vendor), 0).limits == {}
    override = vendors.placement(Accelerator(vendor=vendor, resource_name="example.com/dev"), 1)
    assert override.limits == {"example.com/dev": "1"}


def test_every_vendor_literal_has_an_adapter() -> None:
    from typing import get_args

    from hooks.api.runtime import Vendor

    assert set(get_args(Vendor)) == set(vendors.ADAPTERS)


def _pod(service_spec: dict, **runtime_spec: object) -> dict:
    service = LLMService.model_validate(h.llmservice(**service_spec))
    runtime = InferenceRuntime.model_validate(h.runtime(**runtime_spec))
    return pod.pod_template(service, runtime, {"a": "b"}, pod.CacheMount({"emptyDir": {}}))


def test_env_order_allows_var_expansion_and_overrides_keep_position() -> None:
    spec = _pod({"runtime": {"name": "vllm-nvidia", "env": [{"name": "NOCTAYA_PORT", "value": "9000"}, {"name": "EXTRA", "value": "$(NOCTAYA_PORT)"}],
                             "args": ["--tp", "2"]}},
                env=[{"name": "RT", "value": "$(NOCTAYA_MODEL_PATH)"}])["spec"]
    container = spec["containers"][0]
    env_names = [e["name"] for e in container["env"]]
    assert env_names[:5] == ["NOCTAYA_MODEL_PATH", "NOCTAYA_SERVED_NAME", "NOCTAYA_PORT", "NOCTAYA_ACCELERATORS", "NOCTAYA_MODEL_REVISION"]
    assert env_names.index("RT") < env_names.index("EXTRA")
    assert {e["name"]: e.get("value") for e in container["env"]}["NOCTAYA_PORT"] == "9000"
    assert container["args"][-2:] == ["--tp", "2"]


def test_probes_drain_and_grace() -> None:
    spec = _pod({}, lifecycle={"drainTimeout": "45s"})["spec"]
    c = spec["containers"][0]
    assert c["startupProbe"]["periodSeconds"] == 10 and c["startupProbe"]["failureThreshold"] == 60
    # This runtime names its load gauges: the preStop waits while they say busy, at most 45 s.
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["sh", "-c"] and command[-3] == "45"
    assert command[-1] == "10"  # stops early only after 10 s without an answer from the engine
    assert spec["terminationGracePeriodSeconds"] >= 45 + 10
    sleeping = _pod({}, lifecycle={"drainTimeout": "45s", "drainWait": "Sleep"})["spec"]["containers"][0]
    assert sleeping["lifecycle"]["preStop"] == {"sleep": {"seconds": 45}}
    custom = _pod({}, probes={"readiness": {"path": "/v1/models", "periodSeconds": 2}})["spec"]["containers"][0]
    assert custom["readinessProbe"]["httpGet"] == {"path": "/v1/models", "port": "http"}


def test_every_probe_kind_kubernetes_has() -> None:
    spec = _pod({}, port=8000, probes={
        "startup": {"type": "TCP", "periodSeconds": 5, "failureThreshold": 100},
        "readiness": {"type": "HTTP", "path": "/ready", "scheme": "HTTPS", "port": 8443},
        "liveness": {"type": "Exec", "command": ["/bin/check", "--quick"]},
    })["spec"]
    c = spec["containers"][0]
    assert c["startupProbe"]["tcpSocket"] == {"port": "http"} and c["startupProbe"]["failureThreshold"] == 100
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": 8443, "scheme": "HTTPS"}
    assert c["livenessProbe"]["exec"] == {"command": ["/bin/check", "--quick"]}
    grpc = _pod({}, port=9000, probes={"liveness": {"type": "GRPC", "service": "engine"}})["spec"]["containers"][0]
    assert grpc["livenessProbe"]["grpc"] == {"port": 9000, "service": "engine"}  # gRPC probes take numbers only
    # The gateway polls the readiness path when it is HTTP, else an endpoint every engine serves.
    tcp = InferenceRuntime.model_validate(h.runtime(probes={"readiness": {"type": "TCP"}}))
    assert pod.readiness_path(tcp) == "/v1/models"
    assert pod.readiness_path(InferenceRuntime.model_validate(h.runtime(probes={"readiness": {"path": "/ok"}}))) == "/ok"


def test_runtime_volumes_are_mounted_as_declared() -> None:
    spec = _pod({}, volumes=[
        {"name": "ascend-driver", "mountPath": "/usr/local/Ascend/driver", "hostPath": "/usr/local/Ascend/driver"},
        {"name": "engine-config", "mountPath": "/etc/engine", "configMap": "engine-config"},
        {"name": "scratch", "mountPath": "/scratch", "emptyDir": True, "readOnly": False},
    ])["spec"]
    mounts = {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert mounts["ascend-driver"] == {"name": "ascend-driver", "mountPath": "/usr/local/Ascend/driver", "readOnly": True}
    assert volumes["ascend-driver"]["hostPath"] == {"path": "/usr/local/Ascend/driver"}
    assert volumes["engine-config"]["configMap"] == {"name": "engine-config"}
    assert mounts["scratch"] == {"name": "scratch", "mountPath": "/scratch"} and volumes["scratch"]["emptyDir"] == {}
    assert {"model-cache", "dshm"} <= set(volumes)  # Noctaya's own stay


def test_image_pull_secrets_reach_every_rendered_pod() -> None:
    service = h.llmservice(imagePullSecrets=[{"name": "team-registry"}, {"name": "engine-registry"}],
                           endpoint={"replicas": 2})
    runtime = h.runtime(imagePullSecrets=[{"name": "engine-registry"}])
    answer = sync.sync(h.sync_request(service, runtimes=[runtime]), h.config())
    pods = {c["metadata"]["name"]: c["spec"]["template"]["spec"] for c in answer["children"] if c["kind"] == "Deployment"}
    assert pods["qwen-backend"]["imagePullSecrets"] == [{"name": "engine-registry"}, {"name": "team-registry"}]
    for name in ("qwen-gateway", "qwen-aggregator"):  # Noctaya's image: the LLMService's credentials
        assert pods[name]["imagePullSecrets"] == [{"name": "team-registry"}, {"name": "engine-registry"}]
    plain = sync.sync(h.sync_request(h.llmservice()), h.config())
    assert all("imagePullSecrets" not in c["spec"]["template"]["spec"] for c in plain["children"] if c["kind"] == "Deployment")


def test_serving_container_is_restricted_except_what_the_runtime_relaxes() -> None:
    default = _pod({})["spec"]
    assert default["containers"][0]["securityContext"] == {
        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
    assert "securityContext" not in default  # the image's own user: root images keep working (baseline)
    non_root = _pod({}, security={"runAsUser": 1000})["spec"]
    assert non_root["containers"][0]["securityContext"]["runAsNonRoot"] is True
    assert non_root["containers"][0]["securityContext"]["runAsUser"] == 1000
    assert non_root["securityContext"] == {"fsGroup": 1000}  # the cache volume is writable to it
    relaxed = _pod({}, security={"addCapabilities": ["IPC_LOCK"], "seccompProfile": "Unconfined", "fsGroup": 5,
                                 "runAsUser": 7, "runAsGroup": 8})["spec"]
    sc = relaxed["containers"][0]["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]} and sc["seccompProfile"] == {"type": "Unconfined"}
    assert sc["runAsGroup"] == 8 and relaxed["securityContext"] == {"fsGroup": 5}


def test_pvc_source_mounts_read_only_with_sub_path_and_credentials_stay_out_of_args() -> None:
    spec = _pod({"model": {"source": "pvc://weights/llama/3b"}})["spec"]
    mount = next(m for m in spec["containers"][0]["volumeMounts"] if m["name"] == pod.MODEL_VOLUME)
    assert mount == {"name": "model", "mountPath": "/models", "readOnly": True, "subPath": "llama/3b"}
    vol = next(v for v in spec["volumes"] if v["name"] == pod.MODEL_VOLUME)
    assert vol["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    hub = _pod({"model": {"source": "hf://org/m", "credentialsSecret": {"name": "hf"}}})["spec"]["containers"][0]
    token = next(e for e in hub["env"] if e["name"] == "HF_TOKEN")
    assert token == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    assert "hf" not in " ".join(hub.get("args", []))


def test_scheduling_hints() -> None:
    spec = _pod({}, scheduling={"schedulerName": "volcano", "priorityClassName": "p", "volcano": {"queue": "q", "podGroup": "g"},
                                "hami": {"gpuMemoryMiB": 1000, "gpuCoresPercent": 30}})
    assert spec["spec"]["schedulerName"] == "volcano" and spec["spec"]["priorityClassName"] == "p"
    assert spec["metadata"]["annotations"] == {"scheduling.k8s.io/group-name": "g", "scheduling.volcano.sh/queue-name": "q"}
    limits = spec["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"nvidia.com/gpu": "1", "nvidia.com/gpucores": "30", "nvidia.com/gpumem": "1000"}
