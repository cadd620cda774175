"""The ExternalScaler (``scaler.externalscaler``) served by grpcio: the aggregate scaler, and the
scaler child of a multi-worker gateway (``python -m scaler local``, see gateway/scaler_process.py).

Unary calls run on a small pool and streams on their own pool, so open streams can never take a
unary thread (if a grpcio without the per-handler pool hook is installed, one pool of
``max_streams + unary_workers`` is used).

In a gevent-monkey-patched process grpc must run in gevent mode
(``grpc.experimental.gevent.init_gevent()``, done by ``start_scaler_server``): grpc's pool
"threads" are then greenlets that wait on the broadcaster cooperatively. The gateway does not use
that mode (grpc's gevent mode costs about twice the CPU per call; a one-worker gateway serves the
scaler with h2 on its own loop instead, ``scaler.h2server``); it stays supported and tested for
embedding the scaler in another gevent program.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

from scaler import externalscaler_pb2 as pb
from scaler import externalscaler_pb2_grpc as pb_grpc
from scaler.demand import DemandBroadcaster
from scaler.externalscaler import (
    ExternalScalerServicer,
    ScalerCollector,
    ScalerSettings,
    Status,
    validate_metric_name,
)
from scaler.tls import CertificateListener, TLSFiles, server_credentials

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

__all__ = [
    "ExternalScalerServicer",
    "GrpcioServicer",
    "ScalerServer",
    "ScalerSettings",
    "ensure_grpc_gevent_compat",
    "start_scaler_server",
    "validate_metric_name",
]

log = logging.getLogger("noctaya.scaler")


class _GrpcioContext:
    """grpc's context behind the servicer's RpcContext: our status codes become grpc's."""

    __slots__ = ("_context",)

    def __init__(self, context: grpc.ServicerContext) -> None:
        self._context = context

    def abort(self, code: Status, details: str) -> NoReturn:
        self._context.abort(grpc.StatusCode[code.name], details)
        raise AssertionError("grpc's abort returned")  # pragma: no cover - it always raises

    def is_active(self) -> bool:
        return self._context.is_active()

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return self._context.add_callback(callback)


class GrpcioServicer(pb_grpc.ExternalScalerServicer):
    """The servicer's RPCs as grpcio calls them. grpcio's sync server holds one pool thread per
    open stream, so with ``stream_pool`` StreamIsActive runs on a pool of its own (grpcio's
    per-handler ``experimental_thread_pool`` hook) and unary calls on a small separate one: streams
    can never take a unary thread."""

    def __init__(self, logic: ExternalScalerServicer, stream_pool: futures.ThreadPoolExecutor | None = None) -> None:
        self.logic = logic
        if stream_pool is not None:
            self.StreamIsActive = _on_pool(self.StreamIsActive, stream_pool)  # type: ignore[method-assign]

    def IsActive(self, request: pb.ScaledObjectRef, context: grpc.ServicerContext) -> pb.IsActiveResponse:
        return self.logic.IsActive(request, _GrpcioContext(context))

    def GetMetricSpec(self, request: pb.ScaledObjectRef, context: grpc.ServicerContext) -> pb.GetMetricSpecResponse:
        return self.logic.GetMetricSpec(request, _GrpcioContext(context))

    def GetMetrics(self, request: pb.GetMetricsRequest, context: grpc.ServicerContext) -> pb.GetMetricsResponse:
        return self.logic.GetMetrics(request, _GrpcioContext(context))

    def StreamIsActive(self, request: pb.ScaledObjectRef,
                       context: grpc.ServicerContext) -> Iterator[pb.IsActiveResponse]:
        return self.logic.StreamIsActive(request, _GrpcioContext(context))

    def StreamMetricSpec(self, request: pb.ScaledObjectRef,
                         context: grpc.ServicerContext) -> Iterator[pb.GetMetricSpecResponse]:
        return self.logic.StreamMetricSpec(request, _GrpcioContext(context))


def _on_pool(handler: Callable[..., Any], pool: futures.ThreadPoolExecutor) -> Callable[..., Any]:
    def behaviour(request: Any, context: grpc.ServicerContext) -> Any:
        return handler(request, context)

    behaviour.experimental_thread_pool = pool  # type: ignore[attr-defined]
    return behaviour


def _per_method_pools_supported() -> bool:
    """grpcio's (experimental) per-handler pool hook, present since 1.5x; checked, not assumed."""
    from grpc import _server

    return hasattr(_server, "_select_thread_pool_for_behavior")


def ensure_grpc_gevent_compat() -> bool:
    """Switch grpc to gevent mode when the process is monkey-patched; True if it is in gevent mode.

    Must run before any grpc channel or server exists in the process. Idempotent.
    """
    monkey = sys.modules.get("gevent.monkey")
    if monkey is None or not monkey.is_module_patched("threading"):
        return False
    global _GEVENT_INITIALISED
    if not _GEVENT_INITIALISED:
        from grpc.experimental import gevent as grpc_gevent

        grpc_gevent.init_gevent()
        _GEVENT_INITIALISED = True
    return True


