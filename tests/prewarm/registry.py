"""A real OCI registry on 127.0.0.1 for the tests: Debian's `docker-registry` (the CNCF Distribution
registry), installed when missing (root and apt-get) by the set-up step before pytest starts
(tests/setup.py, `make test`), skipped with the reason where it cannot be had."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.ports import free_port

BINARY = "docker-registry"


class RegistryUnavailable(Exception):
    """docker-registry cannot be had here; the message is the skip reason."""


class RegistryInstallFailed(RegistryUnavailable):
    """apt-get was there and allowed but the install failed (the tests skip with it; the set-up step,
    tests/setup.py, fails on it)."""


def install_registry_binary() -> str:
    """docker-registry's path, installed with apt-get when missing (root only). Raises RegistryUnavailable."""
    found = shutil.which(BINARY)
    if found:
        return found
    if os.environ.get("NOCTAYA_SKIP_INSTALL") == "1":
        raise RegistryUnavailable("docker-registry is not installed and NOCTAYA_SKIP_INSTALL=1")
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise RegistryUnavailable("docker-registry is not installed (apt-get install docker-registry), and this user cannot install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    done = subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", BINARY], env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        update = subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, text=True, timeout=600)
        done = subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", BINARY], env=env,
                              capture_output=True, text=True, timeout=600) if update.returncode == 0 else update
    found = shutil.which(BINARY)
    if not found:
        raise RegistryInstallFailed(f"docker-registry could not be installed: {done.stderr.strip()[-300:]}")
    return found


def ensure_registry_binary() -> str:
    """docker-registry's path (installed before pytest by tests/setup.py); skips with the reason."""
    try:
        return install_registry_binary()
    except RegistryUnavailable as exc:
        pytest.skip(str(exc))



@contextlib.contextmanager
def running_registry(root: Path, auth: str = "") -> Iterator[str]:
    """host:port of a docker-registry serving plain HTTP from ``root``, with ``auth`` (a YAML
    ``auth:`` block, e.g. htpasswd or token) when given; stopped on exit."""
    binary = ensure_registry_binary()
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
{auth}""")
    log = open(root / "registry.log", "wb")
    proc = subprocess.Popen([binary, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if requests.get(f"http://{address}/v2/", timeout=2).status_code in (200, 401):
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


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """host:port of a running registry (plain HTTP, no auth)."""
    with running_registry(tmp_path_factory.mktemp("registry")) as address:
        yield address
