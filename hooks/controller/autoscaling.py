"""The LLMService DecoratorController: attaches the KEDA ScaledObject.

It is a separate controller because a child type whose CRD is missing stops a whole
CompositeController; this one simply waits until KEDA is installed. It never returns `status`, so
the CompositeController's status is left alone. Like sync, it is never destructive: when the spec
or runtime is unusable the observed ScaledObject is kept as it is.

While an AcceleratorPool lists this model's ScaledObject as yielding (its `status.yielding`), the
ScaledObject gets the pool's short cooldownPeriod: KEDA then scales the model in once it has been
idle that long — asking its gateway first, so a busy model never is — and the waiting model gets the
accelerators. When the entry is gone the model's own cooldown is back.

A ghost — a replica nobody waits for — gets a short cooldown too: when KEDA sees no demand (Active
False) while the backend has never become Ready since it was asked for (its Pod still unscheduled),
the cold request that asked for it has ended (504 activation_timeout, client gone). KEDA would keep
that Pending replica for the whole cooldown, and the next accelerator freed could go to it: the model
would load for nobody and hold the accelerator idle. GHOST_COOLDOWN_SECONDS lets it go at once.
"""

from __future__ import annotations

from typing import Any

from hooks.api.status import Reason
from hooks.config import HookConfig, resolve
from hooks.controller import coldstart
from hooks.controller import observe as obs
from hooks.controller.customize import POOL_RULE, gateway_rule, runtime_rule
from hooks.controller.pool_facts import condition
from hooks.controller.status import POOL_GROUP
from hooks.controller.sync import gateway_gone, namespace_of, parse_service, resolve_runtime
from hooks.resources import autoscaling, names
from hooks.resources.context import RenderContext


def customize(request: dict[str, Any], config: HookConfig | None = None) -> dict[str, Any]:
    """Related objects of the decorator: the runtime (its metrics gauges feed leading signals), every
    AcceleratorPool (whose status says when this model yields; see customize.POOL_RULE) and, for a
    member of a shared gateway, that LLMGateway (without it nothing can route to the model)."""
    parent = obs.require_object(request, "parent" if "parent" in request else "object")
    spec = parent.get("spec") if isinstance(parent.get("spec"), dict) else {}
    rules = [rule for rule in (runtime_rule(spec), gateway_rule(spec, namespace_of(parent))) if rule is not None]
    return {"relatedResources": [*rules, dict(POOL_RULE)]}


def _cooldown(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def yield_cooldown(pools: list[dict[str, Any]], scaled_object: str) -> int | None:
    """The shortest cooldownSeconds any pool's `status.yielding` gives this ScaledObject (namespace/name),
    or None when no pool lists it. Entries of the wrong shape are ignored."""
    found: list[int] = []
    for pool in pools:
        status = pool.get("status")
        entries = status.get("yielding") if isinstance(status, dict) else None
        for entry in entries if isinstance(entries, list) else []:
            if isinstance(entry, dict) and entry.get("scaledObject") == scaled_object:
                seconds = _cooldown(entry.get("cooldownSeconds"))
                if seconds is not None:
                    found.append(seconds)
    return min(found) if found else None


GHOST_COOLDOWN_SECONDS = 5
# BackendReady reasons of a backend whose Pod is still unscheduled (hooks.controller.status).
_UNSCHEDULED = frozenset({Reason.UNSCHEDULABLE, Reason.WAITING_FOR_ACCELERATOR})


def is_ghost(obj: dict[str, Any], scaled_object: dict[str, Any] | None) -> bool:
    """No demand by KEDA's record, and the backend's replica still unscheduled (never Ready since it
    was asked for): the request that woke it has ended."""
    no_demand = condition(scaled_object or {}, "Active").get("status") == "False"
    backend = condition(obj, "BackendReady")
    return no_demand and backend.get("status") == "False" and backend.get("reason") in _UNSCHEDULED


def desired_scaled_object(obj: dict[str, Any], observed: obs.Observed, config: HookConfig) -> dict[str, Any] | None:
    """The ScaledObject for one LLMService, or None when it cannot be rendered right now."""
    service, _error = parse_service(obj)
    if service is None or service.spec.cache.strategy == "BakedImage":
        return None
    resolution = resolve_runtime(service, observed)
    if resolution.runtime is None:
        return None
    namespace = namespace_of(obj)
    ctx = RenderContext(service=service, runtime=resolution.runtime, namespace=namespace, config=config,
                        measured_cold_start=coldstart.measured_total(obj))
    if gateway_gone(obj, observed) is not None:
        return autoscaling.unreachable_scaled_object(ctx)
    yielding = yield_cooldown(observed.related_objects(POOL_GROUP), f"{namespace}/{names.scaled_object(ctx.name)}")
    ghost = is_ghost(obj, observed.child(obs.SCALED_OBJECT, names.scaled_object(ctx.name)))
    return autoscaling.scaled_object(ctx, yield_cooldown=yielding,
                                     ghost_cooldown=GHOST_COOLDOWN_SECONDS if ghost else None).scaled_object


def sync(request: dict[str, Any], config: HookConfig | None = None) -> dict[str, Any]:
    obj = obs.require_object(request, "object")
    if request.get("finalizing"):
        # The ScaledObject goes first on deletion: nothing may scale the backend back up.
        return {"attachments": [], "resyncAfterSeconds": 0.0, "finalized": True}
    cfg = resolve(config)
    observed = obs.observe(request, children_key="attachments")
    desired = desired_scaled_object(obj, observed, cfg)
    if desired is None:
        attachments = [obs.kept(o) for o in observed.children.values()]
    else:
        attachments = [desired]
    return {"attachments": attachments, "resyncAfterSeconds": 0.0}
