"""`sync` of the LLMService CompositeController: desired children + truthful status.

Never destructive: when the spec is invalid, the runtime cannot be resolved or the cache strategy
is not implemented, every observed child is returned unchanged (Metacontroller deletes whatever a
response omits) and a condition says why. Without KEDA's CRD the backend Deployment is not created
(an existing one is kept): nothing could scale it.

A member of a shared gateway (spec.endpoint.gateway) renders no gateway children of its own; its
GatewayReady and status.endpoint come from the LLMGateway it names (related by customize).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from hooks.api.llmservice import LLMService
from hooks.api.status import ConditionType, Reason
from hooks.api.upgrades import Upgrades
from hooks.config import HookConfig, resolve
from hooks.controller import coldstart, rollout, weights
from hooks.controller import observe as obs
from hooks.controller import status as st
from hooks.controller.customize import shared_gateway_name
from hooks.errors import describe_validation_error
from hooks.resources import autoscaling, backend, disruption, gateway, labels, names, prewarm, scaler, secrets
from hooks.resources.context import RenderContext, endpoint_url
from hooks.runtime.select import Resolution, select_runtime

COMPONENT = labels.COMPONENT


@dataclass
class Outcome:
    """Everything one sync decided, before it is put on the wire."""

    children: list[dict[str, Any]] = field(default_factory=list)
    conditions: dict[ConditionType, st.Cond] = field(default_factory=dict)
    runtime: str | None = None
    backend_failures: list[tuple[Reason | str, str]] = field(default_factory=list)
    cold_start: dict[str, Any] | None = None  # the lastColdStart this sync writes (computed once)
    pending_upgrade: dict[str, Any] | None = None  # status.pendingUpgrade (hooks.controller.rollout)

    def put(self, cond: st.Cond) -> None:
        self.conditions[cond.type] = cond


def parse_service(parent: dict[str, Any]) -> tuple[LLMService | None, str]:
    """The typed LLMService, or None and a user-facing message naming the bad fields."""
    try:
        return LLMService.model_validate({k: v for k, v in parent.items() if k != "status"}), ""
    except ValidationError as exc:
        return None, describe_validation_error(exc)


def namespace_of(parent: dict[str, Any]) -> str:
    return (parent.get("metadata") or {}).get("namespace") or "default"


def resolve_runtime(service: LLMService, observed: obs.Observed) -> Resolution:
    return select_runtime(service.spec.runtime, observed.related_objects(obs.RUNTIME))


def component_of(obj: dict[str, Any]) -> str | None:
    return ((obj.get("metadata") or {}).get("labels") or {}).get(COMPONENT)


def observed_deployment(observed: obs.Observed, name: str) -> dict[str, Any] | None:
    return observed.child(obs.DEPLOYMENT, name)


def _keep_all(observed: obs.Observed) -> list[dict[str, Any]]:
    return [obs.kept(o) for o in observed.children.values()]


def pool_notes(parent: dict[str, Any], observed: obs.Observed) -> st.PoolNotes:
    """What the AcceleratorPools say about this LLMService's backend (waiting, or yielding)."""
    name = str(parent["metadata"]["name"])
    return st.pool_notes(observed.related_objects(st.POOL_GROUP), namespace_of(parent), names.scaled_object(name))


def served_name_of(parent: dict[str, Any]) -> str:
    """spec.model.servedName (or the name) read from the raw object, so that an invalid spec's
    GatewayReady still looks for the right model."""
    spec = parent.get("spec") if isinstance(parent.get("spec"), dict) else {}
    model = spec.get("model") if isinstance(spec.get("model"), dict) else {}
    served = model.get("servedName")
    return served if isinstance(served, str) and served else str(parent["metadata"]["name"])


def gateway_gone(obj: dict[str, Any], observed: obs.Observed) -> str | None:
    """The LLMGateway a member names when the request shows it does not exist (or is being deleted);
    None for a model with its own gateway, a gateway that exists, or a request that does not say."""
    return missing_gateway(shared_gateway_name(obj.get("spec")), namespace_of(obj), observed)


def missing_gateway(name: str | None, namespace: str, observed: obs.Observed) -> str | None:
    if name is None or not obs.has_group(observed.related, obs.LLMGATEWAY):
        return None
    found = observed.llmgateway(name, namespace)
    return name if found is None or (found.get("metadata") or {}).get("deletionTimestamp") else None


