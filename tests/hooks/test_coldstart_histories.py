"""Property tests: the cold-start record and the live phase over generated histories of backend Pods.

A small simulation of what the cluster does to the backend — KEDA waking it from zero and scaling it
in and out, the ReplicaSet replacing Pods, the kubelet starting, crash-restarting and evicting them,
readiness probes failing and passing, pod GC — produces a history of worlds. The real sync hook sees
only some of them (Metacontroller coalesces events into fewer syncs), each with the status it wrote
last time, exactly as Metacontroller feeds it back.

The simulation knows the truth: a *cold start* happened when a Pod became Ready while nothing had
served since the backend was last at zero (the Deployment at zero replicas and no Pod left that is
neither being deleted nor over) or since the LLMService was created. The hooks know only what the
Pods they are shown say and the status they wrote. The properties:

1. the record changes only when a cold start really happened since it last changed, at most once per
   cold start, and names the Pod that made the start whenever the hooks could see it;
2. a cold start that the hooks saw coming (they saw the backend cold before it, and then the Pod Ready
   before it lost readiness or crashed) is recorded at once, with the parts the Pod really took;
3. at zero the phase is ScaledToZero, whatever Failed or Evicted leftovers remain;
4. once the hooks saw a warm backend serve, no waking phase is shown until it has been at zero again;
5. a resync of the same world (with the clock moved on) gives byte-identical status.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from hooks.controller.coldstart import WAKING
from hooks.controller.sync import sync
from tests.hooks import helpers as h

T0 = datetime(2026, 3, 1, 8, 0, 0, tzinfo=UTC)
PARENT = h.llmservice(scaling={"min": 0, "max": 3, "schedules": [
    {"start": "0 8 * * *", "end": "0 18 * * *", "leadTime": "auto", "replicas": 1}]})
PARTS = ("scheduling", "initialization", "weightsWait", "imagePull", "modelLoad")


def at(seconds: int) -> str:
    return (T0 + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class SimPod:
    """One backend Pod as the simulation knows it (all times in seconds after T0)."""

    name: str
    created: int
    waits: bool  # has a wait-for-weights init container (prewarm)
    scheduled: int | None = None
    wait_start: int | None = None
    wait_end: int | None = None
    initialized: int | None = None
    started: int | None = None  # the engine's current run
    first_start: int | None = None
    last_run: tuple[int, int] | None = None  # the previous run's start and end
    crashed: bool = False  # waiting in CrashLoopBackOff
    restarts: int = 0
    ready: bool = False
    ready_since: int | None = None  # the Ready condition's lastTransitionTime
    served: bool = False  # was Ready at some point
    disturbed: bool = False  # lost readiness (blip, crash, eviction) after its first Ready
    deleting: int | None = None
    evicted: int | None = None
    truth: dict[str, str] | None = None  # the record its first Ready deserves

    @property
    def live(self) -> bool:
        return self.deleting is None and self.evicted is None

    def json(self) -> dict[str, Any]:
        conds: list[dict[str, Any]] = []
        if self.scheduled is None:
            conds.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                          "message": "0/2 nodes are available", "lastTransitionTime": at(self.created)})
        else:
            conds.append({"type": "PodScheduled", "status": "True", "lastTransitionTime": at(self.scheduled)})
            conds.append({"type": "Initialized", "status": "True" if self.initialized is not None else "False",
                          "lastTransitionTime": at(self.initialized if self.initialized is not None else self.scheduled)})
            ready_at = self.ready_since if self.ready_since is not None else self.scheduled
            conds.append({"type": "Ready", "status": "True" if self.ready else "False", "lastTransitionTime": at(ready_at)})
        status: dict[str, Any] = {"phase": "Running" if self.first_start is not None else "Pending", "conditions": conds}
        if self.waits and self.wait_start is not None:
            state = ({"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": at(self.wait_start),
                                     "finishedAt": at(self.wait_end)}} if self.wait_end is not None
                     else {"running": {"startedAt": at(self.wait_start)}})
            status["initContainerStatuses"] = [{"name": "wait-for-weights", "ready": False, "restartCount": 0, "state": state}]
        if self.scheduled is not None:
            engine: dict[str, Any] = {"name": "engine", "image": "vllm/vllm-openai:v0.8.5", "restartCount": self.restarts,
                                      "ready": self.ready, "started": self.started is not None and not self.crashed}
            if self.evicted is not None:
                run = self.started if self.started is not None else self.evicted
                engine["state"] = {"terminated": {"exitCode": 137, "reason": "Error", "startedAt": at(run),
                                                  "finishedAt": at(self.evicted)}}
            elif self.crashed:
                engine["state"] = {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off restarting"}}
            elif self.started is not None:
                engine["state"] = {"running": {"startedAt": at(self.started)}}
            else:
                engine["state"] = {"waiting": {"reason": "PodInitializing"}}
            if self.last_run is not None:
                engine["lastState"] = {"terminated": {"exitCode": 1, "reason": "Error", "startedAt": at(self.last_run[0]),
                                                      "finishedAt": at(self.last_run[1])}}
            status["containerStatuses"] = [engine]
        if self.evicted is not None:
            status.update(phase="Failed", reason="Evicted", message="The node was low on resource: memory.")
        meta: dict[str, Any] = {"name": self.name, "namespace": h.NAMESPACE, "creationTimestamp": at(self.created),
                                "labels": {"serving.noctaya.io/llmservice": "qwen", "serving.noctaya.io/component": "backend"}}
        if self.deleting is not None:
            meta["deletionTimestamp"] = at(self.deleting)
        return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "status": status}


@dataclass
class Event:
    """A cold start that really happened."""

    pod: SimPod
    time: int


@dataclass
class World:
    desired: int
    t: int = 0
    pods: list[SimPod] = field(default_factory=list)
    made: int = 0
    cold: bool = True  # nothing served since the backend was created or last at zero
    events: list[Event] = field(default_factory=list)
    waits: bool = False

    def live(self) -> list[SimPod]:
        return [p for p in self.pods if p.live]

    @property
    def at_zero(self) -> bool:
        return self.desired == 0 and not self.live()

    def reconcile(self) -> None:
        """The ReplicaSet: as many live Pods as desired (the newest go first when there are too many)."""
        while len(self.live()) < self.desired:
            self.made += 1
            self.pods.append(SimPod(f"qwen-backend-{self.made}", self.t, self.waits))
        for extra in sorted(self.live(), key=lambda p: (p.ready, -p.created))[: max(0, len(self.live()) - self.desired)]:
            extra.deleting = self.t
        if self.at_zero:
            self.cold = True

    def become_ready(self, pod: SimPod) -> None:
        pod.ready, pod.ready_since = True, self.t
        if not pod.served:
            pod.served = True
            assert pod.scheduled is not None and pod.initialized is not None and pod.first_start is not None
            wait = (pod.wait_end - pod.wait_start) if pod.wait_end is not None and pod.wait_start is not None else 0
            pod.truth = {"pod": pod.name, "startedAt": at(pod.created), "readyAt": at(self.t),
                         "scheduling": f"{pod.scheduled - pod.created}s",
                         "initialization": f"{pod.initialized - pod.scheduled - wait}s", "weightsWait": f"{wait}s",
                         "imagePull": f"{pod.first_start - pod.initialized}s", "modelLoad": f"{self.t - pod.first_start}s",
                         "total": f"{self.t - pod.created}s", "_restarts": str(pod.restarts)}
        if self.cold:
            self.cold = False
            self.events.append(Event(pod, self.t))

    def act(self, action: str, pick: int) -> None:
        """One thing happening to the backend; `pick` chooses among the Pods it can happen to."""
        def one(candidates: list[SimPod]) -> SimPod | None:
            return candidates[pick % len(candidates)] if candidates else None

        live = self.live()
        if action == "wake" and self.desired == 0:
            self.desired = 1
        elif action == "scale_out" and 1 <= self.desired < 3:
            self.desired += 1
        elif action == "scale_in" and self.desired >= 2 and (pod := one(live)) is not None:
            self.desired -= 1
            pod.deleting = self.t  # the ReplicaSet's choice (pod-deletion-cost, node drains): any of them
        elif action == "to_zero":
            self.desired = 0
        elif action == "progress" and (pod := one([p for p in live if not p.ready and not p.crashed])) is not None:
            if pod.scheduled is None:
                pod.scheduled = self.t
            elif pod.waits and pod.wait_start is None:
                pod.wait_start = self.t
            elif pod.waits and pod.wait_end is None:
                pod.wait_end = self.t
            elif pod.initialized is None:
                pod.initialized = self.t
            elif pod.started is None:
                pod.started = pod.first_start = self.t
            else:
                self.become_ready(pod)
        elif action == "crash" and (pod := one([p for p in live if p.started is not None and not p.crashed])) is not None:
            pod.last_run, pod.crashed, pod.restarts = (pod.started, self.t), True, pod.restarts + 1
            if pod.ready:
                pod.ready, pod.ready_since, pod.disturbed = False, self.t, True
        elif action == "restart" and (pod := one([p for p in live if p.crashed])) is not None:
            pod.crashed, pod.started = False, self.t
        elif action == "blip" and (pod := one([p for p in live if p.ready])) is not None:
            pod.ready, pod.ready_since, pod.disturbed = False, self.t, True
        elif action == "evict" and (pod := one(live)) is not None:
            pod.evicted = self.t
            pod.disturbed = pod.disturbed or pod.ready
            pod.ready = False
        elif action == "gone":  # graceful termination over: deleted Pods leave the API
            self.pods = [p for p in self.pods if p.deleting is None]
        elif action == "gc":  # pod GC removes the Failed leftovers (in a real cluster: maybe days later)
            self.pods = [p for p in self.pods if p.evicted is None]
        self.reconcile()

    def pods_json(self) -> list[dict[str, Any]]:
        return [p.json() for p in self.pods]


# Pods mostly make progress; everything else happens now and then.
ACTIONS = ("wake", "wake", "scale_out", "scale_in", "to_zero", *["progress"] * 8, "crash", "restart", "restart", "blip",
           "evict", "gone", "gone", "gc")

_CHILDREN: dict[int, list[dict[str, Any]]] = {}


def _children(replicas: int) -> list[dict[str, Any]]:
    if replicas not in _CHILDREN:
        answer = sync(h.sync_request(PARENT), h.config())
        _CHILDREN[replicas] = [h.as_observed(c, i, replicas=replicas) if c["kind"] == "Deployment" else h.as_observed(c, i)
                               for i, c in enumerate(answer["children"])]
    return _CHILDREN[replicas]


def hook(world_pods: list[dict[str, Any]], desired: int, status: dict[str, Any] | None, now: int) -> dict[str, Any]:
    """The status the real sync hook writes for this world, given the status it wrote last."""
    parent = PARENT if status is None else {**PARENT, "status": status}
    request = h.sync_request(parent, children=_children(desired), pods=world_pods)
    return sync(request, h.config(at(now)))["status"]


def canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


@dataclass
class Seen:
    """One sync: the world the hooks were shown and the status they wrote."""

    t: int
    cold: bool
    at_zero: bool
    desired: int
    status: dict[str, Any]
    ready_pods: dict[str, SimPod]
    events: int  # how many cold starts had happened by then


history = hs.lists(
    hs.tuples(hs.sampled_from(ACTIONS), hs.integers(0, 5), hs.integers(1, 400), hs.booleans()),
    min_size=20, max_size=80,
)


def run(desired: int, waits: bool, steps: list[tuple[str, int, int, bool]]) -> tuple[World, list[Seen]]:
    world = World(desired=desired, waits=waits)
    world.reconcile()
    seen: list[Seen] = []
    status: dict[str, Any] | None = None

    def observe() -> None:
        nonlocal status
        pods = world.pods_json()
        status = hook(pods, world.desired, status, world.t + 100_000)
        # 5. A resync of the same world, later, writes the same bytes (and never reads the clock).
        again = hook(pods, world.desired, status, world.t + 999_999)
        assert canon(again) == canon(status)
        seen.append(Seen(world.t, world.cold, world.at_zero, world.desired, status,
                         {p.name: p for p in world.live() if p.ready}, len(world.events)))

    observe()  # the first sync sees the new LLMService's backend
    for i, (action, pick, dt, observed) in enumerate(steps):
        world.t += dt
        world.act(action, pick)
        if observed or i == len(steps) - 1:
            observe()
    return world, seen


def check(world: World, seen: list[Seen]) -> None:
    consumed = 0  # cold starts accounted for by a change of the record
    last_warm_episode_seen_serving = False
    for k, now in enumerate(seen):
        status = now.status
        record = status.get("lastColdStart")
        before = seen[k - 1].status.get("lastColdStart") if k else None
        new = world.events[consumed:now.events]

        # 1. The record changes only for a cold start that happened since it last changed.
        if canon(record) != canon(before):
            assert new, f"sync {k}: the record changed with no cold start since the last change: {record}"
            assert int(record["total"][:-1]) == sum(int(record[p][:-1]) for p in PARTS)
            latest = new[-1].pod
            if latest.name in now.ready_pods and not latest.disturbed:
                assert record["pod"] == latest.name, (record, [e.pod.name for e in new])
            consumed = now.events

        # 2. A cold start the hooks saw coming is recorded at once, with the parts it took.
        since_last_sync = world.events[seen[k - 1].events:now.events] if k else []
        if len(since_last_sync) == 1 and seen[k - 1].cold and _saw_it_cold(seen, k - 1):
            event = since_last_sync[0]
            pod = now.ready_pods.get(event.pod.name)
            if pod is not None and not pod.disturbed:
                assert seen[k - 1].status["phase"] in {str(p) for p in WAKING}, seen[k - 1].status
                assert pod.truth is not None
                want = {key: v for key, v in pod.truth.items() if key != "_restarts"}
                if int(pod.truth["_restarts"]) <= 1:
                    assert record == want, (record, want)
                else:  # the Pod shows only its last two runs: load counted from the previous one
                    assert {key: record[key] for key in want if key not in ("imagePull", "modelLoad")} == \
                        {key: want[key] for key in want if key not in ("imagePull", "modelLoad")}
                    assert int(record["imagePull"][:-1]) + int(record["modelLoad"][:-1]) == \
                        int(want["imagePull"][:-1]) + int(want["modelLoad"][:-1])

        # 3. At zero the backend is ScaledToZero, leftovers or not.
        if now.at_zero:
            assert status["phase"] == "ScaledToZero", status

        # 4. A warm backend the hooks saw serving shows no waking phase until it was at zero again.
        if now.cold:
            last_warm_episode_seen_serving = False
        elif now.ready_pods:
            last_warm_episode_seen_serving = True
        if not now.cold and last_warm_episode_seen_serving:
            assert status["phase"] in {"Ready", "NotReady"}, status
        # Ready exactly when a live Pod is.
        assert (status["phase"] == "Ready") == bool(now.ready_pods), status


def _saw_it_cold(seen: list[Seen], k: int) -> bool:
    """The hooks saw this cold episode from its beginning: the world at zero, or the LLMService new."""
    j = k
    while j >= 0 and seen[j].cold:
        if seen[j].at_zero or j == 0:
            return True
        j -= 1
    return False


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(desired=hs.integers(0, 2), waits=hs.booleans(), steps=history)
def test_the_record_keeps_until_a_cold_start_really_happens(desired: int, waits: bool,
                                                             steps: list[tuple[str, int, int, bool]]) -> None:
    world, seen = run(desired, waits, steps)
    check(world, seen)


def test_the_issue_history_a_late_joiner_crashes_and_restarts() -> None:
    """#20 item 5: the replica that joined by scale-out is the only one left; its engine crashes and
    restarts. No new record (the one of the real start is kept), NotReady meanwhile, never LoadingModel."""
    steps = [("progress", 0, 12, True), ("progress", 0, 32, True), ("progress", 0, 27, True),
             ("progress", 0, 83, True),                          # qwen-backend-1 Ready: the cold start
             ("scale_out", 0, 300, True), *[("progress", 1, 20, True)] * 4,  # qwen-backend-2 Ready
             ("scale_in", 0, 600, True), ("gone", 0, 30, True),  # only the late joiner is left
             ("crash", 0, 900, True), ("restart", 0, 10, True), ("progress", 0, 60, True)]
    world, seen = run(1, False, steps)
    check(world, seen)
    assert [s.status["phase"] for s in seen][-4:] == ["Ready", "NotReady", "NotReady", "Ready"]
    assert {canon(s.status.get("lastColdStart")) for s in seen[4:]} == {canon(seen[4].status["lastColdStart"])}
    assert seen[-1].status["lastColdStart"]["pod"] == "qwen-backend-1"


def test_an_evicted_leftover_at_zero_is_scaled_to_zero_for_as_long_as_it_exists() -> None:
    steps = [*[("progress", 0, 10, True)] * 4, ("evict", 0, 100, True), ("to_zero", 0, 5, True), ("gone", 0, 5, True),
             *[("gone", 0, 86_400, True)] * 3, ("gc", 0, 3600, True)]
    world, seen = run(1, False, steps)
    check(world, seen)
    assert [s.status["phase"] for s in seen][-5:] == ["ScaledToZero"] * 5
    assert seen[-1].status["phaseSince"] == seen[-5].status["phaseSince"]


def test_a_wake_after_zero_is_recorded_once_even_when_syncs_coalesce() -> None:
    steps = [*[("progress", 0, 10, True)] * 4, ("to_zero", 0, 600, False), ("gone", 0, 30, True),
             ("wake", 0, 3600, False), *[("progress", 0, 15, False)] * 3, ("progress", 0, 40, True),
             ("blip", 0, 200, False), ("progress", 0, 5, True)]
    world, seen = run(1, False, steps)
    check(world, seen)
    records = [s.status.get("lastColdStart") for s in seen]
    assert records[4]["pod"] == "qwen-backend-1" and records[-2]["pod"] == "qwen-backend-2"
    assert records[-2] == records[-1] and records[-2]["total"] == "85s"
