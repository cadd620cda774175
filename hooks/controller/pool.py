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
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pydantic import ValidationError

from hooks.api.common import API_VERSION, duration_seconds
from hooks.api.pool import AcceleratorPool
from hooks.config import HookConfig, resolve
from hooks.controller import observe as obs
from hooks.controller import status as st
from hooks.controller.pool_facts import Model, Node, Pod, key, read_model, read_node, read_pod, units
from hooks.errors import describe_validation_error
from hooks.resources import labels

POOL = f"AcceleratorPool.{API_VERSION}"
PENDING_RESYNC_SECONDS = 2.0
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
    return PoolView(name=str(meta.get("name", "")), resource=resource, created=str(meta.get("creationTimestamp", "")),
                    selector=selector, nodes=tuple(nodes))


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


@dataclass(frozen=True)
class Promise:
    scaled_object: str
    service: str
    waiter: str
    node: str
    units: int

    def wire(self, cooldown: int) -> dict[str, Any]:
        return {"scaledObject": self.scaled_object, "service": self.service, "for": self.waiter, "node": self.node,
                "units": self.units, "cooldownSeconds": cooldown}


def _previous_promises(status: Any) -> list[Promise]:
    entries = status.get("yielding") if isinstance(status, dict) else None
    out = []
    for y in entries if isinstance(entries, list) else []:
        if not isinstance(y, dict):
            continue
        fields = (y.get("scaledObject"), y.get("service"), y.get("for"), y.get("node"))
        if all(isinstance(f, str) and f for f in fields) and units(y.get("units")) > 0:
            out.append(Promise(*fields, units=units(y.get("units"))))  # type: ignore[arg-type]
    return out


@dataclass
class Decision:
    waiting: list[Pod] = field(default_factory=list)
    promises: list[Promise] = field(default_factory=list)
    scheduling: list[str] = field(default_factory=list)  # waiters with room already free
    no_holder: list[str] = field(default_factory=list)
    unsatisfiable: list[str] = field(default_factory=list)
    held_back: list[str] = field(default_factory=list)  # busy or pinned holders, for the message


def _held_by(pods: list[Pod], service: str, node: str) -> int:
    return sum(p.units for p in pods if p.service == service and p.node == node)


