"""The LLMGateway CompositeController: one shared gateway, its model table, and a truthful status.

Members are the LLMServices of the gateway's namespace whose `spec.endpoint.gateway` names it (read
from the raw object, so a member whose spec no longer parses is still known as one). Each member's
table entry is computed by hooks.resources.gateway.model_settings, from the member and the runtime
the LLMService sync itself resolves (hooks.controller.sync.resolve_runtime), so a model behaves the
same behind its own gateway and behind a shared one.

Never destructive:
- an invalid LLMGateway spec keeps every observed child unchanged (Metacontroller deletes whatever a
  response omits) and says InvalidSpec;
- so does a namespace not enabled for LLMGateways (NamespaceNotEnabled): Metacontroller may write
  ConfigMaps only where the RoleBinding `noctaya-llmgateway` grants it (metacontroller/rbac.yaml), so
  the routing table could not be created or updated there, and a gateway Pod would wait forever for
  its volume; nothing new is rendered until the RoleBinding exists;
- a member that no longer parses, or whose runtime cannot be resolved, keeps the entry it had in the
  observed routing ConfigMap (found through the previous status.models; its balancing.json entry too),
  and MembersAccepted names it;
- two members with one served name: the older (creationTimestamp, then name) is routed, the other
  reported; beyond the gateway's MAX_MODELS the members already routed keep their place, newcomers
  are routed oldest first while there is room, and the rest are reported (TooManyModels).

A member being deleted leaves the table at once: its own finalize stops admission first too.

No finalize hook: every child carries the controller ownerReference Metacontroller sets, so the
garbage collector removes them with the LLMGateway, and there is nothing to drain in order (the
backends belong to the members, which outlive their gateway).

The answer is a function of the request only (the clock feeds lastTransitionTime, carried over while a
condition's status holds): an unchanged world gets the same bytes on every resync.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pydantic import ValidationError

from gateway.modeltable import BALANCING_FIELDS, BALANCING_FILE, MAX_MODELS, MEMBER_FIELD, SCALED_OBJECT_FIELD
from hooks.api.common import API_VERSION
from hooks.api.llmgateway import LLMGateway, LLMGatewaySpec
from hooks.api.llmservice import Endpoint
from hooks.api.status import ConditionType
from hooks.api.upgrades import Upgrades
from hooks.config import HookConfig, resolve
from hooks.controller import observe as obs
from hooks.controller import rollout
from hooks.controller import status as st
from hooks.controller.sync import namespace_of, parse_service, resolve_runtime
from hooks.errors import describe_validation_error
from hooks.resources import gateway, labels, names, shared
from hooks.resources.context import RenderContext

LLMSERVICE = f"LLMService.{API_VERSION}"
CONFIGMAP = "ConfigMap.v1"
RBAC_API_VERSION = "rbac.authorization.k8s.io/v1"
ROLEBINDING = f"RoleBinding.{RBAC_API_VERSION}"
# A namespace is enabled for LLMGateways by this RoleBinding of this ClusterRole (ConfigMap write) to
# Metacontroller: metacontroller/llmgateway-namespace/rolebinding.yaml, or the chart's
# llmGateway.namespaces. Its presence is the signal, read as a related object.
NAMESPACE_ROLEBINDING = "noctaya-llmgateway"
NAMESPACE_CLUSTERROLE = "noctaya-metacontroller-llmgateway"
ENABLE_DOCS = 'docs/install.md, "Enabling a namespace for LLMGateways"'

ACCEPTED = "Accepted"
MEMBERS_ACCEPTED = "MembersAccepted"


class GatewayReason(StrEnum):
    ACCEPTED = "Accepted"
    INVALID_SPEC = "InvalidSpec"
    ALL_MEMBERS_ACCEPTED = "AllMembersAccepted"
    NOT_EVALUATED = "NotEvaluated"
    NAMESPACE_NOT_ENABLED = "NamespaceNotEnabled"
    # Membership problems, most pressing first (the condition's reason is the first that applies).
    INVALID_MEMBER = "InvalidMember"
    RUNTIME_NOT_RESOLVED = "RuntimeNotResolved"
    DUPLICATE_SERVED_NAME = "DuplicateServedName"
    TOO_MANY_MODELS = "TooManyModels"
    NO_KEY_OPENS = "NoKeyOpens"


_PROBLEM_ORDER = (GatewayReason.INVALID_MEMBER, GatewayReason.RUNTIME_NOT_RESOLVED,
                  GatewayReason.DUPLICATE_SERVED_NAME, GatewayReason.TOO_MANY_MODELS, GatewayReason.NO_KEY_OPENS)


def customize(request: dict[str, Any], config: HookConfig | None = None) -> dict[str, Any]:
    """Every LLMService of the gateway's namespace, and every InferenceRuntime.

    Both with an empty selector, on purpose. Metacontroller caches this answer per (parent UID,
    generation), so it may depend on the gateway's spec only, and membership is in the members' specs:
    a new member must be seen without a new gateway generation. LLMServices carry no label naming
    their gateway to select on. Runtimes likewise: which ones the members need changes with the
    members, and runtimes are few, cluster-scoped configuration objects.

    Also the RoleBinding that enables the namespace (by name): whether Metacontroller may write the
    routing ConfigMap here. The hook server has no API credentials to ask the API server itself, and
    a related object re-syncs the gateway as soon as the RoleBinding is created."""
    parent = obs.require_object(request, "parent")
    namespace = namespace_of(parent)
    return {"relatedResources": [
        {"apiVersion": API_VERSION, "resource": "llmservices", "namespace": namespace, "labelSelector": {}},
        {"apiVersion": API_VERSION, "resource": "inferenceruntimes", "labelSelector": {}},
        {"apiVersion": RBAC_API_VERSION, "resource": "rolebindings", "namespace": namespace,
         "names": [NAMESPACE_ROLEBINDING]},
    ]}


# --- membership -----------------------------------------------------------------------------------


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _meta(obj: dict[str, Any]) -> dict[str, Any]:
    return _dict(obj.get("metadata"))


def is_member(obj: dict[str, Any], gateway_name: str, namespace: str) -> bool:
    """The raw object names this gateway (whether or not the rest of its spec parses)."""
    endpoint = _dict(_dict(obj.get("spec")).get("endpoint"))
    return endpoint.get("gateway") == gateway_name and (_meta(obj).get("namespace") or namespace) == namespace


def raw_served_name(obj: dict[str, Any]) -> str:
    """The served name as the raw object gives it (model.servedName, else its name)."""
    served = _dict(_dict(obj.get("spec")).get("model")).get("servedName")
    return served if isinstance(served, str) and served else str(_meta(obj).get("name", ""))


def members_of(observed: obs.Observed, gateway_name: str, namespace: str) -> list[dict[str, Any]]:
    """The LLMServices naming this gateway, but those being deleted (they leave the table at once)."""
    return [o for o in observed.related_objects(LLMSERVICE)
            if is_member(o, gateway_name, namespace) and not _meta(o).get("deletionTimestamp")]


@dataclass(frozen=True)
class Candidate:
    """One member's entry, freshly computed or kept from the observed table."""

    service: str
    created: str
    entry: dict[str, Any]
    balancing: dict[str, Any] = field(default_factory=dict)  # its balancing.json entry (empty: none)

    @property
    def served(self) -> str:
        return str(self.entry["name"])


