"""The Job that stages weights in the cache, the serving Pod's marker wait, and what the observed
Job says.

With `cache.prewarm` a short-lived Job (`python -m prewarm hub`) downloads `model.source` at
`model.revision` into the cache with the hub's own client; an `oci://` source is always staged by one
(`python -m prewarm oci`, pinned by digest, links and escaping paths refused). Either verifies every
file and promotes it with one rename before writing the readiness marker (paths: `prewarm.layout`,
shared with the Job). Serving Pods load that directory offline, carry no hub or registry credentials,
and start only behind an init container that waits for the marker. The Job requests no accelerator; where the cache lives on
one node (NodeLocalPVC, HostPath) it is placed like the backend, so the weights land where the
backend will run.

Jobs are create-once (their Pod template is immutable): the Job is named after the source and
revision it stages, so a new revision is a new Job beside the old one, and its desired spec is hashed
into an annotation so a different spec for the same revision is reported, not silently ignored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hooks.api.common import pull_secret_names
from hooks.resources import gateway, labels, names
from hooks.resources.cache import SPEC_HASH, spec_hash
from hooks.resources.context import RenderContext
from hooks.runtime import pod, vendors
from prewarm.layout import ModelDir

JOB_CONTAINER = "prewarm"
WAIT_CONTAINER = "wait-for-weights"
BACKOFF_LIMIT = 3  # four attempts; each resumes nothing (a leftover .partial is removed first)
ACTIVE_DEADLINE_SECONDS = 6 * 3600  # a 100 GB model over a slow link, with room; then PrewarmFailed
JOB_RESOURCES = {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}
WAIT_RESOURCES = {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}}
TMP_SIZE = "1Gi"
# Settings a user gives the engine for reaching the hub (a mirror, a proxy) apply to the Job too.
PASSED_THROUGH_ENV = ("HF_ENDPOINT", "MODELSCOPE_ENDPOINT", "HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY",
                      "https_proxy", "http_proxy", "no_proxy", "HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT")


REGISTRY_DIR = "/var/run/noctaya/registry"
REGISTRY_CONFIG = "config.json"


def applies(ctx: RenderContext) -> bool:
    """Weights staged by a Job: hub sources with `cache.prewarm`, oci:// always (an engine cannot
    pull an artifact; the schema requires a persistent cache for both)."""
    source = ctx.service.spec.model.parsed
    return source.scheme == "oci" or (ctx.service.spec.cache.prewarm and source.is_hub)


def model_dir(ctx: RenderContext) -> ModelDir:
    return ModelDir.of(ctx.runtime.spec.cache_mount_path, ctx.service.spec.model.source,
                       pod.model_revision(ctx.service) or None)


def job_name(ctx: RenderContext) -> str:
    staged = model_dir(ctx)
    return names.child_name(ctx.name, f"prewarm-{names.stable_hash(f'{staged.source}@{staged.revision}')}")


def _env(name: str, value: str) -> dict[str, str]:
    return {"name": name, "value": value}


def _passed_through(ctx: RenderContext) -> list[dict[str, Any]]:
    chosen: dict[str, dict[str, Any]] = {}
    for var in [*ctx.runtime.spec.env, *ctx.service.spec.runtime.env]:
        if var.name in PASSED_THROUGH_ENV:
            chosen[var.name] = var.wire()
    return list(chosen.values())


def _credentials(ctx: RenderContext) -> list[dict[str, Any]]:
    cred = ctx.service.spec.model.credentials_secret
    if cred is None:
        return []
    scheme = ctx.service.spec.model.parsed.scheme
    if scheme == "oci":
        # A kubernetes.io/dockerconfigjson Secret, mounted as a file (registry_volume); its name is
        # given so a missing Secret is reported by name (scaler.secretfiles).
        return [_env("NOCTAYA_CREDENTIALS_SECRET", cred.name),
                _env("NOCTAYA_REGISTRY_CONFIG_FILE", f"{REGISTRY_DIR}/{REGISTRY_CONFIG}")]
    return [
        # The name only, for error messages; the value comes from the Secret, never from args.
        _env("NOCTAYA_CREDENTIALS_SECRET", cred.name),
        pod.hub_token_env(ctx.service),
    ]


def _placement(ctx: RenderContext) -> dict[str, Any]:
    """Where the cache is one node's: only nodes the backend can use (else anywhere). The backend's
    selector and tolerations; and since the Job requests no accelerator, which alone keeps the backend
    off nodes without one, the vendor's node labels (a runtime that tolerates the GPU taint but names
    no selector would otherwise let the Job, and with it the weights and the backend pinned to them,
    land on a CPU node)."""
    if ctx.service.spec.cache.strategy not in ("NodeLocalPVC", "HostPath"):
        return {}
    place = vendors.placement(ctx.runtime.spec.accelerator, ctx.service.spec.resources.accelerators)
    out: dict[str, Any] = {}
    if place.node_selector:
        out["nodeSelector"] = dict(sorted(place.node_selector.items()))
    if place.node_affinity_terms:
        out["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": place.node_affinity_terms}}}
    if place.tolerations:
        out["tolerations"] = place.tolerations
    return out


def _registry_volume(ctx: RenderContext) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    cred = ctx.service.spec.model.credentials_secret
    if cred is None or ctx.service.spec.model.parsed.scheme != "oci":
        return [], []
    return ([{"name": "registry-credentials", "secret": {
                "secretName": cred.name, "items": [{"key": cred.key or ".dockerconfigjson", "path": REGISTRY_CONFIG}],
                # optional: the Job's Pod starts and says which Secret is missing, for SecretNotFound.
                "defaultMode": 0o440, "optional": True}}],
            [{"name": "registry-credentials", "mountPath": REGISTRY_DIR, "readOnly": True}])


def job(ctx: RenderContext, cache_volume: dict[str, Any]) -> dict[str, Any]:
    staged = model_dir(ctx)
    mount_path = ctx.runtime.spec.cache_mount_path
    if staged.scheme == "oci":
        command = ["python", "-m", "prewarm", "oci", "--source", staged.source, "--cache-dir", mount_path]
    else:
        command = ["python", "-m", "prewarm", "hub", "--source", staged.source, "--revision", staged.revision,
                   "--cache-dir", mount_path]
    registry_volumes, registry_mounts = _registry_volume(ctx)
    container = {
        "name": JOB_CONTAINER,
        "image": ctx.config.image,
        "imagePullPolicy": ctx.config.image_pull_policy,
        "command": command,
        "env": [
            _env("HF_HOME", "/tmp/huggingface"),
            _env("MODELSCOPE_CACHE", "/tmp/modelscope"),
            # No device plugin, no accelerator library: the download must not touch either.
            _env("TORCH_DEVICE_BACKEND_AUTOLOAD", "0"),
            _env("CUDA_VISIBLE_DEVICES", ""),
            _env("HF_HUB_DISABLE_TELEMETRY", "1"),
            _env("PYTHONDONTWRITEBYTECODE", "1"),
            _env("PYTHONUNBUFFERED", "1"),
            *_passed_through(ctx),
            *_credentials(ctx),
        ],
        "resources": JOB_RESOURCES,
        "securityContext": gateway.restricted_container_security(),
        "volumeMounts": [{"name": pod.CACHE_VOLUME, "mountPath": mount_path},
                         {"name": "tmp", "mountPath": "/tmp"}, *registry_mounts],
    }
    pull = pull_secret_names(ctx.service.spec.image_pull_secrets)
    pod_spec: dict[str, Any] = {
        **({"imagePullSecrets": pull} if pull else {}),
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": gateway.RUN_AS,
            "runAsGroup": gateway.RUN_AS,
            "fsGroup": gateway.RUN_AS,  # the claim becomes writable to the downloader
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        **_placement(ctx),
        "containers": [container],
        "volumes": [{"name": pod.CACHE_VOLUME, **cache_volume},
                    {"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE}}, *registry_volumes],
    }
    spec: dict[str, Any] = {
        "backoffLimit": BACKOFF_LIMIT,
        "activeDeadlineSeconds": ACTIVE_DEADLINE_SECONDS,
        "template": {"metadata": {"labels": labels.labels(ctx.name, labels.PREWARM)}, "spec": pod_spec},
    }
    # The hash covers what the Job does and where, not the image: a Noctaya upgrade is no conflict. Nor
    # the vendor's node labels (derived, not the user's; added in 0.2.0): a Job an older release created
    # without them is no conflict either.
    hashed_pod = {k: v for k, v in pod_spec.items() if k != "affinity"}
    hashed = {**spec, "template": {**spec["template"], "spec": {**hashed_pod, "containers": [
        {k: v for k, v in container.items() if k not in ("image", "imagePullPolicy")}]}}}
    meta = ctx.metadata(job_name(ctx), labels.PREWARM, {SPEC_HASH: spec_hash(hashed)})
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": spec}


# The marker wait, in POSIX sh: it runs from the engine's own image (every engine image has a shell),
# so a Noctaya upgrade (a new image tag) leaves the backend's Pod template, and with it every serving
# Pod on an accelerator, exactly as it is. The weights are staged before the backend exists, so the
# marker is normally there at once; the timeout only bounds a Pod on a node without them (the kubelet
# then restarts it with backoff, the message says why).
WAIT_TIMEOUT_SECONDS = 600
WAIT_INTERVAL_SECONDS = 2
WAIT_SCRIPT = """\
marker="$1"; dir="$2"; source="$3"; revision="$4"; job="$5"; timeout="$6"
ready() {
  [ -d "$dir" ] && [ -s "$marker" ] || return 1
  text=""
  while IFS= read -r line || [ -n "$line" ]; do text="$text$line"; done < "$marker"
  case "$text" in *"\\"$source\\""*) ;; *) return 1 ;; esac
  case "$text" in *"\\"$revision\\""*) return 0 ;; esac
  return 1
}
case "$source" in *"@$revision") what="$source" ;; *) what="$source@$revision" ;; esac
if ready; then echo "$what is in the cache; starting the engine"; exit 0; fi
echo "waiting for $what: the prewarm Job $job writes $marker once every file is verified (kubectl logs -f job/$job shows its progress)"
waited=0
while [ "$waited" -lt "$timeout" ]; do
  sleep @INTERVAL@
  waited=$((waited + @INTERVAL@))
  if ready; then echo "$what is in the cache after $waited s; starting the engine"; exit 0; fi
  if [ $((waited % 60)) -eq 0 ]; then echo "still waiting for $what ($waited s so far)"; fi
