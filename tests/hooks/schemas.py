"""Two independent checks that rendered objects are what the API server would accept.

- `k8s_problems`: walks an object against the kubernetes client's generated models (every field
  name must exist in the Kubernetes API with the right JSON type) — catches misspelt fields.
- `openapi_problems`: a structural walk over a CRD's openAPIV3Schema (types, properties,
  required, enums, minimums) — used against KEDA's published ScaledObject CRD.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes.client as k8s
import yaml

from tests.third_party import keda_scaledobject_crd

KINDS = {
    ("apps/v1", "Deployment"): "V1Deployment",
    ("v1", "Service"): "V1Service",
    ("v1", "Secret"): "V1Secret",
    ("v1", "PersistentVolumeClaim"): "V1PersistentVolumeClaim",
    ("policy/v1", "PodDisruptionBudget"): "V1PodDisruptionBudget",
    ("batch/v1", "Job"): "V1Job",
    ("v1", "ConfigMap"): "V1ConfigMap",  # an LLMGateway's routing table
    ("v1", "ServiceAccount"): "V1ServiceAccount",  # a gateway's identity
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "V1RoleBinding",
}
_PRIMITIVES = {"str": str, "int": int, "bool": bool, "float": (int, float), "bytes": str, "datetime": str}


def k8s_problems(obj: Any, type_name: str, path: str = "") -> list[str]:
    problems: list[str] = []
    if type_name == "object":  # int-or-string and free-form
        return problems
    if type_name in _PRIMITIVES:
        want = _PRIMITIVES[type_name]
        if not isinstance(obj, want) or (type_name == "int" and isinstance(obj, bool)):
            problems.append(f"{path}: expected {type_name}, got {type(obj).__name__}")
        return problems
    if type_name.lower().startswith("list["):
        if not isinstance(obj, list):
            return [f"{path}: expected a list"]
        inner = type_name[5:-1]
        for i, item in enumerate(obj):
            problems += k8s_problems(item, inner, f"{path}[{i}]")
        return problems
    if type_name.startswith(("dict(", "Dict[")):
        if not isinstance(obj, dict):
            return [f"{path}: expected a map"]
        inner = type_name.split(", ", 1)[1][:-1]
        for key, value in obj.items():
            problems += k8s_problems(value, inner, f"{path}.{key}")
        return problems
    model = getattr(k8s, type_name)
    if not isinstance(obj, dict):
        return [f"{path}: expected an object ({type_name})"]
    by_json = {json_key: model.openapi_types[attr] for attr, json_key in model.attribute_map.items()}
    for key, value in obj.items():
        if key not in by_json:
            problems.append(f"{path}.{key}: unknown field of {type_name}")
            continue
        problems += k8s_problems(value, by_json[key], f"{path}.{key}")
    return problems


def child_problems(obj: dict[str, Any]) -> list[str]:
    type_name = KINDS.get((obj.get("apiVersion"), obj.get("kind")))
    if type_name is None:
        return [f"unexpected child kind {obj.get('apiVersion')}/{obj.get('kind')}"]
    return k8s_problems(obj, type_name, obj["kind"])


def load_crd_schema(path: Path | None = None) -> dict[str, Any]:
    """KEDA's published ScaledObject schema (from its Go module at the pinned version) by default."""
    crd = yaml.safe_load((path or keda_scaledobject_crd()).read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "integer": int, "number": (int, float)}


def openapi_problems(obj: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    problems: list[str] = []
    if schema.get("x-kubernetes-int-or-string"):
        if not isinstance(obj, int | str):
            problems.append(f"{path}: expected int or string")
        return problems
    t = schema.get("type")
    if t:
        ok = isinstance(obj, _TYPES[t]) and not (t in ("integer", "number") and isinstance(obj, bool))
        if not ok:
            return [f"{path}: expected {t}, got {type(obj).__name__}"]
    if "enum" in schema and obj not in schema["enum"]:
        problems.append(f"{path}: {obj!r} not in {schema['enum']}")
    if "minimum" in schema and isinstance(obj, int | float) and obj < schema["minimum"]:
        problems.append(f"{path}: {obj} < minimum {schema['minimum']}")
    if "maximum" in schema and isinstance(obj, int | float) and obj > schema["maximum"]:
        problems.append(f"{path}: {obj} > maximum {schema['maximum']}")
    if "minLength" in schema and isinstance(obj, str) and len(obj) < schema["minLength"]:
        problems.append(f"{path}: shorter than {schema['minLength']}")
    if "pattern" in schema and isinstance(obj, str) and not re.search(schema["pattern"], obj):
        problems.append(f"{path}: does not match {schema['pattern']}")
    if isinstance(obj, list):
        if "minItems" in schema and len(obj) < schema["minItems"]:
            problems.append(f"{path}: fewer than {schema['minItems']} items")
        for i, item in enumerate(obj):
            problems += openapi_problems(item, schema.get("items", {}), f"{path}[{i}]")
    if isinstance(obj, dict):
        for req in schema.get("required", []):
            if req not in obj:
                problems.append(f"{path}: missing required {req}")
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, value in obj.items():
            if props is not None and key in props:
                problems += openapi_problems(value, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                problems += openapi_problems(value, extra, f"{path}.{key}")
            elif props is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
                problems.append(f"{path}.{key}: unknown field (the API server would prune it)")
    return problems