def gateway_ready(parent: dict[str, Any], observed: obs.Observed, multi: bool, missing_auth: str | None = None) -> st.Cond:
    """GatewayReady: the LLMService's own gateway Deployment(s), or for a member the LLMGateway it joins."""
    name = str(parent["metadata"]["name"])
    shared = shared_gateway_name(parent.get("spec"))
    if shared is not None:
        return st.shared_gateway_condition(observed.llmgateway(shared, namespace_of(parent)), shared,
                                           served_name_of(parent), name)
    return st.gateway_condition(
        observed_deployment(observed, names.gateway(name)),
        observed_deployment(observed, names.aggregator(name)),
        multi,
        missing_auth,
    )


def _observational(out: Outcome, parent: dict[str, Any], observed: obs.Observed, multi: bool) -> None:
    """BackendReady and GatewayReady from what exists, whatever the spec says."""
    parent_name = parent["metadata"]["name"]
    out.put(st.backend_condition(observed_deployment(observed, names.backend(parent_name)), observed.live_pods(),
                                 pools=pool_notes(parent, observed)))
    out.put(gateway_ready(parent, observed, multi))


def _missing_secrets(service: LLMService, observed: obs.Observed) -> dict[str, str]:
    """Referenced Secrets that Pods report missing, by role. Secrets are never read (not even
    listed): the Pods that use them say so (see hooks.controller.status.pod_secrets_missing)."""
    wanted: dict[str, tuple[str, tuple[str, ...]]] = {}
    if service.spec.model.credentials_secret is not None and service.spec.model.parsed.scheme != "pvc":
        wanted["credentials"] = (service.spec.model.credentials_secret.name, (labels.BACKEND, labels.PREWARM))
    if service.spec.endpoint.auth is not None:
        wanted["auth"] = (service.spec.endpoint.auth.secret_ref.name, (labels.GATEWAY,))
    if service.spec.scaler_tls is not None:
        wanted["tls"] = (service.spec.scaler_tls.secret_name, (labels.GATEWAY, labels.AGGREGATOR))
    missing: dict[str, str] = {}
    for role, (name, components) in wanted.items():
        if name in st.pod_secrets_missing(observed.pods_of(*components)):
            missing[role] = name
    return missing


def _invalid(out: Outcome, parent: dict[str, Any], observed: obs.Observed, message: str) -> None:
    out.children = _keep_all(observed)
    spec = parent.get("spec") if isinstance(parent.get("spec"), dict) else {}
    endpoint = spec.get("endpoint") if isinstance(spec.get("endpoint"), dict) else {}
    multi = isinstance(endpoint.get("replicas"), int) and endpoint["replicas"] > 1
    text = f"spec is invalid, existing children are kept unchanged: {message}"
    for ctype in (ConditionType.RUNTIME_RESOLVED, ConditionType.AUTOSCALING_READY, ConditionType.CACHE_READY):
        out.put(st.Cond(ctype, "Unknown", Reason.INVALID_SPEC, "not evaluated: the spec is invalid"))
    _observational(out, parent, observed, multi)
    out.put(st.Cond(ConditionType.READY, "False", Reason.INVALID_SPEC, st.short(text)))


def plan_children(
    ctx: RenderContext, observed: obs.Observed, out: Outcome, keda: bool, missing: dict[str, str]
) -> autoscaling.ScaledObjectPlan:
    """The desired children (appended to `out`, in a fixed order: a resync of an unchanged world
    answers the same bytes) and the cache / autoscaling conditions."""
    observed_backend = observed_deployment(observed, names.backend(ctx.name))
    plan = weights.plan(ctx, observed, observed_backend, missing)
    # Until the weights are staged no backend is created, and a running one (an older revision) is
    # kept exactly as it is: it rolls to the new revision only once that revision is complete.
    if keda and not plan.blocked:
        out.children.append(backend.deployment(ctx, plan.mount, observed_backend,
                                               prewarm.weights_annotations(ctx, plan.node)))
    elif observed_backend is not None:
        out.children.append(obs.kept(observed_backend))
    out.children.append(backend.service(ctx))
    out.children.extend(plan.children)
    out.backend_failures.extend(plan.backend_failures)
    out.put(plan.condition)
    out.children.extend(_front_children(ctx, observed))
    so_plan = autoscaling.scaled_object(ctx)
    out.put(autoscaling_condition(ctx, observed, keda, so_plan, missing))
    return so_plan


