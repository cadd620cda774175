"""Waiting for a cold backend: the keepalive SSE stream and the silent hold.

Every wait here is bounded by the request's activation deadline. A held request's connection has
its hang-up watcher armed (``ClientConnection.arm_watch``), which wakes the wait the moment the
client leaves, so a slot - and the request's queued demand - is not held for a client that left
(the activation lease stays, see gateway.activation) and no held request polls its socket. While a
wait runs, the connection is marked held (``ClientConnection.hold``): a FIN then means the client
left, whatever kind of client it is (keep-alive, ``Connection: close``, HTTP/1.0); a half-close is
allowed again only once forwarding begins.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import gevent
import gevent.event

from gateway.activation import Activation
from gateway.errors import ERRORS, sse_error_frame

if TYPE_CHECKING:
    from gateway.server import ClientConnection

__all__ = ["WaitOutcome", "Retry", "wait_ready", "keepalive_stream", "HEARTBEAT", "OPENING_COMMENT"]

HEARTBEAT = b": heartbeat\n\n"
OPENING_COMMENT = HEARTBEAT  # first bytes: commit 200 text/event-stream at once


class WaitOutcome(enum.Enum):
    READY = "ready"
    TIMEOUT = "timeout"
    PENDING = "pending"
    CLIENT_GONE = "client_gone"
    ABORTED = "aborted"  # the drain grace ended: answer now, the process is about to stop
    REFUSED = "refused"  # a silent hold, and the drain began refusing: answer now, the client retries elsewhere


class Retry:
    """Returned by an attempt that could not connect (nothing sent): wait again within the lease."""


RETRY = Retry()


def wait_ready(activation: Activation, deadline: float, until: float,
               conn: ClientConnection | None = None, refused: gevent.event.Event | None = None) -> WaitOutcome:
    """Block this greenlet until the backend is ready, the deadline passes, ``until``, the client
    hangs up (when its watcher is armed), or ``refused`` is set (REFUSED). The connection stays held
    until READY: between two waits of a keepalive stream (a heartbeat write) a FIN is still a hang-up."""
    if conn is None:
        return _wait(activation, deadline, until, None, refused)
    conn.hold(True)
    outcome = _wait(activation, deadline, until, conn, refused)
    if outcome is WaitOutcome.READY:
        conn.hold(False)  # forwarding begins
    return outcome


def _wait(activation: Activation, deadline: float, until: float, conn: ClientConnection | None,
          refused: gevent.event.Event | None) -> WaitOutcome:
    while True:
        if activation.aborted:
            return WaitOutcome.ABORTED
        # Ready, and a Pod has room for a held request (the cold batch, gateway.backends): else wait
        # for the one that is missing. A request that can be forwarded now is, even while draining:
        # it is admitted, and may finish within the grace.
        event = activation.ready_event
        if activation.ready:
            if activation.has_room():
                return WaitOutcome.READY
            event = activation.room_event
        if refused is not None and refused.is_set():
            return WaitOutcome.REFUSED
        if conn is not None and conn.gone:
            return WaitOutcome.CLIENT_GONE
        now = activation.clock()
        if now >= deadline:
            return WaitOutcome.TIMEOUT
        if now >= until:
            return WaitOutcome.PENDING
        events = [e for e in (event, conn.wake if conn is not None else None, refused) if e is not None]
        if len(events) == 1:
            event.wait(min(deadline, until) - now)
        else:
            gevent.wait(events, timeout=min(deadline, until) - now, count=1)


def hold_silently(activation: Activation, deadline: float, conn: ClientConnection,
                  refused: gevent.event.Event | None = None) -> WaitOutcome:
    """Non-streamed request: hold without sending anything until ready / timeout / client gone, or
    until ``refused`` is set (the drain began refusing: nothing was sent yet, so a retryable 503 now
    lets the client retry on another gateway at once rather than wait for a backend here until the
    grace ends). A streamed request's keepalive is not refused: its 200 is committed, it can only end
    with an error frame, so it keeps waiting within the grace (gateway.drain)."""
    return wait_ready(activation, deadline, deadline, conn, refused)


def keepalive_stream(
    activation: Activation,
    deadline: float,
    heartbeat_seconds: float,
    conn: ClientConnection,
    attempt: Callable[[], Retry | Iterator[bytes]],
    on_give_up: Callable[[str], None],
) -> Iterator[bytes]:
    """Body of a committed ``200 text/event-stream`` response for a cold streamed request.

    Heartbeat comments until the backend is ready, then whatever ``attempt()`` relays (the
    backend's own stream, or an error frame). On the deadline: one ``event: error`` frame with
    type ``activation_timeout`` and a clean end of the stream; when the drain grace ends first, one
    ``gateway_draining`` error frame. ``on_give_up(error_kind)`` runs before either frame.
    """
    yield OPENING_COMMENT
    next_heartbeat = activation.clock() + heartbeat_seconds
    while True:
        outcome = wait_ready(activation, deadline, next_heartbeat, conn)
        if outcome is WaitOutcome.CLIENT_GONE:
            return
        if outcome in (WaitOutcome.TIMEOUT, WaitOutcome.ABORTED):
            kind = "activation_timeout" if outcome is WaitOutcome.TIMEOUT else "draining"
            on_give_up(kind)
            yield sse_error_frame(ERRORS[kind])
            return
        if outcome is WaitOutcome.PENDING:
            # A failed write raises ClientGone in the caller, which closes this generator; the
            # caller's finally block releases the slot.
            yield HEARTBEAT
            next_heartbeat = activation.clock() + heartbeat_seconds
            continue
        result = attempt()
        if isinstance(result, Retry):
            continue
        yield from result
        return
