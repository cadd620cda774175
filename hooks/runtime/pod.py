"""The vendor-neutral serving Pod rendered from an InferenceRuntime plus one LLMService.

Model facts reach the engine through container env and Kubernetes' own `$(VAR)` expansion in
command/args (`--model $(NOCTAYA_MODEL_PATH)`), so runtimes need no template language. The NOCTAYA_*
variables come first in `env`, because Kubernetes expands `$(VAR)` only from variables defined
earlier in the list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hooks.api.common import EnvVar, pull_secret_names
from hooks.api.llmservice import LLMService
from hooks.api.runtime import InferenceRuntime, Probe, RuntimeVolume
from hooks.runtime import drain, scheduling, vendors

CONTAINER_NAME = "engine"
PORT_NAME = "http"
METRICS_PORT_NAME = "metrics"
CACHE_VOLUME = "model-cache"
MODEL_VOLUME = "model"
SHM_VOLUME = "dshm"
DEFAULT_SHM_SIZE = "1Gi"

# Startup probe when the runtime gives none: 10 s × 60 = ten minutes to pull weights and load.
DEFAULT_STARTUP = Probe(path="/health", period_seconds=10, timeout_seconds=5, failure_threshold=60)
DEFAULT_READINESS = Probe(path="/health", period_seconds=5, timeout_seconds=5, failure_threshold=3)
DEFAULT_LIVENESS = Probe(path="/health", period_seconds=10, timeout_seconds=5, failure_threshold=6)


@dataclass(frozen=True)
class CacheMount:
    """The cache volume chosen by the cache strategy (emptyDir, hostPath or a claim), and, when a
    Job stages the weights there, the directory the engine loads and the init container that waits
    for the Job's marker."""

    volume: dict[str, Any]
    read_only: bool = False
    staged_model_path: str | None = None
    wait_container: dict[str, Any] | None = None
    # The node a node-local cache (HostPath) holds the staged weights on: the serving Pods must run there.
    node: str | None = None


# What the gateway polls when the readiness probe is not HTTP: every OpenAI-compatible engine serves it.
FALLBACK_READINESS_PATH = "/v1/models"


def readiness_path(runtime: InferenceRuntime) -> str:
    """The HTTP path the gateway polls before forwarding."""
    probe = runtime.spec.probes.readiness or DEFAULT_READINESS
    return probe.path if probe.type == "HTTP" else FALLBACK_READINESS_PATH


def startup_budget_seconds(runtime: InferenceRuntime) -> int:
    """How long the startup probe lets a replica load before Kubernetes restarts it."""
    p = runtime.spec.probes.startup or DEFAULT_STARTUP
    return p.initial_delay_seconds + p.period_seconds * p.failure_threshold


def model_path(service: LLMService, runtime: InferenceRuntime) -> str:
    """What the engine loads: a hub id (downloaded into HF_HOME / MODELSCOPE_CACHE) or a directory."""
    source = service.spec.model.parsed
    if source.scheme == "pvc":
        return runtime.spec.model_mount_path
    return source.location  # oci:// weights are always staged: the staged path replaces this


def model_revision(service: LLMService) -> str:
    source = service.spec.model.parsed
    if service.spec.model.revision:
        return service.spec.model.revision
    if source.scheme == "hf":
        return "main"
    if source.scheme == "modelscope":
        return "master"
    return ""


