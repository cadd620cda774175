"""AcceleratorPool: many models sharing fewer accelerators.

One pool per accelerator resource name (optionally narrowed to some nodes). Its controller
(hooks.controller.pool) sees backend Pods that cannot be scheduled for lack of that resource and the
idle models holding it, and lists which idle model yields to which waiter; the LLMService
autoscaling decorator then gives the victim's ScaledObject a short cooldownPeriod, so KEDA — which
asks the model's gateway whether it is idle right before it scales in — releases the accelerator.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from hooks.api.common import API_VERSION, ApiModel, CRDInfo, Duration, ObjectMeta, PrinterColumn, Rule, duration_seconds
from hooks.api.status import Condition, _StatusModel

# An extended resource name as the device plugins publish them: `<domain>/<name>`.
RESOURCE_NAME_RE = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
ResourceName = Annotated[str, Field(pattern=RESOURCE_NAME_RE, max_length=253)]
MAX_YIELD_AFTER_SECONDS = 3600
DEFAULT_YIELD_AFTER = "60s"

_CONDITION_LIST = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}


class AcceleratorPoolSpec(ApiModel):
    """Which accelerators form the pool, and how long a model must be idle before it yields."""

    resource_name: ResourceName = Field(
        description="The extended resource the pool shares, as the device plugin publishes it (nvidia.com/gpu, "
        "amd.com/gpu, a MIG profile such as nvidia.com/mig-1g.10gb). One pool per resource: a waiter short of "
        "nvidia.com/gpu never makes a model holding amd.com/gpu yield."
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, max_length=16,
        description="Labels of the nodes that form the pool; empty: every node that offers resourceName.",
    )
    yield_after: Duration = Field(
        default=DEFAULT_YIELD_AFTER,
        description="How long a model must have been idle (KEDA's lastActiveTime) before it gives its accelerators "
        "to a waiting model. Bounds thrash: two models alternating on one accelerator swap at most once per "
        "yieldAfter. 0s evicts an idle model as soon as a waiter needs it; a value at or above a model's own "
        "cooldownPeriod never shortens that model's cooldown.",
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel=f"duration(self.yieldAfter) <= duration('{MAX_YIELD_AFTER_SECONDS}s')",
            message="yieldAfter must be at most 1h",
            check=lambda s: duration_seconds(s.yield_after) <= MAX_YIELD_AFTER_SECONDS,
        ),
    )


class PoolCapacity(_StatusModel):
    nodes: int = Field(description="Pool nodes that offer the resource.")
    units: int = Field(description="The resource's allocatable units summed over those nodes.")


class Waiter(_StatusModel):
    pod: str = Field(description="The backend Pod (namespace/name) the scheduler could not place for lack of the resource.")
    service: str = Field(description="Its LLMService (namespace/name).")
    need: int = Field(description="Units of the resource the Pod requests.")


class Yield(_StatusModel):
    scaled_object: str = Field(description="The victim's ScaledObject (namespace/name), given a short cooldownPeriod.")
    service: str = Field(description="The victim's LLMService (namespace/name).")
    for_: str = Field(alias="for", description="The waiting Pod (namespace/name) the units are promised to.")
    node: str = Field(description="The node where the victim's units are freed.")
    units: int = Field(description="Units the victim frees on that node.")
    cooldown_seconds: int = Field(description="The cooldownPeriod the victim's ScaledObject gets while listed (yieldAfter).")
    listed_at: str | None = Field(
        default=None,  # no schema default: a field added since 0.1.0 (tests/hooks/test_upgrade_compat.py)
        description="When the pool made this promise (RFC 3339). A victim still not scaled in 60 s after it became due "
        "(listedAt, and idle for yieldAfter) is recorded in status.stalled and its waiter placed again.",
    )


class Stalled(_StatusModel):
    scaled_object: str = Field(description="A victim KEDA did not scale in when due (namespace/name).")
    last_active_time: str = Field(
        description="Its KEDA lastActiveTime then. The entry stands, and the model is no holder, until that changes (KEDA "
        "is working on it again) or the model holds nothing on the pool's nodes."
    )


class AcceleratorPoolStatus(_StatusModel):
    """The pool's decision: derived from observed objects and this status; the clock only stamps a new promise
    (listedAt) and bounds how long one may stand without KEDA acting (stalled)."""

    observed_generation: int | None = Field(default=None, description="The spec generation last processed.")
    capacity: PoolCapacity | None = Field(default=None, description="What the pool's nodes offer.")
    waiting: list[Waiter] = Field(default_factory=list, description="Backend Pods waiting for the resource, oldest first.")
    yielding: list[Yield] = Field(
        default_factory=list,
        description="Promises: which idle model frees units for which waiter. An entry stays until its waiter is "
        "bound or gone, so the pool never evicts twice for one waiter while the scheduler catches up.",
    )
    stalled: list[Stalled] = Field(
        default_factory=list,
        description="Victims idle by KEDA's record that KEDA did not scale in when due (its operator down or not "
        "reconciling them): Contended=True/YieldStalled while any stands.",
    )
    conditions: list[Condition] = Field(
        default_factory=list, description="Accepted and Contended.", json_schema_extra=_CONDITION_LIST
    )


class AcceleratorPool(ApiModel):
    """The whole AcceleratorPool object as Metacontroller sends it."""

    model_config = ApiModel.model_config | {"extra": "ignore"}

    api_version: Literal["serving.noctaya.io/v1alpha1"] = Field(default=API_VERSION)
    kind: Literal["AcceleratorPool"] = "AcceleratorPool"
    metadata: ObjectMeta
    spec: AcceleratorPoolSpec
    status: AcceleratorPoolStatus | None = None

    crd: ClassVar[CRDInfo] = CRDInfo(
        kind="AcceleratorPool",
        plural="acceleratorpools",
        singular="acceleratorpool",
        scope="Cluster",
        short_names=("accpool",),
        description="AcceleratorPool lets more scale-to-zero models share fewer accelerators: when a model's backend "
        "cannot be scheduled for lack of resourceName, the least recently used idle model on a node it can use "
        "gives its accelerators up (through a short KEDA cooldownPeriod, so only a model KEDA sees idle is scaled "
        "in).",
        printer_columns=(
            PrinterColumn("Resource", ".spec.resourceName"),
            PrinterColumn("Nodes", ".status.capacity.nodes", type="integer"),
            PrinterColumn("Units", ".status.capacity.units", type="integer"),
            PrinterColumn("Contended", '.status.conditions[?(@.type=="Contended")].reason'),
            PrinterColumn("Accepted", '.status.conditions[?(@.type=="Accepted")].status'),
            PrinterColumn("Yield After", ".spec.yieldAfter", priority=1),
            PrinterColumn("Age", ".metadata.creationTimestamp", type="date"),
        ),
    )
