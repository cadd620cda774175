"""State shared by every worker process of one gateway Pod.

Created once by the supervisor before it forks the workers (or by a test harness for one
in-process worker), it holds the limits that are *per Pod, not per worker*:

- ``slots``: a process-shared POSIX semaphore initialised to ``maxQueue``. Admission is
  ``sem_trywait`` (an atomic decrement that fails at zero), release is ``sem_post``; neither
  needs a lock, neither sleeps, and the count can never go below zero, so the workers together can
  never admit more than ``maxQueue`` requests however their accepts interleave.
- ``held bytes``: one shared integer under a process-shared lock (bodies held by cold requests touch
  it; bodies still arriving are counted apart, per worker, in ``gateway.state.uploads``), so the
  held-body budget is one budget for the Pod. Each worker's share is also kept in its row, so a worker that dies has it returned. The same
  lock guards the claim on timing an activation (once per Pod activation, not once per worker; see
  gateway.activation; the claiming worker is recorded, so a dead worker's claim is dropped at once)
  and the time demand was last pushed active (written by the supervisor, read by the workers).
- ``rows``: one row of float64 cells per worker in an anonymous shared mapping. Each worker writes
  only its own row (its queued / in-flight counts, lease and readiness flags, and its metric
  counters), so writes need no lock; readers (``/noctaya/queue``, ``/metrics``, the demand
  sampler feeding KEDA) sum the rows. A worker that dies has its row's tickets, held bytes and
  activation claim returned by the supervisor (:meth:`PodState.reclaim`).
- ``notify``: a semaphore a worker posts when its *cold* demand flips (a request queued for the
  backend, or the activation lease starting or ending), waking the demand sampler at once: that is
  what wakes a model from zero. Warm traffic (in-flight +1/-1 on every request) is picked up by the
  sampler's periodic read instead, and a request that started and ended between two reads still counts
  as one in flight for that read (a ``TRANSITIONS`` counter of requests started), so a busy backend never looks idle
  and no warm request costs a wake-up or a pipe write. A worker's backend-readiness flip also posts it:
  while no worker believes the backend ready there is no warm traffic, and the sampler sleeps until posted.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import threading
from collections.abc import Iterator
from typing import Any, Self

from gateway.state.podtable import PodTable
from scaler.demand import Demand

__all__ = ["PodState", "Row", "DemandSampler"]

# Row layout: the demand fields first, then the metric cells (gateway.metrics decides their use).
QUEUED, IN_FLIGHT, LEASE_ACTIVE, BACKEND_READY, DRAINING, ALIVE, PID, TRANSITIONS, HELD = range(9)
METRIC_CELLS = HELD + 1  # first cell gateway.metrics may use
ROW_CELLS = 1024  # 8 KiB per worker: demand fields + metric counters (see gateway.metrics.Layout)
# Pod-wide cells after the rows: held body bytes, when demand was last pushed active, the start
# of the activation being timed (0 = none) and the worker timing it, the notAfter of the certificate
# the Pod's ExternalScaler serves (0 = no TLS).
_HELD_BYTES, _PUSHED_AT, _ACTIVATION_AT, _ACTIVATION_OWNER, _SCALER_NOT_AFTER = range(5)

LOCK_PATIENCE_SECONDS = 1.0  # see PodState._lock_after_a_death
# The demand sampler's longest sleep while nothing can change without waking it. Not a need: every
# way out of that state posts ``notify`` (tested). It bounds the cost of a missed post someone adds
# later, and is long because each wake-up of an idle Pod is charged for (docs/benchmarks.md: a
# 5 s bound was most of an idle gateway's wake-ups).
PARKED_SECONDS = 60.0

_ctx = multiprocessing.get_context("fork")


class PodState:
    def __init__(self, workers: int, max_queue: int, max_held_bytes: int | None, *, notify: Any = None) -> None:
        # ``notify``: a semaphore of the caller's, when one sampler watches several Pod states (the
        # models of a shared gateway).
        if workers < 1:
            raise ValueError("workers must be >= 1")
        if max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        self.workers = workers
        self.max_queue = max_queue
        self.max_held_bytes = max_held_bytes
        self._slots = _ctx.Semaphore(max_queue)
        self._lock = _ctx.Lock()
        self.notify = notify if notify is not None else _ctx.Semaphore(0)
        # One extra row-sized area for Pod-wide scalars (_HELD_BYTES, ...).
        self._map = mmap.mmap(-1, (workers + 1) * ROW_CELLS * 8)
        self.cells = memoryview(self._map).cast("d")
        self._pod = workers * ROW_CELLS
        # Per backend Pod counters of each worker (gateway.backends balances per worker).
        self.backend_pods = PodTable(workers)

    # -- admission (any worker) --------------------------------------------------------------
    def try_take_slot(self) -> bool:
        return self._slots.acquire(False)

    def give_slot(self) -> None:
        self._slots.release()

    def try_take_bytes(self, n: int, worker: int = 0) -> bool:
        """Take ``n`` bytes of the Pod's held-body budget for ``worker`` (False: it cannot take them)."""
        if n < 0:
            raise ValueError("n must be >= 0")
        if n == 0:
            return True
        cells = self.cells
        with self._lock:
            held = cells[self._pod]
            if self.max_held_bytes is not None and held + n > self.max_held_bytes:
                return False
            cells[self._pod] = held + n
            cells[worker * ROW_CELLS + HELD] += n
            return True

    def give_bytes(self, n: int, worker: int = 0) -> None:
        if n:
            with self._lock:
                self.cells[self._pod] -= n
                self.cells[worker * ROW_CELLS + HELD] -= n

    @property
    def held_bytes(self) -> int:
        return int(self.cells[self._pod])

    # -- one activation of the Pod (timed once, whichever worker admitted its first cold request) --
    def mark_pushed(self, when: float) -> None:
        """The Pod's demand turned active at KEDA (or the aggregator) at ``when`` (monotonic)."""
        self.cells[self._pod + _PUSHED_AT] = when

    @property
    def pushed_at(self) -> float:
        return self.cells[self._pod + _PUSHED_AT]

    # -- the scaler's certificate (written where the ExternalScaler runs, read by /metrics) ---------
    def mark_scaler_certificate(self, not_after: float) -> None:
        """The Pod's ExternalScaler (on this loop, or the scaler child, whose pipe the supervisor
        reads) now serves a certificate valid until ``not_after`` (Unix time)."""
        self.cells[self._pod + _SCALER_NOT_AFTER] = not_after

    @property
    def scaler_certificate_not_after(self) -> float:
        return self.cells[self._pod + _SCALER_NOT_AFTER]

    def claim_activation(self, now: float, stale_after: float, worker: int = 0) -> bool:
        """True when no activation of the Pod is being timed (or the one claimed has gone stale): the
        caller times this one and must :meth:`release_activation` it."""
        with self._lock:
            claimed = self.cells[self._pod + _ACTIVATION_AT]
            if claimed and now - claimed < stale_after:
                return False
            self.cells[self._pod + _ACTIVATION_AT] = now
            self.cells[self._pod + _ACTIVATION_OWNER] = worker
            return True

    def release_activation(self, claimed_at: float) -> None:
        with self._lock:
            if self.cells[self._pod + _ACTIVATION_AT] == claimed_at:
                self.cells[self._pod + _ACTIVATION_AT] = 0.0

    # -- rows -------------------------------------------------------------------------------
    def row(self, index: int) -> Row:
        if not 0 <= index < self.workers:
            raise IndexError("no such worker")
        return Row(self, index)

    def rows(self) -> Iterator[int]:
        """Base offsets of every worker's row."""
        return iter(range(0, self.workers * ROW_CELLS, ROW_CELLS))

    def total(self, field: int) -> float:
        cells = self.cells
        return sum(cells[base + field] for base in self.rows())

    def any(self, field: int) -> bool:
        cells = self.cells
        return any(cells[base + field] for base in self.rows())

    def demand(self) -> Demand:
        """The Pod's demand now: what ``/noctaya/queue`` shows."""
        return Demand(int(self.total(QUEUED)), int(self.total(IN_FLIGHT)), self.any(LEASE_ACTIVE))

    def sample(self, last_transitions: float) -> tuple[Demand, float]:
        """The Pod's demand for KEDA, one figure for all workers: as :meth:`demand`, but at least
        one in flight when requests came and went since the previous sample."""
        transitions = self.total(TRANSITIONS)
        demand = self.demand()
        if transitions != last_transitions and demand.total == 0:
            demand = Demand(0, 1, demand.lease_active)
        return demand, transitions

    def per_worker(self) -> list[dict[str, int]]:
        cells = self.cells
        return [{"pid": int(cells[base + PID]), "queued": int(cells[base + QUEUED]),
                 "inFlight": int(cells[base + IN_FLIGHT])} for base in self.rows()]

    def reclaim(self, index: int) -> tuple[int, int]:
        """A worker died: return its tickets to the semaphore and its held bytes to the budget, drop
        its activation claim and clear its demand. Its metric counters are kept (counters must not go
        backwards). Returns (tickets, bytes) returned."""
        base = index * ROW_CELLS
        cells = self.cells
        tickets = int(cells[base + QUEUED] + cells[base + IN_FLIGHT])
        for _ in range(tickets):
            self._slots.release()
        self._lock_after_a_death()
        try:
            held = cells[base + HELD]
            cells[base + HELD] = 0.0
            # The total is the sum of the living rows, not total - held: a worker killed between its
            # two stores (total, then its row) must not leave bytes counted that nobody holds.
            cells[self._pod] = sum(cells[b + HELD] for b in self.rows())
            if cells[self._pod + _ACTIVATION_AT] and cells[self._pod + _ACTIVATION_OWNER] == index:
                cells[self._pod + _ACTIVATION_AT] = 0.0
        finally:
            self._lock.release()
        for field in (QUEUED, IN_FLIGHT, LEASE_ACTIVE, BACKEND_READY, ALIVE):
            cells[base + field] = 0.0
        self.backend_pods.clear(index)
        return tickets, int(held)

    def _lock_after_a_death(self, patience: float = LOCK_PATIENCE_SECONDS) -> None:
        """Take the Pod lock after a worker died. The lock is a semaphore, not a robust mutex: a
        worker SIGKILLed inside one of its critical sections (a few stores, microseconds) would leave
        it taken for good and freeze every worker. Held for ``patience`` seconds, it can only be the
        dead worker's: give it back, then take it."""
        if not self._lock.acquire(timeout=patience):
            self._lock.release()
            self._lock.acquire()


