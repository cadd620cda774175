"""The gateway → aggregator report channel over TLS: a real aggregator serving HTTPS with the scaler
certificate, real DemandReporters verifying it with the Secret's CA, certificates made by openssl.
Rotating the certificate in-process: test_rotation.py; here, in a real `python -m scaler aggregate`."""

from __future__ import annotations

import logging
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from scaler.aggregator import Aggregator, AggregatorSettings
from scaler.demand import Demand, DemandBroadcaster
from scaler.reporter import DemandReporter
from scaler.tls import TLSConfigError, TLSFiles, check_served_certificate
from tests.pki import (
    SecretVolume,
    bundle,
    certificate_dates,
    expiry_gauges,
    make_ca,
    make_leaf,
    presented_certificate,
)
from tests.ports import free_port

from .conftest import wait_until

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "report-token"
NAME = "qwen-scaler.models.svc.cluster.local"  # what the hooks render as the gateways' report host


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("report-pki")
    for ca in ("ca", "ca2", "rogue-ca"):
        make_ca(d, ca)
    sans = f"DNS:{NAME},DNS:localhost,IP:127.0.0.1"
    make_leaf(d, "server", "ca", sans=sans)
    make_leaf(d, "server2", "ca2", sans=sans, days=3)  # outlives "server": the gauges tell them apart
    make_leaf(d, "keda", "ca", usage="clientAuth")
    bundle(d, "both", "ca", "ca2")
    make_leaf(d, "elsewhere", "ca", sans="DNS:other.models.svc.cluster.local")
    return d


def secret_files(pki: Path, cert: str = "server", ca: str = "ca") -> dict[str, Path]:
    return {"tls.crt": pki / f"{cert}.crt", "tls.key": pki / f"{cert}.key", "ca.crt": pki / f"{ca}.crt"}


def secret_dir(pki: Path, d: Path, cert: str = "server", ca: str = "ca") -> TLSFiles:
    """A directory laid out like the mounted scaler TLS Secret."""
    volume = SecretVolume(d, secret_files(pki, cert, ca))
    return TLSFiles(str(volume / "tls.crt"), str(volume / "tls.key"), str(volume / "ca.crt"))


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN)
    return path


@pytest.fixture
def tls_aggregator(pki: Path, tmp_path: Path, token_file: Path):
    files = secret_dir(pki, tmp_path / "secret")
    agg = Aggregator(AggregatorSettings(token_file=str(token_file), request_deadline=1.0), DemandBroadcaster())
    agg.start("127.0.0.1", 0, tls=files)
    yield agg, files
    agg.stop()


def reporter(agg: Aggregator, token_file: Path, ca_file: str | None, demand: Demand,
             scheme: str = "https") -> tuple[DemandReporter, DemandBroadcaster]:
    source = DemandBroadcaster(demand)
    rep = DemandReporter(f"{scheme}://localhost:{agg.port}/v1/report", str(token_file), source,
                         interval=0.2, timeout=2.0, retry_delay=0.05, ca_file=ca_file)
    return rep, source


def test_reports_arrive_over_tls_and_are_summed(tls_aggregator, token_file) -> None:
    agg, files = tls_aggregator
    a, source_a = reporter(agg, token_file, files.ca_file, Demand(queued=3, in_flight=1))
    b, _ = reporter(agg, token_file, files.ca_file, Demand(queued=4, lease_active=True))
    a.start()
    b.start()
    try:
        assert wait_until(lambda: agg.broadcaster.current() == Demand(7, 1, True), timeout=10)
        source_a.publish(Demand(queued=0, in_flight=5))
        assert wait_until(lambda: agg.broadcaster.current() == Demand(4, 5, True), timeout=10)
    finally:
        a.stop()
        b.stop()
    assert wait_until(lambda: agg.member_count == 0, timeout=10)  # both withdrew over TLS
    assert a.failures == 0 and b.failures == 0


def test_a_gateway_without_the_right_ca_sends_nothing(tls_aggregator, token_file, pki, caplog) -> None:
    agg, _ = tls_aggregator
    wrong, _ = reporter(agg, token_file, str(pki / "rogue-ca.crt"), Demand(queued=9))
    with caplog.at_level(logging.WARNING, logger="noctaya.scaler.reporter"):
        assert wrong._post(Demand(queued=9)) is False
    assert agg.member_count == 0
    assert "SSLError" in caplog.text and TOKEN not in caplog.text
    wrong.stop(withdraw=False)


