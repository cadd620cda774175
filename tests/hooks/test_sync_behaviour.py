"""Behaviour of the LLMService hooks that goldens alone do not pin down."""

from __future__ import annotations

import base64
import copy
import dataclasses
import json

import pytest

from hooks.controller import autoscaling, customize, finalize, rollout, runtime_status, sync
from hooks.errors import InvalidHookRequest
from hooks.resources import names, secrets
from tests.hooks import helpers as h


def _kinds(children: list[dict]) -> set[tuple[str, str]]:
    return {(c["kind"], c["metadata"]["name"]) for c in children}


def _cond(answer: dict, ctype: str) -> dict:
    return next(c for c in answer["status"]["conditions"] if c["type"] == ctype)


def _running(**spec: object) -> tuple[dict, list[dict]]:
    first = sync.sync(h.sync_request(h.llmservice(**spec)), h.config())
    observed = [h.as_observed(c, i, replicas=1, readyReplicas=1) if c["kind"] == "Deployment" else h.as_observed(c, i)
                for i, c in enumerate(first["children"])]
    return first, observed


# --- never destructive ---------------------------------------------------------------------------


@pytest.mark.parametrize("breakage", ["bad-spec", "runtime-deleted", "keda-removed", "baked-image", "spec-not-an-object"])
def test_breakage_keeps_every_observed_child(breakage: str) -> None:
    first, observed = _running(endpoint={"replicas": 2})
    svc = h.llmservice(endpoint={"replicas": 2}, status=first["status"])
    runtimes, keda = None, True
    if breakage == "bad-spec":
        svc["spec"]["model"]["source"] = "s3://nope"
    elif breakage == "runtime-deleted":
        runtimes = []
    elif breakage == "keda-removed":
        keda = False
    elif breakage == "baked-image":
        svc["spec"]["cache"] = {"strategy": "BakedImage"}
    else:
        svc["spec"] = ["not", "an", "object"]
    answer = sync.sync(h.sync_request(svc, runtimes=runtimes, children=observed, keda=keda), h.config())
    assert _kinds(answer["children"]) >= _kinds(observed)
    ready = _cond(answer, "Ready")
    assert ready["status"] == "False"
    assert ready["reason"] == {"bad-spec": "InvalidSpec", "runtime-deleted": "RuntimeNotFound", "keda-removed": "KEDANotInstalled",
                               "baked-image": "NotImplemented", "spec-not-an-object": "InvalidSpec"}[breakage]
    # Kept children are what we applied before (last-applied), never the server's copy, except the
    # backend's replica count, which is KEDA's live one (the last-applied 0 would scale it down).
    backend = next(c for c in answer["children"] if c["metadata"]["name"] == names.backend("qwen") and c["kind"] == "Deployment")
    assert backend["spec"]["replicas"] == 1 and "status" not in backend
    assert "resourceVersion" not in backend["metadata"]
    assert set(backend["metadata"].get("annotations", {})) <= {rollout.INPUTS_ANNOTATION}  # never last-applied


def test_kept_child_without_last_applied_is_stripped() -> None:
    first, observed = _running()
    for child in observed:
        del child["metadata"]["annotations"]["metacontroller.k8s.io/last-applied-configuration"]
        child["metadata"]["annotations"]["keep.me/too"] = "yes"
    answer = sync.sync(h.sync_request(h.llmservice(), runtimes=[], children=observed), h.config())
    assert _kinds(answer["children"]) == _kinds(observed)
    for child in answer["children"]:
        meta = child["metadata"]
        assert set(meta) <= {"name", "namespace", "labels", "annotations"}, meta.keys()
        assert meta["annotations"]["keep.me/too"] == "yes"
        assert "metacontroller.k8s.io/last-applied-configuration" not in meta["annotations"]
        assert "status" not in child
        if child["kind"] == "Deployment" and meta["labels"]["serving.noctaya.io/component"] == "backend":
            assert child["spec"]["replicas"] == 1  # the live count


def test_keda_missing_creates_everything_but_the_backend() -> None:
    answer = sync.sync(h.sync_request(h.llmservice(), keda=False), h.config())
    kinds = _kinds(answer["children"])
    assert ("Deployment", "qwen-backend") not in kinds
    assert ("Deployment", "qwen-gateway") in kinds and ("Service", "qwen-backend") in kinds
    cond = _cond(answer, "AutoscalingReady")
    assert (cond["status"], cond["reason"]) == ("False", "KEDANotInstalled")
    assert _cond(answer, "BackendReady")["reason"] == "WaitingForDependencies"


