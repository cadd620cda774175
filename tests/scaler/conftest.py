from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from scaler import externalscaler_pb2_grpc as pb_grpc
from scaler.demand import DemandBroadcaster
from scaler.externalscaler import ExternalScalerServicer
from scaler.service import ScalerServer, ScalerSettings, start_scaler_server
from scaler.tls import TLSFiles


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


class H2ServerThread:
    """``scaler.h2server`` on a gevent hub of its own OS thread (as in the gateway, where it shares the
    gateway's loop), driven from the test's plain threads: same ``port``/``servicer``/``stop`` as
    grpcio's ScalerServer."""

    def __init__(self, source: DemandBroadcaster, port: int, settings: ScalerSettings,
                 tls: TLSFiles | None = None, **kwargs: Any) -> None:
        self._stop_grace: float | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._server: Any = None
        self._thread = threading.Thread(target=self._run, args=(source, port, settings, tls, kwargs),
                                        name="h2-scaler-hub", daemon=True)
        self._thread.start()
        assert self._started.wait(30), "h2 scaler did not start"
        if self._error is not None:
            raise self._error

    def _run(self, source: DemandBroadcaster, port: int, settings: ScalerSettings, tls: TLSFiles | None,
             kwargs: dict[str, Any]) -> None:
        import gevent

        from scaler.h2server import start_h2_scaler_server

        try:
            self._server = start_h2_scaler_server(source, port, host="127.0.0.1", settings=settings, tls=tls, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the starting thread
            self._error = exc
            self._started.set()
            return
        self._started.set()
        while self._stop_grace is None:
            gevent.sleep(0.02)
        self._server.stop(self._stop_grace)

    @property
    def port(self) -> int:
        return self._server.port

    @property
    def servicer(self) -> ExternalScalerServicer:
        return self._server.servicer

    def stop(self, grace: float = 5.0) -> None:
        if self._stop_grace is None and self._thread.is_alive():
            self._stop_grace = grace
            self._thread.join(grace + 10.0)


@pytest.fixture(params=["grpcio", "h2"])
def scaler_host(request: pytest.FixtureRequest) -> str:
    """Which server hosts the ExternalScaler: grpcio (aggregate scaler, multi-worker gateways) or
    h2 on a gevent loop (one-worker gateways). Tests about one host's internals parametrize it."""
    return request.param


def start_scaler(host: str, source: DemandBroadcaster, port: int = 0, *, settings: ScalerSettings | None = None,
                 tls: TLSFiles | None = None, **kwargs: Any) -> ScalerServer | H2ServerThread:
    settings = settings or ScalerSettings()
    if host == "h2":
        return H2ServerThread(source, port, settings, tls, **kwargs)
    return start_scaler_server(source, port, host="127.0.0.1", settings=settings, tls=tls, **kwargs)


@pytest.fixture
def start_server(scaler_host: str) -> Iterator[Callable[..., ScalerServer | H2ServerThread]]:
    servers: list[ScalerServer | H2ServerThread] = []

    def start(source: DemandBroadcaster, port: int = 0, **settings: object) -> ScalerServer | H2ServerThread:
        server = start_scaler(scaler_host, source, port, settings=ScalerSettings(**settings))  # type: ignore[arg-type]
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


REPORT_TOKEN = "reporter-token-0123456789"


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    """A demand-report token file holding REPORT_TOKEN."""
    path = tmp_path / "token"
    path.write_text(REPORT_TOKEN)
    return path
