"""Scaler benchmark: unary latency under open streams, and publish → pushed `true` latency.

Run: .venv/bin/python -m bench.scaler_bench [--rounds N] [--pushes N]

The scaler runs in a separate process (bench/scaler_host.py), three times: grpcio natively (the
aggregate scaler, and the `python -m scaler local` child of a multi-worker gateway), grpcio inside a
gevent-monkey-patched process (grpc's gevent mode: the design the gateway measured and rejected), and
h2 on a gevent loop (scaler/h2server.py: the one-worker gateway's in-process scaler). The
client here issues 200 concurrent unary calls (GetMetrics / IsActive alternating, as grpc futures
from one thread so the client's own threads don't add queueing) with 0 streams open (baseline) and
with 128 StreamIsActive streams open (baseline measured before and after: A-B-A), and reports
p50/p99 and the ratio to the baseline. Push
latency = receive time of the first `true` on a stream minus the host's publish time (both
CLOCK_MONOTONIC). Bounded: every wait has a deadline; the whole run takes well under 2 minutes.
"""

from __future__ import annotations

import argparse
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

from scaler import externalscaler_pb2 as pb
from scaler import externalscaler_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
REF = pb.ScaledObjectRef(name="bench", namespace="bench", scalerMetadata={"scalerAddress": "x:9090"})
STREAMS = 128
CONCURRENT = 200


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


