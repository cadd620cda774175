"""Before any test runs (and so outside every per-test timeout), build what the collected tests need
from tests/setup.py's steps: `make test` / `make e2e` have already done it, so this only does work when
pytest is started directly (e.g. `pytest tests/kube` on a fresh machine). Silent when all is cached; a
dependency that cannot be had is reported and its tests skip with the reason, as before."""

from __future__ import annotations

import os

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

    if capture is not None:
        with capture.global_and_fixture_disabled():
            prepare(steps, say, quiet_when_cached=True, fail_fast=False)
    else:
        prepare(steps, say, quiet_when_cached=True, fail_fast=False)
