"""Demand of one LLMService and a broadcaster that wakes waiters on every change.

The broadcaster is shared by code that runs in three different worlds:

* plain OS threads (grpcio's thread pool in the aggregate scaler, tests);
* gevent greenlets of a ``gevent.monkey.patch_all()`` gateway (admission publishes, the in-process
  gRPC scaler waits in greenlets once ``grpc.experimental.gevent.init_gevent()`` is active);
* native OS threads inside that same patched process (``gevent.threadpool`` or anything started
  with the original ``_thread.start_new_thread``).

So the state is guarded by a *native* lock (held only for a few assignments, never across a wait,
so a greenlet taking it can't stall its hub for long), and each waiter brings its own wake-up
primitive that matches the world it blocks in: a native lock for an OS thread without a gevent
hub, a ``gevent.event.Event`` for a greenlet. A publisher in another OS thread wakes a greenlet
through ``loop.run_callback_threadsafe``, the one gevent entry point that is safe across threads.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["Demand", "DemandBroadcaster", "TooManyWaiters", "IDLE"]


def _original(module: str, name: str) -> Any:
    """The unpatched stdlib object, whether or not gevent has monkey-patched the process."""
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None:
        return monkey.get_original(module, name)
    return getattr(__import__(module), name)


@dataclass(frozen=True, slots=True)
class Demand:
    """Demand of one gateway (or the sum over gateways): requests waiting, requests being served,
    and whether an activation lease is keeping the backend wanted."""

    queued: int = 0
    in_flight: int = 0
    lease_active: bool = False

    def __post_init__(self) -> None:
        if self.queued < 0 or self.in_flight < 0:
            raise ValueError("demand counts must be >= 0")

    @property
    def total(self) -> int:
        """The scaling metric: queued + in-flight."""
        return self.queued + self.in_flight

    @property
    def active(self) -> bool:
        """What IsActive answers: anything queued or in flight, or a lease still running."""
        return self.total > 0 or self.lease_active


IDLE = Demand()


class TooManyWaiters(RuntimeError):
    """More concurrent ``wait_for_change`` callers than the broadcaster's bound."""


class _Waiter(Protocol):
    def wait(self, timeout: float) -> None: ...

    def wake(self) -> None: ...