_GEVENT_INITIALISED = False
_REFUSAL_THREADS = 4


class ScalerServer:
    """A running ExternalScaler gRPC server."""

    def __init__(self, server: grpc.Server, servicer: ExternalScalerServicer, port: int,
                 pools: Sequence[futures.ThreadPoolExecutor] = ()) -> None:
        self._server = server
        self.servicer = servicer
        self.port = port
        self._pools = tuple(pools)
        self._stopped = False

    def stop(self, grace: float = 5.0) -> None:
        """End open streams with OK, let in-flight unary calls finish within ``grace``, then close."""
        if self._stopped:
            return
        self._stopped = True
        self.servicer.begin_shutdown()
        # Wait (bounded by grace) for the streams to return before grpc's own stop, which would
        # cancel whatever is still running. Interrupt again each round: a stream that was between
        # its stop check and its wait when the first interrupt went out is caught by the next.
        deadline = time.monotonic() + max(0.0, grace)
        while self.servicer.open_streams and time.monotonic() < deadline:
            time.sleep(0.01)
            self.servicer.begin_shutdown()
        self._server.stop(max(0.0, deadline - time.monotonic())).wait(grace + 1.0)
        for pool in self._pools:  # release the idle worker threads
            pool.shutdown(wait=False, cancel_futures=True)

    def wait(self, timeout: float | None = None) -> bool:
        return self._server.wait_for_termination(timeout)

    def collector(self) -> Collector:
        """Prometheus collector of this server's stream/push/error counts (register it where the
        process exposes /metrics)."""
        return ScalerCollector(self.servicer)


def start_scaler_server(
    broadcaster: DemandBroadcaster,
    port: int,
    *,
    host: str = "0.0.0.0",
    metric_name: str = "noctaya-demand",
    target: int = 10,
    tls: TLSFiles | grpc.ServerCredentials | None = None,
    settings: ScalerSettings | None = None,
    on_activated: Callable[[float], None] | None = None,
    models: Callable[[str], DemandBroadcaster | None] | None = None,
    model_required: bool = True,
    members: Callable[[str, str], DemandBroadcaster | None] | None = None,
    unlisted: Callable[[str, str, str], DemandBroadcaster] | None = None,
    on_certificate: CertificateListener | None = None,
) -> ScalerServer:
    """Serve the ExternalScaler on ``host:port`` (port 0 = ephemeral; see ``.port``).

    ``settings`` overrides the tuning knobs; ``metric_name`` and ``target`` are used when it is None.
    With ``tls`` files, ``on_certificate`` is told the served certificate's notAfter at start and on
    every reload.
    """
    if settings is None:
        settings = ScalerSettings(metric_name=metric_name, target=target)
    gevent_mode = ensure_grpc_gevent_compat()
    # Credentials first: bad TLS material fails before any server or pool exists.
    creds = server_credentials(tls, on_loaded=on_certificate) if isinstance(tls, TLSFiles) else tls
    if _per_method_pools_supported():
        # + a few threads that only ever answer RESOURCE_EXHAUSTED to streams over the cap, at once
        stream_pool = futures.ThreadPoolExecutor(settings.max_streams + _REFUSAL_THREADS,
                                                 thread_name_prefix="noctaya-scaler-stream")
        pool = futures.ThreadPoolExecutor(settings.unary_workers, thread_name_prefix="noctaya-scaler-unary")
    else:  # one shared pool, sized so that max_streams open streams still leave unary_workers free
        stream_pool = None
        pool = futures.ThreadPoolExecutor(settings.max_streams + settings.unary_workers,
                                          thread_name_prefix="noctaya-scaler")
    servicer = ExternalScalerServicer(broadcaster, settings, on_activated, models=models,
                                      model_required=model_required, members=members, unlisted=unlisted)
    server = grpc.server(
        pool,
        maximum_concurrent_rpcs=settings.max_streams + settings.unary_workers + settings.max_pending_rpcs,
        options=[
            ("grpc.so_reuseport", 0),  # a second process on the same port must fail, not share it
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ],
    )
    pb_grpc.add_ExternalScalerServicer_to_server(GrpcioServicer(servicer, stream_pool), server)
    address = f"{host}:{port}"
    pools = [p for p in (pool, stream_pool) if p is not None]
    try:
        bound = server.add_insecure_port(address) if creds is None else server.add_secure_port(address, creds)
    except RuntimeError as exc:  # grpcio raises instead of returning 0 on a failed bind
        bound, reason = 0, f": {exc}"
    else:
        reason = ""
    if not bound:
        server.stop(None)
        for p in pools:
            p.shutdown(wait=False)
        raise OSError(f"cannot bind the gRPC scaler to {address}{reason}")
    server.start()
    log.info("ExternalScaler listening on %s:%d (tls=%s, gevent=%s)", host, bound, tls is not None, gevent_mode)
    return ScalerServer(server, servicer, bound, pools)
