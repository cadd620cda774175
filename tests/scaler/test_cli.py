"""`python -m scaler` as a real process: the aggregate scaler end to end, and its clean SIGTERM."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import requests

from scaler import externalscaler_pb2 as pb
from scaler import externalscaler_pb2_grpc as pb_grpc
from tests.stderr_lines import StderrLines

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    return {"PYTHONPATH": str(ROOT), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), **extra}


def test_help() -> None:
    for args in ([], ["aggregate"]):
        proc = subprocess.run([sys.executable, "-m", "scaler", *args, "--help"], cwd=ROOT, env=_env(),
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and "usage: python -m scaler" in proc.stdout


def test_aggregate_refuses_to_start_without_a_token_file() -> None:
    proc = subprocess.run([sys.executable, "-m", "scaler", "aggregate", "--report-port", "0", "--scaler-port", "0"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "token file" in proc.stderr


def test_aggregate_end_to_end_and_sigterm(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("cli-token")
    proc = subprocess.Popen(
        [sys.executable, "-m", "scaler", "aggregate", "--host", "127.0.0.1", "--report-port", "0",
         "--scaler-port", "0", "--drain-grace-seconds", "5"],
        cwd=ROOT, env=_env(NOCTAYA_AGGREGATOR_TOKEN_FILE=str(token), NOCTAYA_METRIC_NAME="qwen-demand",
                           NOCTAYA_SCALING_TARGET="4"),
        stderr=subprocess.PIPE, text=True,
    )
    try:
        lines = StderrLines(proc)
        deadline, ports = time.monotonic() + 30, None
        while ports is None and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                continue
            match = re.search(r"reports on [\d.]+:(\d+), gRPC on [\d.]+:(\d+)", line)
            ports = match and tuple(map(int, match.groups()))
        assert ports, "aggregate scaler did not start"
        report_port, grpc_port = ports
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb_grpc.ExternalScalerStub(channel)
            (spec,) = stub.GetMetricSpec(pb.ScaledObjectRef(), timeout=10).metricSpecs
            assert (spec.metricName, spec.targetSize) == ("qwen-demand", 4)
            stream = stub.StreamIsActive(pb.ScaledObjectRef(), timeout=60)
            assert next(stream).result is False
            r = requests.post(f"http://127.0.0.1:{report_port}/v1/report", timeout=10,
                              headers={"Authorization": "Bearer cli-token"},
                              json={"member": "g1", "seq": 1, "queued": 3})
            assert r.status_code == 200
            assert next(stream).result is True
            metrics = requests.get(f"http://127.0.0.1:{report_port}/metrics", timeout=10).text
            assert "noctaya_scaler_streams_open 1.0" in metrics and "noctaya_aggregator_queued 3.0" in metrics
            assert "cli-token" not in metrics
            assert stub.GetMetrics(pb.GetMetricsRequest(metricName="qwen-demand"), timeout=10).metricValues[0].metricValue == 3
            proc.send_signal(signal.SIGTERM)
            assert list(stream) == [] and stream.code() == grpc.StatusCode.OK
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        lines.close()


def test_aggregate_reports_a_port_in_use(tmp_path: Path) -> None:
    import socket

    token = tmp_path / "token"
    token.write_text("t")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "scaler", "aggregate", "--host", "127.0.0.1", "--report-port", str(port),
             "--scaler-port", "0", "--aggregator-token-file", str(token)],
            cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60,
        )
    assert proc.returncode == 1 and "cannot listen for reports" in proc.stderr
