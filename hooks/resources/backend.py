"""Backend (serving) Deployment and Service.

The Deployment never sets `spec.replicas`: KEDA owns it. Metacontroller applies children with a
3-way merge on its last-applied annotation, so a field the hook never returned stays as KEDA set it.
"""

from __future__ import annotations

from typing import Any

from hooks.resources import labels, names
from hooks.resources.context import RenderContext, tcp_port
from hooks.runtime import pod

# The default 600 s deadline is shorter than a cold start that pulls an image and loads a model.
MIN_PROGRESS_DEADLINE_SECONDS = 600
PROGRESS_DEADLINE_MARGIN_SECONDS = 300


def deployment(ctx: RenderContext, cache: pod.CacheMount) -> dict[str, Any]:
    template = pod.pod_template(ctx.service, ctx.runtime, labels.labels(ctx.name, labels.BACKEND), cache)
    deadline = max(MIN_PROGRESS_DEADLINE_SECONDS, pod.startup_budget_seconds(ctx.runtime) + PROGRESS_DEADLINE_MARGIN_SECONDS)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": ctx.metadata(names.backend(ctx.name), labels.BACKEND),
        "spec": {
            "selector": {"matchLabels": labels.selector(ctx.name, labels.BACKEND)},
            "progressDeadlineSeconds": deadline,
            # Replace, never surge: a surge Pod needs a spare accelerator (and an RWO cache claim
            # may be attached elsewhere). The gateway holds requests while the new Pod loads.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "revisionHistoryLimit": 3,
            "template": template,
        },
    }


def service(ctx: RenderContext) -> dict[str, Any]:
    spec = ctx.runtime.spec
    ports = [tcp_port(pod.PORT_NAME, spec.port)]
    if spec.metrics is not None and spec.metrics.port is not None and spec.metrics.port != spec.port:
        ports.append(tcp_port(pod.METRICS_PORT_NAME, spec.metrics.port))
    return ctx.service_object(names.backend(ctx.name), labels.BACKEND, labels.BACKEND, ports)


def url(ctx: RenderContext) -> str:
    return f"http://{ctx.host(names.backend(ctx.name))}:{ctx.runtime.spec.port}"
