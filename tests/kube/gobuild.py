"""Test-time programs built from their published Go modules at the versions pinned in
tools/kube-testenv/versions.env (helm, kwok, KEDA's operator), each into its own directory beside the
API server's cache, outside the repository. Built once; later calls return the cached binary."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from tests.kube.apiserver import KubeBuildFailed, KubeUnavailable, _versions, cache_dir
from tests.third_party import BuildFailed, ThirdPartyUnavailable, go_build_cached, module_dir

_REPLACE_BLOCK = re.compile(r"^replace \($.*?^\)$|^replace [^(].*?$", re.M | re.S)


def module_binary_path(variable: str, name: str) -> Path:
    """Where ``module_binary`` builds ``name`` (whether or not it is built)."""
    version = _versions()[variable].partition("@")[2]
    return cache_dir().parent / f"{name}-{version}" / "bin" / name


def module_binary(variable: str, package: str, name: str, *, keep_replaces: bool = False) -> Path:
    """Build ``package`` of the module pinned as ``variable`` (cached). Raises KubeUnavailable.

    The build runs in a throwaway main module that requires the pinned module (`go install pkg@v`
    refuses modules whose go.mod has replace directives). With ``keep_replaces`` the wrapper carries
    the module's own replace directives, which a requiring module does not inherit: KEDA pins its
    Kubernetes libraries that way, as Kubernetes pins its staging modules (tools/kube-testenv/k8s).
    """
    module, _, version = _versions()[variable].partition("@")
    binary = module_binary_path(variable, name)
    if binary.exists():
        return binary
    replaces = ""
    if keep_replaces:
        try:
            own = (module_dir(variable) / "go.mod").read_text()
        except ThirdPartyUnavailable as exc:
            raise _kube_error(exc)(f"{module}@{version}: {exc}") from None
        replaces = "\n".join(block.group(0) for block in _REPLACE_BLOCK.finditer(own))
    with tempfile.TemporaryDirectory(prefix=f"noctaya-{name}-build-") as work:
        Path(work, "go.mod").write_text(f"module noctaya.test/{name}\n\ngo 1.26.0\n\n{replaces}\n")
        try:
            return go_build_cached(binary, Path(work), [["go", "get", f"{package}@{version}"]], package,
                                   CGO_ENABLED="0")
        except ThirdPartyUnavailable as exc:
            raise _kube_error(exc)(f"{module}@{version}: {exc}") from None


def _kube_error(exc: ThirdPartyUnavailable) -> type[KubeUnavailable]:
    return KubeBuildFailed if isinstance(exc, BuildFailed) else KubeUnavailable


def promtool_binary() -> Path:
    return module_binary("PROMETHEUS_MODULE", "github.com/prometheus/prometheus/cmd/promtool", "promtool")


def helm_binary() -> Path:
    return module_binary("HELM_MODULE", "helm.sh/helm/v4/cmd/helm", "helm")


def kwok_binary() -> Path:
    return module_binary("KWOK_MODULE", "sigs.k8s.io/kwok/cmd/kwok", "kwok")


def keda_operator_binary() -> Path:
    return module_binary("KEDA_MODULE", "github.com/kedacore/keda/v2/cmd/operator", "keda-operator", keep_replaces=True)
