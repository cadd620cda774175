"""What the gateway reads from its cgroup: workers from the CPU limit, the held-body budget from the
memory limit (v2 and v1 layouts, no limit, a limit smaller than one body)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cgroup import DEFAULT_HELD_BODY_BYTES, default_workers, held_body_budget, memory_limit
from gateway.config import load_config

MiB = 1024 * 1024


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize(("files", "limit", "budget"), [
    ({"memory.max": "536870912\n"}, 512 * MiB, 128 * MiB),                 # v2: a quarter
    ({"memory.max": "max\n"}, None, DEFAULT_HELD_BODY_BYTES),             # v2 without a limit
    ({"memory/memory.limit_in_bytes": "1073741824\n"}, 1024 * MiB, 256 * MiB),   # v1
    ({"memory/memory.limit_in_bytes": "9223372036854771712\n"}, None, DEFAULT_HELD_BODY_BYTES),  # v1 "no limit"
    ({"memory.max": str(8 * 1024 * MiB)}, 8 * 1024 * MiB, DEFAULT_HELD_BODY_BYTES),  # capped at 256 MiB
    ({"memory.max": str(16 * MiB)}, 16 * MiB, 8 * MiB),                   # never below one body
    ({}, None, DEFAULT_HELD_BODY_BYTES),
])
def test_held_body_budget_follows_the_memory_limit(tmp_path: Path, files: dict[str, str], limit: int | None,
                                                  budget: int) -> None:
    for rel, text in files.items():
        write(tmp_path, rel, text)
    assert memory_limit(str(tmp_path)) == limit
    assert held_body_budget(8 * MiB, str(tmp_path)) == budget


def test_config_derives_the_budget_unless_it_is_set(tmp_path: Path) -> None:
    write(tmp_path, "memory.max", str(512 * MiB))
    base = {"NOCTAYA_BACKEND_URL": "http://b:8000", "NOCTAYA_SERVED_MODEL_NAME": "m", "NOCTAYA_CGROUP_ROOT": str(tmp_path)}
    assert load_config([], base).max_held_body_bytes == 128 * MiB
    assert load_config([], {**base, "NOCTAYA_MAX_HELD_BODY_BYTES": str(64 * MiB)}).max_held_body_bytes == 64 * MiB


def test_workers_follow_the_cpu_limit(tmp_path: Path) -> None:
    write(tmp_path, "cpu.max", "200000 100000\n")
    assert default_workers(str(tmp_path)) == 2
    write(tmp_path, "cpu.max", "max 100000\n")
    assert default_workers(str(tmp_path)) == 1
