"""tools/make-hook-cert.sh against a real kube-apiserver: the first run makes a CA and a certificate,
a rerun renews the certificate with the same CA (ca.crt unchanged, so Metacontroller's caBundle stays
valid), and a CA change goes in two steps that never serve a certificate ca.crt did not already trust:
--new-ca adds the new CA beside the old one and keeps the served certificate, the next run serves a
certificate from the new CA, --drop-old-cas leaves the new CA alone in ca.crt. An install made by the
script's earlier versions (a CA whose key was thrown away) is moved the same way."""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kube.apiserver import REPO_ROOT, ControlPlane
from tests.pki import certificate_dates, make_ca, make_leaf, openssl

SCRIPT = REPO_ROOT / "tools" / "make-hook-cert.sh"
DAY = 86400

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


def run_script(kube: ControlPlane, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=180,
                            env={"PATH": f"{kube.bin_dir}:{os.environ['PATH']}", "KUBECONFIG": str(kube.kubeconfig),
                                 "HOME": str(kube.workdir)})
    if check:
        assert result.returncode == 0, result.stderr + result.stdout
    assert "PRIVATE KEY" not in result.stdout + result.stderr
    return result


def secret(kube: ControlPlane, namespace: str, name: str) -> tuple[dict[str, bytes], dict[str, object]]:
    """(decoded data, the whole object) of a Secret."""
    obj = json.loads(kube.kubectl("-n", namespace, "get", "secret", name, "-o", "json").stdout)
    return {key: base64.b64decode(value) for key, value in obj["data"].items()}, obj


def certificates(bundle: bytes) -> list[bytes]:
    """The PEM blocks of a bundle, in order."""
    end = b"-----END CERTIFICATE-----\n"
    return [part + end for part in bundle.split(end) if part.strip()]


def verifies(tmp_path: Path, leaf: bytes, trusted: bytes) -> bool:
    (tmp_path / "leaf.pem").write_bytes(leaf)
    (tmp_path / "trusted.pem").write_bytes(trusted)
    result = subprocess.run(["openssl", "verify", "-purpose", "sslserver", "-CAfile", "trusted.pem", "leaf.pem"],
                            cwd=tmp_path, capture_output=True, timeout=30)
    return result.returncode == 0


def assert_pair(tmp_path: Path, cert: bytes, key: bytes) -> None:
    """The key is the certificate's."""
    (tmp_path / "pair.crt").write_bytes(cert)
    (tmp_path / "pair.key").write_bytes(key)
    assert (openssl("x509", "-noout", "-pubkey", "-in", "pair.crt", cwd=tmp_path)
            == openssl("pkey", "-pubout", "-in", "pair.key", cwd=tmp_path))


def days_left(cert: bytes) -> float:
    return (certificate_dates(cert)[1] - time.time()) / DAY


@pytest.fixture
def namespace(kube: ControlPlane) -> Iterator[str]:
    name = f"hook-cert-{secrets.token_hex(3)}"
    kube.kubectl("create", "namespace", name)
    yield name
    kube.kubectl("delete", "namespace", name, "--wait=false")


