"""A real OCI registry on 127.0.0.1 for the tests: Debian's `docker-registry` (the CNCF Distribution
registry), installed by the test setup when missing (root and apt-get), skipped with the reason where
it cannot be had."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

BINARY = "docker-registry"


def ensure_registry_binary() -> str:
    found = shutil.which(BINARY)
    if found:
        return found
    if os.environ.get("NOCTAYA_SKIP_INSTALL") == "1":
        pytest.skip("docker-registry is not installed and NOCTAYA_SKIP_INSTALL=1")
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("docker-registry is not installed (apt-get install docker-registry), and this user cannot install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    done = subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", BINARY], env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        update = subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, text=True, timeout=600)
        done = subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", BINARY], env=env,
                              capture_output=True, text=True, timeout=600) if update.returncode == 0 else update
    found = shutil.which(BINARY)
    if not found:
        pytest.skip(f"docker-registry could not be installed: {done.stderr.strip()[-300:]}")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """host:port of a running registry (plain HTTP, no auth)."""
    binary = ensure_registry_binary()
    root = tmp_path_factory.mktemp("registry")
    port = free_port()
    config = root / "config.yml"
    config.write_text(f"""version: 0.1
log:
  level: error
storage:
  filesystem:
    rootdirectory: {root / 'data'}
http:
  addr: 127.0.0.1:{port}
""")
    log = open(root / "registry.log", "wb")
    proc = subprocess.Popen([binary, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if requests.get(f"http://{address}/v2/", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"docker-registry did not start: {Path(root / 'registry.log').read_text()[-500:]}")
            time.sleep(0.1)
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
