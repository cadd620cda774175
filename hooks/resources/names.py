"""Names of every child of one LLMService.

Children are named `<llmservice>-<suffix>`. Services need DNS-1035 labels (≤ 63 characters, start
with a letter) while an LLMService name is a DNS-1123 subdomain (≤ 253, may contain dots and start
with a digit), so a name that does not fit is shortened and made unique with a stable hash of the
full LLMService name. Every child carries a suffix, and no suffix is the tail of another, so two
LLMServices in one namespace can never render the same child name.
"""

from __future__ import annotations

import hashlib
import re

MAX_NAME_LENGTH = 63
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_HASH_LENGTH = 8

BACKEND = "backend"  # backend Deployment and Service, and the ScaledObject that scales them
GATEWAY = "gateway"  # gateway Deployment, public Service and PDB
SCALER = "scaler"  # internal gRPC ExternalScaler Service (never the public one)
AGGREGATOR = "aggregator"  # aggregate-scaler Deployment and Service (endpoint.replicas > 1)
SCALER_TOKEN = "scaler-token"  # per-service token Secret of the demand reports
CACHE = "cache"  # model cache PersistentVolumeClaim
# Children of an LLMGateway `<gateway>` (a shared front door), in the same namespace as LLMServices:
# one word each, so that none is the tail of an LLMService child's name or of another's.
SHARED_GATEWAY = "llmgw"  # Deployment, public Service and PDB of the shared gateway
SHARED_SCALER = "llmgwscaler"  # its internal gRPC ExternalScaler Service (every member's ScaledObject dials it)
SHARED_AGGREGATOR = "llmgwaggregator"  # its aggregate scaler (replicas > 1)
SHARED_TOKEN = "llmgwtoken"  # its demand-report token Secret (replicas > 1)
SHARED_ROUTES = "llmgwroutes"  # its routing ConfigMap (the model table)


def stable_hash(text: str, length: int = _HASH_LENGTH) -> str:
    """First `length` hex digits of SHA-256: stable across processes and Python versions."""
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def is_dns1035_label(name: str) -> bool:
    return len(name) <= MAX_NAME_LENGTH and bool(DNS1035_LABEL.match(name))


def child_name(service: str, suffix: str) -> str:
    """`<service>-<suffix>`, or a shortened `<prefix>-<hash>-<suffix>` when that is not a valid label."""
    candidate = f"{service}-{suffix}"
    if is_dns1035_label(candidate):
        return candidate
    base = re.sub(r"[^a-z0-9-]+", "-", service.lower())
    base = re.sub(r"-{2,}", "-", base).strip("-")
    if not base or not base[0].isalpha():
        base = "x" + base
    tail = f"-{stable_hash(service)}-{suffix}"
    base = base[: MAX_NAME_LENGTH - len(tail)].rstrip("-")
    return base + tail


def backend(service: str) -> str:
    return child_name(service, BACKEND)


def gateway(service: str) -> str:
    return child_name(service, GATEWAY)


def public_service(service: str) -> str:
    return child_name(service, GATEWAY)


def scaler(service: str) -> str:
    return child_name(service, SCALER)


def aggregator(service: str) -> str:
    return child_name(service, AGGREGATOR)


def scaler_token(service: str) -> str:
    return child_name(service, SCALER_TOKEN)


def cache(service: str) -> str:
    return child_name(service, CACHE)


def scaled_object(service: str) -> str:
    return child_name(service, BACKEND)


def service_host(name: str, namespace: str, cluster_domain: str) -> str:
    """In-cluster DNS name of a Service."""
    return f"{name}.{namespace}.svc.{cluster_domain}"


def shared_gateway(gateway: str) -> str:
    return child_name(gateway, SHARED_GATEWAY)


def shared_scaler(gateway: str) -> str:
    return child_name(gateway, SHARED_SCALER)


def shared_aggregator(gateway: str) -> str:
    return child_name(gateway, SHARED_AGGREGATOR)


def shared_token(gateway: str) -> str:
    return child_name(gateway, SHARED_TOKEN)


def shared_routes(gateway: str) -> str:
    return child_name(gateway, SHARED_ROUTES)
