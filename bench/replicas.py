"""Replicas benchmark (issue 41, "Traffic follows replicas"), every figure against a baseline measured
in the same run: the gateway of the baseline tree (``--baseline REF``, default the commit before
the change, extracted with ``git archive``) beside this tree's.

1. Replicas, steady load: 3 backend Pods of fixed capacity (``bench.replica_servers``: 4 requests
   at once each, the rest queued inside the Pod; a request is 5 SSE events 10 ms apart, so one Pod
   serves 80 requests/s), 24 closed-loop clients, each its own conversation. Variants: one Pod
   direct (the capacity every ratio is against); (a) the baseline gateway in front of a
   kube-proxy-like Service (a backend drawn at random per connection, kept for its life); (b) this
   gateway in front of the same Service (its pooled connections age out); (c) this gateway
   following the three Pods through a stand-in Kubernetes API (``tests/gateway/fakekube.py``,
   EndpointSlices list and watch). Interleaved rounds, a fresh gateway each (a new draw of
   connections for (a)). Then (d): 1 Pod listed, all 3 after a few seconds; the shares after.
2. Cold start with a kubelet readiness lag: one Pod; its engine answers at T, the slice (and so the
   Service) says Ready at T + 5 s; a held streamed request waits. Engine ready -> first byte at the
   client, for both gateways behind the Service and this one following the Pod.
3. Warm path, one backend Pod: bench.gateway_bench's warm throughput set-up (wrk against the
   gateway on core 0, static nginx on core 1) against the baseline gateway and this one (Service
   address, the default; and following one listed Pod), interleaved rounds, medians; a second
   baseline process beside them gives the host's noise floor for the ratios.

Targets (issue 41): (c) >= 2.7x one Pod's throughput (measured direct); the new gateway's median
engine ready -> first byte <= 0.15 s; on the warm path, the new gateway (either mode) >= 0.95x the
baseline's throughput at <= 1.05x its CPU per request (medians of per-round ratios).

Run: .venv/bin/python -m bench.replicas [--quick] [--baseline REF] [--only replicas,cold,warm] [--clients N]
(about 9.5 min; ``--quick`` about 3.5). Exit status 1 when a target below is missed.

Needs Debian's nginx and wrk (`apt-get install -y nginx wrk`), taskset, openssl (the stand-in API's
certificate) and two cores: the gateway under test on core 0, everything else on core 1.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import random
import re
import selectors
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from bench.gateway_bench import CPU0, CPU1, Gateway, StealMeter, open_loop, pct, wrk
from bench.gateway_bench import free_port as ephemeral_port
from bench.gateway_nginx import Nginx, find_nginx
from tests.gateway.fakekube import FakeKube, slice_object
from tests.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BASELINE = "4d094dc"  # the last commit before issue 41's gateway change
ADDRESSES = ("127.0.61.1", "127.0.61.2", "127.0.61.3")  # one loopback address per Pod, as Pod IPs
SERVICE = "llm-backend"
SLOTS, CHUNKS, CHUNK_MS, CLIENTS = 4, 5, 10.0, 24
CAPACITY = SLOTS / (CHUNKS * CHUNK_MS / 1000)  # one Pod's requests/s: 80
READY_LAG = 5.0  # engine answering -> the slice says Ready (the kubelet's probe period + the update)
POD = re.compile(rb'"pod":"([^"]+)"')
VARIANTS = {
    "direct": "one Pod, direct",
    "a": "(a) baseline gateway -> Service",
    "b": "(b) new gateway -> Service",
    "c": "(c) new gateway -> Pods (slices)",
}
# name -> (target, True when higher is better)
TARGETS = {
    "c_throughput_x_one_pod": (2.7, True),
    "cold_new_median_s": (0.15, False),
    "warm_throughput_service_x_baseline": (0.95, True),
    "warm_throughput_pods_x_baseline": (0.95, True),
    "warm_cpu_service_x_baseline": (1.05, False),
    "warm_cpu_pods_x_baseline": (1.05, False),
}


def body(i: int) -> bytes:
    """Client ``i``'s streamed request: its own conversation, so prefix affinity spreads them."""
    return (b'{"model":"bench","messages":[{"role":"user","content":"conversation %d: hello"}],"stream":true}' % i)


def request_bytes(payload: bytes) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))


