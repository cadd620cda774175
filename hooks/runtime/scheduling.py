"""Scheduler hints: schedulerName, Volcano queue / PodGroup annotations, HAMi device shares,
priorityClassName. Noctaya references these schedulers; it never installs or talks to them."""

from __future__ import annotations

from dataclasses import dataclass

from hooks.api.runtime import Scheduling

VOLCANO_QUEUE = "scheduling.volcano.sh/queue-name"
POD_GROUP = "scheduling.k8s.io/group-name"
HAMI_GPU_MEMORY = "nvidia.com/gpumem"  # MiB per device
HAMI_GPU_CORES = "nvidia.com/gpucores"  # percent of one device's compute


@dataclass(frozen=True)
class SchedulingHints:
    scheduler_name: str | None
    priority_class_name: str | None
    annotations: dict[str, str]
    limits: dict[str, str]


def hints(scheduling: Scheduling, accelerators: int) -> SchedulingHints:
    annotations: dict[str, str] = {}
    if scheduling.volcano is not None:
        if scheduling.volcano.queue:
            annotations[VOLCANO_QUEUE] = scheduling.volcano.queue
        if scheduling.volcano.pod_group:
            annotations[POD_GROUP] = scheduling.volcano.pod_group
    limits: dict[str, str] = {}
    if scheduling.hami is not None and accelerators > 0:
        # HAMi reads these per container, next to the device count (nvidia.com/gpu: n).
        if scheduling.hami.gpu_memory_mi_b is not None:
            limits[HAMI_GPU_MEMORY] = str(scheduling.hami.gpu_memory_mi_b)
        if scheduling.hami.gpu_cores_percent is not None:
            limits[HAMI_GPU_CORES] = str(scheduling.hami.gpu_cores_percent)
    return SchedulingHints(
        scheduler_name=scheduling.scheduler_name,
        priority_class_name=scheduling.priority_class_name,
        annotations=annotations,
        limits=limits,
    )
