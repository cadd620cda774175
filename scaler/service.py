"""KEDA ExternalScaler servicer over a DemandBroadcaster, and the server that hosts it.

Behaviour that KEDA relies on (SPEC §7):

* StreamIsActive sends the current state as soon as it opens and pushes every change of the
  active flag at once; while active it re-sends ``true`` every ``resend_interval`` (KEDA refreshes
  its cooldown clock on each push, and each message costs it API calls, hence the bound). Right
  after a flip to active the re-sends come sooner, ``activation_resend`` s later and doubling up to
  ``resend_interval``: KEDA scales 0→1 on each ``true`` it gets while at zero, and one scale-up
  lost to a write conflict (seen against real KEDA, a second after its own 1→0) must cost a cold
  request a fraction of a second, not the whole interval. Demand
  counts changing while the flag stays the same are not pushed: they reach KEDA through
  GetMetrics. A stream never ends with an error because the demand source failed (KEDA backs off
  up to 60 s after a broken stream); it ends with OK when the server stops.
* IsActive, GetMetricSpec and GetMetrics answer from memory. grpcio's sync server holds one pool
  thread per open stream, so streams run on their own pool (grpcio's per-handler
  ``experimental_thread_pool`` hook) and unary calls on a small separate one: streams can never
  take a unary thread. Streams beyond ``max_streams`` are refused with RESOURCE_EXHAUSTED. (If a
  grpcio without that hook is installed, one pool of ``max_streams + unary_workers`` is used.)
* StreamMetricSpec answers UNIMPLEMENTED: the spec is static, KEDA then silently keeps polling
  GetMetricSpec, and no pool thread is spent holding a stream that would never send twice.

In a gevent-monkey-patched process grpc must run in gevent mode
(``grpc.experimental.gevent.init_gevent()``, done by ``start_scaler_server``): grpc's pool
"threads" are then greenlets that wait on the broadcaster cooperatively. The gateway itself does not
use that mode (it runs ``python -m scaler local`` as a child process, see gateway/scaler_process.py,
because grpc's gevent mode costs about twice the CPU per call); it stays supported and tested for
embedding the scaler in another gevent program.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from scaler import externalscaler_pb2 as pb
from scaler import externalscaler_pb2_grpc as pb_grpc
from scaler.demand import Demand, DemandBroadcaster
from scaler.tls import TLSFiles, server_credentials

if TYPE_CHECKING:
    from prometheus_client.core import Metric
    from prometheus_client.registry import Collector

__all__ = [
    "ExternalScalerServicer",
    "ScalerServer",
    "ScalerSettings",
    "ensure_grpc_gevent_compat",
    "start_scaler_server",
    "validate_metric_name",
]

log = logging.getLogger("noctaya.scaler")

# Path-safe: the HPA puts the metric name into external.metrics.k8s.io URL paths.
_METRIC_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
# KEDA prefixes trigger metric names with "s<index>-"; it strips that before asking us, but an
# older or future caller that does not is still answered.
_KEDA_PREFIX_RE = re.compile(r"^s\d+-")
TARGET_METADATA_KEY = "targetPerReplica"  # scaling.targetPerReplica, in the external-push trigger metadata
MAX_TARGET = 1_000_000


def validate_metric_name(name: str) -> str:
    if not _METRIC_NAME_RE.match(name):
        raise ValueError(
            f"metric name {name!r} must be 1-63 lowercase letters, digits or '-', starting and ending "
            "with a letter or digit"
        )
    return name


@dataclass(frozen=True, slots=True)
class ScalerSettings:
    metric_name: str = "noctaya-demand"
    target: int = 10
    resend_interval: float = 5.0  # re-send `true` at most this often while active
    activation_resend: float = 0.25  # first re-send after a flip to active, doubling up to resend_interval
    max_streams: int = 256  # open StreamIsActive streams (KEDA opens one per ScaledObject trigger)
    unary_workers: int = 4  # unary handlers never block: a few threads beat many (less GIL convoy)
    max_pending_rpcs: int = 1024  # unary calls queued beyond the workers before RESOURCE_EXHAUSTED
    wait_slice: float = 1.0  # upper bound of one wait, so a missed interrupt costs at most this

    def __post_init__(self) -> None:
        validate_metric_name(self.metric_name)
        if isinstance(self.target, bool) or not isinstance(self.target, int) or self.target < 1:
            raise ValueError("target must be an int >= 1")
        if self.resend_interval <= 0 or self.wait_slice <= 0 or self.activation_resend <= 0:
            raise ValueError("resend_interval, activation_resend and wait_slice must be > 0")
        if self.max_streams < 1 or self.unary_workers < 1 or self.max_pending_rpcs < 0:
            raise ValueError("max_streams and unary_workers must be >= 1, max_pending_rpcs >= 0")


class _RateLimitedLog:
    """At most one log line per ``interval`` seconds, with a count of what was suppressed: a
    demand source failing in a loop must not flood the logs."""

    def __init__(self, interval: float = 10.0) -> None:
        self._interval = interval
        self._lock = threading.Lock()
        self._last = -1e18
        self._suppressed = 0

    def warning(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last < self._interval:
                self._suppressed += 1
                return
            suppressed, self._suppressed, self._last = self._suppressed, 0, now
        log.warning(msg + " (%d similar suppressed)", *args, suppressed)


class ExternalScalerServicer(pb_grpc.ExternalScalerServicer):
    def __init__(
        self,
        source: DemandBroadcaster,
        settings: ScalerSettings,
        stream_pool: futures.ThreadPoolExecutor | None = None,
        on_activated: Callable[[float], None] | None = None,
    ) -> None:
        # Called with the monotonic time (from a stream's thread) each time a stream tells KEDA `true` after `false` or
        # nothing: the moment demand was pushed, which the gateway times activations by.
        self._on_activated = on_activated
        if stream_pool is not None:
            # grpcio runs a handler whose behaviour carries `experimental_thread_pool` on that pool:
            # streams get their own pool and can never occupy the threads of unary calls.
            self.StreamIsActive = _on_pool(self._stream_is_active, stream_pool)  # type: ignore[method-assign]
        self._source = source
        self._settings = settings
        self._stopping = False
        self._streams_lock = threading.Lock()
        self._open_streams = 0
        self._last_good: Demand | None = None
        self._source_errors = _RateLimitedLog()
        self._counters_lock = threading.Lock()
        self._source_error_count = 0
        self._pushes = 0

    @property
    def source_error_count(self) -> int:
        return self._source_error_count

    @property
    def pushes(self) -> int:
        return self._pushes

    def _count(self, *, pushes: int = 0, errors: int = 0) -> None:
        with self._counters_lock:
            self._pushes += pushes
            self._source_error_count += errors

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def open_streams(self) -> int:
        with self._streams_lock:
            return self._open_streams

    def begin_shutdown(self) -> None:
        """Make every open stream return (status OK) promptly."""
        self._stopping = True
        self._interrupt()

    def _interrupt(self) -> None:
        interrupt = getattr(self._source, "interrupt_waiters", None)
        if interrupt is not None:
            try:
                interrupt()
            except Exception:  # a broken source must not break shutdown; wait_slice bounds it
                pass

    # -- demand access that never raises ---------------------------------------------------------

    def _demand_for_unary(self, context: grpc.ServicerContext) -> Demand:
        try:
            demand = self._source.current()
        except Exception as exc:
            self._count(errors=1)
            self._source_errors.warning("demand source failed: %s", type(exc).__name__)
            if self._last_good is None:
                context.abort(grpc.StatusCode.UNAVAILABLE, "demand not known yet")
            return self._last_good
        self._last_good = demand
        return demand

    # -- RPCs ------------------------------------------------------------------------------------

    def IsActive(self, request: pb.ScaledObjectRef, context: grpc.ServicerContext) -> pb.IsActiveResponse:
        return pb.IsActiveResponse(result=self._demand_for_unary(context).active)

    def GetMetricSpec(
        self, request: pb.ScaledObjectRef, context: grpc.ServicerContext
    ) -> pb.GetMetricSpecResponse:
        return pb.GetMetricSpecResponse(metricSpecs=[self._metric_spec(request, context)])

    def _metric_spec(self, request: pb.ScaledObjectRef, context: grpc.ServicerContext) -> pb.MetricSpec:
        # The per-replica target travels in the trigger's metadata (rendered from
        # scaling.targetPerReplica), so retuning rewrites the ScaledObject and never rolls the gateways
        # (which would drop held requests). The configured target serves older ScaledObjects.
        target = self._settings.target
        raw = request.scalerMetadata.get(TARGET_METADATA_KEY)
        if raw is not None:
            if not raw.isdigit() or not 1 <= int(raw) <= MAX_TARGET:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"trigger metadata {TARGET_METADATA_KEY} must be an integer in 1..{MAX_TARGET}, "
                              f"got {raw[:20]!r}")
            target = int(raw)
        return pb.MetricSpec(
            metricName=self._settings.metric_name, targetSize=target, targetSizeFloat=float(target)
        )

    def GetMetrics(self, request: pb.GetMetricsRequest, context: grpc.ServicerContext) -> pb.GetMetricsResponse:
        requested = request.metricName
        ours = self._settings.metric_name
        if requested not in ("", ours) and _KEDA_PREFIX_RE.sub("", requested, count=1) != ours:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown metric {requested[:100]!r}; serving {ours!r}")
        total = self._demand_for_unary(context).total
        return pb.GetMetricsResponse(
            metricValues=[pb.MetricValue(metricName=requested or ours, metricValue=total,
                                         metricValueFloat=float(total))]
        )

    def StreamMetricSpec(
        self, request: pb.ScaledObjectRef, context: grpc.ServicerContext
    ) -> Iterator[pb.GetMetricSpecResponse]:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "metric spec is static; poll GetMetricSpec")
        yield from ()  # pragma: no cover - makes this a generator like every streaming handler

    def StreamIsActive(
        self, request: pb.ScaledObjectRef, context: grpc.ServicerContext
    ) -> Iterator[pb.IsActiveResponse]:
        return self._stream_is_active(request, context)

    def _stream_is_active(
        self, request: pb.ScaledObjectRef, context: grpc.ServicerContext
    ) -> Iterator[pb.IsActiveResponse]:
        with self._streams_lock:
            admitted = not self._stopping and self._open_streams < self._settings.max_streams
            if admitted:
                self._open_streams += 1
        if not admitted:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many open StreamIsActive streams")
        try:
            # A client going away wakes us so its pool thread is freed now, not at the next push.
            context.add_callback(self._interrupt)
            yield from self._stream_active(context)
        finally:
            with self._streams_lock:
                self._open_streams -= 1

    def _stream_active(self, context: grpc.ServicerContext) -> Iterator[pb.IsActiveResponse]:
        settings = self._settings
        # Only flips of the active flag (and the resend timer) wake a stream, not every count change.
        seen_version = -1  # no version is -1: the first wait returns the current state at once
        sent: bool | None = None
        sent_at = 0.0
        gap = settings.resend_interval  # until the next re-send of `true`
        backoff = 0.05
        while not self._stopping and context.is_active():
            if sent:
                timeout = max(0.0, min(settings.wait_slice, sent_at + gap - time.monotonic()))
            else:
                timeout = settings.wait_slice
            try:
                seen_version, demand = self._source.wait_for_activity_change(seen_version, timeout)
            except Exception as exc:
                # Transient by assumption: log, back off briefly, keep the stream open.
                self._count(errors=1)
                self._source_errors.warning("demand source failed in StreamIsActive: %s", type(exc).__name__)
                self._sleep_unless_stopping(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            backoff = 0.05
            self._last_good = demand
            if self._stopping or not context.is_active():
                break
            active = demand.active
            now = time.monotonic()
            if active != sent or (active and now - sent_at >= gap):
                if active:  # a flip (or a stream opening while active) re-sends soon; re-sends back off
                    gap = min(settings.activation_resend if not sent else gap * 2, settings.resend_interval)
                flipped = active and not sent
                sent, sent_at = active, now
                self._count(pushes=1)
                yield pb.IsActiveResponse(result=active)
                if flipped and self._on_activated is not None:
                    try:
                        # The time it was handed to gRPC: this generator resumes only when gRPC asks
                        # for the next message, which can be much later on a busy process.
                        self._on_activated(now)
                    except Exception:  # a broken observer must never end KEDA's stream
                        log.exception("on_activated failed")

    def _sleep_unless_stopping(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self._stopping and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))


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
        return _ScalerCollector(self.servicer)


class _ScalerCollector:
    """Registered by the aggregate scaler only: prometheus-client is imported when it is collected, so
    a gateway's `python -m scaler local` child, which has no /metrics, never loads it (~6 MiB)."""

    def __init__(self, servicer: ExternalScalerServicer) -> None:
        self._servicer = servicer

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        yield GaugeMetricFamily("noctaya_scaler_streams_open", "Open StreamIsActive streams",
                                value=self._servicer.open_streams)
        yield CounterMetricFamily("noctaya_scaler_pushes", "IsActive messages sent on streams",
                                  value=self._servicer.pushes)
        yield CounterMetricFamily("noctaya_scaler_demand_source_errors", "Failed reads of the demand source",
                                  value=self._servicer.source_error_count)


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
) -> ScalerServer:
    """Serve the ExternalScaler on ``host:port`` (port 0 = ephemeral; see ``.port``).

    ``settings`` overrides the tuning knobs; ``metric_name`` and ``target`` are used when it is None.
    """
    if settings is None:
        settings = ScalerSettings(metric_name=metric_name, target=target)
    gevent_mode = ensure_grpc_gevent_compat()
    # Credentials first: bad TLS material fails before any server or pool exists.
    creds = server_credentials(tls) if isinstance(tls, TLSFiles) else tls
    if _per_method_pools_supported():
        # + a few threads that only ever answer RESOURCE_EXHAUSTED to streams over the cap, at once
        stream_pool = futures.ThreadPoolExecutor(settings.max_streams + _REFUSAL_THREADS,
                                                 thread_name_prefix="noctaya-scaler-stream")
        pool = futures.ThreadPoolExecutor(settings.unary_workers, thread_name_prefix="noctaya-scaler-unary")
    else:  # one shared pool, sized so that max_streams open streams still leave unary_workers free
        stream_pool = None
        pool = futures.ThreadPoolExecutor(settings.max_streams + settings.unary_workers,
                                          thread_name_prefix="noctaya-scaler")
    servicer = ExternalScalerServicer(broadcaster, settings, stream_pool, on_activated)
    server = grpc.server(
        pool,
        maximum_concurrent_rpcs=settings.max_streams + settings.unary_workers + settings.max_pending_rpcs,
        options=[
            ("grpc.so_reuseport", 0),  # a second process on the same port must fail, not share it
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ],
    )
    pb_grpc.add_ExternalScalerServicer_to_server(servicer, server)
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
