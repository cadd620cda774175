"""A closed connection leaves no reference cycle behind, whatever ended it.

Found by the attack generator's long mode (bench.attacks, the header family): a gateway answering
431 to heads of ~30 KiB grew by ~8 KiB per connection, for good (31 -> 84 MiB over 3,200
connections). Every connection was a cycle - llhttp's parser holds its Python parser (the callbacks),
the read watcher its connection's bound method, a refused request's kept exception its traceback's
frames - so it was freed only by the cyclic GC, which a worker runs rarely on purpose
(gateway.workers.GC_THRESHOLD: young collections cost tail latency), and each kept its last head's
bytes until then. The class, not the instance: every way a connection ends, client side and backend
side, is played here, and the cyclic GC must then find none of the gateway's connection objects.
"""

from __future__ import annotations

import gc
import json
import socket
from collections.abc import Callable, Iterator

import pytest

from gateway.config import GatewayConfig
from gateway.relay import ReadWaiter, UpstreamConnection
from gateway.server import ClientConnection
from gateway.wire import ClientParser, UpstreamParser
from tests.gateway.abuse_harness import connect, request_bytes
from tests.gateway.conftest import wait_for
from tests.gateway.fakebackend import FakeBackend
from tests.gateway.harness import ThreadedGateway

pytestmark = pytest.mark.timeout(120)

CONNECTION_TYPES = (ClientConnection, ClientParser, UpstreamConnection, UpstreamParser, ReadWaiter)
CHAT = "/v1/chat/completions"
BODY = json.dumps({"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}).encode()


def _answered(sock: socket.socket) -> bytes:
    """Read until the gateway closes the connection or one answer's head has come."""
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            piece = sock.recv(65536)
            if not piece:
                break
            data += piece
    except OSError:
        pass
    return data


def warm_request_then_close(port: int) -> None:
    sock = connect(port, timeout=10)
    sock.sendall(request_bytes("POST", CHAT, BODY))
    assert _answered(sock).startswith(b"HTTP/1.1 200")
    sock.close()


def too_many_headers(port: int) -> None:
    sock = connect(port, timeout=10)
    sock.sendall(request_bytes("POST", CHAT, BODY, headers={f"X-A{n}": "v" * 300 for n in range(101)}))
    assert _answered(sock).startswith(b"HTTP/1.1 431")
    sock.close()


def malformed_request_line(port: int) -> None:
    sock = connect(port, timeout=10)
    sock.sendall(b"GARBAGE\r\n\r\n")
    assert _answered(sock).startswith(b"HTTP/1.1 400")
    sock.close()


def pipelined_pair(port: int) -> None:
    sock = connect(port, timeout=10)
    sock.sendall(request_bytes("POST", CHAT, BODY) * 2)
    assert _answered(sock).startswith(b"HTTP/1.1 200")
    sock.close()


def hang_up_mid_body(port: int) -> None:
    sock = connect(port, timeout=10)
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"
                 % CHAT.encode())
    sock.close()


def reset_mid_head(port: int) -> None:
    sock = connect(port, timeout=10)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: g")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
    sock.close()


ENDINGS: list[Callable[[int], None]] = [warm_request_then_close, too_many_headers, malformed_request_line,
                                        pipelined_pair, hang_up_mid_body, reset_mid_head]


@pytest.fixture
def gateway() -> Iterator[ThreadedGateway]:
    backend = FakeBackend().start()
    gw = ThreadedGateway(GatewayConfig(backend_url=backend.url, served_model_name="test-model", listen_host="127.0.0.1",
                                       listen_port=0, admin_port=0, scaler_mode="off", probe_interval_seconds=0.05,
                                       probe_timeout_seconds=0.5)).start()
    try:
        yield gw
    finally:
        gw.stop()
        backend.stop()


def cyclic_connection_objects(play: Callable[[], None]) -> dict[str, int]:
    """The gateway's connection objects the cyclic GC finds as garbage after ``play``."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        play()
        gc.collect()
        found: dict[str, int] = {}
        for obj in gc.garbage:
            if isinstance(obj, CONNECTION_TYPES):
                found[type(obj).__name__] = found.get(type(obj).__name__, 0) + 1
        return found
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


@pytest.mark.parametrize("ending", ENDINGS, ids=[e.__name__ for e in ENDINGS])
def test_a_closed_connection_leaves_no_cycle(gateway: ThreadedGateway, ending: Callable[[int], None]) -> None:
    warm_request_then_close(gateway.port)  # the backend known ready, the pool warm, lazy imports done

    def play() -> None:
        for _ in range(8):
            ending(gateway.port)
        wait_for(lambda: gateway.call(lambda: len(gateway.server.connections)) == 0, 10, 0.02, "connections closed")

    assert cyclic_connection_objects(play) == {}


def test_closed_backend_connections_leave_no_cycle(gateway: ThreadedGateway) -> None:
    def play() -> None:
        for _ in range(4):
            warm_request_then_close(gateway.port)
        gateway.call(lambda: gateway.server.app.backends.clear())  # the pooled backend connections closed

    assert cyclic_connection_objects(play) == {}
