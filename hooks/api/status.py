"""Status shapes, condition types and the reasons that tell a user what is happening."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class ConditionType(StrEnum):
    RUNTIME_RESOLVED = "RuntimeResolved"
    AUTOSCALING_READY = "AutoscalingReady"
    CACHE_READY = "CacheReady"
    BACKEND_READY = "BackendReady"
    GATEWAY_READY = "GatewayReady"
    READY = "Ready"
    ACCEPTED = "Accepted"  # InferenceRuntime only
    UPGRADE_PENDING = "UpgradePending"  # Noctaya's own changes wait to reach running Pods
    ROUTED = "Routed"  # a member being deleted: whether its LLMGateway still routes it


class Reason(StrEnum):
    """Every reason a condition can carry; docs/troubleshooting.md explains each one."""

    # progress and success
    RESOLVED = "Resolved"
    CONFIGURED = "Configured"
    AVAILABLE = "Available"
    READY = "Ready"
    ACCEPTED = "Accepted"
    PROGRESSING = "Progressing"
    SCALED_TO_ZERO = "ScaledToZero"
    ACTIVATING = "Activating"
    CACHE_NOT_USED = "CacheNotUsed"
    PREWARM_RUNNING = "PrewarmRunning"
    # failures of the backend
    UNSCHEDULABLE = "Unschedulable"
    WAITING_FOR_ACCELERATOR = "WaitingForAccelerator"  # unschedulable, and an AcceleratorPool lists the Pod as waiting
    IMAGE_PULL_FAILED = "ImagePullFailed"
    CRASH_LOOP = "CrashLoop"
    OOM_KILLED = "OOMKilled"
    REPEATED_TERMINATION = "RepeatedTermination"
    PROGRESS_DEADLINE_EXCEEDED = "ProgressDeadlineExceeded"
    # cache
    PREWARM_FAILED = "PrewarmFailed"
    CACHE_SPEC_CONFLICT = "CacheSpecConflict"
    WEIGHTS_NODE_UNAVAILABLE = "WeightsNodeUnavailable"  # node-local weights on a node the backend cannot use
    NOT_IMPLEMENTED = "NotImplemented"
    # configuration
    RUNTIME_NOT_FOUND = "RuntimeNotFound"
    AMBIGUOUS_RUNTIME = "AmbiguousRuntime"
    KEDA_NOT_INSTALLED = "KEDANotInstalled"
    INVALID_SPEC = "InvalidSpec"
    VOLUME_CONFLICT = "VolumeConflict"  # a runtime volume takes one of Noctaya's mounts (runtime and its LLMServices)
    SECRET_NOT_FOUND = "SecretNotFound"
    WAITING_FOR_DEPENDENCIES = "WaitingForDependencies"
    TERMINATING = "Terminating"
    # a member of a shared gateway (spec.endpoint.gateway)
    GATEWAY_NOT_FOUND = "GatewayNotFound"
    NOT_LISTED = "NotListed"
    # Noctaya's own changes to running Pods (condition UpgradePending)
    UP_TO_DATE = "UpToDate"
    WAITING_FOR_SCALE_TO_ZERO = "WaitingForScaleToZero"
    WAITING_FOR_WINDOW = "WaitingForWindow"
    WAITING_FOR_APPROVAL = "WaitingForApproval"


class _StatusModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True)

    def wire(self) -> dict:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class Condition(_StatusModel):
    """A standard Kubernetes condition (metav1.Condition shape)."""

    type: str = Field(description="Condition type, e.g. Ready or BackendReady.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(description="One CamelCase word saying why; see docs/troubleshooting.md.")
    message: str = Field(default="", description="Human-readable detail.")
    last_transition_time: str | None = Field(
        default=None, description="When status last changed (RFC 3339); unchanged while status is unchanged."
    )
    observed_generation: int | None = Field(default=None, description="The spec generation this was computed from.")


# Conditions are a map keyed by type (as metav1.Condition lists are), so server-side apply merges them.
_CONDITION_LIST = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}


class BackendPhase(StrEnum):
    """Where the backend is (hooks.controller.coldstart says how each is read from the Pods)."""

    SCALED_TO_ZERO = "ScaledToZero"
    SCHEDULING = "Scheduling"
    INITIALIZING = "Initializing"
    PULLING_IMAGE = "PullingImage"
    LOADING_MODEL = "LoadingModel"
    NOT_READY = "NotReady"
    READY = "Ready"
_SECONDS = {"pattern": r"^[0-9]+s$"}


class ColdStart(_StatusModel):
    """One start of the backend from nothing serving to a replica Ready, from that Pod's own timestamps."""

    pod: str = Field(description="The backend Pod that became Ready.", max_length=253)
    started_at: str = Field(description="When the Pod was created (RFC 3339).", json_schema_extra={"format": "date-time"})
    ready_at: str = Field(description="When it became Ready (RFC 3339).", json_schema_extra={"format": "date-time"})
    scheduling: str = Field(description="Created until bound to a node (a free accelerator node, the node autoscaler).",
                            json_schema_extra=_SECONDS)
    initialization: str = Field(description="Bound until init containers finished, without the weights wait "
                                "(init images and other init containers).", json_schema_extra=_SECONDS)
    weights_wait: str = Field(description="The wait-for-weights init container (a prewarm Job still staging).",
                              json_schema_extra=_SECONDS)
    image_pull: str = Field(description="Init done until the serving container started (pulling the serving image).",
                            json_schema_extra=_SECONDS)
    model_load: str = Field(description="Serving container started until Ready (the engine loading weights).",
                            json_schema_extra=_SECONDS)
    total: str = Field(description="Created until Ready.", json_schema_extra=_SECONDS)


