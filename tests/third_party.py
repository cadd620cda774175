"""Third-party CRDs for the tests, from where each project publishes them.

KEDA, the Prometheus Operator and cert-manager publish Go modules: their CRDs are read from those modules at the
versions pinned in tools/kube-testenv/versions.env, downloaded once into Go's module cache (outside
the repository) with ``go mod download``. Metacontroller is not served as a module; its CRDs come
from ``../shared/third_party`` when a copy of shared/ sits beside the clone, and the tests that need
them skip with the reason otherwise.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
VERSIONS = REPO_ROOT / "tools" / "kube-testenv" / "versions.env"
SHARED_THIRD_PARTY = REPO_ROOT.parent / "shared" / "third_party"

# module variable in versions.env -> CRD files inside that module
MODULE_CRDS = {
    "KEDA_MODULE": ["config/crd/bases/keda.sh_scaledobjects.yaml",
                    "config/crd/bases/keda.sh_triggerauthentications.yaml",
                    "config/crd/bases/keda.sh_clustertriggerauthentications.yaml"],
    # The hook server's certificate example (examples/security/hook-server-cert-manager.yaml).
    "CERT_MANAGER_MODULE": ["deploy/crds/cert-manager.io_issuers.yaml",
                            "deploy/crds/cert-manager.io_certificates.yaml"],
    "PROMETHEUS_OPERATOR_MODULE": ["example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml",
                                   "example/prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml",
                                   "example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml"],
}


def go_env(**extra: str) -> dict[str, str]:
    """The environment every test-time Go command runs with: the installed toolchain only, modules
    resolved as needed, and no checksum-database lookups (go.sum or the proxy pins the hashes; the
    database is not reachable from every build machine)."""
    return {**os.environ, "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=mod", "GOSUMDB": os.environ.get("GOSUMDB", "off"), **extra}


class ThirdPartyUnavailable(Exception):
    """A skip reason."""


class BuildFailed(ThirdPartyUnavailable):
    """The tools were there but the build or download itself failed (the tests still skip with it; the
    set-up step, tests/setup.py, fails on it)."""


GO_BUILD_TIMEOUT_SECONDS = 1800
# A build or download that failed once in this process fails again: do not spend another one on it.
_FAILED: dict[str, ThirdPartyUnavailable] = {}


def go_build_cached(binary: Path, cwd: Path, prepare: list[list[str]], package: str, **env: str) -> Path:
    """Build ``package`` (in the module at ``cwd``, after the ``prepare`` commands) into ``binary``,
    atomically, unless it is already there. Raises ThirdPartyUnavailable with the reason (BuildFailed
    when a command failed). One build per binary at a time across processes (a lock file beside it)."""
    if binary.exists():
        return binary
    if shutil.which("go") is None:
        raise ThirdPartyUnavailable(f"Go not found: needed to build {package}")
    if str(binary) in _FAILED:
        raise _FAILED[str(binary)]
    binary.parent.mkdir(parents=True, exist_ok=True)
    with open(binary.parent / f".{binary.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session building it: wait, then find it built
        if binary.exists():
            return binary
        started = time.monotonic()
        for argv in [*prepare, ["go", "build", "-trimpath", "-o", f"{binary}.tmp", package]]:
            try:
                out = subprocess.run(argv, cwd=cwd, env=go_env(**env), capture_output=True, text=True,
                                     timeout=GO_BUILD_TIMEOUT_SECONDS, check=False)
            except subprocess.TimeoutExpired:
                _FAILED[str(binary)] = BuildFailed(f"`{' '.join(argv[:3])}` took over {GO_BUILD_TIMEOUT_SECONDS}s")
                raise _FAILED[str(binary)] from None
            if out.returncode != 0:
                _FAILED[str(binary)] = BuildFailed(f"`{' '.join(argv[:3])}` failed: {out.stderr.strip()[-500:]}")
                raise _FAILED[str(binary)]
        os.replace(f"{binary}.tmp", binary)
    print(f"built {binary.name} in {time.monotonic() - started:.0f}s", file=sys.stderr)
    return binary


def _pinned(variable: str) -> str:
    for line in VERSIONS.read_text().splitlines():
        key, _, value = line.partition("=")
        if key.strip() == variable:
            return value.strip()
    raise KeyError(f"{variable} not pinned in {VERSIONS}")


def module_dir(variable: str) -> Path:
    """The unpacked module (``go mod download``; cached by Go, so only the first call fetches).
    Raises ThirdPartyUnavailable (BuildFailed when the download failed), the same one on every call."""
    if variable in _FAILED:
        raise _FAILED[variable]
    try:
        return _module_dir(variable)
    except BuildFailed as exc:
        _FAILED[variable] = exc
        raise


@functools.cache
def _module_dir(variable: str) -> Path:
    if shutil.which("go") is None:
        raise ThirdPartyUnavailable(f"Go not found: needed to download {_pinned(variable)} for its CRDs")
    module = _pinned(variable)
    env = go_env()
    try:
        out = subprocess.run(["go", "mod", "download", "-json", module], capture_output=True, text=True,
                             timeout=600, cwd=REPO_ROOT / "tools", env=env)
    except subprocess.TimeoutExpired:
        raise BuildFailed(f"cannot download {module}: `go mod download` took over 600s") from None
    try:
        info = json.loads(out.stdout)
    except ValueError:
        info = {}
    if out.returncode != 0 or "Dir" not in info:
        detail = info.get("Error") or out.stderr.strip()[-300:]
        raise BuildFailed(f"cannot download {module}: {detail}")
    return Path(info["Dir"])


def module_crds() -> list[Path]:
    """KEDA's and the Prometheus Operator's CRD files. Raises ThirdPartyUnavailable."""
    return [module_dir(var) / rel for var, rels in MODULE_CRDS.items() for rel in rels]


def keda_scaledobject_crd() -> Path:
    """KEDA's ScaledObject CRD; skips the calling test with the reason when it cannot be had."""
    try:
        return module_dir("KEDA_MODULE") / MODULE_CRDS["KEDA_MODULE"][0]
    except ThirdPartyUnavailable as exc:
        pytest.skip(str(exc))


def metacontroller_crds() -> list[Path]:
    """Metacontroller's CRDs from ../shared (no Go module publishes them); [] when absent."""
    return sorted((SHARED_THIRD_PARTY / "metacontroller").glob("*.yaml"))
