"""Free TCP ports for servers a test starts in another process (or hands a port number to).

Asking the kernel for port 0 and closing the socket races twice once the suite runs in several
pytest-xdist workers: another worker's bind(0) may be handed the same port, and - more often - any
outgoing connection of any worker may take it as its local port, since bind(0) and connect() draw
from the same ephemeral range (CI saw the gateway's gRPC scaler refused 127.0.0.1:46069 that way).
So ports come from below the ephemeral range, which connect() never uses, each worker from its own
slice, in turn, and only after a bind shows nobody holds them.
"""

from __future__ import annotations

import itertools
import os
import random
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

# Outside every usual ephemeral range (Linux 32768-60999, IANA 49152-65535) and above the ports
# well-known services and most developers' own servers use.
LOWEST = 20000
SPAN = 12000


def ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def worker_slice() -> range:
    """This process's ports: the xdist worker's own slice, or the whole span outside xdist."""
    low, high = ephemeral_range()
    start, end = LOWEST, LOWEST + SPAN
    if low < end and high >= start:  # a machine whose ephemeral range covers ours: pick above it
        start, end = high + 1, min(65536, high + 1 + SPAN)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or count <= 1:
        return range(start, end)
    width = (end - start) // count
    index = int(worker[2:]) % count
    return range(start + index * width, start + (index + 1) * width)


def _candidates(ports: range) -> Iterator[int]:
    # A random start keeps two pytest processes outside xdist (the e2e suite's two) apart.
    first = random.randrange(len(ports)) if ports else 0
    return itertools.cycle([*ports[first:], *ports[:first]])


_lock = threading.Lock()
_slice: range | None = None  # read once: /proc and the environment do not change under a process
_next: Iterator[int] | None = None


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` nobody holds now, not handed out before by this process (until it wraps)."""
    global _next, _slice
    with _lock:
        if _slice is None or _next is None:
            _slice = worker_slice()
            _next = _candidates(_slice)
        for _ in range(len(_slice)):
            port = next(_next)
            with socket.socket() as probe:
                try:
                    probe.bind((host, port))
                except OSError:
                    continue
                return port
        raise RuntimeError(f"no free port on {host} in {_slice}")
