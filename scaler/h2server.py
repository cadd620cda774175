"""The ExternalScaler (``scaler.externalscaler``) served over HTTP/2 by h2 on a gevent loop.

This is the scaler of a one-worker gateway, in the gateway's own process and event loop. grpcio
there would cost more than the rest of the Pod: ~20 MiB of RSS and its own threads waking a dozen
times a second while nothing happens (docs/benchmarks.md, "Idle footprint"), for five RPCs whose
messages are a few bytes and which KEDA calls once per ``pollingInterval``. h2 (python-hyper's
HTTP/2 state machine: framing, HPACK, flow control, settings, pings, GOAWAY) does the protocol;
this module maps gRPC onto it: ``POST /externalscaler.ExternalScaler/<Method>`` with
``content-type: application/grpc``, one length-prefixed protobuf message each way (many for a
server stream), and the status in trailers (``grpc-status``, ``grpc-message``), or in the only
HEADERS frame ("trailers-only") when a call fails before any message.

Every resource has a bound:

- connections: ``max_connections`` (beyond it the server stops accepting until one closes), and
  ``max_per_address`` from one client address (closed at once beyond it: idle sockets from one
  address cannot take the pool from KEDA);
- streams per connection: SETTINGS_MAX_CONCURRENT_STREAMS (h2 refuses more); open
  StreamIsActive streams: the servicer's ``max_streams``, shared between client addresses by
  ``scaler.streamtable`` (a full table ends the oldest stream of the biggest holder with
  UNAVAILABLE for a newcomer holding two fewer; else RESOURCE_EXHAUSTED);
- frames that ask for nothing (PING, SETTINGS, PRIORITY, WINDOW_UPDATE, empty DATA/HEADERS/
  CONTINUATION, RST_STREAM of an unanswered stream) and streams reset before an answer: per
  connection allowances (``scaler.h2limits``), beyond them GOAWAY ENHANCE_YOUR_CALM and close;
- a request: one message of at most ``MAX_MESSAGE_BYTES`` (RESOURCE_EXHAUSTED), headers at most
  ``MAX_HEADER_LIST_BYTES``; request bytes buffered per connection at most ``MAX_BUFFERED_BYTES``,
  requests begun and not finished at most ``MAX_PENDING_CALLS`` (RST_STREAM REFUSED_STREAM beyond);
- CPU: the reading greenlet gives the loop back after at most ``gateway.slices.SLICE_SECONDS`` of
  the thread's CPU time, however fast input arrives;
- time: the TLS handshake, the client's preface and its first SETTINGS within ``HANDSHAKE_SECONDS``
  in all; a write that cannot finish within ``WRITE_TIMEOUT_SECONDS`` (a client that stopped
  reading) closes the connection; a connection with no call open for ``IDLE_SECONDS`` is closed
  with GOAWAY.

Compressed request messages are refused (UNIMPLEMENTED): KEDA sends none.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import gevent
import gevent.event
import gevent.lock
import gevent.pool
import gevent.ssl
from gevent.server import StreamServer
from google.protobuf.message import DecodeError
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    RequestReceived,
    StreamEnded,
    StreamReset,
    WindowUpdated,
)
from h2.exceptions import H2Error, ProtocolError
from h2.settings import SettingCodes, Settings

from gateway.slices import Slice
from scaler import externalscaler_pb2 as pb
from scaler.demand import DemandBroadcaster
from scaler.externalscaler import ExternalScalerServicer, ScalerSettings, Status, _RateLimitedLog
from scaler.h2limits import CONTROL_CREDIT, Calm, FrameMeter
from scaler.streamtable import StreamTable
from scaler.tls import CertificateListener, ReloadingServerContext, TLSFiles

__all__ = ["H2ScalerServer", "start_h2_scaler_server"]

log = logging.getLogger("noctaya.scaler.h2")

SERVICE_PATH = "/externalscaler.ExternalScaler/"
# method -> (request message type, server streaming)
METHODS: dict[str, tuple[Any, bool]] = {
    "IsActive": (pb.ScaledObjectRef, False),
    "GetMetricSpec": (pb.ScaledObjectRef, False),
    "GetMetrics": (pb.GetMetricsRequest, False),
    "StreamIsActive": (pb.ScaledObjectRef, True),
    "StreamMetricSpec": (pb.ScaledObjectRef, True),
}
MAX_MESSAGE_BYTES = 64 * 1024  # a ScaledObjectRef with its trigger metadata is well under 1 KiB
MAX_HEADER_LIST_BYTES = 16 * 1024
# KEDA multiplexes every ScaledObject's stream (at most the servicer's max_streams, 256) and its
# polls on one connection: twice that leaves room for the polls.
MAX_STREAMS_PER_CONNECTION = 512
MAX_CONNECTIONS = 64
MAX_PER_ADDRESS = 8
# Request bytes of calls not yet complete, per connection: KEDA's requests are under 1 KiB and
# arrive whole; this lets 16 clients' largest messages be in flight while 64 connections hold at
# most 64 MiB between them.
MAX_BUFFERED_BYTES = 1024 * 1024
# Requests begun and not finished, per connection (beyond: RST_STREAM REFUSED_STREAM, which a client
# may retry): KEDA sends each request whole in one write, so it has at most a few at any moment.
MAX_PENDING_CALLS = 64
# TLS handshake + the client's preface and first SETTINGS, in all: KEDA sends them in its first
# round trips inside the cluster; a peer that has not by then only holds a connection slot.
HANDSHAKE_SECONDS = 5.0
WRITE_TIMEOUT_SECONDS = 10.0
IDLE_SECONDS = 300.0
READ_CHUNK = 65536
_PREFIX = 5  # compressed flag (1 byte) + message length (4 bytes, big-endian)
STREAM_IS_ACTIVE = "StreamIsActive"

_calm_log = _RateLimitedLog()


class _Abort(Exception):
    def __init__(self, code: Status, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _Gone(Exception):
    """The call or its connection closed while a reply was being written."""


class _Call:
    __slots__ = ("stream_id", "method", "body", "closed", "callbacks", "answered", "started", "ending",
                 "greenlet")

    def __init__(self, stream_id: int, method: str) -> None:
        self.stream_id = stream_id
        self.method = method
        self.body = bytearray()
        self.closed = False
        self.callbacks: list[Callable[[], None]] = []
        self.answered = False  # a status was sent (an early refusal): the rest of the request is ignored
        self.started = False  # response headers were sent: a reset by the client now is not "rapid"
        self.ending: tuple[Status, str] | None = None  # the server ends this stream (evicted)
        self.greenlet: gevent.Greenlet | None = None  # a server stream's writer

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.wake()

    def wake(self) -> None:
        """Run the servicer's callbacks (they wake its waits) without closing the call."""
        for callback in self.callbacks:
            try:
                callback()
            except Exception:  # one broken callback must not keep the others from running
                log.exception("call close callback failed")

    def end(self, code: Status, details: str) -> None:
        """End the stream from the server's side: its handler returns and sends this status."""
        if self.ending is None and not self.closed:
            self.ending = (code, details)
            self.wake()


