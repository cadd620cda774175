"""A client that leaves during a cold hold is gone, whatever kind of client it is (the ghosts issue).

A FIN (a full close, or a shutdown of the client's sending side) or a reset while a request is held
cold frees its admission slot and its demand (the queued count KEDA's GetMetrics sums) within a
second, for keep-alive, ``Connection: close`` and HTTP/1.0 clients alike, and the request is never
forwarded. Before the fix a ``Connection: close`` or HTTP/1.0 client's FIN was taken for a half-close
and the ghost kept both for the whole activation timeout. A half-close stays allowed once the request
is being forwarded: such a client still gets its answer.

Real sockets on 127.0.0.1; the model is cold (backend not listening) unless a test starts it.
"""

from __future__ import annotations

import json
import socket
import struct
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import gevent
import gevent.socket
import pytest
import requests

from gateway.server import ClientConnection
from tests.gateway.conftest import wait_for

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
STREAM_BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
FREED_WITHIN = 1.0  # the bound, from the client's FIN or reset to slot and demand freed

# How each kind of client asks: the request line's version and its Connection header.
CLIENTS = {
    "keep-alive": (b"HTTP/1.1", b""),
    "connection-close": (b"HTTP/1.1", b"Connection: close\r\n"),
    "http-1.0": (b"HTTP/1.0", b""),
}


def request(client: str, body: bytes = BODY) -> bytes:
    version, connection = CLIENTS[client]
    return (b"POST /v1/chat/completions %s\r\nHost: gw\r\nContent-Type: application/json\r\n%s"
            b"Content-Length: %d\r\n\r\n%s" % (version, connection, len(body), body))


def queue(gw) -> dict:
    return requests.get(gw.admin_url + "/noctaya/queue", timeout=5).json()


def held(gw, n: int) -> bool:
    """``n`` requests hold slots, and KEDA's metric (the published demand) counts them."""
    q = queue(gw)
    return q["queued"] == n and gw.broadcaster.current().total == n


def freed(gw) -> bool:
    q = queue(gw)
    return q["queued"] == 0 and q["heldBytes"] == 0 and gw.broadcaster.current().total == 0


def leave(sock: socket.socket, how: str) -> None:
    """close: FIN and gone. shut-wr: FIN, the client still reading (what a half-close looks like).
    reset: RST (SO_LINGER 0)."""
    if how == "reset":
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    elif how == "shut-wr":
        sock.shutdown(socket.SHUT_WR)
    else:
        sock.close()


def silent(sock: socket.socket) -> bool:
    """Nothing answered yet (the request really is waiting)."""
    sock.settimeout(0.05)
    try:
        return not sock.recv(1, socket.MSG_PEEK)
    except TimeoutError:
        return True
    finally:
        sock.settimeout(10)


def hold(gw, client: str, body: bytes = BODY) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", gw.port), timeout=10)
    sock.sendall(request(client, body))
    return sock


def assert_freed_in_time(gw, left_at: float) -> None:
    wait_for(lambda: freed(gw), timeout=FREED_WITHIN, interval=0.01, what="slot and demand freed")
    assert time.monotonic() - left_at <= FREED_WITHIN + 0.2  # the polls themselves take a moment


@pytest.mark.parametrize("how", ["close", "shut-wr", "reset"])
@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_a_held_client_that_leaves_frees_its_slot_and_demand_within_a_second(backend, make_gateway, client: str,
                                                                             how: str) -> None:
    gw = make_gateway(backend, activation_timeout_seconds=60)
    sock = hold(gw, client)
    wait_for(lambda: held(gw, 1), timeout=10, what="held")
    time.sleep(0.3)  # past the watchdog's tick: still held while the client is there
    assert held(gw, 1) and silent(sock)
    leave(sock, how)
    assert_freed_in_time(gw, time.monotonic())
    sock.close()
    # The ghost is never forwarded once the backend wakes (the lease woke it; nobody is waiting).
    backend.start()
    wait_for(lambda: queue(gw)["backendReady"], what="ready")
    time.sleep(0.2)
    assert backend.requests_to("/v1/chat/completions") == []


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_a_held_stream_whose_client_shuts_its_side_is_freed_within_a_second(backend, make_gateway,
                                                                            client: str) -> None:
    """A cold streamed request is answered at once (200, heartbeats): heartbeats still reach a client
    that only shut its sending side, so no failed write would ever notice it left."""
    gw = make_gateway(backend, activation_timeout_seconds=60)
    sock = hold(gw, client, STREAM_BODY)
    wait_for(lambda: held(gw, 1), timeout=10, what="held")
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    leave(sock, "shut-wr")
    assert_freed_in_time(gw, time.monotonic())
    sock.close()


def test_a_urllib_client_that_times_out_is_gone_within_a_second(backend, make_gateway) -> None:
    """Python's urllib sends ``Connection: close`` and closes its socket when its timeout fires."""
    gw = make_gateway(backend, activation_timeout_seconds=60)
    req = urllib.request.Request(gw.url + "/v1/chat/completions", data=BODY,
                                 headers={"Content-Type": "application/json"})
    with pytest.raises((TimeoutError, urllib.error.URLError)):
        urllib.request.urlopen(req, timeout=1.0)  # noqa: S310 - our own gateway on 127.0.0.1
    assert_freed_in_time(gw, time.monotonic())


