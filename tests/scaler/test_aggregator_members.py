"""The aggregate scaler follows a member, not only a name: shared-gateway replicas report each model's
member's ScaledObject (``scaledObject`` in the model's object), the aggregator sums demand per
ScaledObject too, and a trigger whose ``model`` nobody reports is answered by the asking ScaledObject
(a renamed member, asked by its new name before the replicas reload). Real HTTP reports and a real
gRPC channel on 127.0.0.1, wired as ``python -m scaler aggregate`` wires them."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator

import grpc
import pytest
import requests

from scaler import externalscaler_pb2 as pb
from scaler import externalscaler_pb2_grpc as pb_grpc
from scaler.aggregator import (
    MAX_REPORT_MODELS,
    MAX_SCALED_OBJECT,
    Aggregator,
    AggregatorSettings,
    MemberTable,
    Report,
    ReportError,
    parse_report,
    valid_scaled_object,
)
from scaler.demand import Demand, DemandBroadcaster
from scaler.externalscaler import MODEL_METADATA_KEY
from scaler.reporter import DemandReporter
from scaler.service import start_scaler_server

from .conftest import REPORT_TOKEN as TOKEN
from .conftest import wait_until

LONGEST = "n" * 63 + "/" + "s" * 253  # a namespace of 63 and a name of 253 characters


def ref(model: str, scaled_object: str) -> pb.ScaledObjectRef:
    namespace, name = scaled_object.split("/")
    return pb.ScaledObjectRef(name=name, namespace=namespace, scalerMetadata={MODEL_METADATA_KEY: model})


def body(member: str, seq: int, models: dict[str, tuple[int, str | None]]) -> dict:
    """``models``: name -> (queued, scaledObject or None)."""
    report: dict = {"member": member, "seq": seq, "queued": sum(q for q, _ in models.values()), "models": {}}
    for name, (queued, scaled_object) in models.items():
        report["models"][name] = {"queued": queued, "inFlight": 0, "leaseActive": False}
        if scaled_object is not None:
            report["models"][name]["scaledObject"] = scaled_object
    return report


# --- parsing ---------------------------------------------------------------------------------------


def test_a_models_scaled_object_is_parsed_and_optional() -> None:
    parsed = parse_report(json.dumps(body("g1", 1, {"qwen-7b": (1, "ns/qwen"), "old": (2, None),
                                                    "long": (0, LONGEST)})).encode())
    assert parsed.models == (("qwen-7b", 1, 0, False), ("old", 2, 0, False), ("long", 0, 0, False))
    assert parsed.scaled_objects == (("qwen-7b", "ns/qwen"), ("long", LONGEST))
    assert len(LONGEST) == MAX_SCALED_OBJECT
    # Gateways before 0.3 send none; a per-model gateway sends no models at all.
    assert parse_report(json.dumps(body("g1", 1, {"a": (1, None)})).encode()).scaled_objects == ()
    assert parse_report(b'{"member":"g1","seq":1}').scaled_objects == ()


@pytest.mark.parametrize("value", [
    1, True, None, "", "ns", "/name", "ns/", "ns/a/b", "NS/name", "ns/Name", "ns/na me", "ns/name\n", "-ns/name",
    "ns/name-", "n.s/name", "ns/ü", "n" * 64 + "/name", "ns/" + "s" * 254, LONGEST + "s", "ns/name\u2028",
], ids=repr)
def test_a_malformed_scaled_object_is_refused(value: object) -> None:
    assert not valid_scaled_object(value)
    raw = {"member": "g1", "seq": 1, "models": {"a": {"queued": 1, "scaledObject": value}}}
    with pytest.raises(ReportError, match="scaledObject must be"):
        parse_report(json.dumps(raw).encode())


def test_a_malformed_scaled_object_is_a_400_over_http_and_changes_nothing(token_file) -> None:
    agg = Aggregator(AggregatorSettings(token_file=str(token_file)), DemandBroadcaster())
    agg.start("127.0.0.1", 0)
    try:
        def post(report: dict) -> requests.Response:
            return requests.post(f"http://127.0.0.1:{agg.port}/v1/report", json=report, timeout=10,
                                 headers={"Authorization": f"Bearer {TOKEN}"})

        for value in (["ns", "name"], {"ns": "name"}, "ns/" + "s" * 254, 7):
            answer = post({"member": "g1", "seq": 1, "models": {"a": {"queued": 1, "scaledObject": value}}})
            assert answer.status_code == 400, value
        assert agg.member_count == 0 and agg.scaled_object_count == 0
        assert post(body("g1", 1, {"a": (1, "ns/qwen")})).status_code == 200
        assert post(body("g2", 1, {"a": (1, None)})).status_code == 200  # an older gateway: accepted
        assert agg.scaled_object_source("ns", "qwen").current() == Demand(1, 0, False)
        assert agg.reported_model_source("a").current() == Demand(2, 0, False)
    finally:
        agg.stop()


# --- the member table ------------------------------------------------------------------------------


def test_scaled_object_demand_sums_over_members_and_is_bounded_by_max_models(token_file) -> None:
    table = MemberTable(AggregatorSettings(token_file=str(token_file), max_models=3, max_member_demand=10))
    # One replica has the old table (qwen-7b), the other the new one (qwen-14b): one member's demand.
    assert table.apply(Report("g1", 1, 0, 0, False, False, (("qwen-7b", 50, 0, True), ("b", 1, 0, False)),
                              (("qwen-7b", "ns/qwen"), ("b", "ns/b")))) == "accepted"
    assert table.apply(Report("g2", 1, 0, 0, False, False, (("qwen-14b", 2, 1, False),),
                              (("qwen-14b", "ns/qwen"),))) == "accepted"
    assert table.scaled_object_totals() == {"ns/qwen": Demand(12, 1, True), "ns/b": Demand(1, 0, False)}
    # At the limit: 3 distinct ScaledObjects (and 3 names).
    assert table.apply(Report("g2", 2, 0, 0, False, False, (("qwen-14b", 1, 0, False),),
                              (("qwen-14b", "ns/third"),))) == "accepted"
    assert set(table.scaled_object_totals()) == {"ns/qwen", "ns/b", "ns/third"}
    # A fourth ScaledObject, its names all known: refused, the member's state kept.
    assert table.apply(Report("g2", 3, 0, 0, False, False, (("qwen-14b", 1, 0, False), ("b", 1, 0, False)),
                              (("qwen-14b", "ns/third"), ("b", "ns/fourth")))) == "models_full"
    assert set(table.scaled_object_totals()) == {"ns/qwen", "ns/b", "ns/third"}
    assert table.apply(Report("g1", 2, 0, 0, False, True)) == "withdrawn"
    assert table.scaled_object_totals() == {"ns/third": Demand(1, 0, False)}


def test_max_models_distinct_scaled_objects_fit_and_one_more_is_a_429(token_file) -> None:
    agg = Aggregator(AggregatorSettings(token_file=str(token_file)), DemandBroadcaster())
    agg.start("127.0.0.1", 0)
    try:
        def post(report: dict) -> requests.Response:
            return requests.post(f"http://127.0.0.1:{agg.port}/v1/report", timeout=10,
                                 data=json.dumps(report, ensure_ascii=False).encode(),
                                 headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})

        # The largest report: 256 models of 256 four-byte characters, each with a ScaledObject of
        # the longest form, fits the default body limit.
        full = {f"{i:03d}" + "\U0001f600" * 253: (1, f"{i:03d}" + LONGEST[3:]) for i in range(MAX_REPORT_MODELS)}
        largest = body("g1", 1, full)
        assert len(json.dumps(largest, ensure_ascii=False).encode()) <= agg.settings.max_body_bytes
        assert post(largest).status_code == 200
        assert agg.scaled_object_count == MAX_REPORT_MODELS == agg.settings.max_models
        first_name, (_, first_so) = next(iter(full.items()))
        refused = post(body("g2", 1, {first_name: (1, "ns/one-more")}))
        assert (refused.status_code, refused.json()["error"]["message"]) == (429, "model limit reached")
        assert post(body("g2", 2, {first_name: (1, first_so)})).status_code == 200  # a known one: fine
        namespace, name = first_so.split("/")
        assert agg.scaled_object_source(namespace, name).current() == Demand(2, 0, False)
        assert agg.scaled_object_count == MAX_REPORT_MODELS
    finally:
        agg.stop()


def test_the_per_scaled_object_map_stays_bounded_as_scaled_objects_come_and_go(token_file) -> None:
    class Clock:
        now = 100.0

        def __call__(self) -> float:
            return self.now

    clock = Clock()
    agg = Aggregator(AggregatorSettings(token_file=str(token_file), max_models=2, member_ttl=10.0),
                     DemandBroadcaster(), clock=clock)
    held = None
    for seq in range(1, 40):
        clock.now += 11  # nobody asked for the earlier ones within a TTL
        assert agg.apply(Report("g1", seq, 0, 0, False, False, (("m", 1, 0, False),), (("m", f"ns/so{seq}"),))) \
            == "accepted"
        assert agg.scaled_object_count <= 2 * 2
        if seq == 1:
            held = agg.scaled_object_source("ns", "so1")
        assert agg.scaled_object_source("ns", f"so{seq}") is not None
        assert agg.scaled_object_source("ns", f"so{seq - 1}") is None  # no longer reported
    assert held is not None and held.current() == Demand()  # what a stream still on it is told


# --- resolution through gRPC -----------------------------------------------------------------------


@pytest.fixture
def aggregate(token_file) -> Iterator[tuple[Aggregator, pb_grpc.ExternalScalerStub]]:
    """The aggregator and its ExternalScaler, wired as scaler/__main__.py wires them."""
    agg = Aggregator(AggregatorSettings(token_file=str(token_file), member_ttl=5.0), DemandBroadcaster())
    agg.start("127.0.0.1", 0)
    server = start_scaler_server(agg.broadcaster, 0, host="127.0.0.1", models=agg.reported_model_source,
                                 members=agg.scaled_object_source, unlisted=agg.unlisted_source, model_required=False)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield agg, pb_grpc.ExternalScalerStub(channel)
    finally:
        channel.close()
        server.stop(1.0)
        agg.stop()


def poster(agg: Aggregator):
    def post(report: dict) -> None:
        answer = requests.post(f"http://127.0.0.1:{agg.port}/v1/report", json=report, timeout=10,
                               headers={"Authorization": f"Bearer {TOKEN}"})
        assert answer.status_code == 200, answer.text
    return post


def metric(stub: pb_grpc.ExternalScalerStub, model: str, scaled_object: str) -> int:
    request = pb.GetMetricsRequest(scaledObjectRef=ref(model, scaled_object), metricName="noctaya-demand")
    return stub.GetMetrics(request, timeout=5).metricValues[0].metricValue


def test_a_reported_name_wins_then_the_asking_scaled_object_then_idle(aggregate) -> None:
    agg, stub = aggregate
    post = poster(agg)
    post(body("g1", 1, {"qwen-7b": (1, "ns/qwen"), "other": (2, "ns/other")}))
    post(body("g2", 1, {"qwen-7b": (3, None)}))  # an older replica: by name only
    assert metric(stub, "qwen-7b", "ns/qwen") == 4  # the name, summed over the replicas
    assert metric(stub, "other", "ns/qwen") == 2  # a reported name wins over the ScaledObject
    assert metric(stub, "qwen-14b", "ns/qwen") == 1  # unknown name: its ScaledObject's reported demand
    assert stub.IsActive(ref("qwen-14b", "ns/qwen"), timeout=5).result is True
    # Unknown both (another namespace's ScaledObject of that name too): idle, never NOT_FOUND.
    for model, scaled_object in (("qwen-14b", "elsewhere/qwen"), ("nobody", "ns/nobody")):
        assert metric(stub, model, scaled_object) == 0
        assert stub.IsActive(ref(model, scaled_object), timeout=5).result is False


def test_a_stream_opened_by_the_new_name_follows_the_member_across_the_reload(aggregate) -> None:
    """A request held for qwen-7b; the hooks rename the member and KEDA reopens its stream with
    model=qwen-14b while both replicas still report qwen-7b. The stream says true at once, stays
    true while one replica and then both report the new name, and follows the member's demand
    afterwards (false when it ends, true for the next request)."""
    agg, stub = aggregate
    post = poster(agg)
    seq = {"g1": 0, "g2": 0}

    def report(member: str, models: dict[str, tuple[int, str | None]]) -> None:
        seq[member] += 1
        post(body(member, seq[member], models))

    report("g1", {"qwen-7b": (1, "ns/qwen")})
    report("g2", {})
    pushes: queue.Queue[bool] = queue.Queue()
    stream = stub.StreamIsActive(ref("qwen-14b", "ns/qwen"))

    def follow() -> None:
        try:
            for answer in stream:
                pushes.put(answer.result)
        except grpc.RpcError:  # cancelled at the end
            pass

    threading.Thread(target=follow, daemon=True).start()
    try:
        assert pushes.get(timeout=10) is True
        report("g2", {"qwen-14b": (1, "ns/qwen")})  # a second request, on the replica that reloaded
        report("g1", {"qwen-14b": (1, "ns/qwen")})  # the first replica reloaded: its request moved
        assert wait_until(lambda: metric(stub, "qwen-14b", "ns/qwen") == 2)
        assert wait_until(lambda: agg.reported_model_source("qwen-7b") is None)
        # Re-sends of true only (activation_resend backs off); never a false while held.
        while not pushes.empty():
            assert pushes.get_nowait() is True
        report("g1", {})
        report("g2", {})
        assert wait_until(lambda: not pushes.empty() and pushes.queue[-1] is False)
        while not pushes.empty():
            last = pushes.get_nowait()
        assert last is False
        report("g1", {})
        report("g2", {"qwen-14b": (1, "ns/qwen")})  # the next request: the same stream wakes
        assert pushes.get(timeout=10) is True
    finally:
        stream.cancel()


def test_a_stream_opened_by_the_new_name_of_an_idle_member_wakes_for_a_request_under_the_old_name(aggregate) -> None:
    """The member is idle when it is renamed: KEDA reopens its stream with model=qwen-14b while
    nothing is reported. A request then arrives under the old name at a replica not reloaded yet:
    the stream the new name was given follows the ScaledObject, so it says true at once (not at
    KEDA's next poll, minutes away for a shared gateway's member), then false when it ends, and it
    follows the new name once the replicas report it."""
    agg, stub = aggregate
    post = poster(agg)
    pushes: queue.Queue[bool] = queue.Queue()
    stream = stub.StreamIsActive(ref("qwen-14b", "ns/qwen"))

    def follow() -> None:
        try:
            for answer in stream:
                pushes.put(answer.result)
        except grpc.RpcError:  # cancelled at the end
            pass

    threading.Thread(target=follow, daemon=True).start()
    try:
        assert pushes.get(timeout=10) is False  # idle: nothing reported for the name or the object
        post(body("g1", 1, {"qwen-7b": (1, "ns/qwen")}))  # the old name, on a replica not reloaded
        assert pushes.get(timeout=10) is True
        post(body("g1", 2, {}))
        assert wait_until(lambda: not pushes.empty() and pushes.queue[-1] is False)
        while not pushes.empty():
            pushes.get_nowait()
        post(body("g1", 3, {"qwen-14b": (1, None)}))  # reloaded (by name only, as an older replica)
        assert pushes.get(timeout=10) is True
        # Another member's demand is not this stream's.
        post(body("g1", 4, {"other": (1, "ns/other")}))
        assert wait_until(lambda: not pushes.empty() and pushes.queue[-1] is False)
    finally:
        stream.cancel()


def test_a_reporter_sends_the_scaled_object_of_each_model_its_table_names(token_file) -> None:
    agg = Aggregator(AggregatorSettings(token_file=str(token_file)), DemandBroadcaster())
    agg.start("127.0.0.1", 0)
    demands = {"qwen-7b": Demand(queued=1), "b": Demand(in_flight=2), "c": Demand(queued=1), "idle": Demand()}
    table = {"qwen-7b": "ns/qwen", "c": "Not/Valid", "idle": "ns/idle"}
    reporter = DemandReporter(f"http://127.0.0.1:{agg.port}/v1/report", str(token_file), DemandBroadcaster(),
                              models=lambda: dict(demands), scaled_objects=lambda: dict(table), interval=0.2)
    reporter.start()
    try:
        assert wait_until(lambda: agg.reported_model_source("qwen-7b") is not None)
        assert agg.scaled_object_source("ns", "qwen").current() == Demand(queued=1)
        # b names none, c's is not one the aggregator accepts (left out, the report still goes),
        # an idle model is not reported.
        assert agg.scaled_object_count == 1 and reporter.failures == 0
        assert agg.reported_model_source("c").current() == Demand(queued=1)
    finally:
        reporter.stop()
        agg.stop()


def test_the_map_of_unlisted_triggers_stays_bounded(token_file) -> None:
    agg = Aggregator(AggregatorSettings(token_file=str(token_file), max_models=2), DemandBroadcaster())
    asked = [agg.unlisted_source(f"m{i}", "ns", f"so{i}") for i in range(4)]  # the bound: 2 * max_models
    assert agg.unlisted_source("m0", "ns", "so0") is asked[0]
    beyond = agg.unlisted_source("m4", "ns", "so4")  # asked within the TTL: none of the four is dropped
    assert beyond.current() == Demand() and agg.unlisted_source("m4", "ns", "so4") is not beyond
    assert agg.apply(Report("g1", 1, 0, 0, False, False, (("m1", 1, 0, False),), ())) == "accepted"
    assert asked[1].current() == Demand(queued=1)  # a kept one follows its model
