"""Idle footprint of a gateway Pod (issue 22): memory and CPU of the whole process tree while nothing
happens, for a per-model gateway and for a shared gateway fronting 1, 10 and 100 models, against a
minimal Python process measured in the same windows.

The per-model gateway runs as the rendered gateway Deployment runs it: ``python -m gateway`` with the
env the hooks render for ``examples/models/scale-to-zero.yaml`` (only addresses are changed:
127.0.0.1, free ports, a backend URL on a closed port, since the backend is scaled to zero) and the
container's resources as its cgroup (``NOCTAYA_CGROUP_ROOT`` points at files saying: no CPU limit,
the rendered memory limit), so it picks one worker and the held-body budget a Pod gets.

A shared gateway runs as the hooks render an LLMGateway fronting N copies of that example (each
naming the gateway in ``spec.endpoint.gateway``): its Deployment's env and resources, and the routing
table of its ConfigMap, written to a file (``NOCTAYA_MODEL_TABLE_FILE``), each entry's backend on its
own closed port.

Every configuration runs side by side in the same windows (a burst of load elsewhere hits all alike;
PSS is lower than alone since the processes share library pages). After each answers ``/healthz``
they settle, then two windows of N seconds each are sampled:

- **quiet**: nothing talks to the gateways;
- **as deployed**: what talks to an idle Pod in a cluster: KEDA holding one ``StreamIsActive``
  stream per ScaledObject and calling ``IsActive`` + ``GetMetrics`` for each every
  ``pollingInterval`` of the rendered ScaledObject (a shared gateway's N ScaledObjects name their
  model in the trigger metadata, share one HTTP/2 connection as KEDA's connection pool does, and are
  polled at phases spread over the interval), and the kubelet's readiness and liveness probes
  (``GET /healthz`` on the admin port, once per Pod) at their rendered periods.

Per window: RSS, PSS and USS (``/proc/<pid>/smaps_rollup``; medians of 1 s samples) summed over the
process tree, the number of processes and threads, CPU per wall second (utime + stime from
``/proc/<pid>/stat``, 10 ms ticks, and the scheduler's nanosecond run time from
``/proc/<pid>/task/*/schedstat``) and wake-ups per second (context switches of every thread). The
baseline is ``python -c`` sleeping, sampled in the same windows: the interpreter's floor.

Run: .venv/bin/python -m bench.idle_footprint [--quick] [--seconds N] [--models 1,10,100] [--threads]
[--tree PATH ...]

``--tree PATH`` also runs the per-model gateway of another checkout (e.g. a ``git worktree`` of an
older commit) side by side in the same windows, for before/after comparisons on a shared machine.
``--check`` exits 1 when a target is missed: a per-model Pod <= 40 MiB RSS and <= 0.5 ms CPU per
second idle; a shared gateway fronting 100 models < 2x a per-model Pod's RSS and CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import heapq
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RUNTIME_EXAMPLE = ROOT / "examples/runtimes/vllm-nvidia.yaml"
MODEL_EXAMPLE = ROOT / "examples/models/scale-to-zero.yaml"
GOAL_RSS_MIB = 40.0
GOAL_CPU_MS_PER_S = 0.5
SETTLE_SECONDS = 5.0
WAKER = "baseline: python waking 1/s"
PER_MODEL = "per-model gateway"
SHARED_GOAL_MODELS = 100
SHARED_GOAL_RATIO = 2.0  # a shared gateway fronting SHARED_GOAL_MODELS costs less than this x one per-model Pod
TICK = os.sysconf("SC_CLK_TCK")
MiB = 1024 * 1024


# -- the rendered Pod ---------------------------------------------------------------------------------
def rendered() -> tuple[dict[str, Any], dict[str, Any]]:
    """(gateway container, ScaledObject spec) the hooks render for the scale-to-zero example."""
    import yaml

    from hooks.render import render_documents

    documents = []
    for path in (RUNTIME_EXAMPLE, MODEL_EXAMPLE):
        documents += [d for d in yaml.safe_load_all(path.read_text()) if d]
    container = scaled = None
    for child in render_documents(documents):
        if child["kind"] == "Deployment" and child["metadata"]["name"].endswith("-gateway"):
            (container,) = [c for c in child["spec"]["template"]["spec"]["containers"] if c["name"] == "gateway"]
        elif child["kind"] == "ScaledObject":
            scaled = child["spec"]
    if container is None or scaled is None:
        raise SystemExit("the hooks rendered no gateway Deployment or ScaledObject")
    return container, scaled


def quantity_bytes(value: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "K": 10**3, "M": 10**6, "G": 10**9}
    for suffix, factor in units.items():
        if value.endswith(suffix):
            return int(float(value[: -len(suffix)]) * factor)
    return int(value)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the gateway exited {proc.returncode} before answering /healthz")
        with contextlib.suppress(OSError):
            if http_get(port, "/healthz") == 200:
                return
        time.sleep(0.1)
    raise SystemExit("the gateway did not answer /healthz in time")


def http_get(port: int, path: str, timeout: float = 2.0) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def rendered_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def closed_backend() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there: the backend is scaled to zero


def rendered_shared(models: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(shared gateway container, model table) the hooks render for an LLMGateway fronting ``models``:
    each a copy of the scale-to-zero example naming the gateway, each table entry with its own closed
    backend port."""
    import copy

    import yaml

    from hooks.render import render_documents

    documents = [d for d in yaml.safe_load_all(RUNTIME_EXAMPLE.read_text()) if d]
    (example,) = [d for d in yaml.safe_load_all(MODEL_EXAMPLE.read_text()) if d]
    for name in models:
        member = copy.deepcopy(example)
        member["metadata"]["name"] = name
        member["spec"]["model"]["servedName"] = name
        member["spec"]["endpoint"] = {**member["spec"].get("endpoint", {}), "gateway": "bench"}
        documents.append(member)
    documents.append({"apiVersion": "serving.noctaya.io/v1alpha1", "kind": "LLMGateway",
                      "metadata": {"name": "bench"}, "spec": {}})
    container = table = None
    for child in render_documents(documents):
        if child["kind"] == "Deployment" and child["metadata"]["name"] == "bench-llmgw":
            (container,) = child["spec"]["template"]["spec"]["containers"]
        elif child["kind"] == "ConfigMap":
            table = json.loads(child["data"]["models.json"])
    if container is None or table is None:
        raise SystemExit("the hooks rendered no shared gateway Deployment or routing table")
    for entry in table["models"]:
        entry["backendURL"] = closed_backend()
    return container, table


