"""Issue 29 item 6 at the shared gateway: a member renamed while its request is held (the request
completes, its demand stays visible to KEDA under the old and the new name), and multipart audio
uploads routed by their form's ``model`` field."""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
import requests

from gateway.config import GatewayConfig
from gateway.modeltable import parse_model_table
from gateway.shared import SharedGatewayApp
from gateway.state.models import ModelDemand, ModelsSampler
from tests.gateway.fakebackend import FakeBackend
from tests.gateway.harness import ThreadedGateway
from tests.gateway.test_shared import _start_gateway_process
from tests.ports import free_port

MESSAGES = [{"role": "user", "content": "hi"}]
TRANSCRIBE = "/v1/audio/transcriptions"
WAV = b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(range(256)) * 8  # any bytes: never decoded by the gateway


def base_config(**overrides: object) -> GatewayConfig:
    settings: dict = dict(backend_url="http://unused:1", served_model_name="unused", listen_host="127.0.0.1",
                          listen_port=0, admin_port=0, activation_timeout_seconds=20.0, ready_grace_seconds=0.5,
                          heartbeat_seconds=0.2, scaler_mode="off", probe_interval_seconds=0.05,
                          probe_timeout_seconds=0.5, max_held_body_bytes=64 * 2**20)
    return GatewayConfig(**{**settings, **overrides})


def wait_for(check: Callable[[], bool], what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def write_table(path: Path, *models: dict) -> None:
    tmp = path.with_suffix(".new")
    tmp.write_text(json.dumps({"models": list(models)}))
    tmp.replace(path)


# --- rename while held ---------------------------------------------------------------------------


def test_a_member_renamed_while_its_request_is_held_completes_and_keda_sees_it_throughout(tmp_path) -> None:
    """`python -m gateway` with its gRPC scaler, queried as KEDA does: a request held cold for
    qwen-7b; the member (LLMService qwen) is renamed qwen-14b. KEDA's ScaledObject, rewritten at once
    to ask by the new name, sees the held request before the gateway has the new table (answered by
    the ScaledObject's identity) and after (by name); one still asking by the old name sees it too.
    The test, playing KEDA, starts the backend only on those answers, and the held request gets 200."""
    import grpc

    from scaler import externalscaler_pb2 as pb
    from scaler import externalscaler_pb2_grpc as pb_grpc

    backend = FakeBackend()  # scaled to zero: refuses connections until started
    table = tmp_path / "models.json"
    entry = {"member": "qwen", "scaledObject": "ns/qwen-backend", "backendURL": backend.url,
             "activationTimeoutSeconds": 60}
    write_table(table, {"name": "qwen-7b", **entry})
    scaler = free_port()
    proc, port = _start_gateway_process(table, NOCTAYA_SCALER_MODE="local", NOCTAYA_SCALER_PORT=str(scaler))
    channel = grpc.insecure_channel(f"127.0.0.1:{scaler}")
    stub = pb_grpc.ExternalScalerStub(channel)

    def active(model: str, namespace: str = "ns") -> bool:
        ref = pb.ScaledObjectRef(name="qwen-backend", namespace=namespace, scalerMetadata={"model": model})
        return stub.IsActive(ref, timeout=5).result

    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        result: list[str] = []
        held = threading.Thread(target=lambda: result.append(client.chat.completions.create(
            model="qwen-7b", messages=MESSAGES).choices[0].message.content))
        held.start()
        wait_for(lambda: active("qwen-7b"), "the held request is not KEDA-visible")
        # The hooks rewrote the ScaledObject first: it asks by a name this Pod's table does not list yet.
        assert active("qwen-14b"), "the member's ScaledObject does not see its demand before the reload"
        with pytest.raises(grpc.RpcError) as refused:  # another namespace's ScaledObject of that name
            active("qwen-14b", namespace="elsewhere")
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND

        write_table(table, {"name": "qwen-14b", **entry})
        wait_for(lambda: [m.id for m in client.models.list()] == ["qwen-14b"], "the rename was not applied")
        assert active("qwen-14b"), "the member's demand did not follow it to its new name"
        assert active("qwen-7b"), "a ScaledObject still asking by the old name lost the demand"
        assert held.is_alive()

        backend.start()  # KEDA scales the member up on the demand it saw
        held.join(30)
        assert len(result) == 1 and result[0].startswith("tok")
        assert len(backend.requests_to("/v1/chat/completions")) == 1
        assert client.chat.completions.create(model="qwen-14b", messages=MESSAGES).choices
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="qwen-7b", messages=MESSAGES)
    finally:
        channel.close()
        proc.terminate()
        proc.wait(30)
        backend.stop()


