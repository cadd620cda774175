"""Gateways behind one address (a mesh sidecar, SNAT): a real `python -m scaler aggregate` started
with the env the hooks render for the LLMService takes every gateway from that one address, with a
rolling update's surge, where the aggregator's defaults refuse the third."""

from __future__ import annotations

import os
import queue
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from hooks.controller import sync
from tests.hooks import helpers as h
from tests.stderr_lines import StderrLines

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "nat-token"
REPLICAS = 3


def rendered_env(replicas: int) -> dict[str, str]:
    answer = sync.sync(h.sync_request(h.llmservice(endpoint={"replicas": replicas})), h.config())
    (deployment,) = [c for c in answer["children"] if c["kind"] == "Deployment" and c["metadata"]["name"] == "qwen-aggregator"]
    return {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


class Aggregator:
    def __init__(self, env: dict[str, str], tmp_path: Path) -> None:
        token = tmp_path / "token"
        token.write_text(TOKEN)
        env = {**env, "NOCTAYA_AGGREGATOR_TOKEN_FILE": str(token), "NOCTAYA_LISTEN_HOST": "127.0.0.1",
               "NOCTAYA_REPORT_PORT": "0", "NOCTAYA_SCALER_PORT": "0",
               "PYTHONPATH": str(ROOT), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        env.pop("NOCTAYA_AGGREGATOR_PREVIOUS_TOKEN_FILE", None)  # the mounted path does not exist here
        self.proc = subprocess.Popen([sys.executable, "-m", "scaler", "aggregate"], cwd=ROOT, env=env,
                                     stderr=subprocess.PIPE, text=True)
        lines = self.stderr = StderrLines(self.proc)
        deadline, self.port = time.monotonic() + 30, 0
        while not self.port and time.monotonic() < deadline:
            try:
                match = re.search(r"reports on [\d.]+:(\d+)", lines.get(timeout=0.5))
            except queue.Empty:
                continue
            self.port = int(match.group(1)) if match else 0
        assert self.port, "the aggregate scaler did not start"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.stderr.close()


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Any]:
    started: list[Aggregator] = []

    def start_(env: dict[str, str]) -> Aggregator:
        agg = Aggregator(env, tmp_path)
        started.append(agg)
        return agg

    yield start_
    for agg in started:
        agg.close()


def report(session: requests.Session, agg: Aggregator, member: str, seq: int = 1) -> requests.Response:
    # Every session connects from 127.0.0.1: the one address all gateways share behind the NAT.
    return session.post(f"http://127.0.0.1:{agg.port}/v1/report", timeout=10,
                        headers={"Authorization": f"Bearer {TOKEN}"},
                        json={"member": member, "seq": seq, "queued": 1, "inFlight": 0})


def served_connection(agg: Aggregator, within: float = 5.0) -> socket.socket:
    """A connection the aggregator answers. The connection the test closed just before is counted
    against the address until the server's thread reads its end, so a refusal is retried briefly:
    a cap lower than advertised still fails once ``within`` has passed."""
    deadline = time.monotonic() + within
    while True:
        sock = socket.create_connection(("127.0.0.1", agg.port), timeout=5)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n")
        head = sock.recv(64)
        if head.startswith(b"HTTP/1.1 200"):
            return sock
        sock.close()
        assert time.monotonic() < deadline, f"a connection within the cap was refused: {head!r}"
        time.sleep(0.05)


def test_the_aggregators_defaults_refuse_the_third_gateway_behind_one_address(start) -> None:
    env = {k: v for k, v in rendered_env(REPLICAS).items() if "PER_ADDRESS" not in k}
    agg = start(env)
    with requests.Session() as s:
        assert [report(s, agg, f"gateway-{i}").status_code for i in range(REPLICAS)] == [200, 200, 429]


def test_the_rendered_caps_take_every_gateway_and_a_full_rollout_from_one_address(start) -> None:
    env = rendered_env(REPLICAS)
    agg = start(env)
    members = 2 * REPLICAS  # every gateway and the old Pod it replaces, both still reporting
    assert int(env["NOCTAYA_MAX_MEMBERS_PER_ADDRESS"]) == members
    sessions = [requests.Session() for _ in range(members)]  # one keep-alive connection each, held
    try:
        for round_ in (1, 2):  # and again on the same connections: the heartbeat of each
            outcomes = [report(s, agg, f"gateway-{i}", seq=round_) for i, s in enumerate(sessions)]
            assert [r.status_code for r in outcomes] == [200] * members
            assert outcomes[-1].json() == {"outcome": "accepted", "members": members}
        # A member beyond every gateway's allowance is still refused: the cap is a cap.
        with requests.Session() as extra:
            assert report(extra, agg, "one-too-many").status_code == 429
        # Each reporting process's connection, and as many again for reconnects, from that address.
        held: list[socket.socket] = []
        try:
            for _ in range(int(env["NOCTAYA_MAX_CONNECTIONS_PER_ADDRESS"]) - members):
                held.append(served_connection(agg))
        finally:
            for sock in held:
                sock.close()
        # The held connections just closed are counted against the address until the server's threads
        # read their ends (as in served_connection): a scrape refused meanwhile is retried briefly.
        deadline = time.monotonic() + 5.0
        while (scrape := requests.get(f"http://127.0.0.1:{agg.port}/metrics", timeout=10)).status_code != 200:
            assert time.monotonic() < deadline, scrape.status_code
            time.sleep(0.05)
        assert f"noctaya_aggregator_queued {float(members)}" in scrape.text
    finally:
        for s in sessions:
            s.close()
