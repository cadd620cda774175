"""Wire identity with KEDA's ExternalScaler (SPEC Appendix B), checked on descriptors and on raw
bytes sent over a real channel without our generated stubs."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import grpc
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FieldDescriptor as F

from scaler import externalscaler_pb2 as pb
from scaler.demand import Demand
from scaler.gen_proto import GENERATED_NAMES, generate

ROOT = Path(__file__).resolve().parents[2]

EXPECTED_METHODS = {
    # name: (input, output, server_streaming)
    "IsActive": ("ScaledObjectRef", "IsActiveResponse", False),
    "StreamIsActive": ("ScaledObjectRef", "IsActiveResponse", True),
    "GetMetricSpec": ("ScaledObjectRef", "GetMetricSpecResponse", False),
    "GetMetrics": ("GetMetricsRequest", "GetMetricsResponse", False),
    "StreamMetricSpec": ("ScaledObjectRef", "GetMetricSpecResponse", True),
}

# message: {number: (name, type, label, message type or None)}
REPEATED, OPTIONAL = F.LABEL_REPEATED, F.LABEL_OPTIONAL
EXPECTED_MESSAGES = {
    "ScaledObjectRef": {
        1: ("name", F.TYPE_STRING, OPTIONAL, None),
        2: ("namespace", F.TYPE_STRING, OPTIONAL, None),
        3: ("scalerMetadata", F.TYPE_MESSAGE, REPEATED, "externalscaler.ScaledObjectRef.ScalerMetadataEntry"),
    },
    "IsActiveResponse": {1: ("result", F.TYPE_BOOL, OPTIONAL, None)},
    "GetMetricSpecResponse": {1: ("metricSpecs", F.TYPE_MESSAGE, REPEATED, "externalscaler.MetricSpec")},
    "MetricSpec": {
        1: ("metricName", F.TYPE_STRING, OPTIONAL, None),
        2: ("targetSize", F.TYPE_INT64, OPTIONAL, None),
        3: ("targetSizeFloat", F.TYPE_DOUBLE, OPTIONAL, None),
    },
    "GetMetricsRequest": {
        1: ("scaledObjectRef", F.TYPE_MESSAGE, OPTIONAL, "externalscaler.ScaledObjectRef"),
        2: ("metricName", F.TYPE_STRING, OPTIONAL, None),
    },
    "GetMetricsResponse": {1: ("metricValues", F.TYPE_MESSAGE, REPEATED, "externalscaler.MetricValue")},
    "MetricValue": {
        1: ("metricName", F.TYPE_STRING, OPTIONAL, None),
        2: ("metricValue", F.TYPE_INT64, OPTIONAL, None),
        3: ("metricValueFloat", F.TYPE_DOUBLE, OPTIONAL, None),
    },
}


def test_package_service_and_methods() -> None:
    file = pb.DESCRIPTOR
    proto = descriptor_pb2.FileDescriptorProto.FromString(file.serialized_pb)
    assert file.package == "externalscaler" and proto.syntax == "proto3"
    assert list(file.services_by_name) == ["ExternalScaler"]
    service = file.services_by_name["ExternalScaler"]
    assert service.full_name == "externalscaler.ExternalScaler"
    assert {m.name for m in service.methods} == set(EXPECTED_METHODS)
    for method in service.methods:
        inp, out, streaming = EXPECTED_METHODS[method.name]
        assert method.input_type.full_name == f"externalscaler.{inp}"
        assert method.output_type.full_name == f"externalscaler.{out}"
        assert method.server_streaming is streaming and method.client_streaming is False


def test_messages_fields_numbers_and_types() -> None:
    proto = descriptor_pb2.FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb)
    messages = {m.name: m for m in proto.message_type}
    assert set(messages) == set(EXPECTED_MESSAGES)
    for name, fields in EXPECTED_MESSAGES.items():
        actual = {
            f.number: (f.name, f.type, f.label, f.type_name.lstrip(".") or None) for f in messages[name].field
        }
        assert actual == fields, name
        assert all(not f.HasField("oneof_index") and not f.proto3_optional for f in messages[name].field)
    (entry,) = messages["ScaledObjectRef"].nested_type
    assert entry.name == "ScalerMetadataEntry" and entry.options.map_entry
    assert [(f.number, f.name, f.type) for f in entry.field] == [(1, "key", F.TYPE_STRING), (2, "value", F.TYPE_STRING)]


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _len_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def test_raw_wire_bytes_over_a_real_channel(broadcaster, start_server) -> None:
    """Hand-encoded requests on KEDA's full method paths; responses decoded by field number."""
    broadcaster.publish(Demand(queued=3, in_flight=4))
    server = start_server(broadcaster, metric_name="noctaya-demand", target=10)
    ref = (
        _len_field(1, b"qwen") + _len_field(2, b"models")
        + _len_field(3, _len_field(1, b"scalerAddress") + _len_field(2, b"qwen-scaler:9090"))
    )
    ident = lambda b: b  # noqa: E731
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        is_active = channel.unary_unary("/externalscaler.ExternalScaler/IsActive", ident, ident)
        assert is_active(ref, timeout=10) == b"\x08\x01"  # field 1 varint true
        spec = channel.unary_unary("/externalscaler.ExternalScaler/GetMetricSpec", ident, ident)(ref, timeout=10)
        metric_spec = _len_field(1, b"noctaya-demand") + b"\x10" + _varint(10) + b"\x19" + struct.pack("<d", 10.0)
        assert spec == _len_field(1, metric_spec)
        request = _len_field(1, ref) + _len_field(2, b"noctaya-demand")
        values = channel.unary_unary("/externalscaler.ExternalScaler/GetMetrics", ident, ident)(request, timeout=10)
        value = _len_field(1, b"noctaya-demand") + b"\x10" + _varint(7) + b"\x19" + struct.pack("<d", 7.0)
        assert values == _len_field(1, value)
        stream = channel.unary_stream("/externalscaler.ExternalScaler/StreamIsActive", ident, ident)(ref, timeout=10)
        assert next(stream) == b"\x08\x01"
        stream.cancel()
        spec_stream = channel.unary_stream("/externalscaler.ExternalScaler/StreamMetricSpec", ident, ident)(
            ref, timeout=10
        )
        try:
            next(spec_stream)
            raise AssertionError("StreamMetricSpec should be UNIMPLEMENTED")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNIMPLEMENTED


def test_committed_stubs_are_reproducible(tmp_path: Path) -> None:
    generate(tmp_path / "scaler")
    for name in GENERATED_NAMES:
        committed = (ROOT / "scaler" / name).read_bytes()
        assert (tmp_path / "scaler" / name).read_bytes() == committed, f"{name} is stale: run python -m scaler gen-proto"


def test_generation_detects_a_changed_proto(tmp_path: Path) -> None:
    proto_dir = tmp_path / "proto"
    proto_dir.mkdir()
    text = (ROOT / "proto" / "externalscaler.proto").read_text()
    (proto_dir / "externalscaler.proto").write_text(text.replace("bool result = 1;", "bool result = 4;"))
    generate(tmp_path / "out", proto_dir=proto_dir)
    assert (tmp_path / "out" / "externalscaler_pb2.py").read_bytes() != (ROOT / "scaler" / "externalscaler_pb2.py").read_bytes()
    shutil.rmtree(tmp_path / "out")
