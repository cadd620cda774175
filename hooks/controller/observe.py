"""Read a Metacontroller v2 hook request into plain, typed facts.

Groups are keyed `Kind.apiVersion` (`Kind.v1` for core types); objects inside are keyed
`namespace/name` (or `name` when cluster-scoped). Objects are read by value, not by key, so the
hooks do not depend on the exact key spelling.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from hooks.errors import InvalidHookRequest
from hooks.resources import backend, labels

DEPLOYMENT = "Deployment.apps/v1"
SERVICE = "Service.v1"
SECRET = "Secret.v1"
PDB = "PodDisruptionBudget.policy/v1"
PVC = "PersistentVolumeClaim.v1"
JOB = "Job.batch/v1"
POD = "Pod.v1"
RUNTIME = "InferenceRuntime.serving.noctaya.io/v1alpha1"
LLMGATEWAY = "LLMGateway.serving.noctaya.io/v1alpha1"  # related: the shared gateway a member joins
CRD = "CustomResourceDefinition.apiextensions.k8s.io/v1"
SCALED_OBJECT = "ScaledObject.keda.sh/v1alpha1"
KEDA_CRD_NAME = "scaledobjects.keda.sh"

# The child types of a gateway's own identity (hooks.resources.gateway.service_account and
# endpoints_role_binding), as a controller manifest lists them in spec.childResources.
IDENTITY_CHILD_RESOURCES = (("v1", "serviceaccounts"), ("rbac.authorization.k8s.io/v1", "rolebindings"))

LAST_APPLIED = "metacontroller.k8s.io/last-applied-configuration"
_SERVER_METADATA = ("resourceVersion", "uid", "creationTimestamp", "managedFields", "generation", "ownerReferences",
                    "selfLink", "deletionTimestamp", "deletionGracePeriodSeconds", "finalizers")


def group_key(obj: dict[str, Any]) -> str:
    return f"{obj.get('kind')}.{obj.get('apiVersion')}"


def object_key(obj: dict[str, Any]) -> tuple[str, str]:
    """(group, name): how a child is identified within one parent's namespace."""
    return group_key(obj), str((obj.get("metadata") or {}).get("name", ""))


def objects(groups: Any, group: str) -> list[dict[str, Any]]:
    """The objects of one group, sorted by name; missing or malformed groups read as empty."""
    if not isinstance(groups, dict):
        return []
    members = groups.get(group)
    if not isinstance(members, dict):
        return []
    found = [o for o in members.values() if isinstance(o, dict)]
    return sorted(found, key=lambda o: str((o.get("metadata") or {}).get("name", "")))


def has_group(groups: Any, group: str) -> bool:
    return isinstance(groups, dict) and isinstance(groups.get(group), dict)


@dataclass(frozen=True)
class Observed:
    """What Metacontroller showed us about one parent."""

    children: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    related: dict[str, Any] = field(default_factory=dict)
    # (apiVersion, resource) of every childResources entry of the calling controller's manifest; None
    # when the request carries no manifest (see `child_resources`).
    child_types: frozenset[tuple[str, str]] | None = None

    def child(self, group: str, name: str) -> dict[str, Any] | None:
        return self.children.get((group, name))

    def lists_children(self, *types: tuple[str, str]) -> bool:
        """Whether the calling controller manages children of all these (apiVersion, resource) types.

        A hook must never return a child of a type its controller does not list: Metacontroller would
        create it and never observe it, failing every later sync of the parent (a manifest of an older
        release, which the hook server still answers during an upgrade, hooks.compat). A request
        without a manifest is taken to come with this release's own, which lists every type the hooks
        render."""
        return self.child_types is None or set(types) <= self.child_types

    def related_objects(self, group: str) -> list[dict[str, Any]]:
        return objects(self.related, group)

    def llmgateway(self, name: str, namespace: str) -> dict[str, Any] | None:
        """The related LLMGateway `name` of this namespace, or None when the request carries none."""
        for gateway in self.related_objects(LLMGATEWAY):
            meta = gateway.get("metadata") or {}
            # An object without a namespace was related by customize's namespaced rule: it is this one's.
            if meta.get("name") == name and meta.get("namespace", namespace) == namespace:
                return gateway
        return None

    @property
    def keda_installed(self) -> bool:
        return any((o.get("metadata") or {}).get("name") == KEDA_CRD_NAME for o in self.related_objects(CRD))

    def live_pods(self) -> list[dict[str, Any]]:
        """The backend Pods (what finalize waits for and what the backend condition reads)."""
        return self.pods_of(labels.BACKEND)

    def pods_of(self, *components: str) -> list[dict[str, Any]]:
        """Related Pods of these components. Pods without a component label count as backend Pods
        (requests from before customize asked for every component's Pods)."""
        def component(pod: dict[str, Any]) -> str:
            return str(((pod.get("metadata") or {}).get("labels") or {}).get(labels.COMPONENT, labels.BACKEND))

        return [p for p in self.related_objects(POD) if component(p) in components]

    @property
    def pods_observed(self) -> bool:
        """False when the request carried no Pod group: "no pods" is then unknown, not zero."""
        return has_group(self.related, POD)