class Row:
    """One worker's writable row."""

    __slots__ = ("pod", "index", "base", "cells", "_last_cold", "_notify")

    def __init__(self, pod: PodState, index: int) -> None:
        self.pod = pod
        self.index = index
        self.base = index * ROW_CELLS
        self.cells = pod.cells
        self._last_cold = False
        self._notify = pod.notify
        self.cells[self.base + ALIVE] = 1.0
        self.cells[self.base + PID] = os.getpid()

    def write_demand(self, queued: int, in_flight: int, lease_active: bool) -> None:
        """Record this worker's demand; wake the sampler only when its cold demand flips."""
        cells, base = self.cells, self.base
        if in_flight > cells[base + IN_FLIGHT]:
            cells[base + TRANSITIONS] += 1.0  # a request started: seen by the next sample even if done by then
        cells[base + QUEUED] = queued
        cells[base + IN_FLIGHT] = in_flight
        cells[base + LEASE_ACTIVE] = 1.0 if lease_active else 0.0
        cold = lease_active or queued > 0
        if cold is not self._last_cold:
            self._last_cold = cold
            self._notify.release()

    def set_flag(self, field: int, value: bool) -> None:
        cell = 1.0 if value else 0.0
        flipped = self.cells[self.base + field] != cell
        self.cells[self.base + field] = cell
        if field == BACKEND_READY and flipped:
            self._notify.release()  # a parked sampler must watch warm traffic from now on


