"""The LLMService side of AcceleratorPools, through the real hooks with Metacontroller-shaped requests:
the autoscaling decorator shortens a yielding model's cooldown (and only then), the ScaledObject says
yieldPolicy Never, the backend Pod gets the model's own PriorityClass, and BackendReady explains
waiting for and yielding an accelerator."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from hooks.api.common import API_VERSION
from hooks.controller import autoscaling, customize, pool, sync
from tests.hooks import helpers as h
from tests.hooks import test_pool as tp

POOLS = f"AcceleratorPool.{API_VERSION}"
ME = f"{h.NAMESPACE}/qwen-backend"  # the ScaledObject of h.llmservice()
WAITER = "qwen-backend-x"


def pool_obj(name: str = "gpus", *, waiting: list[Any] | None = None, yielding: list[Any] | None = None,
             contended: tuple[str, str] | None = None, status: Any = None) -> dict[str, Any]:
    """A pool as its own controller writes it (hooks.controller.pool; see tests/hooks/test_pool.py)."""
    if status is None:
        status = {"observedGeneration": 1, "capacity": {"nodes": 1, "units": 2},
                  "waiting": waiting or [], "yielding": yielding or [], "conditions": []}
        if contended is not None:
            status["conditions"] = [
                {"type": "Accepted", "status": "True", "reason": "Accepted", "message": "1 node(s) offer 2 nvidia.com/gpu",
                 "lastTransitionTime": h.FIXED_TIME, "observedGeneration": 1},
                {"type": "Contended", "status": "True", "reason": contended[0], "message": contended[1],
                 "lastTransitionTime": h.FIXED_TIME, "observedGeneration": 1},
            ]
    return {"apiVersion": API_VERSION, "kind": "AcceleratorPool",
            "metadata": {"name": name, "generation": 1, "creationTimestamp": "2026-01-01T00:00:00Z", "uid": f"uid-{name}"},
            "spec": {"resourceName": "nvidia.com/gpu", "yieldAfter": "60s"}, "status": status}


def entry(scaled_object: str = ME, cooldown: Any = 60, waiter: str = "team/c-backend-0", service: str | None = None) -> dict:
    ns, name = scaled_object.split("/")
    return {"scaledObject": scaled_object, "service": service or f"{ns}/{name.removesuffix('-backend')}",
            "for": waiter, "node": "n1", "units": 1, "cooldownSeconds": cooldown}


def with_pools(request: dict, pools: list[dict] | None) -> dict:
    """Pools as Metacontroller relates them (cluster-scoped: keyed by name). None: no pool group at all."""
    request = copy.deepcopy(request)
    if pools is not None:
        request["related"][POOLS] = {p["metadata"]["name"]: p for p in pools}
    return request


def decorate(pools: list[dict] | None = None, **spec: Any) -> dict:
    return autoscaling.sync(with_pools(h.decorator_request(h.llmservice(**spec)), pools), h.config())


def scaled_object(answer: dict) -> dict:
    [so] = answer["attachments"]
    return so


def cooldowns(answer: dict) -> tuple[int, int]:
    spec = scaled_object(answer)["spec"]
    window = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"]
    return spec["cooldownPeriod"], window


def dump(answer: dict) -> bytes:
    return json.dumps(answer, sort_keys=True, separators=(",", ":")).encode()


# --- customize ----------------------------------------------------------------------------------


@pytest.mark.parametrize("runtime", [{"name": "vllm-nvidia"}, {"selector": {"matchLabels": {"a": "b"}}}, {}])
def test_both_controllers_relate_every_pool(runtime: dict) -> None:
    rule = {"apiVersion": "serving.noctaya.io/v1alpha1", "resource": "acceleratorpools", "labelSelector": {}}
    svc = h.llmservice(runtime=runtime)
    for hook in (customize.customize, autoscaling.customize):
        rules = hook({"parent": svc}, h.config())["relatedResources"]
        assert rules.count(rule) == 1 and rules[-1] == rule
    # The decorator's old rules are unchanged (the runtime, when the spec names one).
    assert autoscaling.customize({"parent": svc}, h.config())["relatedResources"][:-1] == (
        [] if runtime == {} else [customize.runtime_rule(svc["spec"])])


# --- the ScaledObject ---------------------------------------------------------------------------


def test_default_rendering_is_unchanged_with_or_without_pools() -> None:
    plain = decorate(None)
    so = scaled_object(plain)
    assert "serving.noctaya.io/yield-policy" not in so["metadata"]["labels"]
    assert cooldowns(plain) == (300, 300)
    others = [pool_obj("gpus", yielding=[entry("team/a-backend", 5), entry("other/qwen-backend", 5)])]
    for pools in ([], [pool_obj("empty")], others):
        assert dump(decorate(pools)) == dump(plain)
    assert dump(decorate(None, scaling={"yieldPolicy": "WhenIdle"})) == dump(plain)


def test_yield_policy_never_is_a_label_on_the_scaled_object() -> None:
    answer = decorate(None, scaling={"yieldPolicy": "Never"})
    so = scaled_object(answer)
    assert so["metadata"]["labels"]["serving.noctaya.io/yield-policy"] == "Never"
    assert so["metadata"]["labels"]["serving.noctaya.io/llmservice"] == "qwen"
    # A stale entry (the pool has not seen the label yet) never shortens a Never model's cooldown.
    assert cooldowns(decorate([pool_obj(yielding=[entry(cooldown=5)])], scaling={"yieldPolicy": "Never"})) == (300, 300)


def test_the_shortest_yield_of_all_pools_is_the_cooldown() -> None:
    pools = [
        pool_obj("a-pool", yielding=[entry(cooldown=60), entry("team/a-backend", 1)]),
        pool_obj("b-pool", yielding=[entry(cooldown=45, waiter="team/d-backend-0"), entry("other/qwen-backend", 2)]),
        pool_obj("c-pool", yielding=[entry(cooldown=90, waiter="team/e-backend-0")]),
    ]
    assert cooldowns(decorate(pools)) == (45, 45)
    assert cooldowns(decorate(pools[2:])) == (90, 90)
    # Only ever shorter than the model's own: a pool's longer yieldAfter keeps the model's cooldown.
    assert cooldowns(decorate(pools, scaling={"cooldownPeriod": "30s"})) == (30, 30)
    assert cooldowns(decorate([pool_obj(yielding=[entry(cooldown=0)])])) == (0, 0)
    # Nothing else of the ScaledObject moves.
    plain, short = scaled_object(decorate(None)), scaled_object(decorate(pools))
    for so in (plain, short):
        so["spec"].pop("cooldownPeriod")
        so["spec"].pop("advanced")
    assert plain == short


def test_the_own_cooldown_is_back_when_the_entry_is_gone() -> None:
    yielding = decorate([pool_obj(yielding=[entry(cooldown=60)])])
    assert cooldowns(yielding) == (60, 60)
    observed = [h.as_observed(scaled_object(yielding))]
    svc = h.llmservice()
    for pools in ([pool_obj(yielding=[])], [pool_obj(waiting=[], yielding=[entry("team/a-backend", 60)])], []):
        request = with_pools(h.decorator_request(svc, attachments=observed), pools)
        back = autoscaling.sync(request, h.config())
        assert cooldowns(back) == (300, 300)
        assert dump(back) == dump(decorate(None))


@pytest.mark.parametrize("status", [
    ["not", "a", "mapping"],
    "yielding",
    {"yielding": {"scaledObject": ME, "cooldownSeconds": 5}},
    {"yielding": "models/qwen-backend"},
    {"yielding": [None, 7, "x", ["models/qwen-backend", 5]]},
    {"yielding": [{"scaledObject": ME, "cooldownSeconds": "5"}, {"scaledObject": ME, "cooldownSeconds": True},
                  {"scaledObject": ME, "cooldownSeconds": -5}, {"scaledObject": ME, "cooldownSeconds": 5.5},
                  {"scaledObject": ME, "cooldownSeconds": None}, {"scaledObject": ME},
                  {"scaledObject": ["models/qwen-backend"], "cooldownSeconds": 5}, {"cooldownSeconds": 5}]},
    {"waiting": "everyone", "yielding": [], "conditions": "Contended"},
])
def test_a_malformed_pool_status_is_ignored(status: Any) -> None:
    plain = decorate(None)
    assert dump(decorate([pool_obj(status=status)])) == dump(plain)
    # ... entry by entry: a good entry beside it still counts.
    good = pool_obj("good", yielding=[entry(cooldown=20)])
    assert cooldowns(decorate([pool_obj(status=status), good])) == (20, 20)
    # The main controller reads the same status without failing either.
    answer = sync.sync(with_pools(h.sync_request(h.llmservice(), pods=[h.pod(WAITER, scheduled=False)]),
                                  [pool_obj(status=status)]), h.config())
    assert _cond(answer, "BackendReady")["reason"] == "Unschedulable"


def test_decorator_resync_is_byte_identical() -> None:
    pools = [pool_obj(yielding=[entry(cooldown=60)])]
    first = decorate(pools)
    observed = [h.as_observed(scaled_object(first))]
    again = autoscaling.sync(with_pools(h.decorator_request(h.llmservice(), attachments=observed), pools), h.config())
    assert dump(again) == dump(first)
    assert dump(decorate(pools)) == dump(first)


# --- priorityClassName --------------------------------------------------------------------------


def _backend_pod_spec(answer: dict) -> dict:
    deployment = next(c for c in answer["children"] if c["kind"] == "Deployment" and c["metadata"]["name"] == "qwen-backend")
    return deployment["spec"]["template"]["spec"]


@pytest.mark.parametrize(("runtime_class", "own", "expected"), [
    (None, None, None),
    ("shared-low", None, "shared-low"),
    ("shared-low", "prod-high", "prod-high"),
    (None, "prod-high", "prod-high"),
])
def test_the_models_priority_class_overrides_the_runtimes(runtime_class: str | None, own: str | None,
                                                          expected: str | None) -> None:
    runtime = h.runtime(scheduling={"priorityClassName": runtime_class} if runtime_class else {})
    svc = h.llmservice(**({"scheduling": {"priorityClassName": own}} if own else {}))
    spec = _backend_pod_spec(sync.sync(h.sync_request(svc, runtimes=[runtime]), h.config()))
    assert spec.get("priorityClassName") == expected
    if own is None:  # an empty scheduling block is the same as none
        empty = _backend_pod_spec(sync.sync(h.sync_request(h.llmservice(scheduling={}), runtimes=[runtime]), h.config()))
        assert empty == spec


def test_an_invalid_priority_class_name_is_refused() -> None:
    answer = sync.sync(h.sync_request(h.llmservice(scheduling={"priorityClassName": "Not_A_Name"})), h.config())
    assert _cond(answer, "Ready")["reason"] == "InvalidSpec"
    assert "priorityClassName" in _cond(answer, "Ready")["message"]


# --- BackendReady: waiting and yielding ---------------------------------------------------------


def _cond(answer: dict, ctype: str) -> dict:
    return next(c for c in answer["status"]["conditions"] if c["type"] == ctype)


def _children(ready: int = 0, replicas: int = 1) -> list[dict]:
    """The observed children of a running model whose backend KEDA set to `replicas` (default: just woken)."""
    first = sync.sync(h.sync_request(h.llmservice()), h.config())

    def observed(c: dict, i: int) -> dict:
        if c["kind"] != "Deployment":
            return h.as_observed(c, i)
        if c["metadata"]["name"] == "qwen-backend":
            return h.as_observed(c, i, replicas=replicas, readyReplicas=ready)
        return h.as_observed(c, i, replicas=1, readyReplicas=1)

    return [observed(c, i) for i, c in enumerate(first["children"])]


def _sync(pools: list[dict] | None, pods: list[dict], status: dict | None = None, **children: int) -> dict:
    request = h.sync_request(h.llmservice(status=status), children=_children(**children), pods=pods)
    return sync.sync(with_pools(request, pools), h.config(h.LATER_TIME))


WAITING = [{"pod": f"{h.NAMESPACE}/{WAITER}", "service": f"{h.NAMESPACE}/qwen", "need": 1}]


def test_a_waiter_with_a_victim_says_who_yields() -> None:
    pools = [pool_obj(waiting=WAITING, yielding=[entry("team/a-backend", waiter=f"{h.NAMESPACE}/{WAITER}")],
                      contended=("Yielding", "yielding: team/a frees 1 on n1 for models/qwen-backend-x"))]
    answer = _sync(pools, [h.pod(WAITER, scheduled=False)])
    backend = _cond(answer, "BackendReady")
    assert (backend["status"], backend["reason"]) == ("False", "WaitingForAccelerator")
    assert backend["message"] == (f"pod {WAITER} is waiting for an accelerator (pool gpus, nvidia.com/gpu): "
                                  "team/a is yielding")
    ready = _cond(answer, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "WaitingForAccelerator")
    assert ready["message"] == f"BackendReady: {backend['message']}"
    # Two victims for a two-unit waiter, from two namespaces, named in order.
    two = [pool_obj(waiting=WAITING, yielding=[entry("zeta/b-backend", waiter=f"{h.NAMESPACE}/{WAITER}"),
                                               entry("team/a-backend", waiter=f"{h.NAMESPACE}/{WAITER}"),
                                               entry("team/x-backend", waiter="team/other-0")])]
    assert _cond(_sync(two, [h.pod(WAITER, scheduled=False)]), "BackendReady")["message"].endswith(
        ": team/a and zeta/b are yielding")


@pytest.mark.parametrize(("reason", "message"), [
    ("NoIdleHolder", "no idle holder: models/qwen-backend-x needs 1 nvidia.com/gpu (holders: team/a (busy), team/b (min 1))"),
    ("Unsatisfiable", "unsatisfiable: models/qwen-backend-x needs 4 nvidia.com/gpu; the largest node it can use offers 2"),
])
def test_a_waiter_nothing_yields_to_says_why(reason: str, message: str) -> None:
    answer = _sync([pool_obj(waiting=WAITING, contended=(reason, message))], [h.pod(WAITER, scheduled=False)])
    backend = _cond(answer, "BackendReady")
    assert backend["reason"] == "WaitingForAccelerator"
    assert backend["message"] == f"pod {WAITER} is waiting for an accelerator (pool gpus, nvidia.com/gpu): {message}"


def test_an_unschedulable_pod_no_pool_lists_stays_unschedulable() -> None:
    pods = [h.pod(WAITER, scheduled=False)]
    listed_elsewhere = [pool_obj(waiting=[{"pod": "team/c-backend-0", "service": "team/c", "need": 1},
                                          {"pod": f"other/{WAITER}", "service": "other/qwen", "need": 1}])]
    for pools in (None, [], listed_elsewhere):
        backend = _cond(_sync(pools, pods), "BackendReady")
        assert backend["reason"] == "Unschedulable"
        assert backend["message"] == f"pod {WAITER} cannot be scheduled: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    # Listed, but the Pod has been bound since (the pool has not caught up): the Pod's own state wins.
    bound = _cond(_sync([pool_obj(waiting=WAITING)], [h.pod(WAITER)]), "BackendReady")
    assert bound["reason"] == "Activating"


def test_a_worse_failure_still_wins_over_waiting() -> None:
    pods = [h.pod(WAITER, scheduled=False), h.pod("qwen-backend-y", waiting="ImagePullBackOff")]
    backend = _cond(_sync([pool_obj(waiting=WAITING)], pods), "BackendReady")
    assert backend["reason"] == "ImagePullFailed"


def test_a_yielding_model_says_to_whom() -> None:
    waiting = [{"pod": "team/c-backend-0", "service": "team/c", "need": 1}]
    pools = [pool_obj("gpus", waiting=waiting, yielding=[entry(ME, waiter="team/c-backend-0", service="models/qwen")]),
             pool_obj("mig", waiting=[], yielding=[entry(ME, waiter="lab/d-backend-0", service="models/qwen")])]
    answer = _sync(pools, [h.pod("qwen-backend-z", ready=True)], ready=1)
    backend = _cond(answer, "BackendReady")
    assert (backend["status"], backend["reason"]) == ("True", "Ready")
    # The waiter's service where the pool lists it, else its Pod; one text per pool, pools by name.
    to = "yielding its accelerator to team/c (pool gpus), lab/d-backend-0 (pool mig)"
    assert backend["message"] == f"1/1 backend replicas ready; {to}"
    assert _cond(answer, "Ready")["status"] == "True"
    # Once scaled in it still says so, while the pool keeps the promise (until the waiter is bound).
    zero = _cond(_sync(pools, [], replicas=0), "BackendReady")
    assert (zero["reason"], zero["message"]) == ("ScaledToZero", f"scaled to zero; the next request activates the backend; {to}")


def test_llmservice_resync_is_byte_identical() -> None:
    pools = [pool_obj(waiting=WAITING, yielding=[entry("team/a-backend", waiter=f"{h.NAMESPACE}/{WAITER}"),
                                                 entry(ME, waiter="team/c-backend-0")],
                      contended=("Yielding", "yielding: team/a frees 1 on n1 for models/qwen-backend-x"))]
    pods = [h.pod(WAITER, scheduled=False)]
    first = _sync(pools, pods)
    second = _sync(pools, pods, status=first["status"])
    third = _sync(pools, pods, status=second["status"])
    assert dump(third) == dump(second)
    assert _cond(second, "BackendReady")["lastTransitionTime"] == _cond(first, "BackendReady")["lastTransitionTime"]


# --- with the pool's own hook -------------------------------------------------------------------


def test_the_pools_decision_reaches_both_models() -> None:
    """A real pool sync over a waiter in `models` and an idle holder in `team`; its status then drives the
    holder's decorator (short cooldown) and the waiter's BackendReady."""
    objs = [tp.node("n1", 1), tp.pod("a", node_name="n1"), tp.scaled("a", "idle", "2026-12-05T07:40:00Z"),
            tp.pod("qwen", waiting=True, ns=h.NAMESPACE), tp.scaled("qwen", "busy", None, ns=h.NAMESPACE)]
    parent = tp.pool_obj()
    status = pool.sync(tp.request(parent, *objs), tp.CONFIG)["status"]
    decided = {**parent, "status": status}
    assert status["yielding"][0]["scaledObject"] == "team/a-backend"

    holder = h.llmservice(name="a")
    holder["metadata"]["namespace"] = "team"
    so = scaled_object(autoscaling.sync(with_pools(h.decorator_request(holder), [decided]), h.config()))
    assert so["metadata"]["namespace"] == "team"
    assert so["spec"]["cooldownPeriod"] == 5  # the pool's yieldAfter

    waiter_pod = next(o for o in objs if o["kind"] == "Pod" and o["metadata"]["namespace"] == h.NAMESPACE)
    request = h.sync_request(h.llmservice(), children=_children(), pods=[waiter_pod])
    answer = sync.sync(with_pools(request, [decided]), h.config())
    assert _cond(answer, "BackendReady")["message"] == (
        "pod qwen-backend-0 is waiting for an accelerator (pool gpus, nvidia.com/gpu): team/a is yielding")
    holder_status = sync.sync(with_pools(h.sync_request(holder), [decided]), h.config())
    assert _cond(holder_status, "BackendReady")["message"].endswith(
        f"; yielding its accelerator to {h.NAMESPACE}/qwen (pool gpus)")


def test_a_yielding_member_is_polled_once_per_pool_cooldown() -> None:
    """A member left at the default polling is polled every 300 s (issue 29); KEDA scales in only at a
    poll, so while a pool lists it as yielding its interval follows the pool's cooldown down."""
    member = {"endpoint": {"gateway": "chat"}}
    assert scaled_object(decorate(**member))["spec"]["pollingInterval"] == 300
    yielding = scaled_object(decorate([pool_obj(yielding=[entry(cooldown=60)])], **member))["spec"]
    assert (yielding["cooldownPeriod"], yielding["pollingInterval"]) == (60, 60)


