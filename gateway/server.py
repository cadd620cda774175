"""Client connections: accept, read and parse requests (pipelined in order), write answers, time
out idle or stuck sockets, and notice clients that hang up.

One greenlet per connection runs :func:`serve_connection`. Deadlines are attributes, not timers: a
single watchdog greenlet wakes every ``WATCHDOG_SECONDS`` while there are connections (it parks while
there are none, from the moment the last one leaves), shuts down any socket whose deadline passed
(which unblocks the greenlet waiting on it) and arms a hang-up watcher for requests still waiting on
the backend after ``LAZY_WATCH_SECONDS``. A fast request therefore creates no timer and no extra
greenlet, and a connection that comes and goes within a tick (a probe) not even the watchdog's; a
held cold request is watched at once (``arm_watch``).

The admin port's connections are served the same way, from the control thread's own hub
(``gateway.control``), with a watchdog of their own there (:class:`ConnectionWatch`).
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import socket as std_socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import gevent
import gevent.event
import gevent.pool
import gevent.socket
from gevent.server import StreamServer

from gateway.errors import ERRORS, error_body
from gateway.idle import IdleConnections
from gateway.relay import INF, READ_CHUNK, ReadWaiter, UpstreamConnection, recv_waiting, send_all
from gateway.slices import Slice
from gateway.state.uploads import UploadRefused, UploadReservation
from gateway.timing import RequestTiming
from gateway.wire import BadRequest, ClientParser, RequestHead, response_head

if TYPE_CHECKING:
    from gateway.config import GatewayConfig
    from gateway.control import AdminServer, ControlThread


class ServedApp(Protocol):
    """What the connection layer and the drain need of an app: one model's ``GatewayApp``, or a shared
    gateway's ``SharedGatewayApp``."""

    config: GatewayConfig
    draining: bool

    def handle(self, conn: ClientConnection, head: RequestHead) -> bool: ...
    def bad_request(self, conn: ClientConnection, exc: BadRequest | RequestTimedOut) -> None: ...
    def background(self) -> list[Callable[[], None]]: ...
    def close(self) -> None: ...
    def connection_refused(self) -> None: ...
    def announce_shutdown(self) -> None: ...
    def start_draining(self) -> None: ...
    @property
    def admitted(self) -> int: ...
    @property
    def waiting(self) -> int: ...
    def abort_waiters(self) -> None: ...
    def withdraw(self) -> None: ...

__all__ = ["AddressCounts", "ClientConnection", "ClientGone", "ConnectionWatch", "ClientBodyError", "RequestBodyTooLarge", "RequestTimedOut",
           "HeldBytesExhausted", "GatewayServer", "ServedApp", "UploadPace", "serve_connection", "listen_socket"]

log = logging.getLogger("noctaya.gateway")

WATCHDOG_SECONDS = 0.25
LAZY_WATCH_SECONDS = 0.25
ADMIN_MAX_CONNECTIONS = 64  # concurrent connections on the admin port (scrapes, operators), per worker
# Greenlets beyond the public pool: a connection that arrives when the pool is full runs in one of
# these just long enough to evict an idle connection (whose greenlet ends on the next loop turn) or
# to be refused 429. Beyond them gevent stops accepting until one ends (the kernel's backlog waits).
ADMISSION_SLACK = 64
JSON = b"application/json"
MAX_REQUEST_ID = 128
_PEEK = std_socket.MSG_PEEK | std_socket.MSG_DONTWAIT


class ClientGone(Exception):
    """The client closed its connection or could not be written to."""


class ClientBodyError(Exception):
    """The request body could not be read (client gone mid-upload, or malformed chunking)."""


class RequestBodyTooLarge(Exception):
    """A body of unknown length ran past the limit while being read."""


class RequestTimedOut(ClientBodyError):
    """The request's head did not arrive within its deadline, or its body came too slowly
    (``slow``: below the minimum rate, or past the body's absolute cap; see :class:`UploadPace`) (-> 408)."""

    def __init__(self, slow: bool = False) -> None:
        super().__init__()
        self.slow = slow


