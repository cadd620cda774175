"""The AcceleratorPool's decision as small named rules, applied in order (as kube-scheduler applies
its filter and score plugins): which Pods wait, which earlier promises still stand, which models
may hold accelerators for others, and where each waiter is placed. Each rule reads plain facts and
is testable alone; `decide` only runs them in order.

Order matters and is the policy:

1. **wanted** — a Pending backend Pod counts only while someone wants its replica (KEDA Active, or a
   floor): a Pod left after its cold request ended waits for nobody.
2. **waiters** — of those, the ones this pool answers for, short of its resource, whose model serves
   nowhere yet; oldest first.
3. **promise rules** — each earlier promise is kept, kept only as a fallback (its victim turned
   busy), or dropped with a reason: its waiter is gone, its node left the pool, its victim is not
   idle by KEDA's own record (paused, scaler broken), or its victim already let go and a younger
   waiter took the room.
4. **holders** — per node, the models that may yield: idle by KEDA, not pinned, not promised yet;
   least recently used first, and among those the ones whose whole holding is on this node first (a
   model with replicas elsewhere gives all of them up to free one node).
5. **placement** — per waiter, oldest first: room already free; else the node whose victims cost
   the fewest accelerators beyond the need, then whose newest victim is least recent.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from enum import StrEnum
from functools import cached_property

from hooks.config import parse_rfc3339
from hooks.controller.pool_facts import Model, Node, Pod

# How long past the moment a victim became due (listed, idle for yieldAfter) KEDA may take to scale it
# in before the pool stops waiting on it: a KEDA poll (30 s by default) plus the scale-in, with room.
# A victim's Pods that are terminating are progress (the preStop drain), never a stall.
STALL_GRACE_SECONDS = 60.0


@dataclass(frozen=True)
class Promise:
    scaled_object: str
    service: str
    waiter: str
    node: str
    units: int
    listed_at: str = ""  # RFC 3339: when the pool first made this promise ("" from an older release)


@dataclass
class Decision:
    waiting: list[Pod] = field(default_factory=list)
    promises: list[Promise] = field(default_factory=list)
    scheduling: list[str] = field(default_factory=list)  # waiters with room already free
    no_holder: list[str] = field(default_factory=list)
    unsatisfiable: list[str] = field(default_factory=list)
    held_back: list[str] = field(default_factory=list)  # busy, pinned or stuck holders, for the message
    stalled: dict[str, str] = field(default_factory=dict)  # ScaledObject -> its lastActiveTime when it stalled


@dataclass(frozen=True)
class Facts:
    """What one decision reads, computed once from the observed objects."""

    resource: str
    nodes: dict[str, Node]  # this pool's nodes by name, in the pool's order
    pods: list[Pod]
    models: dict[str, Model]  # by ScaledObject key
    pending: dict[str, Pod]  # unbound backend Pods someone still wants, by key
    bound: list[Pod]  # Pods on this pool's nodes
    now: str = ""  # the hook's clock, RFC 3339: new promises are stamped with it, stalls measured by it
    yield_after: float = 0.0
    stalled: dict[str, str] = field(default_factory=dict)  # earlier stalls still true (see read_facts)

    @cached_property
    def _units(self) -> tuple[Counter[tuple[str, str]], Counter[str], Counter[str], dict[str, list[str]]]:
        """Units bound per (model, node), per model and per node, and each model's nodes, summed once:
        the rules ask these for every holder, node and promise (a large cluster has thousands of Pods)."""
        per_pair: Counter[tuple[str, str]] = Counter()
        per_service: Counter[str] = Counter()
        per_node: Counter[str] = Counter()
        for p in self.bound:
            per_pair[(p.service, p.node)] += p.units
            per_service[p.service] += p.units
            per_node[p.node] += p.units
        nodes_of: dict[str, list[str]] = {}
        for service, node in per_pair:
            nodes_of.setdefault(service, []).append(node)
        return per_pair, per_service, per_node, nodes_of

    def held_by(self, service: str, node: str) -> int:
        return self._units[0][(service, node)]

    def letting_go(self, service: str, node: str) -> bool:
        """Every Pod the model has on the node is terminating: KEDA did its part."""
        return all(p.deleting for p in self.bound if p.service == service and p.node == node)

    def holding(self, service: str) -> int:
        """Everything a model holds on this pool's nodes: what it gives up when it yields (KEDA
        scales a model to zero, every replica at once)."""
        return self._units[1][service]

    def free(self, node: str) -> int:
        return self.nodes[node].units - self._units[2][node]

    def nodes_held_by(self, service: str) -> list[str]:
        """This pool's nodes where the model has Pods bound (any units), in the order first seen."""
        return self._units[3].get(service, [])


