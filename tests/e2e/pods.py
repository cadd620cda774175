"""The Pods of the lifecycle suite that do real work, run on this machine (there is no container runtime).

- ``LocalPods`` plays the kubelet for a Deployment the hooks rendered in Noctaya's own image (gateway,
  aggregator): it reads the Deployment from the API server and starts one process per replica with
  that Deployment's command, env, Secret and ConfigMap volumes (written to files, their mount paths
  rewritten), each on a private loopback address, and makes every Service selecting those Pods resolve
  to them. So what is tested is the rendered Deployment, not a hand-written command line. A ConfigMap
  volume is refreshed as the kubelet does it — new files in a fresh directory, then one atomic swap of
  the ``..data`` link — every ``CONFIG_MAP_SYNC_SECONDS`` (a kubelet's periodic Pod sync is about a
  minute by default; the suite shortens it so a membership change is seen within its timeouts).
- ``ModelServer`` is the backend: a small OpenAI-compatible server that listens exactly while the
  backend Deployment has a Ready Pod (as kwok reports it), so a cold request really waits for KEDA →
  Deployment → ReplicaSet → scheduler → kwok → gateway readiness.
"""

from __future__ import annotations

import base64
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import requests

from tests.e2e.cluster import Cluster, Timeline
from tests.gateway.fakebackend import FakeBackend
from tests.kube.apiserver import REPO_ROOT

CLUSTER_DOMAIN = "cluster.local"
POLL_SECONDS = 0.1
DRAIN_GRACE_SECONDS = 30.0  # a scaled-in backend answers what it has in flight for this long, at most
CONFIG_MAP_SYNC_SECONDS = 1.0


