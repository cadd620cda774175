"""The gateway's WSGI application and its gevent server.

Request lifecycle (SPEC §6): authenticate -> admit (bounded slots, 429 when full) -> warm: forward
at once / cold: start or extend the activation lease, then wait (keepalive SSE heartbeats, silent
hold, or 503 in reject mode) -> forward once the backend answers its readiness path -> relay.
"""

from __future__ import annotations

import errno
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from urllib.parse import unquote

import gevent
import gevent.pool
from gevent.pywsgi import WSGIHandler, WSGIServer

from gateway import cold, proxy
from gateway.activation import Activation
from gateway.auth import KeyFileAuthenticator
from gateway.config import GatewayConfig
from gateway.errors import ERRORS, REASONS, GatewayError, error_body, sse_error_frame
from gateway.metrics import CONTENT_TYPE_LATEST, REJECTION_REASONS, GatewayMetrics
from gateway.proxy import (
    ClientBodyError,
    ConnectFailed,
    RequestBodyTooLarge,
    UpstreamFailed,
    UpstreamPool,
    UpstreamResponse,
)
from gateway.state.admission import Ticket
from scaler.demand import DemandBroadcaster

__all__ = ["GatewayApp", "GatewayServer", "ThreadedGateway"]

log = logging.getLogger("noctaya.gateway")

StartResponse = Callable[..., Any]
JSON = "application/json"
CLIENT_CLOSED = 499  # nginx's convention for "client went away before the answer"


class _Handler(WSGIHandler):
    """Exposes the client socket (disconnect checks) and bounds idle keep-alive connections."""

    def handle(self) -> None:
        timeout = getattr(self.server, "client_idle_timeout", None)
        if timeout:
            self.socket.settimeout(timeout)
        try:
            # pywsgi writes the head and the body separately: without NODELAY, Nagle + the
            # client's delayed ACK add ~40 ms to every keep-alive response.
            self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        super().handle()

    def _write_with_headers(self, data: bytes) -> None:
        if not data or len(data) > 16384:
            super()._write_with_headers(data)
            return
        # Small first chunk: one write for head + body (half the syscalls on the warm path).
        real_sendall = self._sendall
        parts: list[bytes] = []
        self._sendall = parts.append  # type: ignore[method-assign]
        try:
            super()._write_with_headers(data)
        finally:
            self._sendall = real_sendall  # type: ignore[method-assign]
        self._sendall(b"".join(parts))

    def get_environ(self) -> dict[str, Any]:
        env = super().get_environ()
        env["noctaya.socket"] = self.socket
        env["noctaya.handler"] = self
        return env


_DOT_SEGMENT = re.compile(r"(^|/)\.{1,2}(/|$)")


def _has_dot_segment(environ: dict[str, Any], path: str) -> bool:
    """`/v1/../metrics` must not reach the backend: it forwards the raw URI, which a backend that
    normalises paths would resolve outside /v1. Checked on the decoded path and on the raw one
    (with %2e decoded), whose query string is not part of the path."""
    raw = (environ.get("RAW_URI") or environ.get("REQUEST_URI") or "").split("?", 1)[0]
    return bool(_DOT_SEGMENT.search(path) or _DOT_SEGMENT.search(unquote(raw)))


class _HeldBytesExhausted(Exception):
    """The gateway-wide budget for bodies held by waiting requests is spent (→ 429)."""


def _abandon_input(environ: dict[str, Any]) -> None:
    """Answer without reading the rest of the body: close the connection instead of letting the
    server drain (possibly gigabytes of) unread input."""
    handler = environ.get("noctaya.handler")
    if handler is None:
        return
    handler.close_connection = True
    wsgi_input = getattr(handler, "wsgi_input", None)
    if wsgi_input is not None and hasattr(wsgi_input, "_chunked_input_error"):
        wsgi_input._chunked_input_error = True