done
said="$what is not in the cache on this node after $timeout s: the prewarm Job $job staged it elsewhere or not at all (kubectl describe job $job)"
echo "$said" >&2
echo "$said" > /dev/termination-log 2>/dev/null
exit 1
""".replace("@INTERVAL@", str(WAIT_INTERVAL_SECONDS))


def wait_container(ctx: RenderContext) -> dict[str, Any]:
    """The serving Pod's init container: exits 0 once the pinned revision's marker exists.

    It runs the engine's image (a shell loop), never Noctaya's: see WAIT_SCRIPT."""
    staged = model_dir(ctx)
    spec = ctx.runtime.spec
    container: dict[str, Any] = {"name": WAIT_CONTAINER, "image": spec.image}
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    return {
        **container,
        "command": ["sh", "-c", WAIT_SCRIPT, WAIT_CONTAINER, str(staged.marker), str(staged.final), staged.source,
                    staged.revision, job_name(ctx), str(WAIT_TIMEOUT_SECONDS)],
        "resources": WAIT_RESOURCES,
        "securityContext": {**gateway.restricted_container_security(), "runAsUser": gateway.RUN_AS},
        "volumeMounts": [{"name": pod.CACHE_VOLUME, "mountPath": ctx.runtime.spec.cache_mount_path, "readOnly": True}],
    }


def staged_mount(ctx: RenderContext, mount: pod.CacheMount, weights_node: str | None = None) -> pod.CacheMount:
    """The serving Pods' view of a prewarmed cache: the promoted directory as the model, the marker
    wait in front of the engine, and a SharedPVC read-only (the Job is its only writer; with a
    node-local cache the engine keeps write access for its own compile caches). A HostPath cache is
    pinned to the node the Job staged it on (see weights_node); a NodeLocalPVC's volume pins itself."""
    return dataclasses.replace(
        mount,
        read_only=ctx.service.spec.cache.strategy == "SharedPVC",
        staged_model_path=str(model_dir(ctx).final),
        wait_container=wait_container(ctx),
        node=weights_node if ctx.service.spec.cache.strategy == "HostPath" else None,
    )


