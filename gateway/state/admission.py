"""Bounded admission: queued (waiting for the backend) + in-flight requests <= max_queue.

A request holds a :class:`Ticket` from admission to its end. The ticket moves
QUEUED -> IN_FLIGHT (and back to QUEUED if a connect attempt found the backend gone before any
byte was sent) and is released exactly once, however the request ends; a double release is a
no-op so ``finally:`` blocks can always call it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from gateway.state.inflight import InFlightCounter

__all__ = ["AdmissionSlots", "Ticket", "TicketState"]


class TicketState(enum.Enum):
    QUEUED = "queued"
    IN_FLIGHT = "in_flight"
    RELEASED = "released"


class Ticket:
    """One admitted request's slot."""

    __slots__ = ("_slots", "state")

    def __init__(self, slots: AdmissionSlots, state: TicketState) -> None:
        self._slots = slots
        self.state = state

    def start(self) -> None:
        """QUEUED -> IN_FLIGHT (forwarding begins). No-op when already in flight."""
        if self.state is TicketState.QUEUED:
            self.state = TicketState.IN_FLIGHT
            self._slots._move(queued=-1, in_flight=+1)
        elif self.state is TicketState.RELEASED:
            raise RuntimeError("ticket already released")

    def requeue(self) -> None:
        """IN_FLIGHT -> QUEUED: the backend refused the connection before any byte was sent."""
        if self.state is TicketState.IN_FLIGHT:
            self.state = TicketState.QUEUED
            self._slots._move(queued=+1, in_flight=-1)
        elif self.state is TicketState.RELEASED:
            raise RuntimeError("ticket already released")

    def release(self) -> None:
        """Give the slot back. Idempotent."""
        if self.state is TicketState.QUEUED:
            self._slots._move(queued=-1, in_flight=0)
        elif self.state is TicketState.IN_FLIGHT:
            self._slots._move(queued=0, in_flight=-1)
        self.state = TicketState.RELEASED


class AdmissionSlots:
    """At most ``max_queue`` tickets exist at once, queued or in flight.

    ``on_change`` runs after every count change (the gateway publishes demand from it).
    """

    def __init__(self, max_queue: int, on_change: Callable[[], None] | None = None) -> None:
        if max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        self.max_queue = max_queue
        self._queued = 0
        self._in_flight = InFlightCounter()
        self._on_change = on_change

    @property
    def queued(self) -> int:
        return self._queued

    @property
    def in_flight(self) -> int:
        return self._in_flight.count

    @property
    def in_flight_counter(self) -> InFlightCounter:
        return self._in_flight

    @property
    def total(self) -> int:
        return self._queued + self._in_flight.count

    @property
    def full(self) -> bool:
        return self.total >= self.max_queue

    def try_admit(self, *, in_flight: bool) -> Ticket | None:
        """A ticket (queued, or directly in flight on the warm path), or None when full."""
        if self.full:
            return None
        if in_flight:
            self._move(queued=0, in_flight=+1)
            return Ticket(self, TicketState.IN_FLIGHT)
        self._move(queued=+1, in_flight=0)
        return Ticket(self, TicketState.QUEUED)

    def _move(self, *, queued: int, in_flight: int) -> None:
        self._queued += queued
        if self._queued < 0:
            raise RuntimeError("queued count would go negative")
        if in_flight > 0:
            self._in_flight.increment()
        elif in_flight < 0:
            self._in_flight.decrement()
        if self._on_change is not None:
            self._on_change()
