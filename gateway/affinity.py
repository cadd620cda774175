"""The affinity key of a request: what should bring it back to the Pod that holds its KV cache.

1. OpenAI's ``prompt_cache_key`` (a string the client sends to group requests that share a prefix),
   when the body has one: the key is its value.
2. Else the prompt's leading bytes: the first ``prefix_bytes`` of the raw JSON value of
   ``messages`` (chat completions), ``prompt`` (completions) or ``input`` (responses, embeddings),
   in that order. Requests whose prompts begin alike (one system prompt, one conversation's earlier
   turns) get the same key; an engine's prefix cache reuses exactly such a shared beginning.

Found with C-level substring scans over the raw body, never a JSON parse (the warm path does not
parse bodies): a key is a placement hint, so a field of that name nested deeper or a value with
escapes read approximately sends the request to another Pod at worst, never elsewhere than a Pod
of its own model. Bounded: at most ``_TRIES`` scans per field name and ``MAX_KEY_BYTES`` of a key.
"""

from __future__ import annotations

from gateway.balance import key_hash

__all__ = ["affinity_key", "DEFAULT_PREFIX_BYTES", "MAX_KEY_BYTES"]

DEFAULT_PREFIX_BYTES = 256
MAX_KEY_BYTES = 1024
_CACHE_KEY = b'"prompt_cache_key"'
_PROMPT_FIELDS = (b'"messages"', b'"prompt"', b'"input"')
_TRIES = 4  # occurrences of a field name looked at (the others were inside string values)
_SPACE = b" \t\r\n"
_CACHE_KEY_SEED = 0x6B  # a cache key and a prompt of the same bytes are different keys


def _value_start(body: bytes, name: bytes) -> int:
    """Where the value of the first ``"name":`` in ``body`` starts (-1: none)."""
    at = 0
    for _ in range(_TRIES):
        found = body.find(name, at)
        if found < 0:
            return -1
        i = found + len(name)
        while i < len(body) and body[i] in _SPACE:
            i += 1
        if i < len(body) and body[i] == 0x3A:  # ':'
            i += 1
            while i < len(body) and body[i] in _SPACE:
                i += 1
            return i
        at = found + 1
    return -1


def _string_at(body: bytes, start: int) -> bytes | None:
    """The raw text of the JSON string starting at ``start`` (escapes kept), if short enough."""
    if start < 0 or start >= len(body) or body[start] != 0x22:  # '"'
        return None
    end = start + 1
    limit = min(len(body), start + 1 + MAX_KEY_BYTES)
    while True:
        end = body.find(b'"', end, limit)
        if end < 0:
            return None
        backslashes = 0
        while body[end - 1 - backslashes] == 0x5C:  # '\\'
            backslashes += 1
        if backslashes % 2 == 0:
            return body[start + 1:end]
        end += 1


def affinity_key(body: bytes, prefix_bytes: int = DEFAULT_PREFIX_BYTES) -> int | None:
    """The request's affinity key as a 64-bit hash, or None when the body names no prompt."""
    if not body:
        return None
    cache_key = _string_at(body, _value_start(body, _CACHE_KEY)) if _CACHE_KEY in body else None
    if cache_key:
        return key_hash(cache_key, _CACHE_KEY_SEED)
    for name in _PROMPT_FIELDS:
        start = _value_start(body, name)
        if start >= 0:
            return key_hash(memoryview(body)[start:start + prefix_bytes])  # hashed in place, not copied
    return None