def test_ghosts_at_the_slot_limit_give_their_slots_to_new_requests(backend, make_gateway) -> None:
    """maxQueue ghosts fill every slot (one more is refused); once they leave, as many new requests
    are admitted and held at once, one more is refused again, and only the new ones are served."""
    limit = 4
    gw = make_gateway(backend, max_queue=limit, activation_timeout_seconds=60)
    kinds = ["connection-close", "http-1.0", "connection-close", "http-1.0"]
    ghosts = [hold(gw, kind) for kind in kinds]
    wait_for(lambda: held(gw, limit), timeout=10, what="every slot held")
    refused = hold(gw, "connection-close")
    assert refused.recv(4096).startswith(b"HTTP/1.1 429")  # at the limit: the next one is refused
    refused.close()
    for sock in ghosts:
        sock.close()
    assert_freed_in_time(gw, time.monotonic())
    admitted = [hold(gw, "keep-alive") for _ in range(limit)]
    wait_for(lambda: held(gw, limit), timeout=FREED_WITHIN, what="as many new requests admitted at once")
    assert all(silent(sock) for sock in admitted)  # held, not refused
    refused = hold(gw, "keep-alive")
    assert refused.recv(4096).startswith(b"HTTP/1.1 429")
    refused.close()
    backend.start()
    for sock in admitted:
        sock.settimeout(30)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.close()
    assert len(backend.requests_to("/v1/chat/completions")) == limit  # the ghosts were never forwarded


def read_all(sock: socket.socket) -> bytes:
    sock.settimeout(30)
    reply = b""
    while chunk := sock.recv(65536):
        reply += chunk
    return reply


@pytest.mark.parametrize("client", ["connection-close", "http-1.0"])
def test_a_half_close_while_forwarding_a_held_request_still_gets_the_answer(backend, make_gateway,
                                                                            client: str) -> None:
    """Once forwarding began, a client that announced it sends nothing more may shut its sending side
    and wait: the answer still reaches it."""
    gw = make_gateway(backend, activation_timeout_seconds=60)
    sock = hold(gw, client)
    wait_for(lambda: held(gw, 1), timeout=10, what="held")
    backend.response_delay = 1.0
    backend.start()
    wait_for(lambda: backend.requests_to("/v1/chat/completions"), timeout=10, what="forwarded")
    time.sleep(0.3)  # the gateway is waiting for the answer, its hang-up watcher armed
    sock.shutdown(socket.SHUT_WR)
    reply = read_all(sock)
    sock.close()
    assert reply.split(b"\r\n", 1)[0].endswith(b"200 OK") and b"tok4" in reply


@pytest.mark.parametrize("client", ["connection-close", "http-1.0"])
def test_a_half_close_while_forwarding_a_warm_request_still_gets_the_answer(backend, make_gateway,
                                                                            client: str) -> None:
    backend.start()
    gw = make_gateway(backend)
    requests.post(gw.url + "/v1/embeddings", json={"input": "a"}, timeout=10)  # warm
    backend.response_delay = 1.0
    sock = hold(gw, client)
    wait_for(lambda: backend.requests_to("/v1/chat/completions"), timeout=10, what="forwarded")
    time.sleep(0.6)  # past the lazy watch: the hang-up watcher is armed
    sock.shutdown(socket.SHUT_WR)
    reply = read_all(sock)
    sock.close()
    assert reply.split(b"\r\n", 1)[0].endswith(b"200 OK") and b"tok4" in reply


# -- the rule itself, on one connection ---------------------------------------------------------------------
@pytest.fixture
def watched() -> Iterator[tuple[ClientConnection, socket.socket]]:
    """A gateway-side connection (``Connection: close`` request read, hang-up watcher armed) in this
    thread's hub, and the client's end of it."""
    ours, theirs = gevent.socket.socketpair()
    conn = ClientConnection(ours, "127.0.0.1", 60.0, time.monotonic)
    conn.keep_alive = False
    conn.arm_watch()
    yield conn, theirs
    conn.close()
    theirs.close()


def test_a_fin_during_forwarding_is_a_half_close_and_a_hang_up_once_held_again(watched) -> None:
    """A forwarding attempt that found the backend gone puts the request back on hold: a FIN the
    watcher let pass as a half-close while forwarding is a hang-up from then on."""
    conn, client = watched
    client.shutdown(socket.SHUT_WR)
    gevent.sleep(0.05)  # the read watcher fires
    assert not conn.gone and conn.polled  # forwarding: the client may be waiting for its answer
    conn.hold(True)
    assert conn.gone and conn.wake is not None and conn.wake.is_set()


def test_a_fin_while_held_is_a_hang_up_at_once(watched) -> None:
    conn, client = watched
    conn.hold(True)
    client.shutdown(socket.SHUT_WR)
    gevent.sleep(0.05)
    assert conn.gone
    conn.disarm_watch()
    assert not conn.held  # the next request on a connection starts outside a hold
