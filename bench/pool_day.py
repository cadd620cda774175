"""A day of a multi-model platform, compressed (issue #21): 12 models, 4 accelerators, with and without
an AcceleratorPool, against one model per accelerator kept warm.

The cluster is the e2e harness's, built the same way as tests/e2e/conftest.py's ``cluster`` fixture
(test API server, kube-controller-manager, kube-scheduler, kwok nodes offering ``nvidia.com/gpu``,
Noctaya installed from metacontroller/, the real hook server, real Metacontroller, real KEDA's
operator). Each model is an LLMService whose gateway runs from the rendered Deployment (LocalPods)
and whose backend is the suite's ModelServer stand-in: it listens exactly while kwok reports a Ready
backend Pod, and when that Pod goes it answers what it has in flight first, as the Pod's preStop drain
would (kwok runs no preStop hook). One poller lists the configuration's backend Pods every 0.1 s for all twelve models
(instead of one thread per model) and drives their servers, so twelve models cost the API server
10 lists/s, not 120.

Three configurations replay the same deterministic schedule, one after the other, each in a fresh
namespace with fresh nodes:

- ``min1``: ``scaling.min 1`` per model on 12 GPUs (3 nodes x 4): never a cold start, every GPU
  held all day.
- ``zero``: ``scaling.min 0`` on 4 GPUs (1 node x 4), no pool.
- ``pool``: the same plus an AcceleratorPool on that node (``yieldAfter`` below).

Time: the day's traffic envelope is compressed 1 s = 5 min (a day is 288 s; ``--quick`` replays
08:00-16:00, 96 s, with the same compression and schedule). What the harness cannot compress is
kept as it is and reported in real seconds: the cold start (KEDA activation, Deployment, scheduler,
kwok's fixed 1.5 s load delay in tests/e2e/kwok-stages.yaml, the gateway seeing the backend Ready:
about 1.8 s to the first token when a GPU is free, i.e. 9 compressed minutes) and the gateway's activation lease (readyGrace 15 s,
a product constant: a model counts as busy 15 s after its last request). cooldownPeriod (30 s) and
yieldAfter (5 s, the issue's test setting) are chosen against those floors; the activation timeout
(60 s) is what a user waits, in real seconds, as is every time to first token.

Traffic (seeded, ``--seed``): model popularity Zipf(s=1.4) over m01..m12; user sessions arrive as a
Poisson process whose rate follows a daily cycle (night floor, a daytime peak around 14:00, each
model's peak shifted by up to +-2 h); a session is 1-4 requests 0.5-3 s apart; on top, bursts: a
model (any, uniformly: tail models burst too) gets requests at 1-2/s for 15-45 compressed minutes.
Each request is a streamed chat completion through the model's gateway (plain HTTP, SSE read to
[DONE]); the backend streams 8 tokens 50 ms apart. The clients are a thread pool of fixed size;
the lag between a request's planned and actual start is reported.

Per configuration: accelerator-hours held (nvidia.com/gpu requested by bound backend Pods, sampled
every 0.1 s and integrated over the replayed window, in compressed hours), the share of requests
that met a cold start (no Ready backend Pod when sent), p50/p95/p99 time to first token of the
complete answers, 504 activation_timeout, 429, and lost requests (anything else: must be 0), plus
backend Pods started and the pool's yields.

Run: .venv/bin/python -m bench.pool_day [--quick] [--seed N] [--only min1,zero,pool] [--schedule]
[--ready-grace S] (or ``make bench-pool-day POOL_DAY_ARGS="..."``).
``--ready-grace`` sets the gateways' readyGrace (their NOCTAYA_READY_GRACE_SECONDS, on top of the
rendered env) so that it is compressed like cooldownPeriod: 15 s against a 300 s cooldown in a cluster
is 1.5 s against this benchmark's 30 s.
``--schedule`` prints the schedule and its statistics without a cluster. Exit 1 when a request was
lost. Takes about 20 minutes (1209 s measured; ``--quick`` about 9, estimated) on 2 cores, most of it
the replays; results in docs/benchmarks.md ("A day of a multi-model platform").
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from hooks.resources.gateway import READY_GRACE_SECONDS

MODELS = 12
ZIPF_S = 1.4
DAY_SECONDS = 288.0  # the whole day, real seconds: 1 s = 5 min
COMPRESSION = 24 * 3600 / DAY_SECONDS  # 300
QUICK_HOURS = (8.0, 16.0)
PEAK_SESSIONS_PER_SECOND = 1.0  # all models together, at the daily peak
NIGHT_FLOOR = 0.08  # of the peak
BURSTS_PER_DAY = 8
BURST_RATE = (1.0, 2.0)  # requests per real second
BURST_MINUTES = (15.0, 45.0)  # compressed
SESSION_REQUESTS = (1, 4)
SESSION_GAP = (0.5, 3.0)  # real seconds between a session's requests
CLIENT_THREADS = 96
TOKENS = 8
TOKEN_DELAY = 0.05

COOLDOWN_SECONDS = 30
YIELD_AFTER_SECONDS = 5
ACTIVATION_TIMEOUT_SECONDS = 60
POLLING = "1s"
GPUS_PER_NODE = 4
NODE_LABEL = "bench.noctaya.io/pool-day"
GPU = "nvidia.com/gpu"
POLL_SECONDS = 0.1


# --- the schedule (pure, seeded) --------------------------------------------------------------------


@dataclass(frozen=True)
class Arrival:
    t: float  # real seconds from the start of the day
    model: str
    burst: bool


def model_names() -> list[str]:
    return [f"m{i:02d}" for i in range(1, MODELS + 1)]


def zipf_shares(n: int = MODELS, s: float = ZIPF_S) -> list[float]:
    weights = [k ** -s for k in range(1, n + 1)]
    total = sum(weights)
    return [w / total for w in weights]


def daily_cycle(hour: float) -> float:
    """Relative load at ``hour`` (0..24): a night floor, a daytime bump peaking around 14:00."""
    hour %= 24.0
    day = math.sin(math.pi * (hour - 6.0) / 16.0) if 6.0 <= hour <= 22.0 else 0.0
    return NIGHT_FLOOR + (1.0 - NIGHT_FLOOR) * max(0.0, day) ** 1.5


def hour_of(t: float) -> float:
    return t * 24.0 / DAY_SECONDS


def schedule(seed: int = 21) -> list[Arrival]:
    """Every request of the day, sorted by time: sessions (Poisson, thinned by the daily cycle, shares
    by Zipf) and bursts. Deterministic for a seed."""
    rng = random.Random(seed)
    names = model_names()
    shares = zipf_shares()
    shifts = [rng.uniform(-2.0, 2.0) for _ in names]
    out: list[Arrival] = []
    for name, share, shift in zip(names, shares, shifts, strict=True):
        peak = PEAK_SESSIONS_PER_SECOND * share
        t = 0.0
        while True:  # thinning: candidates at the peak rate, kept with the cycle's relative load
            t += rng.expovariate(peak)
            if t >= DAY_SECONDS:
                break
            if rng.random() < daily_cycle(hour_of(t) - shift):
                at = t
                for i in range(rng.randint(*SESSION_REQUESTS)):
                    if i:
                        at += rng.uniform(*SESSION_GAP)
                    if at < DAY_SECONDS:
                        out.append(Arrival(round(at, 3), name, False))
    for _ in range(BURSTS_PER_DAY):
        name = rng.choice(names)
        start = rng.uniform(7.0, 22.0) * DAY_SECONDS / 24.0
        length = rng.uniform(*BURST_MINUTES) * 60.0 / COMPRESSION
        rate = rng.uniform(*BURST_RATE)
        t = start
        while True:
            t += rng.expovariate(rate)
            if t >= min(start + length, DAY_SECONDS):
                break
            out.append(Arrival(round(t, 3), name, True))
    return sorted(out, key=lambda a: (a.t, a.model))


def window(arrivals: list[Arrival], quick: bool) -> tuple[float, float, list[Arrival]]:
    """(start, end, arrivals shifted to start at 0) of the replayed part of the day."""
    start, end = ((QUICK_HOURS[0] * DAY_SECONDS / 24, QUICK_HOURS[1] * DAY_SECONDS / 24) if quick
                  else (0.0, DAY_SECONDS))
    return start, end, [Arrival(round(a.t - start, 3), a.model, a.burst) for a in arrivals if start <= a.t < end]


def describe(arrivals: list[Arrival], start: float, end: float) -> str:
    """``arrivals`` in day time (not shifted)."""
    per_model = Counter(a.model for a in arrivals)
    hours = Counter(int(hour_of(a.t)) for a in arrivals)
    lines = [f"{len(arrivals)} requests over {end - start:.0f} s ({(end - start) * COMPRESSION / 3600:.1f} compressed "
             f"hours), {sum(a.burst for a in arrivals)} in bursts"]
    lines.append("per model: " + " ".join(f"{m}={per_model.get(m, 0)}" for m in model_names()))
    lines.append("per hour: " + " ".join(f"{h:02d}h={hours.get(h, 0)}" for h in range(round(hour_of(start)), round(hour_of(end)))))
    return "\n".join(lines)


# --- the cluster (tests/e2e/conftest.py's fixture as a context manager) -------------------------------


@contextmanager
def e2e_cluster() -> Iterator[Any]:
    from tests.e2e.cluster import bare_cluster, install_this_release, metacontroller_binary
    from tests.kube.apiserver import ControlPlane, ensure_binaries
    from tests.kube.gobuild import keda_operator_binary, kwok_binary

    bin_dir = ensure_binaries()
    mc = metacontroller_binary()
    kwok = kwok_binary()
    keda_operator_binary()  # built before the clock starts; install_keda finds it
    if shutil.which("unshare") is None:
        raise SystemExit("`unshare` (util-linux) not found: needed to give Metacontroller a private hosts file")
    plane = ControlPlane(bin_dir)
    plane.start()
    env = None
    try:
        env = bare_cluster(plane, mc, kwok)
        install_this_release(env)
        env.install_keda()
        yield env
    finally:
        if env is not None:
            env.stop()
        plane.stop()


# --- one configuration -------------------------------------------------------------------------------


@dataclass
class Config:
    key: str
    title: str
    gpus: int
    min_replicas: int
    pool: bool


CONFIGS = {
    "min1": Config("min1", "(a) min=1 per model, 12 GPUs", 12, 1, False),
    "zero": Config("zero", "(b) scale-to-zero, no pool, 4 GPUs", 4, 0, False),
    "pool": Config("pool", "(c) scale-to-zero + AcceleratorPool, 4 GPUs", 4, 0, True),
}


@dataclass
class Outcome:
    model: str
    planned: float
    lag: float = 0.0
    cold: bool = False
    status: int = 0
    kind: str = ""
    first_token: float | None = None
    seconds: float = 0.0
    chunks: int = 0

    def acceptable(self) -> bool:
        return ((self.status == 200 and self.kind == "complete")
                or (self.status == 504 and self.kind == "activation_timeout") or self.status == 429)


@dataclass
class Result:
    config: Config
    requests: int = 0
    complete: int = 0
    cold: int = 0
    timeouts: int = 0
    refused: int = 0
    lost: list[str] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    ttft_cold: list[float] = field(default_factory=list)
    gpu_seconds: float = 0.0
    replay_seconds: float = 0.0
    pods_started: int = 0
    timeouts_by_model: Counter[str] = field(default_factory=Counter)
    timeouts_by_pool_reason: Counter[str] = field(default_factory=Counter)  # what the pool said meanwhile
    holders_at_timeouts: Counter[str] = field(default_factory=Counter)  # its "no idle holder" messages
    yields: int = 0
    max_lag: float = 0.0
    poll_errors: int = 0
    drains: list[float] = field(default_factory=list)  # seconds each scaled-in backend answered in-flight requests
    wall: float = 0.0

    @property
    def accelerator_hours(self) -> float:
        return self.gpu_seconds * COMPRESSION / 3600.0


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100.0 * len(ordered)) - 1))]


class Poller:
    """Lists the namespace's backend Pods every 0.1 s: starts/stops each model's stand-in server as
    ModelServer does (up exactly while a Ready backend Pod exists) and integrates GPUs held by bound Pods."""

    def __init__(self, cluster: Any, namespace: str, models: dict[str, Any], pool: str | None = None) -> None:
        self.cluster, self.namespace, self.models = cluster, namespace, models
        self.pool = pool  # its Contended condition is read once a second, to explain timeouts
        self.pool_said: list[tuple[float, str, str]] = []  # (monotonic, reason, message) on each change
        self.ready: dict[str, bool] = dict.fromkeys(models, False)
        self.pods_seen: set[str] = set()
        self.held = 0
        self.lists = 0
        self.errors = 0
        self._integrating = False
        self.gpu_seconds = 0.0
        self._last: float | None = None
        from tests.e2e.pods import DRAIN_GRACE_SECONDS

        self.drain_grace = DRAIN_GRACE_SECONDS
        self._drains: dict[str, threading.Thread] = {}
        self.drained: list[float] = []  # each drain's seconds, as it ends
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"poller-{namespace}", daemon=True)

    def start(self) -> Poller:
        self._thread.start()
        return self

    def integrate(self, on: bool) -> None:
        self._integrating = on

    def _run(self) -> None:
        import requests

        # One kept-alive connection (Cluster.api opens a TLS connection per call: 10/s would cost a core's share).
        plane = self.cluster.plane
        session = requests.Session()
        session.headers["Authorization"] = f"Bearer {plane.token}"
        # verify per request: a Session's own verify loses to REQUESTS_CA_BUNDLE/CURL_CA_BUNDLE in the environment.
        verify = str(plane.ca_file)
        url = f"{plane.url}/api/v1/namespaces/{self.namespace}/pods?labelSelector=serving.noctaya.io/component=backend"
        pool_url = f"{plane.url}/apis/serving.noctaya.io/v1alpha1/acceleratorpools/{self.pool}"
        next_pool_read = 0.0
        while not self._stop.is_set():
            if self.pool and time.monotonic() >= next_pool_read:
                next_pool_read = time.monotonic() + 1.0
                self._read_pool(session, pool_url, verify)
            try:
                resp = session.get(url, timeout=10, verify=verify)
                resp.raise_for_status()
                pods = resp.json()["items"]
            except requests.RequestException as exc:
                self.errors += 1
                if self.errors == 1:
                    print(f"poller: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                self._stop.wait(POLL_SECONDS)
                continue
            now = time.monotonic()
            if self._last is not None and self._integrating:
                self.gpu_seconds += self.held * (now - self._last)
            self._last = now
            held = 0
            ready = dict.fromkeys(self.models, False)
            for pod in pods:
                self.pods_seen.add(pod["metadata"]["name"])
                if pod["spec"].get("nodeName"):
                    for c in pod["spec"]["containers"]:
                        res = c.get("resources") or {}
                        held += int((res.get("limits") or res.get("requests") or {}).get(GPU, 0))
                conds = (pod.get("status") or {}).get("conditions") or []
                name = pod["metadata"]["labels"].get("serving.noctaya.io/llmservice")
                if name in ready and not pod["metadata"].get("deletionTimestamp") and any(
                        c["type"] == "Ready" and c["status"] == "True" for c in conds):
                    ready[name] = True
            self.held = held
            self.lists += 1
            for name, up in ready.items():
                self._follow(name, up)
                self.ready[name] = up
            self._stop.wait(POLL_SECONDS)
        session.close()

    def _follow(self, name: str, up: bool) -> None:
        """Start the model's server when its Pod is Ready; when it no longer is, drain it as the Pod's
        preStop hook would (tests/e2e/pods.py ModelServer): the listener closes, the requests in flight are
        answered. Drains run beside the poller, which serves eleven other models meanwhile."""
        backend = self.models[name].server.backend
        drain = self._drains.get(name)
        if drain is not None and drain.is_alive():
            return  # up again once the drain has ended, at the next list
        if up and not backend.running:
            backend.start()
        elif not up and backend.running:
            self._drains[name] = thread = threading.Thread(
                target=lambda: self.drained.append(backend.drain(self.drain_grace)), name=f"drain-{name}", daemon=True)
            thread.start()

    def _read_pool(self, session: Any, url: str, verify: str) -> None:
        import requests

        try:
            resp = session.get(url, timeout=10, verify=verify)
            resp.raise_for_status()
            conds = (resp.json().get("status") or {}).get("conditions") or []
        except requests.RequestException:
            self.errors += 1
            return
        said = next(((c.get("reason", ""), c.get("message", "")) for c in conds if c.get("type") == "Contended"), ("", ""))
        if not self.pool_said or self.pool_said[-1][1:] != said:
            self.pool_said.append((time.monotonic(), *said))

    def said_between(self, start: float, end: float) -> list[tuple[str, str]]:
        """The pool's Contended (reason, message) pairs in force at some moment of [start, end], in order."""
        return [(reason, message) for i, (t, reason, message) in enumerate(self.pool_said)
                if t <= end and (self.pool_said[i + 1][0] if i + 1 < len(self.pool_said) else math.inf) >= start]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for drain in self._drains.values():
            drain.join(self.drain_grace + 5)


