"""The serving Pod's init container: it lets the engine start only once the marker for the pinned
revision exists, and says what it is waiting for."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from prewarm.layout import ModelDir, write_json_atomically
from prewarm.wait import wait_for_marker

ROOT = Path(__file__).resolve().parents[2]


def stage(model: ModelDir, revision: str | None = None) -> None:
    model.final.mkdir(parents=True, exist_ok=True)
    write_json_atomically(model.marker, {"source": model.source, "revision": revision or model.revision, "files": 1})


def test_a_present_marker_returns_at_once(tmp_path: Path) -> None:
    model = ModelDir.of(tmp_path, "hf://org/m", "v1")
    stage(model)
    slept: list[float] = []
    assert wait_for_marker(model, timeout=10, sleep=slept.append) is True and slept == []


def test_a_marker_for_another_revision_or_without_its_directory_does_not_count(tmp_path: Path) -> None:
    model = ModelDir.of(tmp_path, "hf://org/m", "v2")
    stage(model, revision="v1")  # an old marker at the new name: not ours
    assert model.read_marker() is None
    write_json_atomically(model.marker, {"source": model.source, "revision": "v2"})
    model.final.rmdir()
    assert model.read_marker() is None  # a marker without the promoted directory is not a cache


def test_waits_until_the_marker_appears_and_gives_up_at_the_timeout(tmp_path: Path, caplog) -> None:
    model = ModelDir.of(tmp_path, "modelscope://org/m", None)
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds
        if now[0] >= 30:
            stage(model)

    with caplog.at_level("INFO", logger="noctaya.prewarm"):
        assert wait_for_marker(model, timeout=600, interval=2, clock=lambda: now[0], sleep=sleep) is True
    assert "waiting for modelscope://org/m@master" in caplog.text and "after 30 s" in caplog.text
    other = ModelDir.of(tmp_path, "hf://org/never", None)
    clock = [0.0]
    assert wait_for_marker(other, timeout=20, interval=2, clock=lambda: clock[0],
                           sleep=lambda s: clock.__setitem__(0, clock[0] + s)) is False
    assert clock[0] == 20


def test_the_init_container_command_exits_0_when_staged_and_1_with_a_reason_after_its_timeout(tmp_path: Path) -> None:
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "NOCTAYA_TERMINATION_LOG": str(tmp_path / "term"),
           "NOCTAYA_PREWARM_JOB": "qwen-prewarm-0123abcd"}
    cmd = [sys.executable, "-m", "prewarm", "wait", "--source", "hf://org/m", "--revision", "v1",
           "--cache-dir", str(tmp_path), "--interval", "0.1"]
    late = subprocess.run([*cmd, "--timeout", "0.5"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert late.returncode == 1
    assert "kubectl logs -f job/qwen-prewarm-0123abcd" in late.stdout
    assert "was not in the cache after" in (tmp_path / "term").read_text()
    model = ModelDir.of(tmp_path, "hf://org/m", "v1")
    threading.Timer(1.0, stage, args=(model,)).start()
    t0 = time.monotonic()
    ok = subprocess.run([*cmd, "--timeout", "60"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "starting the engine" in ok.stdout, ok.stdout + ok.stderr
    assert time.monotonic() - t0 < 30
