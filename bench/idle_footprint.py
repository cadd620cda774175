"""Idle footprint of one per-model gateway Pod (issue 22): memory and CPU of the whole process tree
while nothing happens, against a minimal Python process measured in the same window.

The gateway runs as the rendered gateway Deployment runs it: ``python -m gateway`` with the env the
hooks render for ``examples/models/scale-to-zero.yaml`` (only addresses are changed: 127.0.0.1, free
ports, a backend URL on a closed port, since the backend is scaled to zero) and the container's
resources as its cgroup (``NOCTAYA_CGROUP_ROOT`` points at files saying: no CPU limit, the rendered
memory limit), so it picks one worker and the held-body budget a Pod gets. After it answers
``/healthz`` it settles, then two windows of N seconds each are sampled:

- **quiet**: nothing talks to the gateway;
- **as deployed**: what talks to an idle Pod in a cluster: KEDA holding one ``StreamIsActive``
  stream and calling ``IsActive`` + ``GetMetrics`` every ``pollingInterval`` of the rendered
  ScaledObject, and the kubelet's readiness and liveness probes (``GET /healthz`` on the admin port)
  at their rendered periods.

Per window: RSS, PSS and USS (``/proc/<pid>/smaps_rollup``; medians of 1 s samples) summed over the
process tree, the number of processes and threads, CPU per wall second (utime + stime from
``/proc/<pid>/stat``, 10 ms ticks, and the scheduler's nanosecond run time from
``/proc/<pid>/task/*/schedstat``) and wake-ups per second (context switches of every thread). The
baseline is ``python -c`` sleeping, sampled in the same windows: the interpreter's floor.

Run: .venv/bin/python -m bench.idle_footprint [--quick] [--seconds N] [--threads] [--tree PATH ...]

``--tree PATH`` also runs the gateway of another checkout (e.g. a ``git worktree`` of an older
commit) side by side in the same windows, for before/after comparisons on a shared machine.
``--check`` exits 1 when the goals (<= 40 MiB RSS, <= 0.5 ms CPU per second) are missed.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
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


class GatewayPod:
    """`python -m gateway` of ``tree`` with the rendered env, on loopback, backend at zero."""

    def __init__(self, tree: Path, container: dict[str, Any], label: str) -> None:
        self.label = label
        self.port, self.admin_port, self.scaler_port = free_port(), free_port(), free_port()
        closed = free_port()  # nothing listens there: the backend is scaled to zero
        self._cgroup = tempfile.TemporaryDirectory(prefix="noctaya-idle-cgroup-")
        limit = container.get("resources", {}).get("limits", {}).get("memory")
        Path(self._cgroup.name, "cpu.max").write_text("max 100000\n")  # the rendered Pod has no CPU limit
        Path(self._cgroup.name, "memory.max").write_text(f"{quantity_bytes(limit)}\n" if limit else "max\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("NOCTAYA_")}
        env.update({e["name"]: e["value"] for e in container["env"] if "value" in e})
        env.update({
            "NOCTAYA_LISTEN_HOST": "127.0.0.1", "NOCTAYA_LISTEN_PORT": str(self.port),
            "NOCTAYA_ADMIN_PORT": str(self.admin_port), "NOCTAYA_SCALER_PORT": str(self.scaler_port),
            "NOCTAYA_BACKEND_URL": f"http://127.0.0.1:{closed}", "NOCTAYA_CGROUP_ROOT": self._cgroup.name,
            "PYTHONPATH": str(tree),
        })
        command = container["command"]
        assert command[0] == "python", command
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, *command[1:]], cwd=tree, env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        wait_healthy(self.admin_port, self.proc)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(45)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._cgroup.cleanup()


class Kubelet:
    """What talks to an idle gateway Pod in a cluster: KEDA (one StreamIsActive stream held open,
    IsActive + GetMetrics every pollingInterval) and the kubelet's two /healthz probes."""

    def __init__(self, pod: GatewayPod, container: dict[str, Any], scaled: dict[str, Any]) -> None:
        import grpc

        from scaler import externalscaler_pb2 as pb
        from scaler import externalscaler_pb2_grpc as pb_grpc

        self._stop = threading.Event()
        self.errors = 0
        self.calls = 0
        self.channel = grpc.insecure_channel(f"127.0.0.1:{pod.scaler_port}")
        grpc.channel_ready_future(self.channel).result(timeout=30)
        stub = pb_grpc.ExternalScalerStub(self.channel)
        ref = pb.ScaledObjectRef(name="idle", namespace="bench", scalerMetadata={})
        metric = next(e["value"] for e in container["env"] if e["name"] == "NOCTAYA_METRIC_NAME")
        self._stream = stub.StreamIsActive(ref)
        polling = float(scaled.get("pollingInterval", 30))

        def keda_poll() -> None:
            stub.IsActive(ref, timeout=5)
            stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref, metricName=metric), timeout=5)

        def probe() -> None:
            if http_get(pod.admin_port, "/healthz") != 200:
                raise RuntimeError("probe failed")

        self._threads = [threading.Thread(target=self._drain_stream, daemon=True),
                         threading.Thread(target=self._every, args=(polling, keda_poll), daemon=True)]
        for name in ("readinessProbe", "livenessProbe"):
            period = float(container[name].get("periodSeconds", 10))
            self._threads.append(threading.Thread(target=self._every, args=(period, probe), daemon=True))
        for thread in self._threads:
            thread.start()

    def _drain_stream(self) -> None:
        with contextlib.suppress(Exception):
            for _ in self._stream:
                pass

    def _every(self, period: float, call: Any) -> None:
        while not self._stop.wait(period):
            try:
                call()
                self.calls += 1
            except Exception:  # noqa: BLE001 - counted, reported
                self.errors += 1

    def stop(self) -> None:
        self._stop.set()
        self._stream.cancel()
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


