"""An LLMService that joins a shared gateway (`spec.endpoint.gateway` names an LLMGateway).

Through the real hooks and models: a member renders no gateway of its own, its ScaledObject asks the
LLMGateway's scaler for its served model, the API refuses what a member cannot use, GatewayReady and
status.endpoint come from the LLMGateway, a switch either way is a deliberate change while a bad
spec keeps everything, and an unchanged world gets the same bytes on every resync.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from hooks import crdgen
from hooks.api.llmservice import LLMService
from hooks.app import create_app
from hooks.controller import autoscaling, customize, finalize, sync
from hooks.controller import observe as obs
from hooks.resources import autoscaling as autoscaling_resource
from hooks.resources import names
from tests.hooks import helpers as h

REPO = Path(__file__).resolve().parents[2]
GATEWAY = "chat"
SERVED = "qwen-7b"
MODEL = {"source": "hf://Qwen/Qwen2.5-7B-Instruct", "servedName": SERVED}
SHARED_URL = "http://chat-llmgw.models.svc.cluster.local/v1"
SHARED_SCALER = "chat-llmgwscaler.models.svc.cluster.local:9090"
# What a per-model LLMService renders for its gateway and a member does not (replicas 2: all of it).
GATEWAY_CHILDREN = {("Deployment", "qwen-gateway"), ("Service", "qwen-gateway"), ("Service", "qwen-scaler"),
                    ("Deployment", "qwen-aggregator"), ("PodDisruptionBudget", "qwen-gateway"),
                    ("Secret", "qwen-scaler-token"), ("ServiceAccount", "qwen-gateway"), ("RoleBinding", "qwen-gateway")}
SYNC_PATH = "/v1/llmservice/sync"
CUSTOMIZE_PATH = "/v1/llmservice/customize"
DECORATOR_PATH = "/v1/llmservice/autoscaling/sync"


def member(status: dict | None = None, generation: int = 1, **spec: Any) -> dict:
    endpoint = {"gateway": GATEWAY, **spec.pop("endpoint", {})}
    return h.llmservice(status=status, generation=generation, model=dict(MODEL), endpoint=endpoint, **spec)


def per_model(status: dict | None = None, generation: int = 1, **spec: Any) -> dict:
    return h.llmservice(status=status, generation=generation, model=dict(MODEL), **spec)


def llmgateway(**kwargs: Any) -> dict:
    return h.llmgateway(GATEWAY if "name" not in kwargs else kwargs.pop("name"),
                        models=kwargs.pop("models", [{"name": SERVED, "service": "qwen"}]), **kwargs)


def request(parent: dict, gateway: dict | None = None, **kwargs: Any) -> dict:
    """A sync request; the LLMGateway `gateway` related as customize asked for it (none: not found)."""
    return h.sync_request(parent, gateways=[] if gateway is None else [gateway], **kwargs)


def kinds(children: list[dict]) -> set[tuple[str, str]]:
    return {(c["kind"], c["metadata"]["name"]) for c in children}


def cond(answer: dict, ctype: str) -> dict:
    return next(c for c in answer["status"]["conditions"] if c["type"] == ctype)


def running(parent: dict, gateway: dict | None = None) -> tuple[dict, list[dict]]:
    """Synced once and applied: the status the next sync sees and the children as the API returns them."""
    first = sync.sync(request(parent, gateway), h.config())
    observed = [h.as_observed(c, i, replicas=1, readyReplicas=1) if c["kind"] == "Deployment" else h.as_observed(c, i)
                for i, c in enumerate(first["children"])]
    status = sync.sync(request({**parent, "status": first["status"]}, gateway, children=observed), h.config())["status"]
    return status, observed


# --- children -----------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [{}, {"cache": {"strategy": "SharedPVC", "size": "100Gi", "prewarm": True}},
                                   {"scaling": {"max": 3, "targetPerReplica": 4}}], ids=["default", "prewarm", "scaling"])
def test_a_member_renders_everything_but_the_gateway_children(extra: dict) -> None:
    own = sync.sync(request(per_model(endpoint={"replicas": 2}, **copy.deepcopy(extra))), h.config())
    joined = sync.sync(request(member(**copy.deepcopy(extra)), llmgateway()), h.config())
    assert kinds(own["children"]) - kinds(joined["children"]) == GATEWAY_CHILDREN
    assert kinds(joined["children"]) <= kinds(own["children"])
    # Backend, cache, prewarm: the very objects a per-model LLMService gets.
    mine = {(c["kind"], c["metadata"]["name"]): c for c in own["children"]}
    for c in joined["children"]:
        assert c == mine[(c["kind"], c["metadata"]["name"])]
    assert not any(c["metadata"]["labels"]["serving.noctaya.io/component"] in ("gateway", "scaler", "aggregator", "auth")
                   for c in joined["children"])


def test_the_scaled_object_dials_the_shared_scaler_for_the_served_model() -> None:
    answer = autoscaling.sync(h.decorator_request(member(scaling={"targetPerReplica": 4})), h.config())
    (scaled,) = answer["attachments"]
    demand = scaled["spec"]["triggers"][0]
    assert demand["type"] == "external-push"
    assert demand["metadata"] == {"scalerAddress": SHARED_SCALER, "targetPerReplica": "4", "model": SERVED}
    assert SHARED_SCALER == f"{names.shared_scaler(GATEWAY)}.{h.NAMESPACE}.svc.cluster.local:9090"
    assert "authenticationRef" not in demand and "enableTLS" not in demand["metadata"]
    # The scaler reads the model from the key the hooks write.
    from scaler.externalscaler import MODEL_METADATA_KEY

    assert autoscaling_resource.MODEL_KEY == MODEL_METADATA_KEY
    # Without servedName the model is the LLMService's name.
    plain = h.llmservice(endpoint={"gateway": GATEWAY})
    metadata = autoscaling.sync(h.decorator_request(plain), h.config())["attachments"][0]["spec"]["triggers"][0]["metadata"]
    assert metadata["model"] == "qwen"


def test_a_per_model_scaled_object_is_unchanged() -> None:
    demand = autoscaling.sync(h.decorator_request(per_model()), h.config())["attachments"][0]["spec"]["triggers"][0]
    assert demand["metadata"] == {"scalerAddress": "qwen-scaler.models.svc.cluster.local:9090", "targetPerReplica": "10"}


def _polling(parent: dict) -> int:
    return autoscaling.sync(h.decorator_request(parent), h.config())["attachments"][0]["spec"]["pollingInterval"]


@pytest.mark.parametrize(("scaling", "expected"), [
    ({}, autoscaling_resource.MEMBER_POLLING_SECONDS),  # the API default: polled rarely (issue 29)
    ({"pollingInterval": "5s"}, autoscaling_resource.MEMBER_POLLING_SECONDS),  # the same, as the API server fills it in
    ({"cooldownPeriod": "90s"}, 90),  # at least one poll per cooldown: scale-in within twice the cooldown
    ({"cooldownPeriod": "2s"}, 5),  # never more often than the default
    ({"cooldownPeriod": "2h"}, autoscaling_resource.MEMBER_POLLING_SECONDS),
    ({"pollingInterval": "1s"}, 1),  # a chosen interval is the member's own
    ({"pollingInterval": "30m"}, 1800),
], ids=["default", "default-spelled", "short-cooldown", "tiny-cooldown", "long-cooldown", "chosen-1s", "chosen-30m"])
def test_a_member_left_at_the_default_polling_is_polled_rarely(scaling: dict, expected: int) -> None:
    """100 members polled every 5 s cost one shared gateway ~30 ms of CPU a second idle; a member's
    push stream wakes it, so the rendered interval is long unless the member chose one."""
    assert _polling(member(scaling=scaling)) == expected


def test_a_per_model_scaled_object_keeps_its_polling_interval() -> None:
    assert _polling(per_model()) == autoscaling_resource.DEFAULT_POLLING_SECONDS
    assert _polling(per_model(scaling={"pollingInterval": "1m"})) == 60


def test_a_member_polling_interval_is_rendered_as_the_api_default_says() -> None:
    """DEFAULT_POLLING_SECONDS mirrors the API default: a changed default must change the rule too."""
    from hooks.api.common import duration_seconds
    from hooks.api.llmservice import Scaling

    assert duration_seconds(Scaling().polling_interval) == autoscaling_resource.DEFAULT_POLLING_SECONDS


# --- validation ---------------------------------------------------------------------------------

REFUSED = [
    ({"endpoint": {"gateway": GATEWAY, "auth": {"secretRef": {"name": "api-key"}}}},
     "endpoint.auth is not allowed with endpoint.gateway: the LLMGateway carries the API keys"),
    ({"endpoint": {"gateway": GATEWAY, "replicas": 2}},
     "endpoint.replicas must be 1 with endpoint.gateway: the LLMGateway's replicas serve this model"),
    ({"endpoint": {"gateway": GATEWAY}, "scalerTLS": {"secretName": "tls", "triggerAuthentication": "keda"}},
     "scalerTLS is not supported with endpoint.gateway yet"),
]


@pytest.mark.parametrize(("spec", "message"), REFUSED, ids=["auth", "replicas", "scalerTLS"])
def test_the_model_refuses_what_a_member_cannot_use(spec: dict, message: str) -> None:
    with pytest.raises(ValidationError) as err:
        LLMService.model_validate(h.llmservice(**spec))
    assert [e["msg"] for e in err.value.errors()] == [f"Value error, {message}"]
    # The same fields without a gateway stay valid.
    alone = copy.deepcopy(spec)
    del alone["endpoint"]["gateway"]
    LLMService.model_validate(h.llmservice(**alone))


def _validations(schema: dict, path: str) -> list[dict]:
    node = schema
    for part in path.split("."):
        node = node["properties"][part]
    return node.get("x-kubernetes-validations", [])


def test_the_generated_and_committed_crds_carry_the_rules() -> None:
    generated = crdgen.crd_object(LLMService)
    committed = yaml.safe_load((REPO / "crds" / "serving.noctaya.io_llmservices.yaml").read_text())
    for crd in (generated, committed):
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        endpoint = {v["message"]: v["rule"] for v in _validations(schema, "spec.endpoint")}
        spec = {v["message"]: v["rule"] for v in _validations(schema, "spec")}
        assert endpoint[REFUSED[0][1]] == "!has(self.gateway) || !has(self.auth)"
        assert endpoint[REFUSED[1][1]] == "!has(self.gateway) || !has(self.replicas) || self.replicas == 1"
        assert spec[REFUSED[2][1]] == "!has(self.endpoint.gateway) || !has(self.scalerTLS)"


@pytest.mark.parametrize(("spec", "message"), REFUSED, ids=["auth", "replicas", "scalerTLS"])
def test_cel_refuses_them_on_the_defaulted_object(spec: dict, message: str) -> None:
    celpy = pytest.importorskip("celpy")
    schema = crdgen.crd_object(LLMService)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    value = {"model": dict(MODEL), "runtime": {"name": "vllm-nvidia"}, **copy.deepcopy(spec)}
    value["endpoint"] = {"replicas": 1, "maxQueue": 100, **value["endpoint"]}  # the schema default, merged as the API server does

    def failures(node: dict, obj: Any) -> list[str]:
        found = []
        for v in node.get("x-kubernetes-validations", []):
            env = celpy.Environment()
            if not env.program(env.compile(v["rule"])).evaluate({"self": celpy.json_to_cel(obj)}):
                found.append(v["message"])
        if isinstance(obj, dict):
            for key, sub in node.get("properties", {}).items():
                if key in obj:
                    found += failures(sub, obj[key])
        return found

    assert failures(schema, value) == [message]


# --- status -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gateway", "expected"),
    [
        (None, ("False", "GatewayNotFound", "LLMGateway chat does not exist in this namespace")),
        (llmgateway(models=[]), ("False", "NotListed", "LLMGateway chat does not list model qwen-7b (yet)")),
        (llmgateway(models=[{"name": SERVED, "service": "other"}]),
         ("False", "NotListed", "LLMGateway chat serves model qwen-7b from LLMService other, not this one: served "
                                "names must be unique behind one gateway (set spec.model.servedName)")),
        # A clash needs the user, so it is said even while the gateway is not Ready.
        (llmgateway(ready="False", reason="Progressing", models=[{"name": SERVED, "service": "other"}]),
         ("False", "NotListed", None)),
        (llmgateway(ready="False", reason="Progressing", message="0/1 gateways available"),
         ("False", "Progressing", "LLMGateway chat: 0/1 gateways available")),
        (llmgateway(ready="False", reason="InvalidSpec", message="spec is invalid"),
         ("False", "InvalidSpec", "LLMGateway chat: spec is invalid")),
        (llmgateway(ready=None), ("False", "Progressing", "LLMGateway chat: no Ready condition yet")),
        (llmgateway(ready="False", reason="not a reason!", message=""), ("False", "Progressing", "LLMGateway chat: not Ready")),
        (llmgateway(), ("True", "Available", "LLMGateway chat serves model qwen-7b")),
        (llmgateway(models=[{"name": "other-model", "service": "other"}, {"name": SERVED, "service": "qwen"}]),
         ("True", "Available", None)),
    ],
    ids=["missing", "not-listed", "clash", "clash-not-ready", "not-ready", "gateway-invalid", "no-ready-yet",
         "malformed-reason", "ready", "ready-beside-others"],
)
def test_gateway_ready_comes_from_the_llmgateway(gateway: dict | None, expected: tuple) -> None:
    status, observed = running(member(), gateway)
    answer = sync.sync(request(member(status=status), gateway, children=observed,
                               pods=[h.pod("qwen-backend-7d9f-abcde", ready=True)]), h.config(h.LATER_TIME))
    got = cond(answer, "GatewayReady")
    assert (got["status"], got["reason"]) == expected[:2]
    if expected[2] is not None:
        assert got["message"] == expected[2]
    assert answer["status"]["endpoint"] == SHARED_URL
    ready = cond(answer, "Ready")
    if expected[0] == "True":
        assert (ready["status"], ready["message"]) == ("True", f"serving at {SHARED_URL}")
    else:
        assert (ready["status"], ready["reason"]) == ("False", expected[1])
        # A gone gateway first stops autoscaling (the ScaledObject scales the model to zero; below).
        first = "AutoscalingReady" if expected[1] == "GatewayNotFound" else "GatewayReady"
        assert ready["message"].startswith(f"{first}: LLMGateway chat")


# --- the LLMGateway is gone: nothing can route to the model, so it must be able to reach zero -----


@pytest.mark.parametrize("gone", ["missing", "deleting"])
@pytest.mark.parametrize("spec", [{}, {"scaling": {"min": 1, "max": 3, "schedules": [
    {"start": "0 8 * * *", "end": "0 18 * * *", "replicas": 2}]}}], ids=["min0", "min1-windows"])
def test_without_its_llmgateway_a_member_scales_to_zero_and_says_why(gone: str, spec: dict) -> None:
    gateway = None
    if gone == "deleting":
        gateway = llmgateway()
        gateway["metadata"]["deletionTimestamp"] = "2026-01-01T02:00:00Z"
    parent = member(**copy.deepcopy(spec))
    decorator = h.decorator_request(parent)
    decorator["related"]["LLMGateway.serving.noctaya.io/v1alpha1"] = {} if gateway is None else {
        f"{h.NAMESPACE}/{GATEWAY}": gateway}
    (so,) = autoscaling.sync(decorator, h.config())["attachments"]
    from tests.hooks import schemas
    assert schemas.openapi_problems(so, schemas.load_crd_schema()) == []  # KEDA's own CRD schema
    assert so["spec"]["minReplicaCount"] == 0 and so["spec"]["maxReplicaCount"] == (3 if spec else 1)
    (trigger,) = so["spec"]["triggers"]  # no external-push at a gone scaler, no warm window holding it
    assert trigger["type"] == "kubernetes-workload" and trigger["metadata"]["value"] == "1"
    # A selector no Pod carries: a member never has a gateway Pod of its own.
    assert trigger["metadata"]["podSelector"] == "serving.noctaya.io/llmservice=qwen,serving.noctaya.io/component=gateway"
    answer = sync.sync(request(parent, gateway), h.config())
    auto = cond(answer, "AutoscalingReady")
    assert (auto["status"], auto["reason"]) == ("False", "GatewayNotFound")
    assert "scales qwen-backend to zero" in auto["message"]


def test_a_decorator_request_that_does_not_say_keeps_the_demand_trigger() -> None:
    """Without the LLMGateway group (a customize answer cached from before it was asked for) the
    gateway's absence is unknown: the usual ScaledObject stays."""
    (so,) = autoscaling.sync(h.decorator_request(member()), h.config())["attachments"]
    assert so["spec"]["triggers"][0]["type"] == "external-push"


