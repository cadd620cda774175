"""The public port shared fairly (issue 38, rows 7 and 8), on real sockets on 127.0.0.1 with clients
bound to other loopback addresses (Linux routes all of 127/8 to loopback).

- Row 7: idle connections from two addresses fill the pool (a small pool without a per-address cap,
  as behind a proxy; and the default configuration): a client from a third address is still served,
  because a full pool evicts its oldest idle connection (gateway.idle) instead of refusing.
- A fresh connection that sends nothing is closed after the first-byte timeout, and counted; a
  keep-alive connection between requests is not (it keeps the idle timeout).
- Row 8: stalled uploads from 8 addresses fill the worker's upload budget; a warm request with a
  100 KiB body (more than one read) from another address still succeeds: an address under its fair
  share preempts the largest upload of the address holding the most (gateway.state.uploads).

No assertion bounds a duration: the client-side timeouts only turn a hang into a failure.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

import pytest

from gateway.config import GatewayConfig
from gateway.state.uploads import UploadBudget, UploadRefused
from tests.gateway.abuse_harness import Reader, Response, connect, request_bytes
from tests.gateway.conftest import wait_for
from tests.gateway.fakebackend import FakeBackend
from tests.gateway.harness import ThreadedGateway
from tests.gateway.test_uploads import BIG, body_of, head_of

pytestmark = pytest.mark.timeout(180)

MiB = 1024 * 1024
HELD = 64 * MiB  # the worker's upload budget in row 8 (the default: the held budget)


@pytest.fixture
def backend() -> Iterator[FakeBackend]:
    made = FakeBackend().start()
    yield made
    made.stop()


@pytest.fixture
def gateway(backend: FakeBackend) -> Iterator[Callable[..., ThreadedGateway]]:
    started: list[ThreadedGateway] = []

    def make(**overrides: object) -> ThreadedGateway:
        settings: dict = {"backend_url": backend.url, "served_model_name": "test-model", "listen_host": "127.0.0.1",
                          "listen_port": 0, "admin_port": 0, "scaler_mode": "off", "probe_interval_seconds": 0.05,
                          "probe_timeout_seconds": 0.5, "max_held_body_bytes": HELD, "max_queue": 64}
        settings.update(overrides)
        gw = ThreadedGateway(GatewayConfig(**settings)).start()
        started.append(gw)
        return gw

    yield make
    for gw in started:
        gw.stop()


def served(port: int, source: str, sock: socket.socket | None = None) -> Response:
    """GET /v1/models from ``source`` (on ``sock`` if given); the answer."""
    sock = sock or connect(port, source, timeout=30)
    sock.sendall(request_bytes("GET", "/v1/models"))
    response = Reader(sock).response()
    assert response is not None, "closed without an answer"
    return response


def public_connections(gw: ThreadedGateway) -> int:
    return gw.call(lambda: sum(1 for c in gw.server.connections if not c.admin))


# -- row 7: idle connections never lock anyone out --------------------------------------------------------
@pytest.mark.parametrize("settings", [
    {"max_connections": 64, "max_connections_per_address": 0},  # behind a proxy: no per-address cap
    {},  # the defaults: 4096 connections per worker, the default per-address cap
], ids=["pool-64-no-cap", "defaults"])
def test_idle_connections_from_two_addresses_never_lock_out_a_third(
        gateway: Callable[..., ThreadedGateway], settings: dict) -> None:
    gw = gateway(**settings)
    pool = gw.config.max_connections
    idle: list[socket.socket] = []
    try:
        for i in range(pool):  # as many idle connections as the pool holds, from two addresses
            idle.append(connect(gw.port, f"127.0.0.{2 + i % 2}", timeout=30))
        # The gateway has taken what it takes of them (all, without a cap; the cap's worth per address).
        expected = pool if not gw.config.connections_per_address else 2 * gw.config.connections_per_address
        wait_for(lambda: public_connections(gw) == expected, what=f"{expected} idle connections open")
        response = served(gw.port, "127.0.0.4")
        assert response.status == 200, response
        if expected == pool:  # a full pool made the room by evicting exactly one idle connection
            assert gw.call(lambda: gw.server.idle.evicted) == 1
        assert public_connections(gw) <= pool
    finally:
        for sock in idle:
            sock.close()


def test_an_address_at_its_cap_loses_its_oldest_idle_connection_not_its_requests(
        gateway: Callable[..., ThreadedGateway]) -> None:
    gw = gateway(max_connections=64, max_connections_per_address=4)
    socks = [connect(gw.port, "127.0.0.5", timeout=30) for _ in range(4)]
    try:
        wait_for(lambda: public_connections(gw) == 4, what="four connections")
        busy = socks[0]
        busy.sendall(b"GET /v1/mod")  # a request in progress on the oldest: never evicted
        wait_for(lambda: gw.call(lambda: len(gw.server.idle)) == 3, what="three idle")
        extra = connect(gw.port, "127.0.0.5", timeout=30)
        socks.append(extra)
        assert served(gw.port, "127.0.0.5", extra).status == 200
        assert Reader(socks[1]).closed(30)  # the oldest idle one of that address made the room
        busy.sendall(b"els HTTP/1.1\r\nHost: gw\r\n\r\n")
        assert Reader(busy).response().status == 200
        assert gw.call(lambda: (gw.server.idle.evicted, gw.server.admission.per_address.get("127.0.0.5"))) == (1, 4)
    finally:
        for sock in socks:
            sock.close()


# -- time to first byte ---------------------------------------------------------------------------------
def test_a_silent_fresh_connection_is_closed_and_counted_a_keep_alive_one_is_not(
        gateway: Callable[..., ThreadedGateway]) -> None:
    gw = gateway(client_first_byte_timeout_seconds=0.5, client_idle_timeout_seconds=120.0)
    used = connect(gw.port, "127.0.0.2", timeout=30)
    try:
        assert served(gw.port, "127.0.0.2", used).status == 200  # now idle between requests
        fresh = connect(gw.port, "127.0.0.3", timeout=30)
        with fresh:
            reader = Reader(fresh)
            assert reader.closed(30), "a fresh connection that sent nothing was not closed"
            assert reader.buf == b""  # silently: no request began, so there is nothing to answer
        assert gw.call(lambda: gw.server.first_byte_timeouts) == 1
        # Opened before the fresh one and idle since its answer: still open, and served.
        assert served(gw.port, "127.0.0.2", used).status == 200
        assert gw.call(lambda: gw.server.first_byte_timeouts) == 1
    finally:
        used.close()


# -- row 8: a fair upload budget --------------------------------------------------------------------------
def test_fair_upload_budget_preempts_the_largest_holder_for_a_newcomer() -> None:
    budget = UploadBudget(max_bytes=80, max_bytes_per_address=40)
    cut: list[str] = []
    holders = []
    for i in range(4):  # four addresses, two uploads of 10 each: the budget is full
        for j in range(2):
            r = budget.reservation(f"a{i}")
            r.on_preempt = lambda name=f"a{i}/{j}": not cut.append(name)  # still arriving: cut
            r.take(10)
            holders.append(r)
    assert budget.bytes == 80
    newcomer = budget.reservation("new")
    newcomer.take(16)  # within its share (80 / 5): two of the largest holders' uploads are cut
    assert budget.bytes == 76 and budget.preempted == 2 and len(cut) == 2
    assert budget.fair_share("new") == 80 // 5
    with pytest.raises(UploadRefused) as refused:
        newcomer.take(5)  # past its share while the budget is full: the worker is full, for it
    assert not refused.value.per_address
    complete = next(r for r in holders if not r.preempted and r.address == "a2")
    complete.on_preempt = lambda: False  # read whole, being forwarded: never cut
    assert not complete.preempt() and complete.bytes == 10
    victim = next(r for r in holders if r.preempted)
    with pytest.raises(UploadRefused):
        victim.take(1)  # a preempted upload takes nothing more
    for r in [*holders, newcomer]:
        r.release()
    assert budget.bytes == 0 and budget.by_address == {} and not budget.holders
    alone = budget.reservation("proxy")  # one address alone: the whole budget is its share
    budget.max_bytes_per_address = 0
    alone.take(80)
    with pytest.raises(UploadRefused):
        alone.take(1)
    assert budget.preempted == 2


def stalled(port: int, source: str) -> socket.socket:
    """All but the last byte of an 8 MiB body, never finished."""
    sock = connect(port, source, timeout=30)
    try:
        sock.sendall(head_of(BIG) + body_of(BIG)[:-1])
    except OSError:
        pass  # refused or preempted while still sending: answered and closed
    return sock


def test_stalled_uploads_from_eight_addresses_leave_room_for_another(
        gateway: Callable[..., ThreadedGateway]) -> None:
    gw = gateway()
    budget = gw.config.upload_bytes
    assert budget == HELD and gw.config.upload_bytes_per_address == 2 * BIG
    socks = [stalled(gw.port, f"127.0.0.{10 + i // 2}") for i in range(16)]
    try:
        # Everything sent has been read: the budget is full (no room for another read of 64 KiB).
        wait_for(lambda: gw.call(lambda: gw.app.uploads.bytes) > budget - 64 * 1024, what="the budget full")
        before = gw.call(lambda: getattr(gw.app.uploads, "preempted", 0))
        with connect(gw.port, "127.0.0.30", timeout=30) as sock:
            body = body_of(100 * 1024)
            sock.sendall(head_of(len(body)) + body)
            response = Reader(sock).response()
        assert response is not None and response.status == 200, response
        assert gw.call(lambda: gw.app.uploads.preempted) == before + 1  # one stalled upload made the room
        assert gw.call(lambda: gw.app.uploads.bytes) <= budget
    finally:
        for sock in socks:
            sock.close()
    wait_for(lambda: gw.call(lambda: gw.app.uploads.bytes) == 0, what="every upload's bytes returned")
