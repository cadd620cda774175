"""Reading the repository's manifests: which files to apply, and how (no API server needed)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.kube.apiserver import REPO_ROOT

EXAMPLES_DIR = REPO_ROOT / "examples"
METACONTROLLER_DIR = REPO_ROOT / "metacontroller"
YAML_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True)
class ApplyUnit:
    """One `kubectl apply` of the examples: a kustomization directory or a single YAML file."""

    path: Path
    kustomization: bool

    @property
    def label(self) -> str:
        return str(self.path.relative_to(REPO_ROOT))

    def kubectl_args(self) -> list[str]:
        return ["-k", str(self.path)] if self.kustomization else ["-f", str(self.path)]


def load_documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def example_units() -> list[ApplyUnit]:
    """Every example, once: a directory with a kustomization.yaml is applied with -k as a whole
    (its files are its resources); any other YAML file on its own."""
    units: list[ApplyUnit] = []
    kustomized: list[Path] = []
    for kfile in sorted(EXAMPLES_DIR.rglob("kustomization.yaml")):
        kustomized.append(kfile.parent)
        units.append(ApplyUnit(kfile.parent, kustomization=True))
    for path in sorted(EXAMPLES_DIR.rglob("*")):
        if path.suffix not in YAML_SUFFIXES or any(k in path.parents for k in kustomized):
            continue
        units.append(ApplyUnit(path, kustomization=False))
    return units


def has_explicit_namespace(unit: ApplyUnit) -> bool:
    """kubectl refuses `-n X` for an object that names another namespace."""
    if unit.kustomization:
        return False
    return any(doc.get("metadata", {}).get("namespace") for doc in load_documents(unit.path))


def example_documents(kind: str) -> list[tuple[Path, dict[str, Any]]]:
    found = []
    for path in sorted(EXAMPLES_DIR.rglob("*")):
        if path.suffix in YAML_SUFFIXES and path.name != "kustomization.yaml":
            found += [(path, d) for d in load_documents(path) if d.get("kind") == kind]
    return found
