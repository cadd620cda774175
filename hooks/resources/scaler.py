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


def aggregator_deployment(ctx: RenderContext) -> dict[str, Any]:
    spec = ctx.service.spec
    env = [
        _env("NOCTAYA_REPORT_PORT", REPORT_PORT),
        _env("NOCTAYA_SCALER_PORT", SCALER_GRPC_PORT),
        _env("NOCTAYA_AGGREGATOR_TOKEN_FILE", f"{gateway.TOKEN_DIR}/{gateway.TOKEN_KEY}"),
        _env("NOCTAYA_AGGREGATOR_PREVIOUS_TOKEN_FILE", f"{gateway.TOKEN_DIR}/{gateway.PREVIOUS_TOKEN_KEY}"),
        _env("NOCTAYA_MAX_MEMBERS", MAX_MEMBERS),
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
        # The report port speaks TLS with scaler TLS; the kubelet's HTTPS probe does not verify.
        "readinessProbe": gateway.http_probe("/healthz", "report", 5, 2, https=spec.scaler_tls is not None),
        "livenessProbe": gateway.http_probe("/healthz", "report", 10, 6, https=spec.scaler_tls is not None),
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

