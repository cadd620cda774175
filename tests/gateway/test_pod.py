"""The Pod-wide state shared by worker processes: exact admission across processes, tickets of a
dead worker returned, demand coalesced (cold flips wake the sampler, warm traffic does not)."""

from __future__ import annotations

import os

from gateway.state.pod import TRANSITIONS, PodState
from scaler.demand import Demand, DemandBroadcaster


def test_forked_workers_flooding_admit_exactly_max_queue() -> None:
    pod = PodState(4, max_queue=50, max_held_bytes=None)
    read_end, write_end = os.pipe()
    pids = []
    for _ in range(4):  # four processes race for 4 x 1,000 tickets
        pid = os.fork()
        if pid == 0:
            got = sum(pod.try_take_slot() for _ in range(1000))
            os.write(write_end, b"%d\n" % got)
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    os.close(write_end)
    counts = [int(x) for x in os.read(read_end, 1024).split()]
    os.close(read_end)
    assert sum(counts) == 50 and len(counts) == 4
    assert not pod.try_take_slot()
    pod.give_slot()
    assert pod.try_take_slot()


def test_held_bytes_are_one_budget_for_the_pod() -> None:
    pod = PodState(2, max_queue=10, max_held_bytes=1000)
    assert pod.try_take_bytes(600) and not pod.try_take_bytes(500) and pod.try_take_bytes(400)
    pod.give_bytes(1000)
    assert pod.held_bytes == 0


def test_a_dead_workers_tickets_return_to_the_pod() -> None:
    pod = PodState(2, max_queue=3, max_held_bytes=None)
    row = pod.row(1)
    for _ in range(3):
        assert pod.try_take_slot()
    row.write_demand(2, 1, True)
    assert not pod.try_take_slot()
    assert pod.reclaim(1) == (3, 0)
    assert pod.demand() == Demand() and all(pod.try_take_slot() for _ in range(3))


def test_a_dead_workers_held_bytes_and_activation_claim_return_to_the_pod() -> None:
    # SIGKILL leaves no finally block: the supervisor gives back what the row says the worker held.
    pod = PodState(2, max_queue=10, max_held_bytes=1000)
    assert pod.try_take_bytes(300, worker=0) and pod.try_take_bytes(600, worker=1)
    assert not pod.try_take_bytes(200, worker=0)
    assert pod.claim_activation(5.0, stale_after=300.0, worker=1)
    assert pod.reclaim(1) == (0, 600)
    assert pod.held_bytes == 300 and pod.try_take_bytes(700, worker=0)  # at the budget exactly
    assert not pod.try_take_bytes(1, worker=0)
    assert pod.claim_activation(6.0, stale_after=300.0, worker=0)  # the dead worker's claim is gone
    assert pod.reclaim(1) == (0, 0)  # reclaiming a worker that holds nothing changes nothing
    assert pod.held_bytes == 1000 and not pod.claim_activation(7.0, stale_after=300.0, worker=1)


def test_warm_traffic_never_wakes_the_sampler_but_is_seen_by_it() -> None:
    pod = PodState(1, max_queue=10, max_held_bytes=None)
    row = pod.row(0)
    for _ in range(100):  # warm requests: in flight +1 / -1
        row.write_demand(0, 1, False)
        row.write_demand(0, 0, False)
    assert not pod.notify.acquire(False)  # no wake-up at all
    assert pod.cells[row.base + TRANSITIONS] == 100
    demand, seen = pod.sample(0.0)
    assert demand.active and demand.in_flight == 1  # came and went since the last sample: still busy
    demand, seen = pod.sample(seen)
    assert not demand.active  # nothing new since
    row.write_demand(1, 0, True)  # a cold request: the sampler is woken at once
    assert pod.notify.acquire(False)


def test_sampler_publishes_the_sum_and_withdraws() -> None:
    pod = PodState(2, max_queue=10, max_held_bytes=None)
    pod.row(0).write_demand(2, 0, True)
    pod.row(1).write_demand(1, 3, False)
    from gateway.state.pod import DemandSampler

    broadcaster = DemandBroadcaster()
    sampler = DemandSampler(pod, broadcaster, interval=0.01)
    sampler.publish_now()
    assert broadcaster.current() == Demand(3, 3, True)
    sampler.withdraw()
    assert broadcaster.current() == Demand()


def test_a_worker_killed_inside_the_pod_lock_does_not_freeze_the_pod() -> None:
    # SIGKILL can land between a worker's lock acquire and release (and between its two stores):
    # the supervisor's reclaim takes the lock back and recounts the held bytes from the living rows.
    import time

    pod = PodState(2, max_queue=10, max_held_bytes=1000)
    assert pod.try_take_bytes(100, worker=0)
    pid = os.fork()
    if pid == 0:  # worker 1: takes the lock, stores half of an update, dies
        pod._lock.acquire()
        pod.cells[pod._pod] += 500
        os.kill(os.getpid(), 9)
    os.waitpid(pid, 0)
    started = time.monotonic()
    assert pod.reclaim(1) == (0, 0)
    assert time.monotonic() - started < 5
    assert pod.held_bytes == 100  # the dead worker's half-stored 500 is gone
    assert pod.try_take_bytes(900, worker=0) and not pod.try_take_bytes(1, worker=0)


def test_the_sampler_parks_while_nothing_warm_can_happen_and_every_way_out_wakes_it() -> None:
    """No worker believes the backend ready and nothing is queued: every request is cold, so its flip
    posts the sampler, which need not wake 10 times a second. A readiness flip posts it as well."""
    from gateway.state.pod import BACKEND_READY, PARKED_SECONDS, DemandSampler

    pod = PodState(2, max_queue=10, max_held_bytes=None)
    sampler = DemandSampler(pod, DemandBroadcaster(), interval=0.1)
    assert sampler._wait() == PARKED_SECONDS
    row = pod.row(1)
    row.set_flag(BACKEND_READY, True)
    assert pod.notify.acquire(False) and not pod.notify.acquire(False)  # one post per flip
    assert sampler._wait() == 0.1  # warm traffic is only seen by sampling
    row.set_flag(BACKEND_READY, True)
    assert not pod.notify.acquire(False)  # no flip, no post (the probe sets it 10 times a second)
    row.set_flag(BACKEND_READY, False)
    assert pod.notify.acquire(False)
    assert sampler._wait() == PARKED_SECONDS
    row.write_demand(1, 0, True)  # a cold request: posted (tested above) and sampled at the interval
    assert sampler._wait() == 0.1
    row.write_demand(0, 0, False)
    assert sampler._wait() == PARKED_SECONDS
    sampler.withdraw()
    assert sampler._wait() == 0.1


def test_a_parked_sampler_publishes_a_cold_flip_at_once() -> None:
    import time

    from gateway.state.pod import DemandSampler

    pod = PodState(1, max_queue=10, max_held_bytes=None)
    broadcaster = DemandBroadcaster()
    sampler = DemandSampler(pod, broadcaster, interval=0.1).start()
    try:
        time.sleep(0.3)  # parked by now (for PARKED_SECONDS)
        row = pod.row(0)
        started = time.monotonic()
        row.write_demand(1, 0, True)
        while not broadcaster.current().active and time.monotonic() - started < 2.0:
            time.sleep(0.005)
        assert broadcaster.current() == Demand(1, 0, True)
        # Correctness, not speed: published within the 2 s bound above, far inside the park.
    finally:
        sampler.stop()
