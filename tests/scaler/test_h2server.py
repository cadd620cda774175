"""The h2 host of the ExternalScaler under clients that are not KEDA: every bound it advertises, at
its limit, and malformed or silent peers. Well-behaved calls are tested for both hosts in
test_service.py and test_tls.py; here a raw HTTP/2 client (h2, client side) sends what grpc never would."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import grpc
import pytest
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    ResponseReceived,
    StreamEnded,
    StreamReset,
    TrailersReceived,
)
from h2.settings import SettingCodes, Settings

from scaler import externalscaler_pb2 as pb
from scaler import externalscaler_pb2_grpc as pb_grpc
from scaler import h2server
from scaler.demand import Demand, DemandBroadcaster
from scaler.externalscaler import ScalerSettings

from .conftest import H2ServerThread, wait_until

REF = pb.ScaledObjectRef(name="qwen", namespace="models")
IS_ACTIVE = "/externalscaler.ExternalScaler/IsActive"
STREAM_IS_ACTIVE = "/externalscaler.ExternalScaler/StreamIsActive"
GET_METRICS = "/externalscaler.ExternalScaler/GetMetrics"


def grpc_frame(message: bytes, *, compressed: bool = False, declared: int | None = None) -> bytes:
    length = len(message) if declared is None else declared
    return bytes([1 if compressed else 0]) + length.to_bytes(4, "big") + message


class RawClient:
    """An HTTP/2 client that sends exactly what a test says."""

    def __init__(self, port: int, settings: dict[int, int] | None = None) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.conn = H2Connection(H2Configuration(client_side=True, header_encoding="utf-8"))
        if settings:
            self.conn.local_settings = Settings(client=True, initial_values=settings)
        self.conn.initiate_connection()
        self.sock.sendall(self.conn.data_to_send())
        self.responses: dict[int, dict[str, Any]] = {}
        self.terminated = False

    def call(self, path: str, body: bytes = b"", *, method: str = "POST",
             content_type: str | None = "application/grpc") -> int:
        stream_id = self.conn.get_next_available_stream_id()
        headers = [(":method", method), (":scheme", "http"), (":authority", "scaler"), (":path", path)]
        if content_type:
            headers.append(("content-type", content_type))
        self.conn.send_headers(stream_id, headers, end_stream=not body)
        if body:
            self.conn.send_data(stream_id, body, end_stream=True)
        self.sock.sendall(self.conn.data_to_send())
        self.responses[stream_id] = {"headers": {}, "data": b"", "ended": False, "reset": None}
        return stream_id

    def pump(self, until: Any, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out; responses so far: {self.responses}")
            self.sock.settimeout(left)
            data = self.sock.recv(65536)
            if not data:
                self.terminated = True
                return
            for event in self.conn.receive_data(data):
                response = self.responses.get(getattr(event, "stream_id", 0) or 0)
                if isinstance(event, (ResponseReceived, TrailersReceived)) and response is not None:
                    response["headers"].update(dict(event.headers))
                elif isinstance(event, DataReceived):
                    self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    if response is not None:
                        response["data"] += event.data
                elif isinstance(event, StreamEnded) and response is not None:
                    response["ended"] = True
                elif isinstance(event, StreamReset) and response is not None:
                    response["reset"] = event.error_code
                elif isinstance(event, ConnectionTerminated):
                    self.terminated = True
            self.sock.sendall(self.conn.data_to_send())

    def answer(self, stream_id: int, timeout: float = 5.0) -> dict[str, Any]:
        response = self.responses[stream_id]
        self.pump(lambda: response["ended"] or response["reset"] is not None or self.terminated, timeout)
        return response

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def h2_server():
    servers: list[H2ServerThread] = []

    def start(source: DemandBroadcaster | None = None, **kwargs: Any) -> H2ServerThread:
        server = H2ServerThread(source or DemandBroadcaster(), 0, ScalerSettings(**kwargs.pop("settings", {})), **kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(1.0)


def sized_ref(size: int) -> pb.ScaledObjectRef:
    """A ScaledObjectRef whose encoding is exactly ``size`` bytes (trigger metadata padded)."""
    pad = size
    while True:
        ref = pb.ScaledObjectRef(name="m", namespace="ns", scalerMetadata={"pad": "x" * pad})
        over = ref.ByteSize() - size
        if over == 0:
            return ref
        pad -= over


def test_a_request_at_the_message_limit_is_served_and_one_byte_more_is_refused(h2_server) -> None:
    server = h2_server(DemandBroadcaster(Demand(queued=1)))
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExternalScalerStub(channel)
        assert stub.IsActive(sized_ref(h2server.MAX_MESSAGE_BYTES), timeout=10).result is True
        with pytest.raises(grpc.RpcError) as err:
            stub.IsActive(sized_ref(h2server.MAX_MESSAGE_BYTES + 1), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert stub.IsActive(REF, timeout=10).result is True  # the connection still serves


def test_what_grpc_never_sends_gets_a_clear_answer_and_the_connection_keeps_serving(h2_server) -> None:
    server = h2_server(DemandBroadcaster(Demand(queued=1)))
    client = RawClient(server.port)
    try:
        ref = REF.SerializeToString()
        cases = [
            (client.call("/", method="GET", content_type=None), {":status": "415"}),
            (client.call("/externalscaler.ExternalScaler/Nope", grpc_frame(ref)), {"grpc-status": "12"}),
            (client.call("/other.Service/IsActive", grpc_frame(ref)), {"grpc-status": "12"}),
            (client.call(IS_ACTIVE, grpc_frame(ref, compressed=True)), {"grpc-status": "12"}),
            (client.call(IS_ACTIVE, grpc_frame(ref, declared=len(ref) + 3)), {"grpc-status": "3"}),
            (client.call(IS_ACTIVE, grpc_frame(b"\xff\xff\xff")), {"grpc-status": "3"}),
            (client.call(IS_ACTIVE, b""), {"grpc-status": "3"}),
            (client.call(IS_ACTIVE, grpc_frame(ref) + grpc_frame(ref)), {"grpc-status": "3"}),
        ]
        for stream_id, expected in cases:
            response = client.answer(stream_id)
            assert response["ended"] and expected.items() <= response["headers"].items(), (expected, response)
            assert response["data"] == b""
        ok = client.answer(client.call(IS_ACTIVE, grpc_frame(ref)))
        assert ok["headers"].get("grpc-status") == "0"
        assert pb.IsActiveResponse.FromString(ok["data"][5:]).result is True
        assert not client.terminated
    finally:
        client.close()


def test_bytes_that_are_not_http2_close_only_their_own_connection(h2_server) -> None:
    server = h2_server()
    bad = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    bad.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    received = b""
    while chunk := bad.recv(65536):  # the server's SETTINGS, a GOAWAY, then the close
        received += chunk
    bad.close()
    assert received  # it said something (a GOAWAY) before closing, rather than hanging
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        assert pb_grpc.ExternalScalerStub(channel).IsActive(REF, timeout=10).result is False


def test_connections_are_bounded_and_silent_ones_are_closed(h2_server, monkeypatch) -> None:
    monkeypatch.setattr(h2server, "HANDSHAKE_SECONDS", 1.5)
    server = h2_server(max_connections=3)
    silent = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(3)]
    try:
        time.sleep(0.2)
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.ExternalScalerStub(channel)
            with pytest.raises(grpc.RpcError) as err:  # every slot is taken by a silent peer
                stub.IsActive(REF, timeout=0.5)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            started = time.monotonic()
            for sock in silent:  # each is closed once its preface is overdue
                while sock.recv(65536):
                    pass
            assert time.monotonic() - started < 5.0
            assert stub.IsActive(REF, timeout=10).result is False  # the slots are free again
    finally:
        for sock in silent:
            sock.close()


def test_a_stream_whose_client_grants_no_window_is_reset_and_frees_its_slot(h2_server, monkeypatch) -> None:
    monkeypatch.setattr(h2server, "WRITE_TIMEOUT_SECONDS", 0.5)
    server = h2_server(DemandBroadcaster(Demand(queued=1)), settings={"max_streams": 1})
    client = RawClient(server.port, settings={SettingCodes.INITIAL_WINDOW_SIZE: 0})
    try:
        stream_id = client.call(STREAM_IS_ACTIVE, grpc_frame(REF.SerializeToString()))
        response = client.answer(stream_id, timeout=5)
        assert response["reset"] is not None and response["data"] == b"", response
        assert wait_until(lambda: server.servicer.open_streams == 0, timeout=5)
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:  # the one slot is free again
            stream = pb_grpc.ExternalScalerStub(channel).StreamIsActive(REF, timeout=10)
            assert next(stream).result is True
            stream.cancel()
    finally:
        client.close()


def test_a_peer_that_vanishes_mid_stream_frees_its_slot(h2_server) -> None:
    server = h2_server(settings={"max_streams": 2, "wait_slice": 30.0})  # only the close can wake them
    client = RawClient(server.port)
    ids = [client.call(STREAM_IS_ACTIVE, grpc_frame(REF.SerializeToString())) for _ in range(2)]
    client.pump(lambda: all(client.responses[i]["data"] for i in ids))
    assert server.servicer.open_streams == 2
    client.sock.shutdown(socket.SHUT_RDWR)
    client.close()
    assert wait_until(lambda: server.servicer.open_streams == 0, timeout=5)


def test_a_poll_is_one_write_however_many_streams_are_held(h2_server, monkeypatch) -> None:
    """Issue 29: KEDA polls every member of a shared gateway over one connection that also holds a
    StreamIsActive stream per member. Each IsActive / GetMetrics is answered in one write (headers,
    message and trailers together), and the held idle streams write nothing meanwhile: the cost of a
    poll does not grow with the members. (Counts writes, not time.)"""
    writes: list[int] = []
    real = H2Connection.data_to_send

    def counted(self: H2Connection, amount: int | None = None) -> bytes:
        data = real(self, amount)
        if data and threading.current_thread().name == "h2-scaler-hub":  # the server's side only
            writes.append(len(data))
        return data

    monkeypatch.setattr(H2Connection, "data_to_send", counted)
    client = RawClient(h2_server().port)
    try:
        held = [client.call(STREAM_IS_ACTIVE, grpc_frame(pb.ScaledObjectRef(name=f"m{i}", namespace="ns")
                                                         .SerializeToString())) for i in range(100)]
        client.pump(lambda: all(client.responses[s]["data"] for s in held))  # each stream's first state
        writes.clear()
        metrics = pb.GetMetricsRequest(scaledObjectRef=REF, metricName="noctaya-demand").SerializeToString()
        for _ in range(10):
            for path, body in ((IS_ACTIVE, REF.SerializeToString()), (GET_METRICS, metrics)):
                answer = client.answer(client.call(path, grpc_frame(body)))
                assert answer["headers"].get("grpc-status") == "0", answer
        assert len(writes) == 20, writes
        assert not any(client.responses[s]["ended"] for s in held)
    finally:
        client.close()
