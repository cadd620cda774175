"""The gateway's request handler (SPEC §6): a thin layer over the request policy, the state objects
and the relay.

authenticate -> read the whole body (its bytes counted against the upload bounds as they arrive, per
client address and per worker, under the minimum-rate rule) -> warm: take a slot and forward at once / cold: inspect the body
(bounded), take a slot, move its bytes to the held-while-cold budget, start or extend the activation
lease, then wait (keepalive SSE heartbeats,
silent hold, or 503 in reject mode) -> forward once the backend answers its readiness path -> relay.

A request takes no slot and makes no demand before its body is complete: a client that trickles
its request cannot lock others out or wake a model. What is answered is decided in
``gateway.policy``, bytes are moved by ``gateway.forward`` (to the client) and ``gateway.relay``
(to the backend), and time to first token is ``gateway.timing``'s. The connection layer
(``gateway.server``) calls :meth:`GatewayApp.handle` once per parsed request and keeps the
connection when it returns True.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import unquote

import gevent
import gevent.event
from gevent.hub import Waiter

from gateway import cold
from gateway import metrics as metrics_module
from gateway.activation import Activation
from gateway.auth import KeyFileAuthenticator
from gateway.backends import Backends
from gateway.config import GatewayConfig
from gateway.endpointslices import EndpointFeed
from gateway.errors import (
    ERRORS,
    NO_RETRY,
    GatewayError,
    backend_failure,
    error_body,
    model_not_found,
    sse_error_frame,
)
from gateway.forward import ClientRelay
from gateway.metrics import REJECTION_REASONS, GatewayMetrics
from gateway.policy import InvalidJSON, inspect_cold_body, route
from gateway.relay import (
    ConnectFailed,
    UpstreamConnection,
    UpstreamFailed,
    read_response_head,
    send_request,
)
from gateway.server import (
    ClientBodyError,
    ClientConnection,
    ClientGone,
    HeldBytesExhausted,
    RequestBodyTooLarge,
    RequestTimedOut,
)
from gateway.state.admission import BodyReservation, Ticket
from gateway.state.pod import IN_FLIGHT, QUEUED, PodState
from gateway.state.readiness import ProbeResult  # noqa: F401 - re-exported for tests
from gateway.state.uploads import UploadBudget, UploadRefused, UploadReservation
from gateway.timing import RequestTiming, produces_tokens
from gateway.wire import LAST_CHUNK, BadRequest, RequestHead, ResponseHead, chunk, connection_tokens, response_head

__all__ = ["GatewayApp", "RequestBody"]

log = logging.getLogger("noctaya.gateway")

# A draining gateway's 503 (new requests, held ones when the drain starts refusing, held ones at the
# grace's end): the retry goes on a new connection, which by then reaches another gateway (the Pod
# left its Service during the drain delay), so it need not wait; the openai SDKs honour Retry-After.
DRAIN_RETRY_AFTER = [(b"Retry-After", b"1")]

_SSE_HEADERS = [(b"Content-Type", b"text/event-stream"), (b"Cache-Control", b"no-cache"),
                (b"X-Accel-Buffering", b"no")]


class _IdleTurns:
    """One hub's scans waiting for the loop to be idle, served one at a time, round-robin: each idle
    moment of the loop resumes one scan for one step, then the loop polls its sockets again.

    With an idle watcher per scan (``gevent.idle()`` in each), libev resumed every waiting scan at the
    same idle moment, one after another with no poll between them: with four 8 MiB hostile bodies in
    flight a round was four steps (~30-130 ms: the longest step is msgspec's one C call, ~30 ms), and
    a warm request waited one round at each of its socket waits (its body, its backend's answer):
    p99 ~240 ms against ~5 ms quiet on a shared gateway (tests/gateway/test_loop_starvation.py).
    Served one per idle moment, a socket wait is behind one step at most, and the scans still share
    the idle CPU in turns (a small body's one or two pauses are not stuck behind a large one's)."""

    def __init__(self, hub: Any) -> None:
        self._waiters: deque[Waiter] = deque()
        self._watcher = hub.loop.idle()

    def wait(self) -> None:
        waiter = Waiter()
        self._waiters.append(waiter)
        if not self._watcher.active:
            self._watcher.start(self._turn)
        try:
            waiter.get()
        finally:  # killed (the client left) or timed out while waiting: give up the place in line
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            if not self._waiters:
                self._watcher.stop()

    def _turn(self) -> None:  # in the hub, at an idle moment
        waiter = self._waiters.popleft()
        if not self._waiters:
            self._watcher.stop()
        waiter.switch(None)


_idle_turns: weakref.WeakKeyDictionary[Any, _IdleTurns] = weakref.WeakKeyDictionary()  # per hub (thread)


def yield_to_loop() -> None:
    """Between steps of a body's JSON scan: the hub serves everything else first (sockets, timers,
    other greenlets: other clients; probes and KEDA's calls have the control thread's hub) and resumes the
    scan when it is idle, one scan per idle moment (:class:`_IdleTurns`). ``gevent.sleep(0)`` was
    not enough: it queues the scan as a callback that runs on every turn of the loop, so a probe that
    needs several turns waited behind a step of every scan in flight at each of them (0.6-1.1 s with
    four 8 MiB bodies)."""
    hub = gevent.get_hub()
    turns = _idle_turns.get(hub)
    if turns is None:
        turns = _idle_turns[hub] = _IdleTurns(hub)
    turns.wait()


class RequestBody:
    """A received request body, its bytes counted as an upload (``upload``) until it is held for a
    cold model, then in the held-body budget (``reservation``). Dropped (memory and both budgets) as
    soon as it has been written to the backend, not when the answer ends."""

    __slots__ = ("data", "reservation", "upload")

    def __init__(self, data: bytes, reservation: BodyReservation, upload: UploadReservation | None = None) -> None:
        self.data = data
        self.reservation = reservation
        self.upload = upload

    def hold(self) -> bool:
        """The request is held for a cold model: its bytes move from the upload bounds to the held
        budget (False, nothing moved, when that cannot take them)."""
        if not self.reservation.cover(len(self.data)):
            return False
        if self.upload is not None:
            self.upload.release()
        return True

    def drop(self) -> None:
        self.data = b""
        self.reservation.release()
        if self.upload is not None:
            self.upload.release()


def answer_error(conn: ClientConnection, metrics: GatewayMetrics, name: str,
                 extra: list[tuple[bytes, bytes]] | None = None, *, close: bool = False,
                 error: GatewayError | None = None) -> bool:
    """Answer an OpenAI-style error (``error``: ``name``'s with its own message, e.g. naming the
    model); returns whether the connection may continue."""
    if error is None:
        error = ERRORS[name]
    if name in REJECTION_REASONS:
        metrics.reject(name)
    headers = list(extra or [])
    if name == "draining" and not extra:
        headers += DRAIN_RETRY_AFTER
    if name in NO_RETRY:
        headers.append((b"x-should-retry", b"false"))
    # A request whose body was not read cannot be followed on the same connection.
    close = close or not conn.message_done
    metrics.count_response(error.status)
    conn.respond(error.status, error_body(error), extra=headers, close=close)
    return not close


def answer_body_failure(conn: ClientConnection, metrics: GatewayMetrics, exc: Exception,
                        retry_429: list[tuple[bytes, bytes]]) -> bool:
    """A body that could not be received: nothing was admitted; the connection closes (the rest
    of the upload is unread)."""
    conn.message_done = False
    if isinstance(exc, RequestTimedOut):
        return answer_error(conn, metrics, "client_too_slow" if exc.slow else "request_timeout", close=True)
    if isinstance(exc, UploadRefused):
        name = "upload_bytes_per_address" if exc.per_address else "upload_bytes_full"
        return answer_error(conn, metrics, name, retry_429, close=True)
    if isinstance(exc, HeldBytesExhausted):
        return answer_error(conn, metrics, "queue_bytes_full", retry_429, close=True)
    name = "too_large" if isinstance(exc, RequestBodyTooLarge) else "bad_request"
    cause = exc.__cause__
    if isinstance(cause, BadRequest) and cause.status == 431:  # a body's framing or trailer past its bound
        name = "headers_too_large"
    return answer_error(conn, metrics, name, close=True)


class AnswersHere:
    """Answers the gateway writes itself (errors, health, plain 200s), for one model's app and for a
    shared gateway's: both have ``metrics`` and ``draining``."""

    metrics: GatewayMetrics
    draining: bool
    unready = False  # readiness 503 after SIGTERM, while requests are still served (the drain delay)

    def _error(self, conn: ClientConnection, name: str, extra: list[tuple[bytes, bytes]] | None = None,
               *, close: bool = False) -> bool:
        return answer_error(conn, self.metrics, name, extra, close=close)

    def bad_request(self, conn: ClientConnection, exc: BadRequest | RequestTimedOut) -> None:
        """Malformed or late HTTP from the client: a JSON 400/408/414/431, then the connection closes."""
        if isinstance(exc, RequestTimedOut):
            name = "request_timeout"
        else:
            name = {414: "uri_too_long", 431: "headers_too_large"}.get(exc.status, "bad_request")
        conn.message_done = True
        try:
            self._error(conn, name, close=True)
        except ClientGone:
            pass

    def _ok(self, conn: ClientConnection, body: bytes, content_type: bytes = b"application/json") -> bool:
        self.metrics.count_response(200)
        conn.respond(200, body, content_type=content_type, close=not conn.message_done)
        return conn.message_done

    def _health(self, conn: ClientConnection, head: RequestHead) -> bool:
        if self.draining or self.unready:
            self.metrics.count_response(503)
            conn.respond(503, b'{"status":"draining"}')
            return True
        return self._ok(conn, b'{"status":"ok"}')

    def connection_refused(self) -> None:
        """Count a connection refused before it was read (too many connections)."""
        self.metrics.count_response(429)
        self.metrics.reject("too_many_connections")

    def announce_shutdown(self) -> None:
        """Readiness turns 503 (the Pod leaves its Service); requests are still served."""
        self.unready = True
        self.metrics.set_draining(True)

    def start_draining(self) -> None:
        """New API requests are refused (a retryable 503 that closes the connection)."""
        self.unready = True
        self.draining = True
        self.metrics.set_draining(True)


class GatewayApp(AnswersHere):
    """One worker's handler. Construct inside the hub thread that will serve it."""

    def __init__(self, config: GatewayConfig, *, pod: PodState | None = None, worker: int = 0,
                 clock: Callable[[], float] = time.monotonic, feed: EndpointFeed | None = None,
                 namespace: str = "") -> None:
        self.config = config
        self.clock = clock
        self.pod = pod if pod is not None else PodState(1, config.max_queue, config.max_held_body_bytes)
        self.metrics = GatewayMetrics(self.pod, worker, config.backend_accelerators)
        # The backend side: its Pods (balanced, each with a pool) or the Service address.
        self.backends = Backends(config, self.metrics, clock=clock, on_change=self._pods_changed)
        self.pool = self.backends.service
        self.relay = ClientRelay(self.metrics, clock)
        self.activation = Activation(
            max_queue=config.max_queue, max_held_bytes=config.max_held_body_bytes,
            activation_timeout=config.activation_timeout_seconds, ready_grace=config.ready_grace_seconds,
            metrics=self.metrics, probe=self.backends.probe, probe_interval=config.probe_interval_seconds, clock=clock,
            settled=lambda: self.backends.settled, room=self.backends.has_room, room_event=self.backends.room,
        )
        self.auth = KeyFileAuthenticator(config.key_files) if config.key_files else None
        self.draining = False
        # Set when the drain starts refusing: requests held silently for a cold backend answer then.
        self._refusing = gevent.event.Event()
        self._base = config.backend_base_path.encode("latin-1")
        self._host = config.backend_netloc.encode("latin-1")
        self._model = config.served_model_name
        self._models_body = json.dumps({"object": "list", "data": [self._model_object()]}).encode()
        self._retry_429 = [(b"Retry-After", b"%d" % config.queue_full_retry_after_seconds)]
        self._retry_503 = [(b"Retry-After", b"%d" % config.retry_after_seconds)]
        self.uploads = UploadBudget(config.upload_bytes, config.upload_bytes_per_address)
        self._routes = {"health": self._health, "metrics": self._metrics, "queue": self._queue,
                        "models": self._models, "forward": self._forward_request}
        self.backends.follow(feed, namespace)

    # -- lifecycle, as GatewayServer and Drainer use it (a shared gateway's app has the same) -------
    def background(self) -> list[Callable[[], None]]:
        """What runs beside the connections, each in a greenlet of its own."""
        return [self.activation.prober.run]

    def close(self) -> None:
        self.activation.prober.stop()
        self.backends.close()

    def _pods_changed(self) -> None:
        """The endpoint source changed the backend's Pods: readiness follows at once (a held
        request is released the moment a Pod may take it), and starting Pods are probed."""
        activation = getattr(self, "activation", None)
        if activation is None:  # the first delivery comes while the app is being built
            return
        if self.backends.pods is not None:
            activation.report_probe(self.backends.verdict())
        activation.prober.hurry()

    @property
    def admitted(self) -> int:
        """Requests admitted and not finished (waiting or in flight)."""
        return self.activation.slots.total

    @property
    def waiting(self) -> int:
        return self.activation.slots.queued

    def rename(self, new_name: str) -> None:
        """Serve the same backend under ``new_name``. A shared gateway's member renamed with no other
        setting changed keeps its app through this (call in the hub thread), so its held requests,
        lease, prober and pool carry on rather than starting over in a new app; what carries the name
        follows: the config's served_model_name and the app's own ``/v1/models`` answers."""
        self.config = dataclasses.replace(self.config, served_model_name=new_name)
        self._model = new_name
        self._models_body = json.dumps({"object": "list", "data": [self._model_object()]}).encode()

    def start_draining(self) -> None:
        """New API requests are refused, and so are the requests held silently for a cold backend
        (their retryable 503 now: they would otherwise wait here until the grace ends, for a backend
        this gateway will not serve them from). Held streamed requests keep waiting within the
        grace: their 200 is committed (gateway.cold.hold_silently)."""
        super().start_draining()
        self._refusing.set()

    def abort_waiters(self) -> None:
        self.activation.abort_waiters()

    def withdraw(self) -> None:
        self.activation.withdraw()

    def _model_object(self) -> dict:
        return {"id": self._model, "object": "model", "created": 0, "owned_by": "noctaya"}

    # -- dispatch --------------------------------------------------------------------------------
    def handle(self, conn: ClientConnection, head: RequestHead) -> bool:
        if self.unready or self.draining:  # from SIGTERM on, every answer closes its connection
            conn.keep_alive = False  # the connection closes after this answer: the answer says so
        path = head.path
        decision = route(head, path, admin=conn.admin, draining=self.draining, auth=self.auth,
                         max_body=self.config.max_body_bytes)
        try:
            if decision.kind == "error":
                return self._error(conn, decision.error, close=decision.close)
            return self._routes[decision.kind](conn, head)
        except ClientGone:
            return False

    def _metrics(self, conn: ClientConnection, head: RequestHead) -> bool:
        return self._ok(conn, self.metrics.render(), metrics_module.CONTENT_TYPE_LATEST.encode())

    def _queue(self, conn: ClientConnection, head: RequestHead) -> bool:
        return self._ok(conn, self.queue_json())

    def queue_json(self) -> bytes:
        """The Pod's admission state (sums over workers) and this worker's lease and readiness."""
        a = self.activation
        pod = self.pod
        lease = a.lease.snapshot()
        timer = a.lease.next_timer()
        demand = pod.demand()
        return json.dumps({
            "queued": int(pod.total(QUEUED)),
            "inFlight": int(pod.total(IN_FLIGHT)),
            "maxQueue": pod.max_queue,
            "heldBytes": pod.held_bytes,
            "heldBytesLimit": self.config.max_held_body_bytes,
            "uploadBytes": self.uploads.bytes,  # this worker's bodies still arriving
            "workers": pod.workers,
            "perWorker": pod.per_worker(),
            "lease": {
                "state": lease.state.value,
                "active": demand.lease_active,
                "remainingSeconds": None if timer is None else round(max(0.0, timer - a.clock()), 3),
            },
            "backendReady": a.ready,
            "backend": self.backends.describe(),
            "draining": self.draining,
            "demand": {"total": demand.total, "active": demand.active},
        }).encode()

    # -- /v1/models --------------------------------------------------------------------------------
    def _models(self, conn: ClientConnection, head: RequestHead) -> bool:
        """Answered locally while cold (listing must never wake a GPU: no slot, no lease, no demand -
        not even the brief in-flight count of a proxied request, which KEDA would see)."""
        if self.activation.ready:
            conn.timing.start(head.arrived, False)  # a listing has no first token
            try:
                upstream = self._acquire(conn, b"")
            except ConnectFailed:
                self.backends.connect_failed()
                self.activation.backend_unreachable()
            else:
                assert upstream is not None  # acquire returns None only for a held request
                try:
                    send_request(upstream, self._upstream_head(conn, head, 0), clock=self.clock)
                    response = read_response_head(upstream, conn, clock=self.clock)
                except UpstreamFailed:
                    self._finish(conn)  # the listing is static knowledge: answer it ourselves
                else:
                    return self._relay(conn, head, upstream, response, None)
        path = head.path
        model_id = unquote(path[len("/v1/models/"):]) if len(path) > len("/v1/models/") else ""
        if not model_id:
            return self._ok(conn, self._models_body)
        if model_id == self._model:
            return self._ok(conn, json.dumps(self._model_object()).encode())
        return answer_error(conn, self.metrics, "model_not_found", error=model_not_found(model_id))

    # -- a request for the backend -------------------------------------------------------------------
    def _forward_request(self, conn: ClientConnection, head: RequestHead) -> bool:
        conn.timing.start(head.arrived, produces_tokens(head.method, head.path))
        reservation = self.activation.slots.reservation()
        upload = self.uploads.reservation(conn.peer)
        try:
            data = b""
            if head.has_body:
                conn.continue_100(head)
                data = conn.read_body(self.config.max_body_bytes, upload)
            return self.dispatch(conn, head, RequestBody(data, reservation, upload))
        except (ClientBodyError, RequestBodyTooLarge, HeldBytesExhausted, UploadRefused) as exc:
            return answer_body_failure(conn, self.metrics, exc, self._retry_429)
        finally:
            upload.release()
            reservation.release()

    def dispatch(self, conn: ClientConnection, head: RequestHead, body: RequestBody) -> bool:
        """A request whose body is complete (``conn.timing`` started): forwarded at once while the
        backend is ready, else admitted cold. A shared gateway calls this once it knows the model."""
        if self.activation.ready:
            return self._warm(conn, head, body)
        return self._cold(conn, head, body, None)

    def _upstream_head(self, conn: ClientConnection, head: RequestHead, body_length: int) -> bytes:
        """Request line and headers for the backend: hop-by-hop headers and those ``Connection``
        names dropped, ``Host`` set to the backend, ``X-Forwarded-*`` and ``X-Request-Id`` set, and
        the client's ``Authorization`` dropped when it carried the gateway's own API key."""
        lines = [b"%s %s%s HTTP/1.1" % (head.method, self._base, head.target), b"Host: " + self._host]
        if head.has_connection:  # rare: the client named extra hop-by-hop headers
            named = connection_tokens(head.headers)
            lines += [line for line in head.forward if line.split(b":", 1)[0].lower() not in named]
        else:
            lines += head.forward
        if head.authorization is not None and self.auth is None:
            lines.append(b"Authorization: " + head.authorization)
        peer = conn.peer_bytes
        lines.append(b"X-Forwarded-For: " + (head.forwarded_for + b", " + peer if head.forwarded_for else peer))
        lines.append(b"X-Forwarded-Proto: http")
        if head.host:
            lines.append(b"X-Forwarded-Host: " + head.host)
        lines.append(b"X-Request-Id: " + conn.request_id)
        if body_length or head.method in (b"POST", b"PUT", b"PATCH"):
            lines.append(b"Content-Length: %d" % body_length)
        lines.append(b"\r\n")
        return b"\r\n".join(lines)

    def _send(self, conn: ClientConnection, head: RequestHead, body: RequestBody,
              upstream: UpstreamConnection) -> ResponseHead:
        """Send the request on ``upstream`` and wait for the response head. Raises UpstreamFailed."""
        conn.upstream = upstream
        started = self.clock()
        try:
            send_request(upstream, self._upstream_head(conn, head, len(body.data)), body.data, clock=self.clock)
            body.drop()
            response = read_response_head(upstream, conn, clock=self.clock)
        except BaseException:
            conn.upstream = None
            raise
        self.metrics.ttfb.observe(self.clock() - started)
        return response

    def _failed_before_answer(self, conn: ClientConnection, exc: UpstreamFailed) -> bool:
        if conn.gone:
            return False
        log.warning("backend failed before answering", extra={"detail": str(exc)})
        return self._error(conn, backend_failure(exc.reason))

    # -- warm path ---------------------------------------------------------------------------------
    def _warm(self, conn: ClientConnection, head: RequestHead, body: RequestBody) -> bool:
        ticket = self.activation.slots.try_admit(in_flight=True)
        if ticket is None:
            return self._error(conn, "queue_full", self._retry_429)
        self.activation.traffic()
        try:
            try:
                upstream = self._acquire(conn, body.data)
            except ConnectFailed:
                # Nothing sent: the backend is gone (scaled to zero). Become a cold request, keeping the slot.
                self._backend_gone(ticket)
                return self._cold(conn, head, body, ticket)
            assert upstream is not None  # acquire returns None only for a held request
            response = self._send(conn, head, body, upstream)
        except UpstreamFailed as exc:
            self._finish(conn)
            ticket.release()
            return self._failed_before_answer(conn, exc)
        except BaseException:
            self._finish(conn)
            ticket.release()
            raise
        return self._relay(conn, head, upstream, response, ticket)

    def _acquire(self, conn: ClientConnection, body: bytes, cold: bool = False) -> UpstreamConnection | None:
        """A backend connection for the request on ``conn``, counted on its Pod until ``_finish``."""
        upstream = self.backends.acquire(body, cold=cold)
        if upstream is not None:
            conn.backend_pod = upstream.pod
        return upstream

    def _finish(self, conn: ClientConnection) -> None:
        """The request on ``conn`` is done with its backend Pod (once, whichever path ends it)."""
        pod, conn.backend_pod = conn.backend_pod, None
        self.backends.finish(pod)

    def _backend_gone(self, ticket: Ticket) -> None:
        """A connect failed before any byte was sent: drop pooled connections, mark the backend cold
        (which starts or extends the lease) and put the request back in the queue, keeping its slot."""
        self.backends.connect_failed()
        self.activation.backend_unreachable()
        ticket.requeue()

    def _relay(self, conn: ClientConnection, head: RequestHead, upstream: UpstreamConnection,
               response: ResponseHead, ticket: Ticket | None) -> bool:
        """The backend's answer to the client; releases the ticket however it ends."""
        try:
            return self.relay.relay(conn, head.method, upstream, response, self._first_byte)
        finally:
            conn.upstream = None
            self._finish(conn)
            if ticket is not None:
                ticket.release()

    def _first_byte(self, conn: ClientConnection, status: int) -> None:
        """The first byte of the backend's answer to this request is leaving for the client."""
        timing: RequestTiming = conn.timing
        now = self.clock()
        ttft = timing.first_byte(now, status)
        if timing.cold:
            pod = conn.backend_pod
            self.activation.first_byte_forwarded(now, pod.name if pod is not None else None)
            if ttft is not None:
                self.metrics.ttft_cold.observe(ttft)
        elif ttft is not None:
            self.metrics.ttft_warm.observe(ttft)

    # -- cold path -------------------------------------------------------------------------------
    def _cold(self, conn: ClientConnection, head: RequestHead, body: RequestBody, ticket: Ticket | None) -> bool:
        """A complete request found the backend not ready. Refused before it can wake anything when
        its JSON is unacceptable; else it takes a slot (if it has none) and holds its body's bytes."""
        conn.timing.cold = True
        try:
            stream = inspect_cold_body(head, body.data, yield_to_loop)
        except InvalidJSON:
            if ticket is not None:
                ticket.release()
            return self._error(conn, "invalid_json")
        activation = self.activation
        if self.config.cold_mode == "reject":
            if ticket is not None:
                ticket.release()
            activation.cold_admission(head.arrived)  # the lease still wakes the backend
            return self._error(conn, "cold_reject", self._retry_503)
        if ticket is None:
            ticket = activation.slots.try_admit(in_flight=False)
            if ticket is None:
                return self._error(conn, "queue_full", self._retry_429)
        if not body.hold():
            ticket.release()
            return self._error(conn, "queue_bytes_full", self._retry_429)
        deadline = activation.cold_admission(head.arrived)
        conn.arm_watch()
        try:
            if stream:
                return self._keepalive(conn, head, body, ticket, deadline)
            return self._hold(conn, head, body, ticket, deadline)
        finally:
            self._finish(conn)  # a committed stream's Pod (a relayed answer's was finished already)
            ticket.release()
            conn.disarm_watch()

    def _attempt(self, conn: ClientConnection, head: RequestHead, body: RequestBody,
                 ticket: Ticket) -> tuple[UpstreamConnection, ResponseHead] | None:
        """One forwarding attempt once the backend looks ready and has room; None = connect failed or
        the cold batch left no room (re-hold)."""
        try:
            upstream = self._acquire(conn, body.data, cold=True)
        except ConnectFailed:
            self._backend_gone(ticket)
            return None
        if upstream is None:  # every ready Pod has its batch while others are starting: wait for room
            return None
        ticket.start()
        try:
            return upstream, self._send(conn, head, body, upstream)
        except BaseException:
            self._finish(conn)
            raise

    def _hold(self, conn: ClientConnection, head: RequestHead, body: RequestBody, ticket: Ticket,
              deadline: float) -> bool:
        while True:
            outcome = cold.hold_silently(self.activation, deadline, conn, self._refusing)
            if outcome is cold.WaitOutcome.TIMEOUT:
                return self._error(conn, "activation_timeout")
            if outcome in (cold.WaitOutcome.ABORTED, cold.WaitOutcome.REFUSED):
                return self._error(conn, "draining", close=True)
            if outcome is cold.WaitOutcome.CLIENT_GONE:
                self.metrics.count_response(499)
                return False
            try:
                attempt = self._attempt(conn, head, body, ticket)
            except UpstreamFailed as exc:
                return self._failed_before_answer(conn, exc)
            if attempt is not None:
                return self._relay(conn, head, *attempt, ticket)

    def _keepalive(self, conn: ClientConnection, head: RequestHead, body: RequestBody, ticket: Ticket,
                   deadline: float) -> bool:
        """Commit ``200 text/event-stream`` at once, heartbeat while waiting, then relay the
        backend's stream into it (or end it with one SSE error frame)."""
        chunked = conn.version == "1.1"
        close = not chunked
        headers = [*_SSE_HEADERS, (b"X-Request-Id", conn.request_id)]
        if chunked:
            headers.append((b"Transfer-Encoding", b"chunked"))
        headers.extend(conn.connection_headers(close))
        self.metrics.count_response(200)
        frame = chunk if chunked else bytes
        conn.send(response_head(200, headers) + frame(cold.OPENING_COMMENT))

        def attempt() -> cold.Retry | Iterator[bytes]:
            try:
                result = self._attempt(conn, head, body, ticket)
            except UpstreamFailed as exc:
                return iter([sse_error_frame(ERRORS[backend_failure(exc.reason)])])
            if result is None:
                return cold.RETRY
            return self.relay.into_committed_stream(conn, *result, self._first_byte)

        for piece in cold.keepalive_stream(self.activation, deadline, self.config.heartbeat_seconds, conn,
                                           attempt, self.metrics.reject):
            conn.send(frame(piece))
        if chunked:
            conn.send(LAST_CHUNK)
        return not close
