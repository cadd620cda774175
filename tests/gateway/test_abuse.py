"""The gateway under abuse (issue #19), as real processes on real sockets: `python -m gateway` from the
env the hooks render for an example LLMService, the fake backend on 127.0.0.1, and clients bound to
many loopback source addresses. Every limit is exercised at the limit:

- a public pool full (requests in progress: idle connections are evicted) cannot fail the kubelet's probes (admin port), and requests
  held before the flood complete;
- slowloris heads, bodies, chunked bodies and chunked trailers (many addresses and one) end at the
  head's deadline, or the body's grace + one minimum-rate window, with a JSON 408, holding no slot and making no demand meanwhile; one address
  gets exactly its per-address cap of connections;
- JSON bombs (10 MiB of small values, 100,000-deep nesting, 8 MiB exactly) on cold streamed requests
  under a 256 MiB memory limit: 400/413 JSON, no activation, the whole Pod tree under the limit;
- a worker SIGKILLed while holding most of the held-body budget gives its bytes back;
- `/v1/models` never feeds the time-to-first-token histogram;
- a client that hangs up after pipelining more bytes frees its slot within 2 s;
- a `Connection: close` or HTTP/1.0 client that leaves a cold hold (FIN or reset) frees its slot and
  its demand (the queue and KEDA's GetMetrics) within 1 s;
- HTTP/1.0 connection semantics.

Each of these runs twice (the ``shared`` fixture): against a per-model gateway and against a shared
gateway (NOCTAYA_MODEL_TABLE_FILE) fronting the same model, with its settings as table fields, beside
a second model; bodies name the rendered model. Not the worker SIGKILL test: a shared gateway is one
process, with no worker to kill. Its own limits are tested besides: one model flooded at ten times its
maxQueue takes none of another model's slots, and the Pod-wide held-body budget at its limit refuses
a cold model's body (429 queue_full), never a warm model's, and is free again once the held requests complete.
"""

from __future__ import annotations

import http.client
import json
import os
import select
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from gateway.policy import MAX_JSON_DEPTH
from scaler import externalscaler_pb2 as pb
from scaler import externalscaler_pb2_grpc as pb_grpc
from tests.gateway.abuse_harness import (
    OTHER_MODEL,
    ActiveStream,
    GatewayPod,
    MemoryCgroup,
    MiB,
    PeakTreeRSS,
    Reader,
    Response,
    chat,
    connect,
    container_port,
    exchange,
    fake_cgroup_root,
    get,
    model_name,
    no_demand,
    rendered_env,
    rendered_gateway_container,
    request_bytes,
    wait_until,
)
from tests.gateway.fakebackend import FakeBackend

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(params=[False, True], ids=["per-model", "shared"])
def shared(request: pytest.FixtureRequest) -> bool:
    """Each test against a per-model gateway and against a shared gateway fronting the same model
    (its table entry from the rendered settings) beside another model."""
    return request.param

DEADLINE = 2.0  # NOCTAYA_CLIENT_REQUEST_TIMEOUT_SECONDS in these tests
# A body below the minimum rate is cut after the grace and one window: 1 s + 1 s, the head's DEADLINE.
PACE = {"NOCTAYA_CLIENT_BODY_GRACE_SECONDS": "1", "NOCTAYA_CLIENT_MIN_RATE_WINDOW_SECONDS": "1"}
TTFT = "noctaya_gateway_time_to_first_token_seconds"


def chat_request(body: bytes, **kw) -> bytes:
    return request_bytes("POST", "/v1/chat/completions", body, **kw)


def assert_error(response: Response | None, status: int, code: str, *, close: bool | None = None) -> dict:
    assert response is not None, f"closed without the {status} {code} answer"
    assert response.status == status, (response.status, response.raw, response.body[:300])
    assert response.headers.get("content-type", "").startswith("application/json"), response.raw
    error = response.json()["error"]
    assert error["code"] == code, error
    if close is not None:
        assert (response.headers.get("connection", "").lower() == "close") is close, response.raw
    return error


def silent(sock: socket.socket) -> bool:
    """Open, with nothing to read (no answer, no EOF)."""
    readable, _, _ = select.select([sock], [], [], 0)
    return not readable


