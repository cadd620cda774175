"""Issue #19, the front door under hostile clients, as far as the hooks render it:

- the kubelet probes the gateway on its admin port (its own connections, on no Service), never on
  the public port whose connections any client can take;
- the aggregate scaler's probes are TCP connects, which its report port's connection caps cannot
  refuse;
- the aggregate scaler's per-address caps fit every gateway behind one address (mesh sidecar,
  SNAT), with a rolling update's surge;
- `endpoint.maxConnectionsPerAddress` and `endpoint.requestTimeoutSeconds` reach the gateway's env
  only when set (the gateway's own defaults otherwise), and the gateway enforces what was rendered.

The real-process checks start `python -m gateway` with the rendered env."""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pydantic
import pytest

from gateway.config import GatewayConfig, load_config
from hooks.api.llmservice import Endpoint
from hooks.controller import sync
from hooks.resources import scaler as scaler_resources
from scaler.aggregator import AggregatorSettings
from tests.hooks import helpers as h
from tests.stderr_lines import StderrLines

ROOT = Path(__file__).resolve().parents[2]
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def _children(**endpoint: Any) -> dict[tuple[str, str], dict[str, Any]]:
    spec = {"endpoint": endpoint} if endpoint else {}
    answer = sync.sync(h.sync_request(h.llmservice(**spec)), h.config())
    return h.by_kind_name(answer["children"])


def _container(children: dict[tuple[str, str], dict[str, Any]], name: str) -> dict[str, Any]:
    return children[("Deployment", name)]["spec"]["template"]["spec"]["containers"][0]


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"]}


def _probe_port(container: dict[str, Any], probe: dict[str, Any]) -> dict[str, Any]:
    """The container port a probe dials, by name or by number, as the kubelet resolves it."""
    action = probe.get("httpGet") or probe.get("tcpSocket")
    assert action is not None, probe
    port = action["port"]
    matches = [p for p in container["ports"] if port in (p["name"], p["containerPort"])]
    assert len(matches) == 1, f"probe port {port!r} is not one of the container's ports"
    return matches[0]


@pytest.mark.parametrize("replicas", [1, 3])
def test_gateway_probes_use_the_admin_port_not_the_public_one(replicas: int) -> None:
    children = _children(replicas=replicas)
    container = _container(children, "qwen-gateway")
    env = _env(container)
    probes = [container[p] for p in PROBES if p in container]
    assert {"readinessProbe", "livenessProbe"} <= {p for p in PROBES if p in container}
    for probe in probes:
        port = _probe_port(container, probe)
        assert port["name"] == "admin" and port["containerPort"] == int(env["NOCTAYA_ADMIN_PORT"]) == 9092
        assert probe["httpGet"]["path"] == "/healthz" and "scheme" not in probe["httpGet"]
        assert port["containerPort"] != int(env["NOCTAYA_LISTEN_PORT"])
    # What the gateway reads from that env binds the same admin port the probes dial.
    config = load_config([], {**env, "NOCTAYA_SCALER_MODE": "off"})
    assert config.admin_port == 9092 and config.listen_port == 8080
    # And the admin port stays off every Service (the public one is often a LoadBalancer).
    for (kind, _), child in children.items():
        if kind == "Service":
            assert all(p["targetPort"] not in ("admin", 9092) for p in child["spec"]["ports"])


def test_aggregator_probes_are_tcp_connects_to_its_own_ports() -> None:
    container = _container(_children(replicas=3), "qwen-aggregator")
    env = _env(container)
    ready, live = container["readinessProbe"], container["livenessProbe"]
    assert set(ready) >= {"tcpSocket"} and set(live) >= {"tcpSocket"}
    assert _probe_port(container, ready)["containerPort"] == int(env["NOCTAYA_REPORT_PORT"])
    assert _probe_port(container, live)["containerPort"] == int(env["NOCTAYA_SCALER_PORT"])


def test_scaler_tls_does_not_change_the_aggregator_probes() -> None:
    service = h.llmservice(endpoint={"replicas": 2}, scalerTLS={"secretName": "qwen-scaler-tls",
                                                                          "triggerAuthentication": "qwen-keda-tls"})
    children = h.by_kind_name(sync.sync(h.sync_request(service), h.config())["children"])
    container = _container(children, "qwen-aggregator")
    assert container["readinessProbe"]["tcpSocket"] == {"port": "report"}
    assert container["livenessProbe"]["tcpSocket"] == {"port": "grpc"}


