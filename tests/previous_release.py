"""The release a user upgrades from, as source, for the tests that judge this checkout against it.

Every change is also judged against what users run today: stored objects the previous release's
CRDs and hooks accepted must stay accepted, and a Pod template it rendered for an unchanged object
must not change without an UpgradePending condition (tests/hooks/test_upgrade_compat.py, the upgrade
e2e in tests/e2e/test_upgrade.py). Its source comes from this clone's own git history (the commit is
pinned below; `docs/releasing.md` says when to move it), extracted once with `git archive` into a cache
directory outside the repository. A clone without that commit (shallow, or a tarball) skips those
tests with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.third_party import ThirdPartyUnavailable

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Release:
    version: str
    commit: str  # full SHA-1 of the landed commit


# The last landed release. Move it (version and commit) when a release lands (docs/releasing.md).
PREVIOUS = Release("0.1.0", "cac67002efb9167f6476b894bad166ca9b348676")


class ReleaseUnavailable(ThirdPartyUnavailable):
    """The previous release's source cannot be had here (the tests skip with this reason)."""


def cache_root() -> Path:
    override = os.environ.get("NOCTAYA_RELEASES_CACHE")
    return Path(override) if override else Path.home() / ".cache" / "noctaya-releases"


def tree_path(release: Release = PREVIOUS) -> Path:
    return cache_root() / release.commit


def present(release: Release = PREVIOUS) -> bool:
    return (tree_path(release) / ".complete").exists()


def _git(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, timeout=300, check=False)


def source_tree(release: Release = PREVIOUS) -> Path:
    """The release's files (cached); raises ReleaseUnavailable saying why they cannot be had."""
    target = tree_path(release)
    if present(release):
        return target
    if shutil.which("git") is None:
        raise ReleaseUnavailable("git is not installed: the previous release's source comes from this clone's history")
    if _git("cat-file", "-e", f"{release.commit}^{{commit}}").returncode != 0:
        raise ReleaseUnavailable(
            f"release {release.version} ({release.commit[:12]}) is not in this clone's history (a shallow clone or a "
            f"copy without .git?): `git fetch --unshallow` or clone the whole repository")
    cache_root().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{release.commit[:12]}-", dir=cache_root()) as tmp:
        archive = Path(tmp) / "release.tar"
        out = _git("archive", "--format=tar", "-o", str(archive), release.commit)
        if out.returncode != 0:
            raise ReleaseUnavailable(f"git archive {release.commit[:12]} failed: {out.stderr.decode(errors='replace')[-300:]}")
        tree = Path(tmp) / "tree"
        with tarfile.open(archive) as tar:
            tar.extractall(tree, filter="data")
        (tree / ".complete").write_text(f"{release.version} {release.commit}\n")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tree, target)  # whole or not at all: another session may extract it too
    return target