def read_facts(resource: str, nodes: tuple[Node, ...], pods: list[Pod], models: list[Model], *, now: str = "",
               yield_after: float = 0.0, stalled: dict[str, str] | None = None) -> Facts:
    """`stalled`: the pool's earlier record of victims KEDA did not scale in; an entry stands while
    the model still holds accelerators here and KEDA's lastActiveTime for it is unchanged (a new one
    means KEDA is working on it again)."""
    by_service = {m.service: m for m in models}
    by_so = {m.scaled_object: m for m in models}
    bound = [p for p in pods if p.node and p.node in {n.name for n in nodes}]
    holding = {p.service for p in bound}
    return Facts(
        resource=resource, nodes={n.name: n for n in nodes}, pods=pods, models=by_so,
        pending={p.key: p for p in pods if wanted(p, by_service.get(p.service))}, bound=bound,
        now=now, yield_after=yield_after,
        stalled={so: last for so, last in sorted((stalled or {}).items())
                 if so in by_so and by_so[so].last_active == last and by_so[so].service in holding},
    )


# --- 1 and 2: who waits ---------------------------------------------------------------------------


def wanted(pod: Pod, model: Model | None) -> bool:
    """An unbound Pod someone wants. A Pod left Pending after its cold request ended (504, client
    gone) waits for nobody: KEDA keeps its replica only for the cooldown, and yielding to it would
    take an accelerator from a model for no one."""
    return not pod.node and not pod.deleting and (model is None or model.wants_replica)


def waiters(facts: Facts, handles: set[str]) -> list[Pod]:
    serving = {p.service for p in facts.pods if p.ready and not p.deleting}
    return sorted((p for p in facts.pending.values() if p.key in handles and p.short_of_resource and p.units > 0
                   and p.service not in serving), key=lambda p: (p.created, p.key))


# --- 3: which promises stand ----------------------------------------------------------------------


class Verdict(StrEnum):
    KEEP = "keep"
    FALLBACK = "fallback"  # its victim turned busy: kept only if no other holder can take over
    DROP = "drop"
    STALLED = "stalled"  # dropped, and its victim is no holder until KEDA moves it (see yield_stalled)


PromiseRule = Callable[[Promise, Facts], tuple[Verdict, str] | None]


def waiter_gone(promise: Promise, facts: Facts) -> tuple[Verdict, str] | None:
    if promise.waiter not in facts.pending:
        return Verdict.DROP, ""  # bound, deleted or no longer wanted: the promise did its work or has none
    return None


def node_left(promise: Promise, facts: Facts) -> tuple[Verdict, str] | None:
    if promise.node not in facts.nodes:
        return Verdict.DROP, f"{promise.node} left the pool"
    return None


def victim_let_go_and_room_taken(promise: Promise, facts: Facts) -> tuple[Verdict, str] | None:
    """The victim's units are gone from the node, but the node has no room for the waiter: another
    Pod took it (the scheduler bound a younger waiter there). The promise is spent; re-plan."""
    waiter = facts.pending[promise.waiter]
    if facts.held_by(promise.service, promise.node) == 0 and facts.free(promise.node) < waiter.units:
        return Verdict.DROP, f"the room {promise.service} freed on {promise.node} was taken by another Pod"
    return None


def victim_not_idle_by_keda(promise: Promise, facts: Facts) -> tuple[Verdict, str] | None:
    """KEDA scales in only a model it sees idle. A victim whose own record says it will not (paused,
    its scaler broken, its ScaledObject gone) never lets go, so waiting on it starves the waiter; one
    that turned busy may still be the only one that can (kept as a fallback). A victim KEDA has just
    scaled in (Active=False/ScalerNotActive, Ready) is letting go: its promise stands."""
    if facts.held_by(promise.service, promise.node) == 0:
        return None  # already let go: nothing left for KEDA to do
    model = facts.models.get(promise.scaled_object)
    if model is None:
        return Verdict.DROP, f"{promise.service} has no ScaledObject any more"
    if model.stuck:
        return Verdict.DROP, f"{promise.service} will not be scaled in by KEDA ({model.stuck})"
    if model.active:
        return Verdict.FALLBACK, ""
    return None


