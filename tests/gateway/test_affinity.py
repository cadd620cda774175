"""gateway.affinity: the key that brings a request back to the Pod holding its prefix."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.affinity import MAX_KEY_BYTES, affinity_key
from gateway.balance import key_hash

SYSTEM = "You are a careful assistant. " * 40


def chat(*messages: str, **extra: object) -> bytes:
    turns = [{"role": "system", "content": SYSTEM}] + [{"role": "user", "content": m} for m in messages]
    return json.dumps({"model": "m", "messages": turns, **extra}).encode()


def test_prompt_cache_key_wins() -> None:
    a = chat("hello", prompt_cache_key="user-42")
    b = json.dumps({"prompt_cache_key": "user-42", "model": "x", "messages": [{"role": "user", "content": "z"}]}).encode()
    assert affinity_key(a) == affinity_key(b) == key_hash(b"user-42", 0x6B)
    assert affinity_key(chat("hello", prompt_cache_key="user-43")) != affinity_key(a)


def test_a_shared_prompt_beginning_is_one_key() -> None:
    assert affinity_key(chat("first question")) == affinity_key(chat("first question", "and a follow-up"))
    assert affinity_key(chat("x")) == affinity_key(chat("y"))  # the first 256 bytes are the system prompt
    other = json.dumps({"model": "m", "messages": [{"role": "system", "content": "Other. " * 50}]}).encode()
    assert affinity_key(other) != affinity_key(chat("x"))


def test_completions_and_responses_prompts() -> None:
    assert affinity_key(b'{"model":"m","prompt":"abc"}') is not None
    assert affinity_key(b'{"model":"m","input":"abc"}') is not None
    assert affinity_key(b'{"model":"m"}') is None
    assert affinity_key(b"") is None


def test_a_field_name_inside_a_string_is_not_the_field() -> None:
    body = b'{"model":"m","note":"\\"prompt_cache_key\\" and \\"messages\\"","messages":[1]}'
    assert affinity_key(body) == key_hash(b"[1]}")


def test_escaped_quotes_in_the_cache_key() -> None:
    body = b'{"prompt_cache_key":"a\\"b\\\\","messages":[]}'
    assert affinity_key(body) == key_hash(b'a\\"b\\\\', 0x6B)


def test_an_overlong_cache_key_falls_back_to_the_prompt() -> None:
    body = json.dumps({"prompt_cache_key": "k" * (MAX_KEY_BYTES + 10), "messages": [{"content": "q"}]}).encode()
    assert affinity_key(body) == affinity_key(json.dumps({"messages": [{"content": "q"}]}).encode())


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048))
def test_any_bytes_give_a_key_or_none_never_an_error(body: bytes) -> None:
    key = affinity_key(body)
    assert key is None or 0 <= key < 2 ** 32