# --- where node-local weights are ---------------------------------------------------------------

# Recorded on the backend Deployment once known, so the pin outlives the Job's Pod (garbage-collected
# with its node, or by the Pod GC): which node holds the weights, and which Job put them there.
WEIGHTS_NODE = "serving.noctaya.io/weights-node"
WEIGHTS_JOB = "serving.noctaya.io/weights-job"


def node_local(ctx: RenderContext) -> bool:
    """Weights staged by a Job into a cache that lives on one node."""
    return applies(ctx) and ctx.service.spec.cache.strategy in ("NodeLocalPVC", "HostPath")


def _job_of(p: dict[str, Any]) -> str | None:
    pod_labels = (p.get("metadata") or {}).get("labels") or {}
    return pod_labels.get("batch.kubernetes.io/job-name") or pod_labels.get("job-name")


def weights_node(ctx: RenderContext, pods: list[dict[str, Any]], backend: dict[str, Any] | None) -> str | None:
    """The node a node-local cache holds the current revision on: where the current Job's succeeded
    Pod ran (the freshest fact), else what the observed backend Deployment recorded for this same
    Job; None when the cache is not node-local or nothing says."""
    if not node_local(ctx):
        return None
    name = job_name(ctx)
    ran: list[tuple[str, str, str]] = []
    for p in pods:
        spec, status, meta = p.get("spec") or {}, p.get("status") or {}, p.get("metadata") or {}
        node = spec.get("nodeName")
        if _job_of(p) == name and status.get("phase") == "Succeeded" and isinstance(node, str) and node:
            finished = max((str(((cs.get("state") or {}).get("terminated") or {}).get("finishedAt") or "")
                            for cs in status.get("containerStatuses") or []), default="")
            ran.append((finished, str(meta.get("name") or ""), node))
    if ran:
        return max(ran)[2]
    annotations = ((backend or {}).get("metadata") or {}).get("annotations") or {}
    recorded = annotations.get(WEIGHTS_NODE)
    if annotations.get(WEIGHTS_JOB) == name and isinstance(recorded, str) and recorded:
        return recorded
    return None


