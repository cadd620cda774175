"""Where a cold start's time goes, read from the backend Pods Metacontroller already relates.

Two things land in the LLMService status:

- the live `phase` of the backend and `phaseSince`, a timestamp (kubectl shows it as an age);
- `lastColdStart`, the most recent start from "nothing serving" to "a replica Ready", broken down
  into scheduling, initialization, the wait for staged weights, the serving image's pull and the
  model load.

Every value is a timestamp the Pod itself carries (creation, condition transitions, container
start and finish) or carried over from the previous status, never "now" minus something: a resync
of an unchanged world must produce the same bytes, or Metacontroller syncs in a loop.

Pod phases, in the order a Pod passes through them:

    Scheduling    created, not bound to a node          since metadata.creationTimestamp
    Initializing  bound; init containers running        since PodScheduled's lastTransitionTime
                  (incl. wait-for-weights)
    PullingImage  init done; serving container not      since Initialized's lastTransitionTime
                  started (the kubelet pulls its image)
    LoadingModel  serving container running, the Pod    since the container's startedAt
                  not yet Ready (or restarting after    (or its last finishedAt)
                  it exited)
    NotReady      was Ready, lost readiness while the   since Ready's lastTransitionTime
                  container kept running (not a start)
    Ready         passes readiness                       since Ready's lastTransitionTime

Pods that are being deleted or are over (status.phase Failed or Succeeded: evicted, shut down with
their node) are not counted at all: a leftover that pod GC removes days later neither serves nor wakes.

What "a cold start" is, from observed objects alone. The hooks are pure and keep no memory but the
status they wrote, so the backend's phase is also its state:

- *cold*: `ScaledToZero` (the Deployment at zero and no live Pod) and the phases of a backend waking
  from it — `Scheduling`, `Initializing`, `PullingImage`, `LoadingModel`. A new LLMService starts
  cold (its first start counts).
- *warm*: `Ready`, and `NotReady`, which the service shows while no replica is Ready although the
  backend served and has not been at zero since (a readiness blip, an engine restarting after a
  crash, a replacement for an evicted replica, a rollout). Warm lasts until the backend is seen at
  zero again.

A cold start happened when the previous status was cold and now a live Pod is Ready; the record is
that Pod's start (the earliest Ready Pod, created → Ready), unless it is the Pod already recorded.
Nothing in a warm backend rewrites the record, and a Pod that had already served before the hooks
saw it (per-Pod `NotReady`) makes the backend warm without a record. Because the phase carries the
state, the record and the phase change in the same status write, and `leadTime: auto` reads the
record this sync writes (`record`), not the previous one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from hooks.api.status import BackendPhase, ColdStart
from hooks.config import parse_rfc3339
from hooks.resources.prewarm import WAIT_CONTAINER
from hooks.runtime.pod import CONTAINER_NAME

_NEVER = datetime.max.replace(tzinfo=UTC)


Phase = BackendPhase  # the status model owns the names (and so the CRD's enum)


# How far along a Pod is: the service shows its most advanced Pod while none is Ready.
_PROGRESS = (Phase.SCHEDULING, Phase.INITIALIZING, Phase.PULLING_IMAGE, Phase.LOADING_MODEL, Phase.NOT_READY, Phase.READY)
# The cold phases: nothing served since the backend was last at zero (or created). A Pod becoming
# Ready after one of these is a cold start worth recording.
WAKING = frozenset({Phase.SCALED_TO_ZERO, Phase.SCHEDULING, Phase.INITIALIZING, Phase.PULLING_IMAGE, Phase.LOADING_MODEL})
# The warm phases: a replica served and the backend has not been at zero since.
WARM = frozenset({Phase.READY, Phase.NOT_READY})
# Pods that are over: they neither serve nor wake (evicted, shut down with their node, completed).
TERMINAL_POD_PHASES = frozenset({"Failed", "Succeeded"})


@dataclass(frozen=True)
class PodPhase:
    phase: Phase
    since: str | None  # RFC 3339, as the Pod carries it
    pod: str


def _conditions(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    conds = (pod.get("status") or {}).get("conditions") or []
    return {c["type"]: c for c in conds if isinstance(c, dict) and isinstance(c.get("type"), str)}


def _true_since(conds: dict[str, dict[str, Any]], ctype: str) -> str | None:
    c = conds.get(ctype)
    if c is None or c.get("status") != "True":
        return None
    when = c.get("lastTransitionTime")
    return when if isinstance(when, str) and when else None


def _serving_status(pod: dict[str, Any]) -> dict[str, Any]:
    statuses = [s for s in (pod.get("status") or {}).get("containerStatuses") or [] if isinstance(s, dict)]
    for s in statuses:
        if s.get("name") == CONTAINER_NAME:
            return s
    return statuses[0] if statuses else {}


def _name(pod: dict[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("name", ""))


def pod_phase(pod: dict[str, Any]) -> PodPhase:
    """The phase one backend Pod is in, and since when (by its own timestamps)."""
    name = _name(pod)
    conds = _conditions(pod)
    ready = _true_since(conds, "Ready")
    if ready is not None:
        return PodPhase(Phase.READY, ready, name)
    engine = _serving_status(pod)
    running = ((engine.get("state") or {}).get("running") or {}).get("startedAt")
    if isinstance(running, str) and running:
        # Ready went False after the container started: it served and lost readiness (an overloaded
        # engine, a failing probe). A fresh or restarted container started after Ready last changed.
        unready_at = parse_rfc3339((conds.get("Ready") or {}).get("lastTransitionTime"))
        started = parse_rfc3339(running)
        if unready_at is not None and started is not None and unready_at > started:
            return PodPhase(Phase.NOT_READY, conds["Ready"]["lastTransitionTime"], name)
        return PodPhase(Phase.LOADING_MODEL, running, name)
    initialized = _true_since(conds, "Initialized")
    ended = ((engine.get("lastState") or {}).get("terminated") or {}).get("finishedAt")
    if initialized is not None and isinstance(ended, str) and ended:
        # The engine ran and exited (a crash, an OOM kill): the kubelet restarts it to load again.
        return PodPhase(Phase.LOADING_MODEL, ended, name)
    if initialized is not None:
        return PodPhase(Phase.PULLING_IMAGE, initialized, name)
    scheduled = _true_since(conds, "PodScheduled")
    if scheduled is not None:
        return PodPhase(Phase.INITIALIZING, scheduled, name)
    created = (pod.get("metadata") or {}).get("creationTimestamp")
    return PodPhase(Phase.SCHEDULING, created if isinstance(created, str) and created else None, name)


def is_over(pod: dict[str, Any]) -> bool:
    """Being deleted, or finished for good (Failed — evicted, node shutdown — or Succeeded)."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return True
    status = pod.get("status") or {}
    return status.get("phase") in TERMINAL_POD_PHASES or status.get("reason") == "Evicted"


