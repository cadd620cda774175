"""InferenceRuntime: a reusable, cluster-scoped description of how to run an engine.

It is configuration, not a workload: its controller only validates it and writes Accepted. An
LLMService names a runtime (or selects one by labels) and the hooks render the runtime's pod.
"""

from __future__ import annotations

import posixpath
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from hooks.api.common import (
    ABSOLUTE_PATH_RE,
    API_VERSION,
    ApiModel,
    CRDInfo,
    DNSLabel,
    DNSSubdomain,
    Duration,
    EnvVar,
    LocalObjectReference,
    ObjectMeta,
    Port,
    PrinterColumn,
    Quantity,
    Rule,
    Toleration,
    duration_seconds,
)
from hooks.api.status import InferenceRuntimeStatus
from hooks.errors import explain_pattern

Engine = Literal["vllm", "sglang", "llamacpp", "tgi", "custom"]
Vendor = Literal["nvidia", "amd", "intel-gaudi", "ascend", "none"]


class Accelerator(ApiModel):
    """Which accelerator the engine needs; vendor adapters turn this into Pod fields."""

    vendor: Vendor = Field(
        default="nvidia",
        description="Accelerator vendor: nvidia, amd, intel-gaudi, ascend, or none (CPU only). It selects "
        "the extended resource name (nvidia.com/gpu, amd.com/gpu, habana.ai/gaudi, huawei.com/Ascend910) "
        "and vendor environment defaults.",
    )
    resource_name: str | None = Field(
        default=None,
        description="Override the extended resource requested per accelerator, e.g. nvidia.com/mig-1g.10gb.",
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
        max_length=253,
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the serving Pod must run on (merged over vendor defaults)."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Tolerations added to the serving Pod (e.g. for tainted GPU nodes)."
    )
    runtime_class_name: str | None = Field(
        default=None, description="RuntimeClass for the serving Pod (e.g. nvidia)."
    )


class VolcanoScheduling(ApiModel):
    """Hints for the Volcano batch scheduler (used when schedulerName is volcano)."""

    queue: str | None = Field(default=None, description="Volcano queue (annotation scheduling.volcano.sh/queue-name).")
    pod_group: str | None = Field(
        default=None, description="Existing PodGroup to join (annotation scheduling.k8s.io/group-name)."
    )


class HAMiSharing(ApiModel):
    """HAMi GPU sharing: a slice of one device instead of a whole one."""

    gpu_memory_mi_b: int | None = Field(
        default=None,
        alias="gpuMemoryMiB",
        ge=1,
        description="Device memory per accelerator in MiB (resource nvidia.com/gpumem).",
    )
    gpu_cores_percent: int | None = Field(
        default=None,
        ge=1,
        le=100,
        description="Share of device compute in percent (resource nvidia.com/gpucores).",
    )


class Scheduling(ApiModel):
    """Scheduler selection and hints. Noctaya references schedulers; it does not install them."""

    scheduler_name: str | None = Field(default=None, description="Pod schedulerName, e.g. volcano or hami-scheduler.")
    priority_class_name: str | None = Field(default=None, description="PriorityClass of the serving Pod.")
    volcano: VolcanoScheduling | None = Field(default=None, description="Volcano queue and PodGroup hints.")
    hami: HAMiSharing | None = Field(default=None, description="HAMi device-sharing resources.")


class Probe(ApiModel):
    """A probe of the serving container: HTTP (the default), TCP, Exec or gRPC, as Kubernetes has them."""

    type: Literal["HTTP", "TCP", "Exec", "GRPC"] = Field(default="HTTP", description="Kind of probe.")
    path: str = Field(default="/health", description="HTTP path probed (type HTTP).", pattern=ABSOLUTE_PATH_RE)
    scheme: Literal["HTTP", "HTTPS"] = Field(default="HTTP", description="HTTP or HTTPS (type HTTP).")
    port: Port | None = Field(
        default=None, description="Port probed (HTTP, TCP, GRPC); defaults to the engine port."
    )
    command: list[str] = Field(
        default_factory=list, max_length=32, description="Command run in the container (type Exec); exit 0 = success."
    )
    service: str | None = Field(
        default=None, max_length=253, description="gRPC health service name (type GRPC); empty = the server's overall health."
    )
    initial_delay_seconds: int = Field(default=0, ge=0, description="Delay before the first probe.")
    period_seconds: int = Field(default=10, ge=1, description="Seconds between probes.")
    timeout_seconds: int = Field(default=5, ge=1, description="Seconds before a probe attempt times out.")
    failure_threshold: int = Field(default=3, ge=1, description="Consecutive failures before the probe fails.")

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="self.type != 'Exec' || (has(self.command) && size(self.command) > 0)",
            message="an Exec probe needs a command",
            check=lambda s: s.type != "Exec" or bool(s.command),
        ),
    )


