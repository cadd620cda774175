"""The children of an LLMGateway: one shared gateway in front of many LLMServices.

Built from the same parts as a model's own gateway (hooks.resources.gateway, scaler, disruption,
secrets), so the two differ only where sharing demands it:

- the Pod's env carries the Pod-level settings only, plus NOCTAYA_MODEL_TABLE_FILE; each model's
  settings are its entry in the routing ConfigMap (`models.json`), computed by
  gateway.model_settings exactly as a model's own gateway env is;
- the ConfigMap is mounted as a directory (never subPath: the kubelet updates a directory mount in
  place, and the gateway rereads the file), so a member joining or leaving rolls no Pod;
- every `apiKeys` Secret is mounted at its own directory, and a model's entry lists the key files
  that open it (`authKeyFiles`);
- a member's `endpoint.balancing` goes into a second key of the same ConfigMap, `balancing.json`,
  only when some member sets it (never into `models.json`: the previous release's gateway refuses a
  table entry with a field it does not know, and crash-loops on its next start);
- the gateway's identity (ServiceAccount and RoleBinding) is built as a model's own gateway's is
  (hooks.resources.gateway), named like the shared gateway's Deployment; it watches the EndpointSlices
  of every member's backend Service, all in its own namespace.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.modeltable import BALANCING_FIELDS, BALANCING_FILE, LIST_FIELDS
from hooks.api.llmgateway import LLMGateway, LLMGatewaySpec
from hooks.api.llmservice import Balancing
from hooks.config import HookConfig
from hooks.resources import disruption, gateway, labels, names, scaler, secrets
from hooks.resources.context import ADMIN_PORT, GATEWAY_PORT, METRIC_NAME, PUBLIC_PORT, service_object, tcp_port

MODELS_DIR = "/etc/noctaya/models"
MODELS_FILE = "models.json"
MODELS_VOLUME = "models"
API_KEYS_DIR = "/var/run/noctaya/api-keys"
# The model-table key of the files of the API keys that open a model (one of the gateway's LIST_FIELDS).
AUTH_KEY_FILES = "authKeyFiles"
assert AUTH_KEY_FILES in LIST_FIELDS
DEFAULT_KEY = "api-key"


@dataclass(frozen=True)
class SharedContext:
    """What every builder of an LLMGateway's children reads."""

    gateway: LLMGateway
    namespace: str
    config: HookConfig
    uid: str = ""
    # As RenderContext.gateway_identity: a ServiceAccount and RoleBinding of its own, and balancing
    # over the members' Pods, only when the calling controller manages those child types.
    gateway_identity: bool = True

    @property
    def name(self) -> str:
        return self.gateway.metadata.name

    @property
    def spec(self) -> LLMGatewaySpec:
        return self.gateway.spec

    @property
    def multi_gateway(self) -> bool:
        return self.spec.replicas > 1

    def host(self, service_name: str) -> str:
        return names.service_host(service_name, self.namespace, self.config.cluster_domain)

    def metadata(self, name: str, component: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name, "namespace": self.namespace,
                                "labels": labels.gateway_labels(self.name, component)}
        if annotations:
            meta["annotations"] = dict(sorted(annotations.items()))
        return meta

    def selector(self, component: str) -> dict[str, str]:
        return labels.gateway_selector(self.name, component)


def url(gateway_name: str, namespace: str, config: HookConfig) -> str:
    """The base URL of every member (status.url)."""
    return f"http://{names.service_host(names.shared_gateway(gateway_name), namespace, config.cluster_domain)}/v1"


# --- API keys -------------------------------------------------------------------------------------


def key_file(index: int) -> str:
    """Where the Pod reads the key of `apiKeys[index]`: one directory per entry, so two entries naming
    the same key of different Secrets cannot collide."""
    return f"{API_KEYS_DIR}/{index}/{gateway.AUTH_FILE}"


def key_files_for(spec: LLMGatewaySpec, served_name: str) -> list[str]:
    """The key files that open `served_name`: entries that list it, or list no model at all."""
    return [key_file(i) for i, key in enumerate(spec.api_keys) if not key.models or served_name in key.models]