def role(pid: int, root: int) -> str:
    if pid == root:
        return "supervisor" if pid_cmd(pid).endswith("-m gateway") else "python -c sleep"
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
            self.processes[label] = [ProcessResult(pid, role(pid, root)) for pid in tree(root)]
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each sampled window (default 60)")
    parser.add_argument("--quick", action="store_true", help="15 s windows")
    parser.add_argument("--threads", action="store_true", help="per-thread CPU and wake-ups")
    parser.add_argument("--tree", action="append", default=[], type=Path,
                        help="also run the gateway of this checkout in the same windows (repeatable)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a goal is missed")
    args = parser.parse_args()
    seconds = 15.0 if args.quick else args.seconds
    container, scaled = rendered()
    print(f"idle footprint of a per-model gateway Pod: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, "
          f"load average {os.getloadavg()[0]:.2f} at start; {seconds:.0f} s windows after {SETTLE_SECONDS:.0f} s "
          f"to settle; CPU = scheduler run time (ticks = utime + stime, {1000 // TICK} ms resolution)")
    trees = {"gateway": ROOT, **{f"gateway@{t.name}": t.resolve() for t in args.tree}}
    baseline = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1e9)"])
    # What one wake-up costs on this host: some VMs charge a thread far more CPU per wake than it runs
    # (measured here: 4-19 ms per wake of an empty select() or gevent.sleep loop on an idle Firecracker
    # VM, 0.1 ms on a loaded one), which would swamp every other figure; this puts it beside them.
    waker = subprocess.Popen([sys.executable, "-c", "import select\nwhile True: select.select([], [], [], 1.0)"])
    pods: dict[str, GatewayPod] = {}
    kubelets: list[Kubelet] = []
    try:
        for label, path in trees.items():
            pods[label] = GatewayPod(path, container, label)
        roots = {**{label: pod.proc.pid for label, pod in pods.items()}, "baseline: python -c sleep": baseline.pid,
                 WAKER: waker.pid}
        time.sleep(SETTLE_SECONDS)
        quiet = report("quiet: nothing talks to the gateway", Window(roots, seconds).run(), args.threads)
        kubelets = [Kubelet(pod, container, scaled) for pod in pods.values()]
        time.sleep(1.0)
        deployed = report(
            f"as deployed: KEDA stream + IsActive/GetMetrics every {scaled.get('pollingInterval', 30)} s, "
            f"probes every {container['readinessProbe']['periodSeconds']} s and "
            f"{container['livenessProbe']['periodSeconds']} s", Window(roots, seconds).run(), args.threads)
        errors = sum(k.errors for k in kubelets)
        if errors:
            print(f"  ({errors} probe or KEDA calls failed)")
    finally:
        for kubelet in kubelets:
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
          "CPU figures are the host's, and wake-ups/s is the figure to compare")
    print(f"goals (issue 22): <= {GOAL_RSS_MIB:.0f} MiB RSS for the tree, <= {GOAL_CPU_MS_PER_S} ms CPU per second idle")
    missed = False
    for label in pods:
        for name, totals in (("quiet", quiet), ("as deployed", deployed)):
            t = totals[label]
            ok = t["rss"] <= GOAL_RSS_MIB and t["cpu"] <= GOAL_CPU_MS_PER_S
            missed |= not ok
            print(f"  {label:<20} {name:<12} RSS {t['rss']:6.1f} MiB = {t['rss'] / GOAL_RSS_MIB:4.2f}x goal "
                  f"({t['rss'] / base['rss']:4.1f}x python floor {base['rss']:.1f}); PSS {t['pss']:5.1f} MiB; "
                  f"CPU {t['cpu']:6.3f} ms/s = {t['cpu'] / GOAL_CPU_MS_PER_S:5.2f}x goal; "
                  f"{int(t['procs'])} processes, {t['wakeups']:.0f} wake-ups/s  {'met' if ok else 'MISSED'}")
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
