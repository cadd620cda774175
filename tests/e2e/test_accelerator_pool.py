"""Many models, fewer accelerators (#21): the AcceleratorPool with the real kube-scheduler, kwok GPU
nodes of a fixed capacity, real KEDA and real Metacontroller.

Each test builds a world of its own: a namespace, kwok nodes offering `nvidia.com/gpu` (or
`amd.com/gpu`) labelled for that test only, an InferenceRuntime whose backend requests the GPU and is
placed on those nodes, models (LLMService + local gateway + stand-in model server, as in
test_scale_from_zero.py) and a pool selecting those nodes; it deletes all of it at the end, so the
next test sees none of its GPUs.

Settings (the issue's): pollingInterval 1 s, cooldownPeriod 300 s (within a test only the pool can
explain a scale-in), yieldAfter 5 s, activationTimeout 60 s unless a scenario says otherwise. A model
is idle for the pool once the gateway's activation lease (readyGrace after its last request) has
ended and KEDA says Active=False/ScalerCooldown. A Watch samples every object of the world every
0.25 s; the phases printed (`-s`) and put in the timeline are read from those samples.

Across every test: each request ends in a complete 200, a 504 activation_timeout or a 429 — never a
502, a reset or a cut stream (Client.outcomes, checked at the end of every test).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from tests.e2e.cluster import Cluster, Timeline
from tests.e2e.pool_world import (
    COOLDOWN_SECONDS,
    FIRST_BYTE_BUDGET,
    YIELD_AFTER_SECONDS,
    Outcome,
    PoolState,
    Sample,
    Watch,
    World,
    bound,
    epoch_seconds,
    long_stream,
    no_pods,
    phases,
    pool_ready,
    pool_waits,
    unschedulable,
    untouched,
    versions_diff,
    yielded,
    yielded_now,
)
from tests.e2e.test_scale_from_zero import ANSWER, keda  # noqa: F401 - keda: the world fixture's KEDA

# --- 1. LRU yield, and its control without a pool ---------------------------------------------------


@pytest.mark.timeout(300)
def test_lru_idle_holder_yields_to_a_cold_model_and_without_a_pool_the_cold_model_times_out(
        world: Callable[[str], World], timeline: Timeline) -> None:
    w = world("lru")
    node = w.node("n1", gpus=2)
    # x is the control's cold model (a short activationTimeout); c is the pool's.
    w.add_models({"a": {}, "b": {}, "x": {"scaling": {"activationTimeout": "20s"}}, "c": {}})
    watch = w.start_watch()
    w.warm("a", "b")  # a is the least recently used

    # Control: no pool. x's backend cannot be placed; it times out while a and b keep their GPUs.
    t_control = time.monotonic()
    before = dict(watch.last.models)
    out = w.client.ask(w.models["x"], stream=False)
    assert (out.status, out.kind, out.retry) == (504, "activation_timeout", "false"), f"{out}\n{timeline.text()}"
    assert 19.0 <= out.seconds <= 23.0, f"activationTimeout 20s, answered after {out.seconds:.1f}s"
    assert watch.first(unschedulable("x", "nvidia.com/gpu"), after=t_control) is not None, timeline.text()
    for name in ("a", "b"):
        untouched(watch, t_control, name, before[name])
        assert watch.last.models[name].replicas == 1
    print(f"\ncontrol (no pool): x got 504 activation_timeout after {out.seconds:.1f}s (timeout 20s); a and b kept "
          "their GPUs")
    # The control's waiter goes away before the pool exists (else it would be the pool's first waiter).
    w.cluster.kubectl("-n", w.ns, "delete", "llmservice", "x", "--wait=false")
    watch.wait("x's backend gone", lambda s: s.models["x"].replicas is None and not s.models["x"].pods, timeout=60)

    w.wait_idle("a", "b")
    pool = w.pool()
    watch.wait("pool Accepted, no waiters", lambda s: (p := s.pools[f"pool/{pool}"]) is not None
               and p.accepted == "True/Accepted" and p.contended == "False/NoWaiters", timeout=30)
    before = dict(watch.last.models)
    a_gen = before["a"].generation
    t0 = time.monotonic()
    out = w.client.ask(w.models["c"])
    assert out.kind == "complete", f"{out}\n{timeline.text()}"
    assert out.first_token is not None and out.first_token <= FIRST_BYTE_BUDGET, f"{out}\n{timeline.text()}"
    restored = watch.wait("a's cooldownPeriod restored to 300 and the pool's yielding empty", lambda s: (
        s.models["a"].cooldown == COOLDOWN_SECONDS and not (s.pools[f"pool/{pool}"] or PoolState("", (), (), "", "", "")).yielding
        and bound("c")(s)), timeout=30)
    marks = [
        ("c Unschedulable", watch.first(unschedulable("c", "nvidia.com/gpu"), t0)),
        ("pool lists c waiting", watch.first(pool_waits(pool), t0)),
        ("pool lists a", watch.first(lambda s: any(y.startswith(f"{w.ns}/a-backend ") for y in
                                                   (s.pools[f"pool/{pool}"] or PoolState("", (), (), "", "", "")).yielding), t0)),
        ("a cooldownPeriod 5", watch.first(lambda s: s.models["a"].cooldown == YIELD_AFTER_SECONDS, t0)),
        ("a replicas 0", watch.first(lambda s: s.models["a"].replicas == 0, t0)),
        ("a Pod gone", watch.first(no_pods("a"), t0)),
        ("c bound", watch.first(bound("c"), t0)),
        ("c first token", t0 + out.first_token),
        ("a cooldown restored", watch.first(lambda s: s.models["a"].cooldown == COOLDOWN_SECONDS, t0 + out.first_token)),
    ]
    phases(timeline, "LRU yield (1 node x 2 GPUs), from c's cold request", marks, t0)
    final = watch.last.models
    assert final["a"].replicas == 0 and not final["a"].pods, timeline.text()
    untouched(watch, t0, "b", before["b"])
    assert final["b"].replicas == 1
    assert all(p.node == node for p in final["c"].pods), timeline.text()
    # a's ScaledObject changed twice (shortened, restored), nothing else.
    assert final["a"].generation == (a_gen or 0) + 2, f"a's generation {a_gen} -> {final['a'].generation}"
    assert restored - (watch.first(bound("c"), t0) or restored) <= 5.0, timeline.text()
    w.client.check_nothing_lost()



# --- 2. a busy holder is never yielded ---------------------------------------------------------------


@pytest.mark.timeout(240)
def test_a_busy_holder_is_never_yielded_even_when_least_recently_used(
        world: Callable[[str], World], timeline: Timeline) -> None:
    w = world("busy")
    w.node("n1", gpus=2)
    w.add_models({"a": {}, "b": {}, "c": {}})
    watch = w.start_watch()
    w.warm("a", "b")
    w.wait_idle("a", "b")  # a is the least recently used
    pool = w.pool()
    pool_ready(watch, pool)
    long_stream(w.models["a"], 30)
    long = w.client.ask_later(w.models["a"], tokens=30)
    watch.wait("a busy again (KEDA Active=True)", lambda s: s.models["a"].active.startswith("True"), timeout=15)
    before = dict(watch.last.models)
    t0 = time.monotonic()
    out = w.client.ask(w.models["c"])
    assert out.kind == "complete" and out.first_token is not None, f"{out}\n{timeline.text()}"
    marks = [
        ("c Unschedulable", watch.first(unschedulable("c", "nvidia.com/gpu"), t0)),
        ("pool lists c waiting", watch.first(pool_waits(pool), t0)),
        ("b cooldownPeriod 5", watch.first(lambda s: s.models["b"].cooldown == YIELD_AFTER_SECONDS, t0)),
        ("b replicas 0", watch.first(lambda s: s.models["b"].replicas == 0, t0)),
        ("c bound", watch.first(bound("c"), t0)),
        ("c first token", t0 + out.first_token),
    ]
    phases(timeline, "busy holder (a streaming, LRU), from c's cold request", marks, t0)
    assert out.first_token <= FIRST_BYTE_BUDGET, f"{out}\n{timeline.text()}"
    long.join(60)
    a_out = [o for o in w.client.outcomes if o.model == "a"][-1]  # after the warm-up's
    assert (a_out.status, a_out.kind, a_out.chunks) == (200, "complete", 30), f"{a_out}\n{timeline.text()}"
    untouched(watch, t0, "a", before["a"])
    assert f"{w.ns}/a-backend" not in yielded(watch, pool), timeline.text()
    assert watch.last.models["b"].replicas == 0, timeline.text()
    print(f"busy holder: a's 30 s stream completed intact ({a_out.chunks} chunks); b yielded")
    w.client.check_nothing_lost()


# --- 3. everyone busy: wait, evict nothing ---------------------------------------------------------


@pytest.mark.timeout(240)
def test_with_every_holder_busy_the_waiter_times_out_and_nothing_is_evicted_until_a_holder_goes_idle(
        world: Callable[[str], World], timeline: Timeline) -> None:
    w = world("allbusy")
    w.node("n1", gpus=2)
    w.add_models({"a": {}, "b": {}, "c": {"scaling": {"activationTimeout": "20s"}}})
    watch = w.start_watch()
    pool = w.pool()
    pool_ready(watch, pool)
    w.warm("a", "b", gap=0.0)
    # a streams 30 s, b 40 s: after c's 504 a goes idle first, while b is still busy.
    streams = {}
    for name, seconds in (("a", 30), ("b", 40)):
        long_stream(w.models[name], seconds)
        streams[name] = w.client.ask_later(w.models[name], tokens=seconds)
    before = dict(watch.last.models)
    t0 = time.monotonic()
    out = w.client.ask(w.models["c"], stream=False)
    assert (out.status, out.kind, out.retry) == (504, "activation_timeout", "false"), f"{out}\n{timeline.text()}"
    assert 19.0 <= out.seconds <= 22.0, f"activationTimeout 20s, answered after {out.seconds:.1f}s"
    said = watch.first(lambda s: (p := s.pools[f"pool/{pool}"]) is not None and p.contended == "True/NoIdleHolder", t0)
    assert said is not None, f"the pool never said NoIdleHolder\n{timeline.text()}"
    message = next(s.pools[f"pool/{pool}"].message for s in watch.during(said))  # type: ignore[union-attr]
    timeline.note(f"Contended message: {message}")
    assert f"{w.ns}/a" in message and f"{w.ns}/b" in message, message
    for name in ("a", "b"):
        untouched(watch, t0, name, before[name])
    assert not yielded(watch, pool), timeline.text()
    phases(timeline, "everyone busy, from c's cold request", [
        ("c Unschedulable", watch.first(unschedulable("c", "nvidia.com/gpu"), t0)),
        ("pool lists c waiting", watch.first(pool_waits(pool), t0)),
        ("pool NoIdleHolder", said), ("c 504 activation_timeout", t0 + out.seconds)], t0)

    # Once a goes idle (its stream ends), a new request for c is served: a yields, b (still streaming) does not.
    streams["a"].join(40)
    a_done = time.monotonic()
    time.sleep(YIELD_AFTER_SECONDS + 3.0)  # a idle past yieldAfter, and no request for c: a keeps its GPU
    assert not yielded(watch, pool), f"a yielded to a Pod nobody waits for\n{timeline.text()}"
    assert watch.last.models["a"].replicas == 1, timeline.text()
    # c's backend Pod stays Pending after the 504 (its Deployment keeps 1 replica for KEDA's cooldown),
    # but nobody waits for it: once KEDA records c inactive the pool stops listing it, so a going idle
    # is not made to yield for a request that already ended.
    gave_up = t0 + out.seconds
    dropped = watch.first(lambda s: not pool_waits(pool)(s), gave_up)
    assert dropped is not None and dropped - gave_up <= 10.0, f"c still listed after its 504\n{timeline.text()}"
    print(f"the pool stopped listing c {dropped - gave_up:.1f}s after its 504")
    a_out = next(o for o in w.client.outcomes if o.model == "a" and o.chunks == 30)
    assert a_out.kind == "complete", f"{a_out}\n{timeline.text()}"
    t_again = time.monotonic()
    again = w.client.ask(w.models["c"])
    assert again.kind == "complete" and again.first_token is not None, f"{again}\n{timeline.text()}"
    served = t_again + again.first_token
    phases(timeline, "a idle again, from the end of a's stream", [
        ("c requested again", t_again),
        ("a Active=False", watch.first(lambda s: s.models["a"].active.startswith("False"), a_done - 1.0)),
        ("pool lists a", watch.first(lambda s: f"{w.ns}/a-backend" in yielded_now(s, pool), a_done - 1.0)),
        ("a replicas 0", watch.first(lambda s: s.models["a"].replicas == 0, a_done - 1.0)),
        ("c bound", watch.first(bound("c"), a_done - 1.0)), ("c first token", served)], a_done)
    assert served - t_again <= FIRST_BYTE_BUDGET, \
        f"c served {served - t_again:.1f}s after its new request\n{timeline.text()}"
    streams["b"].join(40)
    untouched(watch, t0, "b", before["b"])
    assert yielded(watch, pool) == {f"{w.ns}/a-backend"}, timeline.text()
    done = [o for o in w.client.outcomes if (o.model, o.chunks) in (("a", 30), ("b", 40))]
    assert len(done) == 2 and all(o.kind == "complete" for o in done), f"{done}\n{timeline.text()}"
    w.client.check_nothing_lost()


# --- 4. pinned models are never victims --------------------------------------------------------------


@pytest.mark.timeout(240)
def test_pinned_models_are_never_victims(world: Callable[[str], World], timeline: Timeline) -> None:
    w = world("pinned")
    w.node("n1", gpus=3)
    # m holds a GPU from the start (min 1); p says yieldPolicy Never and is the least recently used idle
    # model; b is the only one that may yield.
    w.add_models({"m": {"scaling": {"min": 1}}, "p": {"scaling": {"yieldPolicy": "Never"}}, "b": {}, "c": {}})
    watch = w.start_watch()
    assert watch.last.models["m"].replicas == 1
    w.warm("p", "b")
    w.wait_idle("p", "b")
    pool = w.pool()
    pool_ready(watch, pool)
    before = dict(watch.last.models)
    t0 = time.monotonic()
    out = w.client.ask(w.models["c"])
    assert out.kind == "complete" and out.first_token is not None, f"{out}\n{timeline.text()}"
    phases(timeline, "pinned (m min 1, p yieldPolicy Never, p LRU), from c's cold request", [
        ("c Unschedulable", watch.first(unschedulable("c", "nvidia.com/gpu"), t0)),
        ("pool lists c waiting", watch.first(pool_waits(pool), t0)),
        ("b cooldownPeriod 5", watch.first(lambda s: s.models["b"].cooldown == YIELD_AFTER_SECONDS, t0)),
        ("b replicas 0", watch.first(lambda s: s.models["b"].replicas == 0, t0)),
        ("c bound", watch.first(bound("c"), t0)), ("c first token", t0 + out.first_token)], t0)
    assert out.first_token <= FIRST_BYTE_BUDGET, f"{out}\n{timeline.text()}"
    for name in ("m", "p"):
        untouched(watch, t0, name, before[name])
    assert yielded(watch, pool) == {f"{w.ns}/b-backend"}, timeline.text()
    w.client.check_nothing_lost()


# --- 5. no over-eviction (and the pool writes nothing while nobody waits) ----------------------------

SETTLE_SECONDS = 5.0


def _pool_settled(watch: Watch, pool: str, since: float, timeout: float = 60.0) -> tuple[float, int]:
    """(when the pool's status had last changed, once it has then held for SETTLE_SECONDS; the writes
    seen after ``since`` until then). Fails if it never holds that long: that would be a hot loop."""
    key = f"pool/{pool}"
    deadline = time.monotonic() + timeout
    while True:
        versions = [(s.t, s.pools[key].resource_version) for s in watch.during(since)]  # type: ignore[union-attr]
        changed_at = max((t for (t, v), (_, before) in zip(versions[1:], versions[:-1], strict=True) if v != before), default=since)
        if time.monotonic() - changed_at >= SETTLE_SECONDS:
            return changed_at, len({v for _, v in versions}) - 1
        assert time.monotonic() < deadline, f"the pool's status never held for {SETTLE_SECONDS}s: {versions}"
        time.sleep(0.5)


@pytest.mark.timeout(300)
def test_one_waiter_yields_exactly_one_of_three_idle_holders_and_an_idle_pool_writes_nothing(
        world: Callable[[str], World], cluster: Cluster, timeline: Timeline) -> None:
    w = world("one")
    w.node("n1", gpus=3)
    w.add_models({"a": {}, "b": {}, "d": {}, "c": {}})
    watch = w.start_watch()
    w.warm("a", "b", "d")
    w.wait_idle("a", "b", "d")
    pool = w.pool()
    pool_ready(watch, pool)
    before = dict(watch.last.models)
    t0 = time.monotonic()
    out = w.client.ask(w.models["c"])
    assert out.kind == "complete" and out.first_token is not None, f"{out}\n{timeline.text()}"
    assert out.first_token <= FIRST_BYTE_BUDGET, f"{out}\n{timeline.text()}"
    settled = watch.wait("the pool's yielding empty again", lambda s: not s.pools[f"pool/{pool}"].yielding  # type: ignore[union-attr]
                         and s.models["a"].cooldown == COOLDOWN_SECONDS, timeout=30)
    phases(timeline, "no over-eviction (3 idle holders, 1 needed), from c's cold request", [
        ("c Unschedulable", watch.first(unschedulable("c", "nvidia.com/gpu"), t0)),
        ("pool lists c waiting", watch.first(pool_waits(pool), t0)),
        ("a cooldownPeriod 5", watch.first(lambda s: s.models["a"].cooldown == YIELD_AFTER_SECONDS, t0)),
        ("a replicas 0", watch.first(lambda s: s.models["a"].replicas == 0, t0)),
        ("c bound", watch.first(bound("c"), t0)), ("c first token", t0 + out.first_token),
        ("yielding empty, a restored", settled)], t0)
    # Quiet: nobody waits now. While c's lease ends (KEDA rewrites its ScaledObject's status every poll
    # while it is active) and then for an idle minute, the pool's status is not rewritten; b and d keep
    # their GPUs throughout (over a minute after c was served). Right after the transition Metacontroller
    # may still answer from a cached copy of the pool a write or two old (it applies a status computed
    # from its cache; a CI run saw the condition's lastTransitionTime set back and forth four times
    # within seconds): the quiet minute starts once the status has held for SETTLE_SECONDS.
    quiet_from, settling_writes = _pool_settled(watch, pool, settled)
    version = watch.last.pools[f"pool/{pool}"].resource_version  # type: ignore[union-attr]
    timeline.note(f"pool status settled {quiet_from - settled:.1f}s after the yield ended ({settling_writes} writes)")
    w.wait_idle("c", past_yield_after=False)
    calls = cluster.hook_calls()
    time.sleep(60.0)
    after = cluster.hook_calls()
    per_hook = {hook: int(after.get(hook, 0) - calls.get(hook, 0)) for hook in after if after.get(hook, 0) > calls.get(hook, 0)}
    timeline.note(f"hook calls during the idle minute: {per_hook}")
    print(f"\npool with no waiters: hook calls in one idle minute (4 LLMServices, 3 at 1 replica idle; 1 pool): {per_hook}")
    seen = {s.pools[f"pool/{pool}"].resource_version: s.pools[f"pool/{pool}"].raw  # type: ignore[union-attr]
            for s in watch.during(quiet_from - 1.0)}
    rewrites = {s.pools[f"pool/{pool}"].resource_version for s in watch.during(quiet_from)}  # type: ignore[union-attr]
    assert rewrites == {version}, (f"the pool was rewritten while nobody waited: {sorted(rewrites)}\n"
                                   + versions_diff(seen) + f"\n{timeline.text()}")
    print(f"pool status not rewritten for {time.monotonic() - quiet_from:.0f} s with no waiters (resourceVersion {version})")
    for name in ("b", "d"):
        untouched(watch, t0, name, before[name])
    assert yielded(watch, pool) == {f"{w.ns}/a-backend"}, timeline.text()
    # A hot loop would be hundreds; the pool resyncs on every related change cluster-wide (reported above).
    assert per_hook.get("acceleratorpool_sync", 0) <= 30, per_hook
    w.client.check_nothing_lost()


@pytest.mark.timeout(240)
def test_a_waiter_no_single_node_can_fit_evicts_nobody_and_the_pool_says_unsatisfiable(
        world: Callable[[str], World], timeline: Timeline) -> None:
    w = world("frag")
    w.node("n1", gpus=1)
    w.node("n2", gpus=1)
    w.add_models({"a": {}, "b": {}, "c": {"accelerators": 2, "scaling": {"activationTimeout": "20s"}}})
    watch = w.start_watch()
    w.warm("a", "b")
    w.wait_idle("a", "b")
    assert {p.node for n in ("a", "b") for p in watch.last.models[n].pods} == {w.nodes[0], w.nodes[1]}
    pool = w.pool()
    pool_ready(watch, pool)
    before = dict(watch.last.models)
    t0 = time.monotonic()
    out = w.client.ask(w.models["c"], stream=False)
    assert (out.status, out.kind) == (504, "activation_timeout"), f"{out}\n{timeline.text()}"
    said = watch.first(lambda s: s.pools[f"pool/{pool}"].contended == "True/Unsatisfiable", t0)  # type: ignore[union-attr]
    assert said is not None, f"the pool never said Unsatisfiable\n{timeline.text()}"
    timeline.note(f"Contended message: {watch.last.pools[f'pool/{pool}'].message}")  # type: ignore[union-attr]
    for name in ("a", "b"):
        untouched(watch, t0, name, before[name])
    assert not yielded(watch, pool), timeline.text()
    phases(timeline, "fragmentation (2 nodes x 1 GPU, c needs 2)", [
        ("c Unschedulable", watch.first(unschedulable("c", "nvidia.com/gpu"), t0)),
        ("pool lists c waiting", watch.first(pool_waits(pool), t0)),
        ("pool Unsatisfiable", said), ("c 504 activation_timeout", t0 + out.seconds)], t0)
    w.client.check_nothing_lost()


# --- 6. accelerator kinds ------------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_a_waiter_yields_only_a_holder_of_its_own_accelerator_kind(
        world: Callable[[str], World], timeline: Timeline) -> None:
    w = world("kinds")
    w.node("nv", gpus=1)
    w.node("amd", amd_gpus=1)
    w.add_models({"a": {}, "b": {"vendor": "amd"}, "c": {}, "d": {"vendor": "amd"}})
    watch = w.start_watch()
    w.warm("b", "a")  # b (AMD) is the least recently used of all
    w.wait_idle("a", "b")
    nvidia = w.pool("nvidia.com/gpu", name=f"e2e-pool-{w.key}-nvidia")
    amd = w.pool("amd.com/gpu", name=f"e2e-pool-{w.key}-amd")
    pool_ready(watch, nvidia)
    pool_ready(watch, amd)
    before = dict(watch.last.models)
    t0 = time.monotonic()
    out = w.client.ask(w.models["c"])
    assert out.kind == "complete" and out.first_token is not None, f"{out}\n{timeline.text()}"
    assert out.first_token <= FIRST_BYTE_BUDGET, f"{out}\n{timeline.text()}"
    untouched(watch, t0, "b", before["b"])
    assert yielded(watch, nvidia) == {f"{w.ns}/a-backend"} and not yielded(watch, amd), timeline.text()
    phases(timeline, "NVIDIA waiter c (AMD b is the LRU)", [
        ("a replicas 0", watch.first(lambda s: s.models["a"].replicas == 0, t0)),
        ("c bound", watch.first(bound("c"), t0)), ("c first token", t0 + out.first_token)], t0)
    # And the other way: an AMD waiter yields b, never c (busy now anyway) nor anything on the NVIDIA node.
    before = dict(watch.last.models)
    t1 = time.monotonic()
    out = w.client.ask(w.models["d"])
    assert out.kind == "complete" and out.first_token is not None, f"{out}\n{timeline.text()}"
    assert out.first_token <= FIRST_BYTE_BUDGET, f"{out}\n{timeline.text()}"
    untouched(watch, t1, "c", before["c"])
    assert yielded(watch, amd) == {f"{w.ns}/b-backend"} and yielded(watch, nvidia, t1) <= {f"{w.ns}/a-backend"}
    phases(timeline, "AMD waiter d", [
        ("b replicas 0", watch.first(lambda s: s.models["b"].replicas == 0, t1)),
        ("d bound", watch.first(bound("d"), t1)), ("d first token", t1 + out.first_token)], t1)
    w.client.check_nothing_lost()


# --- timing helpers for the scenarios below -------------------------------------------------------------


def _wall(t: float) -> float:
    """The wall-clock time (epoch seconds, as KEDA's lastActiveTime) of a monotonic instant."""
    return t + (time.time() - time.monotonic())


def _scaled_in(name: str) -> Callable[[Sample], bool]:
    """The model's backend is being scaled in: replicas 0 or its Pod deleting."""
    return lambda s: s.models[name].replicas == 0 or any(p.deleting for p in s.models[name].pods)


def _last_active_before(watch: Watch, name: str, t: float) -> float:
    """The model's lastActiveTime (epoch seconds) in the last sample before ``t``."""
    last = [s.models[name].last_active for s in watch.samples if s.t < t and s.models[name].last_active]
    assert last, f"{name} has no lastActiveTime before {t}"
    return epoch_seconds(last[-1])


def _bound_pods(watch: Watch, since: float, until: float | None = None) -> set[str]:
    """Every backend Pod (any model) seen bound to a node between ``since`` and ``until``."""
    return {f"{name}/{p.name}" for s in watch.during(since) if until is None or s.t <= until
            for name, m in s.models.items() for p in m.pods if p.node}


@dataclass
class Sent:
    model: str
    at: float = 0.0  # monotonic, when the request was sent
    out: Outcome | None = None


def _send_at(w: World, name: str, at: float, **kwargs: Any) -> Sent:
    """One request to ``name`` sent at monotonic ``at`` from a thread of the client's."""
    sent = Sent(name)

    def run() -> None:
        time.sleep(max(0.0, at - time.monotonic()))
        sent.at = time.monotonic()
        sent.out = w.client.ask(w.models[name], **kwargs)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    w.client._threads.append(thread)
    return sent


# --- 2. residency floor ----------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_a_holder_used_moments_ago_is_not_scaled_in_before_last_active_plus_yield_after(
        world: Callable[[str], World], timeline: Timeline) -> None:
    w = world("floor")
    w.node("n1", gpus=1)
    w.add_models({"a": {}, "c": {}})
    watch = w.start_watch()
    pool = w.pool()
    pool_ready(watch, pool)
    w.warm("a")
    w.wait_idle("a", past_yield_after=False)  # a's activation lease over: only requests keep it active
    a = w.models["a"]
    a.server.backend.tokens, a.server.backend.stream_delay = 3, 0.5
    t_used = time.monotonic()
    used = w.client.ask(a, tokens=3)  # 1.5 s in flight
    assert used.kind == "complete", f"{used}\n{timeline.text()}"
    used_end = t_used + used.seconds
    time.sleep(max(0.0, used_end + 1.0 - time.monotonic()))
    t0 = time.monotonic()
    out = w.client.ask(w.models["c"])
    assert out.kind == "complete" and out.first_token is not None, f"{out}\n{timeline.text()}"
    gone = watch.first(_scaled_in("a"), t0)
    assert gone is not None, timeline.text()
    last_active = _last_active_before(watch, "a", gone)
    floor = last_active + YIELD_AFTER_SECONDS
    shortened = watch.first(lambda s: s.models["a"].cooldown == YIELD_AFTER_SECONDS, t0)
    marks = [
        ("c Unschedulable", watch.first(unschedulable("c", "nvidia.com/gpu"), t0)),
        ("pool lists a", watch.first(lambda s: f"{w.ns}/a-backend" in yielded_now(s, pool), t0)),
        ("a cooldownPeriod 5", shortened),
        ("a lastActiveTime + yieldAfter", floor - _wall(0.0)),
        ("a scaled in (replicas 0 or Pod deleting)", gone),
        ("c bound", watch.first(bound("c"), t0)), ("c first token", t0 + out.first_token)]
    phases(timeline, f"residency floor (a used until {t0 - used_end:.1f}s before c's cold request)", marks, t0)
    # a's use moved its lastActiveTime (KEDA saw the request), and the pool wanted a gone before its floor:
    # only the floor held it.
    assert last_active >= _wall(t_used) - 1.0, f"lastActiveTime {last_active} not refreshed by a's request\n{timeline.text()}"
    assert shortened is not None and _wall(shortened) <= floor - 1.0, timeline.text()
    assert _wall(gone) >= floor - 0.5, \
        f"a scaled in {floor - _wall(gone):.2f}s before lastActiveTime + yieldAfter\n{timeline.text()}"
    print(f"residency floor: a scaled in {_wall(gone) - floor:+.2f}s after lastActiveTime + yieldAfter "
          f"({_wall(gone) - _wall(used_end) - YIELD_AFTER_SECONDS:+.2f}s after its request's end + yieldAfter)")
    assert out.first_token <= 25.0, f"{out}\n{timeline.text()}"
    w.client.check_nothing_lost()