class Probes(ApiModel):
    """Probes sized for long model loads. Unset probes get Noctaya's defaults."""

    startup: Probe | None = Field(
        default=None,
        description="Startup probe; defaults to GET /health every 10s, 60 failures allowed (10 minutes to load).",
    )
    readiness: Probe | None = Field(
        default=None,
        description="Readiness probe; when it is an HTTP probe its path is also what the gateway polls before "
        "forwarding (for any other type the gateway polls /v1/models). Default /health.",
    )
    liveness: Probe | None = Field(default=None, description="Liveness probe; defaults to /health every 10s, 6 failures.")


class Lifecycle(ApiModel):
    """Graceful drain of a serving Pod on scale-in or rollout."""

    drain_timeout: Duration = Field(
        default="2m",
        description="Upper bound on how long the preStop hook waits for in-flight requests to finish before the engine "
        "is stopped.",
    )
    drain_wait: Literal["InFlight", "Sleep"] = Field(
        default="InFlight",
        description="InFlight: the preStop hook (sh in the engine image) polls the engine's metrics.inFlightMetric and "
        "waitingMetric and returns as soon as both are 0, so an idle backend stops (and frees its accelerator) in "
        "seconds; without those gauges it sleeps. Sleep: always wait the whole drainTimeout (images without sh).",
    )
    termination_grace_period_seconds: int | None = Field(
        default=None,
        ge=1,
        description="Pod terminationGracePeriodSeconds; must be at least drainTimeout + 10s (the default).",
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="!has(self.terminationGracePeriodSeconds) || "
            "self.terminationGracePeriodSeconds >= duration(self.drainTimeout).getSeconds() + 10",
            message="terminationGracePeriodSeconds must be at least drainTimeout + 10 seconds",
            check=lambda s: s.termination_grace_period_seconds is None
            or s.termination_grace_period_seconds >= int(duration_seconds(s.drain_timeout)) + 10,
        ),
    )

    @property
    def drain_seconds(self) -> int:
        return int(duration_seconds(self.drain_timeout))

    @property
    def grace_seconds(self) -> int:
        return self.termination_grace_period_seconds or self.drain_seconds + 10


class RuntimeMetrics(ApiModel):
    """Where the engine exposes Prometheus metrics, and the names of its load gauges."""

    path: str = Field(default="/metrics", description="Metrics path on the engine.", pattern=ABSOLUTE_PATH_RE)
    port: Port | None = Field(default=None, description="Metrics port; defaults to the engine port.")
    in_flight_metric: str | None = Field(
        default=None, description="Gauge of requests being processed, e.g. vllm:num_requests_running."
    )
    waiting_metric: str | None = Field(
        default=None, description="Gauge of requests waiting in the engine, e.g. vllm:num_requests_waiting."
    )
    kv_cache_usage_metric: str | None = Field(
        default=None, description="Gauge of KV-cache usage in [0,1], e.g. vllm:kv_cache_usage_perc."
    )


Capability = Annotated[str, Field(pattern=r"^[A-Z][A-Z0-9_]*$", max_length=32)]

