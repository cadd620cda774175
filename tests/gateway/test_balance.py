"""gateway.balance: least outstanding, consistent hashing with bounded loads, the cold batch."""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.balance import AffinityRing, bound, choose, key_hash


@dataclass
class Pod:
    name: str
    outstanding: int = 0


def pods(*loads: int) -> list[Pod]:
    return [Pod(f"pod-{i}", load) for i, load in enumerate(loads)]


def test_least_outstanding_and_ties_in_turn() -> None:
    p = pods(3, 1, 2)
    assert choose(p).pod is p[1]
    tied = pods(0, 0, 0)
    assert [choose(tied, turn=t).pod.name for t in range(3)] == ["pod-0", "pod-1", "pod-2"]


def test_a_new_pod_gets_the_next_requests_at_once() -> None:
    p = pods(5, 5)
    p.append(Pod("new"))
    placed = []
    for turn in range(6):
        chosen = choose(p, turn=turn).pod
        chosen.outstanding += 1
        placed.append(chosen.name)
    assert placed[:5] == ["new"] * 5  # until it has as many as the others


def test_cold_batch_leaves_no_room_then_some() -> None:
    p = pods(2, 2)
    assert choose(p, batch=2) is None
    p[1].outstanding = 1
    assert choose(p, batch=2).pod is p[1]
    assert choose([], batch=2) is None


def test_one_pod_is_no_affinity_decision() -> None:
    p = pods(0)
    ring = AffinityRing(["pod-0", "pod-1"])
    assert choose(p, key=1, ring=ring).affinity == "none"


def test_a_key_goes_home_while_under_the_bound() -> None:
    p = pods(0, 0, 0)
    ring = AffinityRing([x.name for x in p])
    key = key_hash(b"conversation-1")
    home = ring.walk(key)[0]
    for _ in range(5):  # sequential requests: each finishes before the next
        choice = choose(p, key=key, ring=ring)
        assert choice.pod.name == home and choice.affinity == "hit"


def test_a_hot_key_spills_to_the_next_pod_on_its_walk() -> None:
    p = pods(0, 0, 0)
    ring = AffinityRing([x.name for x in p])
    key = key_hash(b"hot")
    walk = ring.walk(key)
    outcomes = []
    for _ in range(9):
        choice = choose(p, key=key, ring=ring, factor=1.25)
        choice.pod.outstanding += 1
        outcomes.append((choice.pod.name, choice.affinity))
    by_pod = {x.name: x.outstanding for x in p}
    assert sorted(by_pod.values()) == [3, 3, 3]  # one hot prefix spreads evenly
    assert outcomes[0] == (walk[0], "hit")
    assert any(kind == "spill" for _, kind in outcomes)


def test_few_requests_of_one_key_leave_no_pod_idle() -> None:
    """Six clients with one prompt over three Pods (the rounding up of the classic bound gave 3 / 3 / 0)."""
    p = pods(0, 0, 0)
    ring = AffinityRing([x.name for x in p])
    for _ in range(6):
        choose(p, key=key_hash(b"one prompt"), ring=ring).pod.outstanding += 1
    assert [x.outstanding for x in p] == [2, 2, 2]


def test_many_conversations_stay_home_until_their_pod_is_a_quarter_over_the_mean() -> None:
    p = pods(10, 10, 10)
    ring = AffinityRing([x.name for x in p])
    key = key_hash(b"conversation")
    home = ring.walk(key)[0]
    by_name = {x.name: x for x in p}
    by_name[home].outstanding = 12  # 12 + 1 <= 1.25 * 33 / 3 = 13.75: still home
    assert choose(p, key=key, ring=ring).pod.name == home
    by_name[home].outstanding = 13  # 14 > 1.25 * 34 / 3 = 14.17? no: 14 <= 14.17, home
    assert choose(p, key=key, ring=ring).pod.name == home
    by_name[home].outstanding = 14  # 15 > 1.25 * 35 / 3 = 14.58: spill
    assert choose(p, key=key, ring=ring).affinity == "spill"


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=1, max_value=8), st.lists(st.tuples(st.integers(0, 50), st.booleans()), max_size=200),
       st.floats(min_value=1.0, max_value=3.0))
def test_no_placement_ever_exceeds_the_bound(n: int, steps: list[tuple[int, bool]], factor: float) -> None:
    """Whatever the keys and whenever requests finish: a Pod receives a request only while its load
    stays within max(least + 1, factor * (total + 1) / n) (gateway.balance.bound)."""
    p = pods(*([0] * n))
    ring = AffinityRing([x.name for x in p])
    rng = random.Random(len(steps))
    for key, finish in steps:
        if finish and any(x.outstanding for x in p):
            rng.choice([x for x in p if x.outstanding]).outstanding -= 1
            continue
        limit = bound(sum(x.outstanding for x in p), n, factor, least=min(x.outstanding for x in p))
        choice = choose(p, key=key_hash(b"%d" % key), ring=ring, factor=factor)
        assert choice.pod.outstanding + 1 <= limit
        choice.pod.outstanding += 1


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(alphabet="abcdefghij-0123456789", min_size=1, max_size=20), min_size=2, max_size=10,
                unique=True), st.lists(st.binary(max_size=30), min_size=1, max_size=50))
def test_the_ring_is_the_same_in_every_process_and_moves_only_what_a_pod_takes(names: list[str],
                                                                                keys: list[bytes]) -> None:
    shuffled = list(reversed(names))
    a, b = AffinityRing(names), AffinityRing(shuffled)
    grown = AffinityRing([*names, "joined-pod"])
    for raw in keys:
        key = key_hash(raw)
        assert a.walk(key) == b.walk(key)  # every worker and replica agrees
        home, new_home = a.walk(key)[0], grown.walk(key)[0]
        assert new_home in (home, "joined-pod")  # a joining Pod only takes keys, never reshuffles others


def test_ring_shares_are_balanced_enough() -> None:
    ring = AffinityRing(["backend-7d9f-abcde", "backend-7d9f-fghij", "backend-7d9f-klmno"])
    homes: dict[str, int] = {}
    for i in range(6000):
        home = ring.walk(key_hash(b"key-%d" % i))[0]
        homes[home] = homes.get(home, 0) + 1
    assert min(homes.values()) >= 6000 * 0.2  # no Pod near starved of keys (a third would be 2000)
