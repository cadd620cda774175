"""Backend (serving) Deployment and Service.

`spec.replicas` belongs to KEDA, but a Deployment created without it is defaulted to 1 by the API
server: an accelerator booked and a model loading before anyone asked, for as long as KEDA has not
acted yet (its CRDs arriving late, the gateway not up, its error backoff). So a new Deployment is
created at `scaling.min` (0 by default), and every later sync returns the replica count it observes.
Both halves matter under Metacontroller's merge: a scalar the hook returns always overwrites the live
value, so returning a fixed 0 would undo every KEDA scale-up; and a field once returned and later
omitted is deleted, which the API server would default back to 1. Echoing the observed value is a
no-op merge, and Metacontroller updates with the observed resourceVersion, so a KEDA write that lands
between its read and its update makes the update conflict and retry instead of being overwritten.
"""

from __future__ import annotations

from typing import Any

from hooks.resources import labels, names
from hooks.resources.context import RenderContext, tcp_port
from hooks.runtime import pod

# The default 600 s deadline is shorter than a cold start that pulls an image and loads a model.
MIN_PROGRESS_DEADLINE_SECONDS = 600
PROGRESS_DEADLINE_MARGIN_SECONDS = 300


def replicas(ctx: RenderContext, observed: dict[str, Any] | None) -> int | None:
    """The `spec.replicas` to return: `scaling.min` on create, the live count afterwards (None when
    the live object has none, which the API server never leaves so)."""
    if observed is None:
        return ctx.service.spec.scaling.min
    return observed_replicas(observed)


def observed_replicas(observed: dict[str, Any]) -> int | None:
    value = (observed.get("spec") or {}).get("replicas")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def deployment(ctx: RenderContext, cache: pod.CacheMount, observed: dict[str, Any] | None,
               annotations: dict[str, str] | None = None) -> dict[str, Any]:
    template = pod.pod_template(ctx.service, ctx.runtime, labels.labels(ctx.name, labels.BACKEND), cache)
    deadline = max(MIN_PROGRESS_DEADLINE_SECONDS, pod.startup_budget_seconds(ctx.runtime) + PROGRESS_DEADLINE_MARGIN_SECONDS)
    spec: dict[str, Any] = {}
    count = replicas(ctx, observed)
    if count is not None:
        spec["replicas"] = count
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": ctx.metadata(names.backend(ctx.name), labels.BACKEND, annotations),
        "spec": {
            **spec,
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
