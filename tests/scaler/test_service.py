"""ExternalScaler behaviour over a real grpc channel on 127.0.0.1, for both hosts (grpcio and h2 on gevent)."""

from __future__ import annotations

import itertools
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from scaler import externalscaler_pb2 as pb
from scaler.demand import Demand, DemandBroadcaster
from scaler.service import ScalerSettings, start_scaler_server, validate_metric_name

from .conftest import wait_until

REF = pb.ScaledObjectRef(
    name="qwen", namespace="models",
    scalerMetadata={"scalerAddress": "qwen-gateway.models:9090", "enableTLS": "false", "unheard-of": "x"},
)


class FlakyBroadcaster(DemandBroadcaster):
    """A demand source that fails on a fraction of reads (the fault is injected at the edge)."""

    def __init__(self, failure_rate: float, seed: int = 7) -> None:
        super().__init__()
        self.failure_rate = failure_rate
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        self.failures = 0

    def _maybe_fail(self) -> None:
        with self._rng_lock:
            fail = self._rng.random() < self.failure_rate
            if fail:
                self.failures += 1
        if fail:
            raise ConnectionError("injected demand source failure")

    def current(self) -> Demand:
        self._maybe_fail()
        return super().current()

    def wait_for_activity_change(self, seen_version: int, timeout: float) -> tuple[int, Demand]:
        self._maybe_fail()
        return super().wait_for_activity_change(seen_version, timeout)


def test_is_active_reflects_queue_in_flight_and_lease(broadcaster, start_server, open_stub) -> None:
    stub = open_stub(start_server(broadcaster).port)
    assert stub.IsActive(REF, timeout=10).result is False
    for demand in (Demand(queued=1), Demand(in_flight=1), Demand(lease_active=True)):
        broadcaster.publish(demand)
        assert stub.IsActive(REF, timeout=10).result is True
    broadcaster.publish(Demand())
    assert stub.IsActive(REF, timeout=10).result is False