def test_the_decorator_relates_the_members_llmgateway() -> None:
    rules = autoscaling.customize({"parent": member()})["relatedResources"]
    assert {"apiVersion": "serving.noctaya.io/v1alpha1", "resource": "llmgateways", "namespace": h.NAMESPACE,
            "names": [GATEWAY]} in rules
    assert not any(r["resource"] == "llmgateways" for r in autoscaling.customize({"parent": per_model()})["relatedResources"])


def test_an_llmgateway_of_another_namespace_or_name_is_not_ours() -> None:
    elsewhere = llmgateway()
    elsewhere["metadata"]["namespace"] = "other"
    req = request(member(), llmgateway(name="chat2"))
    req["related"][obs.LLMGATEWAY]["other/chat"] = elsewhere
    assert cond(sync.sync(req, h.config()), "GatewayReady")["reason"] == "GatewayNotFound"


def test_customize_relates_the_named_llmgateway_through_the_app() -> None:
    client = create_app(config=h.config()).test_client()
    rules = client.post(CUSTOMIZE_PATH, json={"controller": {}, "parent": member()}).get_json()["relatedResources"]
    assert {"apiVersion": "serving.noctaya.io/v1alpha1", "resource": "llmgateways", "namespace": h.NAMESPACE,
            "names": [GATEWAY]} in rules
    # A per-model LLMService does not watch gateways; an unusable name relates nothing (sync says why).
    for parent in (per_model(), h.llmservice(endpoint={"gateway": "Not_A_Name"})):
        assert not any(r["resource"] == "llmgateways" for r in customize.customize({"parent": parent})["relatedResources"])


