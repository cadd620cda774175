"""The harness of the accelerator-pool e2e modules (tests/e2e/test_accelerator_pool.py,
tests/e2e/test_pool_edges.py): one test's world (a namespace, labelled kwok GPU nodes, runtimes, models
and pools), a Watch that samples it every 0.25 s, and a Client whose every request is classified. The
`world` fixture that makes and cleans up worlds is in tests/e2e/conftest.py.
"""

from __future__ import annotations

import difflib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import pytest
import requests
import yaml

from hooks.resources.gateway import READY_GRACE_SECONDS
from tests.e2e.cluster import Cluster, Timeline
from tests.e2e.pods import stop_together
from tests.e2e.test_lifecycle import conditions
from tests.e2e.test_scale_from_zero import GATEWAY_PORT, RUNTIME, Model, llmservice

POLLING = "1s"
COOLDOWN_SECONDS = 300
YIELD_AFTER_SECONDS = 5
FIRST_BYTE_BUDGET = 20.0  # yield → first token of the waiter, asserted
NODE_LABEL = "e2e.noctaya.io/accpool"  # each test's nodes carry its own value; its pools and runtimes select it
POOLS = "/apis/serving.noctaya.io/v1alpha1/acceleratorpools"
RESOURCES = {"nvidia": "nvidia.com/gpu", "amd": "amd.com/gpu"}


# --- requests ----------------------------------------------------------------------------------------


def read_stream(resp: requests.Response, out: Any, t0: float, tokens: int) -> str:
    """How an SSE chat stream of ``tokens`` words ended: complete, cut or the error frame's type; sets
    ``out.first_token``, ``out.chunks`` and, for a cold stream's timeout, ``out.status`` 504."""
    words: list[str] = []
    event = ""
    for raw in resp.iter_lines():
        line = raw.decode()
        if line.startswith("event:"):
            event = line.split(":", 1)[1].strip()
        elif line.startswith("data:"):
            data = line.split(":", 1)[1].strip()
            if data == "[DONE]":
                out.chunks = len(words)
                return "complete" if words == [f"tok{i}" for i in range(tokens)] else "cut"
            doc = json.loads(data)
            if event == "error" or "error" in doc:
                out.chunks = len(words)
                # A cold stream's timeout is an error frame inside a committed 200: count it as the 504 it stands for.
                kind = str((doc.get("error") or {}).get("type", "error"))
                if kind == "activation_timeout" and not words:
                    out.status = 504
                return kind
            for choice in doc.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    out.first_token = out.first_token if out.first_token is not None else time.monotonic() - t0
                    words.append(content.strip())
    out.chunks = len(words)
    return "cut"


@dataclass
class Outcome:
    model: str
    stream: bool
    status: int = 0
    kind: str = ""  # complete | activation_timeout | queue_full | <other error type> | reset | cut
    first_token: float | None = None  # seconds from sending to the first content token
    seconds: float = 0.0
    chunks: int = 0
    retry: str | None = None  # x-should-retry

    def acceptable(self) -> bool:
        return ((self.status == 200 and self.kind == "complete") or (self.status == 504 and self.kind == "activation_timeout")
                or self.status == 429)

    def __str__(self) -> str:
        first = f", first token {self.first_token:.2f}s" if self.first_token is not None else ""
        return (f"{self.model} {'stream' if self.stream else 'plain'}: {self.status} {self.kind} after {self.seconds:.2f}s"
                f"{first}, {self.chunks} chunk(s)")