@dataclass(frozen=True, slots=True)
class UploadPace:
    """How fast a body must arrive. Not a fixed deadline for the whole body (a large body on a slow
    but steady link would be cut, and the SDK's retries upload it again and again): after ``grace``
    seconds for the first bytes, every ``window`` seconds must bring ``min_rate * window`` bytes (the
    window restarts each time they have come), and ``cap`` bounds the whole body whatever the rate.
    ``min_rate`` 0: only ``cap``."""

    min_rate: int
    window: float
    grace: float
    cap: float

    @property
    def quota(self) -> int:
        return max(1, int(self.min_rate * self.window))


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

    __slots__ = ("sock", "raw", "peer", "peer_bytes", "parser", "deadline", "idle_timeout", "request_timeout",
                 "request_deadline", "timed_out", "clock", "pace", "body_cap", "progress", "waiting_since",
                 "upstream", "backend_pod", "wire", "watching", "polled", "gone", "held", "wake", "message_done", "request_id", "keep_alive", "version", "reader", "admin", "timing",
                 "first_byte_deadline", "idle_set", "idle", "preempted", "__weakref__")

    def __init__(self, sock: gevent.socket.socket, peer: str, idle_timeout: float,
                 clock: Callable[[], float], admin: bool = False, request_timeout: float = INF,
                 pace: UploadPace | None = None, first_byte_timeout: float = INF,
                 idle_set: IdleConnections | None = None) -> None:
        self.sock = sock
        self.admin = admin  # accepted on the admin port: /metrics and /noctaya/queue, never /v1
        self.raw: std_socket.socket = sock._sock
        self.peer = peer
        self.peer_bytes = peer.encode()
        self.parser = ClientParser(clock)
        self.deadline = INF  # of the blocking read or write in progress (the watchdog enforces it)
        self.idle_timeout = idle_timeout
        self.request_timeout = request_timeout
        self.request_deadline = INF  # of the head (from its first byte), then of the body's progress
        self.timed_out = False
        # Without a pace the body shares the head's deadline (a connection built bare, in tests).
        self.pace = pace
        self.body_cap = INF  # set while a body is being read under ``pace``
        self.progress = 0  # body bytes since the pace's window last restarted
        self.clock = clock
        self.waiting_since: float | None = None  # set while awaiting the backend's response head
        self.upstream: UpstreamConnection | None = None  # the backend connection in use
        self.backend_pod: Any = None  # the backend Pod the current request is counted on (gateway.backends)
        self.wire = 0  # bytes read from the client on this connection (a body's framing counts too)
        self.watching = False  # hang-up detection armed (see arm_watch)
        self.polled = False  # the read watcher cannot tell (pipelined bytes, half-close): the watchdog polls
        self.gone = False
        self.held = False  # a cold hold: waiting for the backend, nothing forwarded (see hung_up)
        self.wake: gevent.event.Event | None = None
        self.message_done = True
        self.request_id = b""
        self.keep_alive = True  # the current request lets the connection carry another one
        self.version = "1.1"
        self.timing = RequestTiming()  # the current request's (restarted per request)
        self.reader = ReadWaiter(self.raw.fileno(), on_idle=self._on_idle_readable)
        # A fresh connection has this long (never more than the idle timeout) for its first byte: a
        # client opens a connection to send on it, and one that sends nothing only holds a slot.
        self.first_byte_deadline = clock() + min(first_byte_timeout, idle_timeout)
        self.idle_set = idle_set  # the public pool's idle connections (evicted oldest first when full)
        self.idle = False  # listed in ``idle_set``: waiting for a request's first byte
        self.preempted = False  # the upload budget cut this request's body for a fairer share

    # -- reading -------------------------------------------------------------------------------
    def _next_event(self) -> tuple[str, Any] | None:
        events = self.parser.events
        while not events:
            now = self.clock()
            idle_until = now + self.idle_timeout if self.wire else self.first_byte_deadline
            self.deadline = min(idle_until, self.request_deadline)
            try:
                # Between requests the next one is not there yet (the answer just left): wait first.
                data = recv_waiting(self.sock, self.reader) if self.message_done else self.sock.recv(READ_CHUNK)
            except OSError:
                data = b""
            finally:
                self.deadline = INF
            if self.idle:  # inlined _busy(): once per request
                self.idle = False
                self.idle_set.discard(self)  # type: ignore[union-attr]  # idle only with a set
            if self.timed_out:
                raise RequestTimedOut(slow=self.body_cap != INF)
            if self.preempted:
                raise UploadRefused(per_address=False)
            if not data:
                return None
            self.wire += len(data)
            parser = self.parser
            parser.feed(data)  # BadRequest propagates
            if self.body_cap != INF:
                self._progressed(len(data), self.clock())
            elif parser.in_message and self.request_deadline == INF:
                self.request_deadline = parser.started + self.request_timeout
        return events.popleft()

    def _start_body(self) -> None:
        """The head is in, its body follows: from now on the body's progress sets the deadline."""
        pace = self.pace
        if pace is None:
            return
        now = self.clock()
        self.body_cap = now + pace.cap
        self.progress = 0
        first = now + pace.grace + pace.window if pace.min_rate else INF
        self.request_deadline = min(self.body_cap, first)

    def _progressed(self, n: int, now: float) -> None:
        """``n`` more body bytes: a full window's quota restarts the window (a steady client is never
        cut, however large its body, up to the cap)."""
        pace = self.pace
        if pace is None or not pace.min_rate:
            return
        self.progress += n
        if self.progress >= pace.quota:
            self.progress = 0
            self.request_deadline = min(self.body_cap, now + pace.window)

    def read_head(self) -> RequestHead | None:
        """The next request's head, or None when the client closed between requests. Raises
        BadRequest, or RequestTimedOut when the head did not arrive in time."""
        if self.idle_set is not None and not self.parser.events and not self.parser.in_message:
            self.idle = True  # nothing of the next request yet: the pool may evict this connection
            self.idle_set.add(self)
        event = self._next_event()
        if event is None:
            return None
        kind, head = event
        if kind != "head":  # cannot happen: events of a message are consumed in order
            raise BadRequest(400, "bad_request")
        self.message_done = False
        self.version = head.version
        self.keep_alive = head.keep_alive
        if not head.has_body:
            self.finish_message()  # its end is already parsed: answers need not close the connection
        else:
            self._start_body()
        return head

    def body_pieces(self, limit: int | None = None) -> Iterator[bytes]:
        """The current request's body as it arrives. Raises ClientBodyError (gone / malformed /
        RequestTimedOut) or RequestBodyTooLarge past ``limit``."""
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
                self._message_read()
                return
            total += len(piece)
            if limit is not None and total > limit:
                raise RequestBodyTooLarge()
            yield piece

    def read_body(self, limit: int, uploads: UploadReservation) -> bytes:
        """The whole body (bounded by ``limit``). A body already parsed with its head (one read) is
        returned as it is; one that needs more reads has every piece counted in ``uploads`` as it
        arrives (UploadRefused past the client address's or the worker's upload bound). Those bytes
        are not the held-while-cold budget's: only a complete request held for a cold model is."""
        events = self.parser.events
        if len(events) >= 2 and events[0][0] == "body" and events[1][0] == "end":
            # The usual small request: head and body arrived in one read.
            piece = events.popleft()[1]
            events.popleft()
            if len(piece) > limit:
                raise RequestBodyTooLarge()
            self._message_read()
            return piece
        parts = []
        wire = self.wire
        uploads.on_preempt = self._preempt
        # A body arriving at line rate never makes recv wait (gevent's recv does not switch while
        # input is queued), so the read must yield by itself. By CPU time, not by bytes: a body of
        # 2-byte chunks costs ~100x more parsing per byte than one of 64 KiB reads, so a byte count
        # held the loop for ~0.1 s per 256 KiB of tiny chunks (tests/gateway/test_slices.py).
        work = Slice()
        for piece in self.body_pieces(limit):
            # What the client sent for it, framing included (2-byte chunks are 7 bytes a chunk on the
            # wire): the upload bounds count work and memory, not only the body's own bytes.
            uploads.take(max(len(piece), self.wire - wire))
            wire = self.wire
            parts.append(piece)
            work.check()  # the others' ready sockets are served before the next piece
        return b"".join(parts)

    def _busy(self) -> None:
        self.idle = False
        if self.idle_set is not None:
            self.idle_set.discard(self)

    def evict(self) -> bool:
        """The pool is full (or this address at its cap) and this connection waits longest for a
        request: close it silently, as its idle timeout would have. Not when bytes of its next
        request are already in (the read simply has not run yet): they are a request in progress."""
        try:
            if self.raw.recv(1, _PEEK):
                return False
        except BlockingIOError:
            pass
        except OSError:
            pass  # reset: it goes either way
        self.gone = True
        try:
            self.raw.shutdown(std_socket.SHUT_RDWR)  # ends the wait in read_head: it returns None
        except OSError:
            pass
        return True

    def _preempt(self) -> bool:
        """The upload budget gives this body's bytes to an address under its fair share: end the read
        (the client gets 429 upload_bytes_full). False once the body is read whole (it is being
        forwarded: not cut). Called from another greenlet's read: no switch here."""
        if self.message_done:
            return False
        self.preempted = True
        try:
            self.raw.shutdown(std_socket.SHUT_RD)
        except OSError:
            pass
        return True

    def _message_read(self) -> None:
        self.message_done = True
        self.request_deadline = INF
        self.body_cap = INF

    def finish_message(self) -> bool:
        """After answering: True when the connection can take its next request (the rest of this
        request's message is already parsed), False when an unread body forbids reuse."""
        if not self.message_done:
            events = self.parser.events
            while events and events[0][0] == "body":
                events.popleft()
            if not (events and events[0][0] == "end"):
                return False
            events.popleft()
            self._message_read()
        parser = self.parser
        if parser.in_message:
            # A pipelined request began while this one was served: its deadline runs from now, since
            # the wait was the gateway's, not the client's.
            parser.started = self.clock()
            self.request_deadline = parser.started + self.request_timeout
        return True

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
        """What the answer says about the connection: the truth, since the connection is closed
        after it whenever ``close`` or the request did not ask to keep it (HTTP/1.0 without
        ``keep-alive``, or ``Connection: close``)."""
        if close or not self.keep_alive:
            return [(b"Connection", b"close")]
        if self.version == "1.0":
            return [(b"Connection", b"keep-alive")]
        return []

    # -- liveness --------------------------------------------------------------------------------
    def arm_watch(self) -> gevent.event.Event:
        """Watch for a hang-up while nobody reads this connection. It costs no watcher of its own:
        the connection's read watcher (``ReadWaiter``) already fires when the client becomes
        readable with nobody waiting. On a hang-up: mark the client gone, unblock a wait on the
        backend, and set ``wake``. Returns ``wake``."""
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
        """The socket turned readable while nobody reads it: EOF, an error, or pipelined bytes.
        Once the read watcher has fired it stays stopped (or it would fire on every loop), so when
        this cannot decide, the watchdog polls the socket's hang-up flags for the rest of the wait."""
        try:
            gone = hung_up(self.raw, self.half_close_allowed)
        except Exception:  # noqa: BLE001
            gone = True
        if gone:
            self.hang_up()
        else:
            self.polled = True

    def poll_hang_up(self) -> None:
        """The watchdog's check of a connection the read watcher cannot judge."""
        if self.watching and not self.gone and polled_hang_up(self.raw, self.half_close_allowed):
            self.hang_up()

    @property
    def half_close_allowed(self) -> bool:
        """May the client end its sending side (FIN) and still be waiting for its answer? Only a
        client that announced it would send nothing more (``Connection: close``, or HTTP/1.0), and
        only while its request is being forwarded. During a cold hold nothing has reached the
        backend yet, and a FIN is what every such client sends when it gives up (Python's urllib
        always closes this way): treating it as a half-close kept a slot and its demand, and woke a
        backend, for a client that was gone. A keep-alive client's FIN is a hang-up throughout."""
        return not self.keep_alive and not self.held

    def hold(self, held: bool) -> None:
        """Enter (True) or leave (False, forwarding begins) a cold hold. Entering it re-judges a FIN
        the watcher saw while half-close was allowed (a forwarding attempt that found the backend
        gone again): it is a hang-up now."""
        self.held = held
        if held and self.polled:
            self.poll_hang_up()

    def hang_up(self) -> None:
        self.gone = True
        self.watching = False
        upstream = self.upstream
        if upstream is not None:
            upstream.abort()
        if self.wake is not None:
            self.wake.set()

    def disarm_watch(self) -> None:
        self.watching = False
        self.polled = False
        self.held = False

    def expire(self) -> None:
        """The deadline passed: end the blocked read or write. A request that did not arrive in
        time is only shut for reading, so it can still be answered 408."""
        # Only a read bounded by the request deadline (``_next_event``) ends in a 408: a blocked write
        # (its deadline is the idle one) must be cut both ways, or it would stay blocked for good.
        if self.deadline == self.request_deadline <= self.clock():
            self.timed_out = True
            how = std_socket.SHUT_RD
        else:
            self.gone = True
            how = std_socket.SHUT_RDWR
        try:
            self.raw.shutdown(how)
        except OSError:
            pass

    def close(self) -> None:
        self._busy()
        self.disarm_watch()
        self.reader.close()
        self.parser.close()
        self.wake = None
        self.upstream = None
        self.sock.close()