# --- status ------------------------------------------------------------------------------------


def test_last_transition_time_moves_only_on_status_change() -> None:
    first, observed = _running()
    steady = sync.sync(h.sync_request(h.llmservice(status=first["status"]), children=observed), h.config(h.LATER_TIME))
    again = sync.sync(h.sync_request(h.llmservice(status=steady["status"]), children=observed), h.config("2031-01-01T00:00:00Z"))
    assert again["status"] == steady["status"]  # no hot loop
    gateway_ready = _cond(steady, "GatewayReady")
    assert gateway_ready["status"] == "True" and gateway_ready["lastTransitionTime"] == h.LATER_TIME
    assert _cond(steady, "RuntimeResolved")["lastTransitionTime"] == h.FIXED_TIME  # unchanged since the first sync
    # A status flip stamps a new time; the clock is not read when nothing changed.
    calls: list[int] = []
    cfg = dataclasses.replace(h.config(), clock=lambda: calls.append(1) or "2032-01-01T00:00:00Z")
    sync.sync(h.sync_request(h.llmservice(status=steady["status"]), children=observed), cfg)
    assert calls == []
    flipped = sync.sync(h.sync_request(h.llmservice(status=steady["status"]), runtimes=[], children=observed), cfg)
    assert _cond(flipped, "RuntimeResolved")["lastTransitionTime"] == "2032-01-01T00:00:00Z" and calls == [1]


def _backend(answer: dict) -> dict:
    return next(c for c in answer["children"] if c["kind"] == "Deployment" and c["metadata"]["name"] == names.backend("qwen"))


@pytest.mark.parametrize("floor", [0, 2])
def test_new_backend_starts_at_the_floor_not_the_api_default(floor: int) -> None:
    # Omitting spec.replicas would let the API server default it to 1: a Pod (an accelerator, a
    # model load) before any demand, for as long as KEDA has not acted.
    answer = sync.sync(h.sync_request(h.llmservice(scaling={"min": floor, "max": 4})), h.config())
    assert _backend(answer)["spec"]["replicas"] == floor


@pytest.mark.parametrize("live", [0, 1, 3])
def test_backend_replicas_echo_the_live_count_so_keda_keeps_owning_them(live: int) -> None:
    first = sync.sync(h.sync_request(h.llmservice(scaling={"min": 0, "max": 4})), h.config())
    observed = [h.as_observed(c, i, replicas=live) if c["metadata"]["name"] == names.backend("qwen") and c["kind"] == "Deployment"
                else h.as_observed(c, i) for i, c in enumerate(first["children"])]
    # the last-applied annotation still says 0: a merge of 0 would undo KEDA's scale-up, and
    # omitting the field would delete it (the API server would default it back to 1)
    answer = sync.sync(h.sync_request(h.llmservice(scaling={"min": 0, "max": 4}), children=observed), h.config())
    assert _backend(answer)["spec"]["replicas"] == live
    again = sync.sync(h.sync_request(h.llmservice(scaling={"min": 0, "max": 4}, status=answer["status"]), children=observed), h.config())
    assert json.dumps(again["children"]) == json.dumps(answer["children"])  # unchanged world, identical answer


def test_status_replicas_come_from_the_backend_deployment_and_endpoint_is_fqdn() -> None:
    _, observed = _running()
    for child in observed:
        if child["metadata"]["name"] == "qwen-backend" and child["kind"] == "Deployment":
            child["spec"]["replicas"] = 0
            child["status"] = {"replicas": 0}
    answer = sync.sync(h.sync_request(h.llmservice(), children=observed), h.config())
    assert answer["status"]["replicas"] == 0 and answer["status"]["readyReplicas"] == 0
    assert answer["status"]["endpoint"] == "http://qwen-gateway.models.svc.cluster.local/v1"
    backend = _cond(answer, "BackendReady")
    assert (backend["status"], backend["reason"]) == ("False", "ScaledToZero")
    ready = _cond(answer, "Ready")
    assert ready["status"] == "True" and "scaled to zero" in ready["message"]


