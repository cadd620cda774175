"""The passive InferenceRuntime controller: validate, write Accepted, own no children."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from hooks.api.runtime import InferenceRuntime
from hooks.api.status import ConditionType, Reason
from hooks.config import HookConfig, resolve
from hooks.controller import observe as obs
from hooks.controller import status as st
from hooks.errors import describe_validation_error


def sync(request: dict[str, Any], config: HookConfig | None = None) -> dict[str, Any]:
    parent = obs.require_object(request, "parent")
    cfg = resolve(config)
    try:
        InferenceRuntime.model_validate({k: v for k, v in parent.items() if k != "status"})
        cond = st.Cond(ConditionType.ACCEPTED, "True", Reason.ACCEPTED, "runtime is valid")
    except ValidationError as exc:
        cond = st.Cond(ConditionType.ACCEPTED, "False", Reason.INVALID_SPEC, st.short(describe_validation_error(exc)))
    meta = parent.get("metadata") or {}
    generation = meta.get("generation") if isinstance(meta.get("generation"), int) else None
    status: dict[str, Any] = {}
    if generation is not None:
        status["observedGeneration"] = generation
    status["conditions"] = st.wire_conditions([cond], parent.get("status"), generation, cfg.clock)
    return {"status": status, "children": [], "resyncAfterSeconds": 0.0, "finalized": bool(request.get("finalizing"))}