def _upstream_headers(environ: dict[str, Any], host: str) -> list[tuple[str, str]]:
    named = {t.strip().lower() for t in environ.get("HTTP_CONNECTION", "").split(",") if t.strip()}
    headers: list[tuple[str, str]] = [("Host", host)]
    forwarded_for = environ.get("REMOTE_ADDR")
    for key, value in environ.items():
        if not key.startswith("HTTP_"):
            continue
        name = key[5:].replace("_", "-").lower()
        if name in proxy.HOP_BY_HOP or name in named or name in ("host", "content-length", "expect"):
            continue
        if name == "x-forwarded-for":
            forwarded_for = f"{value}, {forwarded_for}" if forwarded_for else value
            continue
        headers.append((name.title(), value))
    if environ.get("CONTENT_TYPE"):
        headers.append(("Content-Type", environ["CONTENT_TYPE"]))
    if forwarded_for:
        headers.append(("X-Forwarded-For", forwarded_for))
    return headers


def is_stream_request(body: bytes) -> bool:
    """``"stream": true`` in a JSON object body marks a streamed (SSE) request."""
    if not body or b'"stream"' not in body:
        return False
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(doc, dict) and doc.get("stream") is True


class GatewayApp:
    """WSGI callable. Construct inside the hub thread that will serve it (gevent objects)."""

    def __init__(
        self,
        config: GatewayConfig,
        broadcaster: DemandBroadcaster,
        *,
        metrics: GatewayMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.metrics = metrics or GatewayMetrics()
        self.pool = UpstreamPool(
            config.backend_host, config.backend_port,
            connect_timeout=config.upstream_connect_timeout_seconds,
            idle_timeout=config.upstream_idle_timeout_seconds,
        )
        self.activation = Activation(
            max_queue=config.max_queue,
            max_held_bytes=config.max_held_body_bytes,
            activation_timeout=config.activation_timeout_seconds,
            ready_grace=config.ready_grace_seconds,
            broadcaster=broadcaster,
            metrics=self.metrics,
            probe=self._probe,
            probe_interval=config.probe_interval_seconds,
            clock=clock,
        )
        self.auth = KeyFileAuthenticator(config.auth_key_file) if config.auth_key_file else None
        self.draining = False
        self._base = config.backend_base_path
        self._models_body = json.dumps({
            "object": "list",
            "data": [{"id": config.served_model_name, "object": "model", "created": 0, "owned_by": "noctaya"}],
        }).encode()

    # -- plumbing --------------------------------------------------------------------------
    def _probe(self) -> proxy.ProbeResult:
        return proxy.probe_readiness(
            self.pool, self._base + self.config.readiness_path, self.config.backend_netloc,
            self.config.probe_timeout_seconds,
        )

    def _respond(
        self, start_response: StartResponse, code: int, body: bytes, content_type: str = JSON,
        extra: Iterable[tuple[str, str]] = (),
    ) -> list[bytes]:
        reason = REASONS.get(code, "OK" if code == 200 else "Error")
        headers = [("Content-Type", content_type), ("Content-Length", str(len(body))), *extra]
        start_response(f"{code} {reason}", headers)
        self.metrics.count_response(code)
        return [body]

    def _error(
        self, start_response: StartResponse, name: str, extra: Iterable[tuple[str, str]] = (),
    ) -> list[bytes]:
        error: GatewayError = ERRORS[name]
        if name in REJECTION_REASONS:
            self.metrics.reject(name)
        return self._respond(start_response, error.status, error_body(error), extra=extra)

    # -- WSGI entry point ------------------------------------------------------------------
    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            if self.draining:
                return self._respond(start_response, 503, b'{"status":"draining"}')
            return self._respond(start_response, 200, b'{"status":"ok"}')
        if path == "/metrics":
            return self._respond(start_response, 200, self.metrics.render(), CONTENT_TYPE_LATEST)
        if path == "/noctaya/queue":
            return self._respond(start_response, 200, self.queue_json())
        if not (path == "/v1" or path.startswith("/v1/")) or _has_dot_segment(environ, path):
            return self._error(start_response, "not_found")
        if self.draining:
            _abandon_input(environ)
            return self._error(start_response, "draining", [("Connection", "close")])
        if self.auth is not None and not self.auth.check(environ.get("HTTP_AUTHORIZATION")):
            _abandon_input(environ)
            return self._error(start_response, "unauthorized", [("WWW-Authenticate", "Bearer")])
        length = self._content_length(environ)
        if length == -2:
            _abandon_input(environ)
            return self._error(start_response, "bad_request", [("Connection", "close")])
        if length is not None and length > self.config.max_body_bytes:
            _abandon_input(environ)
            return self._error(start_response, "too_large", [("Connection", "close")])
        method = environ.get("REQUEST_METHOD", "GET")
        if path == "/v1/models" and method == "GET":
            return self._models(environ, start_response)
        if self.activation.ready:
            return self._warm(environ, start_response, length)
        return self._cold(environ, start_response, length, ticket=None, body=None)

    def queue_json(self) -> bytes:
        a = self.activation
        lease = a.lease.snapshot()
        now = a.clock()
        return json.dumps({
            "queued": a.slots.queued,
            "inFlight": a.slots.in_flight,
            "maxQueue": a.slots.max_queue,
            "lease": {
                "state": lease.state.value,
                "active": a.lease.active,
                "remainingSeconds": None if a.lease.next_timer() is None
                else round(max(0.0, a.lease.next_timer() - now), 3),
            },
            "backendReady": a.ready,
            "draining": self.draining,
            "demand": {"total": a.last_demand.total, "active": a.last_demand.active},
        }).encode()

    @staticmethod
    def _content_length(environ: dict[str, Any]) -> int | None:
        """Declared body length; None when absent/chunked; -2 when malformed."""
        raw = environ.get("CONTENT_LENGTH")
        if not raw:
            return None
        try:
            n = int(raw)
        except ValueError:
            return -2
        return n if n >= 0 else -2

    def _target(self, environ: dict[str, Any]) -> str:
        # RAW_URI keeps the client's percent-encoding exactly; PATH_INFO is decoded.
        raw = environ.get("RAW_URI") or environ.get("REQUEST_URI")
        if raw and raw.startswith("/"):
            return self._base + raw
        qs = environ.get("QUERY_STRING")
        return self._base + environ.get("PATH_INFO", "/") + (f"?{qs}" if qs else "")

    def _read_body(
        self, environ: dict[str, Any], length: int | None, reserve: Callable[[int], bool] | None = None,
    ) -> bytes:
        """Whole body, bounded (cold path: it has to wait somewhere). Raises RequestBodyTooLarge
        or ClientBodyError. A chunked body of unknown size reserves held bytes as they arrive
        (``reserve``; _HeldBytesExhausted when the budget is spent), so a slow uploader holds only
        what it has sent, not the whole body limit."""
        stream = environ["wsgi.input"]
        limit = self.config.max_body_bytes
        try:
            if length is not None:
                data = stream.read(length) if length else b""
                if len(data) != length:
                    raise ClientBodyError()
                return data
            chunked = environ.get("HTTP_TRANSFER_ENCODING", "").lower() == "chunked"
            if not chunked:
                return b""
            buf = bytearray()
            while True:
                chunk = stream.read(proxy.READ_CHUNK)
                if not chunk:
                    return bytes(buf)
                buf += chunk
                if len(buf) > limit:
                    raise RequestBodyTooLarge()
                if reserve is not None and not reserve(len(chunk)):
                    raise _HeldBytesExhausted()
        except (OSError, ValueError) as exc:
            raise ClientBodyError() from exc

    def _body_chunks(self, environ: dict[str, Any], remaining: int | None) -> Iterator[bytes]:
        stream = environ["wsgi.input"]
        try:
            while remaining is None or remaining > 0:
                n = proxy.READ_CHUNK if remaining is None else min(proxy.READ_CHUNK, remaining)
                chunk = stream.read(n)
                if not chunk:
                    if remaining:
                        raise ClientBodyError()
                    return
                if remaining is not None:
                    remaining -= len(chunk)
                yield chunk
        except (OSError, ValueError) as exc:
            raise ClientBodyError() from exc

    def _forward(
        self, environ: dict[str, Any], body: bytes | None, rest: Iterator[bytes] | None = None,
        length: int | None = None,
    ) -> UpstreamResponse:
        return proxy.forward(
            self.pool, environ.get("REQUEST_METHOD", "GET"), self._target(environ),
            _upstream_headers(environ, self.config.backend_netloc), body, rest,
            body_length=length, max_body_bytes=self.config.max_body_bytes,
            on_first_byte=self.metrics.ttfb.observe, client_sock=environ.get("noctaya.socket"),
        )

    def _client_gone(self, environ: dict[str, Any]) -> Callable[[], bool]:
        sock = environ.get("noctaya.socket")
        return lambda: proxy.client_gone(sock)

    # -- /v1/models --------------------------------------------------------------------------
    def _models(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        """Answered locally while cold (listing must never wake a GPU: no slot, no lease, no
        demand - not even the brief in-flight count of a proxied request, which KEDA would see)."""
        if self.activation.ready:
            try:
                resp = self._forward(environ, None)
            except ConnectFailed:
                self.pool.clear()
                self.activation.backend_unreachable()
            except UpstreamFailed:
                pass  # the listing is static knowledge: answer it ourselves
            else:
                return self._relay(start_response, resp, None)
        return self._respond(start_response, 200, self._models_body)

    # -- warm path ---------------------------------------------------------------------------
    def _warm(self, environ: dict[str, Any], start_response: StartResponse, length: int | None) -> Iterable[bytes]:
        ticket = self.activation.slots.try_admit(in_flight=True)
        if ticket is None:
            _abandon_input(environ)
            return self._error(start_response, "queue_full", self._retry_after_429())
        self.activation.traffic()
        chunked = environ.get("HTTP_TRANSFER_ENCODING", "").lower() == "chunked"
        body: bytes | None = None
        try:
            if (length is None and not chunked) or (length is not None and length <= proxy.SMALL_BODY_BYTES):
                body = self._read_body(environ, length) if length else None
                resp = self._forward(environ, body)
            else:
                # Large or chunked body: streamed to the backend as it arrives.
                resp = self._forward(environ, None, self._body_chunks(environ, length), length)
        except ConnectFailed:
            # Nothing sent: the backend is gone (scaled to zero). Become a cold request, keeping the slot.
            self._backend_gone(ticket)
            return self._cold(environ, start_response, length, ticket=ticket, body=body)
        except (RequestBodyTooLarge, ClientBodyError) as exc:
            return self._reject_body(environ, start_response, ticket, exc)
        except UpstreamFailed as exc:
            ticket.release()
            log.warning("backend failed before answering", extra={"detail": str(exc)})
            return self._error(start_response, "backend_failure")
        except BaseException:
            ticket.release()
            raise
        return self._relay(start_response, resp, ticket)

    def _backend_gone(self, ticket: Ticket) -> None:
        """A connect failed before any byte was sent: drop pooled connections, mark the backend cold
        (which starts or extends the lease) and put the request back in the queue, keeping its slot."""
        self.pool.clear()
        self.activation.backend_unreachable()
        ticket.requeue()

    def _reject_body(
        self, environ: dict[str, Any], start_response: StartResponse, ticket: Ticket, exc: Exception,
    ) -> Iterable[bytes]:
        """Free the slot of a request whose body cannot be read (413 too large, 400 broken upload);
        the rest of the upload is unread, so the connection closes."""
        ticket.release()
        _abandon_input(environ)
        kind = "too_large" if isinstance(exc, RequestBodyTooLarge) else "bad_request"
        return self._error(start_response, kind, [("Connection", "close")])

    def _retry_after_429(self) -> list[tuple[str, str]]:
        return [("Retry-After", str(self.config.queue_full_retry_after_seconds))]

    def _relay(
        self, start_response: StartResponse, resp: UpstreamResponse, ticket: Ticket | None,
    ) -> Iterable[bytes]:
        headers = resp.end_to_end_headers()
        start_response(f"{resp.status} {resp.reason}", headers)
        self.metrics.count_response(resp.status)
        return _Relay(resp, ticket, sse="text/event-stream" in resp.content_type)

    # -- cold path ---------------------------------------------------------------------------
    def _cold(
        self, environ: dict[str, Any], start_response: StartResponse, length: int | None,
        *, ticket: Ticket | None, body: bytes | None,
    ) -> Iterable[bytes]:
        activation = self.activation
        if self.config.cold_mode == "reject":
            if ticket is not None:
                ticket.release()
            activation.cold_admission()  # the lease still wakes the backend
            _abandon_input(environ)
            return self._error(
                start_response, "cold_reject", [("Retry-After", str(self.config.retry_after_seconds))]
            )
        if ticket is None:
            ticket = activation.slots.try_admit(in_flight=False)
            if ticket is None:
                _abandon_input(environ)
                return self._error(start_response, "queue_full", self._retry_after_429())
        # Reserve the held body before reading it when its size is known; a chunked body reserves
        # chunk by chunk while it is read.
        if body is not None:
            reserve = len(body)
        else:
            reserve = length or 0
        if not ticket.reserve_bytes(reserve):
            ticket.release()
            _abandon_input(environ)
            return self._error(start_response, "queue_bytes_full", self._retry_after_429())
        try:
            if body is None:
                body = self._read_body(environ, length, reserve=ticket.reserve_bytes if length is None else None)
        except _HeldBytesExhausted:
            ticket.release()
            _abandon_input(environ)
            return self._error(start_response, "queue_bytes_full", self._retry_after_429() + [("Connection", "close")])
        except (RequestBodyTooLarge, ClientBodyError) as exc:
            return self._reject_body(environ, start_response, ticket, exc)
        deadline = activation.cold_admission()
        client_gone = self._client_gone(environ)
        if is_stream_request(body):
            start_response("200 OK", [
                ("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache"),
                ("X-Accel-Buffering", "no"),
            ])
            self.metrics.count_response(200)
            return _Guarded(self._keepalive(environ, body, ticket, deadline, client_gone), ticket)
        try:
            return self._hold(environ, start_response, body, ticket, deadline, client_gone)
        except BaseException:
            ticket.release()
            raise

    def _hold(
        self, environ: dict[str, Any], start_response: StartResponse, body: bytes, ticket: Ticket,
        deadline: float, client_gone: Callable[[], bool],
    ) -> Iterable[bytes]:
        while True:
            outcome = cold.hold_silently(self.activation, deadline, client_gone)
            if outcome is cold.WaitOutcome.TIMEOUT:
                ticket.release()
                return self._error(start_response, "activation_timeout")
            if outcome is cold.WaitOutcome.ABORTED:
                ticket.release()
                return self._error(start_response, "draining")
            if outcome is cold.WaitOutcome.CLIENT_GONE:
                ticket.release()
                environ["noctaya.handler"].close_connection = True
                start_response("499 Client Closed Request", [("Content-Length", "0")])
                self.metrics.count_response(CLIENT_CLOSED)
                return []
            ticket.start()
            try:
                resp = self._forward(environ, body)
            except ConnectFailed:
                self._backend_gone(ticket)
                continue
            except UpstreamFailed as exc:
                ticket.release()
                log.warning("backend failed before answering", extra={"detail": str(exc)})
                return self._error(start_response, "backend_failure")
            return self._relay(start_response, resp, ticket)

    def _keepalive(
        self, environ: dict[str, Any], body: bytes, ticket: Ticket, deadline: float,
        client_gone: Callable[[], bool],
    ) -> Iterator[bytes]:
        def attempt() -> cold.Retry | Iterator[bytes]:
            ticket.start()
            try:
                resp = self._forward(environ, body)
            except ConnectFailed:
                self._backend_gone(ticket)
                return cold.RETRY
            except UpstreamFailed:
                return iter([sse_error_frame(ERRORS["backend_failure"])])
            return _committed_stream_body(resp)

        def on_give_up(kind: str) -> None:
            ticket.release()
            self.metrics.reject(kind)

        return cold.keepalive_stream(
            self.activation, deadline, self.config.heartbeat_seconds, client_gone, attempt, on_give_up
        )


def _committed_stream_body(resp: UpstreamResponse) -> Iterator[bytes]:
    """Relay a backend answer into an SSE stream we already committed with 200."""
    try:
        if resp.status == 200:
            try:
                yield from resp
            except UpstreamFailed:
                yield sse_error_frame(ERRORS["backend_failure"])
            return
        # The backend refused the request (e.g. 400 for a bad parameter): pass its error on as an
        # SSE error event, since the 200 status line is already on the wire.
        try:
            raw = resp.read_bounded(64 * 1024)
            doc = json.loads(raw)
            error = doc.get("error") if isinstance(doc, dict) else None
        except (UpstreamFailed, ValueError, UnicodeDecodeError):
            error = None
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            yield b"event: error\ndata: " + json.dumps({"error": error}).encode() + b"\n\n"
        else:
            yield sse_error_frame(ERRORS["backend_failure"])
    finally:
        resp.close()


class _Guarded:
    """Releases the request's slot when the WSGI server closes the response, however it ended."""

    def __init__(self, body: Iterator[bytes], ticket: Ticket) -> None:
        self._body = body
        self._ticket = ticket

    def __iter__(self) -> Iterator[bytes]:
        return self._body

    def close(self) -> None:
        try:
            close = getattr(self._body, "close", None)
            if close is not None:
                close()
        finally:
            self._ticket.release()


class _Relay:
    """Response body relayed from the backend; releases the slot and the connection on close."""

    def __init__(self, resp: UpstreamResponse, ticket: Ticket | None, *, sse: bool) -> None:
        self._resp = resp
        self._ticket = ticket
        self._sse = sse

    def __iter__(self) -> Iterator[bytes]:
        try:
            yield from self._resp
        except UpstreamFailed as exc:
            log.warning("backend failed mid-response", extra={"detail": str(exc)})
            if self._sse:
                yield sse_error_frame(ERRORS["backend_failure"])
                return
            # Committed non-SSE body: the only honest signal left is an abrupt close (the client
            # sees a truncated message). ECONNRESET is what the server treats as a quiet disconnect.
            raise ConnectionResetError(errno.ECONNRESET, "backend failed mid-response") from None

    def close(self) -> None:
        try:
            self._resp.close()
        finally:
            if self._ticket is not None:
                self._ticket.release()


class GatewayServer:
    """The app on a gevent WSGIServer plus the prober greenlet. Build and run in one hub thread."""

    def __init__(
        self, config: GatewayConfig, broadcaster: DemandBroadcaster, *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.broadcaster = broadcaster
        self.app = GatewayApp(config, broadcaster, clock=clock)
        self.server = WSGIServer(
            (config.listen_host, config.listen_port), self.app, handler_class=_Handler,
            spawn=gevent.pool.Pool(config.max_connections), log=None, error_log=_ErrorLog(),
        )
        self.server.client_idle_timeout = config.client_idle_timeout_seconds
        self._prober: gevent.Greenlet | None = None

    @property
    def port(self) -> int:
        return self.server.server_port

    def start(self) -> None:
        self.server.start()
        self._prober = gevent.spawn(self.app.activation.prober.run)
        log.info("gateway listening", extra={"port": self.port, "backend": self.config.backend_netloc})

    def stop(self, timeout: float = 1.0) -> None:
        self.app.activation.prober.stop()
        self.server.stop(timeout=timeout)
        if self._prober is not None:
            self._prober.kill(block=False)
        self.app.pool.close()


class _ErrorLog:
    """pywsgi's error log, routed to logging (one line; tracebacks only at debug)."""

    def write(self, msg: str) -> None:
        msg = msg.strip()
        if msg:
            log.debug("server: %s", msg)

    def flush(self) -> None:
        pass


class ThreadedGateway:
    """A gateway in its own OS thread and gevent hub, for tests and benchmarks that live in an
    unpatched process. Interact over HTTP; read state via ``call()`` (runs in the hub thread)."""

    def __init__(self, config: GatewayConfig, broadcaster: DemandBroadcaster | None = None) -> None:
        self.config = config
        self.broadcaster = broadcaster or DemandBroadcaster()
        self._ready = threading.Event()
        self._stop_requested = threading.Event()
        self._error: BaseException | None = None
        self.server: GatewayServer | None = None
        self._hub: Any = None
        self._thread = threading.Thread(target=self._run, name="gateway-hub", daemon=True)

    def _run(self) -> None:
        try:
            self._hub = gevent.get_hub()
            self.server = GatewayServer(self.config, self.broadcaster)
            self.server.start()
        except BaseException as exc:  # reported to the starting thread
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        while not self._stop_requested.is_set():
            gevent.sleep(0.05)
        self.server.stop(timeout=1.0)

    def start(self, timeout: float = 10.0) -> ThreadedGateway:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("gateway did not start")
        if self._error is not None:
            raise self._error
        return self

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def app(self) -> GatewayApp:
        assert self.server is not None
        return self.server.app

    def call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run ``fn`` in the hub thread and return its result."""
        done = threading.Event()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = exc
            done.set()

        self._hub.loop.run_callback_threadsafe(run)
        if not done.wait(timeout):
            raise TimeoutError("hub call timed out")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def stop(self) -> None:
        self._stop_requested.set()
        self._thread.join(10)
