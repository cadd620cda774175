"""`python -m demo` — scale from zero and back, on one machine, with no cluster.

What runs (all on 127.0.0.1, all real Noctaya code except the clearly labelled stand-in):

1. the hook server (`python -m hooks serve`), asked over HTTP to sync the example LLMService;
2. one gateway (`python -m gateway`) configured from the env of the gateway Deployment the hooks
   rendered (only addresses and demo-sized timings are changed);
3. a STAND-IN FOR KEDA + KUBELET: it opens the gateway's real StreamIsActive gRPC stream, starts a
   small OpenAI-compatible backend (`demo/backend.py`, which "loads" for a few seconds) when the
   stream says active, polls IsActive like KEDA does, and stops the backend after an idle cooldown;
4. a cold request with the real `openai` client, streamed, with a timeline of what happened.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import requests
import yaml

if TYPE_CHECKING:
    from demo.engines import Engine

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_RUNTIME = ROOT / "examples" / "runtimes" / "llamacpp-cpu.yaml"
EXAMPLE_MODEL = ROOT / "examples" / "models" / "scale-to-zero.yaml"
T0 = time.monotonic()
ANSWER_TOKENS = 24  # a random tiny model talks nonsense until its context is full: ask for a few words


def say(who: str, what: str) -> None:
    print(f"[{time.monotonic() - T0:7.3f}s] {who:<10} {what}", flush=True)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports, all held open while they are picked (so none comes twice), from
    below the kernel's ephemeral range: a port the kernel hands out for port 0 is also what it gives
    outgoing connections, and one of those (a health poll, say) can take it between the pick and the
    listener's bind (EADDRINUSE)."""
    high = _ephemeral_low()
    low = max(1024, high - 12000)
    rng = random.Random()
    socks: list[socket.socket] = []
    try:
        for _ in range(2000):
            if len(socks) == count:
                return [s.getsockname()[1] for s in socks]
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", rng.randrange(low, high)))
            except OSError:
                s.close()
                continue
            socks.append(s)
        raise RuntimeError(f"no {count} free ports between {low} and {high}")
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


def wait_http(url: str, timeout: float, ok: tuple[int, ...] = (200,)) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(url, timeout=0.5).status_code in ok:
                return
        except requests.RequestException:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer within {timeout}s")


def first_doc(path: Path, kind: str) -> dict[str, Any]:
    for doc in yaml.safe_load_all(path.read_text()):
        if doc and doc.get("kind") == kind:
            return doc
    raise SystemExit(f"{path}: no {kind} document")


def sync_request(service: dict, runtime: dict) -> dict:
    """A Metacontroller v2 sync request for a fresh LLMService (nothing observed yet)."""
    parent = json.loads(json.dumps(service))
    parent["metadata"].setdefault("namespace", "default")
    parent["metadata"].update(uid="00000000-0000-4000-8000-000000000001", generation=1)
    return {
        "controller": {"metadata": {"name": "noctaya-llmservice"}},
        "parent": parent,
        "children": {
            "Deployment.apps/v1": {},
            "Service.v1": {},
            "Secret.v1": {},
            "PodDisruptionBudget.policy/v1": {},
            "PersistentVolumeClaim.v1": {},
            "Job.batch/v1": {},
        },
        "related": {
            "InferenceRuntime.serving.noctaya.io/v1alpha1": {runtime["metadata"]["name"]: runtime},
            "CustomResourceDefinition.apiextensions.k8s.io/v1": {
                "scaledobjects.keda.sh": {
                    "apiVersion": "apiextensions.k8s.io/v1",
                    "kind": "CustomResourceDefinition",
                    "metadata": {"name": "scaledobjects.keda.sh"},
                }
            },
            "Pod.v1": {},
        },
        "finalizing": False,
    }


