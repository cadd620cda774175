"""Wake when a mounted directory changes, without polling it: Linux inotify through ctypes.

The shared gateway's model table is a ConfigMap volume. The kubelet updates one by writing the new
files into a fresh directory and renaming a ``..data`` link over the old one, so every update is a
``rename`` inside the mount directory; an edit in place (a test, a hostPath) is a ``close_write``.
Watching the directory catches both, and an idle gateway sleeps until one happens instead of waking
every few seconds to ``stat`` a file that almost never changes.

Where inotify is unavailable (not Linux, or the per-user watch limit is reached) :func:`watch_directory`
returns None and the caller keeps polling.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os

__all__ = ["DirectoryWatch", "watch_directory"]

log = logging.getLogger("noctaya.gateway")

_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
# Entries created, written and closed, renamed in or out, deleted; the directory itself going away.
_IN_CLOSE_WRITE, _IN_MOVED_FROM, _IN_MOVED_TO = 0x008, 0x040, 0x080
_IN_CREATE, _IN_DELETE, _IN_DELETE_SELF, _IN_MOVE_SELF = 0x100, 0x200, 0x400, 0x800
_MASK = _IN_CLOSE_WRITE | _IN_MOVED_FROM | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE | _IN_DELETE_SELF | _IN_MOVE_SELF
_READ_BYTES = 4096  # events are drained, not interpreted: any of them means "look again"


class DirectoryWatch:
    """One inotify descriptor watching one directory. :meth:`wait` is gevent-friendly."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def wait(self, timeout: float) -> bool:
        """True when the directory changed within ``timeout`` seconds (events are consumed)."""
        from gevent.socket import wait_read

        try:
            wait_read(self.fd, timeout=timeout)
        except TimeoutError:
            return False
        return self._drain()

    def _drain(self) -> bool:
        changed = False
        while True:
            try:
                if not os.read(self.fd, _READ_BYTES):
                    return changed
                changed = True
            except BlockingIOError:
                return changed

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        libc.inotify_init1  # noqa: B018 - present only where inotify is
        libc.inotify_add_watch  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def watch_directory(path: str) -> DirectoryWatch | None:
    """A watch on ``path`` (a directory), or None where inotify cannot be had (logged once, here)."""
    libc = _libc()
    if libc is None:
        return None
    fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
    if fd < 0:
        log.warning("inotify unavailable; polling the model table", extra={"error": errno.errorcode.get(ctypes.get_errno(), "?")})
        return None
    if libc.inotify_add_watch(fd, os.fsencode(path), _MASK) < 0:
        err = ctypes.get_errno()
        os.close(fd)
        log.warning("cannot watch the model table's directory; polling it",
                    extra={"path": path, "error": errno.errorcode.get(err, "?")})
        return None
    return DirectoryWatch(fd)
