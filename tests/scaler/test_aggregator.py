"""Aggregate scaler: member table rules (injected clock) and the HTTP endpoint on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import requests

from scaler import externalscaler_pb2 as pb
from scaler import externalscaler_pb2_grpc as pb_grpc
from scaler.aggregator import Aggregator, AggregatorSettings, MemberTable, Report, ReportError, parse_report
from scaler.demand import Demand, DemandBroadcaster
from scaler.service import start_scaler_server

from .conftest import wait_until

TOKEN = "s3cr3t-token-value"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def report(member: str, seq: int, queued: int = 0, in_flight: int = 0, lease: bool = False,
           withdraw: bool = False) -> Report:
    return Report(member, seq, queued, in_flight, lease, withdraw)


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


def settings(token_file: Path, **overrides: object) -> AggregatorSettings:
    return AggregatorSettings(token_file=str(token_file), **overrides)


# -- MemberTable ------------------------------------------------------------------------------


def test_sum_of_members(token_file) -> None:
    table = MemberTable(settings(token_file))
    assert table.apply(report("a", 1, queued=2, in_flight=1)) == "accepted"
    assert table.apply(report("b", 1, queued=3, lease=True)) == "accepted"
    assert table.total() == Demand(queued=5, in_flight=1, lease_active=True)


def test_newest_seq_wins_and_older_or_equal_is_ignored(token_file) -> None:
    table = MemberTable(settings(token_file))
    table.apply(report("a", 5, queued=5))
    assert table.apply(report("a", 5, queued=9)) == "stale"
    assert table.apply(report("a", 3, queued=9)) == "stale"
    assert table.total().queued == 5
    assert table.apply(report("a", 6, queued=1)) == "accepted"
    assert table.total().queued == 1


def test_per_member_demand_is_clamped(token_file) -> None:
    table = MemberTable(settings(token_file, max_member_demand=100))
    table.apply(report("a", 1, queued=10**9, in_flight=10**9))
    table.apply(report("b", 1, queued=30, in_flight=500))
    assert table.total() == Demand(queued=130, in_flight=70)


def test_ttl_expiry_with_injected_clock(token_file) -> None:
    clock = FakeClock()
    table = MemberTable(settings(token_file, member_ttl=10.0), clock)
    table.apply(report("a", 1, queued=1))
    clock.now += 5
    table.apply(report("b", 1, queued=2))
    clock.now += 5  # a is exactly at the TTL: still alive
    assert table.expire() == 0 and len(table) == 2
    clock.now += 0.5
    assert table.expire() == 1 and table.total() == Demand(queued=2)
    clock.now += 5
    assert table.expire() == 1 and len(table) == 0


def test_withdraw_removes_member_and_blocks_late_older_reports(token_file) -> None:
    clock = FakeClock()
    table = MemberTable(settings(token_file), clock)
    table.apply(report("a", 1, queued=4))
    assert table.apply(report("a", 2, withdraw=True)) == "withdrawn"
    assert len(table) == 0 and table.total() == Demand()
    assert table.apply(report("a", 1, queued=4)) == "stale"  # delayed packet can't resurrect it
    clock.now += 11
    assert table.apply(report("a", 1, queued=4)) == "accepted"  # tombstone gone after one TTL


def test_member_cap(token_file) -> None:
    table = MemberTable(settings(token_file, max_members=3))
    assert [table.apply(report(f"m{i}", 1, queued=1)) for i in range(5)] == ["accepted"] * 3 + ["full"] * 2
    assert table.apply(report("m0", 2, queued=7)) == "accepted"  # existing members keep reporting
    assert len(table) == 3 and table.total().queued == 9


def test_tombstones_are_bounded(token_file) -> None:
    table = MemberTable(settings(token_file, max_members=4))
    for i in range(100):
        table.apply(report(f"w{i}", 1, withdraw=True))
    assert len(table._tombstones) <= 4


@pytest.mark.parametrize("payload", [
    [], {"seq": 1}, {"member": "", "seq": 1}, {"member": "a/b", "seq": 1}, {"member": "a"},
    {"member": "a", "seq": -1}, {"member": "a", "seq": 1, "queued": "3"}, {"member": "a", "seq": True},
    {"member": "a", "seq": 1, "leaseActive": "yes"}, {"member": "x" * 200, "seq": 1},
])
def test_report_validation(payload) -> None:
    with pytest.raises(ReportError):
        Report.from_json(payload)


# -- HTTP endpoint ----------------------------------------------------------------------------


@pytest.fixture
def make_aggregator(token_file):
    started: list[Aggregator] = []

    def make(**overrides: object) -> Aggregator:
        clock = overrides.pop("clock", time.monotonic)
        agg = Aggregator(settings(token_file, **overrides), DemandBroadcaster(), clock=clock)
        agg.start("127.0.0.1", 0)
        started.append(agg)
        return agg

    yield make
    for agg in started:
        agg.stop()


class _FromAddress(requests.adapters.HTTPAdapter):
    """Connections from a given loopback source address: each one plays a different Pod."""

    def __init__(self, source: str) -> None:
        self.source = source
        super().__init__()

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        kwargs["source_address"] = (self.source, 0)
        super().init_poolmanager(*args, **kwargs)


def post(agg: Aggregator, body: object, token: str | None = TOKEN, source: str = "127.0.0.1",
         **kwargs: object) -> requests.Response:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    with requests.Session() as session:
        session.mount("http://", _FromAddress(source))
        return session.post(f"http://127.0.0.1:{agg.port}/v1/report", json=body, headers=headers, timeout=10, **kwargs)


def test_report_updates_broadcaster_and_health(make_aggregator) -> None:
    agg = make_aggregator()
    r = post(agg, {"member": "g1", "seq": 1, "queued": 2, "inFlight": 1, "leaseActive": True, "withdraw": False})
    assert r.status_code == 200 and r.json() == {"outcome": "accepted", "members": 1}
    post(agg, {"member": "g2", "seq": 1, "queued": 4})
    assert agg.broadcaster.current() == Demand(queued=6, in_flight=1, lease_active=True)
    assert requests.get(f"http://127.0.0.1:{agg.port}/healthz", timeout=10).json()["members"] == 2
    metrics = requests.get(f"http://127.0.0.1:{agg.port}/metrics", timeout=10).text
    assert "noctaya_aggregator_members 2.0" in metrics and "noctaya_aggregator_queued 6.0" in metrics
    assert TOKEN not in metrics


def test_auth_required_and_token_rotation(make_aggregator, token_file) -> None:
    agg = make_aggregator()
    body = {"member": "g1", "seq": 1, "queued": 1}
    for token in (None, "wrong", TOKEN + "x", ""):
        r = post(agg, body, token=token)
        assert r.status_code == 401 and TOKEN not in r.text
    r = requests.post(f"http://127.0.0.1:{agg.port}/v1/report", json=body, timeout=10,
                      headers={"Authorization": f"Basic {TOKEN}"})
    assert r.status_code == 401
    assert agg.member_count == 0
    token_file.write_text("rotated-token")
    assert post(agg, body).status_code == 401
    assert post(agg, body, token="rotated-token").status_code == 200
    token_file.unlink()
    assert post(agg, {"member": "g1", "seq": 2}, token="rotated-token").status_code == 401


def test_body_over_the_limit_is_413_without_reading_it(make_aggregator) -> None:
    agg = make_aggregator()
    limit = agg.settings.max_body_bytes
    assert limit == 384 * 1024  # the default: a shared gateway's 256 models of 256 characters, each with its ScaledObject, fit
    with socket.create_connection(("127.0.0.1", agg.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/report HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (limit + 1)
        )  # no body sent at all: the answer must come from the headers alone
        assert sock.recv(4096).startswith(b"HTTP/1.1 413")
    big = {"member": "g1", "seq": 1, "pad": "x" * (limit + 10)}
    assert post(agg, big).status_code == 413
    exactly = json.dumps({"member": "g1", "seq": 1, "pad": ""}).encode()
    padded = exactly[:-2] + b"x" * (limit - len(exactly)) + b'"}'
    assert len(padded) == limit
    r = requests.post(f"http://127.0.0.1:{agg.port}/v1/report", data=padded, timeout=10,
                      headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    assert r.status_code == 200


def test_bad_json_is_400(make_aggregator) -> None:
    agg = make_aggregator()
    r = requests.post(f"http://127.0.0.1:{agg.port}/v1/report", data=b"{not json", timeout=10,
                      headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
    assert post(agg, {"member": "g1", "seq": "1"}).status_code == 400


def test_parse_report_refuses_what_json_loads_would_build_or_recurse_on() -> None:
    assert parse_report(b'{"member":"g1","seq":1,"queued":2}') == Report("g1", 1, 2, 0, False, False)
    for body, message in [
        (b"[]", "report must be a JSON object"), (b'"x"', "report must be a JSON object"),
        (b'{"member":"g1","seq":1,"extra":{}}', "report must be a flat JSON object (no nested values)"),
        (b'{"member":"g1","seq":1,"pad":[' + b"0," * 30_000 + b"0]}", "report must be a flat JSON object (no nested values)"),
        (b'{"member":"g1","seq":' + b"[" * 100_000, "report must be a flat JSON object (no nested values)"),
        (b"", "empty body"), (b'{"member":"g1","seq":1', "body is not valid JSON"),
        (b'{"member":"g1","seq":NaN}', "body is not valid JSON"), (b'{"member":"g\xff","seq":1}', "body is not valid UTF-8"),
    ]:
        with pytest.raises(ReportError) as info:
            parse_report(body)
        assert str(info.value).startswith(message), body  # the scanner may say where (a byte offset)


def test_hostile_report_bodies_are_400_before_any_state_changes(make_aggregator) -> None:
    agg = make_aggregator()
    assert post(agg, {"member": "g1", "seq": 1, "queued": 3}).status_code == 200
    limit = agg.settings.max_body_bytes

    def raw(body: bytes) -> requests.Response:
        return requests.post(f"http://127.0.0.1:{agg.port}/v1/report", data=body, timeout=10,
                             headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})

    def at_limit(head: bytes, unit: bytes, tail: bytes) -> bytes:
        body = head + unit * ((limit - len(head) - len(tail)) // len(unit))
        body += b" " * (limit - len(body) - len(tail)) + tail
        assert len(body) == limit
        return body

    hostile = [
        at_limit(b'{"member":"g1","seq":2,"queued":0,"pad":', b"[", b""),  # ~64 K levels deep
        at_limit(b'{"member":"g1","seq":2,"queued":0,"pad":[', b"[],", b"[]]}"),  # 21 K empty lists
        at_limit(b'{"member":"g1","seq":2,"queued":0,"pad":[', b"0,", b"0]}"),
        at_limit(b"[", b"0,", b"0]"),  # not an object
    ]
    for body in hostile:
        r = raw(body)
        assert r.status_code == 400 and r.json()["error"]["code"] == 400, r.text
    assert agg.broadcaster.current() == Demand(queued=3, in_flight=0, lease_active=False)  # seq 2 never applied
    # a flat report at the limit is still read
    flat = at_limit(b'{"member":"g1","seq":3,"queued":5,"pad":"', b"x", b'"}')
    assert raw(flat).status_code == 200
    assert agg.broadcaster.current() == Demand(queued=5, in_flight=0, lease_active=False)
    assert agg.member_count == 1


def _hold_report(port: int) -> socket.socket:
    """A report whose body never finishes arriving: it holds one report slot."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/report HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
                 + b"\r\nContent-Length: 100\r\n\r\n{")
    return sock