def rotate(items: Sequence[str], turn: int) -> list[str]:
    """``items`` starting at ``turn``: no variant always holds the same place in a round."""
    k = turn % len(items)
    return [*items[k:], *items[:k]]


def load_text() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.2f} / {five:.2f} (1 / 5 min)"


def tree_fingerprint(root: Path) -> str:
    """A hash of gateway/**/*.py: others edit the working tree while this runs, so the report says
    which code was measured (and whether it changed during the run)."""
    digest = hashlib.sha256()
    for path in sorted((root / "gateway").rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def working_tree() -> str:
    """The tree measured as new: HEAD, and whether gateway/ differs from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout
    dirty = git("status", "--porcelain", "--", "gateway").strip()
    return f"the working tree at {git('rev-parse', '--short=12', 'HEAD').strip()}" + (
        " with uncommitted changes in gateway/" if dirty else " (gateway/ as committed)")


def baseline_tree(ref: str) -> tuple[Path, str]:
    """The baseline commit's files in a temporary directory (``git archive``: no worktree, nothing
    left in the repository's .git), and the commit's full hash."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{ref}^{{commit}}"],
                            capture_output=True, text=True, check=True).stdout.strip()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit],
                             capture_output=True, check=True).stdout
    target = Path(tempfile.mkdtemp(prefix="noctaya-replicas-baseline-"))
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(target, filter="data")
    return target, commit


# -- the far side: Pods, Service, API ----------------------------------------------------------------

class _Child:
    """A ``bench.replica_servers`` process on core 1, driven by one command line per reply line."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(["taskset", "-c", CPU1, sys.executable, "-m", "bench.replica_servers", *args],
                                     cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.lock = threading.Lock()  # commands come from the main thread and from timed actions
        if self._read() != ["ready"]:
            raise RuntimeError(f"bench.replica_servers {args[0]} did not start")

    def _read(self) -> list[str]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("bench.replica_servers exited")
        return line.split()

    def command(self, line: str) -> list[str]:
        assert self.proc.stdin is not None
        with self.lock:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
            return self._read()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def pods_port() -> int:
    """A port free on every Pod address (a Deployment's Pods listen on the same container port)."""
    for _ in range(50):
        port = free_port(ADDRESSES[0])
        try:
            for address in ADDRESSES[1:]:
                with socket.socket() as probe:
                    probe.bind((address, port))
        except OSError:
            continue
        return port
    raise RuntimeError("no port free on every Pod address")


class Pods(_Child):
    def __init__(self) -> None:
        self.port = pods_port()
        super().__init__("pods", str(self.port), str(SLOTS), str(CHUNKS), str(CHUNK_MS))
        self.running: set[str] = set()

    def start(self, address: str, name: str) -> float:
        """The Pod's engine listens; the monotonic instant it did."""
        words = self.command(f"start {address} {name}")
        self.running.add(address)
        return float(words[2])

    def stop(self, address: str) -> None:
        self.command(f"stop {address}")
        self.running.discard(address)

    def stop_all(self) -> None:
        for address in list(self.running):
            self.stop(address)


class Service(_Child):
    """The Service address: ``bench.replica_servers`` proxy (kube-proxy's per-connection choice)."""

    def __init__(self, backend_port: int) -> None:
        # Below the ephemeral range (tests.ports): the listener closes and reopens with the backend
        # set, and an outgoing connection must not take the port meanwhile.
        self.port = free_port()
        super().__init__("proxy", str(self.port), str(backend_port))

    def backends(self, addresses: Sequence[str]) -> float:
        return float(self.command("backends " + ",".join(addresses))[1])


class Kube:
    """The stand-in API server (tests/gateway/fakekube.py), one per gateway: it serves one watch at a
    time, and a second watcher would end the first's."""

    def __init__(self, port: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="noctaya-replicas-kube-"))
        self.fake = FakeKube(self.dir)
        self.port = port

    def list(self, pods: Sequence[tuple[str, str, bool]]) -> float:
        """The backend Service's slice now lists ``pods`` as (name, address, ready)."""
        self.fake.put(slice_object(f"{SERVICE}-abc", SERVICE, list(pods), port=self.port))
        return time.monotonic()

    def env(self) -> dict[str, str]:
        return {"NOCTAYA_ENDPOINT_SOURCE": "endpointslices", "NOCTAYA_SERVICE_ACCOUNT_DIR": str(self.fake.account),
                **self.fake.environ}

    def stop(self) -> None:
        self.fake.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class Front:
    """One gateway under test: behind the Service address (``service_port``) or following the Pods
    ``listed`` through its own stand-in API (``pods_port``: the Pods' port)."""

    def __init__(self, root: Path, *, service_port: int | None = None, pods_port: int | None = None,
                 listed: Sequence[tuple[str, str, bool]] | None = None, **env: str) -> None:
        self.kube: Kube | None = None
        if listed is not None:
            assert pods_port is not None
            self.kube = Kube(pods_port)
            self.kube.list(listed)
            url = f"http://{SERVICE}.ns.svc:{pods_port}"
            env = {**self.kube.env(), **env}
        else:
            url = f"http://127.0.0.1:{service_port}"
        self.gw = Gateway(url, cpus=CPU0, root=root, **env)

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.gw.port)

    def balances_over_pods(self) -> bool:
        """Whether this gateway's tree has the change at all (/noctaya/queue describes its backend)."""
        return "backend" in self.gw.queue_state()

    def wait_pods(self, count: int, state: str = "eligible") -> None:
        def seen(q: dict) -> bool:
            pods = (q.get("backend") or {}).get("pods") or []
            return sum(p["state"] == state for p in pods) == count
        self.gw.wait_queue(seen, timeout=30)

    def stop(self) -> None:
        self.gw.stop()
        if self.kube is not None:
            self.kube.stop()


