"""What the container's cgroup allows: whole CPUs (how many workers) and memory (how many request-body
bytes may be held). cgroup v2 first, v1 as a fallback; no limit found means the defaults."""

from __future__ import annotations

import os

__all__ = ["cgroup_root", "default_workers", "memory_limit", "held_body_budget", "HELD_BODY_SHARE"]

CGROUP_ROOT_ENV = "NOCTAYA_CGROUP_ROOT"  # tests point this at a directory of fake cgroup files
# Held request bodies may use this share of the container's memory limit. The rest is for the workers
# themselves (tens of MB each), every connection's state (~15 KiB each, see docs/benchmarks.md), the
# scaler child and the transient copies of the one body each worker is reading or forwarding; held
# bodies alone must never be what gets the gateway OOM-killed, which would drop every held request.
HELD_BODY_SHARE = 0.25
DEFAULT_HELD_BODY_BYTES = 256 * 1024 * 1024
_UNLIMITED_V1 = 1 << 60  # cgroup v1 reports "no limit" as a huge page-aligned number


def cgroup_root() -> str:
    return os.environ.get(CGROUP_ROOT_ENV) or "/sys/fs/cgroup"


def default_workers(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """The container's CPU limit in whole cores (cgroup v2 ``cpu.max``, else v1 quota), at least 1.
    Without a limit: 1 (the gateway's CPU request is small; set the variable to use more)."""
    try:
        with open(os.path.join(cgroup_root, "cpu.max")) as fh:
            quota, period = fh.read().split()[:2]
        if quota != "max":
            return max(1, int(quota) // int(period))
        return 1
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(cgroup_root, "cpu", "cpu.cfs_quota_us")) as fh:
            quota_us = int(fh.read())
        with open(os.path.join(cgroup_root, "cpu", "cpu.cfs_period_us")) as fh:
            period_us = int(fh.read())
        if quota_us > 0:
            return max(1, quota_us // period_us)
    except (OSError, ValueError):
        pass
    return 1



def memory_limit(cgroup_root: str = "/sys/fs/cgroup") -> int | None:
    """The container's memory limit in bytes (cgroup v2 ``memory.max``, else v1), None without one."""
    for path in (os.path.join(cgroup_root, "memory.max"), os.path.join(cgroup_root, "memory", "memory.limit_in_bytes")):
        try:
            with open(path) as fh:
                raw = fh.read().strip()
        except OSError:
            continue
        if raw == "max":
            return None
        try:
            value = int(raw)
        except ValueError:
            continue
        return value if 0 < value < _UNLIMITED_V1 else None
    return None


def held_body_budget(max_body_bytes: int, cgroup_root: str = "/sys/fs/cgroup") -> int:
    """Default bound on request-body bytes held by waiting cold requests: HELD_BODY_SHARE of the
    memory limit (at most 256 MiB, at least one body), 256 MiB without a limit."""
    limit = memory_limit(cgroup_root)
    if limit is None:
        return max(DEFAULT_HELD_BODY_BYTES, max_body_bytes)
    return max(max_body_bytes, min(DEFAULT_HELD_BODY_BYTES, int(limit * HELD_BODY_SHARE)))