def _live(pods: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for p in pods if not is_over(p)]


def _unready_since(pods: list[dict[str, Any]]) -> str | None:
    """When the last of these (not Ready) Pods changed readiness: for the replica that served, when
    it lost readiness."""
    times = [(t, c["lastTransitionTime"]) for c in (_conditions(p).get("Ready") for p in pods)
             if c is not None and (t := parse_rfc3339(c.get("lastTransitionTime"))) is not None]
    return max(times)[1] if times else None


def service_phase(desired_replicas: int | None, pods: Iterable[dict[str, Any]], warm: bool = False) -> PodPhase | None:
    """The backend's phase as a whole (None without a backend Deployment).

    Ready as soon as one Pod is (since the earliest of them). Otherwise, while warm (the previous
    phase was Ready or NotReady), NotReady unless the Deployment is at zero with no Pod left; while
    cold, the most advanced Pod's phase (NotReady when a Pod already served), and with no Pod
    ScaledToZero or (asked for, not yet created) Scheduling. Pods being deleted or over (Failed,
    Succeeded) no longer count: they are draining or gone, not serving and not waking.
    """
    if desired_replicas is None:
        return None
    live = _live(pods)
    phases = [pod_phase(p) for p in live]
    ready = [p for p in phases if p.phase == Phase.READY]
    if ready:
        return min(ready, key=lambda p: (parse_rfc3339(p.since) or _NEVER, p.pod))
    if not phases and (desired_replicas == 0 or not warm):
        return PodPhase(Phase.SCALED_TO_ZERO if desired_replicas == 0 else Phase.SCHEDULING, None, "")
    if warm:
        return PodPhase(Phase.NOT_READY, _unready_since(live), "")
    # Most advanced first; between equals the one that got there first (then by name): stable.
    return min(phases, key=lambda p: (-_PROGRESS.index(p.phase), parse_rfc3339(p.since) or _NEVER, p.pod))


def seconds(start: Any, end: Any) -> int | None:
    a, b = parse_rfc3339(start), parse_rfc3339(end)
    if a is None or b is None:
        return None
    return max(0, round((b - a).total_seconds()))  # clocks of different components: never negative


def _fmt(value: int) -> str:
    return f"{value}s"


