"""The shared gateway's handler (gateway.shared): the real openai client with one base
URL in front of three models, real backends on 127.0.0.1. Listing wakes nothing, a request wakes only
its own model, one model's flood at its maxQueue is refused for that model only, and an unknown
model gets OpenAI's 404 model_not_found."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
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
from tests.gateway.fakebackend import FakeBackend
from tests.gateway.harness import ThreadedGateway, exchange

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def backends() -> Iterator[dict[str, FakeBackend]]:
    made = {name: FakeBackend() for name in ("a", "b", "c")}
    yield made
    for backend in made.values():
        backend.stop()


@pytest.fixture
def shared(backends: dict[str, FakeBackend]) -> Iterator[ThreadedGateway]:
    base = GatewayConfig(backend_url="http://unused:1", served_model_name="unused", listen_host="127.0.0.1",
                         listen_port=0, admin_port=0, activation_timeout_seconds=10.0, ready_grace_seconds=0.5,
                         heartbeat_seconds=0.2, scaler_mode="off", probe_interval_seconds=0.05,
                         probe_timeout_seconds=0.5, max_held_body_bytes=64 * 2**20)
    table = parse_model_table(json.dumps({"models": [
        {"name": "a", "backendURL": backends["a"].url, "maxQueue": 2},
        {"name": "b", "backendURL": backends["b"].url, "maxQueue": 8},
        {"name": "org/c", "backendURL": backends["c"].url},
    ]}).encode(), base)
    gw = ThreadedGateway(base, app_factory=lambda: SharedGatewayApp(base, table)).start()
    yield gw
    gw.stop()


def posts(backend: FakeBackend) -> int:
    return len(backend.requests_to("/v1/chat/completions"))


def test_one_base_url_lists_every_model_cold_and_wakes_only_the_one_asked(shared, backends) -> None:
    client = openai.OpenAI(base_url=f"{shared.url}/v1", api_key="unused", max_retries=0, timeout=30)
    assert [m.id for m in client.models.list()] == ["a", "b", "org/c"]
    assert client.models.retrieve("org/c").id == "org/c"
    assert all(b.health_checks == 0 for b in backends.values())  # nothing woke, nothing was probed
    assert not any(shared.call(lambda n=n: shared.app.apps[n].activation.lease.snapshot().state.value != "idle")
                   for n in ("a", "b", "org/c"))

    backends["b"].start()
    chunks = list(client.chat.completions.create(model="b", messages=MESSAGES, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert posts(backends["b"]) == 1 and posts(backends["a"]) == posts(backends["c"]) == 0
    assert shared.call(lambda: shared.app.apps["a"].activation.lease.snapshot().state.value) == "idle"

    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="nope", messages=MESSAGES)
    assert unknown.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_a_flood_of_one_model_is_refused_for_that_model_only(shared, backends) -> None:
    """a's maxQueue is 2: held cold, its third request is refused 429; b (warm) still answers, and c
    (cold) still gets a slot of its own."""
    body = json.dumps({"model": "a", "messages": MESSAGES}).encode()
    held: list[socket.socket] = []
    try:
        for _ in range(2):  # a's backend is down: these wait for it, holding a's two slots
            sock = socket.create_connection(("127.0.0.1", shared.port), timeout=10)
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            held.append(sock)
        deadline = time.monotonic() + 5
        while shared.call(lambda: shared.app.apps["a"].admitted) != 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        flood = [requests.post(f"{shared.url}/v1/chat/completions", data=body, timeout=10,
                               headers={"Content-Type": "application/json"}) for _ in range(20)]
        assert {r.status_code for r in flood} == {429}
        assert {r.json()["error"]["code"] for r in flood} == {"queue_full"}

        backends["b"].start()
        answered = requests.post(f"{shared.url}/v1/chat/completions", json={"model": "b", "messages": MESSAGES},
                                 timeout=30)
        assert answered.status_code == 200 and answered.json()["choices"]

        c_result: list[int] = []
        c_thread = threading.Thread(target=lambda: c_result.append(requests.post(
            f"{shared.url}/v1/chat/completions", json={"model": "org/c", "messages": MESSAGES}, timeout=30,
        ).status_code))
        c_thread.start()
        deadline = time.monotonic() + 5
        while shared.call(lambda: shared.app.apps["org/c"].admitted) != 1:
            assert time.monotonic() < deadline, "c found no slot while a was flooded"
            time.sleep(0.01)
        backends["c"].start()
        c_thread.join(30)
        assert c_result == [200]
    finally:
        for sock in held:
            sock.close()


@pytest.mark.parametrize(("body", "status", "code"), [
    (b'{"messages": []}', 404, "model_not_found"),
    (b'{"model": 7, "messages": []}', 404, "model_not_found"),
    (b'{"model": "a", "messages": [', 400, "invalid_json"),
    (b"[" * 100_000, 400, "invalid_json"),
])
def test_a_body_without_a_known_model_wakes_nothing(shared, backends, body, status, code) -> None:
    answer = requests.post(f"{shared.url}/v1/chat/completions", data=body, timeout=10,
                           headers={"Content-Type": "application/json"})
    assert (answer.status_code, answer.json()["error"]["code"]) == (status, code)
    assert not any(shared.call(lambda n=n: shared.app.apps[n].admitted) for n in ("a", "b", "org/c"))
    assert all(b.health_checks == 0 for b in backends.values())


def test_the_table_file_is_reloaded_without_dropping_held_requests(backends, tmp_path) -> None:
    """Must-show 2 of issue 22, at the gateway: a cold request for a is held while the table gains d
    and loses b; the held request completes, d is listed within the reload period, b is not found,
    and a bad table changes nothing."""
    from gateway.modeltable import ModelTableFile

    extra = FakeBackend()
    path = tmp_path / "models.json"

    def write(*models: dict) -> None:
        tmp = path.with_suffix(".new")
        tmp.write_text(json.dumps({"models": list(models)}))
        tmp.replace(path)

    a = {"name": "a", "backendURL": backends["a"].url}
    b = {"name": "b", "backendURL": backends["b"].url}
    d = {"name": "d", "backendURL": extra.url}
    write(a, b)
    base = GatewayConfig(backend_url="http://unused:1", served_model_name="unused", listen_host="127.0.0.1",
                         listen_port=0, admin_port=0, activation_timeout_seconds=20.0, ready_grace_seconds=0.5,
                         heartbeat_seconds=0.2, scaler_mode="off", probe_interval_seconds=0.05,
                         probe_timeout_seconds=0.5, max_held_body_bytes=64 * 2**20)
    table_file = ModelTableFile(path, base)
    table = table_file.poll()
    assert table is not None
    gw = ThreadedGateway(base, app_factory=lambda: SharedGatewayApp(base, table, table_file=table_file,
                                                                    reload_seconds=0.05)).start()
    try:
        result: list[int] = []
        held = threading.Thread(target=lambda: result.append(requests.post(
            f"{gw.url}/v1/chat/completions", json={"model": "a", "messages": MESSAGES}, timeout=30).status_code))
        held.start()
        deadline = time.monotonic() + 5
        while gw.call(lambda: gw.app.apps["a"].admitted) != 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)

        write(a, d)
        listed = time.monotonic()
        while [m["id"] for m in requests.get(f"{gw.url}/v1/models", timeout=5).json()["data"]] != ["a", "d"]:
            assert time.monotonic() - listed < 3, "d not listed within seconds"
            time.sleep(0.02)
        gone = requests.post(f"{gw.url}/v1/chat/completions", json={"model": "b", "messages": MESSAGES}, timeout=5)
        assert (gone.status_code, gone.json()["error"]["code"]) == (404, "model_not_found")
        assert gw.call(lambda: (len(gw.app._retiring), len(gw.app._tasks))) == (0, 2)  # b's app is closed

        write(a, {"name": "d"})  # refused whole: d keeps its backend, nothing is dropped
        time.sleep(0.3)
        assert "backendURL is required" in (table_file.error or "")
        extra.start()
        served = requests.post(f"{gw.url}/v1/chat/completions", json={"model": "d", "messages": MESSAGES}, timeout=30)
        assert served.status_code == 200

        assert held.is_alive()  # a's request was held through both reloads
        backends["a"].start()
        held.join(30)
        assert result == [200]
    finally:
        gw.stop()
        extra.stop()


def test_a_shared_gateway_process_scales_each_model_on_its_own(backends, tmp_path) -> None:
    """`python -m gateway` with NOCTAYA_MODEL_TABLE_FILE: one process, one base URL, one scaler port;
    a cold request for b pushes `true` on b's StreamIsActive only, a's stays `false`; SIGTERM drains."""
    import os
    import queue
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import grpc

    from scaler import externalscaler_pb2 as pb
    from scaler import externalscaler_pb2_grpc as pb_grpc
    from tests.ports import free_port

    table = tmp_path / "models.json"
    table.write_text(json.dumps({"models": [{"name": n, "backendURL": backends[n].url} for n in ("a", "b")]}))
    port, admin, scaler = free_port(), free_port(), free_port()
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "NOCTAYA_MODEL_TABLE_FILE": str(table),
           "NOCTAYA_LISTEN_HOST": "127.0.0.1", "NOCTAYA_LISTEN_PORT": str(port), "NOCTAYA_ADMIN_PORT": str(admin),
           "NOCTAYA_SCALER_MODE": "local", "NOCTAYA_SCALER_PORT": str(scaler), "NOCTAYA_GATEWAY_WORKERS": "1",
           "NOCTAYA_PROBE_INTERVAL_SECONDS": "0.05", "NOCTAYA_READY_GRACE_SECONDS": "0.5"}
    proc = subprocess.Popen([sys.executable, "-m", "gateway"], cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    channel = None
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
            try:
                if requests.get(f"http://127.0.0.1:{port}/healthz", timeout=1).ok:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, "shared gateway not listening"
            time.sleep(0.05)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == ["a", "b"]

        channel = grpc.insecure_channel(f"127.0.0.1:{scaler}")
        stub = pb_grpc.ExternalScalerStub(channel)

        def ref(model: str) -> pb.ScaledObjectRef:
            return pb.ScaledObjectRef(name=model, namespace="ns", scalerMetadata={"model": model})

        pushes: dict[str, queue.Queue] = {"a": queue.Queue(), "b": queue.Queue()}
        for model, q in pushes.items():
            threading.Thread(target=lambda m=model, q=q: [q.put(r.result) for r in stub.StreamIsActive(ref(m))],
                             daemon=True).start()
        assert pushes["a"].get(timeout=10) is False and pushes["b"].get(timeout=10) is False

        result: list[int] = []
        cold = threading.Thread(target=lambda: result.append(requests.post(
            f"http://127.0.0.1:{port}/v1/chat/completions", json={"model": "b", "messages": MESSAGES},
            timeout=60).status_code))
        cold.start()
        assert pushes["b"].get(timeout=10) is True
        assert stub.IsActive(ref("a"), timeout=5).result is False and pushes["a"].empty()
        assert stub.IsActive(ref("b"), timeout=5).result is True
        backends["b"].start()
        cold.join(30)
        assert result == [200]
        assert posts(backends["a"]) == 0

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(45) == 0
    finally:
        if channel is not None:
            channel.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_models_key_opens_that_model_only(backends, tmp_path) -> None:
    """a and b have keys of their own; c has none. An anonymous request is refused before its body
    only while every model is keyed; a's key never opens b, and never reaches a's backend."""
    keys = {"a": tmp_path / "a.key", "b": tmp_path / "b.key"}
    keys["a"].write_text("key-a\n")
    keys["b"].write_text("key-b\n")
    base = GatewayConfig(backend_url="http://unused:1", served_model_name="unused", listen_host="127.0.0.1",
                         listen_port=0, admin_port=0, scaler_mode="off", probe_interval_seconds=0.05,
                         probe_timeout_seconds=0.5, ready_grace_seconds=0.5, max_held_body_bytes=64 * 2**20)

    def serve(*names: str) -> ThreadedGateway:
        entries = [{"name": n, "backendURL": backends[n].url, **({"authKeyFile": str(keys[n])} if n in keys else {})}
                   for n in names]
        table = parse_model_table(json.dumps({"models": entries}).encode(), base)
        return ThreadedGateway(base, app_factory=lambda: SharedGatewayApp(base, table)).start()

    def post(gw: ThreadedGateway, model: str, key: str | None) -> requests.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return requests.post(f"{gw.url}/v1/chat/completions", json={"model": model, "messages": MESSAGES},
                             headers=headers, timeout=30)

    for backend in backends.values():
        backend.start()
    keyed = serve("a", "b")
    try:
        anonymous = requests.post(f"{keyed.url}/v1/chat/completions", data=b"x" * 1000, timeout=10,
                                  headers={"Content-Type": "application/json"})
        assert (anonymous.status_code, anonymous.json()["error"]["code"]) == (401, "invalid_api_key")
        assert post(keyed, "a", "key-a").status_code == 200
        assert post(keyed, "b", "key-a").status_code == 404  # a's key does not open b: as an unknown model
        assert post(keyed, "b", "key-b").status_code == 200
        assert post(keyed, "a", "wrong").status_code == 401
        assert all("Authorization" not in h and "authorization" not in h
                   for h in [backends["a"].last_headers, backends["b"].last_headers])
    finally:
        keyed.stop()
    mixed = serve("a", "c")
    try:
        assert post(mixed, "c", None).status_code == 200  # c takes requests without a key
        assert post(mixed, "a", None).status_code == 401
        assert post(mixed, "a", "key-a").status_code == 200
    finally:
        mixed.stop()


def test_metrics_carry_a_model_label_and_parse(shared, backends) -> None:
    """One exposition for every model (promtool's parser would refuse a family twice): a's answers
    under model="a", the unknown model's 404 under model=""."""
    from prometheus_client.parser import text_string_to_metric_families

    backends["b"].start()
    assert requests.post(f"{shared.url}/v1/chat/completions", json={"model": "b", "messages": MESSAGES},
                         timeout=30).status_code == 200
    assert requests.post(f"{shared.url}/v1/chat/completions", json={"model": "x", "messages": MESSAGES},
                         timeout=30).status_code == 404
    text = requests.get(f"{shared.admin_url}/metrics", timeout=10).text
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names))
    codes = {(s.labels["model"], s.labels.get("code")): s.value for f in families for s in f.samples
             if s.name == "noctaya_gateway_requests_total"}
    assert codes[("b", "200")] == 1 and codes[("", "404")] == 1 and codes.get(("a", "200"), 0) == 0
    assert {s.labels["model"] for f in families for s in f.samples} == {"", "a", "b", "org/c"}


