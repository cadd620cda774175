"""Client API-key authentication through the real openai client."""

from __future__ import annotations

import json
import threading

import openai
import pytest
import requests

from tests.gateway.conftest import wait_for

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