class Client:
    """Requests to the models' gateways, each classified; every outcome is kept for the final check."""

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        self.outcomes: list[Outcome] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def ask(self, model: Model, *, stream: bool = True, tokens: int = 5) -> Outcome:
        """One chat completion through the model's gateway; ``tokens`` is what a complete answer has."""
        assert model.gateways is not None
        out = Outcome(model.name, stream)
        body = {"model": model.name, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        t0 = time.monotonic()
        try:
            with requests.post(f"{model.gateways.url(0, GATEWAY_PORT)}/v1/chat/completions", json=body,
                               stream=stream, timeout=(5, 180)) as resp:
                out.status = resp.status_code
                out.retry = resp.headers.get("x-should-retry")
                if resp.status_code != 200:
                    try:
                        out.kind = str((resp.json().get("error") or {}).get("type", "?"))
                    except ValueError:
                        out.kind = "not-json"
                elif not stream:
                    content = resp.json()["choices"][0]["message"]["content"]
                    out.first_token = time.monotonic() - t0
                    out.chunks = len(content.split())
                    out.kind = "complete" if content.split() == [f"tok{i}" for i in range(tokens)] else "cut"
                else:
                    out.kind = read_stream(resp, out, t0, tokens)
        except requests.RequestException as exc:
            out.kind = f"reset ({type(exc).__name__})"
        out.seconds = time.monotonic() - t0
        with self._lock:
            self.outcomes.append(out)
        self.timeline.note(f"request: {out}")
        return out

    def ask_later(self, model: Model, **kwargs: Any) -> threading.Thread:
        thread = threading.Thread(target=self.ask, args=(model,), kwargs=kwargs, daemon=True)
        thread.start()
        self._threads.append(thread)
        return thread

    def join(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.1, deadline - time.monotonic()))

    def check_nothing_lost(self) -> None:
        self.join()
        bad = [str(o) for o in self.outcomes if not o.acceptable()]
        assert not bad, "requests that ended in neither a complete 200, a 504 activation_timeout nor a 429:\n" + \
            "\n".join(bad) + "\n" + self.timeline.text()


# --- observing the world ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PodState:
    name: str
    node: str
    unschedulable: str  # the PodScheduled=False message, "" otherwise
    ready: bool
    deleting: bool

    def short(self) -> str:
        where = self.node or ("Unschedulable" if self.unschedulable else "Pending")
        return f"{self.name[-5:]}@{where}{':Ready' if self.ready else ''}{'(deleting)' if self.deleting else ''}"


@dataclass(frozen=True)
class ModelState:
    replicas: int | None
    generation: int | None
    cooldown: int | None
    active: str
    last_active: str
    pods: tuple[PodState, ...]

    def short(self) -> str:
        return (f"replicas={self.replicas} gen={self.generation} cooldown={self.cooldown} Active={self.active} "
                f"pods=[{' '.join(p.short() for p in self.pods)}]")


@dataclass(frozen=True)
class PoolState:
    resource_version: str
    yielding: tuple[str, ...]  # "<scaledObject> for <pod> on <node>"
    waiting: tuple[str, ...]
    contended: str  # status/reason
    message: str
    accepted: str
    # The whole object as read (metadata without managedFields): a failed "nothing rewritten" check shows
    # which field moved. Not compared.
    raw: str = field(default="", compare=False, repr=False)

    def short(self) -> str:
        return (f"Contended={self.contended} waiting={list(self.waiting)} yielding={list(self.yielding)} "
                f"({self.message[:240]})")


@dataclass
class Sample:
    t: float
    models: dict[str, ModelState]
    pools: dict[str, PoolState | None]