def test_a_member_renamed_while_its_request_is_held_behind_two_reporting_replicas(tmp_path) -> None:
    """The same with two replicas (report mode) and `python -m scaler aggregate`: a request held cold
    for qwen-7b on replica 0; the hooks rename the member and KEDA reopens its stream by the new name
    while neither replica has the new table. The aggregator answers it by the ScaledObject the
    replicas report with the model, the stream stays true while replica 1 and then replica 0 reload
    (each on its own kubelet schedule), the test playing KEDA starts the backend on that, and the
    held request gets 200."""
    import os
    import queue
    import re
    import subprocess
    import sys

    import grpc

    from scaler import externalscaler_pb2 as pb
    from scaler import externalscaler_pb2_grpc as pb_grpc

    backend = FakeBackend()  # scaled to zero: refuses connections until started
    entry = {"member": "qwen", "scaledObject": "ns/qwen-backend", "backendURL": backend.url,
             "activationTimeoutSeconds": 60}
    tables = [tmp_path / f"models-{i}.json" for i in range(2)]  # each replica's own ConfigMap volume
    for table in tables:
        write_table(table, {"name": "qwen-7b", **entry})
    token = tmp_path / "token"
    token.write_text("report-token")
    root = Path(__file__).resolve().parents[2]
    aggregator = subprocess.Popen(
        [sys.executable, "-m", "scaler", "aggregate", "--host", "127.0.0.1", "--report-port", "0", "--scaler-port",
         "0", "--drain-grace-seconds", "1"],
        cwd=root, env={**os.environ, "PYTHONPATH": str(root), "NOCTAYA_AGGREGATOR_TOKEN_FILE": str(token)},
        stderr=subprocess.PIPE, text=True)
    gateways: list = []
    channel = None
    try:
        assert aggregator.stderr is not None
        ports = None
        deadline = time.monotonic() + 30
        while ports is None:
            assert time.monotonic() < deadline and aggregator.poll() is None, "aggregate scaler did not start"
            match = re.search(r"reports on [\d.]+:(\d+), gRPC on [\d.]+:(\d+)", aggregator.stderr.readline())
            ports = match and tuple(map(int, match.groups()))
        report_port, grpc_port = ports
        report_env = {"NOCTAYA_SCALER_MODE": "report", "NOCTAYA_AGGREGATOR_TOKEN_FILE": str(token),
                      "NOCTAYA_AGGREGATOR_URL": f"http://127.0.0.1:{report_port}/v1/report"}
        started = [_start_gateway_process(table, **report_env) for table in tables]
        gateways = [proc for proc, _ in started]
        clients = [openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
                   for _, port in started]
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        stub = pb_grpc.ExternalScalerStub(channel)

        def ref(model: str) -> pb.ScaledObjectRef:
            return pb.ScaledObjectRef(name="qwen-backend", namespace="ns", scalerMetadata={"model": model})

        def metric(model: str) -> int:
            return stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref(model), metricName="noctaya-demand"),
                                   timeout=5).metricValues[0].metricValue

        result: list[str] = []
        held = threading.Thread(target=lambda: result.append(clients[0].chat.completions.create(
            model="qwen-7b", messages=MESSAGES).choices[0].message.content))
        held.start()
        wait_for(lambda: metric("qwen-7b") == 1, "the held request is not KEDA-visible")

        # The hooks rewrote the ScaledObject: KEDA reopens its stream by the new name, which no
        # replica reports yet.
        pushes: queue.Queue[bool] = queue.Queue()
        stream = stub.StreamIsActive(ref("qwen-14b"))

        def follow() -> None:
            try:
                for answer in stream:
                    pushes.put(answer.result)
            except grpc.RpcError:  # cancelled at the end
                pass

        threading.Thread(target=follow, daemon=True).start()
        assert pushes.get(timeout=10) is True, "the renamed member's stream does not see its held request"
        assert metric("qwen-14b") == 1 and stub.IsActive(ref("qwen-14b"), timeout=5).result is True

        for replica in (1, 0):  # each replica's kubelet brings the new table in its own time
            write_table(tables[replica], {"name": "qwen-14b", **entry})
            wait_for(lambda r=replica: [m.id for m in clients[r].models.list()] == ["qwen-14b"],
                     f"replica {replica} did not apply the rename")
            assert metric("qwen-14b") == 1 and held.is_alive()
        wait_for(lambda: metric("qwen-14b") == 1 and stub.IsActive(ref("qwen-14b"), timeout=5).result,
                 "the member's demand did not follow it to its new name")
        assert metric("qwen-7b") == 1  # a ScaledObject still asking by the old name sees it too
        while not pushes.empty():
            assert pushes.get_nowait() is True, "KEDA was told false while the request was held"

        backend.start()  # KEDA scales the member up on the demand it saw
        held.join(30)
        assert len(result) == 1 and result[0].startswith("tok")
        # The same stream follows the member's demand to zero (after any re-sends of true).
        wait_for(lambda: pushes.get(timeout=15) is False, "the stream did not follow the demand to zero", 30)
        assert clients[1].chat.completions.create(model="qwen-14b", messages=MESSAGES).choices
        stream.cancel()
    finally:
        if channel is not None:
            channel.close()
        for proc in [*gateways, aggregator]:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        backend.stop()