@dataclass
class Membership:
    routed: list[Candidate] = field(default_factory=list)
    problems: list[tuple[GatewayReason, str]] = field(default_factory=list)


def previous_models(status: Any) -> list[dict[str, str]]:
    """status.models as a previous sync wrote it, entry by entry skipping anything malformed."""
    items = _dict(status).get("models")
    out = []
    for item in items if isinstance(items, list) else []:
        if isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("service"), str):
            out.append({"name": item["name"], "service": item["service"]})
    return out


def observed_entries(configmap: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The entries of the observed routing ConfigMap by served name (none when it does not parse)."""
    raw = _dict(_dict(configmap).get("data")).get(shared.MODELS_FILE)
    try:
        doc = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        return {}
    models = _dict(doc).get("models")
    return {e["name"]: e for e in models if isinstance(e, dict) and isinstance(e.get("name"), str)} \
        if isinstance(models, list) else {}


def observed_balancing(configmap: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The observed ConfigMap's balancing.json by served name, each entry with the gateway's known keys
    only (none when it is absent or does not parse): what a member that stops parsing keeps."""
    raw = _dict(_dict(configmap).get("data")).get(BALANCING_FILE)
    try:
        doc = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        return {}
    return {name: {k: v for k, v in entry.items() if k in BALANCING_FIELDS}
            for name, entry in _dict(_dict(doc).get("models")).items() if isinstance(entry, dict)}


def scaled_object_of(namespace: str, service: str) -> str:
    """`<namespace>/<name>` of a member's ScaledObject (hooks.resources.autoscaling names it so): what
    KEDA sends the scaler with every call, unchanged by a change of served name."""
    return f"{namespace}/{names.scaled_object(service)}"


def fresh_candidate(raw: dict[str, Any], observed: obs.Observed, namespace: str,
                    config: HookConfig) -> tuple[Candidate | None, tuple[GatewayReason, str] | None]:
    """A member's entry computed from its spec and runtime, or why it cannot be."""
    name = str(_meta(raw).get("name", ""))
    service, error = parse_service(raw)
    if service is None:
        return None, (GatewayReason.INVALID_MEMBER, f"LLMService {name} is invalid: {error}")
    if service.spec.cache.strategy == "BakedImage":  # its own sync renders no backend for it
        return None, (GatewayReason.INVALID_MEMBER, f"LLMService {name}: cache.strategy BakedImage is not implemented")
    resolution = resolve_runtime(service, observed)
    if resolution.runtime is None:
        return None, (GatewayReason.RUNTIME_NOT_RESOLVED, f"LLMService {name}: {resolution.message}")
    ctx = RenderContext(service=service, runtime=resolution.runtime, namespace=namespace, config=config)
    entry = gateway.model_settings(ctx).table_entry(service.served_name, member=name,
                                                    scaled_object=scaled_object_of(namespace, name))
    return Candidate(name, str(_meta(raw).get("creationTimestamp") or ""), entry,
                     shared.member_balancing(service.spec.endpoint.balancing)), None


def gather(gw: LLMGateway, namespace: str, observed: obs.Observed, previous_status: Any,
           config: HookConfig) -> Membership:
    """Which members are routed, with which entries, and what is wrong with the others."""
    out = Membership()
    was_served = {m["service"]: m["name"] for m in previous_models(previous_status)}
    routes = observed.child(CONFIGMAP, names.shared_routes(gw.metadata.name))
    old_entries, old_balancing = observed_entries(routes), observed_balancing(routes)
    candidates: list[Candidate] = []
    for raw in members_of(observed, gw.metadata.name, namespace):
        fresh, problem = fresh_candidate(raw, observed, namespace, config)
        if fresh is not None:
            candidates.append(fresh)
            continue
        assert problem is not None
        name = str(_meta(raw).get("name", ""))
        old = old_entries.get(was_served.get(name) or raw_served_name(raw))
        kept = "its previous entry is kept" if old is not None else "it is not routed (it never was)"
        out.problems.append((problem[0], f"{problem[1]}; {kept}"))
        if old is not None:  # a kept entry is this member's (one written before 0.2.0 learns it is)
            candidates.append(Candidate(name, str(_meta(raw).get("creationTimestamp") or ""),
                                        {**old, MEMBER_FIELD: name, SCALED_OBJECT_FIELD: scaled_object_of(namespace, name)},
                                        old_balancing.get(str(old["name"]), {})))
    by_name: dict[str, list[Candidate]] = {}
    for c in candidates:
        by_name.setdefault(c.served, []).append(c)
    winners = []
    for served in sorted(by_name):
        first, *rest = sorted(by_name[served], key=lambda c: (c.created, c.service))
        winners.append(first)
        for c in rest:
            out.problems.append((GatewayReason.DUPLICATE_SERVED_NAME,
                                 f"LLMService {c.service} serves {served!r} like the older {first.service}: not routed"))
    if gw.spec.api_keys:
        # Fail closed: with keys on the gateway, a model none of them opens is not served to everyone.
        closed = [c for c in winners if not shared.key_files_for(gw.spec, c.served)]
        if closed:
            out.problems.append((GatewayReason.NO_KEY_OPENS, "no API key opens "
                                 + ", ".join(f"{c.served} ({c.service})" for c in closed)
                                 + ": not routed (add the model to a key's models, or a key without models)"))
            winners = [c for c in winners if c not in closed]
    winners = within_model_limit(winners, was_served, out)
    out.routed = [dataclasses.replace(c, entry=shared.with_keys(gw.spec, c.entry)) for c in winners]
    return out


def within_model_limit(winners: list[Candidate], was_served: dict[str, str], out: Membership) -> list[Candidate]:
    """At most MAX_MODELS, in served-name order. A full table never evicts a routed model: members
    routed before (the previous status.models, which this hook wrote) keep their place, newcomers get
    what is left, oldest first (creationTimestamp, then name), and the rest are reported."""
    if len(winners) <= MAX_MODELS:
        return winners
    by_claim = sorted(winners, key=lambda c: (c.service not in was_served, c.created, c.service))
    kept = {id(c) for c in by_claim[:MAX_MODELS]}
    dropped = sorted(by_claim[MAX_MODELS:], key=lambda c: c.served)
    out.problems.append((GatewayReason.TOO_MANY_MODELS,
                         f"a gateway fronts at most {MAX_MODELS} models; not routed: "
                         + ", ".join(f"{c.served} ({c.service})" for c in dropped)))
    return [c for c in winners if id(c) in kept]


def members_condition(membership: Membership) -> st.Cond:
    if not membership.problems:
        return st.Cond(MEMBERS_ACCEPTED, "True", GatewayReason.ALL_MEMBERS_ACCEPTED,
                       f"{len(membership.routed)} model(s) routed")
    problems = sorted(membership.problems, key=lambda p: _PROBLEM_ORDER.index(p[0]))
    text = f"{len(membership.routed)} model(s) routed; " + "; ".join(p[1] for p in problems)
    return st.Cond(MEMBERS_ACCEPTED, "False", problems[0][0], st.short(text))


# --- the namespace's RoleBinding ------------------------------------------------------------------


def namespace_problem(observed: obs.Observed, namespace: str) -> str | None:
    """Why Metacontroller may not write the routing ConfigMap in this namespace, or None.

    None also when the request carries no RoleBinding group at all: customize asked for none (an
    answer Metacontroller cached from before this rule existed, or offline rendering), so nothing is
    known and the gateway is rendered as before. Metacontroller sends the group, empty or not, for
    every rule of the customize answer."""
    if not obs.has_group(observed.related, ROLEBINDING):
        return None
    binding = next((b for b in observed.related_objects(ROLEBINDING)
                    if _meta(b).get("name") == NAMESPACE_ROLEBINDING
                    and (_meta(b).get("namespace") or namespace) == namespace
                    and not _meta(b).get("deletionTimestamp")), None)
    wanted = f"RoleBinding {NAMESPACE_ROLEBINDING} of ClusterRole {NAMESPACE_CLUSTERROLE} to Metacontroller"
    if binding is None:
        return (f"namespace {namespace} is not enabled for LLMGateways: Metacontroller may write the routing "
                f"ConfigMap only where a {wanted} exists; create it ({ENABLE_DOCS})")
    ref = _dict(binding.get("roleRef"))
    if (ref.get("kind"), ref.get("name")) != ("ClusterRole", NAMESPACE_CLUSTERROLE):
        return (f"namespace {namespace} is not enabled for LLMGateways: RoleBinding {NAMESPACE_ROLEBINDING} "
                f"refers to {ref.get('kind')} {ref.get('name')}, not ClusterRole {NAMESPACE_CLUSTERROLE}; "
                f"replace it (roleRef cannot be changed) with a {wanted} ({ENABLE_DOCS})")
    return None


# --- sync -----------------------------------------------------------------------------------------


def parse_gateway(parent: dict[str, Any]) -> tuple[LLMGateway | None, str]:
    try:
        return LLMGateway.model_validate({k: v for k, v in parent.items() if k != "status"}), ""
    except ValidationError as exc:
        return None, describe_validation_error(exc)


def _raw_replicas(parent: dict[str, Any]) -> int:
    value = _dict(parent.get("spec")).get("replicas")
    return value if isinstance(value, int) and not isinstance(value, bool) else 1


def ready_condition(observed: obs.Observed, gateway_name: str, multi: bool) -> st.Cond:
    """Ready: the per-model gateway's own readiness rule, over the shared gateway's Deployments."""
    cond = st.gateway_condition(observed.child(obs.DEPLOYMENT, names.shared_gateway(gateway_name)),
                                observed.child(obs.DEPLOYMENT, names.shared_aggregator(gateway_name)), multi)
    return dataclasses.replace(cond, type=ConditionType.READY)


def children(ctx: shared.SharedContext, routed: list[Candidate], observed: obs.Observed) -> list[dict[str, Any]]:
    out = [
        shared.deployment(ctx),
        shared.public_service(ctx),
        shared.scaler_service(ctx),
        shared.routes_configmap(ctx, [c.entry for c in routed], {c.served: c.balancing for c in routed}),
        *shared.identity(ctx),
    ]
    if ctx.multi_gateway:
        out.append(shared.aggregator_deployment(ctx, member_demand_cap(routed)))
        out.append(shared.gateway_pdb(ctx))
        out.append(shared.token_secret(ctx, observed.child(obs.SECRET, names.shared_token(ctx.name))))
    return out


def member_demand_cap(routed: list[Candidate]) -> int:
    """What the aggregator caps one member's demand figure at: the largest maxQueue of any routed model."""
    demand = max((int(c.entry.get(gateway.TABLE_KEYS["max_queue"], 0)) for c in routed), default=0)
    return demand or int(Endpoint.model_fields["max_queue"].default)


def sync(request: dict[str, Any], config: HookConfig | None = None) -> dict[str, Any]:
    """CompositeController sync (hook version v2)."""
    parent = obs.require_object(request, "parent")
    cfg = resolve(config)
    observed = obs.observe(request)
    meta = _meta(parent)
    name = str(meta["name"])
    namespace = namespace_of(parent)
    generation = meta.get("generation") if isinstance(meta.get("generation"), int) else None
    previous_status = parent.get("status")
    status: dict[str, Any] = {} if generation is None else {"observedGeneration": generation}
    status["url"] = shared.url(name, namespace, cfg)

    gw, error = parse_gateway(parent)
    if gw is None:
        # Keep everything as it is: the table and the Pods already serving the members.
        conds = [
            st.Cond(ACCEPTED, "False", GatewayReason.INVALID_SPEC,
                    st.short(f"spec is invalid, existing children are kept unchanged: {error}")),
            st.Cond(MEMBERS_ACCEPTED, "Unknown", GatewayReason.NOT_EVALUATED,
                    "not evaluated: the spec is invalid"),
            dataclasses.replace(ready_condition(observed, name, _raw_replicas(parent) > 1), status="False",
                                reason=GatewayReason.INVALID_SPEC,
                                message="the spec is invalid (see Accepted); existing children are kept unchanged"),
        ]
        return _kept_answer(status, conds, observed, previous_status, generation, cfg)
    problem = namespace_problem(observed, namespace)
    if problem is not None:
        conds = [
            st.Cond(ACCEPTED, "False", GatewayReason.NAMESPACE_NOT_ENABLED,
                    st.short(f"{problem}; existing children are kept unchanged")),
            st.Cond(MEMBERS_ACCEPTED, "Unknown", GatewayReason.NOT_EVALUATED,
                    "not evaluated: the namespace is not enabled for LLMGateways (see Accepted)"),
            not_enabled_ready_condition(observed, name, gw.spec.replicas > 1),
        ]
        return _kept_answer(status, conds, observed, previous_status, generation, cfg)

    ctx = shared.SharedContext(gateway=gw, namespace=namespace, config=cfg, uid=str(meta.get("uid") or ""),
                               # An older controller manifest (an upgrade in progress) does not manage them.
                               gateway_identity=observed.lists_children(*obs.IDENTITY_CHILD_RESOURCES))
    membership = gather(gw, namespace, observed, previous_status, cfg)
    models = [{"name": c.served, "service": c.service} for c in membership.routed]
    settled = settle_rollout(gw, parent, observed, children(ctx, membership.routed, observed),
                             members_of(observed, name, namespace), member_demand_cap(membership.routed), cfg)
    conds = [
        st.Cond(ACCEPTED, "True", GatewayReason.ACCEPTED, _accepted_message(gw.spec)),
        members_condition(membership),
        ready_condition(observed, name, ctx.multi_gateway),
        settled.condition,
    ]
    if settled.pending is not None:
        status["pendingUpgrade"] = settled.pending
    return _answer(status, models, conds, settled.children, previous_status, generation, cfg)


ROLLED = {labels.GATEWAY: False, labels.AGGREGATOR: False}  # component → is an engine (never, here)


def _member_warm(member: dict[str, Any]) -> bool:
    """A member whose backend has replicas (its own status, as its sync wrote it)."""
    replicas = _dict(member.get("status")).get("replicas")
    return isinstance(replicas, int) and replicas > 0


def _member_min(member: dict[str, Any]) -> int:
    value = _dict(_dict(member.get("spec")).get("scaling")).get("min")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def settle_rollout(gw: LLMGateway, parent: dict[str, Any], observed: obs.Observed, kids: list[dict[str, Any]],
                   members: list[dict[str, Any]], demand_cap: int, cfg: HookConfig) -> rollout.Settled:
    """The shared gateway's Pods take Noctaya's own changes only while every member is at zero (nothing
    is held or streaming through them then), in a window, or on approval (hooks.controller.rollout).
    Their inputs: the LLMGateway's spec; the aggregator's also the demand cap its members give it."""
    spec = rollout.plain(gw.spec)
    spec.pop("upgrades", None)

    def annotate(child: dict[str, Any]) -> dict[str, Any]:
        if child.get("kind") != "Deployment":
            return child
        aggregator = child["metadata"]["name"] == names.shared_aggregator(gw.metadata.name)
        return rollout.with_inputs(child, rollout.inputs_digest(spec=spec, demandCap=demand_cap if aggregator else None))

    kids = [annotate(c) for c in kids]
    facts = rollout.Facts(upgrades=gw.spec.upgrades or Upgrades(), warm=any(_member_warm(m) for m in members),
                          approval=rollout.approval_of(parent), min_replicas=max(map(_member_min, members), default=0),
                          now=lambda: rollout.parse_clock(cfg.clock()))
    return rollout.settle(kids, rollout.candidates_of(kids, observed, ROLLED), facts, rollout.spec_seen(parent),
                          what="every model it routes")


def _accepted_message(spec: LLMGatewaySpec) -> str:
    keys = f"{len(spec.api_keys)} API key(s)" if spec.api_keys else "no API keys (no model asks for one)"
    return f"{spec.replicas} gateway replica(s), {keys}"


def not_enabled_ready_condition(observed: obs.Observed, gateway_name: str, multi: bool) -> st.Cond:
    """Ready in a namespace not enabled: True while the kept gateway still serves (its last table),
    else False NamespaceNotEnabled rather than Progressing, since nothing moves until it is enabled."""
    cond = ready_condition(observed, gateway_name, multi)
    if cond.status == "True":
        return cond
    return dataclasses.replace(cond, status="False", reason=GatewayReason.NAMESPACE_NOT_ENABLED,
                               message=f"the namespace is not enabled for LLMGateways (see Accepted): {cond.message}")


def _kept_answer(status: dict[str, Any], conds: list[st.Cond], observed: obs.Observed, previous_status: Any,
                 generation: int | None, cfg: HookConfig) -> dict[str, Any]:
    """Every observed child as last applied, and the models the previous status listed: the table and
    the Pods already serving the members stay as they are (a member's finalizer waits on that list)."""
    kept = [obs.kept(o) for o in observed.children.values()]
    return _answer(status, previous_models(previous_status), conds, kept, previous_status, generation, cfg)


def _answer(status: dict[str, Any], models: list[dict[str, str]], conds: list[st.Cond],
            kids: list[dict[str, Any]], previous_status: Any, generation: int | None,
            cfg: HookConfig) -> dict[str, Any]:
    status["modelCount"] = len(models)
    status["models"] = models
    status["conditions"] = st.wire_conditions(conds, previous_status, generation, cfg.clock)
    return {"status": status, "children": kids, "resyncAfterSeconds": 0.0, "finalized": False}
