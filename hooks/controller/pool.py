"""The passive AcceleratorPool controller: which idle model gives its accelerators to which waiter.

Inputs (related objects, all namespaces): backend Pods, Noctaya's ScaledObjects with KEDA's record
of each model (Active, lastActiveTime), every Node, every AcceleratorPool; and this pool's own
previous status, the only memory it has. Output: `status` — waiters, yields (promises) and
conditions. No children: the yield is rendered by the LLMService autoscaling decorator, which
shortens the victim's cooldownPeriod while it is listed here, and KEDA — asking the model's gateway
whether it is idle right before it scales in — stays the only writer of replicas.

The decision compares no clock: "idle long enough" is KEDA's comparison of its own lastActiveTime
with the short cooldown. The answer for an unchanged world is the same bytes, so the status is
written only when the decision changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import ValidationError

from hooks.api.common import API_VERSION, duration_seconds
from hooks.api.pool import DEFAULT_YIELD_AFTER, AcceleratorPool
from hooks.config import HookConfig, resolve
from hooks.controller import observe as obs
from hooks.controller import status as st
from hooks.controller.pool_decide import Decision, Promise, decide
from hooks.controller.pool_facts import Model, Node, Pod, key, read_model, read_node, read_pod, units
from hooks.errors import describe_validation_error
from hooks.resources import labels

POOL = f"AcceleratorPool.{API_VERSION}"
# How soon a pool looks again without an event. Events (Pods, ScaledObjects, Nodes, pools) drive it;
# these only cover a missed or coalesced update. While it acts (a promise stands, room is free for a
# waiter, or a Pending Pod has no verdict from the scheduler yet) a miss costs a cold request its
# deadline: look again soon. A Pod it cannot help (no idle holder, unsatisfiable, stuck on affinity)
# changes only with an event it would see anyway: look again rarely.
PENDING_RESYNC_SECONDS = 2.0
HELPLESS_RESYNC_SECONDS = 30.0
NODE = "Node.v1"


class PoolReason(StrEnum):
    ACCEPTED = "Accepted"
    INVALID_SPEC = "InvalidSpec"
    OVERLAPPING = "Overlapping"
    NO_NODES = "NoNodes"
    NO_WAITERS = "NoWaiters"
    YIELDING = "Yielding"
    SCHEDULING = "Scheduling"  # room is free (or promised and freed): the scheduler has yet to bind
    NO_IDLE_HOLDER = "NoIdleHolder"
    UNSATISFIABLE = "Unsatisfiable"
    YIELD_STALLED = "YieldStalled"  # a victim idle by KEDA's record was not scaled in when due: is KEDA running?


ACCEPTED, CONTENDED = "Accepted", "Contended"
_EVERYTHING: dict[str, Any] = {}  # an empty selector: Metacontroller lists every object of the type


def customize(request: dict[str, Any], config: HookConfig | None = None) -> dict[str, Any]:
    """Every backend Pod, Noctaya ScaledObject, Node and pool, cluster-wide (a cluster-scoped parent's
    rules list all namespaces). Nodes and pools are few; the pool filters them itself, so one rule
    serves every pool and a node relabelled into or out of a pool is seen."""
    obs.require_object(request, "parent")
    return {"relatedResources": [
        {"apiVersion": "v1", "resource": "pods", "labelSelector": {"matchLabels": {labels.COMPONENT: labels.BACKEND}}},
        {"apiVersion": "keda.sh/v1alpha1", "resource": "scaledobjects",
         "labelSelector": {"matchLabels": {labels.MANAGED_BY: labels.MANAGER, labels.COMPONENT: labels.BACKEND}}},
        {"apiVersion": "v1", "resource": "nodes", "labelSelector": _EVERYTHING},
        {"apiVersion": API_VERSION, "resource": "acceleratorpools", "labelSelector": _EVERYTHING},
    ]}


def _sorted_related(observed: obs.Observed, group: str) -> list[dict[str, Any]]:
    return sorted(observed.related_objects(group), key=key)


@dataclass(frozen=True)
class PoolView:
    """One pool as every pool sees it: its resource and the nodes it covers."""

    name: str
    resource: str
    created: str
    selector: dict[str, str]
    nodes: tuple[Node, ...]
    promises: tuple[Promise, ...] = ()  # what its status promised last
    stalled: tuple[tuple[str, str], ...] = ()  # its status.stalled: (ScaledObject, lastActiveTime)
    yield_after: float = 0.0

    def can_serve(self, pod: Pod) -> bool:
        return any(pod.can_use(n) for n in self.nodes)

    def owns_before(self, other: PoolView) -> bool:
        return (self.created, self.name) < (other.created, other.name)


def _pool_view(obj: dict[str, Any], node_objs: list[dict[str, Any]]) -> PoolView | None:
    meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
    resource, selector = spec.get("resourceName"), spec.get("nodeSelector") or {}
    if not isinstance(resource, str) or not isinstance(selector, dict):
        return None
    nodes = []
    for raw in node_objs:
        node = read_node(raw, resource)
        if node is not None and node.units > 0 and all(node.labels.get(k) == v for k, v in selector.items()):
            nodes.append(node)
    try:
        yield_after = duration_seconds(spec.get("yieldAfter") or DEFAULT_YIELD_AFTER)
    except (TypeError, ValueError):
        yield_after = 0.0
    return PoolView(name=str(meta.get("name", "")), resource=resource, created=str(meta.get("creationTimestamp", "")),
                    selector=selector, nodes=tuple(nodes), promises=tuple(_previous_promises(obj.get("status"))),
                    stalled=tuple(sorted(_previous_stalled(obj.get("status")).items())), yield_after=yield_after)


def _overlap(me: PoolView, others: Iterable[PoolView]) -> tuple[PoolView, str] | None:
    """The older pool of the same resource that shares a node with this one, and that node."""
    mine = {n.name for n in me.nodes}
    for other in sorted(others, key=lambda p: (p.created, p.name)):
        if other.name == me.name or other.resource != me.resource or not other.owns_before(me):
            continue
        shared = sorted(mine & {n.name for n in other.nodes})
        if shared:
            return other, shared[0]
    return None


def wire_promise(promise: Promise, cooldown: int) -> dict[str, Any]:
    return {"scaledObject": promise.scaled_object, "service": promise.service, "for": promise.waiter,
            "node": promise.node, "units": promise.units, "cooldownSeconds": cooldown, "listedAt": promise.listed_at}


def _previous_stalled(status: Any) -> dict[str, str]:
    entries = status.get("stalled") if isinstance(status, dict) else None
    out = {}
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict) and isinstance(entry.get("scaledObject"), str) and isinstance(entry.get("lastActiveTime"), str):
            out[entry["scaledObject"]] = entry["lastActiveTime"]
    return out


def _previous_promises(status: Any) -> list[Promise]:
    entries = status.get("yielding") if isinstance(status, dict) else None
    out = []
    for y in entries if isinstance(entries, list) else []:
        if not isinstance(y, dict):
            continue
        fields = (y.get("scaledObject"), y.get("service"), y.get("for"), y.get("node"))
        if all(isinstance(f, str) and f for f in fields) and units(y.get("units")) > 0:
            listed = y.get("listedAt") if isinstance(y.get("listedAt"), str) else ""
            out.append(Promise(*fields, units=units(y.get("units")), listed_at=listed))  # type: ignore[arg-type]
    return out


def _contended(decision: Decision, resource: str) -> st.Cond:
    if not decision.waiting:
        return st.Cond(CONTENDED, "False", PoolReason.NO_WAITERS, f"no backend Pod waits for {resource}")
    parts = []
    if decision.promises:
        parts.append("yielding: " + ", ".join(
            f"{p.service} frees {p.units} on {p.node} for {p.waiter}" for p in decision.promises))
    if decision.unsatisfiable:
        parts.append("unsatisfiable: " + "; ".join(decision.unsatisfiable))
    if decision.no_holder:
        held = ", ".join(decision.held_back) or "none on a node they can use"
        parts.append("no idle holder: " + "; ".join(decision.no_holder) + f" (holders: {held})")
    if decision.scheduling:
        parts.append("room is free, waiting for the scheduler: " + ", ".join(decision.scheduling))
    if decision.stalled:
        parts.append("not scaled in by KEDA when due (is KEDA's operator running?): " + ", ".join(sorted(decision.stalled)))
    reason = (PoolReason.YIELD_STALLED if decision.stalled else PoolReason.YIELDING if decision.promises else PoolReason.UNSATISFIABLE if decision.unsatisfiable
              else PoolReason.NO_IDLE_HOLDER if decision.no_holder else PoolReason.SCHEDULING)
    return st.Cond(CONTENDED, "True", reason, st.short("; ".join(parts)))


def sync(request: dict[str, Any], config: HookConfig | None = None) -> dict[str, Any]:
    parent = obs.require_object(request, "parent")
    cfg = resolve(config)
    observed = obs.observe(request)
    meta = parent.get("metadata") or {}
    generation = meta.get("generation") if isinstance(meta.get("generation"), int) else None
    previous_status = parent.get("status")
    status: dict[str, Any] = {} if generation is None else {"observedGeneration": generation}

    def answer(conds: list[st.Cond], resync: float = 0.0) -> dict[str, Any]:
        status["conditions"] = st.wire_conditions(conds, previous_status, generation, cfg.clock)
        return {"status": status, "children": [], "resyncAfterSeconds": resync,
                "finalized": bool(request.get("finalizing"))}

    try:
        spec = AcceleratorPool.model_validate({k: v for k, v in parent.items() if k != "status"}).spec
    except ValidationError as exc:
        # Nothing is promised, so no model is made to yield on a spec nobody can read.
        return answer([st.Cond(ACCEPTED, "False", PoolReason.INVALID_SPEC, st.short(describe_validation_error(exc)))])
    node_objs = _sorted_related(observed, NODE)
    me = _pool_view(parent, node_objs)
    assert me is not None  # validated above
    status["capacity"] = {"nodes": len(me.nodes), "units": sum(n.units for n in me.nodes)}
    if not me.nodes:
        where = f" matching nodeSelector {me.selector}" if me.selector else ""
        return answer([st.Cond(ACCEPTED, "False", PoolReason.NO_NODES,
                               f"no node{where} offers {spec.resource_name}: check the resource name and that the "
                               "device plugin runs on the pool's nodes")])
    others = [v for v in (_pool_view(o, node_objs) for o in _sorted_related(observed, POOL)) if v is not None]
    others = [o for o in others if o.name != me.name]
    clash = _overlap(me, others)
    if clash is not None:
        other, node = clash
        return answer([st.Cond(ACCEPTED, "False", PoolReason.OVERLAPPING,
                               f"pool {other.name} also shares {spec.resource_name} on node {node} (and was created "
                               "first); this pool decides nothing until their nodes are disjoint")])
    pods = [p for p in (read_pod(o, spec.resource_name) for o in _sorted_related(observed, obs.POD)) if p is not None]
    models = [m for m in (read_model(o) for o in _sorted_related(observed, obs.SCALED_OBJECT)) if m is not None]
    peers = [o for o in others if o.resource == me.resource and _overlap(o, [me, *others]) is None]
    now = cfg.clock()
    handles = assign_waiters(me, peers, pods, models, now)
    cooldown = int(duration_seconds(spec.yield_after))
    decision = decide(me.resource, me.nodes, handles, pods, models, list(me.promises), now=now,
                      yield_after=cooldown, stalled=dict(me.stalled))
    status["waiting"] = [{"pod": w.key, "service": w.service, "need": w.units} for w in decision.waiting]
    status["yielding"] = [wire_promise(p, cooldown) for p in sorted(decision.promises, key=lambda p: (p.waiter, p.scaled_object))]
    if decision.stalled:  # only while one stands: a pool that never stalled writes no such field
        status["stalled"] = [{"scaledObject": so, "lastActiveTime": last} for so, last in sorted(decision.stalled.items())]
    return answer([st.Cond(ACCEPTED, "True", PoolReason.ACCEPTED,
                           f"{len(me.nodes)} node(s) offer {status['capacity']['units']} {spec.resource_name}"),
                   _contended(decision, spec.resource_name)], resync_after(decision, pods, handles))


def assign_waiters(me: PoolView, peers: list[PoolView], pods: list[Pod], models: list[Model], now: str = "") -> set[str]:
    """The Pending Pods this pool answers for, when several pools of one resource (node groups) could.

    Every pool runs the same cascade over the pools in name order, so all agree without talking: each
    pool in turn decides for the Pods it can place that no earlier pool helps; a Pod it helps (a
    promise, or room already free) is its own. A Pod nobody helps belongs to the first pool that
    could place it (which says why not), or, when none can, to the first pool by name (which says
    it is unsatisfiable). Pools that help nobody cost nothing: their decision takes no room or victim.
    """
    if not peers:
        return {p.key for p in pods}
    everyone = sorted([me, *peers], key=lambda v: v.name)
    open_keys = {p.key for p in pods if not p.node and not p.deleting}
    owner: dict[str, str] = {}
    for view in everyone:
        candidates = {p.key for p in pods if p.key in open_keys and view.can_serve(p)}
        decision = decide(view.resource, view.nodes, candidates, pods, models, list(view.promises), now=now,
                          yield_after=view.yield_after, stalled=dict(view.stalled))
        for helped in {pr.waiter for pr in decision.promises} | set(decision.scheduling):
            owner.setdefault(helped, view.name)
            open_keys.discard(helped)
    for p in pods:
        if p.key not in owner:
            owner[p.key] = next((v.name for v in everyone if v.can_serve(p)), everyone[0].name)
    return {key for key, name in owner.items() if name == me.name}


def resync_after(decision: Decision, pods: list[Pod], handles: set[str]) -> float:
    """PENDING_RESYNC_SECONDS while the pool acts, HELPLESS_RESYNC_SECONDS while Pods wait that it
    cannot help, 0 (events only) when nothing waits."""
    pending = [p for p in pods if not p.node and not p.deleting and p.units > 0 and p.key in handles]
    if decision.promises or decision.scheduling or any(not p.refused for p in pending):
        return PENDING_RESYNC_SECONDS
    return HELPLESS_RESYNC_SECONDS if pending else 0.0
