"""Client API-key check: ``Authorization: Bearer <key>`` against a mounted Secret key file.

The file is reread on every check so a rotated Secret (kubelet swaps the projected file) takes
effect on the next request without a restart. The comparison is constant-time over bytes. Neither
the presented nor the expected key is ever logged or put into an error message.
"""

from __future__ import annotations

import hmac
import logging

__all__ = ["KeyFileAuthenticator", "MAX_KEY_FILE_BYTES"]

log = logging.getLogger("noctaya.gateway.auth")

MAX_KEY_FILE_BYTES = 4096  # a key, not a document: bounds the per-request read


class KeyFileAuthenticator:
    def __init__(self, key_file: str) -> None:
        self.key_file = key_file
        self._warned = False

    def _expected_key(self) -> bytes | None:
        try:
            with open(self.key_file, "rb") as fh:
                raw = fh.read(MAX_KEY_FILE_BYTES + 1)
        except OSError as exc:
            if not self._warned:
                log.warning("auth key file unreadable; rejecting all requests",
                            extra={"errno": exc.errno})
                self._warned = True
            return None
        if len(raw) > MAX_KEY_FILE_BYTES:
            log.warning("auth key file larger than %d bytes; rejecting all requests", MAX_KEY_FILE_BYTES)
            return None
        key = raw.strip()
        if not key:
            log.warning("auth key file is empty; rejecting all requests")
            return None
        self._warned = False
        return key

    def check(self, authorization_header: bytes | str | None) -> bool:
        """True when the header carries the current key. Fails closed on any file problem."""
        expected = self._expected_key()
        if expected is None or not authorization_header:
            return False
        if isinstance(authorization_header, str):
            authorization_header = authorization_header.encode("latin-1", errors="replace")
        scheme, _, presented = authorization_header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return hmac.compare_digest(presented.strip(), expected)
