"""gateway.state.endpoints: each eligibility rule alone, then the merge of a Service's Pods."""

from __future__ import annotations

from gateway.state.endpoints import (
    ELIGIBILITY,
    MAX_PODS,
    BackendPod,
    BackendPods,
    PodEndpoint,
    answered,
    connect_failed,
    kubelet_ready,
    terminating,
    unready_again,
    verdict,
)


def ep(name: str = "p", *, ready: bool = False, terminating_: bool = False, address: str = "10.0.0.1") -> PodEndpoint:
    return PodEndpoint(name, address, 8000, ready, ready, terminating_)


def pod(**kw: bool) -> BackendPod[None]:
    return BackendPod(ep(**kw), None)


def test_rules_alone() -> None:
    assert terminating(pod(terminating_=True)) is False and terminating(pod()) is None
    p = pod(ready=True)
    assert unready_again(p) is None
    p.endpoint = ep(ready=False)
    assert unready_again(p) is False  # Ready once, then not: the kubelet's word stands
    assert unready_again(pod()) is None  # never Ready yet: starting, not excluded
    q = pod()
    q.connect_failed = True
    assert connect_failed(q) is False and connect_failed(pod()) is None
    assert kubelet_ready(pod(ready=True)) is True and kubelet_ready(pod()) is None
    r = pod()
    r.answered = True
    assert answered(r) is True and answered(pod()) is None


def test_rules_in_order() -> None:
    assert [rule.__name__ for rule in ELIGIBILITY] == ["terminating", "unready_again", "connect_failed",
                                                       "kubelet_ready", "answered"]
    p = pod(ready=True, terminating_=True)
    assert verdict(p) is False  # terminating wins over ready
    q = pod(ready=True)
    q.connect_failed = True
    assert verdict(q) is False  # a failed connection wins over the slice's ready (until a probe passes)
    assert verdict(pod()) is None  # starting


def test_merge_keeps_state_and_replaces_a_moved_pod() -> None:
    retired: list[object] = []
    made = iter(range(100))
    pods = BackendPods(lambda e: next(made), retired.append)
    change = pods.update([ep("a"), ep("b", ready=True)], now=1.0)
    assert change.added == ("a", "b") and change.kubelet_ready == ("b",)
    assert [p.name for p in pods.eligible] == ["b"] and [p.name for p in pods.starting] == ["a"]
    pods.by_name["a"].outstanding = 3
    change = pods.update([ep("a", ready=True), ep("b", ready=True, address="10.0.0.9")], now=2.0)
    assert pods.by_name["a"].outstanding == 3 and change.kubelet_ready == ("a", "b")
    assert change.added == ("b",) and retired == [1]  # b's new address: a new Pod, its old pool retired
    assert pods.by_name["a"].kubelet_ready_at == 2.0
    change = pods.update([ep("b", ready=True, address="10.0.0.9")], now=3.0)
    assert change.removed == ("a",) and retired == [1, 0]


def test_probes_and_failures() -> None:
    pods = BackendPods(lambda e: None, lambda p: None)
    pods.update([ep("a"), ep("b", ready=True)], now=0.0)
    a, b = pods.by_name["a"], pods.by_name["b"]
    assert pods.to_probe() == [a]
    assert pods.probed(a, True, now=5.0) and a.answered_at == 5.0 and a in pods.eligible
    pods.connection_failed(b)
    assert b not in pods.eligible and pods.to_probe() == [b]
    assert pods.probed(b, True, now=6.0) and b in pods.eligible
    pods.update([ep("a", ready=True), ep("b", ready=False)], now=7.0)  # b: the kubelet says unready again
    assert b not in pods.eligible and b not in pods.starting and pods.to_probe() == []


def test_bounded_pods() -> None:
    pods = BackendPods(lambda e: None, lambda p: None)
    pods.update([ep(f"pod-{i:04d}", ready=True) for i in range(MAX_PODS + 50)], now=0.0)
    assert pods.listed == MAX_PODS
