"""Helm for the chart tests, built from its published Go module at the version pinned in
tools/kube-testenv/versions.env, into the same cache as the API server (outside the repository)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from tests.kube.apiserver import KubeUnavailable, _versions, cache_dir
from tests.third_party import go_env

BUILD_TIMEOUT_SECONDS = 1800


def helm_binary() -> Path:
    """The cached helm, built on first use. Raises KubeUnavailable with the reason."""
    module, _, version = _versions()["HELM_MODULE"].partition("@")
    binary = cache_dir().parent / f"helm-{version}" / "bin" / "helm"
    if binary.exists():
        return binary
    if shutil.which("go") is None:
        raise KubeUnavailable(f"Go not found: needed to build {module}@{version}")
    binary.parent.mkdir(parents=True, exist_ok=True)
    env = go_env(CGO_ENABLED="0")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="noctaya-helm-build-") as work:
        # A throwaway main module that requires helm at the pinned version (`go install pkg@v` would
        # refuse if helm's go.mod ever carried replace directives; a wrapper module does not).
        Path(work, "go.mod").write_text("module noctaya.test/helm\n\ngo 1.25\n")
        for argv in (["go", "get", f"{module}@{version}"],
                     ["go", "build", "-trimpath", "-o", str(binary) + ".tmp", f"{module}/cmd/helm"]):
            out = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True,
                                 timeout=BUILD_TIMEOUT_SECONDS, check=False)
            if out.returncode != 0:
                raise KubeUnavailable(f"{' '.join(argv[:2])} {module}@{version} failed: {out.stderr.strip()[-500:]}")
    os.replace(str(binary) + ".tmp", binary)
    print(f"built helm {version} in {time.monotonic() - started:.0f}s")
    return binary
