"""Ties the state objects together and publishes Demand on every transition.

One instance per gateway process, used only from that process's gevent hub thread (the
broadcaster it publishes to is thread-safe, so a gRPC scaler in OS threads may read it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import gevent.event

from gateway.metrics import GatewayMetrics
from gateway.state.admission import AdmissionSlots
from gateway.state.lease import ActivationLease, LeaseEnd
from gateway.state.readiness import BackendReadiness, ProbeResult, ReadinessProber
from scaler.demand import Demand, DemandBroadcaster

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
        broadcaster: DemandBroadcaster,
        metrics: GatewayMetrics,
        probe: Callable[[], ProbeResult],
        probe_interval: float,
        warm_probe_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self.broadcaster = broadcaster
        self.metrics = metrics
        self.slots = AdmissionSlots(max_queue, on_change=self.publish, max_held_bytes=max_held_bytes)
        self.lease = ActivationLease(activation_timeout, ready_grace)
        self.readiness = BackendReadiness()
        # Set while the backend is believed ready: waiters block on it (with their own deadline).
        self.ready_event = gevent.event.Event()
        self.prober = ReadinessProber(
            probe, self.report_probe, self.wanted, lambda: self.readiness.ready,
            interval_cold=probe_interval, interval_warm=max(probe_interval, warm_probe_interval),
        )
        self.withdrawn = False
        self.aborted = False  # set when the drain grace ends: every cold waiter answers at once
        self.last_demand = Demand()
        self._publish_failures = 0

    # -- questions -------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.readiness.ready

    def wanted(self) -> bool:
        """Probe only while something wants the backend: requests or a running lease."""
        return self.slots.total > 0 or self.lease.active

    def demand(self) -> Demand:
        return Demand(self.slots.queued, self.slots.in_flight, self.lease.active)

    # -- transitions -----------------------------------------------------------------------
    def cold_admission(self) -> float:
        """A request found the backend not ready: start/extend the lease; returns its deadline."""
        deadline = self.lease.cold_admission(self.clock())
        self.metrics.cold_requests.inc()
        self.publish()
        self.prober.kick()
        return deadline

    def traffic(self) -> None:
        """A warm request started: keep the (warm-rate) prober running while traffic flows."""
        self.prober.kick()

    def report_probe(self, result: ProbeResult) -> None:
        now = self.clock()
        if self.readiness.record(result, now):
            if self.readiness.ready:
                duration = self.lease.backend_ready(now)
                if duration is not None:
                    self.metrics.activation_duration.observe(duration)
                    log.info("backend ready", extra={"activation_seconds": round(duration, 3)})
                else:
                    log.info("backend ready")
                self.ready_event.set()
            elif not self.aborted:  # aborted waiters must stay awake to answer
                self.ready_event.clear()
                log.info("backend not ready", extra={"observation": result.value})
            self.metrics.backend_ready.set(1 if self.readiness.ready else 0)
        self.tick(now)

    def backend_unreachable(self) -> None:
        """The forwarder could not connect: the backend is cold, whatever the last probe said."""
        self.report_probe(ProbeResult.REFUSED)
        self.prober.kick()

    def tick(self, now: float | None = None) -> None:
        end = self.lease.tick(self.clock() if now is None else now)
        if end is LeaseEnd.TIMED_OUT:
            log.warning("activation lease timed out without a ready backend")
        elif end is LeaseEnd.COMPLETED:
            log.info("activation lease ended after the ready grace")
        self.publish()

    def publish(self) -> None:
        """Push the current demand (the broadcaster ignores non-changes). After withdrawal
        (graceful shutdown) the published demand stays zero."""
        demand = Demand() if self.withdrawn else self.demand()
        self.last_demand = demand
        self.metrics.queue_depth.set(self.slots.queued)
        self.metrics.in_flight.set(self.slots.in_flight)
        self.metrics.lease_active.set(1 if self.lease.active else 0)
        try:
            self.broadcaster.publish(demand)
        except Exception:
            # The demand sink must never fail a client request; the stored value is what the
            # scaler reads next, and its waiters wake at their next bounded wait slice anyway.
            self._publish_failures += 1
            if self._publish_failures in (1, 10, 100) or self._publish_failures % 1000 == 0:
                log.exception("demand publish failed", extra={"failures": self._publish_failures})

    def abort_waiters(self) -> None:
        """End every cold wait now (drain grace over): waiters answer 503 / an SSE error frame
        instead of being cut off when the server stops."""
        self.aborted = True
        self.ready_event.set()  # wakes them; wait_ready checks `aborted` before anything else

    def withdraw(self) -> None:
        self.withdrawn = True
        self.publish()