_RDHUP = getattr(select, "POLLRDHUP", 0x2000)


def hung_up(raw: std_socket.socket, half_close_allowed: bool) -> bool:
    """Has the client left? A reset or error always means yes. An orderly end of its sending side
    (FIN) means yes unless ``half_close_allowed`` (:attr:`ClientConnection.half_close_allowed`: a
    ``Connection: close`` or HTTP/1.0 client whose request is being forwarded). Pending (pipelined)
    bytes decide nothing: see :func:`polled_hang_up`."""
    try:
        return raw.recv(1, _PEEK) == b"" and not half_close_allowed
    except BlockingIOError:
        return False
    except OSError:
        return True


def polled_hang_up(raw: std_socket.socket, half_close_allowed: bool) -> bool:
    """As :func:`hung_up`, from the socket's poll flags (they see a FIN or a reset behind unread
    pipelined bytes, which a peek cannot). poll(), not select(): valid for any descriptor number."""
    poller = select.poll()
    poller.register(raw.fileno(), _RDHUP | select.POLLHUP | select.POLLERR)
    try:
        events = poller.poll(0)
    except OSError:
        return True
    flags = events[0][1] if events else 0
    if flags & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
        return True
    return bool(flags & _RDHUP) and not half_close_allowed


class HeldBytesExhausted(Exception):
    """The Pod-wide budget for bodies held by waiting requests is spent (-> 429). No longer raised
    while a body is read (bodies still arriving are the upload bounds', ``UploadRefused``); kept for
    callers that still catch it."""