# --- switching, bad input -----------------------------------------------------------------------


def test_switching_to_shared_drops_the_gateway_children_and_keeps_the_backend_serving() -> None:
    status, observed = running(per_model(endpoint={"replicas": 2}))
    assert GATEWAY_CHILDREN <= kinds(observed)
    joined = member(status=status, generation=2)
    answer = sync.sync(request(joined, llmgateway(), children=observed, pods=[h.pod("qwen-backend-7d9f-abcde", ready=True)]),
                       h.config(h.LATER_TIME))
    assert kinds(answer["children"]) == kinds(observed) - GATEWAY_CHILDREN
    backend = next(c for c in answer["children"] if c["kind"] == "Deployment")
    assert backend["spec"]["replicas"] == 1  # KEDA's live count: the switch does not scale the model down
    assert answer["status"]["endpoint"] == SHARED_URL and cond(answer, "GatewayReady")["status"] == "True"
    scaled = autoscaling.sync(h.decorator_request(joined), h.config())["attachments"][0]
    assert scaled["spec"]["triggers"][0]["metadata"]["scalerAddress"] == SHARED_SCALER


def test_switching_back_renders_the_gateway_children_again() -> None:
    status, observed = running(member(), llmgateway())
    alone = per_model(status=status, generation=2)
    answer = sync.sync(request(alone, llmgateway(), children=observed), h.config(h.LATER_TIME))
    assert kinds(answer["children"]) == kinds(observed) | {("Deployment", "qwen-gateway"), ("Service", "qwen-gateway"),
                                                           ("Service", "qwen-scaler"), ("ServiceAccount", "qwen-gateway"),
                                                           ("RoleBinding", "qwen-gateway")}
    assert answer["status"]["endpoint"] == "http://qwen-gateway.models.svc.cluster.local/v1"
    assert cond(answer, "GatewayReady")["reason"] == "Progressing"  # its own gateway, not created yet