def test_the_queue_page_shows_each_model_and_the_pods_budget(shared) -> None:
    page = requests.get(f"{shared.admin_url}/noctaya/queue", timeout=10).json()
    assert list(page["models"]) == ["a", "b", "org/c"]
    assert page["models"]["a"]["maxQueue"] == 2 and page["models"]["b"]["maxQueue"] == 8
    assert page["heldBytes"] == 0 and page["heldBytesLimit"] == 64 * 2**20 and page["draining"] is False


def test_a_models_key_files_each_open_it(backends, tmp_path) -> None:
    """authKeyFiles: a key in any of a's files opens a (each team its own Secret), none opens b."""
    for name in ("team1", "team2", "b"):
        (tmp_path / name).write_text(f"key-{name}\n")
    base = GatewayConfig(backend_url="http://unused:1", served_model_name="unused", listen_host="127.0.0.1",
                         listen_port=0, admin_port=0, scaler_mode="off", probe_interval_seconds=0.05,
                         probe_timeout_seconds=0.5, ready_grace_seconds=0.5, max_held_body_bytes=64 * 2**20)
    table = parse_model_table(json.dumps({"models": [
        {"name": "a", "backendURL": backends["a"].url,
         "authKeyFiles": [str(tmp_path / "team1"), str(tmp_path / "team2")]},
        {"name": "b", "backendURL": backends["b"].url, "authKeyFile": str(tmp_path / "b")},
    ]}).encode(), base)
    backends["a"].start()
    backends["b"].start()
    gw = ThreadedGateway(base, app_factory=lambda: SharedGatewayApp(base, table)).start()
    try:
        def ask(model: str, key: str) -> int:
            client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=30)
            try:
                return 200 if client.chat.completions.create(model=model, messages=MESSAGES).choices else 0
            except openai.APIStatusError as exc:
                return exc.status_code
        assert ask("a", "key-team1") == ask("a", "key-team2") == 200
        assert ask("b", "key-team1") == ask("a", "key-b") == 404  # a valid key, not for that model
        assert ask("a", "key-team3") == 401  # no key of any model
        (tmp_path / "team1").unlink()  # team1's Secret gone: its key opens nothing, team2's still does
        assert ask("a", "key-team1") == 401 and ask("a", "key-team2") == 200
        assert posts(backends["a"]) == 3 and posts(backends["b"]) == 0
    finally:
        gw.stop()


