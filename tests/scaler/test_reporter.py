"""DemandReporter against a real aggregator on 127.0.0.1."""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path

import pytest

from scaler.aggregator import MAX_REPORT_MODELS, Aggregator, AggregatorSettings
from scaler.demand import Demand, DemandBroadcaster
from scaler.reporter import DemandReporter

from .conftest import REPORT_TOKEN as TOKEN
from .conftest import wait_until


@pytest.fixture
def aggregator(token_file: Path):
    agg = Aggregator(AggregatorSettings(token_file=str(token_file), member_ttl=1.0), DemandBroadcaster())
    agg.start("127.0.0.1", 0)
    yield agg
    agg.stop()


def url(agg: Aggregator) -> str:
    return f"http://127.0.0.1:{agg.port}/v1/report"


def test_reports_changes_heartbeats_and_withdraws(aggregator, token_file) -> None:
    local = DemandBroadcaster()
    reporter = DemandReporter(url(aggregator), str(token_file), local, interval=0.2).start()
    try:
        assert wait_until(lambda: aggregator.member_count == 1)
        local.publish(Demand(queued=3, lease_active=True))
        assert wait_until(lambda: aggregator.broadcaster.current() == Demand(queued=3, lease_active=True))
        local.publish(Demand(queued=1, in_flight=2))
        assert wait_until(lambda: aggregator.broadcaster.current() == Demand(queued=1, in_flight=2))
        # Heartbeats every 0.2 s keep the member alive past the 1 s TTL without any change.
        sent = reporter.sent
        time.sleep(1.5)
        assert aggregator.member_count == 1 and reporter.sent >= sent + 4
        assert aggregator.broadcaster.current() == Demand(queued=1, in_flight=2)
    finally:
        reporter.stop()
    assert aggregator.member_count == 0 and aggregator.broadcaster.current() == Demand()


def test_first_active_edge_is_sent_at_once(aggregator, token_file) -> None:
    local = DemandBroadcaster()
    pushed: list[float] = []
    reporter = DemandReporter(url(aggregator), str(token_file), local, interval=30.0, on_pushed=pushed.append).start()
    try:
        assert wait_until(lambda: aggregator.member_count == 1)
        t0 = time.monotonic()
        local.publish(Demand(queued=1))
        assert wait_until(lambda: aggregator.broadcaster.current().active, timeout=10)
        assert time.monotonic() - t0 < 5.0  # correctness bound; far below the 30 s heartbeat
        # The gateway times its activation by this edge: reported once, when the aggregator took it.
        assert wait_until(lambda: len(pushed) == 1) and t0 <= pushed[0] <= time.monotonic()
        local.publish(Demand(queued=2))
        local.publish(Demand(in_flight=1))
        time.sleep(0.3)
        assert len(pushed) == 1  # more demand while active is no new push
    finally:
        reporter.stop()


def test_two_gateways_are_summed_and_a_silent_one_expires(aggregator, token_file) -> None:
    a, b = DemandBroadcaster(Demand(queued=2)), DemandBroadcaster(Demand(in_flight=5))
    ra = DemandReporter(url(aggregator), str(token_file), a, interval=0.2).start()
    rb = DemandReporter(url(aggregator), str(token_file), b, interval=0.2).start()
    try:
        assert wait_until(lambda: aggregator.broadcaster.current() == Demand(queued=2, in_flight=5))
        rb.stop(withdraw=False)  # a crash: no withdraw, the TTL must drop it
        assert wait_until(lambda: aggregator.broadcaster.current() == Demand(queued=2), timeout=10)
    finally:
        ra.stop()


