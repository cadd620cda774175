"""TLS of the scaler: mutual TLS for the gRPC ExternalScaler, server TLS for the report channel (and,
through the same reloading context, the hook server's HTTPS).

KEDA presents its client certificate from a TriggerAuthentication (``tlsClientCert`` /
``tlsClientKey``, verified against ``caCert``); the scaler only needs its own Secret mounted as
files. The aggregate scaler serves gateways' demand reports with the same certificate (the gateways
verify it against the Secret's ``ca.crt`` and authenticate with their bearer token). The files are
re-read when they change (checked at each new TLS handshake), so a renewed Secret (cert-manager, or
the kubelet swapping a Secret volume's ``..data`` link) takes effect without a restart. Each server
reports the ``notAfter`` of the certificate it presents (``on_loaded``) for the expiry gauge
``noctaya_tls_certificate_not_after_timestamp_seconds``.
"""

from __future__ import annotations

import contextlib
import logging
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scaler.secretfiles import file_stamp
from scaler.x509 import not_after

if TYPE_CHECKING:
    import grpc
    from prometheus_client.core import Metric

__all__ = ["TLSFiles", "TLSConfigError", "ReloadingServerContext", "ServedCertificates", "certificate_family",
           "check_served_certificate", "server_credentials", "tls_files_from_env"]

log = logging.getLogger("noctaya.scaler.tls")

ENV_CERT = "NOCTAYA_SCALER_TLS_CERT_FILE"
ENV_KEY = "NOCTAYA_SCALER_TLS_KEY_FILE"
ENV_CA = "NOCTAYA_SCALER_TLS_CA_FILE"
MAX_PEM_BYTES = 1 << 20  # a PEM bundle larger than 1 MiB is a mistake, not a certificate

# The certificate-expiry gauge every TLS-serving process exports (hooks.metrics, gateway.metrics, the
# aggregate scaler). Its one label is the listener's fixed role, never anything read from a certificate.
CERTIFICATE_METRIC = "noctaya_tls_certificate_not_after_timestamp_seconds"
CERTIFICATE_HELP = ("notAfter (Unix time) of the certificate this process presents to new TLS connections, by "
                    "listener: hooks (the hook server), scaler (KEDA's ExternalScaler), report (the aggregate "
                    "scaler's report port). Updated when a rotated certificate is loaded.")
CERTIFICATE_ROLES = ("hooks", "scaler", "report")


class TLSConfigError(ValueError):
    """Incomplete or unreadable TLS material (the message names files, never their content)."""


@dataclass(frozen=True, slots=True)
class TLSFiles:
    cert_file: str
    key_file: str
    ca_file: str = ""  # the CA that signs client certificates: mutual TLS only


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


CertificateListener = Callable[[float], None]
"""Told the ``notAfter`` (seconds since the epoch) of each certificate a server starts presenting."""


def server_credentials(files: TLSFiles, *, on_loaded: CertificateListener | None = None) -> grpc.ServerCredentials:
    """grpcio server credentials that require and verify a client certificate signed by the CA file.

    grpc asks ``fetch`` before every new handshake; it answers with new material only when the files
    changed and load together (checked by :class:`ReloadingServerContext`, which logs a refusal), so
    a half-written or broken update keeps the previous, working material.
    """
    import grpc  # here, not at the top: a one-worker gateway serves mTLS without grpcio (scaler.h2server)

    reloading = ReloadingServerContext(files, client_auth=True, on_loaded=on_loaded)  # fails fast at startup
    generation, material = reloading.loaded()
    served = [generation]

    def configuration(material: tuple[bytes, bytes, bytes]) -> grpc.ServerCertificateConfiguration:
        cert, key, ca = material
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        reloading.current()
        generation, material = reloading.loaded()
        if generation == served[0]:
            return None
        served[0] = generation
        return configuration(material)

    return grpc.dynamic_ssl_server_credentials(configuration(material), fetch, require_client_authentication=True)


