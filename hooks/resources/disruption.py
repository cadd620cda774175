"""PodDisruptionBudget of several gateway replicas (an LLMService's or an LLMGateway's): a drain never
takes the last gateway."""

from __future__ import annotations

from typing import Any

from hooks.resources import labels, names
from hooks.resources.context import RenderContext


def gateway_pdb(ctx: RenderContext) -> dict[str, Any]:
    return pdb_object(ctx.metadata(names.gateway(ctx.name), labels.GATEWAY), labels.selector(ctx.name, labels.GATEWAY))


def pdb_object(metadata: dict[str, Any], selector: dict[str, str]) -> dict[str, Any]:
    """minAvailable 1 over the gateway Pods `selector` picks (any owner's)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata,
        "spec": {"minAvailable": 1, "selector": {"matchLabels": selector}},
    }
