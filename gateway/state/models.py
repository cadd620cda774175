"""Demand per model in a shared gateway: each model's Pod states and the broadcaster its
ScaledObject's calls are answered from, and the one sampler thread that feeds them. In report mode
(several replicas) the reporter sends every model's demand to the aggregator on each change of
``ModelDemand.changes``.

A model has one broadcaster for as long as the table lists it (KEDA's stream for it waits on that
object, so it must survive a reload that changes the model's settings), and one or more Pod states:
the current app's, plus those of apps retired by a reload that still finish requests they admitted.
The model's demand is their sum. A renamed model (same member, new served name) keeps its Pod
states and its broadcaster under the new name, and its old name stays an alias of the new one:
a ScaledObject still asking by the old name (KEDA has not reread it yet, or it was rendered by an
older release) keeps seeing the demand of the requests held across the rename. Every Pod state posts one shared semaphore when its cold demand or
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
        self._aliases: dict[str, str] = {}  # a renamed model's old name -> its current one
        self._scaled_objects: dict[str, str] = {}  # "<namespace>/<name>" of a member's ScaledObject -> its model
        # The sum over the models, changed (forced) whenever any model's demand changes: what a
        # reporter waits on (scaler.reporter).
        self.changes = DemandBroadcaster()

    def pod_for(self, model: str, max_queue: int) -> PodState:
        """A new Pod state for ``model``'s new app (its held bytes count against the Pod's budget,
        not here)."""
        pod = PodState(1, max_queue, None, notify=self.notify)
        with self._lock:
            self._aliases.pop(model, None)  # the name is a model's own again
            self._pods[model] = [*self._pods.get(model, []), pod]
            if model not in self._broadcasters:
                self._broadcasters[model] = ModelBroadcaster(lambda when, m=model: self._mark_pushed(m, when))
        self.notify.release()  # the sampler learns of the model now
        return pod

    def rename(self, old: str, new: str) -> None:
        """``old`` is now served as ``new``: its Pod states (held requests included) count for
        ``new``, and KEDA's streams waiting on its broadcaster keep it (they hold the object)."""
        with self._lock:
            pods = self._pods.pop(old, [])
            self._pods[new] = [*pods, *self._pods.get(new, [])]
            broadcaster = self._broadcasters.pop(old, None)
            if broadcaster is not None and new not in self._broadcasters:
                self._broadcasters[new] = broadcaster
            # Earlier names of this model now lead to its newest; bounded by the table's renames.
            self._aliases = {was: (new if now == old else now) for was, now in self._aliases.items() if was != new}
            self._aliases[old] = new
        self.notify.release()

    def release(self, model: str, pod: PodState, *, listed: bool) -> None:
        """A retired app closed: its Pod state no longer counts. A model the table no longer lists
        loses its broadcaster with its last Pod state (its ScaledObject then gets NOT_FOUND), and
        its old names with it."""
        with self._lock:
            model = self._aliases.get(model, model)  # an app retired after its model was renamed
            left = [p for p in self._pods.get(model, []) if p is not pod]
            if left:
                self._pods[model] = left
            else:
                self._pods.pop(model, None)
                if not listed:
                    self._broadcasters.pop(model, None)
                    self._aliases = {was: now for was, now in self._aliases.items() if now != model}
        self.notify.release()

    def set_scaled_objects(self, scaled_objects: dict[str, str]) -> None:
        """The table's ScaledObjects (``ModelTable.scaled_objects``), replaced whole on each table."""
        self._scaled_objects = dict(scaled_objects)

    def scaled_objects_by_model(self) -> dict[str, str]:
        """Each listed model's member's ScaledObject, by the model's current name (what a replica
        reports to the aggregator with the model's demand; a renamed model's old names carry none,
        so its demand is counted once per ScaledObject)."""
        return {model: scaled_object for scaled_object, model in self._scaled_objects.items()}

    def by_scaled_object(self, namespace: str, name: str) -> DemandBroadcaster | None:
        """The demand of the member whose ScaledObject this is (the scaler's answer when the
        trigger's ``model`` is a name the table does not list yet: a rename the kubelet has not
        brought to this Pod)."""
        model = self._scaled_objects.get(f"{namespace}/{name}")
        return None if model is None else self.broadcaster(model)

    def broadcaster(self, model: str) -> DemandBroadcaster | None:
        """``model``'s broadcaster; a renamed model's also by its old names."""
        found = self._broadcasters.get(model)
        if found is None:
            found = self._broadcasters.get(self._aliases.get(model, ""))
        return found

    def demands(self) -> dict[str, Demand]:
        """Each model's demand as last published (bounded by the table and the models retiring)."""
        with self._lock:
            broadcasters = list(self._broadcasters.items())
            aliases = [(was, self._broadcasters.get(now)) for was, now in self._aliases.items()]
        # A renamed model's demand is also reported by its old names, so the aggregator can answer
        # a ScaledObject that still asks by one of them.
        current = {name: broadcaster.current() for name, broadcaster in broadcasters}
        return {**{was: b.current() for was, b in aliases if b is not None and was not in current}, **current}

    def mark_pushed(self, model: str, when: float) -> None:
        """``model``'s active demand reached KEDA (or the aggregator) at ``when``."""
        self._mark_pushed(model, when)

    def _mark_pushed(self, model: str, when: float) -> None:
        # The broadcaster's callback names the model as it was when the broadcaster was made.
        for pod in self._pods.get(model) or self._pods.get(self._aliases.get(model, ""), []):
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