def test_burst_of_changes_is_coalesced(aggregator, token_file) -> None:
    local = DemandBroadcaster()
    reporter = DemandReporter(url(aggregator), str(token_file), local, interval=5.0, min_gap=0.05).start()
    try:
        assert wait_until(lambda: aggregator.member_count == 1)
        t0 = time.monotonic()
        for i in range(1, 2001):
            local.publish(Demand(queued=i % 50 + 1))
        publish_time = time.monotonic() - t0
        local.publish(Demand(queued=77))
        assert wait_until(lambda: aggregator.broadcaster.current() == Demand(queued=77))
        elapsed = time.monotonic() - t0
        assert reporter.sent <= 3 + elapsed / 0.05  # bounded by the gap, not by the 2001 changes
        assert publish_time < 5.0
    finally:
        reporter.stop()


def test_wrong_token_fails_without_logging_it(aggregator, tmp_path, caplog) -> None:
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token-XYZ")
    local = DemandBroadcaster(Demand(queued=1))
    caplog.set_level(logging.DEBUG)
    reporter = DemandReporter(url(aggregator), str(wrong), local, interval=0.1, retry_delay=0.05).start()
    try:
        assert wait_until(lambda: reporter.failures >= 3)
        assert aggregator.member_count == 0
    finally:
        reporter.stop()
    text = caplog.text
    assert "401" in text and "not-the-token-XYZ" not in text and TOKEN not in text


def test_hanging_aggregator_never_blocks_the_publisher(token_file) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)  # accepts connections, never answers
    local = DemandBroadcaster()
    reporter = DemandReporter(f"http://127.0.0.1:{listener.getsockname()[1]}/v1/report", str(token_file), local,
                              interval=0.2, timeout=0.3).start()
    try:
        t0 = time.monotonic()
        for i in range(1000):
            local.publish(Demand(queued=i % 7))
        assert time.monotonic() - t0 < 2.0
        assert wait_until(lambda: reporter.failures >= 2, timeout=10)
    finally:
        t0 = time.monotonic()
        stopper = threading.Thread(target=reporter.stop)
        stopper.start()
        stopper.join(10)
        assert not stopper.is_alive() and time.monotonic() - t0 < 5.0
        listener.close()


def test_missing_token_file_is_a_logged_failure(aggregator, tmp_path) -> None:
    reporter = DemandReporter(url(aggregator), str(tmp_path / "absent"), DemandBroadcaster(), interval=0.1,
                              retry_delay=0.05).start()
    try:
        assert wait_until(lambda: reporter.failures >= 2)
        assert reporter.sent == 0
    finally:
        reporter.stop()