class GatewayPod:
    """`python -m gateway` of ``tree`` with the rendered env, on loopback, backends at zero: a per-model
    gateway, or with ``models`` > 0 a shared gateway fronting that many models."""

    def __init__(self, tree: Path, container: dict[str, Any], label: str, models: int = 0) -> None:
        self.label = label
        self.models = [f"model-{i:03d}" for i in range(1, models + 1)]
        self.port, self.admin_port, self.scaler_port = free_port(), free_port(), free_port()
        if self.models:  # the shared gateway's own rendered container (resources, env) and its table
            container, shared_table = rendered_shared(self.models)
        self._scratch = tempfile.TemporaryDirectory(prefix="noctaya-idle-")
        cgroup = Path(self._scratch.name, "cgroup")
        cgroup.mkdir()
        limit = container.get("resources", {}).get("limits", {}).get("memory")
        (cgroup / "cpu.max").write_text("max 100000\n")  # the rendered Pod has no CPU limit
        (cgroup / "memory.max").write_text(f"{quantity_bytes(limit)}\n" if limit else "max\n")
        pod_env = rendered_env(container)
        if self.models:
            table = Path(self._scratch.name, "models.json")
            table.write_text(json.dumps(shared_table))
            pod_env["NOCTAYA_MODEL_TABLE_FILE"] = str(table)
        else:
            pod_env["NOCTAYA_BACKEND_URL"] = closed_backend()
        env = {k: v for k, v in os.environ.items() if not k.startswith("NOCTAYA_")}
        env.update(pod_env)
        env.update({
            "NOCTAYA_LISTEN_HOST": "127.0.0.1", "NOCTAYA_LISTEN_PORT": str(self.port),
            "NOCTAYA_ADMIN_PORT": str(self.admin_port), "NOCTAYA_SCALER_PORT": str(self.scaler_port),
            "NOCTAYA_CGROUP_ROOT": str(cgroup), "PYTHONPATH": str(tree),
        })
        command = container["command"]
        assert command[0] == "python", command
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, *command[1:]], cwd=tree, env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.admin_port, self.proc)
        except BaseException:
            self.log.seek(0)
            sys.stderr.write(f"[{label}] {self.log.read()[-2000:].decode(errors='replace')}\n")
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(45)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._scratch.cleanup()


