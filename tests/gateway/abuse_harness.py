"""A process harness for the gateway's abuse suite (tests/gateway/test_abuse.py).

`python -m gateway` runs as a real process tree (supervisor, workers, scaler child) from the env the
hooks render into the gateway Deployment of an example LLMService, or (``shared=True``) as a shared
gateway fronting that model from a model table, listed first with the rendered model's settings as
its fields, beside another model (``OTHER_MODEL``) with a backend of its own; a test overrides only
what it needs (loopback addresses, free ports, small deadlines, the fake backend). Clients are raw sockets,
optionally bound to other loopback source addresses (the whole 127.0.0.0/8 is loopback), so
per-address limits can be exercised from one machine. Memory limits are real cgroups when this
machine lets us create one (v2, else v1), with the whole tree's RSS sampled besides.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import grpc
import yaml

from scaler import externalscaler_pb2 as pb
from scaler import externalscaler_pb2_grpc as pb_grpc
from tests.gateway.conftest import wait_for
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
RUNTIME_EXAMPLE = ROOT / "examples/runtimes/vllm-nvidia.yaml"
MODEL_EXAMPLE = ROOT / "examples/models/scale-to-zero.yaml"
REF = pb.ScaledObjectRef(name="qwen-7b", namespace="default", scalerMetadata={})
MiB = 1024 * 1024
OTHER_MODEL = "other/model-b"  # the second model of a shared gateway's table


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    return wait_for(predicate, timeout, interval, what)


# -- the rendered gateway container ---------------------------------------------------------------
@cache
def rendered_gateway_container() -> dict:
    """The `gateway` container of the gateway Deployment the hooks render for the examples."""
    from hooks.render import render_documents

    documents = []
    for path in (RUNTIME_EXAMPLE, MODEL_EXAMPLE):
        documents += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for child in render_documents(documents):
        if child["kind"] == "Deployment" and child["metadata"]["name"].endswith("-gateway"):
            (container,) = [c for c in child["spec"]["template"]["spec"]["containers"] if c["name"] == "gateway"]
            return container
    raise AssertionError("the hooks rendered no gateway Deployment")


def rendered_env() -> dict[str, str]:
    return {e["name"]: e["value"] for e in rendered_gateway_container()["env"] if "value" in e}


def container_port(name: str) -> int:
    """The rendered containerPort of a named port (what a probe's `port: <name>` means)."""
    for port in rendered_gateway_container()["ports"]:
        if port["name"] == name:
            return port["containerPort"]
    raise AssertionError(f"no container port named {name!r}")


# -- memory limits ----------------------------------------------------------------------------------
class MemoryCgroup:
    """A child memory cgroup with a hard limit (cgroup v2 if mounted and writable, else v1), or
    nothing (``available`` False) when neither can be created here."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.path: Path | None = None
        self.version = 0
        name = f"noctaya-abuse-{os.getpid()}-{next(_cgroup_ids)}"
        for version, parent in self._parents():
            try:
                path = parent / name
                path.mkdir()
            except OSError:
                continue
            try:
                if version == 2:
                    (path / "memory.max").write_text(f"{limit}\n")
                    with contextlib.suppress(OSError):
                        (path / "memory.swap.max").write_text("0\n")
                else:
                    (path / "memory.limit_in_bytes").write_text(f"{limit}\n")
                    with contextlib.suppress(OSError):
                        (path / "memory.memsw.limit_in_bytes").write_text(f"{limit}\n")
            except OSError:
                with contextlib.suppress(OSError):
                    path.rmdir()
                continue
            self.path, self.version = path, version
            return

    @staticmethod
    def _parents() -> Iterator[tuple[int, Path]]:
        try:
            lines = Path("/proc/self/cgroup").read_text().splitlines()
        except OSError:
            return
        for line in lines:
            hid, controllers, path = line.split(":", 2)
            if hid == "0" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
                base = Path("/sys/fs/cgroup") / path.lstrip("/")
                try:
                    if "memory" in (base / "cgroup.subtree_control").read_text().split():
                        yield 2, base
                except OSError:
                    pass
        for line in lines:
            hid, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                base = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
                if base.is_dir():
                    yield 1, base

    @property
    def available(self) -> bool:
        return self.path is not None

    def wrap(self, argv: list[str]) -> list[str]:
        """argv run inside the cgroup: the shell moves itself in, then execs (before anything forks)."""
        if self.path is None:
            return argv
        return ["sh", "-c", f'echo $$ > {self.path / "cgroup.procs"} && exec "$@"', "sh", *argv]

    def _read(self, name: str) -> str | None:
        if self.path is None:
            return None
        try:
            return (self.path / name).read_text()
        except OSError:
            return None

    def peak(self) -> int | None:
        """The cgroup's high-water mark of charged memory, when the kernel keeps one."""
        raw = self._read("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes")
        return int(raw) if raw and raw.strip().isdigit() else None

    def oom_kills(self) -> int:
        raw = self._read("memory.events" if self.version == 2 else "memory.oom_control") or ""
        for line in raw.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        if self.path is None:
            return
        deadline = time.monotonic() + 10
        while True:
            try:
                self.path.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


_cgroup_ids = itertools.count()


def fake_cgroup_root(directory: Path, memory_limit: int) -> str:
    """cgroup files as the gateway would read them in a container limited to ``memory_limit``
    (it derives its held-body budget from them); no CPU limit."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "memory.max").write_text(f"{memory_limit}\n")
    (directory / "cpu.max").write_text("max 100000\n")
    return str(directory)


# -- process tree -----------------------------------------------------------------------------------
def _ppids() -> dict[int, int]:
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        out[int(entry)] = int(stat[stat.rindex(")") + 2:].split()[1])
    return out


def tree(pid: int) -> list[int]:
    """pid and all its descendants."""
    parents = _ppids()
    found, frontier = [pid], [pid]
    while frontier:
        frontier = [p for p, pp in parents.items() if pp in frontier]
        found += frontier
    return found


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


class PeakTreeRSS:
    """Summed RSS of a process tree, sampled every 20 ms (the tree itself re-read every 0.25 s)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self.samples = 0
        self.max_processes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        pids: list[int] = []
        refreshed = 0.0
        while not self._stop.is_set():
            if time.monotonic() - refreshed > 0.25:
                pids, refreshed = tree(self.pid), time.monotonic()
                self.max_processes = max(self.max_processes, len(pids))
            self.peak = max(self.peak, sum(rss_bytes(p) for p in pids))
            self.samples += 1
            self._stop.wait(0.02)

    def __enter__(self) -> PeakTreeRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


# -- the gateway Pod ----------------------------------------------------------------------------------
def model_name() -> str:
    """The served model name the hooks render (and a shared gateway's table lists)."""
    return rendered_env()["NOCTAYA_SERVED_MODEL_NAME"]


def table_entry(env: dict[str, str]) -> dict[str, Any]:
    """The rendered model as a model-table entry: every per-model setting the env sets, as a field."""
    from gateway.config import env_name
    from gateway.modeltable import MODEL_FIELDS

    entry: dict[str, Any] = {"name": env["NOCTAYA_SERVED_MODEL_NAME"]}
    for key, field_name in MODEL_FIELDS.items():
        if env.get(env_name(field_name)):
            entry[key] = env[env_name(field_name)]
    return entry


class GatewayPod:
    """`python -m gateway` from the rendered env plus ``overrides``; with ``shared`` a shared gateway
    whose table lists the rendered model (its settings from the same env) and ``OTHER_MODEL``, whose
    backend is ``other_backend_port`` (a port nothing listens on by default)."""

    def __init__(self, backend_port: int, *, cgroup: MemoryCgroup | None = None, shared: bool = False,
                 other_backend_port: int | None = None, other_model: dict[str, Any] | None = None,
                 **overrides: str) -> None:
        self.port = free_port()
        self.admin_port = free_port()
        self.scaler_port = free_port()
        self.shared = shared
        env = rendered_env()
        env.update({
            "NOCTAYA_BACKEND_URL": f"http://127.0.0.1:{backend_port}",
            "NOCTAYA_LISTEN_HOST": "127.0.0.1",
            "NOCTAYA_LISTEN_PORT": str(self.port),
            "NOCTAYA_ADMIN_PORT": str(self.admin_port),
            "NOCTAYA_SCALER_PORT": str(self.scaler_port),
            "NOCTAYA_PROBE_INTERVAL_SECONDS": "0.05",
            "NOCTAYA_DRAIN_GRACE_SECONDS": "1",  # the tests stop it with requests still held
            **overrides,
        })
        self.model = env["NOCTAYA_SERVED_MODEL_NAME"]
        self._table_dir: tempfile.TemporaryDirectory | None = None
        if shared:
            # The Pod's settings stay in the env; the model's own come from its table entry.
            self._table_dir = tempfile.TemporaryDirectory(prefix="noctaya-abuse-table-")
            table = Path(self._table_dir.name) / "models.json"
            other = {"name": OTHER_MODEL, "backendURL": f"http://127.0.0.1:{other_backend_port or free_port()}",
                     **(other_model or {})}
            table.write_text(json.dumps({"models": [table_entry(env), other]}))
            # The key file too: the hooks render a shared gateway's keys into its table only (a key
            # file in the Pod's env would be every model's, OTHER_MODEL's included).
            env = {k: v for k, v in env.items()
                   if k not in ("NOCTAYA_BACKEND_URL", "NOCTAYA_SERVED_MODEL_NAME", "NOCTAYA_AUTH_KEY_FILE")}
            env["NOCTAYA_MODEL_TABLE_FILE"] = str(table)
        self.env = env
        # Not the API server of a cluster this test may itself run in (a CI runner Pod): the rendered
        # NOCTAYA_ENDPOINT_SOURCE then finds no credentials and the gateway uses the backend URL.
        full = {k: v for k, v in os.environ.items()
                if not k.startswith(("NOCTAYA_", "KUBERNETES_SERVICE_"))}
        full.update(env)
        full["PYTHONPATH"] = str(ROOT)
        self._log = tempfile.NamedTemporaryFile(prefix="noctaya-abuse-gw-", suffix=".log", delete=False)  # noqa: SIM115
        argv = [sys.executable, "-m", "gateway"]
        if cgroup is not None:
            argv = cgroup.wrap(argv)
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=full, stdout=self._log, stderr=subprocess.STDOUT)
        wait_until(self._up, 30, "the gateway's admin and public ports", interval=0.05)

    @property
    def ref(self) -> pb.ScaledObjectRef:
        """What KEDA sends for this model's ScaledObject (a shared gateway's trigger names the model)."""
        if not self.shared:
            return REF
        return pb.ScaledObjectRef(name="qwen-7b", namespace="default", scalerMetadata={"model": self.model})

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"gateway exited {self.proc.returncode}: {self.logs()[-3000:]}")
        try:
            return (get(self.admin_port, "/healthz", timeout=1).status == 200
                    and get(self.port, "/healthz", timeout=1).status == 200)
        except OSError:
            return False

    # -- what it reports
    def queue(self) -> dict:
        """The model's queue page; a shared gateway's with the Pod-wide held-body figures (a per-model
        gateway's page shows its Pod's, which is the same thing)."""
        page = get(self.admin_port, "/noctaya/queue", timeout=10).json()
        if not self.shared:
            return page
        return {**page["models"][self.model], "heldBytes": page["heldBytes"], "heldBytesLimit": page["heldBytesLimit"]}

    def shared_queue(self) -> dict:
        """A shared gateway's whole page (every model, the Pod's budget)."""
        return get(self.admin_port, "/noctaya/queue", timeout=10).json()

    def metrics(self) -> str:
        """/metrics as the model's own gateway would show it: a shared gateway's series of this model
        and of the Pod (model="") summed, without the label; other models' left out."""
        text = get(self.admin_port, "/metrics", timeout=10).body.decode()
        return model_view(text, self.model) if self.shared else text

    def histogram(self, name: str, labels: str) -> tuple[float, float]:
        """(count, sum) of one labelled histogram series on /metrics."""
        count = total = None
        for line in self.metrics().splitlines():
            if line.startswith(f"{name}_count{{{labels}}}"):
                count = float(line.rsplit(" ", 1)[1])
            elif line.startswith(f"{name}_sum{{{labels}}}"):
                total = float(line.rsplit(" ", 1)[1])
        assert count is not None and total is not None, f"{name}{{{labels}}} not on /metrics"
        return count, total

    def workers(self) -> list[int]:
        # By the module run (argv), not a substring of the whole command line: the interpreter's
        # path may contain "scaler" (a checkout named so).
        return [p for p in tree(self.proc.pid)[1:] if b"\0-m\0gateway" in cmdline(p)]

    def logs(self) -> str:
        try:
            return Path(self._log.name).read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> str:
        if self._table_dir is not None:
            self._table_dir.cleanup()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                for pid in reversed(tree(self.proc.pid)):
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                self.proc.wait(10)
        logs = self.logs()
        self._log.close()
        with contextlib.suppress(OSError):
            os.unlink(self._log.name)
        return logs