class PendingUpgrade(_StatusModel):
    """Pod templates that changed only because Noctaya changed, waiting to reach running Pods."""

    digest: str = Field(description="Identifies exactly these waiting templates: annotate the object with "
                        "serving.noctaya.io/approve-upgrade=<digest> to apply them now (their Pods restart).",
                        max_length=64)
    deployments: list[str] = Field(default_factory=list, description="The Deployments whose running Pods keep "
                                   "their current template for now.")
    changes: list[str] = Field(default_factory=list, description="Where the waiting templates differ from the "
                               "running ones (paths inside the Pod template, at most a few).")


class LastYield(_StatusModel):
    """The last time an AcceleratorPool made this model give its accelerators to another."""

    pool: str = Field(description="The AcceleratorPool that listed this model as yielding.")
    to: str = Field(description="The waiting model (namespace/LLMService) its accelerators were promised to.")
    pod: str = Field(description="The waiting backend Pod (namespace/name).")
    node: str = Field(description="The node where its accelerators were freed.")
    listed_at: str = Field(default="", description="When the pool listed it (RFC 3339; empty from a pool of an older release).")


class LLMServiceStatus(_StatusModel):
    """What Noctaya observed and decided for one LLMService."""

    observed_generation: int | None = Field(default=None, description="The spec generation last processed.")
    runtime: str | None = Field(default=None, description="Name of the InferenceRuntime in use.")
    endpoint: str | None = Field(default=None, description="In-cluster OpenAI-compatible base URL of the gateway.")
    replicas: int | None = Field(default=None, description="Backend replicas (as KEDA set them).")
    ready_replicas: int | None = Field(default=None, description="Backend replicas that pass readiness.")
    phase: BackendPhase | None = Field(
        default=None,
        description="Where the backend is: ScaledToZero, Scheduling, Initializing, PullingImage, LoadingModel, "
        "NotReady (served, then lost readiness) or Ready; while waking, the most advanced Pod's phase.",
    )
    phase_since: str | None = Field(
        default=None, description="When the backend entered this phase (RFC 3339, from the Pod's own timestamps).",
        json_schema_extra={"format": "date-time"},
    )
    last_cold_start: ColdStart | None = Field(
        default=None, description="The most recent start from nothing serving to a Ready replica, per phase."
    )
    pending_upgrade: PendingUpgrade | None = Field(
        default=None, description="Noctaya's own changes waiting to reach this model's running Pods (absent: none).")
    last_yield: LastYield | None = Field(
        default=None, description="Why this model went to zero, when a pool made it yield: kept from the moment a pool "
        "lists it until its backend is next asked for replicas (absent: its last scale-in was its own cooldown).")
    conditions: list[Condition] = Field(
        default_factory=list, description="Current conditions.", json_schema_extra=_CONDITION_LIST
    )


class InferenceRuntimeStatus(_StatusModel):
    """Validation result of an InferenceRuntime."""

    observed_generation: int | None = Field(default=None, description="The spec generation last validated.")
    conditions: list[Condition] = Field(
        default_factory=list, description="Accepted condition.", json_schema_extra=_CONDITION_LIST
    )
