"""The backend Pods of one model as the gateway sees them: what the EndpointSlices say (the kubelet's
view) merged with what the gateway observed itself (its own probes, connections that failed), and
the rules that decide which Pods may take a new request. Socket-free: connection pools are made by
a factory the caller passes, and time is an argument.

Which Pod may take a new request, decided by the first of these rules that speaks
(:data:`ELIGIBILITY`; docs/architecture.md, "Backend Pods"):

1. ``terminating``: the Pod is being deleted: no new request (those in flight finish).
2. ``unready_again``: the kubelet once reported it Ready and now does not: no new request.
3. ``connect_failed``: a connection to it failed since its last good probe: none until one passes.
4. ``kubelet_ready``: the EndpointSlice says ready: yes.
5. ``answered``: the gateway's own probe of its readiness path passed: yes, before the kubelet's
   next probe and the slice's update (as Knative's activator probes Pods itself).

A Pod no rule admits and none excludes for good is *starting*: the gateway probes it on the cold
cadence while the model is wanted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["PodEndpoint", "BackendPod", "BackendPods", "PodsChange", "ELIGIBILITY", "MAX_PODS"]

# Pods of one model the gateway keeps (a Deployment of more replicas is served by its first
# MAX_PODS endpoints in name order; the rest are left to the others' gateways' luck and logged).
MAX_PODS = 256

Pool = TypeVar("Pool")


@dataclass(frozen=True, slots=True)
class PodEndpoint:
    """One endpoint of the backend Service as an EndpointSlice lists it (discovery.k8s.io/v1)."""

    name: str  # the Pod's name (targetRef), else the address
    address: str
    port: int
    ready: bool  # conditions.ready (nil reads as true, as the API says)
    serving: bool  # conditions.serving (nil: as ready)
    terminating: bool  # conditions.terminating (nil: false)


class BackendPod(Generic[Pool]):
    """One Pod's state: its endpoint, the gateway's own observations, its load and its pool."""

    __slots__ = ("endpoint", "pool", "answered", "connect_failed", "ready_seen", "outstanding", "served",
                 "answered_at", "kubelet_ready_at", "gone", "cell")

    def __init__(self, endpoint: PodEndpoint, pool: Pool) -> None:
        self.endpoint = endpoint
        self.pool = pool
        self.answered = False  # our own probe passed (and nothing failed since)
        self.connect_failed = False  # a connection failed since the last good probe
        self.ready_seen = endpoint.ready  # the kubelet has called it Ready at least once
        self.outstanding = 0  # requests sent to it and not finished, by this worker
        self.served = 0  # requests sent to it, by this worker
        self.answered_at: float | None = None  # first passing probe of ours
        self.kubelet_ready_at: float | None = None  # first slice saying ready, seen by us
        self.gone = False  # no longer listed: finishes what it has, takes nothing new
        self.cell = -1  # its counters' index in the worker's /metrics table (-1: none yet; -2: given up)

    @property
    def name(self) -> str:
        return self.endpoint.name

    def __repr__(self) -> str:
        return f"BackendPod({self.name} {self.endpoint.address} outstanding={self.outstanding})"


Rule = Callable[[BackendPod[Any]], bool | None]  # True: eligible, False: not, None: no opinion


def terminating(pod: BackendPod[Any]) -> bool | None:
    return False if pod.endpoint.terminating else None


def unready_again(pod: BackendPod[Any]) -> bool | None:
    return False if pod.ready_seen and not pod.endpoint.ready else None


def connect_failed(pod: BackendPod[Any]) -> bool | None:
    return False if pod.connect_failed else None


def kubelet_ready(pod: BackendPod[Any]) -> bool | None:
    return True if pod.endpoint.ready else None


def answered(pod: BackendPod[Any]) -> bool | None:
    return True if pod.answered else None


ELIGIBILITY: tuple[Rule, ...] = (terminating, unready_again, connect_failed, kubelet_ready, answered)


def verdict(pod: BackendPod[Any], rules: Iterable[Rule] = ELIGIBILITY) -> bool | None:
    """The first rule's opinion (None: no rule spoke, the Pod is starting)."""
    for rule in rules:
        said = rule(pod)
        if said is not None:
            return said
    return None