@pytest.mark.parametrize("breakage", ["bad-source", "auth-with-gateway", "replicas-with-gateway", "spec-not-an-object"])
def test_bad_input_keeps_every_child_of_a_member(breakage: str) -> None:
    status, observed = running(member(), llmgateway())
    bad = member(status=status, generation=2)
    if breakage == "bad-source":
        bad["spec"]["model"]["source"] = "s3://nope"
    elif breakage == "auth-with-gateway":
        bad["spec"]["endpoint"]["auth"] = {"secretRef": {"name": "api-key"}}
    elif breakage == "replicas-with-gateway":
        bad["spec"]["endpoint"]["replicas"] = 3
    else:
        bad["spec"] = ["not", "an", "object"]
    answer = sync.sync(request(bad, llmgateway(), children=observed), h.config(h.LATER_TIME))
    assert kinds(answer["children"]) == kinds(observed)
    assert answer["children"] == [obs.kept(c) for c in sorted(observed, key=lambda c: (f"{c['kind']}.{c['apiVersion']}",
                                                                                        c["metadata"]["name"]))]
    assert cond(answer, "Ready")["reason"] == "InvalidSpec"
    if breakage != "spec-not-an-object":
        # Still read from the LLMGateway named in the raw spec.
        assert answer["status"]["endpoint"] == SHARED_URL
        assert cond(answer, "GatewayReady")["status"] == "True"


