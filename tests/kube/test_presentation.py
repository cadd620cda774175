"""What a user sees with kubectl: `explain` descriptions and `get` printer columns."""

from __future__ import annotations

import json
import re
import time

import pytest
from pydantic import BaseModel

from hooks.api import InferenceRuntimeSpec, LLMServiceSpec
from hooks.api.llmservice import Scaling
from tests.kube.apiserver import ControlPlane

pytestmark = pytest.mark.timeout(180, func_only=True)

NAMESPACE = "presentation"
OPENAPI_DEADLINE_SECONDS = 60


def _words(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def explain(kube: ControlPlane, path: str) -> str:
    """`kubectl explain`, retried while the API server is still publishing a new CRD's OpenAPI."""
    deadline = time.monotonic() + OPENAPI_DEADLINE_SECONDS
    while True:
        out = kube.kubectl("explain", path, check=False)
        if out.returncode == 0:
            return out.stdout
        if time.monotonic() > deadline:
            raise AssertionError(f"kubectl explain {path} kept failing: {out.stderr}")
        time.sleep(0.5)


def columns(header: str, row: str) -> dict[str, str]:
    """A kubectl table row by column: kubectl aligns cells under their headers (empty cells stay blank)."""
    starts = [m.start() for m in re.finditer(r"\S+(?: \S+)*", header)]  # "LAST COLD START" is one header
    bounds = [*starts[1:], None]
    return {header[a:b].strip(): row[a:b].strip() for a, b in zip(starts, bounds, strict=True)}


def top_level_fields(model: type[BaseModel]) -> list[tuple[str, str]]:
    """(wire name, description) of each field of a spec model."""
    return [(field.alias or name, field.description or "") for name, field in model.model_fields.items()]


def test_explain_llmservice_describes_the_kind(kube: ControlPlane, noctaya_crds: list[str]) -> None:
    out = _words(explain(kube, "llmservice"))
    assert "KIND: LLMService" in out
    assert "VERSION: v1alpha1" in out
    assert "declares one served model" in out


@pytest.mark.parametrize(
    "resource,model,field,description",
    [("llmservice", LLMServiceSpec, *f) for f in top_level_fields(LLMServiceSpec)]
    + [("inferenceruntime", InferenceRuntimeSpec, *f) for f in top_level_fields(InferenceRuntimeSpec)],
    ids=lambda v: v if isinstance(v, str) and " " not in v else None,
)
def test_explain_prints_the_model_description_of_every_spec_field(
    kube: ControlPlane, noctaya_crds: list[str], resource: str, model: type[BaseModel], field: str, description: str
) -> None:
    assert description, f"{model.__name__}.{field} has no description for kubectl explain"
    out = _words(explain(kube, f"{resource}.spec.{field}"))
    assert f"FIELD: {field}" in out
    assert _words(description) in out, f"kubectl explain {resource}.spec.{field}:\n{out}"


def test_explain_scaling_lists_its_fields_with_descriptions(kube: ControlPlane, noctaya_crds: list[str]) -> None:
    out = _words(explain(kube, "llmservice.spec.scaling"))
    for field, description in top_level_fields(Scaling):
        assert re.search(rf"\b{field} <", out), f"{field} missing from kubectl explain llmservice.spec.scaling"
        assert _words(description) in out, f"description of scaling.{field} missing"


def test_explain_shows_enum_values(kube: ControlPlane, noctaya_crds: list[str]) -> None:
    out = explain(kube, "llmservice.spec.cache.strategy")
    enum = out.split("ENUM:", 1)[1].split("DESCRIPTION:", 1)[0].split()
    assert enum == ["NodeLocalPVC", "SharedPVC", "HostPath", "None", "BakedImage"]


def test_get_llmservice_shows_printer_columns(kube: ControlPlane, noctaya_crds: list[str]) -> None:
    kube.kubectl("create", "namespace", NAMESPACE)
    svc = {
        "apiVersion": "serving.noctaya.io/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": "qwen", "namespace": NAMESPACE},
        "spec": {"model": {"source": "hf://Qwen/Qwen2.5-0.5B-Instruct"}, "runtime": {"name": "vllm-nvidia"}},
    }
    kube.kubectl("apply", "--server-side", "-f", "-", stdin=json.dumps(svc))
    # The status a sync hook writes (through the status subresource, as Metacontroller does).
    status = {
        "status": {
            "observedGeneration": 1,
            "runtime": "vllm-nvidia",
            "endpoint": f"http://qwen-gateway.{NAMESPACE}.svc.cluster.local/v1",
            "replicas": 0,
            "readyReplicas": 0,
            "phase": "ScaledToZero",
            "phaseSince": "2026-01-01T00:00:00Z",
            "lastColdStart": {"pod": "qwen-backend-1", "startedAt": "2025-12-31T23:50:00Z",
                              "readyAt": "2025-12-31T23:51:23Z", "scheduling": "2s", "initialization": "1s",
                              "weightsWait": "0s", "imagePull": "30s", "modelLoad": "50s", "total": "83s"},
            "conditions": [
                {
                    "type": "Ready",
                    "status": "False",
                    "reason": "ScaledToZero",
                    "message": "idle",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                }
            ],
        }
    }
    kube.kubectl(
        "patch", "-n", NAMESPACE, "llmservice", "qwen", "--subresource=status", "--type=merge", "-p", json.dumps(status)
    )
    header, row = kube.kubectl("get", "-n", NAMESPACE, "llmservice", "qwen").stdout.splitlines()
    cells = columns(header, row)
    assert list(cells) == ["NAME", "RUNTIME", "REPLICAS", "READY", "PHASE", "SINCE", "LAST COLD START", "AGE"]
    assert cells == {
        "NAME": "qwen",
        "RUNTIME": "vllm-nvidia",
        "REPLICAS": "0",
        "READY": "False",
        "PHASE": "ScaledToZero",
        "SINCE": cells["SINCE"],
        "LAST COLD START": "83s",
        "AGE": cells["AGE"],
    }
    assert cells["AGE"] and re.fullmatch(r"\d+[smhdy]\S*", cells["SINCE"]), cells  # a timestamp shown as an age
    header, row = kube.kubectl("get", "-n", NAMESPACE, "llmservice", "qwen", "-o", "wide").stdout.splitlines()
    assert columns(header, row)["ENDPOINT"] == f"http://qwen-gateway.{NAMESPACE}.svc.cluster.local/v1"
    # The short name works too.
    assert kube.kubectl("get", "-n", NAMESPACE, "llm", "-o", "name").stdout.strip() == (
        "llmservice.serving.noctaya.io/qwen"
    )


def test_get_inferenceruntime_shows_printer_columns(kube: ControlPlane, noctaya_crds: list[str]) -> None:
    runtime = {
        "apiVersion": "serving.noctaya.io/v1alpha1",
        "kind": "InferenceRuntime",
        "metadata": {"name": "presentation-vllm"},
        "spec": {"engine": "vllm", "image": "vllm/vllm-openai:v0.11.0", "priority": 7},
    }
    kube.kubectl("apply", "--server-side", "-f", "-", stdin=json.dumps(runtime))
    header, row = kube.kubectl("get", "inferenceruntime", "presentation-vllm").stdout.splitlines()
    assert header.split() == ["NAME", "ENGINE", "VENDOR", "PRIORITY", "ACCEPTED", "AGE"]
    cells = columns(header, row)
    # vendor defaults to nvidia on the server (a structural-schema default); nothing accepted it yet.
    assert cells == {
        "NAME": "presentation-vllm",
        "ENGINE": "vllm",
        "VENDOR": "nvidia",
        "PRIORITY": "7",
        "ACCEPTED": "",
        "AGE": cells["AGE"],
    }
    assert cells["AGE"]
