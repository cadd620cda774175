"""Fixtures: a fake OpenAI-compatible backend and gateways running in their own gevent hub thread."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from gateway.config import GatewayConfig
from scaler.demand import DemandBroadcaster
from tests.gateway.fakebackend import FakeBackend
from tests.gateway.harness import ThreadedGateway


def wait_for(predicate: Callable[[], Any], timeout: float = 15.0, interval: float = 0.01, what: str = "") -> Any:
    """Poll a condition with a deadline (generous: CI machines are loaded)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(interval)


@pytest.fixture
def backend() -> Iterator[FakeBackend]:
    b = FakeBackend()
    yield b
    b.stop()


@pytest.fixture
def make_gateway() -> Iterator[Callable[..., ThreadedGateway]]:
    started: list[ThreadedGateway] = []

    def make(backend: FakeBackend, broadcaster: DemandBroadcaster | None = None, **overrides: Any) -> ThreadedGateway:
        settings: dict[str, Any] = {
            "backend_url": backend.url,
            "served_model_name": "test-model",
            "listen_host": "127.0.0.1",
            "listen_port": 0,
            "admin_port": 0,
            "max_queue": 8,
            "activation_timeout_seconds": 10.0,
            "ready_grace_seconds": 0.5,
            "heartbeat_seconds": 0.2,
            "scaler_mode": "off",
            "probe_interval_seconds": 0.05,
            "probe_timeout_seconds": 0.5,
        }
        settings.update(overrides)
        gw = ThreadedGateway(GatewayConfig(**settings), broadcaster).start()
        started.append(gw)
        return gw

    yield make
    for gw in started:
        gw.stop()


@pytest.fixture
def channel_factory() -> Iterator[Callable[[int], grpc.Channel]]:
    """Ready gRPC channels to 127.0.0.1 ports, closed after the test."""
    channels: list[grpc.Channel] = []

    def make(port: int) -> grpc.Channel:
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(ch).result(timeout=20)
        channels.append(ch)
        return ch

    yield make
    for ch in channels:
        ch.close()
