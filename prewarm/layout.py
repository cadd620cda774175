"""Where a model revision lives in the cache, and its readiness marker.

    <cache>/noctaya/<scheme>/<org>/<name>/<revision>          promoted weights (read by the engine)
    <cache>/noctaya/<scheme>/<org>/<name>/<revision>.partial  a download in progress (never read)
    <cache>/noctaya/<scheme>/<org>/<name>/<revision>.ready    the marker: JSON naming what is there
    <cache>/noctaya/<scheme>/<org>/<name>/<revision>.lock     held (flock) by the one process staging it

For oci:// the "org/name" is the registry and repository path (a port's ':' becomes '_'; a registry
name has no '_', so this is one-to-one) and the revision is the pinned manifest digest (directory
``sha256-<hex>``). Sources are parsed with the CRD's own grammar (``prewarm.sources``).

The marker is written only after the rename that promotes the directory, and atomically (write to a
temporary file, fsync, rename), so its presence means the whole revision is in place. The hooks
render the same paths (``hooks.resources.prewarm``): keep both in step.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from prewarm import sources

ROOT = "noctaya"
MARKER_SUFFIX = ".ready"
PARTIAL_SUFFIX = ".partial"
LOCK_SUFFIX = ".lock"
BLOBS_SUFFIX = ".blobs"
# Names this module gives beside a revision's directory: a revision's own key never ends in one.
_RESERVED_SUFFIXES = (MARKER_SUFFIX, PARTIAL_SUFFIX, LOCK_SUFFIX, BLOBS_SUFFIX, ".tmp")
DEFAULT_REVISION = sources.DEFAULT_REVISION


class LayoutError(ValueError):
    """A source or revision that cannot name a cache directory."""


def revision_key(revision: str) -> str:
    """A revision (branch, tag or commit; may contain '/') as one safe path component, injectively.

    '/' becomes "--", as it always has, so a simple revision keeps its directory name (``main``,
    ``v1.0``, a commit id, ``refs/pr/1`` → ``refs--pr--1``). What could read the same is escaped
    with '%' (which no revision contains): a '-' next to another '-' or a '/' (``a--b`` →
    ``a%2D%2Db``, so it is not ``a/b``), a leading ``_.`` (a leading '.' becomes ``_.``, as before:
    never '.', '..' or a hidden name) and the '.' of a trailing ``.ready``/``.partial``/``.lock``/``.blobs``/``.tmp`` (never another
    revision's marker or download). An OCI manifest digest ``sha256:<hex>`` is ``sha256-<hex>``
    (a hub revision cannot contain ':'; the schemes' directories are apart anyway)."""
    if re.fullmatch(sources.DIGEST_RE, revision):
        return revision.replace(":", "-")
    error = sources.revision_error(revision)
    if error is not None:
        raise LayoutError(error)
    out = []
    for i, ch in enumerate(revision):
        if ch == "/":
            out.append("--")
        elif ch == "-" and ((i > 0 and revision[i - 1] in "-/") or (i + 1 < len(revision) and revision[i + 1] in "-/")):
            out.append("%2D")
        elif i == 0 and ch == ".":
            out.append("_.")  # as before: never '.', '..' or a hidden name
        elif i == 0 and ch == "_" and revision[1:2] == ".":
            out.append("%5F")  # so "_.x" is not ".x"
        else:
            out.append(ch)
    key = "".join(out)
    for suffix in _RESERVED_SUFFIXES:
        if key.endswith(suffix):
            key = key[: -len(suffix)] + "%2E" + suffix[1:]
            break
    return key


@dataclass(frozen=True)
class ModelDir:
    """The cache paths of one (source, revision)."""

    cache_dir: Path
    scheme: str
    repo_id: str  # org/name; oci: registry[:port]/repo
    revision: str

    @classmethod
    def of(cls, cache_dir: str | os.PathLike[str], source: str, revision: str | None) -> ModelDir:
        """The paths of ``source`` (the grammar of ``prewarm.sources``, the CRD's own) at ``revision``."""
        try:
            parsed = sources.parse_model_source(source)
        except ValueError as exc:
            raise LayoutError(str(exc)) from None
        if parsed.scheme == "pvc":
            raise LayoutError(f"source {source!r} is pre-staged on a claim: nothing is staged in the cache")
        if parsed.scheme == "oci":
            assert parsed.digest is not None
            return cls(Path(cache_dir), "oci", parsed.location, parsed.digest)
        rev = revision or DEFAULT_REVISION[parsed.scheme]
        revision_key(rev)  # validates
        return cls(Path(cache_dir), parsed.scheme, parsed.location, rev)

    @property
    def source(self) -> str:
        if self.scheme == "oci":
            return f"oci://{self.repo_id}@{self.revision}"
        return f"{self.scheme}://{self.repo_id}"

    @property
    def parent(self) -> Path:
        return self.cache_dir / ROOT / self.scheme / self.repo_id.replace(":", "_")

    @property
    def final(self) -> Path:
        return self.parent / revision_key(self.revision)

    @property
    def partial(self) -> Path:
        return self.parent / (revision_key(self.revision) + PARTIAL_SUFFIX)

    @property
    def marker(self) -> Path:
        return self.parent / (revision_key(self.revision) + MARKER_SUFFIX)

    @property
    def lock_file(self) -> Path:
        return self.parent / (revision_key(self.revision) + LOCK_SUFFIX)

    @property
    def blobs(self) -> Path:
        return self.parent / (revision_key(self.revision) + BLOBS_SUFFIX)

    def read_marker(self) -> dict[str, Any] | None:
        """The marker when it exists and names this source and revision, else None."""
        try:
            data = json.loads(self.marker.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("source") != self.source or data.get("revision") != self.revision:
            return None
        return data if self.final.is_dir() else None

    @contextlib.contextmanager
    def locked(self, timeout: float, log: logging.Logger, interval: float = 10.0) -> Iterator[None]:
        """Hold the revision's lock (an exclusive ``flock`` on ``<revision>.lock``) for staging it.

        Two Jobs for one revision on one node (HostPath, or a shared claim) would otherwise delete
        each other's ``.partial``. The second one waits, saying so every ``interval`` s, and then
        normally finds the marker the first wrote; the kernel releases the lock of a process that
        dies, so a crashed holder never blocks it. Gives up with LockTimeout after ``timeout`` s.
        The lock file is never removed (removing it would let a third process lock another file)."""
        self.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            started = time.monotonic()
            said: float | None = None
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    pass
                now = time.monotonic()
                if now - started >= timeout:
                    raise LockTimeout(f"{self.lock_file.name} is still held by another download after {timeout:.0f} s "
                                      f"({_holder(fd)}); is another Job staging this revision on this cache?")
                if said is None or now - said >= interval:
                    log.info("waiting for %s: another download of this revision holds it (%s) for %.0f s",
                             self.lock_file.name, _holder(fd), now - started)
                    said = now
                time.sleep(min(0.2, max(timeout - (now - started), 0.01)))
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{socket.gethostname()} pid {os.getpid()} since {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n"
                      .encode(), 0)
            yield
        finally:
            os.close(fd)  # releases the lock

    def clear_partial(self) -> bool:
        """Remove a leftover ``.partial`` (an interrupted attempt); True when there was one."""
        if not self.partial.exists():
            return False
        shutil.rmtree(self.partial)
        return True

    def promote(self, marker: dict[str, Any]) -> None:
        """Rename ``.partial`` to the final directory, then write the marker (both atomic)."""
        if self.final.exists():
            # A previous attempt promoted but died before the marker: its content was verified
            # before that rename, but nothing says so now; replace it with this verified copy.
            shutil.rmtree(self.final)
        os.replace(self.partial, self.final)
        _fsync_dir(self.parent)
        write_json_atomically(self.marker, {"source": self.source, "revision": self.revision, **marker})


class LockTimeout(Exception):
    """Another process held a revision's lock for longer than the wait allows."""


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "holder unknown"


def safe_relative_path(name: str, what: str) -> PurePosixPath:
    """A relative path that stays inside its directory, or LayoutError."""
    path = PurePosixPath(name)
    if not name or path.is_absolute() or name.startswith("/"):
        raise LayoutError(f"{what} {name!r} is an absolute path: refused")
    if any(part in ("..",) for part in path.parts):
        raise LayoutError(f"{what} {name!r} leaves the target directory: refused")
    if "\\" in name or "\0" in name:
        raise LayoutError(f"{what} {name!r} is not a portable path: refused")
    parts = [p for p in path.parts if p != "."]
    if not parts:
        raise LayoutError(f"{what} {name!r} names no file: refused")
    return PurePosixPath(*parts)


def check_regular_tree(root: Path) -> None:
    """Nothing but regular files and directories under ``root`` (defence in depth)."""
    for path in root.rglob("*"):
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            raise LayoutError(f"{path.relative_to(root)} is not a regular file: refused")


def write_json_atomically(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(data, fh, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