def _slots_exhausted(agg: Aggregator) -> bool:
    if agg.try_begin_report():
        agg.end_report()
        return False
    return True


def test_concurrent_report_flood_gets_429(make_aggregator) -> None:
    # Slow bodies hold their report slots here (no per-request deadline, no per-address cap): this
    # is about the report-slot bound alone.
    agg = make_aggregator(max_concurrent_reports=4, max_connections=64, request_deadline=60.0,
                          max_connections_per_address=1000)
    held = [_hold_report(agg.port) for _ in range(4)]
    try:
        assert wait_until(lambda: _slots_exhausted(agg), timeout=10)

        def flood(i: int) -> int:
            return post(agg, {"member": f"f{i}", "seq": 1, "queued": 1}).status_code

        with ThreadPoolExecutor(32) as pool:
            codes = list(pool.map(flood, range(100)))
        assert codes == [429] * 100
        assert agg.member_count == 0
    finally:
        for sock in held:
            sock.close()
    assert wait_until(lambda: post(agg, {"member": "after", "seq": 1, "queued": 1}).status_code == 200)


def test_member_cap_flood(make_aggregator) -> None:
    agg = make_aggregator(max_members=8, max_concurrent_reports=64)

    def flood(i: int) -> int:  # 200 gateways (addresses), one member each
        return post(agg, {"member": f"m{i}", "seq": 1, "queued": 1}, source=f"127.0.3.{i + 1}").status_code

    with ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(flood, range(200)))
    assert codes.count(200) == 8 and codes.count(429) == 192
    assert agg.member_count == 8 and agg.broadcaster.current().queued == 8


