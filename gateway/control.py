"""The control thread: the admin port (``/healthz`` for the kubelet's probes, ``/metrics``,
``/noctaya/queue``) and, in a one-worker Pod in ``local`` mode, KEDA's ExternalScaler
(``scaler.h2server``), served on an OS thread of their own with their own gevent hub.

On the worker's loop they waited behind whatever held it: a public connection keeping it busy, or
idle connections filling the admin pool, made the kubelet's probes time out (liveness restarts the
Pod) and locked KEDA out. On their own thread the interpreter hands them the CPU at least every
``sys.getswitchinterval()`` (5 ms) however busy the worker's loop is, and their connections are
bounded apart from the public port's: a pool of their own, a few per client address
(``control_connections_per_address``), and a short wait for a request head on the admin port
(``admin_idle_timeout_seconds``).

Threads: ``threading.Thread`` is not monkey-patched here, so this thread gets its own hub; gevent
objects (events, pools, timers) belong to the hub of the thread that made them, so everything served
here is built here (:meth:`ControlThread.call`), and the two hubs reach each other only through
``loop.run_callback_threadsafe``. What the handlers read of the worker's state crosses threads:
plain attributes are read whole under the GIL, and collections the worker's loop changes are
iterated as snapshots (``list(d.items())``). An idle control thread has no timer: its hub sleeps
until a connection or a call arrives.
"""

from __future__ import annotations

import socket as std_socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import gevent
import gevent.event
import gevent.pool
import gevent.socket
from gevent._hub_local import get_hub_if_exists
from gevent.server import StreamServer
from greenlet import getcurrent

from gateway.server import (
    ADMIN_MAX_CONNECTIONS,
    AddressCounts,
    ClientConnection,
    ConnectionWatch,
    no_delay,
    peer_of,
    refuse,
)

if TYPE_CHECKING:
    from gateway.server import ServedApp, UploadPace

__all__ = ["AdminServer", "ControlThread", "Pending"]


class Pending:
    """The result of a function run on another hub, awaited in the caller's world: a greenlet waits
    on its own hub (which keeps serving), a plain thread blocks."""

    __slots__ = ("_box", "_wait", "_wake")

    def __init__(self) -> None:
        self._box: dict[str, Any] = {}
        hub = get_hub_if_exists()
        if hub is None or getcurrent() is hub:
            done = threading.Event()
            self._wait, self._wake = done.wait, done.set
        else:
            event = gevent.event.Event()
            loop = hub.loop
            self._wait = event.wait
            # The setter runs in the other thread: the set() is handed to this hub's own loop.
            self._wake = lambda: loop.run_callback_threadsafe(event.set)

    def run(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            self._box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            self._box["error"] = exc
        finally:
            self._wake()

    def get(self, timeout: float | None = None) -> Any:
        """The function's result (its exception re-raised); TimeoutError when it has not ended."""
        if not self._box:
            self._wait(timeout)
        if "error" in self._box:
            raise self._box["error"]
        if "value" not in self._box:
            raise TimeoutError("the control thread did not answer")
        return self._box["value"]


def _gone() -> None:
    """What a call to an ended control thread returns: nothing (its servers ended with it)."""


class ControlThread:
    """An OS thread running a gevent hub of its own until :meth:`stop`."""

    def __init__(self, name: str = "noctaya-control") -> None:
        self.hub: Any = None
        self._started = threading.Event()
        self._stop_signal: Any = None  # the control loop's async watcher; send() is safe from any thread
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> ControlThread:
        self._thread.start()
        self._started.wait()
        return self

    def _run(self) -> None:
        hub = self.hub = gevent.get_hub()
        stopped = gevent.event.Event()
        # A waiting greenlet does not keep a loop running (the hub would raise LoopExit with nothing
        # to watch yet); a referenced async watcher does, and costs nothing until it is sent.
        self._stop_signal = hub.loop.async_()
        self._stop_signal.start(stopped.set)
        self._started.set()
        try:
            stopped.wait()
        finally:
            self._stop_signal.close()
            hub.destroy(destroy_loop=True)

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def submit(self, fn: Callable[..., Any], *args: Any) -> Pending:
        """Run ``fn(*args)`` in a greenlet of the control hub; returns at once."""
        pending = Pending()
        if threading.get_ident() == self._thread.ident:
            gevent.spawn(pending.run, fn, *args)
            return pending
        loop = getattr(self.hub, "loop", None)
        if loop is None or not self._thread.is_alive():
            # The thread has ended (stopped, or its hub destroyed): what it served ended with it.
            pending.run(_gone)
            return pending
        loop.run_callback_threadsafe(gevent.spawn, pending.run, fn, *args)
        return pending

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float | None = 30.0) -> Any:
        """``fn(*args)`` run in a greenlet of the control hub, its result returned to the caller."""
        if threading.get_ident() == self._thread.ident:
            return fn(*args)
        return self.submit(fn, *args).get(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """End the thread (what it served must have been stopped first)."""
        if self._stop_signal is None or not self._thread.is_alive():
            return
        self._stop_signal.send()
        self._thread.join(timeout)


class AdminServer:
    """The admin port on the control hub: a pool of its own (``ADMIN_MAX_CONNECTIONS``), at most
    ``control_connections_per_address`` connections per client address (429 and closed beyond), a
    head that must start and complete within ``admin_idle_timeout_seconds``, and a watchdog of its
    own. Build in the control thread (``ControlThread.call(AdminServer.serve, ...)``)."""

    def __init__(self, app: ServedApp, listener: std_socket.socket, pace: UploadPace | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        config = app.config
        self.app = app
        self.clock = clock
        self.pace = pace
        self.idle_timeout = config.admin_idle_timeout_seconds
        self.addresses = AddressCounts(config.control_connections_per_address)
        self.watch = ConnectionWatch(clock)
        self.server = StreamServer(listener, self._handle, spawn=gevent.pool.Pool(ADMIN_MAX_CONNECTIONS))
        self._watchdog: gevent.Greenlet | None = None

    @classmethod
    def serve(cls, app: ServedApp, listener: std_socket.socket, pace: UploadPace | None) -> AdminServer:
        server = cls(app, listener, pace)
        server.server.start()
        server._watchdog = gevent.spawn(server.watch.run)
        return server

    def _handle(self, sock: gevent.socket.socket, address: Any) -> None:
        peer = peer_of(address)
        if not self.addresses.admit(peer):
            refuse(self.app, sock)
            return
        try:
            no_delay(sock)
            # The short idle time bounds the wait for a head to start (from the accept and between
            # requests) and request_timeout the head itself: a probe or a scrape sends its request at once.
            conn = ClientConnection(sock, peer, self.idle_timeout, self.clock, True, self.idle_timeout, self.pace)
            self.watch.serve(self.app, conn)
        finally:
            self.addresses.leave(peer)

    def stop(self, timeout: float) -> None:
        """Stop accepting, give open connections ``timeout`` seconds, cut the rest."""
        self.server.close()
        self.watch.drain(timeout)
        if self._watchdog is not None:
            self._watchdog.kill(block=False)
