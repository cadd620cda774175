"""A gateway's own identity and its balancing settings, through the real hooks.

- The gateway (a model's own, or an LLMGateway's) gets a ServiceAccount and a RoleBinding of it to
  `noctaya-gateway-endpoints` in its namespace, mounts that token (the ServiceAccount itself mounts
  none) and watches the backend's EndpointSlices: only when the calling controller's manifest lists
  both child types. With an older manifest (the hook server answers it during an upgrade) the answer is
  exactly what it was before gateways had an identity.
- `endpoint.balancing` renders gateway env only for what is set, and for a member of an LLMGateway a
  second key of the routing ConfigMap (`balancing.json`), never new fields in `models.json`.
- Every answer is byte-identical on resync; a warm model takes the identity only by the rollout rules.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from gateway.config import load_config
from gateway.modeltable import BALANCING_FIELDS, apply_balancing, parse_model_table
from hooks.api.llmservice import LLMService
from hooks.controller import llmgateway, rollout, sync
from hooks.controller import observe as obs
from hooks.render import render_documents
from hooks.resources.context import RenderContext
from tests.hooks import helpers as h
from tests.hooks import test_llmgateway as lg

REPO = Path(__file__).resolve().parents[2]
IDENTITY = {("ServiceAccount", "qwen-gateway"), ("RoleBinding", "qwen-gateway")}
SHARED_IDENTITY = {("ServiceAccount", "front-llmgw"), ("RoleBinding", "front-llmgw")}
IDENTITY_TYPES = {("v1", "serviceaccounts"), ("rbac.authorization.k8s.io/v1", "rolebindings")}
IDENTITY_ENV = {"name": "NOCTAYA_ENDPOINT_SOURCE", "value": "endpointslices"}


# --- controller manifests -------------------------------------------------------------------------


def manifest(controller: str) -> dict[str, Any]:
    """A controller of this release as Metacontroller sends it: the whole object, spec included."""
    return yaml.safe_load((REPO / "metacontroller" / f"{controller}-controller.yaml").read_text())


def older(controller: dict[str, Any], keep: set[tuple[str, str]] | None = None) -> dict[str, Any]:
    """The same controller as a release before gateway identities listed it (or with only `keep` of
    the identity's types)."""
    out = copy.deepcopy(controller)
    out["spec"]["childResources"] = [c for c in out["spec"]["childResources"]
                                     if (c["apiVersion"], c["resource"]) not in IDENTITY_TYPES - (keep or set())]
    return out


NEW = manifest("llmservice")
OLD = older(NEW)
NEW_GW = manifest("llmgateway")
OLD_GW = older(NEW_GW)


def llm_request(parent: dict[str, Any], controller: dict[str, Any] | None, **kw: Any) -> dict[str, Any]:
    request = h.sync_request(parent, **kw)
    if controller is None:
        del request["controller"]
    else:
        request["controller"] = controller
    return request


def answer(controller: dict[str, Any] | None, **spec: Any) -> dict[str, Any]:
    return sync.sync(llm_request(h.llmservice(**spec), controller), h.config())


def kids(out: dict[str, Any]) -> set[tuple[str, str]]:
    return set(h.by_kind_name(out["children"]))


def gateway_pod(out: dict[str, Any], name: str = "qwen-gateway") -> dict[str, Any]:
    return h.by_kind_name(out["children"])[("Deployment", name)]["spec"]["template"]["spec"]


def env_list(out: dict[str, Any], name: str = "qwen-gateway") -> list[dict[str, str]]:
    (container,) = gateway_pod(out, name)["containers"]
    return container["env"]


def without_identity(out: dict[str, Any], name: str = "qwen-gateway") -> dict[str, Any]:
    """`out` with everything the identity adds taken away again."""
    stripped = copy.deepcopy(out)
    stripped["children"] = [c for c in stripped["children"]
                            if not (c["kind"] in ("ServiceAccount", "RoleBinding") and c["metadata"]["name"] == name)]
    pod = gateway_pod(stripped, name)
    assert pod.pop("serviceAccountName") == name
    pod["automountServiceAccountToken"] = False
    (container,) = pod["containers"]
    container["env"].remove(IDENTITY_ENV)
    return stripped


def test_the_manifests_list_both_types_of_the_identity() -> None:
    for controller in (NEW, NEW_GW):
        assert obs.child_resources(controller) >= IDENTITY_TYPES
        methods = {(c["apiVersion"], c["resource"]): c["updateStrategy"]["method"]
                   for c in controller["spec"]["childResources"]}
        assert all(methods[t] == "InPlace" for t in IDENTITY_TYPES)


def test_this_releases_manifest_gives_the_gateway_its_identity() -> None:
    out = answer(NEW)
    assert IDENTITY <= kids(out)
    by = h.by_kind_name(out["children"])
    account = by[("ServiceAccount", "qwen-gateway")]
    assert account == {"apiVersion": "v1", "kind": "ServiceAccount",
                       "metadata": {"name": "qwen-gateway", "namespace": h.NAMESPACE,
                                    "labels": by[("Deployment", "qwen-gateway")]["metadata"]["labels"]},
                       "automountServiceAccountToken": False}
    binding = by[("RoleBinding", "qwen-gateway")]
    assert binding["metadata"] == account["metadata"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": "noctaya-gateway-endpoints"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "qwen-gateway", "namespace": h.NAMESPACE}]
    pod = gateway_pod(out)
    assert pod["serviceAccountName"] == "qwen-gateway" and pod["automountServiceAccountToken"] is True
    # Appended after everything a gateway had before, then the interpreter's settings as always.
    assert env_list(out)[-3:] == [IDENTITY_ENV, {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
                                  {"name": "PYTHONUNBUFFERED", "value": "1"}]
    config = load_config(environ={e["name"]: e["value"] for e in env_list(out)})
    assert config.endpoint_source == "endpointslices"
    # The aggregate scaler never talks to backends: no identity for it.
    multi = answer(NEW, endpoint={"replicas": 2})
    assert gateway_pod(multi, "qwen-aggregator")["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in gateway_pod(multi, "qwen-aggregator")


@pytest.mark.parametrize("spec", [{}, {"endpoint": {"replicas": 3}},
                                  {"endpoint": {"auth": {"secretRef": {"name": "keys"}}, "maxQueue": 7}},
                                  {"scalerTLS": {"secretName": "tls", "triggerAuthentication": "keda-tls"}}],
                         ids=["defaults", "replicas", "auth", "tls"])
def test_an_older_manifest_gets_exactly_the_answer_without_an_identity(spec: dict[str, Any]) -> None:
    old = answer(OLD, **copy.deepcopy(spec))
    assert not {k for k in kids(old) if k[0] in ("ServiceAccount", "RoleBinding")}
    pod = gateway_pod(old)
    assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod
    assert IDENTITY_ENV not in env_list(old)
    # Nothing else differs from this release's answer: the same children, templates and status.
    assert json.dumps(old) == json.dumps(without_identity(answer(NEW, **copy.deepcopy(spec))))


@pytest.mark.parametrize("keep", [{("v1", "serviceaccounts")}, {("rbac.authorization.k8s.io/v1", "rolebindings")}])
def test_one_of_the_two_types_is_not_enough(keep: set[tuple[str, str]]) -> None:
    out = answer(older(NEW, keep))
    assert json.dumps(out) == json.dumps(answer(OLD))


def test_without_a_manifest_the_identity_is_rendered() -> None:
    """Offline rendering and hand-made requests: no controller, or one without its spec."""
    with_manifest = json.dumps(answer(NEW))
    assert json.dumps(answer(None)) == with_manifest
    assert json.dumps(answer({"metadata": {"name": "noctaya-llmservice"}})) == with_manifest
    rendered = render_documents([h.runtime(), h.llmservice()], h.config())
    assert IDENTITY <= {(o["kind"], o["metadata"]["name"]) for o in rendered}


def test_child_resources_reads_the_manifest() -> None:
    assert obs.child_resources(None) is None and obs.child_resources({"metadata": {}}) is None
    assert obs.child_resources({"spec": {}}) == frozenset()
    assert obs.child_resources({"spec": {"childResources": "nonsense"}}) == frozenset()
    assert obs.child_resources({"spec": {"childResources": [{"apiVersion": "v1", "resource": "serviceaccounts"},
                                                            "junk"]}}) == {("v1", "serviceaccounts")}


# --- resync and upgrade -----------------------------------------------------------------------------


def running(controller: dict[str, Any], replicas: int, **spec: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The LLMService as `controller`'s hooks left it: (parent with its status, observed children), the
    backend at `replicas` (KEDA's count)."""
    parent = h.llmservice(**copy.deepcopy(spec))
    first = sync.sync(llm_request(parent, controller), h.config())
    observed = []
    for i, child in enumerate(first["children"]):
        counts = {}
        if child["kind"] == "Deployment":
            n = replicas if child["metadata"]["name"] == "qwen-backend" else 1
            counts = {"replicas": n, "readyReplicas": n}
        observed.append(h.as_observed(child, i, **counts))
    return h.llmservice(status=first["status"], **copy.deepcopy(spec)), observed


def resync(controller: dict[str, Any], parent: dict[str, Any], observed: list[dict[str, Any]]) -> dict[str, Any]:
    return sync.sync(llm_request(parent, controller, children=observed), h.config())


@pytest.mark.parametrize("controller", [NEW, OLD], ids=["this-release", "older"])
@pytest.mark.parametrize("balancing", [None, {"prefixAffinity": False, "coldBatchPerPod": 3}], ids=["plain", "balancing"])
def test_a_resync_of_an_unchanged_world_is_byte_identical(controller: dict[str, Any], balancing: Any) -> None:
    spec = {} if balancing is None else {"endpoint": {"balancing": balancing}}
    first = sync.sync(llm_request(h.llmservice(**copy.deepcopy(spec)), controller), h.config())
    parent, observed = running(controller, 0, **spec)  # applied as it was answered (scaling.min 0)
    again = resync(controller, parent, observed)
    assert again["children"] == first["children"]  # (a create-once PVC comes back as last applied: key order)
    settled = resync(controller, {**parent, "status": again["status"]}, observed)
    assert json.dumps(settled) == json.dumps(again)
    # Warm (KEDA moved the backend to 1): the same, with KEDA's count echoed back.
    parent, observed = running(controller, 1, **spec)
    again = resync(controller, parent, observed)
    assert json.dumps(resync(controller, {**parent, "status": again["status"]}, observed)) == json.dumps(again)


def test_a_warm_model_takes_the_identity_only_by_the_rollout_rules() -> None:
    """The upgrade: the gateway was rendered for an older manifest, then this release's is applied. The
    template change is Noctaya's (the inputs digest is the same), so a warm model keeps its gateway
    Pods (UpgradePending) while the ServiceAccount and RoleBinding, which restart nothing, are created."""
    parent, observed = running(OLD, replicas=1)
    running_template = next(c for c in observed if c["metadata"]["name"] == "qwen-gateway"
                            and c["kind"] == "Deployment")["spec"]["template"]
    held = resync(NEW, parent, observed)
    assert IDENTITY <= kids(held)
    assert h.by_kind_name(held["children"])[("Deployment", "qwen-gateway")]["spec"]["template"] == running_template
    pending = held["status"]["pendingUpgrade"]
    assert pending["deployments"] == ["qwen-gateway"]
    assert pending["changes"] == ["spec.automountServiceAccountToken", "spec.containers[gateway].env",
                                  "spec.serviceAccountName"]
    assert lg.conditions(held)["UpgradePending"]["status"] == "True"
    # Approved: it applies.
    approved = copy.deepcopy(parent)
    approved["metadata"]["annotations"] = {rollout.APPROVE_ANNOTATION: pending["digest"]}
    applied = resync(NEW, approved, observed)
    assert gateway_pod(applied)["serviceAccountName"] == "qwen-gateway"
    # At zero it applies at once.
    cold_parent, cold = running(OLD, replicas=0)
    assert gateway_pod(resync(NEW, cold_parent, cold))["serviceAccountName"] == "qwen-gateway"


# --- endpoint.balancing ---------------------------------------------------------------------------


def balancing_env(out: dict[str, Any]) -> list[dict[str, str]]:
    return [e for e in env_list(out) if e["name"] in ("NOCTAYA_PREFIX_AFFINITY", "NOCTAYA_POD_BATCH")]


@pytest.mark.parametrize(("balancing", "expected"), [
    ({}, []),
    ({"prefixAffinity": True}, []),  # the gateway's default: nothing to say
    ({"prefixAffinity": False}, [{"name": "NOCTAYA_PREFIX_AFFINITY", "value": "false"}]),
    ({"coldBatchPerPod": 4}, [{"name": "NOCTAYA_POD_BATCH", "value": "4"}]),
    ({"prefixAffinity": False, "coldBatchPerPod": 1024},
     [{"name": "NOCTAYA_PREFIX_AFFINITY", "value": "false"}, {"name": "NOCTAYA_POD_BATCH", "value": "1024"}]),
])
def test_balancing_renders_env_only_for_what_is_set(balancing: dict[str, Any], expected: list[dict[str, str]]) -> None:
    plain = answer(NEW)
    out = answer(NEW, endpoint={"balancing": balancing})
    assert balancing_env(out) == expected
    if not expected:  # an unset field changes no template
        assert gateway_pod(out) == gateway_pod(plain)
        return
    # At the very end of Noctaya's env, after the identity's (the env's order is the template's).
    assert env_list(out)[:-2] == [*env_list(plain)[:-2], *expected]
    config = load_config(environ={e["name"]: e["value"] for e in env_list(out)})
    assert config.prefix_affinity is (balancing.get("prefixAffinity") is not False)
    assert config.pod_batch == balancing.get("coldBatchPerPod", 8)
    # With an older manifest the user's settings still render (the gateway then balances through the
    # Service, where they have no Pods to apply to).
    assert balancing_env(answer(OLD, endpoint={"balancing": balancing})) == expected


def test_the_default_cold_batch_said_in_the_api_is_the_gateways() -> None:
    from hooks.api.llmservice import DEFAULT_COLD_BATCH_PER_POD

    environ = {e["name"]: e["value"] for e in env_list(answer(NEW))}
    assert load_config(environ=environ).pod_batch == DEFAULT_COLD_BATCH_PER_POD


def test_balancing_is_part_of_the_gateways_inputs_digest() -> None:
    def inputs(**endpoint: Any) -> str:
        service = LLMService.model_validate(h.llmservice(endpoint=endpoint))
        from hooks.api.runtime import InferenceRuntime

        ctx = RenderContext(service=service, runtime=InferenceRuntime.model_validate(h.runtime()),
                            namespace=h.NAMESPACE, config=h.config())
        return sync.front_inputs(ctx)

    unset = inputs()
    assert inputs(balancing={"prefixAffinity": False}) != unset
    assert inputs(balancing={"coldBatchPerPod": 4}) != unset
    assert inputs(balancing={"coldBatchPerPod": 4}) != inputs(balancing={"coldBatchPerPod": 5})
    # A user's change to it rolls a warm model's gateway at once (it is no Noctaya change).
    parent, observed = running(NEW, replicas=1)
    changed = h.llmservice(generation=2, status=parent["status"], endpoint={"balancing": {"coldBatchPerPod": 2}})
    out = resync(NEW, changed, observed)
    assert balancing_env(out) == [{"name": "NOCTAYA_POD_BATCH", "value": "2"}]
    assert lg.conditions(out)["UpgradePending"]["status"] == "False"


@pytest.mark.parametrize("balancing", [{"coldBatchPerPod": 0}, {"coldBatchPerPod": 1025}, {"prefixAffinity": "maybe"},
                                       {"prefixAffinity": False, "weights": 1}])
def test_bad_balancing_is_refused(balancing: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        LLMService.model_validate(h.llmservice(endpoint={"balancing": balancing}))


def test_the_crd_gives_balancing_no_schema_default() -> None:
    """docs/upgrading.md, "New fields": absent means the gateway's defaults, never a stored default."""
    crd = yaml.safe_load((REPO / "crds" / "serving.noctaya.io_llmservices.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["endpoint"]
    balancing = schema["properties"]["balancing"]
    assert "default" not in balancing and all("default" not in p for p in balancing["properties"].values())
    assert set(balancing["properties"]) == set(BALANCING_FIELDS)  # the keys balancing.json carries too


# --- the shared gateway -----------------------------------------------------------------------------


def gw_request(controller: dict[str, Any] | None, members: list[dict[str, Any]], status: dict[str, Any] | None = None,
               children: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    request = lg.request(lg.llmgateway_obj(status=status), members, children=children)
    if controller is None:
        del request["controller"]
    else:
        request["controller"] = controller
    return request


def gw_answer(controller: dict[str, Any] | None, members: list[dict[str, Any]]) -> dict[str, Any]:
    return llmgateway.sync(gw_request(controller, members), h.config())


def routes(out: dict[str, Any]) -> dict[str, str]:
    return h.by_kind_name(out["children"])[("ConfigMap", "front-llmgwroutes")]["data"]


def test_the_shared_gateway_gets_its_identity_with_this_releases_manifest() -> None:
    out = gw_answer(NEW_GW, [lg.member("qwen")])
    assert SHARED_IDENTITY <= kids(out)
    binding = h.by_kind_name(out["children"])[("RoleBinding", "front-llmgw")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "front-llmgw", "namespace": h.NAMESPACE}]
    assert binding["roleRef"]["name"] == "noctaya-gateway-endpoints"
    account = h.by_kind_name(out["children"])[("ServiceAccount", "front-llmgw")]
    assert account["automountServiceAccountToken"] is False
    assert account["metadata"]["labels"] == {"serving.noctaya.io/llmgateway": "front",
                                             "serving.noctaya.io/component": "gateway",
                                             "app.kubernetes.io/managed-by": "noctaya"}
    pod = gateway_pod(out, "front-llmgw")
    assert pod["serviceAccountName"] == "front-llmgw" and pod["automountServiceAccountToken"] is True
    assert env_list(out, "front-llmgw")[-3] == IDENTITY_ENV
    assert json.dumps(gw_answer(None, [lg.member("qwen")])) == json.dumps(out)


def test_the_shared_gateway_with_an_older_manifest_is_exactly_as_before() -> None:
    old = gw_answer(OLD_GW, [lg.member("qwen")])
    assert not kids(old) & SHARED_IDENTITY
    assert json.dumps(old) == json.dumps(without_identity(gw_answer(NEW_GW, [lg.member("qwen")]), "front-llmgw"))


def test_balancing_json_only_when_a_member_sets_something() -> None:
    plain = gw_answer(NEW_GW, [lg.member("qwen"), lg.member("llama")])
    assert set(routes(plain)) == {"models.json"}
    unset = gw_answer(NEW_GW, [lg.member("qwen", balancing={}), lg.member("llama", balancing={"prefixAffinity": None})])
    assert json.dumps(unset) == json.dumps(plain)


def test_balancing_json_names_the_members_that_set_something_and_only_what_they_set() -> None:
    members = [lg.member("qwen", balancing={"prefixAffinity": False, "coldBatchPerPod": 4}),
               lg.member("llama", served="llama-3", balancing={"coldBatchPerPod": 2}),
               lg.member("phi", balancing={"prefixAffinity": True}),
               lg.member("mistral")]
    out = gw_answer(NEW_GW, members)
    data = routes(out)
    assert data["balancing.json"] == ('{"models":{"llama-3":{"coldBatchPerPod":2},"phi":{"prefixAffinity":true},'
                                      '"qwen":{"coldBatchPerPod":4,"prefixAffinity":false}}}')
    # models.json is what it would be without any balancing: the previous release's gateway refuses
    # fields it does not know in it.
    plain = gw_answer(NEW_GW, [lg.member("qwen"), lg.member("llama", served="llama-3"), lg.member("phi"),
                               lg.member("mistral")])
    assert data["models.json"] == routes(plain)["models.json"]
    # ... and the shared gateway's Pods do not roll for a member's balancing.
    assert gateway_pod(out, "front-llmgw") == gateway_pod(plain, "front-llmgw")
    # The gateway reads it as meant.
    base = load_config(environ={e["name"]: e["value"] for e in env_list(out, "front-llmgw")})
    table, problem = apply_balancing(parse_model_table(data["models.json"].encode(), base),
                                     data["balancing.json"].encode())
    assert problem is None
    assert (table.models["qwen"].prefix_affinity, table.models["qwen"].pod_batch) == (False, 4)
    assert (table.models["llama-3"].prefix_affinity, table.models["llama-3"].pod_batch) == (True, 2)
    assert (table.models["mistral"].prefix_affinity, table.models["mistral"].pod_batch) == (True, 8)


def test_the_routing_configmap_is_byte_identical_on_resync_and_keeps_a_broken_members_balancing() -> None:
    members = [lg.member("qwen", balancing={"coldBatchPerPod": 4}), lg.member("llama", balancing={"prefixAffinity": False})]
    first = gw_answer(NEW_GW, members)
    observed = h.observe_all(first["children"])
    again = llmgateway.sync(gw_request(NEW_GW, members, children=observed, status=first["status"]), h.config())
    assert json.dumps(again["children"]) == json.dumps(first["children"])
    # llama stops parsing: its table entry and its balancing stay as they were.
    broken = copy.deepcopy(members)
    broken[1]["spec"]["endpoint"]["maxQueue"] = -1
    kept = llmgateway.sync(gw_request(NEW_GW, broken, children=observed, status=first["status"]), h.config())
    assert routes(kept) == routes(first)
    assert lg.conditions(kept)["MembersAccepted"]["reason"] == "InvalidMember"
