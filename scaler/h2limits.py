"""What one HTTP/2 client may make the scaler do without asking it for anything (issue 38).

A frame that carries no request still costs the loop work: h2 parses it, and a PING or SETTINGS
is answered. A client that sends them as fast as it can (a PING or SETTINGS flood), or that opens
streams and resets them at once (rapid reset, CVE-2023-44487), would keep the loop busy with them;
the kubelet's probes and KEDA's calls on the same loop would then wait. So, as nginx, Envoy and Go's
net/http do, such frames are counted per connection before h2 sees them, and a connection beyond
its allowance gets GOAWAY ENHANCE_YOUR_CALM and is closed.

:class:`FrameMeter` reads the frame headers of what a client sent (9 bytes each, no payload is
decoded) and cuts the input at frame boundaries into pieces of at most ``PIECE_FRAMES`` frames, so
the reader can hand h2 one piece at a time, flush h2's answers and give the loop back between them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

__all__ = ["Calm", "FrameMeter", "TokenBucket"]

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types (RFC 9113 section 6) and flags.
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS = 0, 1, 2, 3, 4
PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 6, 7, 8, 9
END_STREAM, END_HEADERS = 0x1, 0x4

# The allowance of frames without a request (PING, SETTINGS, PRIORITY, WINDOW_UPDATE, RST_STREAM of
# a stream not yet answered, empty DATA/HEADERS/CONTINUATION, unknown types). KEDA (grpc-go) keeps
# one connection and sends a handful when it connects (SETTINGS, its ACK, a WINDOW_UPDATE); after
# that only along with its requests and what the server sends: a BDP-estimation PING and a
# WINDOW_UPDATE now and then per DATA it receives; grpc-core (Python's grpc) also sends a stream
# WINDOW_UPDATE or two with each request. Hence a bucket of CONTROL_BURST that refills at
# CONTROL_RATE a second and by CONTROL_CREDIT per stream the client opens and per frame the server
# sends, kept beyond the burst (Envoy's "frames per stream opened / per DATA frame sent"): a client
# that polls many ScaledObjects earns the allowance its calls bring, so the frames that ask for
# nothing stay a fixed multiple of the work asked for, and a client that asks for nothing has 100
# frames and then 5 a second, far below a flood's thousands.
CONTROL_BURST = 100
CONTROL_RATE = 5.0
CONTROL_CREDIT = 2
# Streams the client reset before the server answered them (rapid reset). KEDA resets a stream it
# was answered on when a ScaledObject goes away (not counted: the stream cost it a whole request);
# one not yet answered only when its own deadline passed first, which a working scaler never lets
# happen more than a few times in a row.
RESET_BURST = 50
RESET_RATE = 1.0
# A header block (HEADERS and its CONTINUATIONs) larger than this is not buffered: compressed
# headers are no larger than the decoded list h2 is told to accept (MAX_HEADER_LIST_BYTES) plus
# HPACK's few bytes of framing per field.
MAX_HEADER_BLOCK_BYTES = 20 * 1024
# Frames handed to h2 at once: a PING costs h2 ~20 us to parse and answer, so a piece stays well
# inside a 2 ms time slice and its answers (17 bytes per PING) are a few hundred bytes to flush.
PIECE_FRAMES = 16
_HEADER = 9


class Calm(Exception):
    """The client exceeded an allowance: answer GOAWAY ENHANCE_YOUR_CALM and close."""


class TokenBucket:
    """Tokens refilled at ``rate`` a second (monotonic clock) up to ``capacity``, and by ``credit``
    beyond it: what a client earns by asking for work comes in bursts (a flip of the demand pushes on
    every stream at once, and each push may draw a WINDOW_UPDATE), so capping it would lose it."""

    __slots__ = ("capacity", "rate", "tokens", "_at", "_clock")

    def __init__(self, capacity: float, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.rate = rate
        self.tokens = float(capacity)
        self._clock = clock
        self._at = clock()

    def take(self) -> bool:
        """Spend one token; False when none is left."""
        now = self._clock()
        if self.tokens < self.capacity:
            self.tokens = min(self.capacity, self.tokens + (now - self._at) * self.rate)
        self._at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True

    def credit(self, tokens: float) -> None:
        self.tokens += tokens


class FrameMeter:
    """Counts one connection's frames as they arrive and cuts its input at frame boundaries.

    ``answered(stream_id)``: whether the server has already answered that stream (its RST_STREAM
    then costs nothing: the client paid a whole request to open it).
    """

    def __init__(self, answered: Callable[[int], bool]) -> None:
        self._answered = answered
        self.control = TokenBucket(CONTROL_BURST, CONTROL_RATE)
        self.resets = TokenBucket(RESET_BURST, RESET_RATE)
        self.frames = 0  # frames seen (a client's SETTINGS included)
        self.settled = False  # the preface and the client's first SETTINGS have arrived
        self._preface = len(PREFACE)  # preface bytes still to skip
        self._header = bytearray()  # a frame header split across reads
        self._payload = 0  # payload bytes of the current frame still to come
        self._block = -1  # bytes of an unfinished header block, -1: none open
        self._last_stream = 0  # the highest stream the client opened

    def pieces(self, data: bytes) -> Iterator[bytes]:
        """``data`` in order, cut after every ``PIECE_FRAMES`` frames; raises Calm before the piece
        holding the first frame beyond an allowance."""
        start = pos = 0
        if self._preface:
            pos = min(self._preface, len(data))
            self._preface -= pos
        done = 0
        while pos < len(data):
            if self._payload:
                step = min(self._payload, len(data) - pos)
                pos += step
                self._payload -= step
                done += not self._payload
            else:
                step = min(_HEADER - len(self._header), len(data) - pos)
                self._header += data[pos:pos + step]
                pos += step
                if len(self._header) < _HEADER:
                    break
                self._payload = self._frame(bytes(self._header))
                self._header.clear()
                done += not self._payload
            if done >= PIECE_FRAMES:
                yield data[start:pos]
                start, done = pos, 0
        if start < len(data):
            yield data[start:]

    def _frame(self, header: bytes) -> int:
        """Count one frame by its header; its payload length."""
        length = int.from_bytes(header[:3], "big")
        kind, flags = header[3], header[4]
        stream_id = int.from_bytes(header[5:9], "big") & 0x7FFFFFFF
        self.frames += 1
        if kind == SETTINGS and not self.settled:
            self.settled = True  # the client's half of the handshake (its ACK of ours counts)
        elif _costs_without_request(kind, flags, length):
            self._spend(self.control, "control frames")
        elif kind == RST_STREAM and not self._answered(stream_id):
            self._spend(self.control, "control frames")
            self._spend(self.resets, "streams reset before an answer")
        elif kind == HEADERS and stream_id > self._last_stream:  # a new request (not its trailers)
            self._last_stream = stream_id
            self.control.credit(CONTROL_CREDIT)
        self._count_block(kind, flags, length)
        return length

    def _count_block(self, kind: int, flags: int, length: int) -> None:
        if kind == HEADERS:
            self._block = 0
        elif kind != CONTINUATION:
            return
        if self._block >= 0:
            self._block += length
            if self._block > MAX_HEADER_BLOCK_BYTES:
                raise Calm(f"a header block larger than {MAX_HEADER_BLOCK_BYTES} bytes")
        if flags & END_HEADERS:
            self._block = -1

    @staticmethod
    def _spend(bucket: TokenBucket, what: str) -> None:
        if not bucket.take():
            raise Calm(f"too many {what}")


def _costs_without_request(kind: int, flags: int, length: int) -> bool:
    """Work for the server that asks it for nothing (RST_STREAM is judged by its stream)."""
    if kind in (PING, SETTINGS, PRIORITY, WINDOW_UPDATE) or kind > CONTINUATION:
        return True
    if kind == DATA:
        return length == 0 and not flags & END_STREAM  # an empty DATA that ends the request is one
    return kind in (HEADERS, CONTINUATION) and length == 0