@dataclass(frozen=True)
class PodsChange:
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    kubelet_ready: tuple[str, ...] = ()  # Pods the slice calls ready for the first time

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.kubelet_ready)


class BackendPods(Generic[Pool]):
    """The Pods of one model (see the module doc). ``pool_for(endpoint)`` makes a Pod's connection
    pool; ``retire(pool)`` is called for the pool of a Pod no longer listed."""

    def __init__(self, pool_for: Callable[[PodEndpoint], Pool], retire: Callable[[Pool], None]) -> None:
        self._pool_for = pool_for
        self._retire = retire
        self.by_name: dict[str, BackendPod[Pool]] = {}
        self.eligible: list[BackendPod[Pool]] = []  # in name order: every worker ranks them alike
        self.starting: list[BackendPod[Pool]] = []
        self.generation = 0  # bumped whenever ``eligible`` may have changed

    # -- the kubelet's view ----------------------------------------------------------------------
    def update(self, endpoints: Iterable[PodEndpoint], now: float) -> PodsChange:
        """Merge a fresh list of the Service's endpoints (the whole list, not a delta)."""
        fresh: dict[str, PodEndpoint] = {}
        for endpoint in sorted(endpoints, key=lambda e: e.name)[:MAX_PODS]:
            fresh[endpoint.name] = endpoint
        added, ready = [], []
        for name, endpoint in fresh.items():
            pod = self.by_name.get(name)
            if pod is None or pod.endpoint.address != endpoint.address or pod.endpoint.port != endpoint.port:
                if pod is not None:  # same name, new address: a new Pod for all that matters
                    self._drop(pod)
                pod = self.by_name[name] = BackendPod(endpoint, self._pool_for(endpoint))
                added.append(name)
            else:
                pod.endpoint = endpoint
            if endpoint.ready and pod.kubelet_ready_at is None:
                pod.kubelet_ready_at = now
                ready.append(name)
            pod.ready_seen = pod.ready_seen or endpoint.ready
        removed = [name for name in self.by_name if name not in fresh]
        for name in removed:
            self._drop(self.by_name.pop(name))
        self.refresh()
        return PodsChange(tuple(added), tuple(removed), tuple(ready))

    def _drop(self, pod: BackendPod[Pool]) -> None:
        pod.gone = True
        self._retire(pod.pool)

    # -- the gateway's own observations --------------------------------------------------------
    def probed(self, pod: BackendPod[Pool], ok: bool, now: float) -> bool:
        """One probe of ``pod``'s readiness path; True when its eligibility changed."""
        before = verdict(pod)
        pod.answered = ok
        if ok:
            pod.connect_failed = False
            if pod.answered_at is None:
                pod.answered_at = now
        self.refresh()
        return verdict(pod) != before

    def connection_failed(self, pod: BackendPod[Pool]) -> None:
        """Connecting failed (nothing was sent): no new request until a probe passes."""
        pod.connect_failed = True
        pod.answered = False
        self.refresh()

    def refresh(self) -> None:
        eligible, starting = [], []
        for pod in self.by_name.values():
            said = verdict(pod)
            if said:
                eligible.append(pod)
            elif said is None:
                starting.append(pod)
        self.eligible = eligible
        self.starting = starting
        self.generation += 1

    def to_probe(self) -> list[BackendPod[Pool]]:
        """Pods worth a probe now: starting ones, and listed-ready ones a connection failed on."""
        return [p for p in self.by_name.values()
                if not p.endpoint.terminating and not (p.ready_seen and not p.endpoint.ready)
                and (p.connect_failed or not p.endpoint.ready) and not p.answered]

    @property
    def listed(self) -> int:
        return len(self.by_name)

    def close(self) -> None:
        for pod in self.by_name.values():
            self._drop(pod)
        self.by_name.clear()
        self.refresh()
