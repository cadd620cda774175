"""The kubelet of the real-engine namespace: the Pods of one LLMService there run their rendered
containers on this machine (tests/engines/container.py), and this class writes their status as a
kubelet would. kwok plays no stage in ``ENGINE_NAMESPACE`` (tests/e2e/kwok-stages.yaml).

- A prewarm Job's Pod runs its container (``python -m prewarm hub``, against the suite's stand-in
  hub) to completion: Running, then Succeeded or Failed with its exit code, so the Job controller
  completes or retries the Job.
- A backend Pod runs its init containers to completion, then its engine container (the real
  llama-server, ``tests/engines/llamacpp.py``) on a private loopback address (its Pod IP): Running,
  Ready once its readiness probe's path answers 200 (probed every ``PROBE_SECONDS``, shorter than
  the rendered period as the suite shortens every wait), and only then an endpoint of the backend
  Service, whose ClusterIP is a ``ServiceIP``. An engine that exits is restarted with the kubelet's
  back-off (10 s, doubling) and reported as ``CrashLoopBackOff`` meanwhile, with the exit code and
  its log's last line as the last termination's message (terminationMessagePolicy
  FallbackToLogsOnError).
- A Pod being deleted leaves its Service at once, then runs its preStop hook, gets SIGTERM, and is
  SIGKILLed at the end of its grace period; then its object is removed (grace period 0), as the
  kubelet confirms a deletion.

``events`` records what happened, for assertions and the timeline.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import requests

from tests.e2e.cluster import Cluster, Timeline
from tests.e2e.pods import ServiceIP, service_hosts
from tests.engines.container import LocalContainer, Sandbox, run_to_completion
from tests.kube.apiserver import REPO_ROOT

ENGINE_NAMESPACE = "e2e-engine"
PROBE_SECONDS = 0.2
POLL_SECONDS = 0.1
BACKOFF_SECONDS = 10.0  # the kubelet's first restart back-off (it doubles, up to 5 minutes)
JOB_TIMEOUT_SECONDS = 300.0


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class PlayedPod:
    name: str
    kind: str  # "prewarm" or "backend"
    address: str
    thread: threading.Thread | None = None
    engine: LocalContainer | None = None
    ready: bool = False
    deleting: bool = False
    restarts: int = 0
    exits: list[int] = field(default_factory=list)
    stop_seconds: float | None = None  # deletion seen -> process ended


class EngineKubelet:
    """Plays the kubelet for the Pods of LLMService ``service`` in ``ENGINE_NAMESPACE`` (module doc)."""

    def __init__(self, cluster: Cluster, service: str, port: int, programs: dict[str, str], timeline: Timeline,
                 namespace: str = ENGINE_NAMESPACE) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.service = service
        self.port = port
        self.programs = programs
        self.timeline = timeline
        self.selector = f"serving.noctaya.io/llmservice={service}"
        self.workdir = Path(tempfile.mkdtemp(prefix=f"noctaya-e2e-kubelet-{service}-"))
        self.pods: dict[str, PlayedPod] = {}
        self.pods_seen: set[str] = set()
        self.events: list[tuple[float, str]] = []
        self.service_ip = ServiceIP(cluster, f"{namespace}/{service}-backend", {port: port})
        for host in service_hosts(f"{service}-backend", namespace):
            cluster.publish(host, [self.service_ip.address])
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kubelet-{service}", daemon=True)

    # --- what the tests read -------------------------------------------------------------------

    def note(self, what: str) -> None:
        self.events.append((time.monotonic(), what))
        self.timeline.note(f"kubelet: {what}")

    def ready_engines(self) -> list[PlayedPod]:
        return [p for p in self.pods.values() if p.kind == "backend" and p.ready and not p.deleting]

    @property
    def running(self) -> bool:
        return any(p.engine is not None and p.engine.running() for p in self.pods.values())

    def pod_states(self) -> list[str]:
        return [f"{p.name[-5:]}:{p.kind}:{'Ready' if p.ready else 'NotReady'}:restarts={p.restarts}"
                f"{':deleting' if p.deleting else ''}" for p in self.pods.values()]

    # --- the loop --------------------------------------------------------------------------------

    def start(self) -> EngineKubelet:
        """Starts playing (again: a no-op)."""
        if not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for pod in list(self.pods.values()):
            if pod.engine is not None and pod.engine.running():
                pod.engine.grace_seconds = 5
                pod.engine.stop()
        self.service_ip.close()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _list(self) -> list[dict[str, Any]]:
        return self.cluster.api(f"/api/v1/namespaces/{self.namespace}/pods?labelSelector={self.selector}")["items"]

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                pods = self._list()
            except requests.RequestException:
                pods = []
            listed = {p["metadata"]["name"] for p in pods}
            for obj in pods:
                self._see(obj)
            for name, played in list(self.pods.items()):
                if name not in listed and not played.deleting:  # removed without a graceful deletion
                    self._begin_deletion(played, obj=None)
            self._stop.wait(POLL_SECONDS)

    def _see(self, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        self.pods_seen.add(name)
        played = self.pods.get(name)
        if obj["metadata"].get("deletionTimestamp"):
            if played is None:
                self._force_delete(name)
            elif not played.deleting:
                self._begin_deletion(played, obj)
            return
        if played is not None or not obj["spec"].get("nodeName"):
            return
        component = (obj["metadata"].get("labels") or {}).get("serving.noctaya.io/component")
        kind = component if component in ("prewarm", "backend") else "other"
        played = PlayedPod(name, kind, self.cluster.new_address())
        self.pods[name] = played
        target = {"prewarm": self._run_job, "backend": self._run_backend}.get(kind, self._run_other)
        played.thread = threading.Thread(target=target, args=(played, obj), name=f"pod-{name}", daemon=True)
        played.thread.start()

    # --- status, as the kubelet writes it ---------------------------------------------------------

    def _patch_status(self, name: str, status: dict[str, Any]) -> None:
        plane = self.cluster.plane
        requests.patch(f"{plane.url}/api/v1/namespaces/{self.namespace}/pods/{name}/status",
                       json={"status": status}, verify=str(plane.ca_file), timeout=10,
                       headers={"Authorization": f"Bearer {plane.token}",
                                "Content-Type": "application/merge-patch+json"})

    def _force_delete(self, name: str) -> None:
        plane = self.cluster.plane
        requests.delete(f"{plane.url}/api/v1/namespaces/{self.namespace}/pods/{name}", json={"gracePeriodSeconds": 0},
                        verify=str(plane.ca_file), timeout=10, headers={"Authorization": f"Bearer {plane.token}"})

    @staticmethod
    def _conditions(initialized: bool, ready: bool, reason: str = "") -> list[dict[str, Any]]:
        at = now()

        def cond(kind: str, ok: bool) -> dict[str, Any]:
            out = {"type": kind, "status": "True" if ok else "False", "lastTransitionTime": at}
            return out | ({"reason": reason} if not ok and reason else {})

        return [cond("PodScheduled", True), cond("Initialized", initialized), cond("ContainersReady", ready),
                cond("Ready", ready)]

    def _container_status(self, container: dict[str, Any], state: dict[str, Any], ready: bool, restarts: int,
                          last: dict[str, Any] | None = None) -> dict[str, Any]:
        status = {"name": container["name"], "image": container["image"], "imageID": "", "ready": ready,
                  "started": "running" in state, "restartCount": restarts, "state": state}
        return status | ({"lastState": last} if last else {})

    # --- any other Pod of the model (its gateway: LocalPods runs its processes) -----------------------

    def _run_other(self, played: PlayedPod, obj: dict[str, Any]) -> None:
        """Running and Ready at once, as kwok reports the Pods it plays elsewhere in the suite."""
        started = now()
        played.ready = True
        self._patch_status(played.name, {
            "phase": "Running", "startTime": started, "podIP": played.address, "conditions": self._conditions(True, True),
            "containerStatuses": [self._container_status(c, {"running": {"startedAt": started}}, True, 0)
                                  for c in obj["spec"]["containers"]]})

    # --- a prewarm Job's Pod ------------------------------------------------------------------------

    def _sandbox(self, played: PlayedPod, obj: dict[str, Any]) -> Sandbox:
        """Volumes: a hostPath is a directory of this Pod's node, an emptyDir one of the Pod's own."""
        node_dir = self.workdir / "nodes" / obj["spec"]["nodeName"]
        volumes: dict[str, Path] = {}
        for volume in obj["spec"].get("volumes") or []:
            if "hostPath" in volume:
                volumes[volume["name"]] = node_dir / volume["hostPath"]["path"].lstrip("/")
            elif "emptyDir" in volume:
                volumes[volume["name"]] = self.workdir / "pods" / played.name / volume["name"]
        for local in volumes.values():
            local.mkdir(parents=True, exist_ok=True)
        fields = {"metadata.name": played.name, "metadata.namespace": self.namespace, "status.podIP": played.address,
                  "spec.nodeName": obj["spec"]["nodeName"]}
        return Sandbox(address=played.address, volumes=volumes, programs=self.programs, fields=fields, cwd=REPO_ROOT)

    def _run_job(self, played: PlayedPod, obj: dict[str, Any]) -> None:
        container = obj["spec"]["containers"][0]
        started = now()
        self._patch_status(played.name, {
            "phase": "Running", "startTime": started, "podIP": played.address,
            "conditions": self._conditions(True, True),
            "containerStatuses": [self._container_status(container, {"running": {"startedAt": started}}, True, 0)]})
        self.note(f"prewarm Pod {played.name} running its container")
        done = run_to_completion(container, self._sandbox(played, obj), timeout=JOB_TIMEOUT_SECONDS)
        played.exits.append(done.returncode)
        last_line = (done.stdout + done.stderr).strip().splitlines()[-1:] or [""]
        terminated = {"exitCode": done.returncode, "reason": "Completed" if done.returncode == 0 else "Error",
                      "message": last_line[0][-1000:], "startedAt": started, "finishedAt": now()}
        self._patch_status(played.name, {
            "phase": "Succeeded" if done.returncode == 0 else "Failed",
            "conditions": self._conditions(True, False, "PodCompleted"),
            "containerStatuses": [self._container_status(container, {"terminated": terminated}, False, 0)]})
        self.note(f"prewarm Pod {played.name} exited {done.returncode}: {last_line[0][-200:]}")

    # --- a backend Pod ----------------------------------------------------------------------------

    def _run_backend(self, played: PlayedPod, obj: dict[str, Any]) -> None:
        spec = obj["spec"]
        sandbox = self._sandbox(played, obj)
        container = next(c for c in spec["containers"] if c["name"] == "engine")
        self._patch_status(played.name, {"phase": "Pending", "podIP": played.address, "startTime": now(),
                                         "conditions": self._conditions(False, False, "PodInitializing")})
        for init in spec.get("initContainers") or []:
            done = run_to_completion(init, sandbox, timeout=120)
            if done.returncode != 0:
                self.note(f"{played.name}: init container {init['name']} exited {done.returncode}: {done.stderr[-300:]}")
                return
        grace = float(spec.get("terminationGracePeriodSeconds", 30))
        probe = (container.get("readinessProbe") or {}).get("httpGet") or {"path": "/health"}
        backoff = BACKOFF_SECONDS
        while not played.deleting and not self._stop.is_set():
            with self._lock:
                if played.deleting:
                    return
                played.engine = LocalContainer(container, sandbox, self.workdir / f"{played.name}.log", grace).start()
            started = now()
            self._patch_status(played.name, {
                "phase": "Running", "conditions": self._conditions(True, False, "ContainersNotReady"),
                "containerStatuses": [self._container_status(container, {"running": {"startedAt": started}}, False,
                                                             played.restarts)]})
            self.note(f"{played.name}: engine started (restart {played.restarts}) on {played.address}")
            code = self._probe_until_exit(played, container, probe["path"])
            if code is None or played.deleting:
                return
            played.exits.append(code)
            played.restarts += 1
            tail = played.engine.log_tail(400).strip().splitlines()[-1:] or [""]
            last = {"terminated": {"exitCode": code, "reason": "Error", "message": tail[0], "startedAt": started,
                                   "finishedAt": now()}}
            self._patch_status(played.name, {
                "conditions": self._conditions(True, False, "ContainersNotReady"),
                "containerStatuses": [self._container_status(container, {"waiting": {
                    "reason": "CrashLoopBackOff", "message": f"back-off {backoff:.0f}s restarting failed container"}},
                    False, played.restarts, last)]})
            self.note(f"{played.name}: engine exited {code} ({tail[0][-160:]}); back-off {backoff:.0f}s")
            if self._stop.wait(backoff):
                return
            backoff = min(backoff * 2, 300.0)

    def _probe_until_exit(self, played: PlayedPod, container: dict[str, Any], path: str) -> int | None:
        """Probe readiness until the engine exits (its code) or the Pod is deleted (None)."""
        engine = played.engine
        assert engine is not None
        url = f"http://{played.address}:{self.port}{path}"
        while not played.deleting and not self._stop.is_set():
            code = engine.proc.poll() if engine.proc else None
            if code is not None:
                self._set_ready(played, container, False)
                return code
            try:
                ok = requests.get(url, timeout=1).status_code == 200
            except requests.RequestException:
                ok = False
            if ok != played.ready:
                self._set_ready(played, container, ok)
            self._stop.wait(PROBE_SECONDS)
        return None

    def _set_ready(self, played: PlayedPod, container: dict[str, Any], ready: bool) -> None:
        with self._lock:
            if played.deleting and ready:
                return
            played.ready = ready
            # Noted before the endpoints change: a request served through them (16 tokens take well under
            # the status patch on a busy API server) must find this transition already recorded.
            self.note(f"{played.name}: {'Ready' if ready else 'not Ready'} (GET {container.get('name')} readiness)")
            self.service_ip.endpoints = [p.address for p in self.ready_engines()]
        if ready:
            self._patch_status(played.name, {
                "conditions": self._conditions(True, True),
                "containerStatuses": [self._container_status(container, {"running": {"startedAt": now()}}, True,
                                                             played.restarts)]})

    def _begin_deletion(self, played: PlayedPod, obj: dict[str, Any] | None) -> None:
        with self._lock:
            played.deleting = True
            played.ready = False
            self.service_ip.endpoints = [p.address for p in self.ready_engines()]
        threading.Thread(target=self._terminate, args=(played, obj is not None), name=f"terminate-{played.name}",
                         daemon=True).start()

    def _terminate(self, played: PlayedPod, confirm: bool) -> None:
        t0 = time.monotonic()
        engine = played.engine
        if engine is not None and engine.running():
            self.note(f"{played.name}: deleted; out of the Service, preStop then SIGTERM")
            code = engine.stop()
            played.stop_seconds = time.monotonic() - t0
            self.note(f"{played.name}: engine ended {code} after {played.stop_seconds:.1f}s "
                      f"(preStop {engine.pre_stop_seconds or 0:.1f}s: {engine.pre_stop_output.strip()[-120:]!r}"
                      f"{', killed' if engine.killed else ''})")
        if confirm:
            self._force_delete(played.name)