@pytest.mark.parametrize("replicas", [2, 3, 16, 32])
def test_aggregator_caps_fit_every_gateway_behind_one_address(replicas: int) -> None:
    env = _env(_container(_children(replicas=replicas), "qwen-aggregator"))
    per_address = int(env["NOCTAYA_MAX_MEMBERS_PER_ADDRESS"])
    connections = int(env["NOCTAYA_MAX_CONNECTIONS_PER_ADDRESS"])
    members = int(env["NOCTAYA_MAX_MEMBERS"])
    # Every gateway and a predecessor each (a rollout that replaced them all, or restarts in place).
    assert per_address == 2 * replicas
    assert connections == 2 * per_address
    # One address at its cap still leaves room for every gateway with its surge.
    assert members >= 2 * per_address and members >= scaler_resources.MAX_MEMBERS
    # The aggregator takes them (it refuses values < 1), and a full address stays under its cap on
    # connections in all (256, not configurable), so the other addresses still get through.
    settings = AggregatorSettings(token_file="/dev/null", max_members=members, max_members_per_address=per_address,
                                  max_connections_per_address=connections)
    assert settings.max_connections_per_address < settings.max_connections


# -- the client limits of the gateway: endpoint.maxConnectionsPerAddress, requestTimeoutSeconds ---

LIMIT_ENV = ("NOCTAYA_MAX_CONNECTIONS_PER_ADDRESS", "NOCTAYA_CLIENT_REQUEST_TIMEOUT_SECONDS")


def test_client_limits_are_not_rendered_unless_set() -> None:
    # Everyone else's gateway template stays as it was; the gateway applies its own defaults.
    env = _env(_container(_children(), "qwen-gateway"))
    assert not set(LIMIT_ENV) & set(env)
    config = load_config([], {**env, "NOCTAYA_SCALER_MODE": "off"})
    assert config.client_request_timeout_seconds == GatewayConfig.client_request_timeout_seconds == 60
    assert config.connections_per_address == 64 and config.max_connections == 4096
    assert config.client_first_byte_timeout_seconds == 10.0


@pytest.mark.parametrize("replicas", [1, 3])
@pytest.mark.parametrize(("per_address", "timeout"), [(0, 1), (64, 300), (10000, 3600)])
def test_client_limits_render_into_the_gateway_env(replicas: int, per_address: int, timeout: int) -> None:
    children = _children(replicas=replicas, maxConnectionsPerAddress=per_address, requestTimeoutSeconds=timeout)
    env = _env(_container(children, "qwen-gateway"))
    assert env["NOCTAYA_MAX_CONNECTIONS_PER_ADDRESS"] == str(per_address)
    assert env["NOCTAYA_CLIENT_REQUEST_TIMEOUT_SECONDS"] == str(timeout)
    # What the gateway reads from it: 0 is "no cap", not the default.
    config = load_config([], {**env, "NOCTAYA_SCALER_MODE": "off"})
    assert config.connections_per_address == per_address
    assert config.client_request_timeout_seconds == timeout
    # Only the gateway gets them: the aggregate scaler's own per-address caps are rendered from the
    # gateway count, whatever the client-facing cap is.
    if replicas > 1:
        aggregator = _env(_container(children, "qwen-aggregator"))
        assert aggregator["NOCTAYA_MAX_CONNECTIONS_PER_ADDRESS"] == str(4 * replicas)
        assert "NOCTAYA_CLIENT_REQUEST_TIMEOUT_SECONDS" not in aggregator