def test_a_plaintext_client_gets_nowhere_and_the_channel_keeps_working(tls_aggregator, token_file) -> None:
    agg, files = tls_aggregator
    with pytest.raises(requests.RequestException):
        requests.post(f"http://127.0.0.1:{agg.port}/v1/report", json={"member": "m", "seq": 1, "queued": 5},
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
    assert agg.member_count == 0
    good, _ = reporter(agg, token_file, files.ca_file, Demand(queued=2))
    assert good._post(Demand(queued=2)) is True
    assert agg.broadcaster.current().queued == 2
    good.stop()


def test_a_ca_with_a_plaintext_url_is_refused(token_file) -> None:
    with pytest.raises(ValueError, match="not https"):
        DemandReporter("http://localhost:9091/v1/report", str(token_file), DemandBroadcaster(), ca_file="/ca.crt")


def test_handshake_stallers_are_cut_at_the_deadline_while_reports_keep_arriving(tls_aggregator, token_file) -> None:
    # Connections from 8 addresses that start a TLS handshake and never finish it (half a
    # ClientHello, then a byte every 0.2 s): the handshake runs in the connection's own thread under
    # the request deadline, so the accept loop never waits on them and real reports keep landing.
    agg, files = tls_aggregator
    good, source = reporter(agg, token_file, files.ca_file, Demand(queued=3))
    good.start()
    stallers: list[socket.socket] = []
    try:
        assert wait_until(lambda: agg.broadcaster.current().queued == 3, timeout=10)
        hello = _client_hello()
        for a in range(8):
            for _ in range(4):
                sock = socket.socket()
                sock.bind((f"127.0.8.{a + 1}", 0))
                sock.settimeout(5)
                sock.connect(("127.0.0.1", agg.port))
                sock.sendall(hello[: len(hello) // 2])
                stallers.append(sock)
        sent_before = good.sent
        t0 = time.monotonic()
        for step in range(15):
            source.publish(Demand(queued=3 + step % 2))
            for sock in stallers:
                try:
                    sock.sendall(b"\x00")
                except OSError:
                    pass
            time.sleep(0.2)
        assert time.monotonic() - t0 < 10
        assert all(_closed(sock) for sock in stallers), "a handshake staller outlived the deadline"
        assert good.sent - sent_before >= 10 and good.failures == 0
    finally:
        good.stop()
        for sock in stallers:
            sock.close()


def _client_hello() -> bytes:
    """The first flight of a real TLS client, captured from an in-memory handshake."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def _closed(sock: socket.socket) -> bool:
    sock.settimeout(3)
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_the_startup_check_does_what_a_gateway_will_do(pki: Path, tmp_path: Path) -> None:
    check_served_certificate(secret_dir(pki, tmp_path / "ok"), NAME)
    check_served_certificate(secret_dir(pki, tmp_path / "ok"))  # chain only
    with pytest.raises(TLSConfigError, match="must be the CA that signed"):
        check_served_certificate(secret_dir(pki, tmp_path / "two-cas", ca="ca2"), NAME)
    with pytest.raises(TLSConfigError, match="Hostname mismatch|hostname"):
        check_served_certificate(secret_dir(pki, tmp_path / "other-name", cert="elsewhere"), NAME)


def test_the_aggregate_scaler_refuses_a_secret_whose_ca_did_not_sign_its_certificate(pki, tmp_path, token_file) -> None:
    files = secret_dir(pki, tmp_path / "mismatch", ca="ca2")
    termination = tmp_path / "termination-log"
    proc = subprocess.run(
        [sys.executable, "-m", "scaler", "aggregate", "--host", "127.0.0.1", "--report-port", "0", "--scaler-port", "0",
         "--aggregator-token-file", str(token_file), "--scaler-tls-cert-file", files.cert_file,
         "--scaler-tls-key-file", files.key_file, "--scaler-tls-ca-file", files.ca_file,
         "--report-server-name", NAME],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "NOCTAYA_TERMINATION_LOG": str(termination)},
    )
    assert proc.returncode == 1
    assert "gateways could not report here" in proc.stderr and "must be the CA that signed" in proc.stderr
    assert "must be the CA that signed" in termination.read_text()
    assert "PRIVATE KEY" not in proc.stderr + termination.read_text()


def test_the_aggregate_scaler_serves_reports_over_tls_and_the_expiry_of_what_it_serves(pki, tmp_path,
                                                                                        token_file) -> None:
    volume = SecretVolume(tmp_path / "secret", secret_files(pki))
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "scaler", "aggregate", "--host", "127.0.0.1", "--report-port", str(port),
         "--scaler-port", "0", "--aggregator-token-file", str(token_file),
         "--scaler-tls-cert-file", str(volume / "tls.crt"), "--scaler-tls-key-file", str(volume / "tls.key"),
         "--scaler-tls-ca-file", str(volume / "ca.crt"), "--report-server-name", NAME],
        cwd=ROOT, stderr=subprocess.PIPE, text=True, env={"PATH": "/usr/bin:/bin"},
    )
    trust = pki / "both.crt"

    def presented() -> dict[str, tuple[int, float]]:
        return {"report": presented_certificate(port, trust),
                "scaler": presented_certificate(grpc_port, trust, client=(pki / "keda.crt", pki / "keda.key"),
                                                alpn=["h2"])}

    def gauges() -> dict[str, float]:
        return expiry_gauges(requests.get(f"https://localhost:{port}/metrics", verify=str(trust), timeout=5).text)

    try:
        line = _read_line(proc, "aggregate scaler:")
        assert "HTTPS reports" in line
        grpc_port = int(line.rsplit(":", 1)[1])
        health = requests.get(f"https://localhost:{port}/healthz", verify=str(trust), timeout=5)
        assert health.status_code == 200
        body = {"member": "g", "seq": 1, "queued": 2}
        r = requests.post(f"https://localhost:{port}/v1/report", json=body, verify=str(trust), timeout=5,
                          headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200 and r.json()["outcome"] == "accepted"
        first = certificate_dates((pki / "server.crt").read_bytes())
        assert presented() == {"report": first, "scaler": first}
        assert gauges() == {"report": first[1], "scaler": first[1]}

        # The kubelet swaps the Secret: a certificate from a new CA, both CAs trusted meanwhile.
        volume.write(secret_files(pki, cert="server2", ca="both"))
        renewed = certificate_dates((pki / "server2.crt").read_bytes())
        assert presented() == {"report": renewed, "scaler": renewed}  # new connections, same process
        assert gauges() == {"report": renewed[1], "scaler": renewed[1]}
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(15)


def _read_line(proc: subprocess.Popen[str], marker: str) -> str:
    found: list[str] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if marker in line:
                found.append(line)
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(30)
    assert found, f"no {marker!r} line from the process"
    return found[0]
