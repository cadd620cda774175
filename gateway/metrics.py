"""Prometheus metrics of one gateway Pod, summed over its worker processes.

Each worker counts into its own row of the Pod's shared memory (``gateway.state.pod``): one
float64 store per counter increment, no lock, no per-label dictionary, so counting costs the warm
path almost nothing. ``/metrics``, served by whichever worker the scrape reaches, sums every row,
so a scrape always sees the Pod's totals. Exposition uses prometheus-client's own families and
text format. Labels are bounded enums only: status code, rejection reason, protocol error reason - never
a path, a model name from the request, a client address, a key or text a backend sent.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from gateway.state.pod import (
    BACKEND_READY,
    DRAINING,
    IN_FLIGHT,
    LEASE_ACTIVE,
    METRIC_CELLS,
    QUEUED,
    ROW_CELLS,
    PodState,
)
from gateway.wire import PROTOCOL_ERRORS

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import HistogramMetricFamily, Metric

# prometheus-client is imported on the first scrape, not at start: with its exposition module it
# brings http.server, wsgiref, urllib.request, email and ssl, ~13 MiB of RSS in every process of the
# Pod (docs/benchmarks.md, "Idle footprint of a gateway Pod"), which a gateway nobody scrapes never uses.

__all__ = ["GatewayMetrics", "REJECTION_REASONS", "Counter", "Histogram", "RenderedOnce"]  # and CONTENT_TYPE_LATEST (lazy)

REJECTION_REASONS = (
    "unauthorized", "queue_full", "queue_bytes_full", "cold_reject", "draining", "too_large", "activation_timeout",
    "request_timeout", "too_many_connections", "invalid_json", "client_too_slow", "upload_bytes_per_address",
    "upload_bytes_full",
)
ACTIVATION_BUCKETS = (1, 5, 10, 20, 30, 60, 90, 120, 180, 240, 300, 450, 600, 900)
TTFB_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Phases of one activation of the Pod, in order (label `phase`): the first cold request's arrival
# until the demand reached KEDA (or the aggregator), then until this Pod saw the backend Ready, then
# until the first byte of a held request's answer was forwarded.
ACTIVATION_PHASES = ("admission_to_push", "push_to_ready", "ready_to_first_byte")
PHASE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 90, 120, 180, 300, 600, 900)
# Time to first token as the client saw it: both a warm answer (milliseconds) and a cold one (minutes).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 90, 120, 180, 300, 600, 900)
TTFT_STARTS = ("warm", "cold")
# How a request balanced over several backend Pods was placed (gateway.balance.Choice.affinity).
AFFINITY_OUTCOMES = ("hit", "spill", "none")

# Cell offsets inside a worker's row (after the demand fields).
_CODES = METRIC_CELLS  # 600 cells: requests by status code 0..599 (0 = out of range)
_REASONS = _CODES + 600
_COLD = _REASONS + 16
_ACTIVATION = _COLD + 8
_TTFB = _ACTIVATION + len(ACTIVATION_BUCKETS) + 4
_PHASES = _TTFB + len(TTFB_BUCKETS) + 4
_PHASE_STRIDE = len(PHASE_BUCKETS) + 4
_TTFT = _PHASES + len(ACTIVATION_PHASES) * _PHASE_STRIDE
_TTFT_STRIDE = len(TTFT_BUCKETS) + 4
_PROTOCOL = _TTFT + len(TTFT_STARTS) * _TTFT_STRIDE
_AFFINITY = _PROTOCOL + len(PROTOCOL_ERRORS)
_READY_LEAD = _AFFINITY + len(AFFINITY_OUTCOMES)
_END = _READY_LEAD + len(PHASE_BUCKETS) + 4
assert _END <= ROW_CELLS and len(REJECTION_REASONS) <= _COLD - _REASONS


class Counter:
    """A counter cell of one worker's row."""

    __slots__ = ("_cells", "_at")

    def __init__(self, cells: memoryview, at: int) -> None:
        self._cells = cells
        self._at = at

    def inc(self, amount: float = 1.0) -> None:
        self._cells[self._at] += amount

    @property
    def value(self) -> float:
        return self._cells[self._at]