# -- clients -------------------------------------------------------------------------------------------

class Done(NamedTuple):
    sent: float
    first: float  # the first data event at the client (TTFT = first - sent)
    done: float
    pod: str  # the Pod that answered ("" for an error)
    status: int  # 0: the connection was cut
    client: int  # which client sent it (each client is one conversation: one affinity key)


class _Stream:
    """One client's keep-alive connection, one streamed request at a time."""

    def __init__(self, address: tuple[str, int], payload: bytes, client: int = 0) -> None:
        self.address = address
        self.client = client
        self.request = request_bytes(payload)
        self.sock = self._connect()
        self.buf, self.sent, self.first, self.reusable = b"", 0.0, 0.0, True

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=30)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def reconnect(self) -> None:
        self.sock.close()
        self.sock = self._connect()

    def send(self, now: float) -> None:
        self.buf, self.sent, self.first = b"", now, 0.0
        self.sock.sendall(self.request)

    def feed(self, data: bytes, now: float) -> Done | None:
        """Bytes of the answer; the request's record once the answer is complete."""
        if not data:
            self.reusable = False
            return Done(self.sent, now, now, "", 0, self.client)
        self.buf += data
        if not self.first and b"data: {" in self.buf:
            self.first = now
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return None
        head = self.buf[:end].lower()
        if b"transfer-encoding: chunked" in head:
            complete = self.buf.endswith(b"\r\n0\r\n\r\n")
        else:
            length = re.search(rb"content-length: *(\d+)", head)
            complete = length is not None and len(self.buf) - end - 4 >= int(length.group(1))
        if not complete:
            return None
        self.reusable = b"connection: close" not in head
        pod = POD.search(self.buf)
        return Done(self.sent, self.first or now, now, pod.group(1).decode() if pod else "", int(self.buf[9:12]),
                    self.client)


def request_once(address: tuple[str, int], payload: bytes = b"") -> Done:
    """One streamed request, blocking (a warm-up: the first one may wait for a cold start)."""
    stream = _Stream(address, payload or body(0))
    try:
        stream.send(time.monotonic())
        while True:
            done = stream.feed(stream.sock.recv(65536), time.monotonic())
            if done is not None:
                return done
    finally:
        stream.sock.close()


def _timed(actions: Sequence[tuple[float, Callable[[], None]]], start: float) -> list[threading.Thread]:
    """Run each action at ``start + offset`` in a thread of its own (the client loop never waits)."""
    def run(at: float, action: Callable[[], None]) -> None:
        time.sleep(max(0.0, at - time.monotonic()))
        action()
    threads = [threading.Thread(target=run, args=(start + offset, action), daemon=True) for offset, action in actions]
    for thread in threads:
        thread.start()
    return threads


