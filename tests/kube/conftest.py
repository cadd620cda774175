"""Session fixtures: one real etcd + kube-apiserver for every test in tests/kube/.

The binaries are built before pytest starts, outside any per-test timeout, by the set-up step
(`python -m tests.setup test`, run by `make test`; tests/conftest.py runs the same steps after
collection when pytest is started directly); the fixtures then find them in the cache. Without Go,
or with NOCTAYA_SKIP_KUBE=1, the tests skip with the reason.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kube.apiserver import REPO_ROOT, ControlPlane, KubeUnavailable, ensure_binaries
from tests.third_party import SHARED_THIRD_PARTY, ThirdPartyUnavailable, metacontroller_crds, module_crds

CRDS_DIR = REPO_ROOT / "crds"


@pytest.fixture(scope="session")
def kube() -> Iterator[ControlPlane]:
    try:
        bin_dir = ensure_binaries()
    except KubeUnavailable as exc:
        pytest.skip(str(exc))
    plane = ControlPlane(bin_dir)
    plane.start()
    try:
        yield plane
    finally:
        plane.stop()


def wait_established(kube: ControlPlane, names: list[str]) -> None:
    kube.kubectl("wait", "--for=condition=Established", "--timeout=90s", *[f"crd/{n}" for n in names])


def crd_names(kube: ControlPlane, *paths: Path) -> list[str]:
    """Names of the CRDs in the given files, as kubectl reads them (no YAML parsing of our own)."""
    args: list[str] = []
    for path in paths:
        args += ["-f", str(path)]
    out = kube.kubectl("create", "--dry-run=client", "-o", "name", *args).stdout
    return [line.split("/", 1)[1] for line in out.split() if line.startswith("customresourcedefinition")]


@pytest.fixture(scope="session")
def third_party_crds(kube: ControlPlane) -> list[str]:
    """KEDA and Prometheus Operator CRDs (from their Go modules), and Metacontroller's when a copy of
    shared/ sits beside the clone, installed and Established."""
    try:
        files = module_crds() + metacontroller_crds()
    except ThirdPartyUnavailable as exc:
        pytest.skip(str(exc))
    args: list[str] = []
    for path in files:
        args += ["-f", str(path)]
    kube.kubectl("apply", "--server-side", *args)
    names = crd_names(kube, *files)
    wait_established(kube, names)
    return names


@pytest.fixture(scope="session")
def noctaya_crds(kube: ControlPlane) -> list[str]:
    """Noctaya's generated CRDs from crds/, installed and Established."""
    files = sorted(CRDS_DIR.glob("*.yaml"))
    files = [f for f in files if f.name != "kustomization.yaml"]
    if not files:
        pytest.fail(f"no CRDs in {CRDS_DIR}: run `python -m hooks crds --out crds`")
    kube.kubectl("apply", "--server-side", "-k", str(CRDS_DIR))
    names = crd_names(kube, *files)
    wait_established(kube, names)
    return names


@pytest.fixture(scope="session")
def installed(kube: ControlPlane, third_party_crds: list[str], noctaya_crds: list[str]) -> ControlPlane:
    """The whole install: third-party CRDs, then `kubectl apply --server-side -k metacontroller/`."""
    if not metacontroller_crds():
        pytest.skip(f"Metacontroller's CRDs not found in {SHARED_THIRD_PARTY / 'metacontroller'} (no Go module "
                    "publishes them; a copy of shared/ beside the clone provides them)")
    kube.kubectl("apply", "--server-side", "-k", str(REPO_ROOT / "metacontroller"))
    return kube
