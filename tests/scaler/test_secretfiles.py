"""A Pod whose optional Secret volume came up empty says which Secret is missing, in its termination
message, and the hooks read that name back from the container status (they never read Secrets)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hooks.controller.status import pod_secrets_missing
from scaler.secretfiles import EXIT_SECRET_MISSING

ROOT = Path(__file__).resolve().parents[2]


def run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env={"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), **env},
                          capture_output=True, text=True, timeout=60)


def as_pod(message: str) -> dict:
    return {"metadata": {"name": "p"}, "status": {"containerStatuses": [
        {"name": "gateway", "state": {"waiting": {"reason": "CrashLoopBackOff"}},
         "lastState": {"terminated": {"exitCode": EXIT_SECRET_MISSING, "reason": "Error", "message": message}}}]}}


@pytest.mark.parametrize(("argv", "env", "secret"), [
    (["-m", "gateway"], {"NOCTAYA_BACKEND_URL": "http://127.0.0.1:1", "NOCTAYA_SERVED_MODEL_NAME": "m",
                         "NOCTAYA_AUTH_SECRET": "phi-api-key", "NOCTAYA_AUTH_KEY_FILE": "/nonexistent/api-key"},
     "phi-api-key"),
    (["-m", "scaler", "aggregate"], {"NOCTAYA_AGGREGATOR_TOKEN_FILE": "/nonexistent/token",
                                     "NOCTAYA_SCALER_TLS_SECRET": "qwen-scaler-tls",
                                     "NOCTAYA_SCALER_TLS_CERT_FILE": "/nonexistent/tls.crt",
                                     "NOCTAYA_SCALER_TLS_KEY_FILE": "/nonexistent/tls.key",
                                     "NOCTAYA_SCALER_TLS_CA_FILE": "/nonexistent/ca.crt"}, "qwen-scaler-tls"),
    # A reporting gateway mounts only the CA of the scaler TLS Secret.
    (["-m", "gateway"], {"NOCTAYA_BACKEND_URL": "http://127.0.0.1:1", "NOCTAYA_SERVED_MODEL_NAME": "m",
                         "NOCTAYA_SCALER_MODE": "report", "NOCTAYA_AGGREGATOR_URL": "https://s:9091/v1/report",
                         "NOCTAYA_AGGREGATOR_TOKEN_FILE": "/nonexistent/token",
                         "NOCTAYA_SCALER_TLS_SECRET": "qwen-scaler-tls",
                         "NOCTAYA_AGGREGATOR_CA_FILE": "/nonexistent/ca.crt"}, "qwen-scaler-tls"),
])
def test_missing_secret_files_end_the_program_with_a_message_naming_the_secret(
        tmp_path: Path, argv: list[str], env: dict[str, str], secret: str) -> None:
    log = tmp_path / "termination-log"
    out = run(argv, {**env, "NOCTAYA_TERMINATION_LOG": str(log)})
    assert out.returncode == EXIT_SECRET_MISSING, out.stderr
    message = log.read_text()
    assert f'Secret "{secret}" not found' in message and secret in out.stderr
    assert pod_secrets_missing([as_pod(message)]) == {secret}  # what the hooks make of it


def test_present_files_start_normally(tmp_path: Path) -> None:
    key = tmp_path / "api-key"
    key.write_text("k")
    log = tmp_path / "termination-log"
    # --help exits 0 after the check: the check passed and nothing was written.
    out = run(["-m", "gateway", "--help"], {"NOCTAYA_AUTH_SECRET": "phi-api-key", "NOCTAYA_AUTH_KEY_FILE": str(key),
                                           "NOCTAYA_TERMINATION_LOG": str(log)})
    assert out.returncode == 0 and not log.exists(), out.stderr