def _next(stream: _Stream, selector: selectors.BaseSelector, now: float, end: float) -> None:
    """After an answer: the client's next request (on a new connection if that one cannot carry
    it), or, past ``end``, nothing more from this client."""
    if now >= end or not stream.reusable:
        selector.unregister(stream.sock)
    if now >= end:
        return
    if not stream.reusable:
        stream.reconnect()
        stream.reusable = True
        selector.register(stream.sock, selectors.EVENT_READ, stream)
    stream.send(now)


def closed_loop(address: tuple[str, int], clients: int, seconds: float,
                actions: Sequence[tuple[float, Callable[[], None]]] = ()) -> tuple[list[Done], float]:
    """``clients`` connections each sending its next streamed request as soon as the last one ended,
    for ``seconds`` (one thread, one epoll loop: no GIL hand-offs in the timing); every request's
    record and the start. A cut connection is recorded (status 0) and opened again."""
    streams = [_Stream(address, body(i), i) for i in range(clients)]
    selector = selectors.DefaultSelector()
    start = time.monotonic()
    end = start + seconds
    for stream in streams:
        stream.send(start)
        selector.register(stream.sock, selectors.EVENT_READ, stream)
    threads = _timed(actions, start)
    records: list[Done] = []
    try:
        while selector.get_map():
            if time.monotonic() > end + 30:
                raise RuntimeError(f"requests to {address} did not finish")
            for key, _ in selector.select(0.05):
                stream = key.data
                try:
                    data = stream.sock.recv(65536)
                except ConnectionError:
                    data = b""
                now = time.monotonic()
                done = stream.feed(data, now)
                if done is None:
                    continue
                records.append(done)
                _next(stream, selector, now, end)
    finally:
        for thread in threads:
            thread.join(30)
        for stream in streams:
            stream.sock.close()
        selector.close()
    return records, start


def summary(records: list[Done], t0: float, t1: float) -> dict:
    """Requests completed in [t0, t1): throughput, TTFT percentiles, per-Pod shares, errors."""
    got = [r for r in records if t0 <= r.done < t1]
    ok = [r for r in got if r.status == 200 and r.pod]
    ttft = [(r.first - r.sent) * 1000 for r in ok] or [float("nan")]
    counts = {f"pod-{i + 1}": 0 for i in range(len(ADDRESSES))}
    per_client: dict[int, dict[str, int]] = {}
    for r in ok:
        counts[r.pod] = counts.get(r.pod, 0) + 1
        mine = per_client.setdefault(r.client, {})
        mine[r.pod] = mine.get(r.pod, 0) + 1
    # How much of a conversation stays on one Pod (where its KV cache is): each client's requests
    # on the Pod it used most, over all requests.
    sticky = sum(max(c.values()) for c in per_client.values()) / max(1, len(ok))
    return {"rps": len(ok) / (t1 - t0), "n": len(ok), "errors": len(got) - len(ok), "counts": counts,
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "sticky": sticky}


def shares(counts: dict[str, int]) -> str:
    total = sum(counts.values()) or 1
    return "/".join(f"{100 * n / total:.0f}" for n in counts.values())


# -- 1. replicas under steady load, and a scale-out ----------------------------------------------------

class Rig:
    """What every phase of 1 and 2 shares: the Pods process, the Service, the two source trees."""

    def __init__(self, baseline: Path, clients: int = CLIENTS) -> None:
        self.clients = clients
        self.pods = Pods()
        self.service = Service(self.pods.port)
        self.roots = {"a": baseline, "b": ROOT, "c": ROOT}

    def front(self, variant: str, listed: Sequence[tuple[str, str, bool]], **env: str) -> Front:
        """Variant ``variant``'s gateway; the Service's backends (a, b) or the slice (c) list ``listed``."""
        if variant == "c":
            return Front(ROOT, pods_port=self.pods.port, listed=listed, **env)
        self.service.backends([address for _name, address, ready in listed if ready])
        return Front(self.roots[variant], service_port=self.service.port, **env)

    def grow(self, front: Front, listed: Sequence[tuple[str, str, bool]]) -> float:
        """The Pods ``listed`` are now the Service's (the slice, or the proxy's backend set)."""
        if front.kube is not None:
            return front.kube.list(listed)
        return self.service.backends([address for _name, address, ready in listed if ready])

    def close(self) -> None:
        self.service.close()
        self.pods.close()


def all_pods() -> list[tuple[str, str, bool]]:
    return [(f"pod-{i + 1}", address, True) for i, address in enumerate(ADDRESSES)]


