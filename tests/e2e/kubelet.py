"""The kubelet of the Pods the harness plays itself, in namespaces kwok plays no stage in
(tests/e2e/kwok-stages.yaml): what ``EngineKubelet`` (tests/e2e/engine_pods.py: the rendered
containers of a real engine) and ``StandInKubelet`` (tests/e2e/standin_pods.py: a stand-in OpenAI
server per Pod) share.

Every Pod it plays gets a non-loopback Pod IP of the harness's range (tests/e2e/netns.py) that reaches
whatever plays the Pod, reported in ``status.podIP``/``podIPs`` from the moment its sandbox exists, so
kube-controller-manager's EndpointSlice controller publishes it as in a cluster (ready=false until
the Pod is Ready). A backend Pod is Ready ``readiness_lag`` seconds after its server first answers its
readiness probe's path (probed every ``PROBE_SECONDS``; 0: at once), and only then an endpoint of the
backend Service, whose ClusterIP is a ``ServiceIP`` (tests/e2e/pods.py: previous releases' gateways
dial the Service's name). A Pod being deleted leaves its Service at once, stops as its kind says, and
its object is then removed (grace period 0), as the kubelet confirms a deletion. Any other Pod of the
LLMService (its gateways, which LocalPods runs as processes) is Running and Ready at once, as kwok
reports it elsewhere in the suite, with a Pod IP of the range that nothing serves.

``events`` records what happened, for assertions and the timeline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import requests

from tests.e2e.cluster import Cluster, Timeline
from tests.e2e.netns import Network, PodNetwork
from tests.e2e.pods import ServiceIP, service_hosts

PROBE_SECONDS = 0.2
POLL_SECONDS = 0.1


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class PlayedPod:
    name: str
    kind: str  # "prewarm", "backend" or "other"
    index: int  # the order in which this kubelet began playing its Pods of this kind (0, 1, ...)
    address: str = ""  # the Pod IP, once its sandbox exists
    thread: threading.Thread | None = None
    container: dict[str, Any] = field(default_factory=dict)  # the serving container, as rendered
    network: PodNetwork | None = None  # its network namespace (EngineKubelet)
    engine: Any = None  # what serves: a LocalContainer (EngineKubelet), a StandInBackend (StandInKubelet)
    ready: bool = False
    deleting: bool = False
    restarts: int = 0
    exits: list[int] = field(default_factory=list)
    grace: float = 30.0  # its terminationGracePeriodSeconds
    answered_at: float | None = None  # monotonic: its server first answered the readiness path
    ready_at: float | None = None  # monotonic: first reported Ready
    stop_seconds: float | None = None  # deletion seen -> process ended


class Kubelet:
    """Plays the kubelet for the Pods of LLMService ``service`` in ``namespace`` (module doc).
    Subclasses play the backend (``_run_backend``), optionally a prewarm Job's Pod (``_run_job``), and
    say how a Pod's server ends (``_end``) and whether one runs (``running``)."""

    def __init__(self, cluster: Cluster, network: Network, service: str, port: int, timeline: Timeline,
                 namespace: str, readiness_lag: float = 0.0) -> None:
        self.cluster = cluster
        self.network = network
        self.namespace = namespace
        self.service = service
        self.port = port
        self.timeline = timeline
        self.readiness_lag = readiness_lag
        self.selector = f"serving.noctaya.io/llmservice={service}"
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
        """The backend Pods that are Ready and not being deleted (the Service's endpoints)."""
        return [p for p in self.pods.values() if p.kind == "backend" and p.ready and not p.deleting]

    def backends(self) -> list[PlayedPod]:
        """Every backend Pod played so far, in the order they began."""
        return [p for p in self.pods.values() if p.kind == "backend"]

    @property
    def running(self) -> bool:
        raise NotImplementedError

    def pod_states(self) -> list[str]:
        return [f"{p.name[-5:]}:{p.kind}:{p.address or '-'}:{'Ready' if p.ready else 'NotReady'}:restarts={p.restarts}"
                f"{':deleting' if p.deleting else ''}" for p in self.pods.values()]

    # --- the loop --------------------------------------------------------------------------------

    def start(self) -> Kubelet:
        """Starts playing (again: a no-op)."""
        if not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop playing: every Pod's server ends (``_end_at_stop``), every Pod network goes."""
        self._stop.set()
        self._thread.join(10)
        for pod in list(self.pods.values()):
            self._end_at_stop(pod)
            self._release(pod)
        self.service_ip.close()

    def _end_at_stop(self, played: PlayedPod) -> None:
        raise NotImplementedError

    def _list(self) -> list[dict[str, Any]]:
        return self.cluster.api(f"/api/v1/namespaces/{self.namespace}/pods?labelSelector={self.selector}")["items"]

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                pods = self._list()
            except requests.RequestException:
                # Not "every Pod is gone": an API server slow to answer must not stop the Pods.
                self._stop.wait(POLL_SECONDS)
                continue
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
        played = PlayedPod(name, kind, sum(1 for p in self.pods.values() if p.kind == kind))
        self.pods[name] = played
        target = {"prewarm": self._run_job, "backend": self._run_backend}.get(kind, self._run_other)
        played.thread = threading.Thread(target=self._play, args=(target, played, obj), name=f"pod-{name}",
                                         daemon=True)
        played.thread.start()

    def _play(self, target: Callable[[PlayedPod, dict[str, Any]], None], played: PlayedPod,
              obj: dict[str, Any]) -> None:
        """A Pod's thread: a failure of the harness itself shows in the timeline, not in a thread's
        traceback nobody reads (the Pod then stays as it was, as under a broken kubelet)."""
        try:
            target(played, obj)
        except Exception as exc:  # noqa: BLE001 - reported, and the test waiting on the Pod fails with it
            self.note(f"{played.name}: the harness's kubelet failed: {type(exc).__name__}: {exc}")

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

    @staticmethod
    def _container_status(container: dict[str, Any], state: dict[str, Any], ready: bool, restarts: int,
                          last: dict[str, Any] | None = None) -> dict[str, Any]:
        status = {"name": container["name"], "image": container["image"], "imageID": "", "ready": ready,
                  "started": "running" in state, "restartCount": restarts, "state": state}
        return status | ({"lastState": last} if last else {})

    def _sandbox_up(self, played: PlayedPod, address: str, reason: str = "ContainerCreating") -> None:
        """The Pod's sandbox exists: Pending with its Pod IP, which the EndpointSlice controller
        publishes (not ready) from now on, as in a cluster."""
        played.address = address
        self._patch_status(played.name, {"phase": "Pending", "podIP": address, "podIPs": [{"ip": address}],
                                         "startTime": now(), "conditions": self._conditions(False, False, reason)})

    # --- any other Pod of the model (its gateway: LocalPods runs its processes) -----------------------

    def _run_other(self, played: PlayedPod, obj: dict[str, Any]) -> None:
        """Running and Ready at once, as kwok reports the Pods it plays elsewhere in the suite; its Pod
        IP is one of the range that nothing serves (LocalPods serves the gateway on its own address)."""
        started = now()
        played.address = self.network.allocate()
        played.ready = True
        self._patch_status(played.name, {
            "phase": "Running", "startTime": started, "podIP": played.address, "podIPs": [{"ip": played.address}],
            "conditions": self._conditions(True, True),
            "containerStatuses": [self._container_status(c, {"running": {"startedAt": started}}, True, 0)
                                  for c in obj["spec"]["containers"]]})

    def _run_job(self, played: PlayedPod, obj: dict[str, Any]) -> None:
        self.note(f"{played.name}: a prewarm Pod; this kubelet does not play it")

    def _run_backend(self, played: PlayedPod, obj: dict[str, Any]) -> None:
        raise NotImplementedError

    # --- readiness ------------------------------------------------------------------------------------

    def _probe_until_exit(self, played: PlayedPod, path: str, exited: Callable[[], int | None]) -> int | None:
        """Probe ``path`` on the Pod IP until the server exits (``exited()``'s code) or the Pod is
        deleted (None). Ready ``readiness_lag`` seconds after it first answers 200 (again after a
        failed probe); not Ready at the first failed probe."""
        url = f"http://{played.address}:{self.port}{path}"
        answering_since: float | None = None
        while not played.deleting and not self._stop.is_set():
            code = exited()
            if code is not None:
                if played.ready:
                    self._set_ready(played, False)
                return code
            if not _answers(url):
                answering_since = None
                if played.ready:
                    self._set_ready(played, False)
            elif not played.ready:
                if answering_since is None:
                    answering_since = time.monotonic()
                    played.answered_at = played.answered_at or answering_since
                    self.note(f"{played.name}: engine answered readiness (GET {path} 200); Ready in "
                              f"{self.readiness_lag:g}s")
                if time.monotonic() - answering_since >= self.readiness_lag:
                    self._set_ready(played, True)
            self._stop.wait(PROBE_SECONDS)
        return None

    def _set_ready(self, played: PlayedPod, ready: bool) -> None:
        with self._lock:
            if played.deleting and ready:
                return
            played.ready = ready
            if ready and played.ready_at is None:
                played.ready_at = time.monotonic()
            # Noted before the endpoints change: a request served through them (16 tokens take well under
            # the status patch on a busy API server) must find this transition already recorded.
            self.note(f"{played.name}: {'Ready' if ready else 'not Ready'} (GET {played.container.get('name')} "
                      "readiness)")
            self.service_ip.endpoints = [p.address for p in self.ready_engines()]
        self._patch_status(played.name, {
            "conditions": self._conditions(True, ready, "" if ready else "ContainersNotReady"),
            "containerStatuses": [self._container_status(played.container, {"running": {"startedAt": now()}}, ready,
                                                         played.restarts)]})

    # --- deletion -------------------------------------------------------------------------------------

    def _begin_deletion(self, played: PlayedPod, obj: dict[str, Any] | None) -> None:
        with self._lock:
            played.deleting = True
            played.ready = False
            self.service_ip.endpoints = [p.address for p in self.ready_engines()]
        threading.Thread(target=self._terminate, args=(played, obj is not None), name=f"terminate-{played.name}",
                         daemon=True).start()

    def _terminate(self, played: PlayedPod, confirm: bool) -> None:
        t0 = time.monotonic()
        if self._end(played):
            played.stop_seconds = time.monotonic() - t0
        self._release(played)
        if confirm:
            self._force_delete(played.name)

    def _end(self, played: PlayedPod) -> bool:
        """Stop what plays the Pod, as the kubelet stops a deleted Pod; True when something ran."""
        raise NotImplementedError

    def _release(self, played: PlayedPod) -> None:
        """The Pod's sandbox gone: its network namespace (EngineKubelet; a StandInKubelet overrides)."""
        pod_network, played.network = played.network, None
        if pod_network is not None:
            self.network.remove_pod(pod_network)


