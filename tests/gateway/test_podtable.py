"""gateway.state.podtable: per-Pod counters summed over workers, bounded by its slots."""

from __future__ import annotations

from gateway.state.pod import PodState
from gateway.state.podtable import OTHER, SLOTS, PodTable


def test_workers_sum_by_pod_and_a_departed_pod_leaves() -> None:
    table = PodTable(2)
    w0, w1 = table.row(0), table.row(1)
    a0, a1, b1 = w0.slot("pod-a"), w1.slot("pod-a"), w1.slot("pod-b")
    for row, slot in ((w0, a0), (w0, a0), (w1, a1), (w1, b1)):
        row.sent(slot)
    w0.finished(a0)
    assert table.totals() == {"pod-a": (2.0, 3.0), "pod-b": (1.0, 1.0)}
    w1.free("pod-b")
    assert "pod-b" not in table.totals()
    assert w1.slot("pod-c") == b1 and table.totals()["pod-c"] == (0.0, 0.0)  # the slot reused, counters fresh


def test_more_pods_than_slots_count_as_other() -> None:
    table = PodTable(1)
    row = table.row(0)
    for i in range(SLOTS + 5):
        row.sent(row.slot(f"pod-{i}"))
    totals = table.totals()
    assert len(totals) == SLOTS + 1 and totals[OTHER] == (5.0, 5.0)


def test_a_dead_workers_table_is_cleared() -> None:
    pod = PodState(2, 4, None)
    row = pod.backend_pods.row(1)
    row.sent(row.slot("pod-a"))
    pod.reclaim(1)
    assert pod.backend_pods.totals() == {}