def steady_round(rig: Rig, variant: str, warmup: float, seconds: float) -> dict:
    if variant == "direct":
        records, start = closed_loop((ADDRESSES[0], rig.pods.port), rig.clients, warmup + seconds)
        return summary(records, start + warmup, start + warmup + seconds)
    front = rig.front(variant, all_pods())
    try:
        if variant == "c":
            front.wait_pods(len(ADDRESSES))
        first = request_once(front.address)
        if first.status != 200:
            raise RuntimeError(f"{VARIANTS[variant]}: the first request answered {first.status}")
        records, start = closed_loop(front.address, rig.clients, warmup + seconds)
        result = summary(records, start + warmup, start + warmup + seconds)
        result["new_tree"] = front.balances_over_pods()
        return result
    finally:
        front.stop()


def scale_out_round(rig: Rig, variant: str, warmup: float, before: float, after: float) -> dict:
    """1 Pod listed; ``before`` seconds of load; all 3 listed; ``after`` seconds, in two halves."""
    front = rig.front(variant, all_pods()[:1])
    changed: list[float] = []
    try:
        if variant == "c":
            front.wait_pods(1)
        request_once(front.address)
        records, _start = closed_loop(front.address, rig.clients, warmup + before + after,
                                      actions=[(warmup + before, lambda: changed.append(rig.grow(front, all_pods())))])
    finally:
        front.stop()
        rig.service.backends(ADDRESSES)
    t = changed[0]
    half = after / 2
    return {"before": summary(records, t - before, t), "early": summary(records, t, t + half),
            "late": summary(records, t + half, t + after), "half": half}


def replicas(rig: Rig, rounds: int, seconds: float, scale_rounds: int) -> dict:
    for i, address in enumerate(ADDRESSES):
        rig.pods.start(address, f"pod-{i + 1}")
    rig.service.backends(ADDRESSES)
    warmup = 2.0
    out: dict = {"steady": {v: [] for v in VARIANTS}, "scale": {v: [] for v in ("a", "b", "c")},
                 "load": [load_text()]}
    steal = StealMeter()
    for turn in range(rounds):
        for variant in rotate(list(VARIANTS), turn):
            out["steady"][variant].append(steady_round(rig, variant, warmup, seconds))
        print(f"  steady round {turn + 1}/{rounds} done; {load_text()}", flush=True)
    out["steady_steal"] = steal.percent()
    out["load"].append(load_text())
    steal = StealMeter()
    for turn in range(scale_rounds):
        for variant in rotate(["a", "b", "c"], turn):
            out["scale"][variant].append(scale_out_round(rig, variant, warmup, 3.0, 10.0))
        print(f"  scale-out round {turn + 1}/{scale_rounds} done; {load_text()}", flush=True)
    out["scale_steal"] = steal.percent()
    out["load"].append(load_text())
    rig.pods.stop_all()
    return out


# -- 2. cold start with the kubelet's readiness lag ----------------------------------------------------

