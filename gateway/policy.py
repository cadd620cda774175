"""Request policy: what the gateway answers, decided from the request head and the gateway's state
alone (no sockets, no clocks), so each rule is a unit test.

:func:`route` classifies a request before its body is read; the caller then answers locally, or
reads the body and forwards it. :func:`inspect_cold_body` decides how a cold request waits.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import unquote

from gateway.jsonscan import InvalidJSON, inspect_json_body
from gateway.wire import RequestHead

__all__ = ["Route", "route", "has_dot_segment", "is_models_path", "is_json", "inspect_cold_body", "MAX_JSON_DEPTH",
           "InvalidJSON"]

# OpenAI bodies nest a handful of levels; a tool's or response format's JSON schema adds two per
# nested property (about 25 for ten nested objects). 64 leaves room for any real request (the
# scanner's memory is one byte per open level, gateway.jsonscan).
MAX_JSON_DEPTH = 64
_DOT_SEGMENT = re.compile(r"(^|/)\.{1,2}(/|$)")
_OPENS_OBJECT = re.compile(rb"[ \t\r\n]*\{")


class Authenticator(Protocol):
    def check(self, authorization_header: bytes | None) -> bool: ...


@dataclass(frozen=True, slots=True)
class Route:
    """``kind``: health, metrics, queue, models, forward, or error (``error`` names the answer in
    gateway.errors; ``close``: the connection cannot be reused after it)."""

    kind: str
    error: str = ""
    close: bool = False


HEALTH, METRICS, QUEUE, MODELS, FORWARD = (Route(k) for k in ("health", "metrics", "queue", "models", "forward"))


def _error(name: str, close: bool = False) -> Route:
    return Route("error", name, close)


def route(head: RequestHead, path: str, *, admin: bool, draining: bool, auth: Authenticator | None,
          max_body: int) -> Route:
    """What a request gets, before its body is read. Admin-port paths never reach the backend;
    a draining gateway refuses new API requests; authentication comes before any size check, so
    an unauthenticated client learns nothing else."""
    if path == "/healthz":
        return HEALTH
    if admin:  # the admin port: monitoring and operators, never the OpenAI API
        return {"/metrics": METRICS, "/noctaya/queue": QUEUE}.get(path) or _error("not_found")
    if not (path == "/v1" or path.startswith("/v1/")) or has_dot_segment(path):
        return _error("not_found")
    if draining:
        return _error("draining", close=True)
    if auth is not None and not auth.check(head.authorization):  # the key file is read only here
        return _error("unauthorized")
    if head.content_length is not None and head.content_length > max_body:
        return _error("too_large", close=True)
    if head.method == b"GET" and is_models_path(path):
        return MODELS
    return FORWARD


def is_models_path(path: str) -> bool:
    return path in ("/v1/models", "/v1/models/") or path.startswith("/v1/models/")


def has_dot_segment(path: str) -> bool:
    """`/v1/../metrics` must not reach the backend: it gets the raw target, which a backend that
    normalises paths would resolve outside /v1 (checked raw and with %2e decoded)."""
    if "." not in path and "%" not in path:
        return False
    return bool(_DOT_SEGMENT.search(path) or _DOT_SEGMENT.search(unquote(path)))


_UNTYPED = (b"", b"application/x-www-form-urlencoded", b"text/plain")  # what `curl -d` and friends send


def is_json(content_type: bytes | None, body: bytes) -> bool:
    """Whether a body is to be inspected as JSON: OpenAI clients send ``application/json``; a body
    sent without a real type (``curl -d`` says form-urlencoded) counts when it opens like a JSON
    object, since the model server will read it as one. Other types (multipart audio uploads) are
    forwarded as they are."""
    kind = (content_type or b"").split(b";", 1)[0].strip().lower()
    if b"json" in kind:
        return True
    return kind in _UNTYPED and _OPENS_OBJECT.match(body) is not None


def inspect_cold_body(head: RequestHead, body: bytes, pause: Callable[[], object] | None = None) -> bool:
    """Whether a cold request is a streamed one (held with SSE heartbeats). Raises InvalidJSON for
    a JSON body that is malformed, nested deeper than MAX_JSON_DEPTH or not an object: it is refused
    before it can wake a model. The scan is bounded in memory and depth (gateway.jsonscan); ``pause``
    runs between its steps (the caller's yield to its loop: probes are answered meanwhile)."""
    if not body or not is_json(head.content_type, body):
        return False
    return inspect_json_body(body, max_depth=MAX_JSON_DEPTH, pause=pause).stream

