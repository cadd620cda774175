"""Offline rendering, like `helm template`: LLMService, LLMGateway + InferenceRuntime YAML in, children out.

Each LLMService gets the synthetic v2 requests Metacontroller would send on first sight (nothing
observed yet, KEDA's CRD present, every given runtime related), through the very same `sync` and
decorator `sync` the cluster uses; each LLMGateway its sync with the given LLMServices and runtimes
related (its members are those of its namespace that name it) and no RoleBinding group, so it renders
as in a namespace enabled for LLMGateways (which offline input cannot tell). The controllers are
named without their manifests, which counts as this release's (hooks.controller.observe.child_resources):
every gateway gets its ServiceAccount and RoleBinding. Documents of other kinds are ignored.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from hooks.api.llmgateway import LLMGateway
from hooks.api.llmservice import LLMService
from hooks.api.runtime import InferenceRuntime
from hooks.api.status import ConditionType
from hooks.config import HookConfig, resolve
from hooks.controller import autoscaling, llmgateway, sync
from hooks.controller import observe as obs
from hooks.errors import describe_validation_error

M = TypeVar("M", bound=BaseModel)
_UID_NAMESPACE = uuid.UUID("6f1c9a52-2d3e-4c7b-9a1f-0e5d4c3b2a19")


class RenderError(ValueError):
    """An input document cannot be rendered; the message names the object and the field."""


def _where(doc: dict[str, Any], index: int, sources: list[str] | None) -> str:
    meta = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
    name = meta.get("name") or f"(document {index + 1} has no metadata.name)"
    ns = meta.get("namespace")
    label = f"{doc.get('kind')} {ns + '/' if ns else ''}{name}"
    if sources is not None and index < len(sources):
        label = f"{sources[index]}: {label}"
    return label


def _validated(model: type[M], doc: dict[str, Any], index: int, sources: list[str] | None) -> M:
    try:
        return model.model_validate({k: v for k, v in doc.items() if k != "status"})
    except ValidationError as exc:
        raise RenderError(f"{_where(doc, index, sources)} is invalid: {describe_validation_error(exc)}") from exc


def _with_identity(doc: dict[str, Any], namespaced: bool) -> dict[str, Any]:
    meta = dict(doc.get("metadata") or {})
    if namespaced:
        meta.setdefault("namespace", "default")
    key = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
    meta.setdefault("uid", str(uuid.uuid5(_UID_NAMESPACE, f"{doc.get('kind')}:{key}")))
    meta.setdefault("generation", 1)
    return {**doc, "metadata": meta}


@dataclass
class _Inputs:
    """The documents to render, validated: runtimes by name, services and gateways with their index."""

    runtimes: dict[str, dict[str, Any]] = field(default_factory=dict)
    services: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    gateways: list[tuple[int, dict[str, Any]]] = field(default_factory=list)


def render_documents(
    documents: list[dict[str, Any]],
    config: HookConfig | None = None,
    sources: list[str] | None = None,
) -> list[dict[str, Any]]:
    """Every child (and the decorator's ScaledObject) of every LLMService, in a stable order.

    `sources` optionally names where each document came from (same order), for error messages.
    """
    cfg = resolve(config)
    inputs = _read_inputs(documents, sources)
    related_runtimes = {name: inputs.runtimes[name] for name in sorted(inputs.runtimes)}
    rendered: list[dict[str, Any]] = []
    seen: set[tuple[str, str, str]] = set()

    def once(index: int, doc: dict[str, Any]) -> None:
        key = (doc["kind"], doc["metadata"]["namespace"], doc["metadata"]["name"])
        if key in seen:
            raise RenderError(f"{_where(doc, index, sources)} is given twice")
        seen.add(key)

    for index, service in inputs.services:
        once(index, service)
        rendered.extend(_render_service(service, related_runtimes, cfg, _where(service, index, sources)))
    for index, gateway in inputs.gateways:
        once(index, gateway)
        rendered.extend(_render_gateway(gateway, inputs.services, related_runtimes, cfg,
                                        _where(gateway, index, sources)))
    return rendered


def _read_inputs(documents: list[dict[str, Any]], sources: list[str] | None) -> _Inputs:
    inputs = _Inputs()
    for index, doc in enumerate(documents):
        if not isinstance(doc, dict):
            raise RenderError(f"document {index + 1} is not a Kubernetes object")
        kind = doc.get("kind")
        if kind == "InferenceRuntime":
            parsed = _validated(InferenceRuntime, doc, index, sources)
            if parsed.metadata.name in inputs.runtimes:
                raise RenderError(f"{_where(doc, index, sources)} is given twice")
            inputs.runtimes[parsed.metadata.name] = _with_identity(doc, namespaced=False)
        elif kind == "LLMService":
            _validated(LLMService, doc, index, sources)
            inputs.services.append((index, _with_identity(doc, namespaced=True)))
        elif kind == "LLMGateway":
            _validated(LLMGateway, doc, index, sources)
            inputs.gateways.append((index, _with_identity(doc, namespaced=True)))
    return inputs


def _render_service(service: dict[str, Any], related_runtimes: dict[str, dict[str, Any]], cfg: HookConfig,
                    where: str) -> list[dict[str, Any]]:
    """The sync hook's children for a new LLMService with KEDA installed, then the decorator's ScaledObject."""
    crd = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition", "metadata": {"name": obs.KEDA_CRD_NAME}}
    answer = sync.sync({
        "controller": {"metadata": {"name": "noctaya-llmservice"}},
        "parent": service,
        "children": {g: {} for g in (obs.DEPLOYMENT, obs.SERVICE, obs.SECRET, obs.PDB, obs.PVC, obs.JOB)},
        "related": {obs.RUNTIME: related_runtimes, obs.CRD: {obs.KEDA_CRD_NAME: crd}, obs.POD: {}},
        "finalizing": False,
    }, cfg)
    for cond in answer["status"]["conditions"]:
        if cond["type"] == ConditionType.RUNTIME_RESOLVED and cond["status"] != "True":
            hint = " (add its InferenceRuntime file to the inputs)" if cond["reason"] == "RuntimeNotFound" else ""
            raise RenderError(f"{where}: spec.runtime: {cond['message']}{hint}")
        if cond["type"] == ConditionType.READY and cond["reason"] == "NotImplemented":
            raise RenderError(f"{where}: {cond['message']}")
    decorated = autoscaling.sync({
        "controller": {"metadata": {"name": "noctaya-llmservice-autoscaling"}},
        "object": service,
        "attachments": {obs.SCALED_OBJECT: {}},
        "related": {obs.RUNTIME: related_runtimes},
        "finalizing": False,
    }, cfg)
    return [*answer["children"], *decorated["attachments"]]


def _render_gateway(gateway: dict[str, Any], services: list[tuple[int, dict[str, Any]]],
                    related_runtimes: dict[str, dict[str, Any]], cfg: HookConfig, where: str) -> list[dict[str, Any]]:
    """An LLMGateway's children, with the given LLMServices of its namespace as its candidate members."""
    meta = gateway["metadata"]
    members = {f"{s['metadata']['namespace']}/{s['metadata']['name']}": s for _, s in services
               if s["metadata"]["namespace"] == meta["namespace"]}
    answer = llmgateway.sync({
        "controller": {"metadata": {"name": "noctaya-llmgateway"}},
        "parent": gateway,
        "children": {},
        "related": {obs.RUNTIME: related_runtimes, llmgateway.LLMSERVICE: members},
        "finalizing": False,
    }, cfg)
    for cond in answer["status"]["conditions"]:
        if cond["type"] == llmgateway.MEMBERS_ACCEPTED and cond["status"] != "True":
            raise RenderError(f"{where}: {cond['message']}")
    return list(answer["children"])