def cold_start(pod: dict[str, Any]) -> dict[str, Any] | None:
    """The breakdown of one Pod's start (None when the Pod lacks a timestamp it needs).

    scheduling      created → bound
    initialization  bound → init containers done, minus the weights wait (init images, other init containers)
    weightsWait     the wait-for-weights init container's run (a prewarm Job staging the model)
    imagePull       init done → serving container started (the kubelet pulls the serving image)
    modelLoad       serving container started → Ready
    total           created → Ready
    """
    meta = pod.get("metadata") or {}
    conds = _conditions(pod)
    created = meta.get("creationTimestamp")
    scheduled = _true_since(conds, "PodScheduled")
    initialized = _true_since(conds, "Initialized")
    ready = _true_since(conds, "Ready")
    engine = _serving_status(pod)
    started = ((engine.get("state") or {}).get("running") or {}).get("startedAt")
    # An engine that exited during the start (an OOM kill while loading) and was restarted: the
    # image was pulled before its first run, the Pod shows the one before the current (the first
    # when it restarted once). The time from there on is loading, retries included.
    before = ((engine.get("lastState") or {}).get("terminated") or {}).get("startedAt")
    first, current = parse_rfc3339(before), parse_rfc3339(started)
    if first is not None and current is not None and first < current:
        started = before
    total = seconds(created, ready)
    spans = [seconds(created, scheduled), seconds(scheduled, initialized), seconds(initialized, started), seconds(started, ready)]
    if total is None or any(s is None for s in spans):
        return None
    scheduling, init, pull, load = (int(s) for s in spans)  # type: ignore[arg-type]
    wait = 0
    for s in (pod.get("status") or {}).get("initContainerStatuses") or []:
        if isinstance(s, dict) and s.get("name") == WAIT_CONTAINER:
            done = (s.get("state") or {}).get("terminated") or {}
            wait = seconds(done.get("startedAt"), done.get("finishedAt")) or 0
    wait = min(wait, init)
    return ColdStart(
        pod=_name(pod), started_at=created, ready_at=ready, scheduling=_fmt(scheduling),
        initialization=_fmt(init - wait), weights_wait=_fmt(wait), image_pull=_fmt(pull), model_load=_fmt(load),
        total=_fmt(total),
    ).wire()


def _as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _now(desired_replicas: int | None, pods: list[dict[str, Any]], previous: dict[str, Any]) -> PodPhase | None:
    return service_phase(desired_replicas, pods, warm=previous.get("phase") in WARM)


class Missing:
    """Marks an argument not given (None is a valid record: there is none)."""


MISSING = Missing()


def record(desired_replicas: int | None, pods: list[dict[str, Any]], previous_status: Any) -> dict[str, Any] | None:
    """The `lastColdStart` a sync of this world writes: the previous one, unless a cold start happened
    (the previous phase was cold and now a Pod not yet recorded is Ready): then that Pod's start."""
    previous = _as_dict(previous_status)
    kept = previous.get("lastColdStart") if isinstance(previous.get("lastColdStart"), dict) else None
    now = _now(desired_replicas, pods, previous)
    if now is None or now.phase != Phase.READY or previous.get("phase") not in WAKING:
        return kept
    if (kept or {}).get("pod") == now.pod:
        return kept
    pod = next(p for p in _live(pods) if _name(p) == now.pod)
    return cold_start(pod) or kept


def timeline(
    desired_replicas: int | None,
    pods: list[dict[str, Any]],
    previous_status: Any,
    clock: Callable[[], str],
    last: dict[str, Any] | None | Missing = MISSING,
) -> dict[str, Any]:
    """`phase`, `phaseSince` and `lastColdStart` for the status (keys absent when unknown). ``last``:
    the :func:`record` of these same arguments when the caller already has it."""
    previous = _as_dict(previous_status)
    out: dict[str, Any] = {}
    now = _now(desired_replicas, pods, previous)
    if now is not None:
        since = now.since
        kept = previous.get("phaseSince")
        same = previous.get("phase") == now.phase and isinstance(kept, str)
        if same and now.phase == Phase.NOT_READY:
            since = kept  # the backend stopped serving then, whatever its Pods did since
        elif since is None:
            # Nothing on a Pod says when (scaled to zero, no Pod created yet, a warm backend without a
            # Pod): keep the time this phase was first seen; the clock is read only when it changed.
            since = kept if same else clock()
        out["phase"] = str(now.phase)
        out["phaseSince"] = since
    if isinstance(last, Missing):
        last = record(desired_replicas, pods, previous)
    if last is not None:
        out["lastColdStart"] = last
    return out


def total_seconds(last: Any) -> int | None:
    """Seconds of a `lastColdStart` record (None when there is none)."""
    total = last.get("total") if isinstance(last, dict) else None
    if isinstance(total, str) and total.endswith("s") and total[:-1].isdigit():
        return int(total[:-1])
    return None


def measured_total(parent: dict[str, Any]) -> int | None:
    """Seconds of the last cold start in the parent's status (None when none was recorded)."""
    status = parent.get("status")
    return total_seconds(status.get("lastColdStart") if isinstance(status, dict) else None)
