"""Streaming forwarder to the backend over pooled keep-alive HTTP/1.1 connections.

Bodies are relayed chunk by chunk in both directions: a request body larger than
``SMALL_BODY_BYTES`` is copied from the client socket to the backend as it arrives, and every
response chunk is handed to the WSGI server as soon as one socket read returns it (SSE tokens are
never held back). Hop-by-hop headers are dropped both ways.

Replay safety: a request is retried only while *no byte* has been written to the backend, i.e.
when connecting fails (:class:`ConnectFailed`). Reused pooled connections are checked for a
half-closed peer before use, and any failure after the first byte is a :class:`UpstreamFailed`,
never a retry.

All I/O goes through gevent sockets explicitly, so the forwarder cooperates with the hub whether
or not the process is monkey-patched (the tests run the gateway in a thread of an unpatched
process).
"""

from __future__ import annotations

import errno
import http.client
import logging
import socket as std_socket
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import gevent
import gevent.socket

from gateway.state.readiness import ProbeResult

__all__ = [
    "UpstreamPool", "UpstreamResponse", "ConnectFailed", "UpstreamFailed", "RequestBodyTooLarge",
    "ClientBodyError", "forward", "probe_readiness", "HOP_BY_HOP", "SMALL_BODY_BYTES", "READ_CHUNK",
]

log = logging.getLogger("noctaya.gateway.proxy")

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade", "proxy-connection",
})
SMALL_BODY_BYTES = 64 * 1024  # read whole and sent with the head in one write (no Nagle stall)
READ_CHUNK = 64 * 1024  # max bytes per relayed chunk


def _original_select() -> Callable[..., Any]:
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None and monkey.is_module_patched("select"):
        return monkey.get_original("select", "select")
    import select

    return select.select


_select = _original_select()


class ConnectFailed(Exception):
    """No connection to the backend; nothing was sent, so the request may be retried."""

    def __init__(self, refused: bool) -> None:
        super().__init__("connection refused" if refused else "connect failed")
        self.refused = refused


class UpstreamFailed(Exception):
    """The backend failed after bytes of the request reached it: answer 502, never replay."""


class RequestBodyTooLarge(Exception):
    """A chunked request body ran past the limit while being relayed."""


class ClientBodyError(Exception):
    """The client's request body could not be read (client gone or malformed chunking)."""


class _Connection(http.client.HTTPConnection):
    """http.client over a gevent socket, with separate connect and idle-read timeouts."""

    def __init__(self, host: str, port: int, connect_timeout: float, idle_timeout: float) -> None:
        super().__init__(host, port, timeout=connect_timeout)
        self._create_connection = gevent.socket.create_connection
        self._idle_timeout = idle_timeout

    def connect(self) -> None:
        super().connect()
        self.sock.settimeout(self._idle_timeout)

    def peer_closed(self) -> bool:
        """True when a pooled connection is no longer usable (peer closed or sent stray bytes)."""
        if self.sock is None:
            return True
        try:
            readable, _, _ = _select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)  # an idle HTTP/1.1 connection has nothing to read


class UpstreamPool:
    """LIFO pool of idle keep-alive connections to one backend (bounded)."""

    def __init__(
        self, host: str, port: int, *, connect_timeout: float, idle_timeout: float, max_idle: int = 256
    ) -> None:
        self.host = host
        self.port = port
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self.max_idle = max_idle
        self._idle: deque[_Connection] = deque()
        self._closed = False

    def new_connection(self) -> _Connection:
        return _Connection(self.host, self.port, self.connect_timeout, self.idle_timeout)

    def acquire(self) -> tuple[_Connection, bool]:
        """A connected connection and whether it was reused. Raises ConnectFailed."""
        while self._idle:
            conn = self._idle.pop()
            if conn.peer_closed():
                conn.close()
                continue
            return conn, True
        conn = self.new_connection()
        try:
            conn.connect()
        except ConnectionRefusedError:
            conn.close()
            raise ConnectFailed(refused=True) from None
        except OSError:  # timeout, unreachable, DNS (gaierror is an OSError)
            conn.close()
            raise ConnectFailed(refused=False) from None
        return conn, False

    def release(self, conn: _Connection) -> None:
        if self._closed or len(self._idle) >= self.max_idle or conn.sock is None:
            conn.close()
        else:
            self._idle.append(conn)

    def clear(self) -> None:
        """Drop idle connections (the backend went away; they are dead anyway)."""
        while self._idle:
            self._idle.pop().close()

    def close(self) -> None:
        self._closed = True
        self.clear()