class Processes:
    """Child processes of the demo; all are stopped on exit. Each one's stderr goes to a file (a
    pipe nobody reads would block a chatty process once its buffer is full), shown when it fails."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.logdir = Path(tempfile.mkdtemp(prefix="noctaya-demo-logs-"))
        self.logs: dict[int, Path] = {}

    def start(self, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        log = self.logdir / f"{len(self.procs)}-{args[1] if len(args) > 1 else args[0]}.log"
        with open(log, "wb") as sink:
            proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=full_env, stdout=subprocess.DEVNULL,
                                    stderr=sink)
        self.procs.append(proc)
        self.logs[proc.pid] = log
        return proc

    def log_tail(self, proc: subprocess.Popen, lines: int = 20) -> str:
        path = self.logs.get(proc.pid)
        text = path.read_text(errors="replace") if path is not None and path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, proc: subprocess.Popen, url: str, timeout: float) -> None:
        """wait_http, saying what the process said if it does not come up."""
        try:
            wait_http(url, timeout)
        except TimeoutError:
            state = f"exited {proc.returncode}" if proc.poll() is not None else "still running"
            raise SystemExit(f"{url} did not answer within {timeout}s ({state}); its stderr:\n"
                             f"{self.log_tail(proc)}") from None

    @staticmethod
    def stop(proc: subprocess.Popen, timeout: float = 10.0) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            self.stop(proc)
        shutil.rmtree(self.logdir, ignore_errors=True)


class KedaKubeletStandIn:
    """STAND-IN for KEDA + kubelet: scale 0→1 on a pushed `true`, 1→0 after idle cooldown.

    Like KEDA, it trusts the pushed stream for activation and the polled IsActive for scale-in.
    "Scaling to 1" here means starting the demo backend process; "to 0" means stopping it.
    """

    def __init__(self, procs: Processes, scaler_addr: str, backend_url: str, engine: Engine, cooldown: float,
                 poll: float) -> None:
        from scaler import externalscaler_pb2 as pb
        from scaler import externalscaler_pb2_grpc as pb_grpc

        self.pb = pb
        self.channel = grpc.insecure_channel(scaler_addr)
        self.stub = pb_grpc.ExternalScalerStub(self.channel)
        self.ref = pb.ScaledObjectRef(name="demo", namespace="default", scalerMetadata={"scalerAddress": scaler_addr})
        self.procs = procs
        self.backend_url = backend_url
        self.engine = engine
        self.cooldown = cooldown
        self.poll = poll
        self.backend: Callable[[], None] | None = None  # stops the running engine
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.scaled_to_zero = threading.Event()
        self.activated_at: float | None = None
        # What a kubelet would write on the backend Pod (RFC 3339): created, started, Ready.
        self.pod_times: dict[str, str] = {}

    def start(self) -> None:
        threading.Thread(target=self._watch_stream, daemon=True).start()
        threading.Thread(target=self._poll_is_active, daemon=True).start()

    def _scale_up(self) -> None:
        with self.lock:
            if self.backend is not None:
                return
            say("stand-in", f"scaling backend 0 → 1 (starting {self.engine.describe()})")
            self.pod_times = {"created": wall_clock()}
            self.backend = self.engine.start()
            self.pod_times["started"] = wall_clock()
            self.scaled_to_zero.clear()
        threading.Thread(target=self._report_ready, daemon=True).start()

    def _report_ready(self) -> None:
        """The readiness probe, saying each change of /health's answer (the engine's load phase)."""
        started, last = time.monotonic(), None
        while time.monotonic() - started < 60:
            try:
                code: int | str = requests.get(f"{self.backend_url}/health", timeout=2).status_code
            except requests.RequestException:
                code = "refused"
            if code != last:
                say("backend", f"/health → {code}" + (" (Ready)" if code == 200 else ""))
                last = code
            if code == 200:
                self.pod_times["ready"] = wall_clock()
                return
            time.sleep(0.05)
        say("backend", "did not become ready")

    def _watch_stream(self) -> None:
        while not self.stopped.is_set():
            try:
                for msg in self.stub.StreamIsActive(self.ref):
                    if msg.result:
                        if self.activated_at is None:
                            self.activated_at = time.monotonic()
                            say("stand-in", "StreamIsActive pushed true")
                        self._scale_up()
            except grpc.RpcError as err:
                if self.stopped.is_set():
                    return
                say("stand-in", f"stream ended ({err.code().name}); reconnecting in 1s")
                time.sleep(1)

    def _poll_is_active(self) -> None:
        inactive_since: float | None = None
        while not self.stopped.wait(self.poll):
            try:
                active = self.stub.IsActive(self.ref, timeout=2).result
            except grpc.RpcError:
                continue
            now = time.monotonic()
            if active:
                inactive_since = None
                continue
            inactive_since = inactive_since or now
            with self.lock:
                if self.backend is not None and now - inactive_since >= self.cooldown:
                    say("stand-in", f"IsActive false for {self.cooldown:.0f}s (cooldown): scaling backend 1 → 0")
                    self.backend()
                    self.backend = None
                    self.activated_at = None
                    self.scaled_to_zero.set()

    def close(self) -> None:
        self.stopped.set()
        self.channel.close()


def wall_clock() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def backend_pod(name: str, times: dict[str, str], namespace: str = "default") -> dict:
    """The backend Pod as the stand-in kubelet would report it: bound at once (one node, nothing to
    pull), the engine started, Ready when /health passed."""
    created, started, ready = times["created"], times["started"], times["ready"]
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{name}-backend-demo", "namespace": namespace, "creationTimestamp": created,
                     "labels": {"serving.noctaya.io/llmservice": name, "serving.noctaya.io/component": "backend"}},
        "status": {"phase": "Running", "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": created},
            {"type": "Initialized", "status": "True", "lastTransitionTime": created},
            {"type": "Ready", "status": "True", "lastTransitionTime": ready}],
            "containerStatuses": [{"name": "engine", "ready": True, "restartCount": 0, "started": True,
                                   "state": {"running": {"startedAt": started}}}]},
    }


def cold_start_in_status(hooks_url: str, service: dict, runtime: dict, answer: dict, times: dict[str, str]) -> dict:
    """Ask the hook server for the status of the world after the cold start: first with the backend
    asked for and no Pod yet (the phase the status was in), then with the Ready Pod. ``answer`` holds
    the backend Deployment (with a prewarmed model: the answer once its Job completed)."""
    namespace = service["metadata"].get("namespace", "default")
    backend = next(c for c in answer["children"] if c["kind"] == "Deployment"
                   and c["metadata"]["labels"].get("serving.noctaya.io/component") == "backend")
    observed = {**backend, "spec": {**backend["spec"], "replicas": 1}, "status": {"replicas": 1}}
    jobs = {f"{namespace}/{c['metadata']['name']}": {**c, "status": {
        "succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}} for c in answer["children"] if c["kind"] == "Job"}
    status = answer["status"]
    for pods in ([], [backend_pod(service["metadata"]["name"], times, namespace)]):
        request = sync_request({**service, "status": status}, runtime)
        request["children"]["Deployment.apps/v1"] = {f"{namespace}/{backend['metadata']['name']}": observed}
        request["children"]["Job.batch/v1"] = jobs
        request["related"]["Pod.v1"] = {f"{namespace}/{p['metadata']['name']}": p for p in pods}
        resp = requests.post(f"{hooks_url}/v1/llmservice/sync", json=request, timeout=10)
        resp.raise_for_status()
        status = resp.json()["status"]
    return status


def gateway_phases(admin_url: str) -> dict[str, float]:
    """Per-phase means of the gateway's activation histograms (one activation here: its values)."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in requests.get(f"{admin_url}/metrics", timeout=5).text.splitlines():
        for family, label in (("noctaya_gateway_activation_phase_seconds", "phase"),
                              ("noctaya_gateway_time_to_first_token_seconds", "start")):
            for kind, into in (("_sum{", sums), ("_count{", counts)):
                prefix = family + kind + label + '="'
                if line.startswith(prefix):
                    key, _, value = line[len(prefix):].partition('"} ')
                    into[key] = float(value)
    return {k: sums[k] / counts[k] for k in sums if counts.get(k)}


