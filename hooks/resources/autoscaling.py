"""The KEDA ScaledObject of one LLMService (attached by the DecoratorController, never a child of
the main CompositeController: a missing KEDA CRD would stall that whole controller).

Triggers:
- `external-push` at the internal scaler Service: gateway demand (queued + in flight). A pushed
  `true` wakes the backend at once; KEDA's own polls of IsActive/GetMetrics drive 1→N and scale-in.
  A member of a shared gateway (`spec.endpoint.gateway`) dials the LLMGateway's scaler Service
  instead, naming its served model in the trigger metadata (`model`).
- optional leading-signal `prometheus` triggers, OR-combined by KEDA, each tracking the hottest
  replica: `max()` over the service's pods, with metricType Value so the HPA compares that
  maximum against the threshold (AverageValue would divide it by the replica count).
- one `cron` trigger per warm window (`scaling.schedules`): active inside the window, holding its
  replicas as a floor; `leadTime` moves its start earlier (`auto`: by the last measured cold start).
  KEDA reports it active while the next end comes before the next start; the API model refuses
  windows that rule would open at other times than written (hooks.api.cron).

An AcceleratorPool makes an idle model yield its accelerators through the cooldown alone: while a
pool lists the ScaledObject as yielding, cooldownPeriod (and with it the HPA's scale-down window) is
the pool's shorter one (hooks.controller.autoscaling). `scaling.yieldPolicy: Never` is a label the
pool reads, and it wins over a stale pool entry.

Behaviour when the scaler is unreachable (a deliberate choice): no `fallback`. Current KEDA,
when a trigger errors and no fallback is set, marks the ScaledObject Ready=False (TriggerError) and
changes nothing: it neither scales a serving backend in nor wakes an idle one, while the HPA keeps
its last replica count for the failing metric. `fallback.replicas` would instead start (and keep)
accelerators for a model nobody may be using during a scaler outage, and it only applies to
AverageValue triggers anyway. Gateways re-push demand as soon as the scaler is back (StreamIsActive
reconnects), so holding still is the safe side of an outage for a scale-to-zero model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hooks.api import cron
from hooks.api.llmservice import LeadingSignalTrigger, WarmWindow, lead_minutes
from hooks.resources import labels, names
from hooks.resources.context import RenderContext

API_VERSION = "keda.sh/v1alpha1"
DEMAND_TRIGGER = "gateway-demand"
UNREACHABLE_TRIGGER = "no-gateway"
WARM_WINDOW_TRIGGER = "warm-window"
# Trigger metadata naming the served model at a shared scaler (scaler.externalscaler.MODEL_METADATA_KEY;
# not imported: the hook server does not load the scaler's gRPC stack).
MODEL_KEY = "model"
MAX_HPA_WINDOW_SECONDS = 3600  # the HPA API's upper bound for a stabilization window
# scaling.pollingInterval's API default (hooks.api.llmservice.Scaling), in seconds. The API server fills
# the default in, so a member that shows it is taken as one that did not choose (see member_polling).
DEFAULT_POLLING_SECONDS = 5
# A member's polling interval when it did not choose one, at most its cooldownPeriod. One shared
# gateway answers every member's polls: 100 members at 5 s were 40 RPCs/s, ~30 ms of CPU per second
# idle; at 300 s they are 0.7 RPC/s. The push stream still wakes a model at once (issue 29).
MEMBER_POLLING_SECONDS = 300


@dataclass(frozen=True)
class ScaledObjectPlan:
    scaled_object: dict[str, Any]
    problems: list[str] = field(default_factory=list)  # leading-signal triggers that could not be built


def _gauge(ctx: RenderContext, trigger: LeadingSignalTrigger) -> tuple[str | None, str]:
    metrics = ctx.runtime.spec.metrics
    if trigger.signal == "InFlightRatio":
        return (metrics.in_flight_metric if metrics else None), "inFlightMetric"
    if trigger.signal == "KVCacheUsage":
        return (metrics.kv_cache_usage_metric if metrics else None), "kvCacheUsageMetric"
    return (metrics.waiting_metric if metrics else None), "waitingMetric"


def leading_query(ctx: RenderContext, trigger: LeadingSignalTrigger) -> str | None:
    """PromQL for one leading signal, or None when the runtime does not name the gauge."""
    if trigger.query:
        return trigger.query
    gauge, _ = _gauge(ctx, trigger)
    if gauge is None:
        return None
    # `namespace` and `service` are the labels a ServiceMonitor on the backend Service attaches.
    series = f'{gauge}{{namespace="{ctx.namespace}",service="{names.backend(ctx.name)}"}}'
    query = f"max({series})"
    if trigger.signal == "InFlightRatio":
        query = f"{query} / {trigger.max_concurrent_sequences}"
    return query


def warm_window_triggers(ctx: RenderContext) -> list[dict[str, Any]]:
    """One KEDA cron trigger per warm window. KEDA reports a cron trigger active inside its window
    with desiredReplicas as the metric; with metricType AverageValue and KEDA's target of 1 the HPA
    asks for exactly that many replicas, and takes the largest of all triggers."""
    measured = ctx.measured_cold_start
    out = []
    for index, window in enumerate(ctx.service.spec.scaling.schedules):
        lead = window.lead(measured)  # an `auto` lead is held where KEDA would read it wrongly (WarmWindow.auto_cap)
        start = cron.shift_earlier(window.start, lead)
        if start is None:  # refused at validation; never render a window that opens late
            start = window.start
        out.append({
            "type": "cron",
            "name": f"{WARM_WINDOW_TRIGGER}-{index}",
            "metricType": "AverageValue",
            "metadata": {"timezone": window.time_zone, "start": start, "end": window.end,
                         "desiredReplicas": str(window.replicas)},
        })
    return out


def window_text(window: WarmWindow, measured: float | None) -> str:
    """One warm window as the ScaledObject opens it, for AutoscalingReady (stable: the lead changes
    only with a new cold-start record). Says so when an `auto` lead was shortened."""
    lead = window.lead(measured)
    text = f"{window.replicas} from '{window.start}' to '{window.end}' {window.time_zone}"
    if lead:
        text += f", opening {lead}m early"
    if window.lead_time == "auto":
        wanted = lead_minutes(measured) if measured else 0
        if wanted > lead:
            cap, why = window.auto_cap()
            text += (f"{'' if lead else ', opening on time'} (leadTime auto: the last cold start asks for {wanted}m, "
                     f"held at {cap}m because {why})")
        elif not wanted:
            text += ", opening early once a cold start was measured"
    return text


def unreachable_scaled_object(ctx: RenderContext) -> dict[str, Any]:
    """The ScaledObject of a member whose LLMGateway does not exist (deleted, or not created yet):
    nothing can route a request to the model, and an external-push trigger at the gone scaler would
    only error (KEDA then changes nothing, so a warm backend would keep its accelerators for ever).

    One trigger that is never active: KEDA's kubernetes-workload over this model's own gateway Pods,
    which a member never has. KEDA scales the backend to zero once the cooldown has passed since the
    last active report (enough for requests the gone gateway is still draining), whatever
    scaling.min, warm windows or pools say: an unreachable model holds no accelerator. When the
    LLMGateway exists again the usual ScaledObject returns, and with it scaling.min.
    """
    scaling = ctx.service.spec.scaling
    cooldown = ctx.seconds(scaling.cooldown_period)
    no_pods = f"{labels.LLMSERVICE}={labels.label_value(ctx.name)},{labels.COMPONENT}={labels.GATEWAY}"
    return {
        "apiVersion": API_VERSION,
        "kind": "ScaledObject",
        "metadata": ctx.metadata(names.scaled_object(ctx.name), labels.BACKEND),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": names.backend(ctx.name)},
            "minReplicaCount": 0,
            "maxReplicaCount": scaling.max,
            "pollingInterval": ctx.seconds(scaling.polling_interval),
            "cooldownPeriod": cooldown,
            "advanced": {"horizontalPodAutoscalerConfig": {
                "behavior": {"scaleDown": {"stabilizationWindowSeconds": min(cooldown, MAX_HPA_WINDOW_SECONDS)}}}},
            "triggers": [{"type": "kubernetes-workload", "name": UNREACHABLE_TRIGGER, "metricType": "AverageValue",
                          "metadata": {"podSelector": no_pods, "value": "1"}}],
        },
    }


def member_polling(ctx: RenderContext, cooldown: int) -> int:
    """KEDA's pollingInterval for this ScaledObject. A member of a shared gateway left at the API
    default polls every MEMBER_POLLING_SECONDS, and at least once per cooldownPeriod: KEDA
    scales to zero only at a poll, so scale-in then comes between cooldown and twice the cooldown
    after the last demand (a pool's short yield cooldown keeps yielding prompt). Waking needs no
    poll (the gateway pushes `true` on StreamIsActive), nor does 1→N (the HPA asks GetMetrics every
    15 s through KEDA's metrics server). Any other value, and every model of its own gateway, as set."""
    seconds = ctx.seconds(ctx.service.spec.scaling.polling_interval)
    if ctx.shared_gateway is None or seconds != DEFAULT_POLLING_SECONDS:
        return seconds
    return max(seconds, min(MEMBER_POLLING_SECONDS, cooldown))


def scaled_object(ctx: RenderContext, yield_cooldown: int | None = None,
                  ghost_cooldown: int | None = None) -> ScaledObjectPlan:
    """The ScaledObject. `yield_cooldown`: the shortest cooldown an AcceleratorPool gives this model while
    it yields its accelerators; `ghost_cooldown`: the one a replica nobody waits for gets (both
    hooks.controller.autoscaling). Each only ever shortens the model's own."""
    scaling = ctx.service.spec.scaling
    cooldown = ctx.seconds(scaling.cooldown_period)
    if yield_cooldown is not None and scaling.yield_policy != "Never":  # Never wins over a stale pool entry
        cooldown = min(cooldown, max(yield_cooldown, 0))
    if ghost_cooldown is not None:  # a ghost holds no accelerator: Never has nothing to protect
        cooldown = min(cooldown, max(ghost_cooldown, 0))
    demand: dict[str, Any] = {
        "type": "external-push",
        "name": DEMAND_TRIGGER,
        "metricType": "AverageValue",
        # The target travels here, not in the gateways' env: retuning rewrites this object only.
        "metadata": {"scalerAddress": ctx.scaler_address, "targetPerReplica": str(scaling.target_per_replica)},
    }
    if ctx.shared_gateway is not None:
        # The LLMGateway's scaler answers for every model behind it: this key says which one.
        demand["metadata"][MODEL_KEY] = ctx.service.served_name
    tls = ctx.service.spec.scaler_tls
    if tls is not None:
        # KEDA turns TLS on from enableTLS (or from the certificates); the PEMs come from the
        # TriggerAuthentication (caCert, tlsClientCert, tlsClientKey), never from the scaler.
        demand["metadata"]["enableTLS"] = "true"
        demand["authenticationRef"] = {"name": tls.trigger_authentication, "kind": tls.trigger_authentication_kind}
    triggers = [demand]
    problems: list[str] = []
    for index, trigger in enumerate(scaling.triggers):
        query = leading_query(ctx, trigger)
        if query is None:
            _, field_name = _gauge(ctx, trigger)
            problems.append(
                f"scaling.triggers[{index}] ({trigger.signal}) needs the runtime's metrics.{field_name} or an explicit query"
            )
            continue
        triggers.append(
            {
                "type": "prometheus",
                "name": f"{trigger.signal.lower()}-{index}",
                "metricType": "Value",
                # activationThreshold = threshold: a leading signal only adds replicas (1→N); an idle
                # gauge above 0 (KV cache with prefix caching) must not keep the model awake.
                "metadata": {"serverAddress": trigger.server_address, "query": query, "threshold": trigger.threshold,
                             "activationThreshold": trigger.threshold},
            }
        )
    triggers += warm_window_triggers(ctx)
    metadata = ctx.metadata(names.scaled_object(ctx.name), labels.BACKEND)
    if scaling.yield_policy == "Never":
        metadata["labels"] = {**metadata["labels"], labels.YIELD_POLICY: "Never"}
    obj = {
        "apiVersion": API_VERSION,
        "kind": "ScaledObject",
        "metadata": metadata,
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": names.backend(ctx.name)},
            "minReplicaCount": scaling.min,
            "maxReplicaCount": scaling.max,
            "pollingInterval": member_polling(ctx, cooldown),
            "cooldownPeriod": cooldown,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {"scaleDown": {"stabilizationWindowSeconds": min(cooldown, MAX_HPA_WINDOW_SECONDS)}},
                },
            },
            "triggers": triggers,
        },
    }
    return ScaledObjectPlan(obj, problems)
