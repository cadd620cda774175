"""The LLMGateway controller through its real hooks, with Metacontroller-shaped v2 requests: who is a
member, what the shared gateway's Pods and model table say, and that nothing is ever lost."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import load_config
from gateway.modeltable import MAX_MODELS, MEMBER_FIELD, MODEL_FIELDS, SCALED_OBJECT_FIELD, parse_model_table
from hooks.api.llmservice import LLMService
from hooks.api.runtime import InferenceRuntime
from hooks.app import create_app, serialize_body
from hooks.controller import llmgateway
from hooks.controller import status as st
from hooks.resources import gateway, labels, shared
from hooks.resources.context import RenderContext
from tests.hooks import helpers as h
from tests.hooks.schemas import k8s_problems

GW = "front"
LLMSVC = "LLMService.serving.noctaya.io/v1alpha1"
RUNTIMES = "InferenceRuntime.serving.noctaya.io/v1alpha1"
ROLEBINDINGS = "RoleBinding.rbac.authorization.k8s.io/v1"
# What docs/install.md tells users to apply in a namespace that holds LLMGateways.
ENABLING_FILE = Path(__file__).resolve().parents[2] / "metacontroller" / "llmgateway-namespace" / "rolebinding.yaml"
K8S_TYPES = {"Deployment": "V1Deployment", "Service": "V1Service", "Secret": "V1Secret",
             "PodDisruptionBudget": "V1PodDisruptionBudget", "ConfigMap": "V1ConfigMap",
             "ServiceAccount": "V1ServiceAccount", "RoleBinding": "V1RoleBinding"}


def llmgateway_obj(status: dict[str, Any] | None = None, generation: int = 1, **spec: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {"apiVersion": "serving.noctaya.io/v1alpha1", "kind": "LLMGateway",
                           "metadata": {"name": GW, "namespace": h.NAMESPACE, "uid": "gw-uid", "generation": generation},
                           "spec": spec}
    if status is not None:
        obj["status"] = status
    return obj


def member(name: str, created: str = "2026-01-01T00:00:00Z", gw: str | None = GW, served: str | None = None,
           **endpoint: Any) -> dict[str, Any]:
    ep = {**({"gateway": gw} if gw else {}), **endpoint}
    obj = h.llmservice(name, endpoint=ep)
    if served is not None:
        obj["spec"]["model"]["servedName"] = served
    obj["metadata"].update(creationTimestamp=created, uid=f"uid-{name}")
    return obj


def enabling_rolebinding(namespace: str = h.NAMESPACE) -> dict[str, Any]:
    """The shipped RoleBinding as the API server holds it once applied with `kubectl apply -n <namespace>`."""
    binding = yaml.safe_load(ENABLING_FILE.read_text())
    binding["metadata"].update(namespace=namespace, uid="rb-uid", resourceVersion="7")
    return binding


def request(parent: dict[str, Any], members: list[dict[str, Any]], children: list[dict[str, Any]] | None = None,
            runtimes: list[dict[str, Any]] | None = None,
            bindings: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A sync request as Metacontroller sends it after customize; the namespace is enabled unless
    `bindings` says otherwise (`[]`: the RoleBinding group came back empty)."""
    kids: dict[str, dict[str, Any]] = {}
    for child in children or []:
        kids.setdefault(f"{child['kind']}.{child['apiVersion']}", {})[f"{h.NAMESPACE}/{child['metadata']['name']}"] = child
    bindings = [enabling_rolebinding()] if bindings is None else bindings
    return {
        "controller": {"apiVersion": "metacontroller.k8s.io/v1alpha1", "kind": "CompositeController",
                       "metadata": {"name": "noctaya-llmgateway"}},
        "parent": parent,
        "children": kids,
        "related": {
            LLMSVC: {f"{m['metadata'].get('namespace', h.NAMESPACE)}/{m['metadata']['name']}": m for m in members},
            RUNTIMES: {r["metadata"]["name"]: r for r in (runtimes if runtimes is not None else [h.runtime()])},
            ROLEBINDINGS: {f"{b['metadata']['namespace']}/{b['metadata']['name']}": b for b in bindings},
        },
        "finalizing": False,
    }


