"""Write a release's version into every file that carries a copy, regenerate the chart, check they agree.

    python tools/release.py 0.3.0     # hooks/version.py, then every copy below, then `make chart`
    python tools/release.py --check   # write nothing; exit 1 naming every copy that differs

hooks/version.py is the source; the copies are the ones that cannot import it: pyproject.toml, the
chart's version and appVersion, the image tag and NOCTAYA_EXPECTED_VERSION in
metacontroller/hook-server.yaml, the `serving.noctaya.io/version` annotation of every controller
manifest, the Dockerfile's build line, and the chart templates generated from metacontroller/
(tools/chart/generate.py). tests/test_release.py reads every copy on its own and fails when one differs.
See docs/releasing.md for the whole release step.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: hooks.version is the repository's
from hooks.version import IMAGE_REPOSITORY  # noqa: E402

VERSION_FILE = "hooks/version.py"
CHANGELOG = "CHANGELOG.md"
RELEASE_VERSION = re.compile(r"(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)")
# What a copy holds, right or wrong: wide enough that a stale or mistyped copy is still found.
ANY = r"(?P<v>[0-9A-Za-z.+_-]+)"
IMAGE = re.escape(f"{IMAGE_REPOSITORY}:") + ANY


@dataclass(frozen=True)
class Site:
    """Where a copy of the version lives: a file (or glob), a pattern whose group `v` is the version,
    and how many times the pattern occurs in each file."""

    glob: str
    pattern: re.Pattern[str]
    count: int

    def files(self, root: Path) -> list[Path]:
        return sorted(root.glob(self.glob))


def _site(glob: str, pattern: str, count: int = 1) -> Site:
    return Site(glob, re.compile(pattern, re.MULTILINE), count)


SITES: tuple[Site, ...] = (
    _site(VERSION_FILE, rf'^__version__ = "{ANY}"$'),
    _site("pyproject.toml", rf'^version = "{ANY}"$'),
    _site("charts/noctaya/Chart.yaml", rf"^version: {ANY}$"),
    _site("charts/noctaya/Chart.yaml", rf'^appVersion: "{ANY}"$'),
    # The container's image and NOCTAYA_IMAGE (what the hooks render gateways with).
    _site("metacontroller/hook-server.yaml", rf"{IMAGE}$", count=2),
    _site("metacontroller/hook-server.yaml", rf'name: NOCTAYA_EXPECTED_VERSION\n\s+value: "{ANY}"$'),
    _site("metacontroller/*-controller.yaml", rf'^\s+serving\.noctaya\.io/version: "{ANY}"$'),
    _site("Dockerfile", rf"docker build -t {IMAGE} \.$"),
)


class ReleaseError(Exception):
    """A problem reported as one line on stderr, exit status 2."""


def found_versions(root: Path, site: Site) -> dict[Path, list[str]]:
    """Each file of the site and the versions its pattern finds there."""
    files = site.files(root)
    if not files:
        raise ReleaseError(f"{site.glob}: no such file (update SITES in tools/release.py)")
    return {path: [m["v"] for m in site.pattern.finditer(path.read_text(encoding="utf-8"))] for path in files}


def source_version(root: Path) -> str:
    (versions,) = found_versions(root, SITES[0]).values()
    if len(versions) != 1:
        raise ReleaseError(f"{VERSION_FILE}: expected one `__version__ = \"...\"` line")
    return versions[0]


def disagreements(root: Path) -> list[str]:
    """One line per copy that does not hold hooks/version.py's version exactly `count` times."""
    want = source_version(root)
    problems = []
    for site in SITES[1:]:
        for path, versions in found_versions(root, site).items():
            name = path.relative_to(root)
            if len(versions) != site.count:
                problems.append(f"{name}: `{site.pattern.pattern}` found {len(versions)} time(s), "
                                f"expected {site.count} (update SITES in tools/release.py if the file changed)")
            wrong = sorted({v for v in versions if v != want})
            if wrong:
                problems.append(f"{name}: {', '.join(wrong)} where {VERSION_FILE} says {want}")
    return problems


def _generate_chart(root: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(root / "tools" / "chart" / "generate.py"), *flags],
                          capture_output=True, text=True, check=False, timeout=120)


def check(root: Path) -> list[str]:
    """Every disagreement, including a chart not regenerated since metacontroller/ changed."""
    problems = disagreements(root)
    chart = _generate_chart(root, "--check")
    if chart.returncode != 0:
        problems.append(f"charts/noctaya is not generated from metacontroller/ (run `make chart`):\n{chart.stderr.strip()}")
    return problems


def parse_release(text: str) -> tuple[int, int, int]:
    match = RELEASE_VERSION.fullmatch(text)
    if match is None:
        raise ReleaseError(f"{text!r} is not MAJOR.MINOR.PATCH (digits only: it must be a chart version, "
                           "a Python version and an image tag at once)")
    major, minor, patch = (int(part) for part in match.groups())
    return major, minor, patch


def _rewrite(path: Path, pattern: re.Pattern[str], version: str) -> None:
    text = path.read_text(encoding="utf-8")

    def replace(match: re.Match[str]) -> str:
        start, end = match.span("v")
        return match.string[match.start():start] + version + match.string[end:match.end()]

    path.write_text(pattern.sub(replace, text), encoding="utf-8")


def bump(root: Path, version: str) -> None:
    """Write `version` into hooks/version.py and every copy, then regenerate the chart."""
    new, current = parse_release(version), source_version(root)
    if RELEASE_VERSION.fullmatch(current) and new < parse_release(current):
        raise ReleaseError(f"{version} is older than the current {current}: releases only go forward")
    for site in SITES:  # every site must be where we expect it before anything is written
        for path, versions in found_versions(root, site).items():
            if len(versions) != site.count:
                raise ReleaseError(f"{path.relative_to(root)}: `{site.pattern.pattern}` found {len(versions)} "
                                   f"time(s), expected {site.count}; nothing written (update SITES)")
    for site in SITES:
        for path in site.files(root):
            _rewrite(path, site.pattern, version)
    chart = _generate_chart(root)
    if chart.returncode != 0:
        raise ReleaseError(f"tools/chart/generate.py failed:\n{chart.stderr.strip()}")


def changelog_has(root: Path, version: str) -> bool:
    """Whether CHANGELOG.md has a heading naming `version`."""
    path = root / CHANGELOG
    heading = re.compile(rf"^##.*(?<![0-9.]){re.escape(version)}(?![0-9.])", re.MULTILINE)
    return path.is_file() and heading.search(path.read_text(encoding="utf-8")) is not None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version", nargs="?", help="the new release, MAJOR.MINOR.PATCH")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a copy differs")
    args = parser.parse_args(argv)
    if args.check == bool(args.version):
        parser.error("give either a VERSION or --check")
    try:
        if args.version:
            bump(ROOT, args.version)
        problems = check(ROOT)
    except ReleaseError as exc:
        print(f"release: {exc}", file=sys.stderr)
        return 2
    version = source_version(ROOT)
    if not changelog_has(ROOT, version):
        note = f"{CHANGELOG} has no heading naming {version}: add its entry (docs/releasing.md)"
        if args.check:
            problems.append(note)
        else:  # right after a bump the entry may well be written next
            print(f"release: reminder: {note}", file=sys.stderr)
    for line in problems:
        print(f"release: {line}", file=sys.stderr)
    if problems:
        return 1
    print(f"every copy says {version}" + (" (written; review `git diff`)" if args.version else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