@pytest.fixture
def demand_gateway() -> Iterator[tuple[ThreadedGateway, ModelDemand, FakeBackend, GatewayConfig]]:
    backend = FakeBackend()
    base = base_config()
    demand = ModelDemand()
    sampler = ModelsSampler(demand, interval=0.05).start()
    table = parse_model_table(json.dumps({"models": [
        {"name": "qwen-7b", "member": "qwen", "backendURL": backend.url, "maxQueue": 4}]}).encode(), base)
    gw = ThreadedGateway(base, app_factory=lambda: SharedGatewayApp(base, table, demand=demand)).start()
    yield gw, demand, backend, base
    gw.stop()
    sampler.stop()
    backend.stop()


def queued(demand: ModelDemand, model: str) -> int:
    """What the scaler answers KEDA for ``model`` (it looks the broadcaster up by the same call)."""
    source = demand.broadcaster(model)
    return -1 if source is None else source.current().queued


@pytest.mark.parametrize("max_queue", [4, 9], ids=["name-only", "name-and-settings"])
def test_a_rename_moves_the_held_request_and_its_demand_to_the_new_name(demand_gateway, max_queue) -> None:
    """Only the name changed: the model keeps its app (lease, prober, held requests). Settings
    changed too: a new app, the old one retiring with the held request, whose demand still counts
    for the member under its new name until it completes."""
    gw, demand, backend, base = demand_gateway
    before = gw.call(lambda: gw.app.apps["qwen-7b"])
    result: list[int] = []
    held = threading.Thread(target=lambda: result.append(requests.post(
        f"{gw.url}/v1/chat/completions", json={"model": "qwen-7b", "messages": MESSAGES}, timeout=30).status_code))
    held.start()
    wait_for(lambda: queued(demand, "qwen-7b") == 1, "the held request is not in the demand")

    renamed = parse_model_table(json.dumps({"models": [
        {"name": "qwen-14b", "member": "qwen", "backendURL": backend.url, "maxQueue": max_queue}]}).encode(), base)
    change = gw.call(lambda: gw.app.apply(renamed))
    assert (change.renamed, change.added, change.removed) == ((("qwen-7b", "qwen-14b"),), (), ())
    assert gw.call(lambda: (gw.app.apps["qwen-14b"] is before, len(gw.app._retiring))) == (
        (True, 0) if max_queue == 4 else (False, 1))
    assert gw.call(lambda: gw.app.apps["qwen-14b"].config) == renamed.models["qwen-14b"]  # kept or new, the new name
    time.sleep(0.2)  # a few samples: the demand must not dip while the request is held
    assert queued(demand, "qwen-14b") == 1 and queued(demand, "qwen-7b") == 1

    backend.start()
    held.join(30)
    assert result == [200]
    wait_for(lambda: queued(demand, "qwen-14b") == 0, "the demand did not settle")
    gw.call(gw.app.reap)
    assert gw.call(lambda: len(gw.app._retiring)) == 0
    assert requests.post(f"{gw.url}/v1/chat/completions", json={"model": "qwen-14b", "messages": MESSAGES},
                         timeout=10).status_code == 200


