"""Scale from and to zero with real KEDA: the gateway (run from the Deployment the hooks rendered)
pushes demand to its scaler, KEDA's operator scales the backend Deployment, kube-controller-manager and
kube-scheduler make the Pod, kwok runs it to Ready, the model server comes up, the gateway sees it and
the `openai` client gets its answer.

Each test uses its own namespace and LLMService, bounded in time, and prints its timeline when it
fails. The measured figures are printed (`-s`) and recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import grpc
import httpx2
import openai
import pytest
import requests
import yaml

from gateway.config import GatewayConfig
from hooks.resources.context import ADMIN_PORT
from hooks.resources.gateway import READY_GRACE_SECONDS
from scaler import externalscaler_pb2 as pb
from scaler import externalscaler_pb2_grpc as pb_grpc
from tests.e2e.cluster import Cluster, Timeline
from tests.e2e.kubelet import Kubelet
from tests.e2e.pods import ClusterNames, LocalPods, ModelServer, stop_together
from tests.e2e.test_lifecycle import conditions
from tests.kube.apiserver import REPO_ROOT

pytestmark = pytest.mark.timeout(300)

RUNTIME = REPO_ROOT / "examples" / "runtimes" / "llamacpp-cpu.yaml"
MODEL_PORT = 8080  # llamacpp-cpu's serving port
GATEWAY_PORT = 8080
SCALER_PORT = 9090
COOLDOWN_SECONDS = 10
POLLING_SECONDS = 1
ANSWER = "tok0 tok1 tok2 tok3 tok4"  # what the model server streams


@pytest.fixture(scope="module")
def keda(cluster: Cluster) -> Iterator[None]:
    """KEDA as a user installs it (every CRD of the release, then the operator), and the runtime."""
    cluster.install_keda()
    if cluster.get("inferenceruntime", "llamacpp-cpu") is None:
        cluster.kubectl("apply", "--server-side", "-f", str(RUNTIME))
    yield


def llmservice(name: str, namespace: str, endpoint: dict[str, Any] | None = None,
               scaling: dict[str, Any] | None = None, runtime: dict[str, Any] | None = None, **spec: Any) -> str:
    doc = {
        "apiVersion": "serving.noctaya.io/v1alpha1", "kind": "LLMService",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"source": "hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF", "servedName": name},
            "runtime": runtime or {"name": "llamacpp-cpu"},
            "resources": {"accelerators": 0, "cpu": "1", "memory": "2Gi"},
            "scaling": {"min": 0, "max": 1, "cooldownPeriod": f"{COOLDOWN_SECONDS}s",
                        "pollingInterval": f"{POLLING_SECONDS}s", "activationTimeout": "60s", **(scaling or {})},
            "cache": {"strategy": "None"},
            "endpoint": endpoint or {},
            **spec,
        },
    }
    # JSON, which kubectl reads as YAML too: PyYAML writes a name such as `y` bare, and kubectl's YAML 1.1
    # reads that as a boolean ("cannot unmarshal bool into ... metadata.name").
    return json.dumps(doc)


class Model:
    """One LLMService under test: its objects, its local gateway Pods and its model server."""

    def __init__(self, cluster: Cluster, timeline: Timeline, name: str, namespace: str,
                 server: ModelServer | Kubelet | None = None) -> None:
        """``server``: what plays the backend Pods (default: the stand-in ModelServer; a kubelet of
        the harness: the real engine with tests/e2e/engine_pods.py, a stand-in server per Pod with
        tests/e2e/standin_pods.py)."""
        self.cluster, self.timeline, self.name, self.namespace = cluster, timeline, name, namespace
        self.gateways: LocalPods | None = None
        self.aggregator: LocalPods | None = None
        self.server = server if server is not None else ModelServer(cluster, namespace, name, MODEL_PORT, timeline)
        self.last_answer: float | None = None

    def get(self, kind: str, suffix: str = "") -> dict[str, Any] | None:
        return self.cluster.get(kind, self.name + suffix, self.namespace)

    def replicas(self) -> int | None:
        backend = self.get("deployment", "-backend")
        return None if backend is None else backend["spec"].get("replicas")

    def snapshot(self) -> str:
        conds = conditions(self.get("llmservice"))
        scaled = conditions(self.get("scaledobject", "-backend"))
        return (f"Ready={conds.get('Ready', '?')} Backend={conds.get('BackendReady', '?')} "
                f"ScaledObject.Ready={scaled.get('Ready', '?')} Active={scaled.get('Active', '?')} "
                f"backend.replicas={self.replicas()} model server={'up' if self.server.running else 'down'} "
                f"pods={self.server.pod_states()}")

    def wait(self, what: str, check: Callable[[], bool], timeout: float = 60.0) -> float:
        def logs() -> list[tuple[str, str]]:
            names = ["keda-operator", "metacontroller", *(self.gateways._names if self.gateways else [])]
            return [(n, self.cluster.log_tail(n, 12)) for n in names]

        return self.timeline.wait(what, check, self.snapshot, timeout, logs)

    def create(self, manifest: str) -> None:
        if self.cluster.get("namespace", self.namespace) is None:
            self.cluster.kubectl("create", "namespace", self.namespace)
        self.cluster.kubectl("apply", "--server-side", "-f", "-", stdin=manifest)
        self.wait("gateway, backend and ScaledObject created", lambda: all(
            self.get(kind, suffix) is not None
            for kind, suffix in [("deployment", "-gateway"), ("deployment", "-backend"), ("scaledobject", "-backend")]))

    def start_pods(self, gateways: int = 1, aggregator: bool = False, service_ips: bool = False) -> None:
        """``service_ips``: the gateways' Services get stable addresses (ClusterIPs, LocalPods). A
        ModelServer serves the backend at its Service's name only: its gateways get no credentials,
        so they dial that name instead of the (kwok's, unserved) Pod IPs (tests/e2e/pods.py)."""
        credentials = not isinstance(self.server, ModelServer)
        if aggregator:
            self.aggregator = LocalPods(self.cluster, self.namespace, f"{self.name}-aggregator",
                                        service_ips=service_ips, credentials=credentials).start(1)
        self.gateways = LocalPods(self.cluster, self.namespace, f"{self.name}-gateway",
                                  service_ips=service_ips, credentials=credentials).start(gateways)
        self.gateways.wait_http(GATEWAY_PORT)
        self.server.start()

    def wait_keda_connected(self) -> None:
        self.wait("KEDA reached the scaler (ScaledObject Ready=True)",
                  lambda: conditions(self.get("scaledobject", "-backend")).get("Ready", "").startswith("True"))

    def client(self, index: int = 0, api_key: str = "unused", timeout: float = 120.0) -> openai.OpenAI:
        assert self.gateways is not None
        return openai.OpenAI(base_url=f"{self.gateways.url(index, GATEWAY_PORT)}/v1", api_key=api_key,
                             max_retries=0, timeout=timeout)

    def stop(self) -> None:
        stop_together([self.server, *(pods for pods in (self.gateways, self.aggregator) if pods is not None)])


@pytest.fixture(scope="module")
def models(cluster: Cluster, keda: None) -> Iterator[dict[str, Model]]:
    """The module's models by name; their local Pods live until the module ends (a test may continue
    where another stopped: scale-in needs the gateway the cold request went through)."""
    made: dict[str, Model] = {}
    yield made
    stop_together(made.values())


@pytest.fixture
def model_factory(cluster: Cluster, models: dict[str, Model], timeline: Timeline) -> Callable[[str, str], Model]:
    def make(name: str, namespace: str) -> Model:
        assert name not in models, f"model {name} already made in this module: give each test its own name"
        models[name] = Model(cluster, timeline, name, namespace)
        return models[name]

    return make


def stream_answer(client: openai.OpenAI, model: str) -> tuple[str, float]:
    """The streamed answer and the seconds to its first content token, as the client saw them."""
    t0 = time.monotonic()
    first: float | None = None
    text = []
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], stream=True)
    for chunk in stream:
        delta = chunk.choices[0].delta.content if chunk.choices else None
        if delta:
            first = first if first is not None else time.monotonic() - t0
            text.append(delta)
    assert first is not None, "no content token"
    return "".join(text).strip(), first



