"""Which backend Pod takes a request: pure rules over the Pods' outstanding counts, no sockets, no clocks.

- **Least outstanding.** Without an affinity key, the eligible Pod with the fewest requests in
  flight from this worker; ties go round robin, so a Pod that just turned Ready (zero outstanding)
  gets the next requests at once.
- **Prefix affinity with bounded load.** With a key (``gateway.affinity``), consistent hashing: each
  Pod owns ``VNODES`` points of a 32-bit ring placed by hashing its *name*, so every worker and every
  gateway replica maps a key to the same Pod, and a Pod joining or leaving moves only the keys it
  takes or had. The key's home is the first Pod clockwise from the key's hash; the request goes to
  the first Pod on that walk whose load, with it, stays within ``max(least + 1, factor * (total + 1)
  / pods)`` (:func:`bound`). The second term is the bound of consistent hashing with bounded loads
  (Mirrokni et al.; HAProxy's ``hash-balance-factor``), without its rounding up; the first lets the
  least loaded Pod always take one more. Without the rounding, few requests of one hot prefix spread
  evenly (six over three Pods: 2 / 2 / 2, where ``ceil`` gave 3 / 3 / 0 and left a Pod idle); with
  many, a conversation returns to the Pod holding its KV cache until its Pod carries a quarter more
  than the mean.
- **Cold batch.** A request released from the cold queue while other Pods of the model are still
  starting takes a Pod only below ``batch`` outstanding; with none below it, it waits for the next
  Pod to turn ready or a request to finish (``choose`` returns None). With no Pod starting, the rule
  is off: holding a request for a Pod that is not coming would only delay it.
"""

from __future__ import annotations

import bisect
import hashlib
import zlib
from collections.abc import Mapping, Sequence
from typing import Protocol

__all__ = ["Loaded", "AffinityRing", "Choice", "choose", "bound", "key_hash", "VNODES", "DEFAULT_LOAD_FACTOR"]

VNODES = 64  # ring points per Pod: with 3 Pods the largest share of the ring is within ~±15 % of a third
DEFAULT_LOAD_FACTOR = 1.25


class Loaded(Protocol):
    name: str
    outstanding: int


def key_hash(data: bytes | memoryview, seed: int = 0) -> int:
    """A stable 32-bit hash, the same in every process (never Python's salted ``hash``): CRC-32 in C,
    a tenth of a cryptographic hash's cost per request; a ring needs spread, not secrecy (a client
    choosing its key only chooses its own Pod, within the load bound)."""
    return zlib.crc32(data, seed)


def _point(name: str, index: int) -> int:
    """A Pod's ``index``-th point on the ring (computed once per ring, so a strong hash is affordable:
    its points spread evenly whatever the names look like)."""
    return int.from_bytes(hashlib.blake2b(f"{name}#{index}".encode(), digest_size=4).digest(), "big")


class AffinityRing:
    """The hash ring of a set of Pod names (rebuilt when the set changes; a lookup is one bisect into
    walks computed with the ring: each point's first ``WALK`` distinct Pods)."""

    __slots__ = ("names", "_points", "_owners", "_walks")

    WALK = 4  # Pods a walk tries before the rest (only when these four are all over the bound)

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(sorted(names))
        points = sorted((_point(name, i), name) for name in self.names for i in range(VNODES))
        self._points = [p for p, _ in points]
        self._owners = [n for _, n in points]
        self._walks = [self._walk_from(i, min(self.WALK, len(self.names))) for i in range(len(points))]

    def _walk_from(self, start: int, count: int) -> tuple[str, ...]:
        seen: list[str] = []
        owners = self._owners
        for i in range(len(owners)):
            name = owners[(start + i) % len(owners)]
            if name not in seen:
                seen.append(name)
                if len(seen) == count:
                    break
        return tuple(seen)

    def _start(self, key: int) -> int:
        return bisect.bisect_left(self._points, key) % len(self._points)

    def walk(self, key: int) -> tuple[str, ...]:
        """The first Pods (at most ``WALK``) a key's request tries, its home first."""
        return self._walks[self._start(key)] if self._points else ()

    def walk_all(self, key: int) -> tuple[str, ...]:
        """Every Pod, in the order a key's request tries them."""
        return self._walk_from(self._start(key), len(self.names)) if self._points else ()


def bound(total_outstanding: int, pods: int, factor: float, least: int = 0) -> float:
    """Most requests a Pod may have with a keyed one placed on it: ``max(least + 1, factor * (total +
    1) / pods)`` (``least``: the fewest any eligible Pod has, which can always take one more)."""
    return max(least + 1, factor * (total_outstanding + 1) / max(1, pods))


class Choice:
    """The Pod chosen and how: ``affinity`` is ``"hit"`` (the key's home), ``"spill"`` (home over
    its bound) or ``"none"`` (no key, or affinity off)."""

    __slots__ = ("pod", "affinity")

    def __init__(self, pod: Loaded, affinity: str) -> None:
        self.pod = pod
        self.affinity = affinity


def _least(pods: Sequence[Loaded], turn: int) -> Loaded:
    fewest = min(p.outstanding for p in pods)
    tied = [p for p in pods if p.outstanding == fewest]
    return tied[turn % len(tied)]


def _by_affinity(pods: Sequence[Loaded], ring: AffinityRing, key: int, factor: float,
                 by_name: Mapping[str, Loaded] | None) -> Choice:
    if by_name is None:
        by_name = {p.name: p for p in pods}
    total, least = 0, pods[0].outstanding
    for p in pods:
        total += p.outstanding
        least = min(least, p.outstanding)
    limit = max(least + 1, factor * (total + 1) / len(pods))  # bound(), inlined: once per request
    home = True
    walk = ring.walk(key)
    for names in (walk, ring.walk_all(key)[len(walk):]):  # the rest only when the first are all full
        for name in names:
            pod = by_name.get(name)
            if pod is None:  # on the ring but not eligible now (terminating, not ready): skip
                continue
            if pod.outstanding + 1 <= limit:
                return Choice(pod, "hit" if home else "spill")
            home = False
    return Choice(_least(pods, 0), "spill")  # every Pod at the bound: cannot be, the least loaded fits


def choose(pods: Sequence[Loaded], *, key: int | None = None, ring: AffinityRing | None = None,
           factor: float = DEFAULT_LOAD_FACTOR, batch: int | None = None, turn: int = 0,
           by_name: Mapping[str, Loaded] | None = None) -> Choice | None:
    """The Pod for one request among the eligible ``pods`` (see the module doc); None when ``batch``
    leaves no room (the caller holds the request) or there is no Pod. ``by_name``: ``pods`` by name,
    when the caller keeps it (else it is built per call)."""
    if batch is not None:
        pods = [p for p in pods if p.outstanding < batch]
        by_name = None
    if not pods:
        return None
    if len(pods) == 1:  # nothing to decide: not counted as an affinity outcome
        return Choice(pods[0], "none")
    if key is None or ring is None:
        return Choice(_least(pods, turn), "none")
    return _by_affinity(pods, ring, key, factor, by_name)
