"""Mutual TLS of the gRPC scaler (both hosts: grpcio and h2 on gevent), with certificates made at test
time by the openssl CLI. Rotating the certificate: test_rotation.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import pytest

from scaler import externalscaler_pb2 as pb
from scaler import externalscaler_pb2_grpc as pb_grpc
from scaler.demand import Demand, DemandBroadcaster
from scaler.tls import TLSConfigError, TLSFiles, tls_files_from_env
from tests.pki import make_ca, make_leaf

from .conftest import start_scaler

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "rogue-ca"):
        make_ca(d, ca)
    make_leaf(d, "server", "ca", "serverAuth")
    make_leaf(d, "keda", "ca", "clientAuth")
    make_leaf(d, "intruder", "rogue-ca", "clientAuth")
    return d


def _stub(port: int, pki: Path, client: str | None) -> tuple[grpc.Channel, pb_grpc.ExternalScalerStub]:
    creds = grpc.ssl_channel_credentials(
        root_certificates=(pki / "ca.crt").read_bytes(),
        private_key=(pki / f"{client}.key").read_bytes() if client else None,
        certificate_chain=(pki / f"{client}.crt").read_bytes() if client else None,
    )
    channel = grpc.secure_channel(f"127.0.0.1:{port}", creds, options=[("grpc.ssl_target_name_override", "localhost")])
    return channel, pb_grpc.ExternalScalerStub(channel)


@pytest.fixture
def mtls_server(pki: Path, scaler_host: str):
    files = TLSFiles(str(pki / "server.crt"), str(pki / "server.key"), str(pki / "ca.crt"))
    server = start_scaler(scaler_host, DemandBroadcaster(Demand(queued=1)), tls=files)
    yield server
    server.stop(1.0)


def test_client_with_certificate_is_served(mtls_server, pki) -> None:
    server = mtls_server
    channel, stub = _stub(server.port, pki, "keda")
    with channel:
        assert stub.IsActive(pb.ScaledObjectRef(), timeout=10).result is True
        stream = stub.StreamIsActive(pb.ScaledObjectRef(), timeout=10)
        assert next(stream).result is True
        stream.cancel()


@pytest.mark.parametrize("client", [None, "intruder"])
def test_client_without_a_valid_certificate_is_refused(mtls_server, pki, client) -> None:
    server = mtls_server
    channel, stub = _stub(server.port, pki, client)
    with channel, pytest.raises(grpc.RpcError) as err:
        stub.IsActive(pb.ScaledObjectRef(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_plaintext_client_is_refused(mtls_server) -> None:
    server = mtls_server
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel, pytest.raises(grpc.RpcError):
        pb_grpc.ExternalScalerStub(channel).IsActive(pb.ScaledObjectRef(), timeout=5)


def test_env_needs_all_three_files(pki) -> None:
    assert tls_files_from_env({}) is None
    with pytest.raises(TLSConfigError, match="missing NOCTAYA_SCALER_TLS_KEY_FILE"):
        tls_files_from_env({"NOCTAYA_SCALER_TLS_CERT_FILE": "a", "NOCTAYA_SCALER_TLS_CA_FILE": "c"})
    files = tls_files_from_env({"NOCTAYA_SCALER_TLS_CERT_FILE": "a", "NOCTAYA_SCALER_TLS_KEY_FILE": "b",
                                "NOCTAYA_SCALER_TLS_CA_FILE": "c"})
    assert files == TLSFiles("a", "b", "c")


def test_unreadable_material_fails_at_start_without_leaking_content(pki, tmp_path, scaler_host) -> None:
    bogus = tmp_path / "bogus.key"
    bogus.write_text("SECRET-BYTES not a pem")
    files = TLSFiles(str(pki / "server.crt"), str(bogus), str(pki / "ca.crt"))
    with pytest.raises(TLSConfigError) as err:
        start_scaler(scaler_host, DemandBroadcaster(), tls=files)
    assert "SECRET-BYTES" not in str(err.value)
    with pytest.raises(TLSConfigError):
        start_scaler(scaler_host, DemandBroadcaster(), tls=TLSFiles(str(tmp_path / "nope"), str(bogus), str(bogus)))
