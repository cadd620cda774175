"""Waiting for a cold backend: the keepalive SSE stream and the silent hold.

Every wait here is bounded by the request's activation deadline, and checks every
``CHECK_INTERVAL`` seconds whether the client has gone (so a slot is not held for a client that
left; the lease - and with it the demand - stays, see gateway.activation).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator

from gateway.activation import Activation
from gateway.errors import ERRORS, sse_error_frame

__all__ = ["WaitOutcome", "Retry", "wait_ready", "keepalive_stream", "HEARTBEAT", "OPENING_COMMENT"]

CHECK_INTERVAL = 1.0  # client-gone check while waiting silently
HEARTBEAT = b": heartbeat\n\n"
OPENING_COMMENT = HEARTBEAT  # first bytes: commit 200 text/event-stream at once


class WaitOutcome(enum.Enum):
    READY = "ready"
    TIMEOUT = "timeout"
    PENDING = "pending"
    CLIENT_GONE = "client_gone"
    ABORTED = "aborted"  # the drain grace ended: answer now, the process is about to stop


class Retry:
    """Returned by an attempt that could not connect (nothing sent): wait again within the lease."""


RETRY = Retry()


def wait_ready(activation: Activation, deadline: float, until: float) -> WaitOutcome:
    """Block this greenlet until the backend is ready, the deadline passes, or ``until``."""
    while True:
        if activation.aborted:
            return WaitOutcome.ABORTED
        if activation.ready:
            return WaitOutcome.READY
        now = activation.clock()
        if now >= deadline:
            return WaitOutcome.TIMEOUT
        if now >= until:
            return WaitOutcome.PENDING
        activation.ready_event.wait(min(deadline, until) - now)


def hold_silently(activation: Activation, deadline: float, client_gone: Callable[[], bool]) -> WaitOutcome:
    """Non-streamed request: hold without sending anything until ready / timeout / client gone."""
    while True:
        outcome = wait_ready(activation, deadline, activation.clock() + CHECK_INTERVAL)
        if outcome is not WaitOutcome.PENDING:
            return outcome
        if client_gone():
            return WaitOutcome.CLIENT_GONE


def keepalive_stream(
    activation: Activation,
    deadline: float,
    heartbeat_seconds: float,
    client_gone: Callable[[], bool],
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
        now = activation.clock()
        outcome = wait_ready(activation, deadline, min(next_heartbeat, now + CHECK_INTERVAL))
        if outcome in (WaitOutcome.TIMEOUT, WaitOutcome.ABORTED):
            kind = "activation_timeout" if outcome is WaitOutcome.TIMEOUT else "draining"
            on_give_up(kind)
            yield sse_error_frame(ERRORS[kind])
            return
        if outcome is WaitOutcome.PENDING:
            if activation.clock() >= next_heartbeat:
                # A failed write here raises in pywsgi, which closes this generator: the finally
                # blocks of the caller release the slot.
                yield HEARTBEAT
                next_heartbeat = activation.clock() + heartbeat_seconds
            elif client_gone():
                return
            continue
        result = attempt()
        if isinstance(result, Retry):
            continue
        yield from result
        return