# --- 5. anti-thrash --------------------------------------------------------------------------------------

CONTROL_SECONDS = 40.0  # the control's alternation (yieldAfter 0s), as long as the main part's

def _alternate(w: World, t_start: float, seconds: float, every: float = 2.0) -> list[Sent]:
    """a, c, a, c … one request every ``every`` seconds for ``seconds``: a streamed (warm when it holds
    the GPU), c plain."""
    out = []
    for i in range(int(seconds / every)):
        name = "a" if i % 2 == 0 else "c"
        kwargs: dict[str, Any] = {"tokens": 3} if name == "a" else {"stream": False}
        out.append(_send_at(w, name, t_start + i * every, **kwargs))
    return out


def _wait_sent(sent: list[Sent], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(s.out is None for s in sent) and time.monotonic() < deadline:
        time.sleep(0.2)


@pytest.mark.timeout(420)
def test_alternating_demand_on_one_gpu_does_not_thrash_and_with_yield_after_zero_it_swaps(
        world: Callable[[str], World], timeline: Timeline) -> None:
    w = world("thrash")
    w.node("n1", gpus=1)
    w.add_models({"a": {"scaling": {"activationTimeout": "20s"}}, "c": {"scaling": {"activationTimeout": "20s"}}})
    watch = w.start_watch()
    w.warm("a")
    w.wait_idle("a", past_yield_after=False)  # a holds the only GPU, its activation lease over
    pool = w.pool(yield_after="10s")
    pool_ready(watch, pool)
    a = w.models["a"]
    a.server.backend.tokens, a.server.backend.stream_delay = 3, 0.5  # each a request 1.5 s in flight
    bound_before = _bound_pods(watch, watch.last.t)
    t0 = time.monotonic() + 0.5
    sent = _alternate(w, t0, 40.0)
    a_sent = [s for s in sent if s.model == "a"]
    c_sent = [s for s in sent if s.model == "c"]
    _wait_sent(a_sent, 60)
    a_end = max(s.at + s.out.seconds for s in a_sent)  # type: ignore[union-attr]
    c_ready = watch.wait("c Ready after a's last request", lambda s: any(p.ready for p in s.models["c"].pods),
                         timeout=45)
    _wait_sent(c_sent, 30)
    # While a was busy (its last request's end): no new backend Pod bound, a kept its Pod.
    swaps = _bound_pods(watch, t0, a_end) - bound_before
    assert not swaps, f"backend Pods bound while a was in use: {swaps}\n{timeline.text()}"
    warm = [s.out for s in a_sent]
    assert all(o is not None and o.kind == "complete" and o.first_token is not None and o.first_token <= 2.0
               for o in warm), "a not served warm:\n" + "\n".join(map(str, warm)) + "\n" + timeline.text()
    # While a was in use the pool named it: promised to yield once idle yieldAfter (Yielding; the promise
    # stands while a is busy, as nobody else could take over) or held back as busy (NoIdleHolder).
    named = [p for s in watch.during(t0) if s.t <= a_end and (p := s.pools[f"pool/{pool}"]) is not None
             and p.contended in ("True/Yielding", "True/NoIdleHolder") and f"{w.ns}/a" in p.message]
    assert named, f"the pool never named a while a was in use\n{timeline.text()}"
    for s in c_sent:
        o = s.out
        assert o is not None, timeline.text()
        deadline = s.at + 20.0
        if deadline < c_ready - 2.0:
            assert (o.status, o.kind) == (504, "activation_timeout"), f"c sent {s.at - t0:+.1f}s: {o}\n{timeline.text()}"
        elif deadline > c_ready + 2.0:
            assert o.kind == "complete", f"c sent {s.at - t0:+.1f}s: {o}\n{timeline.text()}"
    gone = watch.first(_scaled_in("a"), t0)
    assert gone is not None and _wall(gone) >= _last_active_before(watch, "a", gone) + 10.0 - 0.5, timeline.text()
    assert c_ready - a_end <= 30.0, f"c Ready {c_ready - a_end:.1f}s after a's last request\n{timeline.text()}"
    served = sum(1 for s in c_sent if s.out is not None and s.out.kind == "complete")
    timed_out = sum(1 for s in c_sent if s.out is not None and s.out.kind == "activation_timeout")
    flips = len({s.models["a"].generation for s in watch.during(t0) if s.t <= a_end})
    # Not a rewrite per request: shortened once when promised (a restore and a second promise at most).
    assert flips <= 3, f"a's ScaledObject rewritten {flips - 1} times while in use\n{timeline.text()}"
    phases(timeline, "anti-thrash (1 GPU, a/c alternating every 2 s for 40 s, yieldAfter 10 s), from the first request", [
        ("pool NoIdleHolder", watch.first(lambda s: (p := s.pools[f"pool/{pool}"]) is not None
                                          and p.contended == "True/NoIdleHolder", t0)),
        ("a's last request ends", a_end), ("a scaled in", gone), ("c bound", watch.first(bound("c"), a_end)),
        ("c Ready", c_ready)], t0)
    print(f"anti-thrash: 0 swaps in 40 s; {len(a_sent)} a requests warm (first token max "
          f"{max(o.first_token or 0.0 for o in warm if o):.3f}s); c: {timed_out} x 504, {served} x 200; "
          f"a's ScaledObject generations while in use: {flips}")

    # Control: yieldAfter 0 — the same alternation swaps the GPU back and forth.
    w.cluster.kubectl("patch", "acceleratorpool", pool, "--type=merge", "-p", '{"spec":{"yieldAfter":"0s"}}')
    t1 = time.monotonic() + 0.5
    bound_before = _bound_pods(watch, watch.last.t)
    control = _alternate(w, t1, CONTROL_SECONDS)
    _wait_sent(control, CONTROL_SECONDS + 40)
    swaps = sorted(_bound_pods(watch, t1, t1 + CONTROL_SECONDS) - bound_before)
    timeline.note(f"control swaps: {swaps}")
    kinds = [f"{s.model}@{s.at - t1:+.0f}s:{s.out.status}" for s in control if s.out is not None]
    when = []
    for pod in swaps:
        model, name = pod.split("/", 1)
        t = watch.first(lambda s, m=model, n=name: any(p.name == n and p.node for p in s.models[m].pods), t1)
        when.append(f"{model} {t - t1:+.1f}s" if t is not None else f"{model} ?")
    print(f"control (yieldAfter 0s): {len(swaps)} swap(s) in {CONTROL_SECONDS:.0f} s, bound at {', '.join(when)}; "
          f"requests: {kinds}")
    assert len(swaps) >= 2, f"yieldAfter 0 swapped {len(swaps)} time(s) in {CONTROL_SECONDS}s\n{timeline.text()}"
    w.client.check_nothing_lost()



# --- 9. demand while yielding; Metacontroller restarted mid-yield ------------------------------------------

YIELD_AFTER = 8  # this scenario's yieldAfter (see the test)


@pytest.mark.timeout(300)
def test_demand_while_yielding_moves_the_yield_and_a_metacontroller_restart_mid_yield_ends_in_the_same_state(
        world: Callable[[str], World], cluster: Cluster, timeline: Timeline) -> None:
    w = world("moving")
    w.node("n1", gpus=2)
    w.add_models({"a": {}, "b": {}, "c": {}})
    watch = w.start_watch()
    # yieldAfter 8 s here: a must be listed *and* asked inside it. KEDA's Active=False lags a stream's end
    # by 1-3 s and lastActiveTime is truncated to the second, which left about 1 s of margin with 5 s.
    pool = w.pool(yield_after=f"{YIELD_AFTER}s")
    pool_ready(watch, pool)
    w.warm("a", "b", gap=0.0)
    w.wait_idle("a", "b", past_yield_after=False)
    # a streams 3 s, b 5 s: a becomes idle first (the least recently used), both well inside yieldAfter.
    for name, seconds in (("a", 3), ("b", 5)):
        long_stream(w.models[name], seconds)
        w.client.ask_later(w.models[name], tokens=seconds)
    time.sleep(1.0)
    before = dict(watch.last.models)
    t0 = time.monotonic()
    c_req = _send_at(w, "c", t0)
    listed = watch.wait("pool lists a for c", lambda s: f"{w.ns}/a-backend" in yielded_now(s, pool), timeout=20)
    floor_a = _last_active_before(watch, "a", listed + 0.01) + YIELD_AFTER
    # Demand for a while it is listed and still inside its yieldAfter.
    t_a = time.monotonic()
    a_out = w.client.ask(w.models["a"], tokens=3)
    _wait_sent([c_req], 70)
    out = c_req.out
    assert out is not None and out.kind == "complete" and out.first_token is not None, f"{out}\n{timeline.text()}"
    assert _wall(listed) < floor_a and _wall(t_a) < floor_a - 0.5, \
        f"a was past its yieldAfter when listed/asked: {floor_a - _wall(listed):.2f}s\n{timeline.text()}"
    assert a_out.kind == "complete" and a_out.first_token is not None and a_out.first_token <= 2.0, \
        f"a not served warm: {a_out}\n{timeline.text()}"
    b_gone = watch.first(_scaled_in("b"), t0)
    assert b_gone is not None, timeline.text()
    floor_b = _last_active_before(watch, "b", b_gone) + YIELD_AFTER
    phases(timeline, "demand while yielding (a listed, then asked), from c's cold request", [
        ("pool lists a", listed), ("a's floor", floor_a - _wall(0.0)), ("a asked", t_a),
        ("a Active=True", watch.first(lambda s: s.models["a"].active.startswith("True"), t_a)),
        ("pool lists b", watch.first(lambda s: f"{w.ns}/b-backend" in yielded_now(s, pool), t0)),
        ("b's floor", floor_b - _wall(0.0)), ("b scaled in", b_gone),
        ("c bound", watch.first(bound("c"), t0)), ("c first token", t0 + out.first_token)], t0)
    assert out.first_token <= FIRST_BYTE_BUDGET, f"{out}\n{timeline.text()}"
    assert _wall(b_gone) >= floor_b - 0.5, timeline.text()
    assert all(s.models["a"].replicas == 1 and s.models["a"].pods == before["a"].pods
               and not any(p.deleting for p in s.models["a"].pods) for s in watch.during(t0)), \
        f"a was touched\n{timeline.text()}"
    assert yielded(watch, pool, t0) == {f"{w.ns}/a-backend", f"{w.ns}/b-backend"}, timeline.text()
    assert watch.last.models["b"].replicas == 0, timeline.text()

    # Metacontroller stopped right after the pool lists a victim, and started again 5 s later. c, then a,
    # used moments ago (c the least recently): the victim c cannot be scaled in before its floor, so the
    # yield is still to come when Metacontroller stops. b, now at zero, is the cold waiter.
    w.wait_idle("a", "c", past_yield_after=False)
    for name in ("c", "a"):
        backend = w.models[name].server.backend
        backend.tokens, backend.stream_delay = 2, 0.5
        used = w.client.ask(w.models[name], tokens=2)
        assert used.kind == "complete", f"{used}\n{timeline.text()}"
    w.models["b"].server.backend.tokens, w.models["b"].server.backend.stream_delay = 5, 0.0
    before = dict(watch.last.models)
    t1 = time.monotonic()
    b_req = _send_at(w, "b", t1)
    listed = watch.wait("pool lists a victim for b", lambda s: bool(yielded_now(s, pool)), timeout=20)
    cluster.stop_metacontroller()
    stopped = time.monotonic()
    victim_at_stop = sorted(yielded_now(watch.last, pool))
    cooldown_at_stop = watch.last.models["c"].cooldown
    try:
        time.sleep(5.0)
    finally:
        cluster.restart_metacontroller()
    restarted = time.monotonic()
    _wait_sent([b_req], 70)
    out = b_req.out
    assert out is not None and out.kind == "complete" and out.first_token is not None, f"{out}\n{timeline.text()}"
    settled = watch.wait("yielding empty, c's cooldown restored, no waiters", lambda s: (
        (p := s.pools[f"pool/{pool}"]) is not None and not p.yielding and p.contended == "False/NoWaiters"
        and s.models["c"].cooldown == COOLDOWN_SECONDS), timeout=40)
    c_gone = watch.first(_scaled_in("c"), t1)
    assert c_gone is not None, timeline.text()
    floor_c = _last_active_before(watch, "c", c_gone) + YIELD_AFTER
    phases(timeline, f"Metacontroller stopped mid-yield (pool listed {victim_at_stop}, c's cooldown {cooldown_at_stop}), "
                     "from b's cold request", [
        ("pool lists c", listed), ("Metacontroller stopped", stopped), ("Metacontroller restarted", restarted),
        ("c cooldownPeriod 8", watch.first(lambda s: s.models["c"].cooldown == YIELD_AFTER, t1)),
        ("c's floor", floor_c - _wall(0.0)), ("c scaled in", c_gone), ("b bound", watch.first(bound("b"), t1)),
        ("b first token", t1 + out.first_token), ("settled", settled)], t1)
    assert victim_at_stop == [f"{w.ns}/c-backend"], victim_at_stop
    assert _wall(stopped) < floor_c, f"c could be scaled in before Metacontroller stopped\n{timeline.text()}"
    assert _wall(c_gone) >= floor_c - 0.5, timeline.text()
    final = watch.last.models
    assert final["c"].replicas == 0 and not final["c"].pods, timeline.text()
    assert final["a"].replicas == 1 and final["b"].replicas == 1, timeline.text()
    untouched(watch, t1, "a", before["a"])
    assert yielded(watch, pool, t1) == {f"{w.ns}/c-backend"}, timeline.text()
    w.client.check_nothing_lost()

