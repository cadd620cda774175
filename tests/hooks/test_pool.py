"""The AcceleratorPool decision, through the real sync hook with Metacontroller-shaped requests:
which idle model yields to which waiting backend Pod, and when nothing may yield."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hooks.api.common import API_VERSION
from hooks.config import HookConfig
from hooks.controller import pool

CONFIG = HookConfig(clock=lambda: "2026-12-05T08:00:00Z")
NVIDIA = "nvidia.com/gpu"


def pool_obj(name: str = "gpus", resource: str = NVIDIA, created: str = "2026-12-01T00:00:00Z",
             status: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {"apiVersion": API_VERSION, "kind": "AcceleratorPool",
                           "metadata": {"name": name, "generation": 1, "creationTimestamp": created},
                           "spec": {"resourceName": resource, "yieldAfter": "5s", **spec}}
    if status is not None:
        obj["status"] = status
    return obj


def node(name: str, gpus: int, resource: str = NVIDIA, labels: dict[str, str] | None = None,
         taints: list[dict[str, str]] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels or {}},
            "spec": {"taints": taints} if taints else {},
            "status": {"allocatable": {"cpu": "16", resource: str(gpus)}}}


def pod(service: str, index: int = 0, *, node_name: str = "", gpus: int = 1, ready: bool = True,
        waiting: bool = False, resource: str = NVIDIA, ns: str = "team", created: str = "2026-12-05T07:00:00Z",
        **spec: Any) -> dict[str, Any]:
    conds = []
    if waiting:
        conds.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                      "message": f"0/2 nodes are available: 2 Insufficient {resource}. preemption: 0/2 nodes are "
                                 "available: 2 No preemption victims found for incoming pod."})
    elif node_name:
        conds.append({"type": "Ready", "status": "True" if ready else "False"})
    body: dict[str, Any] = {"containers": [{"name": "engine", "resources": {"limits": {resource: str(gpus)}}}], **spec}
    if node_name:
        body["nodeName"] = node_name
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{service}-backend-{index}", "namespace": ns, "creationTimestamp": created,
                         "labels": {"serving.noctaya.io/llmservice": service, "serving.noctaya.io/component": "backend"}},
            "spec": body, "status": {"phase": "Running" if node_name else "Pending", "conditions": conds}}


def scaled(service: str, state: str, last: str | None = "2026-12-05T07:50:00Z", *, ns: str = "team",
           minimum: int = 0, never: bool = False) -> dict[str, Any]:
    """state: idle (cooling down), busy (active), zero (inactive at zero)."""
    reason, status = {"idle": ("ScalerCooldown", "False"), "busy": ("ScalerActive", "True"),
                      "zero": ("ScalerNotActive", "False")}[state]
    labels = {"serving.noctaya.io/llmservice": service, "serving.noctaya.io/component": "backend",
              "app.kubernetes.io/managed-by": "noctaya"}
    if never:
        labels["serving.noctaya.io/yield-policy"] = "Never"
    obj: dict[str, Any] = {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
                           "metadata": {"name": f"{service}-backend", "namespace": ns, "labels": labels},
                           "spec": {"minReplicaCount": minimum, "cooldownPeriod": 300},
                           "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "ScaledObjectReady"},
                                                     {"type": "Active", "status": status, "reason": reason}]}}
    if last:
        obj["status"]["lastActiveTime"] = last
    return obj


def request(parent: dict[str, Any], *objs: dict[str, Any], pools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    related: dict[str, dict[str, Any]] = {"Pod.v1": {}, "ScaledObject.keda.sh/v1alpha1": {}, "Node.v1": {},
                                          f"AcceleratorPool.{API_VERSION}": {}}
    for o in [*objs, *(pools or [parent])]:
        meta = o["metadata"]
        k = f"{meta['namespace']}/{meta['name']}" if meta.get("namespace") else meta["name"]
        related[f"{o['kind']}.{o['apiVersion']}"][k] = o
    return {"controller": {}, "parent": parent, "children": {}, "related": related}


def run(parent: dict[str, Any], *objs: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return pool.sync(request(parent, *objs, **kw), CONFIG)["status"]


def cond(status: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == ctype)


def victims(status: dict[str, Any]) -> list[str]:
    return [y["scaledObject"] for y in status["yielding"]]


def two_idle_and_a_waiter(**kw: Any) -> list[dict[str, Any]]:
    return [node("n1", 2), pod("a", node_name="n1"), pod("b", node_name="n1"), pod("c", waiting=True),
            scaled("a", "idle", "2026-12-05T07:40:00Z"), scaled("b", "idle", "2026-12-05T07:45:00Z"),
            scaled("c", "busy", None)]


def test_the_least_recently_used_idle_model_yields_and_only_it() -> None:
    status = run(pool_obj(), *two_idle_and_a_waiter())
    assert status["waiting"] == [{"pod": "team/c-backend-0", "service": "team/c", "need": 1}]
    assert status["yielding"] == [{"scaledObject": "team/a-backend", "service": "team/a", "for": "team/c-backend-0",
                                   "node": "n1", "units": 1, "cooldownSeconds": 5, "listedAt": "2026-12-05T08:00:00Z"}]
    assert cond(status, "Contended")["reason"] == "Yielding"
    assert cond(status, "Accepted")["status"] == "True"
    assert status["capacity"] == {"nodes": 1, "units": 2}


def test_a_busy_holder_never_yields_even_when_least_recently_used() -> None:
    objs = two_idle_and_a_waiter()
    objs[4] = scaled("a", "busy", "2026-12-05T07:40:00Z")
    assert victims(run(pool_obj(), *objs)) == ["team/b-backend"]


@pytest.mark.parametrize("pinned", [{"never": True}, {"minimum": 1}])
def test_pinned_models_are_never_victims(pinned: dict[str, Any]) -> None:
    objs = two_idle_and_a_waiter()
    objs[4] = scaled("a", "idle", "2026-12-05T07:40:00Z", **pinned)
    assert victims(run(pool_obj(), *objs)) == ["team/b-backend"]
    objs[5] = scaled("b", "busy")
    status = run(pool_obj(), *objs)
    assert status["yielding"] == []
    contended = cond(status, "Contended")
    assert contended["reason"] == "NoIdleHolder"
    assert "team/a (" + ("yieldPolicy Never" if "never" in pinned else "min 1") + ")" in contended["message"]
    assert "team/b (busy)" in contended["message"]


def test_everyone_busy_evicts_nothing_and_says_so() -> None:
    objs = [node("n1", 2), pod("a", node_name="n1"), pod("b", node_name="n1"), pod("c", waiting=True),
            scaled("a", "busy"), scaled("b", "busy")]
    status = run(pool_obj(), *objs)
    assert status["yielding"] == [] and len(status["waiting"]) == 1
    assert cond(status, "Contended")["reason"] == "NoIdleHolder"


def test_one_victim_for_one_unit_and_the_promise_stands_until_the_waiter_binds() -> None:
    objs = [node("n1", 3), *(pod(s, node_name="n1") for s in "abd"), pod("c", waiting=True),
            scaled("a", "idle", "2026-12-05T07:40:00Z"), scaled("b", "idle", "2026-12-05T07:41:00Z"),
            scaled("d", "idle", "2026-12-05T07:42:00Z")]
    first = run(pool_obj(), *objs)
    assert victims(first) == ["team/a-backend"]
    # A is gone, the scheduler has not bound C yet: still exactly one victim, no second eviction.
    gone = [o for o in objs if o["metadata"]["name"] != "a-backend-0"]
    gone = [scaled("a", "zero", "2026-12-05T07:40:00Z") if o["metadata"]["name"] == "a-backend" else o for o in gone]
    second = run(pool_obj(status=first), *gone)
    assert victims(second) == ["team/a-backend"]
    assert cond(second, "Contended")["reason"] == "Yielding"
    # C binds: the promise is kept no longer, the victim's cooldown is restored, nothing waits.
    bound = [pod("c", node_name="n1") if o["metadata"]["name"] == "c-backend-0" else o for o in gone]
    third = run(pool_obj(status=second), *bound)
    assert third["yielding"] == [] and third["waiting"] == []
    assert cond(third, "Contended")["reason"] == "NoWaiters"


def test_demand_while_yielding_moves_the_yield_to_the_next_idle_holder() -> None:
    objs = two_idle_and_a_waiter()
    first = run(pool_obj(), *objs)
    objs[4] = scaled("a", "busy", "2026-12-05T07:59:00Z")  # A got a request before KEDA scaled it in
    assert victims(run(pool_obj(status=first), *objs)) == ["team/b-backend"]


def test_a_waiter_no_single_node_can_satisfy_makes_nobody_yield() -> None:
    objs = [node("n1", 1), node("n2", 1), pod("a", node_name="n1"), pod("b", node_name="n2"),
            pod("c", waiting=True, gpus=2), scaled("a", "idle"), scaled("b", "idle")]
    status = run(pool_obj(), *objs)
    assert status["yielding"] == []
    contended = cond(status, "Contended")
    assert contended["reason"] == "Unsatisfiable"
    assert "needs 2 nvidia.com/gpu; the largest node it can use offers 1" in contended["message"]


def test_a_multi_unit_waiter_takes_as_many_victims_as_it_needs_on_one_node() -> None:
    objs = [node("n1", 2), pod("a", node_name="n1"), pod("b", node_name="n1"), pod("c", waiting=True, gpus=2),
            scaled("a", "idle", "2026-12-05T07:40:00Z"), scaled("b", "idle", "2026-12-05T07:45:00Z")]
    assert victims(run(pool_obj(), *objs)) == ["team/a-backend", "team/b-backend"]


def test_the_node_whose_victims_are_least_recent_is_chosen() -> None:
    objs = [node("n1", 1), node("n2", 1), pod("a", node_name="n1"), pod("b", node_name="n2"), pod("c", waiting=True),
            scaled("a", "idle", "2026-12-05T07:45:00Z"), scaled("b", "idle", "2026-12-05T07:40:00Z")]
    assert run(pool_obj(), *objs)["yielding"][0]["node"] == "n2"


def test_other_accelerator_kinds_are_not_this_pools_business() -> None:
    amd = "amd.com/gpu"
    objs = [node("n1", 1), node("n2", 1, resource=amd), pod("a", node_name="n1"),
            pod("b", node_name="n2", resource=amd), pod("c", waiting=True, resource=amd),
            scaled("a", "idle"), scaled("b", "idle")]
    nvidia = run(pool_obj(), *objs)
    assert nvidia["waiting"] == [] and nvidia["yielding"] == []
    amd_pool = run(pool_obj("amd", resource=amd), *objs)
    assert victims(amd_pool) == ["team/b-backend"]


def test_a_waiter_that_cannot_use_the_holders_node_yields_nothing() -> None:
    taint = [{"key": "dedicated", "value": "prod", "effect": "NoSchedule"}]
    objs = [node("n1", 1, taints=taint), pod("a", node_name="n1"), pod("c", waiting=True), scaled("a", "idle")]
    status = run(pool_obj(), *objs)
    assert status["yielding"] == []
    tolerating = pod("c", waiting=True, tolerations=[{"key": "dedicated", "operator": "Exists"}])
    assert victims(run(pool_obj(), *objs[:2], tolerating, objs[3])) == ["team/a-backend"]
    selecting = pod("c", waiting=True, nodeSelector={"gpu": "l4"})
    assert run(pool_obj(), node("n1", 1), objs[1], selecting, objs[3])["yielding"] == []


def test_free_room_waits_for_the_scheduler_instead_of_evicting() -> None:
    objs = [node("n1", 2), pod("a", node_name="n1"), pod("c", waiting=True), scaled("a", "idle")]
    status = run(pool_obj(), *objs)
    assert status["yielding"] == []
    assert cond(status, "Contended")["reason"] == "Scheduling"


def test_two_waiters_get_two_different_victims_oldest_waiter_first() -> None:
    objs = [node("n1", 2), pod("a", node_name="n1"), pod("b", node_name="n1"),
            pod("c", waiting=True, created="2026-12-05T07:58:00Z"), pod("d", waiting=True, created="2026-12-05T07:57:00Z"),
            scaled("a", "idle", "2026-12-05T07:40:00Z"), scaled("b", "idle", "2026-12-05T07:45:00Z")]
    status = run(pool_obj(), *objs)
    assert [w["pod"] for w in status["waiting"]] == ["team/d-backend-0", "team/c-backend-0"]
    assert {(y["for"], y["scaledObject"]) for y in status["yielding"]} == {
        ("team/d-backend-0", "team/a-backend"), ("team/c-backend-0", "team/b-backend")}


def test_scale_out_of_a_serving_model_is_not_a_waiter() -> None:
    objs = [node("n1", 1), pod("a", node_name="n1"), pod("c", node_name="n1", index=0), pod("c", index=1, waiting=True),
            scaled("a", "idle")]
    objs[1] = pod("a", node_name="n1")
    status = run(pool_obj(), node("n1", 2), *objs[1:])
    assert status["waiting"] == [] and status["yielding"] == []


def test_an_unchanged_world_gets_the_same_bytes_every_resync() -> None:
    objs = two_idle_and_a_waiter()
    first = pool.sync(request(pool_obj(), *objs), CONFIG)
    # Within the stall bound (yieldAfter 5 s + STALL_GRACE_SECONDS after the promise): same bytes.
    again = pool.sync(request(pool_obj(status=first["status"]), *objs),
                      HookConfig(clock=lambda: "2026-12-05T08:00:30Z"))
    third = pool.sync(request(pool_obj(status=again["status"]), *objs),
                      HookConfig(clock=lambda: "2026-12-05T08:01:00Z"))
    assert json.dumps(again, sort_keys=True) == json.dumps(first, sort_keys=True) == json.dumps(third, sort_keys=True)


def test_bad_input_is_reported_and_nothing_yields() -> None:
    objs = two_idle_and_a_waiter()
    invalid = pool_obj(resourceName="not a resource")
    status = run(invalid, *objs)
    assert cond(status, "Accepted")["reason"] == "InvalidSpec" and "yielding" not in status
    unknown = run(pool_obj(resource="nvidia.com/gpus"), *objs)
    assert cond(unknown, "Accepted")["reason"] == "NoNodes" and "nvidia.com/gpus" in cond(unknown, "Accepted")["message"]
    assert "yielding" not in unknown
    older, newer = pool_obj("first", created="2026-11-01T00:00:00Z"), pool_obj("second")
    assert cond(run(older, *objs, pools=[older, newer]), "Accepted")["status"] == "True"
    clash = run(newer, *objs, pools=[older, newer])
    assert cond(clash, "Accepted")["reason"] == "Overlapping" and "pool first" in cond(clash, "Accepted")["message"]
    assert "yielding" not in clash
    # Disjoint node sets of one resource are two pools, not an overlap.
    split_old = pool_obj("first", created="2026-11-01T00:00:00Z", nodeSelector={"zone": "a"})
    split_new = pool_obj("second", nodeSelector={"zone": "b"})
    zoned = [node("n1", 1, labels={"zone": "a"}), node("n2", 1, labels={"zone": "b"})]
    assert cond(run(split_new, *zoned, pools=[split_old, split_new]), "Accepted")["status"] == "True"


def test_malformed_related_objects_are_skipped_not_fatal() -> None:
    objs = two_idle_and_a_waiter()
    broken_pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x", "namespace": "team"},
                  "spec": {"containers": "nope", "nodeName": 7}, "status": {"conditions": [None, 3]}}
    broken_so = {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
                 "metadata": {"name": "y", "namespace": "team", "labels": {"serving.noctaya.io/llmservice": "y"}},
                 "spec": [], "status": {"conditions": "x", "lastActiveTime": 5}}
    broken_node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n9"}, "status": {"allocatable": {NVIDIA: "lots"}}}
    previous = {"yielding": [{"scaledObject": 1}, "x", {"scaledObject": "team/z", "service": "team/z", "for": "team/q",
                                                         "node": "n1", "units": "1"}]}
    status = run(pool_obj(status=previous), *objs, broken_pod, broken_so, broken_node)
    assert victims(status) == ["team/a-backend"]


def test_a_waiter_two_pools_could_serve_is_answered_by_one() -> None:
    left = pool_obj("left", nodeSelector={"zone": "a"})
    right = pool_obj("right", nodeSelector={"zone": "b"})
    objs = [node("n1", 1, labels={"zone": "a"}), node("n2", 1, labels={"zone": "b"}), pod("a", node_name="n1"),
            pod("b", node_name="n2"), pod("c", waiting=True), scaled("a", "idle"), scaled("b", "idle")]
    assert victims(run(left, *objs, pools=[left, right])) == ["team/a-backend"]
    assert run(right, *objs, pools=[left, right])["yielding"] == []


def test_customize_relates_what_the_decision_reads() -> None:
    rules = pool.customize({"parent": pool_obj()})["relatedResources"]
    assert {r["resource"] for r in rules} == {"pods", "scaledobjects", "nodes", "acceleratorpools"}
    pods_rule = next(r for r in rules if r["resource"] == "pods")
    assert pods_rule["labelSelector"] == {"matchLabels": {"serving.noctaya.io/component": "backend"}}


def test_a_pool_with_a_pending_backend_looks_again_soon_and_a_quiet_one_does_not() -> None:
    objs = two_idle_and_a_waiter()
    assert pool.sync(request(pool_obj(), *objs), CONFIG)["resyncAfterSeconds"] == pool.PENDING_RESYNC_SECONDS
    # Pending but not (yet) marked Unschedulable: not a waiter, but the pool looks again.
    fresh = pod("c")
    fresh["status"] = {"phase": "Pending", "conditions": []}
    answer = pool.sync(request(pool_obj(), *objs[:3], fresh, *objs[4:]), CONFIG)
    assert answer["status"]["waiting"] == [] and answer["resyncAfterSeconds"] == pool.PENDING_RESYNC_SECONDS
    bound = [pod("c", node_name="n1") if o["metadata"]["name"] == "c-backend-0" else o for o in objs]
    assert pool.sync(request(pool_obj(), node("n1", 3), *bound[1:]), CONFIG)["resyncAfterSeconds"] == 0.0


def test_a_victim_that_turns_busy_keeps_its_promise_when_no_other_holder_could_take_over() -> None:
    # One accelerator, alternating demand: moving the yield is impossible, and dropping the promise on
    # every request would flip the victim's cooldownPeriod (a ScaledObject rewrite) each time.
    objs = [node("n1", 1), pod("a", node_name="n1"), pod("c", waiting=True),
            scaled("a", "idle", "2026-12-05T07:40:00Z"), scaled("c", "busy", None)]
    first = run(pool_obj(), *objs)
    assert victims(first) == ["team/a-backend"]
    objs[3] = scaled("a", "busy", "2026-12-05T07:59:00Z")
    second = pool.sync(request(pool_obj(status=first), *objs), CONFIG)
    assert victims(second["status"]) == ["team/a-backend"]
    assert second["status"]["yielding"] == first["yielding"]
    assert cond(second["status"], "Contended")["reason"] == "Yielding"
    # ... and it is byte-identical on the next resync.
    again = pool.sync(request(pool_obj(status=second["status"]), *objs), CONFIG)
    assert json.dumps(again, sort_keys=True) == json.dumps(second, sort_keys=True)


def test_a_pending_pod_whose_cold_request_ended_makes_nobody_yield() -> None:
    # c's request got its 504: KEDA says c is not active (its replica lives on only for the cooldown).
    objs = two_idle_and_a_waiter()
    objs[6] = scaled("c", "idle", "2026-12-05T07:59:00Z")
    status = run(pool_obj(), *objs)
    assert status["waiting"] == [] and status["yielding"] == []
    assert cond(status, "Contended")["reason"] == "NoWaiters"
    # A promise made while it still waited is withdrawn: the victim's cooldown is restored.
    before = run(pool_obj(), *two_idle_and_a_waiter())
    assert victims(before) == ["team/a-backend"]
    assert run(pool_obj(status=before), *objs)["yielding"] == []
    # A model with a floor (min 1) wants its replica without any demand: it is still a waiter.
    objs[6] = scaled("c", "zero", None, minimum=1)
    assert victims(run(pool_obj(), *objs)) == ["team/a-backend"]


# --- KEDA's own record, stale promises, sizing, resync (issue 31) ---------------------------------


def paused(obj: dict[str, Any], how: str = "annotation") -> dict[str, Any]:
    if how == "annotation":
        obj["metadata"]["annotations"] = {"autoscaling.keda.sh/paused": "true"}
    elif how == "replicas":
        obj["metadata"]["annotations"] = {"autoscaling.keda.sh/paused-replicas": "1"}
    else:
        obj["status"]["conditions"].append({"type": "Paused", "status": "True", "reason": "ScaledObjectPaused"})
    return obj


def broken(obj: dict[str, Any]) -> dict[str, Any]:
    """What KEDA writes when the scaler stops answering (RequestScale, v2.20): Ready=False/TriggerError,
    Active=False/ScalerNotActive; its lastActiveTime stays as it was."""
    obj["status"]["conditions"] = [{"type": "Ready", "status": "False", "reason": "TriggerError"},
                                   {"type": "Active", "status": "False", "reason": "ScalerNotActive"}]
    return obj


@pytest.mark.parametrize("how", ["annotation", "replicas", "condition"])
def test_a_paused_lru_holder_is_no_holder_and_its_stale_cooldown_record_does_not_make_it_the_victim(how: str) -> None:
    objs = two_idle_and_a_waiter()
    objs[4] = paused(objs[4], how)  # a: the LRU, its Active=False/ScalerCooldown frozen by the pause
    status = run(pool_obj(), *objs)
    assert victims(status) == ["team/b-backend"]
    objs[5] = paused(objs[5], how)
    status = run(pool_obj(), *objs)
    assert status["yielding"] == [] and cond(status, "Contended")["reason"] == "NoIdleHolder"
    assert "team/a (paused" in cond(status, "Contended")["message"]


def test_a_victim_whose_scaler_breaks_after_it_was_listed_loses_its_promise_to_another_idle_model() -> None:
    objs = two_idle_and_a_waiter()
    first = run(pool_obj(), *objs)
    assert victims(first) == ["team/a-backend"]
    objs[4] = broken(objs[4])
    second = run(pool_obj(status=first), *objs)
    assert victims(second) == ["team/b-backend"]
    objs[5] = broken(objs[5])  # b's too: nobody is left, and the message says why
    assert "team/a (scaler not Ready: TriggerError)" in cond(run(pool_obj(status=second), *objs), "Contended")["message"]
    # Paused after it was listed: the same.
    objs = two_idle_and_a_waiter()
    objs[4] = paused(objs[4])
    assert victims(run(pool_obj(status=first), *objs)) == ["team/b-backend"]


def test_an_idle_holder_whose_hpa_cannot_read_metrics_is_still_a_holder_and_keeps_its_promise() -> None:
    """KEDA reports the HPA's health in Ready (HPAMetricsUnavailable) but scales an inactive target to
    zero itself: such a holder is a victim like any idle one, and a listed one stays listed."""
    def hpa_unhealthy(obj: dict[str, Any]) -> dict[str, Any]:
        for c in obj["status"]["conditions"]:
            if c["type"] == "Ready":
                c.update(status="False", reason="HPAMetricsUnavailable")
        return obj

    objs = two_idle_and_a_waiter()
    objs[4] = hpa_unhealthy(objs[4])
    first = run(pool_obj(), *objs)
    assert victims(first) == ["team/a-backend"]
    assert victims(run(pool_obj(status=first), *objs)) == ["team/a-backend"]
    for reason in ("TriggerError", "ScalingDegraded", "ErrorGettingCurrentReplicas"):
        objs[4]["status"]["conditions"][0]["reason"] = reason
        assert victims(run(pool_obj(status=first), *objs)) == ["team/b-backend"], reason


def test_a_victim_keda_just_scaled_in_keeps_its_promise_while_its_pod_terminates() -> None:
    objs = two_idle_and_a_waiter()
    first = run(pool_obj(), *objs)
    objs[4] = scaled("a", "zero", "2026-12-05T07:40:00Z")  # Active=False/ScalerNotActive, Ready: scaled in
    assert run(pool_obj(status=first), *objs)["yielding"] == first["yielding"]


def test_two_waiters_crossing_nodes_are_both_served_and_no_promise_is_left_on_a_taken_node() -> None:
    objs = [node("n1", 1), node("n2", 1), pod("a", node_name="n1"), pod("b", node_name="n2"),
            pod("c", waiting=True, created="2026-12-05T07:57:00Z"), pod("d", waiting=True, created="2026-12-05T07:58:00Z"),
            scaled("a", "idle", "2026-12-05T07:40:00Z"), scaled("b", "idle", "2026-12-05T07:45:00Z")]
    first = run(pool_obj(), *objs)
    assert {(y["for"], y["node"]) for y in first["yielding"]} == {("team/c-backend-0", "n1"), ("team/d-backend-0", "n2")}
    # Both victims gone; the scheduler binds the younger waiter d on n1, the node promised to c.
    crossed = [node("n1", 1), node("n2", 1), pod("c", waiting=True, created="2026-12-05T07:57:00Z"),
               pod("d", node_name="n1", created="2026-12-05T07:58:00Z"),
               scaled("a", "zero", "2026-12-05T07:40:00Z"), scaled("b", "zero", "2026-12-05T07:45:00Z")]
    second = run(pool_obj(status=first), *crossed)
    assert second["yielding"] == [], "a promise tied to a node with no holder and no room is dropped"
    contended = cond(second, "Contended")
    assert contended["reason"] == "Scheduling" and "team/c-backend-0" in contended["message"]


def test_a_victim_is_sized_to_the_need_a_multi_replica_model_counts_every_replica() -> None:
    # a is the LRU but holds two GPUs (n1 and n2); b holds one on n1: a one-GPU waiter takes b.
    objs = [node("n1", 2), node("n2", 1), pod("a", 0, node_name="n1"), pod("a", 1, node_name="n2"),
            pod("b", node_name="n1"), pod("c", waiting=True),
            scaled("a", "idle", "2026-12-05T07:40:00Z"), scaled("b", "idle", "2026-12-05T07:45:00Z")]
    assert victims(run(pool_obj(), *objs)) == ["team/b-backend"]
    # A two-GPU waiter that fits only n1 (2 GPUs): a's replica there and b together, nothing cheaper exists.
    objs[5] = pod("c", waiting=True, gpus=2)
    assert sorted(victims(run(pool_obj(), *objs))) == ["team/a-backend", "team/b-backend"]


def test_a_pool_looks_again_rarely_for_pods_it_cannot_help() -> None:
    objs = [node("n1", 1), pod("a", node_name="n1"), pod("c", waiting=True), scaled("a", "busy")]
    answer = pool.sync(request(pool_obj(), *objs), CONFIG)
    assert cond(answer["status"], "Contended")["reason"] == "NoIdleHolder"
    assert answer["resyncAfterSeconds"] == pool.HELPLESS_RESYNC_SECONDS
    stuck = pod("c", nodeSelector={"gpu": "h100"})  # refused by the scheduler for its selector, not for GPUs
    stuck["status"] = {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                                           "message": "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector."}]}
    answer = pool.sync(request(pool_obj(), *objs[:2], stuck, objs[3]), CONFIG)
    assert answer["status"]["waiting"] == [] and answer["resyncAfterSeconds"] == pool.HELPLESS_RESYNC_SECONDS


def test_pools_on_two_node_groups_cooperate_for_a_waiter_that_fits_either() -> None:
    left = pool_obj("left", nodeSelector={"zone": "a"})
    right = pool_obj("right", nodeSelector={"zone": "b"})
    objs = [node("n1", 1, labels={"zone": "a"}), node("n2", 1, labels={"zone": "b"}), pod("a", node_name="n1"),
            pod("b", node_name="n2"), pod("c", waiting=True), scaled("a", "busy"), scaled("b", "idle")]
    # left (first by name) cannot help: its only holder is busy. right's idle model yields.
    first_left = run(left, *objs, pools=[left, right])
    assert first_left["waiting"] == [] and first_left["yielding"] == []
    first_right = run(right, *objs, pools=[left, right])
    assert victims(first_right) == ["team/b-backend"]
    # Each pool reads the other's status; the answer stays the same with both statuses written.
    left["status"], right["status"] = first_left, first_right
    assert run(left, *objs, pools=[left, right])["yielding"] == []
    assert run(right, *objs, pools=[left, right])["yielding"] == first_right["yielding"]
    # Nobody can help: the first pool that could place it says why.
    objs[6] = scaled("b", "busy")
    for p in (left, right):
        p.pop("status")
    assert cond(run(left, *objs, pools=[left, right]), "Contended")["reason"] == "NoIdleHolder"
    assert run(right, *objs, pools=[left, right])["waiting"] == []
    # A waiter only right can place is right's, whatever left can do.
    only_b = pod("c", waiting=True, nodeSelector={"zone": "b"})
    objs[4], objs[6] = only_b, scaled("b", "idle")
    objs[5] = scaled("a", "idle")
    assert run(left, *objs, pools=[left, right])["waiting"] == []
    assert victims(run(right, *objs, pools=[left, right])) == ["team/b-backend"]


def at(clock: str) -> HookConfig:
    return HookConfig(clock=lambda: clock)


def test_a_victim_keda_does_not_scale_in_when_due_stalls_and_the_waiter_is_served_by_another() -> None:
    # KEDA's operator is down: a's record stays Active=False/ScalerCooldown, Ready, and it never goes.
    objs = two_idle_and_a_waiter()
    first = pool.sync(request(pool_obj(), *objs), CONFIG)["status"]
    assert victims(first) == ["team/a-backend"]
    # Due at 08:00:00 (listed then, idle since 07:40 + 5 s): the bound is 60 s past that.
    assert victims(pool.sync(request(pool_obj(status=first), *objs), at("2026-12-05T08:01:00Z"))["status"]) == ["team/a-backend"]
    stalled = pool.sync(request(pool_obj(status=first), *objs), at("2026-12-05T08:01:01Z"))
    status = stalled["status"]
    assert victims(status) == ["team/b-backend"], "the waiter is placed again, on another idle model"
    assert status["stalled"] == [{"scaledObject": "team/a-backend", "lastActiveTime": "2026-12-05T07:40:00Z"}]
    contended = cond(status, "Contended")
    assert contended["reason"] == "YieldStalled" and "is KEDA's operator running?" in contended["message"]
    # The record holds (a is no holder) and the answer is the same bytes while nothing changes.
    again = pool.sync(request(pool_obj(status=status), *objs), at("2026-12-05T08:01:30Z"))
    assert json.dumps(again, sort_keys=True) == json.dumps(stalled, sort_keys=True)
    # KEDA is back and a was used: a new lastActiveTime ends the record; a is a holder again.
    objs[4] = scaled("a", "idle", "2026-12-05T08:02:00Z")
    back = run(pool_obj(status=again["status"]), *objs)
    assert "stalled" not in back
    # A victim whose Pods are terminating is letting go (the preStop drain), never stalled.
    draining = two_idle_and_a_waiter()
    draining[1]["metadata"]["deletionTimestamp"] = "2026-12-05T08:00:10Z"
    late = pool.sync(request(pool_obj(status=first), *draining), at("2026-12-05T08:05:00Z"))["status"]
    assert victims(late) == ["team/a-backend"] and "stalled" not in late
