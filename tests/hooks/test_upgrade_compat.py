"""This checkout against the release users run today (tests/previous_release.py).

- Pod templates: the previous release's own hooks answer its own golden requests; those answers are
  the world an upgrade finds (children applied, warm or at zero). This release's hooks then must never
  hand a warm model a different template without UpgradePending=True (its Pods would restart and
  reload), and must apply it at zero.
- Stored objects: every LLMService, InferenceRuntime, LLMGateway and AcceleratorPool of the previous
  release's examples and fixtures still parses with this release's models (the hooks), and the CRD
  changes between the two releases are only the loosenings, or the tightenings docs/upgrading.md lists
  with their migration.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from hooks.api.llmgateway import LLMGateway
from hooks.api.llmservice import LLMService
from hooks.api.pool import AcceleratorPool
from hooks.api.runtime import InferenceRuntime
from hooks.config import DEFAULT_IMAGE, HookConfig
from hooks.controller import sync
from tests.hooks import helpers as h
from tests.previous_release import PREVIOUS

REPO = Path(__file__).resolve().parents[2]
LAST_APPLIED = "metacontroller.k8s.io/last-applied-configuration"

# Runs inside the previous release's tree, with its own code and test helpers: its golden requests
# and its own answers to them.
_OLD_ANSWERS = """
import json, pathlib, sys
from tests.hooks import helpers as h
from tests.hooks.golden_cases import HOOKS
out = {}
for folder in sorted(pathlib.Path("tests/fixtures/hooks").iterdir()):
    if not (folder / "hook").exists():
        continue
    hook = (folder / "hook").read_text().strip()
    request = json.loads((folder / "request.json").read_text())
    out[folder.name] = {"hook": hook, "request": request, "answer": HOOKS[hook](request, h.config(h.LATER_TIME))}