# --- what Noctaya itself mounts in every serving container ---------------------------------------
# The one list of the volume names and mount paths a runtime's own volumes must not take: the CEL
# rules below, the pydantic checks and the InferenceRuntime's Accepted condition all read it, and
# the Pod renderer (hooks/runtime/pod.py) renders exactly these. A new Noctaya mount belongs here.
CACHE_VOLUME = "model-cache"  # the model cache, at spec.cacheMountPath (also the marker wait's mount)
MODEL_VOLUME = "model"  # a pvc:// model source, read-only at spec.modelMountPath
SHM_VOLUME = "dshm"  # the memory-backed shared memory every serving container gets
SHM_MOUNT_PATH = "/dev/shm"
RESERVED_VOLUMES = (CACHE_VOLUME, MODEL_VOLUME, SHM_VOLUME)

# An absolute path without a `..` segment, which the API server refuses in a container's mountPath
# (so such a runtime could never run a Pod). Trailing and doubled slashes and `.` segments are
# allowed: Kubernetes accepts them, earlier releases accepted them, and a stored runtime must keep
# working after an upgrade (docs/upgrading.md). Paths are compared for conflicts as the container
# runtime sees them (cleaned) by `volume_conflicts`, and by the CEL rules ignoring one trailing slash.
MOUNT_PATH = explain_pattern(r"^(/([^/.][^/]*|\.[^/.][^/]*|\.\.[^/]+|\.)?)+$",
                             "an absolute path without `..` segments, e.g. /cache")
MAX_PATH_LENGTH = 1024


# What cleans to "/" (given no `..` segment): only slashes and `.` segments.
_ROOT_RE = r"^(/\.?)+/*$"
_ROOT_CEL = "'" + _ROOT_RE.replace("\\", "\\\\") + "'"


def is_root(path: str) -> bool:
    """The path names the root directory (`/`, `//`, `/./`): nothing can be mounted there."""
    return posixpath.normpath(path) in ("/", "//")


def same_path(a: str, b: str) -> bool:
    """Equal, or equal but for one trailing slash (the CEL rules compare the same way)."""
    return a == b or a + "/" == b or a == b + "/"


def _cel_same_path(a: str, b: str) -> str:
    return f"({a} == {b} || {a} + '/' == {b} || {a} == {b} + '/')"


def _cel_list(values: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


def _human_list(values: tuple[str, ...], conjunction: str = "and") -> str:
    return ", ".join(values[:-1]) + f" {conjunction} " + values[-1]


class RuntimeVolume(ApiModel):
    """An extra volume of the serving container that an accelerator stack or engine needs, e.g. the
    Ascend driver from the node (hostPath, which Pod Security `baseline` refuses), a config file, or a
    writable scratch directory (an emptyDir with readOnly false) for an engine running as non-root."""

    name: DNSLabel = Field(
        description=f"Volume name, unique in the runtime (not {_human_list(RESERVED_VOLUMES, 'or')}, which Noctaya uses)."
    )
    mount_path: str = Field(
        description=f"Where the serving container sees it: an absolute path without `..` segments, and none of "
        f"Noctaya's own mounts ({SHM_MOUNT_PATH}, cacheMountPath, modelMountPath) or another runtime volume's path.",
        pattern=MOUNT_PATH,
        max_length=MAX_PATH_LENGTH,
    )
    read_only: bool = Field(default=True, description="Mount read-only (set false for a scratch emptyDir).")
    host_path: str | None = Field(default=None, description="A node directory or file.", pattern=ABSOLUTE_PATH_RE)
    config_map: DNSSubdomain | None = Field(default=None, description="A ConfigMap in the LLMService's namespace.")
    secret: DNSSubdomain | None = Field(default=None, description="A Secret in the LLMService's namespace.")
    empty_dir: bool = Field(default=False, description="A scratch directory that lives as long as the Pod.")

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="[has(self.hostPath), has(self.configMap), has(self.secret), self.emptyDir].filter(x, x).size() == 1",
            message="a runtime volume needs exactly one of hostPath, configMap, secret or emptyDir",
            check=lambda s: [s.host_path is not None, s.config_map is not None, s.secret is not None, s.empty_dir].count(True) == 1,
        ),
        Rule(
            cel=f"!(self.name in {_cel_list(RESERVED_VOLUMES)})",
            message=f"runtime volume names {_human_list(RESERVED_VOLUMES)} are Noctaya's own",
            check=lambda s: s.name not in RESERVED_VOLUMES,
        ),
        Rule(
            cel=f"!{_cel_same_path('self.mountPath', repr(SHM_MOUNT_PATH))}",
            message=f"a runtime volume cannot mount at {SHM_MOUNT_PATH}: Noctaya mounts a memory-backed {SHM_MOUNT_PATH} "
            "in every serving container (size it with shmSize)",
            check=lambda s: not same_path(s.mount_path, SHM_MOUNT_PATH),
        ),
        Rule(
            cel=f"!self.mountPath.matches({_ROOT_CEL})",
            message="a runtime volume cannot mount at the container's root directory /",
            check=lambda s: not is_root(s.mount_path),
        ),
    )