# --- ghosts: a replica nobody waits for (issue 31) -------------------------------------------------


def _with_status(svc: dict, backend: tuple[str, str]) -> dict:
    svc = copy.deepcopy(svc)
    svc["status"] = {"conditions": [{"type": "BackendReady", "status": backend[0], "reason": backend[1], "message": "",
                                     "lastTransitionTime": h.FIXED_TIME}]}
    return svc


def _keda_says(so: dict, active: tuple[str, str]) -> dict:
    so = h.as_observed(so)
    so["status"] = {"conditions": [{"type": "Ready", "status": "True", "reason": "ScaledObjectReady"},
                                   {"type": "Active", "status": active[0], "reason": active[1]}]}
    return so


@pytest.mark.parametrize(("backend", "active", "ghost"), [
    (("False", "Unschedulable"), ("False", "ScalerCooldown"), True),  # the 504 came, the Pod still Pending
    (("False", "WaitingForAccelerator"), ("False", "ScalerCooldown"), True),
    (("False", "Unschedulable"), ("True", "ScalerActive"), False),  # its request is still held
    (("False", "Activating"), ("False", "ScalerCooldown"), False),  # scheduled and loading: not a Pending replica
    (("True", "Ready"), ("False", "ScalerCooldown"), False),  # idle but served: the pool's business, not a ghost
])
def test_a_ghost_replica_gets_a_short_cooldown_and_nothing_else_does(backend: tuple[str, str], active: tuple[str, str],
                                                                     ghost: bool) -> None:
    plain = decorate(None)
    observed = [_keda_says(scaled_object(plain), active)]
    svc = _with_status(h.llmservice(), backend)
    answer = autoscaling.sync(h.decorator_request(svc, attachments=observed), h.config())
    expected = autoscaling.GHOST_COOLDOWN_SECONDS if ghost else 300
    assert cooldowns(answer) == (expected, expected)
    # The same answer on every resync; and yieldPolicy Never does not keep a ghost (it holds nothing).
    assert dump(autoscaling.sync(h.decorator_request(svc, attachments=observed), h.config())) == dump(answer)
    never = _with_status(h.llmservice(scaling={"yieldPolicy": "Never"}), backend)
    assert cooldowns(autoscaling.sync(h.decorator_request(never, attachments=observed), h.config()))[0] == expected