class Watch:
    """Samples the world's models and pools every 0.25 s in a thread; notes each change in the timeline."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watch-{world.key}", daemon=True)
        self._last: dict[str, str] = {}

    def start(self) -> Watch:
        self._thread.start()
        while not self.samples:
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                sample = self.world.sample()
            except requests.RequestException:
                self._stop.wait(0.25)
                continue
            self.samples.append(sample)
            for name, state in [*sample.models.items(), *sample.pools.items()]:
                text = state.short() if state is not None else "absent"
                if self._last.get(name) != text:
                    self._last[name] = text
                    self.world.timeline.note(f"{name}: {text}")
            self._stop.wait(0.25)

    @property
    def last(self) -> Sample:
        return self.samples[-1]

    def first(self, check: Callable[[Sample], bool], after: float = 0.0) -> float | None:
        """When ``check`` first held (monotonic time), at or after ``after``."""
        for s in list(self.samples):
            if s.t >= after and check(s):
                return s.t
        return None

    def wait(self, what: str, check: Callable[[Sample], bool], timeout: float = 60.0) -> float:
        """Until a new sample satisfies ``check``; the monotonic time of that sample."""
        start = time.monotonic()
        seen = len(self.samples)
        while True:
            for s in self.samples[seen:]:
                seen += 1
                if check(s):
                    self.world.timeline.note(f"OK: {what} after {s.t - start:.2f}s")
                    return s.t
            if time.monotonic() - start > timeout:
                for name in ("metacontroller", "keda-operator", "hooks", "kube-scheduler"):
                    self.world.timeline.note(f"{name} log tail:\n{self.world.cluster.log_tail(name, 8)}")
                pytest.fail(f"{what}: not within {timeout}s\n{self.world.timeline.text()}")
            time.sleep(0.1)

    def during(self, since: float) -> list[Sample]:
        return [s for s in list(self.samples) if s.t >= since]


# --- one test's world --------------------------------------------------------------------------------


def _pod_state(pod: dict[str, Any]) -> PodState:
    status = pod.get("status") or {}
    conds = {c["type"]: c for c in status.get("conditions") or []}
    sched = conds.get("PodScheduled") or {}
    return PodState(
        name=pod["metadata"]["name"], node=(pod.get("spec") or {}).get("nodeName") or "",
        unschedulable=str(sched.get("message", "")) if sched.get("status") == "False" else "",
        ready=(conds.get("Ready") or {}).get("status") == "True",
        deleting=bool(pod["metadata"].get("deletionTimestamp")))


def versions_diff(raw_by_version: dict[str, str]) -> str:
    """A unified diff between each consecutive pair of an object's versions as sampled."""
    texts = list(raw_by_version.items())
    out = []
    for (v1, a), (v2, b) in zip(texts, texts[1:], strict=False):
        out.append("\n".join(difflib.unified_diff(a.splitlines(), b.splitlines(), v1, v2, lineterm="", n=1)))
    return "\n".join(out)


def _pool_state(obj: dict[str, Any]) -> PoolState:
    status = obj.get("status") or {}
    conds = {c["type"]: c for c in status.get("conditions") or []}
    contended = conds.get("Contended") or {}
    return PoolState(
        resource_version=obj["metadata"]["resourceVersion"],
        yielding=tuple(f"{y['scaledObject']} for {y['for']} on {y['node']}" for y in status.get("yielding") or []),
        waiting=tuple(w["pod"] for w in status.get("waiting") or []),
        contended=f"{contended.get('status', '?')}/{contended.get('reason', '')}",
        message=str(contended.get("message", "")),
        accepted=f"{(conds.get('Accepted') or {}).get('status', '?')}/{(conds.get('Accepted') or {}).get('reason', '')}",
        raw=json.dumps({**obj, "metadata": {k: v for k, v in obj["metadata"].items() if k != "managedFields"}},
                       sort_keys=True, indent=1))