def _front_children(ctx: RenderContext, observed: obs.Observed) -> list[dict[str, Any]]:
    """The model's own gateway, its Services, and with several gateway replicas the scaler aggregator."""
    out: list[dict[str, Any]] = []
    if ctx.shared_gateway is None:
        # A member of a shared gateway has none of these: the LLMGateway renders them for all its
        # models, and Metacontroller deletes the ones a switch to shared leaves behind.
        out += [gateway.deployment(ctx), gateway.public_service(ctx), scaler.service(ctx), *gateway.identity(ctx)]
    if ctx.multi_gateway:
        token_name = names.scaler_token(ctx.name)
        out += [scaler.aggregator_deployment(ctx), disruption.gateway_pdb(ctx),
                secrets.token_secret(ctx, observed.child(obs.SECRET, token_name))]
    return out


def autoscaling_condition(ctx: RenderContext, observed: obs.Observed, keda: bool,
                          so_plan: autoscaling.ScaledObjectPlan, missing: dict[str, str]) -> st.Cond:
    """AutoscalingReady: the first of KEDA missing, a gone LLMGateway, an unbuildable trigger or a
    missing TLS Secret that applies; else what the ScaledObject does."""
    name, scaling, t = ctx.name, ctx.service.spec.scaling, ConditionType.AUTOSCALING_READY
    if not keda:
        return st.Cond(t, "False", Reason.KEDA_NOT_INSTALLED,
                       f"KEDA's CRD {obs.KEDA_CRD_NAME} is not installed: install KEDA; the backend Deployment is "
                       "created once it is (existing children are kept)")
    gone = missing_gateway(ctx.shared_gateway, ctx.namespace, observed)
    if gone is not None:
        return st.Cond(t, "False", Reason.GATEWAY_NOT_FOUND, st.short(
            f"LLMGateway {gone} does not exist in namespace {ctx.namespace}: nothing can route to the model, so its "
            f"ScaledObject scales {names.backend(name)} to zero once cooldownPeriod has passed (scaling.min and warm "
            "windows apply again when the gateway exists)"))
    if so_plan.problems:
        return st.Cond(t, "False", Reason.INVALID_SPEC, st.short("; ".join(so_plan.problems)))
    if "tls" in missing:
        return st.Cond(t, "False", Reason.SECRET_NOT_FOUND, f"scalerTLS Secret {missing['tls']} does not exist")
    return st.Cond(t, "True", Reason.CONFIGURED, st.short(
        f"ScaledObject {names.scaled_object(name)} scales {names.backend(name)} between {scaling.min} and "
        f"{scaling.max} replicas on demand from {ctx.scaler_address}" + _windows_text(ctx)))


def _windows_text(ctx: RenderContext) -> str:
    """The warm windows as the ScaledObject opens them (stable: the lead changes only with a new
    cold-start record)."""
    parts = [autoscaling.window_text(window, ctx.measured_cold_start) for window in ctx.service.spec.scaling.schedules]
    return f"; warm windows hold {'; '.join(parts)}" if parts else ""


