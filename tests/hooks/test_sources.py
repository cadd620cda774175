"""One grammar for model sources (issue #20, item 8): every source the generated CRD's rules admit is
accepted by the API models, rendered by the sync hook (Job, marker wait and backend) without an
exception, and names a cache directory inside the cache for the prewarm Job; what one of them
refuses, all of them refuse.

The sources are drawn from the regular expressions *as they stand in crds/* (the CEL string literals,
unescaped), so a CRD that drifted from `prewarm.sources` would be tested as the API server has it."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hooks.api import LLMService
from hooks.controller import sync
from prewarm import sources
from prewarm.layout import LayoutError, ModelDir
from tests.hooks import helpers as h

celpy = pytest.importorskip("celpy")

CRD = Path(__file__).resolve().parents[2] / "crds" / "serving.noctaya.io_llmservices.yaml"
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def _model_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["model"]


MODEL_SCHEMA = _model_schema()
RULES = MODEL_SCHEMA["x-kubernetes-validations"]


def _cel_literal(rule: str, prefix: str) -> str:
    """The regex of the rule for ``prefix``, unescaped from its CEL string literal."""
    for r in RULES:
        if f"startsWith('{prefix}')" in r["rule"] and ".matches(" in r["rule"]:
            literal = re.search(r"\.matches\('((?:[^'\\]|\\.)*)'\)", r["rule"])
            assert literal is not None
            return re.sub(r"\\(.)", r"\1", literal.group(1))
    raise AssertionError(f"no rule for {prefix}")


CRD_REGEX = {scheme: _cel_literal("", prefix) for scheme, prefix in
             (("hub", "hf://"), ("oci", "oci://"), ("pvc", "pvc://"))}


def test_the_crd_carries_the_grammar_modules_expressions() -> None:
    assert CRD_REGEX == {"hub": sources.HUB_SOURCE_RE, "oci": sources.OCI_SOURCE_RE, "pvc": sources.PVC_SOURCE_RE}
    assert MODEL_SCHEMA["properties"]["source"]["pattern"] == sources.SCHEME_RE
    assert MODEL_SCHEMA["properties"]["revision"]["pattern"] == sources.REVISION_RE


_PROGRAMS: dict[str, Any] = {}


def crd_admits(model: dict[str, Any]) -> bool:
    """The CRD's own checks of spec.model: the OpenAPI pattern and length, then every CEL rule."""
    from celpy import celtypes

    src = model["source"]
    if len(src) > MODEL_SCHEMA["properties"]["source"]["maxLength"] or not re.search(sources.SCHEME_RE, src):
        return False
    rev = model.get("revision")
    if rev is not None and (len(rev) > MODEL_SCHEMA["properties"]["revision"]["maxLength"]
                            or not re.search(MODEL_SCHEMA["properties"]["revision"]["pattern"], rev)):
        return False
    for r in RULES:
        if r["rule"] not in _PROGRAMS:
            env = celpy.Environment()

            def substring(text: Any, start: Any, end: Any = None) -> Any:
                s = str(text)
                return celtypes.StringType(s[int(start):] if end is None else s[int(start):int(end)])

            _PROGRAMS[r["rule"]] = env.program(env.compile(r["rule"]), functions={"substring": substring})
        if not _PROGRAMS[r["rule"]].evaluate({"self": celpy.json_to_cel(model)}):
            return False
    return True


def _render(model: dict[str, Any]) -> list[dict[str, Any]]:
    """The sync hook's answer for this model, then again once its staging Job (if any) succeeded."""
    scheme = model["source"].split("://")[0]
    cache = {"strategy": "SharedPVC", "prewarm": scheme in ("hf", "modelscope")} if scheme != "pvc" else {}
    service = h.llmservice(model=model, **({"cache": cache} if cache else {}))
    LLMService.model_validate(service)
    first = sync.sync(h.sync_request(service), h.config())
    jobs = [c for c in first["children"] if c["kind"] == "Job"]
    assert bool(jobs) == (scheme != "pvc")
    done = []
    for job in jobs:
        observed = copy.deepcopy(job)
        observed["status"] = {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}
        done.append(observed)
    second = sync.sync(h.sync_request(service, children=done), h.config())
    backends = [c for c in second["children"] if c["kind"] == "Deployment" and c["metadata"]["name"].endswith("-backend")]
    assert backends, second["status"]
    return [*first["children"], *second["children"]]