class Host:
    def __init__(self, flag: str) -> None:
        args = [sys.executable, "-m", "bench.scaler_host"] + ([flag] if flag else [])
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        self.lines: queue.Queue[str] = queue.Queue(maxsize=10_000)
        threading.Thread(target=self._read, daemon=True).start()
        self.port = int(self.expect("PORT", 30)[1])

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.put(line)

    def expect(self, word: str, timeout: float = 10.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while True:
            parts = self.lines.get(timeout=max(0.01, deadline - time.monotonic())).split()
            if parts and parts[0] == word:
                return parts

    def publish(self, queued: int, in_flight: int = 0, lease: bool = False) -> float:
        self.proc.stdin.write(f"publish {queued} {in_flight} {int(lease)}\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return float(self.expect("published")[1])

    def open_streams(self) -> int:
        self.proc.stdin.write("streams\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return int(self.expect("streams")[1])

    def stop(self) -> None:
        try:
            self.proc.stdin.write("stop\n")  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
            self.proc.wait(20)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(10)


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux /proc), to report server CPU per call next to latency."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def unary_burst(stub: pb_grpc.ExternalScalerStub) -> list[float]:
    """CONCURRENT calls in flight at once; returns each call's latency in seconds."""
    done = threading.Semaphore(0)
    latencies: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    request = pb.GetMetricsRequest(scaledObjectRef=REF, metricName="noctaya-demand")

    def on_done(started: float, future: grpc.Future) -> None:
        elapsed = time.perf_counter() - started
        with lock:
            if future.exception() is not None:
                errors.append(future.exception())
            latencies.append(elapsed)
        done.release()

    for i in range(CONCURRENT):
        started = time.perf_counter()
        future = stub.GetMetrics.future(request, timeout=30) if i % 2 else stub.IsActive.future(REF, timeout=30)
        future.add_done_callback(lambda f, s=started: on_done(s, f))
    for _ in range(CONCURRENT):
        if not done.acquire(timeout=60):
            raise TimeoutError("unary burst did not finish")
    if errors:
        raise RuntimeError(f"{len(errors)} unary calls failed: {errors[0]!r}")
    return latencies


class StreamReaders:
    """N StreamIsActive streams, each read by its own thread that timestamps every message."""

    def __init__(self, stub: pb_grpc.ExternalScalerStub, n: int) -> None:
        self.calls = [stub.StreamIsActive(REF, timeout=600) for _ in range(n)]
        self.events: queue.Queue[tuple[int, bool, float]] = queue.Queue(maxsize=100_000)
        self.threads = [threading.Thread(target=self._read, args=(i, c), daemon=True) for i, c in enumerate(self.calls)]
        for t in self.threads:
            t.start()
        self.wait_for(False, 60)  # every stream's first message (current state: idle)

    def _read(self, index: int, call: grpc.Call) -> None:
        try:
            for message in call:
                self.events.put((index, message.result, time.monotonic()))
        except grpc.RpcError:
            pass

    def wait_for(self, value: bool, timeout: float) -> list[float]:
        """Receive time of the first message == value on every stream."""
        pending = set(range(len(self.calls)))
        got: dict[int, float] = {}
        deadline = time.monotonic() + timeout
        while pending:
            index, result, at = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            if result is value and index in pending:
                pending.discard(index)
                got[index] = at
        return list(got.values())

    def close(self) -> None:
        for call in self.calls:
            call.cancel()
        for t in self.threads:
            t.join(10)


def run_mode(flag: str, rounds: int, pushes: int) -> dict[str, float]:
    host = Host(flag)
    results: dict[str, float] = {}
    try:
        with grpc.insecure_channel(f"127.0.0.1:{host.port}") as channel:
            stub = pb_grpc.ExternalScalerStub(channel)
            for _ in range(3):
                unary_burst(stub)  # warm-up: connection, code paths, the pool's lazily started threads
            cpu0 = process_cpu_seconds(host.proc.pid)
            base = [x for _ in range(rounds) for x in unary_burst(stub)]
            base_cpu = process_cpu_seconds(host.proc.pid) - cpu0
            readers = StreamReaders(stub, STREAMS)
            cpu0 = process_cpu_seconds(host.proc.pid)
            loaded = [x for _ in range(rounds) for x in unary_burst(stub)]
            loaded_cpu = process_cpu_seconds(host.proc.pid) - cpu0
            first_push: list[float] = []
            all_push: list[float] = []
            for _ in range(pushes):
                published = host.publish(1)
                received = readers.wait_for(True, 30)
                first_push.append(min(received) - published)
                all_push.extend(r - published for r in received)
                host.publish(0)
                readers.wait_for(False, 30)
            readers.close()
            deadline = time.monotonic() + 30
            while host.open_streams() and time.monotonic() < deadline:
                time.sleep(0.05)
            # A-B-A: a second baseline after the streams closed, so drift (warm-up, a noisy
            # neighbour) shows up as two differing baselines rather than as a fake ratio.
            cpu0 = process_cpu_seconds(host.proc.pid)
            base += [x for _ in range(rounds) for x in unary_burst(stub)]
            base_cpu += process_cpu_seconds(host.proc.pid) - cpu0
    finally:
        host.stop()
    results.update(
        base_p50=pct(base, 50), base_p99=pct(base, 99), loaded_p50=pct(loaded, 50), loaded_p99=pct(loaded, 99),
        first_push_p50=pct(first_push, 50), first_push_p99=pct(first_push, 99),
        all_push_p50=pct(all_push, 50), all_push_p99=pct(all_push, 99), calls=len(loaded),
        base_cpu_us=base_cpu / len(base) * 1e6, loaded_cpu_us=loaded_cpu / len(loaded) * 1e6,
    )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="bursts of 200 unary calls per measurement")
    parser.add_argument("--pushes", type=int, default=30, help="idle→active publishes to time")
    args = parser.parse_args()
    ms = 1000.0
    load = os.getloadavg()[0]
    print(f"scaler bench: {CONCURRENT} concurrent unary calls x {args.rounds} rounds; {STREAMS} open streams; "
          f"{args.pushes} publishes; {os.cpu_count()} CPUs; load average {load:.2f} at start")
    modes = (("grpcio, native threads (aggregate scaler, multi-worker gateway's scaler child)", ""),
             ("grpcio, gevent-patched (grpc gevent mode, not used by the gateway)", "--gevent"),
             ("h2 on a gevent loop (one-worker gateway, in process)", "--h2"))
    for label, flag in modes:
        t0 = time.monotonic()
        r = run_mode(flag, args.rounds, args.pushes)
        print(f"\n[{label}] ({time.monotonic() - t0:.1f} s)")
        print(f"  unary, 0 streams:     p50 {r['base_p50'] * ms:7.2f} ms   p99 {r['base_p99'] * ms:7.2f} ms"
              f"   server CPU {r['base_cpu_us']:4.0f} us/call")
        print(f"  unary, {STREAMS} streams:   p50 {r['loaded_p50'] * ms:7.2f} ms   p99 {r['loaded_p99'] * ms:7.2f} ms"
              f"   server CPU {r['loaded_cpu_us']:4.0f} us/call   ({int(r['calls'])} calls)")
        print(f"  ratio loaded/baseline: p50 x{r['loaded_p50'] / r['base_p50']:.2f}   "
              f"p99 x{r['loaded_p99'] / r['base_p99']:.2f}   (target: p99 < 100 ms with {STREAMS} streams)")
        print(f"  publish -> first pushed true (any stream):  p50 {r['first_push_p50'] * ms:6.2f} ms   "
              f"p99 {r['first_push_p99'] * ms:6.2f} ms")
        print(f"  publish -> pushed true, all {STREAMS} streams:   p50 {r['all_push_p50'] * ms:6.2f} ms   "
              f"p99 {r['all_push_p99'] * ms:6.2f} ms   (target: < 250 ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
