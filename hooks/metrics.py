"""Prometheus metrics of the hook server.

Labels are bounded on purpose: the hook name comes from the fixed route table and the error kind
from :data:`ERROR_KINDS`. Nothing from a request (object names, namespaces, messages) ever becomes
a label, so a cluster with ten thousand LLMServices still exports a handful of series. The one
exception is the ``pool`` label of the AcceleratorPool series (:meth:`HookMetrics.observe_pool`):
pools are cluster-scoped objects an administrator creates, one per accelerator kind, and each
process tracks at most :data:`MAX_TRACKED_POOLS` of them.

Under gunicorn with several worker processes each worker has its own memory, so `python -m hooks
serve` runs prometheus-client in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``): every worker
writes its values to shared files and ``/metrics``, whichever worker answers it, aggregates all of
them. Without that variable (tests, the benchmark) the metrics live in a private registry.

The pool gauges use multiprocess mode ``mostrecent``: whichever worker answered a pool's latest
sync holds the truth, so the scrape reports the value written last (by wall-clock time of the
write), not a sum or a maximum over workers. A worker that died keeps its last values in its file;
under ``mostrecent`` that is right (the newest write still wins). prometheus-client cannot remove a
series in multiprocess mode, so the series of a deleted pool stay, frozen at their last value,
until the hook server restarts (``serve`` wipes the directory at start); a passive controller
without a finalize hook never hears of the deletion anyway.

Over HTTPS, ``noctaya_tls_certificate_not_after_timestamp_seconds{role="hooks"}`` (also ``mostrecent``)
is the expiry of the certificate the server presents (:func:`record_served_certificate`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from scaler.tls import CERTIFICATE_HELP, CERTIFICATE_METRIC

logger = logging.getLogger("noctaya.hooks")

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

# The route whose successful answers feed the pool series (hooks.app calls observe_pool_sync).
POOL_SYNC_HOOK = "acceleratorpool_sync"
# Pools are few (one per accelerator kind, maybe per node group); this only stops a runaway script
# that creates thousands from growing the series without bound. Beyond it a new pool is not
# tracked (logged once per process); its status still says everything.
MAX_TRACKED_POOLS = 64
# Models named on noctaya_pool_model_yields_total, per process: the model label is bounded by the models a
# cluster runs, and this keeps a churn of thousands of short-lived models from growing it without bound.
MAX_TRACKED_VICTIMS = 512

# A sync for a big multi-gateway LLMService takes around a millisecond in-process; the buckets
# resolve that range and still cover a pathological multi-second call under Metacontroller's 10 s
# default webhook timeout.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# Every error response of a hook route is counted under exactly one of these kinds. `version_skew`
# (a controller manifest newer than this hook server, hooks.compat) is named by the app, not derived
# from the status code.
ERROR_KINDS = ("bad_request", "unauthorized", "payload_too_large", "overloaded", "internal", "version_skew")


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
    """Latency histogram per hook and error counter per (hook, kind); per AcceleratorPool, what its
    last sync answered (waiters, yields, capacity) and how many yields it started."""

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
        self.pool_waiting = Gauge(
            "noctaya_pool_waiting",
            "Backend Pods waiting for the pool's resource (len of status.waiting) in the pool's last sync answer.",
            ["pool"],
            multiprocess_mode="mostrecent",
            registry=self.registry,
        )
        self.pool_yielding = Gauge(
            "noctaya_pool_yielding",
            "Yields in progress (len of status.yielding) in the pool's last sync answer.",
            ["pool"],
            multiprocess_mode="mostrecent",
            registry=self.registry,
        )
        self.pool_capacity_units = Gauge(
            "noctaya_pool_capacity_units",
            "Allocatable units of the pool's resource on its nodes (status.capacity.units; 0 when unknown).",
            ["pool"],
            multiprocess_mode="mostrecent",
            registry=self.registry,
        )
        self.pool_last_sync = Gauge(
            "noctaya_pool_last_sync_timestamp_seconds",
            "When this hook server last answered the pool's sync (Unix time): with several hook server "
            "replicas, the replica with the newest value has the current pool gauges.",
            ["pool"],
            multiprocess_mode="mostrecent",
            registry=self.registry,
        )
        self.pool_yields = Counter(
            "noctaya_pool_yields",
            "Yields the pool started: entries of an answer's status.yielding whose (scaledObject, for) pair "
            "was not in the request's status.yielding.",
            ["pool"],
            registry=self.registry,
        )
        self.pool_model_yields = Counter(
            "noctaya_pool_model_yields",
            "Yields started, by the model that yields (victim: namespace/LLMService) and the pool; see "
            "noctaya_pool_yields_total for its caveat. Each is also logged: 'pool P: V yields N <resource> "
            "on <node> to W (pod ...)'.",
            ["pool", "victim"],
            registry=self.registry,
        )
        self._victims: set[tuple[str, str]] = set()
        self._pools: set[str] = set()
        self._untracked_logged: set[str] = set()
        self._pools_lock = threading.Lock()

    def prime(self, hook_names: Iterable[str]) -> None:
        """Create every series at zero so dashboards and rate() see them before the first error."""
        for hook in hook_names:
            self.latency.labels(hook=hook)
            for kind in ERROR_KINDS:
                self.errors.labels(hook=hook, kind=kind)

    def observe(self, hook: str, seconds: float, status_code: int, kind: str | None = None) -> None:
        """One answered call; ``kind`` names its error kind when the status code alone does not."""
        self.latency.labels(hook=hook).observe(seconds)
        if kind not in ERROR_KINDS:
            kind = error_kind_for_status(status_code)
        if kind is not None:
            self.errors.labels(hook=hook, kind=kind).inc()

    def _track(self, pool: str) -> bool:
        with self._pools_lock:
            if pool in self._pools:
                return True
            if len(self._pools) >= MAX_TRACKED_POOLS:
                return False
            self._pools.add(pool)
            return True

    def observe_pool(self, pool: str, before: Mapping[str, Any] | None, after: Mapping[str, Any] | None) -> None:
        """Record one successful pool sync: ``before`` is the request's ``parent.status``, ``after``
        the answer's ``status`` (either may be missing or partial).

        The yield counter counts what the answer adds over the request. If Metacontroller sends a
        status older than one already answered (its informer had not yet seen the last write, or a
        write conflict is retried), a yield it had already counted is counted again: the counter is an
        upper bound, right for rates and trends, not an exact ledger. The status is the ledger.
        """
        if not self._track(pool):
            if pool not in self._untracked_logged:
                self._untracked_logged.add(pool)
                logger.warning("more than %d AcceleratorPools: pool %s has no metrics", MAX_TRACKED_POOLS, pool)
            return
        after = after if isinstance(after, Mapping) else {}
        yielding = _entries(after.get("yielding"))
        capacity = after.get("capacity")
        units = capacity.get("units") if isinstance(capacity, Mapping) else None
        self.pool_waiting.labels(pool=pool).set(len(_entries(after.get("waiting"))))
        self.pool_yielding.labels(pool=pool).set(len(yielding))
        self.pool_capacity_units.labels(pool=pool).set(units if isinstance(units, int | float) else 0)
        self.pool_last_sync.labels(pool=pool).set_to_current_time()
        started = _yield_keys(yielding) - _yield_keys(_entries((before or {}).get("yielding")))
        counter = self.pool_yields.labels(pool=pool)
        if started:
            counter.inc(len(started))
        waiters = {str(w.get("pod")): str(w.get("service")) for w in _entries(after.get("waiting"))}
        for entry in yielding:
            if (str(entry.get("scaledObject")), str(entry.get("for"))) in started:
                self._yield_started(pool, entry, waiters)

    def _yield_started(self, pool: str, entry: Mapping[str, Any], waiters: Mapping[str, str]) -> None:
        victim, pod = str(entry.get("service")), str(entry.get("for"))
        logger.info("pool %s: %s yields %s on %s to %s (pod %s)", pool, victim, entry.get("units"), entry.get("node"),
                    waiters.get(pod, "?"), pod)
        with self._pools_lock:
            known = (pool, victim) in self._victims or len(self._victims) < MAX_TRACKED_VICTIMS
            if known:
                self._victims.add((pool, victim))
        if known:
            self.pool_model_yields.labels(pool=pool, victim=victim).inc()

    def observe_pool_sync(self, request: Mapping[str, Any], answer: Mapping[str, Any]) -> None:
        """:meth:`observe_pool` for a pool sync request and its answer; never raises (metrics must
        not turn a good answer into an error)."""
        try:
            parent = request.get("parent")
            if not isinstance(parent, Mapping):
                return
            name = (parent.get("metadata") or {}).get("name")
            if not isinstance(name, str) or not name:
                return
            before = parent.get("status")
            self.observe_pool(name, before if isinstance(before, Mapping) else None, answer.get("status"))
        except Exception:  # pragma: no cover - defensive: a malformed answer is the hook's bug, not ours
            logger.exception("could not record pool metrics")

    def exposition(self) -> tuple[bytes, str]:
        """The text exposition (body, content type) of all workers' metrics."""
        if os.environ.get(MULTIPROC_DIR_ENV):
            # A fresh registry per scrape is how prometheus-client's multiprocess mode is meant to be
            # read: the collector merges the files of all live and dead workers.
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


