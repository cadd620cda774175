"""Helm for the chart tests, built from its published Go module at the version pinned in
tools/kube-testenv/versions.env, into the same cache as the API server (outside the repository)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from tests.kube.apiserver import KubeUnavailable, _versions, cache_dir
from tests.third_party import ThirdPartyUnavailable, go_build_cached


def helm_binary() -> Path:
    """The cached helm, built on first use. Raises KubeUnavailable with the reason."""
    module, _, version = _versions()["HELM_MODULE"].partition("@")
    binary = cache_dir().parent / f"helm-{version}" / "bin" / "helm"
    if binary.exists():
        return binary
    with tempfile.TemporaryDirectory(prefix="noctaya-helm-build-") as work:
        # A throwaway main module that requires helm at the pinned version (`go install pkg@v` would
        # refuse if helm's go.mod ever carried replace directives; a wrapper module does not).
        Path(work, "go.mod").write_text("module noctaya.test/helm\n\ngo 1.25\n")
        try:
            return go_build_cached(binary, Path(work), [["go", "get", f"{module}@{version}"]], f"{module}/cmd/helm",
                                   CGO_ENABLED="0")
        except ThirdPartyUnavailable as exc:
            raise KubeUnavailable(f"{module}@{version}: {exc}") from None
