"""Backend Pods played by a stand-in engine, one server per Pod: for each backend Pod of one
LLMService in ``STANDIN_NAMESPACE`` (kwok plays nothing there: tests/e2e/kwok-stages.yaml), an
address of the harness's range in the root network namespace (tests/e2e/netns.py) is its Pod IP, and
a ``StandInBackend`` (tests/gateway/fakebackend.py's OpenAI-compatible server, which binds one
address) serves on it. So a component that dials each Pod's IP (the gateway of issue 41, reading the
backend Service's EndpointSlices) reaches that Pod and that Pod only, and the tests can count what
each Pod served. What every kubelet of the harness does (Pod IP in the status from the sandbox on,
Ready ``readiness_lag`` seconds after the readiness path first answers, the ServiceIP in front, the
gateway Pods Ready at once): tests/e2e/kubelet.py.

- Loading: a Pod's server starts listening ``load_seconds`` after its Pod is bound (a number, or per
  Pod by the order this kubelet began playing its backend Pods, 0 first: a dict or a callable of that
  index, so Pods can turn Ready at different times; a replacement Pod has the next index). With ``listen_while_loading`` it listens at once and its
  readiness path answers 503 until then, as llama-server does.
- ``configure(index, backend)`` sets a Pod's server up before it starts (``tokens``,
  ``stream_delay``, ``first_byte_delay``, ... of FakeBackend).
- ``hold_streams()``: every stream of every Pod (and of Pods started later) stops after the token it
  is sending, and every non-streamed answer waits, until ``release_streams()``: a request held open
  for as long as the test needs, whatever the machine's speed (``streams_held`` counts them).
- Deleting a Pod: out of the Service at once (and not ready in its EndpointSlice, which the
  EndpointSlice controller marks terminating), the server closes its listener and answers what is in
  flight (FakeBackend.drain, at most the Pod's terminationGracePeriodSeconds), then stops; its address
  goes and the Pod object is removed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from tests.e2e.cluster import Cluster, Timeline
from tests.e2e.kubelet import POLL_SECONDS, Kubelet, PlayedPod, now
from tests.e2e.netns import Network
from tests.gateway.fakebackend import FakeBackend

STANDIN_NAMESPACE = "e2e-pods"
Delay = float | Mapping[int, float] | Callable[[int], float]


class StandInBackend(FakeBackend):
    """FakeBackend whose answers can be held (see the module doc). FakeBackend reads ``stream_delay``
    after each token it sent and ``response_delay`` before a non-streamed answer: as properties here
    they wait while the backend holds, then give the configured delay."""

    def __init__(self, port: int, host: str, readiness_path: str = "/health") -> None:
        self._flowing = threading.Event()
        self._flowing.set()
        self._held = 0
        self._held_lock = threading.Lock()
        self._stream_delay = 0.0
        self._response_delay = 0.0
        super().__init__(port=port, readiness_path=readiness_path, host=host)

    def _wait_flowing(self) -> None:
        if self._flowing.is_set():
            return
        with self._held_lock:
            self._held += 1
        try:
            self._flowing.wait()
        finally:
            with self._held_lock:
                self._held -= 1

    @property  # type: ignore[override]
    def stream_delay(self) -> float:
        self._wait_flowing()
        return self._stream_delay

    @stream_delay.setter
    def stream_delay(self, seconds: float) -> None:
        self._stream_delay = seconds

    @property  # type: ignore[override]
    def response_delay(self) -> float:
        self._wait_flowing()
        return self._response_delay

    @response_delay.setter
    def response_delay(self, seconds: float) -> None:
        self._response_delay = seconds

    @property
    def streams_held(self) -> int:
        """Requests waiting for ``release_streams`` now."""
        with self._held_lock:
            return self._held

    def hold_streams(self) -> None:
        self._flowing.clear()

    def release_streams(self) -> None:
        self._flowing.set()

    def stop(self) -> None:
        self.release_streams()  # nothing may wait on a stopped server
        super().stop()


class StandInKubelet(Kubelet):
    """Plays the backend Pods of LLMService ``service`` in ``namespace`` with one StandInBackend each
    (module doc)."""

    def __init__(self, cluster: Cluster, network: Network, service: str, port: int, timeline: Timeline,
                 namespace: str = STANDIN_NAMESPACE, readiness_lag: float = 0.0, load_seconds: Delay = 0.0,
                 listen_while_loading: bool = False,
                 configure: Callable[[int, StandInBackend], None] | None = None) -> None:
        super().__init__(cluster, network, service, port, timeline, namespace, readiness_lag)
        self.load_seconds = load_seconds
        self.listen_while_loading = listen_while_loading
        self.configure = configure
        self._holding = False

    # --- what the tests read and do ------------------------------------------------------------------

    def load_delay(self, index: int) -> float:
        """Seconds the ``index``-th Pod's server loads before it listens (or answers ready)."""
        if callable(self.load_seconds):
            return float(self.load_seconds(index))
        if isinstance(self.load_seconds, Mapping):
            return float(self.load_seconds.get(index, 0.0))
        return float(self.load_seconds)

    @property
    def running(self) -> bool:
        return any(p.engine is not None and p.engine.running for p in self.pods.values())

    def backend(self, pod: str) -> StandInBackend:
        """The server of Pod ``pod`` (kept after the Pod is gone, with what it served)."""
        played = self.pods[pod]
        assert isinstance(played.engine, StandInBackend), f"{pod}: no stand-in server (yet)"
        return played.engine

    def served(self, pod: str, path: str = "/v1/chat/completions") -> int:
        """Requests to ``path`` Pod ``pod`` received (0 before its server started)."""
        played = self.pods.get(pod)
        return len(played.engine.requests_to(path)) if played and played.engine is not None else 0

    def served_by_pod(self, path: str = "/v1/chat/completions") -> dict[str, int]:
        return {p.name: self.served(p.name, path) for p in self.backends()}

    def hold_streams(self) -> None:
        self._holding = True
        for played in self.backends():
            if played.engine is not None:
                played.engine.hold_streams()

    def release_streams(self) -> None:
        self._holding = False
        for played in self.backends():
            if played.engine is not None:
                played.engine.release_streams()

    def streams_held(self) -> int:
        return sum(p.engine.streams_held for p in self.backends() if p.engine is not None)

    # --- a backend Pod --------------------------------------------------------------------------------

    def _run_backend(self, played: PlayedPod, obj: dict[str, Any]) -> None:
        spec = obj["spec"]
        container = played.container = next((c for c in spec["containers"] if c["name"] == "engine"),
                                             spec["containers"][0])
        played.grace = float(spec.get("terminationGracePeriodSeconds", 30))
        path = ((container.get("readinessProbe") or {}).get("httpGet") or {}).get("path", "/health")
        played.address = self.network.add_address()  # set at once: a deletion from now on removes it
        backend = StandInBackend(self.port, played.address, path)
        if self.configure is not None:
            self.configure(played.index, backend)
        if self._holding:
            backend.hold_streams()
        played.engine = backend
        self._sandbox_up(played, backend.host)
        self._patch_status(played.name, {
            "phase": "Running", "conditions": self._conditions(True, False, "ContainersNotReady"),
            "containerStatuses": [self._container_status(container, {"running": {"startedAt": now()}}, False, 0)]})
        delay = self.load_delay(played.index)
        self.note(f"{played.name}: stand-in engine started on {backend.host}, loading for {delay:g}s")
        if self.listen_while_loading:
            backend.ready = False
            self._start_unless_deleted(played)
        if not self._loaded(played, delay) or not self._start_unless_deleted(played):
            return
        backend.ready = True
        self.note(f"{played.name}: stand-in engine loaded: serving on {backend.host}:{self.port}")
        code = self._probe_until_exit(played, path, lambda: None if backend.running else 0)
        if code is not None:
            self.note(f"{played.name}: stand-in engine stopped by the test")

    def _loaded(self, played: PlayedPod, delay: float) -> bool:
        """False when the Pod was deleted (or the kubelet stopped) while it loaded."""
        deadline = time.monotonic() + delay
        while (left := deadline - time.monotonic()) > 0:
            if played.deleting or self._stop.wait(min(left, POLL_SECONDS)):
                return False
        return not played.deleting and not self._stop.is_set()

    def _start_unless_deleted(self, played: PlayedPod) -> bool:
        with self._lock:  # _begin_deletion takes it too: a deleted Pod's server never starts
            if played.deleting:
                return False
            if not played.engine.running:
                played.engine.start()
            return True

    def _end(self, played: PlayedPod) -> bool:
        backend = played.engine
        if not isinstance(backend, StandInBackend) or not backend.running:
            return False
        self.note(f"{played.name}: deleted; out of the Service, answering its {backend.in_flight} request(s) in "
                  f"flight (grace {played.grace:g}s)")
        waited = backend.drain(played.grace)
        self.note(f"{played.name}: stand-in engine ended after draining {waited:.1f}s")
        return True

    def _end_at_stop(self, played: PlayedPod) -> None:
        if isinstance(played.engine, StandInBackend):
            played.engine.stop()

    def _release(self, played: PlayedPod) -> None:
        """The Pod's address goes with its sandbox (the gateway Pods' addresses were never plumbed)."""
        if played.kind == "backend" and played.address in self.network.addresses:
            self.network.remove_address(played.address)
