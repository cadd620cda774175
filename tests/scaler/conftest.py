from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from scaler import externalscaler_pb2_grpc as pb_grpc
from scaler.demand import DemandBroadcaster
from scaler.service import ScalerServer, ScalerSettings, start_scaler_server


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.005) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@pytest.fixture
def broadcaster() -> DemandBroadcaster:
    return DemandBroadcaster()


@pytest.fixture
def start_server() -> Iterator[Callable[..., ScalerServer]]:
    servers: list[ScalerServer] = []

    def start(source: DemandBroadcaster, **settings: object) -> ScalerServer:
        server = start_scaler_server(source, 0, host="127.0.0.1", settings=ScalerSettings(**settings))
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(1.0)


@pytest.fixture
def open_stub() -> Iterator[Callable[[int], pb_grpc.ExternalScalerStub]]:
    channels: list[grpc.Channel] = []

    def open_(port: int) -> pb_grpc.ExternalScalerStub:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        channels.append(channel)
        return pb_grpc.ExternalScalerStub(channel)

    yield open_
    for channel in channels:
        channel.close()