def decide(parent: dict[str, Any], observed: obs.Observed, config: HookConfig) -> Outcome:
    out = Outcome()
    # The record this sync writes, whatever else it decides (build_status writes it as it is).
    out.cold_start = coldstart.record(_backend_replicas(observed, str((parent.get("metadata") or {}).get("name"))),
                                      observed.live_pods(), parent.get("status"))
    service, error = parse_service(parent)
    if service is None:
        _invalid(out, parent, observed, error)
        out.runtime = (parent.get("status") or {}).get("runtime") if isinstance(parent.get("status"), dict) else None
        return out
    name = service.metadata.name
    keda = observed.keda_installed
    missing = _missing_secrets(service, observed)
    resolution = resolve_runtime(service, observed)
    previous_runtime = (parent.get("status") or {}).get("runtime") if isinstance(parent.get("status"), dict) else None

    if not resolution.resolved:
        out.children = _keep_all(observed)
        out.runtime = previous_runtime
        out.put(st.Cond(ConditionType.RUNTIME_RESOLVED, "False", resolution.reason, resolution.message))
        if keda:
            # The decorator keeps the ScaledObject it last rendered: demand still scales the backend,
            # to zero too (a deleted runtime must not strand a warm model's accelerators).
            out.put(st.Cond(ConditionType.AUTOSCALING_READY, "Unknown", Reason.WAITING_FOR_DEPENDENCIES,
                            "waiting for a runtime; an existing ScaledObject is kept as it was and still scales "
                            "the backend on demand, to zero when idle"))
        else:
            out.put(st.Cond(ConditionType.AUTOSCALING_READY, "False", Reason.KEDA_NOT_INSTALLED, f"KEDA's CRD {obs.KEDA_CRD_NAME} is not installed"))
        out.put(st.Cond(ConditionType.CACHE_READY, "Unknown", Reason.WAITING_FOR_DEPENDENCIES, "waiting for a runtime"))
        _observational(out, parent, observed, service.spec.endpoint.replicas > 1)
        return out

    assert resolution.runtime is not None
    out.runtime = resolution.runtime.metadata.name
    out.put(st.Cond(ConditionType.RUNTIME_RESOLVED, "True", Reason.RESOLVED, resolution.message))

    if service.spec.cache.strategy == "BakedImage":
        out.children = _keep_all(observed)
        out.put(st.Cond(ConditionType.AUTOSCALING_READY, "Unknown", Reason.WAITING_FOR_DEPENDENCIES, "nothing rendered"))
        out.put(
            st.Cond(
                ConditionType.CACHE_READY,
                "False",
                Reason.NOT_IMPLEMENTED,
                "cache.strategy BakedImage is reserved and not implemented; existing children are kept unchanged",
            )
        )
        _observational(out, parent, observed, service.spec.endpoint.replicas > 1)
        out.put(st.Cond(ConditionType.READY, "False", Reason.NOT_IMPLEMENTED, "cache.strategy BakedImage is not implemented"))
        return out

    ctx = RenderContext(
        service=service,
        runtime=resolution.runtime,
        namespace=namespace_of(parent),
        config=config,
        uid=str((parent.get("metadata") or {}).get("uid") or ""),
        # The record this sync writes (a cold start that just happened included): the windows
        # `leadTime: auto` opens and the record land in one status write.
        measured_cold_start=coldstart.total_seconds(out.cold_start),
        # An older controller manifest (an upgrade in progress) does not manage the identity's types.
        gateway_identity=observed.lists_children(*obs.IDENTITY_CHILD_RESOURCES),
    )
    plan_children(ctx, observed, out, keda, missing)
    settle_rollout(ctx, parent, observed, out, config)

    extra = list(out.backend_failures)
    if "credentials" in missing:
        extra.append((Reason.SECRET_NOT_FOUND, f"model.credentialsSecret {missing['credentials']} does not exist"))
    not_created = (Reason.PROGRESSING, "backend Deployment not created yet")
    staging = out.conditions.get(ConditionType.CACHE_READY)
    if not keda:
        not_created = (Reason.WAITING_FOR_DEPENDENCIES, "the backend is created once KEDA is installed")
    elif prewarm.applies(ctx) and staging is not None and staging.status != "True":
        not_created = (staging.reason, "the backend is created once the prewarm Job has staged the weights")
    out.put(
        st.backend_condition(
            observed_deployment(observed, names.backend(name)),
            observed.live_pods(),
            not_created_reason=not_created[0],
            not_created_message=not_created[1],
            extra_failures=extra,
            pools=pool_notes(parent, observed),
        )
    )
    out.put(gateway_ready(parent, observed, ctx.multi_gateway, missing.get("auth")))
    return out


def backend_inputs(ctx: RenderContext, deployment: dict[str, Any]) -> str:
    """What the backend template is rendered from: the runtime, the backend's parts of the spec, and
    where staged weights are (the Deployment's own annotations)."""
    spec = ctx.service.spec
    own = {k: v for k, v in ((deployment["metadata"].get("annotations") or {}).items()) if k != rollout.INPUTS_ANNOTATION}
    return rollout.inputs_digest(runtime=ctx.runtime.spec, model=spec.model, runtimeRef=spec.runtime,
                                 resources=spec.resources, scheduling=spec.scheduling, cache=spec.cache,
                                 imagePullSecrets=spec.image_pull_secrets, annotations=own)


