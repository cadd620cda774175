"""Gateway Deployment (the always-on OpenAI-compatible front door), its public Service, and its identity.

Its env is the contract of docs/architecture.md "Gateway configuration", read by `gateway.config`.
The gateway pod is hardened: restricted security context, read-only root. Its only Kubernetes
credential, when the calling controller manages ServiceAccounts and RoleBindings
(`RenderContext.gateway_identity`), is a ServiceAccount of its own bound to the ClusterRole
`noctaya-gateway-endpoints` in its own namespace: get, list and watch of EndpointSlices, so that it
balances over the backend's Pods (NOCTAYA_ENDPOINT_SOURCE=endpointslices, gateway.endpointslices).
Without it the Pod mounts no token and reaches the backend through its Service, as before.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields
from typing import Any

from gateway.modeltable import MEMBER_FIELD, MODEL_FIELDS, SCALED_OBJECT_FIELD
from hooks.api.common import LocalObjectReference, ResourceRequirements, pull_secret_names
from hooks.api.llmservice import Balancing
from hooks.config import HookConfig
from hooks.resources import backend, labels, names
from hooks.resources.context import (
    ADMIN_PORT,
    GATEWAY_PORT,
    METRIC_NAME,
    PUBLIC_PORT,
    REPORT_PORT,
    SCALER_GRPC_PORT,
    RenderContext,
    tcp_port,
)
from hooks.runtime import pod

CONTAINER_NAME = "gateway"
READY_GRACE_SECONDS = 15
QUEUE_FULL_RETRY_AFTER_SECONDS = 5
HEARTBEAT_SECONDS = 10
DRAIN_GRACE_SECONDS = 30
MAX_BODY_BYTES = 8 * 1024 * 1024
# The container port the kubelet probes (/healthz): `admin`, whose connections public clients
# cannot take (docs/architecture.md "Probes").
PROBE_PORT = "admin"
# Kubernetes waits this long after SIGTERM: the gateway's own drain grace plus a margin.
GATEWAY_TERMINATION_GRACE_SECONDS = DRAIN_GRACE_SECONDS + 10

# What an idle one-worker gateway needs, with room for load (docs/benchmarks.md "Idle footprint"):
# 32 MiB RSS idle, +6 MiB for the JSON scanner of the first cold request, ~15-20 KiB per held
# stream. A platform reserves this per model at zero, so it is kept near the need; the limit (and
# the held-body budget derived from it) is what bounds a burst.
DEFAULT_REQUESTS = {"cpu": "50m", "memory": "64Mi"}
DEFAULT_LIMITS = {"memory": "512Mi"}
RUN_AS = 65532  # an unprivileged uid/gid; the image runs as any non-root user

AUTH_DIR = "/var/run/noctaya/auth"
AUTH_FILE = "api-key"
TOKEN_DIR = "/var/run/noctaya/scaler-token"
TOKEN_KEY = "token"
PREVIOUS_TOKEN_KEY = "previous-token"  # the token of the epoch before, accepted during a rotation
TLS_DIR = "/var/run/noctaya/scaler-tls"

# The gateway's identity (metacontroller/rbac.yaml): the ClusterRole its RoleBinding refers to, granting
# get, list and watch of EndpointSlices only, and only in the namespace of the RoleBinding.
ENDPOINTS_CLUSTERROLE = "noctaya-gateway-endpoints"
RBAC_API_VERSION = "rbac.authorization.k8s.io/v1"
ENDPOINT_SOURCE = "endpointslices"  # NOCTAYA_ENDPOINT_SOURCE of a gateway with an identity


def _env(name: str, value: str | int) -> dict[str, str]:
    return {"name": name, "value": str(value)}


env_var = _env  # public for the LLMGateway's Pod env, built from the same parts (hooks.resources.shared)


def restricted_container_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def restricted_pod_spec(ctx: RenderContext, containers: list[dict[str, Any]], volumes: list[dict[str, Any]],
                        account: str | None = None) -> dict[str, Any]:
    """A Pod of Noctaya's own image (gateway, aggregate scaler): restricted; API credentials only of
    the ServiceAccount `account` when given (a gateway's own, see `service_account`)."""
    return restricted_pod(ctx.service.spec.image_pull_secrets, containers, volumes, account)


def restricted_pod(pull_secrets: list[LocalObjectReference], containers: list[dict[str, Any]],
                   volumes: list[dict[str, Any]], account: str | None = None) -> dict[str, Any]:
    """`restricted_pod_spec` for any owner (an LLMService's or an LLMGateway's Pods)."""
    pull = pull_secret_names(pull_secrets)
    # The ServiceAccount itself mounts nothing (`service_account`): only this Pod opts in. Without an
    # account the Pod keeps exactly the keys it had before gateways had one (an unchanged template).
    identity: dict[str, Any] = ({"serviceAccountName": account, "automountServiceAccountToken": True}
                                if account is not None else {"automountServiceAccountToken": False})
    return {
        **({"imagePullSecrets": pull} if pull else {}),
        **identity,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS,
            "runAsGroup": RUN_AS,
            # Secret volumes are written root-owned; fsGroup makes their 0440 files readable to us.
            "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationGracePeriodSeconds": GATEWAY_TERMINATION_GRACE_SECONDS,
        "containers": containers,
        "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}, *volumes],
    }


def resources(ctx: RenderContext) -> dict[str, Any]:
    return container_resources(ctx.service.spec.endpoint.resources)


def container_resources(given: ResourceRequirements | None) -> dict[str, Any]:
    """The gateway container's resources: the defaults, key by key replaced by what is given."""
    requests = {**DEFAULT_REQUESTS, **(given.requests if given else {})}
    limits = {**DEFAULT_LIMITS, **(given.limits if given else {})}
    return {"requests": dict(sorted(requests.items())), "limits": dict(sorted(limits.items()))}


def tls_env(ctx: RenderContext) -> list[dict[str, str]]:
    tls = ctx.service.spec.scaler_tls
    assert tls is not None
    return [
        # The name only: a missing Secret is reported by the Pod itself (scaler.secretfiles).
        _env("NOCTAYA_SCALER_TLS_SECRET", tls.secret_name),
        _env("NOCTAYA_SCALER_TLS_CERT_FILE", f"{TLS_DIR}/tls.crt"),
        _env("NOCTAYA_SCALER_TLS_KEY_FILE", f"{TLS_DIR}/tls.key"),
        _env("NOCTAYA_SCALER_TLS_CA_FILE", f"{TLS_DIR}/ca.crt"),
    ]


def tls_volume(ctx: RenderContext, *, ca_only: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """The scaler TLS Secret; ``ca_only`` for gateways that only verify the aggregator (the
    serving key then never reaches them)."""
    tls = ctx.service.spec.scaler_tls
    assert tls is not None
    secret: dict[str, Any] = {"secretName": tls.secret_name}
    if ca_only:
        secret["items"] = [{"key": "ca.crt", "path": "ca.crt"}]
    # optional: the Pod starts without the Secret and says which one is missing (scaler.secretfiles).
    secret.update({"defaultMode": 0o440, "optional": True})
    return (
        {"name": "scaler-tls", "secret": secret},
        {"name": "scaler-tls", "mountPath": TLS_DIR, "readOnly": True},
    )


def token_volume(ctx: RenderContext) -> tuple[dict[str, Any], dict[str, Any]]:
    return token_volume_of(names.scaler_token(ctx.name))


def token_volume_of(secret_name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The demand-report token Secret (`secret_name`) as a volume and its mount."""
    return (
        {
            "name": "scaler-token",
            "secret": {
                "secretName": secret_name,
                "items": [{"key": TOKEN_KEY, "path": TOKEN_KEY}, {"key": PREVIOUS_TOKEN_KEY, "path": PREVIOUS_TOKEN_KEY}],
                "defaultMode": 0o440,
            },
        },
        {"name": "scaler-token", "mountPath": TOKEN_DIR, "readOnly": True},
    )


def report_url(ctx: RenderContext) -> str:
    """Where gateways send their demand: the scaler Service (it selects the aggregator and carries
    its report port), so with scaler TLS the name the scaler certificate carries is verified."""
    return report_url_at(ctx.host(names.scaler(ctx.name)), https=ctx.service.spec.scaler_tls is not None)


def report_url_at(scaler_host: str, *, https: bool = False) -> str:
    """The report endpoint of the aggregate scaler behind the scaler Service `scaler_host`."""
    return f"{'https' if https else 'http'}://{scaler_host}:{REPORT_PORT}/v1/report"


# JSON key of a shared gateway's model-table entry for each ModelSettings field: the gateway's own
# MODEL_FIELDS read backwards, so the hooks cannot render a key the gateway does not know.
TABLE_KEYS: dict[str, str] = {field: key for key, field in MODEL_FIELDS.items()}


@dataclass(frozen=True)
class ModelSettings:
    """What a gateway must know about one model: the per-model part of a gateway's env, and the entry of
    a shared gateway's model table. One computation for both, so a model behaves the same behind
    its own gateway and behind an LLMGateway. Field names are GatewayConfig's (env NOCTAYA_<FIELD>)."""

    backend_url: str
    readiness_path: str
    max_queue: int
    cold_mode: str
    activation_timeout_seconds: int
    ready_grace_seconds: int
    retry_after_seconds: int
    heartbeat_seconds: int
    backend_accelerators: int
    max_body_bytes: int

    def env(self, *only: str) -> list[dict[str, str]]:
        """NOCTAYA_<FIELD> of the named fields, in the order named (the env's order is the Pod
        template's: reordering it would roll every gateway)."""
        values = self.__dict__
        return [_env("NOCTAYA_" + name.upper(), values[name]) for name in only]

    def table_entry(self, served_name: str, member: str | None = None,
                    scaled_object: str | None = None) -> dict[str, str | int]:
        """This model's entry of a shared gateway's table (every field, in field order). `member`:
        the LLMService's name, which the gateway follows across a change of served name;
        `scaled_object`: `<namespace>/<name>` of its ScaledObject, which the scaler answers by the member."""
        entry: dict[str, str | int] = {"name": served_name}
        if member is not None:
            entry[MEMBER_FIELD] = member
        if scaled_object is not None:
            entry[SCALED_OBJECT_FIELD] = scaled_object
        for f, value in zip(fields(self), astuple(self), strict=True):
            entry[TABLE_KEYS[f.name]] = value
        return entry


def model_settings(ctx: RenderContext) -> ModelSettings:
    spec = ctx.service.spec
    ep = spec.endpoint
    return ModelSettings(
        backend_url=backend.url(ctx),
        readiness_path=pod.readiness_path(ctx.runtime),
        max_queue=ep.max_queue,
        cold_mode=ep.cold_request_mode,
        activation_timeout_seconds=ctx.seconds(spec.scaling.activation_timeout),
        ready_grace_seconds=READY_GRACE_SECONDS,
        retry_after_seconds=ep.retry_after_seconds,
        heartbeat_seconds=HEARTBEAT_SECONDS,
        backend_accelerators=spec.resources.accelerators,
        max_body_bytes=MAX_BODY_BYTES,
    )


def client_env(max_connections_per_address: int | None, request_timeout_seconds: int | None) -> list[dict[str, str]]:
    """Bounds on client connections (a Pod's, whichever models it fronts); only when set: the
    gateway's own defaults otherwise (an unchanged template for everyone else)."""
    out = []
    if max_connections_per_address is not None:
        out.append(_env("NOCTAYA_MAX_CONNECTIONS_PER_ADDRESS", max_connections_per_address))
    if request_timeout_seconds is not None:
        out.append(_env("NOCTAYA_CLIENT_REQUEST_TIMEOUT_SECONDS", request_timeout_seconds))
    return out


def scaler_env(multi: bool, report_to: str) -> list[dict[str, str]]:
    """How the gateway's demand reaches KEDA: its own gRPC scaler (one gateway), or reports to the
    aggregate scaler at `report_to` (several gateways, each with the token Secret mounted)."""
    if multi:
        return [
            _env("NOCTAYA_SCALER_MODE", "report"),
            _env("NOCTAYA_AGGREGATOR_URL", report_to),
            _env("NOCTAYA_AGGREGATOR_TOKEN_FILE", f"{TOKEN_DIR}/{TOKEN_KEY}"),
            _env("NOCTAYA_AGGREGATOR_PREVIOUS_TOKEN_FILE", f"{TOKEN_DIR}/{PREVIOUS_TOKEN_KEY}"),
        ]
    return [_env("NOCTAYA_SCALER_MODE", "local"), _env("NOCTAYA_SCALER_PORT", SCALER_GRPC_PORT)]


def balancing_env(balancing: Balancing | None) -> list[dict[str, str]]:
    """endpoint.balancing as gateway env, each variable only when its field is set to something the
    gateway does not do by default: an unset field renders nothing, so no template changes for it."""
    if balancing is None:
        return []
    out = []
    if balancing.prefix_affinity is False:
        out.append(_env("NOCTAYA_PREFIX_AFFINITY", "false"))
    if balancing.cold_batch_per_pod is not None:
        out.append(_env("NOCTAYA_POD_BATCH", balancing.cold_batch_per_pod))
    return out


def endpoint_source_env(identity: bool) -> list[dict[str, str]]:
    """Balance over the backend's Pods, watching their EndpointSlices with the Pod's own ServiceAccount;
    nothing without an identity (the gateway's default: the backend Service's address)."""
    return [_env("NOCTAYA_ENDPOINT_SOURCE", ENDPOINT_SOURCE)] if identity else []


def env(ctx: RenderContext) -> list[dict[str, str]]:
    spec = ctx.service.spec
    ep = spec.endpoint
    model = model_settings(ctx)
    out = [
        _env("NOCTAYA_LISTEN_PORT", GATEWAY_PORT),
        _env("NOCTAYA_ADMIN_PORT", ADMIN_PORT),
        *model.env("backend_url", "readiness_path"),
        _env("NOCTAYA_SERVED_MODEL_NAME", ctx.service.served_name),
        *model.env("max_queue", "cold_mode", "activation_timeout_seconds", "ready_grace_seconds"),
        _env("NOCTAYA_QUEUE_FULL_RETRY_AFTER_SECONDS", QUEUE_FULL_RETRY_AFTER_SECONDS),
        *model.env("retry_after_seconds", "heartbeat_seconds"),
        _env("NOCTAYA_DRAIN_GRACE_SECONDS", DRAIN_GRACE_SECONDS),
        *model.env("backend_accelerators", "max_body_bytes"),
        *client_env(ep.max_connections_per_address, ep.request_timeout_seconds),
    ]
    if ep.auth is not None:
        out.append(_env("NOCTAYA_AUTH_KEY_FILE", f"{AUTH_DIR}/{AUTH_FILE}"))
        out.append(_env("NOCTAYA_AUTH_SECRET", ep.auth.secret_ref.name))
    out.append(_env("NOCTAYA_METRIC_NAME", METRIC_NAME))
    out.extend(scaler_env(ctx.multi_gateway, report_url(ctx)))
    if ctx.multi_gateway:
        if spec.scaler_tls is not None:
            out.append(_env("NOCTAYA_SCALER_TLS_SECRET", spec.scaler_tls.secret_name))
            out.append(_env("NOCTAYA_AGGREGATOR_CA_FILE", f"{TLS_DIR}/ca.crt"))
    elif spec.scaler_tls is not None:
        out.extend(tls_env(ctx))
    # Added after everything a gateway rendered before (the env's order is the template's).
    out.extend(endpoint_source_env(ctx.gateway_identity))
    out.extend(balancing_env(ep.balancing))
    return out


def _anti_affinity(ctx: RenderContext) -> dict[str, Any]:
    return anti_affinity(labels.selector(ctx.name, labels.GATEWAY))


def anti_affinity(selector: dict[str, str]) -> dict[str, Any]:
    """Gateways of one owner (`selector`) preferably on different nodes: a node drain or loss then
    leaves the others serving."""
    return {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "podAffinityTerm": {
                        "topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {"matchLabels": selector},
                    },
                }
            ]
        }
    }


