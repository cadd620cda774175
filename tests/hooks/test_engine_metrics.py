"""The engine gauges each shipped InferenceRuntime names are the ones docs/observability.md records
("Engine metrics") from the engines' own sources at the versions the examples pin: every name an
example gives is a row of that table for the same example and field, every row is still named by its
example, and the engine version a row was read at is the one the example's image pins. A name no
engine exports makes the preStop drain wait its whole timeout and a leading-signal trigger never
fire (llamacpp-cpu.yaml named a KV-cache gauge llama.cpp had removed), so a change to either side
must change the other."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
RUNTIMES = ROOT / "examples" / "runtimes"
DOC = ROOT / "docs" / "observability.md"
FIELDS = ("inFlightMetric", "waitingMetric", "kvCacheUsageMetric")
# The engine version each example's image tag pins, as the table names it (the image tag is the
# example's; the version is what its sources were read at).
IMAGE_VERSIONS = {
    "vllm/vllm-openai:v0.11.0": "vLLM 0.11.0",
    "rocm/vllm:rocm6.4.1_vllm_0.10.1_20250909": "vLLM 0.10.1",
    "quay.io/ascend/vllm-ascend:v0.10.0rc1": "vLLM 0.10.0",
    "lmsysorg/sglang:v0.5.3-cu126": "SGLang 0.5.3",
    "ghcr.io/ggml-org/llama.cpp:server-b6700": "llama.cpp server",
}


def table_rows() -> list[tuple[str, str, str, str]]:
    """(example file, engine, field, metric) of each row of the "Engine metrics" table."""
    text = DOC.read_text()
    section = text.split("## Engine metrics", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("`") and cells[0].endswith(".yaml`"):
            rows.append((cells[0].strip("`"), cells[1], cells[2].strip("`"), cells[3].strip("`")))
    return rows


def example_metrics() -> dict[tuple[str, str], str]:
    """(example file, field) -> metric, over every shipped runtime that names engine gauges."""
    named = {}
    for path in sorted(RUNTIMES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "InferenceRuntime":
                continue
            metrics = doc["spec"].get("metrics") or {}
            for field in FIELDS:
                if field in metrics:
                    named[(path.name, field)] = metrics[field]
    return named


def example_images() -> dict[str, str]:
    images = {}
    for path in sorted(RUNTIMES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "InferenceRuntime":
                images[path.name] = doc["spec"]["image"]
    return images


def test_every_metric_a_shipped_runtime_names_is_recorded_for_its_engine() -> None:
    rows = table_rows()
    assert len(rows) >= 14, "the Engine metrics table was not found or lost rows"
    recorded = {(example, field): metric for example, _, field, metric in rows}
    named = example_metrics()
    assert named, "no shipped runtime names an engine gauge"
    for key, metric in named.items():
        assert recorded.get(key) == metric, (
            f"{key[0]} names {key[1]}: {metric!r}, but docs/observability.md records "
            f"{recorded.get(key)!r} for it: check the engine's source at the pinned version")
    stale = sorted(set(recorded) - set(named))
    assert not stale, f"rows for fields no example names any more: {stale}"


def test_each_row_was_read_at_the_version_its_example_pins() -> None:
    images = example_images()
    for example, engine, _, _ in table_rows():
        image = images.get(example)
        assert image is not None, f"{example}: no such runtime example"
        assert image in IMAGE_VERSIONS, f"{example} pins {image}: read its engine's metrics at that version"
        assert engine.startswith(IMAGE_VERSIONS[image]), (example, engine, image)


def test_metric_names_are_prometheus_names_of_their_engine() -> None:
    prefixes = {"vLLM": "vllm:", "SGLang": "sglang:", "llama.cpp": "llamacpp:"}
    for example, engine, field, metric in table_rows():
        assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", metric), (example, field, metric)
        prefix = next(p for name, p in prefixes.items() if engine.startswith(name))
        assert metric.startswith(prefix), (example, field, metric)


def test_llamacpp_names_no_kv_cache_gauge() -> None:
    """llama-server has exported no KV-cache gauge since ggml-org/llama.cpp#13660 (May 2025)."""
    assert ("llamacpp-cpu.yaml", "kvCacheUsageMetric") not in example_metrics()


def test_llamacpp_options_and_values_are_separate_words() -> None:
    """llama-server's parser (common/arg.cpp) looks each argument up whole, so ``--port=8080`` is
    "error: invalid argument" and the engine exits at start; the 0.1.0/0.2.0 example had every
    option in that form. Checked against the real llama-server built from llama.cpp in
    llama-cpp-python 0.3.36."""
    doc = yaml.safe_load((RUNTIMES / "llamacpp-cpu.yaml").read_text())
    joined = [arg for arg in doc["spec"]["args"] if arg.startswith("-") and "=" in arg]
    assert not joined, f"llama-server refuses --option=value: {joined}"
