"""Bounded streaming of one HTTP body into a file: never more than the size declared for it, and
never slower than a minimum rate for long.

A hub or registry is input from the network. Without bounds, a file listed at 4 KiB can fill the
cache volume before any size check runs, and a peer that trickles one byte every few seconds holds
the revision's lock until the Job's deadline. So, for every chunk:

- the chunk is checked *before* it is written: the file never grows past its declared size;
- the bytes that arrived in the last ``stall_window`` seconds are compared with
  ``min_rate * stall_window``: fewer is a stall (a rate judged over a window, not a deadline for
  the whole file, so a large file on a healthy link is never cut off);
- each socket read waits at most ``read_timeout`` seconds, so a silent peer cannot block a read
  forever (``read1``: one read returns what has arrived, not a full chunk, so the checks run while a
  trickle arrives).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import requests
import urllib3.exceptions

CHUNK = 1 << 20
# What a read that waited read_timeout raises, from requests, urllib3 or the socket itself.
READ_TIMEOUTS = (requests.exceptions.ReadTimeout, urllib3.exceptions.ReadTimeoutError, TimeoutError)


@dataclass(frozen=True)
class Limits:
    """How slow a transfer may be before it is abandoned (the Job's ``--min-rate``, ``--stall-window``
    and ``--read-timeout``)."""

    min_rate: float = 1024.0  # bytes per second, averaged over stall_window
    stall_window: float = 60.0  # seconds
    read_timeout: float = 60.0  # seconds one socket read may wait for any byte
    connect_timeout: float = 30.0

    @property
    def timeout(self) -> tuple[float, float]:
        """``requests``' (connect, read) timeout."""
        return (self.connect_timeout, self.read_timeout)


class Sink(Protocol):
    """Where a body is written: a file, or one that also hashes what it is given."""

    def write(self, data: bytes, /) -> int: ...


class TransferError(Exception):
    """A transfer refused or abandoned; the message names the file, never a URL's credentials."""


class Oversize(TransferError):
    """The peer sent or announced more bytes than were declared."""


class Stall(TransferError):
    """Fewer than ``min_rate`` bytes per second arrived over the stall window, or a read timed out."""


class RateGuard:
    """The bytes that arrived in the last ``window`` seconds, judged against ``min_rate``."""

    def __init__(self, limits: Limits, name: str) -> None:
        self.limits, self.name = limits, name
        self._now = time.monotonic
        self.started = self._now()
        self.total = 0
        self._samples: deque[tuple[float, int]] = deque([(self.started, 0)])

    def add(self, n: int) -> None:
        """Count ``n`` bytes that arrived now; raises Stall when the window's rate is too low."""
        now = self._now()
        self.total += n
        samples = self._samples
        # Every other sample at least 1/64 of a window apart (the newest moves forward until then): a
        # peer that sends many tiny reads cannot grow the deque past ~128 samples a window, and every
        # sample stays an exact (time, total) pair.
        if len(samples) >= 2 and now - samples[-2][0] < self.limits.stall_window / 64:
            samples[-1] = (now, self.total)
        else:
            samples.append((now, self.total))
        horizon = now - self.limits.stall_window
        # Keep one sample at or before the horizon: the reference the window's bytes are counted from.
        while len(self._samples) > 1 and self._samples[1][0] <= horizon:
            self._samples.popleft()
        self.check(now)

    def check(self, now: float | None = None) -> None:
        now = self._now() if now is None else now
        window = self.limits.stall_window
        if now - self.started < window:
            return  # not judged before one whole window has passed (a connection opening, a slow start)
        _, ref_bytes = self._samples[0]
        arrived = self.total - ref_bytes
        if arrived < self.limits.min_rate * window:
            raise Stall(f"{self.name}: stalled: {arrived} bytes in the last {window:g} s, below the minimum rate of "
                        f"{self.limits.min_rate:g} bytes/s (--min-rate over --stall-window)")


def announced_size(response: requests.Response) -> int | None:
    """The body's length as the response announces it (Content-Length), or None."""
    value = response.headers.get("Content-Length", "")
    return int(value) if value.isdigit() else None


def stream_into(response: requests.Response, out: Sink, limit: int, limits: Limits, name: str,
                already: int = 0) -> int:
    """Copy ``response``'s body into ``out``, which holds ``already`` bytes of a file declared at
    ``limit`` bytes; returns the bytes now in the file. Raises Oversize before a chunk would take the
    file past ``limit``, Stall when the rate stays below the minimum (a read timeout is one)."""
    announced = announced_size(response)
    if announced is not None and already + announced > limit:
        raise Oversize(f"{name}: the server announces {already + announced} bytes, {limit} bytes were declared: "
                       "refused")
    guard = RateGuard(limits, name)
    size = already
    try:
        # decode_content: a server may gzip a text file despite "Accept-Encoding: identity"; the
        # declared size and hash are the file's, so the decoded bytes are what is counted and written.
        while chunk := response.raw.read1(CHUNK, decode_content=True):
            if size + len(chunk) > limit:
                raise Oversize(f"{name}: the server sent more than the {limit} bytes declared (at least "
                               f"{size + len(chunk)}): refused")
            out.write(chunk)
            size += len(chunk)
            guard.add(len(chunk))
    except READ_TIMEOUTS as exc:
        raise Stall(f"{name}: stalled: no byte for {limits.read_timeout:g} s (--read-timeout)") from exc
    return size
