"""HTTP/1.1 as clients and backends really speak it: malformed input, pipelining, Expect,
HTTP/1.0, request ids, what the backend must never see, and what an OpenAI client expects."""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time

import openai
import pytest
import requests

from tests.ports import free_port

MESSAGES = [{"role": "user", "content": "hi"}]
SECRET = "sk-sentinel-6f1d2c"


def exchange(port: int, raw: bytes, *, timeout: float = 10.0) -> bytes:
    """Send raw bytes, read until the gateway closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(raw)
        reply = b""
        try:
            while chunk := sock.recv(65536):
                reply += chunk
        except ConnectionResetError:
            pass
    return reply


def split_reply(reply: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


MALFORMED = {
    "bad request line": (b"GARBAGE\r\n\r\n", 400),
    "header without a colon": (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nNoColonHere\r\n\r\n", 400),
    "NUL in a header value": (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n", 400),
    "HTTP/2 preface": (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400),
    "bad chunk size": (b"POST /v1/chat/completions?api_key=" + SECRET.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                       b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", 400),
    "too many headers": (b"GET /v1/models HTTP/1.1\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(150)) + b"\r\n",
                         431),
    "oversized header": (b"GET /v1/models HTTP/1.1\r\nX-Big: " + b"a" * 40_000 + b"\r\n\r\n", 431),
    "oversized target": (b"GET /v1/" + b"a" * 10_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
    "content-length and chunked": (b"POST /v1/x HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
                                   b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_requests_get_a_json_error_and_are_never_forwarded(backend, make_gateway, case, caplog,
                                                                     capfd) -> None:
    backend.start()
    gw = make_gateway(backend)
    raw, status = MALFORMED[case]
    caplog.set_level(logging.DEBUG)
    code, headers, body = split_reply(exchange(gw.port, raw))
    assert code == status
    assert headers["content-type"] == "application/json" and headers["connection"] == "close"
    assert headers["x-request-id"]
    assert json.loads(body[: int(headers["content-length"])])["error"]["type"] == "invalid_request_error"
    assert backend.requests == []  # never forwarded
    # ...and the gateway keeps serving.
    assert requests.post(gw.url + "/v1/embeddings", json={"input": "a"}, timeout=10).status_code == 200
    out, err = capfd.readouterr()
    logged = " ".join(r.getMessage() + json.dumps(r.__dict__, default=str) for r in caplog.records)
    for text in (out, err, logged):
        assert "Traceback" not in text and SECRET not in text


def test_malformed_backend_response_is_a_502_json_error(make_gateway) -> None:
    port = free_port()
    listener = socket.create_server(("127.0.0.1", port))
    answers = iter([
        b"HTTP/1.1 2x0 Nope\r\n\r\n",  # malformed status line
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n",  # bad chunk size
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    ])

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                request = conn.recv(65536)
                if request.startswith(b"GET /health"):
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
                else:
                    conn.sendall(next(answers))

    threading.Thread(target=serve, daemon=True).start()

    class _Backend:
        url = f"http://127.0.0.1:{port}"

    gw = make_gateway(_Backend())
    try:
        for _ in range(2):
            resp = requests.post(gw.url + "/v1/chat/completions", json={"model": "m", "messages": MESSAGES},
                                 timeout=10)
            assert resp.status_code == 502 and resp.json()["error"]["code"] == "upstream_protocol_error"
            assert resp.headers["x-request-id"]
        ok = requests.post(gw.url + "/v1/chat/completions", json={"model": "m", "messages": MESSAGES}, timeout=10)
        assert ok.status_code == 200 and ok.content == b"ok"  # and the gateway keeps serving
    finally:
        listener.close()


def test_the_backend_never_receives_the_gateway_api_key(backend, make_gateway, tmp_path) -> None:
    key = tmp_path / "key"
    key.write_text(SECRET + "\n")
    backend.start()
    gw = make_gateway(backend, auth_key_file=str(key))
    resp = requests.post(gw.url + "/v1/embeddings", json={"input": "a"}, timeout=10,
                         headers={"Authorization": f"Bearer {SECRET}", "X-Request-Id": "req-1",
                                  "Connection": "keep-alive, X-Hop", "X-Hop": "1", "Keep-Alive": "timeout=5",
                                  "Upgrade": "h2c", "X-Forwarded-For": "10.1.2.3"})
    assert resp.status_code == 200 and resp.headers["x-request-id"] == "req-1"
    seen = {k.lower(): v for k, v in backend.last_headers.items()}
    assert "authorization" not in seen and SECRET not in json.dumps(seen)
    for hop in ("connection", "keep-alive", "upgrade", "x-hop", "te", "transfer-encoding"):
        assert hop not in seen, hop
    assert seen["x-request-id"] == "req-1" and seen["x-forwarded-for"] == "10.1.2.3, 127.0.0.1"
    assert seen["x-forwarded-proto"] == "http" and seen["host"] == f"127.0.0.1:{backend.port}"


def test_without_gateway_auth_the_clients_authorization_reaches_the_backend(backend, make_gateway) -> None:
    backend.start()
    gw = make_gateway(backend)
    requests.post(gw.url + "/v1/embeddings", json={"input": "a"}, timeout=10,
                  headers={"Authorization": "Bearer backend-own-key"})
    assert backend.last_headers.get("Authorization") == "Bearer backend-own-key"


def test_pipelined_requests_are_answered_in_order(backend, make_gateway) -> None:
    backend.start()
    gw = make_gateway(backend)
    body = b'{"input":"a"}'
    raw = (b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
           b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
           b"GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % (len(body), body))
    reply = exchange(gw.port, raw)
    statuses = [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", reply)]
    assert statuses == [200, 200, 404]
    assert reply.index(b'{"status":"ok"}') < reply.index(b'"object": "list"') < reply.index(b"not_found")


def test_expect_100_continue(backend, make_gateway) -> None:
    backend.start()
    gw = make_gateway(backend)
    body = b'{"input":"a"}'
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
        assert sock.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200")
    # A refused request gets its answer at once, without 100 Continue, and the body is never read.
    too_big = exchange(gw.port, b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                                b"Content-Length: 999999999\r\n\r\n")
    assert too_big.startswith(b"HTTP/1.1 413")


def test_http_10_clients(backend, make_gateway) -> None:
    backend.start()
    gw = make_gateway(backend)
    body = json.dumps({"model": "m", "messages": MESSAGES, "stream": True}).encode()
    reply = exchange(gw.port, b"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    code, headers, rest = split_reply(reply)
    assert code == 200 and "transfer-encoding" not in headers  # no chunked framing for HTTP/1.0
    assert rest.count(b"data: {") == 5 and b"data: [DONE]" in rest
    # Keep-alive when the 1.0 client asks for it.
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
        for _ in range(2):
            sock.sendall(b"GET /healthz HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            data = sock.recv(65536)
            assert data.startswith(b"HTTP/1.1 200") and b"Connection: keep-alive" in data


def test_generated_answers_carry_a_request_id(backend, make_gateway) -> None:
    gw = make_gateway(backend)
    mine = requests.get(gw.url + "/nope", headers={"X-Request-Id": "abc-123"}, timeout=5)
    assert mine.status_code == 404 and mine.headers["x-request-id"] == "abc-123"
    fresh = [requests.get(gw.url + "/nope", timeout=5).headers["x-request-id"] for _ in range(3)]
    assert len(set(fresh)) == 3 and all(fresh)
    injected = requests.get(gw.url + "/nope", headers={"X-Request-Id": "x" * 500}, timeout=5)
    assert injected.headers["x-request-id"] != "x" * 500  # over-long ids are replaced


def test_openai_client_does_not_retry_an_activation_timeout(backend, make_gateway) -> None:
    gw = make_gateway(backend, activation_timeout_seconds=1.0)  # the backend never starts
    c = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", timeout=30)  # default retries (2)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as info:
        c.chat.completions.create(model="m", messages=MESSAGES)
    assert info.value.status_code == 504 and info.value.response.headers["x-should-retry"] == "false"
    assert time.monotonic() - started < 2.5  # one attempt, not three
    metrics = requests.get(gw.admin_url + "/metrics", timeout=5).text
    assert 'noctaya_gateway_requests_total{code="504"} 1.0' in metrics


def test_retrieving_a_model_while_cold_wakes_nothing(backend, make_gateway) -> None:
    gw = make_gateway(backend)  # cold: the backend is not running
    c = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=10)
    assert c.models.retrieve("test-model").id == "test-model"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("other-model")
    assert [m.id for m in c.models.list()] == ["test-model"]
    assert requests.get(gw.url + "/v1/models/", timeout=5).json()["data"][0]["id"] == "test-model"
    q = requests.get(gw.admin_url + "/noctaya/queue", timeout=5).json()
    assert not q["lease"]["active"] and q["demand"]["total"] == 0
    assert not gw.broadcaster.current().active and gw.app.metrics.cold_requests.value == 0


def _status(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def test_header_and_target_limits_hold_exactly_at_the_limit(backend, make_gateway) -> None:
    from gateway.wire import MAX_HEAD_BYTES, MAX_HEADERS, MAX_TARGET_BYTES

    backend.start()
    gw = make_gateway(backend)

    def get(target: bytes, headers: list[bytes]) -> int:
        return _status(exchange(gw.port, b"GET " + target + b" HTTP/1.1\r\n" + b"".join(headers) +
                                b"Connection: close\r\n\r\n"))

    close = len(b"Connection") + len(b"close") + 4  # the request's own Connection header counts too
    # Header count: MAX_HEADERS in all is served, one more is 431.
    many = [b"X-H%03d: v\r\n" % i for i in range(MAX_HEADERS - 1)]
    assert get(b"/v1/models", many) == 200
    assert get(b"/v1/models", many + [b"X-Extra: v\r\n"]) == 431
    # Header bytes (name + value + 4 each): exactly MAX_HEAD_BYTES is served, one byte more is 431.
    value_len = MAX_HEAD_BYTES - close - len(b"X-Big") - 4
    assert get(b"/v1/models", [b"X-Big: " + b"a" * value_len + b"\r\n"]) == 200
    assert get(b"/v1/models", [b"X-Big: " + b"a" * (value_len + 1) + b"\r\n"]) == 431
    # Request target: MAX_TARGET_BYTES reaches the backend (its own 404), one byte more is 414.
    base = b"/v1/x?q="
    assert get(base + b"a" * (MAX_TARGET_BYTES - len(base)), []) == 404
    assert [len(p) for _, p, _ in backend.requests] == [MAX_TARGET_BYTES]  # forwarded intact
    assert get(base + b"a" * (MAX_TARGET_BYTES - len(base) + 1), []) == 414


def test_body_limit_holds_exactly_at_the_limit(backend, make_gateway) -> None:
    limit = 4096
    backend.start()
    gw = make_gateway(backend, max_body_bytes=limit)
    ok = requests.post(gw.url + "/v1/echo", data=b"x" * limit, timeout=10)
    assert ok.status_code == 200 and ok.content == b"x" * limit
    assert requests.post(gw.url + "/v1/echo", data=b"x" * (limit + 1), timeout=10).status_code == 413
    # Chunked (no length): the limit is counted as the body arrives.
    assert requests.post(gw.url + "/v1/echo", data=iter([b"y" * (limit // 2)] * 2), timeout=10).status_code == 200
    assert requests.post(gw.url + "/v1/echo", data=iter([b"y" * (limit // 2)] * 2 + [b"y"]),
                         timeout=10).status_code == 413


def test_max_connections_holds_exactly_at_the_limit(backend, make_gateway) -> None:
    backend.start()
    gw = make_gateway(backend, max_connections=3, max_connections_per_address=0)  # the pool alone
    healthz = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    open_socks = []
    for _ in range(3):  # three kept-alive connections: every one is served
        sock = socket.create_connection(("127.0.0.1", gw.port), timeout=10)
        sock.sendall(healthz)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        open_socks.append(sock)
    # A fourth while all three are idle: the oldest idle one is closed to make room (gateway.idle).
    fourth = socket.create_connection(("127.0.0.1", gw.port), timeout=10)
    fourth.sendall(healthz)
    assert fourth.recv(65536).startswith(b"HTTP/1.1 200")
    assert open_socks[0].recv(65536) == b""  # evicted, silently
    assert gw.call(lambda: gw.server.idle.evicted) == 1
    open_socks[0].close()
    busy = [*open_socks[1:], fourth]
    for sock in busy:  # three requests in progress: nothing is idle, the pool is full
        sock.sendall(healthz[:10])
    fifth = socket.create_connection(("127.0.0.1", gw.port), timeout=10)
    refused = fifth.recv(65536)  # answered at once, unread (nothing sent: no reset can race the answer)
    assert refused.startswith(b"HTTP/1.1 429") and b"too_many_connections" in refused
    fifth.close()
    for sock in busy:  # the requests in progress were never touched
        sock.sendall(healthz[10:])
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.close()
    assert gw.call(lambda: gw.server.idle.evicted) == 1


def test_metrics_and_queue_are_served_on_the_admin_port_only(backend, make_gateway) -> None:
    backend.start()
    gw = make_gateway(backend)
    # The public port (behind the LoadBalancer) answers the OpenAI API and health, nothing else.
    for path in ("/metrics", "/noctaya/queue"):
        resp = requests.get(gw.url + path, timeout=5)
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found", path
    assert requests.get(gw.url + "/healthz", timeout=5).status_code == 200
    # The admin port answers monitoring and health, and never forwards to the backend.
    assert "noctaya_gateway_requests_total" in requests.get(gw.admin_url + "/metrics", timeout=5).text
    assert "queued" in requests.get(gw.admin_url + "/noctaya/queue", timeout=5).json()
    assert requests.get(gw.admin_url + "/healthz", timeout=5).status_code == 200
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
        resp = requests.request(method, gw.admin_url + path, json={"model": "m", "messages": MESSAGES}, timeout=5)
        assert resp.status_code == 404, (method, path)
    assert backend.requests == []


def test_admin_port_connection_bound_at_the_limit(backend, make_gateway) -> None:
    # The admin port serves at most ADMIN_MAX_CONNECTIONS at once per worker, from a pool of its own:
    # with it full, the public port still answers, and the next admin connection waits (in the
    # backlog) until a slot frees, then is served. (The per-address cap is lifted here, so one
    # address can fill the pool, and the idle time is long, so the pool stays full meanwhile.)
    from gateway.server import ADMIN_MAX_CONNECTIONS

    backend.start()
    gw = make_gateway(backend, control_connections_per_address=0, admin_idle_timeout_seconds=120.0)
    port = int(gw.admin_url.rsplit(":", 1)[1])
    held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(ADMIN_MAX_CONNECTIONS)]
    try:
        for sock in held:  # each one is being served: it answers a request
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        extra = socket.create_connection(("127.0.0.1", port), timeout=10)
        extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        extra.settimeout(1.0)
        with pytest.raises(TimeoutError):
            extra.recv(4096)  # over the bound: not served while all slots are taken
        assert requests.get(gw.url + "/v1/models", timeout=5).status_code == 200  # the public port is not affected
        held.pop().close()
        extra.settimeout(10)
        assert extra.recv(4096).startswith(b"HTTP/1.1 200")  # a slot freed: served
        extra.close()
    finally:
        for sock in held:
            sock.close()


def test_the_watchdog_parks_when_the_last_connection_leaves_not_a_tick_later(backend, make_gateway,
                                                                              monkeypatch) -> None:
    """A kubelet probe every few seconds must not cost a timer wake-up of the watchdog each (an idle
    Pod's CPU is mostly wake-ups): the tick is cut short when the last connection leaves. A connection
    that stays is still watched every tick (its idle deadline is enforced). Probes reach the admin
    port's own watchdog (on the control thread); a public connection, the worker's."""
    import gateway.server

    tick = 5.0  # long, so that "at once" and "a tick later" cannot be confused on a loaded host
    monkeypatch.setattr(gateway.server, "WATCHDOG_SECONDS", tick)
    gw = make_gateway(backend)
    server = gw.server
    admin = server.admin.watch

    def parked() -> bool:
        return server.control.call(lambda: not admin.connections and admin._arrived.linkcount() == 1)

    for _ in range(3):
        assert requests.get(f"{gw.admin_url}/healthz", timeout=5).status_code == 200
        started = time.monotonic()
        while not gw.call(parked):
            assert time.monotonic() - started < tick / 2, "the watchdog waited out its tick"
            time.sleep(0.005)
    # A connection that stays: the watchdog waits out its tick (and would expire it at its deadline).
    with socket.create_connection(("127.0.0.1", gw.port), timeout=5):
        started = time.monotonic()
        while gw.call(lambda: (len(server.connections), server.watch._emptied.linkcount())) != (1, 1):
            assert time.monotonic() - started < tick / 2
            time.sleep(0.005)
