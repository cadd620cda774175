"""The backend side of the data path: pooled keep-alive connections, sending one request, reading
its response head, and relaying the body to the client as it arrives.

Bodies are relayed piece by piece in both directions: whatever one socket read returns is framed
for the client and written at once (SSE tokens are never held back); nothing is buffered beyond
one read. Hop-by-hop headers are dropped both ways (``gateway.wire``).

Replay safety: a request is retried only while *no byte* has been written to the backend, i.e.
when connecting fails (:class:`ConnectFailed`). Reused pooled connections are checked for a
half-closed peer before use (one ``poll(0)``, valid for any descriptor number), and any failure
after the first byte is :class:`UpstreamFailed`, never a retry.

Timeouts: every blocking read and write runs under a deadline that the connection watchdog
(``gateway.server``) enforces by shutting the socket down, so the fast path creates no timer.
"""

from __future__ import annotations

import errno
import os
import select
import socket as std_socket
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import gevent.socket
from gevent.hub import Waiter

from gateway.state.readiness import ProbeResult
from gateway.wire import ResponseHead, UpstreamParser, UpstreamProtocolError

if TYPE_CHECKING:
    from gateway.server import ClientConnection

__all__ = [
    "recv_waiting", "send_all", "ConnectFailed", "UpstreamFailed", "UpstreamConnection", "UpstreamPool", "send_request",
    "read_response_head", "probe_readiness", "READ_CHUNK", "SMALL_BODY_BYTES",
]

READ_CHUNK = 64 * 1024  # max bytes per read (and so per relayed piece)
SMALL_BODY_BYTES = 64 * 1024  # a body this small is read whole and sent with the head in one write
INF = float("inf")


class ReadWaiter:
    """A read watcher started once per socket, not once per wait.

    libev is level-triggered and gevent starts and stops a socket's watcher around every blocking
    read, which costs up to three ``epoll_ctl`` calls per wait (measured with strace: 2.8 per
    request, most of them failing and retried). Here the watcher stays started; a wait parks the
    greenlet until the watcher fires. If data arrives while nobody waits, the watcher stops itself
    (or it would fire on every loop iteration), calls ``on_idle`` (a client connection checks for a
    hang-up there), and the next wait returns at once and re-arms it.
    """

    __slots__ = ("_io", "_waiter", "ready", "_hub", "on_idle")

    def __init__(self, fd: int, on_idle: Callable[[], None] | None = None) -> None:
        self._hub = gevent.get_hub()
        self._io = self._hub.loop.io(fd, 1)
        self._waiter: Waiter | None = None
        self.ready = False
        self.on_idle = on_idle
        self._io.start(self._on_readable)

    def _on_readable(self) -> None:  # hub context
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            waiter.switch(None)
        else:
            self.ready = True
            self._io.stop()
            if self.on_idle is not None:
                self.on_idle()

    def wait(self) -> None:
        if self.ready:
            self.ready = False
            self._io.start(self._on_readable)
            return
        waiter = Waiter(self._hub)
        self._waiter = waiter
        try:
            waiter.get()
        finally:
            self._waiter = None

    def close(self) -> None:
        self._io.stop()
        self._io.close()
        self.on_idle = None  # its owner's bound method: no cycle left behind (see ClientParser.close)


def recv_waiting(sock: gevent.socket.socket, reader: ReadWaiter) -> bytes:
    """Read when the data is known not to be there yet (right after sending a request or an
    answer): wait for readability first, then one ``recv`` - no failed read, no watcher churn."""
    raw = sock._sock
    while True:
        reader.wait()
        try:
            return raw.recv(READ_CHUNK)
        except BlockingIOError:  # spurious wake-up
            continue


def send_all(sock: gevent.socket.socket, data: bytes) -> None:
    """``sendall`` with one direct ``send`` first (a small answer always fits the socket buffer)."""
    try:
        sent = sock._sock.send(data)
    except BlockingIOError:
        sent = 0
    if sent < len(data):
        sock.sendall(memoryview(data)[sent:])


