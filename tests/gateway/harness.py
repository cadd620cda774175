"""A gateway worker in its own OS thread and gevent hub, for tests and benchmarks that live in an
unpatched process (the shipped entry point is ``python -m gateway``: a supervisor and forked
workers). Interact over HTTP; read state via ``call()`` (runs in the hub thread)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import gevent

from gateway.backends import endpoint_feed
from gateway.config import GatewayConfig
from gateway.routes import GatewayApp
from gateway.server import GatewayServer, listen_socket
from gateway.state.pod import DemandSampler, PodState
from scaler.demand import DemandBroadcaster

__all__ = ["ThreadedGateway", "exchange"]


class ThreadedGateway:
    def __init__(self, config: GatewayConfig, broadcaster: DemandBroadcaster | None = None,
                 app_factory: Callable[[], Any] | None = None, feed_environ: dict[str, str] | None = None) -> None:
        """``feed_environ``: the env a Pod's endpoint source reads (KUBERNETES_SERVICE_HOST, ...), for a
        gateway with ``endpoint_source="endpointslices"``; the feed is made in the hub thread."""
        self.feed_environ = feed_environ
        self.feed: Any = None
        self.config = config
        self._app_factory = app_factory  # another app than one model's GatewayApp (a shared gateway)
        self.broadcaster = broadcaster or DemandBroadcaster()
        self.pod = PodState(1, config.max_queue, config.max_held_body_bytes)
        self.sampler = DemandSampler(self.pod, self.broadcaster, interval=0.05)
        self._ready = threading.Event()
        self._stop_requested = threading.Event()
        self._error: BaseException | None = None
        self.server: GatewayServer | None = None
        self._hub: Any = None
        self._thread = threading.Thread(target=self._run, name="gateway-hub", daemon=True)

    def _run(self) -> None:
        try:
            self._hub = gevent.get_hub()
            namespace = ""
            if self.feed_environ is not None:
                self.feed, namespace = endpoint_feed(self.config, self.feed_environ)
            if self._app_factory is None:
                app = GatewayApp(self.config, pod=self.pod, feed=self.feed, namespace=namespace)
            elif self.feed_environ is not None:  # a factory of an app that follows the feed: (feed, namespace)
                app = self._app_factory(self.feed, namespace)
            else:
                app = self._app_factory()
            listener = listen_socket(self.config.listen_host, self.config.listen_port, reuse_port=False)
            admin = listen_socket(self.config.listen_host, self.config.admin_port, reuse_port=False)
            self.server = GatewayServer(app, listener, max_connections=self.config.max_connections, admin_listener=admin)
            self.server.start()
        except BaseException as exc:  # reported to the starting thread
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        while not self._stop_requested.is_set():
            gevent.sleep(0.05)
        self.server.stop(timeout=1.0)
        if self.feed is not None:
            self.feed.close()

    def start(self, timeout: float = 10.0) -> ThreadedGateway:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("gateway did not start")
        if self._error is not None:
            raise self._error
        self.sampler.start()
        return self

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        """The admin port: /metrics and /noctaya/queue."""
        assert self.server is not None and self.server.admin_port is not None
        return f"http://127.0.0.1:{self.server.admin_port}"

    @property
    def app(self) -> GatewayApp:
        assert self.server is not None
        return self.server.app

    def call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run ``fn`` in the hub thread and return its result."""
        done = threading.Event()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = exc
            done.set()

        self._hub.loop.run_callback_threadsafe(run)
        if not done.wait(timeout):
            raise TimeoutError("hub call timed out")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def stop(self) -> None:
        self._stop_requested.set()
        self._thread.join(10)
        self.sampler.stop()


def exchange(port: int, head: bytes, body: bytes = b"", *, timeout: float = 5.0) -> tuple[float, bytes]:
    """Send ``head`` (and ``body``, if any) on a fresh connection to 127.0.0.1 and read until the
    gateway closes it; returns the seconds that took and every byte received. A head that declares a
    body which is never sent shows whether the answer waited for it: it would then take ``timeout``."""
    started = time.monotonic()
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head + body)
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except (TimeoutError, ConnectionResetError):
            pass  # a reset after the answer (unread bytes) loses nothing already received
    return time.monotonic() - started, received