def _clean(path: object) -> str | None:
    return posixpath.normpath(re.sub("/+", "/", path)) if isinstance(path, str) and path else None


def volume_conflicts(spec: object) -> list[str]:
    """Each way the runtime's volumes collide with Noctaya's own mounts or with each other, naming the
    volume. It reads the raw (wire) spec, so it also works on a runtime stored before the CRD refused
    these, and compares paths as the container runtime does (cleaned: `/dev//shm/` is `/dev/shm`), so
    it also finds what the admission rules' plain string comparison lets through. The runtime's
    Accepted condition reports each as VolumeConflict. Empty: none."""
    if not isinstance(spec, dict):
        return []
    volumes = [v for v in spec.get("volumes") or [] if isinstance(v, dict)] if isinstance(spec.get("volumes"), list) else []
    cache = _clean(spec.get("cacheMountPath", "/cache"))
    model = _clean(spec.get("modelMountPath", "/models"))
    own = [(p, what) for p, what in ((SHM_MOUNT_PATH, "shared memory"), (cache, "the model cache (cacheMountPath)"),
                                    (model, "pvc:// model sources (modelMountPath)")) if isinstance(p, str)]
    return [*_own_path_conflicts(cache, model), *_runtime_volume_conflicts(volumes, own)]


def _own_path_conflicts(cache: str | None, model: str | None) -> list[str]:
    """Noctaya's own mount paths set on top of each other (cache, pvc:// models, shared memory)."""
    if not isinstance(cache, str) or not isinstance(model, str):
        return []
    out = [f"cacheMountPath and modelMountPath are both {cache}"] if cache == model else []
    for field, path in (("cacheMountPath", cache), ("modelMountPath", model)):
        if path == SHM_MOUNT_PATH:
            out.append(f"{field} is {SHM_MOUNT_PATH}, where Noctaya mounts shared memory")
    return out


def _runtime_volume_conflicts(volumes: list[dict[str, Any]], own: list[tuple[str, str]]) -> list[str]:
    """Runtime volumes named like Noctaya's or each other, or mounted where another mount is."""
    out: list[str] = []
    seen_names: set[str] = set()
    seen_paths: dict[str, str] = {}
    for v in volumes:
        name, path = v.get("name"), _clean(v.get("mountPath"))
        label = f"runtime volume {name}" if isinstance(name, str) else "a runtime volume without a name"
        if isinstance(name, str):
            if name in RESERVED_VOLUMES:
                out.append(f"{label} has the name of Noctaya's own volume {name}")
            elif name in seen_names:
                out.append(f"two runtime volumes are named {name}")
            seen_names.add(name)
        if not isinstance(path, str):
            continue
        out += [f"{label} mounts at {v['mountPath']}, where Noctaya mounts {what}" for own_path, what in own if path == own_path]
        other = seen_paths.get(path)
        if other is not None:
            out.append(f"{label} mounts at {v['mountPath']}, as runtime volume {other} does")
        seen_paths.setdefault(path, name if isinstance(name, str) else "?")
    return out