def test_metric_spec_and_metrics_int_and_float(broadcaster, start_server, open_stub) -> None:
    stub = open_stub(start_server(broadcaster, metric_name="qwen-demand", target=7).port)
    (spec,) = stub.GetMetricSpec(REF, timeout=10).metricSpecs
    assert (spec.metricName, spec.targetSize, spec.targetSizeFloat) == ("qwen-demand", 7, 7.0)
    broadcaster.publish(Demand(queued=5, in_flight=8, lease_active=True))
    for asked in ("qwen-demand", "s0-qwen-demand", "s12-qwen-demand"):
        reply = stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=REF, metricName=asked), timeout=10)
        (value,) = reply.metricValues
        assert (value.metricName, value.metricValue, value.metricValueFloat) == (asked, 13, 13.0)
    with pytest.raises(grpc.RpcError) as err:
        stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=REF, metricName="other-metric"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_target_comes_from_the_trigger_metadata_keda_sends(broadcaster, start_server, open_stub) -> None:
    # scaling.targetPerReplica rides in the ScaledObject's trigger metadata: retuning needs no gateway restart.
    stub = open_stub(start_server(broadcaster, metric_name="qwen-demand", target=7).port)

    def target(**metadata: str) -> int:
        ref = pb.ScaledObjectRef(name="qwen", namespace="models", scalerMetadata={"scalerAddress": "x:9090", **metadata})
        (spec,) = stub.GetMetricSpec(ref, timeout=10).metricSpecs
        assert spec.targetSizeFloat == float(spec.targetSize)
        return spec.targetSize

    assert target(targetPerReplica="3") == 3
    assert target(targetPerReplica="25") == 25
    assert target() == 7  # a ScaledObject from before the key existed: the configured target
    for bad in ("0", "-1", "2.5", "ten", "", "99999999999"):
        with pytest.raises(grpc.RpcError) as err:
            target(targetPerReplica=bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "targetPerReplica" in err.value.details()


def test_metric_name_must_be_path_safe() -> None:
    assert validate_metric_name("noctaya-demand") == "noctaya-demand"
    for bad in ("", "Upper", "a/b", "a b", "-lead", "trail-", "x" * 64, "../x"):
        with pytest.raises(ValueError):
            ScalerSettings(metric_name=bad)
    with pytest.raises(ValueError):
        ScalerSettings(target=0)


def test_stream_metric_spec_is_unimplemented(broadcaster, start_server, open_stub) -> None:
    stub = open_stub(start_server(broadcaster).port)
    with pytest.raises(grpc.RpcError) as err:
        next(stub.StreamMetricSpec(REF, timeout=10))
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("initial", [Demand(), Demand(queued=2), Demand(lease_active=True)])
def test_stream_first_message_is_current_state(initial, start_server, open_stub) -> None:
    source = DemandBroadcaster(initial)
    stub = open_stub(start_server(source).port)
    stream = stub.StreamIsActive(REF, timeout=30)
    assert next(stream).result is initial.active
    stream.cancel()


def test_stream_pushes_changes_at_once(broadcaster, start_server, open_stub) -> None:
    server = start_server(broadcaster, resend_interval=60.0, activation_resend=60.0)
    stub = open_stub(server.port)
    stream = stub.StreamIsActive(REF, timeout=30)
    assert next(stream).result is False
    latencies = []
    for _ in range(5):
        t0 = time.monotonic()
        broadcaster.publish(Demand(queued=1))
        assert next(stream).result is True
        latencies.append(time.monotonic() - t0)
        broadcaster.publish(Demand(queued=1, in_flight=1))  # same flag: not pushed
        broadcaster.publish(Demand())
        assert next(stream).result is False
    # Correctness bound only (a loaded CI box); the 250 ms target is measured in bench/scaler_bench.py.
    assert max(latencies) < 2.0
    stream.cancel()


def test_true_is_resent_at_a_bounded_rate_while_active(broadcaster, start_server, open_stub) -> None:
    broadcaster.publish(Demand(lease_active=True))
    server = start_server(broadcaster, resend_interval=0.2)
    stub = open_stub(server.port)
    stream = stub.StreamIsActive(REF, timeout=30)
    assert next(stream).result is True
    pushes_before = server.servicer.pushes
    time.sleep(1.5)
    resent = server.servicer.pushes - pushes_before  # counted where they are sent, not received
    assert 2 <= resent <= 1.5 / 0.2 + 1
    broadcaster.publish(Demand())
    received_true = 0
    for message in stream:  # the resent trues did reach the client, then the flip to false
        if not message.result:
            break
        received_true += 1
    assert received_true >= resent
    stream.cancel()


def test_true_is_resent_soon_after_activation_then_backs_off(broadcaster, start_server, open_stub) -> None:
    # KEDA scales 0->1 on each `true` it receives while at zero: if one scale-up is lost (a write
    # conflict), the next `true` must come within a fraction of a second, then ease off.
    server = start_server(broadcaster, resend_interval=1.0, activation_resend=0.1)
    stub = open_stub(server.port)
    stream = stub.StreamIsActive(REF, timeout=30)
    assert next(stream).result is False
    broadcaster.publish(Demand(queued=1))
    t0 = time.monotonic()
    assert next(stream).result is True
    arrivals = []
    for message in stream:
        assert message.result is True
        arrivals.append(time.monotonic() - t0)
        if len(arrivals) == 6:
            break
    gaps = [b - a for a, b in zip([0.0, *arrivals], arrivals, strict=False)]
    assert arrivals[0] < 0.6, arrivals  # first re-send ~0.1 s after the flip, not resend_interval later
    # doubling (0.1, 0.2, 0.4, 0.8) up to the steady interval, never faster than scheduled. Checked on
    # arrival times from t0 (which precedes the flip): one message delivered late narrows the gap to the
    # next without anything being sent early (a loaded CI host once saw gaps 0.126, 0.180).
    schedule = itertools.accumulate((0.1, 0.2, 0.4, 0.8, 1.0, 1.0))
    for arrival, due in zip(arrivals, schedule, strict=True):
        assert arrival >= due * 0.95, (arrivals, gaps)
    assert max(gaps) < 1.0 + 1.0, gaps  # capped at resend_interval (plus scheduling slack)
    # a later flip false -> true starts the quick re-sends again
    broadcaster.publish(Demand())
    for message in stream:
        if message.result is False:
            break
    broadcaster.publish(Demand(queued=1))
    assert next(stream).result is True
    t1 = time.monotonic()
    assert next(stream).result is True and time.monotonic() - t1 < 0.6
    stream.cancel()


def test_streams_over_the_cap_are_refused_and_unary_still_served(broadcaster, start_server, open_stub) -> None:
    server = start_server(broadcaster, max_streams=2, unary_workers=2)
    stub = open_stub(server.port)
    streams = [stub.StreamIsActive(REF, timeout=30) for _ in range(2)]
    assert [next(s).result for s in streams] == [False, False]
    with pytest.raises(grpc.RpcError) as err:
        next(stub.StreamIsActive(REF, timeout=30))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert all(stub.IsActive(REF, timeout=10).result is False for _ in range(20))
    for s in streams:
        s.cancel()
    assert wait_until(lambda: server.servicer.open_streams == 0)


def test_cancelled_stream_frees_its_slot_promptly(broadcaster, start_server, open_stub) -> None:
    server = start_server(broadcaster, wait_slice=30.0)  # only the cancel callback can wake it
    stub = open_stub(server.port)
    stream = stub.StreamIsActive(REF, timeout=60)
    next(stream)
    assert server.servicer.open_streams == 1
    stream.cancel()
    assert wait_until(lambda: server.servicer.open_streams == 0, timeout=10)


def test_128_streams_and_200_concurrent_unary_calls(broadcaster, start_server, open_stub) -> None:
    server = start_server(broadcaster)
    stub = open_stub(server.port)
    streams = [stub.StreamIsActive(REF, timeout=120) for _ in range(128)]
    assert all(next(s).result is False for s in streams)
    assert server.servicer.open_streams == 128
    broadcaster.publish(Demand(queued=3))
    start = threading.Barrier(200, timeout=30)

    def call(i: int) -> float:
        start.wait()
        t0 = time.perf_counter()
        if i % 2:
            assert stub.IsActive(REF, timeout=30).result is True
        else:
            reply = stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=REF, metricName="noctaya-demand"), timeout=30)
            assert reply.metricValues[0].metricValue == 3
        return time.perf_counter() - t0

    with ThreadPoolExecutor(200) as pool:
        durations = list(pool.map(call, range(200)))
    assert len(durations) == 200
    p99 = statistics.quantiles(durations, n=100)[98]
    assert p99 < 1.0, f"p99 {p99:.3f}s"  # loose; bench/scaler_bench.py measures the 100 ms target
    assert all(next(s).result is True for s in streams)  # every stream still pushes
    for s in streams:
        s.cancel()