class RealGateways:
    """Two gateways reporting a fixed demand every 50 ms from their own addresses, counting answers."""

    def __init__(self, agg: Aggregator) -> None:
        self.agg = agg
        self.ok = 0
        self.failed: list[object] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        seq = 0
        while not self._stop.is_set():
            seq += 1
            for member, source, queued in (("real-a", "127.0.5.1", 3), ("real-b", "127.0.5.2", 4)):
                try:
                    code = post(self.agg, {"member": member, "seq": seq, "queued": queued, "inFlight": 1},
                                source=source).status_code
                except requests.RequestException as exc:
                    code = type(exc).__name__
                if code == 200:
                    self.ok += 1
                else:
                    self.failed.append(code)
            self._stop.wait(0.05)

    def __enter__(self) -> RealGateways:
        self._thread.start()
        assert wait_until(lambda: self.agg.member_count >= 2, timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


EXACT = Demand(queued=7, in_flight=2, lease_active=False)


def test_a_token_holder_cannot_evict_or_overwrite_another_gateway(make_aggregator) -> None:
    agg = make_aggregator()
    with RealGateways(agg) as real:
        for body in ({"member": "real-a", "seq": 2**40, "withdraw": True},
                     {"member": "real-a", "seq": 2**40, "queued": 0},
                     {"member": "real-b", "seq": 2**40, "queued": 100}):
            r = post(agg, body, source="127.0.6.1")  # a valid token, another Pod's address
            assert r.status_code == 403 and "another address" in r.text
        time.sleep(0.3)
        assert agg.member_count == 2 and agg.broadcaster.current() == EXACT
    assert real.ok > 0 and real.failed == []


def test_one_address_cannot_fill_the_member_table(make_aggregator) -> None:
    agg = make_aggregator(max_members=16)
    with RealGateways(agg) as real:
        codes = [post(agg, {"member": f"fake-{i}", "seq": 1, "queued": 50}, source="127.0.6.2").status_code
                 for i in range(40)]
        assert codes.count(200) == 2 and codes.count(429) == 38  # max_members_per_address
        post(agg, {"member": "fake-0", "seq": 2, "withdraw": True}, source="127.0.6.2")
        post(agg, {"member": "fake-1", "seq": 2, "withdraw": True}, source="127.0.6.2")
        time.sleep(0.3)
        assert agg.member_count == 2 and agg.broadcaster.current() == EXACT
        # A new gateway (another address) still gets in.
        assert post(agg, {"member": "new", "seq": 1}, source="127.0.5.3").status_code == 200
    assert real.ok > 0 and real.failed == []


def test_slow_clients_cannot_take_the_slots_real_reports_need(make_aggregator) -> None:
    # 8 addresses x 6 connections, no token, headers dribbled a byte every 0.2 s and never finished.
    # Each address gets at most 4 connections (the rest are refused at once), and each of those is
    # cut at the 1 s request deadline however slowly it keeps sending, so the 64 connection slots
    # are never all taken and real reports keep arriving.
    agg = make_aggregator(max_connections=64, request_deadline=1.0)
    slow: list[socket.socket] = []
    try:
        with RealGateways(agg) as real:
            before = real.ok
            for a in range(8):
                for _ in range(6):
                    sock = socket.socket()
                    sock.bind((f"127.0.7.{a + 1}", 0))
                    sock.settimeout(5)
                    sock.connect(("127.0.0.1", agg.port))
                    try:
                        sock.sendall(b"POST /v1/report HTTP/1.1\r\nHost: x\r\n")
                    except OSError:
                        pass
                    slow.append(sock)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 3.0:
                for sock in slow:
                    try:
                        sock.sendall(b"X")
                    except OSError:
                        pass
                time.sleep(0.2)
            assert all(_closed_by_server(sock) for sock in slow), "a slow client outlived the request deadline"
            assert real.ok - before >= 20  # real reports kept arriving during the attack
            assert agg.broadcaster.current() == EXACT
        assert real.failed == []
    finally:
        for sock in slow:
            sock.close()


def _closed_by_server(sock: socket.socket) -> bool:
    """True when the server has closed (or refused with 503 and closed) this connection."""
    sock.settimeout(2)
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
            if not data.startswith(b"HTTP/1.1 503"):
                return False
    except ConnectionResetError:
        return True
    except OSError:
        return False


def test_connection_cap_answers_503(make_aggregator) -> None:
    agg = make_aggregator(max_connections=3)
    idle = [socket.create_connection(("127.0.0.1", agg.port), timeout=10) for _ in range(3)]
    try:
        assert wait_until(lambda: requests.get(f"http://127.0.0.1:{agg.port}/healthz", timeout=10).status_code == 503)
    finally:
        for sock in idle:
            sock.close()
    assert wait_until(lambda: requests.get(f"http://127.0.0.1:{agg.port}/healthz", timeout=10).status_code == 200)


def test_per_address_connection_cap_at_the_limit(make_aggregator) -> None:
    # Exactly max_connections_per_address idle connections from one address are served; the next is
    # refused at once with 503, and another address is unaffected; a freed slot is reusable.
    agg = make_aggregator(max_connections_per_address=4, request_deadline=30.0)

    def connect(source: str) -> socket.socket:
        sock = socket.socket()
        sock.bind((source, 0))
        sock.settimeout(5)
        sock.connect(("127.0.0.1", agg.port))
        return sock

    def refused(sock: socket.socket) -> bool:
        sock.settimeout(0.5)
        try:
            return sock.recv(4096).startswith(b"HTTP/1.1 503")
        except TimeoutError:
            return False  # held open: served (its handler waits for a request)

    held = [connect("127.0.8.1") for _ in range(4)]
    try:
        time.sleep(0.3)  # let the server take all four
        assert not any(refused(s) for s in held)
        fifth = connect("127.0.8.1")
        assert refused(fifth)
        fifth.close()
        assert post(agg, {"member": "other", "seq": 1}, source="127.0.8.2").status_code == 200
        held.pop().close()
        assert wait_until(lambda: post(agg, {"member": "same", "seq": 1}, source="127.0.8.1").status_code == 200,
                          timeout=5)
    finally:
        for sock in held:
            sock.close()


def test_clamp_stale_withdraw_and_ttl_over_http(make_aggregator) -> None:
    clock = FakeClock()
    agg = make_aggregator(max_member_demand=100, member_ttl=10.0, clock=clock)
    assert post(agg, {"member": "g1", "seq": 10, "queued": 5000, "inFlight": 5000}).status_code == 200
    assert agg.broadcaster.current() == Demand(queued=100, in_flight=0)
    assert post(agg, {"member": "g1", "seq": 9, "queued": 1}).json()["outcome"] == "stale"
    assert post(agg, {"member": "g2", "seq": 1, "inFlight": 3}).status_code == 200
    assert agg.broadcaster.current() == Demand(queued=100, in_flight=3)
    assert post(agg, {"member": "g1", "seq": 11, "withdraw": True}).json()["outcome"] == "withdrawn"
    assert agg.broadcaster.current() == Demand(in_flight=3)
    clock.now += 10.5
    assert agg.expire() == 1  # the expiry thread calls this too; the injected clock decides
    assert agg.broadcaster.current() == Demand() and agg.member_count == 0


def test_aggregator_feeds_the_grpc_scaler(make_aggregator) -> None:
    agg = make_aggregator()
    server = start_scaler_server(agg.broadcaster, 0, host="127.0.0.1")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.ExternalScalerStub(channel)
            stream = stub.StreamIsActive(pb.ScaledObjectRef(name="qwen"), timeout=30)
            assert next(stream).result is False
            received: list[bool] = []
            reader = threading.Thread(target=lambda: received.append(next(stream).result))
            reader.start()
            post(agg, {"member": "g1", "seq": 1, "queued": 1})
            reader.join(10)
            assert received == [True]
            reply = stub.GetMetrics(pb.GetMetricsRequest(metricName="noctaya-demand"), timeout=10)
            assert reply.metricValues[0].metricValue == 1
            stream.cancel()
    finally:
        server.stop(1.0)
