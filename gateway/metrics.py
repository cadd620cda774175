"""Prometheus metrics of one gateway, on a private registry (several gateways can live in one
test process). Labels are bounded enums only: status code, rejection reason - never a path,
model name from the request, client address or key."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["GatewayMetrics", "REJECTION_REASONS", "CONTENT_TYPE_LATEST"]

REJECTION_REASONS = (
    "unauthorized", "queue_full", "queue_bytes_full", "cold_reject", "draining", "too_large", "activation_timeout",
)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "noctaya_gateway_requests", "Requests answered, by HTTP status code.", ["code"], registry=r
        )
        self.queue_depth = Gauge(
            "noctaya_gateway_queue_depth", "Admitted requests waiting for the backend.", registry=r
        )
        self.in_flight = Gauge(
            "noctaya_gateway_in_flight", "Requests being forwarded to the backend.", registry=r
        )
        self.cold_requests = Counter(
            "noctaya_gateway_cold_requests", "Requests admitted while the backend was not ready.", registry=r
        )
        self.rejections = Counter(
            "noctaya_gateway_rejections", "Requests refused by the gateway, by reason.", ["reason"], registry=r
        )
        self.activation_duration = Histogram(
            "noctaya_gateway_activation_duration_seconds",
            "From the start of an activation lease to backend readiness.",
            buckets=(1, 5, 10, 20, 30, 60, 90, 120, 180, 240, 300, 450, 600, 900),
            registry=r,
        )
        self.ttfb = Histogram(
            "noctaya_gateway_time_to_first_byte_seconds",
            "From the start of forwarding to the backend's response head.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.backend_ready = Gauge(
            "noctaya_gateway_backend_ready", "1 when the backend answered its readiness path.", registry=r
        )
        self.lease_active = Gauge(
            "noctaya_gateway_activation_lease_active", "1 while an activation lease runs.", registry=r
        )
        self.draining = Gauge("noctaya_gateway_draining", "1 after SIGTERM.", registry=r)
        # Label children resolved once: the warm path must not pay a dict-of-labels lookup per call.
        self._by_code: dict[int, Counter] = {}
        self._by_reason = {reason: self.rejections.labels(reason=reason) for reason in REJECTION_REASONS}

    def count_response(self, code: int) -> None:
        child = self._by_code.get(code)
        if child is None:
            if not 100 <= code <= 599:
                code = 0  # keep the label set bounded even if a backend misbehaves
            child = self._by_code.setdefault(code, self.requests.labels(code=str(code)))
        child.inc()

    def reject(self, reason: str) -> None:
        self._by_reason[reason].inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
