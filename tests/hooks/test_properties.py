"""Property tests over generated valid specs: deterministic, idempotent, safe names and labels."""

from __future__ import annotations

import copy
import dataclasses
import json

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from hooks.api.llmservice import LLMService
from hooks.controller import autoscaling, rollout, sync
from hooks.resources import labels as lb
from hooks.resources import names
from tests.hooks import helpers as h
from tests.hooks.strategies import SHARED_GATEWAY, scenarios

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def _request(service: dict, runtimes: list[dict], children: list[dict] | None = None) -> dict:
    ns = service["metadata"]["namespace"]
    gateways = None
    if isinstance(service["spec"], dict) and service["spec"]["endpoint"].get("gateway"):
        # A member's LLMGateway, Ready and listing it, as customize relates it.
        name = service["metadata"]["name"]
        gateway = h.llmgateway(SHARED_GATEWAY, models=[{"name": service["spec"]["model"].get("servedName", name),
                                                       "service": name}])
        gateway["metadata"]["namespace"] = ns
        gateways = [gateway]
    req = h.sync_request(service, runtimes=runtimes, children=children, gateways=gateways)
    for group in req["children"].values():
        for key in list(group):
            obj = group.pop(key)
            obj["metadata"]["namespace"] = ns
            group[f"{ns}/{obj['metadata']['name']}"] = obj
    return req


def _all_labels(obj: dict) -> list[dict]:
    found = [obj["metadata"].get("labels") or {}]
    spec = obj.get("spec") or {}
    if isinstance(spec.get("selector"), dict):
        sel = spec["selector"]
        found.append(sel.get("matchLabels", sel) if obj["kind"] != "Service" else sel)
    template = spec.get("template") or {}
    found.append((template.get("metadata") or {}).get("labels") or {})
    return found


@SETTINGS
@given(scenarios())
def test_sync_is_deterministic(scenario: tuple[dict, list[dict]]) -> None:
    service, runtimes = scenario
    first = sync.sync(_request(service, runtimes), h.config())
    second = sync.sync(copy.deepcopy(_request(service, runtimes)), h.config())
    assert json.dumps(first) == json.dumps(second)
    so1 = autoscaling.sync(h.decorator_request(service, runtimes), h.config())
    so2 = autoscaling.sync(h.decorator_request(copy.deepcopy(service), copy.deepcopy(runtimes)), h.config())
    assert json.dumps(so1) == json.dumps(so2)


@SETTINGS
@given(scenarios())
def test_sync_is_idempotent_and_settles(scenario: tuple[dict, list[dict]]) -> None:
    service, runtimes = scenario
    first = sync.sync(_request(service, runtimes), h.config())
    observed = h.observe_all(first["children"])
    for child in observed:
        child["metadata"]["namespace"] = service["metadata"]["namespace"]
    with_status = {**service, "status": first["status"]}
    second = sync.sync(_request(with_status, runtimes, observed), h.config(h.LATER_TIME))
    assert second["children"] == first["children"]
    # Status reaches a fixed point: a third sync over the same observed state changes nothing.
    third = sync.sync(_request({**service, "status": second["status"]}, runtimes, observed), h.config("2030-01-01T00:00:00Z"))
    assert third == second


@SETTINGS
@given(scenarios())
def test_children_are_safe(scenario: tuple[dict, list[dict]]) -> None:
    service, runtimes = scenario
    answer = sync.sync(_request(service, runtimes), h.config())
    children = answer["children"] + autoscaling.sync(h.decorator_request(service, runtimes), h.config())["attachments"]
    assert set(answer) == {"status", "children", "resyncAfterSeconds", "finalized"}
    has_backend = any(c["kind"] == "Deployment" and c["metadata"]["labels"][lb.COMPONENT] == "backend" for c in children)
    # Weights a Job stages (oci:// always, hub sources with prewarm): no backend before the Job is done
    # (it could only crash-loop, or wait holding an accelerator).
    source = service["spec"]["model"]["source"]
    staged = source.startswith("oci://") or (
        service["spec"]["cache"].get("prewarm", False) and source.split(":")[0] in ("hf", "modelscope"))
    assert has_backend == (not staged)
    assert any(c["kind"] == "Job" for c in children) == staged
    keys = set()
    for child in children:
        meta = child["metadata"]
        assert names.is_dns1035_label(meta["name"]), meta["name"]
        assert meta["namespace"] == service["metadata"]["namespace"]
        assert meta["labels"][lb.LLMSERVICE] == lb.label_value(service["metadata"]["name"])
        assert meta["labels"][lb.COMPONENT]
        for labels in _all_labels(child):
            for key, value in labels.items():
                assert lb.is_valid_label_key(key), key
                assert lb.is_valid_label_value(value), value
        if child["kind"] == "Deployment" and meta["labels"][lb.COMPONENT] == "backend":
            # created at the floor, never at the API server's default of 1
            assert child["spec"]["replicas"] == service["spec"]["scaling"]["min"]
        key = (child["kind"], meta["name"])
        assert key not in keys, f"duplicate child {key}"
        keys.add(key)
    if service["spec"]["endpoint"].get("gateway"):
        # A member of a shared gateway has none of its own; the LLMGateway's answers for it.
        assert not any(c["metadata"]["labels"][lb.COMPONENT] in (lb.GATEWAY, lb.SCALER, lb.AGGREGATOR) for c in children)
        assert answer["status"]["endpoint"].startswith(f"http://{names.shared_gateway(SHARED_GATEWAY)}.")
    else:
        # The public Service never exposes the gRPC scaler.
        public = next(c for c in children if c["kind"] == "Service"
                      and c["metadata"]["name"] == names.public_service(service["metadata"]["name"]))
        assert [p["name"] for p in public["spec"]["ports"]] == ["http"]
    # No Secret data anywhere in status.
    assert "data" not in json.dumps(answer["status"])


