"""`finalize` of the LLMService CompositeController: ordered teardown.

1. Stop admitting: the gateway, its Services, the aggregate scaler, the PDB and the token Secret go
   first, while the backend keeps serving requests already in flight (the gateway drains them on
   SIGTERM). The ScaledObject goes with the DecoratorController's own finalize.
2. Once no gateway Deployment is observed, the backend goes; its Pods drain through preStop.
3. `finalized: true` only when the observed children show no gateway or backend Deployment and no
   backend Pod remains.

A member of a shared gateway (`spec.endpoint.gateway`) has no gateway of its own: its step 1 is the
LLMGateway dropping it from the routing table (it drops a member being deleted at once). Until the
LLMGateway's status no longer lists the model, the backend stays; and then for
`HookConfig.route_grace_seconds` more (condition `Routed=False` records since when), because each
shared gateway Pod reads the table through the kubelet's ConfigMap volume refresh, up to a minute or
so later: nothing the gateway still routes there finds the backend gone.
"""

from __future__ import annotations

from typing import Any

from hooks.api.status import ConditionType, Reason
from hooks.config import HookConfig, parse_rfc3339, resolve
from hooks.controller import observe as obs
from hooks.controller import status as st
from hooks.resources import labels, names

# Poll while tearing down: Pods disappearing is what we wait for.
TEARDOWN_RESYNC_SECONDS = 5.0


def _component(obj: dict[str, Any]) -> str | None:
    return ((obj.get("metadata") or {}).get("labels") or {}).get(labels.COMPONENT)


def _is_deployment(obj: dict[str, Any], component: str, name: str) -> bool:
    if obj.get("kind") != "Deployment":
        return False
    return _component(obj) == component or (obj.get("metadata") or {}).get("name") == name


def _shared_gateway_routes(parent: dict[str, Any], observed: obs.Observed) -> str | None:
    """The LLMGateway that still lists this member's model, if any (read from the raw spec: a member
    whose spec no longer parses is still torn down in order)."""
    spec = parent.get("spec") if isinstance(parent.get("spec"), dict) else {}
    endpoint = spec.get("endpoint") if isinstance(spec.get("endpoint"), dict) else {}
    gateway_name = endpoint.get("gateway")
    if not isinstance(gateway_name, str) or not gateway_name:
        return None
    meta = parent["metadata"]
    model = spec.get("model") if isinstance(spec.get("model"), dict) else {}
    served = model.get("servedName") if isinstance(model.get("servedName"), str) and model.get("servedName") else meta["name"]
    gateway = observed.llmgateway(gateway_name, meta.get("namespace") or "")
    status = (gateway or {}).get("status")
    entries = status.get("models") if isinstance(status, dict) else None
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict) and entry.get("name") == served and entry.get("service") in (None, meta["name"]):
            return gateway_name
    return None


def _seconds_since(stamp: Any, now: str) -> float | None:
    then, current = parse_rfc3339(stamp), parse_rfc3339(now)
    return None if then is None or current is None else (current - then).total_seconds()


def route_grace_left(parent: dict[str, Any], cfg: HookConfig) -> float:
    """Seconds a member's backend must still wait after its LLMGateway stopped listing it: the grace
    counts from the lastTransitionTime of its Routed=False condition (now, when there is none yet)."""
    previous = parent.get("status") if isinstance(parent.get("status"), dict) else {}
    for c in previous.get("conditions") or []:
        if isinstance(c, dict) and c.get("type") == ConditionType.ROUTED and c.get("status") == "False":
            waited = _seconds_since(c.get("lastTransitionTime"), cfg.clock())
            return max(0.0, cfg.route_grace_seconds - waited) if waited is not None else float(cfg.route_grace_seconds)
    return float(cfg.route_grace_seconds)


def _member_of(parent: dict[str, Any]) -> str | None:
    spec = parent.get("spec") if isinstance(parent.get("spec"), dict) else {}
    endpoint = spec.get("endpoint") if isinstance(spec.get("endpoint"), dict) else {}
    gateway = endpoint.get("gateway")
    return gateway if isinstance(gateway, str) and gateway else None