def models_retired_at_end(cluster: Cluster, namespace: str, what: str = "LLMServices") -> Iterator[dict[str, Any]]:
    """The body of a module fixture of models whose Pods a kubelet of the harness plays in
    ``namespace``: yields the module's models by name; at its end their LLMServices are deleted while
    their kubelets still play the Pods (a Pod nobody confirms stays Terminating, and later modules wait
    for every backend in the cluster to be gone), then everything stops. The namespace stays, empty:
    other modules play Pods in it too, and one still terminating would refuse their objects."""
    from tests.e2e.pods import stop_together

    made: dict[str, Any] = {}
    yield made
    try:
        cluster.kubectl("-n", namespace, "delete", "llmservices", "--all", "--wait=false", check=False)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and (
                cluster.api(f"/api/v1/namespaces/{namespace}/pods")["items"]
                or cluster.api(f"/apis/serving.noctaya.io/v1alpha1/namespaces/{namespace}/llmservices")["items"]):
            time.sleep(0.5)
        left = [p["metadata"]["name"] for p in cluster.api(f"/api/v1/namespaces/{namespace}/pods")["items"]]
        assert not left, f"Pods of {namespace} still there 90 s after their {what} were deleted: {left}"
    finally:
        stop_together(made.values())


def endpoint_slice_addresses(cluster: Cluster, namespace: str, service: str) -> dict[str, dict[str, Any]]:
    """What the EndpointSlices of Service ``service`` say now, as a watcher of them reads it: each
    endpoint's address -> its conditions (ready, serving, terminating) and targetRef's Pod name."""
    slices = cluster.api(f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
                         f"?labelSelector=kubernetes.io/service-name={service}")["items"]
    return {address: {**(endpoint.get("conditions") or {}), "pod": (endpoint.get("targetRef") or {}).get("name")}
            for piece in slices for endpoint in piece.get("endpoints") or [] for address in endpoint["addresses"]}


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=1).status_code == 200
    except requests.RequestException:
        return False
