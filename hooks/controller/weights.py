"""Where a model's weights come from, for one sync: the cache claim, the prewarm Job that stages them,
the node that then holds them, and the CacheReady condition all of it adds up to.

CacheReady is decided by rules applied in order, each over the one before: what the cache strategy
promises (``cache.plan``), what the observed claim says (bound, lost, pending, or created from another
spec), what the prewarm Job says (more than the claim it binds), whether the backend can reach the
node holding the weights, and a note when a one-node claim meets several replicas. Claims and Jobs are
create-once: an observed one is kept exactly as it is, whatever the spec says now.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hooks.api.status import ConditionType, Reason
from hooks.controller import observe as obs
from hooks.controller import status as st
from hooks.resources import cache, labels, prewarm
from hooks.resources.context import RenderContext
from hooks.runtime.pod import CacheMount


@dataclass(frozen=True)
class WeightsPlan:
    mount: CacheMount  # what the backend mounts (the staged directory once a Job staged it)
    node: str | None  # the one node holding node-local weights, once known
    blocked: bool  # the weights are still being staged: no new backend yet
    condition: st.Cond  # CacheReady
    children: list[dict[str, Any]] = field(default_factory=list)  # the claim, then the Job
    backend_failures: list[tuple[Reason | str, str]] = field(default_factory=list)


def plan(ctx: RenderContext, observed: obs.Observed, observed_backend: dict[str, Any] | None,
         missing: dict[str, str]) -> WeightsPlan:
    """The cache claim and prewarm Job to apply, the backend's mount and CacheReady."""
    cache_plan = cache.plan(ctx)
    mount, staging, job, node = cache_plan.mount, None, None, None
    if prewarm.applies(ctx):
        job, staging = _prewarm_job(ctx, observed, cache_plan.mount.volume, missing)
        # A node-local cache holds the weights on the node the Job ran on: the backend follows them.
        node = prewarm.weights_node(ctx, observed.pods_of(labels.PREWARM), observed_backend)
        mount = prewarm.staged_mount(ctx, mount, node)
        if staging.status == "True" and node is not None:
            staging = dataclasses.replace(staging, message=st.short(f"{staging.message} on node {node}"))
    children: list[dict[str, Any]] = []
    cond = st.Cond(ConditionType.CACHE_READY, cache_plan.status, cache_plan.reason, cache_plan.message)
    if cache_plan.claim is not None:
        claim, cond = _claim(observed, cache_plan.claim, cond, prewarmed=job is not None)
        children.append(claim)
    if job is not None:
        children.append(job)
    cond = _staging_says_more(ctx, cond, staging, cache_plan.claim)
    failures: list[tuple[Reason | str, str]] = []
    unreachable = _weights_unreachable(ctx, node, observed, cache_plan.claim)
    if unreachable is not None and cond.status == "True":
        cond = st.Cond(ConditionType.CACHE_READY, "False", st.WEIGHTS_NODE_UNAVAILABLE, unreachable)
        failures.append((st.WEIGHTS_NODE_UNAVAILABLE, unreachable))
    blocked = staging is not None and staging.status != "True"
    return WeightsPlan(mount, node, blocked, _one_node_note(ctx, cond), children, failures)


def _claim(observed: obs.Observed, desired: dict[str, Any], cond: st.Cond,
           prewarmed: bool) -> tuple[dict[str, Any], st.Cond]:
    """The claim to apply (create-once: an observed one kept as it is) and what it says of the cache."""
    existing = observed.child(obs.PVC, desired["metadata"]["name"])
    if existing is None:
        return desired, cond
    return obs.kept(existing), _claim_condition(existing, desired, cond, prewarmed)


def _claim_condition(existing: dict[str, Any], desired: dict[str, Any], cond: st.Cond, prewarmed: bool) -> st.Cond:
    t, name = ConditionType.CACHE_READY, desired["metadata"]["name"]
    want = desired["metadata"]["annotations"][cache.SPEC_HASH]
    have = ((existing.get("metadata") or {}).get("annotations") or {}).get(cache.SPEC_HASH)
    if have != want:
        return st.Cond(t, "False", Reason.CACHE_SPEC_CONFLICT,
                       f"claim {name} was created from a different cache spec; claims cannot change: "
                       "restore the previous size/class/strategy or delete the claim to recreate it")
    if cond.reason == Reason.NOT_IMPLEMENTED:
        return cond
    phase = (existing.get("status") or {}).get("phase")
    if phase == "Bound":
        return st.Cond(t, "True", Reason.AVAILABLE, f"claim {name} bound")
    if phase == "Lost":
        return st.Cond(t, "False", Reason.PROGRESSING, f"claim {name} lost its volume")
    # With prewarm the Job is the claim's first consumer: the claim binds (and, on a node-local
    # volume, the weights and later the backend stay) where that Pod runs.
    first = "the prewarm Job's Pod; the backend then runs on that node" if prewarmed else "the first backend Pod"
    return st.Cond(t, "Unknown", Reason.PROGRESSING, f"claim {name} pending (a WaitForFirstConsumer claim binds with {first})")


