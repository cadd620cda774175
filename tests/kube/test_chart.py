"""The Helm chart (charts/noctaya): generated from the kustomize install, linted and rendered by a
real helm (built from its Go module), and its output applied server-side to the test API server."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.kube.apiserver import REPO_ROOT, ControlPlane, KubeUnavailable
from tests.kube.gobuild import helm_binary

CHART = REPO_ROOT / "charts" / "noctaya"
NAMESPACE = "noctaya-system"


def test_chart_is_generated_from_the_kustomize_install() -> None:
    out = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "chart" / "generate.py"), "--check"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, f"charts/noctaya is stale: run `make chart`\n{out.stderr}"


@pytest.fixture(scope="module")
def helm() -> Path:
    try:
        return helm_binary()
    except KubeUnavailable as exc:
        pytest.skip(str(exc))


def run_helm(helm: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    home = helm.parent.parent / "home"  # helm's cache/config/data dirs, inside the build cache
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "HELM_CACHE_HOME": str(home / "cache"),
           "HELM_CONFIG_HOME": str(home / "config"), "HELM_DATA_HOME": str(home / "data")}
    out = subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120, check=False, env=env)
    if check and out.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{out.stderr}{out.stdout}")
    return out


def template(helm: Path, *values: str) -> list[dict[str, Any]]:
    out = run_helm(helm, "template", "noctaya", str(CHART), "--namespace", NAMESPACE, "--include-crds", *values)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_key(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def test_helm_lint_passes_and_the_schema_refuses_bad_values(helm: Path) -> None:
    run_helm(helm, "lint", "--strict", str(CHART))
    for bad in ("hooks.replicas=0", "image.pullPolicy=Sometimes", "unknownKey=1"):
        out = run_helm(helm, "lint", str(CHART), "--set", bad, check=False)
        assert out.returncode != 0, f"--set {bad} was accepted"


def test_helm_template_renders_exactly_the_kustomize_install(helm: Path, kube: ControlPlane) -> None:
    chart = by_key(template(helm))
    kustomized = by_key([d for d in yaml.safe_load_all(kube.kubectl("kustomize", str(REPO_ROOT / "metacontroller")).stdout) if d])
    secret = chart.pop(("Secret", "noctaya-hooks"))
    tls = chart.pop(("Secret", "noctaya-hooks-tls"))
    kustomized.pop(("Namespace", NAMESPACE))  # the release namespace (helm --create-namespace)
    assert set(chart) == set(kustomized)
    for key, obj in kustomized.items():
        assert json.dumps(chart[key], sort_keys=True) == json.dumps(obj, sort_keys=True), f"{key} differs"
    # The generated hook Secret: both keys, random, kept on uninstall.
    assert set(secret["data"]) == {"hook-token", "token-key"}
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    again = by_key(template(helm))[("Secret", "noctaya-hooks")]
    assert again["data"]["hook-token"] != secret["data"]["hook-token"]  # random (no cluster to look up)
    # The generated serving certificate: for the Service Metacontroller dials, signed by ca.crt.
    assert tls["type"] == "kubernetes.io/tls" and set(tls["data"]) == {"tls.crt", "tls.key", "ca.crt"}
    assert tls["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    cert = base64.b64decode(tls["data"]["tls.crt"])
    text = subprocess.run(["openssl", "x509", "-noout", "-text"], input=cert, capture_output=True, check=True,
                          timeout=30).stdout.decode()
    assert f"DNS:noctaya-hooks.{NAMESPACE}.svc" in text
    with tempfile.TemporaryDirectory() as work:
        Path(work, "ca.crt").write_bytes(base64.b64decode(tls["data"]["ca.crt"]))
        Path(work, "tls.crt").write_bytes(cert)
        verified = subprocess.run(["openssl", "verify", "-CAfile", "ca.crt", "tls.crt"], cwd=work, capture_output=True,
                                  timeout=30)
        assert verified.returncode == 0, verified.stderr


def test_values_change_only_what_they_name(helm: Path) -> None:
    docs = by_key(template(helm, "--set", "image.tag=9.9.9", "--set", "hooks.existingSecret=my-hooks",
                           "--set", "hooks.tls.existingSecret=my-tls",
                           "--set", "hooks.replicas=3", "--set", "metacontroller.serviceAccount.namespace=mc"))
    assert ("Secret", "noctaya-hooks") not in docs  # the user's Secret is used, none generated
    hooks = docs[("Deployment", "noctaya-hooks")]
    assert hooks["spec"]["replicas"] == 3
    container = hooks["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "ghcr.io/noctaya/noctaya:9.9.9"
    assert {"name": "NOCTAYA_IMAGE", "value": "ghcr.io/noctaya/noctaya:9.9.9"} in container["env"]
    assert hooks["spec"]["template"]["spec"]["volumes"][1]["secret"]["secretName"] == "my-hooks"
    assert ("Secret", "noctaya-hooks-tls") not in docs
    assert hooks["spec"]["template"]["spec"]["volumes"][2]["secret"]["secretName"] == "my-tls"
    controller = docs[("CompositeController", "noctaya-llmservice")]
    assert controller["spec"]["hooks"]["sync"]["webhook"]["authorization"]["secretRef"]["name"] == "my-hooks"
    assert controller["spec"]["hooks"]["sync"]["webhook"]["caBundle"]["secretRef"]["name"] == "my-tls"
    binding = docs[("ClusterRoleBinding", "noctaya-metacontroller")]
    assert binding["subjects"][0]["namespace"] == "mc"


def test_helm_output_applies_server_side(helm: Path, installed: ControlPlane) -> None:
    other = "noctaya-helm"
    installed.kubectl("create", "namespace", other, check=False)
    out = run_helm(helm, "template", "noctaya", str(CHART), "--namespace", other, "--include-crds").stdout
    installed.kubectl("apply", "--server-side", "--dry-run=server", "--field-manager=helm-chart-test",
                      "--force-conflicts", "-n", other, "-f", "-", stdin=out)
    assert f"noctaya-hooks.{other}.svc" in out


def test_install_upgrade_uninstall_keeps_the_hook_secret(helm: Path) -> None:
    """A real `helm install` / `upgrade` / `uninstall` on an API server of its own (the session's already
    holds the kustomize install, whose cluster-scoped objects helm would refuse to adopt)."""
    from tests.kube.apiserver import ensure_binaries
    from tests.third_party import metacontroller_crds

    crds = metacontroller_crds()
    if not crds:
        pytest.skip("Metacontroller's CRDs are not available (a copy of shared/ beside the clone provides them)")
    plane = ControlPlane(ensure_binaries())
    plane.start()
    try:
        plane.kubectl("apply", "--server-side", *[a for c in crds for a in ("-f", str(c))])
        plane.kubectl("wait", "--for=condition=Established", "--timeout=90s", "crd/compositecontrollers.metacontroller.k8s.io",
                      "crd/decoratorcontrollers.metacontroller.k8s.io")
        common = ["--kubeconfig", str(plane.kubeconfig), "--namespace", NAMESPACE]

        def secret() -> dict[str, str]:
            return json.loads(plane.kubectl("-n", NAMESPACE, "get", "secret", "noctaya-hooks", "-o", "json").stdout)["data"]

        def tls() -> dict[str, str]:
            return json.loads(plane.kubectl("-n", NAMESPACE, "get", "secret", "noctaya-hooks-tls", "-o", "json").stdout)["data"]

        run_helm(helm, "install", "noctaya", str(CHART), "--create-namespace", "--wait=false", *common)
        first, first_tls = secret(), tls()
        assert set(first) == {"hook-token", "token-key"}
        run_helm(helm, "upgrade", "noctaya", str(CHART), "--set", "hooks.replicas=3", *common)
        assert secret() == first  # an upgrade keeps the token Metacontroller sends and the scaler-token key
        assert tls() == first_tls  # ... and the certificate (and CA) the controllers trust
        assert json.loads(plane.kubectl("-n", NAMESPACE, "get", "deployment", "noctaya-hooks", "-o", "json").stdout)["spec"]["replicas"] == 3
        run_helm(helm, "uninstall", "noctaya", *common)
        assert secret() == first and tls() == first_tls  # kept on uninstall (resource-policy: keep)
        assert plane.kubectl("-n", NAMESPACE, "get", "deployment", "noctaya-hooks", "--ignore-not-found", "-o", "name").stdout == ""
    finally:
        plane.stop()
