"""`customize` of the LLMService CompositeController: which related objects sync needs.

Metacontroller caches the answer per (parent UID, generation), so it depends on the spec only —
read here from the raw object, so even an invalid spec still gets its runtime and Pods observed
(its sync must keep children and explain). A rule never combines `names` with a selector, and
never carries an empty selector (that would match everything) — except POOL_RULE, where
everything is what it asks for.
"""

from __future__ import annotations

import re
from typing import Any

from hooks.api.common import API_VERSION, DNS_LABEL_RE
from hooks.config import HookConfig
from hooks.controller import observe as obs
from hooks.resources import labels

# Every AcceleratorPool. The empty selector is deliberate: Metacontroller turns `{}` into
# labels.Everything, and pools are cluster-scoped, few, and carry no label naming the models they
# concern — any pool's status may list this model as waiting or yielding. (Without any selector the
# rule would still list everything, but `{}` says so.) Both LLMService controllers relate them: the
# decorator shortens a yielding model's cooldown, the main controller explains waiting and yielding in
# BackendReady. A pool's status changes only when its decision does, so this costs a resync of every
# LLMService per pool decision, not per Pod event.
POOL_RULE: dict[str, Any] = {"apiVersion": API_VERSION, "resource": "acceleratorpools", "labelSelector": {}}


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _clean_selector(selector: dict[str, Any]) -> dict[str, Any] | None:
    """A label selector with only well-formed parts, or None when nothing would remain."""
    out: dict[str, Any] = {}
    match_labels = {k: v for k, v in _dict(selector.get("matchLabels")).items() if isinstance(k, str) and isinstance(v, str)}
    if match_labels:
        out["matchLabels"] = dict(sorted(match_labels.items()))
    exprs = []
    for e in selector.get("matchExpressions") or []:
        if not isinstance(e, dict) or not isinstance(e.get("key"), str) or e.get("operator") not in ("In", "NotIn", "Exists", "DoesNotExist"):
            continue
        values = [v for v in e.get("values") or [] if isinstance(v, str)]
        if (e["operator"] in ("In", "NotIn")) != bool(values):
            continue
        expr: dict[str, Any] = {"key": e["key"], "operator": e["operator"]}
        if values:
            expr["values"] = values
        exprs.append(expr)
    if exprs:
        out["matchExpressions"] = exprs
    return out or None


def runtime_rule(spec: dict[str, Any]) -> dict[str, Any] | None:
    runtime = _dict(spec.get("runtime"))
    base = {"apiVersion": API_VERSION, "resource": "inferenceruntimes"}
    name = runtime.get("name")
    if isinstance(name, str) and name:
        return {**base, "names": [name]}
    selector = _clean_selector(_dict(runtime.get("selector")))
    if selector is not None:
        return {**base, "labelSelector": selector}
    return None


def related_rules(parent: dict[str, Any]) -> list[dict[str, Any]]:
    meta = _dict(parent.get("metadata"))
    spec = _dict(parent.get("spec"))
    namespace = meta.get("namespace") or "default"
    rules: list[dict[str, Any]] = []
    rule = runtime_rule(spec)
    if rule is not None:
        rules.append(rule)
    rules.append({"apiVersion": "apiextensions.k8s.io/v1", "resource": "customresourcedefinitions", "names": [obs.KEDA_CRD_NAME]})
    # Every Pod of this LLMService: the backend's status, and what gateway and aggregator Pods say about
    # a Secret they could not find. Secrets themselves are never asked for: Metacontroller would send
    # their data to the hook server on every sync, which only needs to know whether they exist.
    rules.append(
        {
            "apiVersion": "v1",
            "resource": "pods",
            "namespace": namespace,
            "labelSelector": {"matchLabels": {labels.LLMSERVICE: labels.label_value(meta["name"])}},
        }
    )
    rules.append(dict(POOL_RULE))
    gateway = gateway_rule(spec, namespace)
    if gateway is not None:
        rules.append(gateway)
    return rules


def shared_gateway_name(spec: Any) -> str | None:
    """spec.endpoint.gateway read from the raw spec, so that an otherwise invalid spec still names the
    LLMGateway that fronts it; None when unset or not a DNS label."""
    gateway = _dict(_dict(spec).get("endpoint")).get("gateway")
    return gateway if isinstance(gateway, str) and re.fullmatch(DNS_LABEL_RE, gateway) else None


def gateway_rule(spec: dict[str, Any], namespace: str) -> dict[str, Any] | None:
    """The LLMGateway a member joins, by name in its own namespace: its status says whether it is Ready
    and lists this model (GatewayReady). None without a usable name."""
    gateway = shared_gateway_name(spec)
    if gateway is None:
        return None
    return {"apiVersion": API_VERSION, "resource": "llmgateways", "namespace": namespace, "names": [gateway]}


def customize(request: dict[str, Any], config: HookConfig | None = None) -> dict[str, Any]:
    parent = obs.require_object(request, "parent")
    return {"relatedResources": related_rules(parent)}
