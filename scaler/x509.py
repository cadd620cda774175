"""The expiry (``notAfter``) of a PEM certificate, for the certificate-expiry gauges.

Read with a walk over the few DER fields in front of it (RFC 5280: Certificate → tbsCertificate →
[version], serialNumber, signature, issuer, validity): the standard library's ``ssl`` module loads
certificates into contexts but only decodes them through a private function, and the runtime image
carries no X.509 library of its own. Anything that does not parse raises ValueError, whose message
never quotes the input.
"""

from __future__ import annotations

import base64
import calendar
import re

__all__ = ["not_after"]

_PEM_CERTIFICATE = re.compile(rb"-----BEGIN CERTIFICATE-----\s*([A-Za-z0-9+/=\s]+?)-----END CERTIFICATE-----")
_SEQUENCE, _INTEGER, _EXPLICIT_VERSION = 0x30, 0x02, 0xA0
_UTC_TIME, _GENERALIZED_TIME = 0x17, 0x18


def not_after(pem: bytes) -> float:
    """Seconds since the epoch at which the first certificate of a PEM chain (the leaf a server
    presents) expires."""
    match = _PEM_CERTIFICATE.search(pem)
    if match is None:
        raise ValueError("no PEM certificate found")
    try:
        der = base64.b64decode(b"".join(match.group(1).split()), validate=True)
    except ValueError:
        raise ValueError("the PEM certificate is not valid base64") from None
    return _validity_end(der)


def _element(der: bytes, at: int) -> tuple[int, int, int]:
    """(tag, start of content, end of content) of the DER element starting at ``at``."""
    if at + 2 > len(der):
        raise ValueError("truncated certificate")
    tag, length, at = der[at], der[at + 1], at + 2
    if length & 0x80:  # long form: the low bits count the length's own bytes
        count = length & 0x7F
        if not 0 < count <= 4 or at + count > len(der):
            raise ValueError("bad length in certificate")
        length, at = int.from_bytes(der[at:at + count], "big"), at + count
    if at + length > len(der):
        raise ValueError("truncated certificate")
    return tag, at, at + length


def _inside(der: bytes, at: int, tag: int) -> tuple[int, int]:
    found, start, end = _element(der, at)
    if found != tag:
        raise ValueError("unexpected field in certificate")
    return start, end


def _validity_end(der: bytes) -> float:
    start, _ = _inside(der, 0, _SEQUENCE)  # Certificate
    at, _ = _inside(der, start, _SEQUENCE)  # tbsCertificate
    if der[at:at + 1] == bytes([_EXPLICIT_VERSION]):
        at = _element(der, at)[2]
    for expected in (_INTEGER, _SEQUENCE, _SEQUENCE):  # serialNumber, signature, issuer
        at = _inside(der, at, expected)[1]
    validity, _ = _inside(der, at, _SEQUENCE)
    not_before_end = _element(der, validity)[2]
    tag, start, end = _element(der, not_before_end)
    return _time(tag, der[start:end])


def _time(tag: int, value: bytes) -> float:
    """UTCTime (YYMMDDHHMMSSZ, years 1950–2049) or GeneralizedTime (YYYYMMDDHHMMSSZ), as RFC 5280
    requires them: UTC, with seconds."""
    text = value.decode("ascii", "replace")
    if tag == _UTC_TIME and re.fullmatch(r"\d{12}Z", text):
        year = int(text[:2])
        year += 1900 if year >= 50 else 2000
        rest = text[2:]
    elif tag == _GENERALIZED_TIME and re.fullmatch(r"\d{14}Z", text):
        year, rest = int(text[:4]), text[4:]
    else:
        raise ValueError("certificate validity is not an RFC 5280 time")
    month, day, hour, minute, second = (int(rest[i:i + 2]) for i in range(0, 10, 2))
    return float(calendar.timegm((year, month, day, hour, minute, second, 0, 0, 0)))
