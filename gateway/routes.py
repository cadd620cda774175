"""What the gateway answers, request by request (SPEC §6).

authenticate -> admit (bounded Pod-wide slots, 429 when full) -> warm: forward at once / cold:
start or extend the activation lease, then wait (keepalive SSE heartbeats, silent hold, or 503 in
reject mode) -> forward once the backend answers its readiness path -> relay.

:class:`GatewayApp` is the thin handler over the state objects (``gateway.activation``) and the
relay (``gateway.relay``); the connection layer (``gateway.server``) calls :meth:`handle` once per
parsed request and keeps the connection when it returns True.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Iterator
from urllib.parse import unquote

from gateway import cold
from gateway.activation import Activation
from gateway.auth import KeyFileAuthenticator
from gateway.config import GatewayConfig
from gateway.errors import ERRORS, NO_RETRY, GatewayError, error_body, sse_error_frame
from gateway.metrics import CONTENT_TYPE_LATEST, REJECTION_REASONS, GatewayMetrics
from gateway.relay import (
    SMALL_BODY_BYTES,
    ConnectFailed,
    UpstreamConnection,
    UpstreamFailed,
    UpstreamPool,
    probe_readiness,
    read_more,
    read_response_head,
    send_request,
)
from gateway.server import (
    ClientBodyError,
    ClientConnection,
    ClientGone,
    HeldBytesExhausted,
    RequestBodyTooLarge,
)
from gateway.state.admission import Ticket
from gateway.state.pod import IN_FLIGHT, QUEUED, PodState
from gateway.state.readiness import ProbeResult
from gateway.wire import LAST_CHUNK, BadRequest, RequestHead, ResponseHead, chunk, connection_tokens, response_head

__all__ = ["GatewayApp", "is_stream_request"]

log = logging.getLogger("noctaya.gateway")

_DOT_SEGMENT = re.compile(r"(^|/)\.{1,2}(/|$)")
_SSE_HEADERS = [(b"Content-Type", b"text/event-stream"), (b"Cache-Control", b"no-cache"),
                (b"X-Accel-Buffering", b"no")]


def is_stream_request(body: bytes) -> bool:
    """``"stream": true`` in a JSON object body marks a streamed (SSE) request."""
    if not body or b'"stream"' not in body:
        return False
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(doc, dict) and doc.get("stream") is True


def _chunks(pieces: list[bytes]) -> bytes:
    return b"".join([chunk(p) for p in pieces if p])


class GatewayApp:
    """One worker's handler. Construct inside the hub thread that will serve it."""

    def __init__(self, config: GatewayConfig, *, pod: PodState | None = None, worker: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.pod = pod if pod is not None else PodState(1, config.max_queue, config.max_held_body_bytes)
        self.metrics = GatewayMetrics(self.pod, worker, config.backend_accelerators)
        self.pool = UpstreamPool(
            config.backend_host, config.backend_port,
            connect_timeout=config.upstream_connect_timeout_seconds,
            idle_timeout=config.upstream_idle_timeout_seconds,
        )
        self.activation = Activation(
            max_queue=config.max_queue, max_held_bytes=config.max_held_body_bytes,
            activation_timeout=config.activation_timeout_seconds, ready_grace=config.ready_grace_seconds,
            metrics=self.metrics, probe=self._probe, probe_interval=config.probe_interval_seconds, clock=clock,
        )
        self.auth = KeyFileAuthenticator(config.auth_key_file) if config.auth_key_file else None
        self.draining = False
        self._base = config.backend_base_path.encode("latin-1")
        self._host = config.backend_netloc.encode("latin-1")
        self._model = config.served_model_name
        self._models_body = json.dumps({"object": "list", "data": [self._model_object()]}).encode()
        self._retry_429 = [(b"Retry-After", b"%d" % config.queue_full_retry_after_seconds)]
        self._retry_503 = [(b"Retry-After", b"%d" % config.retry_after_seconds)]

    def _model_object(self) -> dict:
        return {"id": self._model, "object": "model", "created": 0, "owned_by": "noctaya"}

    def _probe(self) -> ProbeResult:
        return probe_readiness(self.pool, self.config.backend_base_path + self.config.readiness_path,
                               self.config.backend_netloc, self.config.probe_timeout_seconds)

    # -- answers generated here ------------------------------------------------------------------
    def _error(self, conn: ClientConnection, name: str, extra: list[tuple[bytes, bytes]] | None = None,
               *, close: bool = False) -> bool:
        """Answer an OpenAI-style error; returns whether the connection may continue."""
        error: GatewayError = ERRORS[name]
        if name in REJECTION_REASONS:
            self.metrics.reject(name)
        headers = list(extra or [])
        if name in NO_RETRY:
            headers.append((b"x-should-retry", b"false"))
        # A request whose body was not read cannot be followed on the same connection.
        close = close or not conn.message_done
        self.metrics.count_response(error.status)
        conn.respond(error.status, error_body(error), extra=headers, close=close)
        return not close

    def bad_request(self, conn: ClientConnection, exc: BadRequest) -> None:
        """Malformed HTTP from the client: a JSON 400/414/431, then the connection closes."""
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

    # -- dispatch --------------------------------------------------------------------------------
    def handle(self, conn: ClientConnection, head: RequestHead) -> bool:
        try:
            return self._dispatch(conn, head)
        except ClientGone:
            return False

    def _dispatch(self, conn: ClientConnection, head: RequestHead) -> bool:
        path = head.path
        if path == "/healthz":
            if self.draining:
                self.metrics.count_response(503)
                conn.respond(503, b'{"status":"draining"}')
                return True
            return self._ok(conn, b'{"status":"ok"}')
        if conn.admin:  # the admin port: monitoring and operators, never the OpenAI API
            if path == "/metrics":
                return self._ok(conn, self.metrics.render(), CONTENT_TYPE_LATEST.encode())
            if path == "/noctaya/queue":
                return self._ok(conn, self.queue_json())
            return self._error(conn, "not_found")
        if not (path == "/v1" or path.startswith("/v1/")) or self._has_dot_segment(path):
            return self._error(conn, "not_found")
        if self.draining:
            return self._error(conn, "draining", close=True)
        if self.auth is not None and not self.auth.check(head.authorization):
            return self._error(conn, "unauthorized", [(b"WWW-Authenticate", b"Bearer")])
        if head.content_length is not None and head.content_length > self.config.max_body_bytes:
            return self._error(conn, "too_large", close=True)
        if head.method == b"GET" and (path in ("/v1/models", "/v1/models/") or path.startswith("/v1/models/")):
            return self._models(conn, head, path)
        conn.received_at = self.clock()
        if self.activation.ready:
            conn.cold = False
            return self._warm(conn, head)
        return self._cold(conn, head, None, None)

    @staticmethod
    def _has_dot_segment(path: str) -> bool:
        """`/v1/../metrics` must not reach the backend: it gets the raw target, which a backend
        that normalises paths would resolve outside /v1 (checked raw and with %2e decoded)."""
        if "." not in path and "%" not in path:
            return False
        return bool(_DOT_SEGMENT.search(path) or _DOT_SEGMENT.search(unquote(path)))

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
            "workers": pod.workers,
            "perWorker": pod.per_worker(),
            "lease": {
                "state": lease.state.value,
                "active": demand.lease_active,
                "remainingSeconds": None if timer is None else round(max(0.0, timer - a.clock()), 3),
            },
            "backendReady": a.ready,
            "draining": self.draining,
            "demand": {"total": demand.total, "active": demand.active},
        }).encode()

    # -- /v1/models --------------------------------------------------------------------------------
    def _models(self, conn: ClientConnection, head: RequestHead, path: str) -> bool:
        """Answered locally while cold (listing must never wake a GPU: no slot, no lease, no demand -
        not even the brief in-flight count of a proxied request, which KEDA would see)."""
        if self.activation.ready:
            try:
                upstream = self.pool.acquire()
            except ConnectFailed:
                self.pool.clear()
                self.activation.backend_unreachable()
            else:
                try:
                    send_request(upstream, self._upstream_head(conn, head, 0), clock=self.clock)
                    response = read_response_head(upstream, conn, clock=self.clock)
                except UpstreamFailed:
                    pass  # the listing is static knowledge: answer it ourselves
                else:
                    return self._relay(conn, head, upstream, response, None)
        model_id = unquote(path[len("/v1/models/"):]) if len(path) > len("/v1/models/") else ""
        if not model_id:
            return self._ok(conn, self._models_body)
        if model_id == self._model:
            return self._ok(conn, json.dumps(self._model_object()).encode())
        return self._error(conn, "model_not_found")

    # -- the upstream request ----------------------------------------------------------------------
    def _upstream_head(self, conn: ClientConnection, head: RequestHead, body_length: int | None) -> bytes:
        """Request line and headers for the backend: hop-by-hop headers and those ``Connection``
        names dropped, ``Host`` set to the backend, ``X-Forwarded-*`` and ``X-Request-Id`` set, and
        the client's ``Authorization`` dropped when it carried the gateway's own API key.
        ``body_length`` None = a chunked body follows."""
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
        if body_length is None:
            lines.append(b"Transfer-Encoding: chunked")
        elif body_length or head.method in (b"POST", b"PUT", b"PATCH"):
            lines.append(b"Content-Length: %d" % body_length)
        lines.append(b"\r\n")
        return b"\r\n".join(lines)

    def _forward(self, conn: ClientConnection, head: RequestHead, body: bytes | None,
                 upstream: UpstreamConnection) -> ResponseHead:
        """Send the request on ``upstream`` and wait for the response head. ``body`` None = stream
        the client's body as it arrives. Raises UpstreamFailed, ClientBodyError, RequestBodyTooLarge."""
        conn.upstream = upstream
        started = self.clock()
        if body is None:
            length = head.content_length
            rest = conn.body_pieces(self.config.max_body_bytes)
            conn.continue_100(head)
            send_request(upstream, self._upstream_head(conn, head, length), b"", rest,
                         chunked=length is None, clock=self.clock)
        else:
            send_request(upstream, self._upstream_head(conn, head, len(body)), body, clock=self.clock)
        response = read_response_head(upstream, conn, clock=self.clock)
        self.metrics.ttfb.observe(self.clock() - started)
        return response

    # -- warm path ---------------------------------------------------------------------------------
    def _warm(self, conn: ClientConnection, head: RequestHead) -> bool:
        ticket = self.activation.slots.try_admit(in_flight=True)
        if ticket is None:
            return self._error(conn, "queue_full", self._retry_429)
        self.activation.traffic()
        body: bytes | None = b""
        try:
            if head.has_body:
                if head.content_length is not None and head.content_length <= SMALL_BODY_BYTES:
                    conn.continue_100(head)
                    body = conn.read_body(self.config.max_body_bytes)
                else:
                    body = None  # large or chunked: streamed to the backend as it arrives
            try:
                upstream = self.pool.acquire()
            except ConnectFailed:
                # Nothing sent: the backend is gone (scaled to zero). Become a cold request, keeping the slot.
                self._backend_gone(ticket)
                return self._cold(conn, head, ticket, body)
            response = self._forward(conn, head, body, upstream)
        except (RequestBodyTooLarge, ClientBodyError) as exc:
            conn.upstream = None
            return self._reject_body(conn, ticket, exc)
        except UpstreamFailed as exc:
            conn.upstream = None
            ticket.release()
            if conn.gone:
                return False
            log.warning("backend failed before answering", extra={"detail": str(exc)})
            return self._error(conn, "backend_failure")
        except BaseException:
            conn.upstream = None
            ticket.release()
            raise
        return self._relay(conn, head, upstream, response, ticket)

    def _backend_gone(self, ticket: Ticket) -> None:
        """A connect failed before any byte was sent: drop pooled connections, mark the backend cold
        (which starts or extends the lease) and put the request back in the queue, keeping its slot."""
        self.pool.clear()
        self.activation.backend_unreachable()
        ticket.requeue()

    def _reject_body(self, conn: ClientConnection, ticket: Ticket, exc: Exception) -> bool:
        """Free the slot of a request whose body cannot be read (413 too large, 400 broken upload);
        the rest of the upload is unread, so the connection closes."""
        ticket.release()
        conn.message_done = False
        kind = "too_large" if isinstance(exc, RequestBodyTooLarge) else "bad_request"
        return self._error(conn, kind, close=True)

    # -- relaying the backend's answer -----------------------------------------------------------
    def _relay(self, conn: ClientConnection, head: RequestHead, upstream: UpstreamConnection,
               response: ResponseHead, ticket: Ticket | None) -> bool:
        """Write the backend's answer to the client as it arrives; returns whether the client
        connection may continue. Releases the ticket and the upstream connection however it ends."""
        try:
            return self._relay_body(conn, head, upstream, response)
        finally:
            conn.upstream = None
            if ticket is not None:
                ticket.release()

    def _relay_body(self, conn: ClientConnection, head: RequestHead, upstream: UpstreamConnection,
                    response: ResponseHead) -> bool:
        parser = upstream.parser
        status = response.status
        self.metrics.count_response(status)
        no_body = head.method == b"HEAD" or status in (204, 304)
        length = response.content_length
        chunked = length is None and not no_body and conn.version == "1.1"
        close = (length is None and not chunked and not no_body) or not conn.message_done or conn.gone
        headers = response.end_to_end_headers()
        if length is not None:
            headers.append((b"Content-Length", b"%d" % length))
        elif chunked:
            headers.append((b"Transfer-Encoding", b"chunked"))
        if response.request_id is None:
            headers.append((b"X-Request-Id", conn.request_id))
        headers.extend(conn.connection_headers(close))
        out = response_head(status, headers, response.reason or None)
        if no_body:
            upstream.close()  # llhttp cannot be told a HEAD answer has no body: never reuse it
            conn.send(out)
            return not close
        waiting_for_token = True
        try:
            while True:
                pieces = parser.take_body()
                if pieces:
                    out += _chunks(pieces) if chunked else b"".join(pieces)
                if parser.complete:
                    if chunked:
                        out += LAST_CHUNK
                    conn.send(out)
                    if waiting_for_token and pieces:
                        self._first_token(conn)
                    break
                if out:
                    conn.send(out)
                    out = b""
                    if waiting_for_token and pieces:
                        waiting_for_token = False
                        self._first_token(conn)
                if not read_more(upstream, self.clock):
                    if length is None and not response.chunked:
                        break  # close-delimited body: EOF is its end
                    raise UpstreamFailed("backend closed mid-body")
        except UpstreamFailed as exc:
            if conn.gone:
                return False
            log.warning("backend failed mid-response", extra={"detail": str(exc)})
            if response.is_sse and chunked:
                conn.send(out + chunk(sse_error_frame(ERRORS["backend_failure"])) + LAST_CHUNK)
                return not close
            if out:
                conn.send(out)
            conn.gone = True  # committed non-SSE body: an abrupt close is the only honest signal
            return False
        except ClientGone:
            upstream.close()
            return False
        if parser.complete and response.keep_alive:
            self.pool.release(upstream)
        else:
            upstream.close()
        return not close

    def _first_token(self, conn: ClientConnection) -> None:
        """The first byte of the backend's answer has just been written to the client."""
        now = self.clock()
        if conn.cold:
            self.metrics.ttft_cold.observe(now - conn.received_at)
            self.activation.first_byte_forwarded(now)
        else:
            self.metrics.ttft_warm.observe(now - conn.received_at)

    # -- cold path -------------------------------------------------------------------------------
    def _cold(self, conn: ClientConnection, head: RequestHead, ticket: Ticket | None,
              body: bytes | None) -> bool:
        activation = self.activation
        conn.cold = True
        if self.config.cold_mode == "reject":
            if ticket is not None:
                ticket.release()
            activation.cold_admission(conn.received_at)  # the lease still wakes the backend
            return self._error(conn, "cold_reject", self._retry_503)
        if ticket is None:
            ticket = activation.slots.try_admit(in_flight=False)
            if ticket is None:
                return self._error(conn, "queue_full", self._retry_429)
        # Reserve the held body before reading it when its size is known; a chunked body reserves
        # piece by piece while it is read, so a slow uploader holds only what it has sent.
        reserve = len(body) if body is not None else (head.content_length or 0)
        if not ticket.reserve_bytes(reserve):
            ticket.release()
            return self._error(conn, "queue_bytes_full", self._retry_429)
        try:
            if body is None:
                conn.continue_100(head)
                chunked_reserve = ticket.reserve_bytes if head.content_length is None else None
                body = conn.read_body(self.config.max_body_bytes, chunked_reserve)
        except HeldBytesExhausted:
            ticket.release()
            return self._error(conn, "queue_bytes_full", self._retry_429, close=True)
        except (RequestBodyTooLarge, ClientBodyError) as exc:
            return self._reject_body(conn, ticket, exc)
        except BaseException:
            ticket.release()
            raise
        deadline = activation.cold_admission(conn.received_at)
        conn.arm_watch()
        try:
            if is_stream_request(body):
                return self._keepalive(conn, head, body, ticket, deadline)
            return self._hold(conn, head, body, ticket, deadline)
        finally:
            ticket.release()
            conn.disarm_watch()

    def _attempt(self, conn: ClientConnection, head: RequestHead, body: bytes,
                 ticket: Ticket) -> tuple[UpstreamConnection, ResponseHead] | None:
        """One forwarding attempt once the backend looks ready; None = connect failed (re-hold)."""
        ticket.start()
        try:
            upstream = self.pool.acquire()
        except ConnectFailed:
            self._backend_gone(ticket)
            return None
        try:
            return upstream, self._forward(conn, head, body, upstream)
        except BaseException:
            conn.upstream = None
            raise

    def _hold(self, conn: ClientConnection, head: RequestHead, body: bytes, ticket: Ticket,
              deadline: float) -> bool:
        while True:
            outcome = cold.hold_silently(self.activation, deadline, conn)
            if outcome is cold.WaitOutcome.TIMEOUT:
                return self._error(conn, "activation_timeout")
            if outcome is cold.WaitOutcome.ABORTED:
                return self._error(conn, "draining", close=True)
            if outcome is cold.WaitOutcome.CLIENT_GONE:
                self.metrics.count_response(499)
                return False
            try:
                attempt = self._attempt(conn, head, body, ticket)
            except UpstreamFailed as exc:
                if conn.gone:
                    return False
                log.warning("backend failed before answering", extra={"detail": str(exc)})
                return self._error(conn, "backend_failure")
            if attempt is None:
                continue
            upstream, response = attempt
            return self._relay(conn, head, upstream, response, ticket)

    def _keepalive(self, conn: ClientConnection, head: RequestHead, body: bytes, ticket: Ticket,
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

        relayed: list[bool] = []  # appended to once the backend's own bytes flow

        def attempt() -> cold.Retry | Iterator[bytes]:
            try:
                result = self._attempt(conn, head, body, ticket)
            except UpstreamFailed:
                return iter([sse_error_frame(ERRORS["backend_failure"])])
            if result is None:
                return cold.RETRY
            return self._committed_stream(conn, *result, relayed)

        def on_give_up(kind: str) -> None:
            self.metrics.reject(kind)

        waiting_for_token = True
        for piece in cold.keepalive_stream(self.activation, deadline, self.config.heartbeat_seconds, conn,
                                           attempt, on_give_up):
            conn.send(frame(piece))
            if waiting_for_token and relayed:  # heartbeats are not tokens
                waiting_for_token = False
                self._first_token(conn)
        if chunked:
            conn.send(LAST_CHUNK)
        return not close

    def _committed_stream(self, conn: ClientConnection, upstream: UpstreamConnection,
                          response: ResponseHead, relayed: list[bool]) -> Iterator[bytes]:
        """The backend's answer inside an SSE stream we already committed with 200 (``relayed``
        gets an entry before its first byte is handed on)."""
        parser = upstream.parser
        try:
            if response.status == 200:
                try:
                    while True:
                        pieces = parser.take_body()
                        if pieces and not relayed:
                            relayed.append(True)
                        yield from pieces
                        if parser.complete or not read_more(upstream, self.clock):
                            break
                except UpstreamFailed:
                    yield sse_error_frame(ERRORS["backend_failure"])
                    return
                if parser.complete and response.keep_alive:
                    self.pool.release(upstream)
                    upstream = None
                return
            # The backend refused the request (e.g. 400 for a bad parameter): pass its error on as an
            # SSE error event, since the 200 status line is already on the wire.
            error = None
            try:
                raw = b""
                while len(raw) < 64 * 1024:
                    raw += b"".join(parser.take_body())
                    if parser.complete or not read_more(upstream, self.clock):
                        break
                doc = json.loads(raw)
                error = doc.get("error") if isinstance(doc, dict) else None
            except (UpstreamFailed, ValueError, UnicodeDecodeError):
                pass
            if isinstance(error, dict) and isinstance(error.get("message"), str):
                yield b"event: error\ndata: " + json.dumps({"error": error}).encode() + b"\n\n"
            else:
                yield sse_error_frame(ERRORS["backend_failure"])
        finally:
            conn.upstream = None
            if upstream is not None:
                upstream.close()
