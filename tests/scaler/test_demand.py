import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from scaler.demand import IDLE, Demand, DemandBroadcaster, TooManyWaiters

ROOT = Path(__file__).resolve().parents[2]


def test_demand_total_and_active() -> None:
    assert IDLE.total == 0 and not IDLE.active
    assert Demand(queued=2, in_flight=3).total == 5
    assert Demand(queued=1).active and Demand(in_flight=1).active
    assert Demand(lease_active=True).active and Demand(lease_active=True).total == 0
    with pytest.raises(ValueError):
        Demand(queued=-1)
    with pytest.raises(AttributeError):
        Demand().queued = 3  # type: ignore[misc]


def test_publish_bumps_version_only_on_change() -> None:
    b = DemandBroadcaster()
    assert b.snapshot() == (0, IDLE)
    assert b.publish(Demand(queued=1)) is True
    assert b.publish(Demand(queued=1)) is False
    assert b.snapshot() == (1, Demand(queued=1))
    with pytest.raises(TypeError):
        b.publish({"queued": 1})  # type: ignore[arg-type]


def test_wait_returns_at_once_when_version_already_differs() -> None:
    b = DemandBroadcaster()
    b.publish(Demand(queued=4))
    t0 = time.monotonic()
    assert b.wait_for_change(0, 30.0) == (1, Demand(queued=4))
    assert time.monotonic() - t0 < 5


def test_wait_times_out_with_same_version() -> None:
    b = DemandBroadcaster()
    version, demand = b.wait_for_change(0, 0.05)
    assert (version, demand) == (0, IDLE)
    assert b.waiter_count == 0


def test_many_threads_woken_by_one_publish() -> None:
    b = DemandBroadcaster()
    results: list[tuple[int, Demand]] = []
    lock = threading.Lock()

    def wait() -> None:
        r = b.wait_for_change(0, 30.0)
        with lock:
            results.append(r)

    threads = [threading.Thread(target=wait) for _ in range(50)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while b.waiter_count < 50 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert b.waiter_count == 50
    b.publish(Demand(in_flight=7))
    for t in threads:
        t.join(30)
    assert len(results) == 50 and all(r == (1, Demand(in_flight=7)) for r in results)
    assert b.waiter_count == 0


def test_waiter_bound_is_enforced() -> None:
    b = DemandBroadcaster(max_waiters=2)
    started = threading.Barrier(3)

    def wait() -> None:
        started.wait(10)
        b.wait_for_change(0, 30.0)

    threads = [threading.Thread(target=wait) for _ in range(2)]
    for t in threads:
        t.start()
    started.wait(10)
    deadline = time.monotonic() + 30
    while b.waiter_count < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    with pytest.raises(TooManyWaiters):
        b.wait_for_change(0, 30.0)
    b.publish(Demand(queued=1))
    for t in threads:
        t.join(30)
    assert b.waiter_count == 0


def test_gevent_patched_process_greenlets_and_native_threads() -> None:
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("_gevent_demand_probe.py"))],
        cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert facts["greenlet_by_greenlet"] == [1, 1]
    assert facts["ticks_while_waiting"] == 5  # the hub kept running other greenlets
    version, in_flight, waited = facts["greenlet_by_native"]
    assert (version, in_flight) == (1, 2) and waited < 9  # woken, not timed out
    assert facts["native_by_greenlet"] == [1, True]
    assert facts["timeout"] == [True, True]


def test_interrupt_wakes_waiters_without_a_change() -> None:
    b = DemandBroadcaster()
    out: list[tuple[int, Demand]] = []
    t = threading.Thread(target=lambda: out.append(b.wait_for_change(0, 30.0)))
    t.start()
    deadline = time.monotonic() + 30
    while b.waiter_count == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    t0 = time.monotonic()
    assert b.interrupt_waiters() == 1
    t.join(30)
    assert out == [(0, IDLE)] and time.monotonic() - t0 < 10


def test_no_lost_wakeups_under_concurrent_publishers() -> None:
    """Waiters loop on wait_for_change while publishers race; every waiter ends on the final
    version well before its (long) timeout, i.e. no change was missed between check and wait."""
    b = DemandBroadcaster()
    final = Demand(queued=10_000)
    finished: list[float] = []
    lock = threading.Lock()

    def waiter() -> None:
        seen = -1
        while True:
            seen, demand = b.wait_for_change(seen, 20.0)
            if demand == final:
                with lock:
                    finished.append(time.monotonic())
                return

    def publisher(offset: int) -> None:
        for i in range(2000):
            b.publish(Demand(queued=(i * 4 + offset) % 9_999))

    waiters = [threading.Thread(target=waiter) for _ in range(8)]
    publishers = [threading.Thread(target=publisher, args=(k,)) for k in range(4)]
    for t in waiters + publishers:
        t.start()
    for t in publishers:
        t.join(60)
    published_at = time.monotonic()
    b.publish(final)
    for t in waiters:
        t.join(60)
    assert len(finished) == 8 and max(finished) - published_at < 10.0


def test_activity_waiters_sleep_through_count_changes() -> None:
    b = DemandBroadcaster()
    b.publish(Demand(in_flight=1))
    assert b.activity_version == 1 and b.version == 1
    out: list[tuple[int, Demand]] = []
    t = threading.Thread(target=lambda: out.append(b.wait_for_activity_change(1, 30.0)))
    t.start()
    deadline = time.monotonic() + 30
    while b.waiter_count == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    for n in range(2, 50):  # warm-path churn: counts move, the flag stays true
        b.publish(Demand(in_flight=n))
    assert b.version == 49 and b.activity_version == 1
    assert b.waiter_count == 1 and not out  # still asleep
    b.publish(Demand())
    t.join(30)
    assert out == [(2, Demand())]
    assert b.wait_for_activity_change(1, 30.0) == (2, Demand())  # already flipped: at once


def test_waiters_leaving_while_publisher_wakes_them_never_break_publish() -> None:
    """Regression: a waiter timing out used to discard itself from the set a publisher was iterating."""
    b = DemandBroadcaster(max_waiters=256)
    errors: list[BaseException] = []
    stop = threading.Event()

    def waiter() -> None:
        seen = 0
        while not stop.is_set():
            try:
                seen, _ = b.wait_for_change(seen, timeout=0.001)
            except BaseException as exc:  # noqa: BLE001 - any failure is the bug
                errors.append(exc)
                return

    threads = [threading.Thread(target=waiter, daemon=True) for _ in range(64)]
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, so the interleaving happens
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 2.0
        n = 0
        while time.monotonic() < deadline:
            n += 1
            b.publish(Demand(queued=n % 7))
    except BaseException as exc:  # noqa: BLE001
        errors.append(exc)
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        sys.setswitchinterval(old_interval)
    assert errors == []
