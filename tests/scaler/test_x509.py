"""scaler.x509.not_after against openssl's reading of the same certificates."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from scaler.x509 import not_after
from tests.pki import certificate_dates, make_ca, make_leaf, openssl

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


def test_not_after_is_what_openssl_reads(tmp_path: Path) -> None:
    make_ca(tmp_path, "ca")
    leaf, _ = make_leaf(tmp_path, "leaf", "ca", days=3)
    # RSA 3072 (long-form DER lengths, as tools/make-hook-cert.sh makes), expiring after 2049: its
    # notAfter is a GeneralizedTime, the others' a UTCTime.
    openssl("req", "-x509", "-newkey", "rsa:3072", "-nodes", "-days", "36500", "-subj", "/CN=far", "-keyout",
            "far.key", "-out", "far.crt", cwd=tmp_path)
    for cert in (leaf, tmp_path / "ca.crt", tmp_path / "far.crt"):
        pem = cert.read_bytes()
        assert not_after(pem) == certificate_dates(pem)[1]
    assert not_after((tmp_path / "far.crt").read_bytes()) > 4102444800  # 2100-01-01


def test_a_chain_counts_its_first_certificate_the_one_a_server_presents(tmp_path: Path) -> None:
    make_ca(tmp_path, "ca")
    leaf, _ = make_leaf(tmp_path, "leaf", "ca", days=1)
    chain = leaf.read_bytes() + (tmp_path / "ca.crt").read_bytes()
    assert not_after(chain) == certificate_dates(leaf.read_bytes())[1] != not_after((tmp_path / "ca.crt").read_bytes())


@pytest.mark.parametrize("damage", ["truncated", "not base64", "no certificate", "a key"])
def test_what_is_not_a_certificate_is_refused_without_quoting_it(tmp_path: Path, damage: str) -> None:
    make_ca(tmp_path, "ca")
    pem = (tmp_path / "ca.crt").read_bytes()
    lines = pem.splitlines()
    broken = {
        "truncated": b"\n".join([lines[0], *lines[1:3], lines[-1]]) + b"\n",
        "not base64": b"\n".join([lines[0], b"SECRET-BYTES!!", lines[-1]]) + b"\n",
        "no certificate": b"SECRET-BYTES",
        "a key": (tmp_path / "ca.key").read_bytes(),
    }[damage]
    with pytest.raises(ValueError) as err:
        not_after(broken)
    assert "SECRET" not in str(err.value) and "MII" not in str(err.value)