def service_hosts(name: str, namespace: str) -> list[str]:
    return [f"{name}.{namespace}.svc.{CLUSTER_DOMAIN}", f"{name}.{namespace}.svc"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


class LocalPods:
    """The replicas of one Deployment in Noctaya's image, as local processes (see the module doc)."""

    def __init__(self, cluster: Cluster, namespace: str, deployment: str, env: dict[str, str] | None = None,
                 source: Path = REPO_ROOT) -> None:
        self.cluster = cluster
        self.source = source  # the tree whose code the image runs (another release's, for the upgrade tests)
        self.namespace = namespace
        self.deployment = deployment
        self.env_overrides = dict(env or {})  # what a benchmark changes on top of the rendered env
        self.addresses: list[str] = []
        self._names: list[str] = []
        self._config_maps: list[tuple[dict[str, Any], Path]] = []  # (volume source, local mount dir)
        self._stop = threading.Event()
        self._sync: threading.Thread | None = None

    def start(self, replicas: int | None = None, addresses: list[str] | None = None) -> LocalPods:
        """One process per replica of the Deployment as it is now; `addresses`: listen on these (a
        restart behind a stable Service address, as a Service's ClusterIP stays across a rollout)."""
        obj = self.cluster.get("deployment", self.deployment, self.namespace)
        assert obj is not None, f"deployment {self.namespace}/{self.deployment} does not exist"
        spec = obj["spec"]["template"]["spec"]
        labels = obj["spec"]["template"]["metadata"]["labels"]
        (container,) = spec["containers"]
        count = obj["spec"].get("replicas", 1) if replicas is None else replicas
        for index in range(count):
            self._start_one(index, container, spec.get("volumes") or [],
                            addresses[index] if addresses and index < len(addresses) else None)
        if self._config_maps and self._sync is None:
            self._sync = threading.Thread(target=self._sync_config_maps, name=f"kubelet-{self.deployment}", daemon=True)
            self._sync.start()
        for svc in self.cluster.api(f"/api/v1/namespaces/{self.namespace}/services")["items"]:
            if selects(svc["spec"].get("selector") or {}, labels):
                for host in service_hosts(svc["metadata"]["name"], self.namespace):
                    self.cluster.publish(host, self.addresses)
        return self

    def _start_one(self, index: int, container: dict[str, Any], volumes: list[dict[str, Any]],
                   address: str | None = None) -> None:
        name = f"{self.deployment}-{index}"
        address = address or self.cluster.new_address()
        root = self.cluster.workdir / "pods" / self.namespace / f"{name}-{time.monotonic_ns()}"  # a restart gets fresh mounts
        mounts: dict[str, Path] = {}
        for mount in container.get("volumeMounts") or []:
            (volume,) = [v for v in volumes if v["name"] == mount["name"]]
            local = root / mount["name"]
            local.mkdir(parents=True)
            if "secret" in volume:
                self._write_secret(volume["secret"], local)
            elif "configMap" in volume:
                self._write_config_map(volume["configMap"], local)
                self._config_maps.append((volume["configMap"], local))
            mounts[mount["mountPath"]] = local
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(self.source), "TMPDIR": str(mounts.get("/tmp", root)),
               "NOCTAYA_LISTEN_HOST": address, "PYTHONDONTWRITEBYTECODE": "1"}
        for var in container.get("env") or []:
            assert "valueFrom" not in var, f"{name}: env {var['name']} uses valueFrom, which LocalPods does not resolve"
            env[var["name"]] = _rewrite(var["value"], mounts)
        env.update(self.env_overrides)
        command = [*container.get("command", []), *container.get("args", [])]
        assert command[:2] == ["python", "-m"], f"{name}: not Noctaya's image command: {command}"
        self.cluster.spawn_with_cluster_names(name, [sys.executable, *command[1:]], env, cwd=self.source)
        self.addresses.append(address)
        self._names.append(name)

    def _write_secret(self, volume: dict[str, Any], target: Path) -> None:
        secret = self.cluster.get("secret", volume["secretName"], self.namespace)
        assert secret is not None, f"secret {volume['secretName']} missing"
        data = {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}
        items = volume.get("items") or [{"key": k, "path": k} for k in data]
        for item in items:
            path = target / item["path"]
            path.write_bytes(data[item["key"]])
            path.chmod(0o400)

    def _write_config_map(self, volume: dict[str, Any], target: Path, refresh: bool = False) -> bool:
        """The kubelet's atomic writer: the files in a new timestamped directory, then ``..data`` swapped
        to it with one rename, so a reader never sees a half-written file. True when the data changed."""
        obj = self.cluster.get("configmap", volume["name"], self.namespace)
        if obj is None:
            # At start a missing ConfigMap keeps the Pod from starting; later the kubelet keeps the files
            # it has (the Pod itself goes when its owner is deleted).
            assert refresh or volume.get("optional"), f"configmap {volume['name']} missing"
            return False
        data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
        items = volume.get("items") or [{"key": k, "path": k} for k in sorted(data)]
        current = target / "..data"
        if current.exists() and all((current / i["path"]).read_bytes() == data.get(i["key"], b"") for i in items):
            return False
        fresh = target / f"..{time.time_ns()}"
        fresh.mkdir()
        for item in items:
            (fresh / item["path"]).write_bytes(data[item["key"]])
        old = os.readlink(current) if current.is_symlink() else None
        link = target / "..data_tmp"
        link.symlink_to(fresh.name)
        os.replace(link, current)
        if old is not None:
            shutil.rmtree(target / old, ignore_errors=True)
        for item in items:  # the user-visible names point through ..data, as the kubelet makes them
            visible = target / item["path"]
            if not visible.is_symlink():
                visible.symlink_to(f"..data/{item['path']}")
        return True

    def _sync_config_maps(self) -> None:
        while not self._stop.wait(CONFIG_MAP_SYNC_SECONDS):
            for volume, target in self._config_maps:
                try:
                    self._write_config_map(volume, target, refresh=True)
                except (requests.RequestException, OSError):
                    pass  # the next sync tries again, as the kubelet does

    def wait_http(self, port: int, path: str = "/healthz", timeout: float = 30.0) -> None:
        """Until every replica answers ``path`` on ``port`` (the public /healthz, as load balancers ask it)."""
        for name, address in zip(self._names, self.addresses, strict=True):
            deadline = time.monotonic() + timeout
            while True:
                try:
                    if requests.get(f"http://{address}:{port}{path}", timeout=2).status_code < 500:
                        break
                except requests.RequestException:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} not answering {path} on {address}:{port}: {self.cluster.log_tail(name)}")
                time.sleep(0.1)

    def url(self, index: int = 0, port: int = 8080) -> str:
        return f"http://{self.addresses[index]}:{port}"

    def stop(self) -> None:
        self._stop.set()
        if self._sync is not None:
            self._sync.join(10)
        for name in self._names:
            self.cluster.stop_process(name)
        self._names.clear()

    def rollout(self, source: Path = REPO_ROOT) -> LocalPods:
        """The Deployment's new template, played: these processes stop and new ones start from the
        Deployment as it is now (`source`: the tree its image runs), on the same addresses, so KEDA's
        scaler connection finds the new Pod as it would behind the scaler Service's ClusterIP."""
        addresses = list(self.addresses)
        self.stop()
        fresh = LocalPods(self.cluster, self.namespace, self.deployment, self.env_overrides, source=source)
        return fresh.start(len(addresses), addresses=addresses)


