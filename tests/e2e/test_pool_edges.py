"""The accelerator pool under what a cluster also does (issue 31), on the real control plane: kwok GPU
nodes, kube-scheduler, real Metacontroller and KEDA, the hooks of this checkout.

- a holder KEDA will not scale in (paused with KEDA's own annotation; its scaler broken after the pool
  listed it) is passed over, and the waiter is served by another idle model within yieldAfter plus
  its cold start;
- two waiters whose Pods the scheduler binds across the nodes promised to them are both served, and
  no promise is left on a node with no holder;
- the Pending replica of a model whose cold request timed out (a ghost) gives its place up, so the
  next freed accelerator goes to the model someone waits for;
- two pools on two node groups serve a waiter that fits either.

Same harness (tests/e2e/pool_world.py) and settings as tests/e2e/test_accelerator_pool.py (pollingInterval 1 s, cooldownPeriod
300 s, yieldAfter 5 s unless a scenario says otherwise).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from tests.e2e.cluster import Timeline
from tests.e2e.pool_world import (
    COOLDOWN_SECONDS,
    FIRST_BYTE_BUDGET,
    PoolState,
    World,
    bound,
    phases,
    pool_ready,
    pool_waits,
    unschedulable,
    yielded,
    yielded_now,
)
from tests.e2e.test_lifecycle import conditions
from tests.e2e.test_scale_from_zero import keda  # noqa: F401 - the world fixture's KEDA

GPU = "nvidia.com/gpu"


def _scaled_object_ready(w: World, model: str) -> str:
    return conditions(w.cluster.get("scaledobject", f"{model}-backend", w.ns)).get("Ready", "?")


def _kept_its_replica(w: World, since: float, *names: str) -> None:
    assert w.watch is not None
    for s in w.watch.during(since):
        for name in names:
            assert s.models[name].replicas == 1 and any(p.node and not p.deleting for p in s.models[name].pods), \
                f"{name} was scaled in at {s.t - since:+.2f}s: {s.models[name].short()}\n{w.timeline.text()}"


def _last(w: World, model: str):  # noqa: ANN202 - the last Outcome of one model's requests
    return [o for o in w.client.outcomes if o.model == model][-1]


# --- 1. holders KEDA will not scale in ------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_a_paused_lru_holder_and_a_holder_whose_scaler_broke_after_it_was_listed_are_passed_over(
        world: Callable[[str], World], timeline: Timeline) -> None:
    yield_after = 15
    w = world("stuck")
    w.node("n1", gpus=3)
    w.add_models({"a": {}, "b": {}, "d": {}, "c": {}})
    watch = w.start_watch()
    w.warm("a", "b", "d")  # least recently used first: a, then b, then d
    w.wait_idle("a", "b", "d", past_yield_after=False)
    # a: paused with KEDA's own annotation. Its Active=False/ScalerCooldown and its old lastActiveTime
    # stay as they were, which made it every waiter's first victim before.
    w.cluster.kubectl("-n", w.ns, "annotate", "scaledobject", "a-backend", "autoscaling.keda.sh/paused=true")
    w.models["a"].wait("KEDA: a Paused=True", lambda: conditions(
        w.cluster.get("scaledobject", "a-backend", w.ns)).get("Paused", "").startswith("True"), timeout=30)
    pool = w.pool(yield_after=f"{yield_after}s")
    pool_ready(watch, pool)
    t0 = time.monotonic()
    request = w.client.ask_later(w.models["c"])
    listed = watch.wait("the pool lists b (the least recently used holder KEDA can scale in) for c",
                        lambda s: f"{w.ns}/b-backend" in yielded_now(s, pool), timeout=30)
    assert f"{w.ns}/a-backend" not in yielded(watch, pool), f"the paused a was listed\n{timeline.text()}"
    # b's scaler breaks before b is due (yieldAfter 15 s): the gateway KEDA asks is gone.
    assert w.models["b"].gateways is not None
    w.models["b"].gateways.stop()
    broke = time.monotonic()
    w.models["b"].wait("KEDA: b's ScaledObject not Ready", lambda: _scaled_object_ready(w, "b").startswith("False"),
                       timeout=30)
    moved = watch.wait("the pool drops b and lists d instead", lambda s: yielded_now(s, pool) == {f"{w.ns}/d-backend"},
                       timeout=30)
    request.join(120)
    out = _last(w, "c")
    assert out.kind == "complete" and out.first_token is not None, f"{out}\n{timeline.text()}"
    budget = yield_after + FIRST_BYTE_BUDGET
    assert out.first_token <= budget, f"c served after {out.first_token:.1f}s (yieldAfter + cold start: {budget}s)"
    phases(timeline, "stuck holders (a paused, LRU; b listed, then its scaler broke), from c's cold request", [
        ("c Unschedulable", watch.first(unschedulable("c", GPU), t0)), ("pool lists b", listed),
        ("b's gateway stopped", broke), ("pool lists d instead", moved),
        ("d replicas 0", watch.first(lambda s: s.models["d"].replicas == 0, t0)),
        ("c bound", watch.first(bound("c"), t0)), ("c first token", t0 + out.first_token)], t0)
    _kept_its_replica(w, t0, "a", "b")
    assert yielded(watch, pool) <= {f"{w.ns}/b-backend", f"{w.ns}/d-backend"}, timeline.text()


# --- 2. two waiters crossing nodes ------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_two_waiters_bound_across_the_nodes_promised_to_them_are_both_served_and_no_promise_is_left_stale(
        world: Callable[[str], World], timeline: Timeline) -> None:
    """c (older, low priority) is promised a's GPU on n1, d (younger) b's on n2; a is due first. d's
    PriorityClass (preemptionPolicy Never: queue order, no preemption) makes the scheduler bind d on
    n1 once a is gone: c's promise then names a node with no holder and no room."""
    w = world("cross")
    nodes = {w.node("n1", gpus=1), w.node("n2", gpus=1)}
    w.cluster.kubectl("apply", "--server-side", "-f", "-", stdin=(
        "apiVersion: scheduling.k8s.io/v1\nkind: PriorityClass\nmetadata:\n  name: e2e-pool-cross-first\n"
        "value: 1000\npreemptionPolicy: Never\n"))
    try:
        w.add_models({"a": {}, "b": {}, "c": {}, "d": {"scheduling": {"priorityClassName": "e2e-pool-cross-first"}}})
        watch = w.start_watch()
        w.warm("a", gap=0.0)
        # n1 is a's node, whichever the scheduler chose; b then has only the other one.
        watch.wait("a bound", bound("a"), timeout=30)
        n1 = next(p.node for p in watch.last.models["a"].pods if p.node)
        (n2,) = nodes - {n1}
        w.warm("b", gap=0.0)
        watch.wait(f"b on {n2}", lambda s: any(p.node == n2 for p in s.models["b"].pods), timeout=30)
        time.sleep(4.0)  # b's lastActiveTime comes 4 s after a's: a is due (and freed) first
        w.wait_idle("a", "b", past_yield_after=False)
        pool = w.pool(yield_after="10s")
        pool_ready(watch, pool)
        t0 = time.monotonic()
        w.client.ask_later(w.models["c"])
        watch.wait("c waits", unschedulable("c", GPU), timeout=30)
        time.sleep(1.0)
        w.client.ask_later(w.models["d"])
        watch.wait("both promised", lambda s: yielded_now(s, pool) == {f"{w.ns}/a-backend", f"{w.ns}/b-backend"},
                   timeout=30)
        w.client.join(150)
        c_out, d_out = _last(w, "c"), _last(w, "d")
        assert c_out.kind == "complete" and d_out.kind == "complete", f"{c_out}\n{d_out}\n{timeline.text()}"
        final = watch.wait("both bound, nothing promised", lambda s: bound("c")(s) and bound("d")(s)
                           and not yielded_now(s, pool), timeout=30)
        where = {m: next(p.node for p in watch.last.models[m].pods if p.node) for m in ("c", "d")}
        crossed = where["d"] == n1
        how = "crossed: d bound on n1, promised to c" if crossed else "not crossed"
        phases(timeline, f"two waiters ({how}), from c's request", [
            ("c Unschedulable", watch.first(unschedulable("c", GPU), t0)),
            ("a replicas 0", watch.first(lambda s: s.models["a"].replicas == 0, t0)),
            ("d bound", watch.first(bound("d"), t0)),
            ("b replicas 0", watch.first(lambda s: s.models["b"].replicas == 0, t0)),
            ("c bound", watch.first(bound("c"), t0)), ("nothing promised", final)], t0)
        assert crossed, f"the scheduler did not bind d on n1 first: the crossing was not reproduced\n{timeline.text()}"
        state = watch.last.pools[f"pool/{pool}"] or PoolState("", (), (), "", "", "")
        assert not state.waiting and not state.yielding, state
        w.client.check_nothing_lost()
    finally:
        w.cluster.kubectl("delete", "priorityclass", "e2e-pool-cross-first", "--ignore-not-found", check=False)


