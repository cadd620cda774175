"""Client API-key authentication through the real openai client."""

from __future__ import annotations

import json
import socket
import threading

import openai
import pytest
import requests

from gateway.auth import KeyIndex
from tests.gateway.conftest import wait_for
from tests.gateway.harness import exchange

MESSAGES = [{"role": "user", "content": "hi"}]


def test_wrong_or_missing_key_is_401_without_consuming_a_slot(backend, make_gateway, tmp_path) -> None:
    key = tmp_path / "api-key"
    key.write_text("first-key\n")
    gw = make_gateway(backend, auth_key_file=str(key), max_queue=1)
    # Occupy the only slot with a cold request that waits.
    held = threading.Thread(target=lambda: requests.post(
        gw.url + "/v1/chat/completions", json={"model": "m", "messages": MESSAGES},
        headers={"Authorization": "Bearer first-key"}, timeout=30), daemon=True)
    held.start()
    wait_for(lambda: requests.get(gw.admin_url + "/noctaya/queue", timeout=5).json()["queued"] == 1, what="held")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "first-key"}):
        resp = requests.post(gw.url + "/v1/chat/completions", json={"model": "m"}, headers=headers, timeout=10)
        # 401, not 429: authentication runs before admission, and takes no slot.
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
        assert "first-key" not in resp.text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gw.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert requests.get(gw.admin_url + "/noctaya/queue", timeout=5).json()["queued"] == 1
    # With the right key but the slot taken, the answer is 429.
    resp = requests.post(gw.url + "/v1/chat/completions", json={"model": "m"},
                         headers={"Authorization": "Bearer first-key"}, timeout=10)
    assert resp.status_code == 429
    backend.start()
    held.join(30)
    metrics = requests.get(gw.admin_url + "/metrics", timeout=5).text
    assert 'noctaya_gateway_rejections_total{reason="unauthorized"} 4.0' in metrics
    assert "first-key" not in metrics


def test_rotated_key_file_applies_to_the_next_request(backend, make_gateway, tmp_path) -> None:
    backend.start()
    key = tmp_path / "api-key"
    key.write_text("old")
    gw = make_gateway(backend, auth_key_file=str(key))
    old = openai.OpenAI(base_url=gw.url + "/v1", api_key="old", max_retries=0, timeout=30)
    new = openai.OpenAI(base_url=gw.url + "/v1", api_key="new", max_retries=0, timeout=30)
    assert old.chat.completions.create(model="m", messages=MESSAGES).choices
    # Kubernetes swaps projected Secret files atomically; do the same.
    tmp = tmp_path / "api-key.tmp"
    tmp.write_text("new\n")
    tmp.replace(key)
    with pytest.raises(openai.AuthenticationError):
        old.chat.completions.create(model="m", messages=MESSAGES)
    assert new.chat.completions.create(model="m", messages=MESSAGES).choices
    streamed = list(new.chat.completions.create(model="m", messages=MESSAGES, stream=True))
    assert streamed


def test_probe_and_monitoring_endpoints_need_no_api_key(backend, make_gateway, tmp_path) -> None:
    key = tmp_path / "api-key"
    key.write_text("k")
    gw = make_gateway(backend, auth_key_file=str(key))
    assert requests.get(gw.url + "/healthz", timeout=5).status_code == 200
    assert requests.get(gw.admin_url + "/metrics", timeout=5).status_code == 200
    q = requests.get(gw.admin_url + "/noctaya/queue", timeout=5)
    assert q.status_code == 200 and set(json.loads(q.text)) >= {"queued", "inFlight", "lease", "backendReady"}


def declared_body_head(authorization: bytes | None, *, expect_continue: bool = False,
                       length: int = 8 * 1024 * 1024) -> bytes:
    """A POST head that declares an 8 MiB body (the default limit) which the test never sends."""
    lines = [b"POST /v1/chat/completions HTTP/1.1", b"Host: gw", b"Content-Type: application/json",
             b"Content-Length: %d" % length]
    if authorization is not None:
        lines.append(b"Authorization: " + authorization)
    if expect_continue:
        lines.append(b"Expect: 100-continue")
    return b"\r\n".join(lines) + b"\r\n\r\n"


REFUSED_AUTHORIZATIONS = [None, b"Bearer wrong", b"Bearer ", b"Basic Zmlyc3Qta2V5"]