class _NativeWaiter:
    """Blocks a real OS thread on an unpatched lock; release() is safe from any thread or greenlet."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = _original("_thread", "allocate_lock")()
        self._lock.acquire()

    def wait(self, timeout: float) -> None:
        if self._lock.acquire(timeout=timeout):
            self._lock.release()

    def wake(self) -> None:
        try:
            self._lock.release()
        except RuntimeError:  # already woken
            pass


class _GreenletWaiter:
    """Blocks the current greenlet only; its hub keeps running every other greenlet."""

    __slots__ = ("_event", "_loop", "_thread_ident", "_get_ident")

    def __init__(self, hub: Any) -> None:
        import gevent.event

        self._event = gevent.event.Event()
        self._loop = hub.loop
        self._get_ident = _original("_thread", "get_ident")
        self._thread_ident = self._get_ident()

    def wait(self, timeout: float) -> None:
        self._event.wait(timeout)

    def wake(self) -> None:
        if self._get_ident() == self._thread_ident:
            self._event.set()
        else:
            # gevent objects belong to their hub's thread; hand the set() over to that loop.
            self._loop.run_callback_threadsafe(self._event.set)


def _make_waiter() -> _Waiter:
    if "gevent" not in sys.modules:
        return _NativeWaiter()
    from gevent._hub_local import get_hub_if_exists
    from greenlet import getcurrent

    hub = get_hub_if_exists()
    if hub is None:
        # No hub in this OS thread means no greenlet lives here that a native block could starve.
        return _NativeWaiter()
    if getcurrent() is hub:
        raise RuntimeError("wait_for_change() cannot block inside the gevent hub")
    return _GreenletWaiter(hub)


class DemandBroadcaster:
    """Latest Demand plus two versions: ``version`` increases on every change, ``activity_version``
    only when ``Demand.active`` flips.

    ``publish`` of a value equal to the current one is not a change (no version bump, nobody
    woken). Waiters that only care about the active flag (StreamIsActive pushes) wait on the
    activity version and are not woken by the in-flight +1/-1 of every warm request.
    """

    DEFAULT_MAX_WAITERS = 4096
    MAX_WAIT_SECONDS = 3600.0

    def __init__(self, initial: Demand = IDLE, *, max_waiters: int = DEFAULT_MAX_WAITERS) -> None:
        if max_waiters < 1:
            raise ValueError("max_waiters must be >= 1")
        self._lock = _original("_thread", "allocate_lock")()
        self._demand = initial
        self._version = 0
        self._activity_version = 0
        self._waiters: set[_Waiter] = set()  # woken on every change
        self._activity_waiters: set[_Waiter] = set()  # woken when the active flag flips
        self._max_waiters = max_waiters

    @property
    def version(self) -> int:
        with self._lock:
            return self._version

    @property
    def activity_version(self) -> int:
        with self._lock:
            return self._activity_version

    def publish(self, demand: Demand, *, force: bool = False) -> bool:
        """Set the current demand; wake the waiters it concerns. Returns True on a change.
        ``force``: a change even when equal (a sum over models stays the same while they move, and
        a reporter of every model's demand must still send)."""
        if not isinstance(demand, Demand):
            raise TypeError("publish() takes a Demand")
        with self._lock:
            if demand == self._demand and not force:
                return False
            flipped = demand.active != self._demand.active
            self._demand = demand
            self._version += 1
            waiters, self._waiters = self._waiters, set()
            if flipped:
                self._activity_version += 1
                activity_waiters, self._activity_waiters = self._activity_waiters, set()
            else:
                activity_waiters = set()
        for waiter in waiters:
            waiter.wake()
        for waiter in activity_waiters:
            waiter.wake()
        return True

    def current(self) -> Demand:
        with self._lock:
            return self._demand

    def snapshot(self) -> tuple[int, Demand]:
        """(version, demand) read together."""
        with self._lock:
            return self._version, self._demand

    def wait_for_change(self, seen_version: int, timeout: float) -> tuple[int, Demand]:
        """Block until the version differs from ``seen_version`` or ``timeout`` seconds pass, then
        return the current (version, demand); the caller compares versions to tell which."""
        return self._wait(False, seen_version, timeout)

    def wait_for_activity_change(self, seen_activity_version: int, timeout: float) -> tuple[int, Demand]:
        """Like ``wait_for_change`` but on ``activity_version``: returns (activity_version, demand)
        once the active flag flipped since ``seen_activity_version``, or at the timeout."""
        return self._wait(True, seen_activity_version, timeout)

    def _read(self, activity: bool) -> tuple[int, Demand]:  # caller holds the lock
        return (self._activity_version if activity else self._version), self._demand

    def _wait(self, activity: bool, seen: int, timeout: float) -> tuple[int, Demand]:
        timeout = min(max(0.0, float(timeout)), self.MAX_WAIT_SECONDS)
        with self._lock:
            version, demand = self._read(activity)
            if version != seen or timeout == 0.0:
                return version, demand
        waiter = _make_waiter()  # outside the lock: may import gevent.event on first use
        with self._lock:
            version, demand = self._read(activity)
            if version != seen:
                return version, demand
            if len(self._waiters) + len(self._activity_waiters) >= self._max_waiters:
                raise TooManyWaiters(f"more than {self._max_waiters} concurrent waiters")
            registry = self._activity_waiters if activity else self._waiters
            registry.add(waiter)
        try:
            waiter.wait(timeout)
        finally:
            with self._lock:
                # Discard from the *current* set: a publisher that swapped the old one out now owns it
                # and iterates it outside the lock, so it must not change under that iteration.
                (self._activity_waiters if activity else self._waiters).discard(waiter)
        with self._lock:
            return self._read(activity)

    def interrupt_waiters(self) -> int:
        """Wake every current waiter without a change (its wait returns the same version), so a
        stream can notice its own cancellation or a server shutdown at once. Returns how many."""
        with self._lock:
            waiters = self._waiters | self._activity_waiters
            self._waiters, self._activity_waiters = set(), set()
        for waiter in waiters:
            waiter.wake()
        return len(waiters)

    @property
    def waiter_count(self) -> int:
        with self._lock:
            return len(self._waiters) + len(self._activity_waiters)
