"""HTTP/1.1 framing for the gateway, parsed in C by ``httptools`` (llhttp).

Two small push parsers: :class:`ClientParser` turns bytes from a client into request heads and
body pieces (pipelined requests queue up in order), :class:`UpstreamParser` does the same for one
backend response. Neither owns a socket: the connection and relay modules read, feed and consume,
so every read keeps its own timeout and every buffer stays bounded by one read.

Limits enforced here (the parser itself has none): request target <= ``MAX_TARGET_BYTES`` (414),
header count and total head size (431). Everything llhttp rejects - a bad request line, a header
without a colon, a NUL in a value, a bad chunk size, an HTTP/2 preface - is a :class:`BadRequest`
(400), answered by the gateway and never forwarded.

A backend's response is held to the same kind of bounds (:class:`UpstreamProtocolError`, a 502):
each head, interim (1xx) or final, within ``MAX_RESPONSE_HEAD_BYTES`` and ``MAX_RESPONSE_HEADERS``
lines, at most ``MAX_INTERIM_RESPONSES`` interim heads before the final one (each discarded once
parsed, never buffered), no 101, a status in 100-599, and RFC 9112 framing the gateway can relay:
``Transfer-Encoding`` exactly ``chunked`` or absent. llhttp itself refuses Content-Length together
with Transfer-Encoding, duplicate or non-numeric Content-Length, and a status line without three digits.
Bytes read after the end of a response are dropped, never parsed as another one.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import httptools

__all__ = [
    "BadRequest", "RequestHead", "ClientParser", "ResponseHead", "UpstreamParser", "UpstreamProtocolError",
    "HOP_BY_HOP", "MAX_TARGET_BYTES", "MAX_HEAD_BYTES", "MAX_HEADERS", "MAX_RESPONSE_HEAD_BYTES",
    "MAX_RESPONSE_HEADERS", "MAX_INTERIM_RESPONSES", "PROTOCOL_ERRORS", "response_head", "connection_tokens",
    "chunk", "LAST_CHUNK",
]

MAX_TARGET_BYTES = 8 * 1024
MAX_HEAD_BYTES = 32 * 1024  # header names + values (+ 4 bytes each for ": " and CRLF)
MAX_HEADERS = 100
# A request body's bytes in a row that are not body (chunk sizes, extensions, the trailer section):
# beyond, 431 as for a head too large. A real client's chunk framing is a few bytes per chunk.
MAX_BODY_FRAMING_BYTES = 8 * 1024
# Guard on raw bytes of a head still incomplete after a read (llhttp buffers a partial header line
# itself): the request line and header limits above, plus slack for the line ends.
_MAX_RAW_HEAD = MAX_TARGET_BYTES + MAX_HEAD_BYTES + 1024
# A backend's heads get twice a client's room (engines add their own headers), each counted alone:
# raw bytes from the status line to the blank line, and header lines.
MAX_RESPONSE_HEAD_BYTES = MAX_HEAD_BYTES * 2
MAX_RESPONSE_HEADERS = MAX_HEADERS * 2
# Interim (1xx) heads skipped before the final one. Each is dropped once parsed, so this bounds time
# and work, not memory: without it a backend could answer ``102 Processing`` forever. 100 Continue,
# 102 and 103 Early Hints are the ones in use; a handful per request is plenty.
MAX_INTERIM_RESPONSES = 16

# Headers that describe one hop, never forwarded in either direction (RFC 9110 §7.6.1).
HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"proxy-connection",
    b"te", b"trailer", b"trailers", b"transfer-encoding", b"upgrade",
})


_PLAIN_CONNECTION = frozenset({b"keep-alive", b"close"})  # names no header beyond the hop-by-hop set


# Request headers the gateway reads, sets itself, or that describe only the client's hop: never
# forwarded as they are (Authorization is forwarded or not by the caller: see gateway.routes).
_NOT_RELAYED = HOP_BY_HOP | {b"content-length"}  # the gateway frames the body for its own client
_NOT_FORWARDED = HOP_BY_HOP | {b"host", b"content-length", b"expect", b"x-forwarded-for", b"x-forwarded-proto",
                               b"x-forwarded-host", b"x-request-id", b"authorization"}


class BadRequest(Exception):
    """The client sent something that is not acceptable HTTP/1.1; ``status`` is 400, 414 or 431."""

    def __init__(self, status: int, code: str) -> None:
        super().__init__(code)
        self.status = status
        self.code = code


# Why a backend's response was refused: a fixed set (a metric's label values), never backend text.
PROTOCOL_ERRORS = (
    "malformed",  # llhttp refused it (syntax, Content-Length, chunk framing)
    "head_too_large",  # a head over MAX_RESPONSE_HEAD_BYTES or MAX_RESPONSE_HEADERS
    "too_many_interim",  # more than MAX_INTERIM_RESPONSES 1xx heads
    "switching_protocols",  # 101: the gateway never asks for an upgrade
    "invalid_status",  # a status outside 100-599, or not three digits
    "transfer_coding",  # a Transfer-Encoding other than exactly chunked (or any, in HTTP/1.0)
)


class UpstreamProtocolError(Exception):
    """The backend's response is not HTTP/1.1 the gateway can relay; ``reason`` is one of
    ``PROTOCOL_ERRORS``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _AfterTheEnd(Exception):
    """Stops llhttp at bytes that follow a complete response (see UpstreamParser.on_message_begin)."""


