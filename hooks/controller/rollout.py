"""Noctaya's own changes never reload a warm model.

A Deployment the hooks render has a Pod template with two authors: the user's objects (the
LLMService, its InferenceRuntime, the LLMGateway) and Noctaya itself (the drain program, init
containers, env, labels, the gateway image and install settings). Kubernetes restarts every Pod when
any byte of the template changes, so a new Noctaya release would reload every warm model at once.

Each rendered Deployment therefore records, in the annotation ``serving.noctaya.io/inputs``, a digest
of the user inputs its template was rendered from (only the fields the template can depend on, with
defaults left out so a new optional API field changes nothing). On the next sync:

- the template did not change: nothing to decide;
- the inputs changed: the user changed something, and the new template rolls at once, as always;
- only Noctaya's part changed: the new template is applied by the first of these rules that holds,
  else the running template is kept and condition ``UpgradePending`` says why:
  ``immediate_policy`` (``spec.upgrades.policy: Immediate``), ``model_idle`` (the model is at zero
  replicas: the new template starts no Pod), ``approved`` (annotation
  ``serving.noctaya.io/approve-upgrade`` equals the waiting templates' digest), ``window_open`` (one of
  ``spec.upgrades.windows`` is open now: the only rule that reads the clock, and only while something
  waits).

A Deployment rendered by the release before this one has no digest yet. Its template was rendered
from the current spec when ``status.observedGeneration`` equals ``metadata.generation`` (the previous
hooks answered this very spec) and, for the backend, when the engine container's image, command and
args still match what the runtime asks for; otherwise the user changed something and it rolls.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from hooks.api.status import ConditionType, Reason
from hooks.api.upgrades import Upgrades
from hooks.config import parse_rfc3339
from hooks.controller import observe as obs
from hooks.controller import status as st
from hooks.resources import labels

INPUTS_ANNOTATION = "serving.noctaya.io/inputs"
APPROVE_ANNOTATION = "serving.noctaya.io/approve-upgrade"
# How many differing template paths a condition names (the rest is counted).
MAX_PATHS = 4
_ENGINE_FIELDS = ("image", "command", "args")


def digest(value: Any) -> str:
    """A short, stable digest of JSON-able data (canonical: sorted keys, no spaces)."""
    raw = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def plain(value: Any) -> Any:
    """User input as plain data: pydantic models without their defaults (a field a new release adds
    with a default changes nothing), lists item by item, anything else as it is."""
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json", by_alias=True, exclude_defaults=True)
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def inputs_digest(**parts: Any) -> str:
    """The digest of named user inputs (see `plain`)."""
    return digest({name: plain(value) for name, value in parts.items()})


def with_inputs(deployment: dict[str, Any], inputs: str) -> dict[str, Any]:
    """The Deployment with the digest of the inputs its template was rendered from."""
    meta = deployment["metadata"]
    annotations = {**(meta.get("annotations") or {}), INPUTS_ANNOTATION: inputs}
    return {**deployment, "metadata": {**meta, "annotations": dict(sorted(annotations.items()))}}


def _template(deployment: dict[str, Any] | None) -> Any:
    return ((deployment or {}).get("spec") or {}).get("template")


def _annotations(deployment: dict[str, Any]) -> dict[str, Any]:
    return (deployment.get("metadata") or {}).get("annotations") or {}


# --- what changed -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """One rendered Deployment whose observed counterpart exists."""

    desired: dict[str, Any]
    observed: dict[str, Any]  # as last applied (obs.kept)
    live: dict[str, Any]  # as the API server returned it
    engine: bool = False  # the backend: its engine container's runtime fields decide a migration


@dataclass(frozen=True)
class Change:
    """A Deployment whose template changed only because Noctaya changed."""

    name: str
    template: Any  # the waiting (new) template
    running: Any  # the template its Pods run
    paths: tuple[str, ...]


def diff_paths(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Where two JSON values differ, as dotted paths (list items of named objects by their name)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) | set(new)):
            out += diff_paths(old.get(key), new.get(key), f"{prefix}.{key}" if prefix else str(key))
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        out = []
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            label = a.get("name") if isinstance(a, dict) and isinstance(a.get("name"), str) and a.get("name") == (
                b.get("name") if isinstance(b, dict) else None) else str(i)
            out += diff_paths(a, b, f"{prefix}[{label}]")
        return out
    return [] if old == new else [prefix or "."]


def _engine_view(template: Any) -> list[dict[str, Any]]:
    containers = ((template or {}).get("spec") or {}).get("containers") or []
    return [{k: c.get(k) for k in ("name", *_ENGINE_FIELDS)} for c in containers if isinstance(c, dict)]


def user_changed(candidate: Candidate, spec_seen: bool) -> bool:
    """Whether the user's inputs differ from those the running template was rendered from."""
    recorded = _annotations(candidate.live).get(INPUTS_ANNOTATION)
    if isinstance(recorded, str):
        return recorded != _annotations(candidate.desired).get(INPUTS_ANNOTATION)
    # Rendered by a release that recorded no digest (see the module doc).
    if not spec_seen:
        return True
    return candidate.engine and _engine_view(_template(candidate.observed)) != _engine_view(_template(candidate.desired))


def noctaya_changes(candidates: Iterable[Candidate], spec_seen: bool) -> list[Change]:
    """The candidates whose template differs only because Noctaya changed."""
    changes = []
    for c in candidates:
        running, wanted = _template(c.observed), _template(c.desired)
        if running is None or running == wanted or user_changed(c, spec_seen):
            continue
        changes.append(Change(str(c.desired["metadata"]["name"]), wanted, running, tuple(diff_paths(running, wanted))))
    return changes