def weights_annotations(ctx: RenderContext, node: str | None) -> dict[str, str]:
    return {WEIGHTS_JOB: job_name(ctx), WEIGHTS_NODE: node} if node else {}


@dataclass(frozen=True)
class JobState:
    phase: str  # "running", "succeeded" or "failed"
    reason: str = ""
    message: str = ""
    attempt: int = 1


def job_state(observed: dict[str, Any], pods: list[dict[str, Any]]) -> JobState:
    """What the observed Job says, with the last failed attempt's own words when it failed."""
    status = observed.get("status") or {}
    conds = {c.get("type"): c for c in status.get("conditions") or [] if isinstance(c, dict)}

    def true(kind: str) -> dict[str, Any] | None:
        c = conds.get(kind)
        return c if c is not None and c.get("status") == "True" else None

    failed = status.get("failed") if isinstance(status.get("failed"), int) else 0
    if true("Complete") is not None or true("SuccessCriteriaMet") is not None:
        return JobState("succeeded")
    ended = true("Failed") or true("FailureTarget")
    if ended is not None:
        return JobState("failed", str(ended.get("reason") or "Failed"), _last_words(observed, pods) or
                        str(ended.get("message") or ""), failed)
    return JobState("running", attempt=failed + 1, message=_last_words(observed, pods) if failed else "")


def _last_words(observed: dict[str, Any], pods: list[dict[str, Any]]) -> str:
    """The termination message of this Job's most recent failed attempt (the downloader writes it)."""
    name = (observed.get("metadata") or {}).get("name")
    best: tuple[str, str] | None = None
    for p in pods:
        meta = p.get("metadata") or {}
        pod_labels = meta.get("labels") or {}
        if (pod_labels.get("batch.kubernetes.io/job-name") or pod_labels.get("job-name")) != name:
            continue
        for cs in (p.get("status") or {}).get("containerStatuses") or []:
            if cs.get("name") != JOB_CONTAINER:
                continue
            ended = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated")
            if ended and ended.get("exitCode") not in (0, None):
                words = str(ended.get("message") or ended.get("reason") or "").strip().splitlines()
                stamp = str(ended.get("finishedAt") or "")
                if words and (best is None or stamp > best[0]):
                    best = (stamp, words[-1][:300])
    return best[1] if best else ""