def test_the_listing_shows_only_what_the_callers_key_opens(backends, tmp_path) -> None:
    """Two teams' keys scoped to different models, through the real openai client: each lists and
    retrieves only its own models; a model it cannot open answers exactly like one that does not
    exist; a key that opens nothing is refused while every model is keyed. With an open model in the
    table, an anonymous caller or a wrong key sees only the open one."""
    for name in ("team1", "team2", "both"):
        (tmp_path / name).write_text(f"key-{name}\n")
    base = GatewayConfig(backend_url="http://unused:1", served_model_name="unused", listen_host="127.0.0.1",
                         listen_port=0, admin_port=0, scaler_mode="off", probe_interval_seconds=0.05,
                         probe_timeout_seconds=0.5, ready_grace_seconds=0.5, max_held_body_bytes=64 * 2**20)

    def serve(*entries: dict) -> ThreadedGateway:
        table = parse_model_table(json.dumps({"models": list(entries)}).encode(), base)
        return ThreadedGateway(base, app_factory=lambda: SharedGatewayApp(base, table)).start()

    def keys(*names: str) -> list[str]:
        return [str(tmp_path / n) for n in names]

    def client(gw: ThreadedGateway, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=30)

    a = {"name": "a", "backendURL": backends["a"].url, "authKeyFiles": keys("team1", "both")}
    b = {"name": "org/b", "backendURL": backends["b"].url, "authKeyFiles": keys("team2", "both")}
    backends["a"].start()
    gw = serve(a, b)
    try:
        team1, team2, both = client(gw, "key-team1"), client(gw, "key-team2"), client(gw, "key-both")
        assert [m.id for m in team1.models.list()] == ["a"]
        assert [m.id for m in team2.models.list()] == ["org/b"]
        assert [m.id for m in both.models.list()] == ["a", "org/b"]
        assert team1.models.retrieve("a").id == "a" and both.models.retrieve("org/b").id == "org/b"
        with pytest.raises(openai.NotFoundError) as hidden:
            team1.models.retrieve("org/b")
        assert hidden.value.code == "model_not_found"
        # No existence leak: the answer for a model this key cannot open is byte for byte that of
        # a model nobody has.
        def raw(model: str) -> tuple[int, bytes]:
            answer = requests.get(f"{gw.url}/v1/models/{model}", headers={"Authorization": "Bearer key-team1"},
                                  timeout=10)
            return answer.status_code, answer.content
        assert raw("org%2Fb") == (404, raw("org%2Fnope")[1].replace(b"org/nope", b"org/b"))
        for wrong in (client(gw, "key-team3"),):
            with pytest.raises(openai.AuthenticationError):
                wrong.models.list()
            with pytest.raises(openai.AuthenticationError):
                wrong.models.retrieve("a")
        anonymous = requests.get(f"{gw.url}/v1/models", timeout=10)
        assert (anonymous.status_code, anonymous.json()["error"]["code"]) == (401, "invalid_api_key")
        assert team1.chat.completions.create(model="a", messages=MESSAGES).choices
        with pytest.raises(openai.NotFoundError):
            team1.chat.completions.create(model="org/b", messages=MESSAGES)
        assert all(b.health_checks == 0 for b in (backends["b"], backends["c"]))  # listing woke nothing
    finally:
        gw.stop()

    gw = serve(a, {"name": "org/c", "backendURL": backends["c"].url})
    try:
        open_listing = requests.get(f"{gw.url}/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in open_listing] == ["org/c"]
        assert [m.id for m in client(gw, "key-team3").models.list()] == ["org/c"]
        assert [m.id for m in client(gw, "key-team1").models.list()] == ["a", "org/c"]
        with pytest.raises(openai.NotFoundError):
            client(gw, "key-team2").models.retrieve("a")
    finally:
        gw.stop()


def keyed_base() -> GatewayConfig:
    return GatewayConfig(backend_url="http://unused:1", served_model_name="unused", listen_host="127.0.0.1",
                         listen_port=0, admin_port=0, scaler_mode="off", probe_interval_seconds=0.05,
                         probe_timeout_seconds=0.5, ready_grace_seconds=0.5, max_held_body_bytes=64 * 2**20)


@pytest.fixture
def team_keys(tmp_path: Path) -> Callable[..., list[str]]:
    """Key files ``team1``, ``team2``, ``both``, holding ``key-<name>``."""
    for name in ("team1", "team2", "both"):
        (tmp_path / name).write_text(f"key-{name}\n")
    return lambda *names: [str(tmp_path / n) for n in names]


def serve_table(*entries: dict) -> ThreadedGateway:
    base = keyed_base()
    table = parse_model_table(json.dumps({"models": list(entries)}).encode(), base)
    return ThreadedGateway(base, app_factory=lambda: SharedGatewayApp(base, table)).start()


def post_head(authorization: bytes | None, length: int, *extra: bytes) -> bytes:
    lines = [b"POST /v1/chat/completions HTTP/1.1", b"Host: gw", b"Content-Type: application/json",
             b"Content-Length: %d" % length, *extra]
    if authorization is not None:
        lines.append(b"Authorization: " + authorization)
    return b"\r\n".join(lines) + b"\r\n\r\n"


@pytest.mark.parametrize("expect_continue", [False, True])
@pytest.mark.parametrize("authorization", [None, b"Bearer garbage", b"Bearer ", b"Bearer key-team1x"])
def test_a_token_that_is_no_models_key_is_refused_before_any_body_byte(
        backends, team_keys, authorization, expect_continue) -> None:
    """Every model keyed: a token that is no key of any model is refused from the head alone. The
    8 MiB body is never sent, so a 401 at all shows nothing waited for it; no ``100
    Continue`` invites it, and the connection closes."""
    gw = serve_table({"name": "a", "backendURL": backends["a"].url, "authKeyFiles": team_keys("team1", "both")},
                     {"name": "org/b", "backendURL": backends["b"].url, "authKeyFiles": team_keys("team2")})
    try:
        extra = [b"Expect: 100-continue"] if expect_continue else []
        _, answer = exchange(gw.port, post_head(authorization, 8 * 1024 * 1024, *extra))
        assert answer.startswith(b"HTTP/1.1 401 ") and b"100 Continue" not in answer
        head, _, body = answer.partition(b"\r\n\r\n")
        assert b"\r\nconnection: close" in head.lower()
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
        assert gw.call(lambda: gw.app.admitted) == 0 and gw.call(lambda: gw.app.budget.held_bytes) == 0
    finally:
        gw.stop()


def test_a_key_is_invited_to_send_its_body_and_a_new_models_key_opens_at_once(backends, team_keys, tmp_path) -> None:
    """The control of the test above: a key of some model gets ``100 Continue`` and is served; a
    model added by a new table brings its key files into the check before the body at once."""
    backends["a"].start()
    backends["c"].start()
    a = {"name": "a", "backendURL": backends["a"].url, "authKeyFiles": team_keys("team1")}
    gw = serve_table(a)
    try:
        body = json.dumps({"model": "a", "messages": MESSAGES}).encode()
        with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
            sock.sendall(post_head(b"Bearer key-team1", len(body), b"Expect: 100-continue"))
            assert sock.recv(4096) == b"HTTP/1.1 100 Continue\r\n\r\n"
            sock.sendall(body)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        (tmp_path / "team4").write_text("key-team4")
        added = parse_model_table(json.dumps({"models": [
            a, {"name": "c", "backendURL": backends["c"].url, "authKeyFiles": team_keys("team4")},
        ]}).encode(), keyed_base())
        gw.call(lambda: gw.app.apply(added))
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="key-team4", max_retries=0, timeout=30)
        assert client.chat.completions.create(model="c", messages=MESSAGES).choices
    finally:
        gw.stop()