def changes_digest(changes: Iterable[Change]) -> str:
    """What an approval names: exactly these waiting templates (a later change needs a new approval)."""
    return digest(sorted((c.name, digest(c.template)) for c in changes))


# --- whether to apply them now: rules in order, the first that holds applies ------------------


@dataclass(frozen=True)
class Facts:
    """What the rules read about the model (or the shared gateway's models)."""

    upgrades: Upgrades
    warm: bool  # a backend replica exists or is wanted
    approval: str | None  # the approve-upgrade annotation
    min_replicas: int  # scaling.min (for a shared gateway: 0)
    now: Callable[[], _dt.datetime]  # read only by the window rule


def immediate_policy(facts: Facts, _digest: str) -> bool:
    return facts.upgrades.policy == "Immediate"


def model_idle(facts: Facts, _digest: str) -> bool:
    return not facts.warm


def approved(facts: Facts, digest_: str) -> bool:
    return facts.approval is not None and facts.approval.strip() == digest_


def window_open(facts: Facts, _digest: str) -> bool:
    return bool(facts.upgrades.windows) and facts.upgrades.window_open(facts.now())


RULES: tuple[Callable[[Facts, str], bool], ...] = (immediate_policy, model_idle, approved, window_open)


def applying_rule(facts: Facts, digest_: str) -> str | None:
    """The name of the first rule that lets the waiting templates apply now, or None to wait."""
    for rule in RULES:
        if rule(facts, digest_):
            return rule.__name__
    return None


# --- the outcome ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settled:
    children: list[dict[str, Any]]
    condition: st.Cond
    pending: dict[str, Any] | None  # status.pendingUpgrade


def _hold(child: dict[str, Any], running: Any) -> dict[str, Any]:
    return {**child, "spec": {**child["spec"], "template": running}}


def _waiting_condition(changes: list[Change], facts: Facts, digest_: str, what: str) -> st.Cond:
    names = ", ".join(c.name for c in changes)
    paths = sorted({p for c in changes for p in c.paths})
    shown = ", ".join(paths[:MAX_PATHS]) + (f" and {len(paths) - MAX_PATHS} more" if len(paths) > MAX_PATHS else "")
    approve = f"or annotate it {APPROVE_ANNOTATION}={digest_} to apply them now (the Pods restart)"
    if facts.min_replicas > 0:
        reason = Reason.WAITING_FOR_WINDOW if facts.upgrades.windows else Reason.WAITING_FOR_APPROVAL
        when = (f"inside spec.upgrades.windows, {approve}" if facts.upgrades.windows
                else f"never on its own ({what} never reaches zero: scaling.min >= 1): name spec.upgrades.windows, {approve}")
    else:
        reason = Reason.WAITING_FOR_SCALE_TO_ZERO
        when = (f"when {what} is next at zero replicas"
                + (", or inside spec.upgrades.windows" if facts.upgrades.windows else "") + f", {approve}")
    return st.Cond(ConditionType.UPGRADE_PENDING, "True", reason, st.short(
        f"Noctaya's own changes to {names} ({shown}) wait so that warm Pods keep serving without a reload; "
        f"they are applied {when}"))


UP_TO_DATE = st.Cond(ConditionType.UPGRADE_PENDING, "False", Reason.UP_TO_DATE,
                     "running Pods have the templates this Noctaya release renders")


def settle(children: list[dict[str, Any]], candidates: list[Candidate], facts: Facts, spec_seen: bool,
           what: str = "the model") -> Settled:
    """The children to return (held templates put back), UpgradePending and status.pendingUpgrade."""
    changes = noctaya_changes(candidates, spec_seen)
    if not changes:
        return Settled(children, UP_TO_DATE, None)
    digest_ = changes_digest(changes)
    if applying_rule(facts, digest_) is not None:
        return Settled(children, UP_TO_DATE, None)
    running = {c.name: c.running for c in changes}
    held = [_hold(child, running[child["metadata"]["name"]])
            if child.get("kind") == "Deployment" and child["metadata"]["name"] in running else child
            for child in children]
    paths = sorted({p for c in changes for p in c.paths})
    pending = {"digest": digest_, "deployments": sorted(running), "changes": paths[:MAX_PATHS]}
    return Settled(held, _waiting_condition(changes, facts, digest_, what), pending)


def candidates_of(children: list[dict[str, Any]], observed: obs.Observed, components: dict[str, bool]) -> list[Candidate]:
    """The rendered Deployments of these components (component → is the engine) that already exist."""
    out = []
    for child in children:
        component = ((child.get("metadata") or {}).get("labels") or {}).get(labels.COMPONENT)
        if child.get("kind") != "Deployment" or component not in components:
            continue
        live = observed.child(obs.DEPLOYMENT, str(child["metadata"]["name"]))
        if live is not None:
            out.append(Candidate(child, obs.kept(live), live, engine=components[component]))
    return out


def parse_clock(value: str) -> _dt.datetime:
    """The hook config's clock (RFC 3339, UTC) as an aware datetime."""
    parsed = parse_rfc3339(value)
    if parsed is None:
        raise ValueError(f"the hook clock is not RFC 3339: {value!r}")
    return parsed


def spec_seen(parent: dict[str, Any]) -> bool:
    """Whether the hooks already answered this generation of the parent (status.observedGeneration)."""
    meta, status = parent.get("metadata") or {}, parent.get("status")
    generation = meta.get("generation")
    return isinstance(status, dict) and isinstance(generation, int) and status.get("observedGeneration") == generation


def approval_of(parent: dict[str, Any]) -> str | None:
    value = ((parent.get("metadata") or {}).get("annotations") or {}).get(APPROVE_ANNOTATION)
    return value if isinstance(value, str) else None