def ask(url: str, model: str, out: Outcome) -> None:
    """One streamed chat completion, classified as tests/e2e/test_accelerator_pool.py does."""
    import requests

    from tests.e2e.pool_world import read_stream

    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    t0 = time.monotonic()
    try:
        with requests.post(f"{url}/v1/chat/completions", json=body, stream=True,
                           timeout=(5, ACTIVATION_TIMEOUT_SECONDS + 60)) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                try:
                    out.kind = str((resp.json().get("error") or {}).get("type", "?"))
                except ValueError:
                    out.kind = "not-json"
            else:
                out.kind = read_stream(resp, out, t0, TOKENS)
    except requests.RequestException as exc:
        out.kind = f"reset ({type(exc).__name__})"
    out.seconds = time.monotonic() - t0


def pool_yields(cluster: Any, pool: str) -> int:
    try:
        text = cluster._hooks_get("/metrics").text
    except Exception:  # noqa: BLE001 - a report, not a check
        return -1
    total = 0.0
    for line in text.splitlines():
        if line.startswith("noctaya_pool_yields_total{") and f'pool="{pool}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def run_config(cluster: Any, config: Config, arrivals: list[Arrival], length: float, log: Any,
               ready_grace: float | None = None) -> Result:
    import yaml

    from tests.e2e.cluster import Timeline
    from tests.e2e.pods import LocalPods
    from tests.e2e.test_scale_from_zero import GATEWAY_PORT, RUNTIME, Model, llmservice

    t_begin = time.monotonic()
    ns = f"bench-day-{config.key}"
    timeline = Timeline()
    cluster.kubectl("create", "namespace", ns)
    nodes = [f"bench-day-{config.key}-n{i + 1}" for i in range(math.ceil(config.gpus / GPUS_PER_NODE))]
    for node in nodes:
        cluster.add_node(node, gpus=GPUS_PER_NODE, labels={NODE_LABEL: config.key})
    runtime = f"bench-day-{config.key}"
    doc = yaml.safe_load(RUNTIME.read_text())
    doc["metadata"] = {"name": runtime}
    doc["spec"]["accelerator"] = {"vendor": "nvidia", "nodeSelector": {NODE_LABEL: config.key}}
    cluster.kubectl("apply", "--server-side", "-f", "-", stdin=yaml.safe_dump(doc))
    pool = f"bench-day-{config.key}"
    if config.pool:
        cluster.kubectl("apply", "--server-side", "-f", "-", stdin=yaml.safe_dump({
            "apiVersion": "serving.noctaya.io/v1alpha1", "kind": "AcceleratorPool", "metadata": {"name": pool},
            "spec": {"resourceName": GPU, "nodeSelector": {NODE_LABEL: config.key}, "yieldAfter": f"{YIELD_AFTER_SECONDS}s"}}))
    models: dict[str, Any] = {}
    poller: Poller | None = None
    result = Result(config)
    try:
        for name in model_names():
            scaling = {"min": config.min_replicas, "max": 1, "cooldownPeriod": f"{COOLDOWN_SECONDS}s",
                       "pollingInterval": POLLING, "activationTimeout": f"{ACTIVATION_TIMEOUT_SECONDS}s"}
            cluster.kubectl("apply", "--server-side", "-f", "-", stdin=llmservice(
                name, ns, runtime={"name": runtime}, scaling=scaling,
                resources={"accelerators": 1, "cpu": "1", "memory": "2Gi"}))
            models[name] = Model(cluster, timeline, name, ns)
            models[name].server.backend.tokens = TOKENS
            models[name].server.backend.stream_delay = TOKEN_DELAY
        for model in models.values():
            model.wait("gateway, backend and ScaledObject created", lambda m=model: all(
                m.get(kind, suffix) is not None
                for kind, suffix in [("deployment", "-gateway"), ("deployment", "-backend"), ("scaledobject", "-backend")]),
                timeout=120)
            gateway_env = {} if ready_grace is None else {"NOCTAYA_READY_GRACE_SECONDS": f"{ready_grace:g}"}
            model.gateways = LocalPods(cluster, ns, f"{model.name}-gateway", env=gateway_env).start(1)
        for model in models.values():
            model.gateways.wait_http(GATEWAY_PORT, timeout=60)
        poller = Poller(cluster, ns, models, pool if config.pool else None).start()
        for model in models.values():
            model.wait_keda_connected()
        if config.min_replicas:
            deadline = time.monotonic() + 180
            while not all(poller.ready.values()):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"min 1: not every backend Ready within 180 s: {poller.ready}")
                time.sleep(0.5)
        else:
            time.sleep(2.0)
            if not poller.lists:
                raise RuntimeError(f"{config.key}: the backend Pod poller never listed Pods ({poller.errors} errors)")
            assert poller.held == 0, f"{config.key}: GPUs held before the day starts"
        setup = time.monotonic() - t_begin
        print(f"[{config.key}] set up in {setup:.0f} s; replaying {len(arrivals)} requests over {length:.0f} s",
              file=log, flush=True)

        outcomes: list[Outcome] = []
        pods_before = len(poller.pods_seen)
        urls = {name: m.gateways.url(0, GATEWAY_PORT) for name, m in models.items()}
        t0 = time.monotonic()
        poller.integrate(True)

        def run(arrival: Arrival, out: Outcome) -> None:
            out.lag = time.monotonic() - (t0 + arrival.t)
            out.cold = not poller.ready[arrival.model]
            ask(urls[arrival.model], arrival.model, out)

        with ThreadPoolExecutor(CLIENT_THREADS, thread_name_prefix=f"client-{config.key}") as pool_exec:
            for arrival in arrivals:
                wait = t0 + arrival.t - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                out = Outcome(arrival.model, arrival.t)
                outcomes.append(out)
                pool_exec.submit(run, arrival, out)
            remaining = t0 + length - time.monotonic()
            if remaining > 0:
                time.sleep(remaining)
            poller.integrate(False)
            result.replay_seconds = time.monotonic() - t0
            print(f"[{config.key}] day replayed; waiting for the last requests", file=log, flush=True)
        result.gpu_seconds = poller.gpu_seconds
        result.poll_errors = poller.errors
        result.drains = poller.drained
        result.pods_started = len(poller.pods_seen) - pods_before
        result.requests = len(outcomes)
        for o in outcomes:
            result.max_lag = max(result.max_lag, o.lag)
            result.cold += o.cold
            if o.status == 200 and o.kind == "complete":
                result.complete += 1
                assert o.first_token is not None
                result.ttft.append(o.first_token)
                if o.cold:
                    result.ttft_cold.append(o.first_token)
            elif o.status == 504 and o.kind == "activation_timeout":
                result.timeouts += 1
                result.timeouts_by_model[o.model] += 1
                if config.pool:
                    sent = t0 + o.planned + o.lag
                    said = poller.said_between(sent, sent + o.seconds)
                    result.timeouts_by_pool_reason[" then ".join(dict.fromkeys(r for r, _ in said))] += 1
                    for holders in dict.fromkeys(m.rsplit("(holders: ", 1)[1].rstrip(")") for _, m in said
                                                 if "(holders: " in m):
                        result.holders_at_timeouts[holders] += 1
            elif o.status == 429:
                result.refused += 1
            if not o.acceptable():
                result.lost.append(f"{o.model} planned {o.planned:.1f}s: {o.status} {o.kind} after {o.seconds:.2f}s")
        if config.pool:
            result.yields = pool_yields(cluster, pool)
    finally:
        if poller is not None:
            poller.stop()
        if config.pool:
            cluster.kubectl("delete", "acceleratorpool", pool, "--ignore-not-found", "--wait=false", check=False)
        cluster.kubectl("-n", ns, "delete", "llmservices", "--all", "--wait=false", check=False)
        for model in models.values():
            model.stop()
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        for node in nodes:
            cluster.kubectl("delete", "node", node, "--ignore-not-found", "--wait=false", check=False)
        cluster.kubectl("delete", "inferenceruntime", runtime, "--ignore-not-found", "--wait=false", check=False)
        # The next configuration starts once this one's namespace is gone (its Pods with it).
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and cluster.get("namespace", ns) is not None:
            time.sleep(1.0)
    result.wall = time.monotonic() - t_begin
    return result