_certificate_gauge: Gauge | None = None


def record_served_certificate(not_after: float) -> None:
    """The hook server now presents a certificate valid until ``not_after`` (Unix time): set at
    startup in the gunicorn master and by whichever worker reloads a rotated certificate. The gauge
    is not in any app's registry: ``serve`` always runs in multiprocess mode, where ``/metrics``
    reads every process's values from PROMETHEUS_MULTIPROC_DIR, and ``mostrecent`` picks the value
    written last, i.e. the certificate loaded last, which is what every worker serves from its next
    handshake on (a worker checks the files before each one)."""
    global _certificate_gauge
    if _certificate_gauge is None:
        _certificate_gauge = Gauge(CERTIFICATE_METRIC, CERTIFICATE_HELP, ["role"], multiprocess_mode="mostrecent",
                                   registry=None)
    _certificate_gauge.labels(role="hooks").set(not_after)


def _entries(value: Any) -> list[Mapping[str, Any]]:
    return [e for e in value if isinstance(e, Mapping)] if isinstance(value, list) else []


def _yield_keys(entries: list[Mapping[str, Any]]) -> set[tuple[str, str]]:
    """A yield's identity: which ScaledObject frees units for which waiting Pod."""
    return {(str(e.get("scaledObject")), str(e.get("for"))) for e in entries}