def test_a_key_learns_nothing_about_models_it_cannot_open(backends, team_keys) -> None:
    """A token that opens nothing gets the same 401, byte for byte, whether the model exists or not
    (the request id is the client's, so the answers can be compared whole); a valid key asking for
    a model it does not open gets OpenAI's 404 ``model_not_found``, the same bytes as for a model
    that does not exist but for the name it repeats; the key's own models still answer, streamed
    through the openai client."""
    def answer(gw: ThreadedGateway, authorization: bytes | None, model: str | None) -> bytes:
        body = json.dumps({"messages": MESSAGES, **({"model": model} if model is not None else {})}).encode()
        head = post_head(authorization, len(body), b"X-Request-Id: same", b"Connection: close")
        return exchange(gw.port, head, body)[1]

    backends["a"].start()
    backends["c"].start()
    a = {"name": "a", "backendURL": backends["a"].url, "authKeyFiles": team_keys("team1", "both")}
    gw = serve_table(a, {"name": "org/b", "backendURL": backends["b"].url, "authKeyFiles": team_keys("team2")})
    try:
        refused = answer(gw, b"Bearer garbage", "a")
        assert refused.startswith(b"HTTP/1.1 401 ") and b"invalid_api_key" in refused
        assert answer(gw, b"Bearer garbage", "org/b") == answer(gw, b"Bearer garbage", "org/nope") == refused
        assert answer(gw, None, "a") == refused
        scoped = answer(gw, b"Bearer key-team1", "org/b")
        assert scoped.startswith(b"HTTP/1.1 404 ") and b"model_not_found" in scoped
        assert b"The model `org/b` does not exist or you do not have access to it." in scoped
        assert answer(gw, b"Bearer key-team1", "org/x") == scoped.replace(b"org/b", b"org/x")  # no such model
        assert b"The model does not exist or you do not have access to it." in answer(gw, b"Bearer key-team1", None)
        assert posts(backends["b"]) == 0 and backends["b"].health_checks == 0  # nothing woke org/b
        team1 = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="key-team1", max_retries=0, timeout=30)
        chunks = list(team1.chat.completions.create(model="a", messages=MESSAGES, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert [m.id for m in team1.models.list()] == ["a"]
    finally:
        gw.stop()
    # With an open model in the table a request cannot be refused before its body (any caller may be
    # one of the open model's); once the body names a model, a keyed one and an unknown one still
    # answer alike.
    gw = serve_table(a, {"name": "org/c", "backendURL": backends["c"].url})
    try:
        refused = answer(gw, None, "a")
        assert refused.startswith(b"HTTP/1.1 401 ")
        assert answer(gw, None, "org/nope") == answer(gw, b"Bearer garbage", "org/nope") == refused
        assert answer(gw, b"Bearer key-team1", "org/nope").startswith(b"HTTP/1.1 404 ")  # a valid key
        assert answer(gw, None, "org/c").startswith(b"HTTP/1.1 200 ")
    finally:
        gw.stop()


def _start_gateway_process(table: Path, **env_extra: str) -> tuple[subprocess.Popen, int]:
    """`python -m gateway` as a shared gateway on free ports; returns it once /healthz answers."""
    from tests.ports import free_port

    port, admin = free_port(), free_port()
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "NOCTAYA_MODEL_TABLE_FILE": str(table),
           "NOCTAYA_LISTEN_HOST": "127.0.0.1", "NOCTAYA_LISTEN_PORT": str(port), "NOCTAYA_ADMIN_PORT": str(admin),
           "NOCTAYA_GATEWAY_WORKERS": "1", "NOCTAYA_PROBE_INTERVAL_SECONDS": "0.05",
           "NOCTAYA_READY_GRACE_SECONDS": "0.5", **env_extra}
    proc = subprocess.Popen([sys.executable, "-m", "gateway"], cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, proc.stdout.read().decode()[-2000:]  # type: ignore[union-attr]
        try:
            if requests.get(f"http://127.0.0.1:{port}/healthz", timeout=1).ok:
                return proc, port
        except requests.RequestException:
            pass
        assert time.monotonic() < deadline, "shared gateway not listening"
        time.sleep(0.05)


def test_two_reporting_shared_gateways_scale_each_model_through_the_aggregator(backends, tmp_path) -> None:
    """Report mode (a shared gateway with two replicas): both replicas report every model's demand to
    `python -m scaler aggregate`; b's ScaledObject (trigger metadata model=b) sees b's cold requests
    summed over the replicas, a's stays inactive with metric 0, a model nobody reported is inactive
    (not NOT_FOUND), and a SIGTERMed replica withdraws its demand."""
    import queue
    import re

    import grpc

    from scaler import externalscaler_pb2 as pb
    from scaler import externalscaler_pb2_grpc as pb_grpc

    token = tmp_path / "token"
    token.write_text("report-token")
    table = tmp_path / "models.json"
    table.write_text(json.dumps({"models": [{"name": n, "backendURL": backends[n].url} for n in ("a", "b")]}))
    root = Path(__file__).resolve().parents[2]
    aggregator = subprocess.Popen(
        [sys.executable, "-m", "scaler", "aggregate", "--host", "127.0.0.1", "--report-port", "0", "--scaler-port",
         "0", "--drain-grace-seconds", "1"],
        cwd=root, env={**os.environ, "PYTHONPATH": str(root), "NOCTAYA_AGGREGATOR_TOKEN_FILE": str(token)},
        stderr=subprocess.PIPE, text=True)
    gateways: list[subprocess.Popen] = []
    channel = None
    cold: list[threading.Thread] = []
    results: list[int] = []
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
        started = [_start_gateway_process(table, **report_env) for _ in range(2)]
        gateways = [proc for proc, _ in started]
        gateway_ports = [port for _, port in started]

        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        stub = pb_grpc.ExternalScalerStub(channel)

        def ref(model: str | None) -> pb.ScaledObjectRef:
            return pb.ScaledObjectRef(name=f"so-{model}", namespace="ns",
                                      scalerMetadata={"model": model} if model else {})

        def metric(model: str | None) -> int:
            return stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref(model), metricName="noctaya-demand"),
                                   timeout=5).metricValues[0].metricValue

        pushes: dict[str, queue.Queue] = {"a": queue.Queue(), "b": queue.Queue()}
        for model, q in pushes.items():
            def follow(m: str = model, q: queue.Queue = q) -> None:
                try:
                    for answer in stub.StreamIsActive(ref(m)):
                        q.put(answer.result)
                except grpc.RpcError:  # the channel closes at the end
                    pass
            threading.Thread(target=follow, daemon=True).start()
        assert pushes["a"].get(timeout=10) is False and pushes["b"].get(timeout=10) is False

        for port in gateway_ports:  # one cold request for b on each replica
            thread = threading.Thread(target=lambda p=port: results.append(requests.post(
                f"http://127.0.0.1:{p}/v1/chat/completions", json={"model": "b", "messages": MESSAGES},
                timeout=60).status_code))
            thread.start()
            cold.append(thread)
        assert pushes["b"].get(timeout=10) is True
        deadline = time.monotonic() + 10
        while metric("b") != 2:  # summed over both replicas
            assert time.monotonic() < deadline, "b's demand not summed over the replicas"
            time.sleep(0.05)
        assert stub.IsActive(ref("a"), timeout=5).result is False and metric("a") == 0 and pushes["a"].empty()
        assert stub.IsActive(ref("never-listed"), timeout=5).result is False and metric("never-listed") == 0
        assert metric(None) == 2  # no model: the sum over everything, as for a per-model gateway

        backends["b"].start()
        for thread in cold:
            thread.join(30)
        assert results == [200, 200] and posts(backends["a"]) == 0
        deadline = time.monotonic() + 10
        while metric("b") != 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for gateway in gateways:
            gateway.send_signal(signal.SIGTERM)
            assert gateway.wait(45) == 0
    finally:
        if channel is not None:
            channel.close()
        for proc in [*gateways, aggregator]:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.mark.skipif(__import__("shutil").which("openssl") is None, reason="needs the openssl CLI")
