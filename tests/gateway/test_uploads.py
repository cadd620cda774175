"""Uploads apart from held bodies, and deadlines by progress (issue 29), on real sockets on 127.0.0.1
with clients bound to other loopback addresses (Linux routes all of 127/8 to loopback).

- Unfinished uploads (all but the last byte of 8 MiB bodies) count against the upload bounds, per
  client address and per worker, never against the held-while-cold budget: a warm request, and in a
  shared gateway another model's request, still succeeds. One address gets exactly its bound (two
  8 MiB bodies); its next upload is refused 429 ``upload_bytes_per_address`` while other addresses
  are served.
- In a shared gateway each model holds at most its share of the held budget (a half): at the share
  a cold model's next body is refused 429 ``queue_full`` and another cold model's body is still held.
- A body arriving on a slow but steady uplink succeeds on the first try (4 MiB at 60 KB/s, scaled
  down tenfold in time and bytes; the full size with ``NOCTAYA_TEST_FULL_SLOW_UPLINK=1``); one below
  the minimum rate gets 408 ``client_too_slow`` with ``x-should-retry: false`` after grace + window.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterator

import pytest

from gateway.config import GatewayConfig
from gateway.modeltable import parse_model_table
from gateway.shared import SharedGatewayApp
from gateway.state.uploads import UploadBudget, UploadRefused
from tests.gateway.abuse_harness import Reader, Response, connect
from tests.gateway.conftest import wait_for
from tests.gateway.fakebackend import FakeBackend
from tests.gateway.harness import ThreadedGateway

pytestmark = pytest.mark.timeout(120)

MiB = 1024 * 1024
BIG = 8 * MiB  # the default max body
HELD = 64 * MiB  # the held budget in these tests: 17 unfinished 8 MiB bodies would overflow it
ATTACKER = "127.0.0.3"
LEGIT = "127.0.0.2"
UNFINISHED = 17


def body_of(size: int, model: str = "test-model") -> bytes:
    """A chat body of exactly ``size`` bytes naming ``model``."""
    shell = json.dumps({"model": model, "messages": [{"role": "user", "content": ""}]}).encode()
    pad = size - len(shell)
    assert pad >= 0
    return shell[:-4] + b"x" * pad + shell[-4:]


def head_of(length: int) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % length)


def answer(sock: socket.socket) -> Response:
    response = Reader(sock).response()
    assert response is not None, "closed without an answer"
    return response


def post(port: int, body: bytes, source: str, timeout: float = 30) -> Response:
    with connect(port, source, timeout=timeout) as sock:
        sock.sendall(head_of(len(body)) + body)
        return answer(sock)


def unfinished(port: int, source: str, size: int = BIG) -> tuple[socket.socket, Response | None]:
    """An upload of all but the last byte of a ``size`` body; the answer if the gateway refused it."""
    sock = connect(port, source, timeout=30)
    try:
        sock.sendall(head_of(size) + body_of(size)[:-1])
    except OSError:
        pass  # refused and closed while we were still sending: the answer was written first
    sock.settimeout(0.5)
    try:
        return sock, Reader(sock).response()
    except (TimeoutError, OSError):
        return sock, None  # still uploading, as far as the gateway knows
    finally:
        sock.settimeout(30)


def flood(port: int, model: str = "test-model") -> list[socket.socket]:
    """UNFINISHED uploads from ATTACKER, one after the other, none answered yet."""
    socks = []
    for _ in range(UNFINISHED):
        sock = connect(port, ATTACKER, timeout=30)
        try:
            sock.sendall(head_of(BIG) + body_of(BIG, model)[:-1])
        except OSError:
            pass
        socks.append(sock)
    return socks


def flood_refused(socks: list[socket.socket]) -> list[socket.socket]:
    """Exactly two of the flood's uploads fit ATTACKER's per-address bound (2 x 8 MiB): every further
    one was refused 429 upload_bytes_per_address. Returns the two still uploading."""
    refused = []
    for sock in socks[2:]:
        refused.append(answer(sock))
        sock.close()
    for sock in socks[:2]:  # at the bound, still uploading: nothing answered
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):
            sock.recv(1)
    for response in refused:
        assert response.status == 429 and response.error_code() == "upload_bytes_per_address", response
        assert response.headers.get("retry-after") is not None
    return socks[:2]


@pytest.fixture
def backend() -> Iterator[FakeBackend]:
    made = FakeBackend()
    yield made
    made.stop()


def config(**overrides: object) -> GatewayConfig:
    settings: dict = {"backend_url": "http://unused:1", "served_model_name": "test-model", "listen_host": "127.0.0.1",
                      "listen_port": 0, "admin_port": 0, "activation_timeout_seconds": 20.0, "ready_grace_seconds": 0.5,
                      "heartbeat_seconds": 0.2, "scaler_mode": "off", "probe_interval_seconds": 0.05,
                      "probe_timeout_seconds": 0.5, "max_held_body_bytes": HELD, "max_queue": 64}
    settings.update(overrides)
    return GatewayConfig(**settings)


@pytest.fixture
def gateways() -> Iterator[Callable[..., ThreadedGateway]]:
    started: list[ThreadedGateway] = []

    def make(cfg: GatewayConfig, factory: Callable[[], object] | None = None) -> ThreadedGateway:
        gw = ThreadedGateway(cfg, app_factory=factory).start()
        started.append(gw)
        return gw

    yield make
    for gw in started:
        gw.stop()


# -- the upload budget itself, at its bounds -------------------------------------------------------------
def test_upload_budget_at_its_bounds() -> None:
    budget = UploadBudget(max_bytes=30, max_bytes_per_address=16)
    a, b = budget.reservation("127.0.0.2"), budget.reservation("127.0.0.3")
    a.on_preempt = lambda: True  # its reader: still reading, so it may be cut
    a.take(16)  # exactly the address's bound
    with pytest.raises(UploadRefused) as refused:
        a.take(1)
    assert refused.value.per_address and budget.bytes == 16
    b.take(14)  # exactly the worker's bound
    b.take(1)  # within its fair share (30 / 2): the full budget preempts a's upload, over its share
    assert a.preempted and budget.bytes == 15 and budget.by_address == {"127.0.0.3": 15}
    c = budget.reservation("127.0.0.4")
    c.take(15)  # exactly the worker's bound again
    with pytest.raises(UploadRefused) as refused:
        c.take(1)  # past its fair share while the budget is full: the worker is full, for it
    assert not refused.value.per_address
    a.release()
    a.release()  # idempotent (a preempted upload's bytes were given back already)
    c.release()
    assert budget.bytes == 15 and budget.by_address == {"127.0.0.3": 15}
    b.release()
    assert budget.bytes == 0 and budget.by_address == {}


# -- unfinished uploads ---------------------------------------------------------------------------------
def test_unfinished_uploads_leave_warm_requests_and_other_addresses_alone(
        backend: FakeBackend, gateways: Callable[..., ThreadedGateway]) -> None:
    backend.start()
    gw = gateways(config(backend_url=backend.url))
    socks = flood(gw.port)
    # A warm request far larger than one read, from another address: served, first try.
    response = post(gw.port, body_of(4 * MiB), LEGIT)
    assert response.status == 200, response
    stuck = flood_refused(socks)
    # The attacker's address is at its bound; it gets nothing more until one of its uploads ends.
    with connect(gw.port, ATTACKER) as sock:
        try:
            sock.sendall(head_of(MiB) + body_of(MiB))
        except OSError:
            pass
        refused = answer(sock)
    assert refused.status == 429 and refused.error_code() == "upload_bytes_per_address"
    assert gw.call(lambda: gw.app.pod.held_bytes) == 0  # uploads never touch the held budget
    stuck[0].close()
    wait_for(lambda: gw.call(lambda: gw.app.uploads.by_address.get(ATTACKER)) == BIG - 1, what="bytes returned")
    assert post(gw.port, body_of(2 * MiB), ATTACKER).status == 200
    for sock in stuck:
        sock.close()
    wait_for(lambda: gw.call(lambda: gw.app.uploads.bytes) == 0, what="every upload's bytes returned")


def shared_gateway(gateways: Callable[..., ThreadedGateway], a: FakeBackend, b: FakeBackend) -> ThreadedGateway:
    base = config()
    table = parse_model_table(json.dumps({"models": [
        {"name": "a", "backendURL": a.url}, {"name": "b", "backendURL": b.url},
    ]}).encode(), base)
    return gateways(base, lambda: SharedGatewayApp(base, table))


@pytest.mark.parametrize("other_warm", [True, False], ids=["other-warm", "other-cold"])
def test_shared_unfinished_uploads_for_a_cold_model_leave_another_model_alone(
        gateways: Callable[..., ThreadedGateway], other_warm: bool) -> None:
    a, b = FakeBackend(), FakeBackend()  # a stays cold
    try:
        if other_warm:
            b.start()
        gw = shared_gateway(gateways, a, b)
        socks = flood(gw.port, "a")
        with connect(gw.port, LEGIT, timeout=30) as sock:
            sock.sendall(head_of(4 * MiB) + body_of(4 * MiB, "b"))
            if not other_warm:  # held for b, then served once b wakes
                wait_for(lambda: gw.call(lambda: gw.app.apps["b"].waiting) == 1, what="b's request held")
                b.start()
            response = answer(sock)
        assert response.status == 200, response
        for sock in flood_refused(socks):
            sock.close()
    finally:
        a.stop()
        b.stop()


def test_shared_one_cold_model_holds_at_most_its_share(gateways: Callable[..., ThreadedGateway]) -> None:
    a, b = FakeBackend(), FakeBackend()  # both cold
    socks: list[socket.socket] = []
    try:
        gw = shared_gateway(gateways, a, b)
        share = gw.app.config.held_bytes_per_model
        assert share == HELD // 2  # the default share: a half
        size = 4 * MiB
        # From several addresses (each within its own upload bound): exactly a's share is held.
        for i in range(share // size):
            sock = connect(gw.port, f"127.0.0.{10 + i}", timeout=30)
            sock.sendall(head_of(size) + body_of(size, "a"))
            socks.append(sock)
        wait_for(lambda: gw.call(lambda: gw.app.apps["a"].waiting) == share // size, what="a's share held")
        assert gw.call(lambda: gw.app.budget.held_bytes) == share
        refused = post(gw.port, body_of(size, "a"), "127.0.0.30")  # one byte over would be refused too
        assert refused.status == 429 and refused.error_code() == "queue_full", refused
        assert "bytes" in refused.json()["error"]["message"]
        # Another cold model's body is still held, and served when it wakes.
        with connect(gw.port, "127.0.0.31", timeout=30) as sock:
            sock.sendall(head_of(size) + body_of(size, "b"))
            wait_for(lambda: gw.call(lambda: gw.app.apps["b"].waiting) == 1, what="b's request held")
            b.start()
            assert answer(sock).status == 200
        a.start()
        assert all(answer(sock).status == 200 for sock in socks)
        wait_for(lambda: gw.call(lambda: gw.app.budget.held_bytes) == 0, what="held budget free")
    finally:
        for sock in socks:
            sock.close()
        a.stop()
        b.stop()


# -- deadlines by progress ------------------------------------------------------------------------------
def throttled(sock: socket.socket, data: bytes, rate: float, step: float = 0.05) -> None:
    """Send ``data`` at ``rate`` bytes/s, in pieces every ``step`` seconds (a slow uplink)."""
    piece = max(1, int(rate * step))
    started = time.monotonic()
    for sent in range(0, len(data), piece):
        delay = started + sent / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        sock.sendall(data[sent:sent + piece])


def slow_upload(port: int, size: int, rate: float, timeout: float) -> tuple[Response, float]:
    body = body_of(size)
    with connect(port, LEGIT, timeout=timeout) as sock:
        sock.sendall(head_of(size))
        started = time.monotonic()
        try:
            throttled(sock, body, rate)
        except OSError:
            pass  # cut: the answer is already on its way
        return answer(sock), time.monotonic() - started


# Tenfold scaled: the old fixed 60 s deadline is 6 s here, a 10 s grace and window 1 s each, and the body
# a tenth of 4 MiB at the same 60 KB/s (~7 s, past the old deadline).
SCALED = {"client_request_timeout_seconds": 6.0, "client_body_grace_seconds": 1.0,
          "client_min_rate_window_seconds": 1.0, "client_min_rate_bytes": 8 * 1024}


def test_slow_uplink_scaled_succeeds_first_try(backend: FakeBackend, gateways: Callable[..., ThreadedGateway]) -> None:
    backend.start()
    gw = gateways(config(backend_url=backend.url, **SCALED))
    response, took = slow_upload(gw.port, 4 * MiB // 10, 60_000, timeout=30)
    assert response.status == 200, response
    assert took > SCALED["client_request_timeout_seconds"]  # longer than a fixed deadline would have allowed
    assert len(backend.requests_to("/v1/chat/completions")) == 1  # one upload, no retry
    print(f"\n{4 * MiB // 10} bytes at 60 KB/s: 200 in {took:.1f} s")


@pytest.mark.skipif(not os.environ.get("NOCTAYA_TEST_FULL_SLOW_UPLINK"), reason="~70 s: set NOCTAYA_TEST_FULL_SLOW_UPLINK=1")
@pytest.mark.timeout(300)
def test_slow_uplink_full_size_succeeds_first_try(backend: FakeBackend,
                                                  gateways: Callable[..., ThreadedGateway]) -> None:
    backend.start()
    gw = gateways(config(backend_url=backend.url))  # the defaults
    response, took = slow_upload(gw.port, 4 * MiB, 60_000, timeout=200)
    assert response.status == 200, response
    assert len(backend.requests_to("/v1/chat/completions")) == 1
    print(f"\n4 MiB at 60 KB/s: 200 in {took:.1f} s")


def test_a_sender_below_the_minimum_rate_gets_408_no_retry(backend: FakeBackend,
                                                          gateways: Callable[..., ThreadedGateway]) -> None:
    backend.start()
    gw = gateways(config(backend_url=backend.url, **SCALED))
    response, took = slow_upload(gw.port, 64 * 1024, 3 * 1024, timeout=30)  # under half the minimum rate
    assert response.status == 408 and response.error_code() == "client_too_slow", response
    assert response.headers.get("x-should-retry") == "false"
    assert response.headers.get("connection") == "close"
    limit = SCALED["client_body_grace_seconds"] + SCALED["client_min_rate_window_seconds"]
    assert limit - 0.1 <= took <= limit + 1.0, took  # grace + window (+ the watchdog's tick)
    assert backend.requests_to("/v1/chat/completions") == []


def test_a_sender_just_above_the_minimum_rate_is_not_cut(backend: FakeBackend,
                                                        gateways: Callable[..., ThreadedGateway]) -> None:
    backend.start()
    gw = gateways(config(backend_url=backend.url, **SCALED))
    # 1.25 x the minimum for ~5 windows: every window's quota comes in time, however long the body.
    response, took = slow_upload(gw.port, 50 * 1024, 10 * 1024, timeout=30)
    assert response.status == 200, response
    assert took > 4.0


def test_upload_and_rate_settings_defaults_and_bounds() -> None:
    from gateway.config import ConfigError, load_config

    env = {"NOCTAYA_BACKEND_URL": "http://x:1", "NOCTAYA_SERVED_MODEL_NAME": "m",
           "NOCTAYA_MAX_HELD_BODY_BYTES": str(HELD)}
    c = load_config([], env)
    assert (c.upload_bytes, c.upload_bytes_per_address, c.held_bytes_per_model) == (HELD, 2 * BIG, HELD // 2)
    assert (c.client_min_rate_bytes, c.client_min_rate_window_seconds, c.client_body_grace_seconds,
            c.client_body_timeout_seconds) == (8192, 10.0, 10.0, 1800.0)
    at_limit = load_config([], {**env, "NOCTAYA_MAX_UPLOAD_BYTES_PER_ADDRESS": str(BIG), "NOCTAYA_MAX_UPLOAD_BYTES": str(BIG),
                                "NOCTAYA_HELD_BODY_SHARE_PER_MODEL": "1"})
    assert (at_limit.upload_bytes_per_address, at_limit.upload_bytes, at_limit.held_bytes_per_model) == (BIG, BIG, HELD)
    assert load_config([], {**env, "NOCTAYA_MAX_UPLOAD_BYTES_PER_ADDRESS": "0"}).upload_bytes_per_address == 0
    for bad in ({"NOCTAYA_MAX_UPLOAD_BYTES_PER_ADDRESS": str(BIG - 1)}, {"NOCTAYA_MAX_UPLOAD_BYTES": str(BIG - 1)},
                {"NOCTAYA_HELD_BODY_SHARE_PER_MODEL": "0"}, {"NOCTAYA_HELD_BODY_SHARE_PER_MODEL": "1.01"},
                {"NOCTAYA_CLIENT_MIN_RATE_WINDOW_SECONDS": "0"}):
        with pytest.raises(ConfigError):
            load_config([], {**env, **bad})