@SETTINGS
@given(scenarios())
def test_breakage_never_drops_a_child(scenario: tuple[dict, list[dict]]) -> None:
    service, runtimes = scenario
    first = sync.sync(_request(service, runtimes), h.config())
    observed = h.observe_all(first["children"])
    for child in observed:
        child["metadata"]["namespace"] = service["metadata"]["namespace"]
    want = {(c["kind"], c["metadata"]["name"]) for c in observed}
    bad_spec = copy.deepcopy(service)
    bad_spec["spec"]["scaling"]["min"] = 5000
    for request in (
        _request(bad_spec, runtimes, observed),
        _request(service, [], observed),
        {**_request(service, runtimes, observed), "related": {**_request(service, runtimes, observed)["related"],
                                                              "CustomResourceDefinition.apiextensions.k8s.io/v1": {}}},
    ):
        answer = sync.sync(request, h.config())
        assert {(c["kind"], c["metadata"]["name"]) for c in answer["children"]} >= want
        ready = next(c for c in answer["status"]["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "False" and ready["reason"] in ("InvalidSpec", "RuntimeNotFound", "KEDANotInstalled")
        for child in answer["children"]:
            assert "status" not in child and "resourceVersion" not in child["metadata"]
            if child["kind"] == "Deployment" and child["metadata"]["labels"][lb.COMPONENT] == "backend":
                live = next(o for o in observed if o["kind"] == "Deployment" and o["metadata"]["name"] == child["metadata"]["name"])
                assert child["spec"]["replicas"] == live["spec"]["replicas"]  # KEDA's count, echoed


@SETTINGS
@given(scenarios())
def test_scaled_object_always_matches_keda_schema(scenario: tuple[dict, list[dict]]) -> None:
    from tests.hooks import schemas

    service, runtimes = scenario
    (so,) = autoscaling.sync(h.decorator_request(service, runtimes), h.config())["attachments"]
    assert schemas.openapi_problems(so, schemas.load_crd_schema()) == []
    spec = so["spec"]
    assert spec["minReplicaCount"] <= spec["maxReplicaCount"]
    assert spec["scaleTargetRef"]["name"] == names.backend(service["metadata"]["name"])
    assert spec["triggers"][0]["type"] == "external-push"


@SETTINGS
@given(scenarios())
def test_finalize_never_finishes_early(scenario: tuple[dict, list[dict]]) -> None:
    from hooks.controller import finalize

    service, runtimes = scenario
    first = sync.sync(_request(service, runtimes), h.config())
    observed = h.observe_all(first["children"])
    for child in observed:
        child["metadata"]["namespace"] = service["metadata"]["namespace"]
    pods = [h.pod("p-1", ready=True, service=lb.label_value(service["metadata"]["name"]))]
    # The order, not the clock: a member's route grace (tests/hooks/test_shared_member.py) is zero here.
    no_grace = dataclasses.replace(h.config(), route_grace_seconds=0)
    state = observed
    for _ in range(4):  # each round, Kubernetes deletes whatever the hook stopped returning
        answer = finalize.finalize({**_request(service, runtimes, state), "related": {"Pod.v1": {"ns/p-1": pods[0]} if pods else {}}}, no_grace)
        kept = {(c["kind"], c["metadata"]["name"]) for c in answer["children"]}
        gateway_observed = any(c["kind"] == "Deployment" and c["metadata"]["labels"][lb.COMPONENT] == "gateway" for c in state)
        if gateway_observed:
            assert all(c["metadata"]["labels"][lb.COMPONENT] in ("backend", "cache") for c in answer["children"])
        assert answer["finalized"] == (not state and not pods)
        state = [c for c in state if (c["kind"], c["metadata"]["name"]) in kept]
        if not state:
            pods = []  # the backend Pods drain once their Deployment is gone
    assert answer["finalized"] is True


def _complete(job: dict) -> dict:
    job["status"] = {"succeeded": 1, "conditions": [{"type": "SuccessCriteriaMet", "status": "True"},
                                                    {"type": "Complete", "status": "True"}]}
    return job


@SETTINGS
@given(scenarios())
def test_no_serving_container_reads_a_prewarmed_cache_before_the_marker(scenario: tuple[dict, list[dict]]) -> None:
    """Whatever the spec, once a prewarm Job exists the backend that loads its weights has the marker
    wait as its first init container, the engine loads the promoted directory offline and carries no
    hub token, and a SharedPVC is mounted read-only by every serving container."""
    service, runtimes = scenario
    first = sync.sync(_request(service, runtimes), h.config())
    jobs = [c for c in first["children"] if c["kind"] == "Job"]
    if not jobs:
        return
    observed = [h.as_observed(_complete(c) if c["kind"] == "Job" else c, i) for i, c in enumerate(first["children"])]
    answer = sync.sync(_request({**service, "status": first["status"]}, runtimes, observed), h.config(h.LATER_TIME))
    (backend,) = [c for c in answer["children"] if c["kind"] == "Deployment" and c["metadata"]["labels"][lb.COMPONENT] == "backend"]
    pod_spec = backend["spec"]["template"]["spec"]
    cache_volume = next(v["name"] for v in pod_spec["volumes"] if v["name"] == "model-cache")
    inits = pod_spec.get("initContainers") or []
    # The marker wait is a shell loop in the engine's own image (a Noctaya upgrade changes no backend).
    assert inits and inits[0]["name"] == "wait-for-weights" and inits[0]["command"][:2] == ["sh", "-c"]
    engine = pod_spec["containers"][0]
    assert inits[0]["image"] == engine["image"]
    env = {e["name"]: e for e in engine["env"]}
    assert env["HF_HUB_OFFLINE"]["value"] == "1"
    cache_root = next(m["mountPath"] for m in inits[0]["volumeMounts"] if m["name"] == cache_volume)
    marker, model_dir = inits[0]["command"][4:6]
    assert env["NOCTAYA_MODEL_PATH"]["value"] == model_dir and model_dir.startswith(cache_root + "/")
    assert marker.startswith(model_dir.rsplit("/", 1)[0] + "/") and marker.endswith(".ready")
    assert not any("secretKeyRef" in (e.get("valueFrom") or {}) for e in engine["env"]), "a serving Pod got the hub token"
    shared = service["spec"]["cache"]["strategy"] == "SharedPVC"
    if shared:  # nothing the engine's hub client writes may point into the read-only cache
        assert not env["HF_HOME"]["value"].startswith(cache_root) and not env["MODELSCOPE_CACHE"]["value"].startswith(cache_root)
    for container in [*inits, *pod_spec["containers"]]:
        for mount in container.get("volumeMounts") or []:
            if mount["name"] == cache_volume and (shared or container is inits[0]):
                assert mount.get("readOnly") is True, container["name"]


# --- what a template is rendered from is what its inputs digest covers (hooks.controller.rollout) ---


def _rolled_templates(answer: dict) -> dict[str, tuple[str | None, dict]]:
    """Deployment name → (inputs digest, Pod template) of every Deployment the rollout rules judge."""
    out = {}
    for child in answer["children"]:
        if child["kind"] == "Deployment" and child["metadata"]["labels"].get(lb.COMPONENT) in sync.ROLLED:
            out[child["metadata"]["name"]] = ((child["metadata"].get("annotations") or {}).get(rollout.INPUTS_ANNOTATION),
                                              child["spec"]["template"])
    return out


SECTIONS = ("model", "runtime", "resources", "scaling", "scheduling", "cache", "endpoint", "scalerTLS", "imagePullSecrets",
            "upgrades")


@SETTINGS
@given(scenarios(), scenarios(), st.sampled_from([*SECTIONS, "the runtime object"]))
def test_a_template_changes_only_with_its_inputs(first: tuple[dict, list[dict]], second: tuple[dict, list[dict]],
                                                  lent: str) -> None:
    """A Deployment whose inputs digest is unchanged must render the same template: otherwise a user's
    edit would be mistaken for Noctaya's and wait (the digest missed a field the template reads).
    The second spec lends one section of its spec, or its runtime object, to the first."""
    service, runtimes = first
    mixed, mixed_runtimes = copy.deepcopy(service), runtimes
    if lent == "the runtime object":
        mixed_runtimes = [{**copy.deepcopy(second[1][0]), "metadata": runtimes[0]["metadata"]}, *runtimes[1:]]
    elif lent == "upgrades":
        mixed["spec"]["upgrades"] = {"policy": "Immediate", "windows": [{"start": "0 3 * * SUN", "end": "0 5 * * SUN"}]}
    elif lent in second[0]["spec"]:
        mixed["spec"][lent] = copy.deepcopy(second[0]["spec"][lent])
    else:
        mixed["spec"].pop(lent, None)
    try:
        LLMService.model_validate(mixed)
    except ValidationError:
        assume(False)
    before = _rolled_templates(sync.sync(_request(service, runtimes), h.config()))
    after = _rolled_templates(sync.sync(_request(mixed, mixed_runtimes), h.config()))
    for name in before.keys() & after.keys():
        if before[name][0] == after[name][0]:
            assert before[name][1] == after[name][1], f"{name}: same inputs digest, different template ({lent})"
