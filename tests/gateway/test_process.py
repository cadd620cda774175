"""`python -m gateway` as a real process: the in-process gRPC scaler (NOCTAYA_SCALER_MODE=local)
pushes demand over a real StreamIsActive stream, and SIGTERM drains."""

from __future__ import annotations

import json
import os
import queue
import shutil
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
from tests.gateway.fakebackend import FakeBackend
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "user", "content": "hi"}]
DRAIN_DELAY = 3.0  # NOCTAYA_DRAIN_DELAY_SECONDS in the drain tests
REF = pb.ScaledObjectRef(name="qwen", namespace="models", scalerMetadata={"scalerAddress": "x:9090"})


class GatewayProcess:
    def __init__(self, backend: FakeBackend, **env: str) -> None:
        self.port = free_port()
        self.scaler_port = free_port()
        self.admin_port = free_port()
        full_env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "NOCTAYA_BACKEND_URL": backend.url,
            "NOCTAYA_SERVED_MODEL_NAME": "test-model",
            "NOCTAYA_LISTEN_HOST": "127.0.0.1",
            "NOCTAYA_LISTEN_PORT": str(self.port),
            "NOCTAYA_ADMIN_PORT": str(self.admin_port),
            "NOCTAYA_SCALER_MODE": "local",
            "NOCTAYA_SCALER_PORT": str(self.scaler_port),
            "NOCTAYA_PROBE_INTERVAL_SECONDS": "0.05",
            "NOCTAYA_READY_GRACE_SECONDS": "0.5",
            "NOCTAYA_ACTIVATION_TIMEOUT_SECONDS": "20",
            **env,
        }
        self.proc = subprocess.Popen([sys.executable, "-m", "gateway"], cwd=ROOT, env=full_env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_url = f"http://127.0.0.1:{self.admin_port}"
        wait_for(self._up, timeout=30, interval=0.05, what="gateway process listening")

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"gateway exited: {self.proc.stdout.read().decode()}")
        try:
            return requests.get(self.url + "/healthz", timeout=1).status_code == 200
        except requests.RequestException:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def read_stream(stub: pb_grpc.ExternalScalerStub, out: queue.Queue) -> threading.Thread:
    def run() -> None:
        try:
            for msg in stub.StreamIsActive(REF):
                out.put((time.monotonic(), msg.result))
            out.put(("end", grpc.StatusCode.OK))
        except grpc.RpcError as exc:
            out.put(("end", exc.code()))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def next_value(q: queue.Queue, timeout: float = 10.0):
    return q.get(timeout=timeout)


def child_pids(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


# One worker: the whole Pod is one process, KEDA served over h2 on its loop (scaler.h2server). Two: a
# supervisor, its workers and the grpcio scaler child (gateway.scaler_process). KEDA sees the same.
PROCESS_MODELS = pytest.mark.parametrize("workers,children", [("1", 0), ("2", 3)], ids=["one-process", "supervisor"])


@PROCESS_MODELS
def test_cold_request_pushes_true_on_the_real_stream(backend, channel_factory, workers, children) -> None:
    gw = GatewayProcess(backend, NOCTAYA_SCALING_TARGET="4", NOCTAYA_GATEWAY_WORKERS=workers)
    try:
        wait_for(lambda: len(child_pids(gw.proc.pid)) == children, timeout=20, what=f"{children} child processes")
        stub = pb_grpc.ExternalScalerStub(channel_factory(gw.scaler_port))
        assert stub.IsActive(REF, timeout=5).result is False
        spec = stub.GetMetricSpec(REF, timeout=5).metricSpecs[0]
        assert spec.metricName == "noctaya-demand" and spec.targetSize == 4
        pushes: queue.Queue = queue.Queue()
        read_stream(stub, pushes)
        assert next_value(pushes)[1] is False  # current state on open
        sent_at = time.monotonic()
        t = threading.Thread(target=lambda: requests.post(
            gw.url + "/v1/chat/completions", json={"model": "m", "messages": MESSAGES}, timeout=60), daemon=True)
        t.start()
        at, value = next_value(pushes)
        assert value is True and at - sent_at < 5.0  # latency itself is measured in bench/
        assert stub.IsActive(REF, timeout=5).result is True
        metric = stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=REF, metricName="noctaya-demand"), timeout=5)
        assert metric.metricValues[0].metricValue == 1
        backend.start()
        t.join(30)
        wait_for(lambda: stub.IsActive(REF, timeout=5).result is False, timeout=20, what="inactive after grace")
    finally:
        gw.stop()