def yield_stalled(promise: Promise, facts: Facts) -> tuple[Verdict, str] | None:
    """A victim idle by KEDA's record that is still not scaled in well after it became due (listed
    and idle for yieldAfter): KEDA is not acting (down, or not reconciling it). Nothing in KEDA's
    record shows that, so the pool's clock bounds the wait; the waiter is placed again."""
    model = facts.models.get(promise.scaled_object)
    if model is None or facts.held_by(promise.service, promise.node) == 0 or facts.letting_go(promise.service, promise.node):
        return None
    now, listed, last = parse_rfc3339(facts.now), parse_rfc3339(promise.listed_at), parse_rfc3339(model.last_active)
    if now is None or last is None:
        return None
    due = max(listed or last, last + timedelta(seconds=facts.yield_after))
    if now <= due + timedelta(seconds=STALL_GRACE_SECONDS):
        return None
    return Verdict.STALLED, (f"{promise.service} was due to scale in at {due:%Y-%m-%dT%H:%M:%SZ} and KEDA has not "
                             "scaled it in (is KEDA's operator running?)")


PROMISE_RULES: tuple[PromiseRule, ...] = (
    waiter_gone, node_left, victim_let_go_and_room_taken, victim_not_idle_by_keda, yield_stalled)


def judge(promise: Promise, facts: Facts, rules: tuple[PromiseRule, ...] = PROMISE_RULES) -> tuple[Verdict, str]:
    for rule in rules:
        verdict = rule(promise, facts)
        if verdict is not None:
            return verdict
    return Verdict.KEEP, ""


# --- 4: who may hold for others -------------------------------------------------------------------


def may_yield(model: Model, stalled: dict[str, str]) -> bool:
    return model.idle and not model.pinned and not model.stuck and model.scaled_object not in stalled


def held_back(model: Model, stalled: dict[str, str]) -> str:
    """Why a holder does not yield, for the message."""
    if model.pinned:
        return model.pinned
    if model.stuck:
        return model.stuck
    if model.scaled_object in stalled:
        return "not scaled in by KEDA when due"
    return "busy" if model.active else "not idle by KEDA"


def holders(facts: Facts, used: set[str]) -> tuple[dict[str, list[tuple[Model, int]]], list[str]]:
    """Per node, (model, units it holds there) of every model that may yield, in the order they
    should; and why each other holder does not."""
    on: dict[str, list[tuple[Model, int]]] = {name: [] for name in facts.nodes}
    back: list[str] = []
    for m in sorted(facts.models.values(), key=lambda m: (m.last_active, m.scaled_object)):
        for name in facts.nodes_held_by(m.service):
            held = facts.held_by(m.service, name)
            if held <= 0:
                continue
            if may_yield(m, facts.stalled):
                if m.scaled_object not in used:
                    on[name].append((m, held))
            elif (text := f"{m.service} ({held_back(m, facts.stalled)})") not in back:
                back.append(text)
    for listed in on.values():
        # Whole holdings first: a model with replicas on other nodes frees only part of what it gives up.
        listed.sort(key=lambda mh: facts.holding(mh[0].service) > mh[1])
    return on, back


# --- 5: where each waiter goes --------------------------------------------------------------------


@dataclass
class Ledger:
    """What the decision has spoken for so far: room per node once promised victims are gone, and
    the victims already promised."""

    room: dict[str, int]
    used: set[str]


@dataclass(frozen=True)
class Placement:
    node: str
    victims: tuple[tuple[Model, int], ...]  # empty: the room is free already
    rank: tuple[int, str, str]


def victims_on(node: Node, waiter: Pod, facts: Facts, ledger: Ledger,
               holders_on: dict[str, list[tuple[Model, int]]]) -> Placement | None:
    """The victims on one node that free enough for the waiter, or None."""
    if ledger.room[node.name] >= waiter.units:
        return Placement(node.name, (), (-1, "", node.name))
    chosen, got = [], ledger.room[node.name]
    for m, held in holders_on[node.name]:
        if got >= waiter.units:
            break
        if m.scaled_object in ledger.used:
            continue
        chosen.append((m, held))
        got += held
    if got < waiter.units:
        return None
    # Fewest accelerators given up beyond the need first (whole holdings), then the least recent newest victim.
    cost = sum(facts.holding(m.service) for m, _ in chosen) - (waiter.units - ledger.room[node.name])
    return Placement(node.name, tuple(chosen), (cost, chosen[-1][0].last_active, node.name))