@pytest.mark.parametrize(("field", "value", "message"), [
    ("maxConnectionsPerAddress", -1, "greater than or equal to 0"),
    ("requestTimeoutSeconds", 0, "greater than or equal to 1"),
    ("requestTimeoutSeconds", 3601, "less than or equal to 3600"),
    ("requestTimeoutSeconds", 1.5, "valid integer"),
    ("maxConnectionsPerAddress", "many", "valid integer"),
])
def test_client_limits_are_validated(field: str, value: Any, message: str) -> None:
    with pytest.raises(pydantic.ValidationError) as err:
        Endpoint.model_validate({field: value})
    (error,) = err.value.errors()
    assert error["loc"] == (field,) and message in error["msg"], error
    # The hooks report such a spec (which the CRD refuses at admission) instead of rendering it.
    answer = sync.sync(h.sync_request(h.llmservice(endpoint={field: value})), h.config())
    ready = next(c for c in answer["status"]["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "InvalidSpec" and field in ready["message"], ready


# -- a real gateway, its public port's connections all taken -------------------------------------

class Gateway:
    """`python -m gateway` with the rendered env, on ephemeral loopback ports."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "gateway"], cwd=ROOT, env=env,
                                     stderr=subprocess.PIPE, text=True)
        lines = self.stderr = StderrLines(self.proc)
        deadline = time.monotonic() + 30
        self.ports: dict[str, int] = {}
        while not self.ports and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("msg") == "gateway listening":
                self.ports = {"http": record["port"], "admin": record["admin_port"]}
        assert self.ports, "the gateway did not start"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.stderr.close()


def _get(port: int, path: str, timeout: float) -> int | None:
    """One HTTP/1.1 GET as the kubelet sends it; the status, or None without an answer in time."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n".encode())
            head = sock.recv(64)
    except OSError:
        return None
    return int(head.split()[1]) if head.startswith(b"HTTP/1.") else None


def _local_env(**endpoint: Any) -> dict[str, str]:
    """The rendered gateway env, moved onto ephemeral loopback ports with one worker."""
    env = _env(_container(_children(**endpoint), "qwen-gateway"))
    env.update({
        "NOCTAYA_LISTEN_HOST": "127.0.0.1", "NOCTAYA_LISTEN_PORT": "0", "NOCTAYA_ADMIN_PORT": "0",
        "NOCTAYA_SCALER_MODE": "off", "NOCTAYA_BACKEND_URL": "http://127.0.0.1:9",
        "NOCTAYA_GATEWAY_WORKERS": "1", "NOCTAYA_MAX_CONNECTIONS": "8",  # a small pool to fill
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT),
    })
    return env


@pytest.fixture
def gateway() -> Iterator[Gateway]:
    g = Gateway(_local_env())
    yield g
    g.close()


def _answer(sock: socket.socket, timeout: float) -> tuple[int, str, bytes]:
    """Status, error code and head of the one answer on ``sock`` (read until the server closes)."""
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]["code"], head


def test_the_gateway_enforces_the_rendered_client_limits() -> None:
    gateway = Gateway(_local_env(maxConnectionsPerAddress=2, requestTimeoutSeconds=1))
    port = gateway.ports["http"]
    held: list[socket.socket] = []
    try:
        # Two connections from 127.0.0.1 are the rendered cap (the pool holds 8), each with a request
        # in progress (an idle one would be closed to make room): a third is refused.
        held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
        started = time.monotonic()
        for sock in held:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")
        with socket.create_connection(("127.0.0.1", port), timeout=5) as third:
            status, code, head = _answer(third, 5)
        assert (status, code) == (429, "too_many_connections") and b"Connection: close" in head
        # A head that is still not whole after the rendered second (not the default 60) gets 408 (the
        # body is judged by its rate instead, gateway.server.UploadPace).
        slow = held[0]
        slow.sendall(b"Host: g\r\nContent-Type: application/json\r\nContent-Length: 100\r\n")
        status, code, head = _answer(slow, 10)
        assert (status, code) == (408, "request_timeout") and b"Connection: close" in head
        assert 0.9 <= time.monotonic() - started < 5
    finally:
        for sock in held:
            sock.close()
        gateway.close()


def test_the_rendered_probes_answer_while_requests_in_progress_hold_every_public_connection(
        gateway: Gateway) -> None:
    container = _container(_children(), "qwen-gateway")
    timeout = container["readinessProbe"]["timeoutSeconds"]
    idle = []
    for i in range(8):  # from 8 addresses (the default cap of a pool of 8 is 1), each with a head begun
        sock = socket.socket()
        sock.bind((f"127.0.0.{2 + i}", 0))
        sock.settimeout(5)
        sock.connect(("127.0.0.1", gateway.ports["http"]))
        sock.sendall(b"GET /v1/models HTTP/1.1\r\n")
        idle.append(sock)
    try:
        # The premise of issue #19: with the public pool full, /healthz there fails as a probe (no
        # answer in time, or a refusal: the kubelet takes only 200-399). Idle connections no longer
        # fill it (a full pool evicts its oldest idle one): requests in progress do.
        public = _get(gateway.ports["http"], "/healthz", timeout)
        assert public is None or not 200 <= public < 400, public
        for name in PROBES:
            if name in container:
                probe = container[name]
                port = gateway.ports[_probe_port(container, probe)["name"]]
                assert _get(port, probe["httpGet"]["path"], timeout) == 200, name
    finally:
        for sock in idle:
            sock.close()
    # Load balancers may keep using the public /healthz once the idle clients are gone.
    deadline = time.monotonic() + 10
    while _get(gateway.ports["http"], "/healthz", timeout) != 200:
        assert time.monotonic() < deadline, "public /healthz did not recover"
        time.sleep(0.1)