class _CallContext:
    """The servicer's RpcContext for one call."""

    __slots__ = ("_call",)

    def __init__(self, call: _Call) -> None:
        self._call = call

    def abort(self, code: Status, details: str) -> NoReturn:
        raise _Abort(code, details)

    def is_active(self) -> bool:
        return not self._call.closed and self._call.ending is None

    def add_callback(self, callback: Callable[[], None]) -> bool:
        self._call.callbacks.append(callback)
        return True


def _grpc_message(details: str) -> str:
    """grpc-message is percent-encoded UTF-8 (gRPC over HTTP/2, "Responses")."""
    return "".join(chr(b) if 0x20 <= b <= 0x7E and b != 0x25 else f"%{b:02X}" for b in details.encode()[:1024])


class _Connection:
    """One client connection: the reading greenlet feeds h2 and answers unary calls; each server
    stream writes from a greenlet of its own. Every use of the h2 state machine and every write
    holds ``_lock`` (a write yields to the loop while the socket is full)."""

    def __init__(self, server: H2ScalerServer, sock: socket.socket, address: str, deadline: float) -> None:
        self._server = server
        self._sock = sock
        self.address = address
        self._deadline = deadline  # of the handshake: the client's preface and first SETTINGS
        self._h2 = H2Connection(config=H2Configuration(client_side=False, header_encoding="utf-8"))
        self._lock = gevent.lock.Semaphore()
        self._calls: dict[int, _Call] = {}
        self._window = gevent.event.Event()  # set whenever the client grants more flow-control window
        self._streams = gevent.pool.Group()
        self._closed = False
        self._meter = FrameMeter(self._answered)
        self._buffered = 0  # request bytes held for calls not yet complete
        self._pending: set[int] = set()  # streams whose request is not complete yet

    # -- the reading side ----------------------------------------------------------------------
    def serve(self) -> None:
        try:
            with self._lock:
                self._h2.local_settings = Settings(client=False, initial_values={
                    SettingCodes.MAX_CONCURRENT_STREAMS: MAX_STREAMS_PER_CONNECTION,
                    SettingCodes.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST_BYTES,
                })
                self._h2.initiate_connection()
                self._flush()
            # gevent's recv does not switch while input is queued: without the slice a client that
            # keeps the socket full would keep the loop (probes, KEDA's calls) for itself.
            turn = Slice()
            while not self._closed:
                data = self._read()
                if data is None or not self._feed(data, turn):
                    return
        except Calm as calm:
            _calm_log.warning("scaler client %s: %s; closing with ENHANCE_YOUR_CALM", self.address, calm)
            self.close(ErrorCodes.ENHANCE_YOUR_CALM)
        except (OSError, _Gone, H2Error):
            pass  # the client went away or broke the protocol: nothing to answer
        finally:
            self._teardown()

    def _read(self) -> bytes | None:
        """The next bytes; b"" when an idle wait passed with calls open; None: the connection ends."""
        settled = self._meter.settled
        self._sock.settimeout(IDLE_SECONDS if settled else max(0.001, self._deadline - time.monotonic()))
        try:
            return self._sock.recv(READ_CHUNK) or None
        except TimeoutError:
            if settled and self._calls:
                return b""  # streams may be silent for hours; the connection is in use
            self.close(ErrorCodes.NO_ERROR)
            return None

    def _feed(self, data: bytes, turn: Slice) -> bool:
        """Hand h2 the input a piece at a time, answering each; False once h2 ended the connection."""
        for piece in self._meter.pieces(data):
            with self._lock:
                try:
                    events = self._h2.receive_data(piece)
                except ProtocolError:  # h2 has queued a GOAWAY saying why
                    self._flush()
                    return False
                for event in events:
                    self._on_event(event)
                self._flush()
            turn.check()  # outside the lock: the streams' writers may run meanwhile
        return True

    def _answered(self, stream_id: int) -> bool:
        call = self._calls.get(stream_id)
        return call is not None and call.started

    def _on_event(self, event: object) -> None:
        if isinstance(event, RequestReceived):
            self._on_request(event.stream_id, dict(event.headers or ()))
        elif isinstance(event, DataReceived):
            self._h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            self._on_data(event.stream_id, event.data or b"")
        elif isinstance(event, StreamEnded):  # h2 reports END_STREAM as an event of its own
            call = self._calls.get(event.stream_id)
            if call is not None and not call.answered:
                self._dispatch(call)
        elif isinstance(event, StreamReset):
            call = self._calls.get(event.stream_id)
            if call is not None:
                self._forget(call)
        elif isinstance(event, WindowUpdated):
            self._window.set()
        elif isinstance(event, ConnectionTerminated):
            self._closed = True

    def _on_data(self, stream_id: int, data: bytes) -> None:
        call = self._calls.get(stream_id)
        if call is None or call.answered or not data:
            return
        if len(call.body) + len(data) > MAX_MESSAGE_BYTES + _PREFIX:
            self._refuse(call, Status.RESOURCE_EXHAUSTED, f"request larger than {MAX_MESSAGE_BYTES} bytes")
        elif self._buffered + len(data) > MAX_BUFFERED_BYTES:
            self._refuse(call, Status.RESOURCE_EXHAUSTED, "too many request bytes in flight on this connection")
        else:
            call.body += data
            self._buffered += len(data)

    def _on_request(self, stream_id: int, headers: dict[str, str]) -> None:
        path = headers.get(":path", "")
        method = path[len(SERVICE_PATH):] if path.startswith(SERVICE_PATH) else ""
        if len(self._pending) >= MAX_PENDING_CALLS:
            # Each open stream holds h2's state and a call: a client that opens them without ever
            # finishing a request must not make 512 per connection cost memory.
            self._h2.reset_stream(stream_id, ErrorCodes.REFUSED_STREAM)
            return
        call = _Call(stream_id, method)
        self._calls[stream_id] = call
        self._pending.add(stream_id)
        if headers.get(":method") != "POST" or not headers.get("content-type", "").startswith("application/grpc"):
            # Not gRPC at all: a plain HTTP answer, as grpc servers give one.
            self._settle(call)
            self._send_headers(call, [(":status", "415")], end_stream=True)
            self._forget(call)
            return
        if method not in METHODS:
            self._refuse(call, Status.UNIMPLEMENTED, f"unknown method {path[:100]!r}")

    def _dispatch(self, call: _Call) -> None:
        """The whole request is here: decode it, then answer a unary call at once or start a stream."""
        self._settle(call)
        request_type, streaming = METHODS[call.method]
        body = call.body
        self._drop_body(call)
        try:
            request = _decode(request_type, body)
            handler = getattr(self._server.servicer, call.method)
            if streaming:
                self._start_stream(call, handler, request)
                return
            reply = handler(request, _CallContext(call))
        except _Abort as abort:
            self._refuse(call, abort.code, abort.details)
            return
        except Exception:
            log.exception("ExternalScaler %s failed", call.method)
            self._refuse(call, Status.INTERNAL, "internal error")
            return
        payload = _frame(reply.SerializeToString())
        if self._h2.local_flow_control_window(call.stream_id) < len(payload):
            # The reading greenlet cannot wait for a WINDOW_UPDATE it would have to read itself.
            self._refuse(call, Status.RESOURCE_EXHAUSTED, "flow-control window exhausted")
            return
        self._send_headers(call, _RESPONSE_HEADERS)
        self._send_data(call, payload)
        self._send_headers(call, _trailers(Status.OK, ""), end_stream=True)
        self._forget(call)

    def _start_stream(self, call: _Call, handler: Callable[..., Iterator[Any]], request: Any) -> None:
        victim = None
        if call.method == STREAM_IS_ACTIVE:
            admitted, victim = self._server.streams.admit(self.address, (self, call))
            if not admitted:
                raise _Abort(Status.RESOURCE_EXHAUSTED, "too many open StreamIsActive streams")
            if victim is not None:
                victim[1].end(Status.UNAVAILABLE, "stream slot given to another client; reconnect")
                victim[0].wake_writers()
        call.greenlet = self._streams.spawn(self._run_stream, call, handler, request,
                                            victim[1].greenlet if victim else None)

    def _refuse(self, call: _Call, code: Status, details: str) -> None:
        """A trailers-only answer (no message was sent)."""
        self._settle(call)
        try:
            self._send_headers(call, _RESPONSE_HEADERS + _trailers(code, details), end_stream=True)
        except H2Error:
            pass  # the stream is already closed on the client's side
        self._forget(call)

    def _settle(self, call: _Call) -> None:
        """The request is answered or dispatched: the rest of it is ignored."""
        call.answered = True
        self._pending.discard(call.stream_id)

    def _drop_body(self, call: _Call) -> None:
        self._buffered -= len(call.body)
        call.body = bytearray()

    def _forget(self, call: _Call) -> None:
        self._calls.pop(call.stream_id, None)
        self._pending.discard(call.stream_id)
        self._drop_body(call)
        call.close()

    # -- what the server sends (each frame earns the client allowance for its PINGs and WINDOW_UPDATEs)
    def _send_headers(self, call: _Call, headers: list[tuple[str, str]], *, end_stream: bool = False) -> None:
        self._h2.send_headers(call.stream_id, headers, end_stream=end_stream)
        call.started = True
        self._meter.control.credit(CONTROL_CREDIT)

    def _send_data(self, call: _Call, payload: bytes) -> None:
        self._h2.send_data(call.stream_id, payload)
        self._meter.control.credit(CONTROL_CREDIT)

    # -- the writing side of server streams ------------------------------------------------------
    def _run_stream(self, call: _Call, handler: Callable[..., Iterator[Any]], request: Any,
                    evicted: gevent.Greenlet | None) -> None:
        try:
            if evicted is not None:
                # The evicted stream's handler must have given its servicer slot back first.
                evicted.join(WRITE_TIMEOUT_SECONDS)
            status, details, started = self._write_stream(call, handler(request, _CallContext(call)))
            if status is not None:
                self._finish_stream(call, status, details, started)
        finally:
            self._server.streams.remove(self.address, (self, call))

    def _write_stream(self, call: _Call, messages: Iterator[Any]) -> tuple[Status | None, str, bool]:
        """Send the handler's messages; (the final status or None when there is no one to tell, its
        details, whether a message was sent)."""
        status, details = Status.OK, ""
        started = False
        try:
            for message in messages:
                if call.closed or call.ending:
                    break
                self._send_message(call, _frame(message.SerializeToString()), headers=not started)
                started = True
        except _Abort as abort:
            status, details = abort.code, abort.details
        except _Gone:
            if call.ending is None:
                return None, "", started
        except Exception:
            log.exception("ExternalScaler %s failed", call.method)
            status, details = Status.INTERNAL, "internal error"
        finally:
            messages.close()  # runs the handler's own cleanup (its open-stream count) at once
        if call.ending is not None:
            status, details = call.ending
        return (None if call.closed else status), details, started

    def _finish_stream(self, call: _Call, status: Status, details: str, started: bool) -> None:
        with self._lock:
            try:
                headers = _trailers(status, details) if started else _RESPONSE_HEADERS + _trailers(status, details)
                self._send_headers(call, headers, end_stream=True)
                self._flush()
            except (H2Error, OSError, _Gone):
                pass
            finally:
                self._forget(call)

    def _send_message(self, call: _Call, payload: bytes, *, headers: bool) -> None:
        deadline = time.monotonic() + WRITE_TIMEOUT_SECONDS
        while True:
            with self._lock:
                if call.closed or self._closed or call.ending:
                    raise _Gone
                try:
                    if self._h2.local_flow_control_window(call.stream_id) >= len(payload):
                        if headers:
                            self._send_headers(call, _RESPONSE_HEADERS)
                        self._send_data(call, payload)
                        self._flush()
                        return
                except H2Error:
                    raise _Gone from None
                self._window.clear()
            left = deadline - time.monotonic()
            if left <= 0 or not self._window.wait(left):
                with self._lock:
                    if not call.closed:
                        self._h2.reset_stream(call.stream_id, ErrorCodes.FLOW_CONTROL_ERROR)
                        self._flush()
                        self._forget(call)
                raise _Gone

    def wake_writers(self) -> None:
        """Wake the stream writers waiting for window (an evicted one then gives up its slot)."""
        self._window.set()

    # -- I/O -------------------------------------------------------------------------------------
    def _flush(self) -> None:
        """Send what h2 has queued; the caller holds the lock."""
        data = self._h2.data_to_send()
        if not data:
            return
        try:
            with gevent.Timeout(WRITE_TIMEOUT_SECONDS, _Gone):
                self._sock.sendall(data)
        except (_Gone, OSError):
            self._closed = True
            raise _Gone from None

    def close(self, code: ErrorCodes = ErrorCodes.NO_ERROR) -> None:
        """GOAWAY, then the socket closes once the reading greenlet sees it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._h2.close_connection(code)
                self._flush()
            except (H2Error, _Gone):
                pass
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _teardown(self) -> None:
        self._closed = True
        for call in list(self._calls.values()):
            call.close()  # wakes the stream greenlets' waits (the servicer's callbacks)
        self._calls.clear()
        self._window.set()
        self._streams.join(timeout=WRITE_TIMEOUT_SECONDS)
        self._streams.kill(block=False)
        self._server.forget(self)
        try:
            self._sock.close()
        except OSError:
            pass


_RESPONSE_HEADERS = [(":status", "200"), ("content-type", "application/grpc")]


def _trailers(code: Status, details: str) -> list[tuple[str, str]]:
    trailers = [("grpc-status", str(int(code)))]
    if details:
        trailers.append(("grpc-message", _grpc_message(details)))
    return trailers


def _decode(request_type: Any, body: bytearray) -> Any:
    """The one message of a request's body."""
    if len(body) < _PREFIX:
        raise _Abort(Status.INVALID_ARGUMENT, "missing request message")
    if body[0] != 0:
        raise _Abort(Status.UNIMPLEMENTED, "compressed messages are not supported")
    if int.from_bytes(body[1:_PREFIX], "big") != len(body) - _PREFIX:
        raise _Abort(Status.INVALID_ARGUMENT, "the request must be exactly one message")
    try:
        return request_type.FromString(bytes(body[_PREFIX:]))
    except DecodeError:
        raise _Abort(Status.INVALID_ARGUMENT, "the request message does not decode") from None


