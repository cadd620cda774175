"""Demand over a pipe: how a gateway feeds the ExternalScaler process it runs beside itself.

A single gateway runs its scaler as a child process (``python -m scaler local``) rather than in its
own gevent loop: KEDA's calls then get a core of their own and a plain-threads grpc server (about
half the CPU per call of grpc's gevent mode, see docs/benchmarks.md), and a flood of HTTP traffic
cannot delay IsActive. The gateway still owns all admission state; the child only mirrors the
latest `Demand`, one JSON line per change:

    {"q": <queued>, "f": <in flight>, "l": <lease active>}

Lines are tiny and each one carries the complete state, so a reader that falls behind or starts
late only needs the newest line; nothing accumulates.

Back up the child's stdout, one line each time a KEDA stream was told `true` (rare: activations only),
with the child's CLOCK_MONOTONIC time, which is the same clock as the gateway's on one host, and, with
mutual TLS, one line when a certificate starts being served (at start and on every reload) with its
notAfter, for the gateway's expiry gauge (the child serves no /metrics of its own):

    pushed <seconds>
    certificate <unix seconds>
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable, Mapping
from typing import BinaryIO

from scaler.demand import IDLE, Demand, DemandBroadcaster

log = logging.getLogger("noctaya.scaler.pipe")

MAX_LINE_BYTES = 256  # a well-formed line is < 60 bytes; anything longer is not from our gateway
PUSHED, CERTIFICATE = b"pushed", b"certificate"  # the words of the child's lines (see the module docstring)


def encode_demand(demand: Demand) -> bytes:
    return json.dumps({"q": demand.queued, "f": demand.in_flight, "l": demand.lease_active},
                      separators=(",", ":")).encode() + b"\n"


def decode_demand(line: bytes) -> Demand:
    """Parse one line; raises ValueError on anything that is not a well-formed demand line."""
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError("not JSON") from exc
    if not isinstance(obj, dict):
        raise ValueError("not an object")
    queued, in_flight, lease = obj.get("q"), obj.get("f"), obj.get("l")
    if type(queued) is not int or type(in_flight) is not int or type(lease) is not bool:
        raise ValueError("fields q, f (integers) and l (boolean) are required")
    return Demand(queued=queued, in_flight=in_flight, lease_active=lease)  # negative counts raise


def mirror_demand(stream: BinaryIO, broadcaster: DemandBroadcaster, on_eof: Callable[[], None]) -> threading.Thread:
    """Publish every demand line read from `stream` until it closes, then publish IDLE and call
    `on_eof` (the feeding gateway is gone: its demand must not outlive it)."""

    def run() -> None:
        try:
            while True:
                line = stream.readline(MAX_LINE_BYTES + 1)
                if not line:
                    break
                if len(line) > MAX_LINE_BYTES or not line.endswith(b"\n"):
                    log.warning("ignoring an over-long demand line")
                    # skip to the end of that line, in bounded steps
                    while line and not line.endswith(b"\n"):
                        line = stream.readline(MAX_LINE_BYTES + 1)
                    continue
                try:
                    broadcaster.publish(decode_demand(line))
                except ValueError as exc:
                    log.warning("ignoring a malformed demand line: %s", exc)
        except OSError as exc:
            log.warning("demand pipe failed: %s", exc)
        finally:
            broadcaster.publish(IDLE)
            on_eof()

    thread = threading.Thread(target=run, name="noctaya-demand-pipe", daemon=True)
    thread.start()
    return thread


class ReportWriter:
    """The child's side: ``pushed`` and ``certificate`` write one ``<word> <value>`` line each to
    ``stream``, from any thread, under one lock so lines never interleave."""

    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def pushed(self, when: float) -> None:
        """A KEDA stream was told ``true`` at ``when`` (monotonic)."""
        self._write(PUSHED, when)

    def certificate(self, not_after: float) -> None:
        """New connections are served a certificate valid until ``not_after`` (at start and on
        every reload)."""
        self._write(CERTIFICATE, not_after)

    def _write(self, word: bytes, value: float) -> None:
        line = b"%s %.6f\n" % (word, value)
        with self._lock:
            try:
                self._stream.write(line)
                self._stream.flush()
            except (OSError, ValueError):  # the gateway is gone; stdin's EOF ends this process
                pass


def read_reports(stream: BinaryIO, handlers: Mapping[bytes, Callable[[float], None]]) -> None:
    """The gateway's side: for every well-formed line until EOF call the handler of its first word
    with its value (finite and positive; anything else is skipped)."""
    while True:
        line = stream.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        word, _, raw = line.strip().partition(b" ")
        handler = handlers.get(word)
        try:
            value = float(raw)
        except ValueError:
            continue
        if handler is not None and math.isfinite(value) and value > 0:
            handler(value)