def http_probe(path: str, port: str, period: int, failures: int, *, https: bool = False) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port, **({"scheme": "HTTPS"} if https else {})},
        "periodSeconds": period,
        "timeoutSeconds": 2,
        "failureThreshold": failures,
    }


def deployment(ctx: RenderContext) -> dict[str, Any]:
    ep = ctx.service.spec.endpoint
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if ep.auth is not None:
        vol, mount = secret_file_volume("auth", ep.auth.secret_ref.name, ep.auth.secret_ref.key or "api-key",
                                        AUTH_FILE, AUTH_DIR)
        volumes.append(vol)
        mounts.append(mount)
    if ctx.multi_gateway:
        vol, mount = token_volume(ctx)
        volumes.append(vol)
        mounts.append(mount)
        if ctx.service.spec.scaler_tls is not None:
            vol, mount = tls_volume(ctx, ca_only=True)
            volumes.append(vol)
            mounts.append(mount)
    elif ctx.service.spec.scaler_tls is not None:
        vol, mount = tls_volume(ctx)
        volumes.append(vol)
        mounts.append(mount)
    container = gateway_container(ctx.config, env(ctx), resources(ctx), mounts, local_scaler=not ctx.multi_gateway)
    pod_spec = restricted_pod_spec(ctx, [container], volumes, names.gateway(ctx.name) if ctx.gateway_identity else None)
    if ctx.multi_gateway:
        pod_spec["affinity"] = _anti_affinity(ctx)
    return deployment_object(ctx.metadata(names.gateway(ctx.name), labels.GATEWAY), ep.replicas,
                             labels.selector(ctx.name, labels.GATEWAY), labels.labels(ctx.name, labels.GATEWAY),
                             pod_spec)