def linger_reset(sock: socket.socket) -> None:
    """close() sends a RST instead of a FIN."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


# -- the rendered Deployment ----------------------------------------------------------------------
def test_rendered_probes_target_the_admin_port() -> None:
    container = rendered_gateway_container()
    env = rendered_env()
    assert int(env["NOCTAYA_ADMIN_PORT"]) == container_port("admin")
    for kind in ("livenessProbe", "readinessProbe"):
        probe = container[kind]["httpGet"]
        assert probe["path"] == "/healthz" and probe["port"] == "admin", (kind, probe)
    assert "NOCTAYA_CLIENT_REQUEST_TIMEOUT_SECONDS" not in env or float(env["NOCTAYA_CLIENT_REQUEST_TIMEOUT_SECONDS"]) > 0


# -- 1. a public pool full of idle connections -------------------------------------------------------
def test_a_public_pool_full_of_idle_connections_cannot_fail_the_probes(shared: bool) -> None:
    backend = FakeBackend()  # not started: the backend is scaled to zero
    max_connections = 64
    per_address = max_connections // 8  # the default cap: NOCTAYA_MAX_CONNECTIONS_PER_ADDRESS not set
    pod = GatewayPod(backend.port, shared=shared, NOCTAYA_GATEWAY_WORKERS="1", NOCTAYA_MAX_CONNECTIONS=str(max_connections),
                     NOCTAYA_SCALER_MODE="off", NOCTAYA_CLIENT_REQUEST_TIMEOUT_SECONDS="60")
    held: list[socket.socket] = []
    flood: list[socket.socket] = []
    started = b"GET /healthz HTTP/1.1\r\n"  # a request in progress: its connection is never evicted
    try:
        # Requests held before the flood (cold: they wait for the backend).
        for i in range(3):
            sock = connect(pod.port, "127.0.0.1", timeout=60)
            sock.sendall(chat_request(chat(content=f"held {i}")))
            held.append(sock)
        wait_until(lambda: pod.queue()["queued"] == 3, 15, "three held requests")
        # One address may hold exactly the default cap of requests in progress...
        for _ in range(per_address):
            flood.append(connect(pod.port, "127.0.0.2"))
            flood[-1].sendall(started)
        time.sleep(0.3)
        refused = Reader(connect(pod.port, "127.0.0.2", timeout=5))
        assert_error(refused.response(), 429, "too_many_connections", close=True)
        assert refused.closed(5)
        # ...and requests in progress from other addresses fill the rest of the pool. (Idle connections
        # would not: a full pool evicts the oldest idle one, tests/gateway/test_public_fairness.py.)
        for i in range(max_connections - 3 - per_address):
            flood.append(connect(pod.port, f"127.0.0.{3 + i % 7}"))
            flood[-1].sendall(started)
        time.sleep(0.5)
        # The flood is open, not refused or answered.
        assert all(silent(sock) for sock in flood)
        # The public port is saturated: a fresh request there gets no 200, a 429 at once.
        blocked = connect(pod.port, "127.0.0.20", timeout=5)
        try:
            first = blocked.recv(65536)
        except (TimeoutError, ConnectionResetError):
            first = b""
        blocked.close()
        assert first.startswith(b"HTTP/1.1 429") and b"too_many_connections" in first, first[:200]
        # The kubelet probes what the hooks rendered: /healthz on the `admin` port, each on a new connection.
        timeout = min(rendered_gateway_container()[k]["timeoutSeconds"] for k in ("livenessProbe", "readinessProbe"))
        slowest = 0.0
        for _ in range(20):
            started = time.monotonic()
            answer = get(pod.admin_port, rendered_gateway_container()["livenessProbe"]["httpGet"]["path"], timeout=timeout)
            slowest = max(slowest, time.monotonic() - started)
            assert answer.status == 200 and answer.json() == {"status": "ok"}
        assert slowest < min(1.0, timeout), slowest
        assert pod.queue()["queued"] == 3
        # The backend wakes: the requests held before the flood are answered.
        backend.start()
        for sock in held:
            sock.settimeout(30)
            response = Reader(sock).response()
            assert response is not None and response.status == 200, response
            assert response.json()["object"] == "chat.completion"
    finally:
        for sock in held + flood:
            sock.close()
        backend.stop()
        logs = pod.stop()
    assert "Traceback" not in logs


# -- 2. slowloris ---------------------------------------------------------------------------------------
SLOW_INTERVAL = 0.25


@dataclass
class Slow:
    """One slowloris connection: ``prefix`` at once, then ``drip`` one byte every SLOW_INTERVAL."""

    kind: str
    source: str
    prefix: bytes
    drip: bytes
    sock: socket.socket | None = None
    started: float = 0.0
    sent: int = 0
    dripping: bool = True
    reply: bytes = b""
    closed_at: float | None = None
    reset: bool = False
    last: float = 0.0
    errors: list[str] = field(default_factory=list)


def slow_kinds(source: str) -> list[Slow]:
    body = chat(stream=True)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
    chunked_head = head + b"Transfer-Encoding: chunked\r\n\r\n"
    return [
        Slow("head", source, head, b"X-Slow: " + b"a" * 4000),
        Slow("body", source, head + b"Content-Length: %d\r\n\r\n" % (len(body) + 4000) + body[:-1], b" " * 4000),
        Slow("chunked-body", source, chunked_head + b"%x\r\n" % (len(body) + 4000) + body[:-1], b" " * 4000),
        Slow("chunked-trailers", source, chunked_head + b"%x\r\n%s\r\n0\r\n" % (len(body), body),
             b"X-Trailer: " + b"a" * 4000),
    ]


def run_slowloris(port: int, attackers: list[Slow], until: float, stop: threading.Event) -> None:
    """Drive every attacker from this thread until all are closed, ``until`` passes or ``stop``."""
    for a in attackers:
        a.sock = connect(port, a.source)
        a.sock.sendall(a.prefix)
        a.started = a.last = time.monotonic()
        a.sent = len(a.prefix)
        a.sock.setblocking(False)
    while time.monotonic() < until and not stop.is_set() and any(a.closed_at is None for a in attackers):
        now = time.monotonic()
        for a in attackers:
            if a.closed_at is not None:
                continue
            try:
                data = a.sock.recv(65536)
                if not data:
                    a.closed_at = now
                    continue
                a.reply += data
                a.dripping = False  # answered: stop sending, read to the end
            except BlockingIOError:
                pass
            except OSError as exc:  # reset by the gateway
                a.errors.append(type(exc).__name__)
                a.reset, a.closed_at = True, now
                continue
            if a.dripping and now - a.last >= SLOW_INTERVAL and a.sent - len(a.prefix) < len(a.drip):
                try:
                    a.sock.send(a.drip[a.sent - len(a.prefix):a.sent - len(a.prefix) + 1])
                    a.sent += 1
                    a.last = now
                except BlockingIOError:
                    pass
                except OSError as exc:  # the gateway shut the socket: keep reading what it wrote
                    a.errors.append(type(exc).__name__)
                    a.dripping = False
        time.sleep(0.02)


def test_slowloris_heads_bodies_and_trailers_end_at_the_request_deadline(shared: bool) -> None:
    backend = FakeBackend()  # cold
    max_queue = 4
    pod = GatewayPod(backend.port, shared=shared, NOCTAYA_GATEWAY_WORKERS="2", NOCTAYA_MAX_QUEUE=str(max_queue),
                     NOCTAYA_CLIENT_REQUEST_TIMEOUT_SECONDS=str(DEADLINE), NOCTAYA_SCALER_MODE="local",
                     NOCTAYA_ACTIVATION_TIMEOUT_SECONDS="60", **PACE)
    stream = ActiveStream(pod.scaler_port, pod.ref)
    attackers = [a for i in range(24) for a in slow_kinds(f"127.0.0.{2 + i}")]  # many addresses
    attackers += [a for _ in range(6) for a in slow_kinds("127.0.0.100")]  # and one address
    legit: list[socket.socket] = []
    stop = threading.Event()
    driver = None
    try:
        wait_until(stream.opened.is_set, 10, "the first StreamIsActive value")
        assert not stream.saw_true and stream.is_active() is False
        driver = threading.Thread(target=run_slowloris, args=(pod.port, attackers, time.monotonic() + 30, stop),
                                  daemon=True)
        driver.start()
        wait_until(lambda: all(a.sent > len(a.prefix) + 2 or a.reply or a.closed_at for a in attackers), 10,
                   "every attacker dripping")
        early = [(a.kind, a.source, a.reply[:80], a.errors) for a in attackers if a.reply or a.closed_at]
        assert not early, early  # nothing is answered before the deadline
        # Mid-attack: no slot, no demand, no lease, and KEDA is never told to wake the backend.
        no_demand(pod)
        assert stream.is_active() is False
        # Legitimate traffic from another address is served meanwhile, and every slot is free for it.
        models = get(pod.port, "/v1/models", source="127.0.0.200", timeout=5)
        assert models.status == 200 and models.json()["data"][0]["id"] == pod.model
        assert all(a.closed_at is None for a in attackers)  # still mid-request
        assert not stream.saw_true, stream.values
        for i in range(max_queue):
            sock = connect(pod.port, "127.0.0.201", timeout=60)
            sock.sendall(chat_request(chat(content=f"legit {i}")))
            legit.append(sock)
        wait_until(lambda: pod.queue()["queued"] == max_queue, 10, "every legitimate request admitted")
        driver.join(30)
        assert not driver.is_alive()
        # Every attacker ended at the deadline with a JSON 408 and a closed connection: a slow head's
        # may be retried, a body below the minimum rate's says a retry cannot help.
        late = [(a.kind, a.source, round(a.closed_at - a.started, 2)) for a in attackers
                if a.closed_at is None or not DEADLINE - 0.1 <= a.closed_at - a.started <= DEADLINE + 2.0]
        assert not late, late
        for a in attackers:
            assert a.sent > len(a.prefix) + 4, (a.kind, a.sent)  # it really was dribbling
            response = Reader.of(a.reply).response()
            if a.kind == "head":
                assert_error(response, 408, "request_timeout", close=True)
                assert b"x-should-retry" not in a.reply.lower()
            else:
                assert_error(response, 408, "client_too_slow", close=True)
                assert b"x-should-retry: false" in a.reply.lower()
            assert error_type(a.reply) == "invalid_request_error"
        # Nothing left behind: only the legitimate requests are queued, holding only their own bytes.
        q = pod.queue()
        assert q["queued"] == max_queue and q["inFlight"] == 0, q
        assert q["heldBytes"] == sum(len(chat(content=f"legit {i}")) for i in range(max_queue)), q
        backend.start()
        for sock in legit:
            response = Reader(sock).response()
            assert response is not None and response.status == 200, response
    finally:
        stop.set()
        if driver is not None:
            driver.join(5)
        stream.close()
        for a in attackers:
            if a.sock is not None:
                a.sock.close()
        for sock in legit:
            sock.close()
        backend.stop()
        logs = pod.stop()
    assert "Traceback" not in logs


def test_idle_connections_are_closed_silently_by_the_idle_timeout_not_the_request_deadline(shared: bool) -> None:
    backend = FakeBackend().start()
    idle, deadline = 3.0, 1.0
    pod = GatewayPod(backend.port, shared=shared, NOCTAYA_GATEWAY_WORKERS="1", NOCTAYA_SCALER_MODE="off",
                     NOCTAYA_CLIENT_REQUEST_TIMEOUT_SECONDS=str(deadline), NOCTAYA_CLIENT_IDLE_TIMEOUT_SECONDS=str(idle))
    try:
        fresh = connect(pod.port)  # nothing sent: no request has begun, so its deadline does not run
        used = connect(pod.port)  # idle between two requests of a keep-alive connection
        used.sendall(request_bytes("GET", "/v1/models"))
        used_reader = Reader(used)
        assert used_reader.response().status == 200
        opened = time.monotonic()
        time.sleep(deadline + 1.0)
        assert silent(fresh) and silent(used)  # past the request deadline: still open, nothing written
        readers = [Reader(fresh), used_reader]
        for reader in readers:
            assert reader.closed(idle + 2.0), "idle connection not closed by the idle timeout"
            assert reader.buf == b"", reader.buf  # closed silently: no 408 for a request that never began
        closed_after = time.monotonic() - opened
        assert idle - 0.5 <= closed_after <= idle + 2.0, closed_after
        fresh.close()
        used.close()
    finally:
        backend.stop()
        logs = pod.stop()
    assert "Traceback" not in logs


def error_type(raw: bytes) -> str:
    return json.loads(raw[raw.index(b"\r\n\r\n") + 4:])["error"]["type"]


def test_one_address_gets_exactly_its_connection_cap(shared: bool) -> None:
    backend = FakeBackend().start()
    cap = 8
    pod = GatewayPod(backend.port, shared=shared, NOCTAYA_GATEWAY_WORKERS="1", NOCTAYA_MAX_CONNECTIONS="64",
                     NOCTAYA_MAX_CONNECTIONS_PER_ADDRESS=str(cap), NOCTAYA_SCALER_MODE="off")
    open_: list[tuple[socket.socket, Reader]] = []
    try:
        def served(source: str) -> tuple[socket.socket, Reader]:
            sock = connect(pod.port, source)
            sock.sendall(request_bytes("GET", "/v1/models"))
            reader = Reader(sock)
            response = reader.response()
            assert response is not None and response.status == 200, (source, response)
            assert response.headers.get("connection", "").lower() != "close"
            return sock, reader

        def refused(source: str) -> None:
            reader = Reader(connect(pod.port, source))
            reader.sock.sendall(request_bytes("GET", "/v1/models"))
            assert_error(reader.response(), 429, "too_many_connections", close=True)
            assert reader.closed(5)
            reader.sock.close()

        get = request_bytes("GET", "/v1/models")
        for _ in range(cap):  # exactly the cap: all accepted, all kept open
            open_.append(served("127.0.0.5"))
        # cap + 1 while all of them are idle: that address's oldest idle connection is closed for it.
        oldest = open_.pop(0)
        open_.append(served("127.0.0.5"))
        assert oldest[1].closed(5) and oldest[1].buf == b""  # silently, as the idle timeout would
        oldest[0].close()
        # cap + 1 while every one of them has a request in progress: nothing to evict, refused.
        for sock, _ in open_:
            sock.sendall(get[:8])
        refused("127.0.0.5")
        open_.append(served("127.0.0.6"))  # another address is unaffected
        for sock, reader in open_[:cap]:  # the capped ones' requests were never touched
            sock.sendall(get[8:])
            assert reader.response().status == 200
        # Closing one (the others busy again) frees exactly one place for that address.
        for sock, _ in open_[:cap]:
            sock.sendall(get[:8])
        sock, _ = open_.pop(0)
        sock.close()
        wait_until(lambda: _accepted(pod.port, "127.0.0.5", open_), 5, "the freed place reused")
        open_[-1][0].sendall(get[:8])
        refused("127.0.0.5")
    finally:
        for sock, _ in open_:
            sock.close()
        backend.stop()
        logs = pod.stop()
    assert "Traceback" not in logs


def _accepted(port: int, source: str, keep: list) -> bool:
    sock = connect(port, source)
    sock.sendall(request_bytes("GET", "/v1/models"))
    reader = Reader(sock)
    response = reader.response()
    if response is not None and response.status == 200:
        keep.append((sock, reader))
        return True
    sock.close()
    return False


# -- 3. JSON bombs under a 256 MiB memory limit ----------------------------------------------------------
LIMIT = 256 * MiB
MAX_BODY = 8 * MiB
# The rendered model's name: a shared gateway routes the bodies that are admitted by it.
_PREFIX = (b'{"model":%s,"stream":true,"messages":[{"role":"user","content":"hi"}],"x":'
           % json.dumps(model_name()).encode())


def small_values(size: int) -> bytes:
    """A valid JSON object of exactly ``size`` bytes, mostly ``{}`` values (each a dict when parsed
    naively: ~100 bytes of Python objects per 3 bytes of JSON)."""
    n = (size - len(_PREFIX) - 5) // 3
    doc = _PREFIX + b"[" + b"{}," * n + b"{}]"
    doc += b" " * (size - len(doc) - 1) + b"}"
    assert len(doc) == size
    return doc


def nested(depth: int, size: int | None = None) -> bytes:
    """A JSON object whose deepest value is ``depth`` containers down (the object itself is 1)."""
    inner = depth - 1
    doc = _PREFIX + b"[" * inner + b"]" * inner
    if size is not None:
        doc += b" " * (size - len(doc) - 1)
    return doc + b"}"


def deepest(size: int) -> bytes:
    """As deep as ``size`` bytes allow (about size / 2), exactly ``size`` bytes."""
    return nested((size - len(_PREFIX) - 1) // 2, size)


def memory(rss: PeakTreeRSS, cgroup: MemoryCgroup) -> str:
    return (f"peak RSS of the tree so far {rss.peak / MiB:.0f} MiB, cgroup peak "
            f"{(cgroup.peak() or 0) / MiB:.0f} MiB, OOM kills in the cgroup {cgroup.oom_kills()}")


def chunked_request(body: bytes, piece: int = 64 * 1024) -> bytes:
    out = [b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
           b"Transfer-Encoding: chunked\r\n\r\n"]
    for i in range(0, len(body), piece):
        part = body[i:i + piece]
        out.append(b"%x\r\n%s\r\n" % (len(part), part))
    out.append(b"0\r\n\r\n")
    return b"".join(out)


def test_json_bombs_on_cold_streams_stay_under_256_mib_and_wake_nothing(tmp_path: Path, shared: bool) -> None:
    cgroup = MemoryCgroup(LIMIT)
    backend = FakeBackend()  # cold
    pod = None
    try:
        # The gateway derives its held-body budget from the limit, as in a container with memory.max 256Mi
        # (the real cgroup, when there is one, also enforces it on the whole process tree).
        pod = GatewayPod(backend.port, shared=shared, cgroup=cgroup if cgroup.available else None,
                         NOCTAYA_CGROUP_ROOT=fake_cgroup_root(tmp_path / "cgroup", LIMIT),
                         NOCTAYA_SCALER_MODE="local", NOCTAYA_CLIENT_REQUEST_TIMEOUT_SECONDS="60",
                         NOCTAYA_ACTIVATION_TIMEOUT_SECONDS="120")
        assert int(pod.env["NOCTAYA_MAX_BODY_BYTES"]) == MAX_BODY
        q = pod.queue()
        assert q["heldBytesLimit"] == LIMIT // 4, q
        if cgroup.available:
            procs = (cgroup.path / "cgroup.procs").read_text().split()
            # One worker is the whole Pod: one process serves HTTP and KEDA's scaler (gateway.workers).
            assert str(pod.proc.pid) in procs and len(procs) == 1, procs
        stream = ActiveStream(pod.scaler_port, pod.ref)
        wait_until(stream.opened.is_set, 10, "the first StreamIsActive value")
        ten_mib = small_values(10 * MiB)
        deep = nested(100_000)
        at_limit_deep = deepest(MAX_BODY)
        assert len(at_limit_deep) == MAX_BODY
        over_by_one = deepest(MAX_BODY + 1)
        assert len(over_by_one) == MAX_BODY + 1
        attacks: list[tuple[str, bytes, int, str]] = []
        for _ in range(2):
            attacks += [
                ("10 MiB small values", chat_request(ten_mib), 413, "request_too_large"),
                ("10 MiB small values, chunked", chunked_request(ten_mib), 413, "request_too_large"),
                ("8 MiB + 1", chat_request(over_by_one), 413, "request_too_large"),
                ("8 MiB + 1, chunked", chunked_request(over_by_one), 413, "request_too_large"),
                ("8 MiB exactly, 4M deep", chat_request(at_limit_deep), 400, "invalid_json"),
            ]
        for _ in range(4):
            attacks += [
                ("100,000 deep", chat_request(deep), 400, "invalid_json"),
                ("100,000 deep, chunked", chunked_request(deep), 400, "invalid_json"),
            ]
        attacks += [
            ("depth 65", chat_request(nested(MAX_JSON_DEPTH + 1)), 400, "invalid_json"),
            ("depth 65, chunked", chunked_request(nested(MAX_JSON_DEPTH + 1)), 400, "invalid_json"),
            ("malformed", chat_request(b'{"model":"m","stream":true,"messages":['), 400, "invalid_json"),
            ("top-level array", chat_request(b'[{"model":"m","stream":true}]'), 400, "invalid_json"),
            ("top-level string", chat_request(b'"stream"'), 400, "invalid_json"),
            ("trailing garbage", chat_request(chat(stream=True) + b"}"), 400, "invalid_json"),
        ]
        results: dict[int, Response | None | BaseException] = {}

        def attack(i: int, raw: bytes) -> None:
            try:
                results[i] = exchange(pod.port, raw, source=f"127.0.1.{1 + i}", timeout=30)
            except BaseException as exc:  # noqa: BLE001 - reported below
                results[i] = exc

        with PeakTreeRSS(pod.proc.pid) as rss:
            threads = [threading.Thread(target=attack, args=(i, raw), daemon=True) for i, (_, raw, _, _) in enumerate(attacks)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(90)
            for i, (what, _, status, code) in enumerate(attacks):
                result = results.get(i)
                assert not isinstance(result, BaseException) and result is not None, (what, result, memory(rss, cgroup))
                assert_error(result, status, code)
            # Nothing was admitted or woken by any of it.
            no_demand(pod)
            assert pod.queue()["heldBytes"] == 0
            assert not stream.saw_true and stream.is_active() is False, stream.values
            # Exactly at the limits, valid bodies are admitted: 8 MiB of small values (two at once) and
            # nesting MAX_JSON_DEPTH deep. They are held (the stream committed) and answered once the backend wakes.
            accepted = [chat_request(small_values(MAX_BODY)), chat_request(small_values(MAX_BODY)),
                        chat_request(nested(MAX_JSON_DEPTH)),
                        chat_request(chat(stream=True, content="[{" * 5000))]  # brackets in a string are not depth
            socks = []
            for i, raw in enumerate(accepted):
                sock = connect(pod.port, f"127.0.2.{1 + i}", timeout=60)
                try:
                    sock.sendall(raw)
                except OSError as exc:
                    raise AssertionError(f"at-limit body {i} cut while sending ({exc!r}); {memory(rss, cgroup)}; "
                                         f"gateway log tail: {pod.logs()[-1500:]}") from None
                socks.append(sock)
            readers = [Reader(s) for s in socks]
            wait_until(lambda: pod.queue()["queued"] == len(accepted), 60, "the at-limit bodies admitted")
            wait_until(lambda: stream.saw_true, 10, "the activation pushed")
            backend.start()
            for reader in readers:
                response = reader.response()
                assert response is not None and response.status == 200, response
                assert response.headers["content-type"].startswith("text/event-stream")
                assert b"data: [DONE]" in response.body and b"event: error" not in response.body, response.body[-300:]
                reader.sock.close()
        stream.close()
        peak_cgroup = cgroup.peak()
        print(f"\npeak RSS of the gateway tree ({rss.max_processes} processes, {rss.samples} samples) "
              f"{rss.peak / MiB:.0f} MiB; cgroup {f'v{cgroup.version}' if cgroup.available else 'none'} peak "
              f"{'-' if peak_cgroup is None else f'{peak_cgroup / MiB:.0f} MiB'} under {LIMIT / MiB:.0f} MiB")
        # The sampler ran through the attack (every 20 ms; a fast machine gets through it all in ~1 s).
        assert rss.samples >= 5 and rss.max_processes == 1
        assert rss.peak < LIMIT
        if peak_cgroup is not None:
            assert peak_cgroup < LIMIT
        assert cgroup.oom_kills() == 0
        assert pod.proc.poll() is None
        assert "worker exited" not in pod.logs()
    finally:
        backend.stop()
        logs = pod.stop() if pod is not None else ""
        cgroup.remove()
    assert "Traceback" not in logs


# -- 4. a worker killed while holding most of the budget ---------------------------------------------
def test_a_worker_killed_mid_hold_returns_its_bytes_at_once(tmp_path: Path) -> None:
    backend = FakeBackend()  # cold
    pod = GatewayPod(backend.port, NOCTAYA_GATEWAY_WORKERS="2", NOCTAYA_SCALER_MODE="off",
                     NOCTAYA_CGROUP_ROOT=fake_cgroup_root(tmp_path / "cgroup", LIMIT),
                     NOCTAYA_CLIENT_REQUEST_TIMEOUT_SECONDS="60", NOCTAYA_ACTIVATION_TIMEOUT_SECONDS="120")
    budget = LIMIT // 4
    size = 7 * MiB
    body = small_values(size)
    held: list[socket.socket] = []
    try:
        assert pod.queue()["heldBytesLimit"] == budget
        assert len(pod.workers()) == 2

        def send(source: str, held_when: Callable[[dict], bool]) -> tuple[socket.socket, Response | None]:
            """A large cold request: (socket, None) once the Pod's figures say it is held (``held_when``)
            with no answer, else its answer; a connection closed without one raises ConnectionError."""
            sock = connect(pod.port, source, timeout=30)
            try:
                sock.sendall(chat_request(body))
            except (BrokenPipeError, ConnectionResetError):
                pass
            reader = Reader(sock)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                sock.settimeout(0.2)
                try:
                    response = reader.response()
                except TimeoutError:
                    if held_when(pod.queue()) and silent(sock):
                        sock.settimeout(60)
                        return sock, None
                    continue
                sock.close()
                if response is None:
                    raise ConnectionError("closed without an answer")
                return sock, response
            raise AssertionError("neither held nor answered in 20 s")

        i = 0
        while len(held) < budget // size:
            before = pod.queue()["queued"]
            sock, refusal = send(f"127.0.3.{1 + i}", lambda q, before=before: q["queued"] == before + 1)
            i += 1
            assert refusal is None, refusal
            held.append(sock)
        q = pod.queue()
        assert q["heldBytes"] == len(held) * len(chat_request(body).split(b"\r\n\r\n", 1)[1]) and q["heldBytes"] <= budget
        # Full: the next one does not fit.
        _, refusal = send("127.0.3.200", lambda q: False)
        error = assert_error(refusal, 429, "queue_full")
        assert "bytes" in error["message"], error
        # Kill the worker holding the most, mid-hold.
        rows = [w for w in q["perWorker"] if w["queued"]]
        assert len(rows) == 2, q["perWorker"]  # both workers hold some (the kernel spread the connections)
        victim = max(rows, key=lambda w: w["queued"])
        survivor_queued = q["queued"] - victim["queued"]
        os.kill(victim["pid"], signal.SIGKILL)
        killed = time.monotonic()

        def without_victim(q: dict) -> bool:
            return q["queued"] == survivor_queued + 1 and victim["pid"] not in [w["pid"] for w in q["perWorker"]]

        def admitted() -> bool:
            try:
                sock, refusal = send(f"127.0.4.{int((time.monotonic() - killed) * 10) % 250 + 1}", without_victim)
            except ConnectionError:
                return False  # queued on the dead worker's listening socket in the instant it died
            if refusal is None:
                held.append(sock)
                return True
            assert_error(refusal, 429, "queue_full")
            return False

        wait_until(admitted, 5, "a request that fits the budget admitted after the kill", interval=0.2)
        took = time.monotonic() - killed
        assert took < 6, took
        seen: list[dict] = []

        def settled() -> dict | None:
            seen.append(pod.queue())
            return seen[-1] if seen[-1]["queued"] == survivor_queued + 1 else None

        try:
            q = wait_until(settled, 5, "the Pod's figures without the dead worker")
        except AssertionError:
            raise AssertionError(f"survivor held {survivor_queued}, one admitted since; the Pod says {seen[-1]}") from None
        assert q["heldBytes"] == (survivor_queued + 1) * len(chat_request(body).split(b"\r\n\r\n", 1)[1]), q
        assert victim["pid"] not in [w["pid"] for w in q["perWorker"]]
        wait_until(lambda: len(pod.workers()) == 2, 10, "a replacement worker")
        print(f"\nadmitted {took:.2f}s after SIGKILL of a worker holding {victim['queued']} bodies")
    finally:
        for sock in held:
            sock.close()
        backend.stop()
        logs = pod.stop()
    assert "worker exited; restarting" in logs and "Traceback" not in logs


# -- 5. /v1/models and the time-to-first-token histogram -------------------------------------------------
def test_models_listing_never_feeds_time_to_first_token(shared: bool) -> None:
    backend = FakeBackend()  # cold at first
    pod = GatewayPod(backend.port, shared=shared, NOCTAYA_GATEWAY_WORKERS="1", NOCTAYA_SCALER_MODE="off",
                     NOCTAYA_READY_GRACE_SECONDS="60", NOCTAYA_ACTIVATION_TIMEOUT_SECONDS="60")
    keep = connect(pod.port, timeout=30)
    reader = Reader(keep)
    try:
        def ttft() -> tuple[tuple[float, float], tuple[float, float]]:
            return pod.histogram(TTFT, 'start="cold"'), pod.histogram(TTFT, 'start="warm"')

        def models_calls() -> None:
            # A fresh connection each (the fake backend knows only the list; while cold the gateway answers
            # the model's own path too).
            for path in ("/v1/models", f"/v1/models/{pod.model}") if not backend.running else ("/v1/models",) * 2:
                assert get(pod.port, path).status == 200
            for _ in range(2):  # reused connection
                keep.sendall(request_bytes("GET", "/v1/models"))
                response = reader.response()
                assert response is not None and response.status == 200 and response.json()["data"], response

        baseline = ttft()
        assert baseline[0][0] == 0 and baseline[1][0] == 0
        # Cold: the listing is answered by the gateway; errors feed nothing either.
        models_calls()
        assert_error(exchange(pod.port, chat_request(b'{"model":'), timeout=5), 400, "invalid_json")
        assert get(pod.port, "/nothing").status == 404
        assert ttft() == baseline
        # A cold chat completion on the kept-alive connection: one cold observation once answered.
        keep.sendall(chat_request(chat()))
        wait_until(lambda: pod.queue()["queued"] == 1, 10, "held")
        backend.start()
        response = reader.response()
        assert response is not None and response.status == 200 and response.json()["object"] == "chat.completion"
        # /metrics is served from the control thread: an observation made just after the answer's last
        # write may land a moment after the client has read it.
        after_cold = wait_until(lambda: (t := ttft())[0][0] == 1 and t, 10, "the cold observation")
        assert after_cold[1] == baseline[1], after_cold
        # Warm: the listing is forwarded, on fresh connections and on the one that carried the cold request.
        models_calls()
        if shared:  # a shared gateway lists its table, warm or cold: the backend is never asked
            assert not backend.requests_to("/v1/models")
        else:
            assert backend.requests_to("/v1/models")  # really forwarded now
        assert ttft() == after_cold
        # A warm chat completion adds exactly one warm observation.
        assert exchange(pod.port, chat_request(chat())).status == 200
        (cold, warm) = wait_until(lambda: (t := ttft())[1][0] == after_cold[1][0] + 1 and t, 10, "a warm observation")
        assert cold == after_cold[0]
        # Keep-alive: a request after an idle second is timed from its own arrival.
        time.sleep(1.5)
        keep.sendall(chat_request(chat()))
        assert reader.response().status == 200
        (cold2, warm2) = wait_until(lambda: (t := ttft())[1][0] == warm[0] + 1 and t, 10, "a warm observation")
        assert cold2 == cold and warm2[1] - warm[1] < 1.0, (warm, warm2)
        # Pipelined: two requests in one write; the second waits for the first and is timed from its own
        # arrival (with the first's wait), so both are counted and their sum covers both waits.
        backend.response_delay = 0.5
        keep.sendall(chat_request(chat()) + chat_request(chat()))
        assert reader.response().status == 200 and reader.response().status == 200
        (cold3, warm3) = wait_until(lambda: (t := ttft())[1][0] == warm2[0] + 2 and t, 10, "two warm observations")
        assert cold3 == cold, (warm2, warm3)
        assert warm3[1] - warm2[1] >= 1.4, (warm2, warm3)  # ~0.5 + ~1.0
        models_calls()
        assert ttft() == (cold3, warm3)
    finally:
        keep.close()
        backend.stop()
        logs = pod.stop()
    assert "Traceback" not in logs


# -- 6. hang-up after pipelined bytes ---------------------------------------------------------------------
@pytest.mark.parametrize("pipelined, pause, reset", [
    (b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n", 0.0, False),
    (b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n", 0.5, False),
    (b"POST /v1/chat/completions HTTP/1.1\r\nContent-Le", 0.5, False),
    (b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n", 0.5, True),
    (b"POST /v1/chat/completions HTTP/1.1\r\nContent-Le", 0.0, True),
], ids=["whole-fin", "whole-pause-fin", "partial-pause-fin", "whole-pause-rst", "partial-rst"])
def test_a_hang_up_after_pipelined_bytes_frees_the_slot(pipelined: bytes, pause: float, reset: bool,
                                                      shared: bool) -> None:
    backend = FakeBackend()  # cold
    pod = GatewayPod(backend.port, shared=shared, NOCTAYA_GATEWAY_WORKERS="1", NOCTAYA_SCALER_MODE="off",
                     NOCTAYA_ACTIVATION_TIMEOUT_SECONDS="60")
    try:
        sock = connect(pod.port, timeout=30)
        sock.sendall(chat_request(chat()))
        wait_until(lambda: pod.queue()["queued"] == 1, 10, "held")
        sock.sendall(pipelined)
        time.sleep(pause)
        assert pod.queue()["queued"] == 1  # still held while the client is there
        assert silent(sock)  # nothing answered yet: it really was waiting
        if reset:
            linger_reset(sock)
        else:
            sock.close()
        gone = time.monotonic()
        wait_until(lambda: pod.queue()["queued"] == 0, 2.0, "the slot freed after the hang-up", interval=0.05)
        print(f"\nfreed {time.monotonic() - gone:.2f}s after the hang-up")
        assert pod.queue()["heldBytes"] == 0
    finally:
        backend.stop()
        logs = pod.stop()
    assert "Traceback" not in logs


GHOSTS = {  # clients whose FIN used to pass for a half-close: their ghosts held a slot and demand
    "connection-close": {"headers": {"Connection": "close"}},
    "http-1.0": {"version": "1.0"},
}


def demand_metric(stub: pb_grpc.ExternalScalerStub, ref: pb.ScaledObjectRef) -> int:
    """What KEDA's GetMetrics reads."""
    reply = stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref, metricName="noctaya-demand"), timeout=5)
    return reply.metricValues[0].metricValue


