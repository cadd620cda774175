"""A whole cluster on 127.0.0.1 for the lifecycle suite: the test API server, kube-controller-manager
and kube-scheduler, kwok as the kubelet of a fake node, real Metacontroller, real KEDA's operator, and
Noctaya's hook server; the Pods that run Noctaya's own image (gateways, aggregator) run as local
processes (tests/e2e/pods.py).

Metacontroller is built from the source tarball in ``../shared/third_party/metacontroller`` (no Go
module serves it) into a cache directory outside the repository, and runs out of cluster as the
ServiceAccount ``metacontroller/metacontroller`` with only the RBAC of ``metacontroller/rbac.yaml``
(a token from the TokenRequest API, not the admin token), so a missing permission shows. kwok and
KEDA's operator are built from their Go modules (tests/kube/gobuild.py).

Service names resolve as in a cluster (``noctaya-hooks.noctaya-system.svc``,
``<svc>.<ns>.svc.cluster.local``), each to a private loopback address (127.77.x.y) of the process that
plays its Pod, but only inside the mount namespaces of the processes that dial them (Metacontroller,
KEDA, gateways), where the suite's hosts file is bind-mounted over /etc/hosts (``unshare -m``). The
machine's /etc/hosts is never touched and the mounts end with the processes. Every process listens on
an address of its own, so its usual ports are free whatever else runs on the machine.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.kube.apiserver import REPO_ROOT, ControlPlane, KubeBuildFailed, KubeUnavailable, cache_dir
from tests.pki import make_ca, make_leaf
from tests.third_party import SHARED_THIRD_PARTY, BuildFailed, ThirdPartyUnavailable, go_build_cached

HOOK_HOST = "noctaya-hooks.noctaya-system.svc"
HOOK_PORT = 8443
STACK_DUMP_SIGNAL = signal.SIGRTMIN  # hooks.__main__.STACK_DUMP_SIGNAL (not imported: the suite runs it as a process)
METACONTROLLER_TARBALL_GLOB = "metacontroller-src-*.tar.gz"


def _metacontroller_source() -> tuple[Path, Path] | None:
    """(source tarball, where its binary is built), or None without a copy of shared/ beside the clone."""
    tarballs = sorted((SHARED_THIRD_PARTY / "metacontroller").glob(METACONTROLLER_TARBALL_GLOB))
    if not tarballs:
        return None
    version = tarballs[-1].name.removeprefix("metacontroller-src-").removesuffix(".tar.gz")
    return tarballs[-1], cache_dir().parent / f"metacontroller-{version}" / "bin" / "metacontroller"


def metacontroller_binary_path() -> Path | None:
    """Where Metacontroller is built (whether or not it is), or None when its source is absent."""
    found = _metacontroller_source()
    return found[1] if found else None


def metacontroller_binary() -> Path:
    """Build (once, cached) and return Metacontroller. Raises KubeUnavailable with the reason."""
    found = _metacontroller_source()
    if found is None:
        raise KubeUnavailable(f"Metacontroller's source is not in {SHARED_THIRD_PARTY / 'metacontroller'} (no Go module "
                              "serves it; a copy of shared/ beside the clone provides it)")
    tarball, binary = found
    version = tarball.name.removeprefix("metacontroller-src-").removesuffix(".tar.gz")
    root = binary.parent.parent
    if binary.exists():
        return binary
    root.mkdir(parents=True, exist_ok=True)
    # A source tree of this build's own (another session may be unpacking one too; -trimpath keeps
    # the path out of the binary).
    with tempfile.TemporaryDirectory(prefix="src-", dir=root) as src:
        with tarfile.open(tarball) as tar:
            tar.extractall(src, filter="data")
        (module,) = [p.parent for p in Path(src).glob("*/go.mod")]
        try:
            return go_build_cached(binary, module, [], "./pkg/cmd/metacontroller")
        except ThirdPartyUnavailable as exc:
            error = KubeBuildFailed if isinstance(exc, BuildFailed) else KubeUnavailable
            raise error(f"Metacontroller {version}: {exc}") from None


# The suite's private loopback range. `make e2e` runs the upgrade tests (clusters of their own) beside
# the rest in a second pytest on another range, so each run's end-of-session check ("no port left
# listening on my range") sees only its own listeners (tests/e2e/run.py).
LOOPBACK_RANGE = os.environ.get("NOCTAYA_E2E_LOOPBACK", "127.77")


def private_loopback_address(taken: set[str], port: int = HOOK_PORT) -> str:
    """A loopback address nobody else uses (not in ``taken``, ``port`` free on it)."""
    for _ in range(50):
        address = f"{LOOPBACK_RANGE}.{random.randint(1, 254)}.{random.randint(1, 254)}"
        if address in taken:
            continue
        with socket.socket() as probe:
            try:
                probe.bind((address, port))
            except OSError:
                continue
        taken.add(address)
        return address
    raise KubeUnavailable("no free private loopback address")


@dataclass
class Timeline:
    """What a lifecycle test saw, in order; printed when it fails (the output alone must explain it)."""

    start: float = field(default_factory=time.monotonic)
    lines: list[str] = field(default_factory=list)

    def note(self, what: str) -> None:
        self.lines.append(f"[{time.monotonic() - self.start:7.2f}s] {what}")

    def text(self) -> str:
        return "\n".join(self.lines)

    def wait(self, what: str, check: Callable[[], bool], snapshot: Callable[[], str], timeout: float,
             logs: Callable[[], list[tuple[str, str]]]) -> float:
        """Poll ``check`` until true, noting every change of ``snapshot()`` on the way; seconds waited.
        On timeout the test fails with the timeline and the tails of ``logs()`` (name, text)."""
        t0 = time.monotonic()
        last = ""
        while True:
            ok = check()
            now = snapshot()
            if now != last:
                self.note(now)
                last = now
            if ok:
                self.note(f"OK: {what} after {time.monotonic() - t0:.2f}s")
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                for name, tail in logs():
                    self.note(f"{name} log tail:\n{tail}")
                pytest.fail(f"{what}: not within {timeout}s\n{self.text()}")
            time.sleep(0.2)


def bare_cluster(plane: ControlPlane, metacontroller: Path, kwok: Path) -> Cluster:
    """On a started API server: Metacontroller's CRDs, kube-controller-manager, kube-scheduler and kwok's
    node; nothing of Noctaya yet (each caller installs a release its own way)."""
    from tests.kube.conftest import crd_names, wait_established
    from tests.third_party import metacontroller_crds

    files = metacontroller_crds()
    plane.kubectl("apply", "--server-side", *[a for f in files for a in ("-f", str(f))])
    wait_established(plane, crd_names(plane, *files))
    cluster = Cluster(plane, metacontroller)
    cluster.start_kube_controllers()
    cluster.start_kwok(kwok)
    return cluster


def install_this_release(cluster: Cluster) -> None:
    """This checkout installed as docs/install.md says, its hook server and Metacontroller running."""
    plane = cluster.plane
    plane.kubectl("apply", "--server-side", "-k", str(REPO_ROOT / "metacontroller"))
    plane.kubectl("-n", "noctaya-system", "create", "secret", "generic", "noctaya-hooks",
                  f"--from-literal=hook-token={cluster.hook_token}", f"--from-literal=token-key={os.urandom(16).hex()}")
    # The hook server's certificate, made as docs/install.md says (the script calls kubectl).
    subprocess.run(["bash", str(REPO_ROOT / "tools" / "make-hook-cert.sh")], check=True, capture_output=True,
                   timeout=120, env={"PATH": f"{plane.bin_dir}:{os.environ['PATH']}", "KUBECONFIG": str(plane.kubeconfig),
                                     "HOME": str(plane.workdir)})
    # A deleted member's backend outlives its route by this grace (90 s by default: a kubelet's
    # ConfigMap refresh); LocalPods refresh every second, so 5 s is the same margin here.
    cluster.start_hook_server(env_extra={"NOCTAYA_ROUTE_GRACE_SECONDS": str(ROUTE_GRACE_SECONDS)})
    cluster.start_metacontroller()


ROUTE_GRACE_SECONDS = 5


class Cluster:
    """API server + installed Noctaya + hook server + Metacontroller; ``kubectl`` and ``get`` helpers."""

    def __init__(self, plane: ControlPlane, metacontroller: Path) -> None:
        self.plane = plane
        self.metacontroller = metacontroller
        self.workdir = plane.workdir / "e2e"
        self.workdir.mkdir()
        self._addresses: set[str] = set()
        self.address = self.new_address()
        self.hook_token = os.urandom(24).hex()
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._spawned: dict[int, str | None] = {}  # pid -> its start time (see process_start_time)
        self.hosts_file = self.workdir / "hosts"
        self._hosts: dict[str, list[str]] = {HOOK_HOST: [self.address]}
        self._write_hosts()

    # --- names ----------------------------------------------------------------------------------

    def new_address(self) -> str:
        return private_loopback_address(self._addresses)

    def publish(self, host: str, addresses: list[str]) -> None:
        """Make ``host`` resolve to ``addresses`` for every process started with private hosts."""
        self._hosts[host] = list(addresses)
        self._write_hosts()

    def resolve(self, host: str) -> list[str]:
        """The addresses ``host`` resolves to now, as the hosts file says (empty when it names none)."""
        return list(self._hosts.get(host, []))

    def _write_hosts(self) -> None:
        lines = ["127.0.0.1 localhost"] + [f"{a} {host}" for host, addrs in sorted(self._hosts.items()) for a in addrs]
        # Rewritten in place (same inode): the bind mounts of running processes see the change.
        with open(self.hosts_file, "w") as fh:
            fh.write("\n".join(lines) + "\n")

    # --- processes ------------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None,
               cwd: Path = REPO_ROOT) -> subprocess.Popen[bytes]:
        with open(self.workdir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                    start_new_session=True)
        self._procs[name] = proc
        self._spawned[proc.pid] = process_start_time(proc.pid)
        return proc

    def spawn_with_cluster_names(self, name: str, argv: list[str], env: dict[str, str] | None = None,
                                 cwd: Path = REPO_ROOT) -> subprocess.Popen[bytes]:
        """Start a process that resolves Service names: in a mount namespace of its own (unshare), the
        suite's hosts file bind-mounted over /etc/hosts; the bind mount ends with the process."""
        return self._spawn(name, ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                                  'mount --bind "$0" /etc/hosts && exec "$@"', str(self.hosts_file), *argv], env, cwd)

    def stop_process(self, name: str) -> None:
        proc = self._procs.pop(name, None)
        if proc is not None:
            _terminate(proc)

    def signal_process(self, name: str, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to the process itself, not its group: what the container runtime does to a
        container's PID 1 when the kubelet stops it (the process stops its own children)."""
        proc = self._procs[name]
        if proc.poll() is None:
            os.kill(proc.pid, sig)

    def wait_process(self, name: str, timeout: float) -> int | None:
        """Its exit code once ``name`` has exited by itself (it is then forgotten), None while it
        still runs after ``timeout`` seconds."""
        proc = self._procs[name]
        try:
            code = proc.wait(max(0.0, timeout))
        except subprocess.TimeoutExpired:
            return None
        del self._procs[name]
        return code

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.workdir / f"{name}.log"
        if not path.exists():
            return ""
        # Metacontroller logs JSON with Go stack traces: the message is in the first few hundred bytes.
        return "\n".join(line[:400] for line in path.read_text(errors="replace").splitlines()[-lines:])

    def start_hook_server(self, source: Path = REPO_ROOT, env_extra: dict[str, str] | None = None) -> None:
        """Over HTTPS with the certificate tools/make-hook-cert.sh put into noctaya-hooks-tls (the
        controllers verify it against that Secret's ca.crt, as installed). `source`: the tree whose
        hook server runs (another release's, for the upgrade tests)."""
        tls_dir = self.workdir / "hook-tls"
        tls_dir.mkdir(exist_ok=True)
        tls = self.get("secret", "noctaya-hooks-tls", "noctaya-system")
        assert tls is not None, "noctaya-hooks-tls missing: run tools/make-hook-cert.sh first"
        for key in ("tls.crt", "tls.key", "ca.crt"):
            (tls_dir / key).write_bytes(base64.b64decode(tls["data"][key]))
        token_file = self.workdir / "hook-token"
        token_file.write_text(self.hook_token)
        key_file = self.workdir / "token-key"
        if not key_file.exists():  # the same key across hook server versions, as the install's Secret keeps it
            key_file.write_text(os.urandom(32).hex())
        prom = self.workdir / f"prom-{time.monotonic_ns()}"
        prom.mkdir()
        env = {**os.environ, "PYTHONPATH": str(source), "NOCTAYA_HOOK_TOKEN_FILE": str(token_file),
               "NOCTAYA_TOKEN_KEY_FILE": str(key_file), "PROMETHEUS_MULTIPROC_DIR": str(prom),
               "PYTHONDONTWRITEBYTECODE": "1", **(env_extra or {})}
        self._spawn("hooks", [sys.executable, "-m", "hooks", "serve", "--bind", f"{self.address}:{HOOK_PORT}",
                              "--workers", "1", "--tls-cert-file", str(tls_dir / "tls.crt"),
                              "--tls-key-file", str(tls_dir / "tls.key")], env, cwd=source)
        self._wait(lambda: self._hooks_get("/healthz", attempts=1).ok, "hook server", "hooks")
        if getattr(self, "_hook_watchdog", None) is None:
            self._hook_watchdog = HookServerWatchdog(self)
            self._hook_watchdog.start()

    def replace_hook_server(self, source: Path = REPO_ROOT, env_extra: dict[str, str] | None = None) -> None:
        """The hook server Deployment's rollout, played as Recreate: the old process stops (SIGTERM, its
        in-flight calls finish), then the other tree's starts on the same address; Metacontroller's
        calls in between fail and are retried with backoff, as during any hook server restart."""
        watchdog = getattr(self, "_hook_watchdog", None)
        if watchdog is None:
            self.stop_process("hooks")
            self.start_hook_server(source, env_extra)
            return
        # Paused: its stack-dump signal would kill a server still starting (the handler is not yet
        # installed, and the signal's default action is to terminate: a CI run saw "exited with -34").
        with watchdog.paused():
            self.stop_process("hooks")
            self.start_hook_server(source, env_extra)

    @property
    def hook_url(self) -> str:
        return f"https://{self.address}:{HOOK_PORT}"

    def _hooks_get(self, path: str, attempts: int = 3) -> requests.Response:
        """The suite's own read of the hook server (health, counters), with room for a 2-core CI host
        where every component of the cluster shares the CPUs: a CI run once saw one TLS handshake
        stall past 5 s. A slow read is printed, so a hook server that really stalls stays visible."""
        # The suite dials the address, not the Service name the certificate names; Metacontroller,
        # which is what is tested, verifies the certificate.
        started = time.monotonic()
        for attempt in range(1, attempts + 1):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    resp = requests.get(f"{self.hook_url}{path}", timeout=(10, 30), verify=False)
            except (requests.ConnectionError, requests.Timeout) as exc:
                if attempt == attempts:
                    raise
                print(f"hook server: GET {path} attempt {attempt} failed after "
                      f"{time.monotonic() - started:.1f}s ({type(exc).__name__}); retrying")
                time.sleep(1.0)
                continue
            if time.monotonic() - started > 5.0:
                print(f"hook server: GET {path} took {time.monotonic() - started:.1f}s")
            return resp
        raise AssertionError("unreachable")

    def hook_server_stacks(self) -> str:
        """Every thread's stack in the hook server's processes (master and workers), as the server's
        stack-dump signal prints them into its log."""
        proc = self._procs.get("hooks")
        if proc is None or proc.poll() is not None:
            return "(hook server not running)"
        log = self.workdir / "hooks.log"
        start = log.stat().st_size
        for pid in [proc.pid, *_children(proc.pid)]:
            try:
                os.kill(pid, STACK_DUMP_SIGNAL)
            except ProcessLookupError:
                pass
        time.sleep(1.0)
        with open(log, "rb") as fh:
            fh.seek(start)
            return fh.read(64 * 1024).decode(errors="replace")

    def start_metacontroller(self) -> None:
        """As the ServiceAccount the install binds its RBAC to, in a mount namespace of its own."""
        self.kubectl("create", "namespace", "metacontroller")
        self.kubectl("-n", "metacontroller", "create", "serviceaccount", "metacontroller")
        self.kubectl("apply", "--server-side", "-f", str(Path(__file__).with_name("metacontroller-own-rbac.yaml")))
        token = self.kubectl("-n", "metacontroller", "create", "token", "metacontroller", "--duration=6h").stdout.strip()
        kubeconfig = self.workdir / "metacontroller.kubeconfig"
        self.plane.write_kubeconfig(kubeconfig, "metacontroller", token)
        argv = [str(self.metacontroller), f"--kubeconfig={kubeconfig}", "--discovery-interval=2s",
                "--cache-flush-interval=30m", "--health-probe-bind-address=0", "--metrics-address=0",
                "--zap-log-level=4"]
        self._metacontroller_argv = argv
        self.spawn_with_cluster_names("metacontroller", argv)
        self._still_running("metacontroller", after=1.0)

    def stop_metacontroller(self) -> None:
        """Stop Metacontroller (SIGTERM, as a rollout or an eviction would); its log is kept aside."""
        self.stop_process("metacontroller")
        log = self.workdir / "metacontroller.log"
        if log.exists():
            log.rename(self.workdir / f"metacontroller.{time.monotonic():.0f}.log")

    def restart_metacontroller(self) -> None:
        """Start Metacontroller again as start_metacontroller did (same ServiceAccount kubeconfig, flags):
        a fresh process with empty informer caches that resyncs every parent."""
        self.spawn_with_cluster_names("metacontroller", self._metacontroller_argv)
        self._still_running("metacontroller", after=1.0)

    def _still_running(self, name: str, after: float) -> None:
        time.sleep(after)
        proc = self._procs[name]
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}: {self.log_tail(name)}")

    def start_kube_controllers(self) -> None:
        """kube-controller-manager (Deployments → ReplicaSets → Pods, garbage collection, node
        lifecycle) and kube-scheduler, as the admin: they are the cluster, not what is tested."""
        kubeconfig = str(self.plane.kubeconfig)
        pki = self.plane.workdir / "pki"
        bin_dir = self.plane.bin_dir
        self._spawn("kube-controller-manager", [
            str(bin_dir / "kube-controller-manager"), f"--kubeconfig={kubeconfig}", "--leader-elect=false",
            "--secure-port=0", f"--root-ca-file={pki / 'ca.crt'}",
            f"--service-account-private-key-file={pki / 'sa.key'}", "--use-service-account-credentials=false",
            "--controllers=*,-bootstrapsigner,-tokencleaner", "--v=1"])
        self._spawn("kube-scheduler", [
            str(bin_dir / "kube-scheduler"), f"--kubeconfig={kubeconfig}", "--leader-elect=false",
            "--secure-port=0", "--v=1"])
        self._still_running("kube-controller-manager", after=0.5)
        self._still_running("kube-scheduler", after=0.0)

    def start_kwok(self, kwok: Path, node: str = "e2e-node-1") -> None:
        """kwok as the kubelet of one fake node (stages: tests/e2e/kwok-stages.yaml), and that node."""
        self._spawn("kwok", [
            str(kwok), f"--kubeconfig={self.plane.kubeconfig}", f"--config={Path(__file__).with_name('kwok-stages.yaml')}",
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake", "--node-lease-duration-seconds=40",
            "--server-address=", "--node-ip=10.200.0.1", "--cidr=10.244.0.0/16"])
        self._still_running("kwok", after=0.5)
        self.add_node(node)

    def add_node(self, node: str, *, gpus: int = 0, amd_gpus: int = 0, labels: dict[str, str] | None = None,
                 taints: list[dict[str, str]] | None = None) -> None:
        """One more fake node played by kwok, Ready on return; with ``gpus`` it offers that many
        ``nvidia.com/gpu``, with ``amd_gpus`` that many ``amd.com/gpu`` (kwok-stages.yaml reads the
        annotations). Delete it with ``kubectl delete node``."""
        annotations = {"kwok.x-k8s.io/node": "fake", **({"e2e.noctaya.io/gpus": str(gpus)} if gpus else {}),
                       **({"e2e.noctaya.io/amd-gpus": str(amd_gpus)} if amd_gpus else {})}
        body: dict[str, Any] = {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": node, "annotations": annotations,
                         "labels": {"kubernetes.io/hostname": node, "type": "kwok", **(labels or {})}},
        }
        if taints:
            body["spec"] = {"taints": taints}
        self.kubectl("apply", "--server-side", "-f", "-", stdin=json.dumps(body))
        self.wait_api(f"node {node} Ready", lambda: _ready(self.get("node", node)), log="kwok")

    def start_keda(self, operator: Path) -> None:
        """KEDA's operator (ScaledObject controller, scale 0↔1, the HPA for 1↔N), as the admin: KEDA's
        own RBAC is KEDA's install, not Noctaya's. It dials the scalers by their Service names. Once per
        suite: a second call (another file's fixture) finds it running and returns."""
        if "keda-operator" in self._procs:
            return
        certs = self.workdir / "keda-certs"
        certs.mkdir()
        _self_signed(certs, "keda-operator.keda.svc")
        kubeconfig = self.workdir / "keda.kubeconfig"
        self.plane.write_kubeconfig(kubeconfig, "keda", self.plane.token)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "KUBECONFIG": str(kubeconfig),
               "WATCH_NAMESPACE": "", "POD_NAMESPACE": "keda", "KEDA_CLUSTER_OBJECT_NAMESPACE": "keda",
               "KEDA_HTTP_DEFAULT_TIMEOUT": "3000"}
        self.kubectl("create", "namespace", "keda")
        self.spawn_with_cluster_names("keda-operator", [
            str(operator), "--leader-elect=false", "--metrics-bind-address=0", "--health-probe-bind-address=0",
            f"--metrics-service-bind-address={self.new_address()}:9666", f"--cert-dir={certs}",
            "--enable-webhook-patching=false", "--enable-apiservice-patching=false", f"--ca-dir={certs}",
            "--zap-log-level=info", "--zap-encoder=console"], env)
        self._still_running("keda-operator", after=2.0)

    def install_keda(self) -> None:
        """KEDA as a user installs it: every CRD of the release (its operator waits for each one's
        informer and exits after two minutes without, ScaledJob's included), then the operator."""
        from tests.kube.conftest import crd_names, wait_established
        from tests.kube.gobuild import keda_operator_binary
        from tests.third_party import module_dir

        try:
            operator = keda_operator_binary()
            crds = sorted((module_dir("KEDA_MODULE") / "config" / "crd" / "bases").glob("*.yaml"))
        except (KubeUnavailable, ThirdPartyUnavailable) as exc:
            pytest.skip(str(exc))
        self.kubectl("apply", "--server-side", *[a for p in crds for a in ("-f", str(p))])
        wait_established(self.plane, crd_names(self.plane, *crds))
        self.start_keda(operator)

    def install_keda_crds(self) -> None:
        """KEDA's CRDs from its pinned Go module, applied and Established (skips the test without them)."""
        from tests.kube.conftest import crd_names, wait_established
        from tests.third_party import module_crds

        try:
            keda = [p for p in module_crds() if p.name.startswith("keda.sh_")]
        except ThirdPartyUnavailable as exc:
            pytest.skip(str(exc))
        self.kubectl("apply", "--server-side", *[a for p in keda for a in ("-f", str(p))])
        wait_established(self.plane, crd_names(self.plane, *keda))

    def wait_api(self, what: str, check: Callable[[], bool], log: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check():
                return
            time.sleep(0.2)
        raise RuntimeError(f"{what}: not within {timeout}s: {self.log_tail(log)}")

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
        watchdog = getattr(self, "_hook_watchdog", None)
        if watchdog is not None:
            watchdog.stop()
        for _name, proc in reversed(list(self._procs.items())):
            _terminate(proc)
        self._procs.clear()

    def pids(self) -> dict[int, str | None]:
        """Every process the suite started, running or not, with its start time."""
        return dict(self._spawned)

    # --- client ---------------------------------------------------------------------------------

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.plane.kubectl(*args, stdin=stdin, check=check)

    def api(self, path: str) -> dict[str, Any]:
        """GET an API path as the admin (cheaper than a kubectl process for frequent polls)."""
        resp = requests.get(f"{self.plane.url}{path}", headers={"Authorization": f"Bearer {self.plane.token}"},
                            verify=str(self.plane.ca_file), timeout=10)
        resp.raise_for_status()
        return resp.json()

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        ns = ["-n", namespace] if namespace else []
        out = self.kubectl(*ns, "get", kind, name, "-o", "json", "--ignore-not-found", check=True).stdout
        return json.loads(out) if out.strip() else None

    def hook_calls_for(self, hook: str, obj: str) -> int:
        """Answered calls of ``hook`` for the object ``namespace/name`` so far, from the hook server's
        one log line per request (the metrics count every object together)."""
        path = self.workdir / "hooks.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return text.count(f'"hook":"{hook}","object":"{obj}"')

    def hook_calls(self) -> dict[str, float]:
        """Calls per hook so far, from the hook server's own metrics."""
        text = self._hooks_get("/metrics").text
        calls: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("noctaya_hook_duration_seconds_count{"):
                labels, value = line.rsplit(" ", 1)
                hook = labels.split('hook="', 1)[1].split('"', 1)[0]
                calls[hook] = calls.get(hook, 0.0) + float(value)
        return calls


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


class HookServerWatchdog:
    """Probes the hook server's /healthz every few seconds for the whole session. A probe slower than
    PROBE_TIMEOUT prints the server's thread stacks once per stall: a hook server that stops answering
    (two CI runs saw Metacontroller's calls time out) shows where it is stuck, whichever test runs."""

    PERIOD = 3.0
    PROBE_TIMEOUT = 8.0

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._dumping = threading.Lock()  # held while probing and dumping: pause() waits it out
        self._thread = threading.Thread(target=self._run, name="hook-server-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.PROBE_TIMEOUT + 5)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No probe and no stack dump inside (the hook server is being replaced on purpose)."""
        with self._dumping:
            self._paused.set()
        try:
            yield
        finally:
            self._paused.clear()

    def _probe(self) -> bool:
        # http.client, not requests: warnings filters are process-wide and not thread-safe, so this
        # thread verifies the chain against the hook CA (the certificate names the Service, not the
        # address dialled) instead of silencing urllib3's warning.
        context = ssl.create_default_context(cafile=str(self._cluster.workdir / "hook-tls" / "ca.crt"))
        context.check_hostname = False
        conn = http.client.HTTPSConnection(self._cluster.address, HOOK_PORT, timeout=self.PROBE_TIMEOUT,
                                           context=context)
        try:
            conn.request("GET", "/healthz")
            return conn.getresponse().status == 200
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()

    def _run(self) -> None:
        stalled = False
        while not self._stop.wait(self.PERIOD):
            with self._dumping:
                if self._paused.is_set():
                    stalled = False
                    continue
                started = time.monotonic()
                ok = self._probe()
                took = time.monotonic() - started
                if ok:
                    if stalled:
                        print(f"hook server watchdog: answering again ({took:.1f}s)", flush=True)
                    stalled = False
                elif not stalled and not self._stop.is_set():
                    stalled = True
                    print(f"hook server watchdog: /healthz failed after {took:.1f}s; thread stacks:\n"
                          f"{self._cluster.hook_server_stacks()}", flush=True)


def process_start_time(pid: int) -> str | None:
    """When a process started (clock ticks after boot, /proc/<pid>/stat field 22), None once it is gone:
    with the PID it names one process, where a PID alone may since name any other the kernel gave it to."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:  # a starved machine: the kill stands; the test's own failure matters more
                print(f"process {proc.pid} not reaped 20 s after SIGKILL: {proc.args}")


def _ready(obj: dict[str, Any] | None) -> bool:
    conds = ((obj or {}).get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def _self_signed(directory: Path, host: str) -> None:
    """tls.crt/tls.key/ca.crt for a server that insists on a certificate (KEDA's metrics gRPC service)."""
    make_ca(directory, "ca")
    make_leaf(directory, "tls", "ca", sans=f"DNS:{host}")


def private_listeners() -> list[str]:
    """Listening TCP sockets on the suite's private loopback range (127.77.0.0/16 unless
    NOCTAYA_E2E_LOOPBACK says otherwise), as ip:port."""
    found = []
    with open("/proc/net/tcp") as fh:
        for line in fh.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            ip_hex, port_hex = local.split(":")
            ip = ".".join(str(b) for b in reversed(bytes.fromhex(ip_hex)))
            if state == "0A" and ip.startswith(f"{LOOPBACK_RANGE}."):
                found.append(f"{ip}:{int(port_hex, 16)}")
    return found