def test_cold_request_scales_from_zero_through_real_keda_and_the_openai_client_gets_its_answer(
        model_factory: Callable[[str, str], Model], timeline: Timeline) -> None:
    model = model_factory("cold", "e2e-cold")
    model.create(llmservice("cold", "e2e-cold"))
    model.start_pods()
    model.wait_keda_connected()
    # A new LLMService never runs a backend Pod before its first demand.
    time.sleep(3.0)
    assert model.replicas() == 0 and not model.server.pods_seen, timeline.text()

    replicas_at: list[float] = []
    stop = threading.Event()
    t0 = time.monotonic()

    def watch_replicas() -> None:
        while not stop.is_set() and not replicas_at:
            if (model.replicas() or 0) >= 1:
                replicas_at.append(time.monotonic() - t0)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch_replicas, daemon=True)
    watcher.start()
    try:
        text, first_token = stream_answer(model.client(), "cold")
    finally:
        stop.set()
        watcher.join(5)
    timeline.note(model.snapshot())
    assert text == ANSWER, timeline.text()
    assert replicas_at, f"backend replicas never reached 1\n{timeline.text()}"
    print(f"\ncold request -> backend spec.replicas 1 (real KEDA): {replicas_at[0] * 1000:.0f} ms; "
          f"-> first token: {first_token:.2f} s")
    # Warm now: answered at once.
    text, warm_first = stream_answer(model.client(), "cold")
    assert text == ANSWER and warm_first < 2.0, timeline.text()
    model.last_answer = time.monotonic()