@PROCESS_MODELS
def test_sigterm_drains(backend, channel_factory, workers, children) -> None:
    backend.tokens = 15
    backend.stream_delay = 0.3  # the stream outlasts the drain delay: the gateway is still there after it
    backend.start()
    gw = GatewayProcess(backend, NOCTAYA_DRAIN_GRACE_SECONDS="20", NOCTAYA_DRAIN_DELAY_SECONDS=str(DRAIN_DELAY),
                        NOCTAYA_GATEWAY_WORKERS=workers)
    try:
        stub = pb_grpc.ExternalScalerStub(channel_factory(gw.scaler_port))
        pushes: queue.Queue = queue.Queue()
        stream_thread = read_stream(stub, pushes)
        next_value(pushes)
        chunks: list[bytes] = []

        def long_request() -> None:
            with requests.post(gw.url + "/v1/chat/completions", timeout=60, stream=True,
                               json={"model": "m", "messages": MESSAGES, "stream": True}) as resp:
                for chunk in resp.iter_content(None):
                    chunks.append(chunk)

        t = threading.Thread(target=long_request, daemon=True)
        t.start()
        wait_for(lambda: chunks, timeout=20, what="stream started")
        gw.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()

        def public(call):
            # With several workers, one that has nothing left to drain closes its SO_REUSEPORT listener at
            # once, and a connection the kernel had already queued there is reset; the next one reaches a
            # worker still draining. One process has one listener, open until its drain ends: no retry.
            for attempt in range(20):
                try:
                    return call()
                except requests.ConnectionError:
                    if workers == "1" or attempt == 19:
                        raise
                    time.sleep(0.1)

        wait_for(lambda: public(lambda: requests.get(gw.url + "/healthz", timeout=2)).status_code == 503,
                 what="not ready")
        # Not ready, yet still serving for the drain delay: a connection a stale kube-proxy sends here
        # is answered (and closed, so the client's next one goes elsewhere).
        resp = public(lambda: requests.post(gw.url + "/v1/chat/completions",
                                            json={"model": "m", "messages": MESSAGES}, timeout=5))
        assert time.monotonic() - signalled < DRAIN_DELAY, "the test was too slow to ask within the delay"
        assert resp.status_code == 200 and resp.headers["Connection"] == "close", resp.text
        # After the delay: refused, retryably (the openai SDK retries it on a new connection).
        resp = public(lambda: requests.post(gw.url + "/v1/chat/completions",
                                            json={"model": "m", "messages": MESSAGES}, timeout=5))
        while resp.status_code == 200 and time.monotonic() - signalled < DRAIN_DELAY + 5:
            time.sleep(0.1)
            resp = public(lambda: requests.post(gw.url + "/v1/chat/completions",
                                                json={"model": "m", "messages": MESSAGES}, timeout=5))
        assert time.monotonic() - signalled >= DRAIN_DELAY
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "gateway_draining"
        assert "x-should-retry" not in resp.headers and resp.headers["Connection"] == "close"
        assert stub.IsActive(REF, timeout=5).result is True  # in-flight work still counts as demand
        t.join(30)
        body = b"".join(chunks)
        assert body.count(b"data: {") == 15 and b"data: [DONE]" in body  # finished within the grace
        assert gw.proc.wait(20) == 0
        stream_thread.join(10)
        events = []
        while not pushes.empty():
            events.append(pushes.get())
        assert events[-1] == ("end", grpc.StatusCode.OK)  # KEDA resets its backoff only on OK
        logs = gw.proc.stdout.read().decode()
        lines = [json.loads(line) for line in logs.splitlines() if line.startswith("{")]
        assert any(line["msg"] == "drained" for line in lines)
    finally:
        gw.stop()