def test_renewal_keeps_the_ca_and_a_ca_change_goes_in_two_safe_steps(kube: ControlPlane, namespace: str,
                                                                       tmp_path: Path) -> None:
    host = f"noctaya-hooks.{namespace}.svc"
    run_script(kube, namespace, "30")
    ca, ca_obj = secret(kube, namespace, "noctaya-hooks-ca")
    tls, tls_obj = secret(kube, namespace, "noctaya-hooks-tls")
    assert ca_obj["type"] == tls_obj["type"] == "kubernetes.io/tls"
    assert tls["ca.crt"] == ca["tls.crt"] and verifies(tmp_path, tls["tls.crt"], tls["ca.crt"])
    assert_pair(tmp_path, tls["tls.crt"], tls["tls.key"])
    assert 29 < days_left(tls["tls.crt"]) <= 30 and days_left(ca["tls.crt"]) > 3600
    (tmp_path / "served.crt").write_bytes(tls["tls.crt"])
    assert f"DNS:{host}, DNS:{host}.cluster.local" in openssl("x509", "-noout", "-ext", "subjectAltName", "-in",
                                                              "served.crt", cwd=tmp_path)
    for obj in (ca_obj, tls_obj):  # server-side apply: no annotation holding a second copy of the keys
        assert "kubectl.kubernetes.io/last-applied-configuration" not in obj["metadata"].get("annotations", {})

    # Renewal: same CA, so ca.crt (Metacontroller's caBundle) does not change.
    run_script(kube, namespace)
    renewed, _ = secret(kube, namespace, "noctaya-hooks-tls")
    assert secret(kube, namespace, "noctaya-hooks-ca")[0] == ca
    assert renewed["ca.crt"] == tls["ca.crt"]
    assert certificate_dates(renewed["tls.crt"])[0] != certificate_dates(tls["tls.crt"])[0]
    assert renewed["tls.key"] != tls["tls.key"] and verifies(tmp_path, renewed["tls.crt"], renewed["ca.crt"])
    assert 364 < days_left(renewed["tls.crt"]) <= 365

    # CA change, step 1: the new CA is trusted beside the old one; the served certificate stays.
    out = run_script(kube, "--new-ca", namespace).stdout
    assert "restart Metacontroller" in out
    new_ca, _ = secret(kube, namespace, "noctaya-hooks-ca")
    step1, _ = secret(kube, namespace, "noctaya-hooks-tls")
    assert new_ca["tls.crt"] != ca["tls.crt"]
    assert certificates(step1["ca.crt"]) == [ca["tls.crt"], new_ca["tls.crt"]]
    assert (step1["tls.crt"], step1["tls.key"]) == (renewed["tls.crt"], renewed["tls.key"])

    # Step 2 (after Metacontroller reread ca.crt): a certificate from the new CA; both still trusted.
    run_script(kube, namespace)
    step2, _ = secret(kube, namespace, "noctaya-hooks-tls")
    assert step2["ca.crt"] == step1["ca.crt"]
    assert verifies(tmp_path, step2["tls.crt"], new_ca["tls.crt"])
    assert not verifies(tmp_path, step2["tls.crt"], ca["tls.crt"])

    # Done: the old CA leaves ca.crt.
    run_script(kube, "--drop-old-cas", namespace)
    final, _ = secret(kube, namespace, "noctaya-hooks-tls")
    assert final["ca.crt"] == new_ca["tls.crt"] and verifies(tmp_path, final["tls.crt"], final["ca.crt"])


def test_an_install_from_the_earlier_script_moves_to_a_kept_ca_without_breaking_calls(
        kube: ControlPlane, namespace: str, tmp_path: Path) -> None:
    # What the earlier script left: a Secret applied client-side (its keys in the last-applied
    # annotation too) from a CA whose key is gone.
    make_ca(tmp_path, "lost-ca")
    cert, key = make_leaf(tmp_path, "old", "lost-ca", sans=f"DNS:noctaya-hooks.{namespace}.svc")
    created = kube.kubectl("-n", namespace, "create", "secret", "generic", "noctaya-hooks-tls",
                           "--type=kubernetes.io/tls", f"--from-file=tls.crt={cert}", f"--from-file=tls.key={key}",
                           f"--from-file=ca.crt={tmp_path / 'lost-ca.crt'}", "--dry-run=client", "-o", "yaml").stdout
    kube.kubectl("apply", "-f", "-", stdin=created)
    annotations = secret(kube, namespace, "noctaya-hooks-tls")[1]["metadata"]["annotations"]
    assert "kubectl.kubernetes.io/last-applied-configuration" in annotations  # type: ignore[index,operator]

    run_script(kube, namespace)
    ca, _ = secret(kube, namespace, "noctaya-hooks-ca")
    step1, obj = secret(kube, namespace, "noctaya-hooks-tls")
    assert certificates(step1["ca.crt"]) == [(tmp_path / "lost-ca.crt").read_bytes(), ca["tls.crt"]]
    assert step1["tls.crt"] == cert.read_bytes()  # still the one Metacontroller trusts
    assert "kubectl.kubernetes.io/last-applied-configuration" not in obj["metadata"].get("annotations", {})

    run_script(kube, namespace)
    step2, _ = secret(kube, namespace, "noctaya-hooks-tls")
    assert verifies(tmp_path, step2["tls.crt"], ca["tls.crt"])


@pytest.mark.parametrize("args", [["ns", "soon"], ["--rotate"], ["--new-ca", "--drop-old-cas"], ["a", "1", "b"]])
def test_bad_arguments_are_refused_before_anything_is_changed(args: list[str], tmp_path: Path) -> None:
    result = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=30,
                            env={"PATH": "/usr/bin:/bin", "KUBECONFIG": str(tmp_path / "none")})
    assert result.returncode == 2 and result.stderr


def test_help_is_the_header_comment() -> None:
    result = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0
    assert "--new-ca" in result.stdout and "--drop-old-cas" in result.stdout and "set -e" not in result.stdout
