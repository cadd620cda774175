"""TLS of the scaler: mutual TLS for the gRPC ExternalScaler, server TLS for the report channel.

KEDA presents its client certificate from a TriggerAuthentication (``tlsClientCert`` /
``tlsClientKey``, verified against ``caCert``); the scaler only needs its own Secret mounted as
files. The aggregate scaler serves gateways' demand reports with the same certificate (the gateways
verify it against the Secret's ``ca.crt`` and authenticate with their bearer token). The files are
re-read when they change (checked at each new TLS handshake), so a renewed Secret (cert-manager)
takes effect without a restart.
"""

from __future__ import annotations

import logging
import ssl
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scaler.secretfiles import file_stamp

if TYPE_CHECKING:
    import grpc

__all__ = ["TLSFiles", "TLSConfigError", "ReloadingServerContext", "check_served_certificate", "server_credentials",
           "tls_files_from_env"]

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
        return file_stamp(self.cert_file, self.key_file, self.ca_file)


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
    import grpc  # here, not at the top: a one-worker gateway serves mTLS without grpcio (scaler.h2server)

    cert, key, ca = files.read()
    return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)


def server_credentials(files: TLSFiles, *, reload: bool = True) -> grpc.ServerCredentials:
    """Server credentials that require and verify a client certificate signed by the CA file.

    With ``reload`` the files are checked at each new handshake and re-read when they changed; a
    half-written or broken update keeps the previous (working) material and is logged.
    """
    import grpc

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


class ReloadingServerContext:
    """An ``ssl.SSLContext`` for a TLS server, rebuilt when its files change; ``current()`` is asked
    at each new connection. Material that cannot be loaded (a half-written rotation) keeps the last
    good context and is logged once.

    Plain server TLS by default (the report channel: gateways authenticate with a bearer token).
    With ``client_auth`` a client certificate signed by the CA file is required (mutual TLS, as KEDA
    presents it to the ExternalScaler), and ``alpn`` names the protocols offered (``h2`` for gRPC).
    ``context_class`` lets a gevent server build cooperative contexts (``gevent.ssl.SSLContext``)."""

    def __init__(self, files: TLSFiles, *, client_auth: bool = False, alpn: Sequence[str] = (),
                 context_class: Callable[[int], ssl.SSLContext] = ssl.SSLContext) -> None:
        self._files = files
        self._client_auth = client_auth
        self._alpn = list(alpn)
        self._context_class = context_class
        self._lock = threading.Lock()
        self._context = self._build()  # fail fast at startup on bad material (naming the file)
        self._stamp = self._file_stamp()
        self._refused: tuple[object, ...] | None = None  # material that failed to load, not retried

    def _paths(self) -> tuple[str, ...]:
        files = self._files
        return (files.cert_file, files.key_file, files.ca_file) if self._client_auth else (files.cert_file, files.key_file)

    def _file_stamp(self) -> tuple[tuple[int, int, int], ...]:
        return file_stamp(*self._paths())

    def _build(self) -> ssl.SSLContext:
        for path in self._paths():
            _read_pem(path)  # its errors name the file, the ssl module's do not
        context = self._context_class(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self._files.cert_file, self._files.key_file)
        except ssl.SSLError:
            raise TLSConfigError(f"{self._files.cert_file} and {self._files.key_file} do not load as a "
                                 "certificate and its key") from None
        if self._client_auth:
            try:
                context.load_verify_locations(cafile=self._files.ca_file)
            except ssl.SSLError:
                raise TLSConfigError(f"{self._files.ca_file} holds no usable CA certificate") from None
            context.verify_mode = ssl.CERT_REQUIRED
        if self._alpn:
            context.set_alpn_protocols(self._alpn)
        return context

    def current(self) -> ssl.SSLContext:
        with self._lock:
            try:
                stamp = self._file_stamp()
            except OSError as exc:
                self._warn_once(("missing",), f"cannot stat TLS files: {exc.strerror}")
                return self._context
            if stamp == self._stamp or stamp == self._refused:
                return self._context
            try:
                self._context, self._stamp, self._refused = self._build(), stamp, None
                log.info("TLS material reloaded")
            except TLSConfigError as exc:
                self._warn_once(stamp, str(exc))
            return self._context

    def _warn_once(self, stamp: tuple[object, ...], reason: str) -> None:
        if stamp != self._refused:
            self._refused = stamp  # type: ignore[assignment]
            log.warning("TLS material changed but cannot be loaded, keeping the previous one: %s", reason)


def check_served_certificate(files: TLSFiles, server_name: str | None = None) -> None:
    """Do what a reporting gateway will do, in memory: verify the certificate against the CA file
    (and that it names ``server_name``). Raises TLSConfigError saying what is wrong, so a Secret
    whose ``ca.crt`` did not sign its ``tls.crt`` stops the aggregate scaler at startup with that
    sentence instead of every gateway's reports failing quietly."""
    server_ctx = ReloadingServerContext(files).current()
    client_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client_ctx.check_hostname = server_name is not None
    try:
        client_ctx.load_verify_locations(cadata=_read_pem(files.ca_file).decode("ascii", "replace"))
    except ssl.SSLError:
        raise TLSConfigError(f"{files.ca_file} holds no usable CA certificate") from None
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_ctx.wrap_bio(to_client, to_server, server_hostname=server_name or "aggregator")
    server = server_ctx.wrap_bio(to_server, to_client, server_side=True)
    # wrap_bio(incoming, outgoing): each side reads what the other wrote.
    done = {"client": False, "server": False}
    try:
        for _ in range(8):  # a TLS 1.2/1.3 handshake needs at most a few flights
            for side, obj in (("client", client), ("server", server)):
                if not done[side]:
                    try:
                        obj.do_handshake()
                        done[side] = True
                    except ssl.SSLWantReadError:
                        pass
            if all(done.values()):
                return
    except ssl.SSLCertVerificationError as exc:
        raise TLSConfigError(f"{files.cert_file} does not verify against {files.ca_file}: {exc.verify_message}; "
                             "gateways check the aggregator with this CA, so it must be the CA that "
                             "signed the certificate") from None
    except ssl.SSLError as exc:
        raise TLSConfigError(f"a TLS handshake with {files.cert_file} fails: {exc.reason}") from None
    raise TLSConfigError(f"a TLS handshake with {files.cert_file} did not complete")
