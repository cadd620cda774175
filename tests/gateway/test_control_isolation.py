"""Control traffic isolated (issue 38): the admin port (kubelet probes, scrapes) and the in-process
ExternalScaler (KEDA) are served from the control thread's own hub (gateway.control), so

- idle connections from one address cannot take either port's pool from another address;
- a worker loop kept busy by a greenlet that never yields does not keep them waiting: they are
  answered while it provably still runs;
- an idle control thread has no timer (its loop does not wake).

Real sockets on 127.0.0.x, a real grpc channel; no assertion on how long anything took.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import gevent
import pytest

from gateway.server import ADMIN_MAX_CONNECTIONS
from gateway.workers import _start_h2_scaler
from scaler import externalscaler_pb2 as pb
from scaler import externalscaler_pb2_grpc as pb_grpc
from scaler.h2server import MAX_CONNECTIONS as SCALER_MAX_CONNECTIONS
from tests.gateway.conftest import wait_for
from tests.gateway.harness import ThreadedGateway
from tests.ports import free_port

REF = pb.ScaledObjectRef(name="qwen", namespace="models", scalerMetadata={"scalerAddress": "x:9090"})
FLOOD_SOURCE = "127.0.0.2"  # the idle connections' address; the probes come from 127.0.0.1
PER_ADDRESS = 8  # the default control_connections_per_address


def connect(port: int, source: str, timeout: float = 10.0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def probe(port: int, path: bytes = b"/healthz", timeout: float = 20.0) -> bytes:
    """One request on a fresh connection from 127.0.0.1; the whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


def closed_by_peer(sock: socket.socket) -> bool:
    """The server closed this connection (with or without an answer first)."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


@pytest.fixture
def gateway_with_scaler(backend, make_gateway) -> Iterator[Callable[..., tuple[ThreadedGateway, int]]]:
    """A gateway whose control thread also serves the ExternalScaler, wired as a one-worker Pod's."""
    steps: list[Callable[[], None]] = []

    def make(**overrides: Any) -> tuple[ThreadedGateway, int]:
        port = free_port()
        gw = make_gateway(backend, scaler_port=port, **overrides)
        assert gw.server is not None and gw.server.control is not None
        steps.extend(_start_h2_scaler(gw.config, gw.broadcaster, gw.server.control))
        return gw, port

    yield make
    for step in steps:
        step()


def held_flood(port: int, count: int) -> tuple[list[socket.socket], int]:
    """``count`` idle connections from FLOOD_SOURCE. Returns the ones still open once the server has
    decided about each (it closes those over the per-address cap at once), and how many it closed."""
    flood = [connect(port, FLOOD_SOURCE) for _ in range(count)]
    for sock in flood:
        sock.settimeout(0.2)
    kept, closed = [], 0
    for sock in flood:
        try:
            # Over the cap: closed at once (the admin port answers 429 first). Within it: nothing.
            closed_by_peer(sock)
            closed += 1
            sock.close()
        except TimeoutError:
            kept.append(sock)
    return kept, closed


def test_idle_connections_from_one_address_leave_the_admin_port_to_the_others(backend, make_gateway) -> None:
    gw = make_gateway(backend, admin_idle_timeout_seconds=120.0)  # the flood stays for the whole test
    port = gw.server.admin_port
    count = ADMIN_MAX_CONNECTIONS + 16  # more than the whole pool
    kept, closed = held_flood(port, count)
    try:
        # What the old admin port did: every one of them held a slot until the pool was full.
        assert (len(kept), closed) == (PER_ADDRESS, count - PER_ADDRESS)
        admin = gw.server.admin
        assert gw.server.control.call(lambda: admin.addresses.counts) == {FLOOD_SOURCE: PER_ADDRESS}
        assert probe(port).startswith(b"HTTP/1.1 200")  # the kubelet, from another address
        assert b'"queued"' in probe(port, b"/noctaya/queue")
        assert gw.server.control.call(lambda: admin.addresses.counts) == {FLOOD_SOURCE: PER_ADDRESS}  # still held
    finally:
        for sock in kept:
            sock.close()