def parse_children(groups: Any) -> dict[tuple[str, str], dict[str, Any]]:
    out: dict[tuple[str, str], dict[str, Any]] = {}
    if not isinstance(groups, dict):
        return out
    for group in sorted(groups):
        for obj in objects(groups, group):
            kind, _, api_version = group.partition(".")
            obj = {**obj}
            obj.setdefault("kind", kind)
            obj.setdefault("apiVersion", api_version)
            out[object_key(obj)] = obj
    return out


def child_resources(controller: Any) -> frozenset[tuple[str, str]] | None:
    """The (apiVersion, resource) pairs of a controller manifest's spec.childResources.

    None when there is no manifest to read: no `controller` in the request, or one without a `spec`
    (offline rendering and hand-made requests name the controller only; Metacontroller always sends
    the whole object, spec included). A spec without a usable childResources list lists nothing."""
    spec = controller.get("spec") if isinstance(controller, dict) else None
    if not isinstance(spec, dict):
        return None
    entries = spec.get("childResources")
    return frozenset((str(c.get("apiVersion")), str(c.get("resource")))
                     for c in (entries if isinstance(entries, list) else []) if isinstance(c, dict))


def observe(request: dict[str, Any], children_key: str = "children") -> Observed:
    return Observed(children=parse_children(request.get(children_key)), related=request.get("related") or {},
                    child_types=child_resources(request.get("controller")))


def require_object(request: Any, key: str) -> dict[str, Any]:
    """The parent (or decorated object) of a request; anything unreadable is a 400."""
    if not isinstance(request, dict):
        raise InvalidHookRequest("hook request must be a JSON object")
    obj = request.get(key)
    if not isinstance(obj, dict):
        raise InvalidHookRequest(f"hook request has no {key!r} object")
    meta = obj.get("metadata")
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str) or not meta["name"]:
        raise InvalidHookRequest(f"{key}.metadata.name is missing")
    if "namespace" in meta and not isinstance(meta["namespace"], str):
        raise InvalidHookRequest(f"{key}.metadata.namespace must be a string")
    for groups_key in ("children", "attachments", "related"):
        if request.get(groups_key) is not None and not isinstance(request[groups_key], dict):
            raise InvalidHookRequest(f"hook request {groups_key!r} must be an object of groups")
    return obj


def kept(obj: dict[str, Any]) -> dict[str, Any]:
    """An observed child as we return it when we must keep it unchanged.

    Preferably the last-applied configuration Metacontroller recorded (exactly what a previous sync
    returned, so the 3-way merge is a no-op); otherwise the observed object without status and
    server-managed metadata. The backend's `spec.replicas` is the live one, never the last-applied
    one: KEDA has moved it since (see hooks/resources/backend.py).
    """
    meta = obj.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    raw = annotations.get(LAST_APPLIED)
    if isinstance(raw, str):
        try:
            applied = json.loads(raw)
        except ValueError:
            applied = None
        if (
            isinstance(applied, dict)
            and applied.get("kind") == obj.get("kind")
            and (applied.get("metadata") or {}).get("name") == meta.get("name")
        ):
            applied.setdefault("apiVersion", obj.get("apiVersion"))
            return _with_live_backend_replicas(applied, obj)
    clean = {k: v for k, v in obj.items() if k != "status"}
    clean_meta = {k: v for k, v in meta.items() if k not in _SERVER_METADATA}
    if annotations:
        rest = {k: v for k, v in annotations.items() if k != LAST_APPLIED}
        if rest:
            clean_meta["annotations"] = rest
        else:
            clean_meta.pop("annotations", None)
    clean["metadata"] = clean_meta
    return _with_live_backend_replicas(clean, obj)


def _with_live_backend_replicas(kept_obj: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    component = ((kept_obj.get("metadata") or {}).get("labels") or {}).get(labels.COMPONENT)
    spec = kept_obj.get("spec")
    if kept_obj.get("kind") != "Deployment" or component != labels.BACKEND or not isinstance(spec, dict):
        return kept_obj
    spec = {k: v for k, v in spec.items() if k != "replicas"}
    value = backend.observed_replicas(live)
    if value is not None:
        spec = {"replicas": value, **spec}
    return {**kept_obj, "spec": spec}
