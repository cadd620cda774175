"""Client API-key check: ``Authorization: Bearer <key>`` against a mounted Secret key file.

The file is reread on every check so a rotated Secret (kubelet swaps the projected file) takes
effect on the next request without a restart. The comparison is constant-time over bytes. Neither
the presented nor the expected key is ever logged or put into an error message.
"""

from __future__ import annotations

import hmac
import logging

from scaler.secretfiles import MAX_SECRET_FILE_BYTES, read_secret_file

__all__ = ["KeyFileAuthenticator", "MAX_KEY_FILE_BYTES"]

log = logging.getLogger("noctaya.gateway.auth")

MAX_KEY_FILE_BYTES = MAX_SECRET_FILE_BYTES


class KeyFileAuthenticator:
    def __init__(self, key_file: str) -> None:
        self.key_file = key_file
        self._warned = False

    def _expected_key(self) -> bytes | None:
        key = read_secret_file(self.key_file)
        if key is None:
            if not self._warned:
                log.warning("auth key file missing, empty or larger than %d bytes; rejecting all requests",
                            MAX_KEY_FILE_BYTES)
                self._warned = True
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
