"""KEDA's ExternalScaler answered from a DemandBroadcaster, independent of the server that hosts it.

Two hosts serve this logic: grpcio (``scaler.service``: the aggregate scaler, and the scaler child of
a multi-worker gateway) and h2 on a gevent loop (``scaler.h2server``: inside a one-worker gateway,
where grpcio's ~20 MiB and its polling threads would be most of the Pod's idle cost). Neither
grpcio nor gevent is imported here; a host hands each call a context with the three methods of
``RpcContext``.

Behaviour that KEDA relies on (SPEC §7):

* StreamIsActive sends the current state as soon as it opens and pushes every change of the
  active flag at once; while active it re-sends ``true`` every ``resend_interval`` (KEDA refreshes
  its cooldown clock on each push, and each message costs it API calls, hence the bound). Right
  after a flip to active the re-sends come sooner, ``activation_resend`` s later and doubling up to
  ``resend_interval``: KEDA scales 0→1 on each ``true`` it gets while at zero, and one scale-up
  lost to a write conflict (seen against real KEDA, a second after its own 1→0) must cost a cold
  request a fraction of a second, not the whole interval. Demand counts changing while the flag
  stays the same are not pushed: they reach KEDA through GetMetrics. A stream never ends with an
  error because the demand source failed (KEDA backs off up to 60 s after a broken stream); it
  ends with OK when the server stops.
* IsActive, GetMetricSpec and GetMetrics answer from memory. Streams beyond ``max_streams`` are
  refused with RESOURCE_EXHAUSTED.
* StreamMetricSpec answers UNIMPLEMENTED: the spec is static, KEDA then silently keeps polling
  GetMetricSpec, and nothing is spent holding a stream that would never send twice.
"""

from __future__ import annotations

import enum
import logging
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn, Protocol

from scaler import externalscaler_pb2 as pb
from scaler.demand import Demand, DemandBroadcaster

if TYPE_CHECKING:
    from prometheus_client.core import Metric

__all__ = ["ExternalScalerServicer", "RpcContext", "ScalerCollector", "ScalerSettings", "Status", "validate_metric_name"]