def test_a_table_without_members_still_treats_a_new_name_as_a_new_model(demand_gateway) -> None:
    """A table rendered by hooks before 0.2.0 names no member: no rename is guessed."""
    gw, demand, backend, base = demand_gateway
    older = parse_model_table(json.dumps({"models": [{"name": "x", "backendURL": backend.url}]}).encode(), base)
    newer = parse_model_table(json.dumps({"models": [{"name": "y", "backendURL": backend.url}]}).encode(), base)
    assert older.members == {} and older.diff(newer).renamed == ()
    assert older.diff(newer).added == ("y",) and older.diff(newer).removed == ("x",)


# --- multipart -----------------------------------------------------------------------------------


@pytest.fixture
def two_members() -> Iterator[tuple[ThreadedGateway, dict[str, FakeBackend]]]:
    backends = {name: FakeBackend().start() for name in ("whisper-a", "whisper-b")}
    base = base_config()
    table = parse_model_table(json.dumps({"models": [
        {"name": name, "member": name, "backendURL": b.url} for name, b in backends.items()]}).encode(), base)
    gw = ThreadedGateway(base, app_factory=lambda: SharedGatewayApp(base, table)).start()
    yield gw, backends
    gw.stop()
    for b in backends.values():
        b.stop()


def test_the_openai_clients_transcriptions_reach_only_their_own_model(two_members) -> None:
    gw, backends = two_members
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    for name in ("whisper-b", "whisper-a", "whisper-b"):
        out = client.audio.transcriptions.create(model=name, file=("clip.wav", io.BytesIO(WAV), "audio/wav"))
        assert out.text.startswith("heard ")
    translated = client.audio.translations.create(model="whisper-a", file=("clip.wav", io.BytesIO(WAV)))
    assert translated.text.startswith("heard ")
    assert len(backends["whisper-a"].requests_to(TRANSCRIBE)) == 1
    assert len(backends["whisper-b"].requests_to(TRANSCRIBE)) == 2
    assert len(backends["whisper-a"].requests_to("/v1/audio/translations")) == 1
    # Forwarded byte for byte: the file part arrives whole.
    (_, _, body), = backends["whisper-a"].requests_to(TRANSCRIBE)
    assert WAV in body and b'name="model"' in body
    with pytest.raises(openai.NotFoundError):
        client.audio.transcriptions.create(model="whisper-c", file=("clip.wav", io.BytesIO(WAV)))


def post_form(gw: ThreadedGateway, content_type: str, body: bytes) -> requests.Response:
    return requests.post(f"{gw.url}{TRANSCRIBE}", data=body, headers={"Content-Type": content_type}, timeout=10)


def part(name: str, value: bytes, eol: bytes = b"\r\n", boundary: bytes = b"B0und") -> bytes:
    return b"--" + boundary + eol + f'Content-Disposition: form-data; name="{name}"'.encode() + eol + eol + value + eol


@pytest.mark.parametrize("eol", [b"\r\n", b"\n"], ids=["crlf", "lf"])
@pytest.mark.parametrize("content_type", ["multipart/form-data; boundary=B0und",
                                          'multipart/form-data; boundary="B0und"'], ids=["token", "quoted"])
def test_the_model_part_is_found_last_with_either_line_ending_and_boundary_form(two_members, eol, content_type) -> None:
    gw, backends = two_members
    body = (part("file", WAV + b"\r\n--B0un", eol) + part("language", b"en", eol) + part("model", b"whisper-b", eol)
            + b"--B0und--" + eol)
    answer = post_form(gw, content_type, body)
    assert answer.status_code == 200, answer.text
    assert [r[2] for r in backends["whisper-b"].requests_to(TRANSCRIBE)] == [body]
    assert backends["whisper-a"].requests_to(TRANSCRIBE) == []


