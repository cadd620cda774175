"""The hook server over HTTPS, as `python -m hooks serve` runs it (gunicorn, a real TLS socket): a sync
and a customize call with the bearer token, then a rotated certificate and token picked up without a
restart. No customize answer asks for Secrets."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.hooks import helpers as h
from tests.pki import make_ca, make_leaf

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def issue(pki: Path, name: str, serial: str) -> tuple[Path, Path]:
    """A serving certificate for 127.0.0.1 signed by the test CA, with a known serial."""
    return make_leaf(pki, name, "ca", sans="IP:127.0.0.1,DNS:noctaya-hooks.noctaya-system.svc", serial=serial)


def install(cert: Path, key: Path, target: Path) -> None:
    """Swap both files in at once, as the kubelet does for a Secret volume (rename, not rewrite)."""
    for src, dst in ((key, target / "tls.key"), (cert, target / "tls.crt")):
        tmp = dst.with_suffix(".new")
        tmp.write_bytes(src.read_bytes())
        os.replace(tmp, dst)


def served_serial(port: int, ca: Path) -> int:
    context = ssl.create_default_context(cafile=str(ca))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            der = tls.getpeercert(binary_form=True)
    out = subprocess.run(["openssl", "x509", "-inform", "DER", "-noout", "-serial"], input=der, capture_output=True,
                         check=True, timeout=30)
    return int(out.stdout.decode().strip().split("=")[1], 16)


@pytest.fixture
def https_server(tmp_path: Path) -> Iterator[tuple[int, Path, Path, Path]]:
    if not shutil.which("openssl"):
        pytest.skip("openssl not found")
    pki = tmp_path / "pki"
    pki.mkdir()
    make_ca(pki, "ca")
    mounted = tmp_path / "mounted"
    mounted.mkdir()
    install(*issue(pki, "first", "0x1001"), mounted)
    token = tmp_path / "hook-token"
    token.write_text("token-one\n")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "NOCTAYA_HOOK_TOKEN_FILE": str(token),
           "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom")}
    proc = subprocess.Popen([sys.executable, "-m", "hooks", "serve", "--bind", f"127.0.0.1:{port}", "--workers", "1",
                             "--tls-cert-file", str(mounted / "tls.crt"), "--tls-key-file", str(mounted / "tls.key")],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        try:
            requests.get(f"https://127.0.0.1:{port}/healthz", verify=str(pki / "ca.crt"), timeout=2)
            break
        except requests.RequestException:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"hook server did not start: {proc.stdout.read().decode()[-2000:]}") from None
            time.sleep(0.1)
    try:
        yield port, pki, mounted, token
    finally:
        proc.terminate()
        proc.wait(30)


def test_hooks_over_https_with_rotated_certificate_and_token(https_server: tuple[int, Path, Path, Path]) -> None:
    port, pki, mounted, token = https_server
    ca = str(pki / "ca.crt")
    base = f"https://127.0.0.1:{port}"
    service = h.llmservice(endpoint={"auth": {"secretRef": {"name": "keys"}}},
                           model={"source": "hf://org/m", "credentialsSecret": {"name": "hub"}},
                           scalerTLS={"secretName": "tls", "triggerAuthentication": "ta"})

    def call(path: str, body: dict, bearer: str) -> requests.Response:
        return requests.post(f"{base}{path}", json=body, verify=ca, timeout=10,
                             headers={"Authorization": f"Bearer {bearer}"})

    assert served_serial(port, pki / "ca.crt") == 0x1001
    customize = call("/v1/llmservice/customize", {"controller": {}, "parent": service}, "token-one")
    assert customize.status_code == 200
    rules = customize.json()["relatedResources"]
    # Secrets are referenced three times in this spec; none is asked for (their data would be sent).
    assert rules and all(rule["resource"] != "secrets" for rule in rules)
    synced = call("/v1/llmservice/sync", h.sync_request(service), "token-one")
    assert synced.status_code == 200 and synced.json()["children"]

    # cert-manager renews the certificate; the kubelet swaps the Secret's files.
    install(*issue(pki, "second", "0x2002"), mounted)
    deadline = time.monotonic() + 10
    while served_serial(port, pki / "ca.crt") != 0x2002:
        assert time.monotonic() < deadline, "the rotated certificate was not served"
        time.sleep(0.2)
    token.write_text("token-two\n")
    assert call("/v1/llmservice/sync", h.sync_request(service), "token-two").status_code == 200
    assert call("/v1/llmservice/sync", h.sync_request(service), "token-one").status_code == 401
    # Plain HTTP is not served on the TLS port.
    with pytest.raises(requests.RequestException):
        requests.get(f"http://127.0.0.1:{port}/healthz", timeout=3).raise_for_status()