json.dump(out, sys.stdout)
"""


@pytest.fixture(scope="module")
def old_answers(old_tree: Path) -> dict[str, dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(old_tree), "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run([sys.executable, "-c", _OLD_ANSWERS], cwd=old_tree, env=env, capture_output=True,
                         timeout=240, check=False)
    assert out.returncode == 0, f"release {PREVIOUS.version}'s hooks failed on its own golden requests:\n" \
                                f"{out.stderr.decode(errors='replace')[-3000:]}"
    return json.loads(out.stdout)


def this_release() -> HookConfig:
    """This release's hooks as installed: its own image, the suite's fixed key and clock."""
    base = h.config(h.LATER_TIME)
    return HookConfig(image=DEFAULT_IMAGE, token_key=base.token_key, clock=base.clock)


def _applied(child: dict[str, Any], replicas: int) -> dict[str, Any]:
    """A child as the API server holds it after Metacontroller applied the previous release's answer,
    a Deployment settled at `replicas` (the backend: KEDA's count)."""
    live = h.as_observed(child)
    live["metadata"]["annotations"][LAST_APPLIED] = json.dumps(child, sort_keys=True)
    if child["kind"] == "Deployment":
        live["spec"]["replicas"] = replicas if child["metadata"]["labels"].get("serving.noctaya.io/component") == "backend" \
            else child["spec"].get("replicas", 1)
        live["status"] = {"observedGeneration": 1, "replicas": live["spec"]["replicas"],
                          "readyReplicas": live["spec"]["replicas"]}
    return live


def upgraded_world(case: dict[str, Any], replicas: int) -> dict[str, Any]:
    """The request this release's sync gets right after the upgrade: the previous release's answer
    applied (children, status), everything else as the previous release saw it."""
    request = copy.deepcopy(case["request"])
    answer = case["answer"]
    request["parent"]["status"] = answer["status"]
    groups: dict[str, dict[str, Any]] = {g: {} for g in request.get("children", {})}
    for child in answer["children"]:
        group = f"{child['kind']}.{child['apiVersion']}"
        namespace = child["metadata"].get("namespace") or request["parent"]["metadata"].get("namespace", h.NAMESPACE)
        groups.setdefault(group, {})[f"{namespace}/{child['metadata']['name']}"] = _applied(child, replicas)
    request["children"] = groups
    return request


def _deployments(answer: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["metadata"]["name"]: c for c in answer["children"] if c["kind"] == "Deployment"}


def _condition(answer: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    return next((c for c in answer["status"].get("conditions", []) if c["type"] == ctype), None)


def _sync_cases(old_answers: dict[str, dict[str, Any]]) -> list[str]:
    return [name for name, case in old_answers.items() if case["hook"] == "sync" and not case["request"].get("finalizing")]


def test_a_warm_model_never_gets_another_template_without_upgrade_pending(old_answers: dict[str, dict[str, Any]]) -> None:
    """Must-show 2 of issue 28: for an unchanged user object, a template that differs between the
    previous release and this one reaches a warm model only through UpgradePending."""
    cases = _sync_cases(old_answers)
    assert len(cases) >= 15, f"too few of release {PREVIOUS.version}'s golden sync cases: {cases}"
    pending = 0
    for name in cases:
        case = old_answers[name]
        before = _deployments(case["answer"])
        if not any(d["metadata"]["labels"].get("serving.noctaya.io/component") == "backend" for d in before.values()):
            continue  # no backend (KEDA missing, weights not staged yet): nothing is warm to keep
        warm = sync.sync(upgraded_world(case, replicas=1), this_release())
        cold = sync.sync(upgraded_world(case, replicas=0), this_release())
        for deployment, new in _deployments(warm).items():
            if deployment not in before:
                continue
            old_template = before[deployment]["spec"]["template"]
            would_be = _deployments(cold)[deployment]["spec"]["template"]
            assert new["spec"]["template"] == old_template, (
                f"{name}: the warm {deployment} would restart: its template changed on upgrade")
            if would_be != old_template:
                cond = _condition(warm, "UpgradePending")
                assert cond is not None and cond["status"] == "True", f"{name}: {deployment} held without saying so"
                assert deployment in warm["status"]["pendingUpgrade"]["deployments"], name
                pending += 1
        cold_cond = _condition(cold, "UpgradePending")
        if cold_cond is not None and cold["children"] and _deployments(cold):
            # At zero the new templates apply at once (nothing restarts).
            backend = [d for d in _deployments(cold).values()
                       if d["metadata"]["labels"].get("serving.noctaya.io/component") == "backend"]
            if backend:
                assert cold_cond["status"] == "False", f"{name}: at zero nothing should wait: {cold_cond}"
    # The previous release's gateways run another image: at least those wait on warm models.
    assert pending > 0


def test_the_upgraded_world_settles_after_one_answer(old_answers: dict[str, dict[str, Any]]) -> None:
    """The answer for the world right after the upgrade, once applied, is answered again with the
    same children and status: held templates stay held, and nothing rewrites status in a loop."""
    for name in _sync_cases(old_answers):
        request = upgraded_world(old_answers[name], replicas=1)
        first = sync.sync(copy.deepcopy(request), this_release())
        settled = copy.deepcopy(request)
        settled["parent"]["status"] = first["status"]
        for child in first["children"]:
            group = settled["children"].setdefault(f"{child['kind']}.{child['apiVersion']}", {})
            key = next((k for k, v in group.items() if v["metadata"]["name"] == child["metadata"]["name"]), None)
            replicas = child["spec"].get("replicas", 1) if child["kind"] == "Deployment" else 1
            group[key or f"{h.NAMESPACE}/{child['metadata']['name']}"] = _applied(child, replicas)
        second = sync.sync(copy.deepcopy(settled), this_release())
        assert second["children"] == first["children"], name
        assert second["status"] == first["status"], name


# --- stored objects ---------------------------------------------------------------------------------

MODELS = {"LLMService": LLMService, "InferenceRuntime": InferenceRuntime, "LLMGateway": LLMGateway,
          "AcceleratorPool": AcceleratorPool}


def stored_objects(tree: Path) -> list[tuple[str, dict[str, Any]]]:
    """Every Noctaya object of a release's examples and hook fixtures: what its users have stored."""
    found: list[tuple[str, dict[str, Any]]] = []
    for path in sorted((tree / "examples").rglob("*.yaml")) + sorted((tree / "tests" / "fixtures").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if isinstance(doc, dict) and doc.get("kind") in MODELS and str(doc.get("apiVersion", "")).startswith("serving.noctaya.io/"):
                found.append((f"{path.relative_to(tree)}:{doc['metadata']['name']}", doc))
    for path in sorted((tree / "tests" / "fixtures" / "hooks").glob("*/request.json")):
        request = json.loads(path.read_text())
        for obj in [request.get("parent"), request.get("object"),
                    *[o for g in (request.get("related") or {}).values() for o in g.values()]]:
            if isinstance(obj, dict) and obj.get("kind") in MODELS:
                found.append((f"{path.relative_to(tree)}:{obj['kind']}/{obj['metadata']['name']}", obj))
    return found


def test_every_object_the_previous_release_stored_still_parses(old_tree: Path, old_answers: dict[str, dict[str, Any]]) -> None:
    # Its golden cases include objects it refused (InvalidSpec, or a runtime not Accepted): not stored.
    refused_then = {f"tests/fixtures/hooks/{name}/request.json" for name, case in old_answers.items()
                    if any(c.get("reason") == "InvalidSpec" or (c.get("type") == "Accepted" and c.get("status") == "False")
                           for c in ((case["answer"].get("status") or {}).get("conditions") or []))}
    corpus = [(where, doc) for where, doc in stored_objects(old_tree) if where.split(":")[0] not in refused_then]
    assert len(corpus) >= 30, len(corpus)
    refused = []
    for where, doc in corpus:
        try:
            MODELS[doc["kind"]].model_validate({k: v for k, v in doc.items() if k != "status"})
        except Exception as exc:  # noqa: BLE001 - every refusal is reported below
            refused.append(f"{where}: {exc}")
    assert refused == [], "objects release " + PREVIOUS.version + " accepted are refused now:\n" + "\n".join(refused)


# --- CRD schema changes ------------------------------------------------------------------------------


def _walk(old: Any, new: Any, path: str, out: list[str]) -> None:
    """Record every way `new` accepts less than `old` at `path` (structural schema nodes)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return
    if old.get("type") != new.get("type") and "type" in old:
        out.append(f"{path}: type {old.get('type')} -> {new.get('type')}")
    if new.get("pattern") and new.get("pattern") != old.get("pattern"):
        out.append(f"{path}: pattern changed")  # whether it accepts less is for a person to judge
    if "enum" in new and set(old.get("enum", new["enum"])) - set(new["enum"]):
        out.append(f"{path}: enum loses {sorted(set(old['enum']) - set(new['enum']))}")
    if "enum" in new and "enum" not in old:
        out.append(f"{path}: enum added")
    for key in ("maxLength", "maxItems", "maxProperties", "maximum"):
        if key in new and (key not in old or new[key] < old[key]):
            out.append(f"{path}: {key} {old.get(key)} -> {new[key]}")
    for key in ("minLength", "minItems", "minProperties", "minimum"):
        if key in new and (key not in old or new[key] > old[key]):
            out.append(f"{path}: {key} {old.get(key)} -> {new[key]}")
    for field in set(new.get("required", [])) - set(old.get("required", [])):
        if "default" not in (new.get("properties") or {}).get(field, {}):
            out.append(f"{path}: {field} required")
    old_rules = {r["rule"] for r in old.get("x-kubernetes-validations", [])}
    for rule in new.get("x-kubernetes-validations", []):
        if rule["rule"] not in old_rules and "oldSelf" not in rule["rule"]:
            out.append(f"{path}: rule {rule['message']!r}")
    for name in set(old.get("properties", {})) - set(new.get("properties", {})):
        out.append(f"{path}.{name}: removed (stored values would be pruned)")
    for name, sub in (new.get("properties") or {}).items():
        _walk((old.get("properties") or {}).get(name), sub, f"{path}.{name}", out)
    _walk(old.get("items"), new.get("items"), f"{path}[]", out)
    if isinstance(new.get("additionalProperties"), dict):
        _walk(old.get("additionalProperties"), new["additionalProperties"], f"{path}{{}}", out)


def _new_defaults(old: Any, new: Any, path: str, out: list[str]) -> None:
    """Record every property `new` adds with a schema default where `old` had the object: the API
    server would put it into every stored object, which the previous release's hook server (still
    answering while the upgrade rolls) does not know."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return
    for name, sub in (new.get("properties") or {}).items():
        before = (old.get("properties") or {}).get(name)
        if before is None and isinstance(sub, dict) and "default" in sub:
            out.append(f"{path}.{name}: added with a default")
        _new_defaults(before, sub, f"{path}.{name}", out)
    _new_defaults(old.get("items"), new.get("items"), f"{path}[]", out)


def crd_changes(old_dir: Path, new_dir: Path, walk: Any) -> list[str]:
    out: list[str] = []
    for new_file in sorted(new_dir.glob("serving.noctaya.io_*.yaml")):
        old_file = old_dir / new_file.name
        if not old_file.exists():
            continue  # a new CRD holds nothing stored
        old, new = yaml.safe_load(old_file.read_text()), yaml.safe_load(new_file.read_text())
        kind = new["spec"]["names"]["kind"]
        old_versions = {v["name"]: v for v in old["spec"]["versions"]}
        for version in new["spec"]["versions"]:
            before = old_versions.get(version["name"])
            if before is None:
                continue
            walk(before["schema"]["openAPIV3Schema"], version["schema"]["openAPIV3Schema"], kind, out)
    return sorted(out)


def crd_tightenings(old_dir: Path, new_dir: Path) -> list[str]:
    return crd_changes(old_dir, new_dir, _walk)


def documented_tightenings() -> list[str]:
    """The tightenings docs/upgrading.md lists for this release (the lines of its `tightenings` block)."""
    text = (REPO / "docs" / "upgrading.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- tightenings -->\n```text\n(.*?)```", text, re.S)
    assert block is not None, "docs/upgrading.md has no tightenings block"
    return sorted(line for line in block.group(1).splitlines() if line.strip())


def test_crd_tightenings_since_the_previous_release_are_the_documented_ones(old_tree: Path) -> None:
    found = crd_tightenings(old_tree / "crds", REPO / "crds")
    assert found == documented_tightenings(), (
        "a CRD now refuses something release " + PREVIOUS.version + " accepted: loosen it, write it as a transition "
        "rule (oldSelf), or list it with its migration in docs/upgrading.md:\n" + "\n".join(found))


def test_fields_added_since_the_previous_release_carry_no_schema_default(old_tree: Path) -> None:
    """While an upgrade rolls, the previous release's hook server still answers (the hook server's
    Deployment rolls after the CRDs change). A new field with a schema default would appear in every
    stored object it reads, and its models refuse fields they do not know: every model would be
    InvalidSpec until the new hook server answers (seen in tests/e2e/test_upgrade.py). Absent must
    mean the default instead."""
    assert crd_changes(old_tree / "crds", REPO / "crds", _new_defaults) == []


def test_the_tightening_check_can_see_a_tightening(tmp_path: Path, old_tree: Path) -> None:
    """The checker itself: a pattern, a lower maxLength, a new rule and a removed field all count."""
    new = tmp_path / "crds"
    new.mkdir()
    name = "serving.noctaya.io_inferenceruntimes.yaml"
    doc = yaml.safe_load((old_tree / "crds" / name).read_text())
    spec = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["image"]["maxLength"] = 8
    spec["properties"]["engine"]["enum"] = spec["properties"]["engine"]["enum"][:2]
    spec.setdefault("x-kubernetes-validations", []).append({"rule": "self.port > 1024", "message": "high ports"})
    del spec["properties"]["shmSize"]
    spec["properties"]["brandNew"] = {"type": "object", "default": {"on": True}}
    (new / name).write_text(yaml.safe_dump(doc))
    assert crd_changes(old_tree / "crds", new, _new_defaults) == ["InferenceRuntime.spec.brandNew: added with a default"]
    found = crd_tightenings(old_tree / "crds", new)
    assert any("image: maxLength" in f for f in found) and any("enum loses" in f for f in found)
    assert any("'high ports'" in f for f in found) and any("shmSize: removed" in f for f in found)
