"""Throwaway certificates for the tests, with the openssl CLI: CAs, leaves they sign, a directory
laid out and updated as the kubelet does a Secret volume, and what a server presents to a new
connection (read back by openssl, not by the code under test)."""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import ssl
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def openssl(*args: str, cwd: Path, stdin: bytes | None = None) -> str:
    result = subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60, input=stdin)
    return result.stdout.decode()


def make_ca(d: Path, name: str) -> None:
    """``name``.crt / ``name``.key: a self-signed CA, valid two days."""
    openssl("req", "-x509", *EC, "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN={name}",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign", cwd=d)


def make_leaf(d: Path, name: str, ca: str, usage: str = "serverAuth", sans: str = "DNS:localhost,IP:127.0.0.1",
              serial: str | None = None, days: int = 2) -> tuple[Path, Path]:
    """``name``.crt / ``name``.key signed by the CA ``ca`` (with a given serial and lifetime when asked)."""
    openssl("req", *EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    (d / f"{name}.ext").write_text(f"subjectAltName={sans}\nextendedKeyUsage={usage}\nbasicConstraints=CA:FALSE\n")
    numbering = ["-set_serial", serial] if serial else ["-CAcreateserial"]
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", *numbering,
            "-out", f"{name}.crt", "-days", str(days), "-extfile", f"{name}.ext", cwd=d)
    return d / f"{name}.crt", d / f"{name}.key"


def bundle(d: Path, name: str, *cas: str) -> Path:
    """``name``.crt: the certificates of ``cas`` in one PEM file (a trust bundle during a CA change)."""
    path = d / f"{name}.crt"
    path.write_bytes(b"".join((d / f"{ca}.crt").read_bytes() for ca in cas))
    return path


def certificate_dates(pem_or_der: bytes, *, der: bool = False) -> tuple[int, float]:
    """(serial, notAfter as Unix time) of a certificate, as openssl reads them."""
    out = openssl("x509", "-inform", "DER" if der else "PEM", "-noout", "-serial", "-enddate", cwd=Path("/"),
                  stdin=pem_or_der)
    fields = dict(line.split("=", 1) for line in out.splitlines())
    return int(fields["serial"], 16), float(ssl.cert_time_to_seconds(fields["notAfter"]))


def presented_certificate(port: int, ca_file: Path, *, client: tuple[Path, Path] | None = None,
                          alpn: Sequence[str] = (), server_name: str = "localhost") -> tuple[int, float]:
    """(serial, notAfter) of the certificate a server on 127.0.0.1 presents to a *new* connection,
    which must verify against ``ca_file`` (with a client certificate for mutual TLS)."""
    context = ssl.create_default_context(cafile=str(ca_file))
    if client is not None:
        context.load_cert_chain(*map(str, client))
    if alpn:
        context.set_alpn_protocols(list(alpn))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname=server_name) as tls:
            der = tls.getpeercert(binary_form=True)
    assert der is not None
    return certificate_dates(der, der=True)


class SecretVolume:
    """A directory laid out as the kubelet mounts a Secret (its AtomicWriter): each version's files in
    a ``..<timestamp>`` directory, ``..data`` a symlink to the current one, and each key a symlink
    through ``..data``. :meth:`write` puts the next version in a fresh directory, renames a new
    ``..data`` link over the old one (the one atomic step a reader can see), then removes the old
    directory: a process never sees a mix of two versions, but every path resolves to new files."""

    _versions = itertools.count()

    def __init__(self, root: Path, files: Mapping[str, Path | bytes]) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.write(files)

    def __truediv__(self, key: str) -> Path:
        return self.root / key

    def write(self, files: Mapping[str, Path | bytes]) -> None:
        version = f"..2026_01_01_00_00_00.{next(self._versions)}"
        (self.root / version).mkdir()
        for key, content in files.items():
            (self.root / version / key).write_bytes(content.read_bytes() if isinstance(content, Path) else content)
        data, staged = self.root / "..data", self.root / "..data_tmp"
        previous = os.readlink(data) if data.is_symlink() else None
        staged.symlink_to(version)
        os.rename(staged, data)
        for key in files:
            if not (self.root / key).is_symlink():
                (self.root / key).symlink_to(f"..data/{key}")
        if previous is not None:
            shutil.rmtree(self.root / previous)


def expiry_gauges(exposition: str) -> dict[str, float]:
    """The certificate-expiry gauge of a /metrics page, by role (whatever other labels it carries)."""
    from prometheus_client.parser import text_string_to_metric_families

    from scaler.tls import CERTIFICATE_METRIC

    return {sample.labels["role"]: sample.value for family in text_string_to_metric_families(exposition)
            for sample in family.samples if sample.name == CERTIFICATE_METRIC}