class ModelServer:
    """An OpenAI-compatible backend listening exactly while a backend Pod is Ready (see the module doc).

    ``pods_seen`` counts every backend Pod that ever existed, and ``events`` records when the server
    went up and down, for the assertions and the timeline."""

    def __init__(self, cluster: Cluster, namespace: str, service: str, port: int, timeline: Timeline) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.selector = f"serving.noctaya.io/llmservice={service},serving.noctaya.io/component=backend"
        self.timeline = timeline
        self.address = cluster.new_address()
        self.backend = FakeBackend(port=port, host=self.address)
        self.pods_seen: set[str] = set()
        self.up_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"model-server-{service}", daemon=True)
        for host in service_hosts(f"{service}-backend", namespace):
            cluster.publish(host, [self.address])

    def start(self) -> ModelServer:
        self._thread.start()
        return self

    def ready_pods(self) -> list[str]:
        pods = self.cluster.api(f"/api/v1/namespaces/{self.namespace}/pods?labelSelector={self.selector}")["items"]
        ready = []
        for pod in pods:
            self.pods_seen.add(pod["metadata"]["name"])
            conds = (pod.get("status") or {}).get("conditions") or []
            if not pod["metadata"].get("deletionTimestamp") and any(
                    c["type"] == "Ready" and c["status"] == "True" for c in conds):
                ready.append(pod["metadata"]["name"])
        return ready

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                ready = self.ready_pods()
            except requests.RequestException:
                ready = []
            if ready and not self.backend.running:
                self.backend.start()
                self.up_at = time.monotonic()
                self.timeline.note(f"model server up: backend Pod {ready[0]} Ready")
            elif not ready and self.backend.running:
                # kwok deletes a Pod at once; a kubelet would first run its preStop drain, which lets
                # the requests in flight finish (tests/hooks/test_drain.py covers the real one).
                waited = self.backend.drain(DRAIN_GRACE_SECONDS)
                self.up_at = None
                self.timeline.note(f"model server down: no Ready backend Pod (drained in {waited:.2f}s)")
            self._stop.wait(POLL_SECONDS)

    def pod_states(self) -> list[str]:
        """name:phase:ready:container state of every backend Pod, for the timeline."""
        out = []
        for pod in self.cluster.api(f"/api/v1/namespaces/{self.namespace}/pods?labelSelector={self.selector}")["items"]:
            status = pod.get("status") or {}
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or [])
            states = [next(iter(cs.get("state") or {"?": {}})) + ":" + str(next(iter((cs.get("state") or {}).values()), {}).get("reason", ""))
                      for cs in status.get("containerStatuses") or []]
            gone = "(deleting)" if pod["metadata"].get("deletionTimestamp") else ""
            out.append(f"{pod['metadata']['name'][-5:]}:{status.get('phase')}:{'Ready' if ready else 'NotReady'}:{','.join(states)}{gone}")
        return out

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        if self.backend.running:
            self.backend.stop()


def _rewrite(value: str, mounts: dict[str, Path]) -> str:
    for mount_path in sorted(mounts, key=len, reverse=True):
        if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
            return str(mounts[mount_path]) + value[len(mount_path):]
    return value
