"""The pool's decision rules one by one (hooks/controller/pool_decide.py), on facts read from the same
Metacontroller-shaped objects the sync tests use (tests/hooks/test_pool.py)."""

from __future__ import annotations

import copy
from typing import Any

from hooks.controller import pool_decide as rules
from hooks.controller.pool_facts import read_model, read_node, read_pod
from tests.hooks import test_pool as tp

NVIDIA = tp.NVIDIA


def facts(*objs: dict[str, Any], now: str = "2026-12-05T08:00:00Z", stalled: dict[str, str] | None = None) -> rules.Facts:
    nodes = tuple(n for n in (read_node(o, NVIDIA) for o in objs if o["kind"] == "Node") if n is not None)
    pods = [p for p in (read_pod(o, NVIDIA) for o in objs if o["kind"] == "Pod") if p is not None]
    models = [m for m in (read_model(o) for o in objs if o["kind"] == "ScaledObject") if m is not None]
    return rules.read_facts(NVIDIA, nodes, pods, models, now=now, yield_after=5, stalled=stalled)


A_FOR_C = rules.Promise("team/a-backend", "team/a", "team/c-backend-0", "n1", 1, "2026-12-05T08:00:00Z")


def test_a_promise_whose_waiter_bound_or_whose_node_left_is_dropped() -> None:
    world = tp.two_idle_and_a_waiter()
    assert rules.judge(A_FOR_C, facts(*world)) == (rules.Verdict.KEEP, "")
    bound = [tp.pod("c", node_name="n1") if o["metadata"]["name"] == "c-backend-0" else o for o in world]
    assert rules.waiter_gone(A_FOR_C, facts(*bound)) == (rules.Verdict.DROP, "")
    assert rules.node_left(A_FOR_C, facts(*[o for o in world if o["kind"] != "Node"], tp.node("n2", 2)))[0] is rules.Verdict.DROP


def test_the_victim_rules_read_keda_s_own_record() -> None:
    world = tp.two_idle_and_a_waiter()
    busy = [tp.scaled("a", "busy") if o["metadata"]["name"] == "a-backend" and o["kind"] == "ScaledObject" else o
            for o in world]
    assert rules.victim_not_idle_by_keda(A_FOR_C, facts(*busy)) == (rules.Verdict.FALLBACK, "")
    paused = [tp.paused(copy.deepcopy(o)) if o["metadata"]["name"] == "a-backend" and o["kind"] == "ScaledObject" else o for o in world]
    verdict, why = rules.victim_not_idle_by_keda(A_FOR_C, facts(*paused)) or (None, "")
    assert verdict is rules.Verdict.DROP and "paused" in why
    gone = [o for o in world if not (o["kind"] == "ScaledObject" and o["metadata"]["name"] == "a-backend")]
    assert rules.victim_not_idle_by_keda(A_FOR_C, facts(*gone))[0] is rules.Verdict.DROP  # type: ignore[index]
    assert rules.victim_not_idle_by_keda(A_FOR_C, facts(*world)) is None


def test_a_stall_is_measured_from_when_the_victim_became_due_and_terminating_pods_are_progress() -> None:
    world = tp.two_idle_and_a_waiter()  # a idle since 07:40, listed 08:00: due 08:00
    assert rules.yield_stalled(A_FOR_C, facts(*world, now="2026-12-05T08:01:00Z")) is None
    assert rules.yield_stalled(A_FOR_C, facts(*world, now="2026-12-05T08:01:01Z"))[0] is rules.Verdict.STALLED  # type: ignore[index]
    world[1]["metadata"]["deletionTimestamp"] = "2026-12-05T08:00:30Z"
    assert rules.yield_stalled(A_FOR_C, facts(*world, now="2026-12-05T08:09:00Z")) is None


def test_room_freed_and_taken_by_another_pod_spends_the_promise() -> None:
    taken = [tp.node("n1", 2), tp.pod("b", node_name="n1"), tp.pod("x", node_name="n1"), tp.pod("c", waiting=True),
             tp.scaled("b", "idle"), tp.scaled("x", "busy")]
    verdict = rules.victim_let_go_and_room_taken(A_FOR_C, facts(*taken))
    assert verdict is not None and verdict[0] is rules.Verdict.DROP
    free = [o for o in taken if o["metadata"]["name"] != "x-backend-0"]
    assert rules.victim_let_go_and_room_taken(A_FOR_C, facts(*free)) is None


def test_holders_put_whole_holdings_first_and_name_why_others_do_not_yield() -> None:
    world = [tp.node("n1", 3), tp.node("n2", 1), tp.pod("a", 0, node_name="n1"), tp.pod("a", 1, node_name="n2"),
             tp.pod("b", node_name="n1"), tp.pod("p", node_name="n1"),
             tp.scaled("a", "idle", "2026-12-05T07:40:00Z"), tp.scaled("b", "idle", "2026-12-05T07:45:00Z"),
             tp.paused(tp.scaled("p", "idle", "2026-12-05T07:30:00Z"))]
    on, back = rules.holders(facts(*world), used=set())
    assert [m.service for m, _ in on["n1"]] == ["team/b", "team/a"]  # b's whole holding is on n1
    assert [m.service for m, _ in on["n2"]] == ["team/a"]
    assert back == ["team/p (paused: autoscaling.keda.sh/paused)"]


def test_placement_prefers_free_room_then_the_cheapest_victims() -> None:
    world = [tp.node("n1", 2), tp.node("n2", 1), tp.pod("a", 0, node_name="n1"), tp.pod("a", 1, node_name="n1"),
             tp.pod("b", node_name="n2"), tp.pod("c", waiting=True),
             tp.scaled("a", "idle", "2026-12-05T07:40:00Z"), tp.scaled("b", "idle", "2026-12-05T07:45:00Z")]
    f = facts(*world)
    waiter = f.pending["team/c-backend-0"]
    ledger = rules.Ledger(room={n: f.free(n) for n in f.nodes}, used=set())
    on, _ = rules.holders(f, set())
    best = rules.place(waiter, list(f.nodes.values()), f, ledger, on)
    assert best is not None and best.node == "n2" and [m.service for m, _ in best.victims] == ["team/b"]
    ledger.room["n1"] = 1  # room already free beats any eviction
    best = rules.place(waiter, list(f.nodes.values()), f, ledger, on)
    assert best is not None and best.node == "n1" and not best.victims
