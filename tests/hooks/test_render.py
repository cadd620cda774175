"""`hooks.render.render_documents`: offline rendering of LLMService + InferenceRuntime YAML."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import yaml

from hooks.render import RenderError, render_documents
from tests.hooks import helpers as h
from tests.hooks import schemas

FOLDER = Path(__file__).resolve().parents[1] / "fixtures" / "hooks" / "render"
FILES = ("runtimes.yaml", "models.yaml")


def _documents() -> tuple[list[dict], list[str]]:
    docs, sources = [], []
    for name in FILES:
        for doc in yaml.safe_load_all((FOLDER / name).read_text()):
            if doc:
                docs.append(doc)
                sources.append(name)
    return docs, sources


def test_render_matches_golden_and_is_stable() -> None:
    docs, sources = _documents()
    rendered = render_documents(docs, h.config(), sources)
    expected_path = FOLDER / "expected.yaml"
    text = yaml.safe_dump_all(rendered, sort_keys=False, explicit_start=True)
    if os.environ.get("NOCTAYA_UPDATE_GOLDEN") == "1":
        expected_path.write_text(text)
    assert text == expected_path.read_text()
    assert json.dumps(render_documents(copy.deepcopy(docs), h.config())) == json.dumps(rendered)


def test_render_output_is_complete_and_valid() -> None:
    docs, _ = _documents()
    rendered = render_documents(docs, h.config())
    by_service: dict[str, list[str]] = {}
    for obj in rendered:
        by_service.setdefault(obj["metadata"]["labels"]["serving.noctaya.io/llmservice"], []).append(f"{obj['kind']}/{obj['metadata']['name']}")
        if obj["kind"] == "ScaledObject":
            assert schemas.openapi_problems(obj, schemas.load_crd_schema()) == []
        else:
            assert schemas.child_problems(obj) == []
    assert by_service["qwen"][-1] == "ScaledObject/qwen-backend"
    assert "PodDisruptionBudget/qwen-gateway" in by_service["qwen"] and "Secret/qwen-scaler-token" in by_service["qwen"]
    assert "Deployment/tiny-llama-backend" in by_service["tiny-llama"]
    tiny = next(o for o in rendered if o["metadata"]["name"] == "tiny-llama-backend" and o["kind"] == "Deployment")
    assert tiny["metadata"]["namespace"] == "default"
    limits = tiny["spec"]["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {})
    assert not any("/" in name for name in limits)  # CPU only: no extended resource requested


def test_render_ignores_other_kinds_and_runtimes_alone_render_nothing() -> None:
    docs, _ = _documents()
    assert render_documents([d for d in docs if d["kind"] != "LLMService"], h.config()) == []


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda docs: docs[2]["spec"]["scaling"].update(min=5, max=2), "LLMService models/qwen is invalid: spec.scaling: scaling.min must not exceed scaling.max"),
        (lambda docs: docs[4]["spec"]["runtime"].update(name="missing-rt"), "InferenceRuntime missing-rt does not exist (add its InferenceRuntime file"),
        (lambda docs: docs[0]["spec"].update(port=0), "InferenceRuntime vllm-nvidia is invalid: spec.port"),
        (lambda docs: docs.append(copy.deepcopy(docs[1])), "InferenceRuntime llamacpp-cpu is given twice"),
        (lambda docs: docs[2]["spec"]["model"].update(source="s3://bucket/x"), "spec.model.source"),
        (lambda docs: docs[2].pop("metadata"), "LLMService (document 3 has no metadata.name)"),
    ],
    ids=["bad-scaling", "missing-runtime", "bad-runtime", "duplicate-runtime", "bad-source", "no-metadata"],
)
def test_render_errors_name_the_object_and_field(mutate, needle: str) -> None:
    docs, _ = _documents()
    mutate(docs)
    with pytest.raises(RenderError) as err:
        render_documents(docs, h.config())
    assert needle in str(err.value)


def test_render_errors_name_the_file_when_given() -> None:
    docs, sources = _documents()
    docs[2]["spec"]["endpoint"]["replicas"] = 0
    with pytest.raises(RenderError, match=r"^models.yaml: LLMService models/qwen is invalid: spec.endpoint.replicas"):
        render_documents(docs, h.config(), sources)


def test_render_ambiguous_selector_is_an_error() -> None:
    docs, _ = _documents()
    twin = copy.deepcopy(docs[0])
    twin["metadata"]["name"] = "vllm-twin"
    docs.insert(1, twin)
    with pytest.raises(RenderError, match="same priority 10"):
        render_documents(docs, h.config())


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.skipif(not (EXAMPLES / "models").is_dir(), reason="examples/ not present")
def test_render_the_examples() -> None:
    docs: list[dict] = []
    for folder in ("runtimes", "models", "gateways"):
        for path in sorted((EXAMPLES / folder).glob("*.yaml")):
            docs.extend(d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict))
    rendered = render_documents(docs, h.config())
    services = [d for d in docs if d.get("kind") == "LLMService"]
    assert len([o for o in rendered if o["kind"] == "ScaledObject"]) == len(services)
    # Each LLMGateway: its Deployment and a routing table with every member of the example.
    for gateway in (d for d in docs if d.get("kind") == "LLMGateway"):
        (table,) = [o for o in rendered if o["kind"] == "ConfigMap" and o["metadata"]["name"] == f"{gateway['metadata']['name']}-llmgwroutes"]
        members = [s for s in services if s["spec"].get("endpoint", {}).get("gateway") == gateway["metadata"]["name"]]
        assert len(json.loads(table["data"]["models.json"])["models"]) == len(members) >= 3
    for obj in rendered:
        problems = schemas.openapi_problems(obj, schemas.load_crd_schema()) if obj["kind"] == "ScaledObject" else schemas.child_problems(obj)
        assert problems == [], (obj["kind"], obj["metadata"]["name"])