def render_through_hooks(procs: Processes, service: dict, runtime: dict) -> tuple[dict, str]:
    """The hooks' answer for the example, and the hook server's URL (it keeps running)."""
    port = free_port()
    hooks = procs.start(["-m", "hooks", "serve", "--bind", f"127.0.0.1:{port}", "--workers", "1"])
    procs.wait_ready(hooks, f"http://127.0.0.1:{port}/healthz", timeout=30)
    say("hooks", f"hook server up on :{port}; POST /v1/llmservice/sync for {service['metadata']['name']}")
    resp = requests.post(f"http://127.0.0.1:{port}/v1/llmservice/sync", json=sync_request(service, runtime), timeout=10)
    resp.raise_for_status()
    answer = resp.json()
    for child in answer["children"]:
        replicas = child.get("spec", {}).get("replicas") if child["kind"] == "Deployment" else None
        note = f"  (spec.replicas {replicas})" if replicas is not None else ""
        say("hooks", f"  child {child['kind']}/{child['metadata']['name']}{note}")
    for cond in answer["status"].get("conditions", []):
        say("hooks", f"  condition {cond['type']}={cond['status']} ({cond['reason']})")
    return answer, f"http://127.0.0.1:{port}"


def gateway_env(answer: dict) -> dict[str, str]:
    for child in answer["children"]:
        if child["kind"] == "Deployment" and child["metadata"]["labels"].get("serving.noctaya.io/component") == "gateway":
            container = child["spec"]["template"]["spec"]["containers"][0]
            return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    raise SystemExit("the hooks rendered no gateway Deployment")


