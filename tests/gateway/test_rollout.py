"""A gateway Deployment's rollout under load loses no request.

Real `python -m gateway` processes behind a balancer that behaves like a Service: it sends each new
connection to a gateway whose readiness (`/healthz` on the admin port) answered 200 at its last poll,
polled every POLL_SECONDS, so it learns of a terminating gateway late, as kube-proxy does. The real
`openai` client (its default retries) keeps asking, streamed and not, while every old gateway is
replaced by a new one and sent SIGTERM, one after the other, as a rolling update does.
"""

from __future__ import annotations

import itertools
import signal
import socket
import threading
import time

import openai
import pytest
import requests

from tests.gateway.fakebackend import FakeBackend
from tests.gateway.test_process import GatewayProcess

POLL_SECONDS = 1.0  # how late the balancer learns of a Pod leaving (kube-proxy takes about this long)
DRAIN_DELAY_SECONDS = 3.0  # > POLL_SECONDS: a late connection is still served
MESSAGES = [{"role": "user", "content": "hi"}]


class Balancer:
    """A TCP balancer over the gateways that were ready at its last readiness poll."""

    def __init__(self) -> None:
        self.gateways: list[GatewayProcess] = []
        self._ready: list[GatewayProcess] = []
        self._turn = itertools.count()
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._poll, daemon=True).start()
        threading.Thread(target=self._accept, daemon=True).start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            ready = []
            for gw in list(self.gateways):
                try:
                    if requests.get(gw.admin_url + "/healthz", timeout=1).status_code == 200:
                        ready.append(gw)
                except requests.RequestException:
                    pass
            self._ready = ready
            self._stop.wait(POLL_SECONDS)

    def wait_ready(self, gw: GatewayProcess, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while gw not in self._ready:
            assert time.monotonic() < deadline, "the balancer never saw the gateway ready"
            time.sleep(0.05)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed by close()
                return
            ready = self._ready
            if not ready:
                client.close()  # no endpoint: the client sees a refused connection, as with a Service
                continue
            gw = ready[next(self._turn) % len(ready)]
            try:
                upstream = socket.create_connection(("127.0.0.1", gw.port), timeout=5)
            except OSError:
                client.close()  # a listener already closed: a reset, as kube-proxy's stale rule gives
                continue
            self.connections += 1
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        self._listener.close()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Load:
    """Clients asking one after another through the balancer; every failure is kept."""

    def __init__(self, url: str, clients: int = 4) -> None:
        self.answered = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(url, i % 2 == 0), daemon=True)
                         for i in range(clients)]
        for t in self._threads:
            t.start()

    def _run(self, url: str, stream: bool) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=30)  # the SDK's own retries
        while not self._stop.is_set():
            try:
                if stream:
                    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                        model="m", messages=MESSAGES, stream=True) if c.choices)
                else:
                    text = client.chat.completions.create(model="m", messages=MESSAGES).choices[0].message.content
                assert text, "an empty answer"
                self.answered += 1
            except Exception as exc:  # noqa: BLE001 - every failure is a finding
                self.failures.append(f"{type(exc).__name__}: {exc}"[:300])

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


@pytest.mark.timeout(180)
def test_a_rolling_update_of_the_gateway_fails_no_request() -> None:
    backend = FakeBackend()
    backend.stream_delay = 0.02
    backend.start()
    env = {"NOCTAYA_DRAIN_DELAY_SECONDS": str(DRAIN_DELAY_SECONDS), "NOCTAYA_DRAIN_GRACE_SECONDS": "10"}
    balancer = Balancer()
    started: list[GatewayProcess] = []
    load: Load | None = None
    try:
        for _ in range(2):
            started.append(GatewayProcess(backend, **env))
            balancer.gateways.append(started[-1])
            balancer.wait_ready(started[-1])
        load = Load(balancer.url)
        time.sleep(1.0)
        for old in list(balancer.gateways):  # maxSurge 1, maxUnavailable 0: a new one, then the old one goes
            new = GatewayProcess(backend, **env)
            started.append(new)
            balancer.gateways.append(new)
            balancer.wait_ready(new)
            old.proc.send_signal(signal.SIGTERM)
            assert old.proc.wait(30) == 0
            balancer.gateways.remove(old)
        time.sleep(1.0)
        load.stop()
        assert load.failures == [], load.failures[:5]
        assert load.answered > 50, load.answered
        print(f"\ngateway rollout: {load.answered} answered, 0 failed, {balancer.connections} connections")
    finally:
        if load is not None:
            load.stop()
        balancer.close()
        for gw in started:
            gw.stop()
        backend.stop()