def test_faulty_source_never_ends_a_stream_with_an_error(start_server, open_stub) -> None:
    source = FlakyBroadcaster(failure_rate=0.4)
    server = start_server(source, resend_interval=60.0, activation_resend=60.0, wait_slice=0.05)
    stub = open_stub(server.port)
    streams = [stub.StreamIsActive(REF, timeout=60) for _ in range(4)]
    assert [next(s).result for s in streams] == [False] * 4
    for i in range(10):
        source.publish(Demand(queued=1) if i % 2 == 0 else Demand())
        assert [next(s).result for s in streams] == [i % 2 == 0] * 4
    assert source.failures > 0 and server.servicer.source_error_count > 0
    # unary calls answer from the last good value when a read fails
    answers = {stub.IsActive(REF, timeout=10).result for _ in range(30)}
    assert answers == {False}
    server.stop(5.0)
    for s in streams:
        assert list(s) == []
        assert s.code() == grpc.StatusCode.OK


def test_unary_before_any_good_read_is_unavailable(start_server, open_stub) -> None:
    source = FlakyBroadcaster(failure_rate=1.0)
    stub = open_stub(start_server(source).port)
    with pytest.raises(grpc.RpcError) as err:
        stub.IsActive(REF, timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_shutdown_ends_every_stream_with_ok(broadcaster, start_server, open_stub) -> None:
    broadcaster.publish(Demand(queued=1))
    server = start_server(broadcaster, wait_slice=30.0)
    stub = open_stub(server.port)
    streams = [stub.StreamIsActive(REF, timeout=60) for _ in range(16)]
    assert all(next(s).result is True for s in streams)
    t0 = time.monotonic()
    server.stop(10.0)
    assert time.monotonic() - t0 < 5.0  # interrupted, not waiting for wait_slice or grace
    for s in streams:
        list(s)
        assert s.code() == grpc.StatusCode.OK
    with pytest.raises(grpc.RpcError):
        stub.IsActive(REF, timeout=2)


def test_port_in_use_is_an_error(broadcaster, start_server) -> None:
    server = start_server(broadcaster)
    with pytest.raises(OSError, match="cannot bind the gRPC scaler"):
        start_server(broadcaster, server.port)


class ThreadRecordingBroadcaster(DemandBroadcaster):
    def __init__(self) -> None:
        super().__init__()
        self.threads: dict[str, set[str]] = {"stream": set(), "unary": set()}

    def current(self) -> Demand:
        self.threads["unary"].add(threading.current_thread().name.rsplit("_", 1)[0])
        return super().current()

    def wait_for_activity_change(self, seen_version: int, timeout: float) -> tuple[int, Demand]:
        self.threads["stream"].add(threading.current_thread().name.rsplit("_", 1)[0])
        return super().wait_for_activity_change(seen_version, timeout)


@pytest.mark.parametrize("scaler_host", ["grpcio"])
def test_streams_and_unary_calls_run_on_separate_pools(start_server, open_stub) -> None:
    source = ThreadRecordingBroadcaster()
    server = start_server(source, max_streams=8, unary_workers=1)
    stub = open_stub(server.port)
    streams = [stub.StreamIsActive(REF, timeout=30) for _ in range(8)]
    assert all(next(s).result is False for s in streams)
    # every stream pool thread is taken, yet a single unary worker serves calls
    assert all(stub.IsActive(REF, timeout=10).result is False for _ in range(10))
    assert source.threads == {"stream": {"noctaya-scaler-stream"}, "unary": {"noctaya-scaler-unary"}}
    for s in streams:
        s.cancel()


@pytest.mark.parametrize("scaler_host", ["grpcio"])
def test_unary_flood_beyond_the_pending_bound_is_refused_not_queued(broadcaster, start_server, open_stub) -> None:
    server = start_server(broadcaster, max_streams=1, unary_workers=1, max_pending_rpcs=2)
    stub = open_stub(server.port)
    futures = [stub.IsActive.future(REF, timeout=30) for _ in range(300)]
    codes = []
    for f in futures:
        try:
            f.result()
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            codes.append(exc.code())
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert codes.count(grpc.StatusCode.OK) >= 1 and codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 1
    assert stub.IsActive(REF, timeout=10).result is False  # still serving afterwards


def test_single_pool_fallback_still_keeps_unary_threads(broadcaster, open_stub, monkeypatch) -> None:
    """Without grpcio's per-handler pool hook, one pool of max_streams + unary_workers is used."""
    import scaler.service as service

    monkeypatch.setattr(service, "_per_method_pools_supported", lambda: False)
    server = start_scaler_server(broadcaster, 0, host="127.0.0.1",
                                 settings=ScalerSettings(max_streams=6, unary_workers=1))
    try:
        stub = open_stub(server.port)
        streams = [stub.StreamIsActive(REF, timeout=30) for _ in range(6)]
        assert all(next(s).result is False for s in streams)
        assert all(stub.IsActive(REF, timeout=10).result is False for _ in range(10))
        with pytest.raises(grpc.RpcError) as err:
            next(stub.StreamIsActive(REF, timeout=30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        server.stop(2.0)