@pytest.mark.parametrize("expect_continue", [False, True])
@pytest.mark.parametrize("authorization", REFUSED_AUTHORIZATIONS)
def test_a_per_model_gateway_refuses_a_wrong_key_before_any_body_byte(
        backend, make_gateway, tmp_path, authorization, expect_continue) -> None:
    """The body is never sent: a 401 at all shows nothing waited for it; no ``100
    Continue`` invites it, and the connection closes (the unread body cannot be skipped)."""
    key = tmp_path / "api-key"
    key.write_text("first-key\n")
    gw = make_gateway(backend, auth_key_file=str(key))
    _, answer = exchange(gw.port, declared_body_head(authorization, expect_continue=expect_continue))
    assert answer.startswith(b"HTTP/1.1 401 ") and b"100 Continue" not in answer
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"\r\nconnection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "invalid_api_key" and b"first-key" not in answer
    assert backend.health_checks == 0 and gw.call(lambda: gw.app.admitted) == 0


def test_the_right_key_is_invited_to_send_its_body(backend, make_gateway, tmp_path) -> None:
    """The control of the test above: with the key, ``Expect: 100-continue`` is answered ``100
    Continue`` and the body then sent is served."""
    backend.start()
    key = tmp_path / "api-key"
    key.write_text("first-key\n")
    gw = make_gateway(backend, auth_key_file=str(key))
    body = json.dumps({"model": "m", "messages": MESSAGES}).encode()
    head = declared_body_head(b"Bearer first-key", expect_continue=True, length=len(body))
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
        sock.sendall(head)
        assert sock.recv(4096) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")


def test_the_key_index_opens_only_current_keys_and_rereads_its_files_when_stale(tmp_path) -> None:
    """A shared gateway's check before the body: the union of the files' keys, reread at most every
    ``refresh_seconds``; a missing or empty file opens nothing."""
    (tmp_path / "one").write_text("key-one\n")
    (tmp_path / "two").write_text("key-two")
    (tmp_path / "empty").write_text("\n")
    now = [0.0]
    index = KeyIndex([str(tmp_path / n) for n in ("one", "two", "empty", "missing", "one")],
                     refresh_seconds=1.0, clock=lambda: now[0])
    assert index.key_files == tuple(str(tmp_path / n) for n in ("one", "two", "empty", "missing"))
    assert index.check(b"Bearer key-one") and index.check("bearer  key-two ")
    for refused in (None, b"", b"Bearer", b"Bearer ", b"key-one", b"Basic key-one", b"Bearer key-on",
                    b"Bearer key-one-more"):
        assert not index.check(refused)
    (tmp_path / "one").write_text("rotated")
    now[0] = 0.5
    assert index.check(b"Bearer key-one") and not index.check(b"Bearer rotated")  # not reread yet
    now[0] = 1.5
    assert index.check(b"Bearer rotated") and not index.check(b"Bearer key-one")


def test_a_per_model_gateway_answers_openais_404_for_another_model_and_401_for_a_wrong_key(
        backend, make_gateway, tmp_path) -> None:
    """One model's gateway (its backend cold: answered here, nothing woken): a valid key asking for
    a model it does not serve gets OpenAI's 404 in OpenAI's words, a wrong key 401 whatever it asks.
    (Once warm, a request is forwarded as it is: the backend's own 404 reaches the client.)"""
    key = tmp_path / "api-key"
    key.write_text("the-key\n")
    gw = make_gateway(backend, auth_key_file=str(key))
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="the-key", max_retries=0, timeout=30)
    assert client.models.retrieve("test-model").id == "test-model"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("other-model")
    assert missing.value.response.json()["error"] == {
        "message": "The model `other-model` does not exist or you do not have access to it.",
        "type": "invalid_request_error", "param": None, "code": "model_not_found"}
    wrong = openai.OpenAI(base_url=gw.url + "/v1", api_key="wrong", max_retries=0, timeout=30)
    for model in ("test-model", "other-model"):
        with pytest.raises(openai.AuthenticationError):
            wrong.models.retrieve(model)
        with pytest.raises(openai.AuthenticationError):
            wrong.chat.completions.create(model=model, messages=MESSAGES)
    assert backend.health_checks == 0 and requests.get(gw.admin_url + "/noctaya/queue", timeout=5).json()["queued"] == 0
