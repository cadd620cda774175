"""The in-process scaler of the gevent-patched gateway: a subprocess shaped like the gateway (gevent
pywsgi + start_scaler_server, grpc in gevent mode) and an ordinary grpc client here."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import requests

from scaler import externalscaler_pb2 as pb
from scaler import externalscaler_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
REF = pb.ScaledObjectRef(name="qwen", namespace="models", scalerMetadata={"scalerAddress": "x:9090"})


def _read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "gevent host did not start"
    return proc.stdout.readline()  # type: ignore[union-attr]


def _until(stream, value: bool) -> bool:
    return any(message.result is value for message in stream)


def test_scaler_inside_a_gevent_patched_process() -> None:
    env = {"PYTHONPATH": str(ROOT), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("_gevent_scaler_host.py"))],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = _read_line(proc, 30)
        assert line.startswith("PORTS "), line
        http_port, grpc_port = map(int, line.split()[1:])
        http = f"http://127.0.0.1:{http_port}"
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb_grpc.ExternalScalerStub(channel)
            streams = [stub.StreamIsActive(REF, timeout=60) for _ in range(128)]
            assert all(next(s).result is False for s in streams)
            # The gateway's own HTTP greenlets keep running while 128 streams wait in the same hub.
            assert requests.get(f"{http}/ping", timeout=10).text == "pong 128"
            t0 = time.monotonic()
            requests.post(f"{http}/publish?queued=1", timeout=10)
            assert all(next(s).result is True for s in streams)
            assert time.monotonic() - t0 < 5.0

            def unary(i: int) -> int:
                if i % 2:
                    return int(stub.IsActive(REF, timeout=30).result)
                return stub.GetMetrics(pb.GetMetricsRequest(metricName="noctaya-demand"), timeout=30).metricValues[0].metricValue

            with ThreadPoolExecutor(64) as pool:
                assert set(pool.map(unary, range(200))) == {1}
            requests.post(f"{http}/publish?lease=1", timeout=10)  # flag stays true: no push
            requests.post(f"{http}/publish", timeout=10)
            # re-sent trues (soon after an activation) may come first; then the flip
            assert all(_until(s, False) for s in streams)
            requests.post(f"{http}/stop", timeout=10)
            for s in streams:
                assert list(s) == []
                assert s.code() == grpc.StatusCode.OK
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]
