"""Choose the InferenceRuntime of an LLMService among the related runtimes Metacontroller sent.

By name: that runtime, if it exists and is valid. By selector: the valid matching runtime with the
highest `spec.priority`; an equal top priority is reported as AmbiguousRuntime — a guess could move
a model to other hardware without anyone asking.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from hooks.api.llmservice import RuntimeRef
from hooks.api.runtime import InferenceRuntime, volume_conflicts
from hooks.api.status import Reason
from hooks.errors import describe_validation_error


@dataclass(frozen=True)
class Resolution:
    """Either a runtime or the reason there is none."""

    runtime: InferenceRuntime | None
    reason: Reason
    message: str

    @property
    def resolved(self) -> bool:
        return self.runtime is not None


def _name(obj: dict[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))


def _volume_conflict(obj: dict[str, Any]) -> Resolution | None:
    """A runtime whose volumes collide with Noctaya's own mounts, named by volume (its backend would
    be refused by the API server on every sync)."""
    conflicts = volume_conflicts(obj.get("spec"))
    if not conflicts:
        return None
    return Resolution(None, Reason.VOLUME_CONFLICT,
                      f"InferenceRuntime {_name(obj)} is not accepted: {'; '.join(conflicts)}")


def select_runtime(ref: RuntimeRef, candidates: Iterable[dict[str, Any]]) -> Resolution:
    objects = sorted((o for o in candidates if isinstance(o, dict)), key=_name)
    if ref.name is not None:
        for obj in objects:
            if _name(obj) == ref.name:
                conflict = _volume_conflict(obj)
                if conflict is not None:
                    return conflict
                try:
                    runtime = InferenceRuntime.model_validate(obj)
                except ValidationError as exc:
                    return Resolution(
                        None,
                        Reason.INVALID_SPEC,
                        f"InferenceRuntime {ref.name} is invalid: {describe_validation_error(exc)}",
                    )
                return Resolution(runtime, Reason.RESOLVED, f"using InferenceRuntime {ref.name}")
        return Resolution(None, Reason.RUNTIME_NOT_FOUND, f"InferenceRuntime {ref.name} does not exist")

    assert ref.selector is not None  # RuntimeRef's rule: exactly one of name or selector
    matching: list[InferenceRuntime] = []
    invalid: list[str] = []
    for obj in objects:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        if not ref.selector.matches(labels):
            continue
        if _volume_conflict(obj) is not None:
            invalid.append(_name(obj))
            continue
        try:
            matching.append(InferenceRuntime.model_validate(obj))
        except ValidationError:
            invalid.append(_name(obj))
    skipped = f" (skipped invalid: {', '.join(invalid)})" if invalid else ""
    if not matching:
        return Resolution(None, Reason.RUNTIME_NOT_FOUND, f"no valid InferenceRuntime matches runtime.selector{skipped}")
    top = max(r.spec.priority for r in matching)
    best = [r for r in matching if r.spec.priority == top]
    if len(best) > 1:
        names = ", ".join(r.metadata.name for r in best)
        return Resolution(
            None,
            Reason.AMBIGUOUS_RUNTIME,
            f"runtimes {names} match runtime.selector with the same priority {top}; "
            "give one a higher spec.priority or name the runtime",
        )
    chosen = best[0]
    return Resolution(
        chosen,
        Reason.RESOLVED,
        f"selected InferenceRuntime {chosen.metadata.name} (priority {top}, {len(matching)} matching){skipped}",
    )