def sync(parent: dict[str, Any], members: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    return llmgateway.sync(request(parent, members, **kw), h.config())


def by_kind(out: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return h.by_kind_name(out["children"])


def table(out: dict[str, Any]) -> list[dict[str, Any]]:
    cm = by_kind(out)[("ConfigMap", "front-llmgwroutes")]
    return json.loads(cm["data"]["models.json"])["models"]


def conditions(out: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in out["status"]["conditions"]}


def env_of(deployment: dict[str, Any]) -> dict[str, str]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in container["env"]}


def resync(parent: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """The parent as the API server holds it after Metacontroller wrote `out`'s status."""
    return {**copy.deepcopy(parent), "status": copy.deepcopy(out["status"])}


# --- customize --------------------------------------------------------------------------------------


def test_customize_relates_the_namespaces_llmservices_and_every_runtime() -> None:
    out = llmgateway.customize({"parent": llmgateway_obj()})
    assert out == {"relatedResources": [
        {"apiVersion": "serving.noctaya.io/v1alpha1", "resource": "llmservices", "namespace": h.NAMESPACE,
         "labelSelector": {}},
        {"apiVersion": "serving.noctaya.io/v1alpha1", "resource": "inferenceruntimes", "labelSelector": {}},
        # Whether the namespace is enabled: the one RoleBinding docs/install.md has users create, by name.
        {"apiVersion": "rbac.authorization.k8s.io/v1", "resource": "rolebindings", "namespace": h.NAMESPACE,
         "names": ["noctaya-llmgateway"]},
    ]}


# --- membership -------------------------------------------------------------------------------------


def test_members_are_gathered_sorted_by_served_name_and_non_members_ignored() -> None:
    other_ns = member("elsewhere")
    other_ns["metadata"]["namespace"] = "other"
    members = [member("zeta"), member("alpha", served="org/zz-model"), member("mid"),
               member("own-gateway", gw=None), member("other-gateway", gw="back"), other_ns]
    out = sync(llmgateway_obj(), members)
    assert [e["name"] for e in table(out)] == ["mid", "org/zz-model", "zeta"]
    assert out["status"]["models"] == [{"name": "mid", "service": "mid"}, {"name": "org/zz-model", "service": "alpha"},
                                       {"name": "zeta", "service": "zeta"}]
    assert out["status"]["modelCount"] == 3
    assert out["status"]["url"] == "http://front-llmgw.models.svc.cluster.local/v1"
    assert conditions(out)["MembersAccepted"]["status"] == "True"


def test_an_entry_carries_exactly_what_the_models_own_gateway_env_says() -> None:
    raw = member("qwen", maxQueue=7, coldRequestMode="reject", retryAfterSeconds=30)
    raw["spec"]["scaling"] = {"activationTimeout": "90s"}
    raw["spec"]["resources"] = {"accelerators": 2}
    (entry,) = table(sync(llmgateway_obj(), [raw], runtimes=[h.runtime(port=9000)]))
    # The same LLMService behind its own gateway: every per-model NOCTAYA_* the entry replaces.
    ctx = RenderContext(service=LLMService.model_validate(raw),
                        runtime=InferenceRuntime.model_validate(h.runtime(port=9000)),
                        namespace=h.NAMESPACE, config=h.config())
    own = env_of(gateway.deployment(ctx))
    assert entry == {
        "name": "qwen",
        "member": "qwen",  # the LLMService: the gateway follows it across a change of served name
        "scaledObject": "models/qwen-backend",  # what KEDA names on every call: the scaler answers it by member
        "backendURL": "http://qwen-backend.models.svc.cluster.local:9000",
        "readinessPath": "/health",
        "maxQueue": 7,
        "coldMode": "reject",
        "activationTimeoutSeconds": 90,
        "readyGraceSeconds": 15,
        "retryAfterSeconds": 30,
        "heartbeatSeconds": 10,
        "backendAccelerators": 2,
        "maxBodyBytes": 8388608,
    }
    for key, value in entry.items():
        if key not in ("name", "member", "scaledObject"):
            assert own["NOCTAYA_" + MODEL_FIELDS[key].upper()] == str(value), key


def test_a_member_being_deleted_leaves_the_table() -> None:
    going = member("going")
    going["metadata"]["deletionTimestamp"] = "2026-01-02T00:00:00Z"
    assert [e["name"] for e in table(sync(llmgateway_obj(), [member("stays"), going]))] == ["stays"]


def test_duplicate_served_names_route_the_oldest_then_the_first_by_name() -> None:
    members = [member("new", created="2026-01-03T00:00:00Z", served="shared"),
               member("old", created="2026-01-01T00:00:00Z", served="shared"),
               member("b-twin", created="2026-01-02T00:00:00Z", served="twin"),
               member("a-twin", created="2026-01-02T00:00:00Z", served="twin")]
    out = sync(llmgateway_obj(), members)
    assert out["status"]["models"] == [{"name": "shared", "service": "old"}, {"name": "twin", "service": "a-twin"}]
    cond = conditions(out)["MembersAccepted"]
    assert (cond["status"], cond["reason"]) == ("False", "DuplicateServedName")
    assert "LLMService new serves 'shared' like the older old: not routed" in cond["message"]
    assert "LLMService b-twin serves 'twin' like the older a-twin" in cond["message"]


def test_at_the_gateways_model_limit_every_member_is_routed() -> None:
    out = sync(llmgateway_obj(), [member(f"m{i:03d}") for i in range(MAX_MODELS)])
    assert len(table(out)) == MAX_MODELS
    assert conditions(out)["MembersAccepted"]["reason"] == "AllMembersAccepted"


def test_a_full_table_never_evicts_a_routed_model_for_a_newcomer() -> None:
    """A newcomer whose served name sorts first, and which is even older, waits: the routed keep
    their place (status.models says who they are), and the newcomer is reported TooManyModels."""
    members = [member(f"m{i:03d}", created="2026-02-01T00:00:00Z") for i in range(MAX_MODELS)]
    first = sync(llmgateway_obj(), members)
    routed = [e["name"] for e in table(first)]
    newcomer = member("a-new", created="2026-01-01T00:00:00Z")
    out = sync(llmgateway_obj(status=first["status"]), [newcomer, *members])
    assert [e["name"] for e in table(out)] == routed
    cond = conditions(out)["MembersAccepted"]
    assert (cond["status"], cond["reason"]) == ("False", "TooManyModels")
    assert "not routed: a-new (a-new)" in cond["message"]
    # Once a routed member leaves, the newcomer takes its place; the others stay.
    out = sync(llmgateway_obj(status=out["status"]), [newcomer, *members[1:]])
    assert [e["name"] for e in table(out)] == ["a-new", *routed[1:]]
    assert conditions(out)["MembersAccepted"]["reason"] == "AllMembersAccepted"


def test_beyond_the_gateways_model_limit_newcomers_are_routed_oldest_first() -> None:
    members = [member(f"m{i:03d}") for i in range(MAX_MODELS + 2)]
    out = sync(llmgateway_obj(), members)
    routed = [e["name"] for e in table(out)]
    assert routed == [f"m{i:03d}" for i in range(MAX_MODELS)]
    cond = conditions(out)["MembersAccepted"]
    assert cond["reason"] == "TooManyModels"
    assert f"not routed: m{MAX_MODELS:03d} (m{MAX_MODELS:03d}), m{MAX_MODELS + 1:03d}" in cond["message"]
    # What the gateway itself would refuse is never rendered.
    parse_model_table(json.dumps({"models": table(out)}).encode(), load_config(environ=_pod_environ(out)))


# --- API keys -----------------------------------------------------------------------------------------


def test_api_keys_are_mounted_one_directory_each_and_scoped_per_model() -> None:
    keys = [{"secretRef": {"name": "team-a"}, "models": ["qwen"]},
            {"secretRef": {"name": "admin", "key": "token"}},
            {"secretRef": {"name": "team-b"}, "models": ["llama", "not-a-member"]}]
    out = sync(llmgateway_obj(apiKeys=keys), [member("qwen"), member("llama"), member("phi")])
    files = {e["name"]: e.get("authKeyFiles") for e in table(out)}
    assert files == {
        "llama": ["/var/run/noctaya/api-keys/1/api-key", "/var/run/noctaya/api-keys/2/api-key"],
        "phi": ["/var/run/noctaya/api-keys/1/api-key"],
        "qwen": ["/var/run/noctaya/api-keys/0/api-key", "/var/run/noctaya/api-keys/1/api-key"],
    }
    pod = by_kind(out)[("Deployment", "front-llmgw")]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["api-key-1"] == {"name": "api-key-1", "secret": {
        "secretName": "admin", "items": [{"key": "token", "path": "api-key"}], "defaultMode": 0o440, "optional": True}}
    assert volumes["api-key-0"]["secret"]["items"] == [{"key": "api-key", "path": "api-key"}]
    mounts = pod["containers"][0]["volumeMounts"]
    assert [m for m in mounts if m["name"].startswith("api-key")] == [
        {"name": f"api-key-{i}", "mountPath": f"/var/run/noctaya/api-keys/{i}", "readOnly": True} for i in range(3)]


def test_with_api_keys_a_model_no_key_opens_is_not_routed_and_said_so() -> None:
    keys = [{"secretRef": {"name": "team-a"}, "models": ["qwen"]}]
    out = sync(llmgateway_obj(apiKeys=keys), [member("qwen"), member("llama")])
    assert [e["name"] for e in table(out)] == ["qwen"]  # fail closed: llama would be open to anyone
    assert [m["name"] for m in out["status"]["models"]] == ["qwen"]
    cond = conditions(out)["MembersAccepted"]
    assert (cond["status"], cond["reason"]) == ("False", "NoKeyOpens") and "llama (llama)" in cond["message"]
    # A key without models opens it again.
    opened = sync(llmgateway_obj(apiKeys=[*keys, {"secretRef": {"name": "admin"}}]), [member("qwen"), member("llama")])
    assert [e["name"] for e in table(opened)] == ["llama", "qwen"]


def test_without_api_keys_no_model_asks_for_one() -> None:
    out = sync(llmgateway_obj(), [member("qwen")])
    assert "authKeyFiles" not in table(out)[0]
    pod = by_kind(out)[("Deployment", "front-llmgw")]["spec"]["template"]["spec"]
    assert [v["name"] for v in pod["volumes"]] == ["tmp", "models"]


# --- children -------------------------------------------------------------------------------------------


def _pod_environ(out: dict[str, Any]) -> dict[str, str]:
    """The shared gateway's env as its Pod gets it (a fixed held-body budget instead of the host's cgroup)."""
    return {**env_of(by_kind(out)[("Deployment", "front-llmgw")]), "NOCTAYA_MAX_HELD_BODY_BYTES": str(64 << 20)}


def test_one_replica_runs_the_scaler_in_the_gateway() -> None:
    out = sync(llmgateway_obj(maxConnectionsPerAddress=0, requestTimeoutSeconds=120,
                              resources={"requests": {"cpu": "200m"}}, imagePullSecrets=[{"name": "mirror"}],
                              service={"type": "LoadBalancer", "annotations": {"b": "2", "a": "1"}}),
               [member("qwen")])
    assert sorted(by_kind(out)) == [("ConfigMap", "front-llmgwroutes"), ("Deployment", "front-llmgw"),
                                    ("RoleBinding", "front-llmgw"), ("Service", "front-llmgw"),
                                    ("Service", "front-llmgwscaler"), ("ServiceAccount", "front-llmgw")]
    deploy = by_kind(out)[("Deployment", "front-llmgw")]
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    assert container["env"][:-2] == [
        {"name": "NOCTAYA_LISTEN_PORT", "value": "8080"},
        {"name": "NOCTAYA_ADMIN_PORT", "value": "9092"},
        {"name": "NOCTAYA_QUEUE_FULL_RETRY_AFTER_SECONDS", "value": "5"},
        {"name": "NOCTAYA_DRAIN_GRACE_SECONDS", "value": "30"},
        {"name": "NOCTAYA_MAX_CONNECTIONS_PER_ADDRESS", "value": "0"},
        {"name": "NOCTAYA_CLIENT_REQUEST_TIMEOUT_SECONDS", "value": "120"},
        {"name": "NOCTAYA_MODEL_TABLE_FILE", "value": "/etc/noctaya/models/models.json"},
        {"name": "NOCTAYA_METRIC_NAME", "value": "noctaya-demand"},
        {"name": "NOCTAYA_SCALER_MODE", "value": "local"},
        {"name": "NOCTAYA_SCALER_PORT", "value": "9090"},
        {"name": "NOCTAYA_ENDPOINT_SOURCE", "value": "endpointslices"},
    ]
    assert [p["name"] for p in container["ports"]] == ["http", "admin", "grpc"]
    assert container["resources"] == {"requests": {"cpu": "200m", "memory": "64Mi"}, "limits": {"memory": "512Mi"}}
    # A directory mount, never subPath: the kubelet updates it in place and the gateway rereads the file.
    assert {"name": "models", "mountPath": "/etc/noctaya/models", "readOnly": True} in container["volumeMounts"]
    assert not any("subPath" in m for m in container["volumeMounts"])
    pod = deploy["spec"]["template"]["spec"]
    assert {"name": "models", "configMap": {"name": "front-llmgwroutes", "defaultMode": 0o440}} in pod["volumes"]
    assert pod["imagePullSecrets"] == [{"name": "mirror"}]
    # Its own identity (the gateway watches the members' EndpointSlices), the token mounted by this Pod only.
    assert pod["serviceAccountName"] == "front-llmgw" and pod["automountServiceAccountToken"] is True
    assert "affinity" not in pod
    assert deploy["spec"]["replicas"] == 1
    assert deploy["spec"]["selector"]["matchLabels"] == {labels.LLMGATEWAY: GW, labels.COMPONENT: "gateway"}
    public = by_kind(out)[("Service", "front-llmgw")]
    assert public["metadata"]["annotations"] == {"a": "1", "b": "2"}
    assert public["spec"] == {"type": "LoadBalancer", "selector": {labels.LLMGATEWAY: GW, labels.COMPONENT: "gateway"},
                              "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]}
    scaler_svc = by_kind(out)[("Service", "front-llmgwscaler")]
    assert scaler_svc["spec"]["selector"] == {labels.LLMGATEWAY: GW, labels.COMPONENT: "gateway"}
    assert [p["name"] for p in scaler_svc["spec"]["ports"]] == ["grpc"]
    for child in out["children"]:
        # No LLMService's rules (its Pods, its children) may ever select a shared gateway's objects.
        assert labels.LLMSERVICE not in child["metadata"]["labels"]
        assert child["metadata"]["namespace"] == h.NAMESPACE
        assert k8s_problems(child, K8S_TYPES[child["kind"]]) == [], child["kind"]


def test_several_replicas_report_to_an_aggregator_like_a_models_own_gateways() -> None:
    out = sync(llmgateway_obj(replicas=3), [member("qwen", maxQueue=40), member("llama", maxQueue=70)])
    children = by_kind(out)
    assert sorted(children) == [
        ("ConfigMap", "front-llmgwroutes"), ("Deployment", "front-llmgw"), ("Deployment", "front-llmgwaggregator"),
        ("PodDisruptionBudget", "front-llmgw"), ("RoleBinding", "front-llmgw"), ("Secret", "front-llmgwtoken"),
        ("Service", "front-llmgw"), ("Service", "front-llmgwscaler"), ("ServiceAccount", "front-llmgw")]
    deploy = children[("Deployment", "front-llmgw")]
    env = env_of(deploy)
    assert env["NOCTAYA_SCALER_MODE"] == "report"
    assert env["NOCTAYA_AGGREGATOR_URL"] == "http://front-llmgwscaler.models.svc.cluster.local:9091/v1/report"
    assert env["NOCTAYA_AGGREGATOR_TOKEN_FILE"] == "/var/run/noctaya/scaler-token/token"
    assert "NOCTAYA_SCALER_PORT" not in env
    pod = deploy["spec"]["template"]["spec"]
    assert pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"][
        "labelSelector"] == {"matchLabels": {labels.LLMGATEWAY: GW, labels.COMPONENT: "gateway"}}
    assert {"name": "scaler-token", "secret": {
        "secretName": "front-llmgwtoken", "items": [{"key": "token", "path": "token"},
                                                    {"key": "previous-token", "path": "previous-token"}],
        "defaultMode": 0o440}} in pod["volumes"]
    assert [p["name"] for p in pod["containers"][0]["ports"]] == ["http", "admin"]
    agg = children[("Deployment", "front-llmgwaggregator")]
    agg_env = env_of(agg)
    assert agg_env["NOCTAYA_MAX_MEMBER_DEMAND"] == "70"  # the largest maxQueue of a routed model
    assert agg_env["NOCTAYA_MAX_MEMBERS_PER_ADDRESS"] == "6"
    assert agg["spec"]["template"]["metadata"]["labels"][labels.COMPONENT] == "aggregator"
    scaler_svc = children[("Service", "front-llmgwscaler")]
    assert scaler_svc["spec"]["selector"] == {labels.LLMGATEWAY: GW, labels.COMPONENT: "aggregator"}
    assert [p["name"] for p in scaler_svc["spec"]["ports"]] == ["grpc", "report"]
    assert children[("PodDisruptionBudget", "front-llmgw")]["spec"] == {
        "minAvailable": 1, "selector": {"matchLabels": {labels.LLMGATEWAY: GW, labels.COMPONENT: "gateway"}}}
    token = children[("Secret", "front-llmgwtoken")]
    assert token["metadata"]["annotations"] == {"serving.noctaya.io/token-epoch": "0"}
    for child in out["children"]:
        assert k8s_problems(child, K8S_TYPES[child["kind"]]) == [], child["kind"]
    # The token, once written, is what every later sync returns.
    observed = [h.as_observed(c, i) for i, c in enumerate(out["children"])]
    again = llmgateway.sync(request(resync(llmgateway_obj(replicas=3), out), [member("qwen"), member("llama")],
                                    children=observed), h.config())
    assert by_kind(again)[("Secret", "front-llmgwtoken")]["data"] == token["data"]


def test_the_table_parses_with_the_gateways_own_parser() -> None:
    keys = [{"secretRef": {"name": "k"}, "models": ["qwen"]}, {"secretRef": {"name": "all"}}]
    out = sync(llmgateway_obj(apiKeys=keys), [member("qwen", coldRequestMode="reject"), member("llama")])
    entries = table(out)
    for entry in entries:
        assert set(entry) <= {"name", MEMBER_FIELD, SCALED_OBJECT_FIELD, shared.AUTH_KEY_FILES, *MODEL_FIELDS}
    parsed = parse_model_table(json.dumps({"models": entries}).encode(), load_config(environ=_pod_environ(out)))
    assert list(parsed.models) == ["llama", "qwen"]
    assert parsed.members == {"llama": "llama", "qwen": "qwen"}
    assert parsed.scaled_objects == {"models/llama-backend": "llama", "models/qwen-backend": "qwen"}
    assert parsed.models["qwen"].cold_mode == "reject"
    assert parsed.models["qwen"].auth_key_files == ("/var/run/noctaya/api-keys/0/api-key", "/var/run/noctaya/api-keys/1/api-key")
    assert parsed.models["qwen"].backend_url == "http://qwen-backend.models.svc.cluster.local:8000"
    assert parsed.models["llama"].model_table_file == "/etc/noctaya/models/models.json"
    # Compact, deterministic JSON.
    raw = by_kind(out)[("ConfigMap", "front-llmgwroutes")]["data"]["models.json"]
    assert raw == json.dumps({"models": table(out)}, separators=(",", ":"))


# --- never destructive, never churning ------------------------------------------------------------------


def test_an_unchanged_world_gets_the_same_bytes_on_every_resync() -> None:
    parent = llmgateway_obj(replicas=2, apiKeys=[{"secretRef": {"name": "k"}}])
    members = [member("qwen"), member("llama"), member("broken", served="x")]
    members[2]["spec"]["runtime"] = {"name": "missing"}
    first = llmgateway.sync(request(parent, members), h.config())
    observed = [h.as_observed(c, i) for i, c in enumerate(first["children"])]
    second = llmgateway.sync(request(resync(parent, first), members, children=observed), h.config())
    # A later clock changes nothing: no condition changed status, so no timestamp moves.
    third = llmgateway.sync(request(resync(parent, second), members, children=observed), h.config(h.LATER_TIME))
    assert serialize_body(second) == serialize_body(third)
    assert second["children"] == first["children"]
    assert second["status"]["models"] == first["status"]["models"]


def test_a_member_that_breaks_keeps_its_previous_entry() -> None:
    parent = llmgateway_obj()
    good = [member("qwen", maxQueue=9), member("llama")]
    first = sync(parent, good)
    observed = [h.as_observed(c, i) for i, c in enumerate(first["children"])]
    broken = copy.deepcopy(good)
    broken[0]["spec"]["endpoint"]["maxQueue"] = "lots"  # no longer parses
    broken[1]["spec"]["runtime"] = {"name": "gone"}  # its runtime is missing
    fresh = member("phi")
    later = llmgateway.sync(request(resync(parent, first), [*broken, fresh], children=observed), h.config())
    assert table(later) == sorted([*table(first), *table(sync(parent, [fresh]))], key=lambda e: e["name"])
    assert later["status"]["models"] == [{"name": "llama", "service": "llama"}, {"name": "phi", "service": "phi"},
                                         {"name": "qwen", "service": "qwen"}]
    cond = conditions(later)["MembersAccepted"]
    assert (cond["status"], cond["reason"]) == ("False", "InvalidMember")
    assert "LLMService qwen is invalid" in cond["message"] and "its previous entry is kept" in cond["message"]
    assert "LLMService llama: InferenceRuntime gone does not exist; its previous entry is kept" in cond["message"]


def test_a_renamed_member_keeps_its_member_identity_in_the_table() -> None:
    """Issue 29 item 6: the gateway follows a member across a change of served name by the entry's
    `member` (the LLMService), which a rename does not change."""
    parent = llmgateway_obj()
    first = sync(parent, [member("qwen", served="qwen-7b"), member("llama")])
    later = sync(parent, [member("qwen", served="qwen-14b"), member("llama")])
    assert {e["name"]: e[MEMBER_FIELD] for e in table(first)} == {"llama": "llama", "qwen-7b": "qwen"}
    assert {e["name"]: e[MEMBER_FIELD] for e in table(later)} == {"llama": "llama", "qwen-14b": "qwen"}
    parsed = parse_model_table(json.dumps({"models": table(first)}).encode(), load_config(environ=_pod_environ(first)))
    newer = parse_model_table(json.dumps({"models": table(later)}).encode(), load_config(environ=_pod_environ(later)))
    change = parsed.diff(newer)
    assert (change.renamed, change.added, change.removed) == ((("qwen-7b", "qwen-14b"),), (), ())


def test_a_kept_entry_from_an_older_release_learns_its_member() -> None:
    """A table rendered before 0.2.0 has no `member`; a broken member's kept entry gets it, so the
    table never lists one member under two entries nor another member's identity."""
    parent = llmgateway_obj()
    first = sync(parent, [member("qwen")])
    old_cm = copy.deepcopy(by_kind(first)[("ConfigMap", "front-llmgwroutes")])
    old_entries = [{k: v for k, v in e.items() if k not in (MEMBER_FIELD, SCALED_OBJECT_FIELD)} for e in table(first)]
    old_cm["data"]["models.json"] = json.dumps({"models": old_entries}, separators=(",", ":"))
    observed = [h.as_observed(c, i) for i, c in enumerate(
        [old_cm, *(c for c in first["children"] if c["kind"] != "ConfigMap")])]
    broken = member("qwen", maxQueue="lots")
    later = llmgateway.sync(request(resync(parent, first), [broken], children=observed), h.config())
    assert table(later) == [{**old_entries[0], MEMBER_FIELD: "qwen", SCALED_OBJECT_FIELD: "models/qwen-backend"}]


def test_a_broken_member_never_routed_stays_unrouted() -> None:
    bad = member("qwen")
    bad["spec"]["runtime"] = {"name": "gone"}
    out = sync(llmgateway_obj(), [bad])
    assert table(out) == [] and out["status"]["models"] == []
    cond = conditions(out)["MembersAccepted"]
    assert cond["reason"] == "RuntimeNotResolved" and "it is not routed (it never was)" in cond["message"]


def test_an_invalid_spec_keeps_every_child_and_the_routed_models() -> None:
    parent = llmgateway_obj(replicas=2)
    members = [member("qwen")]
    first = sync(parent, members)
    observed = [h.as_observed(c, i, **({"readyReplicas": 2, "replicas": 2} if c["kind"] == "Deployment" else {}))
                for i, c in enumerate(first["children"])]
    bad = resync(parent, first)
    bad["spec"] = {"replicas": 99}
    out = llmgateway.sync(request(bad, [*members, member("newcomer")], children=observed), h.config())
    assert by_kind(out) == by_kind(first)  # as last applied: the 3-way merge changes nothing
    assert out["status"]["models"] == first["status"]["models"]
    conds = conditions(out)
    assert (conds["Accepted"]["status"], conds["Accepted"]["reason"]) == ("False", "InvalidSpec")
    assert "spec.replicas" in conds["Accepted"]["message"]
    assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == ("False", "InvalidSpec")
    assert conds["MembersAccepted"]["status"] == "Unknown"


def test_ready_follows_the_gateway_deployment_like_a_models_own_gateway() -> None:
    parent = llmgateway_obj()
    first = sync(parent, [member("qwen")])
    assert conditions(first)["Ready"]["status"] == "False"
    ready = [h.as_observed(c, i, **({"readyReplicas": 1, "replicas": 1} if c["kind"] == "Deployment" else {}))
             for i, c in enumerate(first["children"])]
    out = llmgateway.sync(request(resync(parent, first), [member("qwen")], children=ready), h.config(h.LATER_TIME))
    cond = conditions(out)["Ready"]
    assert (cond["status"], cond["reason"], cond["message"]) == ("True", "Available", "1/1 gateways ready")
    assert cond["lastTransitionTime"] == h.LATER_TIME
    assert conditions(out)["Accepted"]["lastTransitionTime"] == h.FIXED_TIME


# --- a namespace not enabled for LLMGateways (no RoleBinding: Metacontroller may not write ConfigMaps) ---


def _not_enabled(out: dict[str, Any]) -> None:
    conds = conditions(out)
    assert (conds["Accepted"]["status"], conds["Accepted"]["reason"]) == ("False", "NamespaceNotEnabled")
    assert (conds["MembersAccepted"]["status"], conds["MembersAccepted"]["reason"]) == ("Unknown", "NotEvaluated")


def test_the_shipped_rolebinding_is_the_one_the_hook_looks_for_and_binds_write_only_role() -> None:
    binding = yaml.safe_load(ENABLING_FILE.read_text())
    assert binding["metadata"]["name"] == llmgateway.NAMESPACE_ROLEBINDING
    assert "namespace" not in binding["metadata"], "applied with -n <namespace>"
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": llmgateway.NAMESPACE_CLUSTERROLE}
    rbac = Path(ENABLING_FILE).parents[1] / "rbac.yaml"
    (role,) = [d for d in yaml.safe_load_all(rbac.read_text())
               if d["kind"] == "ClusterRole" and d["metadata"]["name"] == llmgateway.NAMESPACE_CLUSTERROLE]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["configmaps"],
                              "verbs": ["create", "update", "patch", "delete"]}]
    # An aggregating Metacontroller ClusterRole would grant it in every namespace.
    assert not role["metadata"].get("labels") and "aggregationRule" not in role


