"""The model cache: the volume serving Pods mount, and the create-once claim behind it.

PVCs are create-once (their spec is mostly immutable): the desired spec is hashed into an
annotation, and a later change is reported as CacheSpecConflict while the existing claim is kept.
The Job that fills the cache (hub prewarm, oci:// staging) is `hooks.resources.prewarm`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from hooks.api.status import Reason
from hooks.resources import labels, names
from hooks.resources.context import RenderContext
from hooks.runtime.pod import CacheMount

SPEC_HASH = "serving.noctaya.io/spec-hash"
PVC_SOURCE_SCRATCH = "1Gi"


@dataclass(frozen=True)
class CachePlan:
    mount: CacheMount
    claim: dict[str, Any] | None  # the PVC child, when the strategy uses one
    status: str  # CacheReady status if nothing observed contradicts it
    reason: Reason
    message: str


def spec_hash(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def claim(ctx: RenderContext) -> dict[str, Any]:
    cache = ctx.service.spec.cache
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteMany" if cache.strategy == "SharedPVC" else "ReadWriteOnce"],
        "resources": {"requests": {"storage": cache.size}},
    }
    if cache.storage_class_name:
        spec["storageClassName"] = cache.storage_class_name
    meta = ctx.metadata(names.cache(ctx.name), labels.CACHE, {SPEC_HASH: spec_hash(spec)})
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": spec}


def plan(ctx: RenderContext) -> CachePlan:
    cache = ctx.service.spec.cache
    source = ctx.service.spec.model.parsed
    if source.scheme == "pvc" and cache.strategy != "HostPath":
        # Pre-staged weights are mounted from their own claim; the cache only holds engine scratch.
        mount = CacheMount({"emptyDir": {"sizeLimit": PVC_SOURCE_SCRATCH}})
        return CachePlan(mount, None, "True", Reason.CACHE_NOT_USED, "pvc:// weights are pre-staged; no cache needed")
    if cache.strategy == "None":
        mount = CacheMount({"emptyDir": {"sizeLimit": cache.size}})
        result = CachePlan(mount, None, "True", Reason.CACHE_NOT_USED, "no cache: weights are fetched on every start")
    elif cache.strategy == "HostPath":
        mount = CacheMount({"hostPath": {"path": cache.host_path, "type": "DirectoryOrCreate"}})
        result = CachePlan(mount, None, "True", Reason.CONFIGURED, f"node directory {cache.host_path}")
    else:  # NodeLocalPVC, SharedPVC (BakedImage is refused before rendering)
        pvc = claim(ctx)
        mount = CacheMount({"persistentVolumeClaim": {"claimName": pvc["metadata"]["name"]}})
        result = CachePlan(mount, pvc, "Unknown", Reason.PROGRESSING, f"claim {pvc['metadata']['name']} not bound yet")
    return result