class UpstreamResponse:
    """The backend's response head plus a body iterator that relays chunks as they arrive.

    ``close()`` before the body is exhausted closes the backend connection: that is how a client
    disconnect reaches the backend (which then stops generating).
    """

    def __init__(self, pool: UpstreamPool, conn: _Connection, resp: http.client.HTTPResponse) -> None:
        self._pool = pool
        self._conn: _Connection | None = conn
        self._resp = resp
        self.status = resp.status
        self.reason = resp.reason or http.client.responses.get(resp.status, "Unknown")
        self.headers = resp.getheaders()
        self.failed = False

    @property
    def content_type(self) -> str:
        return self._resp.getheader("content-type", "") or ""

    def end_to_end_headers(self) -> list[tuple[str, str]]:
        """Response headers minus hop-by-hop ones (and those the Connection header names)."""
        named = {
            token.strip().lower()
            for value in self._resp.headers.get_all("connection", [])
            for token in value.split(",")
        }
        return [(k, v) for k, v in self.headers if k.lower() not in HOP_BY_HOP and k.lower() not in named]

    def __iter__(self) -> Iterator[bytes]:
        resp = self._resp
        try:
            while True:
                chunk = resp.read1(READ_CHUNK)
                if not chunk:
                    if resp.length:  # EOF before the declared Content-Length: truncated
                        raise http.client.IncompleteRead(b"", resp.length)
                    break
                yield chunk
                if resp.length == 0:  # Content-Length body complete (read1 does not close it)
                    resp.close()
                    break
        except (OSError, http.client.HTTPException) as exc:
            # Backend died mid-body: the response is already committed, so the caller can only
            # end it abnormally. Never retried: bytes reached the backend.
            self.failed = True
            self._discard()
            raise UpstreamFailed(str(exc)) from None
        self._finish()

    def read_bounded(self, limit: int) -> bytes:
        """The whole body when small (error bodies); a longer body is cut at ``limit``."""
        data = bytearray()
        for chunk in self:
            data += chunk
            if len(data) >= limit:
                self._discard()
                break
        return bytes(data[:limit])

    def _finish(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._resp.will_close or not self._resp.isclosed():
            conn.close()
        else:
            self._pool.release(conn)

    def _discard(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """Idempotent; closes the backend connection unless the body was fully relayed."""
        if self._conn is not None and not self._resp.isclosed():
            self._discard()
        else:
            self._finish()


def _encode_chunks(chunks: Iterable[bytes], limit: int, already: int) -> Iterator[bytes]:
    total = already
    for chunk in chunks:
        total += len(chunk)
        if total > limit:
            raise RequestBodyTooLarge()
        yield b"%x\r\n%s\r\n" % (len(chunk), chunk)
    yield b"0\r\n\r\n"


def forward(
    pool: UpstreamPool,
    method: str,
    target: str,
    headers: list[tuple[str, str]],
    body: bytes | None,
    body_rest: Iterable[bytes] | None = None,
    *,
    body_length: int | None = None,
    max_body_bytes: int = 8 * 1024 * 1024,
    on_first_byte: Callable[[float], None] | None = None,
    client_sock: std_socket.socket | None = None,
) -> UpstreamResponse:
    """Send one request and return the response head. ``body`` is sent with the head; the optional
    ``body_rest`` iterator streams the remainder (``body_length`` known = Content-Length framing,
    else chunked framing, bounded by ``max_body_bytes``).

    Raises ConnectFailed (nothing sent: may retry), UpstreamFailed (bytes sent: 502),
    RequestBodyTooLarge or ClientBodyError (upstream connection already closed).
    """
    conn, _reused = pool.acquire()
    started = time.monotonic()
    head_body = body or b""
    chunked = body_rest is not None and body_length is None
    try:
        conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
        for name, value in headers:
            conn.putheader(name, value)
        if chunked:
            conn.putheader("Transfer-Encoding", "chunked")
            head_body = b"%x\r\n%s\r\n" % (len(head_body), head_body) if head_body else b""
        elif body_rest is not None:
            conn.putheader("Content-Length", str(body_length))
        elif body is not None or method in ("POST", "PUT", "PATCH"):
            conn.putheader("Content-Length", str(len(head_body)))
        conn.endheaders(head_body or None)
        if body_rest is not None:
            parts = _encode_chunks(body_rest, max_body_bytes, len(body or b"")) if chunked else body_rest
            for part in parts:
                conn.send(part)
    except (RequestBodyTooLarge, ClientBodyError):
        conn.close()
        raise
    except (OSError, http.client.HTTPException) as exc:
        conn.close()
        raise UpstreamFailed(f"sending request: {type(exc).__name__}") from None
    # While the backend thinks (a non-streamed completion can take minutes), watch the client:
    # if it hangs up, close the backend connection so the backend stops generating.
    watcher = gevent.spawn(_hang_up_when_client_leaves, client_sock, conn) if client_sock is not None else None
    try:
        resp = conn.getresponse()
    except (OSError, http.client.HTTPException) as exc:
        conn.close()
        raise UpstreamFailed(f"reading response head: {type(exc).__name__}") from None
    finally:
        if watcher is not None:
            watcher.kill(block=False)
    if on_first_byte is not None:
        on_first_byte(time.monotonic() - started)
    return UpstreamResponse(pool, conn, resp)


def _hang_up_when_client_leaves(client_sock: std_socket.socket, conn: _Connection) -> None:
    try:
        gevent.socket.wait_read(client_sock.fileno())
    except Exception:  # socket closed under us, or killed: nothing to do
        return
    if client_gone(client_sock) and conn.sock is not None:
        try:
            conn.sock.shutdown(std_socket.SHUT_RDWR)
        except OSError:
            pass


def probe_readiness(pool: UpstreamPool, path: str, host_header: str, timeout: float) -> ProbeResult:
    """One GET of the readiness path on a fresh connection (never a pooled one: a probe must see
    the Service as a new client would)."""
    conn = _Connection(pool.host, pool.port, timeout, timeout)
    try:
        conn.connect()
    except ConnectionRefusedError:
        conn.close()
        return ProbeResult.REFUSED
    except OSError:
        conn.close()
        return ProbeResult.NOT_READY
    try:
        conn.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)
        conn.putheader("Host", host_header)
        conn.putheader("Connection", "close")
        conn.putheader("User-Agent", "noctaya-gateway-probe")
        conn.endheaders()
        resp = conn.getresponse()
        resp.read(4096)
        return ProbeResult.READY if 200 <= resp.status < 300 else ProbeResult.NOT_READY
    except (OSError, http.client.HTTPException):
        return ProbeResult.NOT_READY
    finally:
        conn.close()


def is_disconnect(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.EPIPE, errno.ECONNRESET, errno.ECONNABORTED)


def client_gone(sock: std_socket.socket | None) -> bool:
    """True when the client closed its side (readable with EOF). Pipelined bytes are not EOF."""
    if sock is None:
        return False
    try:
        readable, _, _ = _select([sock], [], [], 0)
        if not readable:
            return False
        return sock.recv(1, std_socket.MSG_PEEK) == b""
    except OSError:
        return True
