"""What an AcceleratorPool decision reads, as small typed facts: nodes, backend Pods and the models
holding accelerators (from KEDA's own record on each ScaledObject).

Everything here is read defensively: a related object with a wrong type in some field is skipped
or read as "nothing", never a crash — the pool must not evict on a misread.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from hooks.resources import labels

_INT = re.compile(r"^\+?[0-9]+$")


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _str_map(value: Any) -> dict[str, str]:
    return {k: v for k, v in _dict(value).items() if isinstance(k, str) and isinstance(v, str)}


def units(value: Any) -> int:
    """An extended-resource quantity: whole units only (the API server refuses fractions for them)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return max(value, 0)
    if isinstance(value, str) and _INT.match(value.strip()):
        return int(value.strip())
    return 0


def key(obj: dict[str, Any]) -> str:
    meta = _dict(obj.get("metadata"))
    name = str(meta.get("name", ""))
    namespace = meta.get("namespace")
    return f"{namespace}/{name}" if isinstance(namespace, str) and namespace else name


def condition(obj: dict[str, Any], ctype: str) -> dict[str, Any]:
    for c in _list(_dict(obj.get("status")).get("conditions")):
        if isinstance(c, dict) and c.get("type") == ctype:
            return c
    return {}


@dataclass(frozen=True)
class Node:
    name: str
    labels: dict[str, str]
    units: int  # allocatable of the pool's resource
    taints: tuple[tuple[str, str, str], ...]  # (key, value, effect) that repel Pods: NoSchedule, NoExecute
    unschedulable: bool


def read_node(obj: dict[str, Any], resource: str) -> Node | None:
    meta = _dict(obj.get("metadata"))
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        return None
    spec = _dict(obj.get("spec"))
    taints = tuple(
        (str(t.get("key", "")), str(t.get("value", "")), str(t.get("effect", "")))
        for t in _list(spec.get("taints"))
        if isinstance(t, dict) and t.get("effect") in ("NoSchedule", "NoExecute")
    )
    return Node(name=name, labels=_str_map(meta.get("labels")),
                units=units(_dict(_dict(obj.get("status")).get("allocatable")).get(resource)),
                taints=taints, unschedulable=spec.get("unschedulable") is True)


@dataclass(frozen=True)
class Pod:
    key: str  # namespace/name
    namespace: str
    service: str  # namespace/<llmservice label value>
    node: str  # "" while unbound
    units: int  # requested units of the pool's resource
    created: str
    deleting: bool
    ready: bool
    short_of_resource: bool  # PodScheduled=False/Unschedulable naming "Insufficient <resource>"
    refused: bool  # PodScheduled=False/Unschedulable, for whatever reason: the scheduler has spoken
    node_selector: dict[str, str]
    tolerations: tuple[dict[str, Any], ...]
    affinity_terms: tuple[tuple[dict[str, Any], ...], ...]  # required node affinity: OR of ANDs

    def can_use(self, node: Node) -> bool:
        """An approximation of the scheduler's filters that matter for a pool: node selector,
        required node affinity, taints and cordoning. Resources are the pool's own arithmetic."""
        if node.unschedulable or any(node.labels.get(k) != v for k, v in self.node_selector.items()):
            return False
        if self.affinity_terms and not any(all(_matches(e, node.labels) for e in term) for term in self.affinity_terms):
            return False
        return all(any(_tolerates(t, taint) for t in self.tolerations) for taint in node.taints)


def _matches(expr: dict[str, Any], node_labels: dict[str, str]) -> bool:
    k, op = expr.get("key"), expr.get("operator")
    values = [v for v in _list(expr.get("values")) if isinstance(v, str)]
    present = isinstance(k, str) and k in node_labels
    if op == "In":
        return present and node_labels[k] in values  # type: ignore[index]
    if op == "NotIn":
        return not present or node_labels[k] not in values  # type: ignore[index]
    if op == "Exists":
        return present
    if op == "DoesNotExist":
        return not present
    return True  # Gt/Lt: left to the scheduler


def _tolerates(toleration: dict[str, Any], taint: tuple[str, str, str]) -> bool:
    taint_key, taint_value, effect = taint
    if toleration.get("effect") not in (None, "", effect):
        return False
    if toleration.get("operator") == "Exists":
        return toleration.get("key") in (None, "", taint_key)
    return toleration.get("key") == taint_key and toleration.get("value", "") == taint_value


def _container_units(containers: Any, resource: str) -> list[int]:
    out = []
    for c in _list(containers):
        res = _dict(_dict(c).get("resources"))
        out.append(max(units(_dict(res.get("requests")).get(resource)), units(_dict(res.get("limits")).get(resource))))
    return out


