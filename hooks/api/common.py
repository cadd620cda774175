"""Building blocks shared by the LLMService and InferenceRuntime models.

Every model here is both a runtime validator (the hooks and `hooks render` parse with it) and the
source the CRD schema is generated from (`hooks.crdgen`). Cross-field rules are declared once as
`Rule` objects: crdgen emits them as CEL `x-kubernetes-validations`, and `ApiModel` checks the same
rule in Python, so the API server and the hooks reject the same objects with the same message.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, model_validator
from pydantic.alias_generators import to_camel

from hooks.errors import explain_pattern

GROUP = "serving.noctaya.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"


@dataclass(frozen=True)
class Rule:
    """A cross-field validation rule, written once for both CEL and Python.

    `cel` is evaluated by the API server (`self` is the object the rule is attached to); `check`
    is the same predicate over the parsed pydantic model. `message` is shown to the user by both.
    """

    cel: str
    message: str
    check: Callable[[Any], bool]


class ApiModel(BaseModel):
    """Base of every spec model: camelCase on the wire, unknown fields rejected, rules enforced."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
    )

    # Cross-field rules of this object; see `Rule`.
    rules: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self) -> ApiModel:
        for rule in type(self).rules:
            if not rule.check(self):
                raise ValueError(rule.message)
        return self

    def wire(self) -> dict[str, Any]:
        """The object as Kubernetes JSON: camelCase keys, unset optional fields left out."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# --- scalar types -------------------------------------------------------------------------------

_QUANTITY_RE = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
_QUANTITY = re.compile(_QUANTITY_RE)


def _quantity(value: Any) -> str:
    if isinstance(value, bool):
        raise ValueError("a quantity is a number or a string such as 500m, 4Gi")
    if isinstance(value, int | float):
        value = str(value)
    if not isinstance(value, str) or not _QUANTITY.match(value):
        raise ValueError(f"{value!r} is not a Kubernetes quantity (examples: 2, 500m, 16Gi)")
    return value


# A Kubernetes resource quantity. Accepts `2` or `"16Gi"`; always held as a string.
Quantity = Annotated[
    str,
    BeforeValidator(_quantity),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": _QUANTITY_RE,
            "x-kubernetes-int-or-string": True,
        }
    ),
]

_DURATION_RE = explain_pattern(r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$", "a duration such as 90s, 5m or 1h30m")
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}

# A Go-style duration (`90s`, `5m`, `1h30m`), as Kubernetes users write them and CEL's
# `duration()` reads them.
# maxLength bounds the CEL cost of rules that parse it with duration().
Duration = Annotated[str, Field(pattern=_DURATION_RE, max_length=32)]


def duration_seconds(value: str) -> float:
    """Seconds in a Go-style duration string (already validated against the pattern)."""
    if not re.fullmatch(_DURATION_RE, value):
        raise ValueError(f"{value!r} is not a duration such as 90s, 5m or 1h30m")
    return sum(float(n) * _UNIT_SECONDS[u] for n, u in _DURATION_PART.findall(value))


# DNS-1123 label: names of Secrets, claims, runtimes.
DNS_LABEL_RE = explain_pattern(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                               "a DNS-1123 label: lower-case letters, digits and '-', starting and ending alphanumeric")
DNSLabel = Annotated[str, Field(pattern=DNS_LABEL_RE, max_length=63)]
# DNS-1123 subdomain: names of most Kubernetes objects.
DNS_SUBDOMAIN_RE = explain_pattern(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
                                   "a DNS-1123 subdomain: DNS labels joined by '.'")
DNSSubdomain = Annotated[str, Field(pattern=DNS_SUBDOMAIN_RE, max_length=253)]
ENV_NAME_RE = explain_pattern(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$",
                              "an environment variable name: letters, digits, '_', '-' and '.', not starting with a digit")
ABSOLUTE_PATH_RE = explain_pattern(r"^/", "an absolute path (starting with /)")

Port = Annotated[int, Field(ge=1, le=65535)]


# --- small Kubernetes shapes --------------------------------------------------------------------


class SecretKeyRef(ApiModel):
    """A key of a Secret in the LLMService's namespace."""

    name: DNSSubdomain = Field(description="Name of the Secret.")
    key: str | None = Field(
        default=None,
        description="Key inside the Secret. Each field that uses this type documents its default.",
        pattern=r"^[-._a-zA-Z0-9]+$",
        max_length=253,
    )


class LocalObjectReference(ApiModel):
    """A Secret in the LLMService's namespace, by name (the shape of a Pod's imagePullSecrets)."""

    name: DNSSubdomain = Field(description="Name of the Secret.")


