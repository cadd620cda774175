"""Client connections: accept, read and parse requests (pipelined in order), write answers, time
out idle or stuck sockets, and notice clients that hang up.

One greenlet per connection runs :func:`serve_connection`. Deadlines are attributes, not timers: a
single watchdog greenlet wakes every ``WATCHDOG_SECONDS``, shuts down any socket whose deadline
passed (which unblocks the greenlet waiting on it) and arms a hang-up watcher for requests still
waiting on the backend after ``LAZY_WATCH_SECONDS``. A fast request therefore creates no timer and
no extra greenlet; a held cold request is watched at once (``arm_watch``).
"""

from __future__ import annotations

import itertools
import logging
import os
import socket as std_socket
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import gevent
import gevent.event
import gevent.pool
import gevent.socket
from gevent.server import StreamServer

from gateway.relay import INF, READ_CHUNK, ReadWaiter, UpstreamConnection, recv_waiting, send_all, socket_closed
from gateway.wire import BadRequest, ClientParser, RequestHead, response_head

if TYPE_CHECKING:
    from gateway.routes import GatewayApp

__all__ = ["ClientConnection", "ClientGone", "ClientBodyError", "RequestBodyTooLarge", "GatewayServer",
           "serve_connection", "listen_socket"]

log = logging.getLogger("noctaya.gateway")

WATCHDOG_SECONDS = 0.25
LAZY_WATCH_SECONDS = 0.25
ADMIN_MAX_CONNECTIONS = 64  # concurrent connections on the admin port (scrapes, operators), per worker
JSON = b"application/json"
MAX_REQUEST_ID = 128


class ClientGone(Exception):
    """The client closed its connection or could not be written to."""


class ClientBodyError(Exception):
    """The request body could not be read (client gone mid-upload, or malformed chunking)."""


class RequestBodyTooLarge(Exception):
    """A body of unknown length ran past the limit while being read."""


_ids = itertools.count(1)
_ID_PREFIX = os.urandom(4).hex().encode()


def new_request_id() -> bytes:
    """Unique per process (random prefix, re-drawn in each forked worker) and cheap."""
    return b"%s-%x" % (_ID_PREFIX, next(_ids))


def reseed_request_ids() -> None:
    global _ID_PREFIX
    _ID_PREFIX = os.urandom(4).hex().encode()


def clean_request_id(value: bytes | None) -> bytes:
    """The client's id when it is short printable ASCII, else a new one."""
    if value and len(value) <= MAX_REQUEST_ID and value.isascii() and value.strip() == value and b" " not in value:
        return value
    return new_request_id()


