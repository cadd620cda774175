"""The gateway at the limits it advertises, as real processes: 5,000 held cold streams in one
worker (descriptors far past 1023, where select() used to fail), and two workers sharing one
Pod-wide maxQueue under a flood."""

from __future__ import annotations

import os
import resource
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import requests

from scaler import externalscaler_pb2 as pb
from scaler import externalscaler_pb2_grpc as pb_grpc
from tests.gateway.conftest import wait_for
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
STREAM_BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
HELD = 5000
REF = pb.ScaledObjectRef(name="qwen", namespace="models", scalerMetadata={})


def request_bytes(body: bytes) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


class Gateway:
    def __init__(self, backend_port: int, **env: str) -> None:
        self.port = free_port()
        self.scaler_port = free_port()
        self.admin_port = free_port()
        full = {**os.environ, "PYTHONPATH": str(ROOT), "NOCTAYA_BACKEND_URL": f"http://127.0.0.1:{backend_port}",
                "NOCTAYA_SERVED_MODEL_NAME": "m", "NOCTAYA_LISTEN_HOST": "127.0.0.1",
                "NOCTAYA_LISTEN_PORT": str(self.port), "NOCTAYA_ADMIN_PORT": str(self.admin_port),
                "NOCTAYA_SCALER_MODE": "off",
                "NOCTAYA_SCALER_PORT": str(self.scaler_port), "NOCTAYA_PROBE_INTERVAL_SECONDS": "0.05",
                "NOCTAYA_LOG_LEVEL": "warning", **env}
        self.proc = subprocess.Popen([sys.executable, "-m", "gateway"], cwd=ROOT, env=full,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        wait_for(self._up, timeout=30, interval=0.05, what="gateway listening")

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"gateway exited: {self.proc.stdout.read().decode()}")
        try:
            return requests.get(self.url + "/healthz", timeout=1).status_code == 200
        except requests.RequestException:
            return False

    def queue(self) -> dict:
        return requests.get(f"http://127.0.0.1:{self.admin_port}/noctaya/queue", timeout=10).json()

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.stdout.read().decode(errors="replace")


