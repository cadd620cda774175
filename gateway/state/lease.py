"""The activation lease: why the backend is wanted even when no client is connected.

A cold admission starts a lease (or extends a running one to ``now + activation_timeout``), so
demand survives clients that give up while waiting. The lease ends either ``ready_grace`` seconds
after the backend became Ready (letting retries and KEDA catch up) or when its deadline passes
without readiness (a failed load must not signal forever). After it ends, the next cold admission
starts a new lease.

Pure state: every method takes ``now`` from the injected clock of the caller; nothing sleeps.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["ActivationLease", "LeaseState", "LeaseEnd"]


class LeaseState(enum.Enum):
    IDLE = "idle"
    ACTIVATING = "activating"
    READY_GRACE = "ready-grace"


class LeaseEnd(enum.Enum):
    TIMED_OUT = "timed_out"
    COMPLETED = "completed"


@dataclass(frozen=True, slots=True)
class LeaseSnapshot:
    state: LeaseState
    started_at: float | None
    deadline: float | None
    ends_at: float | None


class ActivationLease:
    def __init__(self, activation_timeout: float, ready_grace: float) -> None:
        if activation_timeout <= 0:
            raise ValueError("activation_timeout must be > 0")
        if ready_grace < 0:
            raise ValueError("ready_grace must be >= 0")
        self.activation_timeout = activation_timeout
        self.ready_grace = ready_grace
        self.state = LeaseState.IDLE
        self.started_at: float | None = None
        self.deadline: float | None = None  # activation deadline (ACTIVATING)
        self.ends_at: float | None = None  # ready + grace (READY_GRACE)
        self.generation = 0  # increases with every new lease

    @property
    def active(self) -> bool:
        return self.state is not LeaseState.IDLE

    def snapshot(self) -> LeaseSnapshot:
        return LeaseSnapshot(self.state, self.started_at, self.deadline, self.ends_at)

    def cold_admission(self, now: float) -> float:
        """A request found the backend not ready. Returns that request's own deadline."""
        deadline = now + self.activation_timeout
        if self.state is LeaseState.IDLE:
            self.state = LeaseState.ACTIVATING
            self.started_at = now
            self.generation += 1
            self.deadline = deadline
            self.ends_at = None
        elif self.state is LeaseState.ACTIVATING:
            assert self.deadline is not None
            self.deadline = max(self.deadline, deadline)
        else:
            # READY_GRACE yet the request saw a cold backend: readiness was lost; activate again.
            # (Losing readiness alone does not extend the lease: only a waiting request does.)
            self.state = LeaseState.ACTIVATING
            self.started_at = now
            self.deadline = deadline
            self.ends_at = None
        return deadline

    def backend_ready(self, now: float) -> float | None:
        """Readiness arrived. Returns the activation duration when this ended an activation."""
        if self.state is LeaseState.ACTIVATING:
            self.state = LeaseState.READY_GRACE
            self.ends_at = now + self.ready_grace
            assert self.started_at is not None
            return now - self.started_at
        return None

    def tick(self, now: float) -> LeaseEnd | None:
        """End the lease when its time is up; returns how it ended (None if still running)."""
        if self.state is LeaseState.ACTIVATING and self.deadline is not None and now >= self.deadline:
            self._end()
            return LeaseEnd.TIMED_OUT
        if self.state is LeaseState.READY_GRACE and self.ends_at is not None and now >= self.ends_at:
            self._end()
            return LeaseEnd.COMPLETED
        return None

    def next_timer(self) -> float | None:
        """When :meth:`tick` next has something to do."""
        if self.state is LeaseState.ACTIVATING:
            return self.deadline
        if self.state is LeaseState.READY_GRACE:
            return self.ends_at
        return None

    def _end(self) -> None:
        self.state = LeaseState.IDLE
        self.started_at = None
        self.deadline = None
        self.ends_at = None