def _check_layout(model: dict[str, Any], tmp: Path) -> None:
    if model["source"].startswith("pvc://"):
        with pytest.raises(LayoutError, match="pre-staged"):
            ModelDir.of(tmp, model["source"], None)
        return
    staged = ModelDir.of(tmp, model["source"], model.get("revision"))
    root = (tmp / "noctaya" / staged.scheme).resolve()
    for path in (staged.final, staged.partial, staged.marker, staged.lock_file, staged.blobs):
        assert ".." not in path.parts and "." not in path.parts
        assert path.resolve().is_relative_to(root), path
    assert len({staged.final.name, staged.partial.name, staged.marker.name, staged.lock_file.name}) == 4


hub_models = st.builds(
    lambda src, rev: {"source": src, **({"revision": rev} if rev else {})},
    st.from_regex(sources.HUB_SOURCE_RE, fullmatch=True),
    st.one_of(st.none(), st.from_regex(r"[A-Za-z0-9._/-]{1,40}", fullmatch=True)),
)
any_model = st.one_of(
    hub_models,
    st.builds(lambda s: {"source": s}, st.from_regex(CRD_REGEX["oci"], fullmatch=True)),
    st.builds(lambda s: {"source": s}, st.from_regex(CRD_REGEX["pvc"], fullmatch=True)),
).filter(lambda m: len(m["source"]) <= sources.SOURCE_MAX)


@SETTINGS
@given(any_model)
def test_every_source_the_crd_admits_renders_and_names_a_cache_directory(model: dict[str, Any]) -> None:
    assert crd_admits(model), model
    sources.parse_model_source(model["source"])
    _render(model)
    _check_layout(model, Path("/nonexistent-cache"))


# Drawn from a wider alphabet: whatever the CRD admits passes everywhere, whatever it refuses is
# refused by the models and the layout too (the three cannot disagree again).
loose = st.builds(
    lambda scheme, body: f"{scheme}://{body}",
    st.sampled_from(["hf", "modelscope", "oci", "pvc"]),
    st.one_of(
        st.from_regex(r"[a-zA-Z0-9._/:@-]{0,30}(@sha256:[a-f0-9]{64})?", fullmatch=True),
        st.builds(lambda a, b: f"{a}/{b}@sha256:{'c' * 64}", st.sampled_from(["reg", "..", "reg.io:5000", "Reg", "-r", "r_x"]),
                  st.sampled_from(["x", "../x", "a/./b", ".h/x", "a__b", "a___b", "a-b", "a--b", "a.b", "a..b", "x/"])),
    ),
)


@SETTINGS
@given(loose)
def test_the_crd_the_models_and_the_layout_agree(source: str) -> None:
    admitted = crd_admits({"source": source})
    try:
        sources.parse_model_source(source)
        parsed = True
    except ValueError:
        parsed = False
    assert admitted == parsed, source
    if admitted:
        _render({"source": source})
        _check_layout({"source": source}, Path("/nonexistent-cache"))
    elif not source.startswith("pvc://"):
        with pytest.raises(LayoutError):
            ModelDir.of("/nonexistent-cache", source, None)


@pytest.mark.parametrize("source", [
    "oci://reg/../x@sha256:" + "a" * 64,  # the report: admitted, then HTTP 500 on every sync
    "oci://../x@sha256:" + "a" * 64,
    "oci://reg/./x@sha256:" + "a" * 64,
    "oci://reg/.hidden/x@sha256:" + "a" * 64,
    "oci://reg/x/@sha256:" + "a" * 64,
    "oci://-reg/x@sha256:" + "a" * 64,
    "oci://reg_1/x@sha256:" + "a" * 64,  # would share a directory with reg:1
    "oci://reg/x:latest",
    "pvc://weights/..",
    "pvc://weights/./x",
    "hf://../x",
])
def test_the_reported_and_neighbouring_sources_are_refused_everywhere(source: str) -> None:
    assert not crd_admits({"source": source})
    with pytest.raises(ValueError):
        sources.parse_model_source(source)
    with pytest.raises(Exception, match="model.source|must pin a digest|pvc://|hub source"):
        LLMService.model_validate(h.llmservice(model={"source": source}))


@pytest.mark.parametrize("source", [
    "oci://registry.example.com:5000/models/qwen2.5-7b__x/v1.2@sha256:" + "a" * 64,
    "oci://localhost/a-b--c@sha256:" + "a" * 64,
    "pvc://weights/.../x",
    "pvc://weights/.cache/llama",
])
def test_unusual_but_valid_sources_render(source: str) -> None:
    assert crd_admits({"source": source})
    _render({"source": source})
    _check_layout({"source": source}, Path("/nonexistent-cache"))
