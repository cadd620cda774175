"""What a vendor adapter is: a small table that turns `vendor` + count into Pod fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class VendorAdapter:
    """Everything vendor-specific about one accelerator family, and nothing more.

    `resource_name` is the device plugin's extended resource; `taint_key` the taint operators
    usually put on such nodes (tolerating a taint that does not exist is harmless); `env` and
    `node_selector` are defaults the runtime's own values override. `node_labels` are the labels
    (key, value; value None: any) that the usual node labellers put on a node with this vendor's
    devices, any one of which marks such a node: a Pod that requests no device (the prewarm Job of a
    node-local cache) but must land where the backend can, uses them when the runtime names no node
    selector of its own.
    """

    vendor: str
    resource_name: str | None
    taint_key: str | None = None
    node_selector: dict[str, str] = field(default_factory=dict)
    env: tuple[tuple[str, str], ...] = ()
    node_labels: tuple[tuple[str, str | None], ...] = ()

    def node_affinity_terms(self) -> list[dict[str, Any]]:
        """Required node affinity terms (ORed by the scheduler): a node carrying any node label."""
        return [{"matchExpressions": [{"key": key, "operator": "Exists"} if value is None else
                                      {"key": key, "operator": "In", "values": [value]}]}
                for key, value in self.node_labels]

    def tolerations(self) -> list[dict[str, Any]]:
        if self.taint_key is None:
            return []
        return [{"key": self.taint_key, "operator": "Exists", "effect": "NoSchedule"}]
