"""Vendor adapters. Adding a vendor = one module defining `ADAPTER`, registered here (and its name
added to `hooks.api.runtime.Vendor`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hooks.api.runtime import Accelerator
from hooks.runtime.vendors import amd, ascend, gaudi, none, nvidia
from hooks.runtime.vendors.base import VendorAdapter

ADAPTERS: dict[str, VendorAdapter] = {a.vendor: a for a in (nvidia.ADAPTER, amd.ADAPTER, gaudi.ADAPTER, ascend.ADAPTER, none.ADAPTER)}


@dataclass(frozen=True)
class Placement:
    """The Pod fields one accelerator request turns into."""

    limits: dict[str, str]
    node_selector: dict[str, str]
    tolerations: list[dict[str, Any]]
    env: list[dict[str, str]]
    runtime_class_name: str | None
    # Where a Pod that requests no device must go to land where one that does can (empty: anywhere the
    # selector and tolerations allow): the vendor's node labels, unless the runtime names its own selector.
    node_affinity_terms: list[dict[str, Any]] = field(default_factory=list)


def placement(accelerator: Accelerator, count: int) -> Placement:
    """Resources, selector, tolerations, env and RuntimeClass for `count` accelerators."""
    adapter = ADAPTERS[accelerator.vendor]
    resource = accelerator.resource_name or adapter.resource_name
    uses_device = count > 0 and resource is not None
    limits = {resource: str(count)} if uses_device else {}
    tolerations = adapter.tolerations() if uses_device and not accelerator.resource_name else []
    # A runtime often repeats the vendor's own toleration; keep one copy, first one wins.
    for extra in (t.wire() for t in accelerator.tolerations):
        if extra not in tolerations:
            tolerations.append(extra)
    return Placement(
        limits=limits,
        node_selector={**adapter.node_selector, **accelerator.node_selector},
        tolerations=tolerations,
        env=[{"name": k, "value": v} for k, v in adapter.env],
        runtime_class_name=accelerator.runtime_class_name,
        node_affinity_terms=adapter.node_affinity_terms() if uses_device and not accelerator.node_selector else [],
    )