def pull_secret_names(*lists: list[LocalObjectReference]) -> list[dict[str, str]]:
    """imagePullSecrets entries, in order, without duplicates."""
    seen: list[str] = []
    for refs in lists:
        for ref in refs:
            if ref.name not in seen:
                seen.append(ref.name)
    return [{"name": n} for n in seen]


class EnvVar(ApiModel):
    """An environment variable for the serving container (same shape as a container's env)."""

    name: str = Field(description="Variable name.", pattern=ENV_NAME_RE, max_length=256)
    value: str | None = Field(
        default=None,
        description="Literal value; may reference other variables as $(NAME), which Kubernetes expands.",
    )
    value_from: dict[str, Any] | None = Field(
        default=None,
        description="Source for the value (secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef), "
        "exactly as in a Pod's env.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="!(has(self.value) && has(self.valueFrom))",
            message="set either value or valueFrom, not both",
            check=lambda s: not (s.value is not None and s.value_from is not None),
        ),
    )


class Toleration(ApiModel):
    """A Pod toleration, as in `spec.tolerations` of a Pod."""

    key: str | None = Field(default=None, description="Taint key the toleration applies to.")
    operator: Literal["Exists", "Equal"] | None = Field(
        default=None, description="Exists or Equal (Kubernetes' default is Equal)."
    )
    value: str | None = Field(default=None, description="Taint value matched with operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; empty matches all effects."
    )
    toleration_seconds: int | None = Field(
        default=None, description="How long a NoExecute taint is tolerated before eviction."
    )


class LabelSelectorRequirement(ApiModel):
    """One `matchExpressions` entry of a label selector."""

    key: str = Field(description="Label key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(description="Set operator.")
    values: list[str] = Field(default_factory=list, max_length=64, description="Values for In and NotIn.")

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            # has(): an omitted list is absent in CEL, not empty (no schema default for [])
            cel="(self.operator in ['In', 'NotIn']) == (has(self.values) && size(self.values) > 0)",
            message="In and NotIn need values; Exists and DoesNotExist take none",
            check=lambda s: (s.operator in ("In", "NotIn")) == (len(s.values) > 0),
        ),
    )


class LabelSelector(ApiModel):
    """A Kubernetes label selector (matchLabels AND matchExpressions)."""

    match_labels: dict[str, str] = Field(default_factory=dict, description="Labels that must all match.")
    match_expressions: list[LabelSelectorRequirement] = Field(
        default_factory=list, max_length=32, description="Set-based requirements that must all hold."
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="(has(self.matchLabels) && size(self.matchLabels) > 0) "
            "|| (has(self.matchExpressions) && size(self.matchExpressions) > 0)",
            message="an empty selector would match every runtime: give matchLabels or matchExpressions",
            check=lambda s: len(s.match_labels) + len(s.match_expressions) > 0,
        ),
    )

    def matches(self, labels: dict[str, str]) -> bool:
        """Kubernetes selector semantics over one object's labels."""
        if any(labels.get(k) != v for k, v in self.match_labels.items()):
            return False
        for req in self.match_expressions:
            present = req.key in labels
            if req.operator == "In" and labels.get(req.key) not in req.values:
                return False
            if req.operator == "NotIn" and present and labels[req.key] in req.values:
                return False
            if req.operator == "Exists" and not present:
                return False
            if req.operator == "DoesNotExist" and present:
                return False
        return True


class ResourceRequirements(ApiModel):
    """CPU/memory requests and limits of a container."""

    requests: dict[str, Quantity] = Field(default_factory=dict, description="Minimum resources reserved.")
    limits: dict[str, Quantity] = Field(default_factory=dict, description="Maximum resources allowed.")


class ObjectMeta(BaseModel):
    """The part of `metadata` the hooks read. Everything else is carried but ignored."""

    model_config = ConfigDict(populate_by_name=True, alias_generator=to_camel, extra="ignore", frozen=True)

    name: str
    namespace: str | None = None
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    deletion_timestamp: str | None = None


# --- CRD presentation (read by hooks.crdgen) -----------------------------------------------------


@dataclass(frozen=True)
class PrinterColumn:
    name: str
    json_path: str
    type: str = "string"
    description: str = ""
    priority: int = 0


@dataclass(frozen=True)
class CRDInfo:
    """How a top-level model is published as a CustomResourceDefinition."""

    kind: str
    plural: str
    singular: str
    scope: Literal["Namespaced", "Cluster"]
    short_names: tuple[str, ...]
    description: str
    printer_columns: tuple[PrinterColumn, ...] = field(default_factory=tuple)
    categories: tuple[str, ...] = ("noctaya",)