def test_reporter_inside_a_gevent_patched_process(aggregator, token_file) -> None:
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("_gevent_reporter_probe.py")), url(aggregator), str(token_file)],
        cwd=root, env={"PYTHONPATH": str(root), "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "published"  # type: ignore[union-attr]
        assert wait_until(lambda: aggregator.broadcaster.current() == Demand(queued=4, lease_active=True))
        time.sleep(0.5)  # a few heartbeats while the hub keeps ticking
        proc.stdin.write("\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        facts = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert facts["failures"] == 0 and facts["sent"] >= 3 and facts["ticks"] >= 20
    assert aggregator.member_count == 0  # withdrawn


def test_failures_back_off_to_the_interval(tmp_path) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    listener.close()  # nothing listens: every report is refused at connect
    token = tmp_path / "t"
    token.write_text("x")
    reporter = DemandReporter(f"http://127.0.0.1:{port}/v1/report", str(token), DemandBroadcaster(Demand(queued=1)),
                              interval=0.4, retry_delay=0.05).start()
    try:
        time.sleep(2.0)
    finally:
        reporter.stop(withdraw=False)
    # 0.05, 0.1, 0.2, then 0.4 s apart: about 7 attempts in 2 s, never the 40 of a fixed 0.05 s retry
    assert 3 <= reporter.failures <= 12


def test_logged_url_has_no_credentials() -> None:
    from scaler.reporter import _without_userinfo

    assert _without_userinfo("http://u:pw@agg.models:9091/v1/report") == "http://agg.models:9091/v1/report"
    assert _without_userinfo("http://agg:9091/v1/report") == "http://agg:9091/v1/report"


@pytest.mark.parametrize("updated_first", ["aggregator", "gateway"])
def test_a_token_rotation_loses_no_report_whichever_pod_sees_it_first(tmp_path: Path, updated_first: str) -> None:
    """The hooks rotate the token: the Secret now holds the new `token` and the old one as
    `previous-token`. The kubelet updates each Pod's copy on its own schedule."""
    old, new = "token-epoch-0-0123456789", "token-epoch-1-9876543210"
    agg_dir, gw_dir = tmp_path / "aggregator", tmp_path / "gateway"
    for directory in (agg_dir, gw_dir):
        directory.mkdir()
        (directory / "token").write_text(old)
        (directory / "previous-token").write_text(old)
    ahead = agg_dir if updated_first == "aggregator" else gw_dir
    (ahead / "token").write_text(new)
    (ahead / "previous-token").write_text(old)
    agg = Aggregator(AggregatorSettings(token_file=str(agg_dir / "token"),
                                        previous_token_file=str(agg_dir / "previous-token")), DemandBroadcaster())
    agg.start("127.0.0.1", 0)
    broadcaster = DemandBroadcaster()
    reporter = DemandReporter(url(agg), str(gw_dir / "token"), broadcaster, interval=0.2,
                              previous_token_file=str(gw_dir / "previous-token")).start()
    try:
        broadcaster.publish(Demand(queued=3, in_flight=1, lease_active=True))
        assert wait_until(lambda: agg.broadcaster.current() == Demand(3, 1, True), timeout=10)
        assert reporter.failures == 0
        # A token from neither epoch is still refused.
        (gw_dir / "token").write_text("a-token-nobody-issued-0000")
        (gw_dir / "previous-token").write_text("a-token-nobody-issued-1111")
        failures = reporter.failures
        broadcaster.publish(Demand(queued=5, in_flight=1, lease_active=True))
        assert wait_until(lambda: reporter.failures > failures, timeout=10)
        assert agg.broadcaster.current() == Demand(3, 1, True)
    finally:
        reporter.stop(withdraw=False)
        agg.stop()


def test_a_per_model_gateways_report_is_unchanged_on_the_wire(token_file) -> None:
    """Without models (a per-model gateway) the body is what it always was, byte for byte (what
    requests' json= produced); with models it adds only the ``models`` object."""
    import json
    from http.server import BaseHTTPRequestHandler, HTTPServer

    bodies: list[bytes] = []

    class Capture(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - stdlib name
            bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
            assert self.headers["Content-Type"] == "application/json"
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *_: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Capture)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        target = f"http://127.0.0.1:{server.server_port}/v1/report"
        flat = DemandReporter(target, str(token_file), DemandBroadcaster(Demand(2, 1, True)), member_id="m1")
        assert flat._post(Demand(2, 1, True))
        assert bodies[-1] == json.dumps({"member": "m1", "seq": 1, "queued": 2, "inFlight": 1, "leaseActive": True,
                                         "withdraw": False}).encode()
        demands = {"a": Demand(1, 0, True), "idle": Demand(), "ü": Demand(0, 2, False)}
        shared = DemandReporter(target, str(token_file), DemandBroadcaster(), member_id="m2",
                                models=lambda: demands)
        assert shared._post(Demand(1, 2, True))
        sent = json.loads(bodies[-1])
        assert sent["models"] == {"a": {"queued": 1, "inFlight": 0, "leaseActive": True},
                                  "ü": {"queued": 0, "inFlight": 2, "leaseActive": False}}  # idle ones left out
        assert "ü".encode() in bodies[-1]  # UTF-8 as it is, not \\u escapes
        assert shared._post(Demand(), withdraw=True) and json.loads(bodies[-1])["models"] == {}
        # Bounded by the aggregator's limit even while models a reload removed still finish requests.
        demands = {f"m{i}": Demand(1, 0, False) for i in range(MAX_REPORT_MODELS + 40)}
        assert shared._post(Demand(300, 0, False))
        assert len(json.loads(bodies[-1])["models"]) == MAX_REPORT_MODELS
    finally:
        server.shutdown()
        server.server_close()