def model_view(text: str, model: str) -> str:
    """A shared gateway's exposition as one model's: samples of ``model`` and of ``model=""`` summed
    per (name, other labels), the label dropped, comment lines kept."""
    from prometheus_client.parser import text_string_to_metric_families

    out: list[str] = []
    for family in text_string_to_metric_families(text):
        out.append(f"# TYPE {family.name} {family.type}")
        sums: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for sample in family.samples:
            if sample.labels.get("model") not in ("", model):
                continue
            labels = tuple((k, v) for k, v in sample.labels.items() if k != "model")
            sums[(sample.name, labels)] = sums.get((sample.name, labels), 0.0) + sample.value
        for (name, labels), value in sums.items():
            rendered = ",".join(f'{k}="{v}"' for k, v in labels)
            out.append(f"{name}{{{rendered}}} {value}" if labels else f"{name} {value}")
    return "\n".join(out) + "\n"


# -- raw HTTP over sockets ------------------------------------------------------------------------------
@dataclass
class Response:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    raw: bytes = b""

    def json(self) -> Any:
        return json.loads(self.body)

    def error_code(self) -> str | None:
        try:
            return self.json()["error"]["code"]
        except (ValueError, KeyError, TypeError):
            return None


def connect(port: int, source: str | None = None, timeout: float = 10) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if source:
        sock.bind((source, 0))
    sock.settimeout(timeout)
    sock.connect(("127.0.0.1", port))
    return sock


