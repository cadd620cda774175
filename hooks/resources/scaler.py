"""The internal scaler Service KEDA dials, and the aggregate scaler of a multi-gateway LLMService.

With one gateway the ExternalScaler runs inside it, so the scaler Service selects the gateway Pod.
With several, each gateway reports its demand to one aggregator, and the scaler Service selects
the aggregator and carries its report port too: KEDA and the gateways dial the one name the scaler
certificate already carries, so with scaler TLS the reports are verified against it. Either way the
gRPC port is only on this internal Service, never the public one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hooks.api.common import LocalObjectReference
from hooks.config import HookConfig
from hooks.resources import gateway, labels, names
from hooks.resources.context import METRIC_NAME, REPORT_PORT, SCALER_GRPC_PORT, RenderContext, tcp_port

MAX_MEMBERS = 64
# Members and connections one source address may hold, per gateway replica. Where every gateway
# reaches the aggregator from one address (a mesh sidecar, SNAT), that address carries them all:
# each gateway Pod slot has at most two live members, its process and one predecessor (an old Pod
# still draining and reporting during a rolling update that replaced every Pod, or a process that
# restarted in place before its old member's TTL ran out), hence 2 × replicas. Each reporting
# process holds one keep-alive connection and briefly a second while it is replaced, hence twice
# the members, the ratio of the aggregator's own defaults (2 members, 4 connections). Without NAT a
# Pod's address carries its own members only and the caps are merely looser than the defaults.
MEMBERS_PER_ADDRESS_PER_GATEWAY = 2
CONNECTIONS_PER_MEMBER = 2
MEMBER_TTL_SECONDS = 10
MAX_CONCURRENT_REPORTS = 16
AGGREGATOR_RESOURCES = {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}}


def _grpc_port() -> dict[str, Any]:
    return tcp_port("grpc", SCALER_GRPC_PORT, appProtocol="grpc")


def ports(multi: bool) -> list[dict[str, Any]]:
    """The scaler Service's ports: gRPC, and with several gateways the aggregator's report port."""
    return [_grpc_port(), tcp_port("report", REPORT_PORT)] if multi else [_grpc_port()]


def service(ctx: RenderContext) -> dict[str, Any]:
    selects = labels.AGGREGATOR if ctx.multi_gateway else labels.GATEWAY
    return ctx.service_object(names.scaler(ctx.name), labels.SCALER, selects, ports(ctx.multi_gateway))


def _env(name: str, value: str | int) -> dict[str, str]:
    return {"name": name, "value": str(value)}


def members_per_address(ctx: RenderContext) -> int:
    return members_per_address_of(ctx.service.spec.endpoint.replicas)


def members_per_address_of(gateways: int) -> int:
    """NOCTAYA_MAX_MEMBERS_PER_ADDRESS: every gateway behind one address, with a rollout's surge."""
    return MEMBERS_PER_ADDRESS_PER_GATEWAY * gateways


def max_members(ctx: RenderContext) -> int:
    return max_members_of(ctx.service.spec.endpoint.replicas)


def max_members_of(gateways: int) -> int:
    """NOCTAYA_MAX_MEMBERS: room for one address at its cap and, beside it, every gateway with its
    surge (one Pod holding its address's whole allowance cannot lock the others out)."""
    return max(MAX_MEMBERS, 2 * members_per_address_of(gateways))


def tcp_probe(port: str, period: int, failures: int) -> dict[str, Any]:
    return {"tcpSocket": {"port": port}, "periodSeconds": period, "timeoutSeconds": 2, "failureThreshold": failures}