def cold_round(rig: Rig, front: Front, name: str) -> float:
    """One held streamed request; the engine answers at T, the slice says Ready at T + READY_LAG:
    seconds from T to the first data event at the client."""
    address = ADDRESSES[0]
    sock = socket.create_connection(front.address, timeout=30)
    try:
        sock.sendall(request_bytes(body(0)))
        front.gw.wait_queue(lambda q: q["queued"] == 1 and not q["backendReady"])
        if front.kube is not None:  # the Deployment's new Pod: an address, not Ready
            front.kube.list([(name, address, False)])
            front.wait_pods(1, "starting")
        time.sleep(random.uniform(0.0, 0.25))  # a random phase against the prober's cadence
        engine_ready = rig.pods.start(address, name)
        kubelet = _timed([(READY_LAG, lambda: rig.grow(front, [(name, address, True)]))], engine_ready)
        buf = b""
        while b"data: {" not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                raise RuntimeError(f"the held stream ended before the first event: {buf[-300:]!r}")
            buf += chunk
        first = time.monotonic()
        if b'"pod"' not in buf[buf.find(b"data: {"):]:
            raise RuntimeError(f"the first event is not the backend's: {buf[-300:]!r}")
        while not buf.endswith(b"\r\n0\r\n\r\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            buf += chunk
        for thread in kubelet:
            thread.join(READY_LAG + 5)
        return first - engine_ready
    finally:
        sock.close()
        rig.pods.stop(address)  # scaled back to zero: the Pod deleted
        if front.kube is not None:
            front.kube.list([])
        else:
            rig.service.backends([])
        front.gw.wait_queue(lambda q: q["queued"] == 0 and q["inFlight"] == 0)


def cold_starts(rig: Rig, rounds: int) -> dict:
    """Interleaved rounds over the three gateways, alive together (only one has a request at a time)."""
    rig.pods.stop_all()
    rig.service.backends([])
    env = {"NOCTAYA_ACTIVATION_TIMEOUT_SECONDS": "30", "NOCTAYA_READY_GRACE_SECONDS": "0.1"}
    fronts = {variant: rig.front(variant, [], **env) for variant in ("a", "b", "c")}
    out: dict = {"lags": {v: [] for v in fronts}, "load": [load_text()]}
    steal = StealMeter()
    try:
        for turn in range(rounds):
            for variant in rotate(list(fronts), turn):
                out["lags"][variant].append(cold_round(rig, fronts[variant], f"{SERVICE}-{turn}{variant}"))
        out["steal"] = steal.percent()
    finally:
        for front in fronts.values():
            front.stop()
    out["load"].append(load_text())
    return out


# -- 3. the warm path with one Pod ---------------------------------------------------------------------

# "control" is a second baseline process: its ratio to the first is this host's noise floor for the others'.
WARM = {"baseline": "baseline gateway, Service address", "control": "baseline gateway, a second process",
        "service": "new gateway, Service address", "pods": "new gateway, 1 Pod listed"}


def _warm_fronts(baseline: Path, static_port: int) -> dict[str, Front]:
    fronts: dict[str, Front] = {}
    try:
        fronts["baseline"] = Front(baseline, service_port=static_port)
        fronts["control"] = Front(baseline, service_port=static_port)
        fronts["service"] = Front(ROOT, service_port=static_port)
        fronts["pods"] = Front(ROOT, pods_port=static_port, listed=[("pod-1", "127.0.0.1", True)])
        fronts["pods"].wait_pods(1)
        for front in fronts.values():  # the first request is cold (readiness unknown at start)
            open_loop(front.gw.port, 100, 1.0)
    except BaseException:
        for front in fronts.values():
            front.stop()
        raise
    return fronts


def warm_path(nginx_bin: str, baseline: Path, seconds: int, rounds: int) -> dict:
    static_port = ephemeral_port()
    static = Nginx(nginx_bin, static_port, cpu=int(CPU1))
    try:
        runs: dict[str, list[dict]] = {name: [] for name in WARM}
        load = [load_text()]
        steal = StealMeter()
        for turn in range(rounds):  # interleaved: a burst of load elsewhere hits every variant alike
            # Fresh processes every round: one process's own layout (hash seed, allocator, address
            # space) moved its throughput by up to 8 % for all its rounds (the control against the
            # baseline, same code), which no number of rounds of the same processes averages out.
            fronts = _warm_fronts(baseline, static_port)
            try:
                for name in rotate(list(fronts), turn):
                    runs[name].append(wrk(fronts[name].gw.port, seconds, 32, fronts[name].gw.proc.pid))
            finally:
                for front in fronts.values():
                    front.stop()
        direct = wrk(static_port, seconds, 32)
        load.append(load_text())
        return {"runs": runs, "direct": direct, "steal": steal.percent(), "load": load}
    finally:
        static.stop()


def per_round_ratio(runs: dict[str, list[dict]], name: str, key: str) -> tuple[float, list[float]]:
    ratios = [r[key] / b[key] for r, b in zip(runs[name], runs["baseline"], strict=True)]
    return statistics.median(ratios), ratios


# -- report --------------------------------------------------------------------------------------------

def report_replicas(rep: dict, rounds: int, seconds: float, clients: int) -> float:
    """Print 1's tables; (c)'s throughput over one Pod's (measured direct)."""
    steady = rep["steady"]
    med = {v: statistics.median(r["rps"] for r in rs) for v, rs in steady.items()}
    print(f"\n== Replicas, steady load: {clients} closed-loop clients (one conversation each), 3 Pods of {SLOTS} "
          f"slots, {CHUNKS} SSE events {CHUNK_MS:g} ms apart (one Pod {CAPACITY:.0f} req/s nominal); "
          f"{rounds} interleaved round(s) of {seconds:g} s after 2 s of warm-up")
    print(f"  {'variant':34s} {'req/s median (rounds)':28s} {'x one Pod':>9s} {'TTFT p50 / p99 ms':>19s}  "
          f"{'same Pod':>8s}  shares pod-1/2/3 % per round   errors")
    for variant, rs in steady.items():
        each = ", ".join(f"{r['rps']:.1f}" for r in rs)
        p50, p99, sticky = (statistics.median(r[key] for r in rs) for key in ("ttft_p50", "ttft_p99", "sticky"))
        split = ", ".join(shares(r["counts"]) for r in rs)
        print(f"  {VARIANTS[variant]:34s} {med[variant]:6.1f} ({each}){'':{max(0, 20 - len(each))}s} "
              f"{med[variant] / med['direct']:9.2f} {p50:8.1f} / {p99:8.1f}  {100 * sticky:7.0f}%  {split:30s} "
              f"{sum(r['errors'] for r in rs)}")
    print("  same Pod: a conversation's requests on the Pod it used most (where its KV cache would be)")
    print(f"  one Pod nominal: {CAPACITY:.0f} req/s ((a) {med['a'] / CAPACITY:.2f}x, (b) {med['b'] / CAPACITY:.2f}x, "
          f"(c) {med['c'] / CAPACITY:.2f}x of it); CPU steal {rep['steady_steal']:.1f}%; {rep['load'][0]} -> {rep['load'][1]}")
    print("\n== Scale-out: 1 Pod listed, all 3 after 3 s (Service: the proxy's backend set grows; "
          "slices: the slice lists 3); req/s, shares pod-1/2/3 % and TTFT p99 per window")
    for variant, rs in rep["scale"].items():
        for r in rs:
            cells = [f"{label} {r[key]['rps']:5.1f} req/s {shares(r[key]['counts']):>8s} p99 {r[key]['ttft_p99']:6.0f} ms"
                     for key, label in (("before", "3 s before:"), ("early", f"0-{r['half']:g} s after:"),
                                        ("late", f"{r['half']:g}-{2 * r['half']:g} s after:"))]
            print(f"  {VARIANTS[variant]:34s} " + " | ".join(cells))
    print(f"  CPU steal {rep['scale_steal']:.1f}%; {rep['load'][1]} -> {rep['load'][2]}")
    if any(not r.get("new_tree", True) for r in steady["b"] + steady["c"]) or any(r["new_tree"] for r in steady["a"]):
        print("  WARNING: a gateway's tree is not the one expected (/noctaya/queue's 'backend' key)")
    return med["c"] / med["direct"]


def report_cold(cold: dict) -> float:
    print(f"\n== Cold start, one Pod: engine answers at T, the slice (and the Service) Ready at T + {READY_LAG:g} s; "
          "engine ready -> first event at the client (s)")
    for variant, lags in cold["lags"].items():
        each = ", ".join(f"{x:.3f}" for x in lags)
        label = VARIANTS[variant].replace("-> Service", "-> Service address").replace("-> Pods (slices)", "-> the Pod")
        print(f"  {label:40s} median {statistics.median(lags):6.3f}  max {max(lags):6.3f}  ({each})")
    print(f"  CPU steal {cold['steal']:.1f}%; {cold['load'][0]} -> {cold['load'][1]}")
    return statistics.median(cold["lags"]["c"])


def report_warm(warm: dict, rounds: int, seconds: float) -> dict[str, float]:
    runs = warm["runs"]
    print(f"\n== Warm path, one backend Pod: wrk -t1 -c32 POST /v1/chat/completions, {rounds} interleaved rounds "
          f"of {seconds:g} s; gateway on core {CPU0}, wrk + static nginx on core {CPU1}")
    print(f"  nginx direct {warm['direct']['rps']:10.0f} req/s")
    out: dict[str, float] = {}
    for name, label in WARM.items():
        rps = statistics.median(r["rps"] for r in runs[name])
        cpu = statistics.median(r["cpu_us_per_request"] for r in runs[name])
        each = ", ".join(f"{r['rps']:.0f}" for r in runs[name])
        line = f"  {label:36s} {rps:8.0f} req/s median ({each})  CPU {cpu:5.1f} us/request"
        if name != "baseline":
            thr, thr_each = per_round_ratio(runs, name, "rps")
            cpu_ratio, _ = per_round_ratio(runs, name, "cpu_us_per_request")
            out[f"warm_throughput_{name}_x_baseline"], out[f"warm_cpu_{name}_x_baseline"] = thr, cpu_ratio
            line += (f"  / baseline: throughput {thr:.3f} (rounds {', '.join(f'{x:.2f}' for x in thr_each)}),"
                     f" CPU {cpu_ratio:.3f}")
        non2xx = sum(r["non2xx"] for r in runs[name])
        print(line + (f"  non-2xx {non2xx:.0f}" if non2xx else ""))
    print(f"  CPU steal {warm['steal']:.1f}%; {warm['load'][0]} -> {warm['load'][1]}")
    return out


def check_tools() -> str | None:
    """What is missing to run, or None."""
    nginx_bin = find_nginx()
    missing = [name for name, found in (("nginx", nginx_bin), ("wrk", shutil.which("wrk")),
                                        ("taskset", shutil.which("taskset")), ("openssl", shutil.which("openssl")))
               if not found]
    if missing:
        return f"needs {', '.join(missing)}: apt-get install -y nginx wrk util-linux openssl"
    if len(os.sched_getaffinity(0)) < 2:
        return "needs two cores (the gateway on one, everything else on the other)"
    return None


PARTS = ("replicas", "cold", "warm")  # 1 (steady load and scale-out), 2, 3


def measure(parts: set[str], baseline: Path, args: argparse.Namespace) -> dict[str, float]:
    """Run the parts asked for; print their tables; the figures the targets read."""
    rounds, seconds, scale_rounds, cold_rounds, warm_rounds, warm_seconds = (
        (1, 5.0, 1, 3, 2, 2) if args.quick else (3, 10.0, 2, 6, 8, 4))
    rep = cold = warm = None
    if parts & {"replicas", "cold"}:
        rig = Rig(baseline, args.clients)
        try:
            rep = replicas(rig, rounds, seconds, scale_rounds) if "replicas" in parts else None
            cold = cold_starts(rig, cold_rounds) if "cold" in parts else None
        finally:
            rig.close()
    if "warm" in parts:
        warm = warm_path(find_nginx() or "nginx", baseline, warm_seconds, warm_rounds)
    results: dict[str, float] = {}
    if rep is not None:
        results["c_throughput_x_one_pod"] = report_replicas(rep, rounds, seconds, args.clients)
    if cold is not None:
        results["cold_new_median_s"] = report_cold(cold)
    if warm is not None:
        results.update(report_warm(warm, warm_rounds, warm_seconds))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer and shorter rounds (smoke run)")
    parser.add_argument("--clients", type=int, default=CLIENTS, help=f"closed-loop clients in 1 (default {CLIENTS})")
    parser.add_argument("--baseline", default=DEFAULT_BASELINE, help=f"the baseline commit (default {DEFAULT_BASELINE})")
    parser.add_argument("--only", default=",".join(PARTS), help=f"some of {','.join(PARTS)} (default: all)")
    args = parser.parse_args()
    parts = set(args.only.split(","))
    missing = check_tools()
    if missing or not parts <= set(PARTS):
        print(f"bench.replicas {missing or f'--only takes some of {PARTS}'}", file=sys.stderr)
        return 2
    os.sched_setaffinity(0, {int(CPU1)})  # the clients and the stand-in API share core 1 with the Pods
    started = time.monotonic()
    baseline, commit = baseline_tree(args.baseline)
    fingerprint = tree_fingerprint(ROOT)
    print(f"baseline: {commit[:12]} ({args.baseline}); new: {working_tree()} (gateway/ fingerprint {fingerprint}); "
          f"{load_text()}", flush=True)
    try:
        results = measure(parts, baseline, args)
    finally:
        shutil.rmtree(baseline, ignore_errors=True)
    if tree_fingerprint(ROOT) != fingerprint:
        print(f"\nWARNING: gateway/ changed during the run (fingerprint {fingerprint} -> {tree_fingerprint(ROOT)}): "
              "gateways started after the change ran the new files")
    print("\n== Replicas: targets")
    failed = 0
    for key, (target, higher) in TARGETS.items():
        if key not in results:
            continue
        value = results[key]
        ok = value >= target if higher else value <= target
        failed += not ok
        print(f"  {key:36s} {value:8.3f}  target {'>=' if higher else '<='} {target:g}  {'PASS' if ok else 'FAIL'}")
    print(f"\n(total {time.monotonic() - started:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