def secret_file_volume(volume: str, secret: str, key: str, path: str, mount_dir: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """One key of a Secret as the file `<mount_dir>/<path>` (a client API key), with its mount."""
    return (
        {
            "name": volume,
            "secret": {
                "secretName": secret,
                "items": [{"key": key, "path": path}],
                "defaultMode": 0o440,
                # The Pod starts without the Secret and says which one is missing (scaler.secretfiles).
                "optional": True,
            },
        },
        {"name": volume, "mountPath": mount_dir, "readOnly": True},
    )


def gateway_container(config: HookConfig, env: list[dict[str, str]], resources: dict[str, Any],
                      mounts: list[dict[str, Any]], *, local_scaler: bool) -> dict[str, Any]:
    """The gateway container of any gateway Pod (one model's or an LLMGateway's); `local_scaler`:
    it runs the gRPC ExternalScaler itself (one gateway replica)."""
    # `admin` (/metrics, /noctaya/queue) is a container port only: no Service exposes it, so the
    # public Service (often a LoadBalancer) cannot; the example PodMonitor scrapes it per Pod.
    ports = [{"name": "http", "containerPort": GATEWAY_PORT, "protocol": "TCP"},
             {"name": "admin", "containerPort": ADMIN_PORT, "protocol": "TCP"}]
    if local_scaler:
        ports.append({"name": "grpc", "containerPort": SCALER_GRPC_PORT, "protocol": "TCP"})
    return {
        "name": CONTAINER_NAME,
        "image": config.image,
        "imagePullPolicy": config.image_pull_policy,
        "command": ["python", "-m", "gateway"],
        "env": [*env, _env("PYTHONDONTWRITEBYTECODE", 1), _env("PYTHONUNBUFFERED", 1)],
        "ports": ports,
        "resources": resources,
        "securityContext": restricted_container_security(),
        # On the admin port, never the public one: the public port's connections are open to any
        # client (idle ones need no API key), so a full pool there would fail readiness (the
        # Service drops the gateway) and then liveness (the kubelet kills every held request).
        # The admin port has its own small pool, is on no Service and answers /healthz alike
        # (503 while draining); the public /healthz stays for load balancers.
        "readinessProbe": http_probe("/healthz", PROBE_PORT, 5, 2),
        "livenessProbe": http_probe("/healthz", PROBE_PORT, 10, 6),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *mounts],
    }