def serve_connection(app: ServedApp, conn: ClientConnection) -> None:
    """Requests of one connection, in order, until it closes or must close."""
    while True:
        try:
            head = conn.read_head()
        except (BadRequest, RequestTimedOut) as exc:
            conn.request_id = new_request_id()  # nothing of the malformed or late request is trusted
            app.bad_request(conn, exc)
            return
        if head is None:
            return
        conn.request_id = clean_request_id(head.request_id)
        keep = app.handle(conn, head)
        if not keep or not conn.keep_alive or conn.gone or app.draining or not conn.finish_message():
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


class AddressCounts:
    """Open connections per client address, capped (0 = no cap), on one hub."""

    __slots__ = ("cap", "counts")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.counts: dict[str, int] = {}  # bounded by the listener's pool

    def admit(self, peer: str) -> bool:
        count = self.counts.get(peer, 0)
        if self.cap and count >= self.cap:
            return False
        self.counts[peer] = count + 1
        return True

    def leave(self, peer: str) -> None:
        left = self.counts.get(peer, 0) - 1
        if left > 0:
            self.counts[peer] = left
        else:
            self.counts.pop(peer, None)


def peer_of(address: Any) -> str:
    return address[0] if isinstance(address, tuple) else ""


def no_delay(sock: gevent.socket.socket) -> None:
    """Answers go out as written (no Nagle wait for a small last piece)."""
    try:
        sock.setsockopt(std_socket.IPPROTO_TCP, std_socket.TCP_NODELAY, 1)
    except OSError:
        pass


