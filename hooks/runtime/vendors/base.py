"""What a vendor adapter is: a small table that turns `vendor` + count into Pod fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class VendorAdapter:
    """Everything vendor-specific about one accelerator family, and nothing more.

    `resource_name` is the device plugin's extended resource; `taint_key` the taint operators
    usually put on such nodes (tolerating a taint that does not exist is harmless); `env` and
    `node_selector` are defaults the runtime's own values override.
    """

    vendor: str
    resource_name: str | None
    taint_key: str | None = None
    node_selector: dict[str, str] = field(default_factory=dict)
    env: tuple[tuple[str, str], ...] = ()

    def tolerations(self) -> list[dict[str, Any]]:
        if self.taint_key is None:
            return []
        return [{"key": self.taint_key, "operator": "Exists", "effect": "NoSchedule"}]
