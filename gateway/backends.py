"""Where one model's requests go: the backend's Pods, each with its own connection pool, when an
endpoint source lists them (gateway.endpointslices); else the backend Service's address.

Per request, :meth:`Backends.acquire` chooses among the Pods that may take it
(``gateway.state.endpoints``: listed, not terminating, Ready by the kubelet or answering the
gateway's own probe) by the rules of ``gateway.balance`` (fewest outstanding, prefix affinity with a
load bound, the cold batch while other Pods are starting), and returns a connection to that Pod. A
Pod whose connection fails before any byte was sent is set aside until a probe passes, and the
request tries the next one (nothing was sent, so this is no replay). :meth:`Backends.finish` ends a
request's count on its Pod.

:meth:`Backends.probe` is the model's readiness probe (the activation's prober calls it): without
Pods listed it probes the Service as before; with them, it probes the Pods that are starting (every
Pod with an address, Ready or not, as Knative's activator does) at once, and says READY as soon as
one may take a request. A Pod the kubelet reports Ready needs no probe of ours.

Without a source (``NOCTAYA_ENDPOINT_SOURCE=service``, a hand-given URL, no credentials, the watch
failing) the Service's pooled connections live at most ``upstream_max_connection_age_seconds``, so
kube-proxy's choice per connection still reaches new Pods within seconds.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import gevent
import gevent.event

from gateway.affinity import affinity_key
from gateway.balance import AffinityRing, choose
from gateway.config import GatewayConfig
from gateway.endpointslices import EndpointFeed, InClusterCredentials, NotInCluster, service_of
from gateway.metrics import GatewayMetrics
from gateway.relay import ConnectFailed, UpstreamConnection, UpstreamPool, probe_readiness
from gateway.state.endpoints import BackendPod, BackendPods, PodEndpoint
from gateway.state.readiness import ProbeResult

__all__ = ["Backends", "endpoint_feed", "MAX_PROBES"]

log = logging.getLogger("noctaya.gateway.backends")

MAX_PROBES = 64  # Pods probed in one round (the rest in the next; each probe is bounded by its timeout)


def endpoint_feed(config: GatewayConfig, environ: Any = None) -> tuple[EndpointFeed | None, str]:
    """The worker's endpoint source as configured (start in the hub thread), and its namespace
    (empty without one). Without credentials it logs why and returns (None, "")."""
    if config.endpoint_source != "endpointslices":
        return None, ""
    try:
        credentials = InClusterCredentials.from_env(os.environ if environ is None else environ,
                                                    config.service_account_dir)
    except (NotInCluster, OSError) as exc:
        log.warning("no endpoint source: balancing through the backend Service address", extra={"reason": str(exc)})
        return None, ""
    feed = EndpointFeed()
    # One model: its Service's slices only. A shared gateway: the namespace's (each model subscribes).
    selector = ""
    if not config.model_table_file:
        service = service_of(config.backend_host, credentials.namespace)
        if service is None:
            log.warning("the backend URL names no Service of the gateway's namespace: balancing through its address",
                        extra={"backend": config.backend_netloc, "namespace": credentials.namespace})
            feed.close()
            return None, ""
        selector = f"kubernetes.io/service-name={service}"
    feed.start_watch(credentials, selector)
    return feed, credentials.namespace


class Backends:
    """One model's backend side (module doc). Construct and use in the hub thread."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics, *, clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[], None] | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self.on_change = on_change or (lambda: None)
        self.service = UpstreamPool(
            config.backend_host, config.backend_port, connect_timeout=config.upstream_connect_timeout_seconds,
            idle_timeout=config.upstream_idle_timeout_seconds, on_protocol_error=metrics.upstream_protocol_error,
            max_age=config.upstream_max_connection_age_seconds or None,
        )
        self.pods: BackendPods[UpstreamPool] | None = None  # None: no Pods known, use the Service
        self.ring: AffinityRing | None = None
        self.room = gevent.event.Event()  # set while a held request may take a Pod (the cold batch)
        self.room.set()
        self._turn = 0
        self._counted: dict[str, BackendPod[UpstreamPool]] = {}  # Pods with a /metrics slot, by name
        self._cells = metrics.backend_pods.cells
        self._by_name: dict[str, BackendPod[UpstreamPool]] = {}
        self._by_name_generation = -1
        self._feed: EndpointFeed | None = None
        self._service_name = ""
        self._path = config.backend_base_path + config.readiness_path

    # -- the endpoint source ------------------------------------------------------------------------
    def follow(self, feed: EndpointFeed | None, namespace: str) -> None:
        """Take the Pods of the backend URL's Service from ``feed`` (None: the Service address only)."""
        service = service_of(self.config.backend_host, namespace) if feed is not None else None
        if feed is None or service is None:
            return
        self._feed, self._service_name = feed, service
        feed.subscribe(service, self.endpoints)

    def endpoints(self, endpoints: tuple[PodEndpoint, ...] | None) -> None:
        """The Service's Pods, whole (None: unknown, the source is not synced or failing)."""
        if endpoints is None:
            if self.pods is not None:
                self.pods.close()
                self.pods = None
                self._rebuild()
                self.on_change()
            return
        if self.pods is None:
            self.pods = BackendPods(self._pool_for, self._retire)
            self.service.clear()
        change = self.pods.update(endpoints, self.clock())
        for name in change.kubelet_ready:
            self._kubelet_ready(self.pods.by_name[name])
        self._rebuild()
        self.on_change()

    def _pool_for(self, endpoint: PodEndpoint) -> UpstreamPool:
        config = self.config
        return UpstreamPool(endpoint.address, endpoint.port, connect_timeout=config.upstream_connect_timeout_seconds,
                            idle_timeout=config.upstream_idle_timeout_seconds,
                            on_protocol_error=self.metrics.upstream_protocol_error)

    def _retire(self, pool: UpstreamPool) -> None:
        pool.close()  # idle connections now; those in use close when their request ends

    def _kubelet_ready(self, pod: BackendPod[UpstreamPool]) -> None:
        """The slice called ``pod`` Ready: how long it had answered our probe before (the lag the
        kubelet's probe period and the endpoints' update add to a cold start)."""
        if pod.answered_at is not None and pod.kubelet_ready_at is not None:
            lead = max(0.0, pod.kubelet_ready_at - pod.answered_at)
            self.metrics.ready_lead.observe(lead)
            log.info("backend pod ready", extra={"pod": pod.name, "engine_ready_before_kubelet_seconds": round(lead, 3),
                                                 "served_before_kubelet": pod.served})

    def _rebuild(self) -> None:
        """The affinity ring (over listed Pods not terminating: stable while Pods turn ready) and
        the cold batch's room, after the Pods changed."""
        pods = self.pods
        names = () if pods is None else tuple(sorted(p.name for p in pods.by_name.values()
                                                      if not p.endpoint.terminating))
        if self.ring is None or self.ring.names != names:
            self.ring = AffinityRing(names) if len(names) > 1 else None
        for name in [n for n in self._counted if pods is None or n not in pods.by_name]:
            self.metrics.backend_pods.free(name)  # its series goes: the `pod` label follows the listed Pods
            self._counted.pop(name).cell = -2
        self._update_room()

    def _update_room(self) -> None:
        if self.has_room():
            self.room.set()

    # -- questions ----------------------------------------------------------------------------------
    def has_room(self) -> bool:
        """May a held request be released now? (No: every eligible Pod is at the cold batch while
        another Pod of the model is still starting; clears ``room`` so waiters can wait on it.)"""
        pods = self.pods
        if pods is None or not pods.starting or not pods.eligible:
            return True
        batch = self.config.pod_batch
        if any(p.outstanding < batch for p in pods.eligible):
            return True
        self.room.clear()
        return False

    def verdict(self) -> ProbeResult:
        """Ready as far as the Pods tell (without Pods known: the Service, by probe only)."""
        pods = self.pods
        if pods is None:
            return ProbeResult.NOT_READY
        if pods.eligible:
            return ProbeResult.READY
        return ProbeResult.NOT_READY if pods.listed else ProbeResult.REFUSED

    @property
    def settled(self) -> bool:
        """No Pod is starting (the prober may slow to its warm cadence)."""
        return self.pods is None or not self.pods.starting

    # -- per request --------------------------------------------------------------------------------
    def acquire(self, body: bytes, *, cold: bool = False) -> UpstreamConnection | None:
        """A connection for one request (counted on its Pod until :meth:`finish`); None when the cold
        batch leaves no room. Raises ConnectFailed when no Pod (or the Service) can be connected."""
        pods = self.pods
        if pods is None:
            return self.service.acquire()
        key: int | None = None
        keyed = False
        for _ in range(len(pods.eligible) + 1):
            eligible = pods.eligible
            if len(eligible) == 1 and not (cold and pods.starting):
                pod, placement = eligible[0], None  # the warm path with one Pod: nothing to decide
            elif not eligible:
                raise ConnectFailed(refused=not pods.listed)
            else:
                if not keyed and self.config.prefix_affinity and len(eligible) > 1 and self.ring is not None:
                    key, keyed = affinity_key(body, self.config.affinity_prefix_bytes), True
                choice = choose(eligible, key=key, ring=self.ring, factor=self.config.affinity_load_factor,
                                batch=self.config.pod_batch if cold and pods.starting else None, turn=self._turn,
                                by_name=self._eligible_by_name(pods) if key is not None else None)
                self._turn += 1
                if choice is None:
                    self.room.clear()
                    return None
                pod, placement = choice.pod, choice.affinity if len(eligible) > 1 else None  # type: ignore[assignment]
            conn = self._connect(pods, pod, placement)
            if conn is not None:
                return conn
        raise ConnectFailed(refused=False)

    def _eligible_by_name(self, pods: BackendPods[UpstreamPool]) -> dict[str, BackendPod[UpstreamPool]]:
        """The eligible Pods by name, rebuilt only when they changed (not per request)."""
        if self._by_name_generation != pods.generation:
            self._by_name = {p.name: p for p in pods.eligible}
            self._by_name_generation = pods.generation
        return self._by_name

    def _connect(self, pods: BackendPods[UpstreamPool], pod: BackendPod[UpstreamPool],
                 placement: str | None) -> UpstreamConnection | None:
        """A connection to ``pod``, counted; None when connecting failed (nothing sent: the caller tries
        the next Pod)."""
        # Counted before connecting: a connect yields to the loop, and the requests released with
        # this one must see it (the cold batch, the load bound) while it connects.
        pod.outstanding += 1  # (inline: once per request)
        pod.served += 1
        cell = pod.cell
        if cell == -1:
            cell = pod.cell = self._counter(pod)
        if cell >= 0:
            cells = self._cells
            cells[cell] += 1
            cells[cell + 1] += 1
        try:
            conn = pod.pool.acquire()
        except BaseException as exc:
            self.finish(pod)
            if not isinstance(exc, ConnectFailed):
                raise
            pods.connection_failed(pod)
            self._rebuild()
            return None
        if placement is not None:
            self.metrics.placed(placement)
        conn.pod = pod
        return conn

    def _counter(self, pod: BackendPod[UpstreamPool]) -> int:
        """The index of ``pod``'s counters in the worker's /metrics table (assigned on first use)."""
        table = self.metrics.backend_pods
        self._counted[pod.name] = pod
        return table.counter(table.slot(pod.name))

    def finish(self, pod: BackendPod[UpstreamPool] | None) -> None:
        """A request counted on ``pod`` (``acquire``'s connection's ``pod``) ended: answered, failed or
        abandoned. The caller calls it once per request (a connection may already serve another)."""
        if pod is None:
            return
        pod.outstanding -= 1
        if pod.cell >= 0:
            self._cells[pod.cell] -= 1
        if not self.room.is_set() and pod.outstanding < self.config.pod_batch:
            self._update_room()

    def connect_failed(self, conn: UpstreamConnection | None = None) -> None:
        """Nothing could be connected: forget the Service's pooled connections."""
        self.service.clear()

    # -- readiness ------------------------------------------------------------------------------------
    def probe(self) -> ProbeResult:
        """One round of the model's readiness probe (see the module doc)."""
        config = self.config
        pods = self.pods
        if pods is None:
            return probe_readiness(self.service, self._path, config.backend_netloc, config.probe_timeout_seconds)
        targets = pods.to_probe()[:MAX_PROBES]
        if targets:
            results = self._probe_all(targets)
            now = self.clock()
            changed = False
            for pod, result in zip(targets, results, strict=True):
                if not pod.gone:
                    changed = pods.probed(pod, result is ProbeResult.READY, now) or changed
            if changed:
                self._rebuild()
        return self.verdict()

    def _probe_all(self, targets: list[BackendPod[UpstreamPool]]) -> list[ProbeResult]:
        config = self.config
        if len(targets) == 1:
            return [probe_readiness(targets[0].pool, self._path, config.backend_netloc, config.probe_timeout_seconds)]
        probes = [gevent.spawn(probe_readiness, pod.pool, self._path, config.backend_netloc,
                               config.probe_timeout_seconds) for pod in targets]
        gevent.joinall(probes, timeout=config.probe_timeout_seconds * 4)
        results = []
        for probe in probes:
            if probe.ready() and probe.successful():
                results.append(probe.value)
            else:
                probe.kill(block=False)
                results.append(ProbeResult.NOT_READY)
        return results

    # -- observability ----------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """For ``/noctaya/queue``: where requests go and each Pod's state."""
        pods = self.pods
        if pods is None:
            return {"source": "service" if self._feed is None else "service (endpoints not known)",
                    "connectionsOpened": self.service.opened}
        eligible = {p.name for p in pods.eligible}
        starting = {p.name for p in pods.starting}
        return {"source": "endpointslices", "service": self._service_name, "pods": [
            {"name": p.name, "address": p.endpoint.address, "ready": p.endpoint.ready,
             "terminating": p.endpoint.terminating, "answered": p.answered,
             "state": "eligible" if p.name in eligible else "starting" if p.name in starting else "excluded",
             "outstanding": p.outstanding, "served": p.served}
            # A snapshot: the admin port's thread reads this while the worker's loop updates the Pods.
            for p in list(pods.by_name.values())]}

    def clear(self) -> None:
        self.service.clear()

    def close(self) -> None:
        if self._feed is not None:
            self._feed.unsubscribe(self._service_name, self.endpoints)
            self._feed = None
        if self.pods is not None:
            self.pods.close()
        self.service.close()
