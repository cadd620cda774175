"""Before any test runs (and so outside every per-test timeout), build what the collected tests need
from tests/setup.py's steps: `make test` / `make e2e` have already done it, so this only does work when
pytest is started directly (e.g. `pytest tests/kube` on a fresh machine). Silent when all is cached; a
dependency that cannot be had is reported and its tests skip with the reason, as before.

`make test` runs the suite in parallel (pytest-xdist, `--dist loadgroup`): most tests wait on sockets
and subprocesses, not the CPU. Tests that share one expensive session fixture stay together on one
worker (SHARED_SESSIONS), so a worker never starts a second kube-apiserver of its own.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.setup import REPO_ROOT, prepare, steps_for_paths


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    e2e = os.environ.get("NOCTAYA_E2E") == "1"
    paths = set()
    for item in session.items:
        try:
            rel = item.path.resolve().relative_to(REPO_ROOT).as_posix()
        except ValueError:
            continue
        if rel.startswith("tests/e2e/") and not e2e:
            continue  # skipped without NOCTAYA_E2E (tests/e2e/conftest.py)
        paths.add(rel)
    steps = steps_for_paths(paths)
    if not steps:
        return
    capture = session.config.pluginmanager.getplugin("capturemanager")
    reporter = session.config.pluginmanager.getplugin("terminalreporter")

    def say(line: str) -> None:
        if reporter is not None:
            reporter.write_line(f"[setup] {line}")

    with one_setup_at_a_time():
        if capture is not None:
            with capture.global_and_fixture_disabled():
                prepare(steps, say, quiet_when_cached=True, fail_fast=False)
        else:
            prepare(steps, say, quiet_when_cached=True, fail_fast=False)


@contextmanager
def one_setup_at_a_time() -> Iterator[None]:
    """Under xdist every worker collects, so every worker gets here: the first builds what is missing,
    the others wait for it and then find everything cached (two builds into one cache would race)."""
    lock = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "noctaya-setup.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# Test folders whose tests share a costly session fixture: each runs on one xdist worker.
SHARED_SESSIONS = {
    "tests/kube/": "kube-apiserver",  # tests/kube/conftest.py: one etcd + kube-apiserver for the folder
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        try:
            rel = item.path.resolve().relative_to(REPO_ROOT).as_posix()
        except ValueError:
            continue
        for prefix, group in SHARED_SESSIONS.items():
            if rel.startswith(prefix):
                item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def old_tree() -> Path:
    """The previous release's source (tests/previous_release.py); skips with the reason without it."""
    from tests.previous_release import ReleaseUnavailable, source_tree

    try:
        return source_tree()
    except ReleaseUnavailable as exc:
        pytest.skip(str(exc))
