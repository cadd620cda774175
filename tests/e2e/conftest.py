"""One real lifecycle environment for tests/e2e: API server, kube-controller-manager, kube-scheduler,
kwok's fake node, Noctaya installed as a user installs it, the hook server and real Metacontroller
(see cluster.py). KEDA's CRDs are installed by the tests themselves, later than the controllers, as
happens on real clusters; KEDA's operator starts with the scale-from-zero tests.

`make e2e` runs these; `make test` skips them (NOCTAYA_E2E unset) so the default suite stays short.
Without Go, the shared/ copy of Metacontroller's source, or `unshare`, they skip with the reason.
The programs are built before pytest by `python -m tests.setup e2e` (run by `make e2e`; first builds,
cached outside the repository, are timed in docs/install.md), so no fixture builds under a timeout.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.e2e.cluster import (
    Cluster,
    Timeline,
    bare_cluster,
    install_this_release,
    metacontroller_binary,
    private_listeners,
    process_start_time,
)
from tests.e2e.netns import Network, NetworkUnavailable
from tests.kube.apiserver import ControlPlane, KubeUnavailable, ensure_binaries
from tests.kube.gobuild import kwok_binary

if TYPE_CHECKING:
    from tests.e2e.pool_world import World


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("NOCTAYA_E2E") == "1":
        # The lifecycle file first: it starts from a cluster without KEDA's CRDs, which the other
        # files install (sorted() is stable: each file keeps its own order).
        items[:] = sorted(items, key=lambda item: 0 if item.fspath.basename == "test_lifecycle.py" else 1)
        return
    skip = pytest.mark.skip(reason="lifecycle suite: run with `make e2e` (NOCTAYA_E2E=1)")
    for item in items:
        if "tests/e2e/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    try:
        bin_dir = ensure_binaries()
        mc = metacontroller_binary()
        kwok = kwok_binary()
    except KubeUnavailable as exc:
        pytest.skip(str(exc))
    if shutil.which("unshare") is None:
        pytest.skip("`unshare` (util-linux) not found: needed to give Metacontroller a private hosts file")
    hosts_before = Path("/etc/hosts").read_bytes()
    plane = ControlPlane(bin_dir)
    plane.start()
    env = None
    started: dict[int, str | None] = {}  # pid -> start time: a reused PID is not ours
    try:
        env = bare_cluster(plane, mc, kwok)
        install_this_release(env)
        started = {proc.pid: process_start_time(proc.pid) for _name, proc in plane._procs}
        yield env
    finally:
        if env is not None:
            started.update(env.pids())
            env.stop()
        plane.stop()
    # Nothing left behind: no process, no files outside the caches, the machine's hosts file as it was
    # (the bind mount lived in Metacontroller's own mount namespace and ended with it).
    alive = [pid for pid, at in started.items()
             if at is not None and process_start_time(pid) == at and not _zombie(pid)]
    assert not alive, f"processes left running: {[(pid, _cmdline(pid)) for pid in alive]}"
    assert not plane.workdir.exists(), f"{plane.workdir} left behind"
    assert not private_listeners(), f"ports still listening: {private_listeners()}"
    assert Path("/etc/hosts").read_bytes() == hosts_before, "/etc/hosts changed"
    with open("/proc/self/mountinfo") as fh:
        assert " /etc/hosts " not in fh.read(), "a mount over /etc/hosts is visible outside the suite"


@pytest.fixture(scope="session")
def pod_network() -> Iterator[Network]:
    """Pod IPs that reach the processes playing the Pods (tests/e2e/netns.py), for the kubelets the
    harness plays itself; skips with the reason where they cannot be made (not root, no `ip`, network
    namespaces not permitted). Nothing of it outlives the session."""
    try:
        network = Network().open()
    except NetworkUnavailable as exc:
        pytest.skip(str(exc))
    try:
        yield network
    finally:
        network.close()
    assert not network.leftovers(), f"Pod network left behind: {network.leftovers()}"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.fixture
def timeline(request: pytest.FixtureRequest) -> Iterator[Timeline]:
    """Notes of what the test saw; printed with the failure (see pytest_runtest_makereport)."""
    line = Timeline()
    request.node.timeline = line
    yield line


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    report = yield
    line = getattr(item, "timeline", None)
    if line is not None and report.when == "call" and report.failed:
        report.sections.append(("timeline", line.text()))
    return report


@pytest.fixture
def world(cluster: Cluster, timeline: Timeline, request: pytest.FixtureRequest) -> Iterator[Callable[[str], World]]:
    """The accelerator-pool modules' worlds (tests/e2e/pool_world.py), each test's cleaned up after it;
    KEDA's operator is started once (test_scale_from_zero's ``keda`` fixture, which the module imports)."""
    from tests.e2e.pool_world import World  # the harness imports the suite's modules: only when used

    request.getfixturevalue("keda")
    made: list[World] = []

    def make(key: str) -> World:
        w = World(cluster, timeline, key)
        made.append(w)
        return w

    yield make
    for w in made:
        w.cleanup()