def front_inputs(ctx: RenderContext) -> str:
    """What gateway and aggregator templates are rendered from (hooks.resources.gateway and scaler):
    the runtime (port, readiness path), spec.endpoint (balancing included), the activation timeout,
    the served name, the accelerator count, scaler TLS and pull secrets. Not the rest of spec.scaling,
    which only KEDA reads. Not whether the gateway has an identity either: that follows the installed
    controller manifests (Noctaya's side), so it waits on a warm model like any upgrade."""
    spec = ctx.service.spec
    return rollout.inputs_digest(runtime=ctx.runtime.spec, endpoint=spec.endpoint, model=spec.model,
                                 activationTimeout=spec.scaling.activation_timeout,
                                 accelerators=spec.resources.accelerators, scalerTLS=spec.scaler_tls,
                                 imagePullSecrets=spec.image_pull_secrets)


ROLLED = {labels.BACKEND: True, labels.GATEWAY: False, labels.AGGREGATOR: False}  # component → is the engine


def settle_rollout(ctx: RenderContext, parent: dict[str, Any], observed: obs.Observed, out: Outcome,
                   config: HookConfig) -> None:
    """Record each rendered Deployment's inputs and keep a warm model's running templates when only
    Noctaya's part changed (hooks.controller.rollout)."""
    def annotate(child: dict[str, Any]) -> dict[str, Any]:
        component = component_of(child)
        if child.get("kind") != "Deployment" or component not in ROLLED:
            return child
        inputs = backend_inputs(ctx, child) if component == labels.BACKEND else front_inputs(ctx)
        return rollout.with_inputs(child, inputs)

    out.children = [annotate(c) for c in out.children]
    desired, current, _ready = st.deployment_counts(observed_deployment(observed, names.backend(ctx.name)))
    facts = rollout.Facts(upgrades=ctx.service.spec.upgrades or Upgrades(), warm=desired > 0 or current > 0,
                          approval=rollout.approval_of(parent), min_replicas=ctx.service.spec.scaling.min,
                          now=lambda: rollout.parse_clock(config.clock()))
    settled = rollout.settle(out.children, rollout.candidates_of(out.children, observed, ROLLED), facts,
                             rollout.spec_seen(parent))
    out.children = settled.children
    out.put(settled.condition)
    out.pending_upgrade = settled.pending


def _backend_replicas(observed: obs.Observed, name: str) -> int | None:
    """The backend Deployment's replicas (None while there is none): what the phase is read against."""
    deployment = observed_deployment(observed, names.backend(name))
    return None if deployment is None else st.deployment_counts(deployment)[0]


def build_status(parent: dict[str, Any], out: Outcome, observed: obs.Observed, config: HookConfig) -> dict[str, Any]:
    meta = parent.get("metadata") or {}
    name = meta["name"]
    namespace = namespace_of(parent)
    endpoint = endpoint_url(name, namespace, config, shared_gateway_name(parent.get("spec")))
    if ConditionType.READY not in out.conditions:
        out.put(st.ready_condition(out.conditions, endpoint))
    generation = meta.get("generation") if isinstance(meta.get("generation"), int) else None
    deployment = observed_deployment(observed, names.backend(name))
    desired, current, ready = st.deployment_counts(deployment)
    status: dict[str, Any] = {}
    if generation is not None:
        status["observedGeneration"] = generation
    if out.runtime:
        status["runtime"] = out.runtime
    status["endpoint"] = endpoint
    status["replicas"] = current
    status["readyReplicas"] = ready
    status.update(coldstart.timeline(None if deployment is None else desired, observed.live_pods(), parent.get("status"),
                                     config.clock, out.cold_start))
    if out.pending_upgrade is not None:
        status["pendingUpgrade"] = out.pending_upgrade
    record = st.last_yield(observed.related_objects(st.POOL_GROUP), namespace, names.scaled_object(name),
                           parent.get("status"), None if deployment is None else desired)
    if record is not None:
        status["lastYield"] = record
    status["conditions"] = st.wire_conditions(out.conditions.values(), parent.get("status"), generation, config.clock)
    return status


def sync(request: dict[str, Any], config: HookConfig | None = None) -> dict[str, Any]:
    """CompositeController sync (hook version v2); delegates to finalize while the parent is deleting."""
    parent = obs.require_object(request, "parent")
    if request.get("finalizing"):
        from hooks.controller.finalize import finalize

        return finalize(request, config)
    cfg = resolve(config)
    observed = obs.observe(request)
    out = decide(parent, observed, cfg)
    return {
        "status": build_status(parent, out, observed, cfg),
        "children": out.children,
        "resyncAfterSeconds": 0.0,
        "finalized": False,
    }