def decide(pool: PoolView, handles: set[str], pods: list[Pod], models: list[Model], previous: list[Promise]) -> Decision:
    """The pure decision. `handles` are the waiters (Pod keys) this pool answers for."""
    nodes = {n.name: n for n in pool.nodes}
    ready_services = {p.service for p in pods if p.ready and not p.deleting}
    by_service = {m.service: m for m in models}
    # A Pod left Pending after its cold request ended (504, client gone) waits for nobody: KEDA keeps its
    # replica only for the cooldown. Yielding to it would take an accelerator from a model for no one.
    pending = {p.key: p for p in pods if not p.node and not p.deleting
               and (p.service not in by_service or by_service[p.service].wants_replica)}
    waiters = sorted((p for p in pending.values() if p.key in handles and p.short_of_resource and p.units > 0
                      and p.service not in ready_services), key=lambda p: (p.created, p.key))
    by_so = {m.scaled_object: m for m in models}
    decision = Decision(waiting=waiters)
    # A promise stands while its waiter is still unbound (and wanted). A victim that turned busy again
    # keeps its promise only if no other idle holder can take over (decided below): moving the yield
    # serves the waiter sooner, and keeping it otherwise spares the victim's ScaledObject a rewrite on
    # every request (KEDA never scales in an active model; the short cooldown counts from its last one).
    standing = [pr for pr in previous if pr.waiter in pending and pr.node in nodes]
    turned_busy = [pr for pr in standing if by_so.get(pr.scaled_object) is not None and by_so[pr.scaled_object].active]
    kept = [pr for pr in standing if pr not in turned_busy]
    used = {pr.scaled_object for pr in kept}
    bound = [p for p in pods if p.node in nodes]
    # What each node will have free once the promised victims are gone (only Noctaya's Pods are seen).
    room = {name: n.units - sum(p.units for p in bound if p.node == name) for name, n in nodes.items()}
    for pr in kept:
        room[pr.node] += _held_by(bound, pr.service, pr.node)
    holders_on: dict[str, list[tuple[Model, int]]] = {name: [] for name in nodes}
    for m in sorted(models, key=lambda m: (m.last_active, m.scaled_object)):
        for name in nodes:
            held = _held_by(bound, m.service, name)
            if held <= 0:
                continue
            if m.idle and not m.pinned and m.scaled_object not in used:
                holders_on[name].append((m, held))
            elif not m.idle or m.pinned:
                text = f"{m.service} ({m.pinned or ('busy' if m.active else 'not idle by KEDA')})"
                if text not in decision.held_back:
                    decision.held_back.append(text)
    decision.promises.extend(kept)
    for w in waiters:
        mine = [pr for pr in kept if pr.waiter == w.key]
        usable = [nodes[pr.node] for pr in mine[:1]] or [n for n in pool.nodes if w.can_use(n)]
        best: tuple[tuple[str, str], str, list[tuple[Model, int]]] | None = None
        for node in usable:
            if room[node.name] >= w.units:
                best = (("", node.name), node.name, [])
                break
            chosen, got = [], room[node.name]
            for m, held in holders_on[node.name]:
                if got >= w.units:
                    break
                if m.scaled_object in used:
                    continue
                chosen.append((m, held))
                got += held
            if got >= w.units:
                rank = (chosen[-1][0].last_active, node.name)  # the node whose newest victim is least recent
                if best is None or rank < best[0]:
                    best = (rank, node.name, chosen)
        if best is None:
            largest = max((n.units for n in usable), default=0)
            again = [pr for pr in turned_busy if pr.waiter == w.key and pr.scaled_object not in used]
            if largest >= w.units and again:  # nobody else can take over: the busy victim still yields
                decision.promises.extend(again)
                used.update(pr.scaled_object for pr in again)
                for pr in again:
                    room[pr.node] += _held_by(bound, pr.service, pr.node)
                room[again[0].node] -= w.units
                continue
            (decision.unsatisfiable if largest < w.units else decision.no_holder).append(
                f"{w.key} needs {w.units} {pool.resource}" + (f"; the largest node it can use offers {largest}"
                                                              if largest < w.units else ""))
            continue
        _, node_name, chosen = best
        room[node_name] -= w.units  # these units are spoken for, whoever frees them
        if not chosen and not mine:  # free already, not by a promise of this pool's
            decision.scheduling.append(w.key)
        for m, held in chosen:
            used.add(m.scaled_object)
            room[node_name] += held
            decision.promises.append(Promise(m.scaled_object, m.service, w.key, node_name, held))
    return decision


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
    reason = (PoolReason.YIELDING if decision.promises else PoolReason.UNSATISFIABLE if decision.unsatisfiable
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
    # A waiter that several pools of this resource could serve is answered by the first by name.
    peers = [o for o in others if o.resource == me.resource and _overlap(o, [me, *others]) is None]
    handles = {p.key for p in pods
               if not any(o.name < me.name and any(p.can_use(n) for n in o.nodes) for o in peers)}
    decision = decide(me, handles, pods, models, _previous_promises(previous_status))
    cooldown = int(duration_seconds(spec.yield_after))
    status["waiting"] = [{"pod": w.key, "service": w.service, "need": w.units} for w in decision.waiting]
    status["yielding"] = [p.wire(cooldown) for p in sorted(decision.promises, key=lambda p: (p.waiter, p.scaled_object))]
    # Events drive the pool, but a backend Pod still Pending here is exactly when a missed or coalesced
    # Pod update would cost a cold request its deadline: look again soon until none is left. Quiet
    # pools resync only on events (and the controller's resyncPeriodSeconds).
    pending = any(not p.node and not p.deleting and p.units > 0 and p.key in handles for p in pods)
    return answer([st.Cond(ACCEPTED, "True", PoolReason.ACCEPTED,
                           f"{len(me.nodes)} node(s) offer {status['capacity']['units']} {spec.resource_name}"),
                   _contended(decision, spec.resource_name)], PENDING_RESYNC_SECONDS if pending else 0.0)
