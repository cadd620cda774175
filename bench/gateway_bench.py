"""Gateway benchmark: warm path vs nginx, open-loop added latency, held cold connections,
Ready -> first byte, cold admission -> pushed `true` on the real StreamIsActive stream.

Run: .venv/bin/python -m bench.gateway_bench [--quick]

Needs Debian's nginx and wrk (`apt-get install -y nginx wrk`). Everything runs on 127.0.0.1:
the gateway is the real `python -m gateway` process (gevent-patched, in-process gRPC scaler in
`local` mode with one StreamIsActive stream open, as KEDA would hold it), the fast backend is a
static nginx location, and the comparison proxy is nginx's own proxy_pass (one worker, upstream
keepalive) to the same location. Every phase is bounded; the whole run takes about 90 s.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from bench.gateway_backend import StreamingBackend
from bench.gateway_nginx import Nginx, find_nginx, wait_listening
from scaler import externalscaler_pb2 as pb
from scaler import externalscaler_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
REF = pb.ScaledObjectRef(name="bench", namespace="bench", scalerMetadata={})
BODY = b'{"model":"bench","messages":[{"role":"user","content":"hello"}],"max_tokens":16}'
STREAM_BODY = b'{"model":"bench","messages":[{"role":"user","content":"hello"}],"stream":true}'
TARGETS = {
    "throughput_rps": 1000.0, "added_p50_ms": 2.0, "added_p99_ms": 10.0, "held_kib": 64.0,
    "ready_first_byte_ms": 250.0, "admission_push_ms": 50.0,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


class Gateway:
    """`python -m gateway` with the given backend and overrides."""

    def __init__(self, backend_url: str, **env: str) -> None:
        self.port = free_port()
        self.scaler_port = free_port()
        full = {
            **os.environ, "PYTHONPATH": str(ROOT),
            "NOCTAYA_BACKEND_URL": backend_url, "NOCTAYA_SERVED_MODEL_NAME": "bench",
            "NOCTAYA_LISTEN_HOST": "127.0.0.1", "NOCTAYA_LISTEN_PORT": str(self.port),
            "NOCTAYA_SCALER_MODE": "local", "NOCTAYA_SCALER_PORT": str(self.scaler_port),
            "NOCTAYA_LOG_LEVEL": "warning", **env,
        }
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", "gateway"], cwd=ROOT, env=full,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        wait_listening(self.port, 30)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.scaler_port}")
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self.stub = pb_grpc.ExternalScalerStub(self.channel)
        self.pushes: queue.Queue[tuple[float, bool]] = queue.Queue(maxsize=100_000)
        self._stream = self.stub.StreamIsActive(REF)
        threading.Thread(target=self._read_stream, daemon=True).start()

    def _read_stream(self) -> None:
        try:
            for msg in self._stream:
                self.pushes.put((time.monotonic(), msg.result))
        except grpc.RpcError:
            pass

    def queue_state(self) -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            conn.request("GET", "/noctaya/queue")
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()

    def wait_queue(self, predicate, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.queue_state()
            if predicate(state):
                return state
            time.sleep(0.02)
        raise RuntimeError(f"gateway queue never reached the expected state: {self.queue_state()}")

    def stop(self) -> None:
        self._stream.cancel()
        self.channel.close()
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def wrk(port: int, seconds: int, connections: int) -> dict[str, float]:
    script = tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False)
    script.write(f'wrk.method = "POST"\nwrk.body = \'{BODY.decode()}\'\n'
                 'wrk.headers["Content-Type"] = "application/json"\n')
    script.close()
    try:
        out = subprocess.run(
            ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", script.name,
             f"http://127.0.0.1:{port}/v1/chat/completions"],
            capture_output=True, text=True, timeout=seconds + 30, check=True,
        ).stdout
    finally:
        os.unlink(script.name)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errors = re.search(r"Socket errors:.*", out)
    return {"rps": rps, "non2xx": float(non2xx.group(1)) if non2xx else 0.0,
            "socket_errors": 0.0 if errors is None else 1.0}


def open_loop(port: int, rate: float, seconds: float, workers: int = 8) -> list[float]:
    """Latencies (ms) at a fixed arrival rate, measured from each request's *scheduled* start so
    a slow answer cannot hide the queueing it causes (no coordinated omission)."""
    start = time.monotonic() + 0.2
    total = int(rate * seconds)
    results: list[list[float]] = [[] for _ in range(workers)]
    failures = [0]

    def worker(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        for i in range(k, total, workers):
            scheduled = start + i / rate
            delay = scheduled - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            try:
                conn.request("POST", "/v1/chat/completions", BODY, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                if resp.status != 200:
                    failures[0] += 1
            except (OSError, http.client.HTTPException):
                failures[0] += 1
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                continue
            results[k].append((time.monotonic() - scheduled) * 1000)
        conn.close()

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 30)
    if failures[0]:
        raise RuntimeError(f"{failures[0]} failed requests in the open-loop run")
    return [x for r in results for x in r]


def warm_path(nginx_bin: str, seconds: int, latency_seconds: float) -> dict:
    static_port, proxy_port = free_port(), free_port()
    static = Nginx(nginx_bin, static_port)
    proxy = Nginx(nginx_bin, proxy_port, upstream=static_port)
    gw = Gateway(f"http://127.0.0.1:{static_port}")
    try:
        # Warm up: the first request is cold (readiness unknown at start) and loads code paths.
        open_loop(gw.port, 100, 1.0)
        open_loop(proxy_port, 100, 0.5)
        rows = {}
        for name, port in (("direct", static_port), ("nginx", proxy_port), ("gateway", gw.port)):
            rows[name] = wrk(port, seconds, 32)
        lat = {}
        for name, port in (("direct", static_port), ("nginx", proxy_port), ("gateway", gw.port)):
            samples = open_loop(port, 200, latency_seconds)
            lat[name] = {"p50": pct(samples, 50), "p99": pct(samples, 99), "n": len(samples)}
        gw_rss = rss_kib(gw.proc.pid)
    finally:
        gw.stop()
        proxy.stop()
        static.stop()
    return {"wrk": rows, "latency": lat, "gateway_rss_kib": gw_rss}


def held_connections(count: int) -> dict:
    dead_port = free_port()  # nothing listens: the backend is scaled to zero
    gw = Gateway(f"http://127.0.0.1:{dead_port}", NOCTAYA_MAX_QUEUE=str(count + 10),
                 NOCTAYA_ACTIVATION_TIMEOUT_SECONDS="120", NOCTAYA_HEARTBEAT_SECONDS="10")
    socks: list[socket.socket] = []
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(STREAM_BODY), STREAM_BODY))

    def open_one() -> socket.socket:
        s = socket.create_connection(("127.0.0.1", gw.port), timeout=20)
        s.sendall(request)
        head = b""
        while b": heartbeat" not in head:  # committed 200 text/event-stream + first heartbeat
            chunk = s.recv(4096)
            if not chunk:
                raise RuntimeError("gateway closed a held stream")
            head += chunk
        return s

    try:
        socks.append(open_one())  # one held stream so every code path is loaded before the baseline
        time.sleep(0.5)
        before = rss_kib(gw.proc.pid)
        for _ in range(count - 1):
            socks.append(open_one())
        state = gw.wait_queue(lambda q: q["queued"] == count)
        time.sleep(0.5)
        after = rss_kib(gw.proc.pid)
    finally:
        for s in socks:
            s.close()
        gw.stop()
    return {"held": state["queued"], "rss_before_kib": before, "rss_after_kib": after,
            "kib_per_connection": (after - before) / (count - 1)}


def ready_to_first_byte(trials: int) -> list[float]:
    port = free_port()
    backend = StreamingBackend(port)
    gw = Gateway(f"http://127.0.0.1:{port}", NOCTAYA_ACTIVATION_TIMEOUT_SECONDS="30",
                 NOCTAYA_READY_GRACE_SECONDS="0.1")
    out: list[float] = []
    try:
        for _ in range(trials):
            s = socket.create_connection(("127.0.0.1", gw.port), timeout=20)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(STREAM_BODY), STREAM_BODY))
            gw.wait_queue(lambda q: q["queued"] == 1 and not q["backendReady"])
            time.sleep(random.uniform(0.0, 0.25))  # random phase against the prober's cadence
            ready_at = time.monotonic()
            backend.start()
            buf = b""
            while b"data: " not in buf:
                chunk = s.recv(65536)
                if not chunk:
                    raise RuntimeError("stream ended before the first forwarded byte")
                buf += chunk
            out.append((time.monotonic() - ready_at) * 1000)
            s.close()
            backend.stop()
            gw.wait_queue(lambda q: q["queued"] == 0 and q["inFlight"] == 0)
    finally:
        backend.stop()
        gw.stop()
    return out


def admission_to_push(trials: int) -> list[float]:
    dead_port = free_port()
    gw = Gateway(f"http://127.0.0.1:{dead_port}", NOCTAYA_ACTIVATION_TIMEOUT_SECONDS="0.3")
    out: list[float] = []
    try:
        first = gw.pushes.get(timeout=10)
        assert first[1] is False, "stream must open with the current (inactive) state"
        for _ in range(trials):
            s = socket.create_connection(("127.0.0.1", gw.port), timeout=20)
            sent_at = time.monotonic()
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY))
            while True:
                at, value = gw.pushes.get(timeout=10)
                if value:
                    out.append((at - sent_at) * 1000)
                    break
            s.recv(65536)  # 504 activation_timeout after 0.3 s
            s.close()
            while True:  # lease expired: the stream pushes false before the next trial
                _, value = gw.pushes.get(timeout=10)
                if not value:
                    break
    finally:
        gw.stop()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter phases (smoke run)")
    parser.add_argument("--held", type=int, default=1000, help="held cold streams (default 1000)")
    args = parser.parse_args()
    nginx_bin = find_nginx()
    if nginx_bin is None or shutil.which("wrk") is None:
        print("gateway_bench needs Debian's nginx and wrk: apt-get install -y nginx wrk", file=sys.stderr)
        return 2
    seconds, lat_seconds = (2, 3.0) if args.quick else (5, 10.0)
    started = time.monotonic()
    warm = warm_path(nginx_bin, seconds, lat_seconds)
    held = held_connections(args.held)
    ready = ready_to_first_byte(5 if args.quick else 12)
    push = admission_to_push(10 if args.quick else 30)

    w, lat = warm["wrk"], warm["latency"]
    added_p50 = lat["gateway"]["p50"] - lat["direct"]["p50"]
    added_p99 = lat["gateway"]["p99"] - lat["direct"]["p99"]
    results = {
        "throughput_rps": w["gateway"]["rps"],
        "added_p50_ms": added_p50,
        "added_p99_ms": added_p99,
        "held_kib": held["kib_per_connection"],
        "ready_first_byte_ms": max(ready),
        "admission_push_ms": max(push),
    }
    print("\n== Gateway warm path (wrk -t1 -c32, POST /v1/chat/completions, static nginx backend)")
    for name in ("direct", "nginx", "gateway"):
        print(f"  {name:8s} {w[name]['rps']:10.0f} req/s  ratio to direct {w[name]['rps'] / w['direct']['rps']:.3f}"
              f"  non-2xx {w[name]['non2xx']:.0f}")
    print(f"  gateway / nginx proxy throughput ratio: {w['gateway']['rps'] / w['nginx']['rps']:.3f}")
    print("\n== Latency at a fixed open-loop 200 req/s (ms, from scheduled send)")
    for name in ("direct", "nginx", "gateway"):
        print(f"  {name:8s} p50 {lat[name]['p50']:.3f}  p99 {lat[name]['p99']:.3f}  (n={lat[name]['n']})")
    print(f"  added by nginx proxy: p50 {lat['nginx']['p50'] - lat['direct']['p50']:.3f}"
          f"  p99 {lat['nginx']['p99'] - lat['direct']['p99']:.3f}")
    print(f"  added by gateway:     p50 {added_p50:.3f}  p99 {added_p99:.3f}")
    print(f"\n== {held['held']} held cold streams: RSS {held['rss_before_kib']} -> {held['rss_after_kib']} KiB, "
          f"{held['kib_per_connection']:.1f} KiB per held connection")
    print(f"\n== Backend Ready -> first forwarded byte (ms, {len(ready)} trials): "
          f"p50 {pct(ready, 50):.1f}  max {max(ready):.1f}")
    print(f"== Cold admission -> pushed `true` on StreamIsActive (ms, {len(push)} trials): "
          f"p50 {pct(push, 50):.2f}  max {max(push):.2f}")
    print("\n== Targets")
    failed = 0
    for key, target in TARGETS.items():
        value = results[key]
        ok = value >= target if key == "throughput_rps" else value < target
        failed += not ok
        print(f"  {key:22s} {value:10.2f}  target {'>=' if key == 'throughput_rps' else '<'} {target:g}  "
              f"{'OK' if ok else 'MISSED'}")
    print(f"\n(total {time.monotonic() - started:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
