"""The test API server harness itself: it survives a port stolen between probe and bind, requires
its token, and leaves nothing behind."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.kube import apiserver
from tests.kube.apiserver import ControlPlane, KubeUnavailable, ensure_binaries

pytestmark = pytest.mark.timeout(240, func_only=True)


@pytest.fixture(scope="module")
def bin_dir() -> Path:
    try:
        return ensure_binaries()
    except KubeUnavailable as exc:
        pytest.skip(str(exc))


def test_start_retries_when_a_probed_port_is_taken(bin_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        # The first port handed out (etcd's client port) is already bound by someone else.
        ports: Iterator[int] = iter([taken])
        real_free_port = apiserver.free_port
        monkeypatch.setattr(apiserver, "free_port", lambda: next(ports, None) or real_free_port())
        attempts: list[int] = []
        real_start = ControlPlane._start

        def counting_start(self: ControlPlane, pki: Path) -> None:
            attempts.append(1)
            real_start(self, pki)

        monkeypatch.setattr(ControlPlane, "_start", counting_start)

        plane = ControlPlane(bin_dir)
        plane.start()
        try:
            assert len(attempts) == 2, "etcd should have failed on the taken port, then started on a new one"
            assert plane.kubectl("get", "--raw", "/readyz").stdout.strip() == "ok"
            # The API server rejects requests without the generated token (anonymous auth is off).
            anonymous = requests.get(f"{plane.url}/api", verify=str(plane.ca_file), timeout=10)
            assert anonymous.status_code == 401
            procs = [proc for _, proc in plane._procs]
            assert len(procs) == 2
        finally:
            plane.stop()
    assert not plane.workdir.exists()
    assert all(proc.poll() is not None for proc in procs)