def print_breakdown(hooks_url: str, answer: dict, service: dict, runtime: dict, times: dict[str, str],
                    admin_url: str) -> None:
    """The cold start, broken down: the gateway's half from its histograms, the backend Pod's half as
    the hooks put it in status.lastColdStart (from the Pod timestamps the stand-in kubelet wrote)."""
    phases = gateway_phases(admin_url)
    say("gateway", "cold start as the gateway timed it: "
        + ", ".join(f"{name.replace('_to_', ' → ').replace('_', ' ')} {phases[name]:.3f}s"
                    for name in ("admission_to_push", "push_to_ready", "ready_to_first_byte") if name in phases)
        + (f"; time to first token {phases['cold']:.2f}s" if "cold" in phases else ""))
    if {"created", "started", "ready"} <= times.keys():
        status = cold_start_in_status(hooks_url, service, runtime, answer, times)
        record = status.get("lastColdStart") or {}
        say("hooks", "status.lastColdStart (kubectl get llmservice: LAST COLD START "
            f"{record.get('total', '?')}): " + ", ".join(
                f"{k} {record[k]}" for k in ("scheduling", "initialization", "weightsWait", "imagePull", "modelLoad", "total")
                if k in record))


def main() -> int:
    parser = argparse.ArgumentParser(description="Local scale-from-zero demo (no cluster needed).")
    parser.add_argument("--cooldown", type=float, default=6.0, help="idle seconds before scale to zero")
    parser.add_argument("--load-seconds", type=float, default=3.0, help="the stand-in engine's simulated load time")
    parser.add_argument("--engine", choices=("auto", "standin", "llamacpp"), default="auto",
                        help="the engine to wake: llama.cpp's llama-server with a tiny real model (built by the "
                        "test set-up; 'llamacpp' builds it if need be), the stand-in demo/backend.py, or 'auto': "
                        "the real one when it is built")
    args = parser.parse_args()

    from demo.engines import StandInEngine, choose

    service = first_doc(EXAMPLE_MODEL, "LLMService")
    runtime = first_doc(EXAMPLE_RUNTIME, "InferenceRuntime")
    service["spec"]["runtime"] = {"name": runtime["metadata"]["name"]}
    procs = Processes()
    standin: KedaKubeletStandIn | None = None
    workdir = Path(tempfile.mkdtemp(prefix="noctaya-demo-engine-"))
    try:
        gw_port, scaler_port, backend_port, admin_port = free_ports(4)
        engine = choose(args.engine, procs, backend_port, str(service["spec"]["model"].get("servedName")
                        or service["metadata"]["name"]), workdir, say, args.load_seconds)
        if not isinstance(engine, StandInEngine):
            service, runtime = engine.service, engine.runtime
        say("demo", f"engine: {engine.name}")
        answer, hooks_url = render_through_hooks(procs, service, runtime)
        env = gateway_env(answer)
        model = env["NOCTAYA_SERVED_MODEL_NAME"]
        env.update(
            NOCTAYA_LISTEN_PORT=str(gw_port),
            NOCTAYA_ADMIN_PORT=str(admin_port),
            NOCTAYA_SCALER_PORT=str(scaler_port),
            NOCTAYA_BACKEND_URL=engine.backend_url,
            # Demo-sized timings: a short grace so the lease ends soon after the answer.
            NOCTAYA_READY_GRACE_SECONDS="1",
            NOCTAYA_HEARTBEAT_SECONDS="1",
        )
        say("gateway", f"starting with the rendered env (backend {env['NOCTAYA_BACKEND_URL']}, "
            f"maxQueue {env['NOCTAYA_MAX_QUEUE']}, mode {env['NOCTAYA_COLD_MODE']})")
        gateway = procs.start(["-m", "gateway"], env=env)
        procs.wait_ready(gateway, f"http://127.0.0.1:{gw_port}/healthz", timeout=30)
        standin = KedaKubeletStandIn(procs, f"127.0.0.1:{scaler_port}", engine.backend_url, engine,
                                     cooldown=args.cooldown, poll=1.0)
        standin.start()
        time.sleep(0.5)

        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gw_port}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        say("client", f"GET /v1/models while cold → {[m.id for m in client.models.list().data]} "
            "(answered by the gateway; no GPU woken)")
        say("client", "sending a cold streamed chat completion")
        sent = time.monotonic()
        first: float | None = None
        text = []
        for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "wake up and say hello"}], stream=True,
            max_tokens=ANSWER_TOKENS,
        ):
            if first is None:
                first = time.monotonic()
                say("client", f"first token after {first - sent:.2f}s")
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
        say("client", f"answer: {''.join(text)[:120]!r} (from {engine.name})")
        cold_start = dict(standin.pod_times)
        queue = requests.get(f"http://127.0.0.1:{admin_port}/noctaya/queue", timeout=2).json()
        say("gateway", f"/noctaya/queue → {json.dumps(queue)}")
        say("client", "warm request (non-streamed)")
        warm_start = time.monotonic()
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "again"}],
                                               max_tokens=ANSWER_TOKENS)
        say("client", f"warm answer in {1000 * (time.monotonic() - warm_start):.0f} ms: "
            f"{(reply.choices[0].message.content or '')[:120]!r}")
        say("demo", f"idle now; waiting for the lease to end and {args.cooldown:.0f}s of cooldown")
        if not standin.scaled_to_zero.wait(60 + args.cooldown):
            say("demo", "backend did not scale to zero in time")
            return 1
        queue = requests.get(f"http://127.0.0.1:{admin_port}/noctaya/queue", timeout=2).json()
        say("gateway", f"/noctaya/queue → lease {queue['lease']['state']}, demand {json.dumps(queue['demand'])}")
        models = [m.id for m in client.models.list().data]
        say("client", f"GET /v1/models at zero → {models} (the gateway still answers; nothing woke)")
        say("demo", f"scaled back to zero: the accelerator is free (engine: {engine.name})")
        print_breakdown(hooks_url, getattr(engine, "rendered", answer), service, runtime, cold_start,
                        f"http://127.0.0.1:{admin_port}")
        return 0
    finally:
        if standin is not None:
            standin.close()
            if standin.backend is not None:
                standin.backend()
        procs.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
