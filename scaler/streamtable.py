"""Who holds the scaler's StreamIsActive slots, by client address (issue 38, row 9).

The servicer bounds the open StreamIsActive streams (``ScalerSettings.max_streams``), and any
process that reaches the scaler port can open them: without more, one that opens them all first
leaves KEDA's own stream refused. A per-address cap would not do: KEDA's operator reaches the
scaler from one address with one stream per ScaledObject, so its address may need every slot.

The rule instead: when the table is full, a newcomer whose address holds at least two streams fewer
than the address holding the most takes the oldest stream of that address, which is ended with a
status KEDA retries (UNAVAILABLE). That is max-min fairness: each address keeps at least its equal
share of the table whatever the others open, so KEDA's ScaledObjects keep half of it against one
other address. "Two fewer" keeps two addresses at equal shares from taking turns evicting each
other; a newcomer from the biggest holder is refused as before (RESOURCE_EXHAUSTED), so KEDA alone
beyond the bound never churns its own streams.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

__all__ = ["StreamTable"]

T = TypeVar("T")


class StreamTable(Generic[T]):
    """Open streams by address, oldest first. Not thread-safe: one gevent loop uses it."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._by_address: dict[str, OrderedDict[T, None]] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def count(self, address: str) -> int:
        return len(self._by_address.get(address, ()))

    def admit(self, address: str, stream: T) -> tuple[bool, T | None]:
        """(admitted, the stream to end to make room or None). Not admitted: the table is full and
        ``address`` already holds its fair share."""
        victim = None
        if self._size >= self.capacity:
            biggest = max(self._by_address, key=lambda a: len(self._by_address[a]))
            streams = self._by_address[biggest]
            if len(streams) < self.count(address) + 2:
                return False, None
            victim = next(iter(streams))
            self.remove(biggest, victim)
        self._by_address.setdefault(address, OrderedDict())[stream] = None
        self._size += 1
        return True, victim

    def remove(self, address: str, stream: T) -> None:
        streams = self._by_address.get(address)
        if streams is None or stream not in streams:
            return
        del streams[stream]
        self._size -= 1
        if not streams:
            del self._by_address[address]
