"""``python -m bench.loop_starvation [--shared]``: the wall-clock figures of a loaded gateway's loop,
with the bars they are held to (exit 1 when one is missed). The tests check the same floods by the
loop's CPU time between two greenlet switches (tests/gateway/test_loop_starvation.py), which a busy
machine does not inflate; these wall-clock times move with the host's load, so they are measured
here, on a quiet machine, not asserted in the test suite (issue 38).

The admin plane is not starved by the data plane: a real `python -m gateway` (one worker, which also
serves KEDA's scaler) gets 8 MiB hostile JSON bodies from several connections at line rate for a cold
model, while the kubelet's probe (/healthz on the admin port) and KEDA's IsActive are timed. Each
must answer within the kubelet's default timeout, 1 s.

The body is the issue's: 8 MiB of 62-deep brackets with a wrong closer at the end. The regular
expression that checked bodies before (bench.jsonscan_regex_baseline) held the only loop ~2 s per
body; gateway.jsonscan now scans in steps of 256 KiB and the gateway yields to its hub between them.

The same floods against a warm model with API keys, per-model and shared gateway: a keyed user's warm
p99 stays within twice its quiet value (issue 29, Must show 1; figures in docs/benchmarks.md).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

from scaler import externalscaler_pb2_grpc as pb_grpc
from tests.gateway.abuse_harness import (
    ROOT,
    Flood,
    GatewayPod,
    MiB,
    Reader,
    chat,
    connect,
    exchange,
    get,
    model_name,
    request_bytes,
    wait_until,
)
from tests.gateway.fakebackend import FakeBackend
from tests.ports import free_port

KUBELET_TIMEOUT = 1.0
CLIENTS = 4
FLOOD_SECONDS = 6.0


def hostile_body(size: int = 8 * MiB) -> bytes:
    """Valid up to its last byte: a '}' where a ']' belongs. Names the rendered model."""
    head = b'{"model":"%s","stream":true,"x":[' % model_name().encode()
    chain = b"[" * 61 + b"]" * 61 + b","
    filler = chain * ((size - len(head) - 2) // len(chain))
    body = head + filler + b"1"
    return body + b"}" * (size - len(body))


def hostile_json_floods_cannot_delay_probes_or_the_scaler() -> None:
    backend = FakeBackend()  # not started: the model is cold, so every body is scanned before it waits
    pod = GatewayPod(backend.port, NOCTAYA_GATEWAY_WORKERS="1", NOCTAYA_SCALER_MODE="local",
                     NOCTAYA_CLIENT_REQUEST_TIMEOUT_SECONDS="60")
    raw = request_bytes("POST", "/v1/chat/completions", hostile_body())
    stop = threading.Event()
    answers: list[int] = []

    def flood(i: int) -> None:
        while not stop.is_set():
            response = exchange(pod.port, raw, source=f"127.0.2.{1 + i}", timeout=60)
            answers.append(response.status if response is not None else 0)

    channel = grpc.insecure_channel(f"127.0.0.1:{pod.scaler_port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=20)
        stub = pb_grpc.ExternalScalerStub(channel)
        threads = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        wait_until(lambda: len(answers) >= CLIENTS, 30, "the first hostile bodies answered")
        probes: list[float] = []
        scaler: list[float] = []
        deadline = time.monotonic() + FLOOD_SECONDS
        while time.monotonic() < deadline:
            started = time.monotonic()
            assert get(pod.admin_port, "/healthz", timeout=10).status == 200
            probes.append(time.monotonic() - started)
            started = time.monotonic()
            stub.IsActive(pod.ref, timeout=10)
            scaler.append(time.monotonic() - started)
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(30)
        # The flood was real: bodies scanned (and refused) throughout, none woke the model.
        assert len(answers) >= 2 * CLIENTS and set(answers) == {400}, answers
        print(f"\n{len(answers)} hostile bodies answered; /healthz slowest {max(probes) * 1000:.0f} ms, median "
              f"{sorted(probes)[len(probes) // 2] * 1000:.0f} ms ({len(probes)}); IsActive slowest "
              f"{max(scaler) * 1000:.0f} ms, median {sorted(scaler)[len(scaler) // 2] * 1000:.0f} ms")
        assert max(probes) < KUBELET_TIMEOUT, (max(probes), sorted(probes)[-5:])
        assert max(scaler) < KUBELET_TIMEOUT, (max(scaler), sorted(scaler)[-5:])
    finally:
        stop.set()
        channel.close()
        logs = pod.stop()
    assert "Traceback" not in logs


# -- a keyed user's warm requests under the flood ------------------------------------------------------
# Issue 29's bar: with the flood on, a warm keyed user's p99 stays within twice its quiet value. The
# quiet value is taken as at least QUIET_FLOOR. The fake backend answers on loopback in ~1 ms, so the
# quiet p99 here is a few milliseconds of scheduler noise (a real model's warm completion takes tens
# of milliseconds at least: one decode step of a 7B model is ~20-30 ms), and twice of it would fail
# whenever another process of a loaded 2-core CI box takes a time slice, or the flood's own
# processes (four senders, the backend reading 8 MiB bodies) do. Nor can one scan step be made
# shorter than msgspec's one C call over an 8 MiB body (~30 ms, gateway.jsonscan), which a request
# may meet at each of its two socket waits. With the floor the bar is 100 ms; a warm request queued
# behind the scans in flight (four bodies, ~0.25 s of CPU each: ~1 s), as before the loop's idle
# moments were taken in turns (gateway.routes._IdleTurns), fails it by far (p99 ~175-240 ms).
QUIET_FLOOR = 0.05
SAMPLES = 250  # per phase: p99 is the third slowest, not one hiccup
USER_PAUSE = 0.01  # between a user's requests: a user, not a load generator
USER_SOURCE = "127.0.3.1"
API_KEY = "sk-noctaya-p99-user-0123456789abcdef"
_BACKEND = """
import sys
from tests.gateway.fakebackend import FakeBackend
backend = FakeBackend(int(sys.argv[1]))
backend.refuse_over = int(sys.argv[2])
backend.start()
sys.stdin.read()  # until the test closes our stdin
backend.stop()
"""


class BackendProcess:
    """A FakeBackend in a process of its own: the hostile bodies it gets (a warm per-model gateway
    forwards them unscanned) are read there, off the test process's GIL, which times the user;
    bodies over 1 MiB are answered 400 unparsed (json.loads holds a GIL ~2 s per hostile body)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-c", _BACKEND, str(self.port), str(MiB)], cwd=ROOT,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.PIPE)
        wait_until(self._up, 20, "the backend process")

    def _up(self) -> bool:
        assert self.proc.poll() is None, f"the backend process exited {self.proc.returncode}"
        try:
            return get(self.port, "/health", timeout=1).status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


