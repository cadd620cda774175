"""The hook server over HTTPS, as `python -m hooks serve` runs it (gunicorn, a real TLS socket): a sync
and a customize call with the bearer token, a rotated token picked up without a restart, and no thread
lost to idle or stalled TLS connections. No customize answer asks for Secrets. Certificate rotation and
the expiry gauge: tests/scaler/test_rotation.py, with the other TLS servers."""

from __future__ import annotations

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
from tests.hooks.https_server import ROOT, HookServerProcess
from tests.pki import SecretVolume, make_ca, make_leaf

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def https_server(tmp_path: Path) -> Iterator[tuple[int, Path, Path]]:
    if not shutil.which("openssl"):
        pytest.skip("openssl not found")
    pki = tmp_path / "pki"
    pki.mkdir()
    make_ca(pki, "ca")
    cert, key = make_leaf(pki, "first", "ca", sans="IP:127.0.0.1,DNS:noctaya-hooks.noctaya-system.svc")
    mounted = SecretVolume(tmp_path / "mounted", {"tls.crt": cert, "tls.key": key})
    token = tmp_path / "hook-token"
    token.write_text("token-one\n")
    server = HookServerProcess(tmp_path, mounted / "tls.crt", mounted / "tls.key", pki / "ca.crt", token)
    try:
        yield server.port, pki, token
    finally:
        server.stop()


def test_a_certificate_that_cannot_be_served_stops_serve_at_startup(tmp_path: Path) -> None:
    if not shutil.which("openssl"):
        pytest.skip("openssl not found")
    make_ca(tmp_path, "ca")
    cert, _ = make_leaf(tmp_path, "first", "ca")
    _, other_key = make_leaf(tmp_path, "second", "ca")
    proc = subprocess.run([sys.executable, "-m", "hooks", "serve", "--bind", "127.0.0.1:0", "--tls-cert-file",
                           str(cert), "--tls-key-file", str(other_key)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom")})
    assert proc.returncode == 2
    assert "cannot serve HTTPS" in proc.stderr and "do not load as a certificate and its key" in proc.stderr
    assert str(other_key) in proc.stderr and "PRIVATE KEY" not in proc.stderr


def test_hooks_over_https_with_a_rotated_token(https_server: tuple[int, Path, Path]) -> None:
    port, pki, token = https_server
    ca = str(pki / "ca.crt")
    base = f"https://127.0.0.1:{port}"
    service = h.llmservice(endpoint={"auth": {"secretRef": {"name": "keys"}}},
                           model={"source": "hf://org/m", "credentialsSecret": {"name": "hub"}},
                           scalerTLS={"secretName": "tls", "triggerAuthentication": "ta"})

    def call(path: str, body: dict, bearer: str) -> requests.Response:
        return requests.post(f"{base}{path}", json=body, verify=ca, timeout=10,
                             headers={"Authorization": f"Bearer {bearer}"})

    customize = call("/v1/llmservice/customize", {"controller": {}, "parent": service}, "token-one")
    assert customize.status_code == 200
    rules = customize.json()["relatedResources"]
    # Secrets are referenced three times in this spec; none is asked for (their data would be sent).
    assert rules and all(rule["resource"] != "secrets" for rule in rules)
    synced = call("/v1/llmservice/sync", h.sync_request(service), "token-one")
    assert synced.status_code == 200 and synced.json()["children"]

    token.write_text("token-two\n")
    assert call("/v1/llmservice/sync", h.sync_request(service), "token-two").status_code == 200
    assert call("/v1/llmservice/sync", h.sync_request(service), "token-one").status_code == 401
    # Plain HTTP is not served on the TLS port.
    with pytest.raises(requests.RequestException):
        requests.get(f"http://127.0.0.1:{port}/healthz", timeout=3).raise_for_status()


def test_idle_silent_and_stalled_tls_connections_never_take_every_thread(
        https_server: tuple[int, Path, Path]) -> None:
    """One worker with the default 4 threads. Go's HTTP client (Metacontroller) leaves connections
    that finished their handshake but carry no request in its idle pool; with plain gthread each one
    held a thread in a blocking read, and four of them stopped every hook call of an e2e run."""
    from hooks.gunicorn_conf import DEFAULT_THREADS, TLS_HANDSHAKE_TIMEOUT_SECONDS

    port, pki, _token = https_server
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
