"""Demand per model in a shared gateway: each model's Pod states and the broadcaster its
ScaledObject's calls are answered from, and the one sampler thread that feeds them. In report mode
(several replicas) the reporter sends every model's demand to the aggregator on each change of
``ModelDemand.changes``.

A model has one broadcaster for as long as the table lists it (KEDA's stream for it waits on that
object, so it must survive a reload that changes the model's settings), and one or more Pod states:
the current app's, plus those of apps retired by a reload that still finish requests they admitted.
The model's demand is their sum. Every Pod state posts one shared semaphore when its cold demand or
readiness flips, so a single thread parks while every model is idle and wakes for any of them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from gateway.state.pod import BACKEND_READY, PARKED_SECONDS, PodState, SamplerThread
from scaler.demand import Demand, DemandBroadcaster

__all__ = ["ModelBroadcaster", "ModelDemand", "ModelsSampler"]


class ModelBroadcaster(DemandBroadcaster):
    """A model's demand for KEDA; ``on_activated`` is what the scaler calls when it pushes ``true``
    (the model's apps time their activation from it)."""

    def __init__(self, on_activated: Callable[[float], None]) -> None:
        super().__init__()
        self.on_activated = on_activated


class ModelDemand:
    """Shared by the app (hub thread: adds and drops Pod states), the sampler thread and the scaler
    (reads broadcasters). Mutations replace whole dict values; readers take snapshots."""

    def __init__(self) -> None:
        self.notify = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._pods: dict[str, list[PodState]] = {}
        self._broadcasters: dict[str, ModelBroadcaster] = {}
        # The sum over the models, changed (forced) whenever any model's demand changes: what a
        # reporter waits on (scaler.reporter).
        self.changes = DemandBroadcaster()

    def pod_for(self, model: str, max_queue: int) -> PodState:
        """A new Pod state for ``model``'s new app (its held bytes count against the Pod's budget,
        not here)."""
        pod = PodState(1, max_queue, None, notify=self.notify)
        with self._lock:
            self._pods[model] = [*self._pods.get(model, []), pod]
            if model not in self._broadcasters:
                self._broadcasters[model] = ModelBroadcaster(lambda when, m=model: self._mark_pushed(m, when))
        self.notify.release()  # the sampler learns of the model now
        return pod

    def release(self, model: str, pod: PodState, *, listed: bool) -> None:
        """A retired app closed: its Pod state no longer counts. A model the table no longer lists
        loses its broadcaster with its last Pod state (its ScaledObject then gets NOT_FOUND)."""
        with self._lock:
            left = [p for p in self._pods.get(model, []) if p is not pod]
            if left:
                self._pods[model] = left
            else:
                self._pods.pop(model, None)
                if not listed:
                    self._broadcasters.pop(model, None)
        self.notify.release()

    def broadcaster(self, model: str) -> DemandBroadcaster | None:
        return self._broadcasters.get(model)

    def demands(self) -> dict[str, Demand]:
        """Each model's demand as last published (bounded by the table and the models retiring)."""
        with self._lock:
            broadcasters = list(self._broadcasters.items())
        return {name: broadcaster.current() for name, broadcaster in broadcasters}

    def mark_pushed(self, model: str, when: float) -> None:
        """``model``'s active demand reached KEDA (or the aggregator) at ``when``."""
        self._mark_pushed(model, when)

    def _mark_pushed(self, model: str, when: float) -> None:
        for pod in self._pods.get(model, []):
            pod.mark_pushed(when)

    def snapshot(self) -> list[tuple[str, list[PodState], ModelBroadcaster]]:
        with self._lock:
            return [(m, pods, self._broadcasters[m]) for m, pods in self._pods.items() if m in self._broadcasters]


class ModelsSampler(SamplerThread):
    """One OS thread publishing every model's demand (``DemandSampler``'s rules, per model): at once
    when any model's cold demand or readiness flips, every ``interval`` while any model may have warm
    traffic, else parked for up to ``PARKED_SECONDS``."""

    def __init__(self, demand: ModelDemand, interval: float = 0.1) -> None:
        super().__init__(demand.notify, interval, "noctaya-models-sampler")
        self.demand = demand
        self._transitions: dict[int, float] = {}  # id(pod) -> its transition counter at the last sample
        self._next_wait = 0.0  # the first sample at once, then as the last one found

    def _wait(self) -> float:
        return self._next_wait

    def publish_now(self) -> bool:
        """Publish every model's demand; whether any model may have warm traffic."""
        busy = changed = False
        queued_sum = in_flight_sum = 0
        lease_any = False
        seen: dict[int, float] = {}
        for _model, pods, broadcaster in self.demand.snapshot():
            queued = in_flight = 0
            lease = False
            for pod in pods:
                sample, seen[id(pod)] = pod.sample(self._transitions.get(id(pod), 0.0))
                queued += sample.queued
                in_flight += sample.in_flight
                lease = lease or sample.lease_active
                busy = busy or pod.any(BACKEND_READY)
            demand = Demand() if self.withdrawn else Demand(queued, in_flight, lease)
            busy = busy or demand.active
            changed = broadcaster.publish(demand) or changed
            queued_sum += demand.queued
            in_flight_sum += demand.in_flight
            lease_any = lease_any or demand.lease_active
        self.demand.changes.publish(Demand(queued_sum, in_flight_sum, lease_any), force=changed)
        self._transitions = seen
        self._next_wait = self.interval if busy else PARKED_SECONDS
        return busy