@pytest.mark.parametrize("reset", [False, True], ids=["fin", "rst"])
def test_connection_close_and_http_1_0_ghosts_are_freed_within_a_second(reset: bool, shared: bool) -> None:
    """Two workers, the local scaler: each held ghost shows in the queue and in GetMetrics, and both
    are gone within a second of the client's FIN (or reset)."""
    backend = FakeBackend()  # cold, never ready
    pod = GatewayPod(backend.port, shared=shared, NOCTAYA_GATEWAY_WORKERS="2", NOCTAYA_SCALER_MODE="local",
                     NOCTAYA_ACTIVATION_TIMEOUT_SECONDS="60")
    channel = grpc.insecure_channel(f"127.0.0.1:{pod.scaler_port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=20)
        stub = pb_grpc.ExternalScalerStub(channel)
        for kind, shape in GHOSTS.items():
            sock = connect(pod.port, timeout=30)
            sock.sendall(chat_request(chat(), **shape))
            wait_until(lambda: pod.queue()["queued"] == 1 and demand_metric(stub, pod.ref) == 1, 10, f"{kind} held")
            time.sleep(0.3)  # past the watchdog's tick
            assert pod.queue()["queued"] == 1 and silent(sock), kind
            if reset:
                linger_reset(sock)
            else:
                sock.close()
            gone = time.monotonic()
            wait_until(lambda: pod.queue()["queued"] == 0 and demand_metric(stub, pod.ref) == 0, 1.0,
                       f"the {kind} ghost's slot and demand freed", interval=0.02)
            print(f"\n{kind}: freed {time.monotonic() - gone:.2f}s after the hang-up")
            assert pod.queue()["heldBytes"] == 0
        assert backend.requests_to("/v1/chat/completions") == []
    finally:
        channel.close()
        backend.stop()
        logs = pod.stop()
    assert "Traceback" not in logs


# -- 7. HTTP/1.0 ------------------------------------------------------------------------------------------
class HTTP10Connection(http.client.HTTPConnection):
    _http_vsn = 10
    _http_vsn_str = "HTTP/1.0"


def test_http_1_0_closes_unless_asked_to_keep_alive(shared: bool) -> None:
    backend = FakeBackend()  # cold first, then warm
    pod = GatewayPod(backend.port, shared=shared, NOCTAYA_GATEWAY_WORKERS="1", NOCTAYA_SCALER_MODE="off",
                     NOCTAYA_READY_GRACE_SECONDS="60")
    try:
        def check(method: str, path: str, body: bytes | None, expect: int) -> None:
            # The stdlib's own HTTP/1.0 client.
            client = HTTP10Connection("127.0.0.1", pod.port, timeout=30)
            client.request(method, path, body=body, headers={"Content-Type": "application/json"} if body else {})
            answer = client.getresponse()
            assert answer.status == expect and answer.getheader("Connection", "").lower() == "close"
            answer.read()
            client.close()
            # Raw: without keep-alive the connection closes after the answer...
            sock = connect(pod.port)
            reader = Reader(sock)
            sock.sendall(request_bytes(method, path, body, version="1.0"))
            response = reader.response()
            assert response.status == expect and response.headers.get("connection", "").lower() == "close", response.raw
            assert reader.closed(5), "HTTP/1.0 without keep-alive: the connection must close"
            sock.close()
            # ...and with `Connection: keep-alive` it stays open for a second request.
            sock = connect(pod.port)
            reader = Reader(sock)
            for _ in range(2):
                sock.sendall(request_bytes(method, path, body, version="1.0", headers={"Connection": "keep-alive"}))
                response = reader.response()
                assert response is not None and response.status == expect, response
                assert response.headers.get("connection", "").lower() == "keep-alive", response.raw
            sock.close()

        check("GET", "/v1/models", None, 200)  # cold: answered by the gateway
        check("GET", "/nothing", None, 404)
        check("GET", "/healthz", None, 200)
        backend.start()
        assert exchange(pod.port, chat_request(chat())).status == 200  # warm now
        check("GET", "/v1/models", None, 200)  # forwarded
        check("POST", "/v1/chat/completions", chat(), 200)
        assert len(backend.requests_to("/v1/chat/completions")) == 1 + 4  # every one forwarded once
    finally:
        backend.stop()
        logs = pod.stop()
    assert "Traceback" not in logs


# -- 8. a shared gateway: one model's flood, the Pod's held-body budget -------------------------------------
def test_a_shared_gateway_keeps_one_models_flood_off_the_others_slots() -> None:
    """The rendered model (a, cold, maxQueue 4) flooded at ten times its queue from many addresses: it
    holds exactly 4 and refuses the rest 429 queue_full; meanwhile b (warm, maxQueue 4) serves 4
    concurrent requests at once, all in flight together, and a's held requests complete when its
    backend wakes."""
    a_backend = FakeBackend()  # cold
    b_backend = FakeBackend().start()
    b_backend.response_delay = 1.0  # b's four requests overlap: all of b's slots in use at once
    max_queue = 4
    pod = GatewayPod(a_backend.port, shared=True, other_backend_port=b_backend.port, other_model={"maxQueue": 4},
                     NOCTAYA_MAX_QUEUE=str(max_queue), NOCTAYA_SCALER_MODE="off",
                     NOCTAYA_ACTIVATION_TIMEOUT_SECONDS="60", NOCTAYA_CLIENT_REQUEST_TIMEOUT_SECONDS="60")
    flood: list[socket.socket] = []
    try:
        for i in range(10 * max_queue):
            sock = connect(pod.port, f"127.0.5.{1 + i}", timeout=60)
            sock.sendall(chat_request(chat(content=f"flood {i}")))
            flood.append(sock)
        readers = [Reader(s) for s in flood]
        wait_until(lambda: pod.queue()["queued"] == max_queue, 10, "a's queue full")
        refused, held = [], []
        for reader in readers:
            reader.sock.settimeout(1.0)
            try:
                refused.append(reader.response())
            except TimeoutError:
                held.append(reader)
        assert len(held) == max_queue and len(refused) == 9 * max_queue, (len(held), len(refused))
        for response in refused:
            assert_error(response, 429, "queue_full")
            assert response.headers.get("retry-after")
        page = pod.shared_queue()["models"]
        assert page[OTHER_MODEL]["queued"] == 0 and page[OTHER_MODEL]["inFlight"] == 0  # a took none of b's

        results: list[Response | None] = [None] * 4
        started = time.monotonic()

        def ask_b(i: int) -> None:
            results[i] = exchange(pod.port, chat_request(chat(model=OTHER_MODEL, content=f"b {i}")),
                                  source=f"127.0.6.{1 + i}", timeout=30)

        threads = [threading.Thread(target=ask_b, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        wait_until(lambda: pod.shared_queue()["models"][OTHER_MODEL]["inFlight"] == 4, 5, "b's four in flight")
        for t in threads:
            t.join(30)
        assert [r.status if r else None for r in results] == [200] * 4
        assert time.monotonic() - started < 1.0 * 4  # together, not one after another
        assert pod.queue()["queued"] == max_queue  # a still holds its own
        a_backend.start()
        for reader in held:
            reader.sock.settimeout(30)
            response = reader.response()
            assert response is not None and response.status == 200, response
        assert len(a_backend.requests_to("/v1/chat/completions")) == max_queue
    finally:
        for sock in flood:
            sock.close()
        a_backend.stop()
        b_backend.stop()
        logs = pod.stop()
    assert "Traceback" not in logs


def test_a_shared_gateways_held_body_budget_is_the_pods_at_its_limit() -> None:
    """The held-body budget (3 MiB + 64 KiB) is one for the Pod (each model's share set to all of it
    here): three cold 1 MiB bodies of a and a 64 KiB one fill it to the byte; one byte more for a is
    refused 429 queue_full (request bytes, Retry-After). Held bytes never refuse a warm model: b's
    1 MiB body is served meanwhile (issue 29: it was refused for a's bytes). Once a's backend wakes and
    its bodies are answered, the budget is free again."""
    a_backend = FakeBackend()  # cold
    b_backend = FakeBackend().start()
    budget = 3 * MiB + 64 * 1024
    pod = GatewayPod(a_backend.port, shared=True, other_backend_port=b_backend.port,
                     NOCTAYA_MAX_HELD_BODY_BYTES=str(budget), NOCTAYA_MAX_BODY_BYTES=str(MiB),
                     NOCTAYA_SCALER_MODE="off", NOCTAYA_ACTIVATION_TIMEOUT_SECONDS="60",
                     NOCTAYA_CLIENT_REQUEST_TIMEOUT_SECONDS="60", NOCTAYA_HELD_BODY_SHARE_PER_MODEL="1")

    def body(model: str, size: int) -> bytes:
        doc = chat(model=model, content="")
        return doc.replace(b'"content": ""', b'"content": "' + b"x" * (size - len(doc)) + b'"')

    held: list[Reader] = []
    try:
        assert pod.queue()["heldBytesLimit"] == budget
        big_a, big_b, small_b = body(pod.model, MiB), body(OTHER_MODEL, MiB), body(OTHER_MODEL, 64 * 1024)
        small_a, one_more = body(pod.model, 64 * 1024), body(pod.model, 64 * 1024 + 1)
        assert len(big_a) == len(big_b) == MiB and len(small_b) == len(small_a) == 64 * 1024
        # b's first request shows the gateway its backend is up (until then b counts as cold, and its
        # bodies would be held like a's).
        first = exchange(pod.port, chat_request(small_b), timeout=30)
        assert first is not None and first.status == 200, first
        for i, raw in enumerate((big_a, big_a, big_a, small_a)):
            sock = connect(pod.port, f"127.0.7.{1 + i}", timeout=60)
            sock.sendall(chat_request(raw))
            held.append(Reader(sock))
            wait_until(lambda i=i: pod.queue()["queued"] == i + 1, 10, f"a's body {i + 1} held")
        assert pod.queue()["heldBytes"] == budget  # to the byte
        for raw in (one_more, big_a):  # refused once complete: the connection may carry another request
            answer = exchange(pod.port, chat_request(raw), timeout=30)
            error = assert_error(answer, 429, "queue_full", close=False)
            assert "bytes" in error["message"] and answer.headers.get("retry-after"), error
        served = exchange(pod.port, chat_request(big_b), timeout=30)  # warm: held bytes do not refuse it
        assert served is not None and served.status == 200, served
        assert len(b_backend.requests_to("/v1/chat/completions")) == 2
        assert pod.queue()["heldBytes"] == budget and pod.queue()["queued"] == 4
        a_backend.start()
        for reader in held:
            response = reader.response()
            assert response is not None and response.status == 200, response
        wait_until(lambda: pod.queue()["heldBytes"] == 0, 5, "the budget freed on completion")
        for raw in (big_b, small_b, big_a):
            response = exchange(pod.port, chat_request(raw), timeout=30)
            assert response is not None and response.status == 200, response
    finally:
        for reader in held:
            reader.sock.close()
        a_backend.stop()
        b_backend.stop()
        logs = pod.stop()
    assert "Traceback" not in logs