class RuntimeSecurity(ApiModel):
    """What the serving container may do. The default is Pod Security `restricted` except for the user:
    no privilege escalation, every capability dropped, the RuntimeDefault seccomp profile. Relax only
    what the engine's image or the accelerator's driver stack needs (see the vendor adapters)."""

    run_as_user: int | None = Field(
        default=None,
        ge=1,
        description="A non-root uid the engine image works as; sets runAsNonRoot (required by `restricted`) and the "
        "Pod's fsGroup to the same id unless fsGroup is given. Unset: the image's own user (root in most engine "
        "images), which `baseline` admits and `restricted` does not.",
    )
    run_as_group: int | None = Field(default=None, ge=0, description="Primary gid of the engine process.")
    fs_group: int | None = Field(default=None, ge=0, description="Pod fsGroup: the group that owns mounted volumes.")
    add_capabilities: list[Capability] = Field(
        default_factory=list,
        max_length=16,
        description="Linux capabilities to add back after dropping all, e.g. IPC_LOCK for RDMA (pinned memory). "
        "Anything but NET_BIND_SERVICE leaves `restricted`; anything outside the container runtime's default set "
        "(IPC_LOCK, SYS_PTRACE, SYS_ADMIN, NET_RAW, ...) also leaves `baseline`.",
    )
    allow_privilege_escalation: bool = Field(
        default=False, description="Allow setuid binaries to gain privileges (leaves `restricted`)."
    )
    seccomp_profile: Literal["RuntimeDefault", "Unconfined"] = Field(
        default="RuntimeDefault", description="Seccomp profile of the serving container (Unconfined leaves `restricted`)."
    )


class InferenceRuntimeSpec(ApiModel):
    """How to run one inference engine on one kind of accelerator."""

    engine: Engine = Field(description="Engine family: vllm, sglang, llamacpp, tgi or custom.")
    image: str = Field(description="Container image of the engine (pin a tag or digest).", min_length=1)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        default=None, description="Image pull policy of the serving container."
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list,
        max_length=16,
        description="Registry credentials for the engine image, by name; each must exist in the namespace of every "
        "LLMService using this runtime (a missing one leaves the Pod in ImagePullBackOff, reported as ImagePullFailed).",
    )
    command: list[str] = Field(default_factory=list, description="Container command (entrypoint override).")
    args: list[str] = Field(
        default_factory=list,
        description="Container args. Refer to model facts with Kubernetes $(VAR) expansion: $(NOCTAYA_MODEL_PATH), "
        "$(NOCTAYA_SERVED_NAME), $(NOCTAYA_PORT), $(NOCTAYA_ACCELERATORS), $(NOCTAYA_MODEL_REVISION).",
    )
    env: list[EnvVar] = Field(
        default_factory=list, max_length=128, description="Environment of the serving container."
    )
    port: Port = Field(default=8000, description="Port the engine serves its OpenAI-compatible API on.")
    model_mount_path: str = Field(
        default="/models",
        description="Where pvc:// model sources are mounted (read-only): an absolute path without `..` segments.",
        pattern=MOUNT_PATH,
        max_length=MAX_PATH_LENGTH,
    )
    cache_mount_path: str = Field(
        default="/cache",
        description="Where the model cache volume is mounted: an absolute path without `..` segments.",
        pattern=MOUNT_PATH,
        max_length=MAX_PATH_LENGTH,
    )
    shm_size: Quantity | None = Field(
        default=None,
        description="Size limit of the memory-backed /dev/shm every serving container gets (default 1Gi; "
        "tensor-parallel engines need more than the container runtime's 64Mi). Pages count toward the memory limit "
        "as they are written.",
    )
    priority: int = Field(
        default=0,
        description="When an LLMService selects runtimes by label, the highest priority wins; a tie is reported "
        "as AmbiguousRuntime rather than guessed.",
    )
    accelerator: Accelerator = Field(default_factory=Accelerator, description="Accelerator vendor and placement.")
    scheduling: Scheduling = Field(default_factory=Scheduling, description="Scheduler selection and hints.")
    probes: Probes = Field(default_factory=Probes, description="Startup, readiness and liveness probes.")
    lifecycle: Lifecycle = Field(default_factory=Lifecycle, description="Drain on termination.")
    volumes: list[RuntimeVolume] = Field(
        default_factory=list,
        max_length=16,
        description="Extra volumes of the serving container (driver mounts from the node, config files, writable "
        "scratch directories), keyed by name. None may take a name or mount path Noctaya uses itself.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    security: RuntimeSecurity = Field(
        default_factory=RuntimeSecurity,
        description="Security context of the serving container (restricted by default, except the user).",
    )
    metrics: RuntimeMetrics | None = Field(
        default=None, description="Engine metrics metadata, used by leading-signal triggers and monitoring."
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="self.engine != 'custom' || (has(self.command) && size(self.command) > 0) "
            "|| (has(self.args) && size(self.args) > 0)",
            message="a custom engine needs a command or args",
            check=lambda s: s.engine != "custom" or bool(s.command) or bool(s.args),
        ),
        # Noctaya's own mounts (see RESERVED_VOLUMES): a collision makes every backend Deployment invalid.
        Rule(
            cel=f"!{_cel_same_path('self.cacheMountPath', 'self.modelMountPath')} && "
            f"![self.cacheMountPath, self.modelMountPath].exists(p, {_cel_same_path('p', repr(SHM_MOUNT_PATH))})",
            message=f"cacheMountPath, modelMountPath and {SHM_MOUNT_PATH} must be three different paths",
            check=lambda s: not same_path(s.cache_mount_path, s.model_mount_path)
            and not any(same_path(p, SHM_MOUNT_PATH) for p in (s.cache_mount_path, s.model_mount_path)),
        ),
        Rule(
            cel="!has(self.volumes) || self.volumes.all(v, "
            f"![self.cacheMountPath, self.modelMountPath].exists(p, {_cel_same_path('v.mountPath', 'p')}))",
            message="a runtime volume cannot mount at cacheMountPath or modelMountPath: Noctaya mounts the model "
            "cache and pvc:// model sources there",
            check=lambda s: not any(
                same_path(v.mount_path, p) for v in s.volumes for p in (s.cache_mount_path, s.model_mount_path)
            ),
        ),
        Rule(
            cel="!has(self.volumes) || self.volumes.all(v, self.volumes.filter(w, w.name == v.name).size() == 1)",
            message="runtime volume names must be unique",
            check=lambda s: len({v.name for v in s.volumes}) == len(s.volumes),
        ),
        Rule(
            cel="!has(self.volumes) || "
            f"self.volumes.all(v, self.volumes.filter(w, {_cel_same_path('w.mountPath', 'v.mountPath')}).size() == 1)",
            message="two runtime volumes cannot mount at the same path",
            check=lambda s: all(sum(same_path(w.mount_path, v.mount_path) for w in s.volumes) == 1 for v in s.volumes),
        ),
        Rule(
            cel=f"![self.cacheMountPath, self.modelMountPath].exists(p, p.matches({_ROOT_CEL}))",
            message="cacheMountPath and modelMountPath cannot be the container's root directory /",
            check=lambda s: not is_root(s.cache_mount_path) and not is_root(s.model_mount_path),
        ),
    )