class Backend:
    """bench/sse_backend.py as a process: up exactly while running."""

    def __init__(self, port: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.sse_backend", str(port), "3", "0"], cwd=ROOT,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE)
        assert self.proc.stdout.readline().strip() == b"ready"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def file_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2 * HELD + 1000  # per process: the gateway worker holds a client and a backend socket per stream
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(wanted, soft), max(wanted, hard)))
    except (OSError, ValueError):
        if hard < wanted:
            pytest.skip(f"cannot raise the open-file limit to {wanted} (hard limit {hard}; not root)")
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    yield wanted
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class Streams:
    """Many raw client connections read through one epoll selector."""

    def __init__(self) -> None:
        self.selector = selectors.DefaultSelector()
        self.buffers: dict[socket.socket, bytearray] = {}
        self.closed: set[socket.socket] = set()

    def open(self, port: int, count: int, payload: bytes) -> None:
        for _ in range(count):
            sock = socket.create_connection(("127.0.0.1", port), timeout=30)
            sock.sendall(payload)
            sock.setblocking(False)
            self.buffers[sock] = bytearray()
            self.selector.register(sock, selectors.EVENT_READ)

    def pump(self, until, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            for key, _ in self.selector.select(0.2):
                sock = key.fileobj
                try:
                    data = sock.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    self.selector.unregister(sock)
                    self.closed.add(sock)
                    continue
                self.buffers[sock] += data

    def count(self, needle: bytes, at_least: int = 1) -> int:
        return sum(1 for buf in self.buffers.values() if buf.count(needle) >= at_least)

    def close(self) -> None:
        for sock in self.buffers:
            sock.close()
        self.selector.close()


def test_5000_held_cold_streams_all_get_heartbeats_and_complete(file_limit: int) -> None:
    backend_port = free_port()
    # Every client here is 127.0.0.1: the per-address cap is off, as behind a proxy (the cap's own
    # tests are in test_abuse.py).
    gw = Gateway(backend_port, NOCTAYA_GATEWAY_WORKERS="1", NOCTAYA_MAX_QUEUE=str(HELD + 100),
                 NOCTAYA_MAX_CONNECTIONS=str(HELD + 100), NOCTAYA_MAX_CONNECTIONS_PER_ADDRESS="0",
                 NOCTAYA_HEARTBEAT_SECONDS="3",
                 NOCTAYA_ACTIVATION_TIMEOUT_SECONDS="300")
    streams = Streams()
    backend = None
    try:
        worker = gw.proc.pid  # one worker is the whole Pod (gateway.workers)
        assert children(worker) == []
        streams.open(gw.port, 1, request_bytes(STREAM_BODY))  # code paths loaded before the baseline
        streams.pump(lambda: streams.count(b": heartbeat") == 1, 30, "the first held stream")
        time.sleep(0.5)
        before = rss_kib(worker)
        streams.open(gw.port, HELD - 1, request_bytes(STREAM_BODY))
        streams.pump(lambda: streams.count(b": heartbeat") == HELD, 120, f"{HELD} committed streams")
        wait_for(lambda: gw.queue()["queued"] == HELD, timeout=60, what="all held")
        after = rss_kib(worker)
        per_connection = (after - before) / (HELD - 1)
        print(f"\nRSS {before} -> {after} KiB: {per_connection:.1f} KiB per held connection")
        assert per_connection < 32, f"{per_connection:.1f} KiB per held connection"
        # Every stream gets a periodic heartbeat besides the opening comment, and none is cut.
        streams.pump(lambda: streams.count(b": heartbeat", 2) == HELD, 60, "a second heartbeat on every stream")
        assert not streams.closed
        backend = Backend(backend_port)
        streams.pump(lambda: streams.count(b"\r\n0\r\n\r\n") == HELD, 180, "every stream completed")
        bodies = list(streams.buffers.values())
        assert all(b.count(b'data: {"object"') == 3 and b"data: [DONE]" in b for b in bodies)
        assert not any(b"event: error" in b for b in bodies)
        wait_for(lambda: gw.queue()["inFlight"] == 0 and gw.queue()["queued"] == 0, timeout=60, what="all released")
    finally:
        streams.close()
        logs = gw.stop()
        if backend is not None:
            backend.stop()
    assert "Traceback" not in logs


def test_two_workers_share_one_max_queue_and_keda_sees_one_figure() -> None:
    max_queue = 20
    backend_port = free_port()
    gw = Gateway(backend_port, NOCTAYA_GATEWAY_WORKERS="2", NOCTAYA_MAX_QUEUE=str(max_queue),
                 NOCTAYA_SCALER_MODE="local", NOCTAYA_ACTIVATION_TIMEOUT_SECONDS="120")
    backend = None
    streams = Streams()
    try:
        workers = children(gw.proc.pid)
        # The scaler child by its module (argv), not "scaler" anywhere: the checkout's path may contain it.
        assert len([p for p in workers if b"\0-m\0scaler" not in Path(f"/proc/{p}/cmdline").read_bytes()]) == 2
        # A flood of 10 x maxQueue cold requests, all at once, on separate connections.
        replies: list[bytes] = []
        lock = threading.Lock()

        def one() -> None:
            with socket.create_connection(("127.0.0.1", gw.port), timeout=60) as sock:
                sock.sendall(request_bytes(BODY))
                data = sock.recv(65536)
                with lock:
                    replies.append(data)

        # First a few one at a time until both workers hold one (the kernel spreads connections by
        # their addresses, so which worker accepts is chance), then the rest all at once.
        threads: list[threading.Thread] = []
        for _ in range(max_queue - 2):
            threads.append(threading.Thread(target=one, daemon=True))
            threads[-1].start()
            wait_for(lambda: gw.queue()["queued"] == len(threads), timeout=10, what="held")
            if all(w["queued"] for w in gw.queue()["perWorker"]):
                break
        rest = [threading.Thread(target=one, daemon=True) for _ in range(10 * max_queue - len(threads))]
        for t in rest:
            t.start()
        threads += rest
        wait_for(lambda: len(replies) >= 9 * max_queue, timeout=60, what="the refusals")
        time.sleep(0.5)
        assert len(replies) == 9 * max_queue and all(r.startswith(b"HTTP/1.1 429") for r in replies)
        q = gw.queue()
        assert q["queued"] == max_queue and q["workers"] == 2
        per_worker = [w["queued"] for w in q["perWorker"]]
        assert sum(per_worker) == max_queue and all(per_worker), per_worker  # both workers hold some
        # KEDA sees one figure for the Pod: the scaler child sums both workers.
        with grpc.insecure_channel(f"127.0.0.1:{gw.scaler_port}") as channel:
            stub = pb_grpc.ExternalScalerStub(channel)
            wait_for(lambda: stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=REF, metricName="noctaya-demand"),
                                             timeout=5).metricValues[0].metricValue == max_queue,
                     timeout=15, what="summed demand")
            assert stub.IsActive(REF, timeout=5).result is True
        # A held request survives its peer worker being stuck: stop one worker, wake the backend,
        # the other worker's held requests are answered.
        stuck = workers[0] if b"\0-m\0scaler" not in Path(f"/proc/{workers[0]}/cmdline").read_bytes() else workers[1]
        stuck_index = next(i for i, w in enumerate(q["perWorker"]) if w["pid"] == stuck)
        others = max_queue - q["perWorker"][stuck_index]["queued"]
        os.kill(stuck, signal.SIGSTOP)
        try:
            backend = Backend(backend_port)
            wait_for(lambda: len(replies) >= 9 * max_queue + others, timeout=30, what="the other worker's answers")
        finally:
            os.kill(stuck, signal.SIGCONT)
        for t in threads:
            t.join(60)
        ok = [r for r in replies if r.startswith(b"HTTP/1.1 200")]
        assert len(ok) == max_queue
    finally:
        streams.close()
        logs = gw.stop()
        if backend is not None:
            backend.stop()
    assert "Traceback" not in logs
    assert gw.proc.returncode == 0  # SIGTERM drained both workers