def _staging_says_more(ctx: RenderContext, cond: st.Cond, staging: st.Cond | None,
                       claim: dict[str, Any] | None) -> st.Cond:
    """The Job's word over the claim's (which it binds), unless the claim conflicts."""
    if staging is None or cond.reason == Reason.CACHE_SPEC_CONFLICT:
        return cond
    claim_pending = claim is not None and cond.reason == Reason.PROGRESSING
    if claim_pending and staging.status != "True" and ctx.service.spec.cache.strategy == "NodeLocalPVC":
        return dataclasses.replace(staging, message=st.short(
            f"{staging.message}; claim {claim['metadata']['name']} binds on the node this Job's Pod "
            "runs on (its first consumer), and the backend will run on that node"))
    return staging


def _one_node_note(ctx: RenderContext, cond: st.Cond) -> st.Cond:
    spec = ctx.service.spec
    if spec.cache.strategy == "NodeLocalPVC" and spec.scaling.max > 1 and cond.status != "False":
        # Not an error (replica 1 is fine), but replicas 2..N share one node's claim: say so where users look.
        return dataclasses.replace(cond, message=st.short(
            f"{cond.message}; note: a NodeLocalPVC claim lives on one node, so extra "
            "replicas must fit on that node: use SharedPVC for scaling.max > 1"))
    return cond


def _weights_unreachable(ctx: RenderContext, node: str | None, observed: obs.Observed,
                         claim: dict[str, Any] | None) -> str | None:
    """Why the backend cannot reach node-local weights, from its own Pods: the scheduler cannot place
    them on the only node that holds the weights (gone, NotReady, cordoned or full)."""
    if node is None:
        return None
    said = st.unschedulable_message(observed.live_pods())
    if said is None:
        return None
    job = prewarm.job_name(ctx)
    where = (f"the cache claim {claim['metadata']['name']}'s volume is on node {node}" if claim is not None
             else f"the HostPath cache holds them on node {node} only")
    return st.short(
        f"the weights staged by Job {job} are on node {node} ({where}) and the backend cannot be scheduled "
        f"there: {said}; if node {node} is gone for good, delete the Job (kubectl delete job {job}) to stage "
        "them again on a node the backend can use")


def _prewarm_job(ctx: RenderContext, observed: obs.Observed, volume: dict[str, Any],
                 missing: dict[str, str]) -> tuple[dict[str, Any], st.Cond]:
    """The prewarm Job (create-once) and the CacheReady it implies; "True" once it succeeded."""
    t = ConditionType.CACHE_READY
    desired = prewarm.job(ctx, volume)
    job_name = desired["metadata"]["name"]
    staged = prewarm.model_dir(ctx)
    what = f"{staged.source}@{staged.revision}"
    existing = observed.child(obs.JOB, job_name)
    if existing is None:
        return desired, st.Cond(t, "Unknown", Reason.PREWARM_RUNNING, f"prewarm Job {job_name} created to stage {what}")
    kept = obs.kept(existing)
    state = prewarm.job_state(existing, observed.pods_of(labels.PREWARM))
    if state.phase == "succeeded":
        # Done is done: a spec that changed since no longer matters for weights already verified.
        return kept, st.Cond(t, "True", Reason.AVAILABLE, f"{what} staged in the cache by Job {job_name}")
    want = desired["metadata"]["annotations"][cache.SPEC_HASH]
    have = ((existing.get("metadata") or {}).get("annotations") or {}).get(cache.SPEC_HASH)
    if have != want:
        return kept, st.Cond(t, "False", Reason.CACHE_SPEC_CONFLICT, st.short(
            f"prewarm Job {job_name} was created from a different spec and Jobs cannot change: delete it "
            f"(kubectl delete job {job_name}) and it is created again; files already staged are kept"))
    if "credentials" in missing:
        return kept, st.Cond(t, "False", Reason.SECRET_NOT_FOUND, st.short(
            f"model.credentialsSecret {missing['credentials']} does not exist: the prewarm Job {job_name} cannot start"))
    if state.phase == "failed":
        said = f": {state.message}" if state.message else ""
        return kept, st.Cond(t, "False", Reason.PREWARM_FAILED, st.short(
            f"prewarm Job {job_name} failed ({state.reason}){said}; delete the Job to try again"))
    last = f"; the last attempt ended: {state.message}" if state.message else ""
    return kept, st.Cond(t, "Unknown", Reason.PREWARM_RUNNING, st.short(
        f"prewarm Job {job_name} is staging {what}, attempt {state.attempt} of {prewarm.BACKOFF_LIMIT + 1} "
        f"(kubectl logs -f job/{job_name} shows bytes, rate and ETA){last}"))