class ReloadingServerContext:
    """An ``ssl.SSLContext`` for a TLS server, rebuilt when its files change; ``current()`` is asked
    at each new connection. Material that cannot be loaded (a half-written rotation, a key that is not
    the certificate's) keeps the last good context and is logged once, saying why.

    Plain server TLS by default (the report channel, the hook server). With ``client_auth`` a client
    certificate signed by the CA file is required (mutual TLS, as KEDA presents it to the
    ExternalScaler), and ``alpn`` names the protocols offered (``h2`` for gRPC). ``context_class``
    lets a gevent server build cooperative contexts (``gevent.ssl.SSLContext``). ``on_loaded`` is
    told the certificate's ``notAfter`` at startup and on every reload (the expiry gauges)."""

    def __init__(self, files: TLSFiles, *, client_auth: bool = False, alpn: Sequence[str] = (),
                 context_class: Callable[[int], ssl.SSLContext] = ssl.SSLContext,
                 on_loaded: CertificateListener | None = None) -> None:
        self._files = files
        self._client_auth = client_auth
        self._alpn = list(alpn)
        self._context_class = context_class
        self._on_loaded = on_loaded
        self._lock = threading.Lock()
        # The stamp before the read: a rotation landing in between is seen (and loaded) at the next check.
        self._stamp: tuple[tuple[int, int, int], ...] | None = None
        with contextlib.suppress(OSError):  # a missing file: _build names it
            self._stamp = self._file_stamp()
        self._context, self._material, self.not_after = self._build()  # fails fast at startup, naming the file
        self._generation = 0  # bumped on every reload
        self._refused: tuple[object, ...] | None = None  # material that failed to load, not retried
        self._announce()

    def _paths(self) -> tuple[str, ...]:
        files = self._files
        return (files.cert_file, files.key_file, files.ca_file) if self._client_auth else (files.cert_file, files.key_file)

    def _file_stamp(self) -> tuple[tuple[int, int, int], ...]:
        return file_stamp(*self._paths())

    def _read(self) -> tuple[bytes, ...]:
        return tuple(_read_pem(path) for path in self._paths())  # its errors name the file, the ssl module's do not

    def _build(self) -> tuple[ssl.SSLContext, tuple[bytes, bytes, bytes], float]:
        """(context, the PEM bytes it holds: cert, key, CA or b"", the certificate's notAfter)."""
        material = self._read()
        try:
            expires = not_after(material[0])
        except ValueError as exc:
            raise TLSConfigError(f"{self._files.cert_file}: {exc}") from None
        context = self._load()
        if self._read() != material:
            # The files were swapped while being read: what was loaded may mix two versions.
            raise TLSConfigError(f"{self._files.cert_file} changed while being loaded")
        cert, key, *ca = material
        return context, (cert, key, ca[0] if ca else b""), expires

    def _load(self) -> ssl.SSLContext:
        context = self._context_class(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            # An encrypted key fails to load instead of OpenSSL prompting on a terminal for its password.
            context.load_cert_chain(self._files.cert_file, self._files.key_file, password=lambda: b"")
        except ssl.SSLError as exc:
            raise TLSConfigError(f"{self._files.cert_file} and {self._files.key_file} do not load as a "
                                 f"certificate and its key ({exc.reason or 'unreadable'})") from None
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
                self._context, self._material, self.not_after = self._build()
            except TLSConfigError as exc:
                self._warn_once(stamp, str(exc))
                return self._context
            self._stamp, self._refused = stamp, None
            self._generation += 1
            log.info("TLS material reloaded: %s is valid until %s", self._files.cert_file,
                     time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.not_after)))
            self._announce()
            return self._context

    def loaded(self) -> tuple[int, tuple[bytes, bytes, bytes]]:
        """(reload count, the PEM bytes of the current context: cert, key, CA or b""), for a server
        (grpcio) that takes its material as bytes rather than as an ``ssl.SSLContext``."""
        with self._lock:
            return self._generation, self._material

    def _announce(self) -> None:
        if self._on_loaded is not None:
            self._on_loaded(self.not_after)

    def _warn_once(self, stamp: tuple[object, ...], reason: str) -> None:
        if stamp != self._refused:
            self._refused = stamp  # type: ignore[assignment]
            log.warning("TLS material changed but cannot be loaded, keeping the previous one: %s", reason)


class ServedCertificates:
    """The ``notAfter`` of the certificate each TLS listener of this process presents, by role; a
    Prometheus collector (the aggregate scaler registers it beside its own metrics)."""

    def __init__(self) -> None:
        self._values: dict[str, float] = {}
        self._lock = threading.Lock()

    def listener(self, role: str) -> CertificateListener:
        """What a server is given as ``on_loaded`` for its ``role`` (one of CERTIFICATE_ROLES)."""
        if role not in CERTIFICATE_ROLES:
            raise ValueError(f"unknown certificate role {role!r}")

        def record(expires: float) -> None:
            with self._lock:
                self._values[role] = expires
        return record

    def values(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)

    def collect(self) -> Iterator[Metric]:
        if self._values:
            yield certificate_family(self.values())


def certificate_family(values: Mapping[str, float]) -> Metric:
    """The expiry gauge, one sample per role, for a collector to yield."""
    from prometheus_client.core import GaugeMetricFamily  # on first scrape: a gateway imports it lazily too

    family = GaugeMetricFamily(CERTIFICATE_METRIC, CERTIFICATE_HELP, labels=["role"])
    for role, expires in sorted(values.items()):
        family.add_metric([role], expires)
    return family


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