def _env(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


def _merge_env(*groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Later groups override earlier ones by name, keeping the first position (so `$(VAR)` order holds)."""
    merged: dict[str, dict[str, Any]] = {}
    for group in groups:
        for var in group:
            merged[var["name"]] = var
    return list(merged.values())


def _wire_env(env: list[EnvVar]) -> list[dict[str, Any]]:
    return [e.wire() for e in env]


def _probe(p: Probe, engine_port: int) -> dict[str, Any]:
    if p.type == "TCP":
        handler: dict[str, Any] = {"tcpSocket": {"port": p.port or PORT_NAME}}
    elif p.type == "Exec":
        handler = {"exec": {"command": list(p.command)}}
    elif p.type == "GRPC":
        # grpc.port must be a number (no port names for gRPC probes).
        handler = {"grpc": {"port": p.port or engine_port, **({"service": p.service} if p.service else {})}}
    else:
        http: dict[str, Any] = {"path": p.path, "port": p.port or PORT_NAME}
        if p.scheme == "HTTPS":
            http["scheme"] = "HTTPS"
        handler = {"httpGet": http}
    probe: dict[str, Any] = {
        **handler,
        "periodSeconds": p.period_seconds,
        "timeoutSeconds": p.timeout_seconds,
        "failureThreshold": p.failure_threshold,
    }
    if p.initial_delay_seconds:
        probe["initialDelaySeconds"] = p.initial_delay_seconds
    return probe


def _credentials_env(service: LLMService, staged: bool) -> list[dict[str, Any]]:
    """Hub tokens projected from the Secret: never in args, status or logs; and never in a Pod
    that loads weights a Job staged (only that Job needs them)."""
    cred = service.spec.model.credentials_secret
    source = service.spec.model.parsed
    if cred is None or not source.is_hub or staged:
        return []
    return [hub_token_env(service)]


def hub_token_env(service: LLMService) -> dict[str, Any]:
    """The hub token variable the hub's client reads, projected from model.credentialsSecret."""
    cred = service.spec.model.credentials_secret
    assert cred is not None
    var = "HF_TOKEN" if service.spec.model.parsed.scheme == "hf" else "MODELSCOPE_API_TOKEN"
    return {"name": var, "valueFrom": {"secretKeyRef": {"name": cred.name, "key": cred.key or "token"}}}


def engine_env(service: LLMService, runtime: InferenceRuntime, mount: CacheMount | None = None) -> list[dict[str, Any]]:
    spec = runtime.spec
    staged_model_path = mount.staged_model_path if mount is not None else None
    # A read-only cache (a prewarmed SharedPVC) cannot hold the hub clients' own files (remote-code
    # modules, locks): those go to the container's writable layer instead.
    cache = "/tmp" if mount is not None and mount.read_only else spec.cache_mount_path
    noctaya = [
        _env("NOCTAYA_MODEL_PATH", staged_model_path or model_path(service, runtime)),
        _env("NOCTAYA_SERVED_NAME", service.served_name),
        _env("NOCTAYA_PORT", str(spec.port)),
        _env("NOCTAYA_ACCELERATORS", str(service.spec.resources.accelerators)),
        _env("NOCTAYA_MODEL_REVISION", model_revision(service)),
        _env("HF_HOME", f"{cache}/huggingface"),
        _env("MODELSCOPE_CACHE", f"{cache}/modelscope"),
    ]
    if staged_model_path is not None:
        # The weights are a local directory: the hub clients must not reach out (the Pod may have
        # no egress at all, and a revision check would only slow the start).
        noctaya.append(_env("HF_HUB_OFFLINE", "1"))
    elif service.spec.model.parsed.scheme == "modelscope" and spec.engine == "vllm":
        noctaya.append(_env("VLLM_USE_MODELSCOPE", "True"))
    place = vendors.placement(spec.accelerator, service.spec.resources.accelerators)
    return _merge_env(
        noctaya,
        place.env,
        _credentials_env(service, staged_model_path is not None),
        _wire_env(spec.env),
        _wire_env(service.spec.runtime.env),
    )


def _resources(service: LLMService, runtime: InferenceRuntime) -> dict[str, Any]:
    res = service.spec.resources
    place = vendors.placement(runtime.spec.accelerator, res.accelerators)
    hints = scheduling.hints(runtime.spec.scheduling, res.accelerators)
    requests: dict[str, str] = {}
    limits: dict[str, str] = {**res.limits}
    if res.cpu is not None:
        requests["cpu"] = res.cpu
    if res.memory is not None:
        requests["memory"] = res.memory
        limits["memory"] = res.memory
    # Extended resources are limits only; Kubernetes defaults their request to the limit.
    limits.update(place.limits)
    limits.update(hints.limits)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = dict(sorted(requests.items()))
    if limits:
        out["limits"] = dict(sorted(limits.items()))
    return out


def runtime_volume_source(volume: RuntimeVolume) -> dict[str, Any]:
    if volume.host_path is not None:
        return {"hostPath": {"path": volume.host_path}}
    if volume.config_map is not None:
        return {"configMap": {"name": volume.config_map}}
    if volume.secret is not None:
        return {"secret": {"secretName": volume.secret}}
    return {"emptyDir": {}}


def container_security(runtime: InferenceRuntime) -> dict[str, Any]:
    """Pod Security `restricted` for the serving container, minus what the runtime relaxes."""
    sec = runtime.spec.security
    out: dict[str, Any] = {
        "allowPrivilegeEscalation": sec.allow_privilege_escalation,
        "capabilities": {"drop": ["ALL"], **({"add": list(sec.add_capabilities)} if sec.add_capabilities else {})},
        "seccompProfile": {"type": sec.seccomp_profile},
    }
    if sec.run_as_user is not None:
        out |= {"runAsNonRoot": True, "runAsUser": sec.run_as_user}
    if sec.run_as_group is not None:
        out["runAsGroup"] = sec.run_as_group
    return out


def node_pin(node: str) -> dict[str, Any]:
    """A required node affinity for one node by its name (metadata.name: a node's hostname label
    need not equal its name)."""
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}


def pod_template(
    service: LLMService,
    runtime: InferenceRuntime,
    pod_labels: dict[str, str],
    cache: CacheMount,
) -> dict[str, Any]:
    """metadata + spec of the backend Pod template. Key order is part of the answer: a resync of an
    unchanged world must return the same bytes."""
    spec = runtime.spec
    hints = scheduling.hints(spec.scheduling, service.spec.resources.accelerators)
    mounts, volumes = _volumes(service, runtime, cache)
    pod_spec: dict[str, Any] = {
        # The engine needs no Kubernetes API, and Service-link env (e.g. VLLM_PORT from a Service
        # named vllm) is known to break engines that read their own env prefix.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": spec.lifecycle.grace_seconds,
        **({"initContainers": [cache.wait_container]} if cache.wait_container is not None else {}),
        "containers": [_engine_container(service, runtime, cache, mounts)],
        "volumes": volumes,
    }
    pull = pull_secret_names(spec.image_pull_secrets, service.spec.image_pull_secrets)
    if pull:
        pod_spec["imagePullSecrets"] = pull
    fs_group = spec.security.fs_group if spec.security.fs_group is not None else spec.security.run_as_user
    if fs_group is not None:
        # Volumes (the cache claim above all) become writable to the non-root engine.
        pod_spec["securityContext"] = {"fsGroup": fs_group}
    pod_spec.update(_placement(service, runtime, hints, cache))
    metadata: dict[str, Any] = {"labels": dict(pod_labels)}
    if hints.annotations:
        metadata["annotations"] = dict(sorted(hints.annotations.items()))
    return {"metadata": metadata, "spec": pod_spec}


def _volumes(service: LLMService, runtime: InferenceRuntime,
             cache: CacheMount) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The engine's volume mounts and the Pod's volumes: cache, pvc:// weights, the runtime's own, shm."""
    spec = runtime.spec
    source = service.spec.model.parsed
    mounts: list[dict[str, Any]] = [
        {"name": CACHE_VOLUME, "mountPath": spec.cache_mount_path, **({"readOnly": True} if cache.read_only else {})}
    ]
    volumes: list[dict[str, Any]] = [{"name": CACHE_VOLUME, **cache.volume}]
    if source.scheme == "pvc":
        mount = {"name": MODEL_VOLUME, "mountPath": spec.model_mount_path, "readOnly": True}
        if source.sub_path:
            mount["subPath"] = source.sub_path
        mounts.append(mount)
        volumes.append({"name": MODEL_VOLUME, "persistentVolumeClaim": {"claimName": source.location, "readOnly": True}})
    for extra in spec.volumes:
        mounts.append({"name": extra.name, "mountPath": extra.mount_path, **({"readOnly": True} if extra.read_only else {})})
        volumes.append({"name": extra.name, **runtime_volume_source(extra)})
    # Always memory-backed: the container runtime's 64Mi /dev/shm breaks PyTorch/NCCL tensor
    # parallelism and data loaders. Pages count toward the memory limit only as they are written.
    mounts.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
    volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size or DEFAULT_SHM_SIZE}})
    return mounts, volumes