class SamplerThread:
    """An OS thread that publishes demand each time ``notify`` is posted, and otherwise after
    :meth:`_wait` seconds (the subclass says how long: short while there may be warm traffic, which
    only sampling sees; long while parked). The demand sampler of one Pod and the shared gateway's
    sampler of every model are both one of these."""

    def __init__(self, notify: Any, interval: float, name: str) -> None:  # a semaphore (thread or process)
        self.interval = interval
        self.withdrawn = False
        self._notify = notify
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Self:
        self._thread.start()
        return self

    def publish_now(self) -> object:
        raise NotImplementedError

    def _wait(self) -> float:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set():
            self._notify.acquire(timeout=self._wait())
            self.publish_now()

    def withdraw(self) -> None:
        """Graceful shutdown: the published demand is zero from now on."""
        self.withdrawn = True
        self.publish_now()

    def stop(self) -> None:
        self._stop.set()
        self._notify.release()
        self._thread.join(5)


class DemandSampler(SamplerThread):
    """Publishes the Pod's summed demand to a broadcaster: at once when a worker's cold demand
    flips, otherwise every ``interval`` seconds (the broadcaster ignores equal values). Runs in an
    OS thread of the supervisor (or of a test harness)."""

    def __init__(self, pod: PodState, broadcaster: Any, interval: float = 0.1) -> None:
        super().__init__(pod.notify, interval, "noctaya-demand-sampler")
        self.pod = pod
        self.broadcaster = broadcaster
        self.failures = 0
        self._transitions = 0.0

    def publish_now(self) -> None:
        demand, self._transitions = self.pod.sample(self._transitions)
        if self.withdrawn:
            demand = Demand()
        try:
            self.broadcaster.publish(demand)
        except Exception:  # a broken sink must never stop sampling; the next round retries
            self.failures += 1

    def _wait(self) -> float:
        """How long to sleep before the next sample. Warm traffic is seen only by sampling, but there is
        none while no worker believes the backend ready: then every request is cold and its flip (like
        a readiness flip) posts ``notify``, so an idle gateway at zero parks instead of waking 10×/s."""
        if self.withdrawn or self.pod.any(BACKEND_READY) or self.pod.demand().active:
            return self.interval
        return PARKED_SECONDS