def test_help_and_config_errors() -> None:
    out = subprocess.run([sys.executable, "-m", "gateway", "--help"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert out.returncode == 0 and "NOCTAYA_MAX_QUEUE" in out.stdout
    env = {k: v for k, v in os.environ.items() if not k.startswith("NOCTAYA_")}
    out = subprocess.run([sys.executable, "-m", "gateway"], cwd=ROOT, capture_output=True, text=True,
                         env={**env, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert out.returncode == 2 and "NOCTAYA_BACKEND_URL" in out.stderr


class _Aggregator:
    """Records demand reports like the aggregate scaler's /v1/report would receive them."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        reports: list[tuple[str, dict]] = []
        self.reports = reports

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                reports.append((self.headers.get("Authorization", ""), json.loads(body)))
                out = b'{"outcome":"accepted","members":1}'
                self.send_response(200)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1/report"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_report_mode_pushes_demand_and_withdraws_on_sigterm(backend, tmp_path) -> None:
    aggregator = _Aggregator()
    token = tmp_path / "token"
    token.write_text("member-token\n")
    gw = GatewayProcess(backend, NOCTAYA_SCALER_MODE="report", NOCTAYA_AGGREGATOR_URL=aggregator.url,
                        NOCTAYA_AGGREGATOR_TOKEN_FILE=str(token), NOCTAYA_DRAIN_GRACE_SECONDS="5")
    try:
        wait_for(lambda: aggregator.reports, what="first report")
        t = threading.Thread(target=lambda: requests.post(
            gw.url + "/v1/chat/completions", json={"model": "m", "messages": MESSAGES}, timeout=60), daemon=True)
        t.start()
        wait_for(lambda: any(r["queued"] == 1 and r["leaseActive"] for _, r in aggregator.reports),
                 what="cold demand reported")
        backend.start()
        t.join(30)
        gw.proc.send_signal(signal.SIGTERM)
        assert gw.proc.wait(20) == 0
        auth, last = aggregator.reports[-1]
        assert last["withdraw"] is True and auth == "Bearer member-token"
        seqs = [r["seq"] for _, r in aggregator.reports]
        assert seqs == sorted(seqs) and len({r["member"] for _, r in aggregator.reports}) == 1
    finally:
        gw.stop()
        aggregator.stop()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_report_mode_over_tls_reaches_a_real_aggregator(backend, tmp_path) -> None:
    """The gevent-patched gateway verifies the aggregator with the CA file and reports over HTTPS."""
    from scaler.aggregator import Aggregator, AggregatorSettings
    from scaler.demand import DemandBroadcaster
    from scaler.tls import TLSFiles
    from tests.pki import make_ca, make_leaf

    make_ca(tmp_path, "ca")
    cert, key = make_leaf(tmp_path, "server", "ca")
    token = tmp_path / "token"
    token.write_text("member-token\n")
    aggregator = Aggregator(AggregatorSettings(token_file=str(token)), DemandBroadcaster())
    aggregator.start("127.0.0.1", 0, tls=TLSFiles(str(cert), str(key), str(tmp_path / "ca.crt")))
    gw = GatewayProcess(backend, NOCTAYA_SCALER_MODE="report",
                        NOCTAYA_AGGREGATOR_URL=f"https://localhost:{aggregator.port}/v1/report",
                        NOCTAYA_AGGREGATOR_CA_FILE=str(tmp_path / "ca.crt"),
                        NOCTAYA_AGGREGATOR_TOKEN_FILE=str(token), NOCTAYA_DRAIN_GRACE_SECONDS="5")
    try:
        wait_for(lambda: aggregator.member_count == 1, what="membership over TLS")
        t = threading.Thread(target=lambda: requests.post(
            gw.url + "/v1/chat/completions", json={"model": "m", "messages": MESSAGES}, timeout=60), daemon=True)
        t.start()
        wait_for(lambda: aggregator.broadcaster.current().queued == 1, what="cold demand reported over TLS")
        backend.start()
        t.join(30)
        gw.proc.send_signal(signal.SIGTERM)
        assert gw.proc.wait(20) == 0
        assert aggregator.member_count == 0  # withdrawn over TLS on the way out
    finally:
        gw.stop()
        aggregator.stop()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
@PROCESS_MODELS
def test_the_admin_metrics_show_the_expiry_of_the_scaler_certificate_served(backend, tmp_path, workers,
                                                                              children) -> None:
    """With scaler TLS, /metrics says until when the ExternalScaler's certificate is valid: on one
    process, the h2 server's own; with workers, the one the grpcio child loaded, sent up its pipe. A
    renewal the kubelet swaps in is served to KEDA's next connection and shown, without a restart."""
    from tests.pki import SecretVolume, certificate_dates, expiry_gauges, make_ca, make_leaf, presented_certificate

    make_ca(tmp_path, "ca")
    make_leaf(tmp_path, "first", "ca", days=2)
    make_leaf(tmp_path, "renewed", "ca", days=3)
    keda = make_leaf(tmp_path, "keda", "ca", usage="clientAuth")
    secret = SecretVolume(tmp_path / "secret", {"tls.crt": tmp_path / "first.crt", "tls.key": tmp_path / "first.key",
                                                "ca.crt": tmp_path / "ca.crt"})
    gw = GatewayProcess(backend, NOCTAYA_GATEWAY_WORKERS=workers, NOCTAYA_SCALER_TLS_CERT_FILE=str(secret / "tls.crt"),
                        NOCTAYA_SCALER_TLS_KEY_FILE=str(secret / "tls.key"),
                        NOCTAYA_SCALER_TLS_CA_FILE=str(secret / "ca.crt"))

    def gauges() -> dict[str, float]:
        return expiry_gauges(requests.get(gw.admin_url + "/metrics", timeout=5).text)

    def presented() -> tuple[int, float]:
        return presented_certificate(gw.scaler_port, tmp_path / "ca.crt", client=keda, alpn=["h2"])

    first = certificate_dates((tmp_path / "first.crt").read_bytes())
    renewed = certificate_dates((tmp_path / "renewed.crt").read_bytes())
    try:
        wait_for(lambda: len(child_pids(gw.proc.pid)) == children, timeout=20, what=f"{children} child processes")
        wait_for(lambda: port_open(gw.scaler_port), timeout=20, what="the scaler listening")
        assert presented() == first
        wait_for(lambda: gauges() == {"scaler": first[1]}, timeout=10, what="the expiry on /metrics")
        secret.write({"tls.crt": tmp_path / "renewed.crt", "tls.key": tmp_path / "renewed.key",
                      "ca.crt": tmp_path / "ca.crt"})
        assert presented() == renewed  # KEDA's next connection
        # At once on one process; the child's line crosses a pipe to the supervisor first.
        wait_for(lambda: gauges() == {"scaler": renewed[1]}, timeout=10, what="the renewed expiry on /metrics")
    finally:
        gw.stop()


def port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def scaler_children(gateway_pid: int) -> list[int]:
    """PIDs of `python -m scaler local` processes whose parent is the gateway."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == gateway_pid and b"scaler" in cmdline and b"local" in cmdline:
            pids.append(int(entry))
    return pids


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def test_scaler_child_is_restarted_and_learns_the_current_demand(backend) -> None:
    gw = GatewayProcess(backend, NOCTAYA_GATEWAY_WORKERS="2")  # a supervisor runs the scaler as a child
    try:
        wait_for(lambda: len(scaler_children(gw.proc.pid)) == 1, timeout=20, what="scaler child started")
        (first,) = scaler_children(gw.proc.pid)
        # A cold request (the backend never becomes ready here) holds demand in the gateway.
        def held_request() -> None:
            try:
                requests.post(gw.url + "/v1/chat/completions", json={"model": "m", "messages": MESSAGES}, timeout=60)
            except requests.RequestException:
                pass  # the gateway is killed at the end of the test while this is still held

        threading.Thread(target=held_request, daemon=True).start()
        wait_for(lambda: requests.get(gw.admin_url + "/noctaya/queue", timeout=2).json()["queued"] == 1,
                 timeout=10, what="request queued")
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: [p for p in scaler_children(gw.proc.pid) if p != first and pid_alive(p)],
                 timeout=20, what="a new scaler child")

        def active_on_new_child() -> bool:
            with grpc.insecure_channel(f"127.0.0.1:{gw.scaler_port}") as ch:
                try:
                    return pb_grpc.ExternalScalerStub(ch).IsActive(REF, timeout=1).result
                except grpc.RpcError:
                    return False

        wait_for(active_on_new_child, timeout=20, what="restarted scaler reports the held demand")
    finally:
        gw.stop()


def test_scaler_child_never_outlives_a_killed_gateway(backend) -> None:
    gw = GatewayProcess(backend, NOCTAYA_GATEWAY_WORKERS="2")  # a supervisor runs the scaler as a child
    wait_for(lambda: len(scaler_children(gw.proc.pid)) == 1, timeout=20, what="scaler child started")
    (child,) = scaler_children(gw.proc.pid)
    gw.proc.kill()  # SIGKILL: no drain, no cleanup code runs in the gateway
    gw.proc.wait(10)
    wait_for(lambda: not pid_alive(child), timeout=20, what="scaler child exits when its pipe closes")


def test_cold_waiters_get_a_bounded_error_when_the_drain_grace_ends(backend) -> None:
    """Backend never started: after SIGTERM, a held request gets 503 JSON once the drain refuses (at
    the drain delay), and an open keepalive stream, after the drain grace, an SSE error event the
    openai client raises: never a cut connection."""
    import openai

    gw = GatewayProcess(backend, NOCTAYA_DRAIN_GRACE_SECONDS="1.5", NOCTAYA_HEARTBEAT_SECONDS="0.5")
    try:
        results: dict[str, object] = {}

        def held() -> None:
            resp = requests.post(gw.url + "/v1/chat/completions", json={"model": "m", "messages": MESSAGES}, timeout=30)
            results["held"] = (resp.status_code, resp.headers.get("Content-Type"), resp.json())

        def streamed() -> None:
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=30)
            try:
                for _ in client.chat.completions.create(model="m", messages=MESSAGES, stream=True):
                    pass
                results["stream"] = "ended without error"
            except openai.APIError as exc:
                results["stream"] = str(exc)

        threads = [threading.Thread(target=f, daemon=True) for f in (held, streamed)]
        for t in threads:
            t.start()
        wait_for(lambda: requests.get(gw.admin_url + "/noctaya/queue", timeout=2).json()["queued"] == 2,
                 timeout=15, what="two cold waiters")
        gw.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(20)
        status, ctype, body = results["held"]
        assert status == 503 and ctype.startswith("application/json")
        assert body["error"]["code"] == "gateway_draining"
        assert "shutting down" in str(results["stream"])
        assert gw.proc.wait(20) == 0
    finally:
        gw.stop()
