"""Prometheus metrics of the hook server.

Labels are bounded on purpose: the hook name comes from the fixed route table and the error kind
from :data:`ERROR_KINDS`. Nothing from a request (object names, namespaces, messages) ever becomes
a label, so a cluster with ten thousand LLMServices still exports a handful of series.

Under gunicorn with several worker processes each worker has its own memory, so `python -m hooks
serve` runs prometheus-client in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``): every worker
writes its values to shared files and ``/metrics``, whichever worker answers it, aggregates all of
them. Without that variable (tests, the benchmark) the metrics live in a private registry.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    multiprocess,
)

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

# A sync for a big multi-gateway LLMService takes around a millisecond in-process; the buckets
# resolve that range and still cover a pathological multi-second call under Metacontroller's 10 s
# default webhook timeout.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# Every error response of a hook route is counted under exactly one of these kinds.
ERROR_KINDS = ("bad_request", "unauthorized", "payload_too_large", "overloaded", "internal")


def error_kind_for_status(status_code: int) -> str | None:
    """The error kind a hook response's status code is counted as (None for 2xx/3xx)."""
    if status_code < 400:
        return None
    if status_code == 401:
        return "unauthorized"
    if status_code == 413:
        return "payload_too_large"
    if status_code == 429:
        return "overloaded"
    if status_code < 500:
        return "bad_request"
    return "internal"


class HookMetrics:
    """Latency histogram per hook and error counter per (hook, kind)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # A private registry per app keeps several apps (tests) from colliding on the global one.
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.latency = Histogram(
            "noctaya_hook_duration_seconds",
            "Time to answer one Metacontroller hook call, from request to serialised response.",
            ["hook"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.errors = Counter(
            "noctaya_hook_errors",
            "Hook calls answered with an error status, by hook and error kind.",
            ["hook", "kind"],
            registry=self.registry,
        )

    def prime(self, hook_names: Iterable[str]) -> None:
        """Create every series at zero so dashboards and rate() see them before the first error."""
        for hook in hook_names:
            self.latency.labels(hook=hook)
            for kind in ERROR_KINDS:
                self.errors.labels(hook=hook, kind=kind)

    def observe(self, hook: str, seconds: float, status_code: int) -> None:
        self.latency.labels(hook=hook).observe(seconds)
        kind = error_kind_for_status(status_code)
        if kind is not None:
            self.errors.labels(hook=hook, kind=kind).inc()

    def exposition(self) -> tuple[bytes, str]:
        """The text exposition (body, content type) of all workers' metrics."""
        if os.environ.get(MULTIPROC_DIR_ENV):
            # A fresh registry per scrape is how prometheus-client's multiprocess mode is meant to be
            # read: the collector merges the files of all live and dead workers.
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