def test_a_bad_switch_to_shared_keeps_the_own_gateway() -> None:
    """Switching and breaking the spec at once is a bad input: nothing of the running model goes."""
    status, observed = running(per_model(endpoint={"replicas": 2}))
    bad = per_model(status=status, generation=2, endpoint={"replicas": 2, "gateway": GATEWAY})  # replicas must be 1
    answer = sync.sync(request(bad, llmgateway(), children=observed), h.config(h.LATER_TIME))
    assert kinds(answer["children"]) == kinds(observed) and GATEWAY_CHILDREN <= kinds(answer["children"])
    assert cond(answer, "Ready")["reason"] == "InvalidSpec"
    # The decorator keeps the observed ScaledObject too.
    own = autoscaling.sync(h.decorator_request(per_model(endpoint={"replicas": 2})), h.config())["attachments"][0]
    kept = autoscaling.sync(h.decorator_request(bad, attachments=[h.as_observed(own)]), h.config())["attachments"]
    assert kept == [own]


def test_a_member_whose_runtime_is_gone_keeps_its_children() -> None:
    status, observed = running(member(), llmgateway())
    answer = sync.sync(request(member(status=status), llmgateway(), runtimes=[], children=observed), h.config(h.LATER_TIME))
    assert kinds(answer["children"]) == kinds(observed)
    assert cond(answer, "RuntimeResolved")["reason"] == "RuntimeNotFound"
    assert cond(answer, "GatewayReady")["status"] == "True"


