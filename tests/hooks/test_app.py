"""The hook server shell: HTTP contract, errors, auth, ETag, metrics, and a real gunicorn server.

Most tests inject stand-in hook functions through ``create_app(handlers=...)`` so the shell is
tested on its own; the tests at the end run the real hooks end to end (golden fixtures through
HTTP, ``python -m hooks serve`` as a subprocess).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from hooks.app import (
    HOOK_ROUTES,
    HookOverloaded,
    create_app,
    etag_for,
    load_default_handlers,
    read_token_file,
)
from hooks.errors import InvalidHookRequest

ROOT = Path(__file__).resolve().parents[2]
SYNC = "/v1/llmservice/sync"
CUSTOMIZE = "/v1/llmservice/customize"
SECRET_DATA = "c3VwZXItc2VjcmV0LWFwaS1rZXk="  # base64 Secret data that must never leave the request


# ------------------------------------------------------------------------------------ stand-in hooks


def stub_sync(request: dict[str, Any], config: Any) -> dict[str, Any]:
    """Shaped like a CompositeController sync answer and derived from the request, so it changes."""
    parent = request.get("parent")
    if not isinstance(parent, dict):
        raise InvalidHookRequest("request has no parent object")
    name = parent["metadata"]["name"]
    return {
        "status": {"observedGeneration": parent["metadata"].get("generation", 0), "configSeen": config},
        "children": [
            {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": f"{name}-backend"}},
            {"apiVersion": "v1", "kind": "Service", "metadata": {"name": f"{name}-gateway"}},
        ],
        "resyncAfterSeconds": 0.0,
        "finalized": False,
    }


def stub_customize(request: dict[str, Any], config: Any) -> dict[str, Any]:
    return {"relatedResources": []}


def crashing_hook(request: dict[str, Any], config: Any) -> dict[str, Any]:
    raise RuntimeError("hook bug")


def sync_request(name: str = "qwen", generation: int = 1) -> dict[str, Any]:
    return {
        "controller": {"metadata": {"name": "noctaya-llmservice"}},
        "parent": {
            "apiVersion": "serving.noctaya.io/v1alpha1",
            "kind": "LLMService",
            "metadata": {"name": name, "namespace": "models", "generation": generation, "uid": "u-1"},
            "spec": {"model": "hf://Qwen/Qwen2.5-0.5B-Instruct"},
        },
        "children": {
            "Secret.v1": {
                f"models/{name}-token": {
                    "metadata": {"name": f"{name}-token"},
                    "data": {"token": SECRET_DATA},
                }
            }
        },
        "related": {},
        "finalizing": False,
    }


@pytest.fixture()
def client():
    app = create_app({SYNC: stub_sync, CUSTOMIZE: stub_customize}, config="cfg")
    return app.test_client()


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


# ------------------------------------------------------------------------------------------ basics


def test_healthz(client) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.get_json() == {"status": "ok"}


def test_sync_answers_handler_result_compact_in_handler_key_order(client) -> None:
    response = client.post(SYNC, json=sync_request())
    assert response.status_code == 200
    assert response.content_type == "application/json"
    body = response.get_data()
    expected = stub_sync(sync_request(), "cfg")
    assert body == json.dumps(expected, separators=(",", ":")).encode()
    assert list(json.loads(body)) == ["status", "children", "resyncAfterSeconds", "finalized"]
    assert json.loads(body)["status"]["configSeen"] == "cfg"  # the app's config reaches the handler
    assert response.headers["ETag"] == '"' + hashlib.sha256(body).hexdigest() + '"'


def test_same_request_gives_byte_identical_body_and_etag(client) -> None:
    first = client.post(SYNC, json=sync_request())
    second = client.post(SYNC, data=json.dumps(sync_request(), indent=2), content_type="application/json")
    assert first.get_data() == second.get_data()
    assert first.headers["ETag"] == second.headers["ETag"]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"", "empty"),
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe\x00garbage", "JSON"),
        (b"[1, 2, 3]", "must be a JSON object, got list"),
        (b'"just a string"', "must be a JSON object, got str"),
        (b"null", "got NoneType"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ],
    ids=["empty", "not-json", "not-utf8", "array", "string", "null", "deeply-nested"],
)
def test_malformed_body_is_400_json(client, body: bytes, fragment: str) -> None:
    response = client.post(SYNC, data=body, content_type="application/json")
    assert response.status_code == 400
    error = response.get_json()["error"]
    assert error["type"] == "bad_request"
    assert fragment in error["message"]
    assert "ETag" not in response.headers


def test_invalid_hook_request_is_400_with_its_message(client) -> None:
    request = sync_request()
    del request["parent"]
    response = client.post(SYNC, json=request)
    assert response.status_code == 400
    assert response.get_json() == {
        "error": {"message": "request has no parent object", "type": "bad_request"}
    }


def test_handler_crash_is_500_json_logged_with_traceback_and_no_request_data(caplog) -> None:
    app = create_app({SYNC: crashing_hook})
    with caplog.at_level(logging.INFO, logger="noctaya.hooks"):
        response = app.test_client().post(SYNC, json=sync_request())
    assert response.status_code == 500
    error = response.get_json()["error"]
    assert error["type"] == "internal"
    assert "llmservice_sync" in error["message"]
    assert "hook bug" not in error["message"]  # exception text can quote request data
    logged = "\n".join(caplog.text.splitlines())
    assert "Traceback" in logged and "RuntimeError: hook bug" in logged
    assert SECRET_DATA not in logged


@pytest.mark.parametrize(
    "result",
    [["not", "an", "object"], None, {"status": {"ratio": float("nan")}}, {"children": [object()]}],
    ids=["list", "none", "nan", "unserialisable"],
)
def test_unusable_handler_result_is_500_never_200(result: Any) -> None:
    app = create_app({SYNC: lambda request, config: result})
    response = app.test_client().post(SYNC, json=sync_request())
    assert response.status_code == 500
    assert response.get_json()["error"]["type"] == "internal"


def test_overloaded_handler_is_429_with_retry_after() -> None:
    def busy(request: dict[str, Any], config: Any) -> dict[str, Any]:
        raise HookOverloaded(retry_after_seconds=7)

    response = create_app({SYNC: busy}).test_client().post(SYNC, json=sync_request())
    assert response.status_code == 429
    assert response.headers["Retry-After"] == "7"
    assert response.get_json()["error"]["type"] == "overloaded"


def test_unknown_path_and_wrong_method_are_json(client) -> None:
    missing = client.post("/v1/nope", json={})
    assert missing.status_code == 404 and missing.get_json()["error"]["type"] == "not_found"
    wrong_method = client.get(SYNC)
    assert wrong_method.status_code == 405
    assert wrong_method.get_json()["error"]["type"] == "method_not_allowed"
    assert "POST" in wrong_method.headers["Allow"]


def test_only_known_paths_can_be_wired() -> None:
    with pytest.raises(ValueError, match="/v1/other"):
        create_app({"/v1/other": stub_sync})


def test_route_table_matches_architecture_doc() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    for route in HOOK_ROUTES:
        assert f"`{route.path}`" in doc, route.path
        assert f"`{route.module}.{route.function}(" in doc, route.module


# ----------------------------------------------------------------------------------- body size bound


def test_body_over_limit_is_413_and_flooding_it_leaves_the_server_usable() -> None:
    app = create_app({SYNC: stub_sync}, max_body_bytes=4096)
    client = app.test_client()
    oversize = json.dumps({"parent": {"metadata": {"name": "x"}}, "pad": "x" * 8192})
    for _ in range(50):
        response = client.post(SYNC, data=oversize, content_type="application/json")
        assert response.status_code == 413
        assert response.get_json()["error"]["type"] == "payload_too_large"
    assert client.post(SYNC, json=sync_request()).status_code == 200
    samples = metric_samples(client.get("/metrics").get_data(as_text=True))
    assert (
        samples[("noctaya_hook_errors_total", (("hook", "llmservice_sync"), ("kind", "payload_too_large")))]
        == 50
    )


def test_max_body_bytes_from_env(monkeypatch) -> None:
    monkeypatch.setenv("NOCTAYA_HOOK_MAX_BODY_BYTES", "100")
    client = create_app({SYNC: stub_sync}).test_client()
    assert client.post(SYNC, json=sync_request()).status_code == 413
    monkeypatch.setenv("NOCTAYA_HOOK_MAX_BODY_BYTES", "-1")
    with pytest.raises(ValueError):
        create_app({SYNC: stub_sync})


# ------------------------------------------------------------------------------------------- auth


def test_bearer_token_guards_hook_routes_only() -> None:
    client = create_app({SYNC: stub_sync}, token="s3cret-token").test_client()
    no_header = client.post(SYNC, json=sync_request())
    assert no_header.status_code == 401
    assert no_header.get_json()["error"]["type"] == "unauthorized"
    assert no_header.headers["WWW-Authenticate"].startswith("Bearer")
    for header in (
        "Bearer wrong",
        "Bearer s3cret-token-and-more",
        "Basic czNjcmV0LXRva2Vu",
        "s3cret-token",
        "Bearer",
    ):
        response = client.post(SYNC, json=sync_request(), headers={"Authorization": header})
        assert response.status_code == 401, header
        assert "s3cret" not in response.get_data(as_text=True)
    # Metacontroller sends "<type> <trimmed secret>", type defaulting to Bearer; the scheme is
    # case-insensitive (RFC 7235).
    for header in ("Bearer s3cret-token", "bearer s3cret-token", "BEARER  s3cret-token "):
        assert client.post(SYNC, json=sync_request(), headers={"Authorization": header}).status_code == 200, (
            header
        )
    assert client.get("/healthz").status_code == 200
    assert client.get("/metrics").status_code == 200


def test_unauthenticated_request_is_rejected_before_the_body_is_read() -> None:
    calls = []
    client = create_app({SYNC: lambda r, c: calls.append(r) or {}}, token="t0ken").test_client()
    assert client.post(SYNC, data=b"{not json").status_code == 401
    assert calls == []


def test_token_file_is_trimmed_and_reloaded_when_rotated(tmp_path: Path, monkeypatch) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("file-token\n")  # a Secret key file written with a trailing newline
    monkeypatch.setenv("NOCTAYA_HOOK_TOKEN_FILE", str(token_file))
    client = create_app({SYNC: stub_sync}).test_client()

    def status(token: str | None) -> int:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return client.post(SYNC, json=sync_request(), headers=headers).status_code

    assert (status("file-token"), status(None)) == (200, 401)
    token_file.write_text("rotated-token\n")  # the kubelet swapped the Secret: no restart needed
    assert (status("rotated-token"), status("file-token")) == (200, 401)
    token_file.unlink()  # a moment without the file keeps the last good token
    assert (status("rotated-token"), status("file-token")) == (200, 401)


def test_empty_token_file_refuses_to_start(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        read_token_file(token_file)
    with pytest.raises(ValueError):
        create_app({SYNC: stub_sync}, token=" ")


# ------------------------------------------------------------------------------------------- ETag


def test_if_none_match_with_current_etag_is_304_without_body(client) -> None:
    first = client.post(SYNC, json=sync_request())
    etag = first.headers["ETag"]
    for header in (etag, f"W/{etag}", f'"other", {etag}', "*"):
        again = client.post(SYNC, json=sync_request(), headers={"If-None-Match": header})
        assert again.status_code == 304, header
        assert again.get_data() == b""
        assert again.headers["ETag"] == etag


def test_changed_answer_is_200_with_new_etag_despite_stale_if_none_match(client) -> None:
    old = client.post(SYNC, json=sync_request(generation=1))
    new = client.post(SYNC, json=sync_request(generation=2), headers={"If-None-Match": old.headers["ETag"]})
    assert new.status_code == 200
    assert new.headers["ETag"] != old.headers["ETag"]
    assert new.headers["ETag"] == etag_for(new.get_data())
    assert new.get_json()["status"]["observedGeneration"] == 2


def test_errors_never_answer_304() -> None:
    client = create_app({SYNC: crashing_hook}).test_client()
    assert client.post(SYNC, json=sync_request(), headers={"If-None-Match": "*"}).status_code == 500


# ---------------------------------------------------------------------------------------- metrics


def test_metrics_count_latency_and_errors_with_bounded_labels() -> None:
    client = create_app({SYNC: stub_sync, CUSTOMIZE: crashing_hook}).test_client()
    before = metric_samples(client.get("/metrics").get_data(as_text=True))
    sync_count = ("noctaya_hook_duration_seconds_count", (("hook", "llmservice_sync"),))
    assert before[sync_count] == 0  # series exist before the first call
    for generation in range(3):
        client.post(SYNC, json=sync_request(generation=generation))
    client.post(SYNC, data=b"[]")
    client.post(CUSTOMIZE, json=sync_request())
    client.post(CUSTOMIZE, json=sync_request())
    text = client.get("/metrics").get_data(as_text=True)
    after = metric_samples(text)
    assert after[sync_count] == 4
    assert after[("noctaya_hook_duration_seconds_count", (("hook", "llmservice_customize"),))] == 2
    assert after[("noctaya_hook_errors_total", (("hook", "llmservice_sync"), ("kind", "bad_request")))] == 1
    assert after[("noctaya_hook_errors_total", (("hook", "llmservice_customize"), ("kind", "internal")))] == 2
    assert after[("noctaya_hook_errors_total", (("hook", "llmservice_sync"), ("kind", "internal")))] == 0
    label_values = {value for (_, labels) in after for (_, value) in labels}
    assert "qwen" not in " ".join(label_values) and "models" not in label_values


def test_one_log_line_per_hook_call_without_body(client, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="noctaya.hooks"):
        client.post(SYNC, json=sync_request())
        client.get("/healthz")
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "noctaya.hooks"]
    assert len(lines) == 1
    assert lines[0]["hook"] == "llmservice_sync"
    assert lines[0]["object"] == "models/qwen"
    assert lines[0]["status"] == 200
    assert lines[0]["durationMs"] >= 0
    assert SECRET_DATA not in caplog.text


def test_app_is_safe_under_concurrent_calls() -> None:
    app = create_app({SYNC: stub_sync})

    def call(i: int) -> tuple[int, int]:
        response = app.test_client().post(SYNC, json=sync_request(name=f"svc-{i}", generation=i))
        return response.status_code, response.get_json()["status"]["observedGeneration"]

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(call, range(64)))
    assert results == [(200, i) for i in range(64)]


# ------------------------------------------------------------------------------ real gunicorn server


STUB_SERVER = textwrap.dedent(
    """
    import sys
    from hooks.errors import InvalidHookRequest
    from hooks.gunicorn_conf import HookServer, server_options
    from tests.hooks.test_app import stub_sync

    def factory():
        from hooks.app import create_app
        return create_app({"/v1/llmservice/sync": stub_sync}, config="cfg", token="gunicorn-token")

    HookServer(factory, server_options(bind="127.0.0.1:0", workers=2, threads=2, graceful_timeout=5)).run()
    """
)


def _wait_for_port(log_file: Path, proc: subprocess.Popen, deadline_seconds: float = 60.0) -> int:
    deadline = time.monotonic() + deadline_seconds
    while time.monotonic() < deadline:
        match = re.search(r"Listening at: http://127\.0\.0\.1:(\d+)", log_file.read_text(errors="replace"))
        if match:
            return int(match.group(1))
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{log_file.read_text()}")
        time.sleep(0.05)
    raise AssertionError(f"server did not listen within {deadline_seconds}s:\n{log_file.read_text()}")


def _start(
    args: list[str], tmp_path: Path, env_extra: dict[str, str] | None = None
) -> tuple[subprocess.Popen, Path]:
    log_file = tmp_path / "server.log"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PROMETHEUS_MULTIPROC_DIR", "NOCTAYA_HOOK_TOKEN_FILE")
    }
    env.update({"PYTHONPATH": str(ROOT), **(env_extra or {})})
    with log_file.open("wb") as sink:
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
    return proc, log_file


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture()
def stub_gunicorn(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    metrics_dir = tmp_path / "prom"
    metrics_dir.mkdir()
    proc, log_file = _start(
        [sys.executable, "-c", STUB_SERVER], tmp_path, {"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
    )
    try:
        port = _wait_for_port(log_file, proc)
        yield f"http://127.0.0.1:{port}", log_file
    finally:
        _stop(proc)


def test_real_gunicorn_serves_hooks_health_and_aggregated_metrics(stub_gunicorn) -> None:
    base, log_file = stub_gunicorn
    assert requests.get(f"{base}/healthz", timeout=30).json() == {"status": "ok"}
    auth = {"Authorization": "Bearer gunicorn-token"}
    assert requests.post(f"{base}{SYNC}", json=sync_request(), timeout=30).status_code == 401

    # Fresh connections spread the calls over both workers; /metrics must sum all of them.
    def call(i: int) -> int:
        response = requests.post(f"{base}{SYNC}", json=sync_request(generation=i), headers=auth, timeout=30)
        assert response.json()["status"]["observedGeneration"] == i
        return response.status_code

    with ThreadPoolExecutor(max_workers=6) as pool:
        assert list(pool.map(call, range(30))) == [200] * 30

    with requests.Session() as session:  # keep-alive connection, as Metacontroller uses
        first = session.post(f"{base}{SYNC}", json=sync_request(), headers=auth, timeout=30)
        cached = session.post(
            f"{base}{SYNC}",
            json=sync_request(),
            headers={**auth, "If-None-Match": first.headers["ETag"]},
            timeout=30,
        )
        assert (first.status_code, cached.status_code, cached.content) == (200, 304, b"")
        bad = session.post(f"{base}{SYNC}", data=b"[]", headers=auth, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "bad_request"

    samples = metric_samples(requests.get(f"{base}/metrics", timeout=30).text)
    # 1 unauthorised + 30 + 2 + 1 bad request, whichever worker answered each.
    assert samples[("noctaya_hook_duration_seconds_count", (("hook", "llmservice_sync"),))] == 34
    assert (
        samples[("noctaya_hook_errors_total", (("hook", "llmservice_sync"), ("kind", "unauthorized")))] == 1
    )
    assert samples[("noctaya_hook_errors_total", (("hook", "llmservice_sync"), ("kind", "bad_request")))] == 1
    assert SECRET_DATA not in log_file.read_text()


def test_idle_keepalive_connections_beyond_the_thread_count_do_not_block_hook_calls(stub_gunicorn) -> None:
    """gthread parks idle keep-alive connections in a poller: 24 idle clients > 2 workers x 2 threads."""
    base, _ = stub_gunicorn
    auth = {"Authorization": "Bearer gunicorn-token"}
    idle_sessions = [requests.Session() for _ in range(24)]
    try:
        for session in idle_sessions:  # one call each, then the connection stays open and idle
            assert session.get(f"{base}/healthz", timeout=30).status_code == 200

        def call(i: int) -> int:
            response = requests.post(
                f"{base}{SYNC}", json=sync_request(generation=i), headers=auth, timeout=30
            )
            return response.status_code

        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=16) as pool:
            codes = list(pool.map(call, range(120)))
        assert codes == [200] * 120
        # Each parked connection would hold a thread for gunicorn's 5 s data wait if it were not
        # parked; 24 of them on 4 threads would cost >= 30 s. Generous for a loaded CI machine.
        assert time.monotonic() - started < 20.0
        for session in idle_sessions:  # and the parked connections are still usable
            assert session.get(f"{base}/healthz", timeout=30).status_code == 200
    finally:
        for session in idle_sessions:
            session.close()


def test_stub_gunicorn_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    proc, log_file = _start([sys.executable, "-c", STUB_SERVER], tmp_path)
    try:
        port = _wait_for_port(log_file, proc)
        assert requests.get(f"http://127.0.0.1:{port}/healthz", timeout=30).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log_file.read_text()
    finally:
        _stop(proc)


# --------------------------------------------------------------------------- the real hooks, end to end


def test_python_m_hooks_serve_answers_the_real_hooks(tmp_path: Path) -> None:
    from bench.hooks_bench import load_request

    token_file = tmp_path / "token"
    token_file.write_text("serve-token\n")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc, log_file = _start(
        [sys.executable, "-m", "hooks", "serve", "--bind", "127.0.0.1:0", "--workers", "2", "--threads", "2"],
        tmp_path,
        {"NOCTAYA_HOOK_TOKEN_FILE": str(token_file), "TMPDIR": str(scratch)},
    )
    try:
        port = _wait_for_port(log_file, proc)
        base = f"http://127.0.0.1:{port}"
        auth = {"Authorization": "Bearer serve-token"}
        assert requests.get(f"{base}/healthz", timeout=30).status_code == 200
        request, _ = load_request()
        assert requests.post(f"{base}{SYNC}", json=request, timeout=30).status_code == 401
        answer = requests.post(f"{base}{SYNC}", json=request, headers=auth, timeout=30)
        assert answer.status_code == 200, answer.text
        assert set(answer.json()) <= {"status", "children", "resyncAfterSeconds", "finalized"}
        assert answer.json()["children"]
        not_a_request = requests.post(f"{base}{SYNC}", json={"parent": "nope"}, headers=auth, timeout=30)
        assert not_a_request.status_code == 400
        assert not_a_request.json()["error"]["type"] == "bad_request"
        metrics = requests.get(f"{base}/metrics", timeout=30).text
        assert 'noctaya_hook_duration_seconds_count{hook="llmservice_sync"}' in metrics
        assert list(scratch.glob("noctaya-hooks-metrics-*")), "multiprocess metrics directory not created"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log_file.read_text()
        assert not list(scratch.glob("noctaya-hooks-metrics-*")), "metrics directory left behind"
    finally:
        _stop(proc)


GOLDEN = ROOT / "tests" / "fixtures" / "hooks"
# Fixture `hook` file → the path Metacontroller calls for it.
PATH_OF_GOLDEN_HOOK = {
    "customize": "/v1/llmservice/customize",
    "sync": "/v1/llmservice/sync",
    "finalize": "/v1/llmservice/finalize",
    "autoscaling.customize": "/v1/llmservice/autoscaling/customize",
    "autoscaling.sync": "/v1/llmservice/autoscaling/sync",
    "runtime_status.sync": "/v1/inferenceruntime/sync",
}


def _golden_cases() -> list[str]:
    if not GOLDEN.is_dir():
        return []
    return sorted(p.name for p in GOLDEN.iterdir() if (p / "request.json").is_file())


@pytest.mark.parametrize("case", _golden_cases())
def test_golden_fixture_through_http_returns_expected_bytes(case: str) -> None:
    from tests.hooks import helpers

    folder = GOLDEN / case
    path = PATH_OF_GOLDEN_HOOK[(folder / "hook").read_text().strip()]
    expected = json.loads((folder / "expected.json").read_text())
    client = create_app(config=helpers.config(helpers.LATER_TIME)).test_client()
    raw_request = (folder / "request.json").read_bytes()

    response = client.post(path, data=raw_request, content_type="application/json")
    assert response.status_code == 200, response.get_data(as_text=True)
    assert response.get_json() == expected
    assert response.get_data() == json.dumps(expected, separators=(",", ":")).encode()  # key order kept
    assert response.headers["ETag"] == etag_for(response.get_data())
    cached = client.post(
        path,
        data=raw_request,
        content_type="application/json",
        headers={"If-None-Match": response.headers["ETag"]},
    )
    assert (cached.status_code, cached.get_data()) == (304, b"")


@pytest.mark.parametrize("path", [route.path for route in HOOK_ROUTES])
@pytest.mark.parametrize(
    "body", [b"{}", b'{"parent": []}', b'{"object": 3}'], ids=["empty-object", "parent-list", "object-number"]
)
def test_real_hooks_answer_unreadable_requests_with_400(path: str, body: bytes) -> None:
    from tests.hooks import helpers

    client = create_app(config=helpers.config()).test_client()
    response = client.post(path, data=body, content_type="application/json")
    assert response.status_code == 400, response.get_data(as_text=True)
    assert response.get_json()["error"]["type"] == "bad_request"


def test_serve_refuses_to_start_with_an_empty_token_file(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("\n")
    proc, log_file = _start(
        [sys.executable, "-m", "hooks", "serve", "--bind", "127.0.0.1:0", "--workers", "1"],
        tmp_path,
        {"NOCTAYA_HOOK_TOKEN_FILE": str(token_file)},
    )
    try:
        assert proc.wait(timeout=60) != 0
        output = log_file.read_text()
        assert f"hook token file {token_file} is empty" in output
        assert "Listening at" not in output  # preload: the app fails before any socket is bound
    finally:
        _stop(proc)


def test_every_route_is_wired_to_a_real_hook() -> None:
    assert set(load_default_handlers()) == {route.path for route in HOOK_ROUTES}


# ------------------------------------------------------------------ release version (hooks.compat)


def _version_parts() -> tuple[int, int, int]:
    from hooks.version import __version__

    major, minor, patch = (int(part) for part in __version__.split("."))
    return major, minor, patch


def _older() -> str:
    major, minor, patch = _version_parts()
    if patch:
        return f"{major}.{minor}.{patch - 1}"
    return f"{major}.{minor - 1}.99" if minor else f"{major - 1}.99.99"


def _newer() -> list[str]:
    major, minor, patch = _version_parts()
    # minor + 10: one more digit, which a comparison of strings would put before the release.
    return [f"{major}.{minor}.{patch + 1}", f"{major}.{minor + 10}.0", f"{major + 1}.0.0"]


def annotated_request(version: Any = None, controller: str = "noctaya-llmservice", **extra: Any) -> dict[str, Any]:
    request = sync_request()
    metadata: dict[str, Any] = {"name": controller}
    if version is not None:
        metadata["annotations"] = {"serving.noctaya.io/version": version, **extra}
    request["controller"] = {"apiVersion": "metacontroller.k8s.io/v1alpha1", "kind": "CompositeController",
                             "metadata": metadata}
    return request


class CountingSync:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, request: dict[str, Any], config: Any) -> dict[str, Any]:
        self.calls += 1
        return stub_sync(request, config)


def test_version_endpoint_reports_the_release_without_auth_or_secrets(tmp_path: Path) -> None:
    import platform

    from hooks.config import HookConfig
    from hooks.version import __version__

    key_file = tmp_path / "token-key"
    key_file.write_bytes(b"k" * 32)
    config = HookConfig.from_env({"NOCTAYA_IMAGE": "mirror.example/noctaya:x", "NOCTAYA_TOKEN_KEY_FILE": str(key_file)})
    client = create_app({SYNC: stub_sync}, config=config, token="s3cret-token").test_client()
    response = client.get("/version")
    assert response.status_code == 200
    assert response.get_json() == {"version": __version__, "python": platform.python_version(),
                                   "image": "mirror.example/noctaya:x"}
    assert "s3cret" not in response.get_data(as_text=True) and "kkkk" not in response.get_data(as_text=True)
    assert client.post("/version").status_code == 405


@pytest.mark.parametrize("version", ["same", "older", None], ids=["same", "older", "missing"])
def test_a_controller_of_this_or_an_older_release_is_served(version: str | None) -> None:
    from hooks.version import __version__

    sync = CountingSync()
    client = create_app({SYNC: sync}, config="cfg").test_client()
    given = {"same": __version__, "older": _older(), None: None}[version]
    response = client.post(SYNC, json=annotated_request(given))
    assert response.status_code == 200, response.get_data(as_text=True)
    assert sync.calls == 1 and response.get_json()["children"]


@pytest.mark.parametrize("newer", _newer())
def test_a_controller_of_a_newer_release_is_refused_with_both_versions_and_nothing_changed(newer: str) -> None:
    from hooks.version import __version__

    sync = CountingSync()
    client = create_app({SYNC: sync}, config="cfg").test_client()
    response = client.post(SYNC, json=annotated_request(newer))
    assert response.status_code == 503  # not 200: Metacontroller would apply an answer, and retries this
    body = response.get_json()
    assert set(body) == {"error"} and body["error"]["type"] == "version_skew"
    message = body["error"]["message"]
    assert f"CompositeController noctaya-llmservice is from Noctaya {newer}" in message
    assert f"this hook server runs {__version__}" in message and f"Pull the {newer} image" in message
    assert sync.calls == 0
    assert "ETag" not in response.headers
    assert SECRET_DATA not in response.get_data(as_text=True)


@pytest.mark.parametrize("garbage", ["latest", "0.3", "v0.3.0", "01.2.3", "0.3.0-rc.1", " 0.3.0", 3, ""])
def test_an_unreadable_version_annotation_is_a_400_naming_it(garbage: Any) -> None:
    from hooks.version import __version__

    sync = CountingSync()
    client = create_app({SYNC: sync}, config="cfg").test_client()
    response = client.post(SYNC, json=annotated_request(garbage))
    assert response.status_code == 400
    error = response.get_json()["error"]
    assert error["type"] == "bad_request"
    assert "serving.noctaya.io/version" in error["message"] and "not a MAJOR.MINOR.PATCH version" in error["message"]
    assert f"runs Noctaya {__version__}" in error["message"]
    assert sync.calls == 0


def test_a_refusal_is_logged_once_per_controller_and_counted_on_every_call(caplog) -> None:
    newer = _newer()[1]
    client = create_app({SYNC: CountingSync(), CUSTOMIZE: stub_customize}, config="cfg").test_client()
    with caplog.at_level(logging.INFO, logger="noctaya.hooks"):
        for _ in range(3):
            assert client.post(SYNC, json=annotated_request(newer)).status_code == 503
        assert client.post(CUSTOMIZE, json=annotated_request(newer)).status_code == 503  # same controller
        assert client.post(SYNC, json=annotated_request(newer, controller="noctaya-llmgateway")).status_code == 503
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "refusing hook calls of CompositeController noctaya-llmservice" in warnings[0]
    assert "CompositeController noctaya-llmgateway" in warnings[1]
    calls = [json.loads(r.getMessage()) for r in caplog.records if r.levelno == logging.INFO]
    assert [c["status"] for c in calls] == [503] * 5  # the per-call line stays, one per call
    samples = metric_samples(client.get("/metrics").get_data(as_text=True))
    assert samples[("noctaya_hook_errors_total", (("hook", "llmservice_sync"), ("kind", "version_skew")))] == 4
    assert samples[("noctaya_hook_errors_total", (("hook", "llmservice_customize"), ("kind", "version_skew")))] == 1
    assert samples[("noctaya_hook_errors_total", (("hook", "llmservice_sync"), ("kind", "internal")))] == 0


def test_the_real_hooks_answer_a_controller_of_their_release_and_refuse_a_newer_one() -> None:
    from hooks.version import __version__
    from tests.hooks import helpers

    folder = GOLDEN / "cold-single-gateway"
    request = json.loads((folder / "request.json").read_text())
    expected = json.loads((folder / "expected.json").read_text())
    client = create_app(config=helpers.config(helpers.LATER_TIME)).test_client()
    for version, status in ((__version__, 200), (_newer()[0], 503)):
        request["controller"].setdefault("metadata", {})["annotations"] = {"serving.noctaya.io/version": version}
        response = client.post(SYNC, json=request)
        assert response.status_code == status, response.get_data(as_text=True)
    request["controller"]["metadata"]["annotations"]["serving.noctaya.io/version"] = __version__
    assert client.post(SYNC, json=request).get_json() == expected


def test_serve_refuses_to_start_on_an_image_older_than_its_deployment(tmp_path: Path) -> None:
    from hooks.version import __version__

    newer = _newer()[0]
    termination = tmp_path / "termination-log"
    proc, log_file = _start(
        [sys.executable, "-m", "hooks", "serve", "--bind", "127.0.0.1:0", "--workers", "1"],
        tmp_path,
        {"NOCTAYA_EXPECTED_VERSION": newer, "NOCTAYA_TERMINATION_LOG": str(termination)},
    )
    try:
        assert proc.wait(timeout=60) == 3
        output = log_file.read_text()
        said = f"this image runs Noctaya {__version__} but the noctaya-hooks Deployment is from {newer}"
        assert said in output and "Listening at" not in output
        assert termination.read_text().startswith(said)
    finally:
        _stop(proc)


def test_serve_starts_on_its_own_or_an_older_release_and_logs_its_version(tmp_path: Path) -> None:
    from hooks.version import __version__

    for expected in (__version__, _older()):
        scratch = tmp_path / expected
        scratch.mkdir()
        proc, log_file = _start(
            [sys.executable, "-m", "hooks", "serve", "--bind", "127.0.0.1:0", "--workers", "1"],
            scratch,
            {"NOCTAYA_EXPECTED_VERSION": expected, "NOCTAYA_TERMINATION_LOG": str(scratch / "termination-log")},
        )
        try:
            port = _wait_for_port(log_file, proc)
            assert requests.get(f"http://127.0.0.1:{port}/version", timeout=30).json()["version"] == __version__
            start = next(json.loads(line[line.index("{"):]) for line in log_file.read_text().splitlines()
                         if '"event":"start"' in line)
            assert start["version"] == __version__ and start["expectedVersion"] == expected
            assert start["bind"] == "127.0.0.1:0" and start["https"] is False
        finally:
            _stop(proc)
        assert not (scratch / "termination-log").exists()
