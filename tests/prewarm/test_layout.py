"""Cache layout edges (issue #20, item 11): revision keys are one-to-one, and one process at a time
stages a revision (a second Job on the same node waits for the first's lock, then finds its marker)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prewarm import sources
from prewarm.layout import _RESERVED_SUFFIXES, ModelDir, revision_key
from tests.prewarm.conftest import MAIN_FILES, hub, run_prewarm  # noqa: F401 - the fixture

ROOT = Path(__file__).resolve().parents[2]
revisions = st.from_regex(r"[A-Za-z0-9._/-]{1,24}", fullmatch=True)


@pytest.mark.parametrize("revision, key", [
    # unchanged from before #20: what existing caches hold keeps its directory
    ("main", "main"), ("master", "master"), ("v1.0", "v1.0"), ("1" * 40, "1" * 40), ("refs/pr/1", "refs--pr--1"),
    ("release-2024", "release-2024"), ("feature/x-y", "feature--x-y"), (".hidden", "_.hidden"), ("..", "_.."),
    # escaped so that they no longer share a directory with another revision
    ("a--b", "a%2D%2Db"), ("a/b", "a--b"), ("a-/b", "a%2D--b"), ("_.hidden", "%5F.hidden"),
    ("main.ready", "main%2Eready"), ("v1.partial", "v1%2Epartial"), ("x.lock", "x%2Elock"), ("y.blobs", "y%2Eblobs"),
])
def test_revision_keys(revision: str, key: str) -> None:
    assert revision_key(revision) == key


@settings(max_examples=400, deadline=None)
@given(revisions, revisions)
def test_revision_keys_are_one_to_one(a: str, b: str) -> None:
    if a != b:
        assert revision_key(a) != revision_key(b)


@settings(max_examples=300, deadline=None)
@given(revisions)
def test_a_revision_key_is_one_plain_path_component_and_never_a_neighbours_name(revision: str) -> None:
    key = revision_key(revision)
    assert "/" not in key and key not in (".", "..") and not key.startswith(".")
    assert not key.endswith(_RESERVED_SUFFIXES)  # never another revision's marker, download, lock or blobs
    assert revision_key(revision) == key


def test_the_reported_collision_is_gone(tmp_path: Path) -> None:
    a = ModelDir.of(tmp_path, "hf://org/m", "a/b")
    b = ModelDir.of(tmp_path, "hf://org/m", "a--b")
    assert len({a.final, a.partial, a.marker, a.lock_file, b.final, b.partial, b.marker, b.lock_file}) == 8


def _hold(lock: Path, seconds: float) -> subprocess.Popen[str]:
    """Another process (another Job's Pod on this node) holding the revision's lock."""
    code = ("import fcntl, os, sys, time\n"
            f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT, 0o644)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "os.ftruncate(fd, 0)\n"
            "os.pwrite(fd, b'node-a pid 4242', 0)\n"
            "print('held', flush=True)\n"
            f"time.sleep({seconds})\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_download_waits_for_the_first_and_finds_its_marker(hub, tmp_path: Path) -> None:  # noqa: F811
    cache = tmp_path / "cache"
    model = ModelDir.of(cache, "hf://org/model", "main")
    first = run_prewarm(hub, tmp_path, "hub", "--source", "hf://org/model", "--revision", "main", "--cache-dir", str(cache))
    assert first.code == 0, first.out
    marker = model.marker.read_text()
    holder = _hold(model.lock_file, 2.5)
    try:
        started = time.monotonic()
        second = run_prewarm(hub, tmp_path, "hub", "--source", "hf://org/model", "--revision", "main", "--cache-dir",
                             str(cache), "--progress-interval", "1")
        waited = time.monotonic() - started
    finally:
        holder.wait(10)
    assert second.code == 0, second.out
    assert waited >= 2.0 and "waiting for main.lock: another download of this revision holds it (node-a pid 4242)" in second.out
    assert "already in the cache" in second.out and model.marker.read_text() == marker
    assert {p.name for p in model.final.rglob("*") if p.is_file()} == {Path(k).name for k in MAIN_FILES}


def test_the_partial_of_a_download_in_progress_is_not_deleted(hub, tmp_path: Path) -> None:  # noqa: F811
    cache = tmp_path / "cache"
    model = ModelDir.of(cache, "hf://org/model", "main")
    model.partial.mkdir(parents=True)
    (model.partial / "half.safetensors").write_bytes(b"x" * 100)  # the holder's download, in progress
    holder = _hold(model.lock_file, 30)
    try:
        second = run_prewarm(hub, tmp_path, "hub", "--source", "hf://org/model", "--revision", "main", "--cache-dir",
                             str(cache), "--lock-timeout", "1.5", "--progress-interval", "0.5")
        assert (model.partial / "half.safetensors").exists()  # untouched while the other holds the lock
    finally:
        holder.kill()
        holder.wait(10)
    assert second.code == 1
    assert "main.lock is still held by another download after 2 s (node-a pid 4242)" in second.termination
    # The holder died: the kernel released its lock, and the next attempt proceeds (and clears its .partial).
    third = run_prewarm(hub, tmp_path, "hub", "--source", "hf://org/model", "--revision", "main", "--cache-dir", str(cache))
    assert third.code == 0 and "removed main.partial left by an interrupted attempt" in third.out, third.out


def test_the_lock_is_exclusive_between_threads_of_one_process_too(tmp_path: Path) -> None:
    import logging

    model = ModelDir.of(tmp_path, "hf://org/m", "v1")
    inside, order = threading.Event(), []

    def first() -> None:
        with model.locked(10, logging.getLogger("t")):
            inside.set()
            time.sleep(0.5)
            order.append("first out")

    t = threading.Thread(target=first)
    t.start()
    inside.wait(5)
    with model.locked(10, logging.getLogger("t"), interval=0.1):
        order.append("second in")
    t.join()
    assert order == ["first out", "second in"]
    fd = os.open(model.lock_file, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by both
    finally:
        os.close(fd)


def test_the_source_grammar_is_the_one_the_layout_parses() -> None:
    assert sources.DEFAULT_REVISION == {"hf": "main", "modelscope": "master"}