def finalize(request: dict[str, Any], config: HookConfig | None = None) -> dict[str, Any]:
    parent = obs.require_object(request, "parent")
    cfg = resolve(config)
    observed = obs.observe(request)
    name = parent["metadata"]["name"]
    children = list(observed.children.values())
    gateway_up = any(_is_deployment(o, labels.GATEWAY, names.gateway(name)) for o in children)
    routed_by = _shared_gateway_routes(parent, observed)
    member_of = _member_of(parent)
    grace = route_grace_left(parent, cfg) if member_of is not None and routed_by is None else 0.0
    backend_up = any(_is_deployment(o, labels.BACKEND, names.backend(name)) for o in children)
    pods = observed.live_pods()
    if gateway_up or routed_by is not None or grace > 0:
        # Phase 1: keep only what serves requests already admitted.
        keep = [obs.kept(o) for o in children if _component(o) in (labels.BACKEND, labels.CACHE)]
        if gateway_up:
            message = "stopping admission: removing the gateway; the backend keeps serving in-flight requests"
        elif routed_by is not None:
            message = (f"stopping admission: waiting for LLMGateway {routed_by} to stop routing this model; the "
                       "backend keeps serving in-flight requests")
        else:
            message = (f"LLMGateway {member_of} no longer lists this model; the backend stays until every gateway Pod "
                       f"has reloaded its routing table ({cfg.route_grace_seconds}s after that)")
    else:
        keep = []
        message = (
            f"gateway removed; waiting for the backend to drain ({len(pods)} pod(s) left)"
            if backend_up or pods
            else "teardown complete"
        )
    # Without the related Pod group we cannot see draining Pods: never call that "done".
    finalized = (not gateway_up and routed_by is None and grace <= 0 and not backend_up and not pods
                 and observed.pods_observed)

    previous = parent.get("status") if isinstance(parent.get("status"), dict) else {}
    conds: list[st.Cond] = []
    for c in previous.get("conditions") or []:
        if not isinstance(c, dict) or c.get("type") in (ConditionType.READY, ConditionType.GATEWAY_READY,
                                                         ConditionType.BACKEND_READY, ConditionType.ROUTED):
            continue
        try:
            conds.append(st.Cond(ConditionType(c["type"]), c.get("status", "Unknown"), Reason(c.get("reason")), c.get("message", "")))
        except (KeyError, ValueError):
            continue
    backend_deployment = observed.child(obs.DEPLOYMENT, names.backend(name))
    if backend_deployment is not None or pods:
        conds.append(st.backend_condition(backend_deployment, pods, not_created_reason=Reason.TERMINATING,
                                          not_created_message=f"backend Deployment removed; {len(pods)} pod(s) draining"))
    else:
        conds.append(st.Cond(ConditionType.BACKEND_READY, "False", Reason.TERMINATING, "backend removed"))
    conds.append(st.Cond(ConditionType.GATEWAY_READY, "False", Reason.TERMINATING, "the LLMService is being deleted"))
    if member_of is not None:
        conds.append(st.Cond(ConditionType.ROUTED, "True" if routed_by is not None else "False", Reason.TERMINATING,
                             f"LLMGateway {member_of} {'still routes' if routed_by is not None else 'no longer lists'} "
                             "this model"))
    conds.append(st.Cond(ConditionType.READY, "False", Reason.TERMINATING, message))
    meta = parent.get("metadata") or {}
    generation = meta.get("generation") if isinstance(meta.get("generation"), int) else None
    status = {k: v for k, v in previous.items() if k in ("observedGeneration", "runtime", "endpoint")}
    _desired, current, ready = st.deployment_counts(observed.child(obs.DEPLOYMENT, names.backend(name)))
    status["replicas"] = current
    status["readyReplicas"] = ready
    status["conditions"] = st.wire_conditions(conds, previous, generation, cfg.clock)
    return {
        "status": status,
        "children": keep,
        "resyncAfterSeconds": 0.0 if finalized else min(TEARDOWN_RESYNC_SECONDS, grace) if grace > 0
        else TEARDOWN_RESYNC_SECONDS,
        "finalized": finalized,
    }