# --- 3. no ghosts -------------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_a_timed_out_models_ghost_does_not_take_the_next_freed_accelerator(
        world: Callable[[str], World], timeline: Timeline) -> None:
    w = world("ghost")
    node = w.node("n1", gpus=1)
    w.add_models({"a": {}, "g": {"scaling": {"activationTimeout": "10s"}}, "d": {}})
    watch = w.start_watch()
    pool = w.pool()
    pool_ready(watch, pool)
    w.warm("a")
    a = w.models["a"]
    a.server.backend.tokens, a.server.backend.stream_delay = 30, 1.0  # a busy for 30 s
    stream = w.client.ask_later(a, tokens=30)
    watch.wait("a busy", lambda s: s.models["a"].active.startswith("True"), timeout=15)
    t0 = time.monotonic()
    out = w.client.ask(w.models["g"], stream=False)
    assert (out.status, out.kind) == (504, "activation_timeout"), f"{out}\n{timeline.text()}"
    gave_up = time.monotonic()
    # The ghost: g's Pending replica, nobody waiting. It gets a short cooldown and KEDA lets it go.
    short = watch.wait("g's ScaledObject gets the ghost cooldown", lambda s: s.models["g"].cooldown is not None
                       and s.models["g"].cooldown < COOLDOWN_SECONDS, timeout=30)
    gone = watch.wait("g's ghost replica gone", lambda s: s.models["g"].replicas == 0 and not s.models["g"].pods,
                      timeout=30)
    restored = watch.wait("g's own cooldown back", lambda s: s.models["g"].cooldown == COOLDOWN_SECONDS, timeout=30)
    # Now someone waits for d; when a goes idle, the GPU is d's.
    t1 = time.monotonic()
    d_req = w.client.ask_later(w.models["d"])
    stream.join(60)
    d_req.join(120)
    d_out = _last(w, "d")
    assert d_out.kind == "complete", f"{d_out}\n{timeline.text()}"
    phases(timeline, "ghost (1 GPU, a busy 30 s; g timed out after 10 s), from g's request", [
        ("g Unschedulable", watch.first(unschedulable("g", GPU), t0)), ("g 504", gave_up),
        ("g ghost cooldown", short), ("g replica gone", gone), ("g cooldown restored", restored),
        ("d requested", t1), ("pool lists a", watch.first(lambda s: f"{w.ns}/a-backend" in yielded_now(s, pool), t1)),
        ("d bound", watch.first(bound("d"), t1))], t0)
    assert gone - gave_up <= 20.0, f"g's ghost stayed {gone - gave_up:.1f}s after its 504\n{timeline.text()}"
    assert not any(p.node for s in watch.during(gave_up) for p in s.models["g"].pods), \
        f"g's ghost was bound\n{timeline.text()}"
    assert all(p.node == node for p in watch.last.models["d"].pods if p.node)
    w.client.check_nothing_lost()