def test_idle_backend_scales_back_to_zero_after_the_cooldown(models: dict[str, Model], timeline: Timeline) -> None:
    model = models.get("cold")
    if model is None or model.last_answer is None:
        pytest.skip("continues the cold-request test")
    model.timeline = model.server.timeline = timeline
    model.wait("backend scaled back to 0", lambda: model.replicas() == 0,
               timeout=READY_GRACE_SECONDS + COOLDOWN_SECONDS + 60)
    idle = time.monotonic() - model.last_answer
    model.wait("model server down (no Ready backend Pod)", lambda: not model.server.backend.running, timeout=30)
    # Demand stays up for the gateway's readyGrace after its last request (the activation lease), then
    # KEDA waits the cooldown: scale-in before both would cut off a client that is about to come back.
    assert idle >= READY_GRACE_SECONDS + COOLDOWN_SECONDS - 1, f"scaled in {idle:.1f}s after the last answer"
    print(f"\nidle -> backend spec.replicas 0: {idle:.1f} s after the last answer (gateway readyGrace "
          f"{READY_GRACE_SECONDS} s + cooldownPeriod {COOLDOWN_SECONDS} s, pollingInterval {POLLING_SECONDS} s)")


def test_a_backend_that_never_becomes_ready_times_out_held_requests_and_reports_why(
        model_factory: Callable[[str, str], Model], timeline: Timeline) -> None:
    # kwok keeps Pods of `e2e-stuck` Running but never Ready, then crash-looping (tests/e2e/kwok-stages.yaml).
    model = model_factory("stuck", "e2e-stuck")
    # A long cooldown keeps the failing Pod (and so the condition it causes) after the requests gave up.
    model.create(llmservice("stuck", "e2e-stuck", endpoint={"maxQueue": 2},
                            scaling={"activationTimeout": "15s", "cooldownPeriod": "120s"}))
    model.start_pods()
    model.wait_keda_connected()

    outcomes: list[Any] = []

    def held() -> None:
        try:
            model.client().chat.completions.create(model="stuck", messages=[{"role": "user", "content": "hi"}])
            outcomes.append("answered")
        except openai.APIStatusError as exc:
            outcomes.append(exc)

    t0 = time.monotonic()
    threads = [threading.Thread(target=held, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    model.wait("two requests held", lambda: _queue(model)["queued"] >= 2, timeout=10)
    # The queue is full: the third is refused at once, with when to come back.
    with pytest.raises(openai.RateLimitError) as refused:
        model.client().chat.completions.create(model="stuck", messages=[{"role": "user", "content": "hi"}])
    assert refused.value.response.headers.get("retry-after"), timeline.text()
    timeline.note("third request: 429 queue_full")

    for t in threads:
        t.join(40)
    waited = time.monotonic() - t0
    assert [getattr(o, "status_code", o) for o in outcomes] == [504, 504], timeline.text()
    assert all(o.response.headers.get("x-should-retry") == "false" for o in outcomes)
    assert all("activation_timeout" in o.response.text for o in outcomes), outcomes[0].response.text
    assert 14 <= waited <= 25, f"activation timeout 15s, held {waited:.1f}s"

    def failing() -> bool:
        conds = conditions(model.get("llmservice"))
        return conds.get("BackendReady") == "False/CrashLoop" and conds.get("Ready", "").startswith("False/CrashLoop")

    model.wait("LLMService BackendReady=False/CrashLoop and Ready=False", failing, timeout=60)
    assert model.server.pods_seen and not model.server.backend.running
    print(f"\nnever-Ready backend: held requests got 504 activation_timeout after {waited:.1f} s (timeout 15 s)")


def _queue(model: Model) -> dict[str, Any]:
    assert model.gateways is not None
    return requests.get(f"{model.gateways.url(0, ADMIN_PORT)}/noctaya/queue", timeout=5).json()


def test_api_key_and_reject_mode(model_factory: Callable[[str, str], Model], cluster: Cluster,
                                 timeline: Timeline) -> None:
    # The shape of examples/models/api-key-auth.yaml: a key from a Secret, cold requests rejected.
    model = model_factory("keyed", "e2e-auth")
    cluster.kubectl("create", "namespace", "e2e-auth")
    key = "sk-e2e-" + "7" * 24
    cluster.kubectl("-n", "e2e-auth", "create", "secret", "generic", "keyed-api-key", f"--from-literal=api-key={key}")
    model.create(llmservice("keyed", "e2e-auth", endpoint={
        "auth": {"secretRef": {"name": "keyed-api-key", "key": "api-key"}},
        "coldRequestMode": "reject", "retryAfterSeconds": 2}))
    model.start_pods()
    model.wait_keda_connected()
    ask = [{"role": "user", "content": "hi"}]
    for wrong in ("", "sk-wrong"):
        with pytest.raises(openai.AuthenticationError):
            model.client(api_key=wrong or "none").chat.completions.create(model="keyed", messages=ask)
    assert model.replicas() == 0, "an unauthenticated request must not wake the backend"
    timeline.note("no key / wrong key: 401, backend still at 0")

    with pytest.raises(openai.APIStatusError) as rejected:
        model.client(api_key=key).chat.completions.create(model="keyed", messages=ask)
    assert rejected.value.status_code == 503, timeline.text()
    assert rejected.value.response.headers.get("retry-after") == "2"
    timeline.note("cold request in reject mode: 503 Retry-After 2")
    # The rejected request still woke the backend: retrying as told gets the answer.
    t0 = time.monotonic()
    while True:
        try:
            answer = model.client(api_key=key).chat.completions.create(model="keyed", messages=ask)
            break
        except openai.APIStatusError as exc:
            assert exc.status_code == 503, exc.response.text
            assert time.monotonic() - t0 < 60, f"still 503 after 60s\n{timeline.text()}"
            time.sleep(float(exc.response.headers.get("retry-after", "2")))
    assert answer.choices[0].message.content == ANSWER
    print(f"\nreject mode: 503 first, answered {time.monotonic() - t0:.1f} s later")


@pytest.mark.parametrize("gateways", [1, 2], ids=["one-gateway", "two-gateways"])
def test_scaler_mutual_tls_with_the_examples_trigger_authentication(
        model_factory: Callable[[str, str], Model], cluster: Cluster, timeline: Timeline, gateways: int) -> None:
    # One gateway serves KEDA itself; with two, KEDA dials the aggregator and the gateways report to
    # it over HTTPS, verifying the same certificate (the scaler Service's name) with the Secret's CA.
    ns, name = f"e2e-mtls-{gateways}", f"secure{gateways}"
    model = model_factory(name, ns)
    cluster.kubectl("create", "namespace", ns)
    # The example's own script makes both Secrets; its TriggerAuthentication is applied as published.
    kube_env = {"PATH": f"{cluster.plane.bin_dir}:/usr/bin:/bin", "KUBECONFIG": str(cluster.plane.kubeconfig),
                "HOME": str(cluster.workdir)}
    subprocess.run(["bash", str(REPO_ROOT / "examples" / "security" / "make-scaler-certs.sh"), ns, name],
                   env=kube_env, check=True, capture_output=True, timeout=120)
    docs = list(yaml.safe_load_all((REPO_ROOT / "examples" / "security" / "scaler-mtls.yaml").read_text()))
    (auth,) = [d for d in docs if d["kind"] == "TriggerAuthentication"]
    cluster.kubectl("-n", ns, "apply", "--server-side", "-f", "-", stdin=yaml.safe_dump(auth))
    model.create(llmservice(name, ns, endpoint={"replicas": gateways},
                            scalerTLS={"secretName": f"{name}-scaler-tls", "triggerAuthentication": auth["metadata"]["name"]}))
    model.start_pods(gateways=gateways, aggregator=gateways > 1)
    model.wait_keda_connected()
    # The scaler refuses a client without a certificate.
    scaler = model.aggregator if gateways > 1 else model.gateways
    assert scaler is not None
    with grpc.insecure_channel(f"{scaler.addresses[0]}:{SCALER_PORT}") as channel:
        with pytest.raises(grpc.RpcError):
            pb_grpc.ExternalScalerStub(channel).IsActive(pb.ScaledObjectRef(name="x", namespace=ns), timeout=3)
    if gateways > 1:
        env = {e["name"]: e["value"] for e in
               model.get("deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["NOCTAYA_AGGREGATOR_URL"].startswith(f"https://{name}-scaler.{ns}.svc"), env
        # The report port speaks TLS only: a plaintext report goes nowhere.
        with pytest.raises(requests.RequestException):
            requests.post(f"http://{scaler.addresses[0]}:9091/v1/report", json={}, timeout=3)
    # Demand at the last gateway: with two, it reaches KEDA only through a report over TLS.
    text, first = stream_answer(model.client(index=gateways - 1), name)
    assert text == ANSWER
    print(f"\nscaler mTLS ({gateways} gateway(s)): cold request answered through KEDA's client certificate, "
          f"first token {first:.2f} s")


def test_two_gateways_aggregate_their_demand(model_factory: Callable[[str, str], Model], timeline: Timeline) -> None:
    model = model_factory("multi", "e2e-multi")
    model.create(llmservice("multi", "e2e-multi", endpoint={"replicas": 2}))
    model.start_pods(gateways=2, aggregator=True)
    model.wait_keda_connected()
    scaled = model.get("scaledobject", "-backend")
    assert scaled is not None and "multi-scaler" in scaled["spec"]["triggers"][0]["metadata"]["scalerAddress"]
    # Demand at the second gateway only: the aggregate scaler KEDA dials must see it.
    text, first = stream_answer(model.client(index=1), "multi")
    assert text == ANSWER
    text, _ = stream_answer(model.client(index=0), "multi")
    assert text == ANSWER
    print(f"\ntwo gateways + aggregator: cold request at gateway 2 answered, first token {first:.2f} s")


class ServiceLoad:
    """Clients asking one after another through a Service name with the `openai` SDK as it ships (its
    own retries: 2, honouring x-should-retry and Retry-After), half of them streamed. Each client
    counts its attempts (the SDK's retries are the attempts beyond one per call), the status of every
    non-2xx answer, and which Pod answered each call (``route``: the Pod address of a connection, by
    its client address); every failure the SDK raises is kept."""

    def __init__(self, base_url: str, names: ClusterNames, route: Callable[[tuple[str, int]], str | None],
                 model: str, clients: int = 4) -> None:
        self.base_url, self.names, self.route, self.model = base_url, names, route, model
        self.calls = self.answered = self.attempts = 0
        self.by_address: dict[str, int] = {}
        self.refused: dict[int, int] = {}  # status -> answers the SDK retried (or raised)
        self.failures: list[str] = []
        self._once: Callable[[], None] | None = None
        self._http: list[httpx2.Client] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i % 2 == 0,), daemon=True) for i in range(clients)]

    def start(self) -> ServiceLoad:
        for t in self._threads:
            t.start()
        return self

    def ask_once(self) -> None:
        """One call (not streamed) from this load's first client, on the calling thread."""
        if self._once is None:
            self._once = self._client(False)
        self._once()

    def _run(self, stream: bool) -> None:
        call = self._client(stream)
        while not self._stop.is_set():
            call()

    def _client(self, stream: bool) -> Callable[[], None]:
        """A client of its own (its own connection pool), as a call that asks once and counts."""
        answered_by: list[str] = []

        def on_request(_request: httpx2.Request) -> None:
            with self._lock:
                self.attempts += 1

        def on_response(response: httpx2.Response) -> None:
            answered_by.append(str(self.route(response.extensions["network_stream"].get_extra_info("client_addr"))))
            if response.status_code >= 300:
                with self._lock:
                    self.refused[response.status_code] = self.refused.get(response.status_code, 0) + 1

        http = self.names.http_client(event_hooks={"request": [on_request], "response": [on_response]})
        self._http.append(http)
        client = openai.OpenAI(base_url=self.base_url, api_key="unused", http_client=http, timeout=30)
        messages = [{"role": "user", "content": "hi"}]

        def call() -> None:
            answered_by.clear()
            try:
                if stream:
                    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                        model=self.model, messages=messages, stream=True) if c.choices)
                else:
                    text = client.chat.completions.create(model=self.model, messages=messages).choices[0].message.content
                assert (text or "").strip() == ANSWER, f"answer {text!r}"
                with self._lock:
                    self.calls += 1
                    self.answered += 1
                    self.by_address[answered_by[-1]] = self.by_address.get(answered_by[-1], 0) + 1
            except Exception as exc:  # noqa: BLE001 - every failure is a finding
                with self._lock:
                    self.calls += 1
                    self.failures.append(f"{type(exc).__name__}: {exc}"[:300])

        return call

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            if t.ident is not None:
                t.join(60)
        for http in self._http:
            http.close()

    @property
    def retries(self) -> int:
        return self.attempts - self.calls