def test_idle_connections_from_one_address_leave_the_scaler_port_to_keda(gateway_with_scaler, channel_factory,
                                                                          monkeypatch) -> None:
    import scaler.h2server

    monkeypatch.setattr(scaler.h2server, "HANDSHAKE_SECONDS", 300.0)  # the flood stays for the whole test
    gw, port = gateway_with_scaler()
    count = SCALER_MAX_CONNECTIONS + 16
    kept, closed = held_flood(port, count)
    try:
        assert (len(kept), closed) == (PER_ADDRESS, count - PER_ADDRESS)
        stub = pb_grpc.ExternalScalerStub(channel_factory(port))
        assert stub.IsActive(REF, timeout=20).result is False
        for sock in kept:  # the flood's connections are still open (their SETTINGS read): KEDA got in beside them
            with pytest.raises(TimeoutError):
                sock.recv(1)
    finally:
        for sock in kept:
            sock.close()


def test_an_admin_connection_without_a_head_is_closed_after_the_idle_time(backend, make_gateway) -> None:
    gw = make_gateway(backend, admin_idle_timeout_seconds=0.3)
    port = gw.server.admin_port
    with connect(port, FLOOD_SOURCE, timeout=30) as silent, connect(port, FLOOD_SOURCE, timeout=30) as partial:
        partial.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
        assert silent.recv(65536) == b""  # closed without an answer: it asked nothing
        answer = partial.recv(65536)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
    admin = gw.server.admin
    wait_for(lambda: gw.server.control.call(lambda: not admin.watch.connections), what="admin connections gone")


class Spinner:
    """A greenlet on the worker's hub that runs CPU without yielding until told to stop (or until
    ``budget`` seconds of its thread's CPU, a safety net): while it runs, nothing else on that hub
    can. ``ended`` turns True only when it stops."""

    def __init__(self, budget: float = 30.0) -> None:
        self.budget = budget
        self.started = threading.Event()
        self.stop = False
        self.ended = False
        self.cpu = 0.0

    def run(self) -> None:
        began = time.thread_time()
        self.started.set()
        while not self.stop and time.thread_time() - began < self.budget:
            sum(range(1000))
        self.cpu = time.thread_time() - began
        self.ended = True


def test_probes_and_keda_are_answered_while_the_worker_loop_is_busy(gateway_with_scaler, channel_factory) -> None:
    gw, port = gateway_with_scaler()
    stub = pb_grpc.ExternalScalerStub(channel_factory(port))  # connected before the loop is taken
    spinner = Spinner()
    gw.call(lambda: gevent.spawn(spinner.run))
    assert spinner.started.wait(20)
    answers: list[tuple[str, bool]] = []
    try:
        for _ in range(3):
            health = probe(gw.server.admin_port)
            answers.append(("healthz", spinner.ended))
            assert health.startswith(b"HTTP/1.1 200"), health[:100]
            assert stub.IsActive(REF, timeout=20).result is False
            answers.append(("IsActive", spinner.ended))
            assert stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=REF, metricName=gw.config.metric_name),
                                   timeout=20).metricValues is not None
            answers.append(("GetMetrics", spinner.ended))
        # The worker's own port is not answered meanwhile: the loop is provably held.
        with socket.create_connection(("127.0.0.1", gw.port), timeout=20) as public:
            public.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            public.settimeout(0.5)
            with pytest.raises(TimeoutError):
                public.recv(1)
            answers.append(("public still waiting", spinner.ended))
            spinner.stop = True
            public.settimeout(20)
            assert public.recv(65536).startswith(b"HTTP/1.1 200")  # served once the loop is free
    finally:
        spinner.stop = True
    wait_for(lambda: spinner.ended, what="the spinner's end")
    assert answers == [(what, False) for what, _ in answers]  # every answer came while it spun


def test_an_idle_control_thread_does_not_wake(gateway_with_scaler, channel_factory) -> None:
    gw, port = gateway_with_scaler()
    stub = pb_grpc.ExternalScalerStub(channel_factory(port))
    assert stub.IsActive(REF, timeout=20).result is False
    assert probe(gw.server.admin_port).startswith(b"HTTP/1.1 200")
    control, admin = gw.server.control, gw.server.admin
    # The probe's connection has gone and the admin watchdog parked: nothing left to watch.
    wait_for(lambda: control.call(lambda: not admin.watch.connections and admin.watch._arrived.linkcount() == 1),
             what="the admin watchdog parked")
    loop = control.hub.loop
    # Seconds of an idle Pod (KEDA's channel open, no call). The tail of the last call and of the
    # probe's connection may still take a turn of the loop in the first one; a timer would wake it in
    # every one of them.
    quiet = []
    for _ in range(5):
        before = loop.iteration
        threading.Event().wait(1.0)
        quiet.append(loop.iteration == before)
        if quiet[-1]:
            break
    assert quiet[-1], "the idle control loop woke in every second"