def _frame(message: bytes) -> bytes:
    return b"\x00" + len(message).to_bytes(4, "big") + message


class H2ScalerServer:
    """A running ExternalScaler on the calling thread's gevent hub."""

    def __init__(self, servicer: ExternalScalerServicer, host: str, port: int, *,
                 tls: ReloadingServerContext | None = None, max_connections: int = MAX_CONNECTIONS,
                 max_per_address: int = MAX_PER_ADDRESS,
                 max_streams: int = ScalerSettings().max_streams) -> None:
        self.servicer = servicer
        self._tls = tls
        self._max_per_address = max_per_address  # 0 = no cap
        self._per_address: dict[str, int] = {}  # open connections by client address (this hub only)
        self._connections: set[_Connection] = set()
        # StreamIsActive slots by client address, as many as the servicer admits (its max_streams).
        self.streams: StreamTable[tuple[_Connection, _Call]] = StreamTable(max_streams)
        self._server = StreamServer((host, port), self._handle, spawn=gevent.pool.Pool(max_connections))
        self._server.init_socket()  # bind now: a port in use is an error at startup, not later
        self.port: int = self._server.address[1]
        self._stopped = False

    def start(self) -> H2ScalerServer:
        self._server.start()
        return self

    def _handle(self, sock: socket.socket, address: object) -> None:
        peer = address[0] if isinstance(address, tuple) else ""
        count = self._per_address.get(peer, 0)
        if self._max_per_address and count >= self._max_per_address:
            sock.close()
            return
        self._per_address[peer] = count + 1
        try:
            self._serve(sock, peer)
        finally:
            left = self._per_address.pop(peer, 1) - 1
            if left > 0:
                self._per_address[peer] = left

    def _serve(self, sock: socket.socket, peer: str) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # One deadline for the TLS handshake, the preface and the first SETTINGS: a per-read
        # timeout would let a peer that sends a byte now and then hold its slot for ever.
        deadline = time.monotonic() + HANDSHAKE_SECONDS
        if self._tls is not None:
            sock.settimeout(HANDSHAKE_SECONDS)
            try:
                with gevent.Timeout(HANDSHAKE_SECONDS, TimeoutError):
                    sock = self._tls.current().wrap_socket(sock, server_side=True)
            except (OSError, ValueError):  # ssl.SSLError is an OSError: no or a bad client certificate
                sock.close()
                return
        connection = _Connection(self, sock, peer, deadline)
        self._connections.add(connection)
        connection.serve()

    def forget(self, connection: _Connection) -> None:
        self._connections.discard(connection)

    def stop(self, grace: float = 5.0) -> None:
        """End open streams with OK, then say GOAWAY and close every connection (bounded by ``grace``)."""
        if self._stopped:
            return
        self._stopped = True
        self._server.stop_accepting()
        self.servicer.begin_shutdown()
        deadline = time.monotonic() + max(0.0, grace)
        while self.servicer.open_streams and time.monotonic() < deadline:
            gevent.sleep(0.01)
            self.servicer.begin_shutdown()
        gevent.sleep(0)  # let the streams' greenlets send their trailers
        for connection in list(self._connections):
            connection.close()
        self._server.stop(timeout=max(0.0, deadline - time.monotonic()))