@pytest.mark.parametrize(
    ("pods", "reason"),
    [
        ([h.pod("p1", scheduled=False)], "Unschedulable"),
        ([h.pod("p1", waiting="ErrImagePull")], "ImagePullFailed"),
        ([h.pod("p1", waiting="CrashLoopBackOff", restarts=5)], "CrashLoop"),
        ([h.pod("p1", waiting="CrashLoopBackOff", last_terminated="OOMKilled", restarts=2)], "OOMKilled"),
        ([h.pod("p1", last_terminated="Error", restarts=7)], "RepeatedTermination"),  # restarted, not ready again
        ([h.pod("p1", scheduled=False), h.pod("p2", waiting="ImagePullBackOff")], "ImagePullFailed"),  # worst wins
    ],
)
def test_backend_failure_reasons(pods: list[dict], reason: str) -> None:
    _, observed = _running()
    answer = sync.sync(h.sync_request(h.llmservice(), children=observed, pods=pods), h.config())
    assert _cond(answer, "BackendReady")["reason"] == reason
    assert _cond(answer, "Ready")["reason"] == reason


def test_a_crash_loop_names_the_last_exit_code_and_never_the_engines_last_words() -> None:
    """The exit code says what kind of failure (1: the engine refused its arguments or model, 139: a
    crash); the termination message (an engine's log tail under FallbackToLogsOnError) may carry
    anything the engine printed, so it stays out of status."""
    _, observed = _running()
    pod = h.pod("p1", waiting="CrashLoopBackOff", last_terminated="Error", restarts=3,
                terminated_message="error: invalid HF repo format; token=hf_SENTINEL_n3v3r")
    pod["status"]["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] = 1
    answer = sync.sync(h.sync_request(h.llmservice(), children=observed, pods=[pod]), h.config())
    message = _cond(answer, "BackendReady")["message"]
    assert "crash-looping, last exit code 1 (Error)" in message, message
    assert "kubectl logs p1 -c engine --previous" in message, message
    assert "SENTINEL" not in json.dumps(answer) and "invalid HF repo" not in json.dumps(answer)


@pytest.mark.parametrize("pod", [h.pod("p1", ready=True, last_terminated="OOMKilled", restarts=1),
                                 h.pod("p1", ready=True, last_terminated="Error", restarts=7)])
def test_a_recovered_container_is_not_a_failure(pod: dict) -> None:
    """A past OOM kill or restarts of a container that is ready again must not mark a serving model
    not Ready until the Pod is replaced."""
    _, observed = _running()
    answer = sync.sync(h.sync_request(h.llmservice(), children=observed, pods=[pod]), h.config())
    assert _cond(answer, "BackendReady")["reason"] == "Ready"
    assert _cond(answer, "Ready")["status"] == "True"


def test_finalize_never_reports_done_without_seeing_pods() -> None:
    """A request without the related Pod group cannot show that backends finished draining."""
    parent = h.llmservice()
    parent["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    request = h.sync_request(parent, children=[], finalizing=True)
    del request["related"]["Pod.v1"]
    assert finalize.finalize(request, h.config())["finalized"] is False
    request = h.sync_request(parent, children=[], finalizing=True)  # the group is there, and empty
    assert finalize.finalize(request, h.config())["finalized"] is True


def test_progress_deadline_from_the_deployment() -> None:
    _, observed = _running()
    for child in observed:
        if child["kind"] == "Deployment" and child["metadata"]["name"] == "qwen-backend":
            child["status"] = {"replicas": 1, "conditions": [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}]}
    answer = sync.sync(h.sync_request(h.llmservice(), children=observed), h.config())
    assert _cond(answer, "BackendReady")["reason"] == "ProgressDeadlineExceeded"


def test_missing_secrets_are_reported_from_what_the_pods_say_and_secrets_are_never_requested() -> None:
    svc = h.llmservice(endpoint={"auth": {"secretRef": {"name": "keys"}}},
                       model={"source": "hf://org/m", "credentialsSecret": {"name": "hub"}},
                       scalerTLS={"secretName": "tls", "triggerAuthentication": "ta"})
    # customize never asks for Secrets: Metacontroller would send their data on every sync.
    rules = customize.customize({"parent": svc}, h.config())["relatedResources"]
    assert all(r["resource"] != "secrets" for r in rules)
    assert h.sync_request(svc)["related"].get("Secret.v1") is None

    quiet = sync.sync(h.sync_request(svc, pods=[h.pod("qwen-backend-1", ready=True)]), h.config())
    assert all(c["reason"] != "SecretNotFound" for c in quiet["status"]["conditions"])

    pods = [
        # The kubelet's words for an env reference (the hub token) ...
        h.pod("qwen-backend-1", waiting="CreateContainerConfigError", message='secret "hub" not found'),
        # ... and the gateway's termination message for its optional auth and TLS volumes.
        h.pod("qwen-gateway-1", component="gateway", waiting="CrashLoopBackOff", last_terminated="Error",
              terminated_message='Secret "keys" not found, or it lacks a key: /var/run/noctaya/auth/api-key missing'),
        h.pod("qwen-gateway-2", component="gateway", last_terminated="Error",
              terminated_message='Secret "tls" not found, or it lacks a key: /var/run/noctaya/scaler-tls/tls.crt missing'),
    ]
    answer = sync.sync(h.sync_request(svc, pods=pods), h.config())
    backend, gateway, autoscaling_ready = (_cond(answer, t) for t in ("BackendReady", "GatewayReady", "AutoscalingReady"))
    assert backend["reason"] == "SecretNotFound" and "hub" in backend["message"]
    assert gateway["reason"] == "SecretNotFound" and "keys" in gateway["message"]
    assert autoscaling_ready["reason"] == "SecretNotFound" and "tls" in autoscaling_ready["message"]
    # A missing key in an existing Secret, in the kubelet's other wording.
    key = h.pod("qwen-backend-1", waiting="CreateContainerConfigError",
                message="couldn't find key token in Secret models/hub")
    assert _cond(sync.sync(h.sync_request(svc, pods=[key]), h.config()), "BackendReady")["reason"] == "SecretNotFound"
    # Another Secret's absence (not ours) names nothing of ours.
    other = h.pod("qwen-backend-1", waiting="CreateContainerConfigError", message='secret "unrelated" not found')
    cond = _cond(sync.sync(h.sync_request(svc, pods=[other]), h.config()), "BackendReady")
    assert "unrelated" in cond["message"] and "model.credentialsSecret" not in cond["message"]


def test_invalid_trigger_is_reported_not_rendered() -> None:
    rt = h.runtime()
    del rt["spec"]["metrics"]
    svc = h.llmservice(scaling={"triggers": [{"signal": "KVCacheUsage", "threshold": "0.8", "serverAddress": "http://p:9090"}]})
    answer = sync.sync(h.sync_request(svc, runtimes=[rt]), h.config())
    cond = _cond(answer, "AutoscalingReady")
    assert cond["reason"] == "InvalidSpec" and "kvCacheUsageMetric" in cond["message"]
    so = autoscaling.sync(h.decorator_request(svc, runtimes=[rt]), h.config())["attachments"][0]
    assert [t["type"] for t in so["spec"]["triggers"]] == ["external-push"]


# --- children details ----------------------------------------------------------------------------


def test_token_is_derived_once_then_reused_from_the_observed_secret() -> None:
    svc = h.llmservice(endpoint={"replicas": 2})
    first = sync.sync(h.sync_request(svc), h.config())
    secret = next(c for c in first["children"] if c["kind"] == "Secret")
    expected = base64.b64encode(secrets.derive_token(h.TOKEN_KEY, h.UID).encode()).decode()
    assert secret["data"]["token"] == expected
    rotated = base64.b64encode(b"a-token-rotated-by-an-operator-000").decode()
    observed = copy.deepcopy(secret)
    observed["data"]["token"] = rotated
    again = sync.sync(h.sync_request(svc, children=[h.as_observed(observed)]), h.config())
    assert next(c for c in again["children"] if c["kind"] == "Secret")["data"]["token"] == rotated
    # A different key (another hook replica) does not change a token already in use.
    other = dataclasses.replace(h.config(), token_key=b"another-key-another-key-another-key")
    third = sync.sync(h.sync_request(svc, children=[h.as_observed(observed)]), other)
    assert next(c for c in third["children"] if c["kind"] == "Secret")["data"]["token"] == rotated
    assert secrets.derive_token(b"k" * 32, "uid-a") != secrets.derive_token(b"k" * 32, "uid-b")


def test_raising_the_token_epoch_rotates_the_token_and_keeps_the_previous_one() -> None:
    svc = h.llmservice(endpoint={"replicas": 2})

    def secret(config, observed=None) -> dict:
        children = [h.as_observed(observed)] if observed is not None else []
        answer = sync.sync(h.sync_request(svc, children=children), config)
        return next(c for c in answer["children"] if c["kind"] == "Secret")

    def token(epoch: int) -> str:
        return base64.b64encode(secrets.derive_token(h.TOKEN_KEY, h.UID, epoch).encode()).decode()

    first = secret(h.config())
    assert first["data"] == {"token": token(0), "previous-token": token(0)}
    assert first["metadata"]["annotations"][secrets.EPOCH_ANNOTATION] == "0"
    assert secret(h.config(), first) == first  # an unchanged world: the same answer, byte for byte
    bumped = dataclasses.replace(h.config(), token_epoch=1)
    rotated = secret(bumped, first)
    assert rotated["data"] == {"token": token(1), "previous-token": token(0)} and token(1) != token(0)
    assert rotated["metadata"]["annotations"][secrets.EPOCH_ANNOTATION] == "1"
    assert secret(bumped, rotated) == rotated  # rotated once, then stable
    # Gateways present `token` and fall back to `previous-token`; the aggregator accepts either.
    multi = {(c["kind"], c["metadata"]["name"]): c for c in sync.sync(h.sync_request(svc), h.config())["children"]}
    for deployment in ("qwen-gateway", "qwen-aggregator"):
        env = {e["name"]: e["value"] for e in multi[("Deployment", deployment)]["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["NOCTAYA_AGGREGATOR_PREVIOUS_TOKEN_FILE"].endswith("/previous-token")


def test_scaler_tls_may_use_a_cluster_trigger_authentication() -> None:
    for kind in ("TriggerAuthentication", "ClusterTriggerAuthentication"):
        svc = h.llmservice(scalerTLS={"secretName": "s", "triggerAuthentication": "keda-client", "triggerAuthenticationKind": kind})
        trigger = autoscaling.sync(h.decorator_request(svc), h.config())["attachments"][0]["spec"]["triggers"][0]
        assert trigger["authenticationRef"] == {"name": "keda-client", "kind": kind}


def test_single_gateway_scaler_service_selects_the_gateway_multi_selects_the_aggregator() -> None:
    single = {c["metadata"]["name"]: c for c in sync.sync(h.sync_request(h.llmservice()), h.config())["children"] if c["kind"] == "Service"}
    assert single["qwen-scaler"]["spec"]["selector"]["serving.noctaya.io/component"] == "gateway"
    multi = {(c["kind"], c["metadata"]["name"]): c for c in sync.sync(h.sync_request(h.llmservice(endpoint={"replicas": 2})), h.config())["children"]}
    assert multi[("Service", "qwen-scaler")]["spec"]["selector"]["serving.noctaya.io/component"] == "aggregator"
    assert {p["port"] for p in multi[("Service", "qwen-scaler")]["spec"]["ports"]} == {9090, 9091}
    assert ("Service", "qwen-aggregator") not in multi
    assert multi[("PodDisruptionBudget", "qwen-gateway")]["spec"]["minAvailable"] == 1
    gateway = multi[("Deployment", "qwen-gateway")]["spec"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in gateway["containers"][0]["env"]}
    assert env["NOCTAYA_SCALER_MODE"] == "report" and "NOCTAYA_SCALER_PORT" not in env
    # Without scaler TLS: plain HTTP and no TLS material at all.
    assert env["NOCTAYA_AGGREGATOR_URL"] == "http://qwen-scaler.models.svc.cluster.local:9091/v1/report"
    assert "NOCTAYA_AGGREGATOR_CA_FILE" not in env and all(v["name"] != "scaler-tls" for v in gateway["volumes"])
    probe = multi[("Deployment", "qwen-aggregator")]["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    assert probe["tcpSocket"] == {"port": "report"}


def test_pvc_is_create_once_and_a_change_is_a_conflict() -> None:
    first, observed = _running(cache={"strategy": "NodeLocalPVC", "size": "50Gi"})
    changed = h.llmservice(cache={"strategy": "NodeLocalPVC", "size": "100Gi"}, status=first["status"])
    answer = sync.sync(h.sync_request(changed, children=observed), h.config())
    claim = next(c for c in answer["children"] if c["kind"] == "PersistentVolumeClaim")
    assert claim["spec"]["resources"]["requests"]["storage"] == "50Gi"  # the existing claim, unchanged
    cond = _cond(answer, "CacheReady")
    assert (cond["status"], cond["reason"]) == ("False", "CacheSpecConflict")
    for child in observed:
        if child["kind"] == "PersistentVolumeClaim":
            child["status"] = {"phase": "Bound"}
    bound = sync.sync(h.sync_request(h.llmservice(cache={"strategy": "NodeLocalPVC", "size": "50Gi"}), children=observed), h.config())
    assert _cond(bound, "CacheReady")["status"] == "True"


# --- wire shapes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("request_body", [None, [], {"parent": "x"}, {"parent": {"metadata": {}}}, {"parent": {"metadata": {"name": "a"}}, "children": []}])
def test_unreadable_requests_raise_invalid_hook_request(request_body: object) -> None:
    for hook in (sync.sync, finalize.finalize, customize.customize, runtime_status.sync):
        with pytest.raises(InvalidHookRequest):
            hook(request_body, h.config())  # type: ignore[arg-type]
    with pytest.raises(InvalidHookRequest):
        autoscaling.sync({"object": None}, h.config())


def test_customize_rules_never_mix_names_and_selectors() -> None:
    for runtime in ({"name": "x"}, {"selector": {"matchLabels": {"a": "b"}}}, {"selector": {}}, {"name": "x", "selector": {"matchLabels": {"a": "b"}}}, {}):
        svc = h.llmservice(runtime=runtime)
        rules = customize.customize({"parent": svc}, h.config())["relatedResources"]
        for rule in rules:
            assert not ("names" in rule and "labelSelector" in rule)
            if "labelSelector" in rule and rule != customize.POOL_RULE:  # every pool, on purpose
                assert rule["labelSelector"], "an empty selector would match everything"
            if "names" in rule:
                assert rule["names"]
        runtime_rules = [r for r in rules if r["resource"] == "inferenceruntimes"]
        assert len(runtime_rules) == (0 if runtime in ({"selector": {}}, {}) else 1)


def test_customize_depends_on_spec_only() -> None:
    svc = h.llmservice()
    a = customize.customize({"parent": svc}, h.config())
    svc2 = copy.deepcopy(svc)
    svc2["status"] = {"conditions": [{"type": "Ready", "status": "True"}]}
    svc2["metadata"]["resourceVersion"] = "99"
    assert customize.customize({"parent": svc2}, h.config()) == a


def test_decorator_never_writes_status() -> None:
    answer = autoscaling.sync(h.decorator_request(h.llmservice()), h.config())
    assert answer.get("status") is None
    assert set(answer) <= {"labels", "annotations", "attachments", "resyncAfterSeconds", "finalized"}
    so = answer["attachments"][0]
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "qwen-backend"}
    trig = so["spec"]["triggers"][0]
    assert trig["metadata"] == {"scalerAddress": "qwen-scaler.models.svc.cluster.local:9090", "targetPerReplica": "10"}
    tls = autoscaling.sync(h.decorator_request(h.llmservice(scalerTLS={"secretName": "s", "triggerAuthentication": "ta"})), h.config())
    trig = tls["attachments"][0]["spec"]["triggers"][0]
    assert trig["metadata"]["enableTLS"] == "true" and trig["authenticationRef"] == {"name": "ta", "kind": "TriggerAuthentication"}
    rules = autoscaling.customize({"parent": h.llmservice()}, h.config())["relatedResources"]
    assert rules == [{"apiVersion": "serving.noctaya.io/v1alpha1", "resource": "inferenceruntimes", "names": ["vllm-nvidia"]},
                     customize.POOL_RULE]


def test_finalize_tears_down_in_order() -> None:
    first, observed = _running(endpoint={"replicas": 2})
    svc = h.llmservice(endpoint={"replicas": 2}, status=first["status"])
    svc["metadata"]["deletionTimestamp"] = "2026-01-01T03:00:00Z"
    pods = [h.pod("qwen-backend-x", ready=True)]
    # 1: gateway still there → keep only the backend side
    step1 = sync.sync(h.sync_request(svc, children=observed, pods=pods, finalizing=True), h.config())
    assert {c["metadata"]["labels"]["serving.noctaya.io/component"] for c in step1["children"]} == {"backend", "cache"}
    assert step1["finalized"] is False and step1["resyncAfterSeconds"] > 0
    # 2: gateway gone, backend still observed → drop the backend, not finalized yet
    remaining = [c for c in observed if c["metadata"]["labels"]["serving.noctaya.io/component"] in ("backend", "cache")]
    step2 = finalize.finalize(h.sync_request(svc, children=remaining, pods=pods, finalizing=True), h.config())
    assert step2["children"] == [] and step2["finalized"] is False
    # 3: Deployments gone but a Pod still drains → still not finalized
    step3 = finalize.finalize(h.sync_request(svc, children=[], pods=pods, finalizing=True), h.config())
    assert step3["finalized"] is False
    # 4: nothing left
    step4 = finalize.finalize(h.sync_request(svc, children=[], pods=[], finalizing=True), h.config())
    assert step4["finalized"] is True and _cond(step4, "Ready")["reason"] == "Terminating"
    assert set(step4) == {"status", "children", "resyncAfterSeconds", "finalized"}


def test_runtime_status_accepts_and_rejects() -> None:
    ok = runtime_status.sync({"parent": h.runtime()}, h.config())
    assert ok["children"] == [] and ok["status"]["conditions"][0]["reason"] == "Accepted"
    bad = h.runtime()
    bad["spec"]["accelerator"]["vendor"] = "tpu"
    answer = runtime_status.sync({"parent": bad}, h.config())
    cond = answer["status"]["conditions"][0]
    assert (cond["status"], cond["reason"]) == ("False", "InvalidSpec") and "spec.accelerator.vendor" in cond["message"]
    again = runtime_status.sync({"parent": {**bad, "status": answer["status"]}}, h.config(h.LATER_TIME))
    assert again["status"] == answer["status"]


# --- a runtime change reaches every LLMService that uses it --------------------------------------


def _backend_image(answer: dict) -> str:
    deploy = next(c for c in answer["children"] if c["kind"] == "Deployment" and c["metadata"]["name"].endswith("-backend"))
    return deploy["spec"]["template"]["spec"]["containers"][0]["image"]


def test_runtime_change_reaches_every_llmservice_that_uses_it() -> None:
    """Both ways of choosing a runtime make Metacontroller watch it (a related rule that matches it),
    and the next sync of each parent renders the new runtime: no LLMService keeps a stale pod."""
    old = h.runtime(labels={"engine": "vllm"})
    new = h.runtime(labels={"engine": "vllm"}, image="vllm/vllm-openai:v0.9.0")
    by_name = h.llmservice(name="by-name")
    by_selector = h.llmservice(name="by-selector", runtime={"selector": {"matchLabels": {"engine": "vllm"}}})
    for parent in (by_name, by_selector):
        rules = [r for r in customize.customize({"parent": parent}, h.config())["relatedResources"]
                 if r["resource"] == "inferenceruntimes"]
        assert len(rules) == 1
        rule = rules[0]
        assert rule.get("names") == ["vllm-nvidia"] or rule["labelSelector"]["matchLabels"] == {"engine": "vllm"}
        before = sync.sync(h.sync_request(parent, runtimes=[old]), h.config())
        assert _backend_image(before) == "vllm/vllm-openai:v0.8.5"
        observed = [h.as_observed(c, i) for i, c in enumerate(before["children"])]
        after = sync.sync(h.sync_request(parent, runtimes=[new], children=observed), h.config())
        assert _backend_image(after) == "vllm/vllm-openai:v0.9.0"
        assert next(c for c in after["status"]["conditions"] if c["type"] == "RuntimeResolved")["status"] == "True"


def test_retuning_the_target_rewrites_the_scaled_object_and_never_rolls_the_gateways() -> None:
    def render(target: int) -> tuple[dict, dict]:
        service = h.llmservice(scaling={"targetPerReplica": target})
        so = autoscaling.sync(h.decorator_request(service), h.config())["attachments"][0]
        answer = sync.sync(h.sync_request(service), h.config())
        gateway = next(c for c in answer["children"] if c["kind"] == "Deployment" and c["metadata"]["name"] == "qwen-gateway")
        return so, gateway

    so_10, gateway_10 = render(10)
    so_3, gateway_3 = render(3)
    assert so_10["spec"]["triggers"][0]["metadata"]["targetPerReplica"] == "10"
    assert so_3["spec"]["triggers"][0]["metadata"]["targetPerReplica"] == "3"
    assert gateway_3 == gateway_10  # same Pod template: no rollout, no dropped held requests