def test_a_killed_worker_is_replaced_and_its_tickets_return() -> None:
    max_queue = 4
    backend_port = free_port()
    # Restarts are the supervisor's: a Pod of several workers (one worker is the whole process).
    gw = Gateway(backend_port, NOCTAYA_GATEWAY_WORKERS="2", NOCTAYA_MAX_QUEUE=str(max_queue),
                 NOCTAYA_ACTIVATION_TIMEOUT_SECONDS="120")
    socks = []
    backend = None
    try:
        workers = children(gw.proc.pid)
        assert len(workers) == 2, workers
        for _ in range(max_queue):
            sock = socket.create_connection(("127.0.0.1", gw.port), timeout=30)
            sock.sendall(request_bytes(BODY))
            socks.append(sock)
        wait_for(lambda: gw.queue()["queued"] == max_queue, timeout=15, what="queue full")
        for worker in workers:  # whichever of them holds the tickets
            os.kill(worker, signal.SIGKILL)
        wait_for(lambda: len(set(children(gw.proc.pid)) - set(workers)) == 2, timeout=20, what="two new workers")

        def served() -> bool:
            try:
                return gw.queue()["queued"] == 0
            except requests.RequestException:
                return False

        wait_for(served, timeout=20, what="the dead worker's tickets returned")
        backend = Backend(backend_port)
        # All maxQueue slots are usable again: nothing leaked with the dead worker.
        results = []
        threads = [threading.Thread(target=lambda: results.append(
            requests.post(gw.url + "/v1/chat/completions", data=BODY, timeout=30).status_code)) for _ in range(max_queue)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(40)
        assert results == [200] * max_queue
    finally:
        for sock in socks:
            sock.close()
        logs = gw.stop()
        if backend is not None:
            backend.stop()
    assert "worker exited; restarting" in logs and "Traceback" not in logs
