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


def test_idle_silent_and_stalled_tls_connections_never_take_every_thread(
        https_server: tuple[int, Path, Path, Path]) -> None:
    """One worker with the default 4 threads. Go's HTTP client (Metacontroller) leaves connections
    that finished their handshake but carry no request in its idle pool; with plain gthread each one
    held a thread in a blocking read, and four of them stopped every hook call of an e2e run."""
    from hooks.gunicorn_conf import DEFAULT_THREADS, TLS_HANDSHAKE_TIMEOUT_SECONDS

    port, pki, _mounted, token = https_server
    ca = str(pki / "ca.crt")
    base = f"https://127.0.0.1:{port}"
    service = h.llmservice()
    context = ssl.create_default_context(cafile=ca)

    def sync() -> float:
        started = time.monotonic()
        resp = requests.post(f"{base}/v1/llmservice/sync", json=h.sync_request(service), verify=ca, timeout=30,
                             headers={"Authorization": "Bearer token-one"})
        assert resp.status_code == 200 and resp.json()["children"]
        return time.monotonic() - started

    spare = [context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10),
                                 server_hostname="127.0.0.1") for _ in range(3 * DEFAULT_THREADS)]
    silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2 * DEFAULT_THREADS)]
    stalled: list[socket.socket] = []
    try:
        time.sleep(1.0)
        # Spare and silent connections are parked after a short wait: a call is answered at once.
        assert sync() < 3.0
        # The spare connections still carry requests, in any order.
        for tls in reversed(spare):
            tls.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert tls.recv(64).startswith(b"HTTP/1.1 200")

        # A ClientHello that stops after its record header holds a thread until the handshake
        # deadline, then is closed; a call queued behind as many of them as there are threads waits
        # for that deadline and no longer.
        for _ in range(DEFAULT_THREADS):
            raw = socket.create_connection(("127.0.0.1", port), timeout=TLS_HANDSHAKE_TIMEOUT_SECONDS + 10)
            raw.sendall(b"\x16\x03\x01\x02\x00")
            stalled.append(raw)
        time.sleep(0.5)
        waited = sync()
        assert TLS_HANDSHAKE_TIMEOUT_SECONDS - 2 < waited < TLS_HANDSHAKE_TIMEOUT_SECONDS + 8
        for raw in stalled:
            try:
                assert raw.recv(64) == b""
            except ConnectionResetError:
                pass
    finally:
        for sock in (*spare, *silent, *stalled):
            sock.close()
