"""LLMGateway: one OpenAI-compatible front door (one base URL) for many LLMServices of a namespace.

An LLMService joins a gateway with `spec.endpoint.gateway: <LLMGateway name>`; it then renders no
gateway of its own, and the LLMGateway's controller (hooks.controller.llmgateway) renders one shared
gateway Deployment whose model table (a ConfigMap) lists every member by served model name, each
entry with the same per-model settings the member's own gateway would have had.

Contract with the LLMService controller (what it may read from an LLMGateway's status):

- `status.models[].name`: the served model names the gateway routes, in table order; a member whose
  served name is not listed is not routed (a duplicate, over the model limit, or never rendered).
- `status.models[].service`: the LLMService each routed name belongs to.
- `status.conditions[type=Ready]`: "True" while at least one shared gateway Pod (and, with replicas
  > 1, the aggregate scaler) is available.
- `status.url`: the base URL clients use for every member.

Everything else in the status is for people (`kubectl get llmgw`, `kubectl describe`).
"""

from __future__ import annotations

import copy
from typing import Annotated, ClassVar, Literal

from pydantic import Field
from pydantic.fields import FieldInfo

from hooks.api.common import (
    API_VERSION,
    ApiModel,
    CRDInfo,
    LocalObjectReference,
    ObjectMeta,
    PrinterColumn,
    ResourceRequirements,
    SecretKeyRef,
)
from hooks.api.llmservice import Endpoint, EndpointService, ModelSpec
from hooks.api.status import Condition, PendingUpgrade, _StatusModel
from hooks.api.upgrades import Upgrades

MAX_API_KEYS = 16
# The shared gateway's own bound (gateway.modeltable.MAX_MODELS); a key scoped to more names than a
# gateway can front would list names it can never route.
MAX_KEY_MODELS = 256

_CONDITION_LIST = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}


def _same_as(model: type[ApiModel], name: str) -> FieldInfo:
    """A field of another model, bounds and description included: one definition for both."""
    return copy.copy(model.model_fields[name])


# A served model name, validated exactly as an LLMService's model.servedName is.
ServedName = Annotated[str, *ModelSpec.model_fields["served_name"].metadata]


class GatewayAPIKey(ApiModel):
    """A client API key and the models it opens."""

    secret_ref: SecretKeyRef = Field(
        description="Secret key holding the API key clients send as a Bearer token (key defaults to api-key). "
        "Mounted into the gateway Pods and reread on every request, so rotating the Secret needs no restart; a "
        "missing Secret opens nothing."
    )
    models: list[ServedName] = Field(
        default_factory=list, max_length=MAX_KEY_MODELS,
        description="Served model names this key opens; empty: every model of the gateway. A model accepts exactly "
        "the keys whose models list it or is empty. With any key set, a model no key opens is not routed (the gateway "
        "fails closed and says so in MembersAccepted).",
    )


class LLMGatewaySpec(ApiModel):
    """The shared gateway's Pods and Service. Per-model settings (maxQueue, cold mode, timeouts) stay on
    each member LLMService's spec.endpoint and scaling."""

    replicas: int = Field(
        default=1, ge=1, le=32,
        description="Shared gateway replicas; more than one adds an aggregate scaler, a demand-report token "
        "Secret, a PodDisruptionBudget and preferred anti-affinity between the replicas.",
    )
    resources: ResourceRequirements | None = _same_as(Endpoint, "resources")
    service: EndpointService = Field(default_factory=EndpointService, description="Public Service type and annotations.")
    max_connections_per_address: int | None = _same_as(Endpoint, "max_connections_per_address")
    request_timeout_seconds: int | None = _same_as(Endpoint, "request_timeout_seconds")
    api_keys: list[GatewayAPIKey] = Field(
        default_factory=list, max_length=MAX_API_KEYS,
        description="Client API keys, each scoped to some models or to all. Without any, no model asks for a key; "
        "with any, every routed model asks for one.",
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, max_length=16,
        description="Registry credentials (kubernetes.io/dockerconfigjson Secrets in this namespace) for the shared "
        "gateway and aggregate scaler Pods.",
    )
    # No schema default, as on LLMService (docs/upgrading.md, "New fields").
    upgrades: Upgrades | None = Field(
        default=None,
        description="How Noctaya's own changes (a new release, an install setting) reach the shared gateway's Pods "
        "(absent: policy WhenIdle, no windows): "
        "with WhenIdle they wait until every routed model is at zero replicas (nothing is held or streaming "
        "through the gateway then), a window, or an approval. Changes to this LLMGateway roll at once.",
    )


class GatewayModel(_StatusModel):
    name: str = Field(description="The served model name clients send (the member's model.servedName).")
    service: str = Field(description="The LLMService that serves it.")


class LLMGatewayStatus(_StatusModel):
    """What the shared gateway routes, and whether it serves."""

    observed_generation: int | None = Field(default=None, description="The spec generation last processed.")
    url: str | None = Field(default=None, description="In-cluster OpenAI-compatible base URL of every member.")
    model_count: int | None = Field(default=None, description="How many models the gateway routes.")
    models: list[GatewayModel] = Field(
        default_factory=list, description="The routed models by served name, in table order (sorted by name)."
    )
    pending_upgrade: PendingUpgrade | None = Field(
        default=None, description="Noctaya's own changes waiting to reach the shared gateway's Pods (absent: none).")
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, Accepted (the spec, and whether the namespace is enabled for LLMGateways) and "
        "MembersAccepted (membership problems).",
        json_schema_extra=_CONDITION_LIST,
    )


class LLMGateway(ApiModel):
    """The whole LLMGateway object as Metacontroller sends it."""

    model_config = ApiModel.model_config | {"extra": "ignore"}

    api_version: Literal["serving.noctaya.io/v1alpha1"] = Field(default=API_VERSION)
    kind: Literal["LLMGateway"] = "LLMGateway"
    metadata: ObjectMeta
    spec: LLMGatewaySpec = Field(default_factory=LLMGatewaySpec, description="Desired state of the shared gateway.")
    status: LLMGatewayStatus | None = None

    crd: ClassVar[CRDInfo] = CRDInfo(
        kind="LLMGateway",
        plural="llmgateways",
        singular="llmgateway",
        scope="Namespaced",
        short_names=("llmgw",),
        description="LLMGateway is one OpenAI-compatible front door for many LLMServices of its namespace: every "
        "LLMService whose spec.endpoint.gateway names it is routed by model name through one shared gateway "
        "Deployment and Service, each model keeping its own admission, cold-start behaviour and scale to zero.",
        printer_columns=(
            PrinterColumn("URL", ".status.url"),
            PrinterColumn("Models", ".status.modelCount", type="integer"),
            PrinterColumn("Ready", '.status.conditions[?(@.type=="Ready")].status'),
            PrinterColumn("Age", ".metadata.creationTimestamp", type="date"),
        ),
    )
