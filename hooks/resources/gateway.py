"""Gateway Deployment (the always-on OpenAI-compatible front door) and its public Service.

Its env is the contract of docs/architecture.md "Gateway configuration", read by `gateway.config`.
The gateway pod is hardened: restricted security context, read-only root, no service-account token
(it has no Kubernetes credentials: it learns readiness by probing the backend Service).
"""

from __future__ import annotations

from typing import Any

from hooks.api.common import pull_secret_names
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


def _env(name: str, value: str | int) -> dict[str, str]:
    return {"name": name, "value": str(value)}


def restricted_container_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def restricted_pod_spec(ctx: RenderContext, containers: list[dict[str, Any]], volumes: list[dict[str, Any]]) -> dict[str, Any]:
    """A Pod of Noctaya's own image (gateway, aggregate scaler): restricted, no API credentials."""
    pull = pull_secret_names(ctx.service.spec.image_pull_secrets)
    return {
        **({"imagePullSecrets": pull} if pull else {}),
        "automountServiceAccountToken": False,
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
    given = ctx.service.spec.endpoint.resources
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
    return (
        {
            "name": "scaler-token",
            "secret": {
                "secretName": names.scaler_token(ctx.name),
                "items": [{"key": TOKEN_KEY, "path": TOKEN_KEY}, {"key": PREVIOUS_TOKEN_KEY, "path": PREVIOUS_TOKEN_KEY}],
                "defaultMode": 0o440,
            },
        },
        {"name": "scaler-token", "mountPath": TOKEN_DIR, "readOnly": True},
    )


def report_url(ctx: RenderContext) -> str:
    """Where gateways send their demand: the scaler Service (it selects the aggregator and carries
    its report port), so with scaler TLS the name the scaler certificate carries is verified."""
    scheme = "https" if ctx.service.spec.scaler_tls is not None else "http"
    return f"{scheme}://{ctx.host(names.scaler(ctx.name))}:{REPORT_PORT}/v1/report"


def env(ctx: RenderContext) -> list[dict[str, str]]:
    spec = ctx.service.spec
    ep = spec.endpoint
    out = [
        _env("NOCTAYA_LISTEN_PORT", GATEWAY_PORT),
        _env("NOCTAYA_ADMIN_PORT", ADMIN_PORT),
        _env("NOCTAYA_BACKEND_URL", backend.url(ctx)),
        _env("NOCTAYA_READINESS_PATH", pod.readiness_path(ctx.runtime)),
        _env("NOCTAYA_SERVED_MODEL_NAME", ctx.service.served_name),
        _env("NOCTAYA_MAX_QUEUE", ep.max_queue),
        _env("NOCTAYA_COLD_MODE", ep.cold_request_mode),
        _env("NOCTAYA_ACTIVATION_TIMEOUT_SECONDS", ctx.seconds(spec.scaling.activation_timeout)),
        _env("NOCTAYA_READY_GRACE_SECONDS", READY_GRACE_SECONDS),
        _env("NOCTAYA_QUEUE_FULL_RETRY_AFTER_SECONDS", QUEUE_FULL_RETRY_AFTER_SECONDS),
        _env("NOCTAYA_RETRY_AFTER_SECONDS", ep.retry_after_seconds),
        _env("NOCTAYA_HEARTBEAT_SECONDS", HEARTBEAT_SECONDS),
        _env("NOCTAYA_DRAIN_GRACE_SECONDS", DRAIN_GRACE_SECONDS),
        _env("NOCTAYA_BACKEND_ACCELERATORS", spec.resources.accelerators),
        _env("NOCTAYA_MAX_BODY_BYTES", MAX_BODY_BYTES),
    ]
    # Only when set: the gateway's own defaults otherwise (an unchanged template for everyone else).
    if ep.max_connections_per_address is not None:
        out.append(_env("NOCTAYA_MAX_CONNECTIONS_PER_ADDRESS", ep.max_connections_per_address))
    if ep.request_timeout_seconds is not None:
        out.append(_env("NOCTAYA_CLIENT_REQUEST_TIMEOUT_SECONDS", ep.request_timeout_seconds))
    if ep.auth is not None:
        out.append(_env("NOCTAYA_AUTH_KEY_FILE", f"{AUTH_DIR}/{AUTH_FILE}"))
        out.append(_env("NOCTAYA_AUTH_SECRET", ep.auth.secret_ref.name))
    out.append(_env("NOCTAYA_METRIC_NAME", METRIC_NAME))
    if ctx.multi_gateway:
        out.append(_env("NOCTAYA_SCALER_MODE", "report"))
        out.append(_env("NOCTAYA_AGGREGATOR_URL", report_url(ctx)))
        out.append(_env("NOCTAYA_AGGREGATOR_TOKEN_FILE", f"{TOKEN_DIR}/{TOKEN_KEY}"))
        out.append(_env("NOCTAYA_AGGREGATOR_PREVIOUS_TOKEN_FILE", f"{TOKEN_DIR}/{PREVIOUS_TOKEN_KEY}"))
        if spec.scaler_tls is not None:
            out.append(_env("NOCTAYA_SCALER_TLS_SECRET", spec.scaler_tls.secret_name))
            out.append(_env("NOCTAYA_AGGREGATOR_CA_FILE", f"{TLS_DIR}/ca.crt"))
    else:
        out.append(_env("NOCTAYA_SCALER_MODE", "local"))
        out.append(_env("NOCTAYA_SCALER_PORT", SCALER_GRPC_PORT))
        if spec.scaler_tls is not None:
            out.extend(tls_env(ctx))
    return out


def _anti_affinity(ctx: RenderContext) -> dict[str, Any]:
    return {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "podAffinityTerm": {
                        "topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {"matchLabels": labels.selector(ctx.name, labels.GATEWAY)},
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
    mounts: list[dict[str, Any]] = [{"name": "tmp", "mountPath": "/tmp"}]
    if ep.auth is not None:
        ref = ep.auth.secret_ref
        volumes.append(
            {
                "name": "auth",
                "secret": {
                    "secretName": ref.name,
                    "items": [{"key": ref.key or "api-key", "path": AUTH_FILE}],
                    "defaultMode": 0o440,
                    # The Pod starts without the Secret and says which one is missing (scaler.secretfiles).
                    "optional": True,
                },
            }
        )
        mounts.append({"name": "auth", "mountPath": AUTH_DIR, "readOnly": True})
    # `admin` (/metrics, /noctaya/queue) is a container port only: no Service exposes it, so the
    # public Service (often a LoadBalancer) cannot; the example PodMonitor scrapes it per Pod.
    ports = [{"name": "http", "containerPort": GATEWAY_PORT, "protocol": "TCP"},
             {"name": "admin", "containerPort": ADMIN_PORT, "protocol": "TCP"}]
    if ctx.multi_gateway:
        vol, mount = token_volume(ctx)
        volumes.append(vol)
        mounts.append(mount)
        if ctx.service.spec.scaler_tls is not None:
            vol, mount = tls_volume(ctx, ca_only=True)
            volumes.append(vol)
            mounts.append(mount)
    else:
        ports.append({"name": "grpc", "containerPort": SCALER_GRPC_PORT, "protocol": "TCP"})
        if ctx.service.spec.scaler_tls is not None:
            vol, mount = tls_volume(ctx)
            volumes.append(vol)
            mounts.append(mount)
    container = {
        "name": CONTAINER_NAME,
        "image": ctx.config.image,
        "imagePullPolicy": ctx.config.image_pull_policy,
        "command": ["python", "-m", "gateway"],
        "env": [*env(ctx), _env("PYTHONDONTWRITEBYTECODE", 1), _env("PYTHONUNBUFFERED", 1)],
        "ports": ports,
        "resources": resources(ctx),
        "securityContext": restricted_container_security(),
        # On the admin port, never the public one: the public port's connections are open to any
        # client (idle ones need no API key), so a full pool there would fail readiness (the
        # Service drops the gateway) and then liveness (the kubelet kills every held request).
        # The admin port has its own small pool, is on no Service and answers /healthz alike
        # (503 while draining); the public /healthz stays for load balancers.
        "readinessProbe": http_probe("/healthz", PROBE_PORT, 5, 2),
        "livenessProbe": http_probe("/healthz", PROBE_PORT, 10, 6),
        "volumeMounts": mounts,
    }
    pod_spec = restricted_pod_spec(ctx, [container], volumes)
    if ctx.multi_gateway:
        pod_spec["affinity"] = _anti_affinity(ctx)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": ctx.metadata(names.gateway(ctx.name), labels.GATEWAY),
        "spec": {
            "replicas": ep.replicas,
            "selector": {"matchLabels": labels.selector(ctx.name, labels.GATEWAY)},
            "revisionHistoryLimit": 3,
            "template": {"metadata": {"labels": labels.labels(ctx.name, labels.GATEWAY)}, "spec": pod_spec},
        },
    }


def public_service(ctx: RenderContext) -> dict[str, Any]:
    svc = ctx.service.spec.endpoint.service
    # Only HTTP (OpenAI API and /metrics): the gRPC scaler is never exposed here.
    return ctx.service_object(names.public_service(ctx.name), labels.GATEWAY, labels.GATEWAY,
                              [tcp_port("http", PUBLIC_PORT)], service_type=svc.type, annotations=svc.annotations)