class Status(enum.IntEnum):
    """The gRPC status codes this service answers with (numbers from grpc's status.proto)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    NOT_FOUND = 5
    RESOURCE_EXHAUSTED = 8
    INTERNAL = 13
    UNIMPLEMENTED = 12
    UNAVAILABLE = 14


class RpcContext(Protocol):
    """What the servicer needs of a call: the part of ``grpc.ServicerContext`` it uses."""

    def abort(self, code: Status, details: str) -> NoReturn: ...

    def is_active(self) -> bool: ...

    def add_callback(self, callback: Callable[[], None]) -> bool: ...


log = logging.getLogger("noctaya.scaler")

# Path-safe: the HPA puts the metric name into external.metrics.k8s.io URL paths.
_METRIC_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
# KEDA prefixes trigger metric names with "s<index>-"; it strips that before asking us, but an
# older or future caller that does not is still answered.
_KEDA_PREFIX_RE = re.compile(r"^s\d+-")
TARGET_METADATA_KEY = "targetPerReplica"  # scaling.targetPerReplica, in the external-push trigger metadata
# A shared gateway's trigger names the model its ScaledObject scales (served model name).
MODEL_METADATA_KEY = "model"
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


class ExternalScalerServicer:
    def __init__(
        self,
        source: DemandBroadcaster,
        settings: ScalerSettings,
        on_activated: Callable[[float], None] | None = None,
        *,
        sleep: Callable[[float], None] = time.sleep,
        models: Callable[[str], DemandBroadcaster | None] | None = None,
        model_required: bool = True,
        members: Callable[[str, str], DemandBroadcaster | None] | None = None,
        unlisted: Callable[[str, str, str], DemandBroadcaster] | None = None,
    ) -> None:
        # ``models``: a shared gateway's demand per model, looked up by the trigger metadata's
        # ``model`` on every call (the table can change); ``source`` is then unused, unless
        # ``model_required`` is False (the aggregate scaler, which also answers per-model gateways'
        # triggers): a trigger without ``model`` is then answered from ``source``.
        # Called with the monotonic time each time a stream tells KEDA `true` after `false` or
        # nothing: the moment demand was pushed, which the gateway times activations by.
        self._on_activated = on_activated
        self._sleep = sleep  # gevent.sleep where the streams are greenlets
        self._source = source
        self._models = models
        # ``members``: a shared gateway's demand by the asking ScaledObject (namespace, name), for a
        # ``model`` the gateway does not list (yet): a member renamed while the kubelet has not
        # brought the new table to the Pod. The member's demand follows the member.
        self._members = members
        # ``unlisted``: the answer for a ``model`` neither resolver knows, by (model, namespace,
        # ScaledObject) (the aggregate scaler: a model nobody reports is idle, never NOT_FOUND);
        # without it such a model is NOT_FOUND.
        self._unlisted = unlisted
        self._model_required = model_required
        self._settings = settings
        self._stopping = False
        self._streams_lock = threading.Lock()
        self._open_streams = 0
        self._streaming: dict[DemandBroadcaster, int] = {}  # sources with open streams (shutdown wakes them)
        self._last_good: weakref.WeakKeyDictionary[DemandBroadcaster, Demand] = weakref.WeakKeyDictionary()
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
        with self._streams_lock:
            sources = list(self._streaming)
        if self._models is None or not self._model_required:
            sources.append(self._source)
        for source in sources:
            _interrupt(source)

    def _source_of(self, ref: pb.ScaledObjectRef, context: RpcContext) -> DemandBroadcaster:
        if self._models is None:
            return self._source
        name = ref.scalerMetadata.get(MODEL_METADATA_KEY, "")
        if not name and not self._model_required:
            return self._source
        if not name:
            context.abort(Status.INVALID_ARGUMENT,
                          f"trigger metadata {MODEL_METADATA_KEY} is required: this gateway fronts several models")
        source = self._models(name)
        if source is None and self._members is not None:
            source = self._members(ref.namespace, ref.name)
        if source is None and self._unlisted is not None:
            source = self._unlisted(name, ref.namespace, ref.name)
        if source is None:
            context.abort(Status.NOT_FOUND, f"this gateway fronts no model {name[:100]!r}")
        return source

    # -- demand access that never raises ---------------------------------------------------------

    def _demand_for_unary(self, ref: pb.ScaledObjectRef, context: RpcContext) -> Demand:
        source = self._source_of(ref, context)
        try:
            demand = source.current()
        except Exception as exc:
            self._count(errors=1)
            self._source_errors.warning("demand source failed: %s", type(exc).__name__)
            last = self._last_good.get(source)
            if last is None:
                context.abort(Status.UNAVAILABLE, "demand not known yet")
            return last
        self._last_good[source] = demand
        return demand

    # -- RPCs ------------------------------------------------------------------------------------

    def IsActive(self, request: pb.ScaledObjectRef, context: RpcContext) -> pb.IsActiveResponse:
        return pb.IsActiveResponse(result=self._demand_for_unary(request, context).active)

    def GetMetricSpec(
        self, request: pb.ScaledObjectRef, context: RpcContext
    ) -> pb.GetMetricSpecResponse:
        return pb.GetMetricSpecResponse(metricSpecs=[self._metric_spec(request, context)])

    def _metric_spec(self, request: pb.ScaledObjectRef, context: RpcContext) -> pb.MetricSpec:
        # The per-replica target travels in the trigger's metadata (rendered from
        # scaling.targetPerReplica), so retuning rewrites the ScaledObject and never rolls the gateways
        # (which would drop held requests). The configured target serves older ScaledObjects.
        target = self._settings.target
        raw = request.scalerMetadata.get(TARGET_METADATA_KEY)
        if raw is not None:
            if not raw.isdigit() or not 1 <= int(raw) <= MAX_TARGET:
                context.abort(Status.INVALID_ARGUMENT,
                              f"trigger metadata {TARGET_METADATA_KEY} must be an integer in 1..{MAX_TARGET}, "
                              f"got {raw[:20]!r}")
            target = int(raw)
        return pb.MetricSpec(
            metricName=self._settings.metric_name, targetSize=target, targetSizeFloat=float(target)
        )

    def GetMetrics(self, request: pb.GetMetricsRequest, context: RpcContext) -> pb.GetMetricsResponse:
        requested = request.metricName
        ours = self._settings.metric_name
        if requested not in ("", ours) and _KEDA_PREFIX_RE.sub("", requested, count=1) != ours:
            context.abort(Status.NOT_FOUND, f"unknown metric {requested[:100]!r}; serving {ours!r}")
        total = self._demand_for_unary(request.scaledObjectRef, context).total
        return pb.GetMetricsResponse(
            metricValues=[pb.MetricValue(metricName=requested or ours, metricValue=total,
                                         metricValueFloat=float(total))]
        )

    def StreamMetricSpec(
        self, request: pb.ScaledObjectRef, context: RpcContext
    ) -> Iterator[pb.GetMetricSpecResponse]:
        context.abort(Status.UNIMPLEMENTED, "metric spec is static; poll GetMetricSpec")
        yield from ()  # pragma: no cover - makes this a generator like every streaming handler

    def StreamIsActive(
        self, request: pb.ScaledObjectRef, context: RpcContext
    ) -> Iterator[pb.IsActiveResponse]:
        source = self._source_of(request, context)
        with self._streams_lock:
            admitted = not self._stopping and self._open_streams < self._settings.max_streams
            if admitted:
                self._open_streams += 1
                self._streaming[source] = self._streaming.get(source, 0) + 1
        if not admitted:
            context.abort(Status.RESOURCE_EXHAUSTED, "too many open StreamIsActive streams")
        try:
            # A client going away wakes us so its pool thread is freed now, not at the next push.
            context.add_callback(lambda: _interrupt(source))
            yield from self._stream_active(source, context)
        finally:
            with self._streams_lock:
                self._open_streams -= 1
                left = self._streaming.pop(source) - 1
                if left:
                    self._streaming[source] = left

    def _stream_active(self, source: DemandBroadcaster, context: RpcContext) -> Iterator[pb.IsActiveResponse]:
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
                seen_version, demand = source.wait_for_activity_change(seen_version, timeout)
            except Exception as exc:
                # Transient by assumption: log, back off briefly, keep the stream open.
                self._count(errors=1)
                self._source_errors.warning("demand source failed in StreamIsActive: %s", type(exc).__name__)
                self._sleep_unless_stopping(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            backoff = 0.05
            self._last_good[source] = demand
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
                # A shared gateway's model broadcaster names its own observer.
                on_activated = getattr(source, "on_activated", None) or self._on_activated
                if flipped and on_activated is not None:
                    try:
                        # The time it was handed to gRPC: this generator resumes only when gRPC asks
                        # for the next message, which can be much later on a busy process.
                        on_activated(now)
                    except Exception:  # a broken observer must never end KEDA's stream
                        log.exception("on_activated failed")

    def _sleep_unless_stopping(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self._stopping and (left := deadline - time.monotonic()) > 0:
            self._sleep(min(left, 0.05))


def _interrupt(source: DemandBroadcaster) -> None:
    interrupt = getattr(source, "interrupt_waiters", None)
    if interrupt is not None:
        try:
            interrupt()
        except Exception:  # a broken source must not break shutdown; wait_slice bounds it
            pass


class ScalerCollector:
    """Prometheus collector of a servicer's stream/push/error counts, registered by the aggregate
    scaler only: prometheus-client is imported when it is collected, so a gateway's scaler, which
    serves no /metrics of its own, never loads it (~6 MiB)."""

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
