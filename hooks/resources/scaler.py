"""The internal scaler Service KEDA dials, and the aggregate scaler of a multi-gateway LLMService.

With one gateway the ExternalScaler runs inside it, so the scaler Service selects the gateway Pod.
With several, each gateway reports its demand to one aggregator, and the scaler Service selects
the aggregator and carries its report port too: KEDA and the gateways dial the one name the scaler
certificate already carries, so with scaler TLS the reports are verified against it. Either way the
gRPC port is only on this internal Service, never the public one.
"""

from __future__ import annotations

from typing import Any

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


def service(ctx: RenderContext) -> dict[str, Any]:
    if ctx.multi_gateway:
        ports = [_grpc_port(), tcp_port("report", REPORT_PORT)]
        return ctx.service_object(names.scaler(ctx.name), labels.SCALER, labels.AGGREGATOR, ports)
    return ctx.service_object(names.scaler(ctx.name), labels.SCALER, labels.GATEWAY, [_grpc_port()])



def _env(name: str, value: str | int) -> dict[str, str]:
    return {"name": name, "value": str(value)}


def members_per_address(ctx: RenderContext) -> int:
    """NOCTAYA_MAX_MEMBERS_PER_ADDRESS: every gateway behind one address, with a rollout's surge."""
    return MEMBERS_PER_ADDRESS_PER_GATEWAY * ctx.service.spec.endpoint.replicas


def max_members(ctx: RenderContext) -> int:
    """NOCTAYA_MAX_MEMBERS: room for one address at its cap and, beside it, every gateway with its
    surge (one Pod holding its address's whole allowance cannot lock the others out)."""
    return max(MAX_MEMBERS, 2 * members_per_address(ctx))


def tcp_probe(port: str, period: int, failures: int) -> dict[str, Any]:
    return {"tcpSocket": {"port": port}, "periodSeconds": period, "timeoutSeconds": 2, "failureThreshold": failures}


def aggregator_deployment(ctx: RenderContext) -> dict[str, Any]:
    spec = ctx.service.spec
    per_address = members_per_address(ctx)
    env = [
        _env("NOCTAYA_REPORT_PORT", REPORT_PORT),
        _env("NOCTAYA_SCALER_PORT", SCALER_GRPC_PORT),
        _env("NOCTAYA_AGGREGATOR_TOKEN_FILE", f"{gateway.TOKEN_DIR}/{gateway.TOKEN_KEY}"),
        _env("NOCTAYA_AGGREGATOR_PREVIOUS_TOKEN_FILE", f"{gateway.TOKEN_DIR}/{gateway.PREVIOUS_TOKEN_KEY}"),
        _env("NOCTAYA_MAX_MEMBERS", max_members(ctx)),
        _env("NOCTAYA_MAX_MEMBERS_PER_ADDRESS", per_address),
        _env("NOCTAYA_MAX_CONNECTIONS_PER_ADDRESS", CONNECTIONS_PER_MEMBER * per_address),
        _env("NOCTAYA_MAX_MEMBER_DEMAND", spec.endpoint.max_queue),
        _env("NOCTAYA_MEMBER_TTL_SECONDS", MEMBER_TTL_SECONDS),
        _env("NOCTAYA_MAX_CONCURRENT_REPORTS", MAX_CONCURRENT_REPORTS),
        _env("NOCTAYA_METRIC_NAME", METRIC_NAME),
    ]
    vol, mount = gateway.token_volume(ctx)
    volumes = [vol]
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, mount]
    if spec.scaler_tls is not None:
        env.extend(gateway.tls_env(ctx))
        # Checked at startup: the certificate must carry the name gateways (and KEDA) dial.
        env.append(_env("NOCTAYA_REPORT_SERVER_NAME", ctx.host(names.scaler(ctx.name))))
        tls_vol, tls_mount = gateway.tls_volume(ctx)
        volumes.append(tls_vol)
        mounts.append(tls_mount)
    container = {
        "name": "aggregator",
        "image": ctx.config.image,
        "imagePullPolicy": ctx.config.image_pull_policy,
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
        "volumeMounts": mounts,
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": ctx.metadata(names.aggregator(ctx.name), labels.AGGREGATOR),
        "spec": {
            # Memory-only by design: one replica; after a restart the gateways' 2 s heartbeats rebuild it.
            "replicas": 1,
            "selector": {"matchLabels": labels.selector(ctx.name, labels.AGGREGATOR)},
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {"labels": labels.labels(ctx.name, labels.AGGREGATOR)},
                "spec": gateway.restricted_pod_spec(ctx, [container], volumes),
            },
        },
    }