class Histogram:
    """Non-cumulative bucket cells + sum + count in one worker's row (cumulated at scrape)."""

    __slots__ = ("_cells", "_at", "buckets")

    def __init__(self, cells: memoryview, at: int, buckets: Sequence[float]) -> None:
        self._cells = cells
        self._at = at
        self.buckets = tuple(buckets)

    def observe(self, value: float) -> None:
        cells, at = self._cells, self._at
        cells[at + bisect_left(self.buckets, value)] += 1  # index len(buckets) is +Inf
        n = len(self.buckets) + 1
        cells[at + n] += value
        cells[at + n + 1] += 1


class GatewayMetrics:
    """This worker's counters, plus a registry whose collector reports the Pod's totals."""

    def __init__(self, pod: PodState | None = None, index: int = 0, accelerators: int = 0) -> None:
        self.pod = pod if pod is not None else PodState(1, 1, None)
        self.row = self.pod.row(index)
        cells, base = self.pod.cells, self.row.base
        self._cells = cells
        self._codes = base + _CODES
        self._reasons = {reason: Counter(cells, base + _REASONS + i) for i, reason in enumerate(REJECTION_REASONS)}
        self.cold_requests = Counter(cells, base + _COLD)
        self.activation_duration = Histogram(cells, base + _ACTIVATION, ACTIVATION_BUCKETS)
        self.ttfb = Histogram(cells, base + _TTFB, TTFB_BUCKETS)
        self.phases = {phase: Histogram(cells, base + _PHASES + i * _PHASE_STRIDE, PHASE_BUCKETS)
                       for i, phase in enumerate(ACTIVATION_PHASES)}
        self.ttft_warm, self.ttft_cold = (Histogram(cells, base + _TTFT + i * _TTFT_STRIDE, TTFT_BUCKETS)
                                          for i in range(len(TTFT_STARTS)))
        self._protocol = {reason: Counter(cells, base + _PROTOCOL + i) for i, reason in enumerate(PROTOCOL_ERRORS)}
        self._affinity = {outcome: Counter(cells, base + _AFFINITY + i) for i, outcome in enumerate(AFFINITY_OUTCOMES)}
        self.ready_lead = Histogram(cells, base + _READY_LEAD, PHASE_BUCKETS)
        self.backend_pods = self.pod.backend_pods.row(self.row.index)
        self._accelerators = accelerators
        self._registry: CollectorRegistry | None = None

    @property
    def registry(self) -> CollectorRegistry:
        """The registry whose collector reports the Pod's totals (made on first use)."""
        if self._registry is None:
            from prometheus_client import CollectorRegistry

            registry = CollectorRegistry(auto_describe=False)
            registry.register(_PodCollector(self.pod, self._accelerators))
            self._registry = registry
        return self._registry

    def count_response(self, code: int) -> None:
        if not 100 <= code <= 599:
            code = 0  # keep the label set bounded even if a backend misbehaves
        self._cells[self._codes + code] += 1

    def reject(self, reason: str) -> None:
        self._reasons[reason].inc()

    def upstream_protocol_error(self, reason: str) -> None:
        """A backend response refused as malformed (``reason`` from ``gateway.wire.PROTOCOL_ERRORS``)."""
        self._protocol[reason].inc()

    def placed(self, outcome: str) -> None:
        """A request balanced over several Pods: ``hit``, ``spill`` or ``none`` (AFFINITY_OUTCOMES)."""
        self._affinity[outcome].inc()

    def set_backend_ready(self, ready: bool) -> None:
        self.row.set_flag(BACKEND_READY, ready)

    def set_draining(self, draining: bool) -> None:
        self.row.set_flag(DRAINING, draining)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class RenderedOnce:
    """``/metrics`` rendered at most once per ``ttl`` while ``worth_caching()`` says a render is costly
    (a shared gateway of many models: ~2 ms of CPU a model), and once for every scrape that arrives
    while it renders. Otherwise (one model's gateway, a few models: a few ms) always fresh. Decided by
    what is rendered, not by a render's measured time, so the same gateway answers alike on a quiet and
    on a loaded machine."""

    def __init__(self, render: Callable[[], bytes], *, worth_caching: Callable[[], bool], ttl: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._render = render
        self._worth_caching = worth_caching
        self.ttl = ttl
        self._clock = clock
        self._body: bytes | None = None
        self._at = 0.0
        self._pending: Any = None  # gevent AsyncResult while a render runs (it yields between slices)
        self.renders = 0

    def get(self) -> bytes:
        if self._body is not None and self._clock() - self._at < self.ttl:
            return self._body
        if self._pending is not None:
            return self._pending.get(timeout=30)
        from gevent.event import AsyncResult

        pending = self._pending = AsyncResult()
        try:
            body = self._render()
        except BaseException as exc:
            pending.set_exception(exc)
            raise
        finally:
            self._pending = None
        self.renders += 1
        self._body, self._at = (body, self._clock()) if self._worth_caching() else (None, 0.0)
        pending.set(body)
        return body


def __getattr__(name: str) -> Any:
    """``CONTENT_TYPE_LATEST``, prometheus-client's, looked up (and the client imported) on first use."""
    if name == "CONTENT_TYPE_LATEST":
        from prometheus_client.exposition import CONTENT_TYPE_LATEST

        return CONTENT_TYPE_LATEST
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _PodCollector:
    def __init__(self, pod: PodState, accelerators: int) -> None:
        self.pod = pod
        self.accelerators = accelerators

    def _buckets(self, offset: int, buckets: Sequence[float]) -> tuple[list[tuple[str, float]], float]:
        counts = [self.pod.total(offset + i) for i in range(len(buckets) + 1)]
        cumulative, running = [], 0.0
        for bound, count in zip([*map(_fmt, buckets), "+Inf"], counts, strict=True):
            running += count
            cumulative.append((bound, running))
        return cumulative, self.pod.total(offset + len(buckets) + 1)

    def _histogram(self, name: str, doc: str, offset: int, buckets: Sequence[float]) -> HistogramMetricFamily:
        from prometheus_client.core import HistogramMetricFamily

        cumulative, total = self._buckets(offset, buckets)
        return HistogramMetricFamily(name, doc, buckets=cumulative, sum_value=total)

    def _labelled(self, name: str, doc: str, label: str, values: Sequence[str], offset: int, stride: int,
                  buckets: Sequence[float]) -> HistogramMetricFamily:
        from prometheus_client.core import HistogramMetricFamily

        family = HistogramMetricFamily(name, doc, labels=[label])
        for i, value in enumerate(values):
            cumulative, total = self._buckets(offset + i * stride, buckets)
            family.add_metric([value], cumulative, total)
        return family

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        pod = self.pod
        requests = CounterMetricFamily("noctaya_gateway_requests", "Requests answered, by HTTP status code.",
                                       labels=["code"])
        for code in range(600):
            value = self.pod.total(_CODES + code)
            if value:
                requests.add_metric([str(code)], value)
        yield requests
        rejections = CounterMetricFamily("noctaya_gateway_rejections", "Requests refused by the gateway, by reason.",
                                         labels=["reason"])
        for i, reason in enumerate(REJECTION_REASONS):
            rejections.add_metric([reason], self.pod.total(_REASONS + i))
        yield rejections
        protocol = CounterMetricFamily("noctaya_gateway_upstream_protocol_errors",
                                       "Backend responses refused as malformed (answered 502 or cut off), by reason.",
                                       labels=["reason"])
        for i, reason in enumerate(PROTOCOL_ERRORS):
            protocol.add_metric([reason], self.pod.total(_PROTOCOL + i))
        yield protocol
        yield CounterMetricFamily("noctaya_gateway_cold_requests", "Requests admitted while the backend was not ready.",
                                  value=self.pod.total(_COLD))
        yield GaugeMetricFamily("noctaya_gateway_queue_depth", "Admitted requests waiting for the backend.",
                                value=pod.total(QUEUED))
        yield GaugeMetricFamily("noctaya_gateway_in_flight", "Requests being forwarded to the backend.",
                                value=pod.total(IN_FLIGHT))
        yield GaugeMetricFamily("noctaya_gateway_backend_ready", "1 when the backend answered its readiness path.",
                                value=1.0 if pod.any(BACKEND_READY) else 0.0)
        yield GaugeMetricFamily("noctaya_gateway_activation_lease_active", "1 while an activation lease runs.",
                                value=1.0 if pod.any(LEASE_ACTIVE) else 0.0)
        yield GaugeMetricFamily("noctaya_gateway_draining", "1 after SIGTERM.", value=1.0 if pod.any(DRAINING) else 0.0)
        yield GaugeMetricFamily("noctaya_gateway_workers", "Worker processes of this gateway Pod.", value=pod.workers)
        yield self._histogram("noctaya_gateway_activation_duration_seconds",
                              "From the first cold request of an activation of this gateway Pod to backend "
                              "readiness seen (once per activation, whichever worker admitted it).",
                              _ACTIVATION, ACTIVATION_BUCKETS)
        yield self._histogram("noctaya_gateway_time_to_first_byte_seconds",
                              "From the start of forwarding to the backend's response head.", _TTFB, TTFB_BUCKETS)
        yield self._labelled("noctaya_gateway_activation_phase_seconds",
                             "One activation of this gateway Pod, per phase: first cold request's arrival to demand "
                             "pushed active, pushed to backend Ready seen, Ready to the first byte of a held answer forwarded.",
                             "phase", ACTIVATION_PHASES, _PHASES, _PHASE_STRIDE, PHASE_BUCKETS)
        yield self._labelled("noctaya_gateway_time_to_first_token_seconds",
                             "From a request's arrival to the first byte of the backend's answer leaving the gateway "
                             "(heartbeats excluded); start=cold when it waited for the backend.",
                             "start", TTFT_STARTS, _TTFT, _TTFT_STRIDE, TTFT_BUCKETS)
        yield from self._backend_pods()
        yield GaugeMetricFamily("noctaya_gateway_backend_accelerators_per_replica",
                                "Accelerators one backend replica requests (for accelerator-hours).",
                                value=self.accelerators)
        if pod.scaler_certificate_not_after:  # with scaler TLS only
            from scaler.tls import certificate_family

            yield certificate_family({"scaler": pod.scaler_certificate_not_after})


    def _backend_pods(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        pods = self.pod.backend_pods.totals()
        outstanding = GaugeMetricFamily("noctaya_gateway_backend_pod_outstanding_requests",
                                        "Requests sent to a backend Pod and not finished (balanced per Pod).",
                                        labels=["pod"])
        sent = CounterMetricFamily("noctaya_gateway_backend_pod_requests",
                                   "Requests sent to a backend Pod since it was first listed.", labels=["pod"])
        for name, (now, total) in sorted(pods.items()):
            outstanding.add_metric([name], now)
            sent.add_metric([name], total)
        yield outstanding
        yield sent
        affinity = CounterMetricFamily("noctaya_gateway_affinity_requests",
                                       "Requests balanced over several backend Pods, by placement: hit (the "
                                       "affinity key's home Pod), spill (another, the home over its load bound), "
                                       "none (no key, or affinity off).", labels=["outcome"])
        for i, outcome in enumerate(AFFINITY_OUTCOMES):
            affinity.add_metric([outcome], self.pod.total(_AFFINITY + i))
        yield affinity
        yield self._histogram("noctaya_gateway_backend_pod_ready_lead_seconds",
                              "How long a backend Pod answered the gateway's own readiness probe before its "
                              "EndpointSlice said Ready (the kubelet's probe and the endpoints' update).",
                              _READY_LEAD, PHASE_BUCKETS)


def _fmt(bound: float) -> str:
    return repr(float(bound))
