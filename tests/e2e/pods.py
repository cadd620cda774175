"""The Pods of the lifecycle suite that do real work, run on this machine (there is no container runtime).

- ``LocalPods`` plays the kubelet for a Deployment the hooks rendered in Noctaya's own image (gateway,
  aggregator): it reads the Deployment from the API server and starts one process per replica with
  that Deployment's command, env, Secret and ConfigMap volumes (written to files, their mount paths
  rewritten), each on a private loopback address, and makes every Service selecting those Pods resolve
  to them (as a headless Service would; with ``service_ips``, to a stable virtual address of the
  Service instead, ``ServiceIP``, as a ClusterIP Service does). So what is tested is the rendered
  Deployment, not a hand-written command line. A ConfigMap
  volume is refreshed as the kubelet does it — new files in a fresh directory, then one atomic swap of
  the ``..data`` link — every ``CONFIG_MAP_SYNC_SECONDS`` (a kubelet's periodic Pod sync is about a
  minute by default; the suite shortens it so a membership change is seen within its timeouts).
  A Pod template that names a ``serviceAccountName`` whose token is automounted (the Pod's
  ``automountServiceAccountToken``, else the ServiceAccount's, else true, as Kubernetes decides) gets
  the kubelet's projected token: a token for that ServiceAccount from the TokenRequest API, with the
  test API server's ``ca.crt`` and the ``namespace``, in a directory of the Pod's own
  (``NOCTAYA_SERVICE_ACCOUNT_DIR``, where a container would find
  /var/run/secrets/kubernetes.io/serviceaccount), and ``KUBERNETES_SERVICE_HOST``/``_PORT`` naming the
  API server, which the kubelet sets in every Pod; the token is renewed at 80 % of its lifetime, as
  the kubelet renews it. A Pod without a ServiceAccount name, or not automounting its token, gets
  none of this, the two ``KUBERNETES_SERVICE_*`` variables included, although a kubelet sets them in
  every Pod: with them and no ``NOCTAYA_SERVICE_ACCOUNT_DIR`` a process would read this machine's own
  /var/run/secrets/kubernetes.io/serviceaccount, which holds a real cluster's token when the suite runs
  in a Pod (the default ServiceAccount's token is not played either: the suite's Pods never needed it).
  ``credentials=False`` plays no token at all: for gateways in front of a ``ModelServer``, which serves
  every backend Pod at the Service's name while the Pods' IPs are kwok's, which nothing serves; with a
  token such a gateway would balance over those IPs (issue 41), without one it dials the Service.
  ``LocalPods.rolling_update`` plays a new template as a RollingUpdate Deployment rolls it under
  traffic (new Pod on a new address, Ready, in its Services; old Pod SIGTERMed, out of its Services a
  moment later, ending by itself); ``LocalPods.rollout`` plays it as Recreate on the same addresses.
- ``ServiceIP`` is kube-proxy for one Service: a stable address whose every new connection goes to one
  of the Service's ready endpoints, on the targetPort. ``ClusterNames`` resolves Service names for the
  suite's own clients as the hosts file does for its processes (this process cannot mount it).
- ``ModelServer`` is the backend: a small OpenAI-compatible server that listens exactly while the
  backend Deployment has a Ready Pod (as kwok reports it), so a cold request really waits for KEDA →
  Deployment → ReplicaSet → scheduler → kwok → gateway readiness.
"""

from __future__ import annotations

import base64
import itertools
import os
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote, urlsplit

import httpcore2
import httpx2
import requests

from tests.e2e.cluster import Cluster, Timeline
from tests.gateway.fakebackend import FakeBackend
from tests.kube.apiserver import REPO_ROOT

CLUSTER_DOMAIN = "cluster.local"
POLL_SECONDS = 0.1
DRAIN_GRACE_SECONDS = 30.0  # a scaled-in backend answers what it has in flight for this long, at most
CONFIG_MAP_SYNC_SECONDS = 1.0
REVISION_ANNOTATION = "deployment.kubernetes.io/revision"  # the Deployment controller's, on Deployment and ReplicaSet
DEFAULT_TERMINATION_GRACE_SECONDS = 30  # a Pod's terminationGracePeriodSeconds when its template has none
TOKEN_SECONDS = 3600  # a projected service-account token's lifetime (the kubelet's default)
TOKEN_RENEW_FRACTION = 0.8  # the kubelet renews a projected token once this much of its lifetime passed
SERVICE_ACCOUNT_WAIT_SECONDS = 30.0  # a Pod's ServiceAccount may be created a moment after its Deployment


