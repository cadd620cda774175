"""Time slices: a loop that works on client input (or renders for a scrape) gives the event loop
back after at most ``SLICE_SECONDS`` of this thread's CPU time, whatever arrives.

Yielding by bytes or by steps is not enough: gevent's ``recv`` does not switch while input is queued,
so a read loop that is never starved never yields, and a step's cost depends on what the client sent
(a 2-byte chunk costs as much parsing as a 64 KiB one). CPU time is what other clients wait for, so
it is what is counted: ``time.thread_time()`` (CLOCK_THREAD_CPUTIME_ID), which a loaded machine does
not inflate, so the same bound holds in tests and in production.

:class:`Slice` is the budget of one loop; ``due()`` is cheap enough to call per read or per model.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import gevent

__all__ = ["SLICE_SECONDS", "Slice", "yield_now"]

SLICE_SECONDS = 0.002


def yield_now() -> None:
    """Let every other ready greenlet and the loop's I/O run, then continue."""
    gevent.sleep(0)


class Slice:
    """The CPU budget of one loop since it last yielded."""

    __slots__ = ("budget", "mark", "yields", "_yield")

    def __init__(self, budget: float = SLICE_SECONDS, yielder: Callable[[], None] = yield_now) -> None:
        self.budget = budget
        self._yield = yielder
        self.mark = time.thread_time()
        self.yields = 0

    def due(self) -> bool:
        return time.thread_time() - self.mark >= self.budget

    def check(self) -> None:
        """Yield when the budget is spent (then a fresh budget starts)."""
        if time.thread_time() - self.mark >= self.budget:
            self._yield()
            self.yields += 1
            self.mark = time.thread_time()
