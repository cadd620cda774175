"""Graceful shutdown of one worker on SIGTERM (the supervisor forwards it to every worker).

1. readiness (``/healthz``) turns 503 at once, while new requests are still served for the drain
   delay (``drain_delay_seconds``, inside the grace): Kubernetes removes a terminating Pod from its
   Service's endpoints at once, but kube-proxy and client-side balancers send new connections here
   until they learn it;
2. then new ``/v1`` requests get a 503 ``gateway_draining`` (``Retry-After: 1``) that closes the
   connection and that the OpenAI SDKs retry (the request never reached a backend; the retry's
   connection goes elsewhere). At that moment (``app.start_draining``) the requests held silently for
   a cold backend get the same 503 and leave: nothing was sent for them, and another gateway can
   serve their retry now, where here they would wait for a backend until the grace ends. A held
   streamed request keeps waiting (its 200 is committed: it can end only with an SSE error frame):
   a backend Ready within the grace serves it, else the grace's end gives it one ``gateway_draining``
   error frame (``abort_waiters``). Requests in flight may finish within the drain grace;
3. the worker's demand is withdrawn (its row reads zero) and the ``after_withdraw`` steps run;
4. the HTTP server stops (closing whatever is left after the grace): the public port on this
   loop, the admin port on the control thread (``gateway.control``) at the same time; probes are
   answered until then.

Once every worker has drained, the supervisor withdraws the Pod's demand (report mode POSTs
``withdraw: true``) and stops the scaler child process, ending its StreamIsActive streams with OK;
a one-worker Pod does the same with its in-process scaler, on the control thread, then ends that
thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import gevent
import gevent.event

if TYPE_CHECKING:
    from gateway.server import GatewayServer

__all__ = ["Drainer"]

log = logging.getLogger("noctaya.gateway.drain")

ABORT_WRITE_SECONDS = 1.0  # after the grace: time for aborted cold waiters to write their error


class Drainer:
    def __init__(
        self,
        server: GatewayServer,
        grace: float,
        *,
        delay: float = 0.0,
        after_withdraw: list[Callable[[], None]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        poll: float = 0.05,
    ) -> None:
        self.server = server
        self.grace = grace
        self.delay = min(delay, grace)  # the delay is part of the grace, never beyond it
        self.after_withdraw = after_withdraw or []
        self.clock = clock
        self.poll = poll
        self.done = gevent.event.Event()
        self.started = False
        self.unfinished = 0

    def begin(self) -> None:
        """Idempotent (a second SIGTERM does not restart the grace)."""
        if self.started:
            return
        self.started = True
        app = self.server.app
        app.announce_shutdown()
        log.info("draining", extra={"grace_seconds": self.grace, "delay_seconds": self.delay, "admitted": app.admitted})
        gevent.spawn(self._run)

    def _run(self) -> None:
        app = self.server.app
        now = self.clock()
        deadline = now + self.grace
        try:
            gevent.sleep(max(0.0, now + self.delay - self.clock()))
            app.start_draining()
            while app.admitted > 0 and self.clock() < deadline:
                gevent.sleep(self.poll)
            self.unfinished = app.admitted
            if self.unfinished:
                log.warning("drain grace over with requests unfinished", extra={"unfinished": self.unfinished})
                # Cold waiters get a bounded error rather than a cut connection; give them a moment
                # to write it before the server stops.
                app.abort_waiters()
                abort_deadline = self.clock() + ABORT_WRITE_SECONDS
                while app.waiting > 0 and self.clock() < abort_deadline:
                    gevent.sleep(self.poll)
            app.withdraw()
            for step in self.after_withdraw:
                try:
                    step()
                except Exception:  # one failing step must not keep the process alive
                    log.exception("drain step failed")
            self.server.stop(timeout=1.0)
        finally:
            log.info("drained")
            self.done.set()