def aggregator_deployment(ctx: RenderContext) -> dict[str, Any]:
    spec = ctx.service.spec
    tls_env: list[dict[str, str]] = []
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if spec.scaler_tls is not None:
        tls_env.extend(gateway.tls_env(ctx))
        # Checked at startup: the certificate must carry the name gateways (and KEDA) dial.
        tls_env.append(_env("NOCTAYA_REPORT_SERVER_NAME", ctx.host(names.scaler(ctx.name))))
        tls_vol, tls_mount = gateway.tls_volume(ctx)
        volumes.append(tls_vol)
        mounts.append(tls_mount)
    pod_spec = aggregator_pod(ctx.config, spec.image_pull_secrets, names.scaler_token(ctx.name),
                              gateways=spec.endpoint.replicas, max_member_demand=spec.endpoint.max_queue,
                              extra_env=tls_env, extra_volumes=volumes, extra_mounts=mounts)
    return gateway.deployment_object(
        ctx.metadata(names.aggregator(ctx.name), labels.AGGREGATOR),
        # Memory-only by design: one replica; after a restart the gateways' 2 s heartbeats rebuild it.
        1, labels.selector(ctx.name, labels.AGGREGATOR), labels.labels(ctx.name, labels.AGGREGATOR), pod_spec)


def aggregator_pod(
    config: HookConfig, pull_secrets: list[LocalObjectReference], token_secret: str, *, gateways: int,
    max_member_demand: int, extra_env: Sequence[dict[str, str]] = (), extra_volumes: Sequence[dict[str, Any]] = (),
    extra_mounts: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """The aggregate scaler's Pod for `gateways` reporting gateway replicas (any owner's)."""
    per_address = members_per_address_of(gateways)
    env = [
        _env("NOCTAYA_REPORT_PORT", REPORT_PORT),
        _env("NOCTAYA_SCALER_PORT", SCALER_GRPC_PORT),
        _env("NOCTAYA_AGGREGATOR_TOKEN_FILE", f"{gateway.TOKEN_DIR}/{gateway.TOKEN_KEY}"),
        _env("NOCTAYA_AGGREGATOR_PREVIOUS_TOKEN_FILE", f"{gateway.TOKEN_DIR}/{gateway.PREVIOUS_TOKEN_KEY}"),
        _env("NOCTAYA_MAX_MEMBERS", max_members_of(gateways)),
        _env("NOCTAYA_MAX_MEMBERS_PER_ADDRESS", per_address),
        _env("NOCTAYA_MAX_CONNECTIONS_PER_ADDRESS", CONNECTIONS_PER_MEMBER * per_address),
        _env("NOCTAYA_MAX_MEMBER_DEMAND", max_member_demand),
        _env("NOCTAYA_MEMBER_TTL_SECONDS", MEMBER_TTL_SECONDS),
        _env("NOCTAYA_MAX_CONCURRENT_REPORTS", MAX_CONCURRENT_REPORTS),
        _env("NOCTAYA_METRIC_NAME", METRIC_NAME),
        *extra_env,
    ]
    vol, mount = gateway.token_volume_of(token_secret)
    container = {
        "name": "aggregator",
        "image": config.image,
        "imagePullPolicy": config.image_pull_policy,
        "command": ["python", "-m", "scaler", "aggregate"],
        "env": [*env, _env("PYTHONDONTWRITEBYTECODE", 1), _env("PYTHONUNBUFFERED", 1)],
        "ports": [
            {"name": "report", "containerPort": REPORT_PORT, "protocol": "TCP"},
            {"name": "grpc", "containerPort": SCALER_GRPC_PORT, "protocol": "TCP"},
        ],
        "resources": AGGREGATOR_RESOURCES,
        "securityContext": gateway.restricted_container_security(),
        # TCP connects, not GET /healthz on the report port: that port's connections are capped
        # (per address and in all) and any client that reaches it can fill them, and a refused
        # probe would drop the only aggregator from its Service, then restart it. The kernel
        # completes a connect before the server counts it, so these cannot be starved; the
        # liveness probe dials the gRPC listener, which is KEDA's and has no connection cap.
        "readinessProbe": tcp_probe("report", 5, 2),
        "livenessProbe": tcp_probe("grpc", 10, 6),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, mount, *extra_mounts],
    }
    return gateway.restricted_pod(pull_secrets, [container], [vol, *extra_volumes])