class World:
    """One test's namespace, labelled GPU nodes, runtimes, models and pools; ``cleanup`` removes them."""

    def __init__(self, cluster: Cluster, timeline: Timeline, key: str) -> None:
        self.cluster, self.timeline, self.key = cluster, timeline, key
        self.ns = f"e2e-pool-{key}"
        self.models: dict[str, Model] = {}
        self.nodes: list[str] = []
        self.pools: list[str] = []
        self.runtimes: list[str] = []
        self.client = Client(timeline)
        self.watch: Watch | None = None
        cluster.kubectl("create", "namespace", self.ns)

    # building

    def node(self, suffix: str, *, gpus: int = 0, amd_gpus: int = 0, labels: dict[str, str] | None = None) -> str:
        name = f"e2e-pool-{self.key}-{suffix}"
        self.nodes.append(name)
        self.cluster.add_node(name, gpus=gpus, amd_gpus=amd_gpus, labels={NODE_LABEL: self.key, **(labels or {})})
        return name

    def runtime(self, vendor: str) -> str:
        """llamacpp-cpu with an accelerator of ``vendor``: the backend requests its GPU resource and runs on
        this test's nodes."""
        name = f"e2e-pool-{self.key}-{vendor}"
        if name not in self.runtimes:
            doc = yaml.safe_load(RUNTIME.read_text())
            doc["metadata"] = {"name": name}
            doc["spec"]["accelerator"] = {"vendor": vendor, "nodeSelector": {NODE_LABEL: self.key}}
            self.cluster.kubectl("apply", "--server-side", "-f", "-", stdin=yaml.safe_dump(doc))
            self.runtimes.append(name)
        return name

    def add_models(self, specs: dict[str, dict[str, Any]]) -> None:
        """name → {vendor, accelerators, scaling}: every LLMService applied first, then each model's local
        gateway and model server started, and KEDA connected to each."""
        for name, spec in specs.items():
            model = Model(self.cluster, self.timeline, name, self.ns)
            self.models[name] = model
            scaling = {"cooldownPeriod": f"{COOLDOWN_SECONDS}s", "pollingInterval": POLLING, "activationTimeout": "60s",
                       **spec.get("scaling", {})}
            extra = {"scheduling": spec["scheduling"]} if "scheduling" in spec else {}
            manifest = llmservice(name, self.ns, runtime={"name": self.runtime(spec.get("vendor", "nvidia"))},
                                  scaling=scaling,
                                  resources={"accelerators": spec.get("accelerators", 1), "cpu": "1", "memory": "2Gi"},
                                  **extra)
            self.cluster.kubectl("apply", "--server-side", "-f", "-", stdin=manifest)
        for model in self.models.values():
            if model.gateways is None:
                model.wait("gateway, backend and ScaledObject created", lambda m=model: all(
                    m.get(kind, suffix) is not None
                    for kind, suffix in [("deployment", "-gateway"), ("deployment", "-backend"), ("scaledobject", "-backend")]))
                model.start_pods()
        for model in self.models.values():
            model.wait_keda_connected()

    def pool(self, resource: str = "nvidia.com/gpu", yield_after: str = f"{YIELD_AFTER_SECONDS}s", name: str = "",
             labels: dict[str, str] | None = None) -> str:
        """``labels``: more node labels the pool selects (a node group), beside this test's own."""
        name = name or f"e2e-pool-{self.key}"
        doc = {"apiVersion": "serving.noctaya.io/v1alpha1", "kind": "AcceleratorPool", "metadata": {"name": name},
               "spec": {"resourceName": resource, "nodeSelector": {NODE_LABEL: self.key, **(labels or {})},
                        "yieldAfter": yield_after}}
        self.cluster.kubectl("apply", "--server-side", "-f", "-", stdin=yaml.safe_dump(doc))
        self.pools.append(name)
        return name

    def start_watch(self) -> Watch:
        self.watch = Watch(self).start()
        return self.watch

    # reading

    def sample(self) -> Sample:
        t = time.monotonic()
        api = self.cluster.api
        selector = "labelSelector=serving.noctaya.io/component=backend"
        pods = api(f"/api/v1/namespaces/{self.ns}/pods?{selector}")["items"]
        deployments = {d["metadata"]["name"]: d for d in
                       api(f"/apis/apps/v1/namespaces/{self.ns}/deployments?{selector}")["items"]}
        scaled = {s["metadata"]["name"]: s for s in api(f"/apis/keda.sh/v1alpha1/namespaces/{self.ns}/scaledobjects")["items"]}
        models = {}
        for name in self.models:
            so = scaled.get(f"{name}-backend") or {}
            dep = deployments.get(f"{name}-backend")
            models[name] = ModelState(
                replicas=None if dep is None else dep["spec"].get("replicas"),
                generation=(so.get("metadata") or {}).get("generation"),
                cooldown=(so.get("spec") or {}).get("cooldownPeriod"),
                active=conditions(so).get("Active", "?") if so else "?",
                last_active=str((so.get("status") or {}).get("lastActiveTime", "")),
                pods=tuple(sorted((_pod_state(p) for p in pods
                                   if p["metadata"]["labels"].get("serving.noctaya.io/llmservice") == name),
                                  key=lambda p: p.name)))
        pools: dict[str, PoolState | None] = {}
        for name in self.pools:
            try:
                pools[f"pool/{name}"] = _pool_state(api(f"{POOLS}/{name}"))
            except requests.HTTPError:
                pools[f"pool/{name}"] = None
        return Sample(t, models, pools)

    def pool_state(self, name: str = "") -> PoolState | None:
        return self.watch.last.pools.get(f"pool/{name or self.pools[0]}") if self.watch else None

    # waiting

    def warm(self, *names: str, gap: float = 2.0) -> None:
        """Each model answered once (cold), in order, ``gap`` seconds apart: the first is the least recently used."""
        for i, name in enumerate(names):
            if i:
                time.sleep(gap)
            out = self.client.ask(self.models[name])
            assert out.kind == "complete", f"warming {name}: {out}\n{self.timeline.text()}"

    def wait_idle(self, *names: str, past_yield_after: bool = True) -> None:
        """Until KEDA says each model is idle (Active=False/ScalerCooldown, the lease over), and, with
        ``past_yield_after``, the wall clock is yieldAfter past each one's lastActiveTime."""
        assert self.watch is not None

        def idle(s: Sample) -> bool:
            return all(s.models[n].active == "False/ScalerCooldown" and s.models[n].last_active for n in names)

        self.watch.wait(f"{', '.join(names)} idle by KEDA", idle, timeout=READY_GRACE_SECONDS + 30)
        if past_yield_after:
            latest = max(epoch_seconds(self.watch.last.models[n].last_active) for n in names)
            time.sleep(max(0.0, latest + YIELD_AFTER_SECONDS + 1 - time.time()))

    def cleanup(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        self.client.join(5)
        for name in self.pools:
            self.cluster.kubectl("delete", "acceleratorpool", name, "--ignore-not-found", "--wait=false", check=False)
        self.cluster.kubectl("-n", self.ns, "delete", "llmservices", "--all", "--wait=false", check=False)
        stop_together(self.models.values())
        self.cluster.kubectl("delete", "namespace", self.ns, "--wait=false", check=False)
        for name in self.nodes:
            self.cluster.kubectl("delete", "node", name, "--ignore-not-found", "--wait=false", check=False)
        for name in self.runtimes:
            self.cluster.kubectl("delete", "inferenceruntime", name, "--ignore-not-found", "--wait=false", check=False)



def epoch_seconds(rfc3339: str) -> float:
    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


def phases(timeline: Timeline, title: str, marks: list[tuple[str, float | None]], t0: float) -> str:
    """One line per phase, seconds after t0 (the cold request); printed and noted in the timeline."""
    text = f"{title}: " + "; ".join(f"{what} {'—' if t is None else f'{t - t0:+.2f}s'}" for what, t in marks)
    timeline.note(text)
    print("\n" + text)
    return text


def unschedulable(name: str, resource: str) -> Callable[[Sample], bool]:
    return lambda s: any(f"Insufficient {resource}" in p.unschedulable for p in s.models[name].pods)


def bound(name: str) -> Callable[[Sample], bool]:
    return lambda s: any(p.node and not p.deleting for p in s.models[name].pods)


def no_pods(name: str) -> Callable[[Sample], bool]:
    return lambda s: not s.models[name].pods


def pool_waits(pool: str) -> Callable[[Sample], bool]:
    return lambda s: bool((s.pools.get(f"pool/{pool}") or PoolState("", (), (), "", "", "")).waiting)


def untouched(watch: Watch, since: float, name: str, before: ModelState) -> None:
    """``name``'s ScaledObject spec (generation), replicas and Pod kept as they were since ``since``."""
    for s in watch.during(since):
        now = s.models[name]
        assert (now.generation, now.replicas, [p.name for p in now.pods]) == \
            (before.generation, before.replicas, [p.name for p in before.pods]), \
            f"{name} changed at {s.t - since:+.2f}s: {before.short()} -> {now.short()}\n{watch.world.timeline.text()}"



def yielded(watch: Watch, pool: str, since: float = 0.0) -> set[str]:
    """Every ScaledObject the pool ever listed as yielding since ``since``."""
    out: set[str] = set()
    for s in watch.during(since):
        state = s.pools.get(f"pool/{pool}")
        out |= {y.split(" ", 1)[0] for y in (state.yielding if state else ())}
    return out


def yielded_now(sample: Sample, pool: str) -> set[str]:
    """The ScaledObjects the pool lists as yielding in one sample."""
    state = sample.pools.get(f"pool/{pool}")
    return {y.split(" ", 1)[0] for y in (state.yielding if state else ())}


def pool_ready(watch: Watch, pool: str) -> None:
    watch.wait(f"pool {pool} Accepted, no waiters", lambda s: (p := s.pools[f"pool/{pool}"]) is not None
               and p.accepted == "True/Accepted" and p.contended == "False/NoWaiters", timeout=30)


def long_stream(model: Model, seconds: int) -> None:
    """From now on the model's server streams ``seconds`` tokens, one a second."""
    model.server.backend.tokens = seconds
    model.server.backend.stream_delay = 1.0

