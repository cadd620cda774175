"""The time-slice oracle (issue 38): how long the gateway's loop thread ran between two greenlet
switches, in that thread's CPU time.

While one greenlet runs, nothing else on its loop does: not the other clients, not the kubelet's
probes, not KEDA's calls. So the longest stretch between two switches is the longest any of them
waited for the CPU of that thread, and counting it in the thread's own CPU time (not the wall clock)
makes it a property of the code, not of the machine's load: a test can assert it on a busy CI runner.
gevent's blocking monitor measures wall time between loop iterations: right for the benchmark, not
for a test.

Install in the loop's own thread (``ThreadedGateway.call(watch.install)``); read from any thread.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import greenlet

__all__ = ["LoopWatch"]


class LoopWatch:
    def __init__(self) -> None:
        self.longest = 0.0  # seconds of CPU time, the longest stretch seen
        self.where = ""  # the greenlet that ran it
        self.switches = 0
        self.gc_longest = 0.0  # CPU seconds of the longest cyclic collection in the loop's thread
        self._mark = 0.0
        self._gc_started = 0.0
        self._thread = 0
        self._previous: Any = None

    def install(self) -> None:
        self._mark = time.thread_time()
        self._thread = threading.get_ident()
        self._previous = greenlet.settrace(self._trace)
        gc.callbacks.append(self._collected)

    def uninstall(self) -> None:
        greenlet.settrace(self._previous)
        if self._collected in gc.callbacks:
            gc.callbacks.remove(self._collected)

    def _collected(self, phase: str, _info: dict) -> None:
        """A cyclic collection in the loop's thread is not the code's stretch: the interpreter's, and
        it scans the whole process (a test process's heap after a thousand tests: 0.1-0.3 s). Its CPU
        time is left out of the stretch it fell in and kept apart (``gc_longest``); a worker in
        production runs with gc.freeze() and a high threshold (gateway.workers) for that reason."""
        if threading.get_ident() != self._thread:
            return
        if phase == "start":
            self._gc_started = time.thread_time()
            return
        spent = time.thread_time() - self._gc_started
        self._mark += spent
        self.gc_longest = max(self.gc_longest, spent)

    def reset(self) -> None:
        self.longest, self.where, self.switches = 0.0, "", 0
        self._mark = time.thread_time()

    def _trace(self, event: str, args: Any) -> None:
        if event not in ("switch", "throw"):
            return
        now = time.thread_time()
        stretch = now - self._mark
        self._mark = now
        self.switches += 1
        if stretch > self.longest:
            origin = args[0]
            self.longest = stretch
            self.where = f"{getattr(origin, 'name', None) or type(origin).__name__} at {_frames(origin)}"


def _frames(glet: Any, depth: int = 6) -> str:
    """Where the greenlet that ran the stretch stopped (its innermost frames), to name the loop."""
    frame, out = getattr(glet, "gr_frame", None), []
    while frame is not None and len(out) < depth:
        out.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}")
        frame = frame.f_back
    return " < ".join(out)
