"""Throwaway certificates for the tests, with the openssl CLI: one CA, leaves it signs."""

from __future__ import annotations

import subprocess
from pathlib import Path

EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(d: Path, name: str) -> None:
    """``name``.crt / ``name``.key: a self-signed CA, valid two days."""
    openssl("req", "-x509", *EC, "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN={name}",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign", cwd=d)


def make_leaf(d: Path, name: str, ca: str, usage: str = "serverAuth", sans: str = "DNS:localhost,IP:127.0.0.1",
              serial: str | None = None) -> tuple[Path, Path]:
    """``name``.crt / ``name``.key signed by the CA ``ca`` (with a given serial when asked)."""
    openssl("req", *EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    (d / f"{name}.ext").write_text(f"subjectAltName={sans}\nextendedKeyUsage={usage}\nbasicConstraints=CA:FALSE\n")
    numbering = ["-set_serial", serial] if serial else ["-CAcreateserial"]
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", *numbering,
            "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
    return d / f"{name}.crt", d / f"{name}.key"