def test_a_shared_gateways_scaler_serves_mutual_tls_per_model(backends, tmp_path) -> None:
    """Scaler TLS in a shared gateway (local mode): the same three files as a per-model gateway's; KEDA's
    client certificate gets each model's answer, a client without one gets nothing; /metrics shows the
    certificate's expiry."""
    import grpc

    from scaler import externalscaler_pb2 as pb
    from scaler import externalscaler_pb2_grpc as pb_grpc
    from tests.pki import certificate_dates, expiry_gauges, make_ca, make_leaf
    from tests.ports import free_port

    for ca in ("ca", "rogue-ca"):
        make_ca(tmp_path, ca)
    make_leaf(tmp_path, "server", "ca", "serverAuth")
    make_leaf(tmp_path, "keda", "ca", "clientAuth")
    make_leaf(tmp_path, "intruder", "rogue-ca", "clientAuth")
    table = tmp_path / "models.json"
    table.write_text(json.dumps({"models": [{"name": n, "backendURL": backends[n].url} for n in ("a", "b")]}))
    scaler, admin = free_port(), free_port()
    proc, port = _start_gateway_process(
        table, NOCTAYA_SCALER_MODE="local", NOCTAYA_SCALER_PORT=str(scaler), NOCTAYA_ADMIN_PORT=str(admin),
        NOCTAYA_SCALER_TLS_CERT_FILE=str(tmp_path / "server.crt"),
        NOCTAYA_SCALER_TLS_KEY_FILE=str(tmp_path / "server.key"), NOCTAYA_SCALER_TLS_CA_FILE=str(tmp_path / "ca.crt"))

    def stub(client: str | None) -> tuple[grpc.Channel, pb_grpc.ExternalScalerStub]:
        creds = grpc.ssl_channel_credentials(
            root_certificates=(tmp_path / "ca.crt").read_bytes(),
            private_key=(tmp_path / f"{client}.key").read_bytes() if client else None,
            certificate_chain=(tmp_path / f"{client}.crt").read_bytes() if client else None)
        channel = grpc.secure_channel(f"127.0.0.1:{scaler}", creds,
                                      options=[("grpc.ssl_target_name_override", "localhost")])
        return channel, pb_grpc.ExternalScalerStub(channel)

    def ref(model: str) -> pb.ScaledObjectRef:
        return pb.ScaledObjectRef(name=model, namespace="ns", scalerMetadata={"model": model})

    channels = []
    try:
        keda_channel, keda = stub("keda")
        channels.append(keda_channel)
        assert keda.IsActive(ref("a"), timeout=10).result is False
        # The Pod-wide answers (model="") include until when the scaler's certificate is valid.
        metrics = requests.get(f"http://127.0.0.1:{admin}/metrics", timeout=5).text
        assert expiry_gauges(metrics) == {"scaler": certificate_dates((tmp_path / "server.crt").read_bytes())[1]}
        assert 'noctaya_tls_certificate_not_after_timestamp_seconds{model="",role="scaler"}' in metrics
        result: list[int] = []
        cold = threading.Thread(target=lambda: result.append(requests.post(
            f"http://127.0.0.1:{port}/v1/chat/completions", json={"model": "b", "messages": MESSAGES},
            timeout=60).status_code))
        cold.start()
        deadline = time.monotonic() + 10
        while not keda.IsActive(ref("b"), timeout=5).result:
            assert time.monotonic() < deadline, "b's demand not answered over TLS"
            time.sleep(0.05)
        assert keda.IsActive(ref("a"), timeout=5).result is False
        for client in (None, "intruder"):
            channel, other = stub(client)
            channels.append(channel)
            with pytest.raises(grpc.RpcError) as refused:
                other.IsActive(ref("b"), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        backends["b"].start()
        cold.join(30)
        assert result == [200]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(45) == 0
    finally:
        for channel in channels:
            channel.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_kubelet_swap_of_the_table_is_seen_at_once_not_at_the_next_poll(backends, tmp_path) -> None:
    """The table's directory is watched (inotify): with a reload period of a minute, a ConfigMap
    update as the kubelet writes it is served within a second or two; nothing polls in between."""
    from gateway.filewatch import watch_directory
    from gateway.modeltable import ModelTableFile

    probe = watch_directory(str(tmp_path))
    if probe is None:
        pytest.skip("inotify is not available here")
    probe.close()

    def swap(*models: dict) -> None:
        fresh = tmp_path / f"..{time.time_ns()}"
        fresh.mkdir()
        (fresh / "models.json").write_text(json.dumps({"models": list(models)}))
        (tmp_path / "..data_tmp").symlink_to(fresh.name)
        (tmp_path / "..data_tmp").replace(tmp_path / "..data")
        if not (tmp_path / "models.json").is_symlink():
            (tmp_path / "models.json").symlink_to("..data/models.json")

    a = {"name": "a", "backendURL": backends["a"].url}
    swap(a)
    base = GatewayConfig(backend_url="http://unused:1", served_model_name="unused", listen_host="127.0.0.1",
                         listen_port=0, admin_port=0, scaler_mode="off", max_held_body_bytes=64 * 2**20)
    table_file = ModelTableFile(tmp_path / "models.json", base)
    table = table_file.poll()
    assert table is not None
    gw = ThreadedGateway(base, app_factory=lambda: SharedGatewayApp(base, table, table_file=table_file,
                                                                    reload_seconds=60.0)).start()
    try:
        time.sleep(0.3)  # the watch is set up by the app's background greenlet
        swap(a, {"name": "b", "backendURL": backends["b"].url})
        t0 = time.monotonic()
        while [m["id"] for m in requests.get(f"{gw.url}/v1/models", timeout=5).json()["data"]] != ["a", "b"]:
            assert time.monotonic() - t0 < 3, "the swap was not seen: only the 60 s poll would find it"
            time.sleep(0.05)
    finally:
        gw.stop()


@pytest.mark.parametrize("table", ["every model keyed", "an open model too"])
def test_a_valid_key_gets_openais_404_for_an_unknown_model_and_for_one_it_does_not_open(
        backends, team_keys, table) -> None:
    """Through the openai client: a valid key (a key of some model) naming a model that does not
    exist, or one its key does not open, gets the same 404 ``model_not_found`` in OpenAI's words; a
    wrong key gets 401; nothing is woken for either."""
    entries = [{"name": "a", "backendURL": backends["a"].url, "authKeyFiles": team_keys("team1")},
               {"name": "org/b", "backendURL": backends["b"].url, "authKeyFiles": team_keys("team2")}]
    if table == "an open model too":
        entries.append({"name": "org/c", "backendURL": backends["c"].url})
    gw = serve_table(*entries)
    try:
        team1 = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="key-team1", max_retries=0, timeout=30)
        answers = {}
        for model in ("org/b", "org/nope"):
            with pytest.raises(openai.NotFoundError) as missing:
                team1.chat.completions.create(model=model, messages=MESSAGES)
            error = missing.value.response.json()["error"]
            assert error == {"message": f"The model `{model}` does not exist or you do not have access to it.",
                             "type": "invalid_request_error", "param": None, "code": "model_not_found"}
            with pytest.raises(openai.NotFoundError) as listed:
                team1.models.retrieve(model)
            assert listed.value.response.json()["error"] == error
            answers[model] = (missing.value.response.status_code, missing.value.response.headers.get("content-length"))
        assert answers["org/b"][0] == answers["org/nope"][0] == 404
        wrong = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="key-team3", max_retries=0, timeout=30)
        for model in ("a", "org/nope"):
            with pytest.raises(openai.AuthenticationError) as refused:
                wrong.chat.completions.create(model=model, messages=MESSAGES)
            assert refused.value.code == "invalid_api_key"
        assert all(posts(backends[n]) == 0 and backends[n].health_checks == 0 for n in ("a", "b", "c"))
    finally:
        gw.stop()