class KeyedUser:
    """An SDK-like client: its key, one keep-alive connection, a small warm chat completion at a time."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.raw = request_bytes("POST", "/v1/chat/completions", chat(),
                                 headers={"Authorization": f"Bearer {API_KEY}"})
        self.sock: socket.socket | None = None
        self.reader: Reader | None = None

    def ask(self) -> float:
        """Seconds from the request's first byte sent to its answer's last byte read."""
        if self.sock is None:
            self.sock = connect(self.port, USER_SOURCE, timeout=30)
            self.reader = Reader(self.sock)
        assert self.reader is not None
        started = time.monotonic()
        self.sock.sendall(self.raw)
        response = self.reader.response()
        took = time.monotonic() - started
        assert response is not None and response.status == 200, response
        if response.headers.get("connection", "").lower() == "close":
            self.close()
        return took

    def timed(self, n: int = SAMPLES) -> list[float]:
        out = []
        for _ in range(n):
            out.append(self.ask())
            time.sleep(USER_PAUSE)
        return out

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock = self.reader = None


class AdminTimer:
    """Times the kubelet's probe and KEDA's IsActive, one after the other every 50 ms, until stopped."""

    def __init__(self, pod: GatewayPod, stub: pb_grpc.ExternalScalerStub) -> None:
        self.pod, self.stub = pod, stub
        self.probes: list[float] = []
        self.scaler: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            assert get(self.pod.admin_port, "/healthz", timeout=10).status == 200
            self.probes.append(time.monotonic() - started)
            started = time.monotonic()
            self.stub.IsActive(self.pod.ref, timeout=10)
            self.scaler.append(time.monotonic() - started)
            self._stop.wait(0.05)

    def __enter__(self) -> AdminTimer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def p99(samples: list[float]) -> float:
    return sorted(samples)[int(0.99 * len(samples))]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


# Per gateway kind: what each attacker's hostile body gets. A per-model gateway with keys refuses a
# request without one before reading its body; a warm one forwards a keyed body unscanned (the scan
# is for bodies held while cold), so the backend refuses it. A shared gateway scans every body for
# its model; a caller without a key reaches that scan while some model of the table takes requests
# without one (OTHER_MODEL here).
FLOODS = {
    "per-model": {"keyed": {400}, "keyless": {401, 0}},
    "shared": {"keyed": {400}, "keyless": {400}},
}


def a_keyed_users_warm_p99_holds_under_a_hostile_json_flood(kind: str, tmp_path: Path) -> None:
    """Issue 29, Must show 1: a warm model, API keys on, one worker (which also serves KEDA). A keyed
    user's warm requests are timed quietly, then under a flood of 8 MiB hostile bodies from four
    addresses, first by holders of a valid key, then by callers without one; throughout each flood the
    kubelet's probe and KEDA's IsActive are timed. Each answers within 1 s, and the user's p99 stays
    within twice its quiet value (taken as at least QUIET_FLOOR)."""
    key_file = tmp_path / "api-key"
    key_file.write_text(API_KEY)
    backend = BackendProcess()
    pod = GatewayPod(backend.port, shared=kind == "shared", NOCTAYA_GATEWAY_WORKERS="1",
                     NOCTAYA_SCALER_MODE="local", NOCTAYA_AUTH_KEY_FILE=str(key_file),
                     NOCTAYA_CLIENT_REQUEST_TIMEOUT_SECONDS="60")
    hostile = hostile_body()
    floods = {
        "keyed": request_bytes("POST", "/v1/chat/completions", hostile, headers={"Authorization": f"Bearer {API_KEY}"}),
        "keyless": request_bytes("POST", "/v1/chat/completions", hostile),
    }
    user = KeyedUser(pod.port)
    channel = grpc.insecure_channel(f"127.0.0.1:{pod.scaler_port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=20)
        stub = pb_grpc.ExternalScalerStub(channel)
        user.timed(20)  # the model warms (the gateway learns its backend is up), connections pooled
        quiet = user.timed()
        bar = 2 * max(p99(quiet), QUIET_FLOOR)
        lines = [f"{kind} gateway: quiet p99 {ms(p99(quiet))} (median {ms(sorted(quiet)[len(quiet) // 2])}, "
                 f"{len(quiet)}); bar {ms(bar)}"]
        results = {}
        for i, (attacker, raw) in enumerate(floods.items()):
            with Flood(pod.port, raw, 1 + i * CLIENTS, clients=CLIENTS, bodies=None, timeout=60) as flood, \
                    AdminTimer(pod, stub) as admin:
                wait_until(lambda: len(flood.answers) >= CLIENTS, 30, "the first hostile bodies answered")
                loud = user.timed()
            assert set(flood.answers) <= FLOODS[kind][attacker], (attacker, sorted(set(flood.answers)))
            results[attacker] = loud, admin
            lines.append(f"  {attacker} flood ({len(flood.answers)} hostile bodies answered): p99 {ms(p99(loud))} "
                         f"(median {ms(sorted(loud)[len(loud) // 2])}, slowest {ms(max(loud))}, {len(loud)}); "
                         f"/healthz slowest {ms(max(admin.probes))} ({len(admin.probes)}); "
                         f"IsActive slowest {ms(max(admin.scaler))} ({len(admin.scaler)})")
        print("\n" + "\n".join(lines))
        for attacker, (loud, admin) in results.items():
            assert max(admin.probes) < KUBELET_TIMEOUT, (attacker, sorted(admin.probes)[-5:])
            assert max(admin.scaler) < KUBELET_TIMEOUT, (attacker, sorted(admin.scaler)[-5:])
            assert p99(loud) <= bar, (attacker, ms(p99(loud)), ms(bar), [ms(x) for x in sorted(loud)[-5:]])
    finally:
        user.close()
        channel.close()
        logs = pod.stop()
        backend.stop()
    assert "Traceback" not in logs


def main() -> int:
    """Each measurement in turn; its figures printed, its bars asserted (exit 1 when one is missed)."""
    import tempfile
    import traceback

    failed = 0
    runs = [("cold model, probes and IsActive", hostile_json_floods_cannot_delay_probes_or_the_scaler)]
    kinds = ["per-model", "shared"] if "--shared" in sys.argv else ["per-model"]
    for kind in kinds:
        def keyed(kind: str = kind) -> None:
            with tempfile.TemporaryDirectory() as tmp:
                a_keyed_users_warm_p99_holds_under_a_hostile_json_flood(kind, Path(tmp))
        runs.append((f"{kind} gateway, a keyed user's warm p99", keyed))
    for name, run in runs:
        print(f"== {name}", flush=True)
        try:
            run()
        except AssertionError:
            failed += 1
            print(f"bar missed: {name}\n{traceback.format_exc()}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
