"""Certificate rotation without a restart, on every TLS server Noctaya runs: the hook server (a real
`python -m hooks serve`), KEDA's ExternalScaler on grpcio (aggregate scaler, multi-worker gateways) and
on h2 (one-worker and shared gateways), and the aggregate scaler's report port.

Each rotation is made the way the kubelet updates a Secret volume (tests.pki.SecretVolume: new files
in a fresh ``..<timestamp>`` directory, then an atomic rename of the ``..data`` link), and each check
opens a NEW connection and reads the certificate it is shown with openssl. Three cases per server: a
renewal by the same CA; a move to a new CA while clients trust both (a bundle); and a broken update (a
key that is not the certificate's, then a half-written certificate), which keeps the last good
certificate, says why in the log, and does not stop a later good update. Each also checks the
expiry gauge the server's process exports."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import requests

from scaler import externalscaler_pb2 as pb
from scaler import externalscaler_pb2_grpc as pb_grpc
from scaler.aggregator import Aggregator, AggregatorSettings
from scaler.demand import Demand, DemandBroadcaster
from scaler.reporter import DemandReporter
from scaler.tls import ServedCertificates, TLSFiles
from tests.hooks.https_server import HookServerProcess
from tests.pki import (
    SecretVolume,
    bundle,
    certificate_dates,
    expiry_gauges,
    make_ca,
    make_leaf,
    presented_certificate,
)

from .conftest import REPORT_TOKEN, start_scaler

pytestmark = [pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI"),
              pytest.mark.timeout(120)]

SERVERS = ["hooks", "grpcio", "h2", "report"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("rotation-pki")
    for ca in ("ca", "ca2"):
        make_ca(d, ca)
    # Different lifetimes, so each one's notAfter tells which certificate a gauge describes.
    make_leaf(d, "first", "ca", serial="0x1001", days=2)
    make_leaf(d, "renewed", "ca", serial="0x2002", days=3)
    make_leaf(d, "moved", "ca2", serial="0x3003", days=4)
    make_leaf(d, "keda", "ca", usage="clientAuth")
    bundle(d, "both", "ca", "ca2")
    return d


@dataclass
class Server:
    """One running server, its Secret volume, and how to look at it from outside."""

    volume: SecretVolume
    presented: Callable[[], tuple[int, float]]  # what a new connection is shown
    use: Callable[[], None]  # one real call through the protocol's own client
    gauge: Callable[[], float]  # the expiry gauge its process exports
    logs: Callable[[], str]

    def rotate(self, pki: Path, cert: str | bytes, key: str, ca: str = "ca") -> None:
        """Update the Secret as the kubelet would; ``cert`` names a certificate, or is raw bytes."""
        content = cert if isinstance(cert, bytes) else (pki / f"{cert}.crt").read_bytes()
        self.volume.write({"tls.crt": content, "tls.key": pki / f"{key}.key", "ca.crt": pki / f"{ca}.crt"})


def secret(pki: Path, root: Path) -> SecretVolume:
    return SecretVolume(root, {"tls.crt": pki / "first.crt", "tls.key": pki / "first.key", "ca.crt": pki / "ca.crt"})


def hook_server(pki: Path, tmp_path: Path) -> Iterator[Server]:
    volume = secret(pki, tmp_path / "secret")
    server = HookServerProcess(tmp_path, volume / "tls.crt", volume / "tls.key", pki / "both.crt")

    def get(path: str) -> requests.Response:
        response = requests.get(f"{server.url}{path}", verify=str(pki / "both.crt"), timeout=10)
        response.raise_for_status()
        return response

    def healthz() -> None:
        assert get("/healthz").json()

    try:
        yield Server(volume, lambda: presented_certificate(server.port, pki / "both.crt"), healthz,
                     lambda: expiry_gauges(get("/metrics").text)["hooks"], server.log)
    finally:
        server.stop()


def scaler(host: str, pki: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> Iterator[Server]:
    volume = secret(pki, tmp_path / "secret")
    served = ServedCertificates()
    files = TLSFiles(str(volume / "tls.crt"), str(volume / "tls.key"), str(volume / "ca.crt"))
    server = start_scaler(host, DemandBroadcaster(Demand(queued=1)), tls=files, on_certificate=served.listener("scaler"))
    keda = (pki / "keda.crt", pki / "keda.key")

    def is_active() -> None:
        creds = grpc.ssl_channel_credentials(root_certificates=(pki / "both.crt").read_bytes(),
                                             private_key=keda[1].read_bytes(), certificate_chain=keda[0].read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{server.port}", creds,
                                 options=[("grpc.ssl_target_name_override", "localhost")]) as channel:
            assert pb_grpc.ExternalScalerStub(channel).IsActive(pb.ScaledObjectRef(), timeout=10).result is True

    try:
        yield Server(volume, lambda: presented_certificate(server.port, pki / "both.crt", client=keda, alpn=["h2"]),
                     is_active, lambda: served.values()["scaler"], lambda: caplog.text)
    finally:
        server.stop(1.0)


def report_port(pki: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> Iterator[Server]:
    volume = secret(pki, tmp_path / "secret")
    token = tmp_path / "token"
    token.write_text(REPORT_TOKEN)
    aggregator = Aggregator(AggregatorSettings(token_file=str(token)), DemandBroadcaster())
    aggregator.start("127.0.0.1", 0, tls=TLSFiles(str(volume / "tls.crt"), str(volume / "tls.key"),
                                                   str(volume / "ca.crt")))

    def report() -> None:
        reporter = DemandReporter(f"https://localhost:{aggregator.port}/v1/report", str(token), DemandBroadcaster(),
                                  timeout=5.0, ca_file=str(pki / "both.crt"))
        assert reporter._post(Demand(queued=2)) is True
        reporter.stop()

    try:
        yield Server(volume, lambda: presented_certificate(aggregator.port, pki / "both.crt"), report,
                     lambda: expiry_gauges(aggregator.metrics_text().decode())["report"], lambda: caplog.text)
    finally:
        aggregator.stop()


@pytest.fixture(params=SERVERS)
def server(request: pytest.FixtureRequest, pki: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> Iterator[Server]:
    caplog.set_level(logging.INFO, logger="noctaya.scaler.tls")
    if request.param == "hooks":
        yield from hook_server(pki, tmp_path)
    elif request.param == "report":
        yield from report_port(pki, tmp_path, caplog)
    else:
        yield from scaler(request.param, pki, tmp_path, caplog)


def dates(pki: Path, name: str) -> tuple[int, float]:
    return certificate_dates((pki / f"{name}.crt").read_bytes())


def test_a_renewed_certificate_is_served_to_the_next_connection(server: Server, pki: Path) -> None:
    assert server.presented() == dates(pki, "first")
    assert server.gauge() == dates(pki, "first")[1]
    server.rotate(pki, "renewed", "renewed")
    assert server.presented() == dates(pki, "renewed")
    server.use()
    assert server.gauge() == dates(pki, "renewed")[1]
    assert "TLS material reloaded" in server.logs()


def test_a_certificate_from_a_new_ca_is_served_to_clients_that_trust_both(server: Server, pki: Path) -> None:
    # The Secret's ca.crt carries both CAs during the move (the CA that signs KEDA's client certificate
    # for the ExternalScaler); the clients' trust bundle holds both.
    server.rotate(pki, "moved", "moved", ca="both")
    assert server.presented() == dates(pki, "moved")
    server.use()
    assert server.gauge() == dates(pki, "moved")[1]


def test_a_broken_update_keeps_the_last_good_certificate_and_says_why(server: Server, pki: Path) -> None:
    server.rotate(pki, "renewed", "moved")  # a key that is not the certificate's
    assert server.presented() == dates(pki, "first")
    server.use()
    assert "cannot be loaded, keeping the previous one" in server.logs()
    assert "do not load as a certificate and its key" in server.logs()

    half = (pki / "renewed.crt").read_bytes()
    server.rotate(pki, half[: len(half) // 2], "renewed")  # half-written: the certificate cut short
    assert server.presented() == dates(pki, "first")
    server.use()
    assert server.gauge() == dates(pki, "first")[1]
    assert "PRIVATE KEY" not in server.logs()

    server.rotate(pki, "renewed", "renewed")  # the next good update is still taken
    assert server.presented() == dates(pki, "renewed")
    assert server.gauge() == dates(pki, "renewed")[1]