def refuse(app: ServedApp, sock: gevent.socket.socket) -> None:
    """429 and close, without reading: a fresh socket's send buffer takes the answer at once."""
    app.connection_refused()
    error = ERRORS["too_many_connections"]
    body = error_body(error)
    try:
        sock._sock.send(response_head(error.status, [
            (b"Content-Type", JSON), (b"Content-Length", b"%d" % len(body)), (b"Connection", b"close"),
        ]) + body)
    except OSError:
        pass
    finally:
        sock.close()


class ConnectionWatch:
    """The open connections of one hub and their watchdog (see the module doc). The public port's
    live on the worker's loop, the admin port's on the control thread's (``gateway.control``): each
    hub has its own, so neither iterates a set the other thread changes. Build and run in the hub's
    thread."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.connections: set[ClientConnection] = set()
        self.first_byte_timeouts = 0  # fresh public connections closed for sending nothing in time
        # Set when a connection arrives: the watchdog parks while there is none (no idle wake-ups).
        self._arrived = gevent.event.Event()
        # Set when the last one leaves: cuts the watchdog's tick short, so a connection that comes and
        # goes within a tick (a kubelet probe, a scrape) costs no timer wake-up of its own.
        self._emptied = gevent.event.Event()

    def serve(self, app: ServedApp, conn: ClientConnection) -> None:
        """Serve ``conn`` to its end under this watch, then close it."""
        self.connections.add(conn)
        if len(self.connections) == 1:
            self._arrived.set()
        try:
            serve_connection(app, conn)
        except Exception as exc:  # noqa: BLE001 - one bad connection must not print a traceback
            tb = exc.__traceback__
            while tb is not None and tb.tb_next is not None:
                tb = tb.tb_next
            where = f"{tb.tb_frame.f_code.co_filename.rsplit('/', 1)[-1]}:{tb.tb_lineno}" if tb else "?"
            log.warning("connection failed", extra={"error": type(exc).__name__, "at": where})
        finally:
            self.connections.discard(conn)
            if not self.connections:
                self._emptied.set()
            conn.close()

    def drain(self, timeout: float) -> None:
        """Give the connections ``timeout`` seconds to finish, then cut the rest."""
        deadline = self.clock() + timeout
        while self.connections and self.clock() < deadline:
            gevent.sleep(0.02)
        for conn in list(self.connections):
            conn.expire()

    def run(self) -> None:
        """The watchdog greenlet."""
        while True:
            if not self.connections:  # nothing to watch: park until a connection arrives
                self._arrived.clear()
                self._arrived.wait()
            self._emptied.clear()
            if not self.connections or self._emptied.wait(WATCHDOG_SECONDS):
                continue  # all gone before the tick: park again
            self._tick(self.clock())

    def _tick(self, now: float) -> None:
        lazy = now - LAZY_WATCH_SECONDS
        for conn in self.connections:
            if conn.deadline < now:
                if not conn.wire and not conn.admin and not conn.gone:
                    self.first_byte_timeouts += 1  # nothing sent since it connected
                conn.expire()
            upstream = conn.upstream
            if upstream is not None and upstream.deadline < now:
                upstream.abort()
            if conn.polled:
                conn.poll_hang_up()
            since = conn.waiting_since
            if since is not None and since < lazy and not conn.watching and not conn.gone:
                conn.arm_watch()


class PublicAdmission:
    """Where a new public connection may go: at most ``max_connections`` in all and ``cap`` from one
    client address (0 = no cap, e.g. behind a proxy), so one address's busy connections can never
    take the whole pool. Where there is no place, the oldest idle connection (of that address, at its
    cap; of anyone, when the pool is full) is evicted to make one (gateway.idle): idle connections,
    from however few addresses, never lock anyone out. Only a pool full of requests in progress
    refuses (429). One hub (the worker's loop)."""

    def __init__(self, max_connections: int, cap: int) -> None:
        self.max_connections = max_connections
        self.cap = cap
        self.per_address: dict[str, int] = {}  # open public connections by client address (bounded by the pool)
        self.public = 0  # open public connections (admitted, not yet left or evicted)
        self.idle = IdleConnections()

    def admit(self, peer: str) -> bool:
        count = self.per_address.get(peer, 0)
        # An evicted connection still counts until its greenlet ends (the next loop turn): the
        # transient excess is bounded by the evictions in flight, within ADMISSION_SLACK.
        evicted = 0
        if self.cap and count >= self.cap:
            if not self.idle.evict_oldest(peer):
                return False
            evicted = 1  # that place is in the pool too
        if self.public - evicted >= self.max_connections and not self.idle.evict_oldest():
            return False
        self.per_address[peer] = count + 1
        self.public += 1
        return True

    def leave(self, peer: str) -> None:
        self.public -= 1
        left = self.per_address.get(peer, 0) - 1
        if left > 0:
            self.per_address[peer] = left
        else:
            self.per_address.pop(peer, None)
            self.idle.forget(peer)


class GatewayServer:
    """The app on a gevent StreamServer, plus the prober and watchdog greenlets. Build and run in
    one hub thread. The admin listener is served from the control thread (``gateway.control``):
    ``control``, the one to use (a one-worker Pod's, shared with its scaler), else one of its own."""

    def __init__(self, app: ServedApp, listener: std_socket.socket, *, max_connections: int,
                 clock: Callable[[], float] = time.monotonic, admin_listener: std_socket.socket | None = None,
                 control: ControlThread | None = None) -> None:
        self.app = app
        self.clock = clock
        self.idle_timeout = app.config.client_idle_timeout_seconds
        self.request_timeout = app.config.client_request_timeout_seconds
        config = app.config
        self.pace = UploadPace(config.client_min_rate_bytes, config.client_min_rate_window_seconds,
                               config.client_body_grace_seconds, config.client_body_timeout_seconds)
        self.first_byte_timeout = config.client_first_byte_timeout_seconds
        self.admission = PublicAdmission(max_connections, config.connections_per_address)
        self.idle = self.admission.idle
        self.watch = ConnectionWatch(clock)
        self.connections = self.watch.connections  # the public port's open connections
        self.server = StreamServer(listener, self._handle, spawn=gevent.pool.Pool(max_connections + ADMISSION_SLACK))
        self._admin_listener = admin_listener
        self.control = control
        self._owns_control = False
        self.admin: AdminServer | None = None  # built in start(), on the control thread
        self._greenlets: list[gevent.Greenlet] = []

    @property
    def port(self) -> int:
        return self.server.server_port

    @property
    def admin_port(self) -> int | None:
        return None if self._admin_listener is None else self._admin_listener.getsockname()[1]

    @property
    def first_byte_timeouts(self) -> int:
        return self.watch.first_byte_timeouts

    def start(self) -> None:
        self.server.start()
        if self._admin_listener is not None:
            from gateway.control import AdminServer, ControlThread

            if self.control is None:
                self.control = ControlThread().start()
                self._owns_control = True
            # Built and started in the control thread: its pool, events and watchers are that hub's.
            self.admin = self.control.call(AdminServer.serve, self.app, self._admin_listener, self.pace)
        self._greenlets = [*(gevent.spawn(task) for task in self.app.background()), gevent.spawn(self.watch.run)]

    def stop(self, timeout: float = 1.0) -> None:
        self.server.close()
        admin_stopped = None
        if self.admin is not None and self.control is not None:
            # The admin port closes now and drains on its own hub while the public port drains here.
            admin_stopped = self.control.submit(self.admin.stop, timeout)
        self.watch.drain(timeout)
        if admin_stopped is not None:
            admin_stopped.get(timeout + 5.0)
        gevent.killall(self._greenlets, block=False)
        self.app.close()
        if self._owns_control and self.control is not None:
            self.control.stop()

    def _handle(self, sock: gevent.socket.socket, address: Any) -> None:
        peer = peer_of(address)
        if not self.admission.admit(peer):
            refuse(self.app, sock)
            return
        try:
            no_delay(sock)
            conn = ClientConnection(sock, peer, self.idle_timeout, self.clock, False, self.request_timeout, self.pace,
                                    self.first_byte_timeout, self.idle)
            self.watch.serve(self.app, conn)
        finally:
            self.admission.leave(peer)
