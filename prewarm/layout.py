"""Where a model revision lives in the cache, and its readiness marker.

    <cache>/noctaya/<scheme>/<org>/<name>/<revision>          promoted weights (read by the engine)
    <cache>/noctaya/<scheme>/<org>/<name>/<revision>.partial  a download in progress (never read)
    <cache>/noctaya/<scheme>/<org>/<name>/<revision>.ready    the marker: JSON naming what is there

For oci:// the "org/name" is the registry and repository path (a port's ':' becomes '_') and the
revision is the pinned manifest digest (directory ``sha256-<hex>``).

The marker is written only after the rename that promotes the directory, and atomically (write to a
temporary file, fsync, rename), so its presence means the whole revision is in place. The hooks
render the same paths (``hooks.resources.prewarm``): keep both in step.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

ROOT = "noctaya"
MARKER_SUFFIX = ".ready"
PARTIAL_SUFFIX = ".partial"
_SOURCE_RE = re.compile(r"^(hf|modelscope)://([A-Za-z0-9][A-Za-z0-9._-]*)/([A-Za-z0-9][A-Za-z0-9._-]*)$")
_REVISION_RE = re.compile(r"^[A-Za-z0-9._/-]{1,128}$")
_OCI_RE = re.compile(r"^oci://([a-z0-9.-]+(?::[0-9]+)?)((?:/[a-z0-9._-]+)+)@(sha256:[a-f0-9]{64})$")
DEFAULT_REVISION = {"hf": "main", "modelscope": "master"}


class LayoutError(ValueError):
    """A source or revision that cannot name a cache directory."""


def revision_key(revision: str) -> str:
    """A revision (branch, tag or commit; may contain '/') as one safe path component."""
    if re.fullmatch(r"sha256:[a-f0-9]{64}", revision):
        return revision.replace(":", "-")  # an OCI manifest digest
    if not _REVISION_RE.match(revision):
        raise LayoutError(f"revision {revision!r} must be 1-128 characters of [A-Za-z0-9._/-]")
    key = revision.replace("/", "--")
    return "_" + key if key.startswith(".") else key  # never '.', '..' or a hidden name


@dataclass(frozen=True)
class ModelDir:
    """The cache paths of one (source, revision)."""

    cache_dir: Path
    scheme: str
    repo_id: str  # org/name
    revision: str

    @classmethod
    def of(cls, cache_dir: str | os.PathLike[str], source: str, revision: str | None) -> ModelDir:
        oci = _OCI_RE.match(source)
        if oci is not None:
            registry, repo, digest = oci.groups()
            segments = repo.strip("/").split("/")
            if any(s in (".", "..") or s.startswith(".") for s in segments):
                raise LayoutError(f"source {source!r} has a path segment that is not a name")
            return cls(Path(cache_dir), "oci", f"{registry}{repo}", digest)
        match = _SOURCE_RE.match(source)
        if match is None:
            raise LayoutError(f"source {source!r} must be hf://org/name, modelscope://org/name or "
                              "oci://registry/repo@sha256:<64 hex>")
        scheme, org, name = match.groups()
        if ".." in (org, name) or org.startswith(".") or name.startswith("."):
            raise LayoutError(f"source {source!r} has a path segment that is not a name")
        rev = revision or DEFAULT_REVISION[scheme]
        revision_key(rev)  # validates
        return cls(Path(cache_dir), scheme, f"{org}/{name}", rev)

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

    def read_marker(self) -> dict[str, Any] | None:
        """The marker when it exists and names this source and revision, else None."""
        try:
            data = json.loads(self.marker.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("source") != self.source or data.get("revision") != self.revision:
            return None
        return data if self.final.is_dir() else None

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