class InferenceRuntime(ApiModel):
    """The whole InferenceRuntime object as Metacontroller sends it."""

    model_config = ApiModel.model_config | {"extra": "ignore"}

    api_version: Literal["serving.noctaya.io/v1alpha1"] = Field(default=API_VERSION)
    kind: Literal["InferenceRuntime"] = "InferenceRuntime"
    metadata: ObjectMeta
    spec: InferenceRuntimeSpec
    status: InferenceRuntimeStatus | None = None

    crd: ClassVar[CRDInfo] = CRDInfo(
        kind="InferenceRuntime",
        plural="inferenceruntimes",
        singular="inferenceruntime",
        scope="Cluster",
        short_names=("irt",),
        description="InferenceRuntime is a reusable, cluster-scoped description of how to run an inference "
        "engine (image, args, port, probes, drain) on one kind of accelerator. It is configuration, not a "
        "workload: LLMServices reference it by name or select it by label.",
        printer_columns=(
            PrinterColumn("Engine", ".spec.engine"),
            PrinterColumn("Vendor", ".spec.accelerator.vendor"),
            PrinterColumn("Priority", ".spec.priority", type="integer"),
            PrinterColumn("Accepted", '.status.conditions[?(@.type=="Accepted")].status'),
            PrinterColumn("Image", ".spec.image", priority=1),
            PrinterColumn("Age", ".metadata.creationTimestamp", type="date"),
        ),
    )
