"""Bytes of request bodies still arriving, apart from the bytes held for cold requests.

A body that needs more than one read is in memory while it arrives, whatever the model's state. Those
bytes are counted here, not against the held-while-cold budget (``gateway.state.admission``): an
upload that never finishes must not refuse a warm request, nor one for another model. Two bounds,
both per worker process (like the per-address connection cap, ``gateway.server``):

- per client address (``max_upload_bytes_per_address``): one address cannot take the budget from
  everybody else by opening many uploads;
- per worker (``max_upload_bytes``): all uploads together.

The worker's bound is shared fairly. A static per-address bound alone does not do it: 8 addresses at
their bound (2 x 8 MiB each) fill a 64 MiB budget, and every other client's body over one read was
then refused ``upload_bytes_full`` for as long as those uploads trickled in above the minimum rate
(up to the body cap, 30 minutes). So when the worker's budget is full, an address holding less than
its fair share (the budget divided by the addresses with bytes in flight, itself included) takes the
room from the address holding the most: that address's largest upload is preempted (its bytes leave
the budget at once and its connection is told to stop, ``on_preempt``; the client gets 429
``upload_bytes_full``). The victim always exists: if the budget is full and the newcomer is within
its share, the other addresses hold more than ``(k - 1) / k`` of it between ``k - 1`` of them, so one
holds more than its share. Only a body still arriving is cut (a stalled upload always is): a complete
one being written to the backend leaves the budget soon by itself, and cutting it would fail a request
sent in full; while only such bodies are over their share, the newcomer is refused for that moment.
An address already at or over its share when the budget is full is
refused ``upload_bytes_full``: the worker is genuinely full, for it. One address alone (every
client behind one proxy) has the whole budget as its share, as before.

A body's bytes leave this budget when it has been written to the backend, or when it moves to the
held budget (its request is complete and held for a cold model), or when the request ends. One event
loop only (no lock).
"""

from __future__ import annotations

from collections.abc import Callable

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
        self.holders: set[UploadReservation] = set()  # reservations with bytes in flight (the victims' pool)
        self.preempted = 0  # uploads cut to make room for an address under its fair share

    def reservation(self, address: str) -> UploadReservation:
        return UploadReservation(self, address)

    def fair_share(self, address: str) -> int:
        """The worker's budget divided among the addresses with bytes in flight and ``address``."""
        addresses = len(self.by_address) + (address not in self.by_address)
        return self.max_bytes // addresses

    def take(self, address: str, n: int) -> None:
        """Count ``n`` more bytes for ``address``; raises UploadRefused (nothing counted) past a bound.
        A full worker budget is made room in by preempting uploads of addresses over their fair
        share, when ``address`` stays within its own."""
        mine = self.by_address.get(address, 0) + n
        if self.max_bytes_per_address and mine > self.max_bytes_per_address:
            raise UploadRefused(per_address=True)
        while self.bytes + n > self.max_bytes:
            # fair_share only grows as victims' addresses leave: one check per round is exact.
            share = self.fair_share(address)
            if mine > share or not self._preempt_largest(share):
                raise UploadRefused(per_address=False)
        self.by_address[address] = mine
        self.bytes += n

    def _preempt_largest(self, share: int) -> bool:
        """Cut the largest upload of the address holding the most bytes, over ``share`` (one exists,
        by the argument in the module's docstring). Only a body still arriving can be cut: a
        complete one being written to the backend leaves soon by itself, and cutting it would fail
        a request the client has sent in full. False: nothing to cut. A sort of the uploads in
        flight, only when the budget is full."""
        by_address = self.by_address
        over = [r for r in self.holders if by_address[r.address] > share]
        over.sort(key=lambda r: (by_address[r.address], r.bytes), reverse=True)
        for victim in over:
            if victim.preempt():
                self.preempted += 1
                return True
        return False

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
    """One body's bytes in ``budget`` while it arrives; released exactly once (idempotent).
    ``on_preempt`` (set by the reader of the body) stops the reading when the budget preempts this
    upload, and returns False when the body is no longer arriving (it is not cut then); after a cut
    every ``take`` raises UploadRefused."""

    __slots__ = ("_budget", "address", "bytes", "preempted", "on_preempt")

    def __init__(self, budget: UploadBudget, address: str) -> None:
        self._budget = budget
        self.address = address
        self.bytes = 0
        self.preempted = False
        self.on_preempt: Callable[[], bool] | None = None

    def take(self, n: int) -> None:
        if self.preempted:
            raise UploadRefused(per_address=False)
        self._budget.take(self.address, n)
        if not self.bytes and n:
            self._budget.holders.add(self)
        self.bytes += n

    def preempt(self) -> bool:
        """Stop the reader and give the bytes back now (the reader drops them when it wakes, on the
        next loop turn). False: nobody is reading this body any more, nothing done."""
        if self.on_preempt is None or not self.on_preempt():
            return False
        self.preempted = True
        self.release()
        return True

    def release(self) -> None:
        if self.bytes:
            self._budget.give(self.address, self.bytes)
            self._budget.holders.discard(self)
            self.bytes = 0