# --- report ------------------------------------------------------------------------------------------


def _fmt(v: float | None) -> str:
    return "—" if v is None else f"{v * 1000:.0f} ms" if v < 1.0 else f"{v:.2f} s"


def _pct(n: int, total: int) -> str:
    return f"{n} ({100.0 * n / total:.1f} %)" if total else str(n)


def _ratio(a: float, b: float) -> str:
    return "—" if not b else f"{a / b:.2f}x"


def report(results: list[Result], length: float) -> str:
    hours = length * COMPRESSION / 3600
    lines = [f"| configuration | accelerator-hours ({hours:.0f} h replayed) | requests | met a cold start | "
             "TTFT p50 / p95 / p99 | cold TTFT p50 / p99 | 504 activation_timeout | 429 | lost | backend Pods started |",
             "|---|---:|---:|---:|---|---|---:|---:|---:|---:|"]
    for r in results:
        ttft = " / ".join(_fmt(percentile(r.ttft, q)) for q in (50, 95, 99))
        cold = " / ".join(_fmt(percentile(r.ttft_cold, q)) for q in (50, 99))
        lines.append(f"| {r.config.title} | {r.accelerator_hours:.1f} | {r.requests} | {_pct(r.cold, r.requests)} | "
                     f"{ttft} | {cold} | {_pct(r.timeouts, r.requests)} | {r.refused} | {len(r.lost)} | {r.pods_started}"
                     f"{f' ({r.yields} yields)' if r.config.pool else ''} |")
    by = {r.config.key: r for r in results}
    notes = []
    if "pool" in by:
        c = by["pool"]
        for other in ("zero", "min1"):
            if other in by:
                o = by[other]
                p99c, p99o = percentile(c.ttft, 99), percentile(o.ttft, 99)
                notes.append(
                    f"(c) vs {o.config.title.split(' ', 1)[0]}: accelerator-hours {_ratio(c.accelerator_hours, o.accelerator_hours)}, "
                    f"activation_timeout {c.timeouts} vs {o.timeouts} "
                    f"({_ratio(c.timeouts / max(c.requests, 1), o.timeouts / max(o.requests, 1))} the rate), "
                    f"cold-start share {_ratio(c.cold / max(c.requests, 1), o.cold / max(o.requests, 1))}, "
                    f"TTFT p99 {_ratio(p99c or 0.0, p99o or 0.0)}")
    for r in results:
        notes.append(f"{r.config.key}: replay {r.replay_seconds:.0f} s, wall {r.wall:.0f} s with set-up and tear-down; "
                     f"client start lag max {r.max_lag:.2f} s; Pod poller errors {r.poll_errors}; "
                     f"backends drained {len(r.drains)}, {sum(d > 0.1 for d in r.drains)} of them answering "
                     f"requests in flight (longest {max(r.drains, default=0):.2f} s)")
        if r.timeouts_by_model:
            notes.append("  activation_timeout per model: "
                         + " ".join(f"{m}={n}" for m, n in sorted(r.timeouts_by_model.items())))
        if r.timeouts_by_pool_reason:
            notes.append("  the pool's Contended reasons while they waited: "
                         + "; ".join(f"{k or '(none read)'}: {n}" for k, n in r.timeouts_by_pool_reason.most_common()))
        for holders, n in r.holders_at_timeouts.most_common(3):
            notes.append(f"  holders it named meanwhile ({n}x): {holders}")
        for lost in r.lost[:10]:
            notes.append(f"  LOST {lost}")
    return "\n".join(lines + [""] + notes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pool_day", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="replay 08:00-16:00 only (96 s per configuration)")
    parser.add_argument("--seed", type=int, default=21)
    parser.add_argument("--only", default="min1,zero,pool", help="configurations, comma-separated (min1,zero,pool)")
    parser.add_argument("--schedule", action="store_true", help="print the schedule's statistics and exit (no cluster)")
    parser.add_argument("--ready-grace", type=float, default=None, metavar="SECONDS",
                        help=f"the gateways' readyGrace (NOCTAYA_READY_GRACE_SECONDS) instead of the rendered "
                             f"{READY_GRACE_SECONDS} s, to scale it like cooldownPeriod")
    args = parser.parse_args(argv)
    keys = [k.strip() for k in args.only.split(",") if k.strip()]
    unknown = [k for k in keys if k not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}: choose from {list(CONFIGS)}")
    start, end, arrivals = window(schedule(args.seed), args.quick)
    length = end - start
    print(f"pool day: {MODELS} models, Zipf s={ZIPF_S}, seed {args.seed}, 1 s = {COMPRESSION / 60:.0f} min, "
          f"replaying {hour_of(start):.0f}:00-{hour_of(end):.0f}:00; cooldownPeriod {COOLDOWN_SECONDS} s, "
          f"yieldAfter {YIELD_AFTER_SECONDS} s, activationTimeout {ACTIVATION_TIMEOUT_SECONDS} s, "
          f"pollingInterval {POLLING}, {CLIENT_THREADS} client threads, readyGrace "
          f"{f'{READY_GRACE_SECONDS} s (rendered)' if args.ready_grace is None else f'{args.ready_grace:g} s (--ready-grace)'}")
    print(describe([Arrival(a.t + start, a.model, a.burst) for a in arrivals], start, end))
    if args.schedule:
        return 0
    t0 = time.monotonic()
    results = []
    with e2e_cluster() as cluster:
        print(f"cluster up in {time.monotonic() - t0:.0f} s", flush=True)
        for key in keys:
            results.append(run_config(cluster, CONFIGS[key], arrivals, length, sys.stdout, args.ready_grace))
            print(report(results[-1:], length), flush=True)
    print(f"\n{report(results, length)}\ntotal {time.monotonic() - t0:.0f} s", flush=True)
    return 1 if any(r.lost for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