def established(address: str, port: int) -> int:
    """TCP connections established to ``address:port`` on this machine (KEDA's to a scaler, here)."""
    want = f"{bytes(reversed([int(b) for b in address.split('.')])).hex().upper()}:{port:04X}"
    with open("/proc/net/tcp") as fh:
        return sum(1 for line in fh.readlines()[1:] if line.split()[1] == want and line.split()[3] == "01")


ENDPOINTS_LAG_SECONDS = 1.5  # SIGTERM → the old gateway out of its Services (endpoints controller + kube-proxy)


@pytest.mark.timeout(240)
def test_a_rolling_update_of_the_gateway_under_openai_load_fails_no_request(
        model_factory: Callable[[str, str], Model], cluster: Cluster, timeline: Timeline) -> None:
    # A warm model; the `openai` client (its own retries) asks through the gateway's Service name while
    # a spec change rolls the gateway Deployment; the rollout is played as a RollingUpdate with kubelet
    # and endpoints controller (LocalPods.rolling_update): the old gateway keeps serving its drain delay
    # after SIGTERM while clients still reach it, then refuses retryably and ends by itself.
    model = model_factory("rolled", "e2e-roll")
    model.create(llmservice("rolled", "e2e-roll"))
    # The gateway's Services (public and scaler) on stable addresses, as ClusterIP Services are: KEDA
    # dials the scaler Service's name, and in a cluster a Pod's new address never reaches it.
    model.start_pods(service_ips=True)
    model.wait_keda_connected()
    assert model.gateways is not None and model.gateways.service_ips is not None
    text, _ = stream_answer(model.client(), "rolled")  # warm: the backend is up
    assert text == ANSWER, timeline.text()
    backend_pods = set(model.server.pods_seen)

    def gateway_env() -> dict[str, str]:
        dep = model.get("deployment", "-gateway")
        assert dep is not None
        return {e["name"]: e.get("value", "") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}

    before = gateway_env()
    assert before["NOCTAYA_SCALER_MODE"] == "local", before  # KEDA dials this gateway's own scaler
    delay = float(before.get("NOCTAYA_DRAIN_DELAY_SECONDS", GatewayConfig.drain_delay_seconds))
    assert ENDPOINTS_LAG_SECONDS < delay, f"the endpoints lag must be inside the drain delay ({delay}s)"
    endpoint = model.get("llmservice")["status"]["endpoint"]
    assert endpoint == "http://rolled-gateway.e2e-roll.svc.cluster.local/v1", endpoint
    old_scaler = model.gateways.addresses[0]
    assert established(old_scaler, SCALER_PORT) >= 1, "KEDA holds no connection to the gateway's scaler"

    public = model.gateways.service_ips["rolled-gateway"]
    # A client idle across the rollout: its pooled connection reaches the old Pod, its next call comes
    # after that Pod is gone.
    idle = ServiceLoad(endpoint, ClusterNames(cluster), public.endpoint_of, "rolled", clients=1)
    idle.ask_once()
    load = ServiceLoad(endpoint, ClusterNames(cluster), public.endpoint_of, "rolled").start()
    try:
        time.sleep(2.0)
        assert load.answered > 0 and not load.failures, (load.failures[:3], timeline.text())
        # A spec change the gateway's template carries (NOCTAYA_MAX_QUEUE): the hooks render it, the
        # Deployment controller makes a new ReplicaSet.
        t0 = time.monotonic()
        cluster.kubectl("-n", "e2e-roll", "patch", "llmservice", "rolled", "--type=merge",
                        "-p", '{"spec":{"endpoint":{"maxQueue":64}}}')
        model.wait("gateway Deployment template rendered with maxQueue 64",
                   lambda: gateway_env().get("NOCTAYA_MAX_QUEUE") == "64", timeout=30)
        rendered = time.monotonic() - t0
        assert before["NOCTAYA_MAX_QUEUE"] == "100", before
        replaced = model.gateways.rolling_update(ADMIN_PORT, endpoints_lag=ENDPOINTS_LAG_SECONDS, note=timeline.note)
        rolled = time.monotonic() - t0
        idle.ask_once()
        time.sleep(2.0)  # the new gateway alone, a little longer
    finally:
        load.stop()
        idle.stop()
    (done,) = replaced
    timeline.note(f"idle client: {idle.answered} answered, failures {idle.failures}, {idle.retries} retries, "
                  f"by {idle.by_address}")
    assert idle.failures == [] and idle.by_address == {done.old_address: 1, done.new_address: 1}, timeline.text()
    timeline.note(f"load: {load.answered} answered, {len(load.failures)} failed, {load.retries} retries, "
                  f"non-2xx {load.refused}, by address {load.by_address}, connections by endpoint "
                  f"{ {n: ip.connections for n, ip in model.gateways.service_ips.items()} }")
    assert load.failures == [], (load.failures[:5], timeline.text())
    assert load.by_address.get(done.old_address, 0) > 0 and load.by_address.get(done.new_address, 0) > 0, \
        timeline.text()
    assert set(load.by_address) <= {done.old_address, done.new_address}, load.by_address
    assert not done.killed and done.exit_code == 0, timeline.text()
    assert done.exited_after is not None and delay <= done.exited_after < done.grace, timeline.text()

    # The API side of the same rollout: the new ReplicaSet took over, the old one is at zero.
    def rolled_out() -> bool:
        dep = model.get("deployment", "-gateway")
        status = (dep or {}).get("status") or {}
        return status.get("updatedReplicas") == status.get("readyReplicas") == dep["spec"]["replicas"] and \
            status.get("replicas") == dep["spec"]["replicas"]

    model.wait("the gateway Deployment's rollout complete in the API (new ReplicaSet only)", rolled_out, timeout=30)
    # KEDA's external-push stream follows the scaler Service's name to the new gateway's scaler.
    model.wait("KEDA connected to the new gateway's scaler",
               lambda: established(done.new_address, SCALER_PORT) >= 1, timeout=60)
    keda = time.monotonic() - t0 - rolled  # rolling_update returned when the old Pod exited
    scaled = conditions(model.get("scaledobject", "-backend"))
    assert scaled.get("Ready", "").startswith("True"), (scaled, timeline.text())
    assert model.server.pods_seen == backend_pods and model.replicas() == 1, timeline.text()  # the backend stayed
    old_answers, new_answers = load.by_address[done.old_address], load.by_address[done.new_address]
    print(f"\ngateway rolling update under `openai` load (Service name, SDK retries): {load.answered} answered "
          f"({old_answers} by the old Pod, {new_answers} by the new), 0 failed, {load.retries} retries "
          f"(non-2xx seen: {load.refused or 'none'}); spec change -> template rendered {rendered:.1f} s, "
          f"-> old Pod SIGTERMed {done.terminated + rendered:.1f} s; old Pod out of its Services "
          f"{ENDPOINTS_LAG_SECONDS} s after SIGTERM, exited 0 {done.exited_after:.1f} s after it (drain delay "
          f"{delay:.0f} s, grace {done.grace:.0f} s); KEDA on the new scaler {keda:.1f} s after the old one exited; "
          f"whole rollout {rolled:.1f} s; a client idle across it: next call answered by the new Pod, "
          f"{idle.retries} retries")


