"""The passive InferenceRuntime controller: validate, write Accepted, own no children."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from hooks.api.runtime import InferenceRuntime, volume_conflicts
from hooks.api.status import ConditionType, Reason
from hooks.config import HookConfig, resolve
from hooks.controller import observe as obs
from hooks.controller import status as st
from hooks.errors import describe_validation_error


def accepted(parent: dict[str, Any]) -> st.Cond:
    """Accepted=True; or False with VolumeConflict, naming each runtime volume that takes one of
    Noctaya's own mounts (the CRD refuses these at admission, but a runtime stored before it did, or
    a path only the container runtime's cleaning makes equal, still reaches here), or InvalidSpec."""
    conflicts = volume_conflicts(parent.get("spec"))
    if conflicts:
        return st.Cond(ConditionType.ACCEPTED, "False", Reason.VOLUME_CONFLICT,
                       st.short("; ".join(conflicts) + ": the API server would refuse every backend Pod using this runtime"))
    try:
        InferenceRuntime.model_validate({k: v for k, v in parent.items() if k != "status"})
    except ValidationError as exc:
        return st.Cond(ConditionType.ACCEPTED, "False", Reason.INVALID_SPEC, st.short(describe_validation_error(exc)))
    return st.Cond(ConditionType.ACCEPTED, "True", Reason.ACCEPTED, "runtime is valid")


def sync(request: dict[str, Any], config: HookConfig | None = None) -> dict[str, Any]:
    parent = obs.require_object(request, "parent")
    cfg = resolve(config)
    cond = accepted(parent)
    meta = parent.get("metadata") or {}
    generation = meta.get("generation") if isinstance(meta.get("generation"), int) else None
    status: dict[str, Any] = {}
    if generation is not None:
        status["observedGeneration"] = generation
    status["conditions"] = st.wire_conditions([cond], parent.get("status"), generation, cfg.clock)
    return {"status": status, "children": [], "resyncAfterSeconds": 0.0, "finalized": bool(request.get("finalizing"))}
