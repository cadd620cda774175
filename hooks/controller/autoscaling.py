"""The LLMService DecoratorController: attaches the KEDA ScaledObject.

It is a separate controller because a child type whose CRD is missing stops a whole
CompositeController; this one simply waits until KEDA is installed. It never returns `status`, so
the CompositeController's status is left alone. Like sync, it is never destructive: when the spec
or runtime is unusable the observed ScaledObject is kept as it is.
"""

from __future__ import annotations

from typing import Any

from hooks.config import HookConfig, resolve
from hooks.controller import coldstart
from hooks.controller import observe as obs
from hooks.controller.customize import runtime_rule
from hooks.controller.sync import namespace_of, parse_service, resolve_runtime
from hooks.resources import autoscaling
from hooks.resources.context import RenderContext


def customize(request: dict[str, Any], config: HookConfig | None = None) -> dict[str, Any]:
    """Related objects of the decorator: only the runtime (its metrics gauges feed leading signals)."""
    parent = obs.require_object(request, "parent" if "parent" in request else "object")
    spec = parent.get("spec") if isinstance(parent.get("spec"), dict) else {}
    rule = runtime_rule(spec)
    return {"relatedResources": [rule] if rule is not None else []}


def desired_scaled_object(obj: dict[str, Any], observed: obs.Observed, config: HookConfig) -> dict[str, Any] | None:
    """The ScaledObject for one LLMService, or None when it cannot be rendered right now."""
    service, _error = parse_service(obj)
    if service is None or service.spec.cache.strategy == "BakedImage":
        return None
    resolution = resolve_runtime(service, observed)
    if resolution.runtime is None:
        return None
    ctx = RenderContext(service=service, runtime=resolution.runtime, namespace=namespace_of(obj), config=config,
                        measured_cold_start=coldstart.measured_total(obj))
    return autoscaling.scaled_object(ctx).scaled_object


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
