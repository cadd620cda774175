"""The aggregate scaler for shared gateways: replicas report each model's demand (``models`` in the
report), and each ScaledObject is answered from the model its trigger metadata names, summed over the
replicas, through a real gRPC channel and real HTTP reports on 127.0.0.1. Every per-model bound is
tested at its limit; a report without ``models`` (a per-model gateway's) is unchanged."""

from __future__ import annotations

import json
import threading

import grpc
import pytest
import requests

from scaler import externalscaler_pb2 as pb
from scaler.aggregator import (
    MAX_REPORT_MODELS,
    Aggregator,
    AggregatorSettings,
    MemberTable,
    Report,
    ReportError,
    parse_report,
)
from scaler.demand import Demand, DemandBroadcaster
from scaler.externalscaler import MODEL_METADATA_KEY
from scaler.reporter import DemandReporter
from scaler.service import start_scaler_server

from .conftest import REPORT_TOKEN as TOKEN
from .conftest import wait_until


def ref(model: str | None) -> pb.ScaledObjectRef:
    return pb.ScaledObjectRef(name=f"so-{model}", namespace="ns",
                              scalerMetadata={} if model is None else {MODEL_METADATA_KEY: model})


def body(member: str, seq: int, models: dict[str, tuple[int, int, bool]] | None, **flat: object) -> dict:
    report: dict = {"member": member, "seq": seq, **flat}
    if models is not None:
        report["models"] = {n: {"queued": q, "inFlight": i, "leaseActive": lease} for n, (q, i, lease) in models.items()}
    return report


def test_parse_report_reads_models_and_refuses_them_beyond_the_bounds() -> None:
    parsed = parse_report(json.dumps(body("g1", 1, {"a": (2, 1, True), "org/b ü": (0, 0, False)})).encode())
    assert parsed.models == (("a", 2, 1, True), ("org/b ü", 0, 0, False))
    assert parse_report(b'{"member":"g1","seq":1}').models is None  # a per-model gateway's report
    at_limit = {f"m{i}": (1, 0, False) for i in range(MAX_REPORT_MODELS)}
    assert len(parse_report(json.dumps(body("g1", 1, at_limit)).encode()).models or ()) == MAX_REPORT_MODELS
    over = {**at_limit, "one-more": (1, 0, False)}
    for raw, message in [
        (json.dumps(body("g1", 1, over)).encode(), "at most 256"),
        (b'{"member":"g1","seq":1,"models":[]}', "flat JSON object"),
        (b'{"member":"g1","seq":1,"models":{"a":[1,2]}}', "flat JSON object"),
        (b'{"member":"g1","seq":1,"models":{"a":{"queued":[' + b"[]," * 10_000 + b'[]]}}}', "no nested values"),
        (b'{"member":"g1","seq":1,"models":{"a":{"queued":{}}}}', "no nested values"),
        (b'{"member":"g1","seq":1,"models":{"a":{"queued":{"x":{"y":1}}}}}', "no nested values"),
        (b'{"member":"g1","seq":1,"models":{"a":1}}', "must be an object"),
        (b'{"member":"g1","seq":1,"models":{"":{}}}', "1-256 printable"),
        (json.dumps(body("g1", 1, {"n" * 257: (1, 0, False)})).encode(), "1-256 printable"),
        (b'{"member":"g1","seq":1,"models":{"a":{"queued":-1}}}', "non-negative"),
        (b'{"member":"g1","seq":1,"models":{"a":{"leaseActive":1}}}', "boolean"),
        (b'{"member":"g1","seq":1,"other":{"a":{}}}', "flat JSON object"),
    ]:
        with pytest.raises(ReportError, match=message):
            parse_report(raw)


def test_model_demand_sums_over_members_clamped_and_bounded(token_file) -> None:
    table = MemberTable(AggregatorSettings(token_file=str(token_file), max_models=3, max_member_demand=10))
    assert table.apply(Report("g1", 1, 5, 0, False, False, (("a", 50, 50, True), ("b", 1, 0, False)))) == "accepted"
    assert table.apply(Report("g2", 1, 0, 0, False, False, (("a", 2, 1, False), ("c", 0, 0, True)))) == "accepted"
    assert table.model_totals() == {"a": Demand(12, 1, True), "b": Demand(1, 0, False), "c": Demand(0, 0, True)}
    assert table.total() == Demand(5, 0, False)  # the reports' own counts, for a trigger without model
    # At the limit (3 distinct models): a fourth is refused, the member's state is kept.
    assert table.apply(Report("g2", 2, 0, 0, False, False, (("c", 1, 0, False), ("d", 1, 0, False)))) == "models_full"
    assert table.model_totals()["c"] == Demand(0, 0, True)
    # A member may replace its own models within the limit (its old ones no longer count).
    assert table.apply(Report("g2", 3, 0, 0, False, False, (("d", 1, 0, False),))) == "accepted"
    assert set(table.model_totals()) == {"a", "b", "d"}
    assert table.apply(Report("g1", 2, 0, 0, False, True)) == "withdrawn"
    assert table.model_totals() == {"d": Demand(1, 0, False)}


