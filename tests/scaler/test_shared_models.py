"""One scaler endpoint for the ScaledObjects of a shared gateway: each
call is answered from the demand of the model its trigger metadata names, over a real gRPC channel on
both hosts (grpcio, h2). Demand for model A never activates model B."""

from __future__ import annotations

import grpc
import pytest

from scaler import externalscaler_pb2 as pb
from scaler.demand import Demand, DemandBroadcaster
from scaler.externalscaler import MODEL_METADATA_KEY, ScalerSettings
from tests.scaler.conftest import start_scaler, wait_until


def ref(model: str | None) -> pb.ScaledObjectRef:
    return pb.ScaledObjectRef(name=f"so-{model}", namespace="ns",
                              scalerMetadata={} if model is None else {MODEL_METADATA_KEY: model})


def test_each_scaled_object_gets_its_own_models_demand(scaler_host: str, open_stub) -> None:
    models = {"a": DemandBroadcaster(), "org/b": DemandBroadcaster()}
    server = start_scaler(scaler_host, DemandBroadcaster(), settings=ScalerSettings(), models=models.get)
    try:
        stub = open_stub(server.port)
        stream_b = stub.StreamIsActive(ref("org/b"))
        assert next(stream_b).result is False
        models["a"].publish(Demand(3, 0, True))
        assert stub.IsActive(ref("a")).result is True
        assert stub.IsActive(ref("org/b")).result is False
        metrics = stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref("a"), metricName="noctaya-demand"))
        assert metrics.metricValues[0].metricValue == 3
        models["org/b"].publish(Demand(1, 0, True))
        assert next(stream_b).result is True  # b's stream saw b's flip, never a's
        assert wait_until(lambda: server.servicer.open_streams == 1)

        for missing, code in ((ref("nope"), grpc.StatusCode.NOT_FOUND), (ref(None), grpc.StatusCode.INVALID_ARGUMENT)):
            with pytest.raises(grpc.RpcError) as refused:
                stub.IsActive(missing)
            assert refused.value.code() == code
            with pytest.raises(grpc.RpcError) as refused:
                next(stub.StreamIsActive(missing))
            assert refused.value.code() == code
        del models["a"]  # a removed from the table: its ScaledObject is told so
        with pytest.raises(grpc.RpcError) as refused:
            stub.IsActive(ref("a"))
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        stream_b.cancel()
    finally:
        server.stop(1.0)