@pytest.mark.timeout(420)
def test_a_warm_window_wakes_the_backend_with_no_request_and_lets_it_go_after_it_closes(
        model_factory: Callable[[str, str], Model], timeline: Timeline) -> None:
    # The window is read in Tokyo time (not the machine's): it opens at the first minute boundary at
    # least 45 s away (time to create everything first) and closes one minute later.
    zone = ZoneInfo("Asia/Tokyo")
    opens = (datetime.now(zone) + timedelta(seconds=45 + 59)).replace(second=0, microsecond=0)
    closes = opens + timedelta(minutes=1)
    window = {"start": f"{opens.minute} {opens.hour} * * *", "end": f"{closes.minute} {closes.hour} * * *",
              "timeZone": "Asia/Tokyo", "replicas": 1}
    model = model_factory("windowed", "e2e-window")
    model.create(llmservice(model.name, model.namespace, scaling={"schedules": [window]}))
    model.start_pods()
    model.wait_keda_connected()
    cron = [t for t in model.get("scaledobject", "-backend")["spec"]["triggers"] if t["type"] == "cron"]
    assert cron and cron[0]["metadata"]["start"] == window["start"], timeline.text()
    assert model.replicas() == 0, timeline.text()
    timeline.note(f"window {window['start']} .. {window['end']} Asia/Tokyo: opens in "
                  f"{(opens - datetime.now(zone)).total_seconds():.0f} s")

    def seconds_after(moment: datetime) -> float:
        return (datetime.now(zone) - moment).total_seconds()

    until_open = (opens - datetime.now(zone)).total_seconds()
    model.wait("backend scaled 0 → 1 when the window opened (no request sent)", lambda: model.replicas() == 1,
               timeout=until_open + 45)
    woke = seconds_after(opens)
    assert woke >= -1, f"scaled up {-woke:.1f} s before the window opened\n{timeline.text()}"
    model.wait("the backend Pod is Ready (the model server answers)", lambda: model.server.backend.running, timeout=60)
    until_close = (closes - datetime.now(zone)).total_seconds()
    assert model.replicas() == 1, timeline.text()
    model.wait("backend scaled back to 0 after the window closed and the cooldown",
               lambda: model.replicas() == 0, timeout=until_close + COOLDOWN_SECONDS + 60)
    slept = seconds_after(closes)
    assert slept >= COOLDOWN_SECONDS - 1, f"scaled in {slept:.1f} s after the window closed\n{timeline.text()}"
    assert not model.server.backend.requests_to("/v1/chat/completions"), "a request was sent"
    print(f"\nwarm window: backend 0 → 1 {woke:.1f} s after it opened; 1 → 0 {slept:.1f} s after it closed "
          f"(cooldownPeriod {COOLDOWN_SECONDS} s, pollingInterval {POLLING_SECONDS} s)")


