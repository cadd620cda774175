"""Conditions and status of an LLMService, computed from observed children and related Pods.

Messages are built from stable facts only (names, counts, reasons — never times), and
`lastTransitionTime` changes only when a condition's status changes: every status write triggers
another sync, so a status that differs on every call would loop forever.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hooks.api.status import ConditionType, Reason
from hooks.controller.coldstart import is_over

MAX_MESSAGE = 400

CONDITION_ORDER = (
    ConditionType.RUNTIME_RESOLVED,
    ConditionType.AUTOSCALING_READY,
    ConditionType.CACHE_READY,
    ConditionType.BACKEND_READY,
    ConditionType.GATEWAY_READY,
    ConditionType.READY,
)

IMAGE_PULL_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})
# Restarts after which a container that is not crash-looping right now still counts as failing.
REPEATED_TERMINATION_RESTARTS = 3

# The weights of a node-local cache are on a node the backend cannot be scheduled on (gone, NotReady,
# cordoned, full).
WEIGHTS_NODE_UNAVAILABLE = Reason.WEIGHTS_NODE_UNAVAILABLE

# Worst first: the most specific, least self-healing cause wins when several Pods fail differently.
FAILURE_SEVERITY = (
    Reason.IMAGE_PULL_FAILED,
    Reason.OOM_KILLED,
    Reason.CRASH_LOOP,
    WEIGHTS_NODE_UNAVAILABLE,
    Reason.UNSCHEDULABLE,
    Reason.WAITING_FOR_ACCELERATOR,  # unschedulable too, but a pool is freeing (or looking for) room
    Reason.REPEATED_TERMINATION,
    Reason.PROGRESS_DEADLINE_EXCEEDED,
    Reason.SECRET_NOT_FOUND,
)
# A backend in one of these states is not a reason to call the whole service not Ready.
BACKEND_OK_REASONS = frozenset({Reason.READY, Reason.SCALED_TO_ZERO, Reason.ACTIVATING})


@dataclass(frozen=True)
class Cond:
    type: ConditionType
    status: str  # "True" | "False" | "Unknown"
    reason: Reason | str
    message: str

    @property
    def ok(self) -> bool:
        return self.status == "True"


def short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 1] + "…"


def _name(obj: dict[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))


def _int(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


# --- backend ------------------------------------------------------------------------------------


def pod_failures(pod: dict[str, Any], waiting: Mapping[str, str] | None = None) -> list[tuple[Reason, str]]:
    """Why one backend Pod cannot serve, from its status (empty when nothing is wrong yet). `waiting`:
    what AcceleratorPools say about their waiting Pods, by `namespace/name` (PoolNotes.waiting)."""
    if is_over(pod):
        return []  # draining on purpose, or a leftover (evicted, failed) that pod GC will remove
    name = _name(pod)
    status = pod.get("status") or {}
    found: list[tuple[Reason, str]] = []
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and cond.get("reason") == "Unschedulable":
            pool_says = (waiting or {}).get(f"{(pod.get('metadata') or {}).get('namespace')}/{name}")
            if pool_says is not None:
                found.append((Reason.WAITING_FOR_ACCELERATOR, f"pod {name} is {pool_says}"))
            else:
                found.append((Reason.UNSCHEDULABLE, f"pod {name} cannot be scheduled: {cond.get('message') or 'no node fits'}"))
    for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        container = cs.get("name", "?")
        state = cs.get("state") or {}
        last = cs.get("lastState") or {}
        waiting = (state.get("waiting") or {}).get("reason")
        terminated = (state.get("terminated") or {}).get("reason")
        # A past termination only matters while the container has not recovered: a ready container
        # that was OOM-killed once (or restarted a few times) is serving, not failing.
        last_terminated = None if cs.get("ready") else (last.get("terminated") or {}).get("reason")
        if waiting in IMAGE_PULL_REASONS:
            found.append((Reason.IMAGE_PULL_FAILED, f"pod {name} container {container}: {waiting} for image {cs.get('image', '')}"))
        elif "OOMKilled" in (terminated, last_terminated):
            found.append((Reason.OOM_KILLED, f"pod {name} container {container} was OOM-killed: raise resources.memory"))
        elif waiting == "CrashLoopBackOff":
            found.append((Reason.CRASH_LOOP, f"pod {name} container {container} is crash-looping"
                          f"{_last_exit(last)} (kubectl logs {name} -c {container} --previous)"))
        elif waiting == "CreateContainerConfigError":
            missing = secrets_named_missing([cs])
            what = f"Secret {missing[0]} (or a key in it) is missing" if missing else "a referenced Secret or key is missing"
            found.append((Reason.SECRET_NOT_FOUND, f"pod {name} container {container}: {what}"))
        elif _int(cs.get("restartCount")) >= REPEATED_TERMINATION_RESTARTS and last_terminated:
            found.append((Reason.REPEATED_TERMINATION, f"pod {name} container {container} terminated repeatedly ({last_terminated})"))
    return found


def _last_exit(last_state: dict[str, Any]) -> str:
    """The last termination's exit code and reason, never its message (an engine's last log line,
    under FallbackToLogsOnError, could carry anything it printed)."""
    terminated = last_state.get("terminated") or {}
    if "exitCode" not in terminated:
        return ""
    reason = str(terminated.get("reason") or "")
    return f", last exit code {_int(terminated['exitCode'])}" + (f" ({reason})" if reason.isalnum() else "")


# What says a Secret is missing, without ever reading one: the kubelet's CreateContainerConfigError
# (`secret "x" not found`, `couldn't find key k in Secret ns/x`) and the termination message Noctaya's
# own containers leave when a Secret volume (optional, so the Pod starts) came up empty
# (`Secret "x" not found`, see gateway.secretfiles).
_MISSING_SECRET = (re.compile(r'secret "([^"]+)" not found', re.I), re.compile(r"couldn't find key \S+ in Secret [^/\s]+/(\S+)"))


def secrets_named_missing(statuses: Iterable[dict[str, Any]]) -> list[str]:
    """Secret names that container statuses say are missing (waiting or terminated, now or last)."""
    names: set[str] = set()
    for cs in statuses:
        for state in (cs.get("state") or {}, cs.get("lastState") or {}):
            for phase in ("waiting", "terminated"):
                message = str((state.get(phase) or {}).get("message") or "")
                for pattern in _MISSING_SECRET:
                    names.update(pattern.findall(message))
    return sorted(names)


def pod_secrets_missing(pods: Iterable[dict[str, Any]]) -> set[str]:
    """Secret names any of these Pods (not being deleted) reports missing."""
    found: set[str] = set()
    for pod in pods:
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        status = pod.get("status") or {}
        found.update(secrets_named_missing([*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]))
    return found


def unschedulable_message(pods: Iterable[dict[str, Any]]) -> str | None:
    """What the scheduler says about the first of these Pods (not being deleted) it cannot place."""
    for pod in sorted(pods, key=_name):
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and cond.get("reason") == "Unschedulable":
                return str(cond.get("message") or "no node fits")
    return None


def worst(failures: Iterable[tuple[Reason | str, str]]) -> tuple[Reason | str, str] | None:
    ranked = sorted(failures, key=lambda f: (FAILURE_SEVERITY.index(f[0]), f[1]))
    return ranked[0] if ranked else None


def deployment_counts(deployment: dict[str, Any] | None) -> tuple[int, int, int]:
    """(desired, current, ready) replicas of an observed Deployment."""
    if deployment is None:
        return 0, 0, 0
    spec = deployment.get("spec") or {}
    status = deployment.get("status") or {}
    return _int(spec.get("replicas"), 1), _int(status.get("replicas")), _int(status.get("readyReplicas"))


def _deadline_exceeded(deployment: dict[str, Any]) -> str | None:
    for cond in (deployment.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("status") == "False" and cond.get("reason") == "ProgressDeadlineExceeded":
            return f"Deployment {_name(deployment)} exceeded its progress deadline"
    return None


def backend_condition(
    deployment: dict[str, Any] | None,
    pods: list[dict[str, Any]],
    *,
    not_created_reason: Reason | str = Reason.PROGRESSING,
    not_created_message: str = "backend Deployment not created yet",
    extra_failures: Iterable[tuple[Reason | str, str]] = (),
    pools: PoolNotes | None = None,
) -> Cond:
    """BackendReady; with `pools`, a Pod a pool lists as waiting says so, and a model that yields its
    accelerators says to whom."""
    cond = _backend_condition(deployment, pods, not_created_reason, not_created_message, extra_failures,
                              pools.waiting if pools is not None else {})
    if pools is not None and pools.yielding:
        cond = Cond(cond.type, cond.status, cond.reason,
                    short(f"{cond.message}; yielding its accelerator to {', '.join(pools.yielding)}"))
    return cond


def _backend_condition(
    deployment: dict[str, Any] | None,
    pods: list[dict[str, Any]],
    not_created_reason: Reason | str,
    not_created_message: str,
    extra_failures: Iterable[tuple[Reason | str, str]],
    waiting: Mapping[str, str],
) -> Cond:
    t = ConditionType.BACKEND_READY
    failures = [f for p in pods for f in pod_failures(p, waiting)] + list(extra_failures)
    if deployment is not None:
        exceeded = _deadline_exceeded(deployment)
        if exceeded:
            failures.append((Reason.PROGRESS_DEADLINE_EXCEEDED, exceeded))
    bad = worst(failures)
    if bad is not None:
        return Cond(t, "False", bad[0], short(bad[1]))
    if deployment is None:
        return Cond(t, "False", not_created_reason, not_created_message)
    desired, _current, ready = deployment_counts(deployment)
    if desired == 0 and ready == 0:
        return Cond(t, "False", Reason.SCALED_TO_ZERO, "scaled to zero; the next request activates the backend")
    if ready >= 1:
        return Cond(t, "True", Reason.READY, f"{ready}/{desired} backend replicas ready")
    return Cond(t, "False", Reason.ACTIVATING, f"0/{desired} backend replicas ready (starting or loading the model)")


# --- accelerator pools --------------------------------------------------------------------------

# The related group of every AcceleratorPool (cluster-scoped), as both LLMService controllers relate them.
POOL_GROUP = "AcceleratorPool.serving.noctaya.io/v1alpha1"


@dataclass(frozen=True)
class PoolNotes:
    """What the AcceleratorPools' status says about one LLMService. Read defensively: a pool status of the
    wrong shape (or a foreign writer's) is skipped entry by entry, never a failed sync."""

    waiting: dict[str, str] = field(default_factory=dict)  # its waiting backend Pod (namespace/name) → why
    yielding: tuple[str, ...] = ()  # "namespace/waiter (pool P)": whom its accelerators are promised to


def _as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _listing(names: list[str]) -> str:
    """"a", "a and b", "a, b and c"."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def last_yield(pools: Iterable[Any], namespace: str, scaled_object: str, previous: Any, desired: int | None) -> dict[str, Any] | None:
    """status.lastYield: the pool entry listing this model as yielding (the first pool by name), else
    the one recorded before while the backend is still at zero after it (a yield explains the zero
    until the model is next asked for replicas). Built only from the pools' status and the previous
    record, so an unchanged world gives the same bytes."""
    me = f"{namespace}/{scaled_object}"
    for pool in sorted((p for p in pools if isinstance(p, dict)), key=_name):
        status = _as_dict(pool.get("status"))
        service_of = {_text(w.get("pod")): _text(w.get("service")) for w in _as_list(status.get("waiting")) if isinstance(w, dict)}
        for y in _as_list(status.get("yielding")):
            if isinstance(y, dict) and y.get("scaledObject") == me and _text(y.get("for")):
                return {"pool": _name(pool), "to": service_of.get(y["for"]) or y["for"], "pod": y["for"],
                        "node": _text(y.get("node")), "listedAt": _text(y.get("listedAt"))}
    record = _as_dict(_as_dict(previous).get("lastYield"))
    if record and desired == 0 and all(isinstance(record.get(k), str) for k in ("pool", "to", "pod", "node")):
        return {k: record[k] for k in ("pool", "to", "pod", "node", "listedAt") if isinstance(record.get(k), str)}
    return None


def pool_notes(pools: Iterable[Any], namespace: str, scaled_object: str) -> PoolNotes:
    """Which of this namespace's backend Pods the pools list as waiting (and what they wait on), and which
    waiters this LLMService's ScaledObject (`scaled_object`, its name) yields to. Stable text only: the
    pools' status changes only when their decision does."""
    me = f"{namespace}/{scaled_object}"
    waiting: dict[str, str] = {}
    yielding: list[str] = []
    for pool in sorted((p for p in pools if isinstance(p, dict)), key=_name):
        name = _name(pool)
        status = _as_dict(pool.get("status"))
        resource = _text(_as_dict(pool.get("spec")).get("resourceName"))
        where = f"pool {name}, {resource}" if resource else f"pool {name}"
        waiters = [w for w in _as_list(status.get("waiting")) if isinstance(w, dict) and _text(w.get("pod"))]
        yields = [y for y in _as_list(status.get("yielding")) if isinstance(y, dict) and _text(y.get("for"))]
        contended = next((c for c in _as_list(status.get("conditions"))
                          if isinstance(c, dict) and c.get("type") == "Contended"), {})
        for w in waiters:
            pod = w["pod"]
            if not pod.startswith(f"{namespace}/") or pod in waiting:
                continue
            victims = sorted({_text(y.get("service")) for y in yields if y["for"] == pod} - {""})
            if victims:
                why = f"{_listing(victims)} {'is' if len(victims) == 1 else 'are'} yielding"
            else:
                why = _text(contended.get("message")) or _text(contended.get("reason")) or "no model is yielding yet"
            waiting[pod] = f"waiting for an accelerator ({where}): {why}"
        service_of = {w["pod"]: _text(w.get("service")) for w in waiters}
        for y in yields:
            if y.get("scaledObject") == me:
                text = f"{service_of.get(y['for']) or y['for']} (pool {name})"
                if text not in yielding:
                    yielding.append(text)
    return PoolNotes(waiting, tuple(yielding))


# --- gateway ------------------------------------------------------------------------------------


def gateway_condition(
    gateway: dict[str, Any] | None,
    aggregator: dict[str, Any] | None,
    multi: bool,
    missing_secret: str | None = None,
) -> Cond:
    t = ConditionType.GATEWAY_READY
    if missing_secret:
        return Cond(t, "False", Reason.SECRET_NOT_FOUND, f"endpoint.auth Secret {missing_secret} does not exist")
    if gateway is None:
        return Cond(t, "False", Reason.PROGRESSING, "gateway Deployment not created yet")
    desired, _current, ready = deployment_counts(gateway)
    if ready < 1:
        return Cond(t, "False", Reason.PROGRESSING, f"0/{desired} gateways ready")
    if multi:
        if aggregator is None or deployment_counts(aggregator)[2] < 1:
            return Cond(t, "False", Reason.PROGRESSING, f"{ready}/{desired} gateways ready; aggregate scaler not ready")
    return Cond(t, "True", Reason.AVAILABLE, f"{ready}/{desired} gateways ready")


# --- shared gateway (spec.endpoint.gateway) -----------------------------------------------------

# GatewayReady of a member of a shared gateway is GatewayNotFound, NotListed, or the LLMGateway's own
# not-ready reason (passed through).
# metav1.Condition's reason grammar: a foreign reason that does not fit is not passed through.
_REASON_RE = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")


def _listed_models(gateway: dict[str, Any]) -> list[tuple[str, str]]:
    """(served name, LLMService) of each well-formed `status.models` entry (service "" when absent)."""
    entries = _as_list(_as_dict(gateway.get("status")).get("models"))
    return [(e["name"], _text(e.get("service"))) for e in entries if isinstance(e, dict) and _text(e.get("name"))]


def shared_gateway_condition(gateway: dict[str, Any] | None, gateway_name: str, served_name: str,
                             service_name: str) -> Cond:
    """GatewayReady of a member: True when the LLMGateway is Ready and lists this model. A served name
    the gateway gives to another LLMService is said first (it needs the user, not time), then the
    gateway's own not-ready reason, then a model not listed (yet)."""
    t = ConditionType.GATEWAY_READY
    if gateway is None:
        return Cond(t, "False", Reason.GATEWAY_NOT_FOUND, f"LLMGateway {gateway_name} does not exist in this namespace")
    listed = _listed_models(gateway)
    others = sorted({svc for name, svc in listed if name == served_name and svc not in ("", service_name)})
    if others:
        return Cond(t, "False", Reason.NOT_LISTED, short(
            f"LLMGateway {gateway_name} serves model {served_name} from LLMService {others[0]}, not this one: "
            "served names must be unique behind one gateway (set spec.model.servedName)"))
    ready = next((c for c in _as_list(_as_dict(gateway.get("status")).get("conditions"))
                  if isinstance(c, dict) and c.get("type") == "Ready"), None)
    if ready is None or ready.get("status") != "True":
        said = _text((ready or {}).get("reason"))
        reason: Reason | str = said if _REASON_RE.match(said) else Reason.PROGRESSING
        detail = _text((ready or {}).get("message")) or ("not Ready" if ready else "no Ready condition yet")
        return Cond(t, "False", reason, short(f"LLMGateway {gateway_name}: {detail}"))
    if (served_name, service_name) not in listed and (served_name, "") not in listed:
        return Cond(t, "False", Reason.NOT_LISTED, f"LLMGateway {gateway_name} does not list model {served_name} (yet)")
    return Cond(t, "True", Reason.AVAILABLE, f"LLMGateway {gateway_name} serves model {served_name}")


# --- Ready --------------------------------------------------------------------------------------


def ready_condition(conds: dict[ConditionType, Cond], endpoint: str) -> Cond:
    t = ConditionType.READY
    backend = conds.get(ConditionType.BACKEND_READY)
    blocking: list[Cond] = []
    for ctype in (ConditionType.RUNTIME_RESOLVED, ConditionType.AUTOSCALING_READY):
        c = conds.get(ctype)
        if c is not None and not c.ok:
            blocking.append(c)
    if backend is not None and backend.reason not in BACKEND_OK_REASONS:
        blocking.append(backend)
    for ctype in (ConditionType.GATEWAY_READY,):
        c = conds.get(ctype)
        if c is not None and not c.ok:
            blocking.append(c)
    cache = conds.get(ConditionType.CACHE_READY)
    if cache is not None and cache.status == "False":
        blocking.append(cache)
    if blocking:
        first = blocking[0]
        return Cond(t, "False", first.reason, short(f"{first.type}: {first.message}"))
    if backend is not None and backend.reason == Reason.SCALED_TO_ZERO:
        return Cond(t, "True", Reason.READY, f"serving at {endpoint}; backend scaled to zero until the next request")
    if backend is not None and backend.reason == Reason.ACTIVATING:
        return Cond(t, "True", Reason.READY, f"serving at {endpoint}; backend activating")
    return Cond(t, "True", Reason.READY, f"serving at {endpoint}")


# --- wire ---------------------------------------------------------------------------------------


def wire_conditions(
    conds: Iterable[Cond],
    previous_status: Any,
    generation: int | None,
    clock: Callable[[], str],
) -> list[dict[str, Any]]:
    """Conditions in metav1.Condition shape, ordered, with lastTransitionTime carried over."""
    previous: dict[str, dict[str, Any]] = {}
    if isinstance(previous_status, dict):
        for c in previous_status.get("conditions") or []:
            if isinstance(c, dict) and isinstance(c.get("type"), str):
                previous[c["type"]] = c
    now: list[str] = []  # the clock is read at most once, and only when something transitioned

    def stamp() -> str:
        if not now:
            now.append(clock())
        return now[0]

    by_type = {c.type: c for c in conds}
    order = [t for t in CONDITION_ORDER if t in by_type] + sorted(t for t in by_type if t not in CONDITION_ORDER)
    out = []
    for ctype in order:
        c = by_type[ctype]
        prev = previous.get(str(ctype))
        if prev is not None and prev.get("status") == c.status and isinstance(prev.get("lastTransitionTime"), str):
            when = prev["lastTransitionTime"]
        else:
            when = stamp()
        item: dict[str, Any] = {
            "type": str(c.type),
            "status": c.status,
            "reason": str(c.reason),
            "message": c.message,
            "lastTransitionTime": when,
        }
        if generation is not None:
            item["observedGeneration"] = generation
        out.append(item)
    return out
