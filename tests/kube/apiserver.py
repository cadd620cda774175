"""A real etcd + kube-apiserver on 127.0.0.1 for the tests, and a kubectl bound to it.

The binaries are built from their published Go modules by tools/kube-testenv/build.sh into a cache
outside the repository (built once, reused). Nothing here talks to anything but 127.0.0.1.

Lifecycle: `ensure_binaries()` finds or builds them (or says why it cannot); `ControlPlane.start()`
generates a CA, serving certificate, service-account signing key and a static admin token in a
temporary directory, starts etcd and kube-apiserver on free ports, waits for /readyz and writes a
kubeconfig; `stop()` terminates both and removes the directory.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from tests.pki import openssl
from tests.ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
TESTENV_DIR = REPO_ROOT / "tools" / "kube-testenv"
BUILD_SCRIPT = TESTENV_DIR / "build.sh"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")

# First build on a 2-core machine takes several minutes; a hung build must still end.
BUILD_TIMEOUT_SECONDS = 3600
READY_TIMEOUT_SECONDS = 180
KUBECTL_TIMEOUT_SECONDS = 120


START_ATTEMPTS = 3


class PortTaken(RuntimeError):
    """etcd or kube-apiserver lost the race for a port probed as free."""


class KubeUnavailable(Exception):
    """The test API server cannot be had on this machine; the message is the skip reason."""


class KubeBuildFailed(KubeUnavailable):
    """The tools were there but a build failed: the tests skip with it, the set-up step
    (tests/setup.py) fails on it."""


_FAILED_BUILDS: dict[Path, str] = {}


def _versions() -> dict[str, str]:
    values: dict[str, str] = {}
    for line in (TESTENV_DIR / "versions.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            values[key] = value
    return values


def cache_dir() -> Path:
    """Same rule as build.sh: $NOCTAYA_KUBE_CACHE or ~/.cache/noctaya-kube/<versions>."""
    override = os.environ.get("NOCTAYA_KUBE_CACHE")
    if override:
        return Path(override)
    v = _versions()
    return Path.home() / ".cache" / "noctaya-kube" / f"k8s-{v['K8S_VERSION']}-etcd-{v['ETCD_VERSION']}"


def _built(bin_dir: Path) -> bool:
    v = _versions()
    stamp = bin_dir / ".versions"
    return (
        all(os.access(bin_dir / b, os.X_OK) for b in BINARIES)
        and stamp.exists()
        and stamp.read_text().strip() == f"{v['K8S_VERSION']} {v['ETCD_VERSION']}"
    )


def ensure_binaries() -> Path:
    """The directory holding etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kubectl;
    builds them on first use.

    Raises KubeUnavailable (a skip reason) when NOCTAYA_SKIP_KUBE=1, when Go is missing, or when
    the build fails.
    """
    if os.environ.get("NOCTAYA_SKIP_KUBE") == "1":
        raise KubeUnavailable("NOCTAYA_SKIP_KUBE=1: Kubernetes API-server tests disabled")
    bin_dir = cache_dir() / "bin"
    if _built(bin_dir):
        return bin_dir
    # A build that failed once in this process fails again: do not spend another build on it.
    if bin_dir in _FAILED_BUILDS:
        raise KubeUnavailable(_FAILED_BUILDS[bin_dir])
    try:
        return _build(bin_dir)
    except KubeUnavailable as exc:
        _FAILED_BUILDS[bin_dir] = str(exc)
        raise


def _build(bin_dir: Path) -> Path:
    if shutil.which("go") is None:
        raise KubeUnavailable(
            f"Go toolchain not found: cannot build etcd/kube-apiserver/kubectl into {bin_dir} "
            "(install Go >= 1.25, or set NOCTAYA_SKIP_KUBE=1)"
        )
    if shutil.which("openssl") is None:
        raise KubeUnavailable("openssl not found: needed to generate the test API server's certificates")
    log_path = cache_dir() / "build.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log_path, "wb") as log:
        try:
            proc = subprocess.run(
                ["bash", str(BUILD_SCRIPT)],
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=BUILD_TIMEOUT_SECONDS,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise KubeBuildFailed(
                f"building the test API server took over {BUILD_TIMEOUT_SECONDS}s; see {log_path}"
            ) from None
    if proc.returncode != 0 or not _built(bin_dir):
        tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
        raise KubeBuildFailed(
            f"tools/kube-testenv/build.sh failed (exit {proc.returncode}) after "
            f"{time.monotonic() - started:.0f}s; see {log_path}: " + " | ".join(tail)
        )
    return bin_dir



def _generate_pki(pki: Path) -> None:
    """A throwaway CA, a serving certificate for 127.0.0.1/localhost, and a service-account key."""
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=noctaya-test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        cwd=pki,
    )
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=kube-apiserver",
        "-keyout",
        "apiserver.key",
        "-out",
        "apiserver.csr",
        cwd=pki,
    )
    (pki / "san.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc\nextendedKeyUsage=serverAuth\n"
    )
    openssl(
        "x509",
        "-req",
        "-in",
        "apiserver.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "san.ext",
        "-out",
        "apiserver.crt",
        cwd=pki,
    )
    openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", "sa.key", cwd=pki)
    openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


@dataclass
class ControlPlane:
    """etcd + kube-apiserver processes and the files that configure a client for them."""

    bin_dir: Path
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="noctaya-kube-")))
    token: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    url: str = ""
    _procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def ca_file(self) -> Path:
        return self.workdir / "pki" / "ca.crt"

    def start(self) -> None:
        try:
            pki = self.workdir / "pki"
            pki.mkdir(parents=True)
            _generate_pki(pki)
            for attempt in range(1, START_ATTEMPTS + 1):
                try:
                    self._start(pki)
                    return
                except PortTaken:
                    # A free port was taken by someone else between probing and binding it.
                    self._stop_processes()
                    shutil.rmtree(self.workdir / "etcd", ignore_errors=True)
                    if attempt == START_ATTEMPTS:
                        raise
        except BaseException:
            self.stop()
            raise

    def _start(self, pki: Path) -> None:
        # token,user,uid,"groups": a static admin in system:masters (RBAC's superuser group).
        tokens = pki / "tokens.csv"
        tokens.write_text(f'{self.token},noctaya-test-admin,uid-admin,"system:masters"\n')
        tokens.chmod(0o600)

        etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        self._spawn(
            "etcd",
            [
                str(self.bin_dir / "etcd"),
                "--name=test",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=test={peer_url}",
                "--log-level=warn",
                # A disposable test store: durability costs seconds on a loaded CI disk.
                "--unsafe-no-fsync",
                "--quota-backend-bytes=1073741824",
            ],
        )
        self._wait_http(f"{etcd_url}/health", verify=False, headers={}, what="etcd")

        self.url = f"https://127.0.0.1:{api_port}"
        self._spawn(
            "kube-apiserver",
            [
                str(self.bin_dir / "kube-apiserver"),
                f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={api_port}",
                f"--cert-dir={self.workdir / 'certs'}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                f"--token-auth-file={tokens}",
                "--authorization-mode=RBAC",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--anonymous-auth=false",
                # One client, no need for fair queuing; saves CPU on a 2-core machine.
                "--enable-priority-and-fairness=false",
                "--profiling=false",
                "--v=0",
            ],
        )
        headers = {"Authorization": f"Bearer {self.token}"}
        self._wait_http(f"{self.url}/readyz", verify=str(self.ca_file), headers=headers, what="kube-apiserver")
        self._write_kubeconfig()

    def _spawn(self, name: str, argv: list[str]) -> None:
        with open(self.workdir / f"{name}.log", "wb") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._procs.append((name, proc))

    def _wait_http(self, url: str, verify: bool | str, headers: dict[str, str], what: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        last = "no answer"
        while time.monotonic() < deadline:
            for name, proc in self._procs:
                if proc.poll() is not None:
                    tail = self.log_tail(name)
                    if "address already in use" in tail:
                        raise PortTaken(tail)
                    raise RuntimeError(f"{name} exited with {proc.returncode}: {tail}")
            try:
                resp = requests.get(url, verify=verify, headers=headers, timeout=5)
                if resp.status_code == 200:
                    return
                last = f"HTTP {resp.status_code}"
            except requests.RequestException as exc:
                last = type(exc).__name__
            time.sleep(0.25)
        raise RuntimeError(f"{what} not ready after {READY_TIMEOUT_SECONDS}s ({last}): {self.log_tail(what)}")

    def log_tail(self, name: str, lines: int = 15) -> str:
        path = self.workdir / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def _write_kubeconfig(self) -> None:
        self.write_kubeconfig(self.kubeconfig, "admin", self.token)

    def write_kubeconfig(self, path: Path, user: str, token: str) -> None:
        """A kubeconfig for this API server authenticating with ``token`` (readable by its owner only)."""
        config: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test", "cluster": {"server": self.url, "certificate-authority": str(self.ca_file)}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": user}}],
            "current-context": "test",
        }
        path.write_text(json.dumps(config))
        path.chmod(0o600)

    def stop(self) -> None:
        self._stop_processes()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _stop_processes(self) -> None:
        # The API server first, so it does not spin on a vanished etcd.
        for _name, proc in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=20)
        self._procs.clear()

    # --- client -----------------------------------------------------------------------------------

    def kubectl(
        self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = KUBECTL_TIMEOUT_SECONDS
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this API server; raises with stderr when check and it fails."""
        proc = subprocess.run(
            [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env={**os.environ, "KUBECTL_INTERACTIVE_DELETE": "false", "HOME": str(self.workdir)},
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}{proc.stdout}")
        return proc
