"""Backend readiness as the gateway sees it, and the one shared prober that keeps it fresh.

The gateway learns readiness by asking the backend's readiness path itself (every starting Pod's when
it knows the Pods, gateway.backends; else the Service's), and from the EndpointSlices when it watches
them. A single prober greenlet per model does the asking for everyone - never one probe per request -
and only while something wants the backend (queued/in-flight requests or a running lease); an idle
gateway sends nothing. Between probes, the forwarding path reports what it sees: a refused connection marks
the backend cold at once (it scaled to zero), so the next request is admitted as a cold one.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

__all__ = ["ProbeResult", "BackendReadiness", "ReadinessProber"]


class ProbeResult(enum.Enum):
    READY = "ready"  # readiness path answered 2xx
    NOT_READY = "not_ready"  # answered non-2xx, timed out, or broke mid-answer
    REFUSED = "refused"  # nothing listening (no endpoints): definitely cold


class BackendReadiness:
    """Ready or not, with hysteresis while warm.

    Cold -> ready on the first good probe (waiters are served as soon as possible). Ready -> cold
    at once on a refused connection, but only after ``warm_failure_threshold`` consecutive
    NOT_READY probes, so one slow health answer under load does not hold every new request.
    """

    def __init__(self, warm_failure_threshold: int = 3) -> None:
        if warm_failure_threshold < 1:
            raise ValueError("warm_failure_threshold must be >= 1")
        self.ready = False
        self.changed_at: float | None = None
        self._threshold = warm_failure_threshold
        self._failures = 0

    def record(self, result: ProbeResult, now: float) -> bool:
        """Apply one observation; True when ``ready`` flipped."""
        if result is ProbeResult.READY:
            self._failures = 0
            return self._set(True, now)
        if result is ProbeResult.REFUSED:
            self._failures = 0
            return self._set(False, now)
        self._failures += 1
        if self.ready and self._failures < self._threshold:
            return False
        self._failures = 0
        return self._set(False, now)

    def _set(self, ready: bool, now: float) -> bool:
        if ready == self.ready:
            return False
        self.ready = ready
        self.changed_at = now
        return True


class ReadinessProber:
    """Drives ``probe`` while ``wanted()``; parks (no timers, no traffic) otherwise.

    ``step()`` is one probe + report and returns the delay before the next one, so tests can
    run the loop by hand; ``run()`` is the greenlet body. ``kick()`` wakes a parked prober (called
    on admissions and when the forwarder finds the backend gone); it never adds a probe to a
    prober that is already running on the cold cadence.
    """

    def __init__(
        self,
        probe: Callable[[], ProbeResult],
        report: Callable[[ProbeResult], None],
        wanted: Callable[[], bool],
        is_ready: Callable[[], bool],
        *,
        interval_cold: float,
        interval_warm: float,
    ) -> None:
        if not 0 < interval_cold <= 0.2:
            raise ValueError("interval_cold must be in (0, 0.2] seconds")
        if interval_warm < interval_cold:
            raise ValueError("interval_warm must be >= interval_cold")
        self._probe = probe
        self._report = report
        self._wanted = wanted
        self._is_ready = is_ready
        self.interval_cold = interval_cold
        self.interval_warm = interval_warm
        self.probes_sent = 0
        self._wake = None  # gevent.event.Event, created in the hub thread that runs the loop
        self._stopped = False
        self._parked = False

    def step(self) -> float | None:
        """One probe if wanted; returns the next delay, or None when it should park."""
        if self._stopped or not self._wanted():
            return None
        self.probes_sent += 1
        result = self._probe()
        self._report(result)
        return self.interval_warm if self._is_ready() else self.interval_cold

    def kick(self) -> None:
        """Wake a parked prober (cheap no-op while it runs: the warm path calls this per request)."""
        if self._parked and self._wake is not None:
            self._wake.set()

    def hurry(self) -> None:
        """Wake the prober even mid-wait (the backend was just found gone: probe on the cold cadence)."""
        if self._wake is not None:
            self._wake.set()

    def stop(self) -> None:
        self._stopped = True
        self.hurry()

    def run(self) -> None:
        import time

        import gevent.event

        self._wake = gevent.event.Event()
        while not self._stopped:
            probed_at = time.monotonic()
            delay = self.step()
            if delay is None:
                self._wake.clear()
                # Re-check after clear(): an admission between step() and clear() must not be lost.
                if not self._stopped and not self._wanted():
                    self._parked = True
                    try:
                        self._wake.wait()
                    finally:
                        self._parked = False
                continue
            # Fixed cadence while wanted: a kick never adds a probe, it only lets a warm-cadence
            # wait shrink to the cold cadence when the forwarder just found the backend gone.
            due = probed_at + delay
            while not self._stopped:
                remaining = due - time.monotonic()
                if remaining <= 0:
                    break
                self._wake.clear()
                self._wake.wait(remaining)
                if not self._is_ready():
                    due = min(due, probed_at + self.interval_cold)