def deployment_object(metadata: dict[str, Any], replicas: int, selector: dict[str, str], pod_labels: dict[str, str],
                      pod_spec: dict[str, Any]) -> dict[str, Any]:
    """A Deployment of Noctaya's own Pods (gateways, aggregate scalers)."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            "revisionHistoryLimit": 3,
            "template": {"metadata": {"labels": pod_labels}, "spec": pod_spec},
        },
    }


def public_service(ctx: RenderContext) -> dict[str, Any]:
    svc = ctx.service.spec.endpoint.service
    # Only HTTP (OpenAI API and /metrics): the gRPC scaler is never exposed here.
    return ctx.service_object(names.public_service(ctx.name), labels.GATEWAY, labels.GATEWAY,
                              [tcp_port("http", PUBLIC_PORT)], service_type=svc.type, annotations=svc.annotations)


# --- the gateway's identity -----------------------------------------------------------------------


def service_account(metadata: dict[str, Any]) -> dict[str, Any]:
    """The gateway's own ServiceAccount, named like its Deployment. It mounts no token by itself:
    only the gateway Pod, which asks for one (`restricted_pod`), gets it."""
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": metadata, "automountServiceAccountToken": False}


def endpoints_role_binding(metadata: dict[str, Any], account: str) -> dict[str, Any]:
    """Binds the ServiceAccount `account` of this namespace to ENDPOINTS_CLUSTERROLE. A RoleBinding (not
    a ClusterRoleBinding): the grant holds in its own namespace only, where the gateway's backends are."""
    return {
        "apiVersion": RBAC_API_VERSION,
        "kind": "RoleBinding",
        "metadata": metadata,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": ENDPOINTS_CLUSTERROLE},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": metadata["namespace"]}],
    }


def identity(ctx: RenderContext) -> list[dict[str, Any]]:
    """A model's own gateway's ServiceAccount and RoleBinding (none without `gateway_identity`)."""
    if not ctx.gateway_identity:
        return []
    account = names.gateway(ctx.name)
    return [service_account(ctx.metadata(account, labels.GATEWAY)),
            endpoints_role_binding(ctx.metadata(account, labels.GATEWAY), account)]
