"""A real inference engine on the real path: llama.cpp's llama-server (built by the test set-up,
tests/engines/llamacpp.py) serving a tiny GGUF, delivered as users deliver weights: a stand-in hub
(the Hugging Face protocol), the prewarm Job the hooks rendered, run as its container runs
(``python -m prewarm hub``), into the node's HostPath cache; then the backend Pod's init container and
the engine container the hooks rendered for ``examples/runtimes/llamacpp-cpu-staged.yaml``, its
command, args and env expanded as the kubelet does (tests/e2e/engine_pods.py plays that kubelet; kwok
plays nothing in this namespace), each Pod in a network namespace of its own with a Pod IP that the
EndpointSlice controller publishes, its args unchanged. Real KEDA, real Metacontroller, the rendered
gateway, the `openai` client.

Each test can fail on a wrong runtime: a wrong model argument (the engine never serves: the cold
request times out), a metric name the engine does not export (the preStop drain returns while the
stream is in flight), a readiness path it does not serve (never Ready), an engine bound to its Pod's
loopback (``--host 127.0.0.1``: unreachable, never Ready, as in a cluster).
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import openai
import pytest
import requests
import yaml

from demo.hub import FakeHub, HubRepo
from hooks.resources.gateway import READY_GRACE_SECONDS
from tests.e2e.cluster import Cluster, Timeline, private_loopback_address
from tests.e2e.engine_pods import ENGINE_NAMESPACE, EngineKubelet
from tests.e2e.kubelet import endpoint_slice_addresses, models_retired_at_end
from tests.e2e.netns import Network
from tests.e2e.test_lifecycle import conditions
from tests.e2e.test_scale_from_zero import COOLDOWN_SECONDS, MODEL_PORT, Model, keda  # noqa: F401 (fixture)
from tests.engines import llamacpp, staged, tiny_gguf
from tests.kube.apiserver import REPO_ROOT
from tests.third_party import ThirdPartyUnavailable

pytestmark = pytest.mark.timeout(300)

RUNTIME = REPO_ROOT / "examples" / "runtimes" / "llamacpp-cpu-staged.yaml"
CORRUPT_REPO = "noctaya/corrupt-llama-gguf"
LONG_STREAM_TOKENS = 4000  # several seconds of the tiny model's own tokens (one slot's context is 4096)


@pytest.fixture(scope="module")
def llama_server() -> str:
    try:
        return str(llamacpp.llama_server())
    except ThirdPartyUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHub]:
    good = tiny_gguf.write(tmp_path_factory.mktemp("gguf") / staged.GGUF_FILE).read_bytes()
    corrupt = good[:4096] + bytes(len(good) - 4096)  # header and key/values intact, tensors zeroed
    commit = hashlib.sha1(b"corrupt").hexdigest()
    repos = {staged.REPO_ID: staged.hub_repo(good),
             CORRUPT_REPO: HubRepo({commit: {staged.GGUF_FILE: corrupt}}, {"main": commit})}
    # On an address of its own: a Pod's 127.0.0.1 is the Pod itself; the Pods' network namespaces
    # reach the suite's other private loopback addresses (tests/e2e/netns.py).
    with FakeHub(repos, host=private_loopback_address(set(), 80)) as served:
        yield served


@pytest.fixture(scope="module")
def runtime(cluster: Cluster, keda: None) -> None:  # noqa: F811
    cluster.kubectl("apply", "--server-side", "-f", str(RUNTIME))


@pytest.fixture(scope="module")
def engines(cluster: Cluster, runtime: None, llama_server: str) -> Iterator[dict[str, Model]]:
    """The module's models; at its end their LLMServices are deleted while their kubelets still play
    the Pods (kwok plays nothing here: a Pod nobody confirms stays Terminating, and later modules wait
    for every backend in the cluster to be gone), then everything stops."""
    yield from models_retired_at_end(cluster, ENGINE_NAMESPACE)


def manifest(name: str, hub_url: str, repo: str = staged.REPO_ID, runtime: str = "llamacpp-cpu-staged",
             **scaling: str) -> str:
    doc = {
        "apiVersion": "serving.noctaya.io/v1alpha1", "kind": "LLMService",
        "metadata": {"name": name, "namespace": ENGINE_NAMESPACE},
        "spec": {
            "model": {"source": f"hf://{repo}", "servedName": name},
            "runtime": {"name": runtime, "args": ["--threads", "1"],
                        "env": [{"name": "HF_ENDPOINT", "value": hub_url},
                                {"name": "GGUF_FILE", "value": staged.GGUF_FILE}]},
            "resources": {"accelerators": 0, "cpu": "1", "memory": "1Gi"},
            "scaling": {"min": 0, "max": 1, "cooldownPeriod": f"{COOLDOWN_SECONDS}s", "pollingInterval": "1s",
                        "activationTimeout": "90s", **scaling},
            "cache": {"strategy": "HostPath", "hostPath": "/var/lib/noctaya/cache", "prewarm": True},
        },
    }
    return yaml.safe_dump(doc)


@pytest.fixture
def engine_model(cluster: Cluster, engines: dict[str, Model], hub: FakeHub, llama_server: str,
                 timeline: Timeline, pod_network: Network) -> Callable[..., Model]:
    def make(name: str, repo: str = staged.REPO_ID, runtime: str = "llamacpp-cpu-staged", **scaling: str) -> Model:
        if name in engines:
            engines[name].timeline = engines[name].server.timeline = timeline
            return engines[name]
        # The images' programs: Noctaya's python (the prewarm Job) and the engine's llama-server.
        programs = {"python": sys.executable, staged.ENGINE_PROGRAM: llama_server}
        kubelet = EngineKubelet(cluster, pod_network, name, MODEL_PORT, programs, timeline).start()
        model = engines[name] = Model(cluster, timeline, name, ENGINE_NAMESPACE, server=kubelet)
        if cluster.get("namespace", ENGINE_NAMESPACE) is None:
            cluster.kubectl("create", "namespace", ENGINE_NAMESPACE)
        cluster.kubectl("apply", "--server-side", "-f", "-",
                        stdin=manifest(name, hub.url, repo, runtime=runtime, **scaling))
        model.wait("prewarm Job run by the kubelet, then the backend", lambda: model.get("deployment", "-backend")
                   is not None, timeout=120)
        model.wait("gateway and ScaledObject created", lambda: model.get("deployment", "-gateway") is not None
                   and model.get("scaledobject", "-backend") is not None)
        model.start_pods()
        model.wait_keda_connected()
        return model

    return make


def kubelet(model: Model) -> EngineKubelet:
    assert isinstance(model.server, EngineKubelet)
    return model.server


def event_time(model: Model, pattern: str) -> float | None:
    return next((at for at, what in kubelet(model).events if re.search(pattern, what)), None)


def stream(client: openai.OpenAI, model: str, max_tokens: int = 16, **extra: object) -> tuple[str, float, int]:
    """The streamed text, when its first content token came (monotonic), and completion tokens (usage)."""
    first: float | None = None
    text, usage = [], 0
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, extra_body=extra or None):
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            first = first if first is not None else time.monotonic()
            text.append(chunk.choices[0].delta.content)
    assert first is not None, "no content token"
    return "".join(text), first, usage


def engine_counter(pod_address: str, name: str) -> float:
    text = requests.get(f"http://{pod_address}:{MODEL_PORT}/metrics", timeout=5).text
    found = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    assert found, f"{name} not in the engine's /metrics"
    return float(found.group(1))


def test_a_cold_streamed_completion_is_the_real_engines_own(engine_model: Callable[..., Model],
                                                             timeline: Timeline) -> None:
    model = engine_model("tiny")
    engine = kubelet(model)
    job_pods = [p for p in engine.pods.values() if p.kind == "prewarm"]
    assert [p.exits for p in job_pods] == [[0]], f"the prewarm Job ran once and succeeded: {engine.pod_states()}"
    assert model.replicas() == 0 and not engine.running, timeline.text()
    client = model.client()
    cold_list = client.models.list().data
    assert [m.id for m in cold_list] == ["tiny"] and model.replicas() == 0, "listing while cold wakes nothing"
    sent = time.monotonic()
    text, first, tokens = stream(client, "tiny")
    started = event_time(model, r"engine started \(restart 0\)")
    assert started is not None, timeline.text()
    # Held while the engine started and loaded: the first token came after the engine process began.
    # Not necessarily after the kubelet's Ready: a gateway that balances over the backend's Pods
    # (issue 41) probes a Pod that is not Ready yet itself, and may see it answer first.
    assert sent < started < first, (sent, started, first, timeline.text())
    assert tokens >= 1 and text, (text, tokens)
    model.wait("the backend Pod Ready", lambda: len(engine.ready_engines()) == 1, timeout=30)
    ready = event_time(model, r": Ready")
    assert ready is not None and started < ready, timeline.text()
    (pod,) = engine.ready_engines()
    assert engine_counter(pod.address, "llamacpp:tokens_predicted_total") >= tokens
    # The Pod's own IP, not a loopback address, is what the EndpointSlice controller published.
    assert not pod.address.startswith("127.") and pod.answered_at is not None, engine.pod_states()
    model.wait("the backend Pod's IP ready in the backend Service's EndpointSlice", lambda: endpoint_slice_addresses(
        model.cluster, ENGINE_NAMESPACE, "tiny-backend").get(pod.address, {}).get("ready") is True, timeout=30)
    # Warm: the listing is the engine's own (llama-server says owned_by llamacpp and adds its meta).
    warm = requests.get(f"{model.gateways.url(0, 8080)}/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in warm] == ["tiny"] and warm[0].get("owned_by") == "llamacpp", warm
    cold_owner = cold_list[0].model_dump().get("owned_by")
    assert cold_owner != "llamacpp", cold_list
    print(f"\nreal engine cold start: request -> engine process {started - sent:.2f} s, -> Ready "
          f"{ready - sent:.2f} s, -> first token {first - sent:.2f} s ({tokens} tokens)")


def test_a_pod_deleted_mid_stream_drains_on_the_engines_real_metrics(engine_model: Callable[..., Model],
                                                                     cluster: Cluster, timeline: Timeline) -> None:
    model = engine_model("tiny")
    engine = kubelet(model)
    client = model.client()
    stream(client, "tiny")  # warm (again) before the long stream
    # Its answer may come before the kubelet reports the Pod Ready (see the first test).
    model.wait("the backend Pod Ready", lambda: len(engine.ready_engines()) == 1, timeout=30)
    (pod,) = engine.ready_engines()
    result: dict[str, object] = {}

    def long_stream() -> None:
        try:
            result["answer"] = stream(client, "tiny", LONG_STREAM_TOKENS, ignore_eos=True)
        except Exception as exc:  # noqa: BLE001 - the assertion below reports it
            result["error"] = exc
        result["ended"] = time.monotonic()

    thread = threading.Thread(target=long_stream, daemon=True)
    thread.start()
    model.wait("the stream in flight in llamacpp:requests_processing",
               lambda: engine_counter(pod.address, "llamacpp:requests_processing") >= 1, timeout=20)
    deleted = time.monotonic()
    cluster.kubectl("-n", ENGINE_NAMESPACE, "delete", "pod", pod.name, "--wait=false")
    thread.join(120)
    assert "error" not in result and "answer" in result, f"{result.get('error')!r}\n{timeline.text()}"
    _text, _first, tokens = result["answer"]  # type: ignore[misc]
    model.wait("the deleted Pod's engine ended", lambda: pod.stop_seconds is not None, timeout=60)
    assert pod.engine is not None and "nothing in flight" in pod.engine.pre_stop_output, pod.engine.pre_stop_output
    assert pod.engine.exit_code == 0 and not pod.engine.killed, timeline.text()
    # The hook waited for the stream: the engine got SIGTERM only after the last token was sent.
    assert float(result["ended"]) - deleted <= (pod.stop_seconds or 0) + 1.0, timeline.text()  # type: ignore[arg-type]
    assert tokens >= LONG_STREAM_TOKENS - 100, tokens
    print(f"\npreStop drain during a stream: {tokens} tokens completed; engine ended {pod.stop_seconds:.1f} s "
          f"after the delete (preStop {pod.engine.pre_stop_seconds:.1f} s), exit 0")


def test_scale_to_zero_and_back_twice_from_the_cache(engine_model: Callable[..., Model],
                                                    timeline: Timeline) -> None:
    model = engine_model("tiny")
    engine = kubelet(model)
    for round_ in (1, 2):
        model.wait(f"scaled to zero ({round_})", lambda: model.replicas() == 0 and not engine.running,
                   timeout=READY_GRACE_SECONDS + COOLDOWN_SECONDS + 90)
        text, _first, tokens = stream(model.client(), "tiny")
        assert text and tokens >= 1, timeline.text()
    prewarm_runs = [p for p in engine.pods.values() if p.kind == "prewarm"]
    assert len(prewarm_runs) == 1, "served from the cache each time: the Job ran once"
    backends = [p for p in engine.pods.values() if p.kind == "backend"]
    assert all(p.restarts == 0 for p in backends), engine.pod_states()
    assert all(p.engine is None or p.engine.exit_code in (0, None) for p in backends), engine.pod_states()


def test_a_corrupt_gguf_crash_loops_reports_why_and_the_client_gets_the_documented_error(
        engine_model: Callable[..., Model], timeline: Timeline) -> None:
    model = engine_model("corrupt", CORRUPT_REPO, activationTimeout="20s", cooldownPeriod="120s")
    engine = kubelet(model)
    with pytest.raises(openai.APIStatusError) as failed:
        model.client().chat.completions.create(model="corrupt", messages=[{"role": "user", "content": "hi"}])
    assert failed.value.status_code == 504 and "activation_timeout" in failed.value.response.text, failed.value
    assert failed.value.response.headers.get("x-should-retry") == "false"
    backends = [p for p in engine.pods.values() if p.kind == "backend"]
    assert backends and backends[0].exits and all(code != 0 for code in backends[0].exits), engine.pod_states()
    assert not any(p.ready for p in backends), "a corrupt model never turns Ready"

    def crash_loop() -> bool:
        return conditions(model.get("llmservice")).get("BackendReady", "").startswith("False/CrashLoop")

    model.wait("LLMService BackendReady=False/CrashLoop", crash_loop, timeout=60)
    message = next(c["message"] for c in model.get("llmservice")["status"]["conditions"] if c["type"] == "BackendReady")
    print(f"\ncorrupt GGUF: 504 activation_timeout; BackendReady=False/CrashLoop: {message[:200]}")


LOOPBACK_RUNTIME = "llamacpp-cpu-staged-loopback"


def test_an_engine_bound_to_its_pods_loopback_is_never_ready_as_in_a_cluster(
        engine_model: Callable[..., Model], cluster: Cluster, pod_network: Network, timeline: Timeline) -> None:
    # A runtime whose engine listens on 127.0.0.1: in a cluster that is the Pod's own loopback, which
    # neither the kubelet's probe nor the Service reaches. Each Pod's network namespace runs the args
    # as rendered, so the harness sees what a cluster would (it used to rewrite 127.0.0.1 into the
    # Pod's address, and such a runtime passed).
    runtime = yaml.safe_load(RUNTIME.read_text())
    runtime["metadata"]["name"] = LOOPBACK_RUNTIME
    args = runtime["spec"]["args"]
    args[args.index("--host") + 1] = "127.0.0.1"
    cluster.kubectl("apply", "--server-side", "-f", "-", stdin=yaml.safe_dump(runtime))
    model = engine_model("loopback", runtime=LOOPBACK_RUNTIME, activationTimeout="20s", cooldownPeriod="120s")
    engine = kubelet(model)
    with pytest.raises(openai.APIStatusError) as failed:
        model.client().chat.completions.create(model="loopback", messages=[{"role": "user", "content": "hi"}])
    assert failed.value.status_code == 504 and "activation_timeout" in failed.value.response.text, failed.value
    (pod,) = engine.backends()
    assert pod.network is not None and pod.engine is not None

    def answers_inside() -> bool:
        # The engine serves, on the loopback of its own Pod (where its preStop hook asks it).
        probe = subprocess.run([*pod_network.exec_prefix(pod.network), sys.executable, "-c",
                                "import urllib.request; print(urllib.request.urlopen("
                                f"'http://127.0.0.1:{MODEL_PORT}/health', timeout=2).status)"],
                               capture_output=True, text=True, timeout=30, check=False)
        return probe.stdout.strip() == "200"

    model.wait("the engine answers /health inside its Pod", answers_inside, timeout=60)
    assert pod.engine.running() and pod.restarts == 0, engine.pod_states()
    assert not pod.ready and pod.answered_at is None, f"probed at its Pod IP, it never answered: {engine.pod_states()}"
    published = endpoint_slice_addresses(cluster, ENGINE_NAMESPACE, "loopback-backend")
    assert published.get(pod.address, {}).get("ready") is False, published
    print(f"\nengine on its Pod's loopback: answers inside its Pod, never Ready at {pod.address}; the client got "
          "504 activation_timeout")