class ConnectFailed(Exception):
    """No connection to the backend; nothing was sent, so the request may be retried."""

    def __init__(self, refused: bool) -> None:
        super().__init__("connection refused" if refused else "connect failed")
        self.refused = refused


class UpstreamFailed(Exception):
    """The backend failed after bytes of the request reached it: answer 502, never replay.
    ``reason`` is the protocol error's (``gateway.wire.PROTOCOL_ERRORS``) when its answer was not
    HTTP the gateway can relay, else None (a read failed or the backend closed)."""

    def __init__(self, detail: str, reason: str | None = None) -> None:
        super().__init__(detail)
        self.reason = reason


RESOLVE_SECONDS = 5.0


def _is_ip_literal(host: str) -> bool:
    for family in (std_socket.AF_INET, std_socket.AF_INET6):
        try:
            std_socket.inet_pton(family, host)
            return True
        except OSError:
            pass
    return False


class UpstreamConnection:
    """One keep-alive connection to the backend. ``deadline`` (monotonic) bounds the current
    blocking operation; the watchdog shuts the socket down once it passes."""

    __slots__ = ("sock", "raw", "parser", "deadline", "idle_timeout", "broken", "_poll", "reader", "on_protocol_error",
                 "home", "pod", "born", "uses")

    def __init__(self, sock: gevent.socket.socket, idle_timeout: float,
                 on_protocol_error: Callable[[str], None] | None = None, home: UpstreamPool | None = None) -> None:
        self.sock = sock
        self.home = home  # the pool it returns to
        self.pod: Any = None  # the backend Pod it reaches (gateway.backends), None: the Service address
        self.born = time.monotonic()
        self.uses = 0  # requests sent on it
        self.on_protocol_error = on_protocol_error  # called with the reason of a refused response
        self.raw: std_socket.socket = sock._sock  # the OS socket under gevent's wrapper
        self.parser = UpstreamParser()
        self.deadline = INF
        self.idle_timeout = idle_timeout
        self.broken = False
        # poll(), not select(): valid for any descriptor number (select() fails past 1023).
        self._poll = select.poll()
        self._poll.register(self.raw.fileno(), select.POLLIN | select.POLLPRI)
        self.reader = ReadWaiter(self.raw.fileno())

    def stale(self) -> bool:
        """An idle pooled HTTP/1.1 connection has nothing to read: readable, hung up or in error =
        closed or junk, either way unusable. One poll(0) syscall, no exception on the fast path."""
        if self.reader.ready:  # the watcher saw bytes (or EOF) while the connection sat idle
            return True
        try:
            return bool(self._poll.poll(0))
        except OSError:
            return True

    def abort(self) -> None:
        """Unblock whoever waits on this socket (deadline passed or the client left); the backend
        sees the connection end and stops generating."""
        self.broken = True
        try:
            self.raw.shutdown(std_socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.broken = True
        self.reader.close()
        self.parser.close()
        self.sock.close()


class UpstreamPool:
    """LIFO pool of idle keep-alive connections to one backend (at most ``max_idle``).
    ``on_protocol_error`` is called with the reason whenever a response on one of its connections
    is refused as malformed (the app counts them).

    ``max_age`` (seconds) and ``max_requests`` bound one connection's life (Envoy's
    ``max_connection_duration`` and ``max_requests_per_connection``): behind a Service address,
    kube-proxy picks a Pod once per connection, so a pool whose connections live forever keeps
    every request on the Pods it first reached; with a bounded life new Pods get their share
    within ``max_age``. A Pod's own pool (gateway.backends) needs neither."""

    def __init__(self, host: str, port: int, *, connect_timeout: float, idle_timeout: float,
                 max_idle: int = 256, on_protocol_error: Callable[[str], None] | None = None,
                 max_age: float | None = None, max_requests: int | None = None) -> None:
        self.host = host
        self.port = port
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self.max_idle = max_idle
        self.on_protocol_error = on_protocol_error
        self.max_age = max_age
        self.max_requests = max_requests
        self.opened = 0  # connections opened for requests (not probes): tests, /noctaya/queue
        self._idle: deque[UpstreamConnection] = deque()
        self._closed = False
        self._address: tuple[str, int] | None = None
        self._resolved_at = -RESOLVE_SECONDS
        self._literal = _is_ip_literal(host)

    def _target(self) -> tuple[str, int]:
        """The backend's address, resolved at most every RESOLVE_SECONDS (a Service name's
        ClusterIP is stable; a burst of new connections must not queue on the resolver)."""
        if self._literal:
            return (self.host, self.port)
        now = time.monotonic()
        if self._address is None or now - self._resolved_at >= RESOLVE_SECONDS:
            infos = gevent.socket.getaddrinfo(self.host, self.port, 0, std_socket.SOCK_STREAM)
            self._address = infos[0][4][:2]
            self._resolved_at = now
        return self._address

    def connect(self, timeout: float | None = None) -> UpstreamConnection:
        """A new connection. Raises ConnectFailed."""
        try:
            sock = _connect(self._target(), timeout or self.connect_timeout)
        except ConnectionRefusedError:
            raise ConnectFailed(refused=True) from None
        except OSError:  # timeout, unreachable, DNS (gaierror is an OSError)
            self._address = None  # resolve again next time
            raise ConnectFailed(refused=False) from None
        try:
            sock.setsockopt(std_socket.IPPROTO_TCP, std_socket.TCP_NODELAY, 1)
        except OSError:
            pass
        return UpstreamConnection(sock, self.idle_timeout, self.on_protocol_error, self)

    def _expired(self, conn: UpstreamConnection) -> bool:
        if self.max_requests is not None and conn.uses >= self.max_requests:
            return True
        return self.max_age is not None and time.monotonic() - conn.born >= self.max_age

    def acquire(self) -> UpstreamConnection:
        idle = self._idle
        while idle:
            conn = idle.pop()
            # Checked every time: a backend that just stopped (scale to zero) closes every pooled
            # connection, and a request sent on one would fail after its bytes left (502, no replay).
            if conn.stale() or (self.max_age is not None and self._expired(conn)):
                conn.close()
                continue
            return conn
        conn = self.connect()
        self.opened += 1
        return conn

    def release(self, conn: UpstreamConnection) -> None:
        conn.uses += 1
        if self._closed or conn.broken or len(self._idle) >= self.max_idle or (
                (self.max_age is not None or self.max_requests is not None) and self._expired(conn)):
            conn.close()
        else:
            conn.parser.reset()
            conn.deadline = INF
            self._idle.append(conn)

    def clear(self) -> None:
        """Drop idle connections (the backend went away; they are dead anyway)."""
        while self._idle:
            self._idle.pop().close()

    def close(self) -> None:
        self._closed = True
        self.clear()


def _connect(address: tuple[str, int], timeout: float) -> gevent.socket.socket:
    """Connect to an already resolved address. (gevent's create_connection resolves even an IP
    literal through its thread pool, so a burst of new connections would queue on ten threads.)"""
    family = std_socket.AF_INET6 if ":" in address[0] else std_socket.AF_INET
    raw = std_socket.socket(family, std_socket.SOCK_STREAM)
    try:
        raw.setblocking(False)
        err = raw.connect_ex(address)
        if err == errno.EINPROGRESS:
            gevent.socket.wait_write(raw.fileno(), timeout=timeout,
                                     timeout_exc=TimeoutError(errno.ETIMEDOUT, "connect timed out"))
            err = raw.getsockopt(std_socket.SOL_SOCKET, std_socket.SO_ERROR)
        if err:
            raise OSError(err, os.strerror(err)) if err != errno.ECONNREFUSED else ConnectionRefusedError(err, "refused")
    except BaseException:
        raw.close()
        raise
    return gevent.socket.socket(family, std_socket.SOCK_STREAM, fileno=raw.detach())


def _fail(conn: UpstreamConnection, what: str, exc: BaseException | None = None) -> UpstreamFailed:
    conn.close()
    detail = f"{what}: {type(exc).__name__}" if exc is not None else what
    return UpstreamFailed(detail)


def _refuse(conn: UpstreamConnection, what: str, exc: UpstreamProtocolError) -> UpstreamFailed:
    """A response that is not HTTP the gateway can relay: counted, its connection closed (whatever
    follows on it cannot be framed)."""
    conn.close()
    if conn.on_protocol_error is not None:
        conn.on_protocol_error(exc.reason)
    return UpstreamFailed(f"{what}: {exc.reason}", exc.reason)


def send_request(conn: UpstreamConnection, head: bytes, body: bytes = b"", *,
                 clock: Callable[[], float]) -> None:
    """Write the request head and its body (received whole before any slot was taken). Raises
    UpstreamFailed."""
    sock = conn.sock
    conn.deadline = clock() + conn.idle_timeout
    try:
        if len(body) <= SMALL_BODY_BYTES:
            send_all(sock, head + body)  # one write for the usual small request
        else:
            # A held body is never copied to prepend the head: when a backend wakes, every held
            # request is forwarded at once, and copies would double the memory held bodies use.
            send_all(sock, head)
            send_all(sock, body)
    except OSError as exc:
        raise _fail(conn, "sending request", exc) from None
    except BaseException:
        conn.close()
        raise
    finally:
        conn.deadline = INF


def read_response_head(conn: UpstreamConnection, client: ClientConnection | None, *,
                       clock: Callable[[], float]) -> ResponseHead:
    """Block until the backend's final response head arrived. While waiting, ``client`` is marked as
    waiting on the backend, so the watchdog can arm a hang-up watcher for slow answers. One deadline
    covers the whole wait, interim (1xx) heads included: they do not extend it, and past the
    parser's bound on them the answer is refused (UpstreamFailed with a ``reason``)."""
    parser = conn.parser
    sock = conn.sock
    if client is not None:
        client.waiting_since = clock()
    conn.deadline = clock() + conn.idle_timeout
    try:
        while parser.head is None:
            try:
                data = recv_waiting(sock, conn.reader)
            except OSError as exc:
                raise _fail(conn, "reading response head", exc) from None
            if not data:
                raise _fail(conn, "backend closed before answering")
            try:
                parser.feed(data)
            except UpstreamProtocolError as exc:
                raise _refuse(conn, "malformed response", exc) from None
        return parser.head
    finally:
        conn.deadline = INF
        if client is not None:
            client.waiting_since = None


def read_more(conn: UpstreamConnection, clock: Callable[[], float]) -> bool:
    """Read and parse the next piece of the body; False at EOF."""
    conn.deadline = clock() + conn.idle_timeout
    try:
        data = recv_waiting(conn.sock, conn.reader)  # the next piece was not in the last read: wait first
    except OSError as exc:
        raise _fail(conn, "reading response body", exc) from None
    finally:
        conn.deadline = INF
    if not data:
        return False
    try:
        conn.parser.feed(data)
    except UpstreamProtocolError as exc:
        raise _refuse(conn, "malformed response body", exc) from None
    return True


def probe_readiness(pool: UpstreamPool, path: str, host_header: str, timeout: float) -> ProbeResult:
    """One GET of the readiness path on a fresh connection (never a pooled one: a probe must see
    the Service as a new client would). Bounded by ``timeout`` per operation."""
    try:
        conn = pool.connect(timeout)
    except ConnectFailed as exc:
        return ProbeResult.REFUSED if exc.refused else ProbeResult.NOT_READY
    sock = conn.sock
    try:
        sock.settimeout(timeout)
        sock.sendall(b"GET %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\nUser-Agent: noctaya-gateway-probe\r\n\r\n"
                     % (path.encode("latin-1"), host_header.encode("latin-1")))
        parser = conn.parser
        received = 0
        while parser.head is None:
            data = sock.recv(4096)
            received += len(data)
            if not data or received > 64 * 1024:
                return ProbeResult.NOT_READY
            parser.feed(data)
        return ProbeResult.READY if 200 <= parser.head.status < 300 else ProbeResult.NOT_READY
    except (OSError, UpstreamProtocolError):
        return ProbeResult.NOT_READY
    finally:
        conn.close()