class Kubelet:
    """What talks to an idle gateway Pod in a cluster. KEDA, per ScaledObject (one for a per-model
    gateway, one per model for a shared one): a StreamIsActive stream held open, IsActive + GetMetrics
    every pollingInterval. The kubelet: the Pod's two /healthz probes. One HTTP/2 connection carries
    every ScaledObject's calls (KEDA pools its connections by scaler address); their polls are spread
    over the interval, as ScaledObjects reconciled at different times are."""

    def __init__(self, pod: GatewayPod, container: dict[str, Any], scaled: dict[str, Any]) -> None:
        import grpc

        from scaler import externalscaler_pb2 as pb
        from scaler import externalscaler_pb2_grpc as pb_grpc

        self._stop = threading.Event()
        self.errors = self.calls = self.streams_lost = 0
        self.requests = 0  # RPCs and probes answered
        self.channel = grpc.insecure_channel(f"127.0.0.1:{pod.scaler_port}")
        grpc.channel_ready_future(self.channel).result(timeout=30)
        stub = pb_grpc.ExternalScalerStub(self.channel)
        refs = [pb.ScaledObjectRef(name=m, namespace="bench", scalerMetadata={"model": m}) for m in pod.models]
        refs = refs or [pb.ScaledObjectRef(name="idle", namespace="bench", scalerMetadata={})]
        metric = rendered_env(container)["NOCTAYA_METRIC_NAME"]
        self._streams = [stub.StreamIsActive(ref) for ref in refs]
        polling = float(scaled.get("pollingInterval", 30))

        def keda_poll(ref: Any) -> int:
            stub.IsActive(ref, timeout=5)
            stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref, metricName=metric), timeout=5)
            return 2

        def probe() -> int:
            if http_get(pod.admin_port, "/healthz") != 200:
                raise RuntimeError("probe failed")
            return 1

        # (period, first call after, call): the first poll of a lone ScaledObject comes one period in.
        jobs = [(polling, polling * (i + 1) / len(refs), functools.partial(keda_poll, ref))
                for i, ref in enumerate(refs)]
        for name in ("readinessProbe", "livenessProbe"):
            period = float(container[name].get("periodSeconds", 10))
            jobs.append((period, period, probe))
        self._threads = [threading.Thread(target=self._drain, args=(s,), daemon=True) for s in self._streams]
        self._threads.append(threading.Thread(target=self._schedule, args=(jobs,), daemon=True))
        for thread in self._threads:
            thread.start()

    def _drain(self, stream: Any) -> None:
        with contextlib.suppress(Exception):
            for _ in stream:
                pass
        if not self._stop.is_set():
            self.streams_lost += 1

    def _schedule(self, jobs: list[tuple[float, float, Any]]) -> None:
        start = time.monotonic()
        due = [(start + first, i, period, call) for i, (period, first, call) in enumerate(jobs)]
        heapq.heapify(due)
        while not self._stop.wait(max(0.0, due[0][0] - time.monotonic())):
            at, i, period, call = due[0]
            heapq.heapreplace(due, (at + period, i, period, call))
            try:
                self.requests += call()
                self.calls += 1
            except Exception:  # noqa: BLE001 - counted, reported
                self.errors += 1

    def stop(self) -> None:
        self._stop.set()
        for stream in self._streams:
            stream.cancel()
        self.channel.close()


