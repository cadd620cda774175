"""Bytes of request bodies still arriving, apart from the bytes held for cold requests.

A body that needs more than one read is in memory while it arrives, whatever the model's state. Those
bytes are counted here, not against the held-while-cold budget (``gateway.state.admission``): an
upload that never finishes must not refuse a warm request, nor one for another model. Two bounds,
both per worker process (like the per-address connection cap, ``gateway.server``):

- per client address (``max_upload_bytes_per_address``): one address cannot take the budget from
  everybody else by opening many uploads;
- per worker (``max_upload_bytes``): all uploads together.

A body's bytes leave this budget when it has been written to the backend, or when it moves to the
held budget (its request is complete and held for a cold model), or when the request ends. One event
loop only (no lock).
"""

from __future__ import annotations

__all__ = ["UploadBudget", "UploadReservation", "UploadRefused"]


class UploadRefused(Exception):
    """An upload's next bytes do not fit (-> 429). ``per_address``: the client address's own bound
    was reached (others are unaffected), else the worker's."""

    def __init__(self, per_address: bool) -> None:
        super().__init__("per address" if per_address else "worker")
        self.per_address = per_address


class UploadBudget:
    def __init__(self, max_bytes: int, max_bytes_per_address: int) -> None:
        if max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        self.max_bytes = max_bytes
        self.max_bytes_per_address = max_bytes_per_address  # 0 = no per-address bound
        self.bytes = 0
        self.by_address: dict[str, int] = {}  # only addresses with bytes in flight: bounded by connections

    def reservation(self, address: str) -> UploadReservation:
        return UploadReservation(self, address)

    def take(self, address: str, n: int) -> None:
        """Count ``n`` more bytes for ``address``; raises UploadRefused (nothing counted) past a bound."""
        mine = self.by_address.get(address, 0) + n
        if self.max_bytes_per_address and mine > self.max_bytes_per_address:
            raise UploadRefused(per_address=True)
        if self.bytes + n > self.max_bytes:
            raise UploadRefused(per_address=False)
        self.by_address[address] = mine
        self.bytes += n

    def give(self, address: str, n: int) -> None:
        if not n:
            return
        left = self.by_address.get(address, 0) - n
        if left < 0 or n > self.bytes:
            raise RuntimeError("upload bytes would go negative")
        if left:
            self.by_address[address] = left
        else:
            self.by_address.pop(address, None)
        self.bytes -= n


class UploadReservation:
    """One body's bytes in ``budget`` while it arrives; released exactly once (idempotent)."""

    __slots__ = ("_budget", "address", "bytes")

    def __init__(self, budget: UploadBudget, address: str) -> None:
        self._budget = budget
        self.address = address
        self.bytes = 0

    def take(self, n: int) -> None:
        self._budget.take(self.address, n)
        self.bytes += n

    def release(self) -> None:
        if self.bytes:
            self._budget.give(self.address, self.bytes)
            self.bytes = 0
