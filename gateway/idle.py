"""Public connections waiting for a request's first byte, oldest first: what a full pool evicts.

nginx's way (``ngx_drain_connections``), by construction rather than by a per-address number: when
the pool is full, or one address is at its cap, a new connection closes the connection that has been
waiting longest for a request (a fresh one that sent nothing yet, or a keep-alive one between
requests) instead of being refused. An idle connection costs its client nothing to lose (an HTTP
client reopens a closed keep-alive connection), so idle connections, from however few addresses,
can never lock anyone out; a connection with a request in progress (any byte of it received) is
never touched. One event loop only (no lock).
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["Evictable", "IdleConnections"]


class Evictable(Protocol):
    peer: str

    def evict(self) -> bool:
        """Close it, unless its next request's bytes just arrived (False: still in use)."""
        ...


class IdleConnections:
    """Insertion order is the order in which connections became idle (dicts keep it), so the first
    key is the oldest; both orders, all and per address, cost O(1) to keep."""

    def __init__(self) -> None:
        self._all: dict[Evictable, bool] = {}
        self._by_peer: dict[str, dict[Evictable, bool]] = {}
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._all)

    def add(self, conn: Evictable) -> None:
        # Once per request on every keep-alive connection: kept to a few dict operations. An
        # address's dict stays while the address has connections (forget() drops it with the last).
        self._all[conn] = True
        mine = self._by_peer.get(conn.peer)
        if mine is None:
            mine = self._by_peer[conn.peer] = {}
        mine[conn] = True

    def discard(self, conn: Evictable) -> None:
        if self._all.pop(conn, False):
            del self._by_peer[conn.peer][conn]

    def forget(self, peer: str) -> None:
        """``peer`` has no connection left (its dict is empty): drop it, so the map is bounded by the
        addresses connected now."""
        mine = self._by_peer.get(peer)
        if mine is not None and not mine:
            del self._by_peer[peer]

    def evict_oldest(self, peer: str | None = None) -> bool:
        """Close the oldest idle connection (of ``peer``, if given). False: none is idle."""
        order = self._all if peer is None else self._by_peer.get(peer) or {}
        while order:
            conn = next(iter(order))
            self.discard(conn)  # in use after all or closed now: either way not idle any more
            if conn.evict():
                self.evicted += 1
                return True
        return False