def test_invalid_spec_is_refused_at_admission_or_reported_with_every_child_kept(
        model_factory: Callable[[str, str], Model], cluster: Cluster, timeline: Timeline) -> None:
    ns = "e2e-invalid"
    model = model_factory("invalid", ns)
    # What one object can say wrong, the API server refuses (the CRD's CEL rules), with the reason.
    cluster.kubectl("create", "namespace", ns)
    bad = cluster.kubectl("apply", "--server-side", "-f", "-", check=False,
                          stdin=llmservice("invalid", ns, scaling={"min": 2, "max": 1}))
    assert bad.returncode != 0 and "scaling.min must not exceed scaling.max" in bad.stderr, bad.stderr
    # What only the pair can say wrong reaches the hooks: a leading signal whose gauge this runtime
    # does not publish. The hook reports it and keeps every child as it was.
    runtime = yaml.safe_load(RUNTIME.read_text())
    runtime["metadata"]["name"] = "llamacpp-no-metrics"
    del runtime["spec"]["metrics"]
    cluster.kubectl("apply", "--server-side", "-f", "-", stdin=yaml.safe_dump(runtime))
    model.create(llmservice("invalid", ns, runtime={"name": "llamacpp-no-metrics"}))
    model.wait("AutoscalingReady=True", lambda: conditions(model.get("llmservice")).get("AutoscalingReady", "").startswith("True"))

    def children() -> set[str]:
        return set(cluster.kubectl("-n", ns, "get", "deployments,services,scaledobjects", "-o", "name").stdout.split())

    before = children()
    cluster.kubectl("-n", ns, "patch", "llmservice", "invalid", "--type=merge", "-p",
                    '{"spec":{"scaling":{"triggers":[{"signal":"WaitingRequests","threshold":"4",'
                    '"serverAddress":"http://prometheus.monitoring.svc:9090"}]}}}')
    model.wait("AutoscalingReady=False/InvalidSpec naming the missing gauge", lambda: (
        conditions(model.get("llmservice")).get("AutoscalingReady") == "False/InvalidSpec"))
    llm = model.get("llmservice")
    (cond,) = [c for c in llm["status"]["conditions"] if c["type"] == "AutoscalingReady"]
    assert "metrics.waitingMetric" in cond["message"], cond
    time.sleep(2.0)
    assert children() == before, timeline.text()
    timeline.note(f"AutoscalingReady: {cond['message']}")


