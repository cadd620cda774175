"""One release version everywhere (hooks/version.py and every copy), and the release tool that writes them.

The copies are read here on their own (YAML, TOML, the running code), not through tools/release.py's
patterns, so a tool that missed a copy would still fail this test.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from hooks.version import IMAGE_REPOSITORY, RELEASE_IMAGE, __version__

ROOT = Path(__file__).resolve().parents[1]
CONTROLLER_KINDS = ("CompositeController", "DecoratorController")
ANNOTATION = "serving.noctaya.io/version"


def _documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _image_tag(image: str) -> str:
    repository, _, tag = image.rpartition(":")
    assert repository == IMAGE_REPOSITORY, f"{image} is not {IMAGE_REPOSITORY}:<tag>"
    return tag


def copies(root: Path) -> dict[str, str]:
    """Every copy of the release version under ``root``: where -> the version it says."""
    found: dict[str, str] = {}
    source = re.search(r'^__version__ = "([^"]*)"$', (root / "hooks" / "version.py").read_text(), re.MULTILINE)
    found["hooks/version.py"] = source[1] if source else "(none)"
    found["pyproject.toml"] = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((root / "charts" / "noctaya" / "Chart.yaml").read_text())
    found["Chart.yaml version"] = str(chart["version"])
    found["Chart.yaml appVersion"] = str(chart["appVersion"])
    kustomization = yaml.safe_load((root / "metacontroller" / "kustomization.yaml").read_text())
    for resource in kustomization["resources"]:
        path = root / "metacontroller" / resource
        if path.is_dir():
            continue
        for doc in _documents(path):
            where = f"{resource} {doc['kind']}/{doc['metadata']['name']}"
            if doc["kind"] in CONTROLLER_KINDS:
                found[where] = (doc["metadata"].get("annotations") or {}).get(ANNOTATION, "(no annotation)")
            if doc["kind"] == "Deployment" and doc["metadata"]["name"] == "noctaya-hooks":
                (container,) = doc["spec"]["template"]["spec"]["containers"]
                env = {e["name"]: e.get("value") for e in container["env"]}
                found[f"{where} image"] = _image_tag(container["image"])
                found[f"{where} NOCTAYA_IMAGE"] = _image_tag(env["NOCTAYA_IMAGE"])
                found[f"{where} NOCTAYA_EXPECTED_VERSION"] = env.get("NOCTAYA_EXPECTED_VERSION", "(unset)")
    for template in sorted((root / "charts" / "noctaya" / "templates").glob("generated-*-controller.yaml")):
        annotations = re.findall(rf"^\s+{re.escape(ANNOTATION)}: '?\"?([^'\"\s]+)", template.read_text(), re.MULTILINE)
        found[f"chart {template.name}"] = ",".join(annotations) or "(no annotation)"
    build = re.search(rf"docker build -t {re.escape(IMAGE_REPOSITORY)}:(\S+) \.", (root / "Dockerfile").read_text())
    found["Dockerfile build line"] = build[1] if build else "(none)"
    return found


def test_every_copy_of_the_version_agrees() -> None:
    found = copies(ROOT)
    controllers = [where for where in found if where.split()[-1].split("/")[0] in CONTROLLER_KINDS]
    assert len(controllers) >= 5, f"controller manifests not found: {sorted(found)}"
    wrong = {where: version for where, version in found.items() if version != __version__}
    assert not wrong, f"these copies differ from hooks/version.py ({__version__}): {wrong}; run tools/release.py"


def test_the_running_code_reports_the_release() -> None:
    from hooks.config import DEFAULT_IMAGE, HookConfig

    assert DEFAULT_IMAGE == RELEASE_IMAGE == f"{IMAGE_REPOSITORY}:{__version__}"
    assert HookConfig.from_env({}).image == RELEASE_IMAGE
    out = subprocess.run([sys.executable, "-m", "hooks", "--version"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == f"noctaya {__version__}"


def test_the_changelog_has_an_entry_for_the_release() -> None:
    headings = re.findall(r"^## (.*)$", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert any(re.search(rf"(?<![0-9.]){re.escape(__version__)}(?![0-9.])", h) for h in headings), headings


def release(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(root / "tools" / "release.py"), *args], capture_output=True,
                          text=True, timeout=180, check=False)


def test_release_check_passes_on_the_repository() -> None:
    out = release(ROOT, "--check")
    assert out.returncode == 0, out.stderr
    assert f"every copy says {__version__}" in out.stdout


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    """The parts of the repository that carry the version, the chart generator and what it reads."""
    root = tmp_path / "repo"
    for folder in ("metacontroller", "crds", "charts", "tools"):
        shutil.copytree(ROOT / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "hooks").mkdir()
    for name in ("hooks/__init__.py", "hooks/version.py", "pyproject.toml", "Dockerfile", "CHANGELOG.md"):
        shutil.copy2(ROOT / name, root / name)
    return root


def _next_minor() -> str:
    major, minor, _ = (int(part) for part in __version__.split("."))
    return f"{major}.{minor + 1}.0"


def test_release_writes_every_copy_and_regenerates_the_chart(tree: Path) -> None:
    new = _next_minor()
    out = release(tree, new)
    assert out.returncode == 0, out.stderr
    assert f"CHANGELOG.md has no heading naming {new}" in out.stderr  # a reminder, not a failure
    assert set(copies(tree).values()) == {new}
    chart = subprocess.run([sys.executable, str(tree / "tools" / "chart" / "generate.py"), "--check"],
                           capture_output=True, text=True, timeout=120, check=False)
    assert chart.returncode == 0, chart.stderr
    assert f"{IMAGE_REPOSITORY}:{new}" in (tree / "metacontroller" / "hook-server.yaml").read_text()
    # --check wants the changelog entry, then passes.
    refused = release(tree, "--check")
    assert refused.returncode == 1 and f"CHANGELOG.md has no heading naming {new}" in refused.stderr
    changelog = tree / "CHANGELOG.md"
    changelog.write_text(changelog.read_text().replace("\n## ", f"\n## {new}\n\nSomething.\n\n## ", 1))
    assert release(tree, "--check").returncode == 0


def test_release_check_names_a_copy_that_differs(tree: Path) -> None:
    chart = tree / "charts" / "noctaya" / "Chart.yaml"
    chart.write_text(chart.read_text().replace(f'appVersion: "{__version__}"', 'appVersion: "0.0.9"'))
    controller = tree / "metacontroller" / "llmgateway-controller.yaml"
    controller.write_text(controller.read_text().replace(f'{ANNOTATION}: "{__version__}"', "owner: someone"))
    out = release(tree, "--check")
    assert out.returncode == 1
    assert f"charts/noctaya/Chart.yaml: 0.0.9 where hooks/version.py says {__version__}" in out.stderr
    assert "metacontroller/llmgateway-controller.yaml: " in out.stderr and "found 0 time(s), expected 1" in out.stderr
    # ... and a bump refuses to write anything while a copy cannot be found.
    before = (tree / "hooks" / "version.py").read_text()
    assert release(tree, _next_minor()).returncode == 2
    assert (tree / "hooks" / "version.py").read_text() == before


@pytest.mark.parametrize(("version", "message"), [
    ("0.3", "is not MAJOR.MINOR.PATCH"),
    ("v0.3.0", "is not MAJOR.MINOR.PATCH"),
    ("0.3.0-rc.1", "is not MAJOR.MINOR.PATCH"),
    ("0.0.0", "is older than the current"),
])
def test_release_refuses_a_version_it_cannot_use(tree: Path, version: str, message: str) -> None:
    before = copies(tree)
    out = release(tree, version)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert copies(tree) == before