# -- /proc -------------------------------------------------------------------------------------------
def children_of() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as fh:
                    ppid = int(fh.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            out.setdefault(ppid, []).append(int(entry))
    return out


def tree(pid: int) -> list[int]:
    kids = children_of()
    found, frontier = [pid], [pid]
    while frontier:
        frontier = [c for p in frontier for c in kids.get(p, [])]
        found += frontier
    return found


def role(pid: int, root: int, alone: bool) -> str:
    if pid == root:
        if not pid_cmd(pid).endswith("-m gateway"):
            return "python -c sleep"
        return "gateway" if alone else "supervisor"
    return "scaler child" if " scaler " in f" {pid_cmd(pid)} " else "worker"


def pid_cmd(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    parts = raw.rstrip(b"\0").split(b"\0")
    return " ".join(p.decode(errors="replace") for p in parts[1:])


def smaps_kib(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) == 3 and parts[2] == "kB":
                    out[parts[0].rstrip(":")] = int(parts[1])
    except OSError:
        pass
    return out


@dataclass
class CpuSample:
    ticks: int = 0  # utime + stime of the process (all its threads)
    run_ns: int = 0  # schedstat run time summed over its threads
    switches: int = 0  # voluntary + involuntary context switches summed over its threads
    threads: dict[int, tuple[str, int, int]] = field(default_factory=dict)  # tid -> (comm, run_ns, switches)


def cpu_sample(pid: int) -> CpuSample:
    sample = CpuSample()
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        sample.ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
        tids = os.listdir(f"/proc/{pid}/task")
    except (OSError, IndexError, ValueError):
        return sample
    for tid in tids:
        base = f"/proc/{pid}/task/{tid}"
        try:
            run_ns = int(Path(f"{base}/schedstat").read_text().split()[0])
            switches = 0
            for line in Path(f"{base}/status").read_text().splitlines():
                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                    switches += int(line.split()[1])
            comm = Path(f"{base}/comm").read_text().strip()
        except (OSError, ValueError, IndexError):
            continue
        sample.run_ns += run_ns
        sample.switches += switches
        sample.threads[int(tid)] = (comm, run_ns, switches)
    return sample


@dataclass
class ProcessResult:
    pid: int
    role: str
    rss: list[int] = field(default_factory=list)  # KiB per sample
    pss: list[int] = field(default_factory=list)
    uss: list[int] = field(default_factory=list)
    start: CpuSample | None = None
    end: CpuSample | None = None

    def median(self, name: str) -> float:
        values = getattr(self, name)
        return statistics.median(values) if values else 0.0


class Window:
    """Samples a set of process trees for ``seconds`` (memory every second, CPU at both ends)."""

    def __init__(self, roots: dict[str, int], seconds: float) -> None:
        self.roots = roots
        self.seconds = seconds
        self.processes: dict[str, list[ProcessResult]] = {}
        self.elapsed = 0.0

    def run(self) -> Window:
        for label, root in self.roots.items():
            pids = tree(root)
            self.processes[label] = [ProcessResult(pid, role(pid, root, len(pids) == 1)) for pid in pids]
        for results in self.processes.values():
            for r in results:
                r.start = cpu_sample(r.pid)
        t0 = time.monotonic()
        deadline = t0 + self.seconds
        while True:
            for results in self.processes.values():
                for r in results:
                    m = smaps_kib(r.pid)
                    r.rss.append(m.get("Rss", 0))
                    r.pss.append(m.get("Pss", 0))
                    r.uss.append(m.get("Private_Clean", 0) + m.get("Private_Dirty", 0))
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(1.0, left))
        self.elapsed = time.monotonic() - t0
        for results in self.processes.values():
            for r in results:
                r.end = cpu_sample(r.pid)
        return self

    # -- figures
    def cpu_ms_per_s(self, r: ProcessResult, precise: bool = True) -> float:
        assert r.start is not None and r.end is not None
        if precise:
            return (r.end.run_ns - r.start.run_ns) / 1e6 / self.elapsed
        return (r.end.ticks - r.start.ticks) * 1000.0 / TICK / self.elapsed

    def wakeups_per_s(self, r: ProcessResult) -> float:
        assert r.start is not None and r.end is not None
        return (r.end.switches - r.start.switches) / self.elapsed

    def thread_rows(self, r: ProcessResult) -> list[tuple[str, float, float]]:
        assert r.start is not None and r.end is not None
        rows = []
        for tid, (comm, run_ns, switches) in r.end.threads.items():
            _, run0, sw0 = r.start.threads.get(tid, (comm, 0, 0))
            rows.append((f"{comm} ({tid})", (run_ns - run0) / 1e6 / self.elapsed, (switches - sw0) / self.elapsed))
        return sorted(rows, key=lambda row: -row[2])


def mib(kib: float) -> float:
    return kib / 1024.0


def report(name: str, window: Window, show_threads: bool) -> dict[str, dict[str, float]]:
    print(f"\n[{name}] {window.elapsed:.1f} s sampled; load average {os.getloadavg()[0]:.2f} at its end")
    header = (f"  {'process':<34} {'procs':>5} {'thr':>4} {'RSS MiB':>8} {'PSS MiB':>8} {'USS MiB':>8}"
              f" {'CPU ms/s':>9} {'(ticks)':>8} {'wakeups/s':>9}")
    print(header)
    totals: dict[str, dict[str, float]] = {}
    for label, results in window.processes.items():
        total = {"procs": 0.0, "threads": 0.0, "rss": 0.0, "pss": 0.0, "uss": 0.0, "cpu": 0.0, "ticks": 0.0, "wakeups": 0.0}
        for r in results:
            threads = len(r.end.threads) if r.end else 0
            cpu, ticks, wake = window.cpu_ms_per_s(r), window.cpu_ms_per_s(r, precise=False), window.wakeups_per_s(r)
            rss, pss, uss = mib(r.median("rss")), mib(r.median("pss")), mib(r.median("uss"))
            if len(results) > 1:
                print(f"  {label + ': ' + r.role:<34} {1:>5} {threads:>4} {rss:8.1f} {pss:8.1f} {uss:8.1f}"
                      f" {cpu:9.3f} {ticks:8.2f} {wake:9.1f}")
            for key, value in (("procs", 1), ("threads", threads), ("rss", rss), ("pss", pss), ("uss", uss),
                               ("cpu", cpu), ("ticks", ticks), ("wakeups", wake)):
                total[key] += value
        totals[label] = total
        print(f"  {('= ' + label + ' (tree)') if len(results) > 1 else label:<34} {int(total['procs']):>5}"
              f" {int(total['threads']):>4} {total['rss']:8.1f} {total['pss']:8.1f} {total['uss']:8.1f}"
              f" {total['cpu']:9.3f} {total['ticks']:8.2f} {total['wakeups']:9.1f}")
        if show_threads:
            for r in results:
                for thread, cpu, wake in window.thread_rows(r):
                    if wake >= 0.05 or cpu >= 0.005:
                        print(f"      {r.role:<13} {thread:<30} CPU {cpu:7.3f} ms/s  wakeups {wake:6.1f}/s")
    return totals


def shared_label(models: int) -> str:
    return f"shared, {models} model{'' if models == 1 else 's'}"


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("inf")


# Two CPU figures both below this are the same within what a minute of sampling tells apart (one 10 ms
# tick a minute is 0.17 ms/s; the scheduler's nanosecond figure for a process that did not wake moves
# as much between runs): their ratio is noise, so it is taken as 1.
CPU_NOISE_MS_PER_S = 0.2


def cpu_ratio(a: float, b: float) -> float:
    return 1.0 if a < CPU_NOISE_MS_PER_S and b < CPU_NOISE_MS_PER_S else ratio(a, b)


def times(x: float) -> str:
    return f"{x:6.2f}" if x != float("inf") else "   n/a"  # n/a: the per-model figure is 0 in this window


def targets(labels: list[str], windows: dict[str, dict[str, dict[str, float]]], seconds: float,
            quick: bool) -> bool:
    """The targets block `python -m bench` repeats beside the warm path's; whether a target was missed."""
    shared_goal = shared_label(SHARED_GOAL_MODELS)
    note = " (--quick: shorter than the minute the targets are stated over)" if quick else ""
    print(f"\n== Idle footprint: targets (issue 22), {seconds:.0f} s windows{note}")
    print(f"  {'configuration':<20} {'window':<12} {'procs':>5} {'RSS MiB':>8} {'PSS MiB':>8} {'CPU ms/s':>9}"
          f" {'wakeups/s':>9} {'xRSS':>6} {'xCPU':>6}  target")
    missed = False
    for label in labels:
        for name, totals in windows.items():
            t, one = totals[label], totals[PER_MODEL]
            rss_x, cpu_x = ratio(t["rss"], one["rss"]), cpu_ratio(t["cpu"], one["cpu"])
            if label == PER_MODEL or label.startswith(PER_MODEL + "@"):
                ok = t["rss"] <= GOAL_RSS_MIB and t["cpu"] <= GOAL_CPU_MS_PER_S
                target = f"<= {GOAL_RSS_MIB:.0f} MiB, <= {GOAL_CPU_MS_PER_S} ms/s"
            elif label == shared_goal:
                ok = rss_x < SHARED_GOAL_RATIO and cpu_x < SHARED_GOAL_RATIO
                target = f"< {SHARED_GOAL_RATIO:.0f}x per-model RSS and CPU"
            else:
                ok, target = None, "(reported)"
            missed |= ok is False
            verdict = "" if ok is None else ("met" if ok else "MISSED")
            print(f"  {label:<20} {name:<12} {int(t['procs']):>5} {t['rss']:8.1f} {t['pss']:8.1f} {t['cpu']:9.3f}"
                  f" {t['wakeups']:9.1f} {times(rss_x)} {times(cpu_x)}  {target:<30} {verdict}")
    print("  (xRSS, xCPU: against the per-model gateway in the same window; n/a where that is 0, a miss; "
          f"xCPU 1.00 where both are under {CPU_NOISE_MS_PER_S} ms/s, the noise floor)")
    if "quiet" in windows and "as deployed" in windows:
        for label in labels:
            quiet, deployed = windows["quiet"][label], windows["as deployed"][label]
            rate = deployed.get("requests", 0.0)
            if not rate:
                continue
            print(f"  {label}: as deployed it answered {rate:.2f} requests/s (KEDA RPCs + probes), "
                  f"{ratio(deployed['cpu'] - quiet['cpu'], rate):.3f} ms of CPU each above quiet, "
                  f"{ratio(deployed['wakeups'] - quiet['wakeups'], rate):.2f} wake-ups each")
    if shared_goal in labels:
        for name, totals in windows.items():
            one, shared = totals[PER_MODEL], totals[shared_goal]
            n = SHARED_GOAL_MODELS
            print(f"  {name}: {n} per-model Pods would be {n * one['rss']:.0f} MiB RSS, {n * one['cpu']:.1f} ms/s CPU, "
                  f"{n * one['wakeups']:.0f} wake-ups/s; the shared gateway fronting them {shared['rss']:.1f} MiB, "
                  f"{shared['cpu']:.2f} ms/s, {shared['wakeups']:.1f} wake-ups/s")
    print()
    return missed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each sampled window (default 60)")
    parser.add_argument("--quick", action="store_true", help="15 s windows")
    parser.add_argument("--models", default="1,10,100",
                        help="shared gateways to run, by number of models (default 1,10,100; '' for none)")
    parser.add_argument("--threads", action="store_true", help="per-thread CPU and wake-ups")
    parser.add_argument("--tree", action="append", default=[], type=Path,
                        help="also run the per-model gateway of this checkout in the same windows (repeatable)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args()
    seconds = 15.0 if args.quick else args.seconds
    counts = [int(n) for n in args.models.split(",") if n.strip()]
    container, scaled = rendered()
    print(f"idle footprint of gateway Pods: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, "
          f"load average {os.getloadavg()[0]:.2f} at start; {seconds:.0f} s windows"
          f"{' (--quick)' if args.quick else ''} after {SETTLE_SECONDS:.0f} s to settle; CPU = scheduler run time "
          f"(ticks = utime + stime, {1000 // TICK} ms resolution)")
    configurations = {PER_MODEL: (ROOT, 0), **{f"{PER_MODEL}@{t.resolve().name}": (t.resolve(), 0) for t in args.tree},
                      **{shared_label(n): (ROOT, n) for n in counts}}
    baseline = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1e9)"])
    # What one wake-up costs on this host: some VMs charge a thread far more CPU per wake than it runs
    # (measured here: 4-19 ms per wake of an empty select() or gevent.sleep loop on an idle Firecracker
    # VM, 0.1 ms on a loaded one), which would swamp every other figure; this puts it beside them.
    waker = subprocess.Popen([sys.executable, "-c", "import select\nwhile True: select.select([], [], [], 1.0)"])
    pods: dict[str, GatewayPod] = {}
    kubelets: dict[str, Kubelet] = {}
    try:
        for label, (path, models) in configurations.items():
            started = time.monotonic()
            pods[label] = GatewayPod(path, container, label, models)
            print(f"  {label}: answering /healthz {time.monotonic() - started:.1f} s after its start")
        roots = {**{label: pod.proc.pid for label, pod in pods.items()}, "baseline: python -c sleep": baseline.pid,
                 WAKER: waker.pid}
        time.sleep(SETTLE_SECONDS)
        quiet = report("quiet: nothing talks to the gateways", Window(roots, seconds).run(), args.threads)
        kubelets = {label: Kubelet(pod, container, scaled) for label, pod in pods.items()}
        time.sleep(1.0)
        window = Window(roots, seconds)
        answered = {label: kubelet.requests for label, kubelet in kubelets.items()}
        window.run()
        answered = {label: kubelet.requests - answered[label] for label, kubelet in kubelets.items()}
        deployed = report(
            f"as deployed: per ScaledObject a KEDA stream + IsActive/GetMetrics every "
            f"{scaled.get('pollingInterval', 30)} s; per Pod probes every "
            f"{container['readinessProbe']['periodSeconds']} s and {container['livenessProbe']['periodSeconds']} s",
            window, args.threads)
        for label, count in answered.items():
            deployed[label]["requests"] = count / window.elapsed
        for label, kubelet in kubelets.items():
            if kubelet.errors or kubelet.streams_lost:
                print(f"  {label}: {kubelet.errors} of {kubelet.calls + kubelet.errors} probe or KEDA calls failed, "
                      f"{kubelet.streams_lost} StreamIsActive streams ended early")
    finally:
        for kubelet in kubelets.values():
            kubelet.stop()
        for pod in pods.values():
            pod.stop()
        for proc in (baseline, waker):
            proc.kill()
            proc.wait()
    base = quiet["baseline: python -c sleep"]
    wake = quiet[WAKER]
    per_wake = wake["cpu"] / max(wake["wakeups"], 1e-9)
    print(f"\nthis host charges {per_wake:.3f} ms of CPU per wake-up of an empty loop ({WAKER}: "
          f"{wake['cpu']:.3f} ms/s at {wake['wakeups']:.1f} wake-ups/s); where that is far above ~0.05 ms, "
          f"CPU figures are the host's, and wake-ups/s is the figure to compare; python floor {base['rss']:.1f} MiB RSS")
    missed = targets(list(pods), {"quiet": quiet, "as deployed": deployed}, seconds, args.quick)
    return 1 if args.check and missed else 0

if __name__ == "__main__":
    sys.exit(main())