@pytest.mark.parametrize("content_type, body", [
    ("multipart/form-data", part("model", b"whisper-a") + b"--B0und--\r\n"),  # no boundary
    ("multipart/form-data; boundary=Other", part("model", b"whisper-a") + b"--B0und--\r\n"),  # not this body's
    ("multipart/form-data; boundary=B0und", part("model", b"whisper-a")),  # never closed
    ("multipart/form-data; boundary=B0und",
     part("model", b"whisper-a") + part("model", b"whisper-b") + b"--B0und--\r\n"),  # two models
], ids=["no-boundary", "wrong-boundary", "unclosed", "two-models"])
def test_malformed_multipart_is_refused_with_400(two_members, content_type, body) -> None:
    gw, backends = two_members
    answer = post_form(gw, content_type, body)
    assert (answer.status_code, answer.json()["error"]["code"]) == (400, "invalid_multipart")
    assert all(b.requests_to(TRANSCRIBE) == [] for b in backends.values())


def test_a_multipart_model_field_over_the_name_limit_is_refused(two_members) -> None:
    gw, backends = two_members
    body = part("model", b"w" * 2000) + part("file", WAV) + b"--B0und--\r\n"
    answer = post_form(gw, "multipart/form-data; boundary=B0und", body)
    assert (answer.status_code, answer.json()["error"]["code"]) == (400, "model_too_long")


def test_a_multipart_body_without_a_model_field_is_answered_as_a_json_one_without_model(two_members) -> None:
    gw, backends = two_members
    answer = post_form(gw, "multipart/form-data; boundary=B0und", part("file", WAV) + b"--B0und--\r\n")
    assert (answer.status_code, answer.json()["error"]["code"]) == (404, "model_not_found")
    no_model = requests.post(f"{gw.url}/v1/chat/completions", json={"messages": MESSAGES}, timeout=10)
    assert (no_model.status_code, no_model.json()["error"]["code"]) == (404, "model_not_found")


def test_model_demand_follows_renames_and_forgets_old_names_with_the_model() -> None:
    demand = ModelDemand()
    pod = demand.pod_for("a", 4)
    source = demand.broadcaster("a")
    demand.rename("a", "b")
    demand.rename("b", "c")
    assert demand.broadcaster("c") is source and demand.broadcaster("a") is source and demand.broadcaster("b") is source
    assert set(demand.demands()) == {"a", "b", "c"}  # the aggregator is told every name KEDA may ask by
    demand.set_scaled_objects({"ns/a-backend": "c"})
    assert demand.by_scaled_object("ns", "a-backend") is source and demand.by_scaled_object("other", "a-backend") is None
    fresh = demand.pod_for("a", 4)  # "a" names a model of its own again
    assert demand.broadcaster("a") is not source and demand.broadcaster("b") is source
    demand.release("a", fresh, listed=False)
    demand.release("c", pod, listed=False)  # the renamed model leaves the table: its old names go too
    assert demand.broadcaster("b") is None and demand.broadcaster("c") is None and demand.demands() == {}


def test_a_per_model_gateway_forwards_a_transcription_as_it_is() -> None:
    """The per-model gateway needs no model to route: the multipart body reaches its backend byte for
    byte (and an unreadable one too: the backend, not the gateway, judges it)."""
    with FakeBackend() as backend:
        gw = ThreadedGateway(base_config(backend_url=backend.url, served_model_name="whisper")).start()
        try:
            client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
            out = client.audio.transcriptions.create(model="whisper", file=("clip.wav", io.BytesIO(WAV)))
            assert out.text.startswith("heard ")
            odd = post_form(gw, "multipart/form-data", b"not multipart at all")
            assert odd.status_code == 200
            sent = [body for _, _, body in backend.requests_to(TRANSCRIBE)]
            assert WAV in sent[0] and sent[1] == b"not multipart at all"
        finally:
            gw.stop()
