"""PodDisruptionBudget of a multi-gateway LLMService: a drain never takes the last gateway."""

from __future__ import annotations

from typing import Any

from hooks.resources import labels, names
from hooks.resources.context import RenderContext


def gateway_pdb(ctx: RenderContext) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": ctx.metadata(names.gateway(ctx.name), labels.GATEWAY),
        "spec": {"minAvailable": 1, "selector": {"matchLabels": labels.selector(ctx.name, labels.GATEWAY)}},
    }