def test_a_trigger_per_model_through_grpc_and_http_reports(token_file) -> None:
    """Two shared-gateway replicas report through real DemandReporters; each model's ScaledObject is
    answered from that model's sum, a model nobody reported is inactive with metric 0 (never
    NOT_FOUND), a trigger without ``model`` gets the flat sum as before, and a's demand never
    activates b."""
    agg = Aggregator(AggregatorSettings(token_file=str(token_file), member_ttl=2.0), DemandBroadcaster())
    agg.start("127.0.0.1", 0)
    server = start_scaler_server(agg.broadcaster, 0, host="127.0.0.1", models=agg.model_source, model_required=False)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    from scaler import externalscaler_pb2_grpc as pb_grpc

    stub = pb_grpc.ExternalScalerStub(channel)
    replicas = [({"a": Demand(), "b": Demand()}, DemandBroadcaster()) for _ in range(2)]
    pushed: list[tuple[int, str]] = []
    reporters = [DemandReporter(f"http://127.0.0.1:{agg.port}/v1/report", str(token_file), changes,
                                models=lambda d=demands: dict(d), interval=0.3,
                                on_model_pushed=lambda name, _when, i=i: pushed.append((i, name))).start()
                 for i, (demands, changes) in enumerate(replicas)]

    def set_demand(replica: int, model: str, demand: Demand) -> None:
        demands, changes = replicas[replica]
        demands[model] = demand
        changes.publish(Demand(sum(d.queued for d in demands.values()), sum(d.in_flight for d in demands.values()),
                               any(d.lease_active for d in demands.values())), force=True)

    def metric(model: str | None) -> int:
        return stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref(model), metricName="noctaya-demand"),
                               timeout=5).metricValues[0].metricValue

    try:
        assert wait_until(lambda: agg.member_count == 2)
        stream_b = stub.StreamIsActive(ref("b"))
        assert next(stream_b).result is False
        b_pushes: list[bool] = []

        def follow_b() -> None:
            try:
                for answer in stream_b:
                    b_pushes.append(answer.result)
            except grpc.RpcError:  # cancelled at the end of the test
                pass

        threading.Thread(target=follow_b, daemon=True).start()
        never = stub.StreamIsActive(ref("never-reported"))
        assert next(never).result is False
        assert stub.IsActive(ref("never-reported"), timeout=5).result is False and metric("never-reported") == 0

        set_demand(0, "a", Demand(queued=2, lease_active=True))
        set_demand(1, "a", Demand(queued=1, in_flight=3))
        assert wait_until(lambda: metric("a") == 6)  # summed over the replicas
        assert stub.IsActive(ref("a"), timeout=5).result is True
        assert stub.IsActive(ref("b"), timeout=5).result is False and metric("b") == 0
        # Without `model`: the sum of the reports' own counts, as before (a replica's are its models' sum).
        assert metric(None) == 6
        assert b_pushes == []  # a's demand never reached b's stream
        assert wait_until(lambda: {(0, "a"), (1, "a")} <= set(pushed))

        set_demand(1, "b", Demand(queued=1))
        assert wait_until(lambda: b_pushes == [True])
        set_demand(0, "a", Demand())
        set_demand(1, "a", Demand())
        assert wait_until(lambda: metric("a") == 0)
        assert stub.IsActive(ref("b"), timeout=5).result is True

        reporters[1].stop()  # withdraws: b's only demand goes
        assert wait_until(lambda: b_pushes == [True, False])
        stream_b.cancel()
        never.cancel()
    finally:
        for reporter in reporters:
            reporter.stop()
        channel.close()
        server.stop(1.0)
        agg.stop()


def test_models_beyond_the_aggregators_bound_are_refused_with_429(token_file) -> None:
    agg = Aggregator(AggregatorSettings(token_file=str(token_file), max_models=MAX_REPORT_MODELS), DemandBroadcaster())
    agg.start("127.0.0.1", 0)
    try:
        def post(report: dict) -> requests.Response:
            return requests.post(f"http://127.0.0.1:{agg.port}/v1/report", json=report, timeout=10,
                                 headers={"Authorization": f"Bearer {TOKEN}"})

        # 256 models, each with a name of 256 non-ASCII characters, fit the default body limit.
        full = {(f"{i:03d}" + "ü" * 253): (1, 0, False) for i in range(MAX_REPORT_MODELS)}
        first = body("g1", 1, full)
        assert len(json.dumps(first, ensure_ascii=False).encode()) < agg.settings.max_body_bytes
        answer = requests.post(f"http://127.0.0.1:{agg.port}/v1/report",
                               data=json.dumps(first, ensure_ascii=False).encode(), timeout=10,
                               headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        assert answer.status_code == 200
        refused = post(body("g2", 1, {"another": (1, 0, False)}))
        assert (refused.status_code, refused.json()["error"]["message"]) == (429, "model limit reached")
        assert post(body("g2", 2, {next(iter(full)): (1, 0, False)})).status_code == 200  # a known model: fine
        assert agg.model_source(next(iter(full))).current() == Demand(2, 0, False)
        assert agg.model_count == MAX_REPORT_MODELS
    finally:
        agg.stop()


def test_the_per_model_map_is_bounded_for_triggers_naming_models_nobody_reports(token_file) -> None:
    class Clock:
        now = 100.0

        def __call__(self) -> float:
            return self.now

    clock = Clock()
    agg = Aggregator(AggregatorSettings(token_file=str(token_file), max_models=2, member_ttl=10.0), DemandBroadcaster(),
                     clock=clock)
    asked = [agg.model_source(f"m{i}") for i in range(4)]  # the bound: 2 * max_models
    assert agg.model_count == 4 and agg.model_source("m0") is asked[0]
    beyond = agg.model_source("m4")
    assert beyond.current() == Demand() and agg.model_count == 4 and agg.model_source("m4") is not beyond
    clock.now += 11  # nobody asked for a TTL: unwatched entries make room when the map is full
    assert agg.model_source("m5") is agg.model_source("m5") and agg.model_count <= 4
    # A reported model always has its entry (reports are bounded by max_models on their own).
    agg.apply(Report("g1", 1, 0, 0, False, False, (("r1", 1, 0, False), ("r2", 0, 1, False))))
    assert agg.model_source("r1").current() == Demand(1, 0, False)
