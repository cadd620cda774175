"""The container image: every `python -m ...` command that the Dockerfile, the install manifests and
the rendered children name exists in the package and prints --help, and the Dockerfile copies it.

Building the image itself needs a builder (docker, podman or buildah) with access to the base
image; set NOCTAYA_BUILD_IMAGE=1 where one is available.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.kube.apiserver import REPO_ROOT
from tests.kube.manifests import METACONTROLLER_DIR, load_documents

DOCKERFILE = REPO_ROOT / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"
FIXTURES_DIR = REPO_ROOT / "tests" / "fixtures" / "hooks"
PYTHON_M = re.compile(r"python -m ([A-Za-z_][\w.]*)((?: [a-z][a-z-]*)?)")


def dockerfile_stages() -> list[list[str]]:
    """Instructions (continuation lines joined, comments dropped) grouped by FROM."""
    stages: list[list[str]] = []
    logical = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    for line in logical.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


def instruction(stage: list[str], name: str) -> list[str]:
    return [line.split(None, 1)[1] for line in stage if line.split(None, 1)[0].upper() == name]


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj.get("spec", {})
    template = spec.get("jobTemplate", {}).get("spec", spec).get("template", {})
    pod = template.get("spec", {})
    return [*pod.get("initContainers", []), *pod.get("containers", [])]


def python_m_command(container: dict[str, Any]) -> tuple[str, ...] | None:
    """("module", "subcommand"?) of a container that runs `python -m module [subcommand] ...`."""
    argv = [*container.get("command", []), *container.get("args", [])]
    if len(argv) < 3 or Path(argv[0]).name not in ("python", "python3") or argv[1] != "-m":
        return None
    module, rest = argv[2], argv[3:]
    if rest and not rest[0].startswith("-"):
        return (module, rest[0])
    return (module,)


def manifest_objects() -> list[tuple[str, dict[str, Any]]]:
    """Install manifests and rendered children (golden fixtures), with where each came from."""
    found = [
        (str(p.relative_to(REPO_ROOT)), d) for p in sorted(METACONTROLLER_DIR.glob("*.yaml")) for d in load_documents(p)
    ]
    for path in sorted(FIXTURES_DIR.glob("*/expected.json")):
        response = json.loads(path.read_text())
        for obj in [*(response.get("children") or []), *(response.get("attachments") or [])]:
            found.append((str(path.relative_to(REPO_ROOT)), obj))
    render = FIXTURES_DIR / "render" / "expected.yaml"
    if render.exists():
        found += [(str(render.relative_to(REPO_ROOT)), d) for d in yaml.safe_load_all(render.read_text()) if d]
    return found


def named_commands() -> dict[tuple[str, ...], str]:
    """Every python -m command, mapped to one place that names it."""
    commands: dict[tuple[str, ...], str] = {}
    final = dockerfile_stages()[-1]
    (entrypoint,) = instruction(final, "ENTRYPOINT")
    (cmd,) = instruction(final, "CMD")
    assert json.loads(entrypoint) == ["python", "-m"], "ENTRYPOINT runs a module named by CMD or the Pod command"
    commands[tuple(json.loads(cmd))] = "Dockerfile CMD"
    # The commands the Dockerfile documents in its header comment.
    header = "\n".join(line for line in DOCKERFILE.read_text().splitlines() if line.startswith("#"))
    for module, sub in PYTHON_M.findall(header):
        commands.setdefault((module, sub.strip()) if sub.strip() else (module,), "Dockerfile")
    for where, obj in manifest_objects():
        for container in containers(obj):
            command = python_m_command(container)
            if command is not None:
                commands.setdefault(command, f"{where}: {obj['kind']}/{obj['metadata']['name']}")
    return commands


def test_manifests_and_children_name_the_expected_programs() -> None:
    commands = named_commands()
    modules = {c[0] for c in commands}
    assert {"hooks", "gateway"} <= modules, commands
    assert ("hooks", "serve") in commands
    assert ("scaler", "aggregate") in commands


@pytest.mark.parametrize("command", sorted(named_commands()), ids=" ".join)
def test_named_command_exists_and_prints_help(command: tuple[str, ...]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", *command, "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, f"python -m {' '.join(command)} --help failed:\n{proc.stderr}"
    assert "usage" in proc.stdout.lower(), proc.stdout


def _dockerignore_allows(top_level: str) -> bool:
    allowed = False
    for raw in DOCKERIGNORE.read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negated = pattern.startswith("!")
        name = pattern.lstrip("!").rstrip("/")
        if name in ("*", top_level):
            allowed = negated
    return allowed


def test_dockerfile_copies_every_named_package() -> None:
    build, _final = dockerfile_stages()[0], dockerfile_stages()[-1]
    copied = {line.split()[0] for line in instruction(build, "COPY") if not line.startswith("--")}
    for command in named_commands():
        package = command[0].split(".")[0]
        assert (REPO_ROOT / package / "__init__.py").exists(), f"{package} is not a package in the repository"
        assert package in copied, f"the Dockerfile does not COPY {package}/ but `python -m {' '.join(command)}` runs it"
        assert _dockerignore_allows(package), f".dockerignore excludes {package}/"
    assert _dockerignore_allows("requirements.txt")


def test_final_stage_is_non_root_and_has_no_build_tools() -> None:
    stages = dockerfile_stages()
    assert len(stages) >= 2, "multi-stage build expected"
    final = stages[-1]
    (user,) = instruction(final, "USER")
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric non-root USER (runAsNonRoot can only verify a numeric uid)"
    assert not instruction(final, "RUN"), "the final stage installs nothing: no compilers, no package manager runs"
    assert all(line.startswith("--from=") for line in instruction(final, "COPY")), (
        "final stage copies only built artefacts"
    )
    assert re.search(r"python:3\.11-slim", DOCKERFILE.read_text()), "python:3.11-slim base expected"


def _builder() -> str | None:
    return next((b for b in ("docker", "podman", "buildah") if shutil.which(b)), None)


@pytest.mark.timeout(1800)
def test_image_builds() -> None:
    builder = _builder()
    if os.environ.get("NOCTAYA_BUILD_IMAGE") != "1":
        pytest.skip("image build is opt-in: set NOCTAYA_BUILD_IMAGE=1 where a builder can pull python:3.11-slim")
    if builder is None:
        pytest.skip("NOCTAYA_BUILD_IMAGE=1 but no docker, podman or buildah on PATH")
    argv = [builder, "bud" if builder == "buildah" else "build", "-t", "noctaya:test", str(REPO_ROOT)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1700, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    if builder != "buildah":
        for command in named_commands():
            run = subprocess.run(
                [builder, "run", "--rm", "noctaya:test", *command, "--help"],
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            assert run.returncode == 0, f"{' '.join(command)} --help in the image: {run.stderr}"