# --- 4. pools on two node groups ---------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_two_pools_on_two_node_groups_serve_a_waiter_that_fits_either(
        world: Callable[[str], World], timeline: Timeline) -> None:
    w = world("groups")
    g1 = w.node("g1", gpus=1, labels={"e2e.noctaya.io/group": "one"})
    w.add_models({"x": {}, "y": {}, "c": {}})
    watch = w.start_watch()
    w.warm("x")  # x on g1 (the only node yet)
    watch.wait("x on g1", lambda s: any(p.node == g1 for p in s.models["x"].pods), timeout=30)
    g2 = w.node("g2", gpus=1, labels={"e2e.noctaya.io/group": "two"})
    w.warm("y")
    watch.wait("y on g2", lambda s: any(p.node == g2 for p in s.models["y"].pods), timeout=30)
    first = w.pool(name=f"e2e-pool-{w.key}-a", labels={"e2e.noctaya.io/group": "one"})
    second = w.pool(name=f"e2e-pool-{w.key}-b", labels={"e2e.noctaya.io/group": "two"})
    pool_ready(watch, first)
    pool_ready(watch, second)
    w.wait_idle("y")
    x = w.models["x"]
    x.server.backend.tokens, x.server.backend.stream_delay = 40, 1.0  # x (group one) busy
    w.client.ask_later(x, tokens=40)
    watch.wait("x busy", lambda s: s.models["x"].active.startswith("True"), timeout=15)
    t0 = time.monotonic()
    out = w.client.ask(w.models["c"])
    assert out.kind == "complete" and out.first_token is not None, f"{out}\n{timeline.text()}"
    assert out.first_token <= FIRST_BYTE_BUDGET, f"{out}\n{timeline.text()}"
    phases(timeline, "two pools, two node groups (x busy on g1, y idle on g2), from c's cold request", [
        ("c Unschedulable", watch.first(unschedulable("c", GPU), t0)),
        ("pool b lists y", watch.first(lambda s: f"{w.ns}/y-backend" in yielded_now(s, second), t0)),
        ("y replicas 0", watch.first(lambda s: s.models["y"].replicas == 0, t0)),
        ("c bound", watch.first(bound("c"), t0)), ("c first token", t0 + out.first_token)], t0)
    assert all(p.node == g2 for p in watch.last.models["c"].pods if p.node), timeline.text()
    assert not yielded(watch, first), f"pool a listed a yield\n{timeline.text()}"
    listed_by_a = [s for s in watch.during(t0) if pool_waits(first)(s)]
    assert not listed_by_a, f"pool a listed c as its waiter\n{timeline.text()}"
    w.client.join(60)
    w.client.check_nothing_lost()