def start_h2_scaler_server(
    broadcaster: DemandBroadcaster,
    port: int,
    *,
    host: str = "0.0.0.0",
    settings: ScalerSettings | None = None,
    tls: TLSFiles | None = None,
    on_activated: Callable[[float], None] | None = None,
    max_connections: int = MAX_CONNECTIONS,
    max_per_address: int = MAX_PER_ADDRESS,
    models: Callable[[str], DemandBroadcaster | None] | None = None,
    members: Callable[[str, str], DemandBroadcaster | None] | None = None,
    on_certificate: CertificateListener | None = None,
) -> H2ScalerServer:
    """Serve the ExternalScaler on ``host:port`` from the calling thread's gevent hub (port 0 =
    ephemeral, see ``.port``). With ``tls`` the client must present a certificate signed by its CA
    file (KEDA's ``tlsClientCert``); the files are re-read when they change, and ``on_certificate``
    is told the served certificate's notAfter at start and on every reload."""
    settings = settings or ScalerSettings()
    context = None
    if tls is not None:
        context = ReloadingServerContext(tls, client_auth=True, alpn=("h2",), context_class=gevent.ssl.SSLContext,
                                         on_loaded=on_certificate)
    servicer = ExternalScalerServicer(broadcaster, settings, on_activated, sleep=gevent.sleep, models=models,
                                      members=members)
    try:
        server = H2ScalerServer(servicer, host, port, tls=context, max_connections=max_connections,
                                max_per_address=max_per_address,
                                max_streams=settings.max_streams)
    except OSError as exc:
        raise OSError(f"cannot bind the gRPC scaler to {host}:{port}: {exc.strerror or exc}") from None
    server.start()
    log.info("ExternalScaler listening on %s:%d (tls=%s, h2)", host, server.port, tls is not None)
    return server
