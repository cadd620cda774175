"""Mutual TLS for the gRPC ExternalScaler: server certificate + key, client CA, client auth required.

KEDA presents its client certificate from a TriggerAuthentication (``tlsClientCert`` /
``tlsClientKey``, verified against ``caCert``); the scaler only needs its own Secret mounted as
files. The files are re-read when they change (checked at each new TLS handshake), so a renewed
Secret (cert-manager) takes effect without a restart.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

__all__ = ["TLSFiles", "TLSConfigError", "server_credentials", "tls_files_from_env"]

log = logging.getLogger("noctaya.scaler.tls")

ENV_CERT = "NOCTAYA_SCALER_TLS_CERT_FILE"
ENV_KEY = "NOCTAYA_SCALER_TLS_KEY_FILE"
ENV_CA = "NOCTAYA_SCALER_TLS_CA_FILE"
MAX_PEM_BYTES = 1 << 20  # a PEM bundle larger than 1 MiB is a mistake, not a certificate


class TLSConfigError(ValueError):
    """Incomplete or unreadable TLS material (the message names files, never their content)."""


@dataclass(frozen=True, slots=True)
class TLSFiles:
    cert_file: str
    key_file: str
    ca_file: str

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(cert chain, private key, client CA bundle) as PEM bytes."""
        return _read_pem(self.cert_file), _read_pem(self.key_file), _read_pem(self.ca_file)

    def fingerprint(self) -> tuple[tuple[int, int, int], ...]:
        """Cheap change detector: (inode, size, mtime_ns) of each file. Secret volume updates swap
        a symlink, which changes the inode even when size and mtime happen to match."""
        stats = []
        for path in (self.cert_file, self.key_file, self.ca_file):
            st = os.stat(path)
            stats.append((st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(stats)


def _read_pem(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PEM_BYTES + 1)
    except OSError as exc:
        raise TLSConfigError(f"cannot read TLS file {path}: {exc.strerror}") from None
    if len(data) > MAX_PEM_BYTES:
        raise TLSConfigError(f"TLS file {path} is larger than {MAX_PEM_BYTES} bytes")
    if b"-----BEGIN" not in data:
        raise TLSConfigError(f"TLS file {path} is not PEM")
    return data


def tls_files_from_env(env: Mapping[str, str]) -> TLSFiles | None:
    """TLSFiles when all three variables are set, None when none is; a partial set is an error
    (silently falling back to plaintext would be worse than refusing to start)."""
    values = {name: env.get(name, "").strip() for name in (ENV_CERT, ENV_KEY, ENV_CA)}
    given = [name for name, value in values.items() if value]
    if not given:
        return None
    if len(given) != 3:
        missing = sorted(set(values) - set(given))
        raise TLSConfigError("mutual TLS needs all of cert, key and CA files; missing " + ", ".join(missing))
    return TLSFiles(values[ENV_CERT], values[ENV_KEY], values[ENV_CA])


def _certificate_configuration(files: TLSFiles) -> grpc.ServerCertificateConfiguration:
    cert, key, ca = files.read()
    return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)


def server_credentials(files: TLSFiles, *, reload: bool = True) -> grpc.ServerCredentials:
    """Server credentials that require and verify a client certificate signed by the CA file.

    With ``reload`` the files are checked at each new handshake and re-read when they changed; a
    half-written or broken update keeps the previous (working) material and is logged.
    """
    initial = _certificate_configuration(files)  # fail fast at startup on bad material
    if not reload:
        cert, key, ca = files.read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)

    state = {"fingerprint": files.fingerprint()}

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        try:
            fingerprint = files.fingerprint()
            if fingerprint == state["fingerprint"]:
                return None
            config = _certificate_configuration(files)
        except (OSError, TLSConfigError) as exc:
            log.warning("TLS material changed but cannot be loaded, keeping the previous one: %s", exc)
            return None
        state["fingerprint"] = fingerprint
        log.info("TLS material reloaded")
        return config

    return grpc.dynamic_ssl_server_credentials(initial, fetch, require_client_authentication=True)
