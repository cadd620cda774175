"""Client API-key check: ``Authorization: Bearer <key>`` against one or more mounted Secret key files.

A per-model gateway has one key file; a shared gateway's model may list several (``authKeyFiles`` in
the model table), so that keys handed to different teams each open the model. Every file is reread
on every check so a rotated Secret (kubelet swaps the projected file) takes effect on the next
request without a restart. The comparison is constant-time over bytes and runs against every file,
whichever matches, so the time taken does not tell which key (or whether an earlier one) matched.
Neither the presented nor an expected key is ever logged or put into an error message.

A shared gateway checks a request's token before reading its body, against every key of every model
(:class:`KeyIndex`): one hash and one dict lookup per request, whatever the number of key files. The
same lookup says which models the token opens, so that once the body names a model, a model that
does not exist and one the key does not open are told apart by nothing: both are one set lookup in
what the key opens, and both are answered 404 ``model_not_found`` (gateway.shared).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from scaler.secretfiles import MAX_SECRET_FILE_BYTES, read_secret_file

__all__ = ["KeyFileAuthenticator", "KeyIndex", "KEY_INDEX_SECONDS", "MAX_KEY_FILE_BYTES", "MAX_KEY_FILES",
           "bearer_token"]

log = logging.getLogger("noctaya.gateway.auth")

MAX_KEY_FILE_BYTES = MAX_SECRET_FILE_BYTES
MAX_KEY_FILES = 16  # files read per check: bounds the cost one request can cause
# How stale a KeyIndex may be: its files are reread at most this often (a shared gateway may have up
# to 256 models of 16 files; rereading them all per request would let any caller cost that much).
KEY_INDEX_SECONDS = 1.0


def bearer_token(authorization_header: bytes | str | None) -> bytes | None:
    """The token of a ``Bearer`` header (surrounding whitespace stripped), or None."""
    if not authorization_header:
        return None
    if isinstance(authorization_header, str):
        authorization_header = authorization_header.encode("latin-1", errors="replace")
    scheme, _, presented = authorization_header.partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return presented.strip()


class KeyFileAuthenticator:
    """Lets a request in when its bearer key equals the key in any of ``key_files`` (1..16 paths).
    A file that is missing, empty or oversized opens nothing (fail closed); the others still do."""

    def __init__(self, key_files: str | Sequence[str]) -> None:
        files = (key_files,) if isinstance(key_files, str) else tuple(key_files)
        if not 1 <= len(files) <= MAX_KEY_FILES:
            raise ValueError(f"an authenticator reads 1 to {MAX_KEY_FILES} key files")
        self.key_files = files
        self._warned: set[str] = set()

    def _expected_keys(self, read: dict[str, bytes | None] | None = None) -> list[bytes]:
        keys = []
        for path in self.key_files:
            if read is None:
                key = read_secret_file(path)
            elif path in read:
                key = read[path]
            else:
                key = read[path] = read_secret_file(path)
            if key is None:
                if path not in self._warned:  # once per file until it is readable again: the path only
                    log.warning("auth key file missing, empty or larger than %d bytes; it opens nothing",
                                MAX_KEY_FILE_BYTES, extra={"key_file": path})
                    self._warned.add(path)
                continue
            self._warned.discard(path)
            keys.append(key)
        return keys

    def check(self, authorization_header: bytes | str | None) -> bool:
        """True when the header carries a current key. Fails closed on any file problem."""
        expected = self._expected_keys()
        presented = bearer_token(authorization_header)
        if not expected or presented is None:
            return False
        return self.matches(presented, expected)

    def opens(self, presented: bytes, read: dict[str, bytes | None]) -> bool:
        """Whether the bearer token ``presented`` matches a key of these files; ``read`` holds the
        files already read for the same request (several models may share a key file: one read
        each per request)."""
        expected = self._expected_keys(read)
        return bool(expected) and self.matches(presented, expected)

    @staticmethod
    def matches(presented: bytes, expected: Sequence[bytes]) -> bool:
        # Every key compared, always (no short circuit): the time does not say which one matched.
        results = [hmac.compare_digest(presented, key) for key in expected]
        return any(results)


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


_NOTHING: frozenset[str] = frozenset()


class KeyIndex:
    """Whether a bearer token is a current key of any of ``key_files``: the union of a shared
    gateway's keys, checked before a request's body is read, and which models it opens. One SHA-256
    and one dict lookup per check: the dict holds digests, never keys, and where a lookup lands
    depends on the digest alone, so its time says nothing about any key. The files are reread at
    most every ``refresh_seconds`` (a rotated key opens within that; the model's own check after
    routing rereads its files, so a revoked key never opens a model, and is refused before the body
    once the index is reread).

    ``key_files``: paths, or a mapping of each path to the names (models) its key opens; a bare path
    opens its own name."""

    def __init__(self, key_files: Iterable[str] | Mapping[str, Iterable[str]], *,
                 refresh_seconds: float = KEY_INDEX_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        owners = key_files if isinstance(key_files, Mapping) else {path: (path,) for path in key_files}
        # a file shared by several models: read once
        self.key_files = tuple(dict.fromkeys(owners))
        self._owners = {path: frozenset(names) for path, names in owners.items()}
        self.refresh_seconds = refresh_seconds
        self._clock = clock
        self._opens: dict[bytes, frozenset[str]] = {}
        self._read_at = -math.inf

    def _refresh(self) -> None:
        now = self._clock()
        if now - self._read_at < self.refresh_seconds:
            return
        self._read_at = now
        opens: dict[bytes, frozenset[str]] = {}
        for path in self.key_files:
            key = read_secret_file(path)  # a missing file opens nothing
            if key is not None:
                digest = _digest(key)
                opens[digest] = opens.get(digest, _NOTHING) | self._owners[path]
        self._opens = opens

    def check(self, authorization_header: bytes | str | None) -> bool:
        """True when the header's bearer token is one of the keys (as of the last reread)."""
        return bool(self.opens(authorization_header))

    def opens(self, authorization_header: bytes | str | None) -> frozenset[str]:
        """The names the header's bearer token opens (as of the last reread); none for no token or
        one that is no key."""
        presented = bearer_token(authorization_header)
        self._refresh()
        if not presented:
            return _NOTHING
        return self._opens.get(_digest(presented), _NOTHING)
