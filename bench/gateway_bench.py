"""Gateway benchmark, every figure against a baseline measured in the same run:

- warm path: throughput and CPU per request against nginx's own ``proxy_pass``, with the proxy under
  test (gateway: one worker; nginx: one worker) pinned to core 0 and the load generator (wrk) and
  the static nginx backend on core 1; interleaved rounds, medians;
- workers: the same load against 1 and 2 gateway workers spread over both cores (the gain);
- added latency at a fixed open-loop 200 req/s (gateway / nginx proxy minus direct), in interleaved
  rounds: the median of per-round differences (a host stall hits one round) and the pooled figure;
- streaming: 200 concurrent streams of 50 SSE chunks (10 ms apart) direct, through nginx and
  through the gateway: chunk rate and time to first byte;
- held cold streams (memory per connection), backend Ready -> first forwarded byte, cold
  admission -> pushed ``true`` on the real StreamIsActive stream.

Run: .venv/bin/python -m bench.gateway_bench [--quick] [--held N]

Needs Debian's nginx and wrk (`apt-get install -y nginx wrk`) and taskset (util-linux). Everything
runs on 127.0.0.1 with the real ``python -m gateway`` process; every phase is bounded.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import random
import re
import resource
import selectors
import shutil
import socket
import statistics
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
# name -> (target, True when higher is better)
TARGETS = {
    "throughput_ratio_to_nginx": (0.27, True), "cpu_per_request_ratio_to_nginx": (5.0, False),
    "added_p50_ms": (0.5, False), "added_p99_ms": (2.0, False),
    "stream_chunk_rate_ratio_to_nginx": (0.95, True), "stream_added_ttfb_p99_ms": (5.0, False),
    "held_kib": (32.0, False), "ready_first_byte_ms": (250.0, False), "admission_push_ms": (50.0, False),
}
CPU0, CPU1 = "0", "1"  # the proxy under test / the load generator and the backend


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
    """`python -m gateway` with the given backend and overrides; ``root``: the source tree it runs
    from (another commit's, extracted for an A/B: bench.replicas)."""

    def __init__(self, backend_url: str, cpus: str = CPU0, root: Path = ROOT, **env: str) -> None:
        self.port = free_port()
        self.scaler_port = free_port()
        self.admin_port = free_port()
        full = {
            **os.environ, "PYTHONPATH": str(root),
            "NOCTAYA_BACKEND_URL": backend_url, "NOCTAYA_SERVED_MODEL_NAME": "bench",
            "NOCTAYA_LISTEN_HOST": "127.0.0.1", "NOCTAYA_LISTEN_PORT": str(self.port),
            "NOCTAYA_ADMIN_PORT": str(self.admin_port),
            "NOCTAYA_SCALER_MODE": "local", "NOCTAYA_SCALER_PORT": str(self.scaler_port),
            "NOCTAYA_LOG_LEVEL": "warning", "NOCTAYA_GATEWAY_WORKERS": "1", **env,
        }
        self.log = tempfile.TemporaryFile()
        pin = ["taskset", "-c", cpus] if cpus else []
        self.proc = subprocess.Popen([*pin, sys.executable, "-m", "gateway"], cwd=root, env=full,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        wait_listening(self.port, 30)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.scaler_port}")
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self.stub = pb_grpc.ExternalScalerStub(self.channel)
        self.pushes: queue.Queue[tuple[float, bool]] = queue.Queue(maxsize=100_000)
        self._stream = self.stub.StreamIsActive(REF)
        threading.Thread(target=self._read_stream, daemon=True).start()

    def worker_pid(self) -> int:
        """The (single) worker process: RSS is measured there, not in a supervisor."""
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as fh:
                    ppid = int(fh.read().rsplit(b")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    cmdline = fh.read()
            except OSError:
                continue
            if ppid == self.proc.pid and b"scaler" not in cmdline:
                return int(entry)
        return self.proc.pid  # one worker is the whole Pod: the gateway process itself (gateway.workers)

    def _read_stream(self) -> None:
        try:
            for msg in self._stream:
                self.pushes.put((time.monotonic(), msg.result))
        except grpc.RpcError:
            pass

    def queue_state(self) -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", self.admin_port, timeout=5)
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


def cpu_ticks() -> tuple[int, int]:
    """(busy, steal) ticks of the whole machine from /proc/stat. On a virtual machine, steal is
    time the host ran someone else while this guest wanted the CPU: it lands in every latency."""
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return user + nice + system + irq + softirq + steal, steal


class StealMeter:
    def __init__(self) -> None:
        self.start = cpu_ticks()

    def percent(self) -> float:
        busy, steal = cpu_ticks()
        return 100.0 * (steal - self.start[1]) / max(1, busy - self.start[0])


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` and all its descendants (the gateway is a supervisor, its workers
    and its scaler child)."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += times.get(p, 0.0)
        todo += [c for c, parent in parents.items() if parent == p]
    return total


def wrk(port: int, seconds: float, connections: int, pid: int | None = None) -> dict[str, float]:
    """wrk on core 1 (the load generator's core); with ``pid``, the CPU it used per request."""
    script = tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False)
    script.write(f'wrk.method = "POST"\nwrk.body = \'{BODY.decode()}\'\n'
                 'wrk.headers["Content-Type"] = "application/json"\n')
    script.close()
    cpu_before = cpu_seconds(pid) if pid else 0.0
    try:
        out = subprocess.run(
            ["taskset", "-c", CPU1, "wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", script.name,
             f"http://127.0.0.1:{port}/v1/chat/completions"],
            capture_output=True, text=True, timeout=seconds + 30, check=True,
        ).stdout
    finally:
        os.unlink(script.name)
    cpu = cpu_seconds(pid) - cpu_before if pid else 0.0
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    total = int(re.search(r"(\d+) requests in", out).group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errors = re.search(r"Socket errors:.*", out)
    return {"rps": rps, "non2xx": float(non2xx.group(1)) if non2xx else 0.0,
            "socket_errors": 0.0 if errors is None else 1.0, "cpu_us_per_request": cpu / max(total, 1) * 1e6}


def open_loop(port: int, rate: float, seconds: float, connections: int = 8) -> list[float]:
    """Latencies (ms) at a fixed arrival rate, measured from each request's *scheduled* start so a
    slow answer cannot hide the queueing it causes (no coordinated omission). One thread, one epoll
    loop over ``connections`` keep-alive connections: no GIL hand-offs in the measurement."""
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY))
    selector = selectors.DefaultSelector()
    idle: list[socket.socket] = []
    for _ in range(connections):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        idle.append(sock)
    busy: dict[socket.socket, list] = {}  # sock -> [scheduled, received bytes]
    start = time.monotonic() + 0.2
    total = int(rate * seconds)
    latencies: list[float] = []
    backlog: list[float] = []
    sent = 0
    deadline = start + seconds + 30
    while len(latencies) < total:
        now = time.monotonic()
        if now > deadline:
            raise RuntimeError("open-loop run did not finish")
        while sent < total and start + sent / rate <= now:
            backlog.append(start + sent / rate)
            sent += 1
        while backlog and idle:
            sock = idle.pop()
            sock.send(request)
            busy[sock] = [backlog.pop(0), b""]
            selector.register(sock, selectors.EVENT_READ)
        next_send = start + sent / rate if sent < total else now + 0.05
        for key, _ in selector.select(max(0.0, min(next_send - time.monotonic(), 0.05))):
            sock = key.fileobj
            entry = busy[sock]
            entry[1] += sock.recv(65536)
            head, sep, body = entry[1].partition(b"\r\n\r\n")
            if not sep:
                continue
            length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
            if len(body) < length:
                continue
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"open-loop request failed: {head[:100]!r}")
            latencies.append((time.monotonic() - entry[0]) * 1000)
            selector.unregister(sock)
            del busy[sock]
            idle.append(sock)
    for sock in idle + list(busy):
        sock.close()
    selector.close()
    return latencies


def warm_path(nginx_bin: str, seconds: float, rounds: int, latency_seconds: float) -> dict:
    static_port, proxy_port = free_port(), free_port()
    static = Nginx(nginx_bin, static_port, cpu=int(CPU1))
    proxy = Nginx(nginx_bin, proxy_port, upstream=static_port, cpu=int(CPU0))
    gw = Gateway(f"http://127.0.0.1:{static_port}", cpus=CPU0)
    try:
        # Warm up: the first request is cold (readiness unknown at start) and loads code paths.
        open_loop(gw.port, 100, 1.0)
        open_loop(proxy_port, 100, 0.5)
        runs: dict[str, list[dict]] = {"nginx": [], "gateway": []}
        steal = StealMeter()
        for _ in range(rounds):  # interleaved, so a burst of load elsewhere hits both alike
            runs["nginx"].append(wrk(proxy_port, seconds, 32, proxy.pid))
            runs["gateway"].append(wrk(gw.port, seconds, 32, gw.proc.pid))
        direct = wrk(static_port, seconds, 32)
        warm_steal = steal.percent()
        steal = StealMeter()
        # Interleaved rounds, as for throughput: a host stall (steal, another guest) lands in one
        # round of one target; a tail the gateway causes shows in every round. Both the pooled
        # percentiles and the median of per-round ones are reported.
        pooled: dict[str, list[float]] = {"direct": [], "nginx": [], "gateway": []}
        per_round: dict[str, list[tuple[float, float]]] = {name: [] for name in pooled}
        for _ in range(rounds):
            for name, port in (("direct", static_port), ("nginx", proxy_port), ("gateway", gw.port)):
                samples = open_loop(port, 200, latency_seconds)
                pooled[name] += samples
                per_round[name].append((pct(samples, 50), pct(samples, 99)))
        lat = {name: {"p50": pct(v, 50), "p99": pct(v, 99), "n": len(v), "rounds": per_round[name]}
               for name, v in pooled.items()}
        lat_steal = steal.percent()
        gw_rss = rss_kib(gw.worker_pid())
    finally:
        gw.stop()
    try:
        # Workers: the same load against 1 and 2 workers spread over both cores.
        spread = {}
        for workers in ("1", "2"):
            g = Gateway(f"http://127.0.0.1:{static_port}", cpus=f"{CPU0},{CPU1}", NOCTAYA_GATEWAY_WORKERS=workers)
            try:
                open_loop(g.port, 100, 0.5)
                spread[workers] = statistics.median(wrk(g.port, seconds, 64)["rps"] for _ in range(rounds))
            finally:
                g.stop()
    finally:
        proxy.stop()
        static.stop()
    ratios = [g["rps"] / n["rps"] for g, n in zip(runs["gateway"], runs["nginx"], strict=True)]
    cpu_ratios = [g["cpu_us_per_request"] / n["cpu_us_per_request"]
                  for g, n in zip(runs["gateway"], runs["nginx"], strict=True)]
    return {"runs": runs, "direct": direct, "ratio": statistics.median(ratios), "ratios": ratios,
            "cpu_ratio": statistics.median(cpu_ratios), "latency": lat, "gateway_rss_kib": gw_rss,
            "workers_rps": spread, "steal": {"warm": warm_steal, "latency": lat_steal}}


def streaming(nginx_bin: str, seconds: float, streams: int = 200, chunks: int = 50, interval_ms: int = 10) -> dict:
    """``streams`` concurrent clients, each sending one streamed request after another for
    ``seconds``; chunk rate and time to first ``data:`` byte, direct / nginx / gateway."""
    backend_port, proxy_port = free_port(), free_port()
    backend = subprocess.Popen(["taskset", "-c", CPU1, sys.executable, "-m", "bench.sse_backend", str(backend_port),
                                str(chunks), str(interval_ms)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                               stdout=subprocess.PIPE)
    assert backend.stdout.readline().strip() == b"ready"
    proxy = Nginx(nginx_bin, proxy_port, upstream=backend_port, cpu=int(CPU0))
    gw = Gateway(f"http://127.0.0.1:{backend_port}", cpus=CPU0, NOCTAYA_MAX_QUEUE=str(4 * streams))
    out: dict = {}
    try:
        steal = StealMeter()
        for name, port in (("direct", backend_port), ("nginx", proxy_port), ("gateway", gw.port)):
            out[name] = stream_load(port, streams, seconds)
        out["steal"] = steal.percent()
    finally:
        gw.stop()
        proxy.stop()
        backend.kill()
        backend.wait(10)
    return out


def stream_load(port: int, streams: int, seconds: float) -> dict:
    """Each connection first completes one unmeasured stream (connections set up, backend pool
    warm), then starts are staggered over one stream's duration and streams run back to back for
    ``seconds``. Chunk rate counts only chunks received inside the window; TTFB is per stream,
    from request sent to the first ``data:`` byte."""
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(STREAM_BODY), STREAM_BODY))
    selector = selectors.DefaultSelector()
    # sock -> [sent_at (None = not yet sent), first byte seen, buffer tail, measured]
    state: dict[socket.socket, list] = {}
    ttfb: list[float] = []
    chunks = completed = 0
    for _ in range(streams):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setblocking(False)
        s.send(request)
        state[s] = [time.monotonic(), False, b"", False]
        selector.register(s, selectors.EVENT_READ)
    started = end = None
    pending: list[tuple[float, socket.socket]] = []
    warm = 0
    while state:
        now = time.monotonic()
        if end is not None and now > end + 30:
            raise RuntimeError("streams did not finish")
        for at, s in [p for p in pending if p[0] <= now]:
            pending.remove((at, s))
            s.send(request)
            state[s][0] = time.monotonic()
        for key, _ in selector.select(0.005):
            s = key.fileobj
            try:
                data = s.recv(65536)
            except BlockingIOError:
                continue
            if not data:
                raise RuntimeError(f"a stream was cut on port {port}: {state[s][2][-200:]!r}")
            now = time.monotonic()
            st = state[s]
            if st[3] and st[0] is None:
                raise RuntimeError(f"bytes before the request on port {port}: {data[:300]!r}")
            if st[3] and not st[1] and b"data: " in data:
                st[1] = True
                ttfb.append((now - st[0]) * 1000)
            if st[3] and now < end:
                chunks += data.count(b"data: {")
            tail = st[2] + data
            if b"\r\n0\r\n\r\n" not in tail[-64:]:  # the last-chunk line (not a header ending in 0)
                st[2] = tail[-64:]
                continue
            if not st[3]:  # the unmeasured first stream of this connection is done
                warm += 1
                state[s] = [None, False, b"", True]
                if warm == streams:  # all warm: stagger the measured starts over ~0.5 s
                    started = time.monotonic()
                    end = started + seconds
                    for k, sock in enumerate(state):
                        pending.append((started + 0.5 * k / streams, sock))
                continue
            completed += 1
            if now < end:
                s.send(request)
                state[s] = [time.monotonic(), False, b"", True]
            else:
                selector.unregister(s)
                s.close()
                del state[s]
    selector.close()
    return {"chunks_per_s": chunks / seconds, "streams": completed, "ttfb_p50": pct(ttfb, 50),
            "ttfb_p99": pct(ttfb, 99)}


def held_connections(count: int, root: Path = ROOT) -> dict:
    """``count`` held cold SSE streams on the gateway of ``root`` (another commit's tree for an A/B:
    bench.release_ab); its worker's RSS before and after, KiB per connection."""
    dead_port = free_port()  # nothing listens: the backend is scaled to zero
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 2 * count + 1000)), hard))
    gw = Gateway(f"http://127.0.0.1:{dead_port}", root=root, NOCTAYA_MAX_QUEUE=str(count + 10),
                 NOCTAYA_MAX_CONNECTIONS=str(count + 100), NOCTAYA_MAX_CONNECTIONS_PER_ADDRESS="0",  # one client address
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
        before = rss_kib(gw.worker_pid())
        for _ in range(count - 1):
            socks.append(open_one())
        state = gw.wait_queue(lambda q: q["queued"] == count)
        time.sleep(0.5)
        after = rss_kib(gw.worker_pid())
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
    if nginx_bin is None or shutil.which("wrk") is None or shutil.which("taskset") is None:
        print("gateway_bench needs Debian's nginx, wrk and taskset: apt-get install -y nginx wrk util-linux",
              file=sys.stderr)
        return 2
    if len(os.sched_getaffinity(0)) < 2:
        print("gateway_bench needs two cores (proxy on one, load generator on the other)", file=sys.stderr)
        return 2
    os.sched_setaffinity(0, {int(CPU1)})  # this process is a load generator too (open loop, streams)
    seconds, rounds, lat_seconds, stream_seconds = (2, 2, 3.0, 3.0) if args.quick else (4, 5, 4.0, 8.0)
    started = time.monotonic()
    warm = warm_path(nginx_bin, seconds, rounds, lat_seconds)
    stream = streaming(nginx_bin, stream_seconds)
    held = held_connections(args.held)
    ready = ready_to_first_byte(5 if args.quick else 12)
    push = admission_to_push(10 if args.quick else 30)

    runs, lat = warm["runs"], warm["latency"]
    med = {name: statistics.median(r["rps"] for r in rs) for name, rs in runs.items()}
    cpu = {name: statistics.median(r["cpu_us_per_request"] for r in rs) for name, rs in runs.items()}
    def added(name: str, i: int) -> float:  # median over rounds of (proxy - direct) at percentile index i
        return statistics.median(r[i] - d[i] for r, d in zip(lat[name]["rounds"], lat["direct"]["rounds"], strict=True))

    added_p50, added_p99 = added("gateway", 0), added("gateway", 1)
    results = {
        "throughput_ratio_to_nginx": warm["ratio"],
        "cpu_per_request_ratio_to_nginx": warm["cpu_ratio"],
        "added_p50_ms": added_p50,
        "added_p99_ms": added_p99,
        "stream_chunk_rate_ratio_to_nginx": stream["gateway"]["chunks_per_s"] / stream["nginx"]["chunks_per_s"],
        "stream_added_ttfb_p99_ms": stream["gateway"]["ttfb_p99"] - stream["direct"]["ttfb_p99"],
        "held_kib": held["kib_per_connection"],
        "ready_first_byte_ms": max(ready),
        "admission_push_ms": max(push),
    }
    print(f"\n== Warm path: wrk -t1 -c32 POST /v1/chat/completions, {rounds} interleaved rounds of {seconds} s;"
          f" proxy on core {CPU0}, wrk + static nginx backend on core {CPU1}")
    print(f"  direct nginx     {warm['direct']['rps']:10.0f} req/s")
    for name in ("nginx", "gateway"):
        rps = ", ".join(f"{r['rps']:.0f}" for r in runs[name])
        print(f"  {name:8s} proxy {med[name]:10.0f} req/s median  ({rps})  CPU {cpu[name]:.1f} us/request"
              f"  non-2xx {sum(r['non2xx'] for r in runs[name]):.0f}")
    print(f"  gateway / nginx: throughput {warm['ratio']:.3f} (median of per-round ratios "
          f"{', '.join(f'{r:.3f}' for r in warm['ratios'])}), CPU per request {warm['cpu_ratio']:.2f}x")
    print(f"  CPU steal (host) during these rounds: {warm['steal']['warm']:.1f}% of busy time")
    spread = warm["workers_rps"]
    print(f"  workers over both cores (wrk -c64): 1 worker {spread['1']:.0f} req/s, 2 workers {spread['2']:.0f} req/s"
          f" ({spread['2'] / spread['1']:.2f}x)")
    print(f"\n== Latency at a fixed open-loop 200 req/s (ms, from scheduled send; {rounds} interleaved rounds of {lat_seconds:g} s)")
    for name in ("direct", "nginx", "gateway"):
        each = ", ".join(f"{p99:.2f}" for _p50, p99 in lat[name]["rounds"])
        print(f"  {name:8s} pooled p50 {lat[name]['p50']:.3f}  p99 {lat[name]['p99']:.3f}  (n={lat[name]['n']}; p99 per round {each})")
    print(f"  added by nginx proxy (median of rounds): p50 {added('nginx', 0):.3f}  p99 {added('nginx', 1):.3f}"
          f"   pooled p99 {lat['nginx']['p99'] - lat['direct']['p99']:.3f}")
    print(f"  added by gateway     (median of rounds): p50 {added_p50:.3f}  p99 {added_p99:.3f}"
          f"   pooled p99 {lat['gateway']['p99'] - lat['direct']['p99']:.3f}")
    print(f"  CPU steal (host) during these runs: {warm['steal']['latency']:.1f}% of busy time")
    print("\n== Streaming: 200 concurrent streams of 50 SSE chunks 10 ms apart")
    for name in ("direct", "nginx", "gateway"):
        st = stream[name]
        print(f"  {name:8s} {st['chunks_per_s']:9.0f} chunks/s  {st['streams']:5d} streams  "
              f"TTFB p50 {st['ttfb_p50']:.2f}  p99 {st['ttfb_p99']:.2f} ms")
    print(f"  CPU steal (host) during these runs: {stream['steal']:.1f}% of busy time")
    print(f"\n== {held['held']} held cold streams: RSS {held['rss_before_kib']} -> {held['rss_after_kib']} KiB, "
          f"{held['kib_per_connection']:.1f} KiB per held connection")
    print(f"\n== Backend Ready -> first forwarded byte (ms, {len(ready)} trials): "
          f"p50 {pct(ready, 50):.1f}  max {max(ready):.1f}")
    print(f"== Cold admission -> pushed `true` on StreamIsActive (ms, {len(push)} trials): "
          f"p50 {pct(push, 50):.2f}  max {max(push):.2f}")
    print("\n== Targets")
    failed = 0
    for key, (target, higher) in TARGETS.items():
        value = results[key]
        ok = value >= target if higher else value < target
        failed += not ok
        print(f"  {key:34s} {value:10.3f}  target {'>=' if higher else '<'} {target:g}  {'OK' if ok else 'MISSED'}")
    print(f"\n(total {time.monotonic() - started:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
