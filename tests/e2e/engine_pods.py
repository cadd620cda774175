"""The kubelet of the real-engine namespace: the Pods of one LLMService there run their rendered
containers on this machine (tests/engines/container.py), and this class writes their status as a
kubelet would (tests/e2e/kubelet.py: what every kubelet of the harness shares). kwok plays no stage
in ``ENGINE_NAMESPACE`` (tests/e2e/kwok-stages.yaml).

Each Pod that runs containers has a network namespace of its own (tests/e2e/netns.py) with a Pod IP
of the harness's range, and every process of the Pod (init containers, the engine, its preStop hook,
a Job's container) runs inside it with its rendered args unchanged: an engine told ``--host 0.0.0.0``
serves on its Pod IP, one told ``--host 127.0.0.1`` is unreachable and never Ready, as in a cluster.

- A prewarm Job's Pod runs its container (``python -m prewarm hub``, against the suite's stand-in
  hub) to completion: Running, then Succeeded or Failed with its exit code, so the Job controller
  completes or retries the Job.
- A backend Pod runs its init containers to completion, then its engine container (the real
  llama-server, ``tests/engines/llamacpp.py``): Running, Ready ``readiness_lag`` seconds after its
  readiness probe's path first answers 200 (probed every ``PROBE_SECONDS``, shorter than the rendered
  period as the suite shortens every wait; tests/e2e/kubelet.py), and only then an endpoint of the backend Service, whose
  ClusterIP is a ``ServiceIP``. An engine that exits is restarted with the kubelet's back-off (10 s,
  doubling) and reported as ``CrashLoopBackOff`` meanwhile, with the exit code and its log's last line
  as the last termination's message (terminationMessagePolicy FallbackToLogsOnError).
- A Pod being deleted leaves its Service at once, then runs its preStop hook, gets SIGTERM, and is
  SIGKILLed at the end of its grace period; then its network namespace goes and its object is removed
  (grace period 0), as the kubelet confirms a deletion.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from tests.e2e.cluster import Cluster, Timeline
from tests.e2e.kubelet import Kubelet, PlayedPod, now
from tests.e2e.netns import Network
from tests.engines.container import LocalContainer, Sandbox, run_to_completion
from tests.kube.apiserver import REPO_ROOT

ENGINE_NAMESPACE = "e2e-engine"
BACKOFF_SECONDS = 10.0  # the kubelet's first restart back-off (it doubles, up to 5 minutes)
JOB_TIMEOUT_SECONDS = 300.0


class EngineKubelet(Kubelet):
    """Plays the kubelet for the Pods of LLMService ``service`` in ``ENGINE_NAMESPACE`` (module doc).
    ``readiness_lag``: seconds between the engine first answering its readiness path and the Pod
    reported Ready (tests/e2e/kubelet.py)."""

    def __init__(self, cluster: Cluster, network: Network, service: str, port: int, programs: dict[str, str],
                 timeline: Timeline, namespace: str = ENGINE_NAMESPACE, readiness_lag: float = 0.0) -> None:
        super().__init__(cluster, network, service, port, timeline, namespace, readiness_lag)
        self.programs = programs
        self.workdir = Path(tempfile.mkdtemp(prefix=f"noctaya-e2e-kubelet-{service}-"))

    @property
    def running(self) -> bool:
        return any(p.engine is not None and p.engine.running() for p in self.pods.values())

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _end_at_stop(self, played: PlayedPod) -> None:
        if played.engine is not None and played.engine.running():
            played.engine.grace_seconds = 5
            played.engine.stop()

    # --- a Pod's sandbox ------------------------------------------------------------------------------

    def _sandbox(self, played: PlayedPod, obj: dict[str, Any]) -> Sandbox:
        """The Pod's network namespace and Pod IP (reported at once); volumes: a hostPath is a
        directory of this Pod's node, an emptyDir one of the Pod's own."""
        played.network = self.network.add_pod()
        self._sandbox_up(played, played.network.ip)
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
        return Sandbox(address=played.address, volumes=volumes, programs=self.programs, fields=fields, cwd=REPO_ROOT,
                       netns=self.network.exec_prefix(played.network))

    # --- a prewarm Job's Pod ------------------------------------------------------------------------

    def _run_job(self, played: PlayedPod, obj: dict[str, Any]) -> None:
        container = played.container = obj["spec"]["containers"][0]
        sandbox = self._sandbox(played, obj)
        started = now()
        self._patch_status(played.name, {
            "phase": "Running", "conditions": self._conditions(True, True),
            "containerStatuses": [self._container_status(container, {"running": {"startedAt": started}}, True, 0)]})
        self.note(f"prewarm Pod {played.name} running its container on {played.address}")
        done = run_to_completion(container, sandbox, timeout=JOB_TIMEOUT_SECONDS)
        self._release(played)  # a completed Pod's sandbox is torn down
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
        container = played.container = next(c for c in spec["containers"] if c["name"] == "engine")
        sandbox = self._sandbox(played, obj)
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
                played.engine = engine = LocalContainer(container, sandbox, self.workdir / f"{played.name}.log",
                                                        grace).start()
            started = now()
            self._patch_status(played.name, {
                "phase": "Running", "conditions": self._conditions(True, False, "ContainersNotReady"),
                "containerStatuses": [self._container_status(container, {"running": {"startedAt": started}}, False,
                                                             played.restarts)]})
            self.note(f"{played.name}: engine started (restart {played.restarts}) on {played.address}")
            code = self._probe_until_exit(played, probe["path"], lambda e=engine: e.proc.poll() if e.proc else None)
            if code is None or played.deleting:
                return
            self._crashed(played, code, started, backoff)
            if self._stop.wait(backoff):
                return
            backoff = min(backoff * 2, 300.0)

    def _crashed(self, played: PlayedPod, code: int, started: str, backoff: float) -> None:
        """CrashLoopBackOff with the exit code and the log's last line, as the kubelet reports it."""
        played.exits.append(code)
        played.restarts += 1
        tail = played.engine.log_tail(400).strip().splitlines()[-1:] or [""]
        last = {"terminated": {"exitCode": code, "reason": "Error", "message": tail[0], "startedAt": started,
                               "finishedAt": now()}}
        self._patch_status(played.name, {
            "conditions": self._conditions(True, False, "ContainersNotReady"),
            "containerStatuses": [self._container_status(played.container, {"waiting": {
                "reason": "CrashLoopBackOff", "message": f"back-off {backoff:.0f}s restarting failed container"}},
                False, played.restarts, last)]})
        self.note(f"{played.name}: engine exited {code} ({tail[0][-160:]}); back-off {backoff:.0f}s")

    def _end(self, played: PlayedPod) -> bool:
        engine = played.engine
        if engine is None or not engine.running():
            return False
        self.note(f"{played.name}: deleted; out of the Service, preStop then SIGTERM")
        code = engine.stop()
        self.note(f"{played.name}: engine ended {code} after preStop {engine.pre_stop_seconds or 0:.1f}s: "
                  f"{engine.pre_stop_output.strip()[-120:]!r}{', killed' if engine.killed else ''}")
        return True