def test_a_model_is_refused_alike_whether_it_exists_or_not_in_the_same_steps(team_keys, monkeypatch) -> None:
    """No timing oracle: a valid key's request for a model that does not exist and for one it does
    not open run the same lookups, and neither reads a key file (only a granted model's files are
    reread)."""
    import gateway.auth as auth_module

    base = keyed_base()
    table = parse_model_table(json.dumps({"models": [
        {"name": "a", "backendURL": "http://a.ns.svc:8000", "authKeyFiles": team_keys("team1")},
        {"name": "org/b", "backendURL": "http://b.ns.svc:8000", "authKeyFiles": team_keys("team2")}]}).encode(), base)
    app = SharedGatewayApp(base, table)
    try:
        reads: list[str] = []
        real = auth_module.read_secret_file
        monkeypatch.setattr(auth_module, "read_secret_file", lambda path: reads.append(path) or real(path))
        assert app._refusal("a", b"Bearer key-team1") is None
        assert reads == team_keys("team1", "team2") + team_keys("team1")  # the index, then a's own check
        reads.clear()
        assert app._refusal("org/b", b"Bearer key-team1") == app._refusal("org/nope", b"Bearer key-team1") \
            == "model_not_found"
        assert reads == []
        assert app._refusal("org/b", b"Bearer key-team3") == app._refusal("org/nope", None) == "unauthorized"
        assert reads == []
    finally:
        app.close()