def place(waiter: Pod, usable: list[Node], facts: Facts, ledger: Ledger,
          holders_on: dict[str, list[tuple[Model, int]]]) -> Placement | None:
    best: Placement | None = None
    for node in usable:
        found = victims_on(node, waiter, facts, ledger, holders_on)
        if found is not None and not found.victims:
            return found  # free room beats any eviction
        if found is not None and (best is None or found.rank < best.rank):
            best = found
    return best


# --- the decision ---------------------------------------------------------------------------------


def decide(resource: str, nodes: tuple[Node, ...], handles: set[str], pods: list[Pod], models: list[Model],
           previous: list[Promise], *, now: str = "", yield_after: float = 0.0,
           stalled: dict[str, str] | None = None) -> Decision:
    """The pure decision. `handles` are the waiters (Pod keys) this pool answers for; `now` stamps new
    promises and bounds old ones; `stalled` is the pool's earlier record of victims KEDA left alone."""
    facts = read_facts(resource, nodes, pods, models, now=now, yield_after=yield_after, stalled=stalled)
    decision = Decision(waiting=waiters(facts, handles), stalled=dict(facts.stalled))
    kept, fallback = [], []
    for promise in previous:
        verdict, _why = judge(promise, facts)
        if verdict is Verdict.KEEP:
            kept.append(promise if promise.listed_at else replace(promise, listed_at=now))
        elif verdict is Verdict.FALLBACK:
            fallback.append(promise)
        elif verdict is Verdict.STALLED:
            decision.stalled[promise.scaled_object] = facts.models[promise.scaled_object].last_active
    facts = replace(facts, stalled=decision.stalled)
    ledger = Ledger(room={name: facts.free(name) for name in facts.nodes}, used={p.scaled_object for p in kept})
    for promise in kept:
        ledger.room[promise.node] += facts.held_by(promise.service, promise.node)
    holders_on, decision.held_back = holders(facts, ledger.used)
    decision.promises.extend(kept)
    for waiter in decision.waiting:
        _answer(waiter, facts, ledger, holders_on, kept, fallback, decision)
    return decision


def _answer(waiter: Pod, facts: Facts, ledger: Ledger, holders_on: dict[str, list[tuple[Model, int]]],
            kept: list[Promise], fallback: list[Promise], decision: Decision) -> None:
    mine = [pr for pr in kept if pr.waiter == waiter.key]
    usable = [facts.nodes[pr.node] for pr in mine[:1]] or [n for n in facts.nodes.values() if waiter.can_use(n)]
    best = place(waiter, usable, facts, ledger, holders_on)
    if best is None:
        _no_placement(waiter, usable, facts, ledger, fallback, decision)
        return
    ledger.room[best.node] -= waiter.units  # these units are spoken for, whoever frees them
    if not best.victims and not mine:  # free already, not by a promise of this pool's
        decision.scheduling.append(waiter.key)
    for m, held in best.victims:
        ledger.used.add(m.scaled_object)
        ledger.room[best.node] += held
        decision.promises.append(Promise(m.scaled_object, m.service, waiter.key, best.node, held, facts.now))


def _no_placement(waiter: Pod, usable: list[Node], facts: Facts, ledger: Ledger, fallback: list[Promise],
                  decision: Decision) -> None:
    largest = max((n.units for n in usable), default=0)
    # A victim that turned busy keeps its promise when nobody else can take over: moving the yield is
    # impossible, and dropping it on every request would rewrite the victim's ScaledObject each time.
    again = [pr for pr in fallback if pr.waiter == waiter.key and pr.scaled_object not in ledger.used]
    if largest >= waiter.units and again:
        decision.promises.extend(again)
        ledger.used.update(pr.scaled_object for pr in again)
        for pr in again:
            ledger.room[pr.node] += facts.held_by(pr.service, pr.node)
        ledger.room[again[0].node] -= waiter.units
        return
    text = f"{waiter.key} needs {waiter.units} {facts.resource}"
    if largest < waiter.units:
        decision.unsatisfiable.append(f"{text}; the largest node it can use offers {largest}")
    else:
        decision.no_holder.append(text)
