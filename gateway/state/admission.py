"""Bounded admission: queued (waiting for the backend) + in-flight requests <= max_queue, and the
request bodies held by waiting cold requests <= max_held_bytes (maxQueue x 8 MiB bodies
would otherwise be a lot of memory for a small gateway Pod). Both bounds are the Pod's
(``gateway.state.pod``): with several worker processes, their tickets come out of one shared
semaphore and one byte budget.

A slot is taken only once a request is complete enough to be served (its body received and, when
cold, inspected): a client that trickles its request holds only upload bytes
(``gateway.state.uploads``, bounded per client address), never a slot nor held bytes, and so never
wakes a model nor refuses a warm request.

A request holds a :class:`Ticket` from admission to its end. The ticket moves
QUEUED -> IN_FLIGHT (and back to QUEUED if a connect attempt found the backend gone before any
byte was sent) and is released exactly once, however the request ends; a double release is a
no-op so ``finally:`` blocks can always call it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from gateway.state.pod import PodState

__all__ = ["AdmissionSlots", "BodyReservation", "HeldBytesBudget", "ModelShare", "Ticket", "TicketState"]


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
        state = self.state
        if state is TicketState.RELEASED:
            return
        self.state = TicketState.RELEASED
        if state is TicketState.QUEUED:
            self._slots._move(queued=-1, in_flight=0)
        else:
            self._slots._move(queued=0, in_flight=-1)
        self._slots.pod.give_slot()


class BodyReservation:
    """One request body's share of the Pod's held-body budget, taken when the complete request is to
    be held for a cold model and given back exactly once (:meth:`release` is idempotent)."""

    __slots__ = ("_slots", "bytes")

    def __init__(self, slots: HeldBytes) -> None:
        self._slots = slots
        self.bytes = 0

    def take(self, n: int) -> bool:
        """Reserve ``n`` more bytes; False (and nothing reserved) when the budget cannot take them."""
        if not self._slots._take_bytes(n):
            return False
        self.bytes += n
        return True

    def cover(self, n: int) -> bool:
        """Make the reservation at least ``n`` bytes (a body read in one piece is reserved only once
        it is to be held)."""
        return n <= self.bytes or self.take(n - self.bytes)

    def release(self) -> None:
        if self.bytes:
            self._slots._give_bytes(self.bytes)
            self.bytes = 0


class HeldBytes:
    """What a :class:`BodyReservation` takes bytes from: ``held_bytes`` counted here, and whatever
    bound the subclass checks in :meth:`_take_bytes` (and gives back to in :meth:`_give_bytes`)."""

    held_bytes: int

    def reservation(self) -> BodyReservation:
        return BodyReservation(self)

    def _take_bytes(self, n: int) -> bool:
        raise NotImplementedError

    def _give_bytes(self, n: int) -> None:
        if n > self.held_bytes:
            raise RuntimeError("held bytes would go negative")
        self.held_bytes -= n


class HeldBytesBudget(HeldBytes):
    """A Pod-wide held-body budget of its own, for a gateway that reads a body before it knows which
    model's slots it will take (the shared gateway): every model's bodies count against one bound.
    One event loop only (no lock)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        self.max_bytes = max_bytes
        self.held_bytes = 0

    def _take_bytes(self, n: int) -> bool:
        if self.held_bytes + n > self.max_bytes:
            return False
        self.held_bytes += n
        return True


class ModelShare(HeldBytes):
    """One model's share of a shared gateway's :class:`HeldBytesBudget`: its held bodies count against
    both its own bound and the Pod's, so one cold model cannot refuse every other model's requests.
    One event loop only."""

    def __init__(self, budget: HeldBytesBudget, max_bytes: int) -> None:
        self.budget = budget
        self.max_bytes = max_bytes
        self.held_bytes = 0

    def _take_bytes(self, n: int) -> bool:
        if self.held_bytes + n > self.max_bytes or not self.budget._take_bytes(n):
            return False
        self.held_bytes += n
        return True

    def _give_bytes(self, n: int) -> None:
        super()._give_bytes(n)
        self.budget._give_bytes(n)


class AdmissionSlots(HeldBytes):
    """At most ``max_queue`` tickets exist at once in the Pod, queued or in flight; ``queued`` and
    ``in_flight`` count this worker's own.

    ``on_change`` runs after every count change (the gateway publishes demand from it).
    """

    def __init__(
        self, max_queue: int, on_change: Callable[[], None] | None = None, *, max_held_bytes: int | None = None,
        pod: PodState | None = None, worker: int = 0,
    ) -> None:
        if max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        if max_held_bytes is not None and max_held_bytes < 1:
            raise ValueError("max_held_bytes must be >= 1")
        self.max_queue = max_queue
        self.max_held_bytes = max_held_bytes
        self.pod = pod if pod is not None else PodState(1, max_queue, max_held_bytes)
        self.worker = worker
        self.held_bytes = 0  # this worker's share of the Pod's held bytes
        self._queued = 0
        self._in_flight = 0
        self._on_change = on_change

    @property
    def queued(self) -> int:
        return self._queued

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def total(self) -> int:
        return self._queued + self._in_flight

    def try_admit(self, *, in_flight: bool) -> Ticket | None:
        """A ticket (queued, or directly in flight on the warm path), or None when the Pod is full."""
        if not self.pod.try_take_slot():
            return None
        if in_flight:
            self._move(queued=0, in_flight=+1)
            return Ticket(self, TicketState.IN_FLIGHT)
        self._move(queued=+1, in_flight=0)
        return Ticket(self, TicketState.QUEUED)

    def _take_bytes(self, n: int) -> bool:
        if not self.pod.try_take_bytes(n, self.worker):
            return False
        self.held_bytes += n
        return True

    def _give_bytes(self, n: int) -> None:
        super()._give_bytes(n)
        self.pod.give_bytes(n, self.worker)

    def _move(self, *, queued: int, in_flight: int) -> None:
        # On every request, twice: plain int updates, then the demand record (one call).
        q = self._queued + queued
        f = self._in_flight + in_flight
        if q < 0 or f < 0:
            raise RuntimeError("queued or in-flight count would go negative")
        self._queued = q
        self._in_flight = f
        if self._on_change is not None:
            self._on_change()