# --- resync -------------------------------------------------------------------------------------


def test_an_unchanged_world_gets_byte_identical_answers_through_the_app() -> None:
    gateway = llmgateway()
    status, observed = running(member(), gateway)
    pods = [h.pod("qwen-backend-7d9f-abcde", ready=True)]
    # Settle: the status written by one sync is what the next one reads.
    for _ in range(2):
        status = sync.sync(request(member(status=status), gateway, children=observed, pods=pods), h.config())["status"]
    body = json.dumps(request(member(status=status), gateway, children=observed, pods=pods))
    bodies = []
    for clock in (h.LATER_TIME, "2026-01-02T00:00:00Z"):
        client = create_app(config=h.config(clock)).test_client()
        for _ in range(2):
            response = client.post(SYNC_PATH, data=body, content_type="application/json")
            assert response.status_code == 200, response.get_data(as_text=True)
            bodies.append(response.get_data())
    assert len(set(bodies)) == 1
    answer = json.loads(bodies[0])
    assert answer["status"] == status  # a fixed point: writing it back triggers nothing new
    assert cond(answer, "Ready")["status"] == "True" and cond(answer, "GatewayReady")["reason"] == "Available"
    decorator = json.dumps(h.decorator_request(member(status=status)))
    client = create_app(config=h.config()).test_client()
    first, second = (client.post(DECORATOR_PATH, data=decorator, content_type="application/json").get_data() for _ in range(2))
    assert first == second and json.loads(first)["attachments"][0]["spec"]["triggers"][0]["metadata"]["model"] == SERVED


