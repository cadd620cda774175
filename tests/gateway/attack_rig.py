"""The attack generator's player (issue 38): attack shapes turned into wire bytes, played on raw sockets
against a running gateway while a keyed user of another model sends normal requests, and what that
cost measured. Shared by tests/gateway/test_attack_generator.py (a gateway on a thread of the test
process, hypothesis drawing the shapes) and bench/attacks.py (``python -m gateway`` in a process of
its own, heavy fixed shapes for seconds).

A shape is a list of ``Plan``: one per attacking connection, with the bytes it sends at once, a piece
it then sends again and again until the gateway answers (a trailer or extension that never ends),
whether it half-closes, and whether it goes to the public port or to KEDA's scaler port (h2).
``play`` drives every connection from one thread with a selector, so a hundred attacking connections
cost the test one thread, not a hundred, and the CPU the oracle measures is the gateway's own.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hpack import Encoder
from hyperframe.frame import (
    DataFrame,
    Frame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from tests.gateway.abuse_harness import Reader, connect, request_bytes

__all__ = ["Plan", "Outcome", "KeyedUser", "IsActivePoller", "PeakRSS", "play", "source", "chunked_plans",
           "pipeline_plans", "header_plans", "multipart_plans", "h2_plans", "idle_plans", "H2_KINDS",
           "chat_body", "pct"]

KiB = 1024
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
H2_KINDS = ("ping", "settings", "window_update", "headers_rst", "empty_data")
CHAT = "/v1/chat/completions"
TRANSCRIBE = "/v1/audio/transcriptions"
# One never-ending connection stops after this much: far past every framing bound the gateway has
# (8 KiB), small enough that the attacker's own sending stays a fraction of the run's CPU.
ENDLESS_CAP = 1024 * KiB
ENDLESS_PIECE = b"a" * 4096


@dataclass
class Plan:
    """One attacking connection. ``port``: "public" or "scaler"; ``source``: the 127.0.0.x it binds."""

    source: str
    first: bytes
    endless: bytes = b""
    half_close: bool = False
    port: str = "public"


@dataclass
class _Conn:
    plan: Plan
    sock: socket.socket
    outbox: memoryview
    sent: int = 0
    received: bytes = b""
    closed: bool = False
    shut: bool = False


@dataclass
class Outcome:
    """What the attack's connections saw: bytes sent, the first status line each got (HTTP/1.1),
    how many the gateway closed, how many could not even connect."""

    connections: int = 0
    sent: int = 0
    max_sent: int = 0
    statuses: list[int] = field(default_factory=list)
    closed_by_gateway: int = 0
    refused: int = 0


def source(i: int, sources: int) -> str:
    """The i-th connection's client address among ``sources`` of them (127.0.5.x: the whole 127/8 is
    loopback, and no other test of the suite binds this /24)."""
    return f"127.0.5.{2 + i % max(1, sources)}"


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


# -- shapes into bytes ---------------------------------------------------------------------------------
def chat_body(model: str, pad: int = 0) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "pad": "x" * pad}).encode()


def _chunked(body: bytes, sizes: Sequence[int], ext: bytes) -> bytes:
    """``body`` as chunks of ``sizes`` in turn (cycled), each with the extension ``ext``."""
    out, at, i = [], 0, 0
    while at < len(body):
        size = sizes[i % len(sizes)]
        out.append(b"%x%s\r\n%s\r\n" % (min(size, len(body) - at), ext, body[at:at + size]))
        at, i = at + size, i + 1
    return b"".join(out)


def chunked_plans(model: str, sizes: Sequence[int], body_bytes: int, ext_len: int, trailer_len: int,
                  endless: str, connections: int, sources: int) -> list[Plan]:
    """A chunked chat completion: chunks of ``sizes`` (cycled) carrying ``body_bytes`` of JSON, each
    chunk with an extension of ``ext_len``, a trailer field of ``trailer_len``; ``endless``: "" or the
    part that never ends ("extension": the first chunk's; "trailer": a trailer field's value)."""
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()
    ext = b";e=" + b"x" * ext_len if ext_len else b""
    body = chat_body(model, max(0, body_bytes - 80))
    if endless == "extension":
        first, piece = head + b"1;e=", ENDLESS_PIECE
    elif endless == "trailer":
        first, piece = head + _chunked(body, sizes, ext) + b"0\r\nX-T: ", ENDLESS_PIECE
    else:
        trailer = b"X-T: " + b"t" * trailer_len + b"\r\n" if trailer_len else b""
        first, piece = head + _chunked(body, sizes, ext) + b"0\r\n" + trailer + b"\r\n", b""
    return [Plan(source(i, sources), first, piece) for i in range(connections)]


def pipeline_plans(model: str, depth: int, post: bool, connections: int, sources: int) -> list[Plan]:
    """``depth`` requests in one send on each connection: small chat completions or GET /v1/models."""
    one = request_bytes("POST", CHAT, chat_body(model)) if post else request_bytes("GET", "/v1/models")
    return [Plan(source(i, sources), one * depth) for i in range(connections)]


def header_plans(model: str, count: int, size: int, connections: int, sources: int) -> list[Plan]:
    """A chat completion with ``count`` extra header fields of ``size`` bytes each (past the gateway's
    100 fields / 32 KiB it is a 431: the work to get there is the point)."""
    headers = {f"X-A{n}": "v" * size for n in range(count)}
    one = request_bytes("POST", CHAT, chat_body(model), headers=headers)
    return [Plan(source(i, sources), one) for i in range(connections)]


def multipart_plans(model: str, parts: int, part_bytes: int, model_last: bool, connections: int,
                    sources: int) -> list[Plan]:
    """An upload of ``parts`` form parts of ``part_bytes`` each, the ``model`` field last (every part
    scanned before the route is known) or missing."""
    filler = b"".join(b'--b\r\nContent-Disposition: form-data; name="f%d"\r\n\r\n%s\r\n' % (n, b"x" * part_bytes)
                      for n in range(parts))
    field_ = b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\n' + model.encode() + b"\r\n"
    body = filler + (field_ if model_last else b"") + b"--b--\r\n"
    one = request_bytes("POST", TRANSCRIBE, body, headers={"Content-Type": "multipart/form-data; boundary=b"})
    return [Plan(source(i, sources), one) for i in range(connections)]


def _h2_frames(kind: str, count: int, encoder: Encoder, next_stream: list[int]) -> list[Frame]:
    """``count`` frames (or frame pairs) of one kind; streams opened from ``next_stream``."""
    frames: list[Frame] = []
    if kind == "ping":
        frames = [PingFrame(0, opaque_data=b"12345678") for _ in range(count)]
    elif kind == "settings":
        frames = [SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 65535}) for _ in range(count)]
    elif kind == "window_update":
        frames = [WindowUpdateFrame(0, window_increment=1) for _ in range(count)]
    elif kind in ("headers_rst", "empty_data"):
        block = encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", "/externalscaler.ExternalScaler/IsActive"),
                                (":authority", "scaler"), ("content-type", "application/grpc"), ("te", "trailers")])
        for _ in range(count if kind == "headers_rst" else 1):
            stream = next_stream[0]
            next_stream[0] += 2
            headers = HeadersFrame(stream, data=block)
            headers.flags.add("END_HEADERS")
            frames.append(headers)
            if kind == "headers_rst":
                frames.append(RstStreamFrame(stream, error_code=8))  # CANCEL
            else:
                frames += [DataFrame(stream, data=b"") for _ in range(count)]
    return frames


def h2_plans(sequence: Sequence[tuple[str, int]], connections: int) -> list[Plan]:
    """HTTP/2 to the scaler port: the preface and SETTINGS a client owes, then ``sequence`` of
    (frame kind, count) in order."""
    plans = []
    for _ in range(connections):
        encoder, next_stream = Encoder(), [1]
        frames: list[Frame] = [SettingsFrame(0)]
        for kind, count in sequence:
            frames += _h2_frames(kind, count, encoder, next_stream)
        plans.append(Plan("127.0.0.1", PREFACE + b"".join(f.serialize() for f in frames), port="scaler"))
    return plans


def idle_plans(model: str, idle: int, half_open: int, partial_head: int, partial_body: int,
               sources: int) -> list[Plan]:
    """Connections that hold a slot and do nothing more: connected and silent; a head cut short then
    half-closed (FIN); a head never finished; a body promised (Content-Length) and barely begun."""
    partial = f"POST {CHAT} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n".encode()
    body = chat_body(model)
    promised = request_bytes("POST", CHAT, None, headers={"Content-Length": str(len(body) + 4096)}) + body[:10]
    kinds = [(b"", False)] * idle + [(partial, True)] * half_open + [(partial, False)] * partial_head
    kinds += [(promised, False)] * partial_body
    return [Plan(source(i, sources), first, half_close=half) for i, (first, half) in enumerate(kinds)]


# -- playing them -----------------------------------------------------------------------------------------
def _open(plan: Plan, ports: dict[str, int]) -> socket.socket | None:
    try:
        sock = connect(ports[plan.port], plan.source, timeout=5)
    except OSError:
        return None
    sock.setblocking(False)
    return sock


def _step_write(conn: _Conn) -> None:
    """Send what the connection has to send; refill a never-ending piece until answered or capped."""
    if not conn.outbox and conn.plan.endless and not conn.received and conn.sent < ENDLESS_CAP:
        conn.outbox = memoryview(conn.plan.endless)
    if conn.outbox:
        try:
            n = conn.sock.send(conn.outbox)
        except BlockingIOError:
            return
        except OSError:
            conn.closed = True
            return
        conn.sent += n
        conn.outbox = conn.outbox[n:]
    if not conn.outbox and conn.plan.half_close and not conn.shut:
        conn.shut = True
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            conn.closed = True


def _step_read(conn: _Conn) -> None:
    try:
        data = conn.sock.recv(65536)
    except BlockingIOError:
        return
    except OSError:
        data = b""
    if not data:
        conn.closed = True
    elif len(conn.received) < 4096:  # enough for the first status line; the rest is not kept
        conn.received += data


def _nothing_to_send(conn: _Conn) -> bool:
    endless_left = conn.plan.endless and not conn.received and conn.sent < ENDLESS_CAP
    return not conn.outbox and not endless_left and (conn.shut or not conn.plan.half_close)


def play(plans: Sequence[Plan], ports: dict[str, int], seconds: float) -> Outcome:
    """Open every plan's connection, send, keep sending the never-ending ones, read what comes back,
    for ``seconds`` (wall: how long the attack lasts, never asserted); then close them all."""
    outcome = Outcome(connections=len(plans))
    conns: list[_Conn] = []
    for plan in plans:
        sock = _open(plan, ports)
        if sock is None:
            outcome.refused += 1
        else:
            conns.append(_Conn(plan, sock, memoryview(plan.first)))
    selector = selectors.DefaultSelector()
    for conn in conns:
        selector.register(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline and any(not c.closed for c in conns):
            for key, events in selector.select(timeout=0.02):
                conn = key.data
                if events & selectors.EVENT_READ:
                    _step_read(conn)
                if events & selectors.EVENT_WRITE and not conn.closed:
                    _step_write(conn)
                if conn.closed:
                    selector.unregister(conn.sock)
                elif key.events & selectors.EVENT_WRITE and _nothing_to_send(conn):
                    selector.modify(conn.sock, selectors.EVENT_READ, conn)  # else EVENT_WRITE would spin
    finally:
        selector.close()
        for conn in conns:
            conn.sock.close()
    for conn in conns:
        outcome.sent += conn.sent
        outcome.max_sent = max(outcome.max_sent, conn.sent)
        outcome.closed_by_gateway += conn.closed
        if conn.received.startswith(b"HTTP/1."):
            outcome.statuses.append(int(conn.received.split(b" ", 2)[1]))
    return outcome


# -- the users who are not attacking ----------------------------------------------------------------------
class KeyedUser:
    """A client of another model (or, on a per-model gateway, another client of the same one) sending a
    small chat completion every ``interval`` on one keep-alive connection from 127.0.0.1, in a thread:
    each answer's status and latency. A connection the gateway closes counts as status 0 and is
    opened again."""

    def __init__(self, port: int, model: str, key: str | None, interval: float = 0.02) -> None:
        self.port, self.interval = port, interval
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.request = request_bytes("POST", CHAT, chat_body(model), headers=headers)
        self.statuses: list[int] = []
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="keyed-user", daemon=True)

    def _run(self) -> None:
        sock: socket.socket | None = None
        reader: Reader | None = None
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                if sock is None:
                    sock = connect(self.port, "127.0.0.1", timeout=30)
                    reader = Reader(sock)
                sock.sendall(self.request)
                assert reader is not None
                response = reader.response()
                status = response.status if response is not None else 0
            except (OSError, AssertionError):
                status = 0
            self.latencies.append(time.monotonic() - started)
            self.statuses.append(status)
            if status != 200 and sock is not None:
                sock.close()
                sock = None
            self._stop.wait(self.interval)
        if sock is not None:
            sock.close()

    def __enter__(self) -> KeyedUser:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    @property
    def refused(self) -> list[int]:
        return [s for s in self.statuses if s != 200]

    def p(self, q: float) -> float:
        return pct(self.latencies, q)


class IsActivePoller:
    """KEDA's IsActive on a real grpc channel every ``interval``: latencies, and calls that failed."""

    def __init__(self, call: Callable[[], object], interval: float = 0.05) -> None:
        self.call, self.interval = call, interval
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="is-active", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.call()
            except Exception as exc:  # noqa: BLE001 - a failed call is a finding, recorded
                self.errors.append(type(exc).__name__)
            self.latencies.append(time.monotonic() - started)
            self._stop.wait(self.interval)

    def __enter__(self) -> IsActivePoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    @property
    def longest(self) -> float:
        return max(self.latencies, default=0.0)


def vmrss(pid: int | None = None) -> int:
    try:
        with open(f"/proc/{pid or 'self'}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * KiB
    except OSError:
        pass
    return 0


class PeakRSS:
    """The peak of ``read()`` (VmRSS of this process by default), sampled every ``interval`` in a thread."""

    def __init__(self, read: Callable[[], int] = vmrss, interval: float = 0.005) -> None:
        self.read, self.interval = read, interval
        self.start = read()
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.read())
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.peak = max(self.peak, self.read())

    @property
    def growth(self) -> int:
        return max(0, self.peak - self.start)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def cpu_seconds() -> float:
    """This process's CPU time so far (user + system, every thread)."""
    return sum(os.times()[:2])