class Reader:
    """Reads HTTP/1.x responses off one socket (Content-Length, chunked or close-delimited)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.eof = False

    @classmethod
    def of(cls, raw: bytes) -> Reader:
        """A reader over bytes already received (the connection since closed)."""
        reader = cls(None)  # type: ignore[arg-type]
        reader.buf, reader.eof = raw, True
        return reader

    def _fill(self) -> bool:
        if self.eof:
            return False
        try:
            data = self.sock.recv(1 << 20)
        except ConnectionResetError:
            data = b""
        if not data:
            self.eof = True
            return False
        self.buf += data
        return True

    def response(self, *, head_request: bool = False) -> Response | None:
        """The next response, None when the connection closed before any byte of it."""
        while b"\r\n\r\n" not in self.buf:
            if not self._fill():
                if self.buf:
                    raise AssertionError(f"connection closed inside a response head: {self.buf[:300]!r}")
                return None
        end = self.buf.index(b"\r\n\r\n")
        head, self.buf = self.buf[:end].decode("latin-1"), self.buf[end + 4:]
        status_line, *lines = head.split("\r\n")
        status = int(status_line.split(" ", 2)[1])
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if status in (100, 101):
            return self.response(head_request=head_request)
        body = b""
        if head_request or status in (204, 304):
            pass
        elif "content-length" in headers:
            n = int(headers["content-length"])
            while len(self.buf) < n:
                if not self._fill():
                    raise AssertionError(f"body cut at {len(self.buf)} of {n} bytes")
            body, self.buf = self.buf[:n], self.buf[n:]
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                while b"\r\n" not in self.buf:
                    if not self._fill():
                        raise AssertionError("chunked body cut")
                line, self.buf = self.buf.split(b"\r\n", 1)
                size = int(line.split(b";")[0], 16)
                while len(self.buf) < size + 2:
                    if not self._fill():
                        raise AssertionError("chunked body cut")
                if size == 0:
                    while not self.buf.startswith(b"\r\n") and b"\r\n\r\n" not in self.buf:
                        if not self._fill():
                            raise AssertionError("chunked trailer cut")
                    self.buf = self.buf[2:] if self.buf.startswith(b"\r\n") else self.buf.split(b"\r\n\r\n", 1)[1]
                    break
                body += self.buf[:size]
                self.buf = self.buf[size + 2:]
        else:
            while self._fill():
                pass
            body, self.buf = self.buf, b""
        return Response(status, headers, body, head.encode("latin-1"))

    def closed(self, timeout: float) -> bool:
        """True when the peer closes (EOF or reset) within ``timeout`` with no further bytes."""
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False
        self.buf += data
        return not data


def request_bytes(method: str, path: str, body: bytes | None = None, *, version: str = "1.1",
                  headers: dict[str, str] | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/{version}", "Host: gw"]
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}")
    if body is not None:
        if not any(k.lower() in ("content-length", "transfer-encoding") for k in (headers or {})):
            lines.append(f"Content-Length: {len(body)}")
        if not any(k.lower() == "content-type" for k in (headers or {})):
            lines.append("Content-Type: application/json")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


def exchange(port: int, raw: bytes, *, source: str | None = None, timeout: float = 30) -> Response | None:
    """One request on a fresh connection; None when the gateway closed without answering."""
    with connect(port, source, timeout) as sock:
        try:
            sock.sendall(raw)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused early and closed while we were still sending: read what it said
        return Reader(sock).response()


def get(port: int, path: str, *, timeout: float = 10, source: str | None = None) -> Response:
    response = exchange(port, request_bytes("GET", path), source=source, timeout=timeout)
    if response is None:
        raise ConnectionError(f"GET {path}: closed without an answer")
    return response


def chat(stream: bool = False, content: str = "hi", model: str | None = None) -> bytes:
    """A chat completion body naming the rendered model (what a shared gateway routes by; a per-model
    gateway forwards any name)."""
    model = model_name() if model is None else model
    return json.dumps({"model": model, "messages": [{"role": "user", "content": content}],
                       "stream": stream}).encode()


# -- the scaler ------------------------------------------------------------------------------------------
class ActiveStream:
    """A KEDA-like StreamIsActive reader against the gateway's local scaler: every value pushed."""

    def __init__(self, port: int, ref: pb.ScaledObjectRef = REF) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(self.channel).result(timeout=20)
        self.stub = pb_grpc.ExternalScalerStub(self.channel)
        self.ref = ref
        self.values: list[tuple[float, bool]] = []
        self.opened = threading.Event()
        self._call = self.stub.StreamIsActive(ref)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for msg in self._call:
                self.values.append((time.monotonic(), msg.result))
                self.opened.set()
        except grpc.RpcError:
            pass

    @property
    def saw_true(self) -> bool:
        return any(v for _, v in self.values)

    def is_active(self) -> bool:
        return self.stub.IsActive(self.ref, timeout=5).result

    def close(self) -> None:
        self._call.cancel()
        self._thread.join(5)
        self.channel.close()