def with_keys(spec: LLMGatewaySpec, entry: dict[str, Any]) -> dict[str, Any]:
    """A table entry with this gateway's key files (recomputed on every sync, also for a kept entry:
    which keys open a model is the gateway's decision, never a member's)."""
    out = {k: v for k, v in entry.items() if k != AUTH_KEY_FILES}
    files = key_files_for(spec, str(entry["name"]))
    if files:  # none only without apiKeys: a model no key opens is not routed (llmgateway.gather)
        out[AUTH_KEY_FILES] = files
    return out


# --- children -------------------------------------------------------------------------------------


def table_json(entries: list[dict[str, Any]]) -> str:
    """The model table as the gateway reads it: compact, and the same bytes for the same entries."""
    return json.dumps({"models": entries}, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def member_balancing(balancing: Balancing | None) -> dict[str, Any]:
    """A member's balancing.json entry: the fields it sets, and only those (empty when none)."""
    if balancing is None:
        return {}
    entry = balancing.model_dump(by_alias=True, exclude_none=True, mode="json")
    # Only keys of the gateway's own list (gateway.modeltable), which is the API's (a test holds both
    # equal): the hooks never write a key the gateway does not read.
    return {key: value for key, value in entry.items() if key in BALANCING_FIELDS}


def balancing_json(by_model: dict[str, dict[str, Any]]) -> str:
    """balancing.json as the gateway reads it (gateway.modeltable.apply_balancing): compact, keys sorted,
    so the same settings are the same bytes on every resync."""
    return json.dumps({"models": by_model}, separators=(",", ":"), sort_keys=True, ensure_ascii=True,
                      allow_nan=False)


def routes_configmap(ctx: SharedContext, entries: list[dict[str, Any]],
                     balancing: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The model table, and beside it `balancing.json` with the members that set any balancing (by served
    name). Without such a member the ConfigMap has the table only, as before balancing existed."""
    data = {MODELS_FILE: table_json(entries)}
    chosen = {name: entry for name, entry in (balancing or {}).items() if entry}
    if chosen:
        data[BALANCING_FILE] = balancing_json(chosen)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": ctx.metadata(names.shared_routes(ctx.name), labels.ROUTES),
        "data": data,
    }


def env(ctx: SharedContext) -> list[dict[str, str]]:
    """The Pod-level half of a model gateway's env (the per-model half is in each table entry)."""
    spec = ctx.spec
    return [
        gateway.env_var("NOCTAYA_LISTEN_PORT", GATEWAY_PORT),
        gateway.env_var("NOCTAYA_ADMIN_PORT", ADMIN_PORT),
        gateway.env_var("NOCTAYA_QUEUE_FULL_RETRY_AFTER_SECONDS", gateway.QUEUE_FULL_RETRY_AFTER_SECONDS),
        gateway.env_var("NOCTAYA_DRAIN_GRACE_SECONDS", gateway.DRAIN_GRACE_SECONDS),
        *gateway.client_env(spec.max_connections_per_address, spec.request_timeout_seconds),
        gateway.env_var("NOCTAYA_MODEL_TABLE_FILE", f"{MODELS_DIR}/{MODELS_FILE}"),
        gateway.env_var("NOCTAYA_METRIC_NAME", METRIC_NAME),
        *gateway.scaler_env(ctx.multi_gateway, gateway.report_url_at(ctx.host(names.shared_scaler(ctx.name)))),
        # After everything a shared gateway rendered before (the env's order is the template's).
        *gateway.endpoint_source_env(ctx.gateway_identity),
    ]


def deployment(ctx: SharedContext) -> dict[str, Any]:
    volumes: list[dict[str, Any]] = [
        {"name": MODELS_VOLUME, "configMap": {"name": names.shared_routes(ctx.name), "defaultMode": 0o440}},
    ]
    mounts: list[dict[str, Any]] = [{"name": MODELS_VOLUME, "mountPath": MODELS_DIR, "readOnly": True}]
    for index, key in enumerate(ctx.spec.api_keys):
        vol, mount = gateway.secret_file_volume(f"api-key-{index}", key.secret_ref.name,
                                                key.secret_ref.key or DEFAULT_KEY, gateway.AUTH_FILE,
                                                key_file(index).rsplit("/", 1)[0])
        volumes.append(vol)
        mounts.append(mount)
    if ctx.multi_gateway:
        vol, mount = gateway.token_volume_of(names.shared_token(ctx.name))
        volumes.append(vol)
        mounts.append(mount)
    container = gateway.gateway_container(ctx.config, env(ctx), gateway.container_resources(ctx.spec.resources),
                                          mounts, local_scaler=not ctx.multi_gateway)
    account = names.shared_gateway(ctx.name) if ctx.gateway_identity else None
    pod_spec = gateway.restricted_pod(ctx.spec.image_pull_secrets, [container], volumes, account)
    if ctx.multi_gateway:
        pod_spec["affinity"] = gateway.anti_affinity(ctx.selector(labels.GATEWAY))
    return gateway.deployment_object(ctx.metadata(names.shared_gateway(ctx.name), labels.GATEWAY), ctx.spec.replicas,
                                     ctx.selector(labels.GATEWAY), labels.gateway_labels(ctx.name, labels.GATEWAY),
                                     pod_spec)


def public_service(ctx: SharedContext) -> dict[str, Any]:
    svc = ctx.spec.service
    # Only HTTP: the gRPC scaler is never exposed here.
    return service_object(ctx.metadata(names.shared_gateway(ctx.name), labels.GATEWAY, svc.annotations),
                          ctx.selector(labels.GATEWAY), [tcp_port("http", PUBLIC_PORT)], svc.type)


def identity(ctx: SharedContext) -> list[dict[str, Any]]:
    """The shared gateway's ServiceAccount and RoleBinding (none without `gateway_identity`)."""
    if not ctx.gateway_identity:
        return []
    account = names.shared_gateway(ctx.name)
    return [gateway.service_account(ctx.metadata(account, labels.GATEWAY)),
            gateway.endpoints_role_binding(ctx.metadata(account, labels.GATEWAY), account)]


def scaler_service(ctx: SharedContext) -> dict[str, Any]:
    """What every member's ScaledObject dials (trigger metadata `model` picks the member's demand)."""
    selects = labels.AGGREGATOR if ctx.multi_gateway else labels.GATEWAY
    return service_object(ctx.metadata(names.shared_scaler(ctx.name), labels.SCALER), ctx.selector(selects),
                          scaler.ports(ctx.multi_gateway))


def aggregator_deployment(ctx: SharedContext, max_member_demand: int) -> dict[str, Any]:
    pod_spec = scaler.aggregator_pod(ctx.config, ctx.spec.image_pull_secrets, names.shared_token(ctx.name),
                                     gateways=ctx.spec.replicas, max_member_demand=max_member_demand)
    return gateway.deployment_object(
        ctx.metadata(names.shared_aggregator(ctx.name), labels.AGGREGATOR),
        # Memory-only by design, as a model's own: one replica, rebuilt by the gateways' heartbeats.
        1, ctx.selector(labels.AGGREGATOR), labels.gateway_labels(ctx.name, labels.AGGREGATOR), pod_spec)


def gateway_pdb(ctx: SharedContext) -> dict[str, Any]:
    return disruption.pdb_object(ctx.metadata(names.shared_gateway(ctx.name), labels.GATEWAY),
                                 ctx.selector(labels.GATEWAY))


def token_secret(ctx: SharedContext, observed: dict[str, Any] | None) -> dict[str, Any]:
    # Without a uid (never from Metacontroller) the seed still differs from an LLMService's of the same name.
    seed = ctx.uid or f"{ctx.namespace}/llmgateway/{ctx.name}"
    return secrets.token_secret_object(
        ctx.config, seed, lambda annotations: ctx.metadata(names.shared_token(ctx.name), labels.AUTH, annotations),
        observed)
