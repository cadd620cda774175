"""Every shipped llama.cpp runtime's metric names, checked against the live engine rather than a table:
for each InferenceRuntime under examples/runtimes whose ``spec.engine`` is ``llamacpp`` (found by
reading the files), the backend Pod the hooks render for it runs with the real llama-server
(tests/engines/staged.py: the tiny GGUF prewarmed into a local cache, then the rendered engine
container's command, args and env), its metrics endpoint (``spec.metrics.path`` on
``spec.metrics.port``, else ``spec.port``) is scraped, and every name the runtime gives there
(``inFlightMetric``, ``waitingMetric``, ``kvCacheUsageMetric``: any ``*Metric`` field) must be a
series of what the engine exports, parsed with prometheus_client's text parser.

One substitution, for a runtime whose model option downloads from a hub (``--hf-repo``): llama-server
can reach no hub here, so that option becomes ``--model`` on the same prewarmed file. Every other
word is the rendered one, so a runtime without ``--metrics`` fails here as its Pod would.

The check is shown to fail: against the same live scrape, a copy of each runtime with a wrong
``waitingMetric``, ``inFlightMetric`` or ``kvCacheUsageMetric`` is reported naming that field, and so
is the staged runtime's engine started without ``--metrics``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from hooks.api.runtime import InferenceRuntime, RuntimeMetrics
from tests.e2e.cluster import private_loopback_address
from tests.engines import llamacpp, staged
from tests.engines.container import LocalContainer

RUNTIMES = Path(__file__).resolve().parents[2] / "examples" / "runtimes"
HUB_MODEL_OPTIONS = ("--hf-repo", "-hf", "-hfr")  # llama-server's options that download the model
HUB_FILE_OPTIONS = ("--hf-file", "-hff")
STAGED_MODEL = "$(NOCTAYA_MODEL_PATH)/$(GGUF_FILE)"  # as llamacpp-cpu-staged.yaml loads it

pytestmark = pytest.mark.timeout(180)


def llamacpp_runtimes() -> list[tuple[str, dict[str, Any]]]:
    """(file name, InferenceRuntime) for every llama.cpp runtime shipped under examples/runtimes."""
    found = []
    for path in sorted(RUNTIMES.iterdir()):
        if path.suffix not in (".yaml", ".yml"):
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "InferenceRuntime" \
                    and (doc.get("spec") or {}).get("engine") == "llamacpp":
                found.append((path.name, doc))
    return found


SHIPPED = llamacpp_runtimes()


def named_metrics(runtime: dict[str, Any]) -> dict[str, str]:
    """field -> metric name, for every metric name the runtime gives."""
    metrics = runtime["spec"].get("metrics") or {}
    return {field: name for field, name in metrics.items() if field.endswith("Metric") and name}


@dataclass(frozen=True)
class Scrape:
    url: str
    status: int
    text: str


def series(text: str) -> set[str]:
    """The name of every series (sample) in a Prometheus text exposition."""
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def wrong_metric_names(runtime: dict[str, Any], scrape: Scrape) -> dict[str, str]:
    """field -> what is wrong, for each metric name the runtime gives that is not a series of the scrape."""
    named = named_metrics(runtime)
    if scrape.status != 200:
        return {field: f"{name}: {scrape.url} answered {scrape.status}" for field, name in named.items()}
    exported = series(scrape.text)
    return {field: f"{name} is not a series at {scrape.url}" for field, name in named.items() if name not in exported}


def offline_model_args(args: list[str]) -> list[str]:
    """The rendered args, a hub download option replaced by ``--model`` on the prewarmed file."""
    out: list[str] = []
    words = iter(args)
    for word in words:
        if word in HUB_MODEL_OPTIONS:
            next(words, None)
            out += ["--model", STAGED_MODEL]
        elif word in HUB_FILE_OPTIONS:
            next(words, None)
        else:
            out.append(word)
    return out


def scrape_live(runtime: dict[str, Any], workdir: Path, binary: Path, *, drop: tuple[str, ...] = ()) -> Scrape:
    """Render ``runtime``'s backend Pod, run its engine container with llama-server (``drop``: words
    taken out of its args), scrape its metrics endpoint once it is healthy, stop it."""
    spec = InferenceRuntime.model_validate(runtime).spec
    metrics = spec.metrics or RuntimeMetrics()
    address = private_loopback_address(set(), spec.port)
    backend = staged.deliver(workdir, runtime, address, binary)
    container = copy.deepcopy(next(c for c in backend.pod_spec["containers"] if c["name"] == "engine"))
    container["args"] = [w for w in offline_model_args(container.get("args") or []) if w not in drop]
    container.pop("lifecycle", None)  # stopped with SIGTERM: the preStop drain is not what is checked here
    engine = LocalContainer(container, backend.sandbox, workdir / "engine.log").start()
    try:
        staged.wait_health(engine, f"http://{address}:{spec.port}")
        url = f"http://{address}:{metrics.port or spec.port}{metrics.path}"
        answer = requests.get(url, timeout=5)
        return Scrape(url, answer.status_code, answer.text)
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def llama_server() -> Path:
    return llamacpp.llama_server()


@pytest.fixture(scope="module", params=SHIPPED, ids=[name for name, _ in SHIPPED])
def live(request: pytest.FixtureRequest, llama_server: Path,
         tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Scrape]:
    name, runtime = request.param
    return runtime, scrape_live(runtime, tmp_path_factory.mktemp(Path(name).stem), llama_server)


def test_the_shipped_llamacpp_runtimes_are_found() -> None:
    """What the tests below run over: the staged runtime the e2e suite and the demo serve is one."""
    names = [name for name, _ in SHIPPED]
    assert staged.STAGED_RUNTIME.name in names, names
    assert all(doc["spec"]["engine"] == "llamacpp" for _, doc in SHIPPED)


def test_every_metric_name_the_runtime_gives_is_a_series_of_the_live_engine(
        live: tuple[dict[str, Any], Scrape]) -> None:
    runtime, scrape = live
    wrong = wrong_metric_names(runtime, scrape)
    assert not wrong, f"{wrong}; the engine exports {sorted(series(scrape.text)) if scrape.status == 200 else scrape.text}"


@pytest.mark.parametrize(("field", "wrong_name"), [
    ("waitingMetric", "llamacpp:requests_waiting"),
    ("inFlightMetric", "llamacpp:requests_running"),
    ("kvCacheUsageMetric", "llamacpp:kv_cache_usage_ratio"),  # removed from llama.cpp in May 2025
])
def test_a_wrong_name_in_a_copy_of_the_runtime_is_reported(live: tuple[dict[str, Any], Scrape], field: str,
                                                             wrong_name: str) -> None:
    runtime, scrape = live
    changed = copy.deepcopy(runtime)
    changed["spec"].setdefault("metrics", {})[field] = wrong_name
    wrong = wrong_metric_names(changed, scrape)
    assert set(wrong) == {field} and wrong_name in wrong[field], wrong


def test_the_staged_runtime_without_metrics_flag_is_reported(llama_server: Path, tmp_path: Path) -> None:
    runtime = staged.runtime_doc()
    assert named_metrics(runtime), "the staged runtime names its gauges"
    scrape = scrape_live(runtime, tmp_path, llama_server, drop=("--metrics",))
    wrong = wrong_metric_names(runtime, scrape)
    assert scrape.status != 200 and set(wrong) == set(named_metrics(runtime)), (scrape, wrong)