def connection_tokens(headers: list[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """Lower-cased tokens of every ``Connection`` header (names of extra hop-by-hop headers)."""
    tokens: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            tokens.update(t.strip().lower() for t in value.split(b",") if t.strip())
    return frozenset(tokens)


class RequestHead:
    """One parsed request line + headers, as received (names keep their case)."""

    __slots__ = ("method", "target", "version", "headers", "keep_alive", "content_length", "chunked",
                 "expect_continue", "authorization", "host", "request_id", "has_connection", "forward",
                 "forwarded_for", "content_type", "arrived")

    def __init__(self, arrived: float = 0.0) -> None:
        self.arrived = arrived  # when its first byte was parsed (monotonic): its own start, even when pipelined
        self.method = b""
        self.target = b""
        self.version = "1.1"
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = True
        self.content_length: int | None = None
        self.chunked = False
        self.expect_continue = False
        self.authorization: bytes | None = None
        self.host: bytes | None = None
        self.request_id: bytes | None = None
        self.has_connection = False  # a Connection header may name more hop-by-hop headers
        # ``Name: value`` lines to forward as they are (filtered once, while parsing).
        self.forward: list[bytes] = []
        self.forwarded_for: bytes | None = None
        self.content_type: bytes | None = None

    @property
    def has_body(self) -> bool:
        return self.chunked or bool(self.content_length)

    @property
    def path(self) -> str:
        """The target's path (no query), latin-1 decoded; the query never leaves this object."""
        return self.target.split(b"?", 1)[0].decode("latin-1")


class ClientParser:
    """Feeds client bytes to llhttp; yields ``("head", RequestHead)``, ``("body", bytes)`` and
    ``("end", None)`` events in order. Call :meth:`feed` only when :attr:`events` is empty, so at
    most one read's worth of data is ever buffered here. ``in_message`` is True from a message's first
    byte to its end, and ``started`` is when that first byte was parsed (the request deadline runs
    from there)."""

    __slots__ = ("_parser", "events", "_head", "_head_bytes", "in_head", "_error", "_header_bytes", "in_message",
                 "started", "_clock", "_pending", "_pieces", "quiet")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.in_message = False
        self.started = 0.0
        self._parser = httptools.HttpRequestParser(self)
        self.events: deque[tuple[str, Any]] = deque()
        self._head: RequestHead | None = None
        self._head_bytes = 0
        self.in_head = False
        self._error: tuple[int, str] | None = None  # (status, code) refused in a callback, raised by feed
        self._header_bytes = 0
        self._pending: list[bytes] = []  # this read's body pieces, one event at its end (see on_body)
        self._pieces = 0  # body pieces parsed so far (tells a read that brought body from one that did not)
        # Bytes of the current body read since its last body piece: chunk framing, chunk extensions and
        # the trailer section. They are work, not body, and llhttp counts none of them.
        self.quiet = 0

    def feed(self, data: bytes) -> None:
        if self.in_head:
            self._head_bytes += len(data)
        in_body = self.in_message and not self.in_head
        pieces = self._pieces
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # Upgrade/CONNECT are not proxied: the OpenAI API is plain request/response.
            raise BadRequest(400, "bad_request") from None
        except httptools.HttpParserCallbackError:
            raise BadRequest(*(self._error or (400, "bad_request"))) from None
        except httptools.HttpParserError:
            raise BadRequest(400, "bad_request") from None
        finally:
            if self._pending:
                self._flush()
        if self.in_head and self._head_bytes > _MAX_RAW_HEAD:
            raise BadRequest(431, "headers_too_large")
        if in_body and self.in_message and not self.in_head:
            # Still in the same body: a read that brought no body byte was framing or trailer. Past
            # MAX_BODY_FRAMING_BYTES of it in a row (an endless trailer field, a chunk extension
            # that never ends) the request is refused as a head would be; httptools keeps an
            # unfinished trailer field in memory, so this also bounds what it copies.
            self.quiet = self.quiet + len(data) if self._pieces == pieces else 0
            if self.quiet > MAX_BODY_FRAMING_BYTES:
                raise BadRequest(431, "headers_too_large")

    def close(self) -> None:
        """The connection is closed: drop llhttp's parser, which holds this object (its callbacks),
        and what was parsed. Without it every connection was a reference cycle, freed only by the
        cyclic GC (rare in a worker: gateway.workers.GC_THRESHOLD), each keeping its last head's
        bytes until then (tests/gateway/test_connection_cycles.py)."""
        self._parser = None
        self._head = None
        self.events.clear()
        self._pending = []

    # -- llhttp callbacks ---------------------------------------------------------------------
    def _fail(self, status: int, code: str) -> None:
        # Kept as values, and raised anew by feed: an exception object kept on the parser would hold
        # its own traceback, whose frames hold the parser: a cycle per refused request, freed only by
        # the cyclic GC (rare here, gateway.workers.GC_THRESHOLD), so every 431 kept its head's bytes.
        self._error = (status, code)
        raise BadRequest(status, code)

    def on_message_begin(self) -> None:
        self.started = self._clock()
        self.in_message = True
        self._head = RequestHead(self.started)
        self._head_bytes = 0
        self.in_head = True
        self._header_bytes = 0

    def on_url(self, url: bytes) -> None:
        head = self._head
        assert head is not None
        head.target += url
        if len(head.target) > MAX_TARGET_BYTES:
            self._fail(414, "uri_too_long")

    def on_header(self, name: bytes, value: bytes) -> None:
        head = self._head
        assert head is not None
        headers = head.headers
        headers.append((name, value))
        self._header_bytes += len(name) + len(value) + 4
        if len(headers) > MAX_HEADERS or self._header_bytes > MAX_HEAD_BYTES:
            self._fail(431, "headers_too_large")
        if not self.in_head:
            return  # a chunked body's trailer: never merged into the head (RFC 9112 §7.1.2), dropped
        lower = name.lower()
        if lower not in _NOT_FORWARDED:
            head.forward.append(name + b": " + value)
            if lower == b"content-type":
                head.content_type = value
            return
        if lower == b"content-length":
            head.content_length = int(value)  # llhttp has validated the digits
        elif lower == b"transfer-encoding":
            head.chunked = value.strip().lower().endswith(b"chunked")
        elif lower == b"expect":
            head.expect_continue = value.strip().lower() == b"100-continue"
        elif lower == b"authorization":
            head.authorization = value
        elif lower == b"host":
            head.host = value
        elif lower == b"x-request-id":
            head.request_id = value
        elif lower == b"connection" and value.lower() not in _PLAIN_CONNECTION:
            head.has_connection = True
        elif lower == b"x-forwarded-for":
            head.forwarded_for = value if head.forwarded_for is None else head.forwarded_for + b", " + value

    def on_headers_complete(self) -> None:
        head = self._head
        assert head is not None
        parser = self._parser
        head.method = parser.get_method()
        head.version = parser.get_http_version()
        head.keep_alive = parser.should_keep_alive()
        if head.chunked:
            head.content_length = None
        self.in_head = False
        self.quiet = 0
        self.events.append(("head", head))

    def on_body(self, body: bytes) -> None:
        # Collected, then one event per read (_flush): a body sent as 2-byte chunks is one piece per
        # read here, not thousands of tiny objects and events (~22 bytes of memory per byte counted).
        self._pending.append(body)
        self._pieces += 1

    def _flush(self) -> None:
        pending = self._pending
        if pending:
            self.events.append(("body", pending[0] if len(pending) == 1 else b"".join(pending)))
            pending.clear()

    def on_message_complete(self) -> None:
        if self._pending:
            self._flush()
        self.events.append(("end", None))
        self._head = None
        self.in_message = False


class ResponseHead:
    __slots__ = ("status", "reason", "headers", "keep_alive", "content_length", "chunked", "content_type",
                 "request_id", "has_connection", "kept")

    def __init__(self) -> None:
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = True
        self.content_length: int | None = None
        self.chunked = False
        self.content_type = b""
        self.request_id: bytes | None = None
        self.has_connection = False
        self.kept: list[tuple[bytes, bytes]] = []  # end-to-end headers, filtered while parsing

    @property
    def is_sse(self) -> bool:
        return b"text/event-stream" in self.content_type

    def end_to_end_headers(self) -> list[tuple[bytes, bytes]]:
        """Response headers minus hop-by-hop ones, those ``Connection`` names, and the framing
        (the gateway frames the body for its own client)."""
        if not self.has_connection:
            return list(self.kept)
        named = connection_tokens(self.headers)
        return [(n, v) for n, v in self.kept if n.lower() not in named]


class UpstreamParser:
    """Parses one backend response at a time (interim 1xx heads are counted and dropped).

    llhttp validates the whole message and frames the body; the head's header lines are read in
    one pass from the raw bytes once llhttp has accepted them, instead of one Python callback per
    header (a measurable share of the warm path). Until the final head has arrived, ``_raw`` holds
    the bytes of the head being received and nothing before it: parsed interim heads are dropped
    after every read, so a backend that keeps sending them holds at most one head here."""

    __slots__ = ("_parser", "head", "body", "complete", "_raw", "_scan", "_interim", "_error")

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self.head: ResponseHead | None = None
        self.body: list[bytes] = []
        self.complete = False
        self._raw = b""  # bytes received while the head is incomplete
        self._scan = 0  # where the next head starts in _raw (after skipped 1xx heads)
        self._interim = 0  # 1xx heads skipped before this response's final head
        self._error: str | None = None  # the reason refused in a callback, raised anew by feed

    @property
    def held(self) -> int:
        """Bytes of an incomplete head held between reads (bounded by MAX_RESPONSE_HEAD_BYTES)."""
        return len(self._raw)

    def feed(self, data: bytes) -> None:
        if self.head is None:
            self._raw += data
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, _AfterTheEnd):
                return  # the response is whole; what followed it is dropped
            raise UpstreamProtocolError(self._error or "malformed") from None
        except httptools.HttpParserUpgrade:
            raise UpstreamProtocolError("switching_protocols") from None
        except httptools.HttpParserInvalidStatusError:
            raise UpstreamProtocolError("invalid_status") from None
        except httptools.HttpParserError:
            raise UpstreamProtocolError("malformed") from None
        if self.head is None:
            self._keep_incomplete_head()

    def _keep_incomplete_head(self) -> None:
        if self._scan:  # interim heads parsed in this read: their bytes are not needed again
            self._raw = self._raw[self._scan:]
            self._scan = 0
        if len(self._raw) > MAX_RESPONSE_HEAD_BYTES:  # llhttp buffers nothing: the bound is ours to keep
            raise UpstreamProtocolError("head_too_large")

    def _fail(self, reason: str) -> None:
        """Refuse the response from inside an llhttp callback (feed raises it anew: a kept exception
        would hold the parser through its traceback, see ClientParser._fail)."""
        self._error = reason
        raise UpstreamProtocolError(reason)

    def _take_head_lines(self) -> list[bytes]:
        # llhttp has accepted the head, so it ends with CRLF CRLF (it refuses bare LF line ends and
        # obsolete line folding) and every header line has a colon.
        raw, start = self._raw, self._scan
        end = raw.find(b"\r\n\r\n", start)
        self._scan = end + 4
        # Checked per head, complete or not: one read may hold a whole head larger than the bound.
        if self._scan - start > MAX_RESPONSE_HEAD_BYTES:
            self._fail("head_too_large")
        lines = raw[start:end].split(b"\r\n")
        if len(lines) > MAX_RESPONSE_HEADERS + 1:  # the status line and the header lines
            self._fail("head_too_large")
        return lines

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        lines = self._take_head_lines()
        if not 100 <= status <= 599:  # llhttp takes any three digits (RFC 9110 §15: 100-599)
            self._fail("invalid_status")
        if status < 200:
            self._skip_interim(status)
            return
        self.head = self._final_head(status, lines)
        self._raw = b""
        self._scan = 0

    def _skip_interim(self, status: int) -> None:
        if status == 101:  # the gateway never sends Upgrade: the connection would stop being HTTP
            self._fail("switching_protocols")
        self._interim += 1
        if self._interim > MAX_INTERIM_RESPONSES:
            self._fail("too_many_interim")

    def _final_head(self, status: int, lines: list[bytes]) -> ResponseHead:
        head = ResponseHead()
        head.status = status
        head.keep_alive = self._parser.should_keep_alive()
        parts = lines[0].split(b" ", 2)
        head.reason = parts[2] if len(parts) > 2 else b""
        headers = head.headers
        kept = head.kept
        codings: list[bytes] = []
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            value = value.strip(b" \t")
            headers.append((name, value))
            lower = name.lower()
            if lower not in _NOT_RELAYED:
                kept.append((name, value))
                if lower == b"content-type":
                    head.content_type = value.lower()
                elif lower == b"x-request-id":
                    head.request_id = value
            elif lower == b"content-length":
                head.content_length = int(value)  # llhttp has refused a second one and non-digits
            elif lower == b"transfer-encoding":
                codings.append(value)
            elif lower == b"connection" and value.lower() not in _PLAIN_CONNECTION:
                head.has_connection = True
        if codings:
            self._check_transfer_coding(codings)
            head.chunked = True  # llhttp has refused Content-Length alongside Transfer-Encoding
        return head

    def _check_transfer_coding(self, values: list[bytes]) -> None:
        """RFC 9112 §6.1: the gateway decodes chunked and nothing else, and it drops the backend's
        Transfer-Encoding (hop-by-hop), so any other coding would reach the client as if it were the
        content itself. chunked twice is forbidden, and Transfer-Encoding in an HTTP/1.0 message
        means faulty framing."""
        tokens = [t.strip().lower() for v in values for t in v.split(b",")]
        # Empty list elements are allowed (RFC 9110 §5.6.1) before chunked, not after it: llhttp
        # frames ``chunked ,`` as read-until-close, so it is refused rather than relayed as chunked.
        if tokens[-1] != b"chunked" or any(tokens[:-1]) or self._parser.get_http_version() == "1.0":
            self._fail("transfer_coding")

    def on_message_begin(self) -> None:
        if self.complete:
            # Bytes after the end of the response to the one request sent: never read as a response
            # of their own (RFC 9112 §6.3), nor as more body (they would reach the client after the
            # Content-Length it was given, as a response it never asked for). Dropped, and the
            # connection is not reused.
            assert self.head is not None
            self.head.keep_alive = False
            raise _AfterTheEnd

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.head is not None:
            self.complete = True

    def reset(self) -> None:
        """Ready for the next response on the same connection (llhttp keeps its own state)."""
        self.head = None
        self.body = []
        self.complete = False
        self._raw = b""
        self._scan = 0
        self._interim = 0
        self._error = None

    def close(self) -> None:
        """Its connection is closed: drop llhttp's parser (it holds this object: a reference cycle
        otherwise, see ClientParser.close) and what was parsed."""
        self._parser = None
        self.head = None
        self.body = []
        self._raw = b""

    def take_body(self) -> list[bytes]:
        body, self.body = self.body, []
        return body


_REASONS = {
    100: b"Continue", 200: b"OK", 204: b"No Content", 400: b"Bad Request", 401: b"Unauthorized",
    404: b"Not Found", 408: b"Request Timeout", 413: b"Payload Too Large", 414: b"URI Too Long", 429: b"Too Many Requests",
    431: b"Request Header Fields Too Large", 499: b"Client Closed Request", 500: b"Internal Server Error",
    502: b"Bad Gateway", 503: b"Service Unavailable", 504: b"Gateway Timeout",
}


def chunk(data: bytes) -> bytes:
    """One piece of a ``Transfer-Encoding: chunked`` body (never the empty last chunk)."""
    return b"%x\r\n%s\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"


def response_head(status: int, headers: list[tuple[bytes, bytes]], reason: bytes | None = None,
                  version: bytes = b"HTTP/1.1") -> bytes:
    """Serialise a status line and headers (ending with the blank line)."""
    lines = [b"%s %d %s" % (version, status, reason or _REASONS.get(status, b"Unknown"))]
    lines += [name + b": " + value for name, value in headers]
    lines.append(b"\r\n")
    return b"\r\n".join(lines)
