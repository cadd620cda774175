"""Run in a subprocess: gevent-patched process exercising DemandBroadcaster across greenlets and a
native OS thread. Prints one JSON line with the observed facts; the test asserts on them."""

from gevent import monkey

monkey.patch_all()

import json  # noqa: E402
import time  # noqa: E402

import gevent  # noqa: E402

from scaler.demand import Demand, DemandBroadcaster  # noqa: E402

native_start = monkey.get_original("_thread", "start_new_thread")
native_sleep = monkey.get_original("time", "sleep")
result: dict[str, object] = {}

# 1. greenlet waiter woken by a greenlet publisher; other greenlets keep running while it waits.
b = DemandBroadcaster()
ticks = []


def ticker() -> None:
    for _ in range(5):
        ticks.append(1)
        gevent.sleep(0.01)


def publisher() -> None:
    gevent.sleep(0.1)
    b.publish(Demand(queued=1))


def wait_and_count() -> tuple[int, int, int]:
    version, demand = b.wait_for_change(0, 10.0)
    return version, demand.queued, len(ticks)  # ticks seen at wake-up: the hub ran meanwhile


waiter = gevent.spawn(wait_and_count)
gevent.joinall([gevent.spawn(ticker), gevent.spawn(publisher), waiter], timeout=10)
result["greenlet_by_greenlet"] = list(waiter.value[:2])
result["ticks_while_waiting"] = waiter.value[2]

# 2. greenlet waiter woken by a publisher in a native OS thread.
b2 = DemandBroadcaster()


def native_publish() -> None:
    native_sleep(0.1)
    b2.publish(Demand(in_flight=2))


t0 = time.monotonic()
native_start(native_publish, ())
version, demand = b2.wait_for_change(0, 10.0)
result["greenlet_by_native"] = [version, demand.in_flight, round(time.monotonic() - t0, 3)]

# 3. native OS thread waiter (no hub in its thread) woken by a greenlet publisher, and the hub
#    keeps scheduling greenlets while that native thread is blocked.
b3 = DemandBroadcaster()
native_result: list[object] = []
done = monkey.get_original("_thread", "allocate_lock")()
done.acquire()


def native_wait() -> None:
    native_result.append(b3.wait_for_change(0, 10.0))
    done.release()


native_start(native_wait, ())
deadline = time.monotonic() + 10
while b3.waiter_count == 0 and time.monotonic() < deadline:
    gevent.sleep(0.005)
g = gevent.spawn(b3.publish, Demand(lease_active=True))
g.join(5)
done.acquire(timeout=10)
v3, d3 = native_result[0]
result["native_by_greenlet"] = [v3, d3.lease_active]

# 4. timeout path in a greenlet returns the unchanged version.
t0 = time.monotonic()
v4, _ = b3.wait_for_change(v3, 0.05)
result["timeout"] = [v4 == v3, time.monotonic() - t0 >= 0.04]
print(json.dumps(result))