# --- deletion -----------------------------------------------------------------------------------


def _deleting_member_request(gateway: dict | None, pods: list[dict], gone: bool = False) -> dict:
    status, observed = running(member(), llmgateway())
    parent = member(status=status)
    parent["metadata"]["deletionTimestamp"] = "2026-01-01T02:00:00Z"
    return h.sync_request(parent, children=[] if gone else observed, pods=pods, finalizing=True,
                          gateways=[] if gateway is None else [gateway])


def test_a_deleted_member_keeps_its_backend_while_the_llmgateway_still_routes_to_it() -> None:
    ready_pod = h.pod("qwen-backend-7d9f-abcde", ready=True)
    answer = finalize.finalize(_deleting_member_request(llmgateway(), [ready_pod]), h.config())
    assert not answer["finalized"]
    # Even with the backend already gone, teardown is not done while the gateway lists the model.
    assert not finalize.finalize(_deleting_member_request(llmgateway(), [], gone=True), h.config())["finalized"]
    assert {c["metadata"]["labels"]["serving.noctaya.io/component"] for c in answer["children"]} >= {"backend"}
    assert "waiting for LLMGateway chat to stop routing" in cond(answer, "Ready")["message"]


@pytest.mark.parametrize("gateway", [llmgateway(models=[]), None,
                                     llmgateway(models=[{"name": SERVED, "service": "another"}])],
                         ids=["no-longer-listed", "gateway-gone", "the-name-is-another-members"])
def test_once_the_llmgateway_stops_routing_the_member_its_backend_outlives_the_route_then_goes(gateway: dict | None) -> None:
    """The LLMGateway's status drops the model at once; its Pods read the table through the kubelet's
    ConfigMap refresh, up to a minute or so later. The backend waits route_grace_seconds (90) from
    when the hook first saw the model unlisted (Routed=False), at the limit: 89 s still waits."""
    at = "2026-01-01T02:00:00Z"
    request = _deleting_member_request(gateway, [h.pod("qwen-backend-7d9f-abcde", ready=True)])
    first = finalize.finalize(copy.deepcopy(request), h.config(at))
    assert {c["metadata"]["labels"]["serving.noctaya.io/component"] for c in first["children"]} >= {"backend"}
    routed = cond(first, "Routed")
    assert (routed["status"], routed["lastTransitionTime"]) == ("False", at) and not first["finalized"]
    assert "no longer lists this model" in cond(first, "Ready")["message"]
    request["parent"]["status"] = first["status"]
    waiting = finalize.finalize(copy.deepcopy(request), h.config("2026-01-01T02:01:29Z"))
    assert waiting["children"] == first["children"] and waiting["resyncAfterSeconds"] == 1.0
    assert cond(waiting, "Routed")["lastTransitionTime"] == at  # the grace is not restarted by a resync
    answer = finalize.finalize(copy.deepcopy(request), h.config("2026-01-01T02:01:30Z"))
    assert answer["children"] == [] and not answer["finalized"]  # the backend Pod still drains
    gone = _deleting_member_request(gateway, [], gone=True)
    gone["parent"]["status"] = answer["status"]
    done = finalize.finalize(gone, h.config("2026-01-01T02:02:00Z"))
    assert done["children"] == [] and done["finalized"]


def test_the_route_grace_follows_the_hook_config() -> None:
    request = _deleting_member_request(llmgateway(models=[]), [], gone=True)
    quick = dataclasses.replace(h.config("2026-01-01T02:00:00Z"), route_grace_seconds=0)
    assert finalize.finalize(request, quick)["finalized"]
    assert not finalize.finalize(request, h.config("2026-01-01T02:00:00Z"))["finalized"]


def test_the_idle_members_benchmark_polls_at_the_rendered_interval() -> None:
    """bench.idle_members plays KEDA at the interval the hooks render for a member (make bench's
    idle-members figure, issue 29): the example member renders the member interval."""
    from bench.idle_members import member_scaled_object

    assert member_scaled_object()["pollingInterval"] == autoscaling_resource.MEMBER_POLLING_SECONDS
