"""The request policy and per-request timing, without sockets: what each request gets before its
body is read, how a cold body decides its wait, and which answers count as a first token."""

from __future__ import annotations

import pytest

from gateway.policy import MAX_JSON_DEPTH, InvalidJSON, has_dot_segment, inspect_cold_body, is_json, route
from gateway.timing import RequestTiming, produces_tokens
from gateway.wire import ClientParser, RequestHead


def parsed(raw: bytes) -> RequestHead:
    parser = ClientParser(clock=lambda: 42.0)
    parser.feed(raw)
    kind, head = parser.events.popleft()
    assert kind == "head"
    return head


class Keys:
    def __init__(self, ok: bool) -> None:
        self.ok = ok
        self.calls = 0

    def check(self, authorization_header: bytes | None) -> bool:
        self.calls += 1
        return self.ok


def decide(raw: bytes, *, admin: bool = False, draining: bool = False, auth: Keys | None = None,
           max_body: int = 100) -> tuple[str, str, bool]:
    head = parsed(raw)
    r = route(head, head.path, admin=admin, draining=draining, auth=auth, max_body=max_body)
    return r.kind, r.error, r.close


def test_routes_before_the_body_is_read() -> None:
    post = b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}"
    assert decide(b"GET /healthz HTTP/1.1\r\n\r\n") == ("health", "", False)
    assert decide(b"GET /healthz HTTP/1.1\r\n\r\n", admin=True) == ("health", "", False)
    assert decide(b"GET /metrics HTTP/1.1\r\n\r\n", admin=True) == ("metrics", "", False)
    assert decide(b"GET /noctaya/queue HTTP/1.1\r\n\r\n", admin=True) == ("queue", "", False)
    assert decide(b"GET /v1/models HTTP/1.1\r\n\r\n", admin=True) == ("error", "not_found", False)
    assert decide(b"GET /metrics HTTP/1.1\r\n\r\n") == ("error", "not_found", False)  # never on the public port
    assert decide(b"GET /v1/%2e%2e/metrics HTTP/1.1\r\n\r\n") == ("error", "not_found", False)
    assert decide(b"GET /v1/models HTTP/1.1\r\n\r\n") == ("models", "", False)
    assert decide(b"GET /v1/models/qwen HTTP/1.1\r\n\r\n") == ("models", "", False)
    assert decide(post) == ("forward", "", False)
    assert decide(post, draining=True) == ("error", "draining", True)
    assert decide(post, max_body=1) == ("error", "too_large", True)


def test_authentication_comes_before_size_and_is_read_only_for_the_api() -> None:
    keys = Keys(ok=False)
    big = b"POST /v1/completions HTTP/1.1\r\nContent-Length: 1000\r\n\r\n"
    assert decide(big, auth=keys, max_body=10) == ("error", "unauthorized", False)  # says nothing about size
    assert decide(b"GET /healthz HTTP/1.1\r\n\r\n", auth=keys)[0] == "health"
    assert keys.calls == 1  # the key file is not read for health checks
    assert decide(big, auth=Keys(ok=True), max_body=10) == ("error", "too_large", True)


def test_dot_segments() -> None:
    assert has_dot_segment("/v1/../x") and has_dot_segment("/v1/%2E%2E/x") and has_dot_segment("/v1/.")
    assert not has_dot_segment("/v1/models/qwen2.5-7b") and not has_dot_segment("/v1/chat/completions")


def test_a_cold_body_decides_its_wait_and_hostile_json_is_refused() -> None:
    head = parsed(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 2\r\n\r\n{}")
    assert inspect_cold_body(head, b'{"model":"m","stream":true}')
    assert not inspect_cold_body(head, b'{"model":"m","stream":false}')
    assert not inspect_cold_body(head, b'{"messages":[{"stream":true}]}')  # only the top level counts
    assert not inspect_cold_body(head, b"")
    ok = b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1)
    assert not inspect_cold_body(head, b'{"a":' + ok + b"}")  # depth exactly at the limit
    for bad in (b'{"stream":true', b"[1]", b'{"a":' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}",
                b"[" * 100_000, b'{"stream":true} x'):
        with pytest.raises(InvalidJSON):
            inspect_cold_body(head, bad)
    multipart = parsed(b"POST /v1/audio/transcriptions HTTP/1.1\r\nContent-Type: multipart/form-data; b=x\r\n"
                       b"Content-Length: 2\r\n\r\n{}")
    assert not inspect_cold_body(multipart, b"--x\r\nnot json")  # other types are forwarded as they are
    assert is_json(b"application/json; charset=utf-8", b"") and is_json(b"application/vnd.x+json", b"x")
    assert is_json(None, b' {"a": 1}') and is_json(b"application/x-www-form-urlencoded", b"{")  # curl -d
    assert not is_json(None, b"x" * 10) and not is_json(b"text/plain", b"hello")
    assert not is_json(b"multipart/form-data; boundary=x", b"{")


def test_only_token_answers_are_timed_once_from_their_own_arrival() -> None:
    assert produces_tokens(b"POST", "/v1/chat/completions") and produces_tokens(b"POST", "/v1/completions/")
    assert produces_tokens(b"POST", "/v1/responses")
    assert not produces_tokens(b"GET", "/v1/models") and not produces_tokens(b"POST", "/v1/embeddings")
    timing = RequestTiming(arrived=10.0, timed=True)
    assert timing.first_byte(10.5, 500) is None  # an error has no first token ...
    assert timing.first_byte(11.0, 200) == 1.0  # ... the answer does, once
    assert timing.first_byte(12.0, 200) is None
    assert RequestTiming(10.0, timed=False).first_byte(11.0, 200) is None


def test_each_pipelined_head_carries_its_own_arrival() -> None:
    now = [1.0]
    parser = ClientParser(clock=lambda: now[0])
    parser.feed(b"GET /v1/models HTTP/1.1\r\n\r\n")
    now[0] = 5.0
    parser.feed(b"GET /v1/models HTTP/1.1\r\n\r\nGET /v1/mo")
    heads = [h for kind, h in parser.events if kind == "head"]
    assert [h.arrived for h in heads] == [1.0, 5.0]
    assert parser.in_message and parser.started == 5.0  # the third has begun: its deadline runs