def no_demand(pod: GatewayPod) -> dict:
    """The Pod's queue view, asserted idle: nothing queued or in flight, no lease, no demand."""
    q = pod.queue()
    assert q["queued"] == 0 and q["inFlight"] == 0, q
    assert q["lease"]["active"] is False and q["lease"]["state"] == "idle", q
    assert q["demand"] == {"total": 0, "active": False}, q
    return q


class Flood:
    """``clients`` attackers, each from its own address (127.0.2.``first_source``...), sending ``raw``
    back to back at line rate: ``bodies`` times each (a count, for tests), or until the ``with``
    block ends (``bodies`` None, for benchmarks). ``answers``: each exchange's status (0: cut)."""

    def __init__(self, port: int, raw: bytes, first_source: int, *, clients: int = 4, bodies: int | None = 2,
                 timeout: float = 120.0) -> None:
        self.answers: list[int] = []
        self.bodies = bodies
        self.timeout = timeout
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(port, raw, f"127.0.2.{first_source + i}"),
                                          daemon=True) for i in range(clients)]

    def _run(self, port: int, raw: bytes, source: str) -> None:
        sent = 0
        while not self._stop.is_set() and (self.bodies is None or sent < self.bodies):
            sent += 1
            try:
                response = exchange(port, raw, source=source, timeout=self.timeout)
            except OSError:
                response = None  # refused and reset before the answer could be read
            self.answers.append(response.status if response is not None else 0)

    def __enter__(self) -> Flood:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bodies is None:
            self._stop.set()
        for t in self._threads:
            t.join(self.timeout)

    @property
    def over(self) -> bool:
        return not any(t.is_alive() for t in self._threads)
