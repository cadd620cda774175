"""The harness's Pod network (tests/e2e/netns.py), without a cluster: a Pod's namespace serves on its
Pod IP exactly what a cluster would let through, and nothing of a run outlives it."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.e2e.netns import (
    ALIAS,
    METRIC_BASE,
    POD_RANGE,
    PREFIX,
    Network,
    NetworkUnavailable,
    PodNetwork,
    _base36,
)

PORT = 8123
# Answers every connection with the peer address it saw, then closes it.
SERVER = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
while True:
    conn, peer = server.accept()
    conn.sendall(f"{peer[0]}".encode())
    conn.close()
"""


@pytest.fixture
def network() -> Iterator[Network]:
    """A Network of the test's own (not the session's), closed by the test itself or at its end."""
    try:
        net = Network().open()
    except NetworkUnavailable as exc:
        pytest.skip(str(exc))
    try:
        yield net
    finally:
        net.close()


def serve(net: Network, pod: PodNetwork, host: str) -> subprocess.Popen[str]:
    """SERVER inside the Pod's namespace, bound to ``host`` there; returns once it listens."""
    proc = subprocess.Popen([*net.exec_prefix(pod), sys.executable, "-c", SERVER, host, str(PORT)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
    return proc


def ask(ip: str, source: str | None = None) -> str:
    """What the server at ``ip`` saw as this connection's source (``source``: bind the client to it)."""
    with socket.socket() as sock:
        sock.settimeout(5)
        if source:
            sock.bind((source, 0))
        sock.connect((ip, PORT))
        return sock.recv(100).decode()


def test_pod_namespaces_serve_on_their_pod_ip_as_in_a_cluster_and_leave_nothing(network: Network) -> None:
    open_pod, loopback_pod = network.add_pod(), network.add_pod()
    assert open_pod.ip != loopback_pod.ip
    assert all(not ip.startswith("127.") for ip in (open_pod.ip, loopback_pod.ip, network.host_address))
    servers = [serve(network, open_pod, "0.0.0.0"), serve(network, loopback_pod, "127.0.0.1")]
    try:
        # Bound to 0.0.0.0 inside: reachable at the Pod IP, from the root namespace's own source
        # address and from a client bound to one of the suite's private loopback addresses.
        assert ask(open_pod.ip) == network.host_address
        assert ask(open_pod.ip, source="127.77.201.9") == "127.77.201.9"
        # Bound to 127.0.0.1 inside: that is the Pod's own loopback, unreachable from outside.
        with pytest.raises(ConnectionRefusedError):
            ask(loopback_pod.ip)
        # ... but reachable from inside the same Pod (a preStop hook asks 127.0.0.1).
        inside = subprocess.run([*network.exec_prefix(loopback_pod), sys.executable, "-c",
                                 f"import socket; print(socket.create_connection(('127.0.0.1', {PORT}), 5).recv(100)"
                                 ".decode())"], capture_output=True, text=True, timeout=30, check=True)
        assert inside.stdout.strip() == "127.0.0.1"
        # Two Pods listen on the same port, each on its own IP.
        third = network.add_pod()
        servers.append(serve(network, third, "0.0.0.0"))
        assert ask(third.ip) == ask(open_pod.ip) == network.host_address
    finally:
        for proc in servers:
            proc.kill()
            proc.wait()
    network.close()
    assert network.leftovers() == []
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert network.ns_prefix not in namespaces and network.prefix not in links, (namespaces, links)
    routes = subprocess.run(["ip", "route"], capture_output=True, text=True, check=True).stdout
    assert open_pod.ip not in routes and network.host_address not in routes, routes
    assert f"metric {network.metric}" not in routes, routes


def test_an_address_nothing_plays_is_unreachable_at_once(network: Network) -> None:
    # A deleted Pod's IP: refused by the harness's unreachable route, not sent out of the machine.
    gone = network.allocate()
    with pytest.raises(OSError) as failed, socket.socket() as sock:
        sock.settimeout(10)
        sock.connect((gone, PORT))
    assert "No route to host" in str(failed.value), failed.value


def test_a_pod_reaches_the_suites_loopback_servers_but_not_the_machines_127_0_0_1(network: Network) -> None:
    # The stand-in hub a prewarm Job downloads from listens on a private loopback address.
    pod = network.add_pod()
    with socket.create_server(("127.77.201.10", PORT)) as server:
        server.settimeout(10)
        probe = subprocess.Popen([*network.exec_prefix(pod), sys.executable, "-c",
                                  f"import socket; socket.create_connection(('127.77.201.10', {PORT}), 5).recv(1)"])
        conn, peer = server.accept()
        conn.close()
        assert probe.wait(30) == 0 and peer[0] == pod.ip


def test_an_address_in_the_root_namespace_serves_every_local_client(network: Network) -> None:
    ip = network.add_address()
    with socket.create_server((ip, PORT)) as server:
        server.settimeout(10)
        for source in (None, "127.77.201.11"):
            with socket.socket() as client:
                if source:
                    client.bind((source, 0))
                client.connect((ip, PORT))
                conn, peer = server.accept()
                conn.close()
                assert peer[0] == (source or ip)
    network.remove_address(ip)
    assert ip not in subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout


def test_a_crashed_runs_leftovers_are_removed_by_the_next_run() -> None:
    # A run whose process is gone: a pid that no longer runs, a start time that never was.
    gone = subprocess.Popen(["true"])
    gone.wait()
    time.sleep(0.1)
    pid = gone.pid
    namespace = f"{PREFIX}-{pid}-1-0-1"
    link = f"{PREFIX}{_base36(pid)}0a"
    metric = str(METRIC_BASE + 36 * pid)
    try:
        subprocess.run(["ip", "netns", "add", namespace], check=True, capture_output=True)
        subprocess.run(["ip", "route", "add", "unreachable", POD_RANGE, "metric", metric], check=True,
                       capture_output=True)
        subprocess.run(["ip", "link", "add", link, "type", "veth", "peer", "name", f"{PREFIX}{_base36(pid)}0b"],
                       check=True, capture_output=True)
        for name in (link, f"{PREFIX}{_base36(pid)}0b"):
            subprocess.run(["ip", "link", "set", "dev", name, "alias", f"{ALIAS} {pid} 1"], check=True)
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        pytest.skip(f"cannot make network namespaces here: {exc}")
    net = Network()
    try:
        net.open()
    except NetworkUnavailable as exc:
        pytest.skip(str(exc))
    try:
        namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
        routes = subprocess.run(["ip", "route"], capture_output=True, text=True, check=True).stdout
        assert namespace not in namespaces and link not in links, (namespaces, links)
        assert f"metric {metric}" not in routes, routes
    finally:
        net.close()
        subprocess.run(["ip", "netns", "delete", namespace], capture_output=True, check=False)
        subprocess.run(["ip", "link", "delete", link], capture_output=True, check=False)
        subprocess.run(["ip", "route", "delete", "unreachable", POD_RANGE, "metric", metric], capture_output=True,
                       check=False)