def test_a_new_gateway_in_a_namespace_not_enabled_renders_nothing_and_says_what_to_create() -> None:
    out = llmgateway.sync(request(llmgateway_obj(), [member("qwen")], bindings=[]), h.config())
    # No ConfigMap Metacontroller could not create, and no gateway Pod waiting forever for it.
    assert out["children"] == [] and out["status"]["models"] == []
    _not_enabled(out)
    accepted = conditions(out)["Accepted"]["message"]
    assert accepted == (
        "namespace models is not enabled for LLMGateways: Metacontroller may write the routing ConfigMap only "
        "where a RoleBinding noctaya-llmgateway of ClusterRole noctaya-metacontroller-llmgateway to Metacontroller "
        'exists; create it (docs/install.md, "Enabling a namespace for LLMGateways"); existing children are kept '
        "unchanged")
    ready = conditions(out)["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "NamespaceNotEnabled")
    # A member says the same in its own GatewayReady (the gateway's not-ready reason is passed through).
    said = st.shared_gateway_condition({**llmgateway_obj(), "status": out["status"]}, GW, "qwen", "qwen")
    assert (said.status, said.reason) == ("False", "NamespaceNotEnabled")
    assert "not enabled for LLMGateways" in said.message


def test_an_upgraded_gateway_keeps_every_child_until_its_namespace_is_enabled() -> None:
    """The previous release wrote ConfigMaps everywhere: its gateways keep serving their last table, and
    a member that joins meanwhile is routed once the RoleBinding exists."""
    parent = llmgateway_obj(replicas=2)
    first = sync(parent, [member("qwen")])
    observed = [h.as_observed(c, i, **({"readyReplicas": 2, "replicas": 2} if c["kind"] == "Deployment" else {}))
                for i, c in enumerate(first["children"])]
    members = [member("qwen"), member("newcomer")]
    frozen = llmgateway.sync(request(resync(parent, first), members, children=observed, bindings=[]),
                             h.config(h.LATER_TIME))
    assert by_kind(frozen) == by_kind(first)  # as last applied: Metacontroller writes nothing
    assert frozen["status"]["models"] == first["status"]["models"]
    _not_enabled(frozen)
    ready = conditions(frozen)["Ready"]
    assert (ready["status"], ready["reason"]) == ("True", "Available")  # it still serves
    again = llmgateway.sync(request(resync(parent, frozen), members, children=observed, bindings=[]),
                            h.config(h.LATER_TIME))
    assert serialize_body(again) == serialize_body(frozen)  # a resync while not enabled changes nothing

    enabled = llmgateway.sync(request(resync(parent, again), members, children=observed), h.config(h.LATER_TIME))
    assert [e["name"] for e in table(enabled)] == ["newcomer", "qwen"]
    accepted = conditions(enabled)["Accepted"]
    assert (accepted["status"], accepted["lastTransitionTime"]) == ("True", h.LATER_TIME)


def test_a_rolebinding_of_another_role_or_namespace_does_not_enable() -> None:
    other_role = enabling_rolebinding()
    other_role["roleRef"]["name"] = "edit"
    out = llmgateway.sync(request(llmgateway_obj(), [member("qwen")], bindings=[other_role]), h.config())
    _not_enabled(out)
    assert "RoleBinding noctaya-llmgateway refers to ClusterRole edit, not ClusterRole " \
           "noctaya-metacontroller-llmgateway; replace it (roleRef cannot be changed)" in conditions(out)["Accepted"]["message"]
    elsewhere = llmgateway.sync(request(llmgateway_obj(), [member("qwen")], bindings=[enabling_rolebinding("other")]),
                                h.config())
    _not_enabled(elsewhere)
    deleting = enabling_rolebinding()
    deleting["metadata"]["deletionTimestamp"] = h.FIXED_TIME
    _not_enabled(llmgateway.sync(request(llmgateway_obj(), [member("qwen")], bindings=[deleting]), h.config()))


def test_a_request_without_the_rolebinding_group_renders_as_before() -> None:
    """Metacontroller may hold a customize answer from before the rule existed (cached per gateway
    generation), and offline rendering relates no RoleBinding: unknown is not "not enabled"."""
    without = request(llmgateway_obj(), [member("qwen")])
    del without["related"][ROLEBINDINGS]
    enabled = request(llmgateway_obj(), [member("qwen")])
    assert serialize_body(llmgateway.sync(without, h.config())) == serialize_body(llmgateway.sync(enabled, h.config()))


# --- the HTTP shell -------------------------------------------------------------------------------------


@pytest.mark.parametrize("hook", ["customize", "sync"])
def test_the_hook_server_answers_llmgateway_hooks(hook: str) -> None:
    app = create_app(config=h.config(), handlers={
        f"/v1/llmgateway/{hook}": getattr(llmgateway, hook),
    })
    body = request(llmgateway_obj(), [member("qwen")])
    response = app.test_client().post(f"/v1/llmgateway/{hook}", json=body)
    assert response.status_code == 200
    assert response.data == serialize_body(getattr(llmgateway, hook)(body, h.config()))
    bad = app.test_client().post(f"/v1/llmgateway/{hook}", json={"parent": {"metadata": {}}})
    assert bad.status_code == 400


def test_a_member_with_the_reserved_baked_image_strategy_is_not_routed_since_it_has_no_backend() -> None:
    baked = member("phi")
    baked["spec"]["cache"] = {"strategy": "BakedImage"}
    out = sync(llmgateway_obj(), [member("qwen"), baked])
    assert [e["name"] for e in table(out)] == ["qwen"]
    cond = conditions(out)["MembersAccepted"]
    assert cond["reason"] == "InvalidMember" and "BakedImage is not implemented" in cond["message"]


# --- Noctaya's own changes reach the shared gateway's Pods only while nothing flows through them ---


def _upgraded(image: str = "ghcr.io/noctaya/noctaya:9.9.9") -> Any:
    base = h.config()
    return type(base)(**{**base.__dict__, "image": image})


def _warm(obj: dict[str, Any], replicas: int) -> dict[str, Any]:
    return {**obj, "status": {"replicas": replicas, "readyReplicas": replicas}}


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_new_image_waits_while_a_member_is_warm_and_applies_when_all_are_at_zero(replicas: int) -> None:
    members = [member("a", served="a"), member("b", served="b")]
    parent = llmgateway_obj(replicas=replicas)
    first = sync(parent, members)
    observed = h.observe_all(first["children"])
    parent = llmgateway_obj(status=first["status"], replicas=replicas)
    deployments = [c["metadata"]["name"] for c in first["children"] if c["kind"] == "Deployment"]

    warm = llmgateway.sync(request(parent, [_warm(members[0], 0), _warm(members[1], 1)], children=observed), _upgraded())
    for name in deployments:
        assert by_kind(warm)[("Deployment", name)]["spec"]["template"] == by_kind(first)[("Deployment", name)]["spec"]["template"]
    cond = conditions(warm)["UpgradePending"]
    assert (cond["status"], cond["reason"]) == ("True", "WaitingForScaleToZero")
    assert warm["status"]["pendingUpgrade"]["deployments"] == sorted(deployments)

    idle = llmgateway.sync(request(parent, [_warm(members[0], 0), _warm(members[1], 0)], children=observed), _upgraded())
    for name in deployments:
        assert by_kind(idle)[("Deployment", name)]["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":9.9.9")
    assert conditions(idle)["UpgradePending"]["reason"] == "UpToDate"


def test_a_member_with_min_one_makes_the_shared_gateway_wait_for_a_window_or_approval() -> None:
    always = member("a", served="a")
    always["spec"]["scaling"] = {"min": 1}
    parent = llmgateway_obj()
    first = sync(parent, [always])
    observed = h.observe_all(first["children"])
    parent = llmgateway_obj(status=first["status"])
    held = llmgateway.sync(request(parent, [_warm(always, 1)], children=observed), _upgraded())
    assert conditions(held)["UpgradePending"]["reason"] == "WaitingForApproval"
    parent["metadata"]["annotations"] = {"serving.noctaya.io/approve-upgrade": held["status"]["pendingUpgrade"]["digest"]}
    approved = llmgateway.sync(request(parent, [_warm(always, 1)], children=observed), _upgraded())
    assert conditions(approved)["UpgradePending"]["reason"] == "UpToDate"


def test_a_change_to_the_llmgateway_itself_rolls_at_once() -> None:
    members = [member("a", served="a")]
    first = sync(llmgateway_obj(), members)
    observed = h.observe_all(first["children"])
    edited = llmgateway_obj(status=first["status"], generation=2, maxConnectionsPerAddress=7)
    out = llmgateway.sync(request(edited, [_warm(members[0], 1)], children=observed), _upgraded())
    env = {e["name"]: e.get("value") for e in by_kind(out)[("Deployment", "front-llmgw")]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["NOCTAYA_MAX_CONNECTIONS_PER_ADDRESS"] == "7"
    assert conditions(out)["UpgradePending"]["reason"] == "UpToDate"