def test_no_hook_hot_loop_with_keda_and_gateways_running(cluster: Cluster, models: dict[str, Model],
                                                         timeline: Timeline) -> None:
    # KEDA writes ScaledObject status and the HPA its own; kube-controller-manager writes Deployment
    # status. None of that may turn into a sync loop: once every backend is idle at 0, count hook
    # calls over one minute.
    if not models:
        pytest.skip("needs the LLMServices of this module")
    count = len(cluster.kubectl("get", "llmservices", "-A", "-o", "name").stdout.split())

    def all_idle() -> bool:
        backends = cluster.api("/apis/apps/v1/deployments?labelSelector=serving.noctaya.io/component=backend")["items"]
        pods = cluster.api("/api/v1/pods?labelSelector=serving.noctaya.io/component=backend")["items"]
        return all(d["spec"].get("replicas") == 0 for d in backends) and not pods

    deadline = time.monotonic() + 240
    while not all_idle():
        assert time.monotonic() < deadline, f"backends not all idle at 0 within 240s\n{timeline.text()}"
        time.sleep(1.0)
    time.sleep(10.0)
    log = cluster.workdir / "metacontroller.log"
    offset = log.stat().st_size
    before = cluster.hook_calls()
    time.sleep(60.0)
    after = cluster.hook_calls()
    per_hook = {hook: after.get(hook, 0) - before.get(hook, 0) for hook in after}
    with open(log, errors="replace") as fh:
        fh.seek(offset)
        synced = [line for line in fh if '"msg":"Sync"' in line]
    per_object: dict[str, int] = {}
    for line in synced:
        obj = json.loads(line).get("object") or {}
        key = f"{obj.get('namespace', '')}/{obj.get('name', '')}"
        per_object[key] = per_object.get(key, 0) + 1
    timeline.note(f"calls during the idle minute, {count} LLMServices: {per_hook}")
    timeline.note(f"Metacontroller syncs per object (all controllers): {per_object}")
    print(f"\nhook calls per idle minute with KEDA, kwok and gateways running ({count} LLMServices, all at 0): "
          f"{per_hook}")
    for hook, calls in per_hook.items():
        assert calls <= 2 * count, f"{hook}: {calls} calls for {count} objects in an idle minute\n{timeline.text()}"
