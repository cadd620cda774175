"""`python -m hooks serve` over HTTPS as a real process (gunicorn, one worker), for the tests that
rotate its certificate and token files."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import requests

from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


class HookServerProcess:
    """Started with the certificate and key at the given paths; its output goes to ``log_file``."""

    def __init__(self, workdir: Path, cert: Path, key: Path, ca_file: Path, token: Path | None = None) -> None:
        self.port = free_port()
        self.log_file = workdir / "hooks.log"
        env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "PROMETHEUS_MULTIPROC_DIR": str(workdir / "prom")}
        if token is not None:
            env["NOCTAYA_HOOK_TOKEN_FILE"] = str(token)
        with open(self.log_file, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hooks", "serve", "--bind", f"127.0.0.1:{self.port}", "--workers", "1",
                 "--tls-cert-file", str(cert), "--tls-key-file", str(key)],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        self._wait_until_up(ca_file)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_file.read_text(errors="replace")

    def _wait_until_up(self, ca_file: Path) -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                requests.get(f"{self.url}/healthz", verify=str(ca_file), timeout=2)
                return
            except requests.RequestException:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"hook server did not start: {self.log()[-2000:]}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
