"""Ties the state objects together and records this worker's demand on every transition.

One instance per worker process, used only from that worker's gevent hub thread. The demand is
written into the worker's row of the Pod's shared state (a few memory stores, no lock, no pipe);
the Pod's demand sampler sums the rows for KEDA and is woken at once only when ``active`` flips
(``gateway.state.pod``), so warm traffic (in-flight +1/-1 per request) costs no wake-up at all.

The activation lease is per worker; the Pod's lease is their OR. That equals one Pod-wide lease:
each cold admission extends a lease to ``max(deadline, now + activationTimeout)``, so the OR of the
workers' leases is active exactly while the latest deadline (or ready grace) of any admission in the
Pod has not passed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import gevent.event

from gateway.metrics import GatewayMetrics
from gateway.state.admission import AdmissionSlots
from gateway.state.lease import ActivationLease, LeaseEnd, LeaseState
from gateway.state.pod import PodState
from gateway.state.readiness import BackendReadiness, ProbeResult, ReadinessProber
from scaler.demand import Demand

__all__ = ["Activation"]

log = logging.getLogger("noctaya.gateway.activation")


class Activation:
    def __init__(
        self,
        *,
        max_queue: int,
        max_held_bytes: int | None = None,
        activation_timeout: float,
        ready_grace: float,
        metrics: GatewayMetrics,
        probe: Callable[[], ProbeResult],
        probe_interval: float,
        warm_probe_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        settled: Callable[[], bool] | None = None,
        room: Callable[[], bool] | None = None,
        room_event: gevent.event.Event | None = None,
    ) -> None:
        """``settled``: the backend has no Pod starting (else the prober keeps its cold cadence while
        ready, so a Pod turning ready is found at once); ``room``/``room_event``: whether a held
        request may be released now (gateway.backends' cold batch) and the event set when it may."""
        self.clock = clock
        self.metrics = metrics
        self.pod: PodState = metrics.pod
        self.row = metrics.row
        self.worker = self.row.index
        self.slots = AdmissionSlots(max_queue, on_change=self.publish, max_held_bytes=max_held_bytes, pod=self.pod,
                                    worker=self.worker)
        self.lease = ActivationLease(activation_timeout, ready_grace)
        self.readiness = BackendReadiness()
        # Set while the backend is believed ready: waiters block on it (with their own deadline).
        self.ready_event = gevent.event.Event()
        self.has_room = room or (lambda: True)
        self.room_event = room_event if room_event is not None else gevent.event.Event()
        settle = settled or (lambda: True)
        self.prober = ReadinessProber(
            probe, self.report_probe, self.wanted, lambda: self.readiness.ready and settle(),
            interval_cold=probe_interval, interval_warm=max(probe_interval, warm_probe_interval),
        )
        self.withdrawn = False
        self.aborted = False  # set when the drain grace ends: every cold waiter answers at once
        # Timing one activation of the Pod (only the worker that claimed it, so each activation is
        # observed once however many workers admitted cold requests): when it began, and when this
        # worker saw the backend Ready while the first held answer is still to be forwarded.
        self._timing: float | None = None
        self._ready_at: float | None = None
        self._stale_after = activation_timeout + ready_grace

    # -- questions -------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.readiness.ready

    def wanted(self) -> bool:
        """Probe only while something wants the backend: requests or a running lease."""
        return self.slots.total > 0 or self.lease.active

    def demand(self) -> Demand:
        """This worker's demand."""
        return Demand(self.slots.queued, self.slots.in_flight, self.lease.active)

    # -- transitions -----------------------------------------------------------------------
    def cold_admission(self, arrived: float | None = None) -> float:
        """A request found the backend not ready: start/extend the lease; returns its deadline.

        ``arrived`` is when that request reached the gateway: an activation is timed from there,
        since its demand may have been pushed while its body was still being read."""
        now = self.clock()
        if self.lease.state is LeaseState.IDLE:  # a new activation (as far as this worker knows)
            self._ready_at = None
            start = min(now, arrived) if arrived is not None else now
            if self._timing is None and self.pod.claim_activation(start, self._stale_after, self.worker):
                self._timing = start
        deadline = self.lease.cold_admission(now)
        self.metrics.cold_requests.inc()
        self.publish()
        self.prober.hurry()
        return deadline

    def traffic(self) -> None:
        """A warm request started: keep the (warm-rate) prober running while traffic flows."""
        self.prober.kick()

    def report_probe(self, result: ProbeResult) -> None:
        now = self.clock()
        if self.readiness.record(result, now):
            if self.readiness.ready:
                timed = self._activation_ready(now)
                duration = self.lease.backend_ready(now)
                if duration is not None:
                    log.info("backend ready", extra={"activation_seconds": round(duration, 3)})
                else:
                    log.info("backend ready")
                if timed is not None:
                    self.metrics.activation_duration.observe(timed)
                self.ready_event.set()
            elif not self.aborted:  # aborted waiters must stay awake to answer
                self.ready_event.clear()
                log.info("backend not ready", extra={"observation": result.value})
            self.metrics.set_backend_ready(self.readiness.ready)
        self.tick(now)

    def backend_unreachable(self) -> None:
        """The forwarder could not connect: the backend is cold, whatever the last probe said."""
        self.report_probe(ProbeResult.REFUSED)
        self.prober.hurry()

    def _activation_ready(self, now: float) -> float | None:
        """Observe the phases of the activation this worker times; returns its whole duration."""
        started = self._timing
        if started is None:
            return None
        self._observe_push(started)
        pushed = self.pod.pushed_at
        if pushed >= started:
            self.metrics.phases["push_to_ready"].observe(max(0.0, now - pushed))
        self._ready_at = now
        self._end_timing()
        return now - started

    def _observe_push(self, started: float) -> None:
        pushed = self.pod.pushed_at
        if pushed >= started:  # else the demand never had to be pushed (another path woke the backend)
            self.metrics.phases["admission_to_push"].observe(pushed - started)

    def _end_timing(self) -> None:
        if self._timing is not None:
            self.pod.release_activation(self._timing)
            self._timing = None

    def first_byte_forwarded(self, now: float, pod: str | None = None) -> None:
        """A held (cold) request's first answer byte left the gateway (from backend Pod ``pod``, when
        the gateway balances over Pods): the last phase of the activation this worker times."""
        if self._ready_at is not None:
            seconds = max(0.0, now - self._ready_at)
            self.metrics.phases["ready_to_first_byte"].observe(seconds)
            self._ready_at = None
            log.info("cold start served", extra={"ready_to_first_byte_seconds": round(seconds, 3),
                                                 **({"pod": pod} if pod else {})})

    def tick(self, now: float | None = None) -> None:
        end = self.lease.tick(self.clock() if now is None else now)
        if end is not None and self._timing is not None:  # ended without Ready: nothing more to time
            self._observe_push(self._timing)
            self._end_timing()
        if end is LeaseEnd.TIMED_OUT:
            log.warning("activation lease timed out without a ready backend")
        elif end is LeaseEnd.COMPLETED:
            log.info("activation lease ended after the ready grace")
        self.publish()

    def publish(self) -> None:
        """Record this worker's demand in its row. After withdrawal (graceful shutdown) it stays
        zero. Runs on every slot transition: keep it a handful of stores."""
        slots = self.slots
        if self.withdrawn:
            self.row.write_demand(0, 0, False)
        else:
            self.row.write_demand(slots._queued, slots._in_flight, self.lease.state is not LeaseState.IDLE)

    def abort_waiters(self) -> None:
        """End every cold wait now (drain grace over): waiters answer 503 / an SSE error frame
        instead of being cut off when the server stops."""
        self.aborted = True
        self.ready_event.set()  # wakes them; wait_ready checks `aborted` before anything else

    def withdraw(self) -> None:
        self.withdrawn = True
        self.publish()
