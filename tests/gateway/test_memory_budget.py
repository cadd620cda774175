"""Held request bodies are bounded by the gateway container's memory limit, as a real process: a flood
of large cold bodies never takes `python -m gateway` (supervisor, worker, scaler child) over the limit,
not while they are held and not when the backend wakes and every held body is forwarded at once; the
overflow gets 429 `queue_full` (held bytes) or `upload_bytes_full` (bytes still arriving, a bound of their
own) and an oversized body 413, all JSON."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest

from gateway.cgroup import HELD_BODY_SHARE
from tests.gateway.attack_rig import PeakRSS
from tests.gateway.conftest import wait_for
from tests.gateway.fakebackend import FakeBackend
from tests.gateway.test_scale import Gateway, children, request_bytes, rss_kib
from tests.ports import free_port

pytestmark = pytest.mark.timeout(180)

LIMIT = 256 * 1024 * 1024  # the container's memory.max, as the cgroup says it
BODY_BYTES = 4 * 1024 * 1024
FLOOD = 40  # 160 MiB of bodies against a 64 MiB budget
BUDGET = int(LIMIT * HELD_BODY_SHARE)


def cold_request(size: int) -> bytes:
    pad = b"x" * (size - 60)
    return request_bytes(b'{"model":"m","messages":[{"role":"user","content":"' + pad + b'"}]}')


def exchange(port: int, request: bytes, out: list[tuple[int, bytes]]) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        try:
            sock.sendall(request)
        except OSError:
            pass  # refused early (413/429 from the headers) and closed while we were still sending
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply) < reply.index(b"\r\n\r\n") + 4 + _length(reply):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    out.append((int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1") else 0, reply))


def _length(reply: bytes) -> int:
    head = reply[: reply.index(b"\r\n\r\n")].decode("latin-1").lower()
    for line in head.split("\r\n"):
        if line.startswith("content-length:"):
            return int(line.split(":", 1)[1])
    return 0


def body_json(reply: bytes) -> dict:
    return json.loads(reply[reply.index(b"\r\n\r\n") + 4:])


def tree_rss(pid: int) -> int:
    """Bytes of RSS of ``pid`` and its children (one that ends while read counts nothing)."""
    total = 0
    for one in [pid, *children(pid)]:
        try:
            total += rss_kib(one) * 1024
        except (OSError, RuntimeError):
            pass
    return total


def test_a_flood_of_large_cold_bodies_stays_under_the_memory_limit(tmp_path: Path) -> None:
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text(f"{LIMIT}\n")
    (cgroup / "cpu.max").write_text("max 100000\n")
    backend_port = free_port()
    # One address sends the whole flood: no per-address upload bound here (that is test_uploads.py's),
    # so bodies still arriving are bounded by the worker's upload bound alone.
    gw = Gateway(backend_port, NOCTAYA_CGROUP_ROOT=str(cgroup), NOCTAYA_MAX_QUEUE="100",
                 NOCTAYA_ACTIVATION_TIMEOUT_SECONDS="120", NOCTAYA_MAX_UPLOAD_BYTES_PER_ADDRESS="0")
    backend = FakeBackend(port=backend_port)
    try:
        assert gw.queue()["heldBytesLimit"] == BUDGET  # derived from memory.max, not configured
        results: list[tuple[int, bytes]] = []
        with PeakRSS(lambda: tree_rss(gw.proc.pid), interval=0.02) as rss:
            threads = [threading.Thread(target=exchange, args=(gw.port, cold_request(BODY_BYTES), results), daemon=True)
                       for _ in range(FLOOD)]
            for t in threads:
                t.start()
            # Settled: every request answered 429 or held, and no admission still in flight (one can be
            # counted as queued for an instant before its body reservation fails), twice in a row.
            def settled() -> bool:
                first = gw.queue()
                time.sleep(0.5)
                second = gw.queue()
                refused = sum(1 for code, _ in results if code == 429)
                return first["queued"] == second["queued"] and refused + second["queued"] == FLOOD

            wait_for(settled, timeout=60, what="every request held or refused")
            held = gw.queue()
            assert held["heldBytes"] <= BUDGET
            # An oversized body is refused from its headers alone.
            too_big: list[tuple[int, bytes]] = []
            exchange(gw.port, cold_request(9 * 1024 * 1024), too_big)
            # The backend wakes: every held request is forwarded at once.
            backend.start()
            for t in threads:
                t.join(120)
        codes = sorted(code for code, _ in results)
        accepted = codes.count(200)
        others = [(code, reply[:300]) for code, reply in results if code not in (200, 429)]
        assert not others, others
        assert accepted == held["queued"] and accepted >= BUDGET // BODY_BYTES - 1, (codes, held)
        assert codes.count(429) == FLOOD - accepted, codes
        for code, reply in results:
            if code == 429:  # held bytes (the metric's reason says queue_bytes_full), or bytes still arriving
                error = body_json(reply)["error"]
                assert error["code"] in ("queue_full", "upload_bytes_full") and "bytes" in error["message"], error
        assert too_big[0][0] == 413 and body_json(too_big[0][1])["error"]["code"] == "request_too_large"
        print(f"\npeak RSS of the gateway tree {rss.peak / 2**20:.0f} MiB under a {LIMIT / 2**20:.0f} MiB limit; "
              f"held {held['heldBytes'] / 2**20:.0f} MiB of bodies (budget {BUDGET / 2**20:.0f} MiB)")
        assert rss.peak < LIMIT
        assert gw.proc.poll() is None  # alive: nothing was dropped
    finally:
        backend.stop()
        gw.stop()