def _engine_container(service: LLMService, runtime: InferenceRuntime, cache: CacheMount,
                      mounts: list[dict[str, Any]]) -> dict[str, Any]:
    spec = runtime.spec
    ports = [{"name": PORT_NAME, "containerPort": spec.port, "protocol": "TCP"}]
    if spec.metrics is not None and spec.metrics.port is not None and spec.metrics.port != spec.port:
        ports.append({"name": METRICS_PORT_NAME, "containerPort": spec.metrics.port, "protocol": "TCP"})
    container: dict[str, Any] = {"name": CONTAINER_NAME, "image": spec.image}
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    if spec.command:
        container["command"] = list(spec.command)
    args = [*spec.args, *service.spec.runtime.args]
    if args:
        container["args"] = args
    container["env"] = engine_env(service, runtime, cache)
    container["ports"] = ports
    resources = _resources(service, runtime)
    if resources:
        container["resources"] = resources
    container["volumeMounts"] = mounts
    container["startupProbe"] = _probe(spec.probes.startup or DEFAULT_STARTUP, spec.port)
    container["readinessProbe"] = _probe(spec.probes.readiness or DEFAULT_READINESS, spec.port)
    container["livenessProbe"] = _probe(spec.probes.liveness or DEFAULT_LIVENESS, spec.port)
    pre_stop = drain.pre_stop(runtime)
    if pre_stop is not None:
        container["lifecycle"] = {"preStop": pre_stop}
    container["securityContext"] = container_security(runtime)
    return container


def _placement(service: LLMService, runtime: InferenceRuntime, hints: scheduling.SchedulingHints,
               cache: CacheMount) -> dict[str, Any]:
    """Where the Pod may run and who schedules it: the vendor's placement, the node holding
    node-local weights, the runtime's scheduler, the priority class."""
    place = vendors.placement(runtime.spec.accelerator, service.spec.resources.accelerators)
    out: dict[str, Any] = {}
    if place.node_selector:
        out["nodeSelector"] = dict(sorted(place.node_selector.items()))
    if place.tolerations:
        out["tolerations"] = place.tolerations
    if cache.node is not None:
        out["affinity"] = node_pin(cache.node)
    if place.runtime_class_name:
        out["runtimeClassName"] = place.runtime_class_name
    if hints.scheduler_name:
        out["schedulerName"] = hints.scheduler_name
    # The LLMService's own priority wins over its runtime's (a model-level tier on a shared runtime).
    own = service.spec.scheduling.priority_class_name if service.spec.scheduling is not None else None
    priority_class = own or hints.priority_class_name
    if priority_class:
        out["priorityClassName"] = priority_class
    return out