class ClientConnection:
    """One client socket, its parser and its deadlines."""

    __slots__ = ("sock", "raw", "peer", "peer_bytes", "parser", "deadline", "idle_timeout", "clock", "waiting_on",
                 "waiting_since", "upstream", "watching", "gone", "wake", "message_done", "request_id", "received_at", "cold",
                 "version", "hub", "reader", "admin", "__weakref__")

    def __init__(self, sock: gevent.socket.socket, peer: str, idle_timeout: float,
                 clock: Callable[[], float], admin: bool = False) -> None:
        self.sock = sock
        self.admin = admin  # accepted on the admin port: /metrics and /noctaya/queue, never /v1
        self.raw: std_socket.socket = sock._sock
        self.peer = peer
        self.peer_bytes = peer.encode()
        self.parser = ClientParser()
        self.deadline = INF
        self.idle_timeout = idle_timeout
        self.clock = clock
        self.waiting_on: UpstreamConnection | None = None  # set while awaiting a response head
        self.waiting_since: float | None = None
        self.upstream: UpstreamConnection | None = None  # the backend connection in use
        self.watching = False  # hang-up detection armed (see arm_watch)
        self.gone = False
        self.wake: gevent.event.Event | None = None
        self.message_done = True
        self.request_id = b""
        self.received_at = 0.0  # when the current request's head was read (time to first token)
        self.cold = False  # whether it waited for the backend
        self.version = "1.1"
        self.hub = gevent.get_hub()
        self.reader = ReadWaiter(self.raw.fileno(), on_idle=self._on_idle_readable)

    # -- reading -------------------------------------------------------------------------------
    def _next_event(self) -> tuple[str, Any] | None:
        events = self.parser.events
        while not events:
            self.deadline = self.clock() + self.idle_timeout
            try:
                # Between requests the next one is not there yet (the answer just left): wait first.
                data = recv_waiting(self.sock, self.reader) if self.message_done else self.sock.recv(READ_CHUNK)
            except OSError:
                data = b""
            finally:
                self.deadline = INF
            if not data:
                return None
            self.parser.feed(data)  # BadRequest propagates
        return events.popleft()

    def read_head(self) -> RequestHead | None:
        """The next request's head, or None when the client closed between requests."""
        event = self._next_event()
        if event is None:
            return None
        kind, head = event
        if kind != "head":  # cannot happen: events of a message are consumed in order
            raise BadRequest(400, "bad_request")
        self.message_done = False
        self.version = head.version
        if not head.has_body:
            self.finish_message()  # its end is already parsed: answers need not close the connection
        return head

    def body_pieces(self, limit: int | None = None) -> Iterator[bytes]:
        """The current request's body as it arrives. Raises ClientBodyError (gone / malformed) or
        RequestBodyTooLarge past ``limit``."""
        total = 0
        while not self.message_done:
            try:
                event = self._next_event()
            except BadRequest as exc:
                raise ClientBodyError() from exc
            if event is None:
                raise ClientBodyError()
            kind, piece = event
            if kind == "end":
                self.message_done = True
                return
            total += len(piece)
            if limit is not None and total > limit:
                raise RequestBodyTooLarge()
            yield piece

    def read_body(self, limit: int, reserve: Callable[[int], bool] | None = None) -> bytes:
        """The whole body (bounded by ``limit``). ``reserve(n)`` is asked for each piece's bytes as
        it arrives; False raises HeldBytesExhausted."""
        events = self.parser.events
        if reserve is None and len(events) >= 2 and events[0][0] == "body" and events[1][0] == "end":
            # The usual small request: head and body arrived in one read.
            piece = events.popleft()[1]
            events.popleft()
            if len(piece) > limit:
                raise RequestBodyTooLarge()
            self.message_done = True
            return piece
        parts = []
        for piece in self.body_pieces(limit):
            if reserve is not None and not reserve(len(piece)):
                raise HeldBytesExhausted()
            parts.append(piece)
        return b"".join(parts)

    def finish_message(self) -> bool:
        """After answering: True when the connection can take its next request (the rest of this
        request's message is already parsed), False when an unread body forbids reuse."""
        if self.message_done:
            return True
        events = self.parser.events
        while events and events[0][0] == "body":
            events.popleft()
        if events and events[0][0] == "end":
            events.popleft()
            self.message_done = True
            return True
        return False

    def continue_100(self, head: RequestHead) -> None:
        """Answer ``Expect: 100-continue`` right before the body is read (never when rejecting)."""
        if head.expect_continue and head.version == "1.1" and not self.message_done:
            head.expect_continue = False
            self.send(b"HTTP/1.1 100 Continue\r\n\r\n")

    # -- writing -------------------------------------------------------------------------------
    def send(self, data: bytes) -> None:
        self.deadline = self.clock() + self.idle_timeout
        try:
            send_all(self.sock, data)
        except OSError:
            self.gone = True
            raise ClientGone() from None
        finally:
            self.deadline = INF

    def respond(self, status: int, body: bytes, *, content_type: bytes = JSON,
                extra: list[tuple[bytes, bytes]] | None = None, close: bool = False) -> None:
        """A complete answer generated by the gateway itself (always with ``x-request-id``)."""
        headers = [(b"Content-Type", content_type), (b"Content-Length", b"%d" % len(body)),
                   (b"X-Request-Id", self.request_id)]
        if extra:
            headers.extend(extra)
        headers.extend(self.connection_headers(close))
        self.send(response_head(status, headers) + body)

    def connection_headers(self, close: bool) -> list[tuple[bytes, bytes]]:
        if close:
            return [(b"Connection", b"close")]
        if self.version == "1.0":
            return [(b"Connection", b"keep-alive")]
        return []

    # -- liveness --------------------------------------------------------------------------------
    def client_gone(self) -> bool:
        if not self.gone and socket_closed(self.raw):
            self.gone = True
        return self.gone

    def arm_watch(self) -> gevent.event.Event:
        """Watch for a hang-up while nobody reads this connection. It costs no watcher of its own:
        the connection's read watcher (``ReadWaiter``) already fires when the client becomes
        readable with nobody waiting. On EOF: mark the client gone, unblock a wait on the backend,
        and set ``wake``. Returns ``wake``."""
        if self.wake is None:
            self.wake = gevent.event.Event()
        if not self.watching and not self.gone:
            self.watching = True
            if self.reader.ready:  # bytes or EOF arrived before arming: no callback will come again
                self._check_hang_up()
        return self.wake

    def _on_idle_readable(self) -> None:  # hub context: must never raise
        if self.watching:
            self._check_hang_up()

    def _check_hang_up(self) -> None:
        try:
            gone = socket_closed(self.raw)
        except Exception:  # noqa: BLE001
            gone = True
        self.watching = False  # EOF: done; pipelined bytes: the next request waits its turn
        if gone:
            self.gone = True
            upstream = self.upstream
            if upstream is not None:
                upstream.abort()
            if self.wake is not None:
                self.wake.set()

    def disarm_watch(self) -> None:
        self.watching = False

    def expire(self) -> None:
        """The deadline passed: shut the socket down so the blocked read or write returns."""
        self.gone = True
        try:
            self.raw.shutdown(std_socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.disarm_watch()
        self.reader.close()
        self.sock.close()


class HeldBytesExhausted(Exception):
    """The Pod-wide budget for bodies held by waiting requests is spent (-> 429)."""


def serve_connection(app: GatewayApp, conn: ClientConnection) -> None:
    """Requests of one connection, in order, until it closes or must close."""
    while True:
        try:
            head = conn.read_head()
        except BadRequest as exc:
            conn.request_id = new_request_id()  # nothing of the malformed request is trusted
            app.bad_request(conn, exc)
            return
        if head is None:
            return
        conn.request_id = clean_request_id(head.request_id)
        keep = app.handle(conn, head)
        if not keep or not head.keep_alive or conn.gone or app.draining or not conn.finish_message():
            return


def listen_socket(host: str, port: int, *, reuse_port: bool, backlog: int = 2048) -> std_socket.socket:
    """The listening socket; with ``reuse_port`` every worker binds its own and the kernel spreads
    new connections across them (SO_REUSEPORT)."""
    family = std_socket.AF_INET6 if ":" in host else std_socket.AF_INET
    sock = std_socket.socket(family, std_socket.SOCK_STREAM)
    sock.setsockopt(std_socket.SOL_SOCKET, std_socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(std_socket.SOL_SOCKET, std_socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


class GatewayServer:
    """The app on a gevent StreamServer, plus the prober and watchdog greenlets. Build and run in
    one hub thread."""

    def __init__(self, app: GatewayApp, listener: std_socket.socket, *, max_connections: int,
                 clock: Callable[[], float] = time.monotonic, admin_listener: std_socket.socket | None = None) -> None:
        self.app = app
        self.clock = clock
        self.idle_timeout = app.config.client_idle_timeout_seconds
        self.connections: set[ClientConnection] = set()
        self.server = StreamServer(listener, self._handle, spawn=gevent.pool.Pool(max_connections))
        # Scrapes get slots of their own: a full public port must not blind monitoring, nor the reverse.
        self.admin_server = None if admin_listener is None else StreamServer(
            admin_listener, self._handle_admin, spawn=gevent.pool.Pool(ADMIN_MAX_CONNECTIONS))
        self._greenlets: list[gevent.Greenlet] = []

    @property
    def port(self) -> int:
        return self.server.server_port

    @property
    def admin_port(self) -> int | None:
        return None if self.admin_server is None else self.admin_server.server_port

    def start(self) -> None:
        self.server.start()
        if self.admin_server is not None:
            self.admin_server.start()
        self._greenlets = [gevent.spawn(self.app.activation.prober.run), gevent.spawn(self._watchdog)]

    def stop(self, timeout: float = 1.0) -> None:
        self.app.activation.prober.stop()
        self.server.close()
        if self.admin_server is not None:
            self.admin_server.close()
        deadline = self.clock() + timeout
        while self.connections and self.clock() < deadline:
            gevent.sleep(0.02)
        for conn in list(self.connections):
            conn.expire()
        gevent.killall(self._greenlets, block=False)
        self.app.pool.close()

    def _handle_admin(self, sock: gevent.socket.socket, address: Any) -> None:
        self._handle(sock, address, admin=True)

    def _handle(self, sock: gevent.socket.socket, address: Any, admin: bool = False) -> None:
        try:
            sock.setsockopt(std_socket.IPPROTO_TCP, std_socket.TCP_NODELAY, 1)
        except OSError:
            pass
        peer = address[0] if isinstance(address, tuple) else ""
        conn = ClientConnection(sock, peer, self.idle_timeout, self.clock, admin)
        self.connections.add(conn)
        try:
            serve_connection(self.app, conn)
        except Exception as exc:  # noqa: BLE001 - one bad connection must not print a traceback
            tb = exc.__traceback__
            while tb is not None and tb.tb_next is not None:
                tb = tb.tb_next
            where = f"{tb.tb_frame.f_code.co_filename.rsplit('/', 1)[-1]}:{tb.tb_lineno}" if tb else "?"
            log.warning("connection failed", extra={"error": type(exc).__name__, "at": where})
        finally:
            self.connections.discard(conn)
            conn.close()

    def _watchdog(self) -> None:
        while True:
            gevent.sleep(WATCHDOG_SECONDS)
            now = self.clock()
            lazy = now - LAZY_WATCH_SECONDS
            for conn in self.connections:
                if conn.deadline < now:
                    conn.expire()
                upstream = conn.upstream
                if upstream is not None and upstream.deadline < now:
                    upstream.abort()
                since = conn.waiting_since
                if since is not None and since < lazy and not conn.watching and not conn.gone:
                    conn.arm_watch()
