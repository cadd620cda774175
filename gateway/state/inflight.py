"""Count of requests currently being forwarded to the backend."""

from __future__ import annotations

__all__ = ["InFlightCounter"]


class InFlightCounter:
    """In-flight requests of this gateway, with the peak seen (for diagnostics).

    Only the gateway's own hub thread mutates it; other threads only read the ints.
    """

    __slots__ = ("_count", "_peak")

    def __init__(self) -> None:
        self._count = 0
        self._peak = 0

    @property
    def count(self) -> int:
        return self._count

    @property
    def peak(self) -> int:
        return self._peak

    @property
    def idle(self) -> bool:
        return self._count == 0

    def increment(self) -> None:
        self._count += 1
        if self._count > self._peak:
            self._peak = self._count

    def decrement(self) -> None:
        if self._count <= 0:
            raise RuntimeError("in-flight count would go negative")
        self._count -= 1