def read_pod(obj: dict[str, Any], resource: str) -> Pod | None:
    meta = _dict(obj.get("metadata"))
    namespace, name = meta.get("namespace"), meta.get("name")
    if not isinstance(namespace, str) or not isinstance(name, str):
        return None
    pod_labels = _str_map(meta.get("labels"))
    spec = _dict(obj.get("spec"))
    # What the scheduler charges: the app containers together, or the largest init container.
    need = max([sum(_container_units(spec.get("containers"), resource)),
                *_container_units(spec.get("initContainers"), resource)])
    scheduled = condition(obj, "PodScheduled")
    refused = scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable"
    short = (refused
             and f"Insufficient {resource}" in str(scheduled.get("message", "")))
    required = _dict(_dict(_dict(spec.get("affinity")).get("nodeAffinity")).get(
        "requiredDuringSchedulingIgnoredDuringExecution"))
    terms = tuple(
        tuple(e for e in _list(_dict(t).get("matchExpressions")) if isinstance(e, dict))
        for t in _list(required.get("nodeSelectorTerms"))
    )
    return Pod(
        key=f"{namespace}/{name}", namespace=namespace,
        service=f"{namespace}/{pod_labels.get(labels.LLMSERVICE, '')}",
        node=spec.get("nodeName") if isinstance(spec.get("nodeName"), str) else "",
        units=need, created=str(meta.get("creationTimestamp", "")),
        deleting=meta.get("deletionTimestamp") is not None,
        ready=condition(obj, "Ready").get("status") == "True",
        short_of_resource=short, refused=refused, node_selector=_str_map(spec.get("nodeSelector")),
        tolerations=tuple(t for t in _list(spec.get("tolerations")) if isinstance(t, dict)),
        affinity_terms=terms,
    )


@dataclass(frozen=True)
class Model:
    """One Noctaya model as a possible holder: its ScaledObject and what KEDA says about it."""

    scaled_object: str  # namespace/name
    service: str  # namespace/<llmservice label value>
    last_active: str  # KEDA's status.lastActiveTime (RFC 3339, 1 s resolution): the LRU key
    idle: bool  # Active=False with reason ScalerCooldown: replicas up, nothing to do, cooling down
    active: bool  # Active=True
    pinned: str  # why it never yields ("" when it may)
    minimum: int = 0  # minReplicaCount: a replica it keeps without any demand
    stuck: str = ""  # why KEDA will not scale it in whatever its Active says: paused, scaler not Ready

    @property
    def wants_replica(self) -> bool:
        """Demand now (KEDA Active) or a floor: a Pending Pod of a model with neither is only KEDA's
        cooldown keeping a replica nobody asked for (its cold request already ended)."""
        return self.active or self.minimum > 0


# KEDA's own ways to stop autoscaling a ScaledObject: its Active condition then stays as it was.
PAUSE_ANNOTATIONS = {"autoscaling.keda.sh/paused": "true", "autoscaling.keda.sh/paused-scale-in": "true",
                     "autoscaling.keda.sh/paused-replicas": None}  # None: any value pauses


# Ready=False reasons under which KEDA's operator still scales an inactive target to zero: KEDA copies
# the HPA's health there (checkHPAHealth in pkg/scaling/executor/scale_scaledobjects.go, v2.20), e.g.
# while the HPA cannot read KEDA's metrics adapter, but its own scale loop does the scale-in. Seen on
# the real control plane: every idle holder reads Ready=False/HPAMetricsUnavailable there, and
# treating it as stuck left a waiter beside an idle model. A broken scaler reads TriggerError.
READY_REASONS_THAT_SCALE_IN = frozenset({"HPAMetricsUnavailable"})


def _stuck(obj: dict[str, Any]) -> str:
    """Why KEDA will not scale this model in, by its own record ("" when nothing stops it)."""
    annotations = _str_map(_dict(obj.get("metadata")).get("annotations"))
    for name, value in PAUSE_ANNOTATIONS.items():
        if name in annotations and (value is None or annotations[name].strip().lower() == value):
            return f"paused: {name}"
    if condition(obj, "Paused").get("status") == "True":
        return "paused"
    ready = condition(obj, "Ready")
    if ready.get("status") != "True" and ready.get("reason") not in READY_REASONS_THAT_SCALE_IN:
        return f"scaler not Ready: {ready.get('reason') or 'no Ready condition'}"
    return ""


def read_model(obj: dict[str, Any]) -> Model | None:
    meta = _dict(obj.get("metadata"))
    namespace = meta.get("namespace")
    obj_labels = _str_map(meta.get("labels"))
    if not isinstance(namespace, str) or labels.LLMSERVICE not in obj_labels:
        return None
    spec, status = _dict(obj.get("spec")), _dict(obj.get("status"))
    active = condition(obj, "Active")
    minimum = spec.get("minReplicaCount")
    pinned = ""
    if obj_labels.get(labels.YIELD_POLICY) == "Never":
        pinned = "yieldPolicy Never"
    elif isinstance(minimum, int) and minimum > 0:
        pinned = f"min {minimum}"
    last = status.get("lastActiveTime")
    return Model(stuck=_stuck(obj),
        scaled_object=key(obj), service=f"{namespace}/{obj_labels[labels.LLMSERVICE]}",
        last_active=last if isinstance(last, str) else "",
        idle=active.get("status") == "False" and active.get("reason") == "ScalerCooldown" and isinstance(last, str),
        active=active.get("status") == "True", pinned=pinned,
        minimum=minimum if isinstance(minimum, int) and not isinstance(minimum, bool) and minimum > 0 else 0,
    )