def service_hosts(name: str, namespace: str) -> list[str]:
    return [f"{name}.{namespace}.svc.{CLUSTER_DOMAIN}", f"{name}.{namespace}.svc"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


@dataclass
class Replacement:
    """One Pod replaced by ``LocalPods.rolling_update``; times in seconds after the update began."""

    old: str
    new: str
    old_address: str
    new_address: str
    new_ready: float  # the new Pod's readiness probe answered 200 (its address joined its Services)
    terminated: float  # SIGTERM to the old Pod
    unpublished: float  # the old Pod's address left its Services
    grace: float  # the template's terminationGracePeriodSeconds
    exited_after: float | None = None  # seconds from SIGTERM to the old process's exit
    exit_code: int | None = None
    killed: bool = False  # still running at the end of its grace: SIGKILLed, as the kubelet does


class LocalPods:
    """The replicas of one Deployment in Noctaya's image, as local processes (see the module doc)."""

    def __init__(self, cluster: Cluster, namespace: str, deployment: str, env: dict[str, str] | None = None,
                 source: Path = REPO_ROOT, service_ips: bool = False, credentials: bool = True) -> None:
        """``service_ips``: each Service selecting these Pods gets a ``ServiceIP`` its names resolve to
        (a ClusterIP: a connection by name survives a Pod changing address, as in a cluster); without,
        its names resolve to the Pods' own addresses (a headless Service: a client that resolved the
        name keeps the old address until it resolves again). ``credentials``: play the Pods'
        service-account tokens (module doc)."""
        self.cluster = cluster
        self.source = source  # the tree whose code the image runs (another release's, for the upgrade tests)
        self.namespace = namespace
        self.deployment = deployment
        self.env_overrides = dict(env or {})  # what a benchmark changes on top of the rendered env
        self.addresses: list[str] = []
        self._names: list[str] = []
        self._config_maps: list[tuple[str, dict[str, Any], Path]] = []  # (Pod, volume source, local mount dir)
        self._tokens: list[ProjectedToken] = []  # the Pods' service-account tokens, renewed by the sync
        self.service_account_wait = SERVICE_ACCOUNT_WAIT_SECONDS
        self.credentials = credentials
        self._template: dict[str, Any] | None = None  # the Pod template the processes run
        self.service_ips: dict[str, ServiceIP] | None = {} if service_ips else None  # by Service name
        self._stop = threading.Event()
        self._sync: threading.Thread | None = None

    def start(self, replicas: int | None = None, addresses: list[str] | None = None) -> LocalPods:
        """One process per replica of the Deployment as it is now; `addresses`: listen on these (a
        restart behind a stable Service address, as a Service's ClusterIP stays across a rollout)."""
        obj = self.cluster.get("deployment", self.deployment, self.namespace)
        assert obj is not None, f"deployment {self.namespace}/{self.deployment} does not exist"
        self._template = obj["spec"]["template"]
        count = obj["spec"].get("replicas", 1) if replicas is None else replicas
        for index in range(count):
            name, address = self._start_one(f"{self.deployment}-{index}", self._template,
                                            addresses[index] if addresses and index < len(addresses) else None)
            self._names.append(name)
            self.addresses.append(address)
        self._start_sync()
        self._publish(self.addresses)
        return self

    def _start_sync(self) -> None:
        if (self._config_maps or self._tokens) and self._sync is None:
            self._sync = threading.Thread(target=self._sync_config_maps, name=f"kubelet-{self.deployment}", daemon=True)
            self._sync.start()

    def _publish(self, addresses: list[str]) -> None:
        """``addresses`` are the ready endpoints of every Service selecting these Pods: its names
        resolve to them, or (``service_ips``) its ServiceIP sends new connections to them."""
        assert self._template is not None
        labels = self._template["metadata"]["labels"]
        for svc in self.cluster.api(f"/api/v1/namespaces/{self.namespace}/services")["items"]:
            if not selects(svc["spec"].get("selector") or {}, labels):
                continue
            name = svc["metadata"]["name"]
            if self.service_ips is None:
                for host in service_hosts(name, self.namespace):
                    self.cluster.publish(host, addresses)
                continue
            if name not in self.service_ips:
                ports = {p["port"]: self._container_port(p.get("targetPort", p["port"])) for p in svc["spec"]["ports"]}
                self.service_ips[name] = ServiceIP(self.cluster, f"{self.namespace}/{name}", ports)
                for host in service_hosts(name, self.namespace):
                    self.cluster.publish(host, [self.service_ips[name].address])
            self.service_ips[name].endpoints = list(addresses)

    def _container_port(self, target: int | str) -> int:
        """A Service port's targetPort: a number, or the name of a container port of the template."""
        if isinstance(target, int):
            return target
        assert self._template is not None
        found = [p["containerPort"] for c in self._template["spec"]["containers"] for p in c.get("ports") or []
                 if p.get("name") == target]
        assert found, f"{self.deployment}: no container port named {target}"
        return found[0]

    def _start_one(self, name: str, template: dict[str, Any], address: str | None = None) -> tuple[str, str]:
        """One Pod of ``template`` as the process ``name``; (name, its address)."""
        (container,) = template["spec"]["containers"]
        volumes = template["spec"].get("volumes") or []
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
                self._config_maps = [*self._config_maps, (name, volume["configMap"], local)]
            mounts[mount["mountPath"]] = local
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(self.source), "TMPDIR": str(mounts.get("/tmp", root)),
               "NOCTAYA_LISTEN_HOST": address, "PYTHONDONTWRITEBYTECODE": "1"}
        for var in container.get("env") or []:
            assert "valueFrom" not in var, f"{name}: env {var['name']} uses valueFrom, which LocalPods does not resolve"
            env[var["name"]] = _rewrite(var["value"], mounts)
        env.update(self._service_account(name, template["spec"], root))
        env.update(self.env_overrides)
        command = [*container.get("command", []), *container.get("args", [])]
        assert command[:2] == ["python", "-m"], f"{name}: not Noctaya's image command: {command}"
        self.cluster.spawn_with_cluster_names(name, [sys.executable, *command[1:]], env, cwd=self.source)
        return name, address

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
        """The ConfigMap's files, written as the kubelet writes them (``atomic_write``). True when the
        data changed."""
        obj = self.cluster.get("configmap", volume["name"], self.namespace)
        if obj is None:
            # At start a missing ConfigMap keeps the Pod from starting; later the kubelet keeps the files
            # it has (the Pod itself goes when its owner is deleted).
            assert refresh or volume.get("optional"), f"configmap {volume['name']} missing"
            return False
        data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
        items = volume.get("items") or [{"key": k, "path": k} for k in sorted(data)]
        return atomic_write(target, {item["path"]: data[item["key"]] for item in items})

    def _service_account(self, pod: str, spec: dict[str, Any], root: Path) -> dict[str, str]:
        """The env of a Pod whose ServiceAccount token is mounted (module doc), its files written;
        empty when the template names no ServiceAccount or does not automount its token."""
        account = spec.get("serviceAccountName")
        if not account or not self.credentials:
            return {}
        # Created by the same sync as the Deployment, it may arrive a moment later: the ReplicaSet
        # controller retries a Pod the API server refused for want of it as long.
        deadline = time.monotonic() + self.service_account_wait
        while (obj := self.cluster.get("serviceaccount", account, self.namespace)) is None and \
                time.monotonic() < deadline:
            time.sleep(POLL_SECONDS * 5)
        assert obj is not None, (f"{pod}: serviceaccount {self.namespace}/{account} does not exist; the kubelet "
                                 "would not start this Pod (the API server would not even admit it)")
        automount = spec.get("automountServiceAccountToken")
        if automount is None:
            automount = obj.get("automountServiceAccountToken", True)
        if not automount:
            return {}
        token = ProjectedToken(self.cluster, self.namespace, account, root / "serviceaccount")
        token.renew()
        self._tokens.append(token)
        api = urlsplit(self.cluster.plane.url)
        return {"NOCTAYA_SERVICE_ACCOUNT_DIR": str(token.directory), "KUBERNETES_SERVICE_HOST": str(api.hostname),
                "KUBERNETES_SERVICE_PORT": str(api.port or 443)}

    def renew_tokens(self, at: float | None = None) -> int:
        """Renew every token past ``TOKEN_RENEW_FRACTION`` of its lifetime at monotonic time ``at``
        (now by default), as the kubelet does; how many were renewed."""
        due = [t for t in self._tokens if t.due(time.monotonic() if at is None else at)]
        for token in due:
            token.renew()
        return len(due)

    def _sync_config_maps(self) -> None:
        while not self._stop.wait(CONFIG_MAP_SYNC_SECONDS):
            for _pod, volume, target in self._config_maps:
                try:
                    self._write_config_map(volume, target, refresh=True)
                except (requests.RequestException, OSError):
                    pass  # the next sync tries again, as the kubelet does
            try:
                self.renew_tokens()
            except (requests.RequestException, OSError):
                pass  # likewise: the old token stays valid until it expires

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
        for service_ip in (self.service_ips or {}).values():
            service_ip.close()

    def rollout(self, source: Path = REPO_ROOT) -> LocalPods:
        """The Deployment's new template, played as Recreate: these processes stop and new ones start
        from the Deployment as it is now (`source`: the tree its image runs), on the same addresses, so
        KEDA's scaler connection finds the new Pod as it would behind the scaler Service's ClusterIP.
        Requests sent meanwhile fail: for a Deployment under traffic, see ``rolling_update``."""
        addresses = list(self.addresses)
        self.stop()
        fresh = LocalPods(self.cluster, self.namespace, self.deployment, self.env_overrides, source=source,
                          credentials=self.credentials)
        return fresh.start(len(addresses), addresses=addresses)

    def new_replica_set(self, timeout: float = 60.0) -> dict[str, Any]:
        """The Deployment controller's ReplicaSet of the Deployment's current template: the one whose
        revision is the Deployment's, once the controller has observed the Deployment's generation."""
        base = f"/apis/apps/v1/namespaces/{self.namespace}"
        deadline = time.monotonic() + timeout
        while True:
            dep = self.cluster.api(f"{base}/deployments/{self.deployment}")
            revision = (dep["metadata"].get("annotations") or {}).get(REVISION_ANNOTATION)
            if revision and dep["status"].get("observedGeneration") == dep["metadata"]["generation"]:
                selector = ",".join(f"{k}={v}" for k, v in dep["spec"]["selector"]["matchLabels"].items())
                for rs in self.cluster.api(f"{base}/replicasets?labelSelector={quote(selector)}")["items"]:
                    owners = [o["uid"] for o in rs["metadata"].get("ownerReferences") or []]
                    if dep["metadata"]["uid"] in owners and \
                            (rs["metadata"].get("annotations") or {}).get(REVISION_ANNOTATION) == revision:
                        return rs
            if time.monotonic() > deadline:
                raise RuntimeError(f"no ReplicaSet of {self.deployment}'s revision {revision} within {timeout}s")
            time.sleep(POLL_SECONDS)

    def rolling_update(self, admin_port: int, endpoints_lag: float = 1.5, timeout: float = 60.0,
                       note: Callable[[str], None] | None = None) -> list[Replacement]:
        """The Deployment's new template, played as its RollingUpdate strategy rolls it under traffic
        (the hooks leave the defaults, maxSurge 25% and maxUnavailable 25%: one new Pod first, no old
        one gone before it is Ready), with the kubelet and the endpoints controller, replica by replica:

        1. the Deployment controller's new ReplicaSet is awaited (``new_replica_set``); its template
           is what the new Pods run, each on a new private address (a new Pod IP), as process
           ``<deployment>-<pod-template-hash>-<index>``;
        2. once its readiness probe (``/healthz`` on ``admin_port``) answers 200, its address joins
           every Service selecting these Pods;
        3. the old Pod's process is sent SIGTERM (the process, not its group: the container runtime
           signals PID 1), and its address leaves its Services ``endpoints_lag`` seconds later — the
           endpoints controller drops a terminating Pod at once, but kube-proxy and client-side
           balancers learn it about that much later and meanwhile still send it new connections
           (a connection already open stays, as with kube-proxy);
        4. then the next replica; at the end every old process is waited for: it must end by itself
           within the template's terminationGracePeriodSeconds from its SIGTERM, else it is killed
           (SIGKILL to its group), as the kubelet does.

        ``note`` is told each step. Returns what happened to each old Pod."""
        say = note or (lambda _: None)
        t0 = time.monotonic()
        rs = self.new_replica_set(timeout)
        template = rs["spec"]["template"]
        assert self._template is not None, "start() first"
        assert template["spec"] != self._template["spec"], \
            f"{self.deployment}: the new ReplicaSet runs the same Pod spec; nothing to roll"
        pod_hash = rs["metadata"]["labels"].get("pod-template-hash", rs["metadata"]["name"].rsplit("-", 1)[-1])
        say(f"{self.deployment}: new ReplicaSet {rs['metadata']['name']} (revision "
            f"{rs['metadata']['annotations'][REVISION_ANNOTATION]}) after {time.monotonic() - t0:.2f}s")
        grace = float(template["spec"].get("terminationGracePeriodSeconds", DEFAULT_TERMINATION_GRACE_SECONDS))
        serving = list(self.addresses)
        replaced: list[Replacement] = []
        terminated_at: list[float] = []
        for index, (old, old_address) in enumerate(zip(list(self._names), list(self.addresses), strict=True)):
            new, new_address = self._start_one(f"{self.deployment}-{pod_hash}-{index}", template)
            self._wait_ready(new, new_address, admin_port, timeout)
            ready = time.monotonic() - t0
            serving.append(new_address)
            self._publish(serving)
            say(f"{new} Ready at {new_address} after {ready:.2f}s: in its Services {serving}")
            self.cluster.signal_process(old, signal.SIGTERM)
            terminated_at.append(time.monotonic())
            say(f"{old} ({old_address}) sent SIGTERM; it leaves its Services in {endpoints_lag}s")
            time.sleep(endpoints_lag)
            serving.remove(old_address)
            self._publish(serving)
            unpublished = time.monotonic() - t0
            say(f"{old_address} out of its Services {unpublished - (terminated_at[-1] - t0):.2f}s after SIGTERM: {serving}")
            replaced.append(Replacement(old, new, old_address, new_address, ready, terminated_at[-1] - t0,
                                        unpublished, grace))
            self._names[index], self.addresses[index] = new, new_address
            self._template = template
            self._start_sync()
        for done, signalled in zip(replaced, terminated_at, strict=True):
            code = self.cluster.wait_process(done.old, signalled + grace - time.monotonic())
            if code is None:
                self.cluster.stop_process(done.old)  # SIGKILL after the grace (its group: nothing outlives the Pod)
                done.killed = True
            else:
                done.exit_code = code
            done.exited_after = time.monotonic() - signalled
            self._config_maps = [c for c in self._config_maps if c[0] != done.old]
            say(f"{done.old} {'killed at the end of its grace' if done.killed else f'exited with {code}'} "
                f"{done.exited_after:.2f}s after SIGTERM (grace {grace:.0f}s)")
        return replaced

    def _wait_ready(self, name: str, address: str, port: int, timeout: float) -> None:
        """Until the kubelet would call the Pod Ready: its readiness probe (/healthz on ``port``) 2xx/3xx."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if 200 <= requests.get(f"http://{address}:{port}/healthz", timeout=2).status_code < 400:
                    return
            except requests.RequestException:
                pass
            if self.cluster.wait_process(name, 0) is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} not Ready at {address}:{port}: {self.cluster.log_tail(name)}")
            time.sleep(POLL_SECONDS)


def atomic_write(target: Path, files: dict[str, bytes]) -> bool:
    """The kubelet's atomic writer (ConfigMap, Secret and projected volumes): the files in a new
    timestamped directory, then ``..data`` swapped to it with one rename, so a reader never sees a
    half-written file; each visible name a link through ``..data``. True when the data changed."""
    current = target / "..data"
    if current.exists() and all((current / path).exists() and (current / path).read_bytes() == data
                                for path, data in files.items()):
        return False
    fresh = target / f"..{time.time_ns()}"
    fresh.mkdir()
    for path, data in files.items():
        (fresh / path).write_bytes(data)
    old = os.readlink(current) if current.is_symlink() else None
    link = target / "..data_tmp"
    link.symlink_to(fresh.name)
    os.replace(link, current)
    if old is not None:
        shutil.rmtree(target / old, ignore_errors=True)
    for path in files:
        visible = target / path
        if not visible.is_symlink():
            visible.symlink_to(f"..data/{path}")
    return True


class ProjectedToken:
    """A Pod's projected service-account token (token, ca.crt, namespace in ``directory``) as the
    kubelet keeps it: requested from the TokenRequest API for ``TOKEN_SECONDS``, renewed once
    ``TOKEN_RENEW_FRACTION`` of that has passed."""

    def __init__(self, cluster: Cluster, namespace: str, account: str, directory: Path) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.account = account
        self.directory = directory
        self.issued: float | None = None  # monotonic
        self.seconds = TOKEN_SECONDS
        self.renewals = 0

    def due(self, at: float) -> bool:
        return self.issued is None or at - self.issued >= TOKEN_RENEW_FRACTION * self.seconds

    def renew(self) -> None:
        plane = self.cluster.plane
        resp = requests.post(
            f"{plane.url}/api/v1/namespaces/{self.namespace}/serviceaccounts/{self.account}/token",
            json={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                  "spec": {"expirationSeconds": TOKEN_SECONDS}},
            headers={"Authorization": f"Bearer {plane.token}"}, verify=str(plane.ca_file), timeout=10)
        assert resp.status_code != 404, (f"serviceaccount {self.namespace}/{self.account} does not exist: the "
                                         "kubelet cannot mount its token")
        resp.raise_for_status()
        issued = time.monotonic()
        status = resp.json()["status"]
        self.directory.mkdir(parents=True, exist_ok=True)
        atomic_write(self.directory, {"token": status["token"].encode(), "ca.crt": plane.ca_file.read_bytes(),
                                      "namespace": self.namespace.encode()})
        self.renewals += self.issued is not None
        self.issued = issued
        # The lifetime the API server granted (it may change the one asked for), counted from now.
        expires = datetime.fromisoformat(status["expirationTimestamp"].replace("Z", "+00:00"))
        self.seconds = max(1.0, (expires - datetime.now(UTC)).total_seconds())


class ServiceIP:
    """A Service's ClusterIP as kube-proxy serves it: a stable private address on every port of the
    Service; each new connection goes to one of the Service's ready endpoints at that moment
    (``endpoints``, round robin) on that port's targetPort, and stays there until either side closes
    it — so a kept-alive connection to a terminating Pod lasts, and a client reconnecting to the same
    address reaches whichever Pod is ready now. With no ready endpoint the address refuses connections
    (kube-proxy's REJECT rule: ECONNREFUSED; nothing listens then); an endpoint no longer listening: the
    connection is closed at once. ``connections`` counts them per endpoint; ``endpoint_of`` tells a
    client which Pod its connection reached."""

    def __init__(self, cluster: Cluster, name: str, ports: dict[int, int]) -> None:
        self.name = name
        self.address = cluster.new_address()
        self.ports = dict(ports)
        self._endpoints: list[str] = []
        self.connections: dict[str, int] = {}
        self._routes: dict[tuple[str, int], str] = {}  # client (address, port) -> endpoint
        self._turn = itertools.count()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._listeners: list[socket.socket] = []

    @property
    def endpoints(self) -> list[str]:
        return self._endpoints

    @endpoints.setter
    def endpoints(self, addresses: list[str]) -> None:
        """Listening exactly while there is a ready endpoint (refused otherwise, as kube-proxy's rules)."""
        with self._lock:
            self._endpoints = list(addresses)
            if self._endpoints and not self._listeners and not self._stop.is_set():
                for port, target in self.ports.items():
                    listener = socket.create_server((self.address, port))
                    listener.settimeout(0.2)
                    self._listeners.append(listener)
                    threading.Thread(target=self._accept, args=(listener, target),
                                     name=f"service-ip-{self.name}:{port}", daemon=True).start()
            elif not self._endpoints:
                self._close_listeners()

    def _close_listeners(self) -> None:
        for listener in self._listeners:
            listener.close()
        self._listeners = []

    def _accept(self, listener: socket.socket, target: int) -> None:
        while not self._stop.is_set():
            try:
                client, peer = listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed by close()
                return
            endpoints = self.endpoints
            if not endpoints:
                client.close()
                continue
            endpoint = endpoints[next(self._turn) % len(endpoints)]
            try:
                upstream = socket.create_connection((endpoint, target), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            self.connections[endpoint] = self.connections.get(endpoint, 0) + 1
            self._routes[peer[:2]] = endpoint
            ends = [2]
            lock = threading.Lock()
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pipe, args=(a, b, ends, lock), daemon=True).start()

    def endpoint_of(self, client: tuple[str, int]) -> str | None:
        """The endpoint the open connection from ``client`` (its address and port) was sent to."""
        return self._routes.get(tuple(client[:2]))

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._close_listeners()


def _pipe(src: socket.socket, dst: socket.socket, ends: list[int], lock: threading.Lock) -> None:
    """One direction of a proxied connection; its end is passed on (a half close), and the last of
    the two directions to end closes both sockets."""
    try:
        while data := src.recv(65536):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
    with lock:
        ends[0] -= 1
        last = ends[0] == 0
    if last:
        src.close()
        dst.close()


class ClusterNames(httpcore2.NetworkBackend):
    """Service names for the suite's own clients (an httpcore network backend; ``http_client`` makes an
    httpx client of it): the suite's processes resolve them through the hosts file the cluster
    publishes (cluster.py), which this process cannot mount over its /etc/hosts; a connection here to
    ``<service>.<namespace>.svc[.cluster.local]`` goes to the address the cluster publishes for that
    name at that moment (a ServiceIP; round robin among several), same port. Other names are dialled
    as they are."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._direct = httpcore2.SyncBackend()
        self._turn = itertools.count()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore2.NetworkStream:
        if host.removesuffix("." + CLUSTER_DOMAIN).endswith(".svc"):
            addresses = self.cluster.resolve(host)
            if not addresses:
                raise httpcore2.ConnectError(f"{host}: unknown name")
            host = addresses[next(self._turn) % len(addresses)]
        return self._direct.connect_tcp(host, port, timeout, local_address, socket_options)

    def http_client(self, **kwargs: Any) -> httpx2.Client:
        """An httpx client (as the `openai` SDK takes it: ``http_client=``) resolving Service names
        through this; ``kwargs`` as httpx.Client takes them (event_hooks, ...)."""
        transport = httpx2.HTTPTransport()
        # httpx builds its connection pool with the default network backend and has no argument for
        # another: the pool is replaced by the same one on this backend.
        transport._pool = httpcore2.ConnectionPool(network_backend=self, max_connections=100)
        return httpx2.Client(transport=transport, follow_redirects=True, **kwargs)


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

    @property
    def running(self) -> bool:
        return self.backend.running

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


class Stoppable(Protocol):
    def stop(self) -> None: ...


def stop_together(things: Iterable[Stoppable], timeout: float = 90.0) -> None:
    """Each one's ``stop()`` at the same time, as the kubelet stops the Pods of a deleted namespace: a
    gateway takes its drain delay (5 s) to end, so a test's models stopped one after another took that
    many times as long. The first error is raised once all have stopped."""
    errors: list[BaseException] = []

    def stop(thing: Stoppable) -> None:
        try:
            thing.stop()
        except BaseException as exc:  # noqa: BLE001 - raised below, after the others stopped
            errors.append(exc)

    threads = [threading.Thread(target=stop, args=(t,), name="stop-together", daemon=True) for t in things]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), f"still stopping after {timeout}s"


def _rewrite(value: str, mounts: dict[str, Path]) -> str:
    for mount_path in sorted(mounts, key=len, reverse=True):
        if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
            return str(mounts[mount_path]) + value[len(mount_path):]
    return value