def test_a_yield_is_recorded_on_the_victim_until_its_next_activation() -> None:
    waiting = [{"pod": "team/c-backend-0", "service": "team/c", "need": 1}]
    listed = {**entry(ME, waiter="team/c-backend-0", service="models/qwen"), "listedAt": "2026-12-05T08:00:00Z"}
    pools = [pool_obj("gpus", waiting=waiting, yielding=[listed])]
    record = {"pool": "gpus", "to": "team/c", "pod": "team/c-backend-0", "node": "n1", "listedAt": "2026-12-05T08:00:00Z"}
    yielding = _sync(pools, [h.pod("qwen-backend-z", ready=True)], ready=1)
    assert yielding["status"]["lastYield"] == record
    # Scaled in; the waiter bound, so the pool's entry is gone: the record stays while the model is at zero.
    after = _sync([pool_obj("gpus")], [], status=yielding["status"], replicas=0)
    assert after["status"]["lastYield"] == record
    again = _sync([pool_obj("gpus")], [], status=after["status"], replicas=0)
    assert dump(again) == dump(after)
    # Next activation (KEDA asks for a replica): a new story begins.
    woken = _sync([pool_obj("gpus")], [h.pod("qwen-backend-y", scheduled=False)], status=after["status"], replicas=1)
    assert "lastYield" not in woken["status"]
    # A model no pool ever listed has no record.
    assert "lastYield" not in _sync([pool_obj("gpus")], [], replicas=0)["status"]
