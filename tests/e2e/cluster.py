"""Real Metacontroller and Noctaya's hook server against the test API server, on 127.0.0.1.

Metacontroller is built from the source tarball in ``../shared/third_party/metacontroller`` (no Go
module serves it) into a cache directory outside the repository, and runs out of cluster as the
ServiceAccount ``metacontroller/metacontroller`` with only the RBAC of ``metacontroller/rbac.yaml``
(a token from the TokenRequest API, not the admin token), so a missing permission shows.

The controllers call the hooks at ``noctaya-hooks.noctaya-system.svc:8080`` exactly as installed.
That name resolves to a private loopback address (127.77.x.y) only inside Metacontroller's own mount
namespace, where a generated hosts file is bind-mounted over /etc/hosts (``unshare -m``): the
machine's /etc/hosts is never touched, and the mount ends with the process. The hook server
listens on that address, so port 8080 is free whatever else runs on the machine.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from tests.kube.apiserver import REPO_ROOT, ControlPlane, KubeUnavailable, cache_dir
from tests.third_party import SHARED_THIRD_PARTY, ThirdPartyUnavailable, go_build_cached

HOOK_HOST = "noctaya-hooks.noctaya-system.svc"
HOOK_PORT = 8080
METACONTROLLER_TARBALL_GLOB = "metacontroller-src-*.tar.gz"


def metacontroller_binary() -> Path:
    """Build (once, cached) and return Metacontroller. Raises KubeUnavailable with the reason."""
    tarballs = sorted((SHARED_THIRD_PARTY / "metacontroller").glob(METACONTROLLER_TARBALL_GLOB))
    if not tarballs:
        raise KubeUnavailable(f"Metacontroller's source is not in {SHARED_THIRD_PARTY / 'metacontroller'} (no Go module "
                              "serves it; a copy of shared/ beside the clone provides it)")
    tarball = tarballs[-1]
    version = tarball.name.removeprefix("metacontroller-src-").removesuffix(".tar.gz")
    root = cache_dir().parent / f"metacontroller-{version}"
    binary = root / "bin" / "metacontroller"
    if binary.exists():
        return binary
    src = root / "src"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    with tarfile.open(tarball) as tar:
        tar.extractall(src, filter="data")
    (module,) = [p.parent for p in src.glob("*/go.mod")]
    try:
        return go_build_cached(binary, module, [], "./pkg/cmd/metacontroller")
    except ThirdPartyUnavailable as exc:
        raise KubeUnavailable(f"Metacontroller {version}: {exc}") from None


def private_loopback_address() -> str:
    """A loopback address nobody else uses, with HOOK_PORT free on it."""
    for _ in range(50):
        address = f"127.77.{random.randint(1, 254)}.{random.randint(1, 254)}"
        with socket.socket() as probe:
            try:
                probe.bind((address, HOOK_PORT))
            except OSError:
                continue
        return address
    raise KubeUnavailable("no free private loopback address for the hook server")


@dataclass
class Timeline:
    """What a lifecycle test saw, in order; printed when it fails (the output alone must explain it)."""

    start: float = field(default_factory=time.monotonic)
    lines: list[str] = field(default_factory=list)

    def note(self, what: str) -> None:
        self.lines.append(f"[{time.monotonic() - self.start:7.2f}s] {what}")

    def text(self) -> str:
        return "\n".join(self.lines)


class Cluster:
    """API server + installed Noctaya + hook server + Metacontroller; ``kubectl`` and ``get`` helpers."""

    def __init__(self, plane: ControlPlane, metacontroller: Path) -> None:
        self.plane = plane
        self.metacontroller = metacontroller
        self.workdir = plane.workdir / "e2e"
        self.workdir.mkdir()
        self.address = private_loopback_address()
        self.hook_token = os.urandom(24).hex()
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    # --- processes ------------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        with open(self.workdir / f"{name}.log", "wb") as log:
            self._procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                                 env=env, start_new_session=True)

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.workdir / f"{name}.log"
        if not path.exists():
            return ""
        # Metacontroller logs JSON with Go stack traces: the message is in the first few hundred bytes.
        return "\n".join(line[:400] for line in path.read_text(errors="replace").splitlines()[-lines:])

    def start_hook_server(self) -> None:
        token_file = self.workdir / "hook-token"
        token_file.write_text(self.hook_token)
        key_file = self.workdir / "token-key"
        key_file.write_text(os.urandom(32).hex())
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "NOCTAYA_HOOK_TOKEN_FILE": str(token_file),
               "NOCTAYA_TOKEN_KEY_FILE": str(key_file), "PROMETHEUS_MULTIPROC_DIR": str(self.workdir / "prom")}
        (self.workdir / "prom").mkdir()
        self._spawn("hooks", [sys.executable, "-m", "hooks", "serve", "--bind", f"{self.address}:{HOOK_PORT}",
                              "--workers", "1"], env)
        self._wait(lambda: requests.get(f"{self.hook_url}/healthz", timeout=2).ok, "hook server", "hooks")

    @property
    def hook_url(self) -> str:
        return f"http://{self.address}:{HOOK_PORT}"

    def start_metacontroller(self) -> None:
        """As the ServiceAccount the install binds its RBAC to, in a mount namespace of its own."""
        self.kubectl("create", "namespace", "metacontroller")
        self.kubectl("-n", "metacontroller", "create", "serviceaccount", "metacontroller")
        self.kubectl("apply", "--server-side", "-f", str(Path(__file__).with_name("metacontroller-own-rbac.yaml")))
        token = self.kubectl("-n", "metacontroller", "create", "token", "metacontroller", "--duration=6h").stdout.strip()
        kubeconfig = self.workdir / "metacontroller.kubeconfig"
        self.plane.write_kubeconfig(kubeconfig, "metacontroller", token)
        hosts = self.workdir / "hosts"
        hosts.write_text(f"127.0.0.1 localhost\n{self.address} {HOOK_HOST}\n")
        argv = [str(self.metacontroller), f"--kubeconfig={kubeconfig}", "--discovery-interval=2s",
                "--cache-flush-interval=30m", "--health-probe-bind-address=0", "--metrics-address=0",
                "--zap-log-level=4"]
        # unshare: a private mount namespace; the bind mount (and so the name) exists only there.
        self._spawn("metacontroller", ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                                       'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts), *argv])
        time.sleep(1.0)
        proc = self._procs["metacontroller"]
        if proc.poll() is not None:
            raise RuntimeError(f"metacontroller exited with {proc.returncode}: {self.log_tail('metacontroller')}")

    def _wait(self, check: Callable[[], bool], what: str, log: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self._procs[log]
            if proc.poll() is not None:
                raise RuntimeError(f"{log} exited with {proc.returncode}: {self.log_tail(log)}")
            try:
                if check():
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{what} not up after {timeout}s: {self.log_tail(log)}")

    def stop(self) -> None:
        for _name, proc in reversed(list(self._procs.items())):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(20)
        self._procs.clear()

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs.values()]

    # --- client ---------------------------------------------------------------------------------

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.plane.kubectl(*args, stdin=stdin, check=check)

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        ns = ["-n", namespace] if namespace else []
        out = self.kubectl(*ns, "get", kind, name, "-o", "json", "--ignore-not-found", check=True).stdout
        return json.loads(out) if out.strip() else None

    def hook_calls(self) -> dict[str, float]:
        """Calls per hook so far, from the hook server's own metrics."""
        text = requests.get(f"{self.hook_url}/metrics", timeout=5).text
        calls: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("noctaya_hook_duration_seconds_count{"):
                labels, value = line.rsplit(" ", 1)
                hook = labels.split('hook="', 1)[1].split('"', 1)[0]
                calls[hook] = calls.get(hook, 0.0) + float(value)
        return calls
