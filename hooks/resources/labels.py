"""Labels every child carries, and the Kubernetes rules for label keys and values."""

from __future__ import annotations

import re

from hooks.resources.names import stable_hash

LLMSERVICE = "serving.noctaya.io/llmservice"
COMPONENT = "serving.noctaya.io/component"
MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "noctaya"
# On the ScaledObject of a model that never yields its accelerators (scaling.yieldPolicy: Never): the
# AcceleratorPool controller reads it from the ScaledObjects it already watches. Absent for WhenIdle.
YIELD_POLICY = "serving.noctaya.io/yield-policy"

BACKEND = "backend"
GATEWAY = "gateway"
SCALER = "scaler"
AGGREGATOR = "aggregator"
CACHE = "cache"
PREWARM = "prewarm"
AUTH = "auth"

_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_NAME_PART = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def is_valid_label_value(value: str) -> bool:
    return len(value) <= 63 and bool(_VALUE.match(value))


def is_valid_label_key(key: str) -> bool:
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _PREFIX.match(prefix)):
        return False
    return 0 < len(name) <= 63 and bool(_NAME_PART.match(name))


def label_value(name: str) -> str:
    """An object name as a label value: LLMService names may be up to 253 characters, values 63."""
    if is_valid_label_value(name):
        return name
    tail = "-" + stable_hash(name)
    head = re.sub(r"[^-A-Za-z0-9_.]", "-", name)[: 63 - len(tail)]
    head = re.sub(r"[^A-Za-z0-9]+$", "", head) or "x"
    return head + tail


def selector(service: str, component: str) -> dict[str, str]:
    """The immutable part: what a Deployment or Service selects on."""
    return {LLMSERVICE: label_value(service), COMPONENT: component}


def labels(service: str, component: str) -> dict[str, str]:
    return {**selector(service, component), MANAGED_BY: MANAGER}


# Children of an LLMGateway carry this key instead of LLMSERVICE: an LLMService's rules (its Pods, its
# children) then never select a shared gateway's objects, even when the two share a name.
LLMGATEWAY = "serving.noctaya.io/llmgateway"
ROUTES = "routes"  # an LLMGateway's routing ConfigMap


def gateway_selector(gateway: str, component: str) -> dict[str, str]:
    """`selector` for the children of the LLMGateway `gateway`."""
    return {LLMGATEWAY: label_value(gateway), COMPONENT: component}


def gateway_labels(gateway: str, component: str) -> dict[str, str]:
    return {**gateway_selector(gateway, component), MANAGED_BY: MANAGER}
